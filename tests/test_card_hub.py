"""Model card generation from a results JSON, and Hub upload up to the network boundary."""

import json
import os

import pytest
import yaml
from conftest import tiny_model

from hf_eagle2 import EagleDraftModel
from hf_eagle2.heads.card import (acceptance_by_depth, assemble_results, card_metadata, chain_stage_commands,
                            is_namespaced, merge_evaluations, parse_front_matter, render_card, row_label, write_card)
from hf_eagle2.heads.formats import weights_sha256
from hf_eagle2.heads.hub import push_head_folder

MODEL_CARDS = os.path.join(os.path.dirname(__file__), "..", "model_cards")
SHIPPED_HEADS = sorted(os.listdir(MODEL_CARDS))  # every head folder the repo ships

RESULTS = {
    "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "hub_name": "someone/smollm2-135m-instruct-eagle2",
    "hardware": "2-core CPU",
    "training": {"config": {"lr": 0.001, "draft_vocab_size": 8192, "ce_weight": 0.1, "noise_std": 0.2,
                            "warmup_steps": 100, "grad_clip": 0.5, "batch_tokens": 4096, "seed": 0},
                 "tokens_seen": 1234567, "epochs": 3.0, "train_tokens": 411522, "train_sequences": 1000,
                 "train_seconds": 7200.0, "head_parameters": 4203648},
    "eval": {"max_new_tokens": 256, "tree": {"tree": "eagle2", "tree_total_tokens": 60, "tree_depth": 6, "tree_top_k": 10},
             "datasets": {"mtbench": {"prompts": 80, "tau": 3.1}, "humaneval": {"prompts": 164, "tau": 3.4}},
             "calibration": {"nodes": 10, "local": {"edges": [0, 0.5, 1], "count": [4, 6], "confidence": [0.3, 0.8],
                                                    "accepted": [0.25, 0.75], "ece": 0.05, "total": 10},
                             "path": {"edges": [0, 0.5, 1], "count": [5, 5], "confidence": [0.2, 0.7],
                                      "accepted": [0.2, 0.6], "ece": 0.05, "total": 10}}},
    "speed": {"mtbench": {"speedup": 1.8}, "humaneval": {"speedup": 2.1}},
    "curve": [{"tokens_seen": 1000, "tau_mtbench": 2.0}],
    "commands": {"eval": "hf-eagle2 eval-head ...", "train": "hf-eagle2 train ...", "card": "hf-eagle2 card ..."},
}  # fmt: skip


def test_card_front_matter_is_valid_yaml():
    text = render_card(RESULTS)
    meta = parse_front_matter(text)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["license"] == "apache-2.0" and meta["datasets"]
    assert {"eagle", "eagle-2", "speculative-decoding"} <= set(meta["tags"])
    # a head cannot generate alone (no task), and no Hub library loads it (hf_eagle2 is none, transformers cannot)
    assert "pipeline_tag" not in meta and "library_name" not in meta
    yaml.safe_load(yaml.safe_dump(meta))
    for needle in ("3.10", "3.40", "1.80x", "ECE", "tree=\"eagle2\"", "hf-eagle2 eval-head", "Limitations"):
        assert needle in text, needle


def snippet(text):
    return next(line for line in text.splitlines() if "EagleDraftModel.from_pretrained(" in line)


def test_usage_snippet_loads_a_namespaced_repo_id():
    assert 'from_pretrained("someone/smollm2-135m-instruct-eagle2")' in snippet(render_card(RESULTS))
    local = {k: v for k, v in RESULTS.items() if k != "hub_name"}
    assert 'from_pretrained("path/to/smollm2-135m-instruct-eagle2")' in snippet(render_card(local))
    assert 'from_pretrained("me/my-head")' in snippet(render_card(local, repo_id="me/my-head"))
    with pytest.raises(ValueError, match="namespaced"):
        render_card(local, repo_id="my-head")


@pytest.mark.parametrize("name", SHIPPED_HEADS)
def test_shipped_card_is_what_the_generator_writes(name):
    """The shipped cards' front matter and text are regenerated from their results.json (numbers untouched)."""
    folder = os.path.join(MODEL_CARDS, name)
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        assert f.read() == render_card(results)


@pytest.mark.parametrize("name", SHIPPED_HEADS)
def test_shipped_head_names_its_target_by_hub_id(name):
    """A shipped head's config names its target as a Hub id (what `from_pretrained` users load), never the local
    cache folder it was trained against, and the same target as its card's `base_model`."""
    folder = os.path.join(MODEL_CARDS, name)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        target = json.load(f)["target_model"]
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    assert is_namespaced(target) and not os.path.isabs(target) and "cache" not in target, target
    assert card_metadata(results)["base_model"] == target


def test_reproduce_commands_chain_each_stage_to_the_folder_the_last_one_wrote():
    """A stage run from a copy of the previous head (the head as then shipped in model_cards/, since replaced) reads,
    in the card, from the folder the previous stage's command wrote: its --head-out, else OUT/head."""
    stage1 = "hf-eagle2 train --data d --out runs/train/a --head-out 'runs/stage/first head'"
    stage2 = "hf-eagle2 train --data d --init model_cards/x --out runs/train/b"
    stage3 = "hf-eagle2 train --data d --init model_cards/x --epochs 2 --out runs/train/c"
    assert chain_stage_commands([stage1, stage2, stage3]) == [
        stage1,
        "hf-eagle2 train --data d --init 'runs/stage/first head' --out runs/train/b",
        "hf-eagle2 train --data d --init runs/train/b/head --epochs 2 --out runs/train/c",
    ]
    untouched = "hf-eagle2 train --data d --out runs/train/d"  # no --init: a fresh stage, left as run
    assert chain_stage_commands([stage1, untouched]) == [stage1, untouched]


def test_acceptance_by_depth():
    # 10 rounds: 4 accepted nothing, 3 one draft token, 2 two, 1 three
    assert acceptance_by_depth([4, 3, 2, 1]) == [0.6, 0.5, 1 / 3]
    assert acceptance_by_depth([5, 0, 0]) == [0.0, None]
    assert acceptance_by_depth([]) == []


def test_eagle3_card_and_side_by_side_table(tmp_path):
    """An EAGLE-3 head's card names its architecture and loss, gives per-depth acceptance, and a side-by-side
    table built from other heads' results.json."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.json").write_text(json.dumps(RESULTS))
    new = tmp_path / "new"
    new.mkdir()
    cfg = RESULTS["training"]["config"] | {"head": "eagle3", "unroll": 3, "noise_std": 0.0, "lm_head_init": "target"}
    (new / "training.json").write_text(json.dumps(RESULTS["training"] | {"config": cfg, "tokens_seen": 999}))
    ev = json.loads(json.dumps(RESULTS["eval"]))
    ev["datasets"]["mtbench"] |= {"tau": 4.25, "accept_hist": [4, 3, 2, 1]}
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    results = assemble_results(str(new), eval_json=str(tmp_path / "eval.json"), compare={"old head": str(old)},
                               extra={"hub_name": "someone/new-eagle3"})  # fmt: skip
    assert [r["name"] for r in results["comparison"]] == ["old head"]
    text = render_card(results)
    assert "eagle-3" in parse_front_matter(text)["tags"] and "**EAGLE-3 draft head**" in text
    assert "fc 3H->H" in text and "training-time test: 3 passes" in text and "no feature regression" in text
    assert "its lm_head started as the target's rows of the draft vocabulary" in text
    # a later stage (`--init`) keeps the lm_head its first stage started: the card says where that was
    staged = results["training"] | {"config": cfg | {"init": "stage-1", "lm_head_init": None},
                                    "init_lineage": [results["training"]]}  # fmt: skip
    assert "its lm_head started as the target's rows" in render_card(results | {"training": staged})
    first = results["training"] | {"config": cfg | {"lm_head_init": "random"}}
    assert "its lm_head started" not in render_card(results | {"training": staged | {"init_lineage": [first]}})
    assert "| 1 | 0.60 | - |" in text and "| 3 | 0.33 | - |" in text  # per-depth acceptance, mtbench column
    assert "| someone/new-eagle3 | 4,203,648 | 999 | 4.25 | 3.40 |" in text
    assert "| old head | 4,203,648 | 1,234,567 | 3.10 | 3.40 |" in text
    ev["max_new_tokens"] = 128  # heads evaluated differently are not put side by side
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    with pytest.raises(ValueError, match="max_new_tokens"):
        assemble_results(str(new), eval_json=str(tmp_path / "eval.json"), compare={"old head": str(old)})
    ev["max_new_tokens"], ev["kernels"] = RESULTS["eval"]["max_new_tokens"], "fast"  # the old eval: stock (unset)
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    with pytest.raises(ValueError, match="kernels"):
        assemble_results(str(new), eval_json=str(tmp_path / "eval.json"), compare={"old head": str(old)})
    ev["kernels"], ev["full_vocab"] = "stock", True  # the same weights scoring another vocabulary
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    with pytest.raises(ValueError, match="full_vocab"):
        assemble_results(str(new), eval_json=str(tmp_path / "eval.json"), compare={"old head": str(old)})
    ev["full_vocab"] = False
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    assert assemble_results(str(new), eval_json=str(tmp_path / "eval.json"), compare={"old head": str(old)})
    # the rows the old head's own card compares with come along, named after it
    older = RESULTS | {"comparison": [{"name": "stage 1", "tau": {"mtbench": 2.5}, "head_parameters": 7, "tokens_seen": 8}]}
    (old / "results.json").write_text(json.dumps(older))
    results = assemble_results(str(new), eval_json=str(tmp_path / "eval.json"), compare={"old head": str(old)})
    assert [row_label(r) for r in results["comparison"]] == ["old head", "old head: stage 1"]
    assert "| old head: stage 1 | 7 | 8 | 2.50 | - |" in render_card(results)
    # a head both compared cards list (the newer one brings the older one's rows) is one row, the first one named
    newer = tmp_path / "newer"
    newer.mkdir()
    ev_newer = json.loads(json.dumps(RESULTS["eval"]))
    ev_newer["datasets"]["mtbench"]["tau"] = 3.9
    (newer / "results.json").write_text(json.dumps(RESULTS | {"eval": ev_newer, "comparison": results["comparison"]}))
    both = assemble_results(str(new), eval_json=str(tmp_path / "eval.json"),
                            compare={"old head": str(old), "newer head": str(newer)})  # fmt: skip
    assert [row_label(r) for r in both["comparison"]] == ["old head", "old head: stage 1", "newer head"]
    # a row brought twice keeps the card that named it: a lineage of stages does not nest "a: b: c: ..."
    newest = assemble_results(str(new), eval_json=str(tmp_path / "eval.json"), compare={"newer head": str(newer)})
    assert [row_label(r) for r in newest["comparison"]] == ["newer head", "newer head: old head", "old head: stage 1"]
    # results.json from before "listed_by" kept the lister in the name: read the same way
    legacy = [{k: v for k, v in r.items() if k != "listed_by"} | {"name": row_label(r)} for r in results["comparison"]]
    (newer / "results.json").write_text(json.dumps(RESULTS | {"eval": ev_newer, "comparison": legacy}))
    again = assemble_results(str(new), eval_json=str(tmp_path / "eval.json"), compare={"newer head": str(newer)})
    assert again["comparison"] == newest["comparison"]


def test_results_describe_one_set_of_weights(tmp_path):
    """eval-head and bench record the sha256 of the head's weights file; card refuses measurements of other
    weights, and a folder whose head was replaced starts its results.json over instead of keeping old numbers."""
    EagleDraftModel.from_target(tiny_model("llama"), seed=0).save_pretrained(tmp_path)
    digest = EagleDraftModel.from_pretrained(tmp_path).weights_sha256
    assert digest is not None and digest == weights_sha256(tmp_path) == weights_sha256(tmp_path / "model.safetensors")
    (tmp_path / "eval.json").write_text(json.dumps(RESULTS["eval"] | {"draft_sha256": digest}))
    (tmp_path / "bench.json").write_text(json.dumps({"meta": {"draft_sha256": "0" * 64}, "results": {}}))
    legacy = {key: RESULTS[key] for key in ("hardware", "speed", "curve")}  # written before digests: kept
    (tmp_path / "results.json").write_text(json.dumps(legacy))
    results = assemble_results(str(tmp_path), eval_json=str(tmp_path / "eval.json"))
    assert results["head_sha256"] == digest and results["speed"] == RESULTS["speed"] and "dropped" not in results
    with pytest.raises(ValueError, match="bench.json .bench --out. was measured on other weights"):
        assemble_results(str(tmp_path), bench_json=str(tmp_path / "bench.json"))
    (tmp_path / "bench.json").write_text(json.dumps({"meta": {"draft": "random"}, "results": {}}))  # no head found
    with pytest.raises(ValueError, match="randomly initialised head"):
        assemble_results(str(tmp_path), bench_json=str(tmp_path / "bench.json"))
    EagleDraftModel.from_target(tiny_model("llama"), seed=1).save_pretrained(tmp_path)  # retrained in place
    assert weights_sha256(tmp_path) != digest
    with pytest.raises(ValueError, match="eval.json .eval-head --out. was measured on other weights"):
        assemble_results(str(tmp_path), eval_json=str(tmp_path / "eval.json"))
    results = assemble_results(str(tmp_path), extra={"hardware": "the new machine"})
    assert results["dropped"] == ["commands", "curve", "eval", "speed"]  # hardware: given again, so not dropped
    assert results["head_sha256"] == weights_sha256(tmp_path) and "eval" not in results and "speed" not in results
    assert results["hardware"] == "the new machine"
    assert "dropped" not in assemble_results(str(tmp_path))  # said once, on the run that dropped them
    # a comparison given again on the run that drops the old one is not reported dropped (it was measured anew)
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text(json.dumps({"training": RESULTS["training"]}))
    stale = json.loads((tmp_path / "results.json").read_text()) | {"head_sha256": "0" * 64, "comparison": []}
    (tmp_path / "results.json").write_text(json.dumps(stale))
    results = assemble_results(str(tmp_path), extra={"hardware": "the new machine"}, compare={"other": str(other)})
    assert [row["name"] for row in results["comparison"]] == ["other"]
    assert "dropped" not in results  # hardware and the comparison given again, hub_name re-derived


def test_card_of_a_head_trained_in_stages(tmp_path):
    """A head trained from other heads (`train --init`) gets one row per stage, every stage's command, tokens
    counted across stages (its row, the comparison, the curve), and a curve of like-for-like evaluations."""
    stage = lambda n, tokens: RESULTS["training"] | {"tokens_seen": tokens, "command": f"hf-eagle2 train stage {n}"}
    head = tmp_path / "head"
    head.mkdir()
    summary = stage(3, 500) | {"init_lineage": [stage(2, 300), stage(1, 200)], "tokens_seen_total": 1000}
    (head / "training.json").write_text(json.dumps(summary))
    first = tmp_path / "run1" / "head"  # stage 1's head: trained from scratch, its tokens are its total
    first.mkdir(parents=True)
    (first / "training.json").write_text(json.dumps(stage(1, 200)))
    snapshot = tmp_path / "run3" / "snapshots" / "tokens_0000000100"
    snapshot.mkdir(parents=True)
    (snapshot / "training.json").write_text(json.dumps({"tokens_seen": 100, "tokens_seen_total": 600}))
    curve = []
    for i, folder in enumerate([snapshot, first, head]):
        ev = RESULTS["eval"] | {"draft": str(folder), "kernels": "fast"}
        ev["datasets"] = {"mtbench": {"prompts": 10, "tau": 2.0 + i / 10}}
        curve.append(tmp_path / f"curve{i}.json")
        curve[-1].write_text(json.dumps(ev))
    results = assemble_results(str(head), curve_jsons=[str(p) for p in curve])
    assert [(c["tokens_seen"], c["tau_mtbench"]) for c in results["curve"]] == [(200, 2.1), (600, 2.0), (1000, 2.2)]
    # the card of stage 2 (retrained since, its snapshots gone) lends its measured points to the curve
    earlier = tmp_path / "stage2_card"
    earlier.mkdir()
    earlier_training = stage(2, 300) | {"init_lineage": [stage(1, 200)], "tokens_seen_total": 500}
    earlier_card = {"hub_name": "head-stage2", "training": earlier_training, "curve_settings": results["curve_settings"],
                    "curve": [{"tokens_seen": 100, "tau_mtbench": 1.5, "prompts": 10},
                              {"tokens_seen": 500, "tau_mtbench": 1.9, "prompts": 10}]}  # fmt: skip
    (earlier / "results.json").write_text(json.dumps(earlier_card))
    carried = assemble_results(str(head), curve_jsons=[str(earlier / "results.json"), str(curve[2])])
    assert [(c["tokens_seen"], c["tau_mtbench"], c.get("carried_from")) for c in carried["curve"]] == [
        (100, 1.5, "head-stage2"), (500, 1.9, "head-stage2"), (1000, 2.2, None)]  # fmt: skip
    assert ("The 2 points up to 500 tokens were measured for the card of an earlier stage of this head "
            "(`head-stage2`) and carried over.") in render_card(carried)  # fmt: skip
    (earlier / "results.json").write_text(json.dumps(earlier_card | {"training": stage(2, 301)}))
    with pytest.raises(ValueError, match="not trained from"):  # not this head's stage 2: another axis
        assemble_results(str(head), curve_jsons=[str(earlier / "results.json"), str(curve[2])])
    other = earlier_card | {"curve_settings": results["curve_settings"] | {"max_new_tokens": 64}}
    (earlier / "results.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="other settings"):
        assemble_results(str(head), curve_jsons=[str(curve[2]), str(earlier / "results.json")])
    results = assemble_results(str(head), curve_jsons=[str(p) for p in curve])
    text = render_card(results)
    assert "500 tokens seen over 3.00 epochs (1,000 with the earlier stages below)" in text
    assert "6.00 h of training (all stages)" in text  # 3 stages x 7200 s
    assert text.index("train stage 1") < text.index("train stage 2") < text.index("train stage 3")
    assert "each `--init` names the folder the previous stage wrote" in text and "| 3 | " in text and "| 200 |" in text
    assert "10 new tokens" not in text and "256 new tokens, fast CPU kernels; tokens seen include" in text
    assert "Started from" not in text  # stage 1 started from scratch
    size = RESULTS["training"]["config"]["draft_vocab_size"]
    assert f"Draft vocabulary: {size} most frequent target tokens of the training data" in text
    grew = summary | {"config": summary["config"] | {"draft_vocab_size": size + 512, "grow_vocab": True}}
    assert (f"Draft vocabulary: the {size:,} most frequent target tokens of the first stage's data, grown to "
            f"{size + 512:,} with the most frequent ones of a later stage's data it lacked") in render_card(
        RESULTS | {"training": grew})  # fmt: skip
    ev = json.loads(curve[0].read_text()) | {"kernels": "stock"}
    curve[0].write_text(json.dumps(ev))
    with pytest.raises(ValueError, match="other settings"):
        assemble_results(str(head), curve_jsons=[str(p) for p in curve])
    bare = tmp_path / "run2" / "snapshots" / "tokens_0000000050"  # no training.json: its name counts one run only
    bare.mkdir(parents=True)
    curve[0].write_text(json.dumps(ev | {"kernels": "fast", "draft": str(bare)}))
    with pytest.raises(ValueError, match="counts only its own run"):
        assemble_results(str(head), curve_jsons=[str(p) for p in curve])
    EagleDraftModel.from_target(tiny_model("llama"), seed=0).save_pretrained(bare)  # weights the eval did not see
    (bare / "training.json").write_text(json.dumps({"tokens_seen": 50, "tokens_seen_total": 250}))
    curve[0].write_text(json.dumps(json.loads(curve[0].read_text()) | {"draft_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="holds other weights than"):
        assemble_results(str(head), curve_jsons=[str(p) for p in curve])
    # a lineage ending at a head with unknown training says so; stages without a command are named
    started = stage(1, 200) | {"config": RESULTS["training"]["config"] | {"init": "someone/official-head"}}
    del started["command"]
    text = render_card(RESULTS | {"training": summary | {"init_lineage": [stage(2, 300), started]}})
    assert "Started from `someone/official-head`, a head whose training is not recorded here" in text
    assert "Commands of the stages (stage 1: not recorded)" in text and "each `--init` names" not in text
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text(json.dumps(RESULTS | {"training": summary}))
    (tmp_path / "eval.json").write_text(json.dumps(RESULTS["eval"]))
    results = assemble_results(str(head), eval_json=str(tmp_path / "eval.json"), compare={"other": str(other)})
    assert results["comparison"][0]["tokens_seen"] == 1000


def test_card_merges_one_heads_evaluations_of_different_datasets(tmp_path):
    """MT-bench 80 and HumanEval 40 evaluated in two runs make one evaluation: datasets side by side, calibration
    over all nodes (as if measured in one run), both commands; other weights, settings or a repeated dataset are
    refused, and calibration.png is redrawn from what the card reports."""
    import torch

    from hf_eagle2.heads.calibration import reliability

    confidence, outcome = torch.rand(500, generator=torch.Generator().manual_seed(0)), torch.rand(500) < 0.5
    whole = reliability(confidence, outcome).to_dict()
    evals = []
    for i, (ds, part) in enumerate([("mtbench", slice(0, 180)), ("humaneval", slice(180, 500))]):
        rel = reliability(confidence[part], outcome[part]).to_dict()
        ev = RESULTS["eval"] | {"draft_sha256": None, "command": f"eval {ds}", "datasets": {ds: {"prompts": 5, "tau": 3.0 + i}},
                                "calibration": {"local": rel, "path": rel, "nodes": rel["total"]}}  # fmt: skip
        evals.append(tmp_path / f"{ds}.json")
        evals[-1].write_text(json.dumps(ev))
    head = tmp_path / "head"
    head.mkdir()
    results = assemble_results(str(head), eval_json=[str(p) for p in evals])
    merged = results["eval"]
    assert list(merged["datasets"]) == ["mtbench", "humaneval"] and merged["command"] == "eval mtbench\neval humaneval"
    assert merged["calibration"]["nodes"] == 500 and merged["calibration"]["local"]["count"] == whole["count"]
    assert merged["calibration"]["path"]["ece"] == pytest.approx(whole["ece"], abs=1e-12)
    assert merged["calibration"]["local"]["accepted"] == pytest.approx(whole["accepted"], abs=1e-12)
    assert (head / "calibration.png").stat().st_size > 0
    with pytest.raises(ValueError, match="both measure mtbench"):
        assemble_results(str(head), eval_json=[str(evals[0]), str(evals[0])])
    other = json.loads(evals[1].read_text()) | {"max_new_tokens": 128}
    evals[1].write_text(json.dumps(other))
    with pytest.raises(ValueError, match="differ in max_new_tokens"):
        assemble_results(str(head), eval_json=[str(p) for p in evals])
    fixed = other | {"max_new_tokens": 256}
    partial = json.loads(evals[0].read_text())
    del partial["calibration"]  # calibration of one dataset only would read as the whole evaluation's
    assert "calibration" not in merge_evaluations([partial, fixed])
    legacy = json.loads(evals[0].read_text()) | {"draft": "a"}  # recorded before eval-head stored digests
    assert merge_evaluations([legacy, fixed | {"draft": "a", "draft_sha256": "1" * 64}])
    with pytest.raises(ValueError, match="differ in draft"):
        merge_evaluations([legacy, fixed | {"draft": "b"}])
    with pytest.raises(ValueError, match="differ in draft_sha256"):  # (card also refuses it as not this head's)
        merge_evaluations([json.loads(evals[0].read_text()) | {"draft_sha256": "0" * 64}, fixed | {"draft_sha256": "1" * 64}])


def test_card_needs_front_matter():
    with pytest.raises(ValueError):
        parse_front_matter("# no metadata")


class FakeApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, **kw):
        self.calls.append(("create_repo", kw))
        full_id = kw["repo_id"] if "/" in kw["repo_id"] else "someone/" + kw["repo_id"]  # the caller's namespace
        return type("RepoUrl", (str,), {"repo_id": full_id})(f"https://huggingface.co/{full_id}")

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw))
        return type("Info", (), {"commit_url": "https://huggingface.co/x/y/commit/abc"})()


def test_push_uploads_card_config_and_weights(tmp_path):
    head = EagleDraftModel.from_target(tiny_model("llama"), seed=0)
    head.save_pretrained(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(RESULTS))
    write_card(str(tmp_path))
    (tmp_path / "scratch.txt").write_text("not uploaded")
    api = FakeApi()
    url = push_head_folder(str(tmp_path), "someone/head", api=api)
    assert url.endswith("/commit/abc")
    assert api.calls[0] == ("create_repo", {"repo_id": "someone/head", "repo_type": "model", "private": False, "exist_ok": True})
    upload = api.calls[1][1]
    assert set(upload["allow_patterns"]) == {"README.md", "config.json", "model.safetensors", "results.json"}
    assert upload["repo_id"] == "someone/head"
    assert 'from_pretrained("someone/head")' in snippet((tmp_path / "README.md").read_text())
    push_head_folder(str(tmp_path), "other-head", api=api)  # a bare name lands in the caller's namespace
    assert 'from_pretrained("someone/other-head")' in snippet((tmp_path / "README.md").read_text())


def test_push_refuses_a_folder_without_a_head(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        push_head_folder(str(tmp_path), "someone/head", api=FakeApi())


def test_real_hub_client_reaches_the_network_boundary(tmp_path, monkeypatch):
    """With the real huggingface_hub client, the call gets as far as the HTTP request (offline here)."""
    head = EagleDraftModel.from_target(tiny_model("llama"), seed=0)
    head.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Exception) as err:
        push_head_folder(str(tmp_path), "someone/head", token="hf_fake")
    text = f"{type(err.value).__name__}: {err.value}".lower()
    assert any(word in text for word in ("offline", "connect", "name or service", "resolve", "network")), text
