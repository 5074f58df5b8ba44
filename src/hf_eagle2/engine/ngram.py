"""n-gram branches for the dynamic tree: continuations copied from earlier in the context (prompt lookup).

The head wins on open chat; answers that copy the prompt (code edits, quotes, lists) are better guessed by
looking the last few tokens up earlier in the context and proposing what followed them there. `NgramProposer`
finds that continuation per row and keeps a running estimate of how often such tokens are accepted, so the tree
builder can weigh them against the head's own nodes (`tree.build_dynamic_tree(..., chain=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NgramChain:
    """tokens: (B, L) proposed continuation (target ids), valid for the first lengths[b] entries; logv: (B, L)
    log acceptance estimate of each chain node's whole path (decreasing along the chain)."""

    tokens: torch.LongTensor
    lengths: torch.LongTensor
    logv: torch.Tensor


class NgramProposer:
    """Finds the most recent earlier occurrence of the context's last n tokens (n = max_ngram .. 1) and proposes
    the up to `length` tokens that followed it.

    `accept_rate` is the running per-token acceptance of proposed chain tokens, given an accepted parent
    (an exponential moving average of what verification reported, starting from `prior`): chain node d's value
    is accept_rate ** d, on the same scale as the head's V_i.
    """

    def __init__(self, length: int, max_ngram: int = 3, prior: float = 0.5, momentum: float = 0.8):
        if length < 1 or max_ngram < 1:
            raise ValueError("n-gram branch length and size must be >= 1")
        self.length = length
        self.max_ngram = max_ngram
        self.accept_rate = prior
        self.momentum = momentum

    def propose(self, rows: list[torch.LongTensor], max_len: int) -> NgramChain | None:
        """rows[b]: (S_b,) row b's tokens so far, ending with the root. None when no row has a match."""
        length = min(self.length, max_len)
        if length < 1:
            return None
        device = rows[0].device
        tokens = torch.zeros(len(rows), length, dtype=torch.long, device=device)
        lengths = torch.zeros(len(rows), dtype=torch.long, device=device)
        for b, seq in enumerate(rows):
            cont = self._continuation(seq, length)
            if cont is not None:
                tokens[b, : cont.numel()] = cont
                lengths[b] = cont.numel()
        if not bool((lengths > 0).any()):
            return None
        rate = min(max(self.accept_rate, 1e-4), 1 - 1e-4)
        depth = torch.arange(1, length + 1, device=device, dtype=torch.float32)
        logv = (depth * torch.log(torch.tensor(rate))).expand(len(rows), length)
        return NgramChain(tokens, lengths, logv)

    def _continuation(self, seq: torch.LongTensor, length: int) -> torch.LongTensor | None:
        size = seq.numel()
        for n in range(min(self.max_ngram, size - 1), 0, -1):
            windows = seq[: size - 1].unfold(0, n, 1)  # (size - n, n): every earlier n-gram but the last one
            hits = (windows == seq[size - n :]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # most recent occurrence
                return seq[start : start + length]
        return None

    def update(self, proposed: int, accepted: int) -> None:
        """Verification saw `proposed` chain tokens whose parent was accepted; `accepted` of them were correct."""
        if proposed:
            self.accept_rate = self.momentum * self.accept_rate + (1 - self.momentum) * accepted / proposed
