"""Token archives: a self-distilled feature folder exported without its features and rebuilt from the archive
gives the same shards (features to float rounding: extraction records them during generation, the rebuild in one
forward), and `extract` then extends the rebuilt folder as its own."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import tiny_model

from hf_eagle2.cli import main
from hf_eagle2.training.features import extract_features, open_shard, shard_index, shard_name, shard_paths
from hf_eagle2.training.tokens import cut_folder, export_tokens, read_tokens, rebuild_features, write_archive
from hf_eagle2.training.train import FeatureSet


def test_rebuilt_folder_is_the_extracted_one_and_extends(smollm2, tmp_path):
    model, tokenizer = smollm2
    kw = dict(responses="target", turns="first", eagle3=True, max_new_tokens=8, max_prompt_tokens=300, batch_size=2,
              progress=False)  # fmt: skip
    original = str(tmp_path / "original")
    meta = extract_features(model, tokenizer, original, max_conversations=4, **kw)
    assert meta["shards"] >= 2  # more than one shard: the archive keeps the shard boundaries
    archive = str(tmp_path / "tokens.npz")
    summary = export_tokens(original, archive)
    assert summary["tokens"] == meta["tokens"] and summary["shards"] == meta["shards"]
    assert summary["bytes"] < 2 * meta["tokens"] + 4096  # uint16 ids, packed masks: no features
    tokens = read_tokens(archive)
    saved_meta = tokens.meta
    assert saved_meta == json.load(open(os.path.join(original, "meta.json")))
    first = open_shard(shard_paths([original])[0])
    assert [t for _, ids, _ in tokens.shard(0) for t in ids] == first["input_ids"].tolist()
    assert [m for _, _, mask in tokens.shard(0) for m in mask] == first["loss_mask"].bool().tolist()
    assert sum(tokens.shard_tokens(i) for i in range(meta["shards"])) == tokens.tokens == meta["tokens"]
    with pytest.raises(ValueError, match="another target's tokens"):
        rebuild_features(tiny_model("llama"), archive, str(tmp_path / "wrong"), progress=False)
    rebuilt = str(tmp_path / "rebuilt")
    main(["rebuild-features", "--tokens", archive, "--out", rebuilt, "--shards", "1-"])  # the CLI path (fp32: the
    main(["rebuild-features", "--tokens", archive, "--out", rebuilt, "--shards", "0"])  # archive's), in two ranges
    for a, b in zip(shard_paths([original]), shard_paths([rebuilt]), strict=True):
        ta, tb = open_shard(a), open_shard(b)
        assert ta.keys() == tb.keys() and "aux_features" in ta
        for name in ta:  # the same tokens; features from generate's forwards, rebuilt by one forward: rounding apart
            if name in ("features", "aux_features"):
                torch.testing.assert_close(ta[name].float(), tb[name].float(), rtol=2e-3, atol=2e-3, msg=name)
            else:
                assert torch.equal(ta[name], tb[name]), name
    with open(os.path.join(rebuilt, "meta.json")) as f:
        rebuilt_meta = json.load(f)
    assert {k: v for k, v in rebuilt_meta.items() if k != "sequences_reached"} == \
        {k: v for k, v in meta.items() if k != "sequences_reached"}  # fmt: skip
    # extract resumes the rebuilt folder as its own: the next batches of the same work list, not the first again
    grown = extract_features(model, tokenizer, rebuilt, max_conversations=6, **kw)
    also = extract_features(model, tokenizer, original, max_conversations=6, **kw)
    assert grown["shards"] == also["shards"] > meta["shards"] and grown["tokens"] == also["tokens"]
    last_a, last_b = open_shard(shard_paths([original])[-1]), open_shard(shard_paths([rebuilt])[-1])
    assert torch.equal(last_a["input_ids"], last_b["input_ids"])
    cut = str(tmp_path / "cut")  # a folder cut for training is not extended: new shards would keep whole prompts
    shutil.copytree(rebuilt, cut)
    with pytest.raises(ValueError, match="does not hold shard_0000"):  # extract grew it past the archive
        cut_folder(cut, 4, archive, progress=False)
    export_tokens(cut, str(tmp_path / "grown.npz"))
    cut_folder(cut, 4, str(tmp_path / "grown.npz"), progress=False)
    with pytest.raises(ValueError, match="keeps only 4 prompt positions before each answer"):
        extract_features(model, tokenizer, cut, max_conversations=6, **kw)
    # features in another dtype than the answers' (fp32 where a CPU emulates bf16; here a bf16 stand-in target of
    # SmolLM2's vocabulary, for speed): recorded, and a folder for training only
    other_dtype = str(tmp_path / "other-dtype")
    stand_in = tiny_model("llama", vocab=model.config.vocab_size, dtype=torch.bfloat16)
    other_meta = rebuild_features(stand_in, archive, other_dtype, progress=False)
    assert other_meta["dtype"] == "float32" and other_meta["feature_dtype"] == "bfloat16"
    assert [open_shard(p)["input_ids"].tolist() for p in shard_paths([other_dtype])] == \
        [open_shard(p)["input_ids"].tolist() for p in shard_paths([original])[: meta["shards"]]]  # fmt: skip
    assert open_shard(shard_paths([other_dtype])[0])["features"].shape[-1] == stand_in.config.hidden_size
    for target in (model, stand_in):  # new answers in either dtype would make the folder's dtypes disagree
        with pytest.raises(ValueError, match="answers written in float32 and features rebuilt in bfloat16"):
            extract_features(target, tokenizer, other_dtype, max_conversations=6, **kw)
    with pytest.raises(ValueError, match="feature_dtype: 'bfloat16' -> 'float32'"):  # nor resumed in another dtype
        rebuild_features(tiny_model("llama", vocab=model.config.vocab_size), archive, other_dtype, progress=False)
    # a range of shards (the answers a head has not seen yet), then another range into the same folder
    part = str(tmp_path / "part")
    last = meta["shards"] - 1
    part_meta = rebuild_features(stand_in, archive, part, shards=range(last, last + 1), progress=False)
    assert [os.path.basename(p) for p in shard_paths([part])] == [f"shard_{last:05d}.safetensors"]
    assert (part_meta["shards"], part_meta["tokens"]) == (1, tokens.shard_tokens(last))
    assert torch.equal(open_shard(shard_paths([part])[0])["features"], open_shard(shard_paths([other_dtype])[last])["features"])
    part_meta = rebuild_features(stand_in, archive, part, shards=range(0, 1), progress=False)
    assert (part_meta["shards"], part_meta["tokens"]) == (2, tokens.shard_tokens(0) + tokens.shard_tokens(last))
    with pytest.raises(ValueError, match=f"the archive holds shards 0-{last}"):
        rebuild_features(stand_in, archive, part, shards=range(last, last + 2), progress=False)
    # a folder of other settings is not mixed into
    np.savez_compressed(str(tmp_path / "other.npz"), **{k: v for k, v in np.load(archive).items() if k != "meta"},
                        meta=np.array(json.dumps(saved_meta | {"batch_size": 4})))  # fmt: skip
    with pytest.raises(ValueError, match="batch_size: 2 -> 4"):
        rebuild_features(model, str(tmp_path / "other.npz"), rebuilt, progress=False)


def test_export_needs_an_extracted_folder(tmp_path):
    with pytest.raises(ValueError, match="no extracted shards"):
        export_tokens(str(tmp_path), str(tmp_path / "x.npz"))


def test_shard_names_round_trip_and_order_by_index(tmp_path):
    for index in (0, 42, 99_999, 100_000):
        assert shard_index(os.path.join("some", "folder", shard_name(index))) == index
    for other in ("meta.json", "shard_00001.safetensors.tmp", "shard_0001.safetensors", "shard_x0001.safetensors",
                  "shard_000042.safetensors"):  # 42 is shard_00042: one index, one name
        with pytest.raises(ValueError, match="is not a feature shard's name"):
            shard_index(other)
    for name in [shard_name(i) for i in (100_000, 3, 99_999)] + ["meta.json", "shard_00004.safetensors.tmp",
                                                                  "shard_000005.safetensors"]:  # fmt: skip
        (tmp_path / name).touch()
    # past 99,999 the names grow a digit: string order would put shard 100,000 before 3
    assert [shard_index(p) for p in shard_paths([str(tmp_path)])] == [3, 99_999, 100_000]


def test_shard_ranges_parse_or_are_refused(capsys):
    from hf_eagle2.cli import build_parser

    parse = lambda text: build_parser().parse_args(["rebuild-features", "--tokens", "x.npz", "--out", "y", "--shards", text]).shards  # noqa: E731
    assert (parse("117-173"), parse("117-"), parse("5")) == ((117, 173), (117, None), (5, 5))
    with pytest.raises(SystemExit):
        parse("a-3")
    assert "'a-3': shards are 'A-B' (inclusive), 'A-' (to the last) or 'A'" in capsys.readouterr().err


def test_cut_prompts_store_what_training_reads(tmp_path):
    """A folder rebuilt with max_prompt_context N (or cut to it in place) stores less, and a training set loaded
    from it with a cut of N or less is the whole folder's set, features bit for bit; more context is refused."""
    model = tiny_model("llama")
    rng = np.random.default_rng(0)
    shards = [[(f"s{s}-{j}", rng.integers(3, 32, int(p) + int(n)), [False] * int(p) + [True] * int(n))
               for j, (p, n) in enumerate(zip(rng.integers(1, 12, 3), rng.integers(1, 6, 3)))] for s in range(3)]
    archive = str(tmp_path / "tokens.npz")
    write_archive(archive, {"dtype": "float32", "batch_size": 3}, shards)
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    whole_meta = rebuild_features(model, archive, whole, eagle3=True, progress=False)
    rebuild_features(model, archive, cut, eagle3=True, shards=range(1, 3), max_prompt_context=5, progress=False)
    cut_meta = rebuild_features(model, archive, cut, eagle3=True, shards=range(0, 1), max_prompt_context=5,
                                progress=False)  # fmt: skip
    prompts = [len(mask) - sum(mask) for shard in shards for _, _, mask in shard]
    assert max(prompts) > 5  # something to cut
    assert cut_meta["tokens"] == whole_meta["tokens"] - sum(max(0, p - 5) for p in prompts)
    assert cut_meta == whole_meta | {"max_prompt_context": 5, "tokens": cut_meta["tokens"]}
    for n in (5, 3):
        a, b = (FeatureSet.load([folder], 1024, aux=True, max_prompt_context=n) for folder in (whole, cut))
        assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and torch.equal(a.offsets, b.offsets)
        for i, length in enumerate(a.lengths().tolist()):
            for source_a, source_b in ((a.features, b.features), (a.aux, b.aux)):
                assert torch.equal(a._rows(source_a, i, length), b._rows(source_b, i, length))
    for n in (None, 6):  # the cut folder lacks the context these ask for
        with pytest.raises(ValueError, match="keeps only 5 prompt positions before each answer"):
            FeatureSet.load([cut], 1024, aux=True, max_prompt_context=n)
    # cutting a whole folder in place gives the folder the cut rebuild wrote
    part = str(tmp_path / "part.npz")  # an archive without the folder's last shard: its prompts would be lost
    write_archive(part, {"dtype": "float32", "batch_size": 3}, shards[:2])
    with pytest.raises(ValueError, match="does not hold shard_00002.safetensors's sequences"):
        cut_folder(whole, 5, part, progress=False)
    main(["cut-features", "--folder", whole, "--max-prompt-context", "5", "--tokens", archive])
    for a, b in zip(shard_paths([whole]), shard_paths([cut]), strict=True):
        ta, tb = open_shard(a), open_shard(b)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert json.load(open(os.path.join(whole, "meta.json"))) == cut_meta
    assert cut_folder(whole, 5, archive, progress=False) == cut_meta  # again: nothing left to cut
    with pytest.raises(ValueError, match="a cut cannot grow back to 6"):
        cut_folder(whole, 6, archive, progress=False)
    with pytest.raises(ValueError, match="an archive of the cut rows would rebuild other features"):
        export_tokens(cut, str(tmp_path / "x.npz"))
    with pytest.raises(ValueError, match="keeps 5 prompt positions before each answer, this rebuild would keep "
                                         "whole prompts"):  # fmt: skip
        rebuild_features(model, archive, cut, eagle3=True, progress=False)
    fresh = str(tmp_path / "fresh")
    rebuild_features(model, archive, fresh, eagle3=True, shards=range(0, 1), progress=False)
    with pytest.raises(ValueError, match="keeps whole prompts, this rebuild would keep 5 prompt positions"):
        rebuild_features(model, archive, fresh, eagle3=True, max_prompt_context=5, progress=False)
