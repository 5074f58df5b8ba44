"""`tree_total_tokens="auto"`: size each round's tree by what it is expected to return for what it costs here.

    tokens per second of a round keeping the top-m nodes = (1 + sum of their V_i) / (verify(m + 1) + draft + rest)

* verify(q): the target's cost of one forward over q tokens on top of a cached prefix, draft: the head's steps,
  rest: per-round bookkeeping. Measured once on this machine (a few seconds) and cached per model shape,
  device, dtype, threads and CPU kernels (`optimize_for_cpu`), so the choice follows the hardware: a CPU whose
  multi-token passes cost ~2x a step keeps small trees, a GPU where they are nearly free keeps large ones.
* V_i (the product of draft confidences along the path) estimates each node's acceptance; for EAGLE heads it is
  well calibrated (the calibration report measures it), so 1 + sum V_i is the expected yield of a round.

The choice is made per round from that round's own values (`tree.RoundBudget`): confident rounds verify more
nodes, uncertain ones fewer, and drafting stops at the depth whose nodes could not pay for another head step.
The official EAGLE code instead picks one m from a list by timing whole generations.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..kernels.cpu import cache_root

VERIFY_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class CostModel:
    """Seconds per round: verify[q] for q tree tokens (interpolated), draft_step per head step, overhead."""

    verify_q: list[int]
    verify_s: list[float]
    draft_step_s: float
    overhead_s: float

    def verify(self, q: int) -> float:
        xs, ys = self.verify_q, self.verify_s
        if q <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if q <= x1:
                return y0 + (y1 - y0) * (q - x0) / (x1 - x0)
        return ys[-1] + (ys[-1] - ys[-2]) * (q - xs[-1]) / (xs[-1] - xs[-2])  # linear beyond the last point

    def round_s(self, m: int, depth: int) -> float:
        return self.verify(m + 1) + depth * self.draft_step_s + self.overhead_s


# ---------------------------------------------------------------- measurement (cached)
def _key(*parts) -> str:
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:16]


def _cache_file(kind: str, key: str) -> str:
    return os.path.join(cache_root(), "autotune", f"{kind}-{key}.json")


@torch.inference_mode()
def measure_cost(model, draft, top_k: int, prefix_len: int = 256, repeats: int = 5, refresh: bool = False,
                 points=VERIFY_POINTS) -> CostModel:  # fmt: skip
    """Times verify(q) for q in VERIFY_POINTS and one head step (median of `repeats` after two warm-ups); cached
    per model, device (CPU model or GPU name), dtype and threads. Measure on an otherwise idle machine: the numbers
    are reused."""
    from transformers.cache_utils import DynamicCache

    from .target import TargetModel
    from .tree import DraftTree, _ancestors_from_parents

    from ..kernels.cpu import device_name, min_rows_of

    target = TargetModel(model)
    tc = target.config
    kernels = sorted((str(k), v) for k, v in min_rows_of(model).items())
    key = _key(type(model).__name__, tc.hidden_size, tc.num_hidden_layers, tc.vocab_size, target.device, target.dtype,
               torch.get_num_threads(), top_k, draft.draft_vocab_size, prefix_len, kernels, tuple(points),
               device_name(target.device))  # fmt: skip
    path = _cache_file("cost", key)
    if os.path.exists(path) and not refresh:
        with open(path) as f:
            return CostModel(**json.load(f))
    device = target.device
    vocab = tc.vocab_size
    rng = torch.Generator().manual_seed(0)  # never the global RNG: a seeded sampling run must not depend on this
    prefix = torch.randint(0, vocab, (1, prefix_len), generator=rng).to(device)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    target.forward(prefix, torch.arange(prefix_len, device=device).unsqueeze(0), None, cache, logits_to_keep=1)
    slot_pos = torch.arange(prefix_len, device=device).unsqueeze(0)
    verify_s = []
    for q in points:
        parents = torch.arange(-1, q - 1, device=device).unsqueeze(0)  # a chain: same cost as any tree of q nodes
        depths = torch.arange(q, device=device).unsqueeze(0)
        tree = DraftTree(torch.randint(0, vocab, (1, q), generator=rng).to(device), parents, depths,
                         _ancestors_from_parents(parents, depths, q - 1), torch.zeros(1, q), torch.zeros(1, q))  # fmt: skip
        times = []
        for _ in range(repeats + 2):
            _sync(device)
            start = time.perf_counter()
            positions = prefix_len + tree.depths
            mask = target.tree_attention_mask(cache, tree, positions, slot_pos)
            target.forward(tree.tokens, positions, mask, cache)
            _sync(device)
            times.append(time.perf_counter() - start)
            cache.crop(-q)
        verify_s.append(statistics.median(times[2:]))
    verify_s = [max(verify_s[: i + 1]) for i in range(len(verify_s))]  # a larger tree never costs less
    # one head step: k tokens on top of the prefix, their logits and top-k
    draft.bind(model)
    hidden = draft.config.hidden_size  # the head's feature width (EAGLE-3 heads may differ from the target's)
    k_ctx = draft(prefix[:, 1:], torch.randn(1, prefix_len - 1, hidden, generator=rng).to(device, draft.fc.weight.dtype),
                  torch.arange(prefix_len - 1, device=device).unsqueeze(0))[1]  # fmt: skip
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        mask = torch.ones(1, 1, top_k, prefix_len - 1 + top_k, dtype=torch.bool, device=device)
        h, _ = draft(prefix[:, :top_k], torch.randn(1, top_k, hidden, generator=rng).to(device, draft.fc.weight.dtype),
                     torch.full((1, top_k), prefix_len, device=device), mask, k_ctx)  # fmt: skip
        torch.log_softmax(draft.draft_logits(h).float(), -1).topk(top_k, dim=-1)
        _sync(device)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    cost = CostModel(list(points), verify_s, step, overhead_s=0.1 * verify_s[0])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(asdict(cost), f)
    return cost


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def round_budget(model, draft, top_k: int) -> "RoundBudget":
    """The measured (cached) cost model as a per-round `RoundBudget`, with verify costs for q = 1..65."""
    from .tree import RoundBudget

    cost = measure_cost(model, draft, top_k)
    verify = torch.tensor([cost.verify(max(q, 1)) for q in range(VERIFY_POINTS[-1] + 2)], dtype=torch.float32)
    device = draft.fc.weight.device
    on_cpu = device.type == "cpu"  # a CPU reads once per depth (free there); accelerators once a round, lagged
    return RoundBudget(verify.to(device), cost.draft_step_s, cost.overhead_s, early_stop=on_cpu, lagged=not on_cpu)
