"""`optimize_for_cpu`: the oneDNN prepacked linears agree with F.linear, switch on and off, survive copies and
weight updates, leave autograd alone, and keep tree speculation token-identical to plain generate."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import emulate_bf16, tiny_model
from torch import nn

from hf_eagle2 import Eagle3DraftModel, EagleDraftModel, optimize_for_cpu
from hf_eagle2.kernels.cpu import (NEVER, PackedLinear, bf16_is_emulated, fast_path_available, is_optimized,
                                   kernel_crossover, min_rows_of, packable)

pytestmark = pytest.mark.skipif(not fast_path_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_packed_linear_matches_f_linear(dtype, rows):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(dtype)
    x = torch.randn(2, rows, 64, dtype=dtype)
    ref = F.linear(x, lin.weight, lin.bias)
    optimize_for_cpu(lin, min_rows={dtype: 1})
    assert type(lin) is PackedLinear and isinstance(lin, nn.Linear)
    with torch.no_grad():
        out = lin(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref.detach(), atol=tol, rtol=tol)
    # the packed kernel ran where this CPU can pack the dtype (bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)
    assert (lin.__dict__["_packed_weight"]._packed is not None) == packable(dtype)
    assert packable(torch.float32)


def test_bf16_stays_on_f_linear_where_onednn_cannot_pack_it(monkeypatch):
    """A Zen 3 EPYC (AVX2) has no bf16 reorder: optimize_for_cpu must not measure or call it there."""
    monkeypatch.setattr("hf_eagle2.kernels.cpu.packable", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr("hf_eagle2.kernels.cpu.kernel_crossover", lambda dtype, shapes: 1)
    mixed = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32).to(torch.bfloat16))
    optimize_for_cpu(mixed)
    assert min_rows_of(mixed) == {torch.float32: 1, torch.bfloat16: NEVER}
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    for module in (mixed[1], optimize_for_cpu(nn.Linear(96, 32).to(torch.bfloat16), min_rows={torch.bfloat16: 1})):
        with torch.no_grad():  # even when told to pack from one row: F.linear, bit for bit
            assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
        assert module.__dict__["_packed_weight"]._packed is None


def test_switch_copy_weight_update_and_autograd():
    lin = nn.Linear(32, 16)
    optimize_for_cpu(lin, min_rows={torch.float32: 1})
    x = torch.randn(3, 32)
    with torch.no_grad():
        lin(x)  # builds the packed copy
        lin.weight.mul_(2.0)  # in-place update: the packed copy must follow
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    clone = copy.deepcopy(lin)
    assert "_packed_weight" not in clone.__dict__ and type(clone) is PackedLinear
    y = lin(x.requires_grad_())  # grad enabled: F.linear, so backward works and is exact
    y.sum().backward()
    assert lin.weight.grad is not None
    assert set(lin.state_dict()) == {"weight", "bias"}
    optimize_for_cpu(lin, enable=False)
    assert type(lin) is nn.Linear and "_packed_weight" not in lin.__dict__


def test_crossover_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_EAGLE2_CACHE", str(tmp_path))
    rows = kernel_crossover(torch.float32, [(64, 32)])
    assert rows in (1, 2, 4, 8, 16, 32, NEVER)
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 1
    assert kernel_crossover(torch.float32, [(64, 32)]) == rows  # read back, not re-measured


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tree_speculation_on_fast_kernels_equals_plain_on_fast_kernels(family):
    model = tiny_model(family, seed=5)
    draft = EagleDraftModel.from_target(model, seed=0)
    optimize_for_cpu(model, min_rows={torch.float32: 1})  # the packed kernel for every pass, whatever the machine
    assert is_optimized(model) and min_rows_of(model) == {torch.float32: 1}
    ids = torch.tensor([[5, 9, 3, 7, 11, 4]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=30)
    out = model.generate(ids, assistant_model=draft, tree="eagle2", tree_total_tokens=12, tree_depth=4, tree_top_k=4,
                         do_sample=False, max_new_tokens=30)  # fmt: skip
    assert torch.equal(out, ref)
    assert is_optimized(draft) and draft.binding.head_packed is not None  # the head followed the target
    optimize_for_cpu(model, enable=False)
    model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=4)
    assert not is_optimized(draft) and draft.binding.head_packed is None  # and back


def test_eagle3_head_follows_the_target_onto_fast_kernels():
    """An EAGLE-3 head (own lm_head, fc over three target layers) is packed with its target and exact there."""
    model = tiny_model("llama", seed=5, num_hidden_layers=4)  # EAGLE-3 reads layers 2, L // 2, L - 3
    draft = Eagle3DraftModel.from_target(model, seed=0)
    optimize_for_cpu(model, min_rows={torch.float32: 1})
    ids = torch.tensor([[5, 9, 3, 7, 11, 4]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=30)
    for tree in (dict(tree="eagle2", tree_total_tokens=12, tree_top_k=4), dict(tree="chain")):
        out = model.generate(ids, assistant_model=draft, tree_depth=4, do_sample=False, max_new_tokens=30, **tree)
        assert torch.equal(out, ref), tree
    assert type(draft.lm_head) is PackedLinear and type(draft.fc) is PackedLinear
    assert min_rows_of(draft) == {torch.float32: 1}
    optimize_for_cpu(model, enable=False)
    assert torch.equal(model.generate(ids, assistant_model=draft, tree="eagle2", do_sample=False, max_new_tokens=30),
                       model.generate(ids, do_sample=False, max_new_tokens=30))  # fmt: skip
    assert not is_optimized(draft)  # and back


def test_loading_a_bf16_target_warns_where_the_cpu_emulates_bf16(smollm2, monkeypatch, recwarn):
    from hf_eagle2.evaluation.assets import load_model

    emulate_bf16(monkeypatch, native=False)
    assert bf16_is_emulated()
    with pytest.warns(UserWarning, match="no AVX512-BF16 or AMX: bf16 is emulated"):
        model, _ = load_model("smollm2", dtype="bfloat16")
    assert model.dtype == torch.bfloat16  # a warning, not a refusal: the results are right, only slow
    recwarn.clear()
    load_model("smollm2", dtype="float32")
    emulate_bf16(monkeypatch, native=True)
    assert not bf16_is_emulated()
    load_model("smollm2", dtype="bfloat16")
    assert not [w for w in recwarn if "bf16 is emulated" in str(w.message)]
