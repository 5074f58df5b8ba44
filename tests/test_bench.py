"""`hf-eagle2 bench`: a real smoke run on SmolLM2 and the bookkeeping that turns runs into tables."""

import json
import os

import pytest

from hf_eagle2 import cli
from hf_eagle2.evaluation.bench import Run, summarize, update_readme
from hf_eagle2.evaluation.evaluate import BUILTIN_PROMPTS, load_prompts, parse_limit

SHIPPED_HEAD = os.path.join(os.path.dirname(__file__), "..", "model_cards", "smollm2-135m-instruct-eagle2")
SMOKE_METHODS = ["plain", "plain_stock", "prompt_lookup", "assisted_chain", "eagle1", "eagle2", "eagle2_no_ngram",
                 "eagle2_fixed", "eagle2_no_value", "eagle2_no_rerank", "eagle2_neither", "eagle2_full_vocab",
                 "eagle2_compiled_static"]  # fmt: skip


def test_bench_smoke_on_smollm2(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\n<!-- RESULTS -->\nold table\n<!-- /RESULTS -->\n\n## more\n")
    out = tmp_path / "results.json"
    argv = ["bench", "--dataset", "mtbench,humaneval", "--limit", "mtbench=2,humaneval=1", "--max-new-tokens", "16", "--draft", SHIPPED_HEAD,
            "--methods", ",".join(SMOKE_METHODS), "--out", str(out), "--readme", str(readme), "--threads",
            os.environ.get("HF_EAGLE2_TEST_THREADS", "2")]  # fmt: skip
    assert cli.main(argv) == 0
    results = json.loads(out.read_text())
    assert results["all_identical"] is True
    assert results["meta"]["methods"] == SMOKE_METHODS and results["meta"]["commit"] is not None
    for ds, runs in (("mtbench", 4), ("humaneval", 1)):  # MT-bench: 2 questions x 2 turns
        table = results["results"][ds]
        assert set(table) == set(SMOKE_METHODS)
        for m, r in table.items():
            assert r["runs"] == runs and r["mismatches"] == 0, (ds, m)
            assert r["new_tokens"] > 0 and r["tokens_per_second"] > 0 and r["speedup_median"] > 0
        assert table["plain"]["tau"] == 1.0  # one token per forward (the prefill's token is in no round)
        assert table["eagle2_fixed"]["tau"] > 1.2 and set(table["eagle2"]["round_ms"]) >= {"draft", "verify", "bookkeeping"}
        assert table["eagle2"]["speedup_vs_stock_median"] > 0 and table["plain"]["identical_share"] == 1.0
    assert os.path.exists(tmp_path / "results.md") and os.path.getsize(tmp_path / "results.png") > 1000
    text = readme.read_text()
    assert "old table" not in text and "| eagle2 |" in text and "hf-eagle2 bench" in text and text.endswith("## more\n")
    assert "paper (Vicuna-7B" in text  # the ablation table sits next to the paper's numbers


def test_summary_reports_a_mismatch_and_excludes_it_from_timing():
    runs = {
        "builtin/plain": [Run("plain", "p1", 2.0, 10, 10, True), Run("plain", "p2", 4.0, 10, 10, True)],
        "builtin/eagle2": [Run("eagle2", "p1", 1.0, 10, 4, True), Run("eagle2", "p2", 0.5, 10, 2, False)],
    }
    res = summarize(runs, ["builtin"], ["plain", "eagle2"], {"m": 8, "depth": 4, "k": 4}, 16)
    r = res["results"]["builtin"]["eagle2"]
    assert res["all_identical"] is False
    assert r["mismatches"] == 1 and r["failed_prompts"] == ["p2"]
    assert r["speedup_median"] == pytest.approx(2.0) and r["tau"] == pytest.approx(9 / 4)  # only p1 counts


def test_inexact_dtypes_time_every_run_and_report_divergence():
    """bf16: mismatches are expected (a q-token pass rounds differently), so all runs are timed and the identical
    share and mean first-divergence position are reported; all_identical still tells the truth."""
    runs = {
        "builtin/plain": [Run("plain", "p1", 2.0, 10, 10, True), Run("plain", "p2", 4.0, 10, 10, True)],
        "builtin/eagle2": [Run("eagle2", "p1", 1.0, 10, 4, True), Run("eagle2", "p2", 1.0, 10, 2, False, diverged_at=6)],
    }
    res = summarize(runs, ["builtin"], ["plain", "eagle2"], {"m": 8, "depth": 4, "k": 4}, 16, exact=False)
    r = res["results"]["builtin"]["eagle2"]
    assert res["all_identical"] is False and res["meta"]["exact"] is False
    assert r["identical_share"] == pytest.approx(0.5) and r["first_divergence_mean"] == pytest.approx(6)
    assert r["speedup_median"] == pytest.approx(3.0) and r["tau"] == pytest.approx(18 / 6)  # both runs count


def test_mark_divergence_finds_the_first_differing_token():
    import torch

    from hf_eagle2.evaluation.bench import mark_divergence

    run = Run("eagle2", "p", 1.0, 4, 2, True)
    mark_divergence(run, torch.tensor([[1, 2, 3, 4, 9, 9]]), torch.tensor([[1, 2, 3, 4, 5, 9]]), prompt_len=2)
    assert run.identical is False and run.diverged_at == 2
    mark_divergence(run, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 3]]), prompt_len=2)
    assert run.identical is True and run.diverged_at is None


def test_update_readme_needs_its_marker(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no marker here\n")
    with pytest.raises(ValueError, match="RESULTS"):
        update_readme(str(readme), "table")


def test_limit_per_dataset():
    assert parse_limit(None) is None and parse_limit("5") == 5
    assert parse_limit("mtbench=10,humaneval=20") == {"mtbench": 10, "humaneval": 20}
    with pytest.raises(ValueError, match="mtbench=10,humaneval=20"):
        parse_limit("mtbench=ten")
    with pytest.raises(ValueError, match="mtbnech"):  # a misspelt name would leave its dataset uncapped
        parse_limit("mtbnech=80", ["mtbench", "humaneval"])
    with pytest.raises(ValueError, match="twice"):
        parse_limit("mtbench=1,mtbench=2")
    caps = parse_limit("mtbench=3,humaneval=2", ["mtbench", "humaneval"])
    assert [len(load_prompts(ds, caps)) for ds in ("mtbench", "humaneval", "builtin")] == [3, 2, len(BUILTIN_PROMPTS)]

def test_bench_profile_reports_ops_and_host_reads_per_round(tmp_path, capsys):
    out = tmp_path / "results.json"
    argv = ["bench", "--dataset", "builtin", "--limit", "1", "--max-new-tokens", "8", "--draft", SHIPPED_HEAD,
            "--methods", "plain,eagle2_fixed", "--profile", "--out", str(out), "--threads",
            os.environ.get("HF_EAGLE2_TEST_THREADS", "2")]  # fmt: skip
    assert cli.main(argv) == 0
    profile = json.loads(out.read_text())["profile"]
    assert set(profile) == {"plain", "eagle2_fixed", "eagle2_accelerator", "eagle2_accelerator_compiled"}
    for name, counts in profile.items():
        assert counts["launches"] > 0 and counts["host_reads"] >= 0, name
    assert profile["plain"]["head_ops"] == 0 and profile["eagle2_accelerator"]["head_ops"] > 0
    assert profile["eagle2_accelerator"]["host_reads"] <= 1.0
    # compiled: each draft level (<= depth 6) one compiled call, the verify pass one more (the target then runs no
    # counted op in the rounds), the rest eager
    compiled = profile["eagle2_accelerator_compiled"]
    assert 2 <= compiled["compiled_calls"] <= 6 + 1 and compiled["target_ops"] == 0, compiled
    assert compiled["launches"] < profile["eagle2_accelerator"]["launches"]
    assert "ops per round" in capsys.readouterr().out


FAKE_VLLM_WORKER = '''
import json, sys
config = json.loads(sys.argv[2])
print(json.dumps({"ready": True, "vllm_version": "fake", "load_seconds": 0.0}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if request.get("cmd") == "stop":
        break
    n = request["max_new_tokens"]
    eagle3 = config["speculative_config"] is not None
    spec = {"drafts": 2, "draft_tokens": 6, "accepted": 2, "per_pos": [2, 0, 0]} if eagle3 else \\
        {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    print(json.dumps({"tokens": [7] * n, "seconds": 0.5 if eagle3 else 1.0, "spec": spec}), flush=True)
'''


def test_vllm_peers_join_the_rotation_and_never_fail_the_bench(tmp_path, monkeypatch):
    """vllm_* methods through the worker protocol (a fake worker that answers fixed ids): Run fields, the
    per-prompt rotation, the error without a serve venv, and a vLLM mismatch is reported but no failure."""
    import sys

    from hf_eagle2.evaluation import bench
    from hf_eagle2.evaluation.assets import load_model
    from hf_eagle2.evaluation.vllm_peer import VllmOptions, VllmPeer

    with pytest.raises(FileNotFoundError, match="make serve-check"):
        cli.main(["bench", "--methods", "plain,vllm_plain", "--serve-venv", str(tmp_path / "none"), "--out",
                  str(tmp_path / "r.json")])  # fmt: skip
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (venv / "python").chmod(0o755)
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_VLLM_WORKER)
    calls = []
    real_run_one, real_generate = bench.run_one, VllmPeer.generate
    monkeypatch.setattr(bench, "run_one", lambda model, ids, m, *a, **kw: calls.append(m) or real_run_one(model, ids, m, *a, **kw))
    monkeypatch.setattr(VllmPeer, "generate", lambda self, ids, n: calls.append(self.name) or real_generate(self, ids, n))
    procs = {}
    real_start = bench.start_peers

    def start_peers(*a, **kw):
        peers = real_start(*a, **kw)
        procs.update({m: peer.proc for m, peer in peers.items()})
        return peers

    monkeypatch.setattr(bench, "start_peers", start_peers)
    model, tokenizer = load_model("smollm2")
    options = VllmOptions(serve_venv=str(tmp_path / "venv"), target="unused", head_export=str(tmp_path / "head"),
                          worker=str(worker), log_dir=str(tmp_path / "logs"), start_timeout=30, request_timeout=30)  # fmt: skip
    methods = ["plain", "vllm_plain", "vllm_eagle3"]
    res = bench.run_bench(model, tokenizer, None, datasets=["builtin"], methods=methods, limit=3, max_new_tokens=5,
                          threads=2, progress=False, vllm=options)  # fmt: skip
    assert calls == methods + methods + methods[1:] + methods[:1] + methods[2:] + methods[:2]  # warm-up, 3 rotations
    table = res["results"]["builtin"]
    assert res["all_identical"] is True and res["meta"]["vllm"]["vllm_eagle3"]["config"]["speculative_config"] == {
        "method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    plain, vp, ve = table["plain"], table["vllm_plain"], table["vllm_eagle3"]
    assert plain["mismatches"] == 0 and vp["mismatches"] == 3 and vp["identical_share"] == 0.0  # fake ids differ
    assert vp["runs"] == 3 and vp["new_tokens"] == 15 and vp["target_forwards"] == 12 and vp["tau"] == 1.0
    assert vp["tokens_per_second"] == pytest.approx(5.0)  # timed although mismatching: 15 tokens in 3 x 1.0 s
    assert ve["target_forwards"] == 6 and ve["tau"] == pytest.approx(2.0)  # (5 - 1) / 2 drafts per prompt
    assert ve["vllm_mean_accepted_length"] == pytest.approx(2.0) and ve["vllm_acceptance_rate"] == pytest.approx(1 / 3)
    assert ve["speedup_vs_vllm_plain_median"] == pytest.approx(2.0)
    text = bench.markdown(res)
    assert "| vllm_eagle3 |" in text and "not a bench failure" in text and "mismatches**" not in text
    assert set(procs) == set(methods[1:]) and all(proc.poll() is not None for proc in procs.values())  # stopped
    assert all((tmp_path / "logs" / f"{m}.log").exists() for m in methods[1:])


def test_vllm_peer_is_bounded_in_time_and_killed(tmp_path):
    """A worker that never answers: the start times out and the worker's process group is gone."""
    import sys

    from hf_eagle2.evaluation.vllm_peer import VllmPeer

    worker = tmp_path / "silent_worker.py"
    worker.write_text("import time\ntime.sleep(60)\n")
    peer = VllmPeer("vllm_plain", sys.executable, {"target": "unused"}, str(tmp_path / "w.log"), start_timeout=1,
                    worker=str(worker))  # fmt: skip
    with pytest.raises(TimeoutError, match="within 1 s"):
        peer.start()
    assert peer.proc is None
    with pytest.raises(RuntimeError, match="not running"):
        peer.generate([1, 2], 4)


class _Tok:
    """Just enough tokenizer for run_bench on a tiny model: chat ids from the prompt's characters."""

    def apply_chat_template(self, messages, add_generation_prompt=True, return_tensors="pt", **kwargs):
        import torch

        text = " ".join(m["content"] for m in messages)
        return torch.tensor([[3 + (ord(c) % 29) for c in text[:24]]])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def test_bench_journal_resumes_where_it_stopped_and_assisted_uses_the_assistant(tmp_path, monkeypatch):
    """Each finished prompt is journaled; a second bench with the same settings measures only what is missing and
    reports the same runs; other settings, or another CPU, are refused. `assisted` / `assisted_<n>` run
    transformers' assisted decoding with the separate assistant model, exact in fp32."""
    from conftest import tiny_model

    from hf_eagle2 import EagleDraftModel
    from hf_eagle2.evaluation import bench

    model, assistant = tiny_model("llama", seed=3), tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = None
    draft = EagleDraftModel.from_target(model, seed=0)
    journal = tmp_path / "r.json.journal.jsonl"
    methods = ["plain", "assisted", "assisted_3", "eagle2"]
    kwargs = dict(datasets=["mtbench"], methods=methods, limit=2, max_new_tokens=12, threads=1, progress=False,
                  kernels="stock", assistant=assistant, settings={"model": "tiny"})  # fmt: skip
    measured = []
    real_run_one = bench.run_one
    monkeypatch.setattr(bench, "run_one", lambda model, ids, m, *a, **kw: measured.append(m) or real_run_one(model, ids, m, *a, **kw))
    first = bench.run_bench(model, _Tok(), draft, journal=str(journal), **kwargs)
    assert first["all_identical"] and first["results"]["mtbench"]["assisted_3"]["runs"] == 4  # 2 questions x 2 turns
    assert len(journal.read_text().splitlines()) == 1 + 4
    report = bench.journal_report(str(journal))  # read back without a model: the same figures
    assert report["meta"]["prompts"] == {"mtbench": 4} and report["meta"]["cpu"] == bench.cpu_name()
    for m in methods:
        a, b = first["results"]["mtbench"][m], report["results"]["mtbench"][m]
        keys = ("runs", "new_tokens", "tau", "speedup_median")
        assert [a[k] for k in keys] == [b[k] for k in keys], m
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:3]) + "\n")  # as if stopped after two prompts
    assert bench.journal_report(str(journal))["results"]["mtbench"]["eagle2"]["runs"] == 2
    measured.clear()
    again = bench.run_bench(model, _Tok(), draft, journal=str(journal), **kwargs)
    assert len(measured) == len(methods) * (1 + 2)  # warm-up, then only the two missing prompts
    for m in methods:
        a, b = first["results"]["mtbench"][m], again["results"]["mtbench"][m]
        assert (a["runs"], a["new_tokens"], a["mismatches"]) == (b["runs"], b["new_tokens"], b["mismatches"]), m
    with pytest.raises(ValueError, match="other settings \\(max_new_tokens\\)"):
        bench.run_bench(model, _Tok(), draft, journal=str(journal), **(kwargs | {"max_new_tokens": 8}))
    monkeypatch.setattr(bench, "cpu_name", lambda: "Another CPU (family 6, model 143)")
    with pytest.raises(ValueError, match="other settings \\(cpu\\)"):  # its figures would not compare
        bench.run_bench(model, _Tok(), draft, journal=str(journal), **kwargs)
    with pytest.raises(ValueError, match="give --assistant"):
        bench.run_bench(model, _Tok(), draft, **(kwargs | {"assistant": None}))


def test_assisted_n_sets_the_assistants_own_draft_length():
    """transformers reads an assistant's draft length from the assistant's generation_config, not from the target's
    generate kwargs: `assisted_<n>` sets it there for its run (n tokens a round, no confidence stop), restores it
    after, and stays exact. A twin assistant has every draft accepted, so n sets the target forwards."""
    import torch
    from conftest import tiny_model

    from hf_eagle2.evaluation import bench

    model, twin = tiny_model("llama", seed=3), tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = twin.generation_config.eos_token_id = None
    ids = torch.tensor([[5, 9, 13, 2, 7, 11]])
    before = twin.generation_config.to_dict()
    plain, _ = bench.run_one(model, ids, "plain", None, {}, 24, kernels="stock")
    forwards = {}
    for method in ("assisted_1", "assisted_5"):
        seq, run = bench.run_one(model, ids, method, None, {}, 24, kernels="stock", assistant=twin)
        assert torch.equal(seq, plain), method
        assert twin.generation_config.to_dict() == before, method
        forwards[method] = run.target_forwards
    assert forwards["assisted_1"] >= 11 and forwards["assisted_5"] <= 5, forwards
