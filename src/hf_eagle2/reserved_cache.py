"""A dynamic KV cache that keeps spare room, so a decode step writes its entry in place instead of copying the cache.

`DynamicLayer.update` grows keys and values by `torch.cat`, which copies every cached entry on every forward.
For one row of a few hundred tokens that is noise; for a batch of long rows it is a large part of the step: a
64-row extraction batch of ~1,000-token prompts holds up to ~2 GB of SmolLM2 keys and values (23 kB per token in
bf16), copied on every decode step (`examples/extraction_cost.py --reserve none,256` times a whole batch both
ways). `ReservedLayer` stores them
in buffers (B, heads, capacity, D) and hands attention views (B, heads, length, D) of the filled part; a buffer
grows by `reserve` slots at a time, so the copy happens once per `reserve` tokens instead of once per step.

The views are the same values a `DynamicLayer` would hold, attended over the same length, so the outputs are the
same up to kernel rounding (SDPA reads a strided view instead of a contiguous tensor). `reserved_cache` builds a
`DynamicCache` for a model with every full-attention layer reserved (sliding-window layers stay as they are, they
never hold more than their window); `generate` takes it through `cache=` like any other cache, and
`prune_tree_cache` prunes it (it moves entries in place and crops, which only shortens the views).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# slots a buffer gains when it is full: a 32-step generate call of extraction grows it at most once
DEFAULT_RESERVE = 256


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of larger buffers (B, heads, capacity, D)."""

    def __init__(self, reserve: int = DEFAULT_RESERVE):
        super().__init__()
        if reserve < 1:
            raise ValueError(f"reserve must be a positive number of slots, not {reserve}")
        self.reserve = reserve
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = key_states.new_empty(*key_states.shape[:2], 0, key_states.shape[-1])
        self._value_buffer = value_states.new_empty(*value_states.shape[:2], 0, value_states.shape[-1])
        self.length = 0

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._key_buffer = self._grown(self._key_buffer, end + self.reserve)
            self._value_buffer = self._grown(self._value_buffer, end + self.reserve)
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _grown(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = buffer.new_empty(*buffer.shape[:2], capacity, buffer.shape[-1])
        grown[:, :, : self.length] = buffer[:, :, : self.length]
        return grown

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, not {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._refresh_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._key_buffer = self._key_buffer.repeat_interleave(repeats, dim=0)
            self._value_buffer = self._value_buffer.repeat_interleave(repeats, dim=0)
            self._refresh_views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:  # the spare room comes along, so the next step still writes in place
            self._key_buffer = self._key_buffer[indices]
            self._value_buffer = self._value_buffer[indices]
            self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._key_buffer = self._key_buffer.index_select(0, beam_idx.to(self._key_buffer.device))
            self._value_buffer = self._value_buffer.index_select(0, beam_idx.to(self._value_buffer.device))
            self._refresh_views()

    def offload(self):
        raise NotImplementedError("a ReservedLayer keeps its buffers on their device; use DynamicCache(offloading=True)")

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self.length = 0
        super().reset()


def reserved_cache(config, reserve: int = DEFAULT_RESERVE) -> DynamicCache:
    """`DynamicCache(config=config)` with each plain full-attention layer replaced by a `ReservedLayer`."""
    cache = DynamicCache(config=config)
    cache.layers = [ReservedLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def concat_rows(caches: list[DynamicCache]) -> DynamicCache:
    """The first of `caches` (all reserved, all layers holding the same number of entries and slots) extended to hold
    every cache's rows in order, along the batch: how rows prefilled in separate forwards become one batch's cache.
    The other caches are emptied layer by layer as their rows move, so the rows are held twice only for one layer at
    a time."""
    first = caches[0]
    if len(caches) == 1:
        return first
    for index, layer in enumerate(first.layers):
        parts = [cache.layers[index] for cache in caches]
        if not all(type(p) is ReservedLayer and p.is_initialized for p in parts):
            raise ValueError("concat_rows joins caches whose every layer is an initialized ReservedLayer")
        if len({(p.length, p._key_buffer.shape[-2]) for p in parts}) != 1:
            raise ValueError("concat_rows joins caches of equal lengths and reserves")
        layer._key_buffer = torch.cat([p._key_buffer for p in parts])
        layer._value_buffer = torch.cat([p._value_buffer for p in parts])
        layer._refresh_views()
        for p in parts[1:]:
            p.reset()
    return first
