"""The head's fewer-kernel forms (one-op RMSNorm, three-op rotary, round-level rotary tables) compute what the
transformers modules they replace compute, up to float rounding."""

import torch
from conftest import tiny_model
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from hf_eagle2 import EagleDraftModel
from hf_eagle2.heads.modeling_eagle import EagleRMSNorm, rotate


def test_rms_norm_is_llamas():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g)
    ours, theirs = EagleRMSNorm(64, eps=1e-6), LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64, generator=g))
        theirs.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours(x.bfloat16()), theirs(x.bfloat16()))  # mixed dtypes: the stock path


def test_rotate_is_apply_rotary_pos_emb():
    model = tiny_model("llama")
    head = EagleDraftModel.from_target(model, seed=0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 7, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)  # (B, T, heads, D)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 40, 41, 42, 300]])
    cos, sin = LlamaRotaryEmbedding(config=head.config)(q, pos)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got = rotate(torch.cat([q, k], dim=2), *head.rotary(q, pos)).transpose(1, 2)
    torch.testing.assert_close(got[:, :4], want_q)
    torch.testing.assert_close(got[:, 4:], want_k)


def test_precomputed_rotary_gives_the_same_head_step():
    model = tiny_model("qwen2")
    head = EagleDraftModel.from_target(model, seed=0).eval()
    g = torch.Generator().manual_seed(2)
    ids, feats = torch.randint(3, 32, (2, 3), generator=g), torch.randn(2, 3, 64, generator=g)
    pos = torch.tensor([[5, 5, 5], [8, 8, 8]])
    table = head.rotary(feats, torch.tensor([[3, 4, 5, 6], [6, 7, 8, 9]]))
    with torch.no_grad():
        plain, _ = head(ids, feats, pos)
        shared, _ = head(ids, feats, None, cos_sin=(table[0][:, 2:3], table[1][:, 2:3]))
    torch.testing.assert_close(shared, plain)
