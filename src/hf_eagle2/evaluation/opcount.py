"""Ops and host reads per round outside the target's forward: the round's launch overhead, counted on any device.

On a GPU every eager aten op that is not a view launches a kernel (~5-10 µs) and every device-to-host read
(`.item()`, `bool(t)`, `.tolist()`, `nonzero`) drains the queue; on a CPU the same ops are the per-op overhead of
drafting. `count_round_ops` runs `generate` twice (a short and a long call) under a `TorchDispatchMode` and takes
the difference per round, so one-time work (binding, the cost curve, prefill) drops out:

    per_round = count_round_ops(model, ids, assistant_model=draft, tree="eagle2", tree_ngram=0)
    per_round.ops, per_round.launches, per_round.head_ops, per_round.host_reads
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..engine import drafter, verify_compiled

HOST_READ_OPS = {"aten.item.default", "aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default"}
METADATA_OPS = {"aten.detach.default", "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
                "aten.sym_storage_offset.default", "aten.lift_fresh.default"}  # fmt: skip


@dataclass
class OpCounts:
    """Counts over some span of work: aten ops outside the target's forward (`ops`), those that launch a kernel
    (`launches`: views and metadata excluded), those inside the head's forward (`head_ops`), the target's own
    (`target_ops`), and device-to-host reads (`host_reads`, `tolist` included)."""

    ops: float = 0
    launches: float = 0
    head_ops: float = 0
    target_ops: float = 0
    host_reads: float = 0
    compiled_calls: float = 0  # `tree_compile`: each draft level and the verify pass over a static cache are one
    # compiled call each (their ops are not counted)

    def minus(self, other: "OpCounts", per: float = 1.0) -> "OpCounts":
        return OpCounts(**{k: (v - getattr(other, k)) / per for k, v in asdict(self).items()})

    def as_dict(self, digits: int = 2) -> dict:
        return {k: round(v, digits) for k, v in asdict(self).items()}


class OpCounter(TorchDispatchMode):
    """Counts aten ops by where they run: inside `target`'s forward, inside `head`'s forward, or elsewhere."""

    def __init__(self, target: torch.nn.Module, head: torch.nn.Module | None = None):
        super().__init__()
        self.counts = OpCounts()
        self._in_target = self._in_head = 0
        self._hooks = []
        for module, attr in ((target, "_in_target"), (head, "_in_head")):
            if module is not None:
                self._hooks.append(module.register_forward_pre_hook(lambda *_, a=attr: self._enter(a, 1)))
                self._hooks.append(module.register_forward_hook(lambda *_, a=attr: self._enter(a, -1)))

    def _enter(self, attr: str, step: int) -> None:
        setattr(self, attr, getattr(self, attr) + step)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        counts = self.counts
        if self._in_target:
            counts.target_ops += 1
        else:
            counts.ops += 1
            if not (func.is_view or name in METADATA_OPS):
                counts.launches += 1
            if self._in_head:
                counts.head_ops += 1
        if name in HOST_READ_OPS:
            counts.host_reads += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter = self
        self._compiled = drafter.compiled_level_step
        self._compiled_call = verify_compiled.compiled_call

        def counted(factory):  # a compiled call (a draft level, the verify pass) runs outside the mode (dynamo
            def make(*factory_args):  # skips frames under one) and counts as one call
                call = factory(*factory_args)

                def run(*args, **kwargs):
                    counter.counts.compiled_calls += 1
                    with _disable_current_modes():
                        return call(*args, **kwargs)

                return run

            return make

        drafter.compiled_level_step = counted(self._compiled)
        verify_compiled.compiled_call = counted(self._compiled_call)

        def tolist(tensor, *args, **kwargs):  # reads the device without an aten op on CPU tensors
            counter.counts.host_reads += 1
            return counter._tolist(tensor, *args, **kwargs)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        drafter.compiled_level_step = self._compiled
        verify_compiled.compiled_call = self._compiled_call
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)


def count_ops(model, input_ids: torch.Tensor, head: torch.nn.Module | None = None, **generate_kwargs):
    """(OpCounts, output) of one `model.generate(input_ids, **generate_kwargs)`; head: the module whose forward
    is counted as `head_ops` (defaults to `assistant_model` when it is a module)."""
    if head is None and isinstance(generate_kwargs.get("assistant_model"), torch.nn.Module):
        head = generate_kwargs["assistant_model"]
    counter = OpCounter(model, head)
    with counter, torch.inference_mode():
        out = model.generate(input_ids, **generate_kwargs)
    return counter.counts, out


def count_round_ops(model, input_ids: torch.Tensor, short: int = 12, long: int = 40, **generate_kwargs) -> OpCounts:
    """OpCounts per round of a tree `generate` (per new token for other methods), greedy: the difference between
    a `long` and a `short` call over the difference in rounds (tokens), after one warm-up call (binding, the
    per-round budget's cost curve)."""
    kwargs = dict(do_sample=False, eos_token_id=None, return_dict_in_generate=True, **generate_kwargs)
    model.generate(input_ids, **{**kwargs, "max_new_tokens": 4})
    (c1, o1), (c2, o2) = (count_ops(model, input_ids, max_new_tokens=n, **kwargs) for n in (short, long))
    stats = getattr(o2, "eagle_stats", None)
    if stats is not None:
        rounds = stats.rounds - o1.eagle_stats.rounds
    else:
        rounds = o2.sequences.shape[1] - o1.sequences.shape[1]
    if rounds <= 0:
        raise ValueError("the long call ran no more rounds than the short one: raise `long`")
    return c2.minus(c1, per=rounds)
