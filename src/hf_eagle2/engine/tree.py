"""Draft trees: the EAGLE-2 dynamic tree, the EAGLE-1 static tree and a chain, all built with batched tensor ops.

A tree is returned as a `DraftTree` whose node 0 is the *root*: the last accepted token, which the target has
not processed yet. Nodes are in depth-major order (a parent always precedes its children).

EAGLE-2 (Li et al., 2024), as built by `build_dynamic_tree`:

1. The head's distribution after the root gives the top-k depth-1 nodes. Each node carries its global
   acceptance value V_i = product of draft confidences along its path (summed log-probs here).
2. For depth 2..D, the k frontier nodes with the highest V_i are fed to the head (one forward over k tokens)
   and each proposes its top-k children: k*k new candidates per depth.
3. Reranking keeps the top-m candidates of all depths by V_i. A child never scores above its parent, and ties
   are broken in favour of the earlier (shallower) candidate, so the kept set is ancestor-closed: a connected
   tree. This is asserted.

Ablations (paper, Table 4): `use_global_value=False` ranks by the node's own confidence (made monotone along
each path, so the kept set stays connected); `rerank=False` keeps the expanded frontier nodes of every depth
(k per depth, depth-major), truncated to m.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from . import constants
# The EAGLE-1 default static tree: 25 nodes below the root, depth 5. Each entry is a path of top-k ranks
# (0 = the draft's most likely token) from the root; e.g. (0, 1) is the 2nd-ranked child of the 1st-ranked
# depth-1 node. Branching is widest near the root, where acceptance is likeliest.
EAGLE1_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip


def chain_tree(depth: int) -> tuple[tuple[int, ...], ...]:
    """A single chain of `depth` top-1 tokens."""
    return tuple((0,) * d for d in range(1, depth + 1))


@dataclass
class DraftTree:
    """A batch of draft trees with n nodes each (node 0 = root).

    tokens: (B, n) target token ids; parents: (B, n) parent node index (root: -1); depths: (B, n) (root: 0);
    ancestors: (B, n, n) bool, ancestors[b, i, j] = node j is an ancestor of node i or i itself (so the rows
    are exactly the tree attention mask over the tree tokens); scores: (B, n) log V_i (root: 0);
    local_logp: (B, n) log draft confidence of each node given its parent (root: 0).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    ancestors: torch.BoolTensor
    scores: torch.Tensor
    local_logp: torch.Tensor
    extras: dict = field(default_factory=dict)
    depth_bound: int | None = None  # known upper bound of depths (no host sync); None: read from `depths`

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_depth(self) -> int:
        """The deepest node's depth, or an upper bound of it known from construction (paths are padded)."""
        return self.depth_bound if self.depth_bound is not None else int(self.depths.max())

    @property
    def paths(self) -> torch.LongTensor:
        """(B, L, max_depth + 1) root-to-leaf node indices per leaf, padded with -1 (L = most leaves in a row)."""
        bsz, n = self.tokens.shape
        device = self.tokens.device
        has_child = torch.zeros(bsz, n, dtype=torch.bool, device=device)
        has_child.scatter_(1, self.parents.clamp(min=0), self.parents >= 0)
        is_leaf = ~has_child
        width = self.max_depth + 1
        # full[b, i, d] = ancestor of node i at depth d: each depth slot gets exactly one ancestor's id + 1
        ids = torch.arange(1, n + 1, device=device).expand(bsz, n, n)
        full = torch.zeros(bsz, n, width, dtype=torch.long, device=device)
        full.scatter_add_(2, self.depths.unsqueeze(1).expand(bsz, n, n), torch.where(self.ancestors, ids, 0))
        full -= 1
        num_leaves = int(is_leaf.sum(1).max())
        order = torch.argsort((~is_leaf).to(torch.int8), dim=1, stable=True)[:, :num_leaves]
        paths = full.gather(1, order.unsqueeze(-1).expand(bsz, num_leaves, width))
        return torch.where(is_leaf.gather(1, order).unsqueeze(-1), paths, -1)

    def check(self) -> None:
        """Asserts the structural invariants (connected, depth-major, consistent ancestors)."""
        n = self.num_nodes
        idx = torch.arange(n, device=self.tokens.device)
        assert bool((self.parents[:, 0] == -1).all()), "root must have no parent"
        assert bool((self.parents[:, 1:] >= 0).all()), "tree is not connected: a node lost its parent"
        assert bool((self.parents[:, 1:] < idx[1:]).all()), "parents must precede their children"
        parent_depth = self.depths.gather(1, self.parents.clamp(min=0))
        assert bool((self.depths[:, 1:] == parent_depth[:, 1:] + 1).all()), "depth != parent depth + 1"
        assert bool((self.ancestors.sum(-1) == self.depths + 1).all()), "ancestor rows must hold depth + 1 nodes"


def root_only_tree(root_tokens: torch.LongTensor, like: torch.Tensor) -> DraftTree:
    """A tree with no draft nodes: verifying it is one plain decoding step."""
    bsz = root_tokens.shape[0]
    zeros = torch.zeros(bsz, 1, dtype=torch.long, device=root_tokens.device)
    return DraftTree(
        tokens=root_tokens.view(bsz, 1),
        parents=zeros - 1,
        depths=zeros,
        ancestors=torch.ones(bsz, 1, 1, dtype=torch.bool, device=root_tokens.device),
        scores=like.new_zeros(bsz, 1),
        local_logp=like.new_zeros(bsz, 1),
        depth_bound=0,
    )


def _ancestors_from_parents(parents: torch.LongTensor, depths: torch.LongTensor, max_depth: int) -> torch.BoolTensor:
    """(B, n) parents in depth-major order -> (B, n, n) ancestor-or-self mask: max_depth rounds of "a node's row is
    its parent's row plus itself", over all nodes at once (two kernels each): after d rounds every node of depth
    <= d is exact, and exact rows stay so (the root is its own parent here)."""
    bsz, n = parents.shape
    eye = constants.eye(n, parents.device).expand(bsz, n, n)
    anc = eye
    gather_idx = parents.clamp(min=0).unsqueeze(-1).expand(bsz, n, n)
    for _ in range(max_depth):
        anc = anc.gather(1, gather_idx) | eye
    return anc if max_depth else eye.clone()


@dataclass(frozen=True)
class _Layout:
    """The dynamic tree's candidate layout, a constant per (k, levels): C = k + (levels - 1) k^2 candidates, depth
    by depth. The frontier of each depth is k of its candidates (all k at depth 1, the top-k `picks` below), and
    candidate j of depth d + 1 >= 2 is a child of that depth's frontier slot j // k."""

    depths: torch.LongTensor  # (C,) depth of each candidate
    slot_base: torch.LongTensor  # (levels * k,) added to the frontier picks: candidate ids of every frontier slot
    parent_slot: torch.LongTensor  # (C,) index into the frontier slots of each candidate's parent (0 at depth 1)
    top: torch.BoolTensor  # (C,) depth-1 candidates (children of the root)


@functools.lru_cache(maxsize=64)
def _level_layout(k: int, levels: int, device: torch.device) -> _Layout:
    sizes = [k] + [k * k] * (levels - 1)
    starts = [0, *itertools.accumulate(sizes)][:levels]
    depths = torch.repeat_interleave(torch.arange(1, levels + 1), torch.tensor(sizes))
    slot_base = torch.tensor([starts[d] for d in range(levels) for _ in range(k)])
    parent_slot = torch.cat([torch.zeros(k, dtype=torch.long)] +
                            [(d - 1) * k + torch.arange(k * k) // k for d in range(1, levels)])  # fmt: skip
    return _Layout(depths.to(device), slot_base.to(device), parent_slot.to(device), (depths == 1).to(device))


# A draft step: (frontier tokens (B, f), parent features (B, f, H), depth of the fed nodes, what the fed nodes
# attend to (B, f, C + S): the builder's `context_mask` (B, C), then their ancestry over all tree slots fed so far
# including themselves) -> predicted features (B, f, H).
DraftStep = Callable[[torch.LongTensor, torch.Tensor, int, torch.BoolTensor], torch.Tensor]
# Log-probabilities over the draft vocabulary: (..., H) -> (..., N)
DraftLogProbs = Callable[[torch.Tensor], torch.Tensor]


def build_dynamic_tree(
    root_tokens: torch.LongTensor,
    root_hidden: torch.Tensor,
    draft_step: DraftStep,
    draft_logprobs: DraftLogProbs,
    to_target_ids: Callable[[torch.LongTensor], torch.LongTensor],
    *,
    total_tokens: int,
    depth: int,
    top_k: int,
    use_global_value: bool = True,
    rerank: bool = True,
    chain=None,
    budget=None,
    context_mask: torch.BoolTensor | None = None,
) -> DraftTree:
    """EAGLE-2 dynamic tree. root_tokens: (B,), root_hidden: (B, H) = head output at the root; context_mask:
    (B, C) the head-cache slots every tree node attends to (None: none), the first C columns of each step's mask.

    chain: optional `ngram.NgramChain` below the root, merged into the candidates before reranking (see
    `_merge_chain`). budget: optional `RoundBudget`: stop expanding when the next depth cannot pay for its head
    step, and keep only as many of the top nodes as maximise expected tokens per second (then total_tokens is
    an upper bound). Returns a DraftTree of min(total_tokens, #head candidates) + 1 nodes. Head forwards:
    depth - 1 (plus the one that produced root_hidden).
    """
    bsz, hidden_size = root_hidden.shape
    device = root_hidden.device
    k = top_k
    eye = constants.eye(k, device).expand(bsz, k, k)
    logp = draft_logprobs(root_hidden).float()  # (B, N)
    top_lp, top_idx = logp.topk(k, dim=-1)  # (B, k)
    cand_tokens = [to_target_ids(top_idx)]
    cand_local = [top_lp]
    cand_key = [top_lp]  # ranking key: log V_i, or the path-monotone local confidence for the ablation
    cand_score = [top_lp]
    picks = []  # per expanded depth: the frontier, as indices into that depth's k * k candidates

    frontier_tokens = cand_tokens[0]
    frontier_key, frontier_score = top_lp, top_lp
    frontier_hidden = root_hidden.unsqueeze(1).expand(bsz, k, hidden_size)
    frontier_anc = eye if context_mask is None else torch.cat([context_mask.unsqueeze(1).expand(bsz, k, -1), eye], -1)
    levels = 1
    for d in range(1, depth):
        if budget is not None and not budget.worth_expanding(frontier_score):
            break
        levels += 1
        hidden = draft_step(frontier_tokens, frontier_hidden, d, frontier_anc)  # (B, k, H)
        child_lp, child_idx = draft_logprobs(hidden).float().topk(k, dim=-1)  # (B, k, k)
        child_score = frontier_score.unsqueeze(-1) + child_lp
        child_key = child_score if use_global_value else torch.minimum(child_lp, frontier_key.unsqueeze(-1))
        cand_tokens.append(to_target_ids(child_idx).flatten(1))
        cand_local.append(child_lp.flatten(1))
        cand_score.append(child_score.flatten(1))
        cand_key.append(child_key.flatten(1))
        # next frontier: the k best children by the ranking key
        frontier_key, pick = cand_key[-1].topk(k, dim=-1)  # (B, k) indices into this depth's k*k
        picks.append(pick)
        frontier_tokens = cand_tokens[-1].gather(1, pick)
        frontier_score = frontier_key if use_global_value else cand_score[-1].gather(1, pick)
        parent_slot = pick // k
        frontier_hidden = hidden.gather(1, parent_slot.unsqueeze(-1).expand(bsz, k, hidden_size))
        inherited = frontier_anc.gather(1, parent_slot.unsqueeze(-1).expand(bsz, k, frontier_anc.shape[-1]))
        frontier_anc = torch.cat([inherited, eye], dim=-1)

    num_cand = k + (levels - 1) * k * k
    tokens, local, score = torch.cat(cand_tokens, 1), torch.cat(cand_local, 1), torch.cat(cand_score, 1)
    key = torch.cat(cand_key, 1)
    layout = _level_layout(k, levels, device)
    depths = layout.depths.expand(bsz, num_cand)
    # candidate ids of each depth's frontier, depth-major, k per depth (depth 1's frontier is all its k)
    expanded = torch.cat([constants.arange(k, device).expand(bsz, k), *picks], 1) + layout.slot_base
    parent = torch.where(layout.top, -1, expanded.gather(1, layout.parent_slot.expand(bsz, num_cand)))
    chain_cand = None
    if chain is not None:
        if not rerank:
            raise ValueError("n-gram branches are ranked against head nodes: they need reranking (tree_rerank=True)")
        tokens, local, score, key, parent, depths, chain_cand = _merge_chain(chain, tokens, local, score, key, parent, depths)
    if rerank:
        m = min(total_tokens, num_cand)  # never more than the head's candidates: all of those have finite keys
        ranked = torch.sort(key, dim=1, descending=True, stable=True)
        if budget is not None:
            m = budget.best_size(ranked.values[:, :m], levels)
        order = ranked.indices[:, :m]
    else:
        m = min(total_tokens, expanded.shape[1])
        order = expanded[:, :m]
    selected = torch.sort(order, dim=1).values  # depth-major: parents first (head candidates are numbered so)
    if chain_cand is not None:
        selected = _depth_major(selected, depths)
    bound = max(levels, chain.tokens.shape[1] if chain is not None else 0) if m else 0
    tree = _assemble(root_tokens, selected, tokens, parent, depths, score, local, tokens.shape[1], bound)
    tree.extras.update(candidate_scores=score, selected=selected)
    if chain_cand is not None:
        node_of_cand = torch.full_like(tokens, -1)
        node_of_cand.scatter_(1, selected, torch.arange(1, selected.shape[1] + 1, device=device).expand_as(selected))
        tree.extras["chain_nodes"] = node_of_cand.gather(1, chain_cand)  # (B, L) tree node of each chain step, or -1
    return tree


@dataclass
class RoundBudget:
    """Per-round tree size from a measured cost curve (see autotune.py).

    verify_s: (Q + 1,) seconds of a verification pass over q tokens (index q; index 0 unused); draft_step_s:
    one head step; overhead_s: the rest of a round. Values V_i (path probabilities, well calibrated for EAGLE
    heads: see the calibration report) estimate each node's chance of being accepted, so a round keeping the
    top-m nodes yields 1 + sum of their V_i tokens on average.
    """

    verify_s: torch.Tensor
    draft_step_s: float
    overhead_s: float
    early_stop: bool = True  # one host sync per depth: worth it on CPUs, where a sync costs nothing
    lagged: bool = False  # accelerators: a round keeps the size chosen from the previous round's values, whose read
    # rides on that round's own host sync (a non-blocking copy to pinned memory), so a round reads the device once
    _pending: torch.Tensor | None = field(default=None, repr=False)  # host scalar the last choice is copied into

    def worth_expanding(self, frontier_logv: torch.Tensor) -> bool:
        """One more depth yields at most sum(V) of the frontier expected tokens (children's probabilities sum
        to at most their parent's); worth it when that many tokens, at a plain step's cost each, beat the cost
        of a head step. frontier_logv: (B, f). One host sync (none without early_stop)."""
        if not self.early_stop:
            return True
        gain = frontier_logv.exp().sum(dim=1).max()
        return bool(gain * self.verify_s[1] > self.draft_step_s)

    def best_size(self, ranked_logv: torch.Tensor, levels: int) -> int:
        """ranked_logv: (B, M) node values in decreasing order -> the m <= M maximising expected tokens per second
        (the largest over rows: a batch verifies trees of one size). One host sync."""
        bsz, num = ranked_logv.shape
        num = min(num, self.verify_s.numel() - 2)
        gain = torch.cat([ranked_logv.new_zeros(bsz, 1), ranked_logv[:, :num].exp().cumsum(dim=1)], dim=1) + 1.0
        cost = self.verify_s[1 : num + 2].to(gain) + levels * self.draft_step_s + self.overhead_s
        choice = (gain / cost).argmax(dim=1).max()
        if not self.lagged:
            return int(choice)
        # the previous round's choice: its copy finished at that round's host sync (the accepted block's read)
        if self._pending is None:  # the first round: no choice yet, every candidate
            self._pending, last = torch.empty((), dtype=choice.dtype, pin_memory=choice.is_cuda), num
        else:
            last = min(int(self._pending.numpy()), num)  # a host buffer: no device sync
        self._pending.copy_(choice, non_blocking=True)
        return last


def _depth_major(selected: torch.LongTensor, depths: torch.LongTensor) -> torch.LongTensor:
    """Orders selected candidate ids (B, m) by depth, then id: parents before children, also for chain nodes
    (appended after all head candidates, so their ids do not follow depth)."""
    sel_depth = depths.gather(1, selected)
    order = torch.sort(sel_depth * (depths.shape[1] + 1) + selected, dim=1).indices
    return selected.gather(1, order)


def _merge_chain(chain, tokens, local, score, key, parent, depths):
    """Adds an n-gram chain c_1..c_L below the root to the candidate set (B, C), one candidate per step.

    Where the chain's step j coincides with a head candidate (same parent, same token) the two merge: the head
    candidate's ranking key becomes max(its key, the chain's log value) and the chain's own slot gets key -inf,
    so siblings keep distinct tokens (which lossless sampling relies on). Otherwise the chain node is a new
    candidate with the chain's log value as key. Chain values fall with depth and a boosted node only rises,
    so keys stay non-increasing along every path and the top-m set stays a connected tree.
    Returns the extended tensors (B, C + L) and the candidate id of each chain step (B, L).
    """
    bsz, num = tokens.shape
    length = chain.tokens.shape[1]
    device = tokens.device
    neg_inf = torch.tensor(float("-inf"), device=device, dtype=key.dtype)
    ids = torch.arange(length, device=device)
    in_chain = ids.view(1, -1) < chain.lengths.view(-1, 1)  # (B, L)
    chain_logv = chain.logv.to(key.dtype)
    chain_parent = torch.full((bsz, length), -1, dtype=torch.long, device=device)
    chain_cand = torch.empty(bsz, length, dtype=torch.long, device=device)
    new_key = torch.empty(bsz, length, dtype=key.dtype, device=device)
    prev = torch.full((bsz,), -1, dtype=torch.long, device=device)
    for j in range(length):
        chain_parent[:, j] = prev
        same = (parent == prev.view(-1, 1)) & (tokens == chain.tokens[:, j : j + 1]) & in_chain[:, j : j + 1]
        exists = same.any(dim=1)
        existing = same.to(torch.int8).argmax(dim=1)
        boost = torch.where(exists & in_chain[:, j], chain_logv[:, j], neg_inf)
        key = key.scatter_reduce(1, existing.view(-1, 1), boost.view(-1, 1), reduce="amax")
        new_key[:, j] = torch.where(exists | ~in_chain[:, j], neg_inf, chain_logv[:, j])
        prev = torch.where(exists, existing, num + j)
        chain_cand[:, j] = prev
    cat = lambda a, b: torch.cat([a, b], dim=1)  # noqa: E731
    return (
        cat(tokens, chain.tokens),
        cat(local, torch.where(in_chain, chain_logv.diff(dim=1, prepend=torch.zeros_like(chain_logv[:, :1])), 0.0)),
        cat(score, chain_logv),
        cat(key, new_key),
        cat(parent, chain_parent),
        cat(depths, (ids + 1).expand(bsz, length)),
        chain_cand,
    )


def _assemble(root_tokens, selected, tokens, parent, depths, score, local, num_cand, depth_bound) -> DraftTree:
    """Turns selected candidate ids (B, m), parents first, into a DraftTree with the root prepended.

    Connectivity (every selected node's parent selected) holds by construction (keys never rise along a path,
    ties go to the earlier candidate); `DraftTree.check` asserts it in the tests, not here: that is a host sync."""
    bsz, m = selected.shape
    device = selected.device
    # node index of every candidate, shifted by one so that the root's children (parent -1) find the root (0)
    node_of_cand = torch.zeros(bsz, num_cand + 1, dtype=torch.long, device=device)
    node_of_cand.scatter_(1, selected + 1, constants.arange(m + 1, device)[1:].expand(bsz, m))
    node_parent = node_of_cand.gather(1, parent.gather(1, selected) + 1)
    zeros_long = constants.scalar(0, torch.long, device).expand(bsz, 1)
    zeros = constants.scalar(0, score.dtype, device).expand(bsz, 1)
    parents = torch.cat([constants.scalar(-1, torch.long, device).expand(bsz, 1), node_parent], 1)
    node_depths = torch.cat([zeros_long, depths.gather(1, selected)], 1)
    return DraftTree(
        tokens=torch.cat([root_tokens.view(bsz, 1), tokens.gather(1, selected)], 1),
        parents=parents,
        depths=node_depths,
        ancestors=_ancestors_from_parents(parents, node_depths, depth_bound),
        scores=torch.cat([zeros, score.gather(1, selected)], 1),
        local_logp=torch.cat([zeros, local.gather(1, selected)], 1),
        depth_bound=depth_bound,
    )


@dataclass(frozen=True)
class StaticLevel:
    """One head expansion of a static tree: feed `fed` nodes, give each child the draft's `rank`-th token."""

    fed: torch.LongTensor  # (f,) nodes whose head outputs propose the children
    children: torch.LongTensor  # (c,)
    child_slot: torch.LongTensor  # (c,) index into `fed` of each child's parent
    child_rank: torch.LongTensor  # (c,)
    width: int  # top-k needed = max rank + 1


@dataclass(frozen=True)
class StaticTreeSpec:
    """Precomputed layout of a static tree given as rank paths (see EAGLE1_TREE)."""

    paths: tuple[tuple[int, ...], ...]
    parents: torch.LongTensor  # (n,) root = -1
    depths: torch.LongTensor  # (n,)
    ancestors: torch.BoolTensor  # (n, n)
    levels: tuple[StaticLevel, ...]  # levels[0] expands the root, levels[d] the depth-d nodes with children

    @staticmethod
    def from_paths(paths: Sequence[Sequence[int]]) -> "StaticTreeSpec":
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("a static tree needs at least one node, and ranks must be >= 0")
        index = {(): 0}
        parents, ranks, depths = [-1], [-1], [0]
        for p in paths:
            if p[:-1] not in index:
                raise ValueError(f"static tree path {p} has no parent path {p[:-1]}")
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            ranks.append(p[-1])
            depths.append(len(p))
        levels = []
        for d in range(max(depths)):
            fed = sorted({parents[c] for c in range(1, len(parents)) if depths[c] == d + 1})
            children = [c for c in range(1, len(parents)) if depths[c] == d + 1]
            levels.append(
                StaticLevel(
                    fed=torch.tensor(fed),
                    children=torch.tensor(children),
                    child_slot=torch.tensor([fed.index(parents[c]) for c in children]),
                    child_rank=torch.tensor([ranks[c] for c in children]),
                    width=1 + max(ranks[c] for c in children),
                )
            )
        parents_t, depths_t = torch.tensor(parents), torch.tensor(depths)
        anc = _ancestors_from_parents(parents_t.view(1, -1), depths_t.view(1, -1), max(depths))[0]
        return StaticTreeSpec(tuple(paths), parents_t, depths_t, anc, tuple(levels))

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    @property
    def max_depth(self) -> int:
        return len(self.levels)

    def truncated(self, max_depth: int) -> "StaticTreeSpec":
        return StaticTreeSpec.from_paths([p for p in self.paths if len(p) <= max_depth])


def build_static_tree(
    root_tokens: torch.LongTensor,
    root_hidden: torch.Tensor,
    draft_step: DraftStep,
    draft_logprobs: DraftLogProbs,
    to_target_ids: Callable[[torch.LongTensor], torch.LongTensor],
    spec: StaticTreeSpec,
    context_mask: torch.BoolTensor | None = None,
) -> DraftTree:
    """EAGLE-1 static tree (or a chain): fixed shape, tokens = the draft's top-ranked children of each node;
    context_mask as for `build_dynamic_tree`."""
    bsz, hidden_size = root_hidden.shape
    device = root_hidden.device
    n = spec.num_nodes
    anc = spec.ancestors.to(device)
    tokens = root_tokens.new_zeros(bsz, n)
    tokens[:, 0] = root_tokens
    local = torch.zeros(bsz, n, device=device)
    node_hidden = root_hidden.new_zeros(bsz, n, hidden_size)  # head output at each fed node
    node_hidden[:, 0] = root_hidden
    fed_so_far = torch.zeros(0, dtype=torch.long, device=device)
    for d, level in enumerate(spec.levels):
        fed = level.fed.to(device)
        if d == 0:
            hidden = root_hidden.unsqueeze(1)
        else:
            fed_so_far = torch.cat([fed_so_far, fed])
            parent_hidden = node_hidden[:, spec.parents[level.fed].to(device)]
            fed_anc = anc[fed][:, fed_so_far].expand(bsz, fed.numel(), fed_so_far.numel())
            if context_mask is not None:
                fed_anc = torch.cat([context_mask.unsqueeze(1).expand(bsz, fed.numel(), -1), fed_anc], -1)
            hidden = draft_step(tokens[:, fed], parent_hidden, d, fed_anc)
            node_hidden[:, fed] = hidden
        top_lp, top_idx = draft_logprobs(hidden).float().topk(level.width, dim=-1)  # (B, f, width)
        slot, rank, children = level.child_slot.to(device), level.child_rank.to(device), level.children.to(device)
        tokens[:, children] = to_target_ids(top_idx[:, slot, rank])
        local[:, children] = top_lp[:, slot, rank]
    scores = (anc.to(local.dtype).unsqueeze(0) * local.unsqueeze(1)).sum(-1)  # sum of log-probs along the path
    return DraftTree(
        tokens=tokens,
        parents=spec.parents.to(device).expand(bsz, n),
        depths=spec.depths.to(device).expand(bsz, n),
        ancestors=anc.expand(bsz, n, n),
        scores=scores,
        local_logp=local,
        depth_bound=spec.max_depth,
    )
