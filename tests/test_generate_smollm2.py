"""Greedy identity on the real model: SmolLM2-135M-Instruct (fp32), random and trained heads, every tree kind."""

import os

import pytest
import torch
from conftest import CHAT_PROMPTS, chat_ids

from hf_eagle2 import Eagle3DraftModel, EagleDraftModel

SHIPPED_HEAD = os.path.join(os.path.dirname(__file__), "..", "model_cards", "smollm2-135m-instruct-eagle2")
SHIPPED_EAGLE3 = os.path.join(os.path.dirname(__file__), "..", "model_cards", "smollm2-135m-instruct-eagle3")
MAX_NEW = 128


@pytest.fixture(scope="module")
def references(smollm2):
    model, tokenizer = smollm2
    refs = {}
    for text in CHAT_PROMPTS:
        ids = chat_ids(tokenizer, text)
        refs[text] = (ids, model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW))
    return refs


@pytest.fixture(scope="module")
def shipped_head():
    if not os.path.exists(os.path.join(SHIPPED_HEAD, "model.safetensors")):
        pytest.fail("the shipped head model_cards/smollm2-135m-instruct-eagle2 is missing")
    return EagleDraftModel.from_pretrained(SHIPPED_HEAD)


TREES = {
    "eagle2": dict(tree="eagle2", tree_total_tokens=16, tree_depth=6, tree_top_k=4),
    "eagle1": dict(tree="eagle1"),
    "chain": dict(tree="chain", tree_depth=4),
}


@pytest.mark.parametrize("tree", list(TREES))
def test_random_head_identity(smollm2, references, tree):
    model, _ = smollm2
    draft = EagleDraftModel.from_target(model, seed=0)
    for text in CHAT_PROMPTS[:8]:
        ids, ref = references[text]
        out = model.generate(ids, assistant_model=draft, max_new_tokens=MAX_NEW, **TREES[tree])
        assert torch.equal(out, ref), text


@pytest.mark.parametrize("tree", list(TREES))
def test_shipped_eagle3_head_identity(smollm2, references, tree):
    """The shipped EAGLE-3 head: its own lm_head over 12,288 draft tokens (8,192 grown by stage 5's
    `--grow-vocab`), three target layers taken from the verify forward, its own output fed back from depth 2 on."""
    model, _ = smollm2
    if not os.path.exists(os.path.join(SHIPPED_EAGLE3, "model.safetensors")):
        pytest.fail("the shipped head model_cards/smollm2-135m-instruct-eagle3 is missing")
    head = EagleDraftModel.from_pretrained(SHIPPED_EAGLE3)
    assert isinstance(head, Eagle3DraftModel) and head.draft_vocab_size == 12288
    accepted_long = 0
    for text in CHAT_PROMPTS[:6]:
        ids, ref = references[text]
        out = model.generate(ids, assistant_model=head, max_new_tokens=MAX_NEW, return_dict_in_generate=True, **TREES[tree])
        assert torch.equal(out.sequences, ref), text
        accepted_long += sum(out.eagle_stats.accept_hist[3:])
    assert accepted_long > 0  # a trained head: deep drafts get accepted


@pytest.mark.parametrize("tree", list(TREES))
def test_trained_head_identity(smollm2, references, shipped_head, tree):
    """All chat prompts x 128 tokens; prompts whose answers end early put EOS inside accepted paths."""
    model, _ = smollm2
    ended_early = accepted_long = 0
    for text in CHAT_PROMPTS:
        ids, ref = references[text]
        out = model.generate(ids, assistant_model=shipped_head, max_new_tokens=MAX_NEW, return_dict_in_generate=True, **TREES[tree])
        assert torch.equal(out.sequences, ref), text
        ended_early += ref.shape[1] - ids.shape[1] < MAX_NEW
        accepted_long += sum(out.eagle_stats.accept_hist[3:])
    assert ended_early >= 2 and accepted_long > 0


def test_paper_default_tree(smollm2, references, shipped_head):
    model, _ = smollm2
    for text in CHAT_PROMPTS[:3]:
        ids, ref = references[text]
        assert torch.equal(model.generate(ids, assistant_model=shipped_head, tree="eagle2", max_new_tokens=MAX_NEW), ref)


def test_shipped_head_is_trained(smollm2, references, shipped_head):
    """A random head gives tau ~ 1; the shipped one must do much better (and stay exact)."""
    model, _ = smollm2
    new = forwards = 0
    for text in CHAT_PROMPTS[:6]:
        ids, ref = references[text]
        out = model.generate(ids, assistant_model=shipped_head, tree="eagle2", tree_total_tokens=32,
                             max_new_tokens=MAX_NEW, return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(out.sequences, ref)
        new += out.eagle_stats.new_tokens
        forwards += out.eagle_stats.target_forwards
    assert new / forwards > 2.0
    assert shipped_head.num_head_parameters() <= 0.10 * sum(p.numel() for p in model.parameters())


def test_full_vocab_and_reduced_vocab_are_both_exact(smollm2, references, shipped_head):
    model, _ = smollm2
    full = EagleDraftModel.from_pretrained(SHIPPED_HEAD).set_draft_vocab(None)
    assert shipped_head.config.draft_vocab_size is not None and full.config.draft_vocab_size is None
    for text in CHAT_PROMPTS[:3]:
        ids, ref = references[text]
        for head in (shipped_head, full):
            assert torch.equal(model.generate(ids, assistant_model=head, tree="eagle2", tree_total_tokens=16,
                                              tree_top_k=4, max_new_tokens=MAX_NEW), ref)  # fmt: skip


def test_multi_turn_chat_reusing_the_cache_equals_plain(smollm2):
    """Three turns, each passing the previous turn's cache and the whole conversation so far, as transformers
    users do; tree speculation prefills only the new suffix and returns a cache plain generate continues from
    ("mixed" alternates the two on one cache)."""
    model, tokenizer = smollm2
    draft = EagleDraftModel.from_pretrained(SHIPPED_HEAD)
    turns = ["Name three colours.", "Which of them is warmest?", "Write one sentence about it."]
    results = {}
    for mode in ("plain", "eagle2", "mixed"):
        cache, seq = None, None
        results[mode] = []
        for i, text in enumerate(turns):
            if seq is None:
                ids = chat_ids(tokenizer, text)
            else:
                follow = f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
                ids = torch.cat([seq, tokenizer(follow, add_special_tokens=False, return_tensors="pt")["input_ids"]], 1)
            tree = mode == "eagle2" or (mode == "mixed" and i % 2 == 1)
            kw = dict(assistant_model=draft, tree="eagle2") if tree else {}
            out = model.generate(ids, cache=cache, max_new_tokens=24, do_sample=False, return_dict_in_generate=True, **kw)
            cache, seq = out.cache, out.sequences
            assert cache.get_seq_length() == seq.shape[1] - 1  # all but the last token, as plain generate leaves it
            if tree and i:
                assert out.eagle_stats.new_tokens == seq.shape[1] - ids.shape[1]
            results[mode].append(seq)
    for mode in ("eagle2", "mixed"):
        for turn, (a, b) in enumerate(zip(results[mode], results["plain"])):
            assert torch.equal(a, b), (mode, turn)
