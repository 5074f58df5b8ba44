"""`hf-eagle2`'s verb tree: every verb's help ends with examples the parser accepts, the data steps' old flat
spellings (which model cards record) parse as their `data` form, and `train-head` trains a head end to end over the
`smoke` recipe on a tiny random target, then skips every finished step when run again."""

import glob
import json
import os
import re
import shlex

import pytest
import torch

from hf_eagle2 import EagleDraftModel
from hf_eagle2.cli import DATA_STEPS, build_parser, main
from hf_eagle2.training.recipes import RECIPES, extraction_complete

ROOT = os.path.join(os.path.dirname(__file__), "..")
TOP_VERBS = ["data", "train-head", "eval-head", "bench", "card", "push", "demo"]
VERBS = [[]] + [[verb] for verb in TOP_VERBS] + [["data", step] for step in DATA_STEPS]
# the least each data step parses with
MINIMAL = {
    "extract": ["--out", "f"], "export-prompts": ["--out", "p.npz", "--shards", "0-"],
    "answer": ["--tokens", "p.npz", "--out", "a.npz"], "join-tokens": ["--tokens", "a.npz", "b.npz", "--out", "c.npz"],
    "export-tokens": ["--data", "f", "--out", "t.npz"], "rebuild-features": ["--tokens", "t.npz", "--out", "f"],
    "cut-features": ["--folder", "f", "--max-prompt-context", "8", "--tokens", "t.npz"],
    "train": ["--data", "f", "--out", "run", "--epochs", "2"],
}  # fmt: skip


def verb_of(args) -> list[str]:
    return [args.command] + ([args.step] if args.command == "data" else [])


@pytest.mark.parametrize("verb", VERBS, ids=lambda verb: " ".join(verb) or "hf-eagle2")
def test_every_verbs_help_ends_with_examples_that_parse(verb, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*verb, "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    match = re.search(r"\n(examples?\b[^\n]*:)\n((?:  hf-eagle2 [^\n]+\n?)+)$", text)
    assert match, f"{' '.join(verb)} --help does not end with an example:\n{text[-400:]}"
    for line in match.group(2).splitlines():
        args = build_parser().parse_args(shlex.split(line)[1:])
        if verb:  # a verb's examples are of that verb (the top level's of any)
            assert verb_of(args)[: len(verb)] == verb, line


def test_demo_defaults_follow_the_model_and_flags_override_them():
    """`demo --model M` shows M's shipped head in its dtype and prompt; flags win; other models get smollm2's."""
    from hf_eagle2.cli import DEMO_DEFAULTS, demo_settings

    qwen = demo_settings(build_parser().parse_args(["demo", "--model", "qwen2.5-coder-1.5b"]))
    assert qwen["dtype"] == "bfloat16" and os.path.isfile(os.path.join(ROOT, qwen["draft"], "config.json"))
    small = demo_settings(build_parser().parse_args(["demo"]))
    assert small == DEMO_DEFAULTS["smollm2"] and os.path.isfile(os.path.join(ROOT, small["draft"], "config.json"))
    mine = demo_settings(build_parser().parse_args(["demo", "--model", "qwen2.5-coder-1.5b", "--dtype", "float32",
                                                    "--prompt", "Hi"]))  # fmt: skip
    assert (mine["dtype"], mine["prompt"], mine["draft"]) == ("float32", "Hi", qwen["draft"])
    assert demo_settings(build_parser().parse_args(["demo", "--model", "my/folder"])) == DEMO_DEFAULTS["smollm2"]


def test_old_flat_spellings_parse_as_their_data_step(capsys):
    usage = build_parser().format_usage()  # the top level lists the new verbs only
    assert re.search(r"\{([^}]*)\}", usage).group(1).split(",") == TOP_VERBS
    for step in DATA_STEPS:
        old = vars(build_parser().parse_args([step, *MINIMAL[step]]))
        assert f"`hf-eagle2 {step}` is now `hf-eagle2 data {step}`" in capsys.readouterr().err
        new = vars(build_parser().parse_args(["data", step, *MINIMAL[step]]))
        assert capsys.readouterr().err == ""
        assert old == new and new["func"].__name__ == "cmd_" + step.replace("-", "_")
        assert new["command_line"] == "hf-eagle2 " + shlex.join(["data", step, *MINIMAL[step]])


def test_commands_the_shipped_cards_record_still_parse():
    """training.json and results.json of the shipped heads record `hf-eagle2 train ...` (the old spelling),
    eval-head, bench and card commands: each still parses, the train ones as `data train`."""

    def commands(value):
        if isinstance(value, dict):
            return [c for v in value.values() for c in commands(v)]
        if isinstance(value, list):
            return [c for v in value for c in commands(v)]
        return [line for line in value.splitlines() if line.startswith("hf-eagle2 ")] if isinstance(value, str) else []

    found = []
    for path in glob.glob(os.path.join(ROOT, "model_cards", "*", "*.json")):
        with open(path, encoding="utf-8") as f:
            found += commands(json.load(f))
    assert len(found) > 10 and any(c.startswith("hf-eagle2 train ") for c in found)
    for command in found:
        args = build_parser().parse_args(shlex.split(command)[1:])
        if command.startswith("hf-eagle2 train "):
            assert verb_of(args) == ["data", "train"] and args.data and args.out


def test_train_head_lists_its_recipes(capsys):
    assert main(["train-head", "--list-recipes"]) == 0
    out = capsys.readouterr().out
    assert {"eagle3-sharegpt", "eagle2-sharegpt", "smoke"} <= set(RECIPES)
    for name, recipe in RECIPES.items():
        assert f"\n{name}: " in "\n" + out
    assert "responses=target, turns=all, dtype=bfloat16, eagle3=True" in out  # eagle3-sharegpt's extraction
    assert "responses=sharegpt" in out and "head=eagle3" in out and "head=eagle2" in out
    with pytest.raises(SystemExit, match="give --recipe and --out"):
        main(["train-head", "--recipe", "smoke"])


def test_an_extraction_cut_short_is_not_complete(tmp_path):
    settings = {"responses": "sharegpt", "split": "train", "turns": "first", "dtype": "float32", "batch_size": 4,
                "max_prompt_tokens": 384, "max_new_tokens": 384, "eagle3": False}  # fmt: skip
    meta = {k: v for k, v in settings.items() if k != "eagle3"} | {"min_prompt_tokens": 0, "aux_layers": [],
                                                                   "sampling": None, "tokens": 100, "shards": 2}
    (tmp_path / "meta.json").write_text(json.dumps(meta))  # as extract leaves it after each shard
    assert not extraction_complete(str(tmp_path), settings)
    (tmp_path / "meta.json").write_text(json.dumps(meta | {"sequences_reached": 8}))  # as when the run ends
    assert extraction_complete(str(tmp_path), settings)
    assert not extraction_complete(str(tmp_path), settings | {"batch_size": 8})  # other settings
    assert not extraction_complete(str(tmp_path), settings | {"eagle3": True})


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (and chat template) saved as a local model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from hf_eagle2.evaluation.assets import converted_gguf_folder, resolve_gguf

    tokenizer = AutoTokenizer.from_pretrained(converted_gguf_folder(resolve_gguf("smollm2")))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    folder = str(tmp_path_factory.mktemp("tiny-target"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model.eval(), tokenizer


def test_train_head_smoke_end_to_end_then_skips_what_is_done(tiny_target, tmp_path, capsys):
    folder, model, tokenizer = tiny_target
    out = str(tmp_path / "run")
    argv = ["train-head", "--target", folder, "--recipe", "smoke", "--out", out, "--threads",
            os.environ.get("HF_EAGLE2_TEST_THREADS", "2")]  # fmt: skip
    steps = ["extract-train", "extract-val", "train", "eval", "card"]
    assert main(argv) == 0
    head = EagleDraftModel.from_pretrained(os.path.join(out, "head"))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                        return_tensors="pt")["input_ids"]  # fmt: skip
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids, assistant_model=head, max_new_tokens=6, do_sample=False), plain)
    with open(os.path.join(out, "head", "training.json")) as f:
        assert json.load(f)["command"].startswith("hf-eagle2 data train --model ")
    assert os.path.exists(os.path.join(out, "head", "README.md"))

    def log():
        with open(os.path.join(out, "train-head.json")) as f:
            return json.load(f)

    first = log()
    assert first["recipe"] == "smoke" and first["target"] == folder and len(first["runs"]) == 1
    records = first["runs"][0]["steps"]
    assert [r["step"] for r in records] == steps and all(r["status"] == "done" for r in records)
    assert all(r["seconds"] > 0 and r["command"].startswith("hf-eagle2 ") for r in records)
    assert first["compute_seconds"] == pytest.approx(sum(r["seconds"] for r in records), abs=0.01)
    assert all(r["cpu_seconds"] > 0 for r in records)  # what a compute budget counts
    assert first["compute_cpu_seconds"] == pytest.approx(sum(r["cpu_seconds"] for r in records), abs=0.01)

    capsys.readouterr()
    assert main(argv) == 0  # again: every step is done
    second = log()
    assert len(second["runs"]) == 2 and second["runs"][0] == first["runs"][0]
    assert [(r["step"], r["status"]) for r in second["runs"][1]["steps"]] == [(s, "skipped") for s in steps]
    assert second["compute_seconds"] == first["compute_seconds"]
    assert "ran nothing (all done)" in capsys.readouterr().out

    os.remove(os.path.join(out, "head", "README.md"))  # an output gone: that step (and those after it) run again
    assert main(argv) == 0
    third = log()["runs"][2]["steps"]
    assert [(r["step"], r["status"]) for r in third] == [(s, "skipped") for s in steps[:-1]] + [("card", "done")]
    assert "extract_hours=" in third[-1]["command"]
    with pytest.raises(SystemExit, match="holds a train-head run of recipe 'smoke'"):
        main(["train-head", "--target", folder, "--recipe", "eagle2-sharegpt", "--out", out, "--dry-run"])


def test_a_bf16_target_trains_on_its_own_bf16_distribution():
    """train-head --dtype bfloat16 extracts in bf16 and trains with bf16 autocast and bf16 soft labels (the bf16
    target's own distribution, and a quarter of a 1.5B head's step cheaper); fp32 keeps fp32 labels."""
    from hf_eagle2.training import recipes

    def train_step(dtype):
        recipe = recipes.with_overrides(recipes.get_recipe("eagle2-sharegpt"), dtype=dtype)
        (step,) = [s for s in recipes.plan(recipe, "smollm2", "/tmp/unused", evaluate=False) if s.name == "train"]
        return step

    bf16, fp32 = train_step("bfloat16"), train_step("float32")
    assert bf16.argv[bf16.argv.index("--soft-labels") + 1] == "bfloat16" and bf16.settings["soft_labels"] == "bfloat16"
    assert "--autocast" in bf16.argv
    assert "--soft-labels" not in fp32.argv and "soft_labels" not in fp32.settings


def test_train_head_can_shrink_its_evaluation():
    """--eval-limit / --eval-max-new-tokens reach eval-head's command line and its step settings (a resumed run with
    other evaluation settings runs it again); left out, the recipe's 80 + 40 prompts at 256 tokens stand."""
    from hf_eagle2.training import recipes

    def eval_step(**overrides):
        recipe = recipes.with_overrides(recipes.get_recipe("eagle2-sharegpt"), **overrides)
        (step,) = [s for s in recipes.plan(recipe, "smollm2", "/tmp/unused") if s.name == "eval"]
        return step

    small, default = eval_step(eval_limit="mtbench=5,humaneval=5", eval_max_new_tokens=128), eval_step()
    assert small.argv[small.argv.index("--limit") + 1] == "mtbench=5,humaneval=5"
    assert small.argv[small.argv.index("--max-new-tokens") + 1] == "128"
    assert (small.settings["limit"], small.settings["max_new_tokens"]) == ("mtbench=5,humaneval=5", 128)
    assert default.argv[default.argv.index("--limit") + 1] == "mtbench=80,humaneval=40"
    assert default.settings["max_new_tokens"] == 256


def test_train_head_refuses_evaluation_settings_with_no_eval(tmp_path):
    """--no-eval skips eval-head, so settings for it would be silently ignored: refused, naming both flags."""
    with pytest.raises(SystemExit, match="--no-eval skips"):
        main(["train-head", "--recipe", "eagle2-sharegpt", "--out", str(tmp_path), "--no-eval",
              "--eval-limit", "mtbench=5"])  # fmt: skip
    assert not any(tmp_path.iterdir())  # refused before the run log is written
