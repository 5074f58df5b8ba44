"""The attention of a training-time-test pass, in one causal kernel.

Pass s of an unrolled training step (`training.train.eagle_loss`) feeds the head its own prediction at every
position at once. Its queries attend the true pairs strictly before the drafted run and the head's own keys of
each earlier pass on the way to the same draft, as tree depth s does at inference. With all passes' keys
(B, H_kv, s * T, D) end to end, query i attends

    pass-1 keys j <= i - (s - 1)           (a causal band)
    pass-r key  i - (s - r), r = 2..s      (one key per later pass; pass s's own is i itself)

A boolean (T, s * T) mask says this, but a masked kernel then scores all s * T keys of every query, s times the
work of pass 1's causal attention. Here the s - 1 per-query keys are scored apart (a dot product each) and their
softmax mass enters the causal kernel as one extra "sink" key in front of the band: the query carries the log of
that mass in two extra channels (a high and a low half, so bf16 keeps it to ~fp32 precision) that only the sink's
key reads, and the sink's value is a unit channel, which returns the share of the mass the per-query keys get.
Query rows with no band key yet (i < s - 2) attend the per-query keys alone. The result is the masked softmax's,
gradients included (the same to float64 rounding, `tests/test_unrolled_attention.py`). EAGLE-3 training steps
(3 passes, the band's rows, bf16 autocast, 2 cores) ran 1.16-1.20x faster with it than under the dense mask, the
same batches alternating in one process (`python benchmarks/unrolled_attention_cost.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class UnrolledMask:
    """The attention mask of training-time-test pass `passes` (>= 2), as `unrolled_attention` reads it: passed to
    the head's forward in place of a boolean mask, over a cache of the earlier passes' (keys, values)."""

    passes: int

    def dense(self, length: int, device=None) -> torch.Tensor:
        """The same mask as a boolean (length, passes * length) tensor (True = attend)."""
        i = torch.arange(length, device=device)
        blocks = [i.view(1, -1) <= i.view(-1, 1) - (self.passes - 1)]
        blocks += [i.view(1, -1) == i.view(-1, 1) - (self.passes - r) for r in range(2, self.passes + 1)]
        return torch.cat(blocks, dim=1)


def unrolled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, passes: int,
                       scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """q (B, H, T, D); k, v (B, H_kv, passes * T, D): pass 1's keys and values, then each later pass's.
    Returns (B, H, T, D): scaled dot-product attention under `UnrolledMask(passes).dense(T)`."""
    bsz, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    if passes < 2 or k.shape[2] != passes * length or v.shape[2] != passes * length:
        raise ValueError(f"unrolled attention of pass {passes} needs {passes} x {length} keys and values (all "
                         f"passes' so far), got {k.shape[2]} and {v.shape[2]}")  # fmt: skip
    scale = dim**-0.5 if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)
    i = torch.arange(length, device=q.device)
    # the per-query keys: pass r's key and value at i - (passes - r), scored in fp32 as the kernel accumulates
    grouped = q.reshape(bsz, kv_heads, heads // kv_heads, length, dim).to(wide)
    scores, values = [], []
    for r in range(2, passes + 1):
        shift = passes - r
        key = F.pad(k[:, :, (r - 1) * length : r * length], (0, 0, shift, 0))[:, :, :length]
        value = F.pad(v[:, :, (r - 1) * length : r * length], (0, 0, shift, 0))[:, :, :length]
        score = (grouped * key.unsqueeze(2).to(wide)).sum(-1) * scale  # (B, H_kv, G, T)
        scores.append(score.masked_fill(i < shift, float("-inf")))
        values.append(value.unsqueeze(2).to(wide))
    own_scores = torch.stack(scores, dim=-1)  # (B, H_kv, G, T, passes - 1)
    weights = torch.softmax(own_scores, dim=-1)
    own = sum(weights[..., n : n + 1] * value for n, value in enumerate(values)).reshape(bsz, heads, length, dim)
    first = min(passes - 2, length)  # rows before it see no pass-1 key: the per-query keys alone
    if first == length:
        return own.to(q.dtype)
    # rows first.. over [sink, pass-1 keys 0..n-2]: square and causal, so query i reaches pass-1 key i - (passes - 1)
    n = length - first
    sink = (torch.logsumexp(own_scores, dim=-1) / scale).reshape(bsz, heads, length, 1)[:, :, first:]
    high = sink.to(q.dtype)
    low = (sink - high.to(wide)).to(q.dtype)
    band_k, band_v = k[:, :, : n - 1], v[:, :, : n - 1]
    zeros = band_k.new_zeros(bsz, kv_heads, n - 1, 2)
    sink_k = torch.cat([band_k.new_zeros(bsz, kv_heads, 1, dim), band_k.new_ones(bsz, kv_heads, 1, 2)], dim=-1)
    sink_v = torch.cat([band_v.new_zeros(bsz, kv_heads, 1, dim), band_v.new_ones(bsz, kv_heads, 1, 1),
                        band_v.new_zeros(bsz, kv_heads, 1, 1)], dim=-1)  # fmt: skip
    out = F.scaled_dot_product_attention(
        torch.cat([q[:, :, first:], high, low], dim=-1),
        torch.cat([sink_k, torch.cat([band_k, zeros], dim=-1)], dim=2),
        torch.cat([sink_v, torch.cat([band_v, zeros.to(band_v.dtype)], dim=-1)], dim=2),
        is_causal=True, scale=scale, enable_gqa=kv_heads != heads,
    )  # fmt: skip
    band = out[..., :dim].to(wide) + out[..., dim : dim + 1].to(wide) * own[:, :, first:]
    return torch.cat([own[:, :, :first], band], dim=2).to(q.dtype)
