"""Tree-aware KV-cache pruning over `transformers` caches.

After a tree pass, every layer holds the q tree entries after the prefix. `prune_tree_cache` keeps the root and
the accepted path, moves them to the front of the tree block (they sit at non-contiguous positions) and crops the
rest, for every layer, so that the cache again holds exactly prefix + accepted tokens.

Handled layer kinds: `DynamicLayer`, `DynamicSlidingWindowLayer` (Gemma3; needs `cache.activate_past_recording()`
before the tree pass, so no entry is evicted before we know which ones to keep), `StaticLayer` (the
`StaticCache` path for GPU use) and `StaticSlidingWindowLayer` while the sequence fits in its window.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from ..kernels.reserved_cache import shared_store


def check_cache_supported(cache: Cache) -> None:
    for layer in cache.layers:
        if not isinstance(layer, (DynamicLayer, StaticLayer)) or type(layer).__name__.startswith("Quant"):
            raise NotImplementedError(
                f"tree speculation cannot prune a {type(layer).__name__}; use the default dynamic cache or a StaticCache"
            )


def _tree_start(layer, num_tree: int) -> int:
    """Index (in the layer's key tensor) of the first of the `num_tree` entries written by the tree pass."""
    if isinstance(layer, StaticSlidingWindowLayer):
        if layer.cumulative_length_int > layer.max_cache_len:
            raise NotImplementedError(
                "a StaticCache sliding-window layer cannot be pruned once the sequence exceeds its window; "
                "use the default dynamic cache for long sequences with sliding-window models"
            )
        return layer.cumulative_length_int - num_tree
    if isinstance(layer, StaticLayer):
        return int(layer.cumulative_length) - num_tree
    return layer.keys.shape[-2] - num_tree


def prune_tree_cache(
    cache: Cache, keep: torch.LongTensor, num_tree: int, holes: torch.LongTensor | None = None,
    identity: bool | None = None, compact: bool | None = None, tree_start: int | None = None,
) -> None:  # fmt: skip
    """Keeps, of the last `num_tree` tree entries of every layer, the nodes `keep` (B, n_keep), in that order.

    keep[b] lists tree node indices (root first, then the accepted path by depth). In a batch, a row that
    accepted fewer nodes starts its block with holes[b] filler entries (masked out by the caller). Full-attention
    layers keep such holes in place; sliding-window layers close them up (each row's entries are shifted so
    that its last `window - 1` real tokens stay contiguous), because a sliding layer only keeps a fixed number
    of slots and a hole must not push a real token out of the window.

    identity (keep[b] == 0..n_keep-1 for every row) and compact (some row has holes) may be given by a caller that
    knows them on the host; otherwise they are read from the tensors (two host syncs). tree_start: where the
    tree's entries start in full-attention static layers (the entries cached before the pass), when the caller
    knows it; otherwise each static layer's tensor length is read (one host sync per layer).
    """
    bsz, n_keep = keep.shape
    drop = num_tree - n_keep
    if drop < 0:
        raise ValueError("cannot keep more entries than the tree pass wrote")
    if identity is None:
        identity = bool((keep == torch.arange(n_keep, device=keep.device)).all())
    if compact is None:
        compact = holes is not None and bool((holes > 0).any())
    index = {}  # (start, device) -> (B, 1, n_keep, 1) gather index: built once, not once per layer
    store = shared_store(cache)  # layers whose entries live in one tensor: all moved by one gather
    if store is not None and store is getattr(cache, "_hf_eagle2_store", None):  # a stacked static cache
        if not identity:
            start = tree_start if tree_start is not None else _tree_start(cache.layers[0], num_tree)
            store.move(start, keep.to(store.data.device))
        if drop:  # every layer is a full-attention StaticLayer: their lengths drop at once
            torch._foreach_sub_([layer.cumulative_length for layer in cache.layers], drop)
        return
    in_store = set() if store is None else {id(layer) for layer in cache.layers
                                            if getattr(getattr(layer, "buffer", None), "store", None) is store}
    if store is not None and not identity:
        length = next(layer for layer in cache.layers if id(layer) in in_store).buffer.length
        store.move(length - num_tree, keep.to(store.data.device))
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        known = tree_start is not None and type(layer) is StaticLayer  # no host read of its length
        start = tree_start if known else _tree_start(layer, num_tree)
        if not identity and id(layer) not in in_store:
            where = (start, layer.keys.device)
            if where not in index:
                index[where] = (start + keep).to(layer.keys.device).view(bsz, 1, n_keep, 1)
            for tensor in (layer.keys, layer.values):
                heads, dim = tensor.shape[1], tensor.shape[-1]
                moved = tensor.gather(2, index[where].expand(bsz, heads, n_keep, dim))
                tensor[:, :, start : start + n_keep] = moved
        if compact and getattr(layer, "is_sliding", False):
            if not isinstance(layer, DynamicSlidingWindowLayer):
                raise NotImplementedError("batched tree speculation with a static sliding-window cache is not supported")
            _close_holes(layer, start, n_keep, holes.to(layer.keys.device))
        if isinstance(layer, DynamicSlidingWindowLayer) or drop:
            layer.crop(-drop)  # crop(0) also trims a recording sliding layer back to its window


def _close_holes(layer, start: int, n_keep: int, holes: torch.LongTensor) -> None:
    """Row b's block at [start, start + n_keep) begins with holes[b] fillers: shift the entries before its real
    part right by holes[b], so each row's real entries end contiguous at the block's end (O(window) work)."""
    bsz = holes.numel()
    end = start + n_keep
    slots = torch.arange(end, device=holes.device).view(1, end)
    shift = holes.view(bsz, 1)
    src = torch.where(slots >= start + shift, slots, (slots - shift).clamp(min=0))
    for tensor in (layer.keys, layer.values):
        heads, dim = tensor.shape[1], tensor.shape[-1]
        moved = tensor[:, :, :end].gather(2, src.view(bsz, 1, end, 1).expand(bsz, heads, end, dim))
        tensor[:, :, :end] = moved
