"""A training-time-test pass's attention in one causal kernel (`unrolled_attention`) is the masked attention it
replaces: values and gradients, grouped-query heads, short rows, bf16, and through both heads' forwards."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from hf_eagle2 import Eagle3DraftModel, EagleDraftModel
from hf_eagle2.kernels.unrolled_attention import UnrolledMask, unrolled_attention


def masked_reference(q, k, v, passes):
    """Softmax attention under the dense boolean mask, written out (no kernel choice)."""
    length = q.shape[2]
    groups = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~UnrolledMask(passes).dense(length), float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def random_qkv(heads, kv_heads, length, passes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, heads, length, 8), (2, kv_heads, passes * length, 8), (2, kv_heads, passes * length, 8))
    return [torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for shape in shapes]


@pytest.mark.parametrize("passes", [2, 3, 4, 7])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("length", [1, 3, 11])
def test_unrolled_attention_is_the_masked_softmax(passes, heads, kv_heads, length):
    q, k, v = random_qkv(heads, kv_heads, length, passes, torch.float64)
    ref, out = masked_reference(q, k, v, passes), unrolled_attention(q, k, v, passes)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((ref * weights).sum(), (q, k, v)),
                    torch.autograd.grad((out * weights).sum(), (q, k, v)), strict=True):  # fmt: skip
        torch.testing.assert_close(b, a, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("scale", [6, 20])
def test_unrolled_attention_in_bf16_is_about_as_close_as_the_masked_kernel(scale):
    """The sink's log-mass rides in two bf16 channels (high and low halves). On bf16 inputs with scores of a
    trained head's size (tens), the result is within 2.5x the masked kernel's own distance from the exact
    attention of the same inputs (it rounds twice: the kernel's bf16 output, then the sum); one channel alone
    would be 4-12x."""
    q, k, v = random_qkv(9, 3, 64, 3, torch.float64, seed=2)
    q, k, v = (q * scale).bfloat16(), k.bfloat16(), v.bfloat16()
    exact = masked_reference(q.double(), k.double(), v.double(), 3)
    mask = UnrolledMask(3).dense(64).view(1, 1, 64, 192)
    kernel = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ours = unrolled_attention(q, k, v, 3)
    assert ours.dtype == torch.bfloat16
    assert (ours.double() - exact).abs().max() <= 2.5 * (kernel.double() - exact).abs().max()


def test_unrolled_attention_needs_every_pass_keys():
    q, k, v = random_qkv(4, 4, 5, 3, torch.float32)
    with pytest.raises(ValueError, match="needs 3 x 5 keys and values"):
        unrolled_attention(q, k[:, :, :10], v[:, :, :10], 3)


@pytest.mark.parametrize("head_class", [EagleDraftModel, Eagle3DraftModel])
def test_heads_run_an_unrolled_pass_as_under_its_dense_mask(head_class):
    """Pass 3 of an unrolled step through the head's forward, over the cache of passes 1 and 2."""
    target = tiny_model("llama", num_hidden_layers=8)
    head = head_class.from_target(target, seed=0)
    g = torch.Generator().manual_seed(0)
    steps = 9
    width = 3 * 64 if head_class is Eagle3DraftModel else 64
    feats = head.project_features(torch.randn(1, steps, width, generator=g))
    embeds = head.embed(torch.randint(3, 32, (1, steps), generator=g))
    pos = torch.arange(steps)[None]
    with torch.no_grad():
        pred, past = head(None, feats, pos, inputs_embeds=embeds)
        pred, kv = head(None, pred, pos, UnrolledMask(2), past, inputs_embeds=embeds)
        past = (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
        ours, _ = head(None, pred, pos, UnrolledMask(3), past, inputs_embeds=embeds)
        dense, _ = head(None, pred, pos, UnrolledMask(3).dense(steps).view(1, 1, steps, 3 * steps), past,
                        inputs_embeds=embeds)  # fmt: skip
    torch.testing.assert_close(ours, dense, rtol=1e-5, atol=1e-5)
