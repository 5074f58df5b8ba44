"""Training EAGLE-3 heads: three-layer features from the target's one forward, training-time test matching
inference drafting, a tiny head that learns, and self-distillation over every user turn."""

import os

import pytest
import torch
from conftest import tiny_model

from hf_eagle2 import Eagle3DraftModel, EagleDraftModel
from hf_eagle2.kernels.reserved_cache import concat_rows
from hf_eagle2.training import features
from hf_eagle2.training.data import iter_sharegpt
from hf_eagle2.training.features import (
    aux_layer_ids,
    extract_features,
    forward_features,
    generate_with_features,
    iter_shards,
    turn_prompts,
)
from hf_eagle2.training.train import FeatureSet, TrainConfig, Trainer, eagle_loss, token_frequencies

LAYERS = 8


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=LAYERS, seed=4)


def tiny_features(model, n=32, new=24, seed=0) -> FeatureSet:
    """The tiny target's own greedy continuations of random prompts, with final and three-layer features."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for _ in range(n):
        prompt = torch.randint(3, model.config.vocab_size, (1, int(torch.randint(2, 10, (1,), generator=g))), generator=g)
        out = model.generate(prompt, do_sample=False, max_new_tokens=new, eos_token_id=None)
        rows.append(out[0].tolist())
        masks.append([0] * prompt.shape[1] + [1] * (out.shape[1] - prompt.shape[1]))
    final, aux = forward_features(model, rows, 0, aux_layer_ids(model))
    lengths = torch.tensor([len(r) for r in rows])
    return FeatureSet(ids=torch.tensor([t for r in rows for t in r]), features=torch.cat(final).half(),
                      mask=torch.tensor([m for ms in masks for m in ms], dtype=torch.bool),
                      offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                      aux=torch.cat(aux).half())  # fmt: skip


def test_aux_features_are_the_three_layers_of_the_same_forward(target):
    ids = torch.randint(3, 32, (1, 9), generator=torch.Generator().manual_seed(1))
    final, aux = forward_features(target, [ids[0].tolist()], 0, aux_layer_ids(target))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    assert aux_layer_ids(target) == (2, LAYERS // 2, LAYERS - 3)
    torch.testing.assert_close(aux[0], torch.cat([hs[2], hs[4], hs[5]], dim=-1)[0])
    torch.testing.assert_close(final[0], hs[-1][0])


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "cohere", "granite", "gemma2"])
def test_padded_forwards_give_each_row_its_own_features_in_every_family(family):
    """Right-padded groups without an attention mask (causality alone hides the padding) give each row the states of
    a forward over it alone: sliding windows (Gemma3, with a window shorter than the rows), eager attention with
    soft-capping (Gemma2) and scaled families alike."""
    model = tiny_model(family, **({"sliding_window": 4} if family in ("gemma3", "gemma2") else {}))
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 32, (n,), generator=g).tolist() for n in (9, 3, 14, 5, 11)]
    layers = aux_layer_ids(model)
    alone = [forward_features(model, [r], 0, layers) for r in rows]
    final, aux = forward_features(model, rows, 0, layers, max_batch_tokens=10_000)  # one forward, padded to 14
    for (ref_final, ref_aux), f, a in zip(alone, final, aux, strict=True):
        torch.testing.assert_close(f, ref_final[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, ref_aux[0], rtol=1e-5, atol=1e-5)


def test_forward_features_groups_rows_by_length_and_keeps_their_order(target, monkeypatch):
    """Rows of mixed lengths run in length-sorted groups under a padded-token budget; each row gets its own
    states (those of a forward over it alone), in the order given, whatever the grouping."""
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 32, (n,), generator=g).tolist() for n in (9, 3, 14, 5, 5, 11, 2)]
    layers = aux_layer_ids(target)
    alone = [forward_features(target, [r], 0, layers) for r in rows]
    forwards = []  # (rows, longest row) of every padded forward
    padded_forward = features._padded_forward
    monkeypatch.setattr(features, "_padded_forward", lambda model, group, *a: (
        forwards.append((len(group), max(map(len, group)))) or padded_forward(model, group, *a)))  # fmt: skip
    # every row alone; groups of lengths (2, 3, 5), (5), (9), (11), (14); (2..5), (9, 11), (14); one forward
    for budget, groups in ((1, 7), (16, 5), (30, 3), (10_000, 1)):
        forwards.clear()
        final, aux = forward_features(target, rows, 0, layers, max_batch_tokens=budget)
        assert len(forwards) == groups and all(n == 1 or n * width <= budget for n, width in forwards)
        assert [f.shape[0] for f in final] == [len(r) for r in rows]
        for (ref_final, ref_aux), f, a in zip(alone, final, aux, strict=True):
            torch.testing.assert_close(f, ref_final[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a, ref_aux[0], rtol=1e-5, atol=1e-5)


def test_unrolled_pass_equals_inference_drafting_eagle3(target):
    """Training-time test for EAGLE-3: pass 2 at index i is the head drafting a depth-1 node at position i from
    fc(target layers) context and its own pass-1 output."""
    head = Eagle3DraftModel.from_target(target, seed=0)
    g = torch.Generator().manual_seed(0)
    steps = 9
    ids = torch.randint(3, 32, (1, steps + 1), generator=g)
    aux = torch.randn(1, steps + 1, 3 * 64, generator=g)
    feats = torch.randn(1, steps + 1, 64, generator=g)
    pos = torch.arange(steps)[None]
    emb = head.embed(ids[:, 1:])
    ctx_feats = head.project_features(aux[:, :-1])
    pred1, _ = head(None, ctx_feats, pos, inputs_embeds=emb)
    batch = {"ids": ids, "features": feats, "aux": aux, "mask": torch.ones(1, steps + 1, dtype=torch.bool)}
    captured = []
    original = head.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.append(out[0])
        return out

    head.forward = spy
    lm_rows = target.get_output_embeddings().weight.detach()
    loss, info = eagle_loss(head, lm_rows, batch, 0.0, 0.1, unroll=2)
    head.forward = original
    assert info["feature_loss"] == 0.0 and "acc_deep" in info and loss.requires_grad
    for i in range(1, steps):
        _, ctx = head(None, ctx_feats[:, :i], pos[:, :i], inputs_embeds=emb[:, :i])
        node, _ = head(None, pred1[:, i - 1 : i], pos[:, i : i + 1], torch.ones(1, 1, 1, i + 1, dtype=torch.bool), ctx,
                       inputs_embeds=emb[:, i : i + 1])  # fmt: skip
        torch.testing.assert_close(captured[1][0, i], node[0, 0], atol=1e-5, rtol=1e-5)


def test_a_tiny_eagle3_head_learns_and_stays_lossless(target, tmp_path):
    data = tiny_features(target, n=16, new=16)
    config = TrainConfig(data=[], out=str(tmp_path / "run"), head="eagle3", draft_vocab_size=24, epochs=60, lr=3e-3,
                         warmup_steps=10, batch_tokens=512, noise_std=0.0, unroll=3, save_every=10**9,
                         eval_every=10**9, max_steps=80)  # fmt: skip
    trainer = Trainer(config, target, data=data, progress=False)
    assert isinstance(trainer.head, Eagle3DraftModel) and trainer.head.d2t.numel() == 24
    batch = data.batch(list(range(8)))
    with torch.no_grad():  # soft labels of a random tiny target are near uniform: CE stays near their entropy,
        before, start = eagle_loss(trainer.head, trainer.lm_weight, batch, 0.0, 0.1, unroll=3)  # so compare argmax
    trainer.run(resume=False)
    with torch.no_grad():
        after, info = eagle_loss(trainer.head, trainer.lm_weight, batch, 0.0, 0.1, unroll=3)
    assert after.item() < before.item() and info["acc"] > 0.6 > start["acc"] + 0.3, (start, info)
    assert info["acc_deep"] > start["acc_deep"] + 0.2, (start, info)
    trainer.save_head(str(tmp_path / "head"))
    loaded = EagleDraftModel.from_pretrained(str(tmp_path / "head"))
    assert type(loaded) is Eagle3DraftModel
    ids = torch.randint(3, 32, (1, 5), generator=torch.Generator().manual_seed(3))
    plain = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    out = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None, assistant_model=loaded,
                          tree="eagle2", tree_total_tokens=10, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, plain)
    assert out.eagle_stats.new_tokens / out.eagle_stats.target_forwards > 1.5  # the trained head gets accepted
    config.init, config.out = str(tmp_path / "head"), str(tmp_path / "run2")  # a new run from the saved head
    warm = Trainer(config, target, data=data, progress=False)
    with torch.no_grad():
        resumed, resumed_info = eagle_loss(warm.head, warm.lm_weight, batch, 0.0, 0.1, unroll=3)
    assert torch.equal(warm.head.d2t, trainer.head.d2t) and resumed_info["acc"] == info["acc"]
    assert abs(resumed.item() - after.item()) < 1e-5
    trainer.head.config.feature_layer_ids = [1, 3, 5]  # a head reading other layers than extraction stores
    trainer.save_head(str(tmp_path / "head_other_layers"), extra=None)
    config.init = str(tmp_path / "head_other_layers")
    with pytest.raises(ValueError, match=r"reads target layers \(1, 3, 5\)"):
        Trainer(config, target, data=data, progress=False)


def test_a_new_eagle3_head_starts_from_the_targets_lm_head(target, tmp_path):
    data = tiny_features(target, n=4, new=6)
    config = TrainConfig(data=[], out=str(tmp_path), head="eagle3", draft_vocab_size=24, max_steps=1)
    assert config.lm_head_init == "target"
    trainer = Trainer(config, target, data=data, progress=False)
    rows = trainer.head.to_target_ids(torch.arange(24))
    torch.testing.assert_close(trainer.head.lm_head.weight, target.get_output_embeddings().weight[rows].float())
    fresh = Trainer(TrainConfig(data=[], out=str(tmp_path), head="eagle3", draft_vocab_size=24, lm_head_init="random"),
                    target, data=data, progress=False)  # fmt: skip
    assert not torch.allclose(fresh.head.lm_head.weight, trainer.head.lm_head.weight)
    with pytest.raises(ValueError, match="EAGLE-1/2 head scores with the target's own lm_head"):
        TrainConfig(data=[], out=str(tmp_path), lm_head_init="target")
    with pytest.raises(ValueError, match="keeps that head's lm_head"):
        TrainConfig(data=[], out=str(tmp_path), head="eagle3", init="some/head", lm_head_init="random")
    assert TrainConfig(data=[], out=str(tmp_path), head="eagle3", init="some/head").lm_head_init is None


SMALL = dict(data=[], head="eagle3", lr=3e-3, warmup_steps=2, batch_tokens=512, save_every=10**9, eval_every=10**9)


def small_trained_head(target, data, tmp_path) -> Trainer:
    """A head with a 12-token draft vocabulary trained 4 steps, saved to tmp_path / "head" (a run's init)."""
    first = Trainer(TrainConfig(out=str(tmp_path / "a"), draft_vocab_size=12, max_steps=4, **SMALL), target, data=data,
                    progress=False)  # fmt: skip
    first.run(resume=False)
    first.save_head(str(tmp_path / "head"))
    return first


def test_a_trained_eagle3_heads_vocabulary_grows_with_its_trained_rows(target, tmp_path):
    """grow_vocab: a head trained with a small draft vocabulary continues with the next data's most frequent
    tokens it lacks added; its trained lm_head rows stay, new rows start at zero, d2t / t2d / the soft
    labels follow, and the grown head saves, loads and decodes losslessly."""
    data = tiny_features(target, n=16, new=16)
    lm_head = target.get_output_embeddings().weight.detach()
    first = small_trained_head(target, data, tmp_path)
    old_ids, old_rows = first.head.to_target_ids(torch.arange(12)), first.head.lm_head.weight.detach().clone()
    config = TrainConfig(out=str(tmp_path / "b"), draft_vocab_size=20, max_steps=3, init=str(tmp_path / "head"),
                         grow_vocab=True, **SMALL)  # fmt: skip
    grown = Trainer(config, target, data=data, progress=False)
    ids = grown.head.to_target_ids(torch.arange(20))
    assert grown.head.draft_vocab_size == 20 and bool((ids[1:] > ids[:-1]).all())
    assert int(grown.head.t2d.sum()) == 20 and bool(grown.head.t2d[ids].all())
    kept = torch.isin(ids, old_ids)
    assert int(kept.sum()) == 12
    added = ids[~kept]
    counts = token_frequencies(data, target.config.vocab_size)
    lacked = torch.ones_like(counts, dtype=torch.bool)
    lacked[old_ids] = False
    lacked[added] = False
    assert int(counts[added].min()) >= int(counts[lacked].max())  # the most frequent tokens the head lacked
    torch.testing.assert_close(grown.head.lm_head.weight[kept], old_rows, rtol=0, atol=0)
    assert not grown.head.lm_head.weight[~kept].any()
    torch.testing.assert_close(grown.lm_weight, lm_head[ids].float(), rtol=0, atol=0)  # soft labels over the new ids
    torch.testing.assert_close(grown.head.fc.weight, first.head.fc.weight, rtol=0, atol=0)
    grown.run(resume=False)
    grown.save_head(str(tmp_path / "grown"))
    loaded = EagleDraftModel.from_pretrained(str(tmp_path / "grown"))
    assert torch.equal(loaded.to_target_ids(torch.arange(20)), ids)
    prompt = torch.randint(3, 32, (1, 5), generator=torch.Generator().manual_seed(5))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None)
    for tree in ("eagle2", "chain"):
        out = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None, assistant_model=loaded,
                              tree=tree)  # fmt: skip
        assert torch.equal(out, plain), tree
    assert Trainer(config, target, data=data, progress=False).load_checkpoint()  # the grown run resumes
    with pytest.raises(ValueError, match="larger draft_vocab_size"):
        Trainer(TrainConfig(out=str(tmp_path / "c"), draft_vocab_size=12, init=str(tmp_path / "head"), grow_vocab=True,
                            **SMALL), target, data=data, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="needs init"):
        TrainConfig(out=str(tmp_path / "c"), draft_vocab_size=20, grow_vocab=True, **SMALL)
    with pytest.raises(ValueError, match="already"):
        loaded.grow_draft_vocab(ids[:1])


def test_a_trained_eagle3_head_continues_on_the_targets_frozen_lm_head(target, tmp_path):
    """freeze_lm_head: a trained head's own lm_head is replaced by the target's rows, which training leaves as
    they are while the body learns; with the init's draft vocabulary size its vocabulary is kept, with None the
    head drafts over the full vocabulary. The result saves, loads and decodes losslessly."""
    data = tiny_features(target, n=16, new=16)
    lm_head = target.get_output_embeddings().weight.detach()
    first = small_trained_head(target, data, tmp_path)
    old_ids = first.head.to_target_ids(torch.arange(12))
    assert not torch.allclose(first.head.lm_head.weight, lm_head[old_ids].float())  # its own rows moved
    config = TrainConfig(out=str(tmp_path / "b"), draft_vocab_size=12, max_steps=3, init=str(tmp_path / "head"),
                         freeze_lm_head=True, **SMALL)  # fmt: skip
    frozen = Trainer(config, target, data=data, progress=False)
    assert torch.equal(frozen.head.to_target_ids(torch.arange(12)), old_ids)  # the init's vocabulary, kept
    assert not frozen.head.lm_head.weight.requires_grad
    torch.testing.assert_close(frozen.head.lm_head.weight, lm_head[old_ids].float(), rtol=0, atol=0)
    torch.testing.assert_close(frozen.lm_weight, lm_head[old_ids].float(), rtol=0, atol=0)
    frozen.run(resume=False)
    torch.testing.assert_close(frozen.head.lm_head.weight, lm_head[old_ids].float(), rtol=0, atol=0)
    assert not torch.allclose(frozen.head.fc.weight, first.head.fc.weight)  # the body trained
    frozen.save_head(str(tmp_path / "frozen"))
    loaded = EagleDraftModel.from_pretrained(str(tmp_path / "frozen"))
    torch.testing.assert_close(loaded.lm_head.weight, lm_head[old_ids].float(), rtol=0, atol=0)
    full = Trainer(TrainConfig(out=str(tmp_path / "c"), draft_vocab_size=None, max_steps=2, init=str(tmp_path / "head"),
                               freeze_lm_head=True, **SMALL), target, data=data, progress=False)  # fmt: skip
    full.run(resume=False)
    assert full.head.full_vocab and full.head.config.draft_vocab_size is None
    torch.testing.assert_close(full.head.lm_head.weight, lm_head.float(), rtol=0, atol=0)
    full.save_head(str(tmp_path / "full"))
    prompt = torch.randint(3, 32, (1, 5), generator=torch.Generator().manual_seed(6))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None)
    widened = EagleDraftModel.from_pretrained(str(tmp_path / "frozen")).bind(target).set_draft_vocab(None)
    assert widened.full_vocab  # frozen target rows: any vocabulary is a choice of the target's rows
    own = sum(p.numel() for p in widened.parameters())
    assert widened.bind(target).num_head_parameters() == own - lm_head.numel()  # borrowed rows: not the head's
    trained = EagleDraftModel.from_pretrained(str(tmp_path / "head")).bind(target)
    assert trained.num_head_parameters() == sum(p.numel() for p in trained.parameters())  # its own rows count
    torch.testing.assert_close(widened.lm_head.weight, lm_head.float(), rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="own trained lm_head"):
        EagleDraftModel.from_pretrained(str(tmp_path / "head")).bind(target).set_draft_vocab(None)
    for head in (loaded, widened, EagleDraftModel.from_pretrained(str(tmp_path / "full"))):
        for tree in ("eagle2", "chain"):
            out = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None, assistant_model=head,
                                  tree=tree)  # fmt: skip
            assert torch.equal(out, plain), tree
    for bad in (dict(head="eagle2"), dict(head="eagle3", lm_head_init="random"),
                dict(head="eagle3", init="some/head", grow_vocab=True)):  # fmt: skip
        with pytest.raises(ValueError, match="freeze_lm_head"):
            TrainConfig(data=[], out=str(tmp_path), freeze_lm_head=True, **bad)


def test_self_distilled_rows_leave_the_batch_once_their_answer_ends(target, monkeypatch):
    """Self-distilled answers run in generate calls of a few decode steps; a row whose EOS was fed back leaves
    the batch (each later call gets exactly the rows still answering) and every row keeps the tokens and features
    of one call for the whole answer, and its own batch-of-one greedy answer."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 32, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 4, 6)]
    eos, new, layers = [4, 26, 19], 12, aux_layer_ids(target)
    one_call = generate_with_features(target, prompts, new, eos, 0, aux_layers=layers, chunk_steps=None)
    answers = [len(ids) - start for ids, _, _, start in one_call]
    ended = [ids[-1].item() in eos for ids, _, _, _ in one_call]
    assert min(answers) == 1 and max(answers) == new and len(set(answers)) >= 3 and any(ended) and not all(ended)
    for p, (ids, _, _, start) in zip(prompts, one_call):
        alone = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new, eos_token_id=eos,
                                pad_token_id=0)  # fmt: skip
        assert ids.tolist() == alone[0].tolist() and start == len(p)
    calls, generate = [], target.generate
    monkeypatch.setattr(target, "generate", lambda ids, **kw: calls.append(ids.shape[0]) or generate(ids, **kw))
    joined = []  # how many row groups each reserved run prefilled apart (16 padded tokens per forward: 2 rows)
    monkeypatch.setattr(features, "FORWARD_BATCH_TOKENS", 16)
    monkeypatch.setattr(features, "concat_rows", lambda caches: joined.append(len(caches)) or concat_rows(caches))
    for chunk, reserve in ((1, 256), (4, 2), (5, None)):  # reserved caches that grow rarely / often, DynamicCache
        calls.clear()
        chunked = generate_with_features(target, prompts, new, eos, 0, aux_layers=layers, chunk_steps=chunk,
                                         reserve=reserve)  # fmt: skip
        for (ids, feats, aux, start), (ids1, feats1, aux1, start1) in zip(chunked, one_call, strict=True):
            assert torch.equal(ids, ids1) and start == start1
            torch.testing.assert_close(feats, feats1, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(aux, aux1, rtol=1e-4, atol=1e-5)
        # a row answering n tokens with EOS stops once step n + 1 fed it back; one without runs all new + 1 steps
        steps = range(0, new + 1, chunk)
        assert calls == [sum(not e or n + 1 > done for n, e in zip(answers, ended)) for done in steps], chunk
    assert joined == [3, 3]  # the prompts (width 9) were prefilled in 3 groups of 2 rows, with each reserved cache


def test_eagle3_training_needs_aux_features(target, tmp_path):
    data = tiny_features(target, n=4, new=6)
    data.aux = None
    with pytest.raises(ValueError, match="aux features"):
        Trainer(TrainConfig(data=[], out=str(tmp_path), head="eagle3", draft_vocab_size=None, max_steps=1), target,
                data=data, progress=False).run(resume=False)  # fmt: skip
    with pytest.raises(ValueError, match="needs unroll >= 2"):
        TrainConfig(data=[], out=str(tmp_path), head="eagle3", unroll=1)
    assert TrainConfig(data=[], out=str(tmp_path), head="eagle3").noise_std == 0.0
    with pytest.raises(ValueError, match="head must be"):
        Trainer(TrainConfig(data=[], out=str(tmp_path), head="medusa"), target, data=data, progress=False)


def test_all_turns_self_distillation_with_eagle3_features(smollm2, tmp_path):
    model, tokenizer = smollm2
    conv = next(c for c in iter_sharegpt(split="train") if sum(m["role"] == "user" for m in c.messages) >= 2)
    prompts = turn_prompts(tokenizer, conv)
    assert len(prompts) == sum(m["role"] == "user" for m in conv.messages)
    assert prompts[1][: len(prompts[0])] == prompts[0]  # a later turn's prompt holds the earlier turns as written
    meta = extract_features(model, tokenizer, str(tmp_path), responses="target", turns="all", eagle3=True,
                            max_conversations=2, max_new_tokens=6, max_prompt_tokens=400, batch_size=8,
                            progress=False)  # fmt: skip
    seqs = list(iter_shards([str(tmp_path)]))
    layers = model.config.num_hidden_layers
    assert meta["aux_layers"] == [2, layers // 2, layers - 3] and meta["turns"] == "all"
    assert len(seqs) == meta["sequences_reached"] > 2  # one per user turn (of <= 400 prompt tokens) of two conversations
    s = min(seqs, key=lambda s: s.input_ids.numel())
    with torch.no_grad():
        hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i] for i in meta["aux_layers"]], dim=-1)[0]
    torch.testing.assert_close(s.aux_features.float(), ref, atol=3e-2, rtol=3e-3)  # fp16 storage, padded batch


@pytest.mark.parametrize("name", ["smollm2-135m-instruct-eagle2", "smollm2-135m-instruct-eagle3"])
def test_shipped_smollm2_heads_stay_under_a_tenth_of_the_target(smollm2, name):
    """Issue 9's size bound on the shipped heads themselves (their own parameters at their draft vocabulary's
    size; the target's embeddings, borrowed, are not counted): at most 10% of SmolLM2's."""
    model, _ = smollm2
    head = EagleDraftModel.from_pretrained(os.path.join(os.path.dirname(__file__), "..", "model_cards", name))
    target = sum(p.numel() for p in model.parameters())
    assert head.num_head_parameters() <= 0.10 * target, (head.num_head_parameters(), target)
