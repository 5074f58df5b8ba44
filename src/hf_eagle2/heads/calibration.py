"""Calibration of the draft's confidence: does a node the head is p-sure of get accepted with probability p?

EAGLE-2 rests on this: it ranks nodes by V_i, the product of draft confidences along the path, as an estimate of
the probability that the target accepts the whole path. Two reliability diagrams:

* local: each drafted node's own confidence p(node | parent), against whether the target accepted it, among
  nodes whose parent was accepted (so the question is well posed);
* path: V_i against whether the whole path to the node was accepted.

ECE = sum over bins of (bin share) * |acceptance rate - mean confidence|.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reliability:
    edges: list[float]
    count: list[int]
    confidence: list[float]  # mean predicted probability per bin
    accepted: list[float]  # measured acceptance rate per bin
    ece: float
    total: int

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def reliability(confidence: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> Reliability:
    """confidence: (N,) in [0, 1]; outcome: (N,) bool. Equal-width bins."""
    confidence = confidence.double().clamp(0, 1)
    outcome = outcome.double()
    index = (confidence * bins).long().clamp(max=bins - 1)
    count = torch.bincount(index, minlength=bins)
    conf_sum = torch.bincount(index, weights=confidence, minlength=bins)
    acc_sum = torch.bincount(index, weights=outcome, minlength=bins)
    nonzero = count.clamp(min=1).double()
    total = int(count.sum())
    ece = float(((acc_sum - conf_sum).abs()).sum() / max(total, 1))
    return Reliability(
        edges=[i / bins for i in range(bins + 1)],
        count=count.tolist(),
        confidence=(conf_sum / nonzero).tolist(),
        accepted=(acc_sum / nonzero).tolist(),
        ece=ece,
        total=total,
    )


def merge_logs(logs: list[dict]) -> dict:
    """Concatenates the `eagle_stats.calibration` dicts of several generate calls."""
    keys = logs[0].keys()
    return {k: torch.cat([log[k] for log in logs]) for k in keys}


def merge_reliability(parts: list[dict]) -> dict:
    """One `Reliability` dict from several over the same bins (per-bin sums are mean x count, so the merge is the
    report of all their nodes together)."""
    edges = parts[0]["edges"]
    if any(p["edges"] != edges for p in parts):
        raise ValueError("reliability reports with different bins cannot be merged")
    count = [sum(p["count"][i] for p in parts) for i in range(len(edges) - 1)]
    conf_sum = [sum(p["confidence"][i] * p["count"][i] for p in parts) for i in range(len(count))]
    acc_sum = [sum(p["accepted"][i] * p["count"][i] for p in parts) for i in range(len(count))]
    total = sum(count)
    return Reliability(edges=edges, count=count, confidence=[c / max(n, 1) for c, n in zip(conf_sum, count)],
                       accepted=[a / max(n, 1) for a, n in zip(acc_sum, count)],
                       ece=sum(abs(a - c) for a, c in zip(acc_sum, conf_sum)) / max(total, 1), total=total).to_dict()


def merge_reports(reports: list[dict]) -> dict:
    """The calibration report of several evaluation runs' nodes together (`calibration_report` outputs)."""
    return {"local": merge_reliability([r["local"] for r in reports]),
            "path": merge_reliability([r["path"] for r in reports]), "nodes": sum(r["nodes"] for r in reports)}


def calibration_report(log: dict, bins: int = 10) -> dict:
    local_sel = log["parent_valid"].bool()
    local = reliability(log["local_logp"][local_sel].exp(), log["correct"][local_sel].bool(), bins)
    path = reliability(log["path_logv"].exp(), log["valid"].bool(), bins)
    return {"local": local.to_dict(), "path": path.to_dict(), "nodes": int(log["valid"].numel())}


def markdown_table(report: dict) -> str:
    lines = ["| bin | local: nodes | local: confidence | local: accepted | path: nodes | path: V | path: accepted |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    local, path = report["local"], report["path"]
    for i in range(len(local["count"])):
        lo, hi = local["edges"][i], local["edges"][i + 1]
        row = [f"{lo:.1f}-{hi:.1f}"]
        for r in (local, path):
            n = r["count"][i]
            row += [str(n), f"{r['confidence'][i]:.3f}" if n else "-", f"{r['accepted'][i]:.3f}" if n else "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(f"| **ECE** | | {local['ece']:.4f} | | | {path['ece']:.4f} | |")
    return "\n".join(lines)


def plot_reliability(report: dict, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, label in ((axes[0], "local", "draft confidence p(node | parent)"), (axes[1], "path", "path value V_i")):
        r = report[key]
        centers = [(a + b) / 2 for a, b in zip(r["edges"][:-1], r["edges"][1:])]
        width = r["edges"][1] - r["edges"][0]
        shown = [i for i, n in enumerate(r["count"]) if n]
        ax.bar([centers[i] for i in shown], [r["accepted"][i] for i in shown], width=width * 0.9, alpha=0.7,
               label="measured acceptance", color="tab:blue")  # fmt: skip
        ax.plot([r["confidence"][i] for i in shown], [r["accepted"][i] for i in shown], "o", color="tab:red",
                label="(mean confidence, acceptance)")  # fmt: skip
        ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
        ax.set_xlabel(label)
        ax.set_ylabel("accepted by the target")
        ax.set_title(f"{key}: ECE = {r['ece']:.3f} ({r['total']} nodes)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(loc="upper left", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
