"""Tree verification: per-node logits processing and greedy acceptance.

Given the target's logits at every tree node (one forward over the whole tree), node i is *correct* when its
token is the target's choice at its parent, and *valid* when it and all its ancestors are correct. Greedy
decoding accepts the deepest valid node's path (siblings carry distinct tokens, so at most one valid node per
depth) plus the bonus token: the target's choice at that node. This is exactly the sequence plain greedy
decoding produces, one token per step, because every accepted token is the target's argmax given its own prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from .tree import DraftTree


@dataclass
class Acceptance:
    """path: (B, D + 1) accepted nodes, root first, padded with the last accepted node; num_accepted: (B,)
    accepted draft nodes; next_token: (B,) bonus token; correct, valid: (B, n) per node (see module doc)."""

    path: torch.LongTensor
    num_accepted: torch.LongTensor
    next_token: torch.LongTensor
    correct: torch.BoolTensor
    valid: torch.BoolTensor


def path_tokens(tree: DraftTree) -> torch.LongTensor:
    """(B, n, D + 1): tokens from the root to each node by depth (entry d = ancestor at depth d; 0 past the node)."""
    bsz, n = tree.tokens.shape
    width = tree.max_depth + 1
    out = torch.zeros(bsz, n, width, dtype=torch.long, device=tree.tokens.device)
    src = torch.where(tree.ancestors, tree.tokens.unsqueeze(1), 0)
    return out.scatter_add_(2, tree.depths.unsqueeze(1).expand(bsz, n, n), src)


def process_node_logits(
    logits: torch.Tensor,
    tree: DraftTree,
    sequences: list[torch.LongTensor],
    logits_processor: LogitsProcessorList | None,
) -> torch.Tensor:
    """Applies `logits_processor` to each node's logits (B, n, V) with that node's own prefix.

    sequences[b]: (L_b,) row b's tokens so far, ending with the root. A depth-d node's prefix is that sequence
    followed by the d tokens of its path, so processors see exactly what plain decoding would show them.
    Nodes of equal depth are processed as one batch.
    """
    if not logits_processor:
        return logits
    out = logits.clone()
    prefix = path_tokens(tree)[:, :, 1:]
    for b, seq in enumerate(sequences):
        for d in range(tree.max_depth + 1):
            rows = (tree.depths[b] == d).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            ids = torch.cat([seq.unsqueeze(0).expand(rows.numel(), -1), prefix[b, rows, :d]], dim=1)
            out[b, rows] = logits_processor(ids, logits[b, rows])
    return out


def greedy_accept(tree: DraftTree, choice: torch.LongTensor) -> Acceptance:
    """choice: (B, n) the target's token at each node (argmax of its processed logits)."""
    bsz, n = tree.tokens.shape
    parent_choice = choice.gather(1, tree.parents.clamp(min=0))
    correct = tree.tokens == parent_choice
    correct[:, 0] = True
    valid = ~(tree.ancestors & ~correct.unsqueeze(1)).any(-1)
    best = torch.where(valid, tree.depths, -1).argmax(dim=1)  # deepest valid node (B,)
    num_accepted = tree.depths.gather(1, best.unsqueeze(1)).squeeze(1)
    path = accepted_path(tree, best)
    return Acceptance(path, num_accepted, choice.gather(1, best.unsqueeze(1)).squeeze(1), correct, valid)


def accepted_path(tree: DraftTree, best: torch.LongTensor) -> torch.LongTensor:
    """(B, D + 1) the ancestors-or-self of node `best` (B,) in depth order (nodes are depth-major, so in index
    order), padded with `best`."""
    bsz, n = tree.tokens.shape
    on_path = tree.ancestors[torch.arange(bsz, device=best.device), best]  # (B, n)
    idx = torch.where(on_path, torch.arange(n, device=best.device), n)
    idx = idx.sort(dim=1).values[:, : tree.max_depth + 1]
    return torch.where(idx < n, idx, best.unsqueeze(1))
