"""`FusedLinear`: q/k/v and gate/up as one GEMM each agree with the separate linears, follow weight changes (in place
or by assignment), pass gradients to every source, take the packed path under `optimize_for_cpu`, and change a
head's forward by float rounding only."""

import copy

import pytest
import torch
from torch import nn

from hf_eagle2 import EagleDraftModel
from hf_eagle2.kernels.cpu import PackedLinear, fast_path_available, optimize_for_cpu
from hf_eagle2.kernels.fused_linear import FusedLinear


def linears(bias=True):
    torch.manual_seed(0)
    return nn.Linear(32, 48, bias=bias), nn.Linear(32, 16, bias=bias), nn.Linear(32, 16, bias=bias)


def separate(x, mods):
    return torch.cat([m(x) for m in mods], -1)


@pytest.mark.parametrize("bias", [True, False])
def test_fused_output_is_the_separate_linears_concatenated(bias):
    mods, fused, x = linears(bias), FusedLinear(), torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, mods), separate(x, mods), rtol=1e-6, atol=1e-6)


def test_the_cache_follows_in_place_writes_and_reassignment():
    mods, fused, x = linears(), FusedLinear(), torch.randn(3, 32)
    with torch.no_grad():
        fused(x, mods)
        mods[1].weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(fused(x, mods), separate(x, mods))
        mods[2].weight = nn.Parameter(torch.randn(16, 32))  # a new tensor
        torch.testing.assert_close(fused(x, mods), separate(x, mods))
        mods[0].bias.zero_()
        torch.testing.assert_close(fused(x, mods), separate(x, mods))


def test_gradients_reach_every_source_and_deep_copies_start_empty():
    mods, fused, x = linears(), FusedLinear(), torch.randn(4, 32)
    fused(x, mods).square().sum().backward()
    grads = [m.weight.grad.clone() for m in mods]
    for m in mods:
        m.weight.grad = None
    separate(x, mods).square().sum().backward()
    for m, g in zip(mods, grads):
        torch.testing.assert_close(m.weight.grad, g)
    with torch.no_grad():
        fused(x, mods)
    assert copy.deepcopy(fused)._weight is None


@pytest.mark.skipif(not fast_path_available(), reason="this torch build has no oneDNN")
def test_packed_sources_put_the_fused_weight_on_the_packed_path():
    mods = linears()
    for m in mods:
        optimize_for_cpu(m, min_rows={torch.float32: 1})
        assert type(m) is PackedLinear
    fused, x = FusedLinear(), torch.randn(2, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, mods), separate(x, mods), rtol=1e-5, atol=1e-5)
    assert fused._packed._packed is not None  # the oneDNN copy was built


def test_a_heads_forward_is_unchanged_but_for_rounding():
    """The head's attention (q/k/v fused, q/k rotated without a concat) and MLP (gate/up fused) against the same
    forward with the fusion undone (each linear on its own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()  # fmt: skip
    head = EagleDraftModel.from_target(target, seed=0).bind(target).eval()
    ids, feats = torch.randint(0, 64, (2, 6)), torch.randn(2, 6, 32)
    pos = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        fused_out = head(ids, feats, pos)[0]

    def unfused(x, mods):
        return torch.cat([m(x) for m in mods], -1)

    layer = head.layers[0]
    layer.self_attn._qkv = unfused
    layer.mlp._gate_up = unfused
    with torch.no_grad():
        ref = head(ids, feats, pos)[0]
    torch.testing.assert_close(fused_out, ref, rtol=1e-5, atol=1e-5)
