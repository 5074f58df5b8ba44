"""GPU check: the first thing to run on a lent GPU. Prints ONE JSON object (stdout, and `--out`); progress on stderr.

A Llama-3-8B-shaped target (hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab 128256, rope theta 5e5) with
random bf16 weights, built on the GPU (no download), and a random EAGLE head (`EagleDraftModel.from_target`).
Random weights leave drafts nearly always rejected, so this reports costs per phase of a round, not speed-ups:

* `verify_ms`: one target forward of q tokens over 256 cached ones (`engine.budget.measure_cost`), and a head step;
* `round_split`: ms per round by phase (`eagle_profile=True`) at the accelerator round (m=60, depth 6, k=10, no
  n-gram: a fixed tree size, whatever is accepted) and at the per-round budget's choice (the `tree="eagle2"`
  defaults), plus unprofiled wall ms per round and what of it lies outside the target's forward;
* `round_ops`: aten ops, kernel launches and host reads per round outside the target's forward (`opcount`);
* `host_syncs`: synchronizing CUDA calls per round (`torch.cuda.set_sync_debug_mode("warn")`), null on a CPU;
* `identity`: fp32 greedy eagle2 output == plain greedy `generate` on a small random Llama, per setting;
* `*_compiled`: the accelerator round again with `tree_compile=True` over a static cache (each draft level one
  compiled call, and the verify pass one: `engine/verify_compiled.py`);
* `env`: versions, device, CUDA, torch.compile. Expected to take 2-4 minutes on one H100 (not yet run on a GPU).

`--smoke` runs the same on tiny shapes on the CPU in well under a minute (tests/test_gpu_check.py); without a GPU
the script always does (so `tests/test_examples.py` can run it bare). Sections that fail are reported as
{"error": ...} and the exit status is 1; the JSON so far is rewritten to `--out` after every section.

On a GPU machine with torch >= 2.11 and transformers 5.17 (no network), carry this repo plus wheels of the project,
transformers 5.25 and its pure-Python needs that machine lacks. Prepare them here, from the repository root:

    .venv/bin/python -m pip wheel -q --no-deps -w wheels/ . transformers==5.25.0 huggingface-hub==2.4.0 \
        httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5

then run there, from the repository root, in one command:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl && \
        PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 examples/gpu_check.py --out gpu_check.json
"""

import argparse
import json
import sys
import time
import traceback
import warnings

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import hf_eagle2
from hf_eagle2.engine.budget import measure_cost
from hf_eagle2.engine.drafter import TreeOptions
from hf_eagle2.evaluation.bench import ACCELERATOR_ROUND, COMPILED_ROUND, machine_meta
from hf_eagle2.evaluation.opcount import count_round_ops

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0)  # fmt: skip
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, vocab_size=1000, rope_theta=10000.0)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=128, rope_theta=10000.0)  # fmt: skip
FULL = dict(shape=LLAMA3_8B, points=(1, 2, 4, 8, 16, 32, 64, 96, 128), prefix=256, prompt=64, short=16, long=64)
SMOKE = dict(shape=TINY, points=(1, 2, 4, 8), prefix=32, prompt=16, short=8, long=24)
DEFAULTS = dict(tree="eagle2")  # the per-round budget's choice: tree_total_tokens="auto", device defaults
NOTES = {
    "weights": "random: drafts are rarely accepted, so costs are per phase of a round, not end-to-end speed-ups",
    "verify_ms": "ms of one target forward of q tokens over `prefix` cached ones, lm_head included; median of 5 "
                 "after 2 warm-ups, then a running max over q (a larger tree never costs less), as the budget sees it",
    "round_split": "ms per round: profiled phases (a CUDA sync around each), and unprofiled wall ms per round from "
                   "a short and a long call; outside_target = round minus the target's forward",
    "round_ops": "per round outside the target's forward, accelerator round (m=60, depth 6, k=10, no n-gram)",
    "host_syncs": "synchronizing CUDA calls per round under set_sync_debug_mode('warn'), greedy; null on a CPU",
    "compiled": "round_split / round_ops / identity `*_compiled`: the accelerator round with tree_compile=True, each draft "
                "level one torch.compile'd call (fullgraph, static shapes; CUDA graphs via mode='reduce-overhead' on "
                "CUDA) and, over a static cache (cache_implementation='static', max_cache_len=1024), the verify "
                "pass one more: the model's get_compiled_call, the tree padded to 64 nodes",
}  # fmt: skip


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_llama(shape: dict, dtype: torch.dtype, device: torch.device, seed: int) -> LlamaForCausalLM:
    """A random Llama of `shape`, built directly on `device` in `dtype` (its init runs there: fast on a GPU)."""
    shape = dict(shape)
    rope = {"rope_type": "default", "rope_theta": shape.pop("rope_theta")}
    config = LlamaConfig(**shape, rope_parameters=rope, max_position_embeddings=8192, bos_token_id=None,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def build_head(model) -> hf_eagle2.EagleDraftModel:
    """A random EAGLE head sized to `model` and bound to it, made on the model's device."""
    with torch.device(model.device):
        return hf_eagle2.EagleDraftModel.from_target(model, seed=0)


def random_ids(model, length: int, seed: int) -> torch.Tensor:
    rng = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, length), generator=rng).to(model.device)


def generate(model, ids, max_new_tokens: int, **kwargs):
    with torch.inference_mode():
        return model.generate(ids, do_sample=False, eos_token_id=None, max_new_tokens=max_new_tokens,
                              return_dict_in_generate=True, **kwargs)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- measurements
def verify_curve(model, head, cfg: dict) -> dict:
    """ms per target forward of q tokens over `prefix` cached ones, and per head step (k tokens)."""
    top_k = TreeOptions().resolved(model.device).top_k
    cost = measure_cost(model, head, top_k, prefix_len=cfg["prefix"], refresh=True, points=cfg["points"])
    curve = {str(q): round(1000 * s, 3) for q, s in zip(cost.verify_q, cost.verify_s)}
    return {"prefix": cfg["prefix"], "q_ms": curve, "head_step_ms": round(1000 * cost.draft_step_s, 3), "top_k": top_k}


def round_split(model, head, ids, cfg: dict, curve: dict, **tree) -> dict:
    """Per round: profiled phases of a `long` call, and unprofiled wall ms from a `short` and a `long` call."""
    kwargs = dict(assistant_model=head, **tree)
    generate(model, ids, 4, **kwargs)  # warm-up: binding, the budget's cost curve
    stats = generate(model, ids, cfg["long"], eagle_profile=True, **kwargs).eagle_stats
    rounds = max(stats.rounds, 1)
    phases = {"draft_model": stats.draft_model_s, "tree_build": stats.tree_build_s, "verify": stats.verify_s,
              "bookkeeping": stats.bookkeeping_s}  # fmt: skip
    per_round = {k: round(1000 * v / rounds, 3) for k, v in phases.items()}
    per_round["outside_target"] = round(1000 * (stats.round_s - stats.verify_s) / rounds, 3)
    wall_ms, wall_rounds = _wall_ms_per_round(model, ids, cfg, kwargs)
    q = 1 + stats.tree_nodes / rounds
    verify_ms = _interpolate(curve["q_ms"], q)
    return {"rounds": stats.rounds, "tau": round(stats.tau, 3), "mean_tree_tokens": round(q, 2),
            "profiled_ms": per_round, "wall_ms": round(wall_ms, 3), "wall_rounds": wall_rounds,
            "verify_curve_ms_at_q": round(verify_ms, 3),
            "wall_outside_target_ms": round(wall_ms - verify_ms, 3)}  # fmt: skip


def _wall_ms_per_round(model, ids, cfg: dict, kwargs: dict) -> tuple[float, int]:
    times, rounds = [], []
    for n in (cfg["short"], cfg["long"]):
        sync(model.device)
        start = time.perf_counter()
        out = generate(model, ids, n, **kwargs)
        sync(model.device)
        times.append(time.perf_counter() - start)
        rounds.append(out.eagle_stats.rounds)
    extra = max(rounds[1] - rounds[0], 1)
    return 1000 * (times[1] - times[0]) / extra, extra


def _interpolate(q_ms: dict, q: float) -> float:
    """The curve's ms at q tokens, linear between measured points (clamped to the last)."""
    xs, ys = [int(k) for k in q_ms], list(q_ms.values())
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if q <= x1:
            return y0 + (y1 - y0) * max(q - x0, 0) / (x1 - x0)
    return ys[-1]


def round_ops(model, head, ids, cfg: dict) -> dict:
    return {name: count_round_ops(model, ids, short=cfg["short"], long=cfg["long"], assistant_model=head,
                                  **tree).as_dict()
            for name, tree in (("eager", ACCELERATOR_ROUND), ("compiled", COMPILED_ROUND))}  # fmt: skip


def host_syncs(model, head, ids, cfg: dict) -> dict | None:
    """Synchronizing CUDA calls per round (all, and inside the target's forward), greedy, per setting."""
    if model.device.type != "cuda":
        return None
    return {name: _syncs_per_round(model, ids, cfg, dict(assistant_model=head, **tree))
            for name, tree in (("accelerator_round", ACCELERATOR_ROUND), ("budget_defaults", DEFAULTS))}  # fmt: skip


def _syncs_per_round(model, ids, cfg: dict, kwargs: dict) -> dict:
    generate(model, ids, 4, **kwargs)  # warm-up
    (all0, in0, r0), (all1, in1, r1) = (_syncs_of(model, ids, n, kwargs) for n in (cfg["short"], cfg["long"]))
    rounds = max(r1 - r0, 1)
    return {"per_round": round((all1 - all0) / rounds, 2), "in_target_per_round": round((in1 - in0) / rounds, 2),
            "outside_target_per_round": round((all1 - all0 - in1 + in0) / rounds, 2), "rounds": rounds}  # fmt: skip


def _syncs_of(model, ids, max_new_tokens: int, kwargs: dict) -> tuple[int, int, int]:
    """(sync warnings in one generate, those inside the target's forward, rounds)."""
    spans = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hooks = [model.register_forward_pre_hook(lambda *_: spans.append([len(caught), None])),
                 model.register_forward_hook(lambda *_: spans[-1].__setitem__(1, len(caught)))]  # fmt: skip
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = generate(model, ids, max_new_tokens, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for hook in hooks:
                hook.remove()
    is_sync = [("synchroniz" in str(w.message)) for w in caught]
    inside = sum(sum(is_sync[a:b]) for a, b in spans if b is not None)
    return sum(is_sync), inside, out.eagle_stats.rounds


def identity(device: torch.device, max_new_tokens: int) -> dict:
    """fp32 greedy: eagle2 output token-identical to plain `generate`, per setting, over three prompts."""
    model = build_llama(SMALL, torch.float32, device, seed=1)
    head = build_head(model)
    prompts = [random_ids(model, n, seed=n) for n in (5, 17, 40)]
    plain = [generate(model, ids, max_new_tokens).sequences for ids in prompts]
    out = {}
    for name, tree in (("tree_ngram=0", dict(tree="eagle2", tree_ngram=0)), ("defaults", DEFAULTS),
                       ("accelerator_round_compiled", COMPILED_ROUND)):  # fmt: skip
        runs = [generate(model, ids, max_new_tokens, assistant_model=head, **tree).sequences for ids in prompts]
        out[name] = all(torch.equal(a, b) for a, b in zip(runs, plain))
    return out


def environment(device: torch.device, try_compile: bool) -> dict:
    env = machine_meta()
    env.update(python=sys.version.split()[0], transformers=transformers.__version__, hf_eagle2=hf_eagle2.__version__,
               device=str(device), cuda_runtime=torch.version.cuda,
               compile=_compile_status(device, try_compile))  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count)  # fmt: skip
    return env


def _compile_status(device: torch.device, try_compile: bool) -> dict:
    """Whether torch.compile exists, Triton is usable, and (try_compile) a tiny compiled function runs here."""
    try:
        from torch.utils._triton import has_triton

        triton = has_triton()
    except ImportError:
        triton = False
    status = {"torch_compile": hasattr(torch, "compile"), "triton": triton, "tiny_compile_ok": None}
    if try_compile:
        x = torch.arange(8.0, device=device)
        try:
            status["tiny_compile_ok"] = bool(torch.equal(torch.compile(lambda t: t * 2 + 1)(x), x * 2 + 1))
        except Exception as error:  # noqa: BLE001 - reported, not fatal: nothing else here compiles
            status["tiny_compile_ok"] = f"{type(error).__name__}: {str(error)[:300]}"
    return status


# ---------------------------------------------------------------- driver
def section(result: dict, name: str, out: str | None, fn, *args, **kwargs):
    """result[name] = fn(...), or {"error": traceback} if it raised; logged and saved to `out` either way."""
    start = time.perf_counter()
    log(f"{name} ...")
    try:
        result[name] = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - one failing section must not lose the others' figures
        result[name] = {"error": traceback.format_exc(limit=8)[-3000:]}
    log(f"{name}: {time.perf_counter() - start:.1f}s {json.dumps(result[name])[:300]}")
    save(result, out)
    return result[name]


def save(result: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the default without a GPU)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    cfg = SMOKE if smoke else FULL
    started = time.perf_counter()
    result = {"smoke": smoke, "target": {"shape": cfg["shape"], "dtype": "bfloat16"}, "notes": NOTES}
    section(result, "env", args.out, environment, device, try_compile=not smoke)
    log(f"building the target {cfg['shape']} on {device}")
    model = build_llama(cfg["shape"], torch.bfloat16, device, seed=0)
    head = build_head(model)
    ids = random_ids(model, cfg["prompt"], seed=0)
    result["target"]["parameters_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 4)
    curve = section(result, "verify_ms", args.out, verify_curve, model, head, cfg)
    result["round_split"] = {}
    for name, tree in (("accelerator_round", ACCELERATOR_ROUND), ("accelerator_round_compiled", COMPILED_ROUND),
                       ("budget_defaults", DEFAULTS)):  # fmt: skip
        section(result["round_split"], name, None, round_split, model, head, ids, cfg, curve, **tree)
        save(result, args.out)
    section(result, "round_ops", args.out, round_ops, model, head, ids, cfg)
    section(result, "host_syncs", args.out, host_syncs, model, head, ids, cfg)
    del model, head
    section(result, "identity", args.out, identity, device, max_new_tokens=24 if smoke else 48)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    save(result, args.out)
    print(json.dumps(result, indent=1))
    failed = [k for k, v in _sections(result) if isinstance(v, dict) and "error" in v]
    log(f"done in {result['wall_s']}s" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def _sections(result: dict):
    yield from result.items()
    yield from result.get("round_split", {}).items()


if __name__ == "__main__":
    sys.exit(main())
