"""Hub model cards for draft heads, generated from the measured results JSON (never written by hand).

`results.json` (written by `hf-eagle2 card` from the head's training.json and the measurements it is given) holds:

    {"base_model": ..., "hub_name": ..., "hardware": ...,
     "training": {...training.json...}  (with "init_lineage", the runs it started from, and "tokens_seen_total"
                                         for a head trained with `train --init`: one card row per stage),
     "eval": {...eval_head() output, incl. calibration...}  (or several merged: `merge_evaluations`),
     "speed": {"mtbench": {"speedup": ..., ...}, ...}        (optional, from `hf-eagle2 bench`)
     "curve": [{"tokens_seen": ..., "tau_mtbench": ..., "prompts": ...}, ...] (optional; tokens of all stages;
               "carried_from": NAME on a point taken from an earlier stage's card)
     "curve_settings": {...the curve evaluations' EVAL_SETTINGS and prompts...}
     "comparison": [{"name": ..., "tau": {dataset: τ}, "head_parameters": ..., "tokens_seen": ...}, ...] (optional:
                   other heads, evaluated with this head's settings; this head's row is drawn from "eval"; a row
                   brought from a compared head's own card has "listed_by", the name of the head whose card named it)
     "commands": {"train": ..., "eval": ..., "bench": ..., "card": ...},
     "head_sha256": ...}  (the weights all of it describes: a retrained head starts its results.json over, and an
                          evaluation or benchmark of other weights is refused)
"""

from __future__ import annotations

import json
import os
import shlex

import yaml

from .formats import weights_sha256
from ..engine.stats import tau_of

SHAREGPT_HUB = "anon8231489123/ShareGPT_Vicuna_unfiltered"


DEFAULT_NAME = "smollm2-135m-instruct-eagle2"


def is_eagle3(results: dict) -> bool:
    return results.get("training", {}).get("config", {}).get("head") == "eagle3"


def acceptance_by_depth(accept_hist: list[int]) -> list[float | None]:
    """From a histogram of draft tokens accepted per round (`EagleStats.accept_hist`): for d = 1, 2, ... the
    share of rounds that reached depth d - 1 and accepted depth d too (None where no round reached d - 1)."""
    reached = [sum(accept_hist[d:]) for d in range(len(accept_hist))]
    return [reached[d] / reached[d - 1] if reached[d - 1] else None for d in range(1, len(accept_hist))]


def card_metadata(results: dict) -> dict:
    """The card's YAML metadata.

    No `pipeline_tag`: a draft head cannot generate on its own (it needs its target), so it belongs to no Hub task
    and gets no inference widget. No `library_name`: hf_eagle2 is not a library the Hub knows, and `transformers`
    would offer a loading snippet that fails (AutoModel knows model_type "eagle" only after `import hf_eagle2`).
    """
    return {
        "base_model": results.get("base_model", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        "license": "apache-2.0",
        "tags": ["eagle", "eagle-3" if is_eagle3(results) else "eagle-2", "speculative-decoding", "draft-model",
                 "hf-eagle2"],
        "datasets": [SHAREGPT_HUB],
        "language": ["en"],
    }


def is_namespaced(repo_id) -> bool:
    """`user/name`: a repo id the usage snippet can load from the Hub."""
    return isinstance(repo_id, str) and repo_id.count("/") == 1 and all(repo_id.split("/"))


def _fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def _count(value) -> str:
    return "-" if value is None else f"{value:,}"


def render_card(results: dict, repo_id: str | None = None) -> str:
    """The card's markdown. `repo_id` (`user/name`), or a namespaced `hub_name` in the results, is what the usage
    snippet loads; without one the snippet loads the local folder."""
    if repo_id is not None and not is_namespaced(repo_id):
        raise ValueError(f"repo_id must be namespaced, 'user/name', for the card's usage snippet; got {repo_id!r}")
    meta = card_metadata(results)
    train = results.get("training", {})
    cfg = train.get("config", {})
    ev = results.get("eval", {})
    datasets = ev.get("datasets", {})
    calib = ev.get("calibration")
    speed = results.get("speed", {})
    commands = results.get("commands", {})
    base = meta["base_model"]
    hub_name = results.get("hub_name")
    repo = repo_id or (hub_name if is_namespaced(hub_name) else None)
    name = repo or hub_name or DEFAULT_NAME
    if repo:
        load = f'"{repo}")  # Hub repo id'
    else:
        load = f'"path/to/{name}")  # this folder (its Hub repo id `user/name` once pushed)'
    tree = ev.get("tree", {})
    eagle3 = is_eagle3(results)
    unroll = cfg.get("unroll") or 1
    stages = [*reversed(train.get("init_lineage", [])), train]  # oldest first; one stage unless trained with --init
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", ""]
    lines += [
        f"# {name}",
        "",
        f"An **{'EAGLE-3' if eagle3 else 'EAGLE-2'} draft head** for [{base}](https://huggingface.co/{base}), trained and evaluated with "
        "the `hf_eagle2` package on CPU. It proposes a dynamic tree of draft tokens that the target "
        "verifies in one forward pass; greedy output is token-identical to plain `generate`.",
        "",
        "## Usage",
        "",
        "```python",
        "import hf_eagle2",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{base}")',
        f'model = AutoModelForCausalLM.from_pretrained("{base}", attn_implementation="sdpa")',
        f"draft = hf_eagle2.EagleDraftModel.from_pretrained({load}",
        'messages = [{"role": "user", "content": "Write a haiku about the sea."}]',
        'ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]',
        'out = model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=256)',
        "print(tokenizer.decode(out[0, ids.shape[1]:]))",
        "```",
        "",
        "## Results (measured)",
        "",
        f"Greedy, `max_new_tokens={ev.get('max_new_tokens', '-')}`, tree `{tree.get('tree', 'eagle2')}` with "
        f"m={tree.get('tree_total_tokens', '-')}, depth {tree.get('tree_depth', '-')}, k={tree.get('tree_top_k', '-')}. "
        "τ is the average number of tokens per verification round (bonus token included; the prefill's token is in "
        "no round)"
        + (" (fast CPU kernels)" if ev.get("kernels") == "fast" else "")
        + (" with the head scoring the full vocabulary (`eval-head --full-vocab`)." if ev.get("full_vocab") else "."),
        "",
        "| dataset | prompts | τ | speed-up vs plain generate |",
        "|---|---:|---:|---:|",
    ]
    for ds, r in datasets.items():
        sp = speed.get(ds, {})
        lines.append(f"| {ds} | {r['prompts']} | {_fmt(round_tau(r))} | {_fmt(sp.get('speedup'))}x |" if sp else
                     f"| {ds} | {r['prompts']} | {_fmt(round_tau(r))} | - |")  # fmt: skip
    if speed.get("note"):
        lines += ["", speed["note"]]
    lines += [""]
    if results.get("comparison"):
        this = {"name": name, "tau": {ds: round_tau(r) for ds, r in datasets.items()},
                "head_parameters": train.get("head_parameters"), "tokens_seen": _total_tokens(train)}  # fmt: skip
        lines += _comparison_table([this, *results["comparison"]], list(datasets))
    lines += _depth_table(datasets)
    if commands.get("eval"):
        lines += ["τ and calibration reproduce with:", "", "```bash", commands["eval"], "```", ""]
    if commands.get("bench"):
        lines += ["Speed-ups reproduce with:", "", "```bash", commands["bench"], "```", ""]
    if calib:
        lines += [
            "## Calibration",
            "",
            "EAGLE-2 ranks draft nodes by V_i, the product of draft confidences along the path, as an estimate of "
            "the probability that the target accepts the path. Measured over every drafted node of the evaluation "
            f"above ({calib['nodes']} nodes):",
            "",
            f"- expected calibration error of the node confidence: **{calib['local']['ece']:.4f}**",
            f"- expected calibration error of the path value V_i: **{calib['path']['ece']:.4f}**",
            "",
            "![reliability diagram](calibration.png)",
            "",
        ]
        from .calibration import markdown_table

        lines += [markdown_table(calib), ""]
    curve = results.get("curve") or []
    if curve:
        prompts = curve[0].get("prompts", "-")
        at = results.get("curve_settings") or {"max_new_tokens": 256, "tree": {"tree_total_tokens": 60, "tree_depth": 6,
                                                                              "tree_top_k": 10}}  # before it was recorded
        ctree = at.get("tree") or {}
        lines += ["## τ against training tokens", "",
                  f"Training snapshots, each evaluated on the first {prompts} MT-bench questions (greedy, "
                  f"m={ctree.get('tree_total_tokens')}, depth {ctree.get('tree_depth')}, k={ctree.get('tree_top_k')}, "
                  f"{at.get('max_new_tokens')} new tokens{', fast CPU kernels' if at.get('kernels') == 'fast' else ''}"
                  + ("; tokens seen include the earlier training stages'" if stages[:-1] else "")
                  + "):", "", "| tokens seen | τ (MT-bench) |",
                  "|---:|---:|"]  # fmt: skip
        lines += [f"| {c['tokens_seen']:,} | {_fmt(c['tau_mtbench'])} |" for c in curve]
        carried = [c for c in curve if c.get("carried_from")]
        if carried:
            names = ", ".join(f"`{name}`" for name in sorted({c["carried_from"] for c in carried}))
            lines += ["", f"The {len(carried)} points up to {max(c['tokens_seen'] for c in carried):,} tokens were "
                      f"measured for the card of an earlier stage of this head ({names}) and carried over."]
        lines += ["", "![tau curve](tau_curve.png)", ""]
    lines += [
        "## Training",
        "",
        f"- Architecture: {_architecture(eagle3, cfg, stages[0].get('config', {}))} "
        f"{train.get('head_parameters', 0):,} parameters.",
        f"- Draft vocabulary: {_draft_vocab(stages)} (the head proposes only these; verification uses the full "
        "vocabulary).",
        f"- Data: {results.get('data_description', 'ShareGPT')}.",
        f"- Tokens: {train.get('train_tokens', 0):,} per epoch ({train.get('train_sequences', 0):,} sequences); "
        f"{train.get('tokens_seen', 0):,} tokens seen over {_fmt(train.get('epochs'))} epochs"
        + (f" ({_total_tokens(train):,} with the earlier stages below)." if stages[:-1] else "."),
        f"- Loss{' (last stage)' if stages[:-1] else ''}: {_loss(eagle3, cfg, unroll)}",
        f"- Optimiser{' (last stage)' if stages[:-1] else ''}: AdamW (lr {cfg.get('lr')}, warm-up {cfg.get('warmup_steps')} steps, cosine decay), gradient "
        f"clip {cfg.get('grad_clip')}, {cfg.get('batch_tokens')} tokens per batch, seed {cfg.get('seed')}.",
        f"- Wall time: {_fmt(sum(st.get('train_seconds', 0) for st in stages) / 3600)} h of training"
        f"{' (all stages)' if stages[:-1] else ''} on {results.get('hardware', 'CPU')}"
        f"{'; feature extraction ' + _fmt(results['extract_hours']) + ' h' if results.get('extract_hours') else ''}.",
    ]
    first_init = stages[0].get("config", {}).get("init")
    if first_init:
        lines.append(f"- Started from `{first_init}`, a head whose training is not recorded here: its tokens and "
                     "hours are not counted above.")  # fmt: skip
    if results.get("training_note"):
        lines.append(f"- Note: {results['training_note']}")
    lines.append("")
    if stages[:-1]:
        lines += _stages_table(stages)
    train_commands = [st.get("command") for st in stages]
    if stages[:-1] and all(train_commands):
        lines += ["Reproduce (the stages in order; each `--init` names the folder the previous stage wrote):", "",
                  "```bash", *chain_stage_commands(train_commands), "```", ""]  # fmt: skip
    elif stages[:-1] and any(train_commands):
        missing = ", ".join(str(i) for i, c in enumerate(train_commands, 1) if not c)
        lines += [f"Commands of the stages (stage {missing}: not recorded):", "", "```bash",
                  *[c for c in train_commands if c], "```", ""]  # fmt: skip
    elif commands.get("train"):
        lines += ["Reproduce:", "", "```bash", commands["train"], "```", ""]
    lines += [
        "## Limitations",
        "",
        "- Trained on a small CPU budget: τ is below what GPU-trained EAGLE heads reach on 7B models.",
        "- Works only with the target it was trained for (same hidden size and tokenizer).",
        "- The speed-up depends on the hardware: on a CPU the verification cost grows quickly with the tree "
        "size, so smaller trees than the paper's m=60 are faster (see `tree_total_tokens=\"auto\"`).",
        "- Greedy decoding is exact; sampling is lossless in distribution, not token-identical.",
        "",
    ]
    if commands.get("card"):
        lines += ["*This card was generated by `" + commands["card"] + "` from `results.json`.*", ""]
    return "\n".join(lines)


def chain_stage_commands(commands: list[str]) -> list[str]:
    """Stage commands as a reader runs them in order: each later stage's `--init` is set to the folder the stage
    before wrote (its `--head-out`, else `OUT/head`). A stage may have been run from a copy (say, the head as then
    shipped in model_cards/, which a later stage has since replaced), so the recorded path can name another head."""
    chained = [commands[0]]
    for previous, command in zip(commands, commands[1:]):
        args, prev = shlex.split(command), shlex.split(previous)
        out = _flag(prev, "--out")
        wrote = _flag(prev, "--head-out") or (out and os.path.join(out, "head"))  # `train`'s own default
        if wrote and "--init" in args[:-1]:
            args[args.index("--init") + 1] = wrote
            command = shlex.join(args)
        chained.append(command)
    return chained


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args[:-1] else None


def _draft_vocab(stages: list[dict]) -> str:
    """Where the draft vocabulary came from: one stage's most frequent tokens, or grown by later stages'."""
    sizes = [st.get("config", {}).get("draft_vocab_size") for st in stages]
    grown = [size for st, size in zip(stages, sizes) if st.get("config", {}).get("grow_vocab")]
    if not sizes[-1]:
        return "the full target vocabulary"
    if not grown:  # (the wording of the cards shipped before vocabularies grew)
        return f"{sizes[-1]} most frequent target tokens of the training data"
    first = next(size for size in sizes if size)  # summaries from before configs were kept name none
    return f"the {first:,} most frequent target tokens of the first stage's data" + "".join(
        f", grown to {size:,} with the most frequent ones of a later stage's data it lacked" for size in grown)


def _architecture(eagle3: bool, cfg: dict, first_cfg: dict) -> str:
    """The head's layout (`cfg`: the last stage's config) and where its lm_head started (`first_cfg`: the first
    stage's, the one that created the head)."""
    if eagle3:
        return ("EAGLE-3 head (fc 3H->H over three target layers (low, middle, high), one Llama decoder layer whose "
                "attention reads the normed token embedding and the normed feature (2H), its own lm_head over the "
                "draft vocabulary with d2t / t2d; its output is fed back as the feature from depth 2 on); the "
                "target's embeddings are reused"
                + ("; its lm_head started as the target's rows of the draft vocabulary."
                   if first_cfg.get("lm_head_init") == "target" else "."))  # fmt: skip
    return (f"EAGLE-1/2 head (fc 2H->H{' with bias' if cfg.get('bias', True) else ''}, one Llama decoder layer "
            "without input norm); the target's embeddings and lm_head are reused.")  # fmt: skip


def _loss(eagle3: bool, cfg: dict, unroll: int) -> str:
    ttt = (f"; training-time test: {unroll} passes, pass s fed the head's own features from pass s - 1"
           + (", weighted 0.8^(s-1)" if eagle3 else "") if unroll > 1 else "")  # fmt: skip
    if eagle3:
        return ("soft cross-entropy against the target's next-token distribution restricted to the draft "
                f"vocabulary (no feature regression){ttt}; uniform noise on the three-layer inputs (std parameter "
                f"{cfg.get('noise_std')}).")
    return (f"SmoothL1(feature) + {cfg.get('ce_weight', 0.1)} x soft cross-entropy against the target's "
            f"distribution; uniform feature noise (std parameter {cfg.get('noise_std')}){ttt}.")


def _depth_table(datasets: dict) -> list[str]:
    """Per-depth acceptance of the evaluation run (the rate at which a round that reached depth d - 1 also got
    depth d accepted)."""
    rates = {ds: acceptance_by_depth(r.get("accept_hist") or []) for ds, r in datasets.items()}
    depth = max((len(v) for v in rates.values()), default=0)
    if not depth:
        return []
    lines = ["Acceptance by depth (share of rounds that reached depth d - 1 and had depth d accepted too):", "",
             "| depth | " + " | ".join(rates) + " |", "|---:|" + "---:|" * len(rates)]  # fmt: skip
    for d in range(depth):
        lines.append(f"| {d + 1} | " + " | ".join(_fmt(v[d] if d < len(v) else None) for v in rates.values()) + " |")
    return lines + [""]


def _stages_table(stages: list[dict]) -> list[str]:
    """One row per training run behind the head, oldest first (`train --init` chains them)."""
    lines = ["Training stages (each started from the previous stage's head):", "",
             "| stage | data | tokens per epoch | epochs | tokens seen | lr | unroll (TTT passes) | autocast | hours |",
             "|---:|---|---:|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for i, st in enumerate(stages, 1):
        cfg = st.get("config", {})
        lines.append(f"| {i} | {', '.join(f'`{d}`' for d in cfg.get('data', []))} | {_count(st.get('train_tokens'))} | "
                     f"{_fmt(st.get('epochs'))} | {_count(st.get('tokens_seen'))} | {cfg.get('lr')} | "
                     f"{cfg.get('unroll') or 1} | {cfg.get('autocast') or 'fp32'} | "
                     f"{_fmt(st.get('train_seconds', 0) / 3600)} |")  # fmt: skip
    return lines + [""]


def _comparison_table(rows: list[dict], datasets: list[str]) -> list[str]:
    lines = ["Side by side (same evaluation settings):", "",
             "| head | parameters | tokens seen | " + " | ".join(f"τ {ds}" for ds in datasets) + " |",
             "|---|---:|---:|" + "---:|" * len(datasets)]  # fmt: skip
    for r in rows:
        taus = " | ".join(_fmt(r.get("tau", {}).get(ds)) for ds in datasets)
        sizes = f"{_count(r.get('head_parameters'))} | {_count(r.get('tokens_seen'))}"
        lines.append(f"| {row_label(r)} | {sizes} | {taus} |")
    return lines + [""]


def round_tau(r: dict) -> float | None:
    """An evaluation's τ over verification rounds. Evaluations from before eval-head recorded `prefill_tokens`
    stored new_tokens / target_forwards, which counted each prompt's prefill token as a round's: recomputed from
    their counts (one prefill token per prompt)."""
    if "prefill_tokens" in r or not all(key in r for key in ("new_tokens", "target_forwards", "prompts")):
        return r.get("tau")
    return tau_of(r["new_tokens"], r["prompts"], r["target_forwards"])


# the settings heads put side by side must share: setting -> its value where an evaluation did not record it
EVAL_SETTINGS = {"max_new_tokens": None, "tree": None, "kernels": "stock", "full_vocab": False}


def comparison_rows(name: str, head_folder: str, evaluation: dict) -> list[dict]:
    """Side-by-side rows from another head folder's results.json: its own (its evaluation and training summary),
    then the rows its own card compares with, "listed_by" NAME unless they name their lister already (they were
    checked against its evaluation when its card was made, and it is checked against `evaluation` here, so they
    were measured alike: a new head's card can sit beside every earlier head without re-evaluating heads whose
    folders are gone). An error unless it was evaluated as `evaluation` was (EVAL_SETTINGS and the prompts per
    dataset)."""
    with open(os.path.join(head_folder, "results.json"), encoding="utf-8") as f:
        other = json.load(f)
    theirs = other.get("eval", {})
    differ = [key for key, unset in EVAL_SETTINGS.items() if theirs.get(key, unset) != evaluation.get(key, unset)]
    differ += [f"{ds} prompts" for ds, r in evaluation.get("datasets", {}).items()
               if theirs.get("datasets", {}).get(ds, {}).get("prompts") != r.get("prompts")]  # fmt: skip
    if differ:
        raise ValueError(f"{head_folder} was evaluated with other settings ({', '.join(differ)}): evaluate it as this "
                         "head was (same eval-head command) before putting the two side by side")  # fmt: skip
    train = other.get("training", {})
    own = {"name": name, "tau": {ds: round_tau(r) for ds, r in other.get("eval", {}).get("datasets", {}).items()},
           "head_parameters": train.get("head_parameters"), "tokens_seen": _total_tokens(train)}  # fmt: skip
    return [own, *({"listed_by": name, **row} for row in _with_listed_by(other.get("comparison", [])))]


def row_label(row: dict) -> str:
    """A comparison row's name in the table: "LISTED_BY: NAME" for a row another head's card brought (its name is
    that card's name for the head), else NAME."""
    return f"{row['listed_by']}: {row['name']}" if row.get("listed_by") else row["name"]


def _with_listed_by(rows: list[dict]) -> list[dict]:
    """Comparison rows with "listed_by" set where the name carries it: results.json from before "listed_by" wrote a
    brought row's name as "LISTED_BY: NAME", LISTED_BY being an earlier row's name in the same list. Keeping the
    lister once (rather than prefixing again at each card) stops the names nesting a level deeper every stage."""
    out = []
    for row in rows:
        lister = next((r["name"] for r in out if row["name"].startswith(f"{r['name']}: ")), None)
        if lister and "listed_by" not in row:
            row = {**row, "listed_by": lister, "name": row["name"][len(lister) + 2 :]}
        out.append(row)
    return out


def merge_evaluations(evaluations: list[dict]) -> dict:
    """One evaluation from `eval-head` runs of the same weights and settings over different datasets (e.g. MT-bench
    80 and HumanEval 40 run separately): datasets side by side, calibration over all their nodes, the commands in
    order. An error when the weights, EVAL_SETTINGS or a dataset overlap."""
    from .calibration import merge_reports

    first = evaluations[0]
    merged = dict(first, datasets={})
    for ev in evaluations:
        differ = [key for key, unset in EVAL_SETTINGS.items() if ev.get(key, unset) != first.get(key, unset)]
        digests = (ev.get("draft_sha256"), first.get("draft_sha256"))
        if (digests[0] != digests[1]) if None not in digests else ev.get("draft") != first.get("draft"):
            differ.append("draft_sha256" if None not in digests else "draft")
        if differ:
            raise ValueError(f"evaluations to merge differ in {', '.join(differ)}: they must be one head's, made alike")
        repeated = set(ev["datasets"]) & set(merged["datasets"])
        if repeated:
            raise ValueError(f"evaluations to merge both measure {', '.join(sorted(repeated))}")
        merged["datasets"] |= ev["datasets"]
    reports = [ev.get("calibration") for ev in evaluations]
    merged.pop("calibration", None)
    if all(reports):  # a report over some of the datasets would be read as one over all of them
        merged["calibration"] = merge_reports(reports)
    merged["command"] = "\n".join(ev["command"] for ev in evaluations if ev.get("command"))
    return merged


def assemble_results(folder: str, eval_json: str | list[str] | None = None, bench_json: str | None = None,
                     curve_jsons: list[str] | None = None, extra: dict | None = None,
                     compare: dict[str, str] | None = None) -> dict:  # fmt: skip
    """Builds `folder/results.json` from the measured outputs: the head's training.json, `eval-head --out` (one
    JSON, or several of the same head and settings: `merge_evaluations`; calibration.png is redrawn from it),
    `bench --out`, `eval-head` runs of training snapshots (the τ curve) and `compare` ({name: other head folder},
    rows of the side-by-side table after this head's own). Returns the dict."""
    def load(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    results_path = os.path.join(folder, "results.json")
    results = load(results_path) if os.path.exists(results_path) else {}
    results.pop("dropped", None)
    digest = weights_sha256(folder)
    if results.get("head_sha256") not in (None, digest):  # the head was retrained or replaced since
        dropped = sorted(key for key in results if key not in ("head_sha256", "training"))  # training: re-read below
        results = {"dropped": dropped} if dropped else {}
    results["head_sha256"] = digest
    results.setdefault("hub_name", os.path.basename(os.path.abspath(folder)))  # the card's title: the folder's name

    def measured_here(what: str, path: str, recorded: str | None) -> None:
        if recorded not in (None, digest):
            raise ValueError(f"{path} ({what}) was measured on other weights (sha256 {recorded[:12]}...) than "
                             f"{folder} holds ({(digest or 'none')[:12]}...): measure this head")  # fmt: skip
    if os.path.exists(os.path.join(folder, "training.json")):
        results["training"] = load(os.path.join(folder, "training.json"))
        if results["training"].get("command"):
            results.setdefault("commands", {})["train"] = results["training"]["command"]
    if eval_json:
        paths = [eval_json] if isinstance(eval_json, str) else list(eval_json)
        for path in paths:
            measured_here("eval-head --out", path, load(path).get("draft_sha256"))
        ev = merge_evaluations([load(path) for path in paths])
        results["eval"] = ev
        results.setdefault("commands", {})["eval"] = ev.get("command")
        if ev.get("calibration"):  # the card's diagram is of the evaluation it reports
            from .calibration import plot_reliability

            plot_reliability(ev["calibration"], os.path.join(folder, "calibration.png"),
                             title=f"{os.path.basename(os.path.abspath(folder))} ({','.join(ev['datasets'])})")
    if bench_json:
        bench = load(bench_json)
        if bench["meta"].get("draft") == "random":
            raise ValueError(f"{bench_json} benchmarked a randomly initialised head, not {folder}'s: pass --draft")
        measured_here("bench --out", bench_json, bench["meta"].get("draft_sha256"))
        speed = {ds: {"speedup": r["eagle2"]["speedup_median"], "tau": r["eagle2"]["tau"]}
                 for ds, r in bench["results"].items() if "eagle2" in r}  # fmt: skip
        speed["note"] = (f"Speed-up: median over prompts of plain/EAGLE-2 wall time, both greedy and interleaved, "
                         f"on {bench['meta'].get('cpu')} ({bench['meta'].get('threads')} threads), "
                         f"tree m={bench['meta']['tree_params']['m']}, depth {bench['meta']['tree_params']['depth']}, "
                         f"k={bench['meta']['tree_params']['k']}, max_new_tokens={bench['meta']['max_new_tokens']}; at that "
                         "tree: " + ", ".join(f"{ds} τ {r['eagle2']['tau']:.2f} over {r['eagle2']['runs']} generations"
                                              for ds, r in bench["results"].items() if "eagle2" in r) + ".")  # fmt: skip
        results["speed"] = speed
        results.setdefault("commands", {})["bench"] = bench["meta"].get("command")
    if curve_jsons:
        curve, settings = [], None
        for path in curve_jsons:
            ev = load(path)
            if "curve" in ev and "datasets" not in ev:  # an earlier stage's card: its measured points, carried
                points, these = _carried_curve(path, ev, results.get("training", {}))
            else:
                points, these = _snapshot_point(path, ev, bool(results.get("training", {}).get("init_lineage")))
            if settings is not None and these != settings:
                raise ValueError(f"{path} was evaluated with other settings than {curve_jsons[0]} "
                                 f"({these} vs {settings}): a curve compares like with like")  # fmt: skip
            settings = these
            curve += points
        results["curve"] = sorted(curve, key=lambda c: c["tokens_seen"])
        results["curve_settings"] = settings
        plot_curve(results["curve"], os.path.join(folder, "tau_curve.png"))
    for key, value in (extra or {}).items():
        if key == "commands":
            results.setdefault("commands", {}).update(value)
        else:
            results[key] = value
    if compare:
        rows, seen = [], []
        for name, path in compare.items():
            for row in comparison_rows(name, path, results.get("eval", {})):
                # a head that two compared cards both list (one head's card brings the other's rows) shows once,
                # under the first name: same τ, size and tokens seen is the same measurement of the same head
                measured = {k: v for k, v in row.items() if k not in ("name", "listed_by")}
                if measured not in seen:
                    seen.append(measured)
                    rows.append(row)
        results["comparison"] = rows
    if results.get("dropped"):  # name only what this command did not measure again
        results["dropped"] = [key for key in results["dropped"] if key not in results]
        if not results["dropped"]:
            del results["dropped"]
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    return results


def _snapshot_point(path: str, evaluation: dict, staged: bool) -> tuple[list[dict], dict]:
    """The τ-curve point of one `eval-head --out` run of a training snapshot (its MT-bench τ at the tokens seen
    behind it, every stage's when the head was trained in stages: `staged`) and its settings."""
    if "mtbench" not in evaluation.get("datasets", {}):
        raise ValueError(f"{path} has no MT-bench evaluation: the τ curve is τ on MT-bench")
    settings = {key: evaluation.get(key, unset) for key, unset in EVAL_SETTINGS.items()}
    settings["prompts"] = evaluation["datasets"]["mtbench"]["prompts"]
    draft = evaluation["draft"]
    now = weights_sha256(draft) if os.path.isdir(draft) else None
    if None not in (now, evaluation.get("draft_sha256")) and now != evaluation["draft_sha256"]:
        raise ValueError(f"{draft} holds other weights than {path} evaluated (retrained or replaced since): its "
                         "training.json would put that evaluation at the wrong tokens")  # fmt: skip
    tokens, total = _tokens_seen(draft)
    if not total and staged:
        raise ValueError(f"{draft} ({path}) has no training.json: its tokens_<N> counts only its own run's tokens, "
                         "but this head's curve counts every training stage's")  # fmt: skip
    point = {"tokens_seen": tokens, "tau_mtbench": round_tau(evaluation["datasets"]["mtbench"]),
             "prompts": settings["prompts"]}  # fmt: skip
    return [point], settings


def _carried_curve(path: str, card: dict, training: dict) -> tuple[list[dict], dict]:
    """The τ curve of an earlier stage's card (its results.json, passed to `--curve`) as points of this head's
    curve, each marked "carried_from" that card's name, and their settings. A retrained head's results.json drops
    its old curve (other weights), yet those points measured the stages this head was trained from, on the same
    axis (tokens seen across stages): they stay on its curve without evaluating the old snapshots again, which may
    be gone. An error unless that card's head is one of this head's `init_lineage` stages."""
    own = lambda summary: {key: value for key, value in summary.items()
                           if key not in ("init_lineage", "tokens_seen_total")}  # as `train --init` records it
    earlier = own(card.get("training", {}))
    if not earlier or earlier not in [own(stage) for stage in training.get("init_lineage", [])]:
        raise ValueError(f"{path} is the card of a head this head was not trained from (its training is not one of "
                         "this head's init_lineage stages): only a lineage's points share the curve's axis")  # fmt: skip
    if not card.get("curve_settings"):
        raise ValueError(f"{path} does not record its curve's evaluation settings (curve_settings): it cannot be "
                         "checked against this curve's")  # fmt: skip
    name = card.get("hub_name") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    points = [{key: value for key, value in point.items() if key != "carried_from"} | {"carried_from": name}
              for point in card["curve"]]  # fmt: skip
    return points, dict(card["curve_settings"])


def _tokens_seen(head_folder: str) -> tuple[int, bool]:
    """Training tokens behind a head and whether they are known to include its lineage's: training.json's
    `tokens_seen_total` (True) or `tokens_seen` (a head not trained from another: True), else a snapshot's name,
    snapshots/tokens_<N> (its own run's tokens only: False)."""
    summary = os.path.join(head_folder, "training.json")
    if os.path.exists(summary):
        with open(summary, encoding="utf-8") as f:
            train = json.load(f)
        return int(_total_tokens(train)), "tokens_seen_total" in train or not train.get("config", {}).get("init")
    name = os.path.basename(head_folder.rstrip("/"))
    if name.startswith("tokens_") and name[7:].isdigit():
        return int(name[7:]), False
    raise ValueError(f"cannot tell how many training tokens {head_folder} saw (no tokens_<N> name, no training.json)")


def _total_tokens(train: dict) -> int | None:
    """Tokens seen by a head's training run and the runs of the heads it started from (`train --init`)."""
    return train.get("tokens_seen_total", train.get("tokens_seen"))


def plot_curve(curve: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([c["tokens_seen"] for c in curve], [c["tau_mtbench"] for c in curve], "o-")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("τ on MT-bench (greedy)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_card(folder: str, results_path: str | None = None, repo_id: str | None = None) -> str:
    results_path = results_path or os.path.join(folder, "results.json")
    with open(results_path, encoding="utf-8") as f:
        results = json.load(f)
    text = render_card(results, repo_id)
    path = os.path.join(folder, "README.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def parse_front_matter(text: str) -> dict:
    """The YAML metadata block of a model card."""
    if not text.startswith("---\n"):
        raise ValueError("model card has no YAML front matter")
    end = text.index("\n---", 4)
    return yaml.safe_load(text[4:end])
