"""`tree_total_tokens="auto"`: pick the tree size m and depth that maximise expected tokens per second here.

    tokens per second(m, d) = E[tokens per round](m, d) / T_round(m, d)

* T_round(m, d) = verify(m + 1) + draft(d) + overhead: the target's cost of one forward over m + 1 tokens on top
  of a cached prefix, the head's cost of d drafting steps with the chosen k, and the per-round bookkeeping. All
  measured once on this machine and cached per (model, device, dtype, threads).
* E[tokens per round](m, d) = 1 + E[sum over the kept nodes of P(node accepted)]. At most one node per depth is
  accepted, so the expected number of accepted draft tokens is the sum of the nodes' acceptance probabilities;
  EAGLE-2's V_i estimates them (the calibration report measures how well). A short profiling run records, per
  round, the V_i of a large tree (m_max, d_max); since EAGLE-2 keeps the top-m nodes by V_i among those of depth
  <= d, and a smaller tree's candidates are the first levels of a larger one, E(m, d) follows for every m <= m_max
  and d <= d_max from that one recording. V_i is mapped through the measured reliability curve first.

The official EAGLE code only picks m from a fixed list by timing whole generations; this model also picks the
depth, and needs a handful of forward timings rather than full generations per candidate.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .assets import cache_root

M_GRID = (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 60)
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


def expected_tokens(values: list[torch.Tensor], depths: list[torch.Tensor], m: int, depth: int) -> float:
    """1 + mean over rounds of the sum of the m largest (calibrated) node values among nodes of depth <= depth.

    values[r], depths[r]: the nodes of round r's recorded tree (root excluded)."""
    totals = []
    for v, d in zip(values, depths):
        kept = v[d <= depth]
        totals.append(float(kept.topk(min(m, kept.numel())).values.sum()) if kept.numel() else 0.0)
    return 1.0 + statistics.fmean(totals) if totals else 1.0


def choose_budget(cost: CostModel, expected, m_grid=M_GRID, depths=range(1, 9)) -> dict:
    """argmax over (m, depth) of expected(m, depth) / cost.round_s(m, depth). `expected` is a callable."""
    best = None
    for depth in depths:
        for m in m_grid:
            if m < depth:
                continue  # a tree of depth d needs at least d nodes
            e = expected(m, depth)
            rate = e / cost.round_s(m, depth)
            if best is None or rate > best["tokens_per_s"] * (1 + 1e-9):
                best = {"m": m, "depth": depth, "expected_tokens": e, "round_s": cost.round_s(m, depth), "tokens_per_s": rate}
    return best


# ---------------------------------------------------------------- measurement (cached)
def _key(*parts) -> str:
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:16]


def _cache_file(kind: str, key: str) -> str:
    return os.path.join(cache_root(), "autotune", f"{kind}-{key}.json")


@torch.inference_mode()
def measure_cost(model, draft, top_k: int, prefix_len: int = 256, repeats: int = 7, refresh: bool = False) -> CostModel:
    """Times verify(q) for q in VERIFY_POINTS and one head step (median of `repeats` after two warm-ups); cached
    per model, device, dtype and threads. Measure on an otherwise idle machine: the numbers are reused."""
    from transformers.cache_utils import DynamicCache

    from .target import TargetModel
    from .tree import DraftTree, _ancestors_from_parents

    target = TargetModel(model)
    tc = target.config
    key = _key(type(model).__name__, tc.hidden_size, tc.num_hidden_layers, tc.vocab_size, target.device, target.dtype,
               torch.get_num_threads(), top_k, draft.draft_vocab_size, prefix_len)  # fmt: skip
    path = _cache_file("cost", key)
    if os.path.exists(path) and not refresh:
        with open(path) as f:
            return CostModel(**json.load(f))
    device = target.device
    vocab = tc.vocab_size
    prefix = torch.randint(0, vocab, (1, prefix_len), device=device)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    target.forward(prefix, torch.arange(prefix_len, device=device).unsqueeze(0), None, cache, logits_to_keep=1)
    slot_pos = torch.arange(prefix_len, device=device).unsqueeze(0)
    verify_s = []
    for q in VERIFY_POINTS:
        parents = torch.arange(-1, q - 1, device=device).unsqueeze(0)  # a chain: same cost as any tree of q nodes
        depths = torch.arange(q, device=device).unsqueeze(0)
        tree = DraftTree(torch.randint(0, vocab, (1, q), device=device), parents, depths,
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
    hidden = tc.hidden_size
    k_ctx = draft(prefix[:, 1:], torch.randn(1, prefix_len - 1, hidden, device=device, dtype=draft.fc.weight.dtype),
                  torch.arange(prefix_len - 1, device=device).unsqueeze(0))[1]  # fmt: skip
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        mask = torch.ones(1, 1, top_k, prefix_len - 1 + top_k, dtype=torch.bool, device=device)
        h, _ = draft(prefix[:, :top_k], torch.randn(1, top_k, hidden, device=device, dtype=draft.fc.weight.dtype),
                     torch.full((1, top_k), prefix_len, device=device), mask, k_ctx)  # fmt: skip
        torch.log_softmax(draft.draft_logits(h).float(), -1).topk(top_k, dim=-1)
        _sync(device)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    cost = CostModel(list(VERIFY_POINTS), verify_s, step, overhead_s=0.1 * verify_s[0])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(asdict(cost), f)
    return cost


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class AcceptanceProfile:
    """Per recorded round: calibrated node values and depths of a large EAGLE-2 tree, plus bookkeeping time."""

    values: list[list[float]]
    depths: list[list[int]]
    overhead_s: float
    top_k: int
    m_max: int
    d_max: int

    def expected(self, m: int, depth: int) -> float:
        return expected_tokens([torch.tensor(v) for v in self.values], [torch.tensor(d) for d in self.depths], m, depth)


def _draft_key(draft) -> str:
    with torch.no_grad():
        fingerprint = float(draft.fc.weight.double().sum()) + float(draft.layers[0].mlp.down_proj.weight.double().abs().sum())
    return _key(getattr(draft, "name_or_path", ""), draft.config.hidden_size, draft.draft_vocab_size, f"{fingerprint:.6e}")


@torch.inference_mode()
def profile_acceptance(model, draft, prompts: list[torch.Tensor], top_k: int, m_max: int = 64, d_max: int = 8,
                       max_new_tokens: int = 96, refresh: bool = False) -> AcceptanceProfile:  # fmt: skip
    """Records a large tree per round on `prompts` (greedy) and maps V_i through the measured reliability curve.
    Cached per (target, head, k)."""
    from .calibration import reliability

    tc = model.config.get_text_config()
    key = _key(type(model).__name__, tc.hidden_size, tc.num_hidden_layers, _draft_key(draft), top_k, m_max, d_max)
    path = _cache_file("accept", key)
    if os.path.exists(path) and not refresh:
        with open(path) as f:
            return AcceptanceProfile(**json.load(f))
    logs, overhead, rounds = [], 0.0, 0
    for ids in prompts:
        out = model.generate(ids, assistant_model=draft, tree="eagle2", tree_total_tokens=m_max, tree_depth=d_max,
                             tree_top_k=top_k, max_new_tokens=max_new_tokens, do_sample=False,
                             return_dict_in_generate=True, eagle_record_calibration=True)  # fmt: skip
        logs.append(out.eagle_stats.calibration)
        overhead += out.eagle_stats.bookkeeping_s
        rounds += out.eagle_stats.rounds
    value = torch.cat([log["path_logv"] for log in logs]).exp()
    valid = torch.cat([log["valid"] for log in logs]).bool()
    curve = reliability(value, valid, bins=20)
    bins = (value * 20).long().clamp(max=19)
    calibrated = torch.tensor(curve.accepted, dtype=torch.float64)[bins]  # measured acceptance rate of each V bin
    round_id = torch.cat([log["round"] + 10_000 * i for i, log in enumerate(logs)])
    depth = torch.cat([log["depth"] for log in logs])
    values, depths = [], []
    for r in torch.unique(round_id).tolist():
        sel = round_id == r
        values.append(calibrated[sel].tolist())
        depths.append(depth[sel].tolist())
    profile = AcceptanceProfile(values, depths, overhead / max(rounds, 1), top_k, m_max, d_max)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(asdict(profile), f)
    return profile


def auto_budget(model, draft, top_k: int, prompts: list[torch.Tensor], fix_depth: int | None = None,
                fix_m: int | None = None) -> dict:  # fmt: skip
    """The (m, depth) with the best expected tokens per second for this target, head and machine."""
    cost = measure_cost(model, draft, top_k)
    profile = profile_acceptance(model, draft, prompts, top_k)
    cost.overhead_s = profile.overhead_s
    depths = [fix_depth] if fix_depth else range(1, profile.d_max + 1)
    m_grid = [fix_m] if fix_m else [m for m in M_GRID if m <= profile.m_max]
    return choose_budget(cost, profile.expected, m_grid=m_grid, depths=depths)
