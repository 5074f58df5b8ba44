"""Answers written elsewhere: a folder's first shard extracted here, the rest of its work list exported as prompts,
answered by `answer` (stopped by its time limit and resumed), joined after the first shard's archive and rebuilt
into the folder, gives the folder `extract` writes in one go: the same tokens, masks and shard boundaries (fp32
greedy), features to float rounding."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import tiny_model

from hf_eagle2.cli import main
from hf_eagle2.training import answers
from hf_eagle2.training.answers import answer_prompts, export_prompts, join_archives
from hf_eagle2.training.features import Sampling, extract_features, generate_with_features, open_shard, shard_paths
from hf_eagle2.training.tokens import export_tokens, read_tokens, rebuild_features

WORK = dict(turns="all", max_prompt_tokens=300, min_prompt_tokens=40, max_new_tokens=8, batch_size=2)


def _archive_rows(path):
    archive = read_tokens(path)
    return [archive.shard(i) for i in range(len(archive.shard_sequences))]


def _with_meta(path, out, input_ids=None, **changes):
    """A copy of the archive at `path` whose meta has `changes` (and whose ids are `input_ids(ids)`, if given)."""
    with np.load(path) as archive:
        arrays = {k: v for k, v in archive.items() if k != "meta"}
    if input_ids is not None:
        arrays["input_ids"] = input_ids(arrays["input_ids"]).astype(arrays["input_ids"].dtype)
    np.savez_compressed(out, **arrays, meta=np.array(json.dumps(read_tokens(path).meta | changes)))


def test_answers_from_elsewhere_rebuild_the_extracted_folder(smollm2, tmp_path, monkeypatch):
    model, tokenizer = smollm2
    whole = str(tmp_path / "whole")
    # a token budget ends the folder at a shard boundary of the whole work list (max_conversations would cut the
    # list itself, and with it the length-sorted windows that make the batches)
    meta = extract_features(model, tokenizer, whole, responses="target", max_tokens=1000, eagle3=True, progress=False,
                            **WORK)  # fmt: skip
    shards = meta["shards"]
    assert shards >= 4
    # the same work list: its first shard extracted here, the rest exported as prompts
    part = str(tmp_path / "part")
    extract_features(model, tokenizer, part, responses="target", max_tokens=1, eagle3=True, progress=False, **WORK)
    assert len(shard_paths([part])) == 1
    first = str(tmp_path / "first.npz")
    export_tokens(part, first)
    prompts = str(tmp_path / "prompts.npz")
    main(["export-prompts", "--out", prompts, "--shards", f"1-{shards - 1}", "--eagle3", "--turns", "all",
          "--max-prompt-tokens", "300", "--min-prompt-tokens", "40", "--max-new-tokens", "8", "--batch-size", "2"])
    asked = read_tokens(prompts)
    assert asked.meta["prompts_only"] and asked.meta["first_shard"] == 1 and len(asked.shard_sequences) == shards - 1
    assert not asked.loss_mask.any()
    export_tokens(whole, str(tmp_path / "whole.npz"))
    whole_rows = _archive_rows(str(tmp_path / "whole.npz"))
    for got, want in zip(_archive_rows(prompts), whole_rows[1:], strict=True):  # each prompt is its answer's prefix
        assert [(sid, ids) for sid, ids, _ in got] == [(sid, ids[: len(mask) - sum(mask)]) for sid, ids, mask in want]
    # answered in groups of ~4 rows (two shards, crossed by calls of 3 rows), stopped by the time limit after one
    # group on a clock that ticks 10 s per reading (at 40 s of 45 the next group, estimated at the last one's 10 s,
    # would end past the limit), then resumed
    ticks = iter(range(0, 10**6, 10))
    monkeypatch.setattr(answers, "monotonic", lambda: next(ticks))
    answered = str(tmp_path / "answered.npz")
    summary = answer_prompts(model, tokenizer, prompts, answered, rows_per_call=3, rows_per_write=4, time_limit=45,
                             progress=False)  # fmt: skip
    assert 1 <= summary["shards"] < shards - 1
    monkeypatch.undo()
    summary = answer_prompts(model, tokenizer, prompts, answered, rows_per_call=3, rows_per_write=4, progress=False)
    assert summary["shards"] == shards - 1 and summary["answered_on"].startswith("cpu: ")
    assert _archive_rows(answered) == whole_rows[1:]  # fp32 greedy: the answers extract wrote, token for token
    # joined after the first shard's archive: the whole folder's archive, with where each part was answered
    joined = str(tmp_path / "joined.npz")
    main(["join-tokens", "--tokens", first, answered, "--out", joined])
    assert _archive_rows(joined) == whole_rows
    sources = read_tokens(joined).meta["answer_sources"]
    assert [s["shards"] for s in sources] == [[0, 0], [1, shards - 1]] and sources[1]["answered_on"].startswith("cpu")
    # rebuilt into the folder that holds shard 0: the folder extract wrote in one go
    rebuild_features(model, joined, part, shards=range(1, shards), progress=False)
    for a, b in zip(shard_paths([whole]), shard_paths([part]), strict=True):
        ta, tb = open_shard(a), open_shard(b)
        for name in ta:
            if name in ("features", "aux_features"):
                torch.testing.assert_close(ta[name].float(), tb[name].float(), rtol=2e-3, atol=2e-3, msg=name)
            else:
                assert torch.equal(ta[name], tb[name]), name
    with open(os.path.join(part, "meta.json")) as f:
        assert json.load(f)["shards"] == shards
    # extract extends the folder and adds its own shards to the record of who answered what
    grown = extract_features(model, tokenizer, part, responses="target", max_tokens=meta["tokens"] + 1, eagle3=True,
                             progress=False, **WORK)  # fmt: skip
    assert grown["shards"] == shards + 1 and grown["answer_sources"][:2] == sources
    assert grown["answer_sources"][2]["shards"] == [shards, shards]
    assert grown["answer_sources"][2]["answered_on"].startswith("extract, cpu: ")
    # what cannot be done is refused, by name
    with pytest.raises(ValueError, match=f"starts at shard 0; the archives before it end at shard {shards - 1}"):
        join_archives([answered, first], str(tmp_path / "x.npz"))
    with pytest.raises(ValueError, match="holds prompts only"):
        join_archives([first, prompts], str(tmp_path / "x.npz"))
    with pytest.raises(ValueError, match="holds prompts only"):
        rebuild_features(model, prompts, str(tmp_path / "x"), progress=False)
    with pytest.raises(ValueError, match="starts at work-list shard 1: join it after"):
        rebuild_features(model, answered, str(tmp_path / "x"), progress=False)
    with pytest.raises(ValueError, match="not a prompt archive"):
        answer_prompts(model, tokenizer, answered, str(tmp_path / "y.npz"), progress=False)
    bf16_prompts = str(tmp_path / "bf16.npz")
    _with_meta(prompts, bf16_prompts, dtype="bfloat16")
    with pytest.raises(ValueError, match="exported for answers in bfloat16; this target runs in float32"):
        answer_prompts(model, tokenizer, bf16_prompts, str(tmp_path / "y.npz"), progress=False)
    other = str(tmp_path / "other.npz")
    export_prompts(model, tokenizer, other, range(0, 2), **WORK)  # other prompts: not continued into `answered`
    with pytest.raises(ValueError, match="holds answers to other prompts, settings or from another machine .*first_shard: 1 -> 0"):
        answer_prompts(model, tokenizer, other, answered, progress=False)
    _with_meta(answered, str(tmp_path / "b4.npz"), batch_size=4)
    _with_meta(answered, str(tmp_path / "elsewhere.npz"), answered_on="cuda: another machine")
    with pytest.raises(ValueError, match="from another machine .*answered_on: 'cuda: another machine' -> 'cpu"):
        answer_prompts(model, tokenizer, prompts, str(tmp_path / "elsewhere.npz"), progress=False)
    changed_prompt = str(tmp_path / "changed.npz")
    _with_meta(prompts, changed_prompt, input_ids=lambda ids: np.where(np.arange(ids.size) == 5, ids + 1, ids))
    with pytest.raises(ValueError, match="shard 1 answers other prompts than 0 of the prompt archive"):
        answer_prompts(model, tokenizer, changed_prompt, answered, progress=False)
    _with_meta(first, str(tmp_path / "again.npz"), first_shard=1)  # the same sequences numbered as the next shard
    with pytest.raises(ValueError, match="holds sequences an archive before it holds too"):
        join_archives([first, str(tmp_path / "again.npz")], str(tmp_path / "x.npz"))
    gap = tmp_path / "gap"
    gap.mkdir()
    for name in ("meta.json", "shard_00000.safetensors", "shard_00002.safetensors"):
        shutil.copy(os.path.join(whole, name), gap / name)
    with pytest.raises(ValueError, match=r"lacks 1 shard\(s\) before its last \(shard_00001.safetensors first\)"):
        export_tokens(str(gap), str(tmp_path / "x.npz"))
    with pytest.raises(ValueError, match="batch_size: 2 -> 4"):
        join_archives([first, str(tmp_path / "b4.npz")], str(tmp_path / "x.npz"))
    with pytest.raises(ValueError, match="shards 3-2: not a range of work-list batches"):
        export_prompts(model, tokenizer, other, range(3, 3), **WORK)


def test_sampled_tokens_follow_the_tempered_distribution():
    """Sampled answers are drawn from softmax(logits / T) over the whole vocabulary: neither generate's defaults
    (top_k 50) nor the model's generation_config (here top-p, min-p and a repetition penalty) shape it. Measured as
    the total variation between 12,000 first answer tokens and each candidate distribution; sampling noise alone
    is ~0.03 here."""
    model = tiny_model("llama", vocab=128)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # logits spread enough that T matters, flat enough that 13% lies past the top 50
    model.generation_config.update(top_p=0.5, min_p=0.3, repetition_penalty=3.0)
    prompt, n, temperature = [1, 5, 9, 13], 12_000, 0.7
    logits = model(torch.tensor([prompt])).logits[0, -1].double().detach()
    rows = generate_with_features(model, [prompt] * n, 1, [2], 0, sampling=Sampling(temperature, 0))
    drawn = torch.bincount(torch.tensor([int(ids[len(prompt)]) for ids, _, _, _ in rows]), minlength=128).double() / n
    want = torch.softmax(logits / temperature, -1)
    top50 = torch.zeros_like(want).scatter(0, want.topk(50).indices, want.topk(50).values)
    distance = {name: float(0.5 * (drawn - p / p.sum()).abs().sum())
                for name, p in {"want": want, "T=1": torch.softmax(logits, -1),
                                "T=0.5": torch.softmax(logits / 0.5, -1), "top-50": top50}.items()}  # fmt: skip
    assert distance["want"] < 0.06, distance
    assert min(distance["T=1"], distance["T=0.5"], distance["top-50"]) > 0.1, distance


def test_sampled_answers_are_seeded_recorded_and_kept_apart(smollm2, tmp_path, monkeypatch):
    """`answer --temperature`: the same seed draws the same answers (a run stopped by its time limit and resumed
    included), another seed others; the archive records the sampling, so it neither resumes nor joins with answers
    drawn otherwise, and `extract` refuses to extend a folder rebuilt from it with greedy answers."""
    model, tokenizer = smollm2
    prompts = str(tmp_path / "prompts.npz")
    export_prompts(model, tokenizer, prompts, range(0, 3), **WORK)
    # groups of two shards (4 rows), one row per call: seeds vary by group and by call
    answer = lambda out, sampling, **kw: answer_prompts(model, tokenizer, prompts, str(tmp_path / out),  # noqa: E731
                                                        rows_per_call=1, rows_per_write=4, sampling=sampling,
                                                        progress=False, **kw)  # fmt: skip
    drawn = Sampling(0.8, 1)
    assert len({drawn.for_call(shard, call).seed for shard in range(3) for call in range(4)}) == 12
    summary = answer("a.npz", drawn)
    recorded = read_tokens(str(tmp_path / "a.npz")).meta["sampling"]
    assert summary["sampling"] == {"temperature": 0.8, "seed": 1, "rows_per_write": 4, "rows_per_call": 1} == recorded
    ticks = iter(range(0, 10**6, 10))  # stopped after one group, then resumed (as in the test above)
    monkeypatch.setattr(answers, "monotonic", lambda: next(ticks))
    assert answer("b.npz", drawn, time_limit=45)["shards"] < 3
    monkeypatch.undo()
    answer("b.npz", drawn)
    answer("c.npz", Sampling(0.8, 2))
    answer("greedy.npz", None)
    rows = {name: _archive_rows(str(tmp_path / f"{name}.npz")) for name in ("a", "b", "c", "greedy")}
    assert rows["a"] == rows["b"]
    assert rows["a"] != rows["c"] and rows["a"] != rows["greedy"]  # 6 answers of 8 tokens at T=0.8
    for shard_a, shard_greedy in zip(rows["a"], rows["greedy"], strict=True):  # the same prompts, answers masked in
        for (sid, ids, mask), (sid_g, ids_g, mask_g) in zip(shard_a, shard_greedy, strict=True):
            prompt = len(mask_g) - sum(mask_g)
            assert sid == sid_g and ids[:prompt] == ids_g[:prompt]
            assert mask == [False] * prompt + [True] * (len(ids) - prompt)
    assert read_tokens(str(tmp_path / "greedy.npz")).meta["sampling"] is None
    with pytest.raises(ValueError, match="'seed': 1, .* -> {'temperature': 0.8, 'seed': 3"):
        answer("a.npz", Sampling(0.8, 3))
    with pytest.raises(ValueError, match="'rows_per_call': 1} -> {.*'rows_per_call': 2}"):  # other calls, other draws
        answer_prompts(model, tokenizer, prompts, str(tmp_path / "a.npz"), rows_per_call=2, rows_per_write=4,
                       sampling=drawn, progress=False)  # fmt: skip
    first = str(tmp_path / "first.npz")  # greedy shard 0, then sampled shards 1-2: not one folder's answers
    export_prompts(model, tokenizer, first, range(0, 1), **WORK)
    answer_prompts(model, tokenizer, first, str(tmp_path / "first-greedy.npz"), progress=False)
    rest = str(tmp_path / "rest.npz")
    export_prompts(model, tokenizer, rest, range(1, 3), **WORK)
    answer_prompts(model, tokenizer, rest, str(tmp_path / "rest-drawn.npz"), sampling=drawn, progress=False)
    with pytest.raises(ValueError, match="other settings .*sampling: None -> {'temperature': 0.8, 'seed': 1, "):
        join_archives([str(tmp_path / "first-greedy.npz"), str(tmp_path / "rest-drawn.npz")], str(tmp_path / "x.npz"))
    folder = str(tmp_path / "drawn")
    rebuild_features(model, str(tmp_path / "a.npz"), folder, progress=False)
    with pytest.raises(ValueError, match=r"other settings \(sampling: \{'temperature': 0.8, 'seed': 1, .*\} -> None\)"):
        extract_features(model, tokenizer, folder, responses="target", max_tokens=10**6, eagle3=False, progress=False,
                         **WORK)  # fmt: skip
    greedy_folder = str(tmp_path / "greedy")  # a folder from before the setting (no `sampling` in its meta) is greedy
    rebuild_features(model, str(tmp_path / "greedy.npz"), greedy_folder, shards=range(0, 1), progress=False)
    with open(os.path.join(greedy_folder, "meta.json")) as f:
        old_meta = {k: v for k, v in json.load(f).items() if k != "sampling"}
    with open(os.path.join(greedy_folder, "meta.json"), "w") as f:
        json.dump(old_meta, f)
    with pytest.raises(ValueError, match=r"other settings \(sampling: None -> \{'temperature': 0.8"):
        rebuild_features(model, str(tmp_path / "a.npz"), greedy_folder, shards=range(1, 2), progress=False)
    with pytest.raises(ValueError, match="a sampling temperature must be > 0"):
        Sampling(0.0, 0)
    with pytest.raises(ValueError, match="--seed draws sampled answers: give --temperature too"):
        main(["answer", "--tokens", prompts, "--out", str(tmp_path / "x.npz"), "--seed", "3"])
