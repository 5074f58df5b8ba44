"""`FusedLinear`: several `nn.Linear`s over the same input run as one GEMM, their modules and state dict untouched.

Why: a draft head's forward is ~23 kernels, and the round runs ~6 of them; q/k/v as one GEMM and gate/up as another
take 3 of the 8 linears and the q/k concat out of every forward (~25 launches a round, issue 46). The weights
(N_1 + N_2 + ..., K) are concatenated once and cached, and rebuilt when any source weight changes (replaced,
moved, cast, or written in place: an optimiser step, `load_state_dict`), as `PackedWeight` does for one weight;
`optimize_for_cpu` (`PackedLinear` sources) puts the fused weight on the oneDNN packed path too. Under autograd
or `torch.compile` it concatenates the live weights instead (gradients reach each source; the compiler sees
plain tensors), at the cost of one small copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cpu import PackedLinear, PackedWeight, packed_linear, tensor_stamp


class FusedLinear:
    """`torch.cat([m(x) for m in linears], -1)` as one GEMM. Hold it as a plain attribute (not a submodule):
    the linears stay where they are, and the cache is never saved (deep copies start empty)."""

    __slots__ = ("_key", "_sources", "_weight", "_bias", "_packed")

    def __init__(self):
        self._key, self._sources, self._weight, self._bias, self._packed = None, None, None, None, PackedWeight()

    def __deepcopy__(self, memo) -> "FusedLinear":
        return FusedLinear()

    def __getstate__(self):  # pickling keeps no cache either
        return None

    def __setstate__(self, state) -> None:
        self.__init__()

    def __call__(self, x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> torch.Tensor:
        """x: (..., K) -> (..., N_1 + N_2 + ...)."""
        weights = [m.weight for m in linears]
        biases = [m.bias for m in linears]
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))):
            bias = None if biases[0] is None else torch.cat(biases)
            return F.linear(x, torch.cat(weights), bias)
        sources = [t for t in (*weights, *biases) if t is not None]
        key = tuple((id(t), *tensor_stamp(t)) for t in sources)  # ids stay valid: _sources holds the tensors
        if key != self._key:
            self._weight = torch.cat(weights).detach()
            self._bias = None if biases[0] is None else torch.cat(biases).detach()
            self._key, self._sources = key, sources
        first = linears[0]
        if type(first) is PackedLinear:
            min_rows = first.__dict__.get("_min_rows", {}).get(self._weight.dtype, 1)
            return packed_linear(x, self._weight, self._bias, self._packed, min_rows)
        return F.linear(x, self._weight, self._bias)
