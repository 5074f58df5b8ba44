"""Keys and values with spare room, so a forward writes its entries in place instead of copying the whole cache.

`DynamicLayer.update` grows keys and values by `torch.cat`, which copies every cached entry on every forward.
For one row of a few hundred tokens that is noise; for a batch of long rows it is a large part of the step: a
64-row extraction batch of ~1,000-token prompts holds up to ~2 GB of SmolLM2 keys and values (23 kB per token in
bf16), copied on every decode step (`benchmarks/extraction_cost.py --reserve none,256` times a whole batch both
ways). A `KVBuffer` holds them in buffers (B, heads, capacity, D) and hands attention views (B, heads, length, D)
of the filled part; a full buffer grows by `reserve` slots, so the copy happens once per `reserve` tokens instead
of once per step. The EAGLE head caches its context in one; `ReservedLayer` is the transformers cache layer
around one, for the target.

The views are the same values a `DynamicLayer` would hold, attended over the same length, so the outputs are the
same up to kernel rounding (SDPA reads a strided view instead of a contiguous tensor). `reserved_cache` builds a
`DynamicCache` for a model with every full-attention layer reserved (sliding-window layers stay as they are, they
never hold more than their window); `generate` takes it through `cache=` like any other cache (beam reordering
included, offloading refused), and `prune_tree_cache` prunes it (it moves entries in place and crops, which only
shortens the views).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# slots a buffer gains when it is full: a 32-step generate call of extraction grows it at most once
DEFAULT_RESERVE = 256


class KVBuffer:
    """Keys and values (B, H_kv, capacity, D), the first `length` positions filled.

    `append` writes a step's T entries after the filled ones and returns views over all of them, so a step copies
    only its own entries; a full buffer grows to hold `reserve` more slots than it needs. The EAGLE head's layer
    caches its context in one (`EagleAttention`; the drafter rolls a round's tree back with `truncate`), and
    `ReservedLayer` wraps one for the target."""

    def __init__(self, reserve: int = DEFAULT_RESERVE):
        if reserve < 1:
            raise ValueError(f"reserve must be a positive number of slots, not {reserve}")
        self.keys: torch.Tensor | None = None  # the whole buffers
        self.values: torch.Tensor | None = None
        self.length = 0
        self.reserve = reserve

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: (B, H_kv, T, D) -> views (B, H_kv, length + T, D) over everything written so far."""
        end = self.length + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self.keys, self.values = self._grown(self.keys, keys, end), self._grown(self.values, values, end)
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.length = end
        return self.views()

    def _grown(self, buffer: torch.Tensor | None, new: torch.Tensor, end: int) -> torch.Tensor:
        grown = new.new_empty(*new.shape[:2], end + self.reserve, new.shape[3])
        if buffer is not None and self.length:
            grown[:, :, : self.length] = buffer[:, :, : self.length]
        return grown

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def select_rows(self, indices: torch.Tensor) -> None:
        """Keeps (or repeats, reorders) the rows `indices` (n,), spare slots included."""
        self.keys = self.keys.index_select(0, indices.to(self.keys.device))
        self.values = self.values.index_select(0, indices.to(self.values.device))


class StaticKV(KVBuffer):
    """A `KVBuffer` of fixed capacity for compiled draft steps: (B, H_kv, capacity, D) buffers that a step writes
    at the tensor positions `write_pos` (T,) and attends over whole (its mask hides what is not its context), so
    every shape and every Python value a compiled step sees stays the same from round to round. `length` (the
    context slots) is kept by the caller, outside compiled code; `ensure` doubles the capacity from `reserve` (a new
    shape: one recompilation per doubling, not per round)."""

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, write_pos: torch.LongTensor) -> "StaticKV":
        """A view of given buffers (inside a compiled step: built from its tensor arguments)."""
        kv = cls.__new__(cls)
        kv.keys, kv.values, kv.write_pos, kv.length, kv.reserve = keys, values, write_pos, 0, DEFAULT_RESERVE
        return kv

    def ensure(self, like: torch.Tensor, slots: int) -> None:
        """Capacity for `slots` positions (like: (B, H_kv, *, D) entries of the right rows, dtype and device)."""
        if self.keys is not None and slots <= self.keys.shape[2]:
            return
        capacity = self.reserve if self.keys is None else self.keys.shape[2]
        while capacity < slots:
            capacity *= 2
        keys = like.new_zeros(*like.shape[:2], capacity, like.shape[3])
        values = like.new_zeros(*like.shape[:2], capacity, like.shape[3])
        if self.keys is not None:
            keys[:, :, : self.keys.shape[2]] = self.keys
            values[:, :, : self.values.shape[2]] = self.values
        self.keys, self.values = keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes (B, H_kv, T, D) entries at `write_pos` (T,); returns the whole buffers."""
        self.keys.index_copy_(2, self.write_pos, keys)
        self.values.index_copy_(2, self.write_pos, values)
        return self.keys, self.values

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values


class KVStore:
    """One tensor (L, 2, B, H_kv, capacity, D) holding the keys and values of L layers, so that an operation on
    every layer's entries (pruning a tree pass: `move`) is one kernel, not two per layer. Created by the first
    layer that writes; grows for all layers at once (`grow`)."""

    def __init__(self, num_layers: int, reserve: int = DEFAULT_RESERVE):
        self.num_layers, self.reserve = num_layers, reserve
        self.data: torch.Tensor | None = None

    def fits(self, keys: torch.Tensor) -> bool:
        """Whether a layer's (B, H_kv, T, D) entries can live here (same rows, heads, width, dtype, device)."""
        d = self.data
        return d is None or (d.shape[2:4] == keys.shape[:2] and d.shape[-1] == keys.shape[-1] and d.dtype == keys.dtype
                             and d.device == keys.device)  # fmt: skip

    def grow(self, like: torch.Tensor, end: int) -> None:
        """Makes room for `end` slots per layer (plus `reserve`), keeping what every layer holds."""
        if self.data is not None and end <= self.data.shape[-2]:
            return
        old = self.data
        self.data = like.new_empty(self.num_layers, 2, *like.shape[:2], end + self.reserve, like.shape[-1])
        if old is not None:
            self.data[..., : old.shape[-2], :] = old

    def move(self, start: int, keep: torch.LongTensor) -> None:
        """Every layer: entries start + keep[b] (B, n) move to start .. start + n, in that order (two kernels)."""
        num, _, bsz, heads, _, dim = self.data.shape
        n = keep.shape[1]
        index = (start + keep).view(1, 1, bsz, 1, n, 1).expand(num, 2, bsz, heads, n, dim)
        self.data[..., start : start + n, :] = self.data.gather(4, index)


class StackedBuffer(KVBuffer):
    """A `KVBuffer` whose buffers are layer `index` of a shared `KVStore` (falls back to buffers of its own if its
    entries do not fit the store, or when rows are selected: then it no longer takes part in `KVStore.move`)."""

    def __init__(self, store: KVStore, index: int):
        super().__init__(store.reserve)
        self.store, self.index = store, index

    @property
    def stacked(self) -> bool:
        """Whether this layer's buffers are (still) its slice of the store's current tensor."""
        data = None if self.store is None else self.store.data
        return data is not None and self.keys is not None and self.keys.data_ptr() == data[self.index, 0].data_ptr()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + keys.shape[2]
        if self.store is not None and self.store.fits(keys):
            self.store.grow(keys, end)
            self.keys, self.values = self.store.data[self.index, 0], self.store.data[self.index, 1]
        elif self.store is not None:  # another shape than the store's: this layer keeps its own buffers
            self.store = None
        return super().append(keys, values)

    def select_rows(self, indices: torch.Tensor) -> None:
        self.store = None
        super().select_rows(indices)


def stack_empty_cache(cache, reserve: int = DEFAULT_RESERVE) -> bool:
    """Turns an empty `DynamicCache` (the one `generate` makes when none is passed) into one whose plain layers keep
    their keys and values in one `KVStore`, in place (the object the caller holds stays the cache that fills).
    Returns whether it did; caches that hold entries, offload, or have no plain layers are left as they are."""
    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        return False
    if any(getattr(layer, "is_initialized", False) for layer in cache.layers):
        return False
    plain = [i for i, layer in enumerate(cache.layers) if type(layer) is DynamicLayer]
    if not plain:
        return False
    store = KVStore(len(plain), reserve)
    for index, i in enumerate(plain):
        layer = ReservedLayer(reserve)
        layer.buffer = StackedBuffer(store, index)
        cache.layers[i] = layer
    return True


def full_attention_static(cache) -> bool:
    """Whether every layer of `cache` is a plain full-attention `StaticLayer` (not sliding): the caches whose
    layers can share one `KVStore` and whose verify pass can compile."""
    from transformers.cache_utils import StaticLayer

    return cache is not None and bool(cache.layers) and all(type(layer) is StaticLayer for layer in cache.layers)


def static_store(cache) -> KVStore | None:
    """The `KVStore` of a static cache stacked by `stack_static_cache`, while all its layers still view it."""
    store = getattr(cache, "_hf_eagle2_store", None)
    if store is None or not all(getattr(layer, "keys", None) is not None and
                                layer.keys.data_ptr() == store.data[i, 0].data_ptr()
                                for i, layer in enumerate(cache.layers)):  # fmt: skip
        return None
    return store


def stack_static_cache(cache) -> KVStore | None:
    """Moves the keys and values of a `StaticCache` whose layers are all initialized full-attention `StaticLayer`s
    of one shape into one `KVStore` (each layer's tensors become views of it, marked static for the compiler), so
    that pruning a tree pass is one gather and one copy instead of two per layer. Returns the store (the one made
    earlier, if the layers still view it), or None where the cache does not qualify."""
    layers = cache.layers
    if not full_attention_static(cache) or not all(layer.is_initialized for layer in layers):
        return None
    store = static_store(cache)
    if store is not None:
        return store
    first = layers[0].keys
    if any(layer.keys.shape != first.shape or layer.values.shape != first.shape or layer.keys.dtype != first.dtype
           or layer.keys.device != first.device for layer in layers):  # fmt: skip
        return None
    store = KVStore(len(layers), reserve=1)
    store.data = torch.stack([torch.stack([layer.keys, layer.values]) for layer in layers])
    for i, layer in enumerate(layers):
        layer.keys, layer.values = store.data[i, 0], store.data[i, 1]
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)
    cache._hf_eagle2_store = store
    return store


def shared_store(cache) -> KVStore | None:
    """The `KVStore` all of `cache`'s stacked layers write to, when every layer of the store is in it, stacked and
    equally long (then `KVStore.move` prunes them all at once); else None. A static cache's store
    (`stack_static_cache`) counts while its layers still view it."""
    if getattr(cache, "_hf_eagle2_store", None) is not None:
        return static_store(cache)
    buffers = [layer.buffer for layer in cache.layers if isinstance(getattr(layer, "buffer", None), StackedBuffer)]
    if not buffers or buffers[0].store is None:
        return None
    store = buffers[0].store
    if len(buffers) != store.num_layers or any(not b.stacked or b.store is not store for b in buffers):
        return None
    return store if len({b.length for b in buffers}) == 1 else None


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of a `KVBuffer`'s filled part."""

    def __init__(self, reserve: int = DEFAULT_RESERVE):
        super().__init__()
        self.buffer = KVBuffer(reserve)

    def _refresh_views(self) -> None:
        self.keys, self.values = self.buffer.views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.buffer.append(key_states, value_states)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, not {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.buffer.truncate(max(0, self.buffer.length + tokens_to_remove))
        self._refresh_views()

    def _select_rows(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self.buffer.keys is not None:  # the spare slots come along
            self.buffer.select_rows(indices)
            self._refresh_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self.buffer.keys is not None:
            rows = torch.arange(self.buffer.keys.shape[0], device=self.buffer.keys.device)
            self._select_rows(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def offload(self):
        raise NotImplementedError(
            "a ReservedLayer keeps its buffers on their device; use DynamicCache(offloading=True)")

    def reset(self) -> None:
        self.buffer = KVBuffer(self.buffer.reserve)
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
        if len({(p.buffer.length, p.buffer.keys.shape[-2]) for p in parts}) != 1:
            raise ValueError("concat_rows joins caches of equal lengths and reserves")
        layer.buffer.keys = torch.cat([p.buffer.keys for p in parts])
        layer.buffer.values = torch.cat([p.buffer.values for p in parts])
        layer._refresh_views()
        for p in parts[1:]:
            p.reset()
    return first
