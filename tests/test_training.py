"""Training pipeline on real data: the truncated ShareGPT reader, features of real conversations, the loss going
down, and exact resume after an interruption."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import emulate_bf16

from hf_eagle2.kernels.cpu import fast_path_available, is_optimized, optimize_for_cpu
from hf_eagle2.evaluation.evaluate import SHAREGPT_PROMPT_CHARS, eval_head, load_prompts
from hf_eagle2.training.data import conversation_base, is_heldout, iter_json_array, iter_sharegpt, render_with_loss_mask, sharegpt_path
from hf_eagle2.training.features import extract_features, forward_features, iter_shards
from hf_eagle2 import EagleDraftModel
from hf_eagle2.training.train import (FeatureSet, TrainConfig, Trainer, eagle_loss, init_lineage, select_draft_vocab,
                                     total_tokens_seen)


def test_truncated_json_reader_returns_complete_objects_only(tmp_path):
    items = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]} for i in range(5)]
    text = json.dumps(items, indent=1)
    cut = text[: text.index('"3"') + 10]  # truncated inside the 4th object
    path = tmp_path / "trunc.json"
    path.write_text(cut)
    assert [o["id"] for o in iter_json_array(str(path))] == ["0", "1", "2"]
    path.write_text(text)
    assert [o["id"] for o in iter_json_array(str(path))] == ["0", "1", "2", "3", "4"]


def test_sharegpt_package_has_17671_complete_conversations():
    assert os.path.getsize(sharegpt_path()) > 100e6
    count = sum(1 for _ in iter_json_array(sharegpt_path()))
    assert count == 17671
    train = sum(1 for _ in iter_sharegpt(split="train"))
    val = sum(1 for _ in iter_sharegpt(split="validation"))
    assert 0.01 * (train + val) < val < 0.03 * (train + val)  # the fixed ~2% held-out split
    assert is_heldout(next(iter_sharegpt(split="validation")).id) and not is_heldout(next(iter_sharegpt()).id)


def test_loss_mask_covers_assistant_turns_only(smollm2):
    _, tokenizer = smollm2
    conv = next(iter_sharegpt())
    ids, mask = render_with_loss_mask(tokenizer, conv.messages[:2])
    assistant = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert assistant.strip().startswith(conv.messages[1]["content"].strip()[:40])
    assert "<|im_start|>" not in assistant and "<|im_end|>" in assistant
    user = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert conv.messages[0]["content"][:40] in user


@pytest.fixture(scope="module")
def real_features(smollm2, tmp_path_factory):
    model, tokenizer = smollm2
    out = str(tmp_path_factory.mktemp("features"))
    meta = extract_features(model, tokenizer, out, responses="sharegpt", max_conversations=12, max_seq_tokens=256,
                            batch_size=4, progress=False)  # fmt: skip
    assert meta["tokens"] > 1000
    return out


def test_features_are_the_targets_final_hidden_states(smollm2, real_features):
    model, _ = smollm2
    seq = next(iter_shards([real_features]))
    with torch.no_grad():
        ref = model.get_decoder()(input_ids=seq.input_ids[None]).last_hidden_state[0]
    torch.testing.assert_close(seq.features.float(), ref, atol=2e-2, rtol=2e-3)  # fp16 storage


def test_extraction_resumes_without_redoing_shards(smollm2, real_features):
    model, tokenizer = smollm2
    before = {f: os.path.getmtime(os.path.join(real_features, f)) for f in os.listdir(real_features) if f.startswith("shard_")}
    extract_features(model, tokenizer, real_features, responses="sharegpt", max_conversations=12, max_seq_tokens=256,
                     batch_size=4, progress=False)  # fmt: skip
    after = {f: os.path.getmtime(os.path.join(real_features, f)) for f in before}
    assert before == after


def test_extraction_refuses_to_resume_with_other_settings_and_keeps_its_meta_current(smollm2, tmp_path, monkeypatch):
    """Shard i holds batch i of the work list, so another batch size (or responses, dtype, ...) would silently
    mix two extractions; meta.json is rewritten after every shard, so an interrupted run leaves its true size."""
    import hf_eagle2.training.features as features

    model, tokenizer = smollm2
    kw = dict(responses="sharegpt", max_conversations=6, max_seq_tokens=128, progress=False)
    real_write, written = features.write_shard, []

    def write_then_stop(*args, **kwargs):  # the second shard "crashes"
        if written:
            raise KeyboardInterrupt
        written.append(real_write(*args, **kwargs))
        return written[-1]

    monkeypatch.setattr(features, "write_shard", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        extract_features(model, tokenizer, str(tmp_path), batch_size=2, **kw)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["tokens"] == written[0] and meta["shards"] == 1 and meta["batch_size"] == 2
    monkeypatch.setattr(features, "write_shard", real_write)
    with pytest.raises(ValueError, match="batch_size: 2 -> 3"):
        extract_features(model, tokenizer, str(tmp_path), batch_size=3, **kw)
    meta = extract_features(model, tokenizer, str(tmp_path), batch_size=2, **kw)  # the same settings resume
    assert meta["shards"] == 3 and meta["tokens"] == sum(s.input_ids.numel() for s in iter_shards([str(tmp_path)]))


def test_extraction_renders_only_the_windows_it_needs(smollm2, tmp_path):
    """Items are built window by window (batch_size * 8 sequences, sorted by length), so a small budget renders
    one window, not the dataset, and writes the shortest sequence of that window first."""
    model, tokenizer = smollm2
    meta = extract_features(model, tokenizer, str(tmp_path), responses="sharegpt", max_conversations=12,
                            max_seq_tokens=256, batch_size=1, max_tokens=1, progress=False)  # fmt: skip
    assert meta["shards"] == 1 and meta["sequences_reached"] == 8
    lengths = []
    for conv in iter_sharegpt(split="train"):
        ids, mask = render_with_loss_mask(tokenizer, conv.messages, max_tokens=256)
        lengths += [len(ids)] if sum(mask) else []
        if len(lengths) == 8:
            break
    assert next(iter_shards([str(tmp_path)])).input_ids.numel() == min(lengths)


def test_self_distilled_features(smollm2, tmp_path):
    model, tokenizer = smollm2
    meta = extract_features(model, tokenizer, str(tmp_path), responses="target", max_conversations=2,
                            max_new_tokens=12, batch_size=2, progress=False)  # fmt: skip
    seqs = list(iter_shards([str(tmp_path)]))
    assert len(seqs) == 2 and meta["tokens"] == sum(s.input_ids.numel() for s in seqs)
    for s in seqs:  # the response is the target's own greedy continuation
        start = int((~s.loss_mask).sum())
        prompt = s.input_ids[:start][None]
        ref = model.generate(prompt, do_sample=False, max_new_tokens=12)
        assert torch.equal(ref[0, start:], s.input_ids[start:])
    # the features generate recorded are those of one forward over each stored sequence, token for token (an
    # off-by-one between decode steps and answer tokens would move every answer feature to its neighbour's)
    feats, _ = forward_features(model, [s.input_ids.tolist() for s in seqs], 0)
    for s, ref in zip(seqs, feats, strict=True):
        torch.testing.assert_close(s.features.float(), ref.half().float(), rtol=2e-3, atol=2e-3)


def test_min_prompt_tokens_answers_the_turns_a_smaller_max_left_out(smollm2, tmp_path):
    """Split at a prompt length, two folders hold between them every answer one folder up to the larger bound
    holds, none twice; a folder from before the setting resumes as one without a lower bound, not with one."""
    from hf_eagle2.training.features import turn_prompts
    from hf_eagle2.training.tokens import export_tokens, read_tokens

    model, tokenizer = smollm2
    ids = [i for i in (f"conv{n}" for n in range(50)) if not is_heldout(i)][:3]
    convs = [{"id": cid, "conversations": [m for t in range(3) for m in (
        {"from": "human", "value": f"Question {t} of {cid}: " + "tell me more about it. " * (4 + 8 * t * (n + 1))},
        {"from": "gpt", "value": "Here is more. " * (3 + 5 * t)})]} for n, cid in enumerate(ids)]  # fmt: skip
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))
    lengths = sorted(len(p) for c in iter_sharegpt(str(data)) for p in turn_prompts(tokenizer, c))
    cut, top = lengths[len(lengths) // 2], lengths[-1]
    assert lengths[0] < cut < top
    kw = dict(responses="target", turns="all", max_new_tokens=2, batch_size=3, sharegpt_file=str(data), progress=False)

    def answered(folder, **bounds):
        extract_features(model, tokenizer, str(tmp_path / folder), **bounds, **kw)
        export_tokens(str(tmp_path / folder), str(tmp_path / f"{folder}.npz"))
        tokens = read_tokens(str(tmp_path / f"{folder}.npz"))
        return [sid for i in range(tokens.meta["shards"]) for sid, _, _ in tokens.shard(i)]

    every = answered("every", max_prompt_tokens=top)
    short = answered("short", max_prompt_tokens=cut)
    long = answered("long", min_prompt_tokens=cut, max_prompt_tokens=top)
    assert len(every) == len(lengths) and short and long and not set(short) & set(long)
    assert sorted(short + long) == sorted(every)
    meta_path = tmp_path / "short" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["min_prompt_tokens"] == 0
    del meta["min_prompt_tokens"]  # a folder written before the setting existed
    meta_path.write_text(json.dumps(meta))
    extract_features(model, tokenizer, str(tmp_path / "short"), max_prompt_tokens=cut, **kw)  # resumes: no bound
    with pytest.raises(ValueError, match="min_prompt_tokens: 0 -> 5"):
        extract_features(model, tokenizer, str(tmp_path / "short"), min_prompt_tokens=5, max_prompt_tokens=cut, **kw)
    with pytest.raises(ValueError, match=r"must be in \[0, max_prompt_tokens"):
        extract_features(model, tokenizer, str(tmp_path / "x"), min_prompt_tokens=cut, max_prompt_tokens=cut, **kw)
    with pytest.raises(ValueError, match="responses='target'"):
        extract_features(model, tokenizer, str(tmp_path / "x"), responses="sharegpt", min_prompt_tokens=5,
                         sharegpt_file=str(data), progress=False)  # fmt: skip


def test_feature_set_reads_shards_memory_mapped(real_features):
    """FeatureSet keeps the features in the shard files (memory-mapped, not copied) and its batches hold exactly
    the stored rows, cut to max_seq_len."""
    data = FeatureSet.load([real_features], 64)
    assert isinstance(data.features, list) and data.rows is not None
    seqs = [s for s in iter_shards([real_features])
            if min(64, s.input_ids.numel()) >= 3 and s.loss_mask[1 : min(64, s.input_ids.numel())].any()]
    assert data.num_sequences == len(seqs) and all(n <= 64 for n in data.lengths().tolist())
    order = [data.num_sequences - 1, 0, 1]
    batch = data.batch(order)
    for row, i in enumerate(order):
        n = min(64, seqs[i].input_ids.numel())
        assert torch.equal(batch["ids"][row, :n], seqs[i].input_ids[:n])
        assert torch.equal(batch["features"][row, :n], seqs[i].features[:n].float())
        assert torch.equal(batch["mask"][row, :n], seqs[i].loss_mask[:n])
        assert not batch["mask"][row, n:].any()


def test_loss_on_all_positions_trains_every_real_token_and_is_part_of_the_run(smollm2, real_features, tmp_path):
    """loss_positions="all" masks in every real position of a batch (padding stays out), counts them as trained
    tokens, and a checkpoint of an answers-only run does not resume as an all-positions one."""
    model, _ = smollm2
    data = FeatureSet.load([real_features], 64)
    trainer = Trainer(_config(tmp_path, max_steps=1, loss_positions="all"), model, data=data, progress=False)
    batch = data.batch([0, 1])
    lengths = data.lengths()[:2].tolist()
    assert [int(row.sum()) for row in batch["mask"]] == lengths and not batch["mask"][0, lengths[0]:].any()
    answers = FeatureSet.load([real_features], 64).batch([0, 1])["mask"]
    assert int(answers.sum()) < sum(lengths)  # the prompts' positions are the difference
    info = trainer.train_step([0, 1])
    assert info["tokens"] == sum(lengths) - 2  # every position but each row's last has a next token to predict
    trainer.save_checkpoint()
    data.all_positions = False
    with pytest.raises(ValueError, match="loss_positions"):
        Trainer(_config(tmp_path, max_steps=2), model, data=data, progress=False).load_checkpoint()
    with pytest.raises(ValueError, match="loss_positions must be"):
        _config(tmp_path, loss_positions="prompts")


def test_bf16_soft_labels_are_the_bf16_targets_distribution_and_part_of_the_run(smollm2, real_features, tmp_path):
    """soft_labels="bfloat16" takes the CE term's labels from the lm_head rows in bf16 (what a bf16 target computes):
    the loss moves by rounding only, the labels are exactly a bf16 GEMM's softmax, and a checkpoint of an fp32-label
    run does not resume as a bf16-label one."""
    model, _ = smollm2
    data = FeatureSet.load([real_features], 64)
    trainer = Trainer(_config(tmp_path, max_steps=1, soft_labels="bfloat16"), model, data=data, progress=False)
    assert trainer.label_weight.dtype == torch.bfloat16 and torch.equal(trainer.label_weight, trainer.lm_weight.bfloat16())
    batch = data.batch([0, 1])
    with torch.no_grad():
        fp32, _ = eagle_loss(trainer.head, trainer.lm_weight, batch, 0.0, 1.0)
        bf16, _ = eagle_loss(trainer.head, trainer.lm_weight, batch, 0.0, 1.0, label_weight=trainer.label_weight)
        # labels in float64 agree with the fp32 ones to rounding: the precision is all label_weight changes
        probe, _ = eagle_loss(trainer.head, trainer.lm_weight, batch, 0.0, 1.0,
                              label_weight=trainer.lm_weight.double())
    assert fp32.item() != bf16.item() and abs(fp32.item() - bf16.item()) < 0.02 * abs(fp32.item())
    assert abs(probe.item() - fp32.item()) < 1e-4 * abs(fp32.item())
    trainer.train_step([0, 1])
    trainer.save_checkpoint()
    with pytest.raises(ValueError, match="soft_labels"):
        Trainer(_config(tmp_path, max_steps=2), model, data=data, progress=False).load_checkpoint()
    with pytest.raises(ValueError, match="soft_labels must be"):
        _config(tmp_path, soft_labels="float16")


def test_a_narrower_head_mlp_is_a_setting_of_the_run(smollm2, real_features, tmp_path):
    model, _ = smollm2
    data = FeatureSet.load([real_features], 64)
    trainer = Trainer(_config(tmp_path, max_steps=1, head_intermediate_size=96), model, data=data, progress=False)
    assert trainer.head.config.intermediate_size == 96 and trainer.head.layers[0].mlp.up_proj.out_features == 96
    trainer.run(resume=False)
    with pytest.raises(ValueError, match="head_intermediate_size"):
        Trainer(_config(tmp_path, max_steps=2), model, data=data, progress=False).load_checkpoint()
    trainer.save_head(str(tmp_path / "head"))
    loaded = EagleDraftModel.from_pretrained(str(tmp_path / "head"))
    assert loaded.config.intermediate_size == 96  # the saved config carries the width


def test_max_prompt_context_keeps_every_answer_position_and_the_prompts_last_positions(real_features):
    """train --max-prompt-context: each row starts at most N positions before its first answer token, so the
    answer positions (every one the loss reads) and their features stay, and only the prompt's head is dropped."""
    whole = FeatureSet.load([real_features], 256)
    cut = FeatureSet.load([real_features], 256, max_prompt_context=4)
    assert cut.num_sequences == whole.num_sequences and int(cut.mask.sum()) == int(whole.mask.sum())
    assert cut.num_tokens < whole.num_tokens
    order = list(range(whole.num_sequences))
    full, short = whole.batch(order), cut.batch(order)
    for row, (n, m) in enumerate(zip(whole.lengths().tolist(), cut.lengths().tolist())):
        first = int(full["mask"][row].nonzero()[0])  # the row's first answer token
        kept = min(first, 4)
        assert m == n - (first - kept) and int(short["mask"][row].nonzero()[0]) == kept
        assert torch.equal(short["ids"][row, :m], full["ids"][row, first - kept : n])
        assert torch.equal(short["features"][row, :m], full["features"][row, first - kept : n])
        assert torch.equal(short["mask"][row, :m], full["mask"][row, first - kept : n])
    with pytest.raises(ValueError, match="max_prompt_context must be >= 1"):
        FeatureSet.load([real_features], 256, max_prompt_context=0)


def test_a_preloaded_feature_set_with_a_prompt_cut_in_the_config_is_refused(smollm2, real_features, tmp_path):
    """TrainConfig.max_prompt_context applies where the Trainer loads config.data itself; a data= set was cut when
    it was loaded, so another setting would be ignored without a word (the same one is recorded for resuming)."""
    model, _ = smollm2
    whole, cut = FeatureSet.load([real_features], 256), FeatureSet.load([real_features], 256, max_prompt_context=4)
    for data, setting in ((whole, 4), (cut, None), (cut, 8)):
        with pytest.raises(ValueError, match="pass max_prompt_context to FeatureSet.load"):
            Trainer(_config(tmp_path, max_prompt_context=setting), model, data=data, progress=False)
    trainer = Trainer(_config(tmp_path, max_prompt_context=4), model, data=cut, progress=False)  # the same cut
    assert trainer.data is cut


def test_held_out_agreement_counts_the_targets_greedy_token_over_its_full_vocabulary(smollm2, real_features, tmp_path):
    """evaluate()'s val_agree: per pass, the share of answer positions where the head's top draft token (as a
    target id) is the target's argmax over its whole lm_head. Checked against a direct count, and bounded by the
    draft vocabulary's coverage of the target's choices (what `acc`, counted within the draft vocabulary, hides)."""
    model, _ = smollm2
    data, val = FeatureSet.load([real_features], 64), FeatureSet.load([real_features], 64)
    weight = model.get_output_embeddings().weight.detach().float()
    for vocab in (2048, 16):
        trainer = Trainer(_config(tmp_path / str(vocab), draft_vocab_size=vocab), model, data=data, val_data=val,
                          progress=False)  # fmt: skip
        assert val.target_top is not None
        exact = torch.cat([F.linear(val._rows(val.features, i, n).float(), weight).argmax(-1)
                           for i, n in enumerate(val.lengths().tolist())])  # fmt: skip
        assert (val.target_top == exact).float().mean() > 0.98  # bf16 scoring: near-ties may flip
        out = trainer.evaluate(passes=2)
        assert len(out["val_agree"]) == 2
        batch = val.batch(list(range(val.num_sequences)))
        ids, feats, sel = batch["ids"], batch["features"], batch["mask"][:, 1:]
        positions = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
        with torch.no_grad():
            pred, _ = trainer.head(None, feats[:, :-1], positions, inputs_embeds=trainer.head.embed(ids[:, 1:]))
            best = trainer.head.to_target_ids(F.linear(pred, trainer.lm_weight).argmax(-1))
        top = batch["top"][:, 1:]
        direct = (best == top)[sel].float().mean().item()
        assert abs(out["val_agree"][0] - direct) < 1e-4, (out, direct)
        covered = torch.isin(top[sel], trainer.head.to_target_ids(torch.arange(vocab))).float().mean().item()
        assert out["val_agree"][0] <= covered + 1e-6
    assert covered < 0.9 and out["val_agree"][0] < out["val_acc"]  # 16 tokens: most target choices lie outside
    cached = FeatureSet.load([real_features], 64)
    cached.attach_target_top(weight, cache_folder=str(tmp_path))  # computed and kept
    (kept,) = tmp_path.glob("target_top.*.pt")
    torch.save(torch.zeros_like(val.target_top), kept)  # a kept file is read back, not recomputed
    again = FeatureSet.load([real_features], 64)
    again.attach_target_top(weight, cache_folder=str(tmp_path))
    assert torch.equal(cached.target_top, val.target_top) and not again.target_top.any()


def _config(out, **kw):
    base = dict(data=[], out=str(out), draft_vocab_size=2048, epochs=5, lr=1e-3, warmup_steps=2, batch_tokens=1024,
                save_every=3, eval_every=10**9, seed=0)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_a_few_steps_reduce_the_loss(smollm2, real_features, tmp_path, autocast):
    model, _ = smollm2
    data = FeatureSet.load([real_features], 256)
    trainer = Trainer(_config(tmp_path, max_steps=12, autocast=autocast), model, data=data, progress=False)
    batch = data.batch(list(range(min(4, data.num_sequences))))
    with torch.no_grad():
        before, _ = eagle_loss(trainer.head, trainer.lm_weight, batch, 0.0, 0.1)
    trainer.run(resume=False)
    with torch.no_grad():
        after, _ = eagle_loss(trainer.head, trainer.lm_weight, batch, 0.0, 0.1)
    assert after.item() < 0.9 * before.item()


def test_bf16_autocast_warns_where_the_cpu_emulates_bf16(smollm2, real_features, tmp_path, monkeypatch, recwarn):
    model, _ = smollm2
    data = FeatureSet.load([real_features], 256)
    emulate_bf16(monkeypatch, native=False)
    with pytest.warns(UserWarning, match="training with autocast in bfloat16, but this CPU has no AVX512-BF16"):
        Trainer(_config(tmp_path / "a", autocast="bfloat16"), model, data=data, progress=False)
    recwarn.clear()
    Trainer(_config(tmp_path / "b"), model, data=data, progress=False)
    emulate_bf16(monkeypatch, native=True)
    Trainer(_config(tmp_path / "c", autocast="bfloat16"), model, data=data, progress=False)
    assert not [w for w in recwarn if "bf16 is emulated" in str(w.message)]


def test_resume_reproduces_an_uninterrupted_run(smollm2, real_features, tmp_path):
    model, _ = smollm2
    data = FeatureSet.load([real_features], 256)
    straight = Trainer(_config(tmp_path / "a", max_steps=7), model, data=data, progress=False).run(resume=False)
    Trainer(_config(tmp_path / "b", max_steps=3), model, data=data, progress=False).run(resume=False)  # "stopped"
    resumed = Trainer(_config(tmp_path / "b", max_steps=7), model, data=data, progress=False)
    assert resumed.load_checkpoint() and resumed.step == 3
    head = resumed.run(resume=True)
    for (name, a), (_, b) in zip(straight.state_dict().items(), head.state_dict().items()):
        assert torch.equal(a, b), name


def test_resume_refuses_a_checkpoint_of_other_data_or_settings(smollm2, real_features, tmp_path):
    """A checkpoint resumes only the run it belongs to: other data (e.g. a feature folder that grew) or another
    schedule would silently mix two runs (and re-select the draft vocabulary under trained weights)."""
    model, _ = smollm2
    data = FeatureSet.load([real_features], 256)
    Trainer(_config(tmp_path, max_steps=3), model, data=data, progress=False).run(resume=False)
    with pytest.raises(ValueError, match=r"lr: 0.001 -> 0.002"):
        Trainer(_config(tmp_path, max_steps=6, lr=2e-3), model, data=data, progress=False).load_checkpoint()
    fewer = FeatureSet.load([real_features], 128)  # the same folder read differently: fewer tokens
    with pytest.raises(ValueError, match="data_tokens"):
        Trainer(_config(tmp_path, max_steps=6), model, data=fewer, progress=False).load_checkpoint()
    assert Trainer(_config(tmp_path, max_steps=6, save_every=5), model, data=data, progress=False).load_checkpoint()
    # a run from a saved head resumes only while that folder holds the same head (same draft vocabulary)
    first = Trainer(_config(tmp_path / "a", max_steps=1), model, data=data, progress=False)
    first.run(resume=False)
    first.save_head(str(tmp_path / "head"))
    Trainer(_config(tmp_path / "b", max_steps=1, init=str(tmp_path / "head")), model, data=data,
            progress=False).run(resume=False)  # fmt: skip
    other = Trainer(_config(tmp_path / "c", max_steps=1), model, data=FeatureSet.load([real_features], 48), progress=False)
    other.save_head(str(tmp_path / "head"))  # the folder now holds a head of another vocabulary
    with pytest.raises(ValueError, match="soft_label_rows"):
        Trainer(_config(tmp_path / "b", max_steps=2, init=str(tmp_path / "head")), model, data=data,
                progress=False).load_checkpoint()  # fmt: skip


def test_init_starts_a_new_run_from_a_trained_head(smollm2, real_features, tmp_path):
    model, _ = smollm2
    data = FeatureSet.load([real_features], 256)
    first = Trainer(_config(tmp_path / "a", max_steps=6), model, data=data, progress=False)
    first.run(resume=False)
    first.save_head(str(tmp_path / "head"))
    other = FeatureSet.load([real_features], 48)  # other data: its own draft vocabulary would differ
    second = Trainer(_config(tmp_path / "b", max_steps=2, init=str(tmp_path / "head"), lr=3e-4), model, data=other,
                     progress=False)  # fmt: skip
    for (name, a), (_, b) in zip(first.head.state_dict().items(), second.head.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(first.lm_weight, second.lm_weight)  # the head's draft vocabulary, not a re-selected one
    fresh = Trainer(_config(tmp_path / "c", max_steps=2), model, data=other, progress=False)
    assert not torch.equal(fresh.head.d2t, second.head.d2t)
    batch = data.batch(list(range(min(4, data.num_sequences))))
    with torch.no_grad():
        warm, _ = eagle_loss(second.head, second.lm_weight, batch, 0.0, 0.1)
        cold, _ = eagle_loss(fresh.head, fresh.lm_weight, batch, 0.0, 0.1)
    assert warm.item() < 0.9 * cold.item()
    second.run(resume=False)
    with pytest.raises(ValueError, match="--draft-vocab-size 2048"):
        Trainer(_config(tmp_path / "d", init=str(tmp_path / "head"), draft_vocab_size=1024), model, data=data)
    with pytest.raises(ValueError, match="EAGLE-1/2 head"):
        Trainer(_config(tmp_path / "e", init=str(tmp_path / "head"), head="eagle3"), model, data=data)


def test_grow_vocab_adds_the_new_datas_frequent_tokens_to_an_eagle2_heads_vocabulary(smollm2, real_features, tmp_path):
    """An EAGLE-1/2 head borrows the target's lm_head: growing its vocabulary only adds ids (and soft-label rows)."""
    model, _ = smollm2
    data = FeatureSet.load([real_features], 256)
    first = Trainer(_config(tmp_path / "a", max_steps=1, draft_vocab_size=1024), model, data=data, progress=False)
    first.run(resume=False)
    first.save_head(str(tmp_path / "head"))
    grown = Trainer(_config(tmp_path / "b", max_steps=1, draft_vocab_size=1536, init=str(tmp_path / "head"),
                            grow_vocab=True), model, data=data, progress=False)  # fmt: skip
    ids = grown.head.to_target_ids(torch.arange(1536))
    assert bool(torch.isin(first.head.d2t, ids).all()) and ids.unique().numel() == 1536
    torch.testing.assert_close(grown.lm_weight, model.get_output_embeddings().weight[ids].float(), rtol=0, atol=0)
    for (name, a), (_, b) in zip(first.head.state_dict().items(), grown.head.state_dict().items()):
        assert name == "d2t" or torch.equal(a, b), name


def test_heads_trained_from_heads_carry_their_lineage(smollm2, real_features, tmp_path):
    """A head trained with `init` records the runs behind it (nearest first) and the tokens they saw in all; its
    snapshots count them too, so a τ-vs-tokens curve across stages is on one axis."""
    model, _ = smollm2
    data = FeatureSet.load([real_features], 256)
    runs = []
    for i, init in enumerate([None, "h0", "h1"]):
        config = _config(tmp_path / f"run{i}", max_steps=2, init=str(tmp_path / init) if init else None,
                         snapshot_every_tokens=1 if i == 1 else None)  # fmt: skip
        trainer = Trainer(config, model, data=data, progress=False)
        trainer.run(resume=False)
        trainer.save_head(str(tmp_path / f"h{i}"), extra={"command": f"train {i}"})
        runs.append(trainer.tokens_seen)
    summary = json.loads((tmp_path / "h2" / "training.json").read_text())
    assert [s["command"] for s in summary["init_lineage"]] == ["train 1", "train 0"]
    assert [s["tokens_seen"] for s in summary["init_lineage"]] == runs[1::-1]
    assert "init_lineage" not in summary["init_lineage"][0]  # each summary once, flat
    assert summary["tokens_seen_total"] == total_tokens_seen(summary) == sum(runs)
    assert "init_lineage" not in json.loads((tmp_path / "h0" / "training.json").read_text())  # no init: no lineage
    snapshots = sorted((tmp_path / "run1" / "snapshots").iterdir())
    first = json.loads((snapshots[0] / "training.json").read_text())
    assert first["tokens_seen_total"] == runs[0] + first["tokens_seen"] and first["tokens_seen"] < runs[1]
    assert EagleDraftModel.from_pretrained(str(snapshots[0])).draft_vocab_size == 2048  # still a loadable head
    # a summary written before summaries carried their lineage is followed through its config's init
    legacy = json.loads((tmp_path / "h1" / "training.json").read_text())
    del legacy["init_lineage"], legacy["tokens_seen_total"]
    (tmp_path / "h1" / "training.json").write_text(json.dumps(legacy))
    assert [s["command"] for s in init_lineage(str(tmp_path / "h1"))] == ["train 1", "train 0"]
    # ... and one naming itself (retrained in place) ends the chain instead of recursing
    (tmp_path / "h0" / "training.json").write_text(json.dumps(
        json.loads((tmp_path / "h0" / "training.json").read_text()) | {"config": {"init": str(tmp_path / "h0")}}))
    assert [s["command"] for s in init_lineage(str(tmp_path / "h0"))] == ["train 0"]
    # a run saving over its own init records the head it started from, not itself, however often it saves
    again = Trainer(_config(tmp_path / "run3", max_steps=1, init=str(tmp_path / "h2")), model, data=data, progress=False)
    again.run(resume=False)
    for _ in range(2):
        again.save_head(str(tmp_path / "h2"), extra={"command": "train 3"})
    in_place = json.loads((tmp_path / "h2" / "training.json").read_text())
    assert [s["command"] for s in in_place["init_lineage"]] == ["train 2", "train 1", "train 0"]
    # a snapshot as init keeps the stages behind it; a head with no training.json starts an empty lineage
    from_snapshot = Trainer(_config(tmp_path / "run4", max_steps=1, init=str(snapshots[0])), model, data=data,
                            progress=False)  # fmt: skip
    assert [s.get("snapshot", False) for s in from_snapshot.lineage] == [True, False]
    EagleDraftModel.from_pretrained(str(tmp_path / "h0")).save_pretrained(str(tmp_path / "bare"))
    bare = Trainer(_config(tmp_path / "run5", max_steps=1, init=str(tmp_path / "bare")), model, data=data, progress=False)
    bare.run(resume=False)
    bare.save_head(str(tmp_path / "h5"))
    summary = json.loads((tmp_path / "h5" / "training.json").read_text())
    assert summary["init_lineage"] == [] and summary["tokens_seen_total"] == bare.tokens_seen


def test_draft_vocabulary_selection():
    counts = torch.tensor([5, 0, 9, 9, 1, 3])
    assert select_draft_vocab(counts, 3).tolist() == [0, 2, 3]
    assert select_draft_vocab(counts, 3, always=[1]).tolist() == [1, 2, 3]


def test_unrolled_pass_equals_inference_drafting():
    """Training-time test: pass 2 at index i is exactly the head drafting a depth-1 node at position i."""
    from conftest import tiny_model

    from hf_eagle2 import EagleDraftModel

    model = tiny_model("llama")
    head = EagleDraftModel.from_target(model, seed=0)
    g = torch.Generator().manual_seed(0)
    steps = 9
    ids = torch.randint(3, 32, (1, steps + 1), generator=g)
    feats = torch.randn(1, steps + 1, 64, generator=g)
    pos = torch.arange(steps)[None]
    emb = head.embed(ids[:, 1:])
    pred1, kv1 = head(None, feats[:, :-1], pos, inputs_embeds=emb)
    batch = {"ids": ids, "features": feats, "mask": torch.ones(1, steps + 1, dtype=torch.bool)}
    captured = {}
    original = head.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.setdefault("passes", []).append(out[0])
        return out

    head.forward = spy
    eagle_loss(head, head.binding.head_weight, batch, 0.0, 0.1, unroll=2)
    head.forward = original
    pred2 = captured["passes"][1]
    for i in range(1, steps):
        _, ctx = head(None, feats[:, :i], pos[:, :i], inputs_embeds=emb[:, :i])
        node, _ = head(None, pred1[:, i - 1 : i], pos[:, i : i + 1], torch.ones(1, 1, 1, i + 1, dtype=torch.bool), ctx,
                       inputs_embeds=emb[:, i : i + 1])  # fmt: skip
        torch.testing.assert_close(pred2[0, i], node[0, 0], atol=1e-5, rtol=1e-5)


def test_sharegpt_eval_prompts_are_held_out_first_turns():
    """`eval-head --dataset sharegpt`: first turns of held-out conversations none of whose chunks is in the
    training split."""
    prompts = load_prompts("sharegpt")
    trained = {conversation_base(c.id) for c in iter_sharegpt(split="train")}
    assert len(prompts) >= 100
    for p in prompts:
        cid = p.id.removeprefix("sharegpt-")
        assert is_heldout(cid) and cid.endswith("_0") and conversation_base(cid) not in trained
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        assert len(p.messages[0]["content"]) <= SHAREGPT_PROMPT_CHARS
    assert conversation_base("hRPPgZT_11") == "hRPPgZT" and conversation_base("abc") == "abc"


def test_a_truncated_shard_is_named(real_features, tmp_path):
    """A shard cut short (a copy interrupted, a full disk) is an error naming it, not a garbled feature set."""
    shard = sorted(f for f in os.listdir(real_features) if f.startswith("shard_"))[0]
    data = open(os.path.join(real_features, shard), "rb").read()
    (tmp_path / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        FeatureSet.load([str(tmp_path)], 64)


@pytest.mark.parametrize("kernels", ["stock", "fast"])
def test_eval_head_measures_tau_and_leaves_the_kernels_as_they_were(smollm2, kernels, monkeypatch):
    """eval-head's τ is the rounds' tokens per target forward of real generate calls, on the kernels asked for; the
    model's own kernels are restored after."""
    import hf_eagle2.evaluation.evaluate as evaluation

    if kernels == "fast" and not fast_path_available():
        pytest.skip("no oneDNN in this torch build")
    model, tokenizer = smollm2
    draft = EagleDraftModel.from_target(model, seed=0)
    ran_on, inner = [], evaluation._eval_head
    monkeypatch.setattr(evaluation, "_eval_head", lambda m, *a: ran_on.append(is_optimized(m)) or inner(m, *a))
    result = eval_head(model, tokenizer, draft, ["builtin"], limit=2, max_new_tokens=8, calibration=False,
                       progress=False, kernels=kernels)  # fmt: skip
    r = result["datasets"]["builtin"]
    assert result["kernels"] == kernels and r["prompts"] == 2 and r["new_tokens"] == 16
    assert r["prefill_tokens"] == r["prompts"] and sum(r["accept_hist"]) == r["target_forwards"]
    assert r["tau"] == (r["new_tokens"] - r["prompts"]) / r["target_forwards"]  # rounds' tokens per round
    assert not is_optimized(model) and not is_optimized(draft) and draft.binding.head_packed is None
    optimize_for_cpu(model)  # a model the user optimised stays optimised (and "stock" ran on stock kernels)
    try:
        again = eval_head(model, tokenizer, draft, ["builtin"], limit=2, max_new_tokens=8, calibration=False,
                          progress=False, kernels=kernels)  # fmt: skip
        assert is_optimized(model) and again["datasets"]["builtin"]["new_tokens"] == 16
        assert ran_on == [kernels == "fast"] * 2
    finally:
        optimize_for_cpu(model, enable=False)
    with pytest.raises(ValueError, match="kernels must be"):
        eval_head(model, tokenizer, draft, ["builtin"], limit=1, kernels="turbo")


def test_eval_head_mtbench2_measures_second_turns_after_the_targets_own_answer(smollm2, monkeypatch):
    """`eval-head --dataset mtbench2`: each MT-bench question's second turn, asked after the target's greedy answer
    to its first (the history a chat keeps), and only the second answer counted."""
    import hf_eagle2.evaluation.evaluate as evaluation
    from hf_eagle2.evaluation.assets import mtbench_questions
    from hf_eagle2.evaluation.bench import run_bench

    model, tokenizer = smollm2
    draft = EagleDraftModel.from_target(model, seed=0)
    asked, inner = [], evaluation.chat_input_ids
    monkeypatch.setattr(evaluation, "chat_input_ids",
                        lambda tok, messages: asked.append(messages) or inner(tok, messages))  # fmt: skip
    result = eval_head(model, tokenizer, draft, ["mtbench2"], limit=1, max_new_tokens=8, calibration=False,
                       progress=False)  # fmt: skip
    r = result["datasets"]["mtbench2"]
    assert r["prompts"] == 1 and r["new_tokens"] == 8 and r["prefill_tokens"] == 1
    question = mtbench_questions()[0]
    first = [{"role": "user", "content": question["turns"][0]}]
    ids = inner(tokenizer, first)
    answer = tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :],
                              skip_special_tokens=True)  # fmt: skip
    assert answer.strip()
    second = [{"role": "assistant", "content": answer}, {"role": "user", "content": question["turns"][1]}]
    assert asked[-1] == first + second
    assert load_prompts("mtbench", 1)[0].follow_up == question["turns"][1]  # what bench's second turns ask
    with pytest.raises(ValueError, match="bench measures MT-bench's second turns with --dataset mtbench"):
        run_bench(model, tokenizer, draft, datasets=["mtbench2"], progress=False)
