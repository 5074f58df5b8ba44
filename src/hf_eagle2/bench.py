"""`hf-eagle2 bench`: speculative decoders side by side on MT-bench, HumanEval or a smoke list.

Methods run interleaved per prompt (order rotated every prompt) so machine drift hits them alike; each method
is warmed up first and the thread count is fixed. Every method's output must equal plain greedy `generate`; a
mismatch is recorded as a failure and that run is not counted in the timings.

Reported per method and dataset: tokens/s, speed-up over `plain` (median of the per-prompt time ratios, with
min and max), τ and target forwards, and for hf_eagle2 methods the per-round time split.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .evaluation import Prompt, chat_input_ids, load_prompts

TREE_METHODS = {
    "eagle2": dict(tree="eagle2"),
    "eagle1": dict(tree="eagle1"),
    "chain": dict(tree="chain"),
    "eagle2_no_value": dict(tree="eagle2", tree_global_value=False),
    "eagle2_no_rerank": dict(tree="eagle2", tree_rerank=False),
    "eagle2_neither": dict(tree="eagle2", tree_global_value=False, tree_rerank=False),
    "eagle2_paper": dict(tree="eagle2", tree_total_tokens=60, tree_depth=6, tree_top_k=10),  # the paper's GPU setting
    "eagle2_auto": dict(tree="eagle2", tree_total_tokens="auto", tree_depth="auto"),  # budget picked for this machine
    "eagle2_full_vocab": dict(tree="eagle2"),  # same tree, head scoring the full vocabulary
}
# per-round time split reported by the bench: column -> EagleStats attribute (seconds)
SPLIT_STATS = {"draft": "draft_model_s", "tree": "tree_build_s", "verify": "verify_s", "bookkeeping": "bookkeeping_s"}
ALL_METHODS = ("plain", "prompt_lookup", "assisted_chain", *TREE_METHODS)
DEFAULT_METHODS = ("plain", "prompt_lookup", "assisted_chain", "eagle1", "eagle2",
                   "eagle2_no_value", "eagle2_no_rerank", "eagle2_neither")  # fmt: skip


class ForwardCounter:
    """Counts target forward passes (a hook on the decoder), for methods that report no stats of their own."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.get_decoder().register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1

    def close(self):
        self.handle.remove()


@dataclass
class Run:
    method: str
    prompt: str
    seconds: float
    new_tokens: int
    target_forwards: int
    identical: bool
    split: dict = field(default_factory=dict)


def method_kwargs(method: str, draft, tree_params: dict) -> dict:
    if method == "plain":
        return {}
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": 10}
    if method == "assisted_chain":
        return {"assistant_model": draft, "num_assistant_tokens": tree_params.get("chain_depth", 4)}
    if method in TREE_METHODS:
        kw = dict(TREE_METHODS[method])
        if method == "eagle2_full_vocab":
            draft = _full_vocab(draft)
        if method == "eagle2_auto":
            kw.update(tree_top_k=tree_params["k"])
        elif kw["tree"] == "eagle2" and method != "eagle2_paper":
            kw.update(tree_total_tokens=tree_params["m"], tree_depth=tree_params["depth"], tree_top_k=tree_params["k"])
        elif kw["tree"] == "chain":
            kw.update(tree_depth=tree_params.get("chain_depth", 4))
        return {"assistant_model": draft, **kw}
    raise ValueError(f"unknown method {method!r}; choose from {ALL_METHODS}")


_FULL_VOCAB = {}


def _full_vocab(draft):
    """The same head with its reduced draft vocabulary removed (scores all target tokens)."""
    if id(draft) not in _FULL_VOCAB:
        _FULL_VOCAB[id(draft)] = draft.unbound_copy().set_draft_vocab(None)
    return _FULL_VOCAB[id(draft)]


def run_one(model, ids, method, draft, tree_params, max_new_tokens, reference=None) -> tuple[torch.Tensor, Run]:
    kwargs = method_kwargs(method, draft, tree_params)
    counter = ForwardCounter(model)
    try:
        start = time.perf_counter()
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **kwargs)
        seconds = time.perf_counter() - start
    finally:
        counter.close()
    seq = out.sequences
    new = seq.shape[1] - ids.shape[1]
    stats = getattr(out, "eagle_stats", None)
    forwards = stats.target_forwards if stats is not None else max(counter.calls - 1, 1 if new > 1 else 0)
    split = {}
    if stats is not None and stats.rounds:
        split = {key: 1000 * getattr(stats, attr) / stats.rounds for key, attr in SPLIT_STATS.items()}
    identical = reference is None or torch.equal(seq, reference)
    return seq, Run(method, "", seconds, new, forwards, identical, split)


def bench_prompts(dataset: str, limit: int | None) -> list[Prompt]:
    return load_prompts(dataset, limit)


def run_bench(model, tokenizer, draft, *, datasets=("mtbench",), methods=DEFAULT_METHODS, limit=None,
              max_new_tokens=256, tree_params=None, threads=None, progress=True, second_turn=True) -> dict:  # fmt: skip
    """Runs the benchmark; returns the results dict (see module doc)."""
    if threads:
        torch.set_num_threads(threads)
    tree_params = {"m": 16, "depth": 6, "k": 4, "chain_depth": 4} | dict(tree_params or {})
    methods = list(dict.fromkeys(["plain", *methods]))
    for m in methods:
        method_kwargs(m, draft, tree_params)  # validate names early
    # warm-up: one short generation per method
    warm = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello!"}])
    for m in methods:
        run_one(model, warm, m, draft, tree_params, 8)
    work = []  # (dataset, prompt id, messages builder)
    for ds in datasets:
        for p in bench_prompts(ds, limit):
            work.append((ds, p, 0))
            if ds == "mtbench" and second_turn:
                work.append((ds, p, 1))
    runs: dict[str, list[Run]] = {}
    first_answers: dict[str, str] = {}
    bar = tqdm(total=len(work) * len(methods), desc="bench", unit="run", disable=not progress)
    for index, (ds, prompt, turn) in enumerate(work):
        messages = list(prompt.messages)
        if turn == 1:  # MT-bench second turn, conditioned on the model's own first answer
            from .assets import mtbench_questions

            question = next(q for q in mtbench_questions() if f"mtbench-{q['question_id']}" == prompt.id)
            messages += [{"role": "assistant", "content": first_answers[prompt.id]},
                         {"role": "user", "content": question["turns"][1]}]  # fmt: skip
        ids = chat_input_ids(tokenizer, messages)
        order = methods[index % len(methods) :] + methods[: index % len(methods)]
        outputs, results = {}, {}
        for m in order:
            seq, run = run_one(model, ids, m, draft, tree_params, max_new_tokens)
            run.prompt = f"{prompt.id}/turn{turn + 1}"
            outputs[m], results[m] = seq, run
            bar.update(1)
        reference = outputs["plain"]
        for m, run in results.items():
            run.identical = torch.equal(outputs[m], reference)
            runs.setdefault(f"{ds}/{m}", []).append(run)
        if turn == 0 and ds == "mtbench":
            first_answers[prompt.id] = tokenizer.decode(reference[0, ids.shape[1] :], skip_special_tokens=True)
    bar.close()
    return summarize(runs, datasets, methods, tree_params, max_new_tokens)


def summarize(runs: dict[str, list[Run]], datasets, methods, tree_params, max_new_tokens) -> dict:
    table = {}
    for ds in datasets:
        plain_runs = {r.prompt: r for r in runs.get(f"{ds}/plain", [])}
        for m in methods:
            rs = runs.get(f"{ds}/{m}", [])
            ok = [r for r in rs if r.identical]
            ratios = [plain_runs[r.prompt].seconds / r.seconds for r in ok if r.prompt in plain_runs and r.seconds > 0]
            tokens = sum(r.new_tokens for r in ok)
            forwards = sum(r.target_forwards for r in ok)
            seconds = sum(r.seconds for r in ok)
            split = {}
            if ok and ok[0].split:
                rounds = [r for r in ok if r.split]
                split = {k: statistics.fmean(r.split[k] for r in rounds) for k in SPLIT_STATS}
                split["overhead_share"] = (split["tree"] + split["bookkeeping"]) / sum(split[k] for k in SPLIT_STATS)
            table.setdefault(ds, {})[m] = {
                "runs": len(rs),
                "mismatches": len(rs) - len(ok),
                "failed_prompts": [r.prompt for r in rs if not r.identical],
                "new_tokens": tokens,
                "target_forwards": forwards,
                "tau": tokens / forwards if forwards else None,
                "tokens_per_second": tokens / seconds if seconds else None,
                "speedup_median": statistics.median(ratios) if ratios else None,
                "speedup_min": min(ratios) if ratios else None,
                "speedup_max": max(ratios) if ratios else None,
                "round_ms": split,
            }
    return {
        "meta": machine_meta() | {"max_new_tokens": max_new_tokens, "tree_params": tree_params, "methods": list(methods)},
        "results": table,
        "all_identical": all(v["mismatches"] == 0 for ds in table.values() for v in ds.values()),
    }


def machine_meta() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001 - not a git checkout
        commit = ""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def markdown(results: dict) -> str:
    lines = []
    for ds, methods in results["results"].items():
        lines += [f"**{ds}**", "", "| method | tok/s | speed-up (median, min-max) | τ | target fwd | round ms: draft / tree / verify / bookkeeping | identical |",
                  "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for m, r in methods.items():
            sp = "-" if r["speedup_median"] is None else f"{r['speedup_median']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
            split = r["round_ms"]
            split_s = " / ".join(f"{split[k]:.1f}" for k in SPLIT_STATS) if split else "-"
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            tps = "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:.1f}"
            ident = "yes" if r["mismatches"] == 0 else f"**{r['mismatches']} mismatches**"
            lines.append(f"| {m} | {tps} | {sp} | {tau} | {r['target_forwards']} | {split_s} | {ident} |")
        lines.append("")
    return "\n".join(lines)


# EAGLE-2 paper, ablations on Vicuna-7B, MT-bench, greedy (speed-up over vanilla decoding on GPU)
PAPER_ABLATION = {"eagle2": 3.62, "eagle2_no_rerank": 3.48, "eagle2_no_value": 3.21, "eagle2_neither": 2.81}


def ablation_markdown(results: dict) -> str:
    """The paper's value / reranking ablation next to ours (empty when the ablation methods were not run)."""
    rows = [m for m in PAPER_ABLATION if m in results["meta"]["methods"]]
    datasets = list(results["results"])
    if len(rows) < 2:
        return ""
    head = "| variant | paper (Vicuna-7B, MT-bench, GPU) | " + " | ".join(f"ours: {ds} speed-up / τ" for ds in datasets) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(datasets)]
    names = {"eagle2": "EAGLE-2 (value V_i + reranking)", "eagle2_no_rerank": "without reranking",
             "eagle2_no_value": "without the global value (own confidence)", "eagle2_neither": "both removed"}  # fmt: skip
    for m in rows:
        cells = []
        for ds in datasets:
            r = results["results"][ds][m]
            cells.append("-" if r["speedup_median"] is None else f"{r['speedup_median']:.2f}x / {r['tau']:.2f}")
        lines.append(f"| {names[m]} | {PAPER_ABLATION[m]:.2f}x | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def readme_section(results: dict) -> str:
    """The README's results block: provenance line, the table, the ablation table and the plot."""
    meta = results["meta"]
    tree = meta["tree_params"]
    out = [f"Measured {meta['date']} on {meta['cpu']} ({meta['cores']} cores, {meta['threads']} threads, torch "
           f"{meta['torch']}), commit `{meta['commit']}`, {meta.get('dtype', 'float32')}, greedy, "
           f"max_new_tokens {meta['max_new_tokens']}; eagle2 tree m={tree['m']}, depth {tree['depth']}, k={tree['k']}.",
           "", "```bash", meta.get("command", "hf-eagle2 bench"), "```", "", markdown(results)]  # fmt: skip
    ablation = ablation_markdown(results)
    if ablation:
        out += ["Ablation (the paper's Table next to ours):", "", ablation]
    return "\n".join(out)


def update_readme(path: str, section: str, marker: str = "RESULTS") -> None:
    """Replaces the text between `<!-- RESULTS -->` and `<!-- /RESULTS -->` in `path`."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    with open(path) as f:
        text = f.read()
    if start not in text:
        raise ValueError(f"{path} has no {start} marker to put the results under")
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1] if end in rest else rest
    with open(path, "w") as f:
        f.write(f"{before}{start}\n{section}\n{end}{after}")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(results["results"])
    methods = [m for m in results["meta"]["methods"] if m != "plain"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(datasets), 1)
    for j, ds in enumerate(datasets):
        xs = [i + j * width for i in range(len(methods))]
        sp = [results["results"][ds][m]["speedup_median"] or 0 for m in methods]
        tau = [results["results"][ds][m]["tau"] or 0 for m in methods]
        axes[0].bar(xs, sp, width, label=ds)
        axes[1].bar(xs, tau, width, label=ds)
    for ax, title in ((axes[0], "speed-up over plain generate (median)"), (axes[1], "τ (tokens per target forward)")):
        ax.set_xticks([i + width * (len(datasets) - 1) / 2 for i in range(len(methods))])
        ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    meta = results["meta"]
    fig.suptitle(f"{meta.get('cpu', '')}, {meta.get('threads')} threads, commit {meta.get('commit')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    stem = os.path.splitext(out)[0]
    with open(stem + ".md", "w") as f:
        f.write(readme_section(results))
    plot(results, stem + ".png")
