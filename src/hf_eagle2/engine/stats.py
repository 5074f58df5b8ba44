"""`EagleStats`: what one speculative `generate` call did, returned as `output.eagle_stats`."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch


def tau_of(new_tokens: int, prefill_tokens: int, rounds: int) -> float | None:
    """τ from counts: tokens per verification round. `prefill_tokens` (the first token of each generation, which
    the prefill forward produced) are left out, as the prefill is not a round; None without rounds."""
    return (new_tokens - prefill_tokens) / rounds if rounds else None


@dataclass
class EagleStats:
    """Counters and a time split for one generate call.

    tau = tokens from verification rounds / rounds, over all rows: the average number of tokens each
    verification pass produced, bonus token included. The prefill's token (one per row) came from no round, so it
    counts in new_tokens but not in tau (`tau_of`). accept_hist[n] counts rounds that accepted n draft tokens
    (so each such round emitted n + 1 tokens, fewer where a stop cut it). Seconds are wall-clock; on CUDA they
    are measured after a synchronize only when `profile=True` was passed to generate.
    """

    tree: str = "eagle2"
    batch_size: int = 1
    new_tokens: int = 0
    target_forwards: int = 0
    accept_hist: list[int] = field(default_factory=list)
    tree_nodes: int = 0  # total draft nodes verified (root excluded)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # all drafting: head forwards and logits (draft_model_s) plus tree construction
    draft_model_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    total_s: float = 0.0
    new_tokens_per_row: list[int] = field(default_factory=list)
    prefill_tokens_per_row: list[int] = field(default_factory=list)  # 1, or 0 where max_length left no room
    target_forwards_per_row: list[int] = field(default_factory=list)
    calibration: dict | None = None
    verify_compiled: int = 0  # rounds whose verify pass ran as the compiled call (tree_compile, static cache)

    @property
    def tau(self) -> float:
        """Average acceptance length over all rows: round tokens per row-verification."""
        row_forwards = sum(self.target_forwards_per_row) or self.target_forwards
        return tau_of(self.new_tokens, sum(self.prefill_tokens_per_row), row_forwards) or 0.0

    @property
    def rounds(self) -> int:
        return self.target_forwards

    @property
    def tau_per_row(self) -> list[float]:
        prefill = self.prefill_tokens_per_row or [0] * len(self.new_tokens_per_row)
        return [tau_of(n, p, f) or 0.0 for n, p, f in zip(self.new_tokens_per_row, prefill, self.target_forwards_per_row)]

    @property
    def round_s(self) -> float:
        return self.draft_s + self.verify_s + self.bookkeeping_s

    @property
    def tree_build_s(self) -> float:
        """Drafting time outside the head's forwards and logits: top-k, selection, reranking, masks."""
        return max(self.draft_s - self.draft_model_s, 0.0)

    @property
    def bookkeeping_share(self) -> float:
        """Share of round time in tree construction, mask building, acceptance and cache pruning."""
        return (self.bookkeeping_s + self.tree_build_s) / self.round_s if self.round_s else 0.0

    def record_round(self, counts: list[int], rows: list[int], num_nodes: int) -> None:
        """One verification round: counts[b] drafted tokens accepted in each active row b of `rows`, over a tree of
        num_nodes nodes (root included)."""
        for b in rows:
            self.record_accept(counts[b])
            self.target_forwards_per_row[b] += 1
        self.target_forwards += 1
        self.tree_nodes += num_nodes - 1

    def record_accept(self, accepted: int) -> None:
        while len(self.accept_hist) <= accepted:
            self.accept_hist.append(0)
        self.accept_hist[accepted] += 1

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("calibration")
        out.update(tau=self.tau, rounds=self.rounds, tree_build_s=self.tree_build_s,
                   bookkeeping_share=self.bookkeeping_share)  # fmt: skip
        return out

    def summary(self) -> str:
        per_round = 1000 * self.round_s / max(self.rounds, 1)
        return (
            f"tree={self.tree} new_tokens={self.new_tokens} target_forwards={self.target_forwards} tau={self.tau:.2f} "
            f"round={per_round:.1f}ms (draft {self.draft_model_s:.2f}s, tree {self.tree_build_s:.2f}s, "
            f"verify {self.verify_s:.2f}s, bookkeeping {self.bookkeeping_s:.2f}s; tree + bookkeeping = "
            f"{100 * self.bookkeeping_share:.1f}% of round time)"
        )


class Timer:
    """Accumulates wall time into EagleStats fields; synchronizes CUDA only when asked to."""

    def __init__(self, stats: EagleStats, device: torch.device, sync: bool):
        self.stats = stats
        self.sync = sync and device.type == "cuda"

    @contextmanager
    def __call__(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            setattr(self.stats, name, getattr(self.stats, name) + time.perf_counter() - start)
