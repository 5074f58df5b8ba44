"""Verification logits are the target's own: families that post-process their lm_head output (Cohere's
logit_scale, Granite's logits_scaling, Gemma2's soft-cap in the model dtype) match plain `generate`."""

import pytest
import torch
from conftest import tiny_model
from transformers import LogitsProcessor, LogitsProcessorList

from hf_eagle2 import EagleDraftModel
from hf_eagle2.engine.target import TargetModel

POSTPROCESSING = ["cohere", "granite", "gemma2"]
ALL_FAMILIES = ["llama", "qwen2", "gemma3", *POSTPROCESSING]


class EvenBonus(LogitsProcessor):
    """Adds a constant to even token ids: an additive processor makes greedy choices depend on the logits' scale."""

    def __call__(self, input_ids, scores):
        bonus = torch.zeros_like(scores)
        bonus[:, ::2] = 0.75
        return scores + bonus


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32, (1, int(torch.randint(2, 24, (1,), generator=g))), generator=g) for _ in range(n)]


def bf16_tolerance(logits: torch.Tensor) -> float:
    """Tree verification attends all nodes in one pass, sequential decoding one token at a time; in bf16 the two
    round the hidden states at different points. The logits come out of a bf16 lm_head, so they are bf16 values:
    the two runs end up about one bf16 ulp (eps = 2**-7, relative) of the largest logit apart; allow two."""
    return 2 * torch.finfo(torch.bfloat16).eps * float(logits.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", POSTPROCESSING)
def test_logits_and_greedy_output_match_plain(family, dtype):
    model = tiny_model(family, seed=1, dtype=dtype)
    draft = EagleDraftModel.from_target(model, seed=0)
    kw = dict(max_new_tokens=16, min_new_tokens=16, return_dict_in_generate=True, output_logits=True,
              output_scores=True, logits_processor=LogitsProcessorList([EvenBonus()]))  # fmt: skip
    compared = 0
    for ids in prompts(3, seed=1):
        ref = model.generate(ids, do_sample=False, **kw)
        out = model.generate(ids, assistant_model=draft, tree="eagle2", tree_top_k=4, **kw)
        # the first token comes from the prefill, the same forward as plain's first step: bit-identical
        assert torch.equal(out.logits[0], ref.logits[0]), f"{family} {dtype}: prefill logits differ"
        if dtype == torch.float32:
            # fp32: tree and sequential attention differ by rounding only (~1e-6); a wrong scale or cap is O(1)
            assert torch.equal(out.sequences, ref.sequences)
            agree, tol = len(ref.logits), 1e-5
        else:
            # bf16: the outputs may part only where plain's choice was within rounding of a tie; up to there
            # (and at that step, whose prefix is still shared) the logits agree within the tolerance
            tol = bf16_tolerance(torch.stack(ref.logits))
            p = ids.shape[1]
            differs = (out.sequences[0, p:] != ref.sequences[0, p:]).nonzero()
            agree = int(differs[0]) if differs.numel() else len(ref.logits)
            if agree < len(ref.logits):
                top2 = ref.scores[agree][0].topk(2).values
                assert top2[0] - top2[1] <= 2 * tol, f"{family} bf16 diverged at step {agree} without a near-tie"
        for a, b in zip(out.logits[: agree + 1], ref.logits[: agree + 1]):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        compared += agree
    assert compared >= 24  # most steps were compared, not cut short by a divergence


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_features_are_the_lm_head_input(family):
    """The draft head's features (the final hidden states) are exactly what the target's lm_head reads."""
    from transformers.cache_utils import DynamicCache

    model = tiny_model(family, seed=2)
    target = TargetModel(model)
    seen = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        ids = prompts(1, seed=3)[0]
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        features, logits = target.forward(ids, pos, None, DynamicCache(config=model.config), logits_to_keep=1)
    finally:
        handle.remove()
    assert features.shape == (1, ids.shape[1], model.config.hidden_size) and logits.shape == (1, 1, 32)
    assert logits.dtype == torch.float32
    assert torch.equal(seen[-1][:, -1], features[:, -1])
    if family == "llama":  # no post-processing: the logits are the lm_head of the features
        assert torch.equal(model.lm_head(features[:, -1:]), logits)


def test_a_transformed_lm_head_input_is_reported(caplog):
    """A model that changes the hidden state between the final norm and the lm_head (simulated with a pre-hook)
    still gets exact logits, but the draft head's features are not its lm_head input: that is reported."""
    model = tiny_model("llama", seed=4)
    draft = EagleDraftModel.from_target(model, seed=0)
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    try:
        ids = prompts(1, seed=5)[0]
        ref = model.generate(ids, do_sample=False, max_new_tokens=8)
        with caplog.at_level("WARNING"):
            out = model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=8)
    finally:
        handle.remove()
    assert torch.equal(out, ref)
    assert "lm_head input" in caplog.text
