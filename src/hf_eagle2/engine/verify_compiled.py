"""The verify pass as one compiled call at static shapes (`tree_compile=True` over a static cache).

transformers compiles decoding only over a static cache (`cache_implementation="static"`), through
`model.get_compiled_call(compile_config)`; the tree's verify pass does the same. What makes its shapes static:

    cache       a `StaticCache` (full-attention layers): keys (B, H, S_max, D), written at its tensor
                `cumulative_length`, read whole under the mask: the same shapes every round
    tree        padded to a bucket of Q nodes (16, 32, 64, ...: a few graphs, not one per tree size); a padding
                node sits at the root's position and attends to itself only, so its entry is finite, no real node
                sees it, and pruning drops it with the rest of the unaccepted nodes
    mask        (B, 1, Q, S_max) additive float, built eagerly by `TargetModel.tree_attention_mask`

Rounds whose padded tree would not fit in what is left of the cache (near `max_length`) run eagerly: give the
cache room with `max_cache_len=` (`generate` kwarg) to compile those too. Sliding-window static layers keep a
Python-int length that the compiler would specialise on (a recompile per round), so such caches verify eagerly.
"""

from __future__ import annotations

import torch
from transformers import CompileConfig
from transformers.cache_utils import Cache

from ..kernels.reserved_cache import full_attention_static

from typing import TYPE_CHECKING

from . import constants
from .tree import DraftTree

if TYPE_CHECKING:
    from .target import TargetModel

BUCKETS = (16, 32, 64, 128, 256)
RECOMPILE_LIMIT = 64


def default_compile_config(device: torch.device) -> CompileConfig:
    """fullgraph, static shapes; CUDA graphs (`reduce-overhead`) on CUDA, inductor's default elsewhere."""
    return CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else "default")


def compiled_call(model, config: CompileConfig):
    """The model's compiled call (transformers' `get_compiled_call`: one per config, kept on the model)."""
    return model.get_compiled_call(config)


def compiles_verify(cache: Cache | None) -> bool:
    """Whether the verify pass over `cache` can run compiled: every layer a full-attention `StaticLayer`."""
    return full_attention_static(cache)


def bucket(nodes: int) -> int | None:
    """The padded size for a tree of `nodes` nodes (None: larger than every bucket)."""
    return next((b for b in BUCKETS if b >= nodes), None)


def pad_tree(tree: DraftTree, size: int) -> DraftTree:
    """`tree` with `size - n` padding nodes appended: token 0, depth 0 (the root's position), parent -1, each its
    own only ancestor. For the verify pass alone (mask and inputs); acceptance reads the real tree."""
    bsz, n = tree.tokens.shape
    pad = size - n
    if pad == 0:
        return tree
    device = tree.tokens.device
    false = constants.scalar(False, torch.bool, device)
    ancestors = torch.cat([torch.cat([tree.ancestors, false.expand(bsz, n, pad)], 2),
                           torch.cat([false.expand(bsz, pad, n), constants.eye(pad, device).expand(bsz, pad, pad)], 2)],
                          1)  # fmt: skip
    zeros = constants.scalar(0, torch.long, device).expand(bsz, pad)
    return DraftTree(
        tokens=torch.cat([tree.tokens, zeros], 1), parents=torch.cat([tree.parents, constants.scalar(-1, torch.long, device).expand(bsz, pad)], 1),
        depths=torch.cat([tree.depths, zeros], 1), ancestors=ancestors,
        scores=tree.scores, local_logp=tree.local_logp, depth_bound=tree.depth_bound,  # not read by the verify pass
    )  # fmt: skip


class CompiledVerify:
    """Runs a round's verify pass through the model's compiled call when the padded tree fits the cache."""

    def __init__(self, target: "TargetModel", cache: Cache, capacity: int, compile_config: CompileConfig | None):
        """capacity: the cache's slots (its `max_cache_len`)."""
        self.target = target
        self.cache = cache
        config = compile_config or default_compile_config(target.device)
        self.call = compiled_call(target.model, config)
        self.copy_outputs = config.mode == "reduce-overhead"  # CUDA graphs reuse their output buffers
        self.capacity = capacity
        self.calls = 0  # rounds verified compiled

    def __call__(self, tree: DraftTree, root_pos: torch.LongTensor, slot_pos: torch.LongTensor, cached: int):
        """(features (B, n, H), float32 logits (B, n, V)) of the n tree nodes, or None when the padded tree does
        not fit (the caller verifies eagerly). root_pos: (B,); slot_pos: (B, C) logical positions of the C = `cached`
        cache entries (as `TargetModel.tree_attention_mask` takes them)."""
        n = tree.num_nodes
        size = bucket(n)
        if size is None or cached + size > self.capacity:
            return None
        padded = pad_tree(tree, size)
        positions = root_pos.view(-1, 1) + padded.depths
        mask = self.target.tree_attention_mask(self.cache, padded, positions, slot_pos)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # a graph per bucket, batch, kernels
            hidden, logits = self.target.forward(padded.tokens, positions, mask, self.cache, call=self.call)
        hidden, logits = hidden[:, :n], logits[:, :n]
        if self.copy_outputs:
            hidden, logits = hidden.clone(), logits.clone()
        self.calls += 1
        return hidden, logits, size
