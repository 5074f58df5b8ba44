"""`EagleDrafter`: the draft side of one tree-speculative `generate` call.

The drafter owns the head's KV cache over the accepted context: one entry per pair (feature_t, token_{t+1})
for every accepted position t whose target feature is known. Each round it

1. feeds the pairs whose features arrived since the last round (`add_features`: the target's final hidden
   states at the root and at each accepted node), and
2. expands a draft tree from the head's output at the root, on top of that cache. The tree's own KV entries
   are written after the context in the same preallocated buffer (`KVBuffer`) and rolled back when the tree is
   built, so the cache never holds drafted (unverified) positions and no step copies the whole cache.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import constants
from .ngram import NgramProposer
from ..kernels.reserved_cache import KVBuffer, StaticKV
from .tree import (
    EAGLE1_TREE,
    DraftTree,
    StaticTreeSpec,
    build_dynamic_tree,
    build_static_tree,
    chain_tree,
    root_only_tree,
)

TREE_KINDS = ("eagle2", "eagle1", "chain")


AUTO_MAX_TOKENS = 60  # tree_total_tokens="auto": the most nodes a round may keep (the paper's m)
AUTO_MAX_DEPTH = 8  # tree_depth="auto": the deepest a round may draft (it stops earlier when nodes cannot pay)
DEFAULT_CPU_NGRAM = 8  # tree_ngram=None on a CPU: the n-gram branch length the bench measured


@dataclass(frozen=True)
class TreeOptions:
    """How to draft. `total_tokens` (m), `depth` and `top_k` (k) apply to eagle2; `depth` also to chain.

    total_tokens="auto" (the default) sizes every round's tree from the measured cost curve (autotune.py);
    top_k=None means 10 on accelerators and 4 on CPUs, where each extra expanded node costs a head step's share.
    ngram=None means an 8-token n-gram branch on CPUs (it won both bench sets there: README) and none on
    accelerators, where its per-row lookup would add host syncs to every round and nothing measured it yet.
    """

    tree: str = "eagle2"
    total_tokens: int | str = "auto"
    depth: int | str = 6
    top_k: int | None = None
    use_global_value: bool = True  # ablation switch (eagle2): rank by V_i, or by each node's own confidence
    rerank: bool = True  # ablation switch (eagle2): rerank all candidates, or keep the expanded frontier
    static_paths: tuple[tuple[int, ...], ...] | None = None  # eagle1 shape; default EAGLE1_TREE
    ngram: int | None = None  # eagle2: length of the n-gram (prompt lookup) branch merged into the tree; 0 = none
    record_calibration: bool = False
    profile: bool = False
    compile: bool = False  # eagle2: each draft level is one `torch.compile`d call at static shapes (StaticKV)

    def __post_init__(self):
        if self.tree not in TREE_KINDS:
            raise ValueError(f"tree must be one of {TREE_KINDS}, got {self.tree!r}")
        for name in ("total_tokens", "depth", "top_k"):
            value = getattr(self, name)
            if (value == "auto" and name != "top_k") or (value is None and name == "top_k"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tree_{name} must be a positive int{' or auto' if name != 'top_k' else ''}, got {value!r}")
        if self.depth == "auto" and self.tree != "eagle2":
            raise ValueError(f"tree_depth='auto' sizes the dynamic tree: it needs tree='eagle2', not {self.tree!r}")
        if self.ngram is not None:
            if not isinstance(self.ngram, int) or isinstance(self.ngram, bool) or self.ngram < 0:
                raise ValueError(f"tree_ngram must be an int >= 0 (the n-gram branch length; 0 = off), got {self.ngram!r}")
            if self.ngram and self.tree != "eagle2":
                raise ValueError(f"tree_ngram adds a branch to the dynamic tree: it needs tree='eagle2', not {self.tree!r}")
            if self.ngram and not self.rerank:
                raise ValueError("tree_ngram needs tree_rerank=True: n-gram nodes are ranked against head nodes by value")
        if self.compile and self.tree != "eagle2":
            raise ValueError(f"tree_compile compiles the dynamic tree's draft levels: it needs tree='eagle2', not "
                             f"{self.tree!r}")  # fmt: skip

    @property
    def per_round_budget(self) -> bool:
        return self.tree == "eagle2" and "auto" in (self.total_tokens, self.depth)

    def resolved(self, device: torch.device) -> "TreeOptions":
        """Concrete numbers for this device: top_k, ngram and "auto" sizes filled in (the budget then caps each
        round)."""
        on_cpu = torch.device(device).type == "cpu"
        top_k = self.top_k if self.top_k is not None else (4 if on_cpu else 10)
        ngram = self.ngram
        if ngram is None:
            ngram = DEFAULT_CPU_NGRAM if on_cpu and self.tree == "eagle2" and self.rerank else 0
        total = AUTO_MAX_TOKENS if self.total_tokens == "auto" else self.total_tokens
        depth = AUTO_MAX_DEPTH if self.depth == "auto" else self.depth
        return replace(self, top_k=top_k, total_tokens=total, depth=depth, ngram=ngram)

    def static_spec(self, depth_limit: int, max_nodes: int | None = None) -> StaticTreeSpec:
        paths = chain_tree(self.depth) if self.tree == "chain" else (self.static_paths or EAGLE1_TREE)
        return _static_spec(tuple(map(tuple, paths)), depth_limit, max_nodes)


@functools.lru_cache(maxsize=64)
def _static_spec(paths: tuple[tuple[int, ...], ...], depth_limit: int, max_nodes: int | None) -> StaticTreeSpec:
    """The static tree cut to depth_limit and, keeping the shallowest nodes first, to max_nodes (root included)."""
    kept = sorted((p for p in paths if len(p) <= depth_limit), key=lambda p: (len(p), p))
    return StaticTreeSpec.from_paths(kept if max_nodes is None else kept[: max_nodes - 1])


class EagleDrafter:
    """Head KV over the accepted context plus tree drafting, for one generate call (rows share only tensors)."""

    def __init__(self, draft: torch.nn.Module, target_model, options: TreeOptions, timer=None, budget=None,
                 context_start: int = 0):  # fmt: skip
        """options: resolved `TreeOptions`; budget: optional `tree.RoundBudget` sizing each eagle2 round;
        context_start: the first slot whose feature the head gets (slots before it, e.g. a cache reused from an
        earlier turn, stay outside the head's context)."""
        self.draft = draft.bind(target_model)
        self.context_start = context_start
        self.options = options
        self.budget = budget
        self.kv = StaticKV() if options.compile else KVBuffer()
        self.ctx_valid: torch.BoolTensor | None = None  # (B, C): False for padding / holes
        self.pending: list[torch.Tensor] = []  # target features (B, T, H) not fed to the head yet
        self.pending_valid: list[torch.BoolTensor | None] = []
        self.last_tree: DraftTree | None = None
        self.ngram = NgramProposer(options.ngram) if options.ngram else None
        self.timer = timer  # optional stats.Timer: head forwards and logits are timed as "draft_model_s"

    @property
    def fed(self) -> int:
        """C: number of context slots in the head cache."""
        return self.kv.length

    def _timed(self):
        return self.timer("draft_model_s") if self.timer is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ context
    def add_features(self, features: torch.Tensor, valid: torch.BoolTensor | None = None) -> None:
        """Queue target features (B, T, F) of the next T accepted slots (valid: (B, T), False for holes).

        F is whatever the target forward returned for the head (`target_feature_ids`); the head projects them
        to its own width here, once (`project_features`: the identity for EAGLE-1/2, `fc` for EAGLE-3)."""
        with self._timed():
            self.pending.append(self.draft.project_features(features))
        self.pending_valid.append(valid)

    def discard_pending(self) -> None:
        self.pending.clear()
        self.pending_valid.clear()

    def _feed_context(self, input_ids: torch.LongTensor, positions: torch.LongTensor) -> torch.Tensor:
        """Feeds queued pairs; input_ids (B, S) holds the slots' tokens, the last being the root.

        positions: (B, S) logical positions of the slots. Returns the head output at the root (B, H).
        """
        features = torch.cat(self.pending, dim=1) if len(self.pending) > 1 else self.pending[0]
        bsz, num_new = features.shape[:2]
        device = features.device
        valid_parts = [
            v if v is not None else torch.ones(bsz, f.shape[1], dtype=torch.bool, device=device)
            for f, v in zip(self.pending, self.pending_valid)
        ]
        valid = torch.cat(valid_parts, dim=1) if len(valid_parts) > 1 else valid_parts[0]
        self.discard_pending()
        start = self.fed
        input_ids, positions = input_ids[:, self.context_start :], positions[:, self.context_start :]
        if input_ids.shape[1] != start + num_new + 1:
            raise RuntimeError("draft context out of sync with the sequence")
        tokens = input_ids[:, start + 1 : start + num_new + 1]
        pos = positions[:, start : start + num_new]
        ctx_valid = valid if self.ctx_valid is None else torch.cat([self.ctx_valid, valid], dim=1)
        rows = constants.arange(num_new, device)
        cols = constants.arange(start + num_new, device)
        causal = cols.unsqueeze(0) <= start + rows.unsqueeze(1)  # (T, C + T)
        itself = cols.unsqueeze(0) == start + rows.unsqueeze(1)  # holes attend to themselves only, never NaN
        mask = ((causal.unsqueeze(0) & ctx_valid.unsqueeze(1)) | itself).unsqueeze(1)  # (B, 1, T, C + T)
        if isinstance(self.kv, StaticKV):  # room for the context and the round's tree; the mask spans it all
            config = self.draft.config
            like = features.new_empty(bsz, config.num_key_value_heads, 0, config.head_dim, dtype=self.draft.fc.weight.dtype)
            self.kv.ensure(like, start + num_new + self.options.depth * self.options.top_k)
            mask = F.pad(mask, (0, self.kv.keys.shape[2] - mask.shape[-1]))
            self.kv.write_pos = constants.arange(start + num_new, device)[start:]
        with self._timed():
            hidden, _ = self.draft(tokens, features.to(self.draft.fc.weight.dtype), pos, mask, self.kv)
        if isinstance(self.kv, StaticKV):
            self.kv.length = start + num_new
        self.ctx_valid = ctx_valid
        return hidden[:, -1]

    # ------------------------------------------------------------------ tree
    def draft_tree(
        self, input_ids: torch.LongTensor, positions: torch.LongTensor, max_depth: int, max_nodes: int | None = None,
        options: TreeOptions | None = None, rows: list[torch.LongTensor] | None = None,
    ) -> DraftTree:  # fmt: skip
        """Builds a draft tree below the last token of `input_ids` (B, S); positions: (B, S) logical positions.

        max_depth / max_nodes (root included) cap the tree near the end of max_length or of a static cache;
        options overrides the drafter's own for this tree; rows[b]: (L_b,) row b's real tokens ending with the
        root, where n-gram branches are looked up (default: input_ids)."""
        opts = options or self.options
        root_hidden = self._feed_context(input_ids, positions)
        root_pos = positions[:, -1]  # (B,)
        context = self.fed
        ctx_valid = self.ctx_valid
        # the rotary (cos, sin) of every level's position, once for the round: (B, L, D) each (compiled steps read
        # views of it, so L stays the same every round: the tree's depth; eagle2 never drafts deeper)
        levels = opts.depth if opts.compile else max(1, max_depth)
        level_pos = root_pos.unsqueeze(1) + constants.arange(levels, root_pos.device)
        cos, sin = self.draft.rotary(root_hidden, level_pos)

        def draft_step(tokens, parent_hidden, depth, anc):  # anc: (B, num, context + tree slots fed)
            cos_sin = (cos[:, depth - 1 : depth], sin[:, depth - 1 : depth])  # node positions: root_pos + depth - 1
            if isinstance(self.kv, StaticKV):  # static shapes: the mask spans the buffers, writes at tensor slots
                slots, capacity = anc.shape[-1], self.kv.keys.shape[2]
                mask = F.pad(anc, (0, capacity - slots)).unsqueeze(1)
                write_pos = constants.arange(capacity, anc.device)[slots - tokens.shape[1] : slots]
                # level 1's parents are the root's output broadcast: materialised, every level passes the same strides
                parent_hidden = parent_hidden.contiguous()
                with self._timed(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    return compiled_level_step(anc.device.type)(self.draft, tokens, parent_hidden, *cos_sin, mask,
                                                                self.kv.keys, self.kv.values, write_pos)  # fmt: skip
            with self._timed():
                hidden, _ = self.draft(tokens, parent_hidden, None, anc.unsqueeze(1), self.kv, cos_sin=cos_sin)
            return hidden

        root_tokens = input_ids[:, -1]
        common = (root_tokens, root_hidden, draft_step, self._logprobs, self.draft.to_target_ids)
        if max_nodes is not None:
            max_depth = min(max_depth, max_nodes - 1)
        try:
            if max_depth < 1:  # no room for draft tokens (end of max_length): verify the root alone
                tree = root_only_tree(root_tokens, root_hidden.float())
            elif opts.tree == "eagle2":
                chain = None
                if self.ngram is not None:
                    chain = self.ngram.propose(rows if rows is not None else list(input_ids), max_depth)
                tree = build_dynamic_tree(
                    *common,
                    total_tokens=opts.total_tokens if max_nodes is None else min(opts.total_tokens, max_nodes - 1),
                    depth=min(opts.depth, max_depth),
                    top_k=min(opts.top_k, self.draft.draft_vocab_size),
                    use_global_value=opts.use_global_value,
                    rerank=opts.rerank,
                    chain=chain,
                    budget=self.budget,
                    context_mask=ctx_valid,
                )
            else:
                tree = build_static_tree(*common, spec=opts.static_spec(max_depth, max_nodes), context_mask=ctx_valid)
        finally:
            self.kv.truncate(context)  # forget the tree's entries
        self.last_tree = tree
        return tree

    def record_acceptance(self, tree: DraftTree, valid: torch.BoolTensor, correct: torch.BoolTensor) -> None:
        """Updates the n-gram branch's acceptance estimate from a verified tree (valid, correct: (B, n))."""
        nodes = tree.extras.get("chain_nodes") if self.ngram is not None else None
        if nodes is None:
            return
        on_tree = nodes >= 0
        idx = nodes.clamp(min=0)
        parent_ok = valid.gather(1, tree.parents.clamp(min=0).gather(1, idx)) & on_tree
        hit = correct.gather(1, idx) & parent_ok
        counts = torch.stack([parent_ok.sum(), hit.sum()]).tolist()
        self.ngram.update(*counts)

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._timed():
            return F.log_softmax(self.draft.draft_logits(hidden).float(), dim=-1)


def _level_step(head, tokens, hidden, cos, sin, mask, keys, values, write_pos) -> torch.Tensor:
    """One draft level at static shapes, the body `tree_compile` compiles: head(tokens (B, k), hidden (B, k, H))
    over the whole `StaticKV` buffers keys / values (B, H_kv, capacity, D) under mask (B, 1, k, capacity), writing
    its own entries at write_pos (k,). Returns (B, k, H)."""
    return head(tokens, hidden, None, mask, StaticKV.over(keys, values, write_pos), cos_sin=(cos, sin))[0]


# graphs one process may compile for the level step: one per (head shape, batch, k, capacity step), where
# capacities double; dynamo's default of 8 would make a fullgraph step fail on the ninth instead of compiling it
RECOMPILE_LIMIT = 64


@functools.lru_cache(maxsize=None)
def compiled_level_step(device_type: str):
    """`_level_step` compiled once per process and device type (fullgraph, static shapes; CUDA graphs on CUDA)."""
    return torch.compile(_level_step, fullgraph=True, dynamic=False,
                         mode="reduce-overhead" if device_type == "cuda" else None)  # fmt: skip
