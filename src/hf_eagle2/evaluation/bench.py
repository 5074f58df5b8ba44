"""`hf-eagle2 bench`: speculative decoders side by side on MT-bench, HumanEval or a smoke list.

Methods run interleaved per prompt (order rotated every prompt) so machine drift hits them alike; each method
is warmed up first and the thread count is fixed. `plain_stock` is plain `generate` on stock kernels: what a
user has today; every other method runs on the kernels `--kernels` names (`fast`: `optimize_for_cpu`), so the
headline speed-up is against `plain` on the same kernels and a second one against `plain_stock`.

Exactness: in float32 every method's output must equal plain greedy `generate`; a mismatch is recorded as a
failure and that run is not counted in the timings. In bf16/fp16 a q-token pass rounds differently from a
1-token step, so every speculative method (transformers' own included) drifts from plain greedy sooner or
later: there all runs are timed, and the share of identical outputs and the mean position of the first
differing token are reported instead.

Reported per method and dataset: tokens/s, speed-ups (median of the per-prompt time ratios, with min and max),
τ and target forwards, and for hf_eagle2 methods the per-round time split.

vLLM as a peer (`vllm_plain`, `vllm_eagle3`; `vllm_peer`): vLLM's CPU build, from its own venv, one long-lived
worker per method, on the same prompts (token ids), greedy, one request at a time, in the same per-prompt
rotation. Their seconds are vLLM's `generate` wall time; `vllm_eagle3`'s target forwards are vLLM's draft steps
(`spec_decode_num_drafts`: every decode step after the prefill drafts), so its τ is (new tokens - 1) / drafts, which
matches vLLM's mean accepted length 1 + accepted / drafts (reported beside it). vLLM's kernels round differently
from transformers', so its output is compared with plain `generate` and the identical share reported, but a
vLLM mismatch is no bench failure (`all_identical` leaves vllm_* out) and its runs are all timed.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from ..engine.drafter import DEFAULT_CPU_NGRAM
from .evaluate import chat_input_ids, follow_up_chat, load_prompts
from .vllm_peer import VLLM_METHODS, VllmOptions, close_peers, start_peers
from ..engine.stats import tau_of
from ..kernels.cpu import cpu_name

# name -> generate kwargs; FIXED marks the methods that get the fixed tree of `tree_params` (m, depth, k)
TREE_METHODS = {
    "eagle2": dict(tree="eagle2"),  # the defaults: rounds sized by the cost curve (+ the n-gram branch on CPU)
    "eagle2_no_ngram": dict(tree="eagle2", tree_ngram=0),  # the defaults without the n-gram (prompt lookup) branch
    "eagle2_auto_depth": dict(tree="eagle2", tree_depth="auto"),
    "eagle2_fixed": dict(tree="eagle2"),  # FIXED: m, depth, k of tree_params
    "eagle2_m8": dict(tree="eagle2", tree_total_tokens=8),
    "eagle2_m32": dict(tree="eagle2", tree_total_tokens=32),
    "eagle1": dict(tree="eagle1"),
    "chain": dict(tree="chain"),
    "eagle2_no_value": dict(tree="eagle2", tree_global_value=False),  # FIXED
    "eagle2_no_rerank": dict(tree="eagle2", tree_rerank=False),  # FIXED
    "eagle2_neither": dict(tree="eagle2", tree_global_value=False, tree_rerank=False),  # FIXED
    "eagle2_paper": dict(tree="eagle2", tree_total_tokens=60, tree_depth=6, tree_top_k=10),  # the paper's GPU setting
    "eagle2_full_vocab": dict(tree="eagle2"),  # the defaults, head scoring the full vocabulary
    "eagle2_compiled": dict(tree="eagle2", tree_compile=True),  # the defaults, each draft level one compiled call
    # and the verify pass one more, over a static cache of a fixed size (one graph for every prompt)
    "eagle2_compiled_static": dict(tree="eagle2", tree_compile=True, cache_implementation="static", max_cache_len=2048),
}
FIXED = ("eagle2_fixed", "eagle2_no_value", "eagle2_no_rerank", "eagle2_neither")
# per-round time split reported by the bench: column -> EagleStats attribute (seconds)
SPLIT_STATS = {"draft": "draft_model_s", "tree": "tree_build_s", "verify": "verify_s", "bookkeeping": "bookkeeping_s"}
ALL_METHODS = ("plain", "plain_stock", "prompt_lookup", "assisted", "assisted_chain", *TREE_METHODS, *VLLM_METHODS)
# HF's own assisted decoding with a separate small model (--assistant): `assisted` with transformers' defaults,
# `assisted_<n>` with num_assistant_tokens=n under the constant schedule (each round drafts exactly n)
ASSISTED_N = re.compile(r"^assisted_(\d+)$")
DEFAULT_METHODS = ("plain", "plain_stock", "prompt_lookup", "assisted_chain", "eagle2", "eagle2_no_ngram", "eagle2_fixed")


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
    diverged_at: int | None = None  # first new token that differs from plain greedy (None: identical)
    prefill_tokens: int = 1  # the first token, from the prefill forward (not counted in target_forwards or tau)
    spec: dict = field(default_factory=dict)  # vllm_eagle3: vLLM's spec-decode counters for this request


def method_kwargs(method: str, draft, tree_params: dict, assistant=None) -> dict:
    """generate kwargs of a bench method; assistant: the separate assistant model of `assisted` / `assisted_<n>`."""
    if method in ("plain", "plain_stock"):
        return {}
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": 10}
    if method == "assisted" or ASSISTED_N.match(method):
        if assistant is None:
            raise ValueError(f"{method} is transformers' assisted decoding with a separate assistant model: give "
                             "--assistant (e.g. qwen2.5-coder-0.5b for the 1.5B)")  # fmt: skip
        return {"assistant_model": assistant}  # `assisted_<n>`'s draft length: `assistant_settings`
    if method == "assisted_chain":
        return {"assistant_model": draft, "num_assistant_tokens": tree_params.get("chain_depth", 4)}
    if method in TREE_METHODS:
        kw = dict(TREE_METHODS[method])
        if method == "eagle2_full_vocab":
            draft = _full_vocab(draft)
        if method in FIXED:
            kw.update(tree_total_tokens=tree_params["m"], tree_depth=tree_params["depth"], tree_top_k=tree_params["k"])
        elif kw["tree"] == "chain":
            kw.update(tree_depth=tree_params.get("chain_depth", 4))
        return {"assistant_model": draft, **kw}
    if method in VLLM_METHODS:
        return {}  # run by a vLLM worker (run_vllm), not by generate
    raise ValueError(f"unknown method {method!r}; choose from {ALL_METHODS} (or assisted_<n>)")


_FULL_VOCAB = {}


def _full_vocab(draft):
    """The same head with its reduced draft vocabulary removed (scores all target tokens)."""
    if id(draft) not in _FULL_VOCAB:
        _FULL_VOCAB[id(draft)] = draft.unbound_copy().set_draft_vocab(None)
    return _FULL_VOCAB[id(draft)]


def assistant_settings(method: str) -> dict:
    """The assistant's generation_config of `assisted_<n>`: n draft tokens a round under the constant schedule, with
    no confidence early stop. transformers reads these from the assistant model's own generation_config (it ignores
    a `num_assistant_tokens=` given to the target's generate), so `run_one` sets them there for the run."""
    n = ASSISTED_N.match(method)
    return {"num_assistant_tokens": int(n.group(1)), "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0} if n else {}  # fmt: skip


def run_one(model, ids, method, draft, tree_params, max_new_tokens, reference=None, kernels="fast",
            assistant=None) -> tuple[torch.Tensor, Run]:  # fmt: skip
    from ..kernels.cpu import optimize_for_cpu

    kwargs = method_kwargs(method, draft, tree_params, assistant)
    # tree methods count their own forwards (a hook's Python counter would also be a guard of a compiled verify)
    counter = None if kwargs.get("tree") else ForwardCounter(model)
    fast = kernels == "fast" and method != "plain_stock"
    optimize_for_cpu(model, enable=fast, release=False)  # the packed weights stay cached across switches
    overrides = assistant_settings(method)
    if assistant is not None:
        optimize_for_cpu(assistant, enable=fast, release=False)
        saved = {key: getattr(assistant.generation_config, key) for key in overrides}
        assistant.generation_config.update(**overrides)
    try:
        start = time.perf_counter()
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **kwargs)
        seconds = time.perf_counter() - start
    finally:
        if counter is not None:
            counter.close()
        if assistant is not None:  # `assisted` (transformers' defaults) runs on the assistant's own settings
            assistant.generation_config.update(**saved)
    seq = out.sequences
    new = seq.shape[1] - ids.shape[1]
    stats = getattr(out, "eagle_stats", None)
    forwards = stats.target_forwards if stats is not None else max(counter.calls - 1, 1 if new > 1 else 0)
    split = {}
    if stats is not None and stats.rounds:
        split = {key: 1000 * getattr(stats, attr) / stats.rounds for key, attr in SPLIT_STATS.items()}
    prefill_tokens = sum(stats.prefill_tokens_per_row) if stats is not None else min(new, 1)
    run = Run(method, "", seconds, new, forwards, True, split, prefill_tokens=prefill_tokens)
    if reference is not None:
        mark_divergence(run, seq, reference, ids.shape[1])
    return seq, run


def run_vllm(peer, ids, method, max_new_tokens) -> tuple[torch.Tensor, Run]:
    """One request to a vLLM worker (vllm_peer.VllmPeer) as a Run; see the module doc for forwards and τ."""
    answer = peer.generate(ids[0].tolist(), max_new_tokens)
    tokens = answer["tokens"]
    new = len(tokens)
    spec = answer.get("spec") or {}
    if method == "vllm_eagle3" and spec.get("drafts"):
        forwards = int(spec["drafts"])
    else:
        forwards = max(new - 1, 0)  # one token per forward after the prefill's
    seq = torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype)], dim=1)
    run = Run(method, "", float(answer["seconds"]), new, forwards, True, prefill_tokens=min(new, 1),
              spec={k: spec[k] for k in ("drafts", "draft_tokens", "accepted") if k in spec})  # fmt: skip
    return seq, run


def mark_divergence(run: Run, seq: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> None:
    """Sets run.identical and run.diverged_at (index of the first differing new token, or None)."""
    run.identical = torch.equal(seq, reference)
    if run.identical:
        run.diverged_at = None
        return
    n = min(seq.shape[1], reference.shape[1])
    diff = (seq[0, :n] != reference[0, :n]).nonzero()
    run.diverged_at = (int(diff[0]) if diff.numel() else n) - prompt_len


def run_bench(model, tokenizer, draft, *, datasets=("mtbench",), methods=DEFAULT_METHODS, limit=None,
              max_new_tokens=256, tree_params=None, threads=None, progress=True, second_turn=True,
              kernels="fast", vllm: VllmOptions | None = None, assistant=None, journal: str | None = None,
              settings: dict | None = None) -> dict:  # fmt: skip
    """Runs the benchmark; returns the results dict (see module doc). `vllm`: how to run the vllm_* methods;
    assistant: the assistant model of `assisted*` methods.

    journal: a JSON-lines file that gets one line per finished prompt (every method's run), so a bench of hours
    resumes where it stopped: prompts already in it (written with the same `settings`) are not run again, and
    their runs count in the results as if measured now. Another bench's journal is refused, and so is one written on
    another CPU (`cpu_name`): its figures do not compare."""
    if threads:
        torch.set_num_threads(threads)
    if kernels not in ("fast", "stock"):
        raise ValueError(f"kernels must be 'fast' or 'stock', got {kernels!r}")
    if "mtbench2" in datasets:
        raise ValueError("bench measures MT-bench's second turns with --dataset mtbench (--first-turn-only leaves "
                         "them out); mtbench2 is eval-head's")  # fmt: skip
    tree_params = {"m": 16, "depth": 6, "k": 4, "chain_depth": 4} | dict(tree_params or {})
    methods = list(dict.fromkeys(["plain", *methods]))
    for m in methods:
        method_kwargs(m, draft, tree_params, assistant)  # validate names early
    # vLLM workers: started once (tens of seconds each), kept for the whole bench, stopped at its end
    peers = start_peers(methods, vllm or VllmOptions(dtype=str(next(model.parameters()).dtype)), model)
    try:
        done = Journal(journal, {"datasets": list(datasets), "methods": methods, "limit": limit,
                                 "max_new_tokens": max_new_tokens, "tree_params": tree_params, "kernels": kernels,
                                 "second_turn": second_turn, "cpu": cpu_name()} | dict(settings or {}))  # fmt: skip
        return _run_bench(model, tokenizer, draft, datasets, methods, limit, max_new_tokens, tree_params, progress,
                          second_turn, kernels, peers, assistant, done)  # fmt: skip
    finally:
        close_peers(peers)


class Journal:
    """The finished prompts of one bench (see `run_bench`): {work key: {"runs": {method: Run}, "answer": text}}."""

    def __init__(self, path: str | None, settings: dict):
        self.path, self.settings, self.done = path, json.loads(json.dumps(settings)), {}
        if path is None or not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if lines and lines[0].get("settings") != self.settings:
            changed = sorted(k for k in set(lines[0].get("settings", {})) | set(self.settings)
                             if lines[0].get("settings", {}).get(k) != self.settings.get(k))  # fmt: skip
            raise ValueError(f"{path} journals a bench with other settings ({', '.join(changed)}): run with the same "
                             "ones to resume it, or delete it (or pass --restart) to measure afresh")  # fmt: skip
        for line in lines[1:]:
            self.done[line["key"]] = {"runs": {m: Run(**r) for m, r in line["runs"].items()}, "answer": line["answer"]}

    def record(self, key: str, runs: dict, answer: str | None) -> None:
        self.done[key] = {"runs": runs, "answer": answer}
        if self.path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
        new = not os.path.exists(self.path)
        with open(self.path, "a", encoding="utf-8") as f:
            if new:
                f.write(json.dumps({"settings": self.settings}) + "\n")
            f.write(json.dumps({"key": key, "runs": {m: asdict(r) for m, r in runs.items()}, "answer": answer}) + "\n")


def journal_report(path: str) -> dict:
    """A bench's results as its journal stands (finished prompts only), without loading a model: the dict `run_bench`
    returns, its meta naming the journal's CPU, threads and last write, and `prompts` measured per dataset."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no bench journal there (a bench run with --out writes <out>.journal.jsonl)")
    with open(path, encoding="utf-8") as f:
        settings = json.loads(f.readline())["settings"]
    journal = Journal(path, settings)
    runs: dict[str, list[Run]] = {}
    for key, done in journal.done.items():
        for m, run in done["runs"].items():
            runs.setdefault(f"{key.split('/', 1)[0]}/{m}", []).append(run)
    prompts = Counter(key.split("/", 1)[0] for key in journal.done)  # keys: dataset/prompt id/turn
    datasets = [ds for ds in settings["datasets"] if prompts[ds]]
    exact = settings.get("dtype", "float32") in ("float32", "fp32")
    results = summarize(runs, datasets, settings["methods"], settings["tree_params"], settings["max_new_tokens"], exact)
    results["meta"].update(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(os.path.getmtime(path))), cpu=settings.get("cpu"),
        threads=settings.get("threads"), kernels=settings["kernels"], dtype=settings.get("dtype", "float32"),
        journal=path, prompts={ds: prompts[ds] for ds in datasets})  # fmt: skip
    return results


def _run_bench(model, tokenizer, draft, datasets, methods, limit, max_new_tokens, tree_params, progress, second_turn,
               kernels, peers, assistant=None, journal: Journal | None = None) -> dict:  # fmt: skip
    journal = journal or Journal(None, {})

    def one(m, ids, new_tokens):
        if m in VLLM_METHODS:
            return run_vllm(peers[m], ids, m, new_tokens)
        return run_one(model, ids, m, draft, tree_params, new_tokens, kernels=kernels, assistant=assistant)

    # warm-up: one short generation per method (the first also measures the kernel crossover and cost curve)
    warm = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello!"}])
    for m in methods:
        one(m, warm, 8)
    work = []  # (dataset, prompt id, messages builder)
    for ds in datasets:
        for p in load_prompts(ds, limit):
            work.append((ds, p, 0))
            if p.follow_up is not None and second_turn:
                work.append((ds, p, 1))
    runs: dict[str, list[Run]] = {}
    first_answers: dict[str, str] = {}
    resumed = sum(f"{ds}/{p.id}/{turn}" in journal.done for ds, p, turn in work)
    if resumed:
        print(f"bench: {resumed} of {len(work)} prompts already measured in {journal.path}: resuming", flush=True)
    bar = tqdm(total=len(work) * len(methods), desc="bench", unit="run", disable=not progress)
    for index, (ds, prompt, turn) in enumerate(work):
        key = f"{ds}/{prompt.id}/{turn}"
        if key in journal.done:
            for m, run in journal.done[key]["runs"].items():
                runs.setdefault(f"{ds}/{m}", []).append(run)
            if journal.done[key]["answer"] is not None:
                first_answers[prompt.id] = journal.done[key]["answer"]
            bar.update(len(methods))
            continue
        # MT-bench's second turn is conditioned on the model's own first answer
        messages = follow_up_chat(prompt, first_answers[prompt.id]) if turn == 1 else list(prompt.messages)
        ids = chat_input_ids(tokenizer, messages)
        order = methods[index % len(methods) :] + methods[: index % len(methods)]
        outputs, results = {}, {}
        for m in order:
            seq, run = one(m, ids, max_new_tokens)
            run.prompt = f"{prompt.id}/turn{turn + 1}"
            outputs[m], results[m] = seq, run
            bar.update(1)
        reference = outputs["plain"]
        for m, run in results.items():
            mark_divergence(run, outputs[m], reference, ids.shape[1])
            runs.setdefault(f"{ds}/{m}", []).append(run)
        answer = None
        if turn == 0 and prompt.follow_up is not None:
            answer = first_answers[prompt.id] = tokenizer.decode(reference[0, ids.shape[1] :], skip_special_tokens=True)
        journal.record(key, results, answer)
    bar.close()
    exact = next(model.parameters()).dtype == torch.float32
    results = summarize(runs, datasets, methods, tree_params, max_new_tokens, exact=exact)
    results["meta"].update(kernels=kernels, dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    if peers:
        results["meta"]["vllm"] = {m: {"vllm_version": p.info.get("vllm_version"),
                                       "load_seconds": p.info.get("load_seconds"), "log": p.log_path,
                                       "config": p.config} for m, p in peers.items()}  # fmt: skip
    return results


def _ratios(base: dict, runs: list[Run]) -> list[float]:
    return [base[r.prompt].seconds / r.seconds for r in runs if r.prompt in base and r.seconds > 0]


def summarize(runs: dict[str, list[Run]], datasets, methods, tree_params, max_new_tokens, exact: bool = True) -> dict:
    """exact: float32 runs, where a mismatch is a failure and is left out of the timings; otherwise every run
    is timed and the identical share and first-divergence position are reported. vllm_* runs are always all timed
    and never count against all_identical (another engine's rounding; see the module doc)."""
    table = {}
    for ds in datasets:
        plain_runs = {r.prompt: r for r in runs.get(f"{ds}/plain", [])}
        stock_runs = {r.prompt: r for r in runs.get(f"{ds}/plain_stock", [])}
        for m in methods:
            rs = runs.get(f"{ds}/{m}", [])
            ok = [r for r in rs if r.identical] if exact and m not in VLLM_METHODS else rs
            ratios = _ratios(plain_runs, ok)
            stock_ratios = _ratios(stock_runs, ok)
            diverged = [r.diverged_at for r in rs if r.diverged_at is not None]
            tokens = sum(r.new_tokens for r in ok)
            prefill_tokens = sum(r.prefill_tokens for r in ok)
            forwards = sum(r.target_forwards for r in ok)
            seconds = sum(r.seconds for r in ok)
            split = {}
            if ok and ok[0].split:
                rounds = [r for r in ok if r.split]
                split = {k: statistics.fmean(r.split[k] for r in rounds) for k in SPLIT_STATS}
                split["overhead_share"] = (split["tree"] + split["bookkeeping"]) / sum(split[k] for k in SPLIT_STATS)
            table.setdefault(ds, {})[m] = {
                "runs": len(rs),
                "mismatches": sum(not r.identical for r in rs),
                "failed_prompts": [r.prompt for r in rs if not r.identical],
                "new_tokens": tokens,
                "target_forwards": forwards,
                "prefill_tokens": prefill_tokens,
                "tau": tau_of(tokens, prefill_tokens, forwards),
                "tokens_per_second": tokens / seconds if seconds else None,
                "speedup_median": statistics.median(ratios) if ratios else None,
                "speedup_min": min(ratios) if ratios else None,
                "speedup_max": max(ratios) if ratios else None,
                "speedup_vs_stock_median": statistics.median(stock_ratios) if stock_ratios else None,
                "identical_share": (len(rs) - len(diverged)) / len(rs) if rs else None,
                "first_divergence_mean": statistics.fmean(diverged) if diverged else None,
                "round_ms": split,
            }
            if m == "vllm_eagle3":
                drafts = sum(r.spec.get("drafts", 0) for r in ok)
                draft_tokens = sum(r.spec.get("draft_tokens", 0) for r in ok)
                accepted = sum(r.spec.get("accepted", 0) for r in ok)
                vllm_plain = {r.prompt: r for r in runs.get(f"{ds}/vllm_plain", [])}
                vratios = _ratios(vllm_plain, ok)
                table[ds][m].update(
                    vllm_drafts=drafts, vllm_accepted=accepted,
                    vllm_acceptance_rate=accepted / draft_tokens if draft_tokens else None,
                    vllm_mean_accepted_length=1 + accepted / drafts if drafts else None,
                    speedup_vs_vllm_plain_median=statistics.median(vratios) if vratios else None)  # fmt: skip
    return {
        "meta": machine_meta() | {"max_new_tokens": max_new_tokens, "tree_params": tree_params, "methods": list(methods),
                                  "exact": exact},  # fmt: skip
        "results": table,
        "all_identical": all(v["mismatches"] == 0 for ds in table.values() for m, v in ds.items() if m not in VLLM_METHODS),
    }


def machine_meta() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001 - not a git checkout
        commit = ""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def markdown(results: dict) -> str:
    lines = []
    exact = results["meta"].get("exact", True)
    for ds, methods in results["results"].items():
        lines += [f"**{ds}**", "", "| method | tok/s | speed-up vs plain, same kernels (median, min-max) | vs plain, stock kernels "
                  "| τ | target fwd | round ms: draft / tree / verify / bookkeeping | identical to plain |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for m, r in methods.items():
            sp = "-" if r["speedup_median"] is None else f"{r['speedup_median']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
            stock = r.get("speedup_vs_stock_median")
            stock_s = "-" if stock is None else f"{stock:.2f}x"
            split = r["round_ms"]
            split_s = " / ".join(f"{split[k]:.1f}" for k in SPLIT_STATS) if split else "-"
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            tps = "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:.1f}"
            if exact and m not in VLLM_METHODS:
                ident = "yes" if r["mismatches"] == 0 else f"**{r['mismatches']} mismatches**"
            else:
                share, first = r.get("identical_share"), r.get("first_divergence_mean")
                ident = f"{100 * share:.0f}%" + ("" if first is None else f" (first diff at token {first:.0f} on average)")
            lines.append(f"| {m} | {tps} | {sp} | {stock_s} | {tau} | {r['target_forwards']} | {split_s} | {ident} |")
        lines.append("")
        if any(m in VLLM_METHODS for m in methods):
            lines += [vllm_note(methods), ""]
    if "profile" in results:
        lines += ["**ops per round** (outside the target's forward, first prompt)", "", profile_markdown(results["profile"])]
    return "\n".join(lines)


def vllm_note(methods: dict) -> str:
    note = ("vllm_* rows: vLLM's CPU build (its own venv), same prompts as token ids, greedy, one request at a time; "
            "seconds are vLLM's `generate` time. Its kernels round differently from transformers', so its identity "
            "to plain `generate` is reported as a share and is not a bench failure; all its runs are timed.")  # fmt: skip
    r = methods.get("vllm_eagle3")
    if r is not None:
        acc, mal, sp = r.get("vllm_acceptance_rate"), r.get("vllm_mean_accepted_length"), r.get("speedup_vs_vllm_plain_median")
        note += (" vllm_eagle3: τ = (new tokens - 1) / vLLM draft steps; vLLM's own mean accepted length "
                 f"{'-' if mal is None else f'{mal:.2f}'}, acceptance rate {'-' if acc is None else f'{acc:.2f}'}, "
                 f"speed-up over vllm_plain {'-' if sp is None else f'{sp:.2f}x'} (median).")  # fmt: skip
    return note


# EAGLE-2 paper, ablations on Vicuna-7B, MT-bench, greedy (speed-up over vanilla decoding on GPU)
PAPER_ABLATION = {"eagle2_fixed": 3.62, "eagle2_no_rerank": 3.48, "eagle2_no_value": 3.21, "eagle2_neither": 2.81}


def ablation_markdown(results: dict) -> str:
    """The paper's value / reranking ablation next to ours (empty when the ablation methods were not run)."""
    rows = [m for m in PAPER_ABLATION if m in results["meta"]["methods"]]
    datasets = list(results["results"])
    if len(rows) < 2:
        return ""
    head = "| variant | paper (Vicuna-7B, MT-bench, GPU) | " + " | ".join(f"ours: {ds} speed-up / τ" for ds in datasets) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(datasets)]
    names = {"eagle2_fixed": "EAGLE-2 (value V_i + reranking)", "eagle2_no_rerank": "without reranking",
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
           f"{meta['torch']}), commit `{meta['commit']}`, {meta.get('dtype', 'float32')}, {meta.get('kernels', 'stock')} "
           f"kernels, greedy, max_new_tokens {meta['max_new_tokens']}; fixed trees (eagle2_fixed, ablations) m={tree['m']}, "
           f"depth {tree['depth']}, k={tree['k']}; eagle2 = the defaults (per-round budget; on a CPU target also the "
           f"{DEFAULT_CPU_NGRAM}-token n-gram branch).",
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


# the accelerator setting of the round the op profile always reports (issue 46's yardstick): the paper's tree,
# no n-gram branch (it reads the host per row), and no per-round budget
ACCELERATOR_ROUND = dict(tree="eagle2", tree_total_tokens=60, tree_depth=6, tree_top_k=10, tree_ngram=0)
# compiled: each draft level one compiled call, and over a static cache with room for the last round's padded tree
# (64 nodes) the verify pass one more
COMPILED_ROUND = dict(ACCELERATOR_ROUND, tree_compile=True, cache_implementation="static", max_cache_len=1024)


def profile_ops(model, draft, ids, methods, tree_params: dict, kernels: str = "fast") -> dict:
    """Aten ops and host reads per unit of work outside the target's forward (`opcount`): per round for tree
    methods (each as the bench runs it, plus `eagle2_accelerator`: ACCELERATOR_ROUND), per token for plain.
    Returns {name: OpCounts.as_dict()}, measured on `ids` (greedy)."""
    from ..kernels.cpu import optimize_for_cpu
    from .opcount import count_round_ops

    optimize_for_cpu(model, enable=kernels == "fast", release=False)
    out = {"plain": count_round_ops(model, ids, short=8, long=24).as_dict()}
    rows = {m: method_kwargs(m, draft, tree_params) for m in methods if m in TREE_METHODS}
    rows["eagle2_accelerator"] = {"assistant_model": draft, **ACCELERATOR_ROUND}
    rows["eagle2_accelerator_compiled"] = {"assistant_model": draft, **COMPILED_ROUND}
    for name, kwargs in rows.items():
        out[name] = count_round_ops(model, ids, short=16, long=64, **kwargs).as_dict()
    return out


def profile_markdown(profile: dict) -> str:
    lines = ["| method | unit | aten ops | kernel launches (views excluded) | in the head's forward | compiled calls "
             "| host reads |", "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, c in profile.items():
        unit = "token" if name == "plain" else "round"
        lines.append(f"| {name} | {unit} | {c['ops']:.0f} | {c['launches']:.0f} | {c['head_ops']:.0f} | "
                     f"{c.get('compiled_calls', 0):.0f} | {c['host_reads']:.2f} |")  # fmt: skip
    return "\n".join(lines) + ("\n\nPer unit of work outside the target's forward, greedy; `eagle2_accelerator`: "
                               "m=60, depth 6, k=10, no n-gram branch; `_compiled`: with `tree_compile=True` over a "
                               "static cache (each draft level and the verify pass one compiled call, its ops not "
                               "counted).\n")


def cost_curve(model, draft, top_k: int = 4, points=(1, 2, 4, 8, 16, 32, 64)) -> dict:
    """Verify cost per q on stock and fast kernels (same prefix, measured now, not cached) and the per-dtype
    row count from which `optimize_for_cpu` uses oneDNN: {'stock': {q: ms}, 'fast': {q: ms}, 'min_rows': ...}."""
    from ..engine.budget import measure_cost
    from ..kernels.cpu import min_rows_of, optimize_for_cpu

    out = {}
    for kernels in ("stock", "fast"):
        optimize_for_cpu(model, enable=kernels == "fast", release=False)
        cost = measure_cost(model, draft, top_k, refresh=True, points=points)
        out[kernels] = {q: 1000 * s for q, s in zip(cost.verify_q, cost.verify_s)}
        out[kernels]["head step"] = 1000 * cost.draft_step_s
    out["min_rows"] = {str(k).replace("torch.", ""): v for k, v in min_rows_of(model).items()}
    return out


def cost_curve_markdown(curve: dict) -> str:
    keys = [k for k in curve["stock"] if k != "head step"]
    lines = ["| kernels | " + " | ".join(f"q={q}" for q in keys) + " | head step (k tokens) |",
             "|---|" + "---:|" * (len(keys) + 1)]  # fmt: skip
    for kernels in ("stock", "fast"):
        row = curve[kernels]
        lines.append(f"| {kernels} | " + " | ".join(f"{row[q]:.1f}" for q in keys) + f" | {row['head step']:.1f} |")
    return "\n".join(lines) + f"\n\nms per target forward of q tokens on 256 cached ones (lm_head included); fast = " \
        f"oneDNN prepacked from {curve['min_rows']} rows on.\n"
