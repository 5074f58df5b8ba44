"""Small constant tensors the round reuses (aranges, identities, fill values), made once per shape and device.

Each eager op is a kernel launch on an accelerator and a dispatch on a CPU; a round that rebuilt its index
vectors every time spent a tenth of its ops on them. The tensors are shared: never write into them."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def arange(n: int, device: torch.device) -> torch.LongTensor:
    """(n,) 0 .. n - 1."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=32)
def eye(n: int, device: torch.device) -> torch.BoolTensor:
    """(n, n) bool identity."""
    return torch.eye(n, dtype=torch.bool, device=device)


@functools.lru_cache(maxsize=32)
def scalar(value: float | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor (expand it to any shape: `torch.cat` and `torch.where` take it as a broadcast value)."""
    return torch.full((), value, dtype=dtype, device=device)
