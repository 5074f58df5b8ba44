"""`optimize_for_cpu(model)`: run the linears of a model through oneDNN with prepacked weights where that is faster.

Why: on x86 CPUs, stock `nn.Linear` goes to MKL, whose small-M GEMM (M = 2..32 rows: a tree verification pass)
is far slower per row than its GEMV (M = 1), so a 17-token pass costs ~2x a decode step. oneDNN with the weight
reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) keeps the cost of M = 2..32
close to M = 1, and in bf16 it uses AMX/AVX512-BF16 where the CPU has them. Which kernel wins at which M depends
on the CPU and the dtype (on some CPUs MKL's fp32 GEMV beats oneDNN at M = 1), so `optimize_for_cpu` times
both on the model's own weight shapes once per machine, dtype and thread count (cached on disk) and records, per
dtype, the smallest M from which the packed kernel is used (`hf-eagle2 bench --cost-curve` shows the result).
`torch.compile` was the other candidate: it compiles ~25 s per shape, and tree passes change shape every round.

The switch swaps the class of each linear to `PackedLinear` (a subclass: `isinstance(m, nn.Linear)` holds, the
state dict and parameters are untouched), so plain `generate` on the same model object gets the same kernels and
plain and speculative decoding are compared on equal terms. The packed copy is rebuilt when the weight changes
(in place or by assignment) and is never saved or deep-copied. What the fast path cannot do exactly (autograd,
non-CPU tensors, dtypes other than fp32/bf16, bf16 on a CPU whose oneDNN cannot pack it) falls back to `F.linear`.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

FAST_DTYPES = (torch.float32, torch.bfloat16)
NEVER = 1 << 62  # min_rows meaning "always use F.linear"


def bf16_is_emulated() -> bool:
    """True on an x86 CPU without AVX512-BF16 or AMX, where bf16 matmuls run through conversions to fp32: a
    SmolLM2 forward (8 x 512 tokens, 2 threads) took 4.5x as long in bf16 as in fp32 on a Zen 3 EPYC (55 against
    246 tokens/s). False where the CPU has either, or where torch cannot tell (other architectures)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if platform.machine().lower() not in ("x86_64", "amd64") or None in probes:
        return False
    return not any(probe() for probe in probes)


def warn_if_bf16_emulated(what: str) -> None:
    """A warning (not an error: the results are right, only slow) when `what` is to run in bf16 on such a CPU."""
    if bf16_is_emulated():
        warnings.warn(f"{what} in bfloat16, but this CPU has no AVX512-BF16 or AMX: bf16 is emulated and runs "
                      "several times slower than float32 here (4.5x for SmolLM2's forward on a Zen 3 EPYC)",
                      stacklevel=3)  # fmt: skip


def fast_path_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a weight of `dtype` on this CPU. bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT:
    elsewhere (e.g. a Zen 3 EPYC, AVX2 only) `_reorder_linear_weight` raises, and such linears stay on F.linear."""
    if dtype not in FAST_DTYPES or not fast_path_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def tensor_stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """(data_ptr, version counter) of a tensor: changes when it is replaced or written in place (inference tensors
    keep no version counter: -1), so a cache derived from it knows when to rebuild."""
    return tensor.data_ptr(), -1 if tensor.is_inference() else tensor._version


class PackedWeight:
    """A weight (N, K) reordered for oneDNN, rebuilt when the source tensor changes."""

    __slots__ = ("_key", "_packed")

    def __init__(self):
        self._key, self._packed = None, None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (*tensor_stamp(weight), weight.dtype, tuple(weight.shape))
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self._key = key
        return self._packed


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight, min_rows: int = 1
) -> torch.Tensor:
    """F.linear(x, weight, bias) through oneDNN when x has >= min_rows rows and the fast path applies.

    x: (..., K), weight: (N, K) -> (..., N). Under `torch.compile` it is F.linear (the compiler picks the kernel)."""
    if (
        torch.compiler.is_compiling()
        or x.numel() < min_rows * x.shape[-1]
        or x.device.type != "cpu"
        or x.dtype != weight.dtype
        or not packable(weight.dtype)
        or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    ):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.get(weight), bias, "none", [], "")


class PackedLinear(nn.Linear):
    """`nn.Linear` that uses a oneDNN-prepacked copy of its weight for inputs of >= `min_rows` rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.__dict__
        packed = state.get("_packed_weight")
        if packed is None:
            packed = state["_packed_weight"] = PackedWeight()
        return packed_linear(x, self.weight, self.bias, packed, state.get("_min_rows", {}).get(self.weight.dtype, 1))

    def __getstate__(self):  # deepcopy / pickle: the packed copy is a cache, rebuilt on first use
        state = dict(super().__getstate__())
        state.pop("_packed_weight", None)
        return state


def optimize_for_cpu(model: nn.Module, enable: bool = True, min_rows: dict | None = None, release: bool = True) -> nn.Module:
    """Puts the `nn.Linear`s of `model` on the oneDNN prepacked path (enable=False restores stock `nn.Linear`;
    with release=False it keeps the packed copies for a later switch back, as the bench does between runs).

    Returns `model` (changed in place). A no-op for linears whose weights are not on the CPU (e.g. CUDA) and when
    this torch build has no oneDNN. min_rows: {dtype: M} uses the packed kernel for inputs of >= M rows; default:
    measured on this machine (`kernel_crossover`). Outputs agree with `F.linear` to float rounding (another
    summation order), so compare plain and speculative decoding on the same kernels. An EAGLE head bound to an
    optimised target is optimised too (see `EagleDraftModel.bind`).
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not enable:
        for module in linears:
            if type(module) is PackedLinear:
                if release:
                    module.__dict__.pop("_packed_weight", None)
                    module.__dict__.pop("_min_rows", None)
                module.__class__ = nn.Linear
        return model
    cpu = [m for m in linears if type(m) in (nn.Linear, PackedLinear) and m.weight.device.type == "cpu"]
    if not cpu or not fast_path_available():
        return model
    if min_rows is None:  # a previous switch's dispatch, else measured (cached on disk)
        min_rows = next((m.__dict__["_min_rows"] for m in cpu if "_min_rows" in m.__dict__), None)
    if min_rows is None:
        dtypes = {m.weight.dtype for m in cpu if m.weight.dtype in FAST_DTYPES}
        shapes = sorted({tuple(m.weight.shape) for m in cpu})
        min_rows = {dtype: kernel_crossover(dtype, shapes) if packable(dtype) else NEVER for dtype in dtypes}
    for module in cpu:
        module.__class__ = PackedLinear
        module.__dict__["_min_rows"] = dict(min_rows)
    return model


def is_optimized(model: nn.Module) -> bool:
    """True when the linears of `model` run through `PackedLinear`."""
    return any(type(m) is PackedLinear for m in model.modules())


def min_rows_of(model: nn.Module) -> dict:
    """The {dtype: min_rows} dispatch of an optimised model ({} when it is not optimised)."""
    for m in model.modules():
        if type(m) is PackedLinear:
            return dict(m.__dict__.get("_min_rows", {}))
    return {}



def cache_root() -> str:
    """Where the package caches what it measured or converted: `$HF_EAGLE2_CACHE`, default `~/.cache/hf_eagle2`."""
    return os.environ.get("HF_EAGLE2_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hf_eagle2"))


ROWS_PROBED = (1, 2, 4, 8, 16, 32)


def kernel_crossover(dtype: torch.dtype, shapes: list[tuple[int, int]], refresh: bool = False) -> int:
    """The smallest M of ROWS_PROBED from which oneDNN-packed beats F.linear at every larger probed M, on
    `shapes` (N, K) in `dtype`; NEVER if it never does. Cached per CPU, torch version, threads, dtype, shapes."""
    key = f"{cpu_name()}|{torch.__version__}|{torch.get_num_threads()}|{dtype}|{shapes}"
    path = os.path.join(cache_root(), "kernels", f"{abs(hash_str(key)):016x}.json")
    if os.path.exists(path) and not refresh:
        with open(path) as f:
            return int(json.load(f)["min_rows"])
    timings = time_kernels(dtype, shapes)
    faster = [timings["packed"][m] < 0.95 * timings["stock"][m] for m in ROWS_PROBED]
    min_rows = NEVER
    for i in range(len(ROWS_PROBED) - 1, -1, -1):
        if not faster[i]:
            break
        min_rows = ROWS_PROBED[i]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"key": key, "min_rows": min_rows, "timings_ms": timings}, f)
    return min_rows


@torch.inference_mode()
def time_kernels(dtype: torch.dtype, shapes: list[tuple[int, int]], repeats: int = 7) -> dict:
    """{'stock'|'packed': {M: ms}}: one pass over `shapes` (N, K), each weight used once per pass, with enough
    distinct copies (>= 64 MB) that they come from memory as in a real forward; the two kernels interleaved."""
    rng = torch.Generator().manual_seed(0)  # never the global RNG: seeded generate calls must not depend on this
    copies = min(32, max(1, int(64e6 // max(1, sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8))))
    weights = [[(torch.randn(n, k, generator=rng) * 0.02).to(dtype) for n, k in shapes] for _ in range(copies)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]
    out = {"stock": {}, "packed": {}}
    for m in ROWS_PROBED:
        xs = {k: torch.randn(1, m, k, generator=rng).to(dtype) for _, k in shapes}
        runs = {"stock": [], "packed": []}
        for r in range(repeats + 1):
            for name in ("stock", "packed") if r % 2 == 0 else ("packed", "stock"):
                start = time.perf_counter()
                for layer_w, layer_p in zip(weights, packed):
                    for w, p in zip(layer_w, layer_p):
                        x = xs[w.shape[1]]
                        if name == "stock":
                            F.linear(x, w)
                        else:
                            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                if r:  # the first round is a warm-up
                    runs[name].append(time.perf_counter() - start)
        for name in runs:
            out[name][m] = 1000 * statistics.median(runs[name]) / copies
    return out


def hash_str(text: str) -> int:
    import hashlib

    return int(hashlib.sha1(text.encode()).hexdigest()[:15], 16)


@functools.cache  # read once a process: it is part of every cost-curve cache key, looked up on each generate call
def cpu_name() -> str:
    """The CPU, as caches and figures must name it: /proc/cpuinfo's model name with its family and model numbers,
    which tell CPUs apart where a virtual machine reports only "AMD EPYC" (family 25: Zen 3/4, 26: Zen 5)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def device_name(device) -> str:
    """The device a record or cache key names: a CUDA GPU's name, else the host CPU's `cpu_name`."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
