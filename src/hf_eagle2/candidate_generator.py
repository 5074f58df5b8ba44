"""`EagleCandidateGenerator`: the draft side, as a transformers `CandidateGenerator`.

The generator owns the head's KV cache over the accepted context: one entry per pair (feature_t, token_{t+1})
for every accepted position t whose target feature is known. Each round it

1. feeds the pairs whose features arrived since the last round (`update_candidate_strategy` hands them over:
   the target's final hidden states at the root and at each accepted node), and
2. expands a draft tree from the head's output at the root, on top of that cache. The tree's own KV entries
   are discarded when the tree is built, so the cache never holds drafted (unverified) positions.

Tree mode (`get_candidates(input_ids)` -> `DraftTree`) is used by the hf_eagle2 decoding loop. Chain mode
(`get_candidates(input_ids, model_outputs=..., ...)` -> `(candidate_ids, None)`) plugs the same head into the
stock `transformers` assisted-decoding loop, which passes the target's outputs in.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from transformers.generation.candidate_generator import CandidateGenerator

from .modeling_eagle import EagleDraftModel
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


@dataclass(frozen=True)
class TreeOptions:
    """How to draft. `total_tokens` (m), `depth` and `top_k` (k) apply to eagle2; `depth` also to chain."""

    tree: str = "eagle2"
    total_tokens: int = 60
    depth: int = 6
    top_k: int = 10
    use_global_value: bool = True  # ablation switch (eagle2): rank by V_i, or by each node's own confidence
    rerank: bool = True  # ablation switch (eagle2): rerank all candidates, or keep the expanded frontier
    static_paths: tuple[tuple[int, ...], ...] | None = None  # eagle1 shape; default EAGLE1_TREE
    record_calibration: bool = False
    profile: bool = False

    def __post_init__(self):
        if self.tree not in TREE_KINDS:
            raise ValueError(f"tree must be one of {TREE_KINDS}, got {self.tree!r}")
        for name in ("total_tokens", "depth", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tree_{name} must be a positive int, got {value!r}")

    def static_spec(self, depth_limit: int, max_nodes: int | None = None) -> StaticTreeSpec:
        paths = chain_tree(self.depth) if self.tree == "chain" else (self.static_paths or EAGLE1_TREE)
        return _static_spec(tuple(map(tuple, paths)), depth_limit, max_nodes)


@functools.lru_cache(maxsize=64)
def _static_spec(paths: tuple[tuple[int, ...], ...], depth_limit: int, max_nodes: int | None) -> StaticTreeSpec:
    """The static tree cut to depth_limit and, keeping the shallowest nodes first, to max_nodes (root included)."""
    kept = sorted((p for p in paths if len(p) <= depth_limit), key=lambda p: (len(p), p))
    return StaticTreeSpec.from_paths(kept if max_nodes is None else kept[: max_nodes - 1])


class EagleCandidateGenerator(CandidateGenerator):
    """Draft-side state and tree building for one generate call (batch rows share nothing but tensors)."""

    requires_model_outputs = True  # chain mode in the stock loop reads the target's hidden states

    def __init__(self, draft: EagleDraftModel, target_model, options: TreeOptions, max_length: int | None = None):
        self.draft = draft.bind(target_model)
        self.options = options
        self.max_length = max_length
        self.model_kwargs_overrides = {"output_hidden_states": -1}
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, H_kv, C, D) each
        self.ctx_valid: torch.BoolTensor | None = None  # (B, C): False for padding / holes
        self.pending: list[torch.Tensor] = []  # target features (B, T, H) not fed to the head yet
        self.pending_valid: list[torch.BoolTensor] = []
        self.fed = 0  # C: number of context slots in the head cache
        self.last_tree: DraftTree | None = None
        self.timer = None  # optional stats.Timer: head forwards and logits are timed as "draft_model_s"

    def _timed(self):
        return self.timer("draft_model_s") if self.timer is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ context
    def add_features(self, features: torch.Tensor, valid: torch.BoolTensor | None = None) -> None:
        """Queue target features (B, T, H) of the next T accepted slots (valid: (B, T), False for holes)."""
        self.pending.append(features)
        if valid is None:
            valid = torch.ones(features.shape[:2], dtype=torch.bool, device=features.device)
        self.pending_valid.append(valid)

    def _feed_context(self, input_ids: torch.LongTensor, positions: torch.LongTensor) -> torch.Tensor:
        """Feeds queued pairs; input_ids (B, S) holds the slots' tokens, the last being the root.

        positions: (B, S) logical positions of the slots. Returns the head output at the root (B, H).
        """
        features = torch.cat(self.pending, dim=1) if len(self.pending) > 1 else self.pending[0]
        valid = torch.cat(self.pending_valid, dim=1) if len(self.pending_valid) > 1 else self.pending_valid[0]
        self.pending, self.pending_valid = [], []
        bsz, num_new = features.shape[:2]
        start = self.fed
        if input_ids.shape[1] != start + num_new + 1:
            raise RuntimeError("draft context out of sync with the sequence")
        tokens = input_ids[:, start + 1 : start + num_new + 1]
        pos = positions[:, start : start + num_new]
        ctx_valid = valid if self.ctx_valid is None else torch.cat([self.ctx_valid, valid], dim=1)
        rows = torch.arange(num_new, device=features.device)
        cols = torch.arange(start + num_new, device=features.device)
        causal = cols.unsqueeze(0) <= start + rows.unsqueeze(1)  # (T, C + T)
        itself = cols.unsqueeze(0) == start + rows.unsqueeze(1)  # holes attend to themselves only, never NaN
        mask = ((causal.unsqueeze(0) & ctx_valid.unsqueeze(1)) | itself).unsqueeze(1)  # (B, 1, T, C + T)
        with self._timed():
            hidden, kv = self.draft(tokens, features.to(self.draft.fc.weight.dtype), pos, mask, self.kv)
        self.kv = kv if self.kv is None else (torch.cat([self.kv[0], kv[0]], 2), torch.cat([self.kv[1], kv[1]], 2))
        self.ctx_valid = ctx_valid
        self.fed = start + num_new
        return hidden[:, -1]

    # ------------------------------------------------------------------ tree
    def draft_tree(
        self, input_ids: torch.LongTensor, positions: torch.LongTensor, max_depth: int, max_nodes: int | None = None
    ) -> DraftTree:
        """Builds a draft tree below the last token of `input_ids` (B, S); positions: (B, S) logical positions.

        max_depth / max_nodes (root included) cap the tree near the end of max_length or of a static cache."""
        root_hidden = self._feed_context(input_ids, positions)
        root_pos = positions[:, -1]  # (B,)
        ctx_kv, ctx_valid = self.kv, self.ctx_valid
        tree_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

        def draft_step(tokens, parent_hidden, depth, anc):
            bsz, num = tokens.shape
            past = (
                (torch.cat([ctx_kv[0], *[kv[0] for kv in tree_kv]], 2), torch.cat([ctx_kv[1], *[kv[1] for kv in tree_kv]], 2))
                if tree_kv
                else ctx_kv
            )
            mask = torch.cat([ctx_valid.unsqueeze(1).expand(bsz, num, ctx_valid.shape[1]), anc], dim=-1).unsqueeze(1)
            pos = (root_pos + depth - 1).unsqueeze(1).expand(bsz, num)
            with self._timed():
                hidden, kv = self.draft(tokens, parent_hidden, pos, mask, past)
            tree_kv.append(kv)
            return hidden

        opts = self.options
        root_tokens = input_ids[:, -1]
        common = (root_tokens, root_hidden, draft_step, self._logprobs, self.draft.to_target_ids)
        if max_nodes is not None:
            max_depth = min(max_depth, max_nodes - 1)
        if max_depth < 1:  # no room for draft tokens (end of max_length): verify the root alone
            tree = root_only_tree(root_tokens, root_hidden.float())
        elif opts.tree == "eagle2":
            tree = build_dynamic_tree(
                *common,
                total_tokens=opts.total_tokens if max_nodes is None else min(opts.total_tokens, max_nodes - 1),
                depth=min(opts.depth, max_depth),
                top_k=min(opts.top_k, self.draft.draft_vocab_size),
                use_global_value=opts.use_global_value,
                rerank=opts.rerank,
            )
        else:
            tree = build_static_tree(*common, spec=opts.static_spec(max_depth, max_nodes))
        self.last_tree = tree
        return tree

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._timed():
            return F.log_softmax(self.draft.draft_logits(hidden).float(), dim=-1)

    # ------------------------------------------------------------------ CandidateGenerator API
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs: Any):
        """Tree mode: `get_candidates(input_ids, positions=..., max_depth=...)` -> DraftTree.

        Chain mode (stock assisted loop): called with `model_outputs`, `is_first_iteration`, `n_last_matches`;
        returns `(candidate_input_ids, None)`.
        """
        if "model_outputs" not in kwargs:
            positions = kwargs.get("positions")
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            return self.draft_tree(input_ids, positions, kwargs.get("max_depth", self.options.depth), kwargs.get("max_nodes"))
        if kwargs.get("is_first_iteration"):
            return input_ids, None  # let the target prefill first: the head needs its features
        if input_ids.shape[0] != 1:
            raise ValueError("the stock assisted-decoding loop supports batch size 1 only")
        hidden = kwargs["model_outputs"].hidden_states[-1]
        new = hidden if self.kv is None and not self.pending else hidden[:, : kwargs.get("n_last_matches", 0) + 1]
        self.add_features(new.to(self.draft.fc.weight.device))
        budget = self.options.depth
        if self.max_length is not None:
            budget = min(budget, self.max_length - input_ids.shape[1] - 1)
        if budget < 1:
            self.pending.clear()
            self.pending_valid.clear()
            return input_ids, None
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        chain_options = replace(self.options, tree="chain", depth=budget)
        saved, self.options = self.options, chain_options
        try:
            tree = self.draft_tree(input_ids, positions, budget)
        finally:
            self.options = saved
        return torch.cat([input_ids, tree.tokens[:, 1:].to(input_ids.device)], dim=1), None

    def update_candidate_strategy(
        self,
        input_ids: torch.LongTensor,
        scores: torch.Tensor | None,
        num_matches: int | torch.Tensor,
        features: torch.Tensor | None = None,
        valid: torch.BoolTensor | None = None,
    ) -> None:
        """Receives the accepted path's target features (B, n + 1, H): root first, then each accepted node.

        In the stock loop (no `features`) they arrive with the next `get_candidates` call instead.
        """
        if features is not None:
            self.add_features(features, valid)
