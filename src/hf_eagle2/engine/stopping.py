"""`BlockStopper`: where plain decoding would have stopped inside a round's accepted block of tokens.

A round emits several tokens at once; plain decoding checks its stopping criteria after every token. The stock
criteria are checked on the whole block at once, on tokens already on the host (the round's one sync):

* `MaxLengthCriteria`: the block is cut to the room left;
* `EosTokenCriteria`: the first EOS in the block;
* `StopStringCriteria`: one call over the windows that end at each block position (a batch of prefixes);
* `MaxTimeCriteria`: wall time only, so once per block (its stop point is a matter of timing in any case).

Any other criterion is called token by token on the row's prefix (a batch of one) with the scores `_sample`
would pass it there (every processed step's scores so far when they are returned, else None); with a batch that would show a row-stateful criterion the wrong rows,
so custom criteria with batch size > 1 are refused up front.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)

STOCK = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria, MaxTimeCriteria)


class BlockStopper:
    """Stopping criteria of one generate call, applied to accepted blocks."""

    def __init__(self, criteria: StoppingCriteriaList | None, batch_size: int):
        criteria = list(criteria or [])
        self.max_length = min((c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)), default=None)
        eos = [c.eos_token_id.flatten().tolist() for c in criteria if isinstance(c, EosTokenCriteria)]
        self.eos = {int(t) for ids in eos for t in ids}
        self.stop_strings = [c for c in criteria if isinstance(c, StopStringCriteria)]
        self.max_time = [c for c in criteria if isinstance(c, MaxTimeCriteria)]
        self.custom = StoppingCriteriaList(c for c in criteria if not isinstance(c, STOCK))
        if self.custom and batch_size > 1:
            names = sorted({type(c).__name__ for c in self.custom})
            raise NotImplementedError(
                f"custom stopping criteria {names} with tree speculation support batch size 1: a round's block is "
                "checked per row, which would show a row-stateful criterion the wrong batch rows"
            )

    def take(
        self, sequence: torch.LongTensor, start: int, block: list[int], scores: Callable[[int], tuple] | None
    ) -> tuple[int, bool]:
        """How many of `block` (host token ids, written at sequence[start:]) plain decoding would emit, and whether
        it stops there. sequence: (L,) the row's tokens with the block already written; scores(j): what `_sample`
        passes stopping criteria after block[j] (the tuple of every processed step's scores so far when the
        caller returns scores); None: None, as `_sample` passes when scores are not returned."""
        take, stop = len(block), False
        if self.max_length is not None and start + take >= self.max_length:
            take, stop = self.max_length - start, True
        for j in range(take):
            if block[j] in self.eos:
                take, stop = j + 1, True
                break
        if self.stop_strings and take:
            hit = self._first_stop_string(sequence, start, take)
            if hit is not None:
                take, stop = hit + 1, True
        if self.custom and take:
            for j in range(take):
                prefix = sequence[None, : start + j + 1]
                if bool(self.custom(prefix, scores(j) if scores is not None else None)[0]):
                    take, stop = j + 1, True
                    break
        if self.max_time and take and any(time.time() - c.initial_timestamp > c.max_time for c in self.max_time):
            stop = True
        return take, stop

    def _first_stop_string(self, sequence: torch.LongTensor, start: int, n: int) -> int | None:
        """Index j < n of the first block token that completes a stop string, or None (one call per criterion on
        the n windows ending at start..start+n-1; prefixes shorter than a window are checked one by one)."""
        found = [j for j in (self._first_hit(c, sequence, start, n) for c in self.stop_strings) if j is not None]
        return min(found) if found else None

    @staticmethod
    def _first_hit(criterion, sequence: torch.LongTensor, start: int, n: int) -> int | None:
        width = criterion.maximum_token_len
        first_full = max(0, width - 1 - start)  # earlier prefixes are shorter than the window
        for j in range(min(first_full, n)):
            if bool(criterion(sequence[None, : start + j + 1], None)[0]):
                return j
        if first_full < n:
            ends = torch.arange(start + first_full, start + n, device=sequence.device)
            windows = sequence[ends.view(-1, 1) - width + 1 + torch.arange(width, device=sequence.device)]
            hits = criterion(windows, None).tolist()
            if any(hits):
                return first_full + hits.index(True)
        return None
