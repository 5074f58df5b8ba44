"""vLLM as a peer in `hf-eagle2 bench` (methods `vllm_plain`, `vllm_eagle3`): one long-lived worker per method.

vLLM's CPU build lives in its own venv (`.venv-serve`, built by `make serve-check`: it pins its own torch and
transformers), so the bench talks to it through a subprocess of that venv running THIS file as a script
(`.venv-serve/bin/python vllm_peer.py --serve '<config json>'`). The file is therefore importable with the
standard library alone (everything from this package is imported lazily, inside the bench-side functions), and
benchmarks/serve_check.py loads it by path for the vLLM helpers it shares (WORKER_ENV, spec_counters, delta,
root_cause).

Protocol (JSON lines; the worker moves vLLM's own stdout to stderr, which goes to a log file, so its stdout carries
only these lines):
- start: argv `--serve CONFIG` with CONFIG = {"name", "target", "dtype", "speculative_config" (None: plain),
  "max_model_len"}; the worker builds `LLM(..., enforce_eager=True)` and answers
  {"ready": true, "vllm_version", "load_seconds"} or {"error": "..."} (then exits);
- request: {"ids": [prompt token ids], "max_new_tokens": n}, answered, greedy and one request at a time, with
  {"tokens": [new token ids], "seconds": wall time of `llm.generate`, "spec": {"drafts", "draft_tokens",
  "accepted", "per_pos"}} (vLLM's spec-decode counters, after minus before: zeros for plain) or {"error": "..."};
- stop: {"cmd": "stop"} or the end of stdin; the worker exits.
The bench side (VllmPeer) bounds the start and every request in time and kills the worker's process group on close,
on a timeout, on an error and at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

VLLM_METHODS = ("vllm_plain", "vllm_eagle3")
WORKER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: SmolLM2 at 2k context needs far less
    "HF_HUB_OFFLINE": "1",  # everything is local; the Hub is unreachable here
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
VLLM_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}  # fmt: skip


# ---------------------------------------------------------------------- shared vLLM helpers (stdlib only)
def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters (`LLM.get_metrics()`, Prometheus names `vllm:spec_decode_*`), summed over
    engines."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}  # fmt: skip
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            width = max(len(values), len(out["per_pos"]))
            out["per_pos"] = [(out["per_pos"][i] if i < len(out["per_pos"]) else 0) + (values[i] if i < len(values) else 0)
                              for i in range(width)]  # fmt: skip
    return out


def delta(after: dict, before: dict) -> dict:
    per_pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0) for i, a in enumerate(after["per_pos"])]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")} | {"per_pos": per_pos}


def root_cause(log: Path) -> str | None:
    """vLLM's own message for a failed run: the last `SomethingError: ...` line of its log that is not the engine's
    generic 'Engine core initialization failed' wrapper, without the process / logger prefix."""
    log = Path(log)
    if not log.exists():
        return None
    found = None
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"\b(\w+(?:Error|Exception)): (.*)$", line)
        if m and "Engine core initialization failed" not in line:
            found = f"{m.group(1)}: {m.group(2)}".strip()
    return found


# ---------------------------------------------------------------------- worker (runs in .venv-serve)
def serve(config: dict) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints and logs (its children's too) go to stderr, the log; fd 1 is no longer the protocol

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        import vllm
        from vllm import LLM, SamplingParams

        t = time.perf_counter()
        llm = LLM(model=config["target"], tokenizer=config["target"], dtype=config["dtype"],
                  max_model_len=config.get("max_model_len", 2048), seed=0, enforce_eager=True, disable_log_stats=False,
                  speculative_config=config.get("speculative_config"))  # fmt: skip
        send({"ready": True, "vllm_version": vllm.__version__, "load_seconds": time.perf_counter() - t})
    except Exception as err:  # noqa: BLE001 - vLLM's refusal, sent back with its own message
        send({"error": f"{type(err).__name__}: {err}"})
        return 3
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("cmd") == "stop":
            break
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=int(request["max_new_tokens"]))
            before = spec_counters(llm)
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": request["ids"]}], greedy, use_tqdm=False)[0]
            seconds = time.perf_counter() - t
            send({"tokens": list(out.outputs[0].token_ids), "seconds": seconds, "spec": delta(spec_counters(llm), before)})
        except Exception as err:  # noqa: BLE001 - answered, the bench decides
            send({"error": f"{type(err).__name__}: {err}"})
    return 0


# ---------------------------------------------------------------------- bench side (runs in .venv)
@dataclass
class VllmOptions:
    """What the bench needs to run vLLM peers. `target`: a local transformers folder (see `target_folder`);
    `head_export`: the EAGLE-3 head in the speculators layout (None: exported from `draft` by `export_eagle3`)."""

    serve_venv: str = ".venv-serve"
    target: str | None = None
    dtype: str = "float32"
    draft: str = "model_cards/smollm2-135m-instruct-eagle3"
    k: int = 3
    head_export: str | None = None
    log_dir: str | None = None
    start_timeout: float = 900.0
    request_timeout: float = 600.0
    max_model_len: int = 2048
    worker: str | None = None  # the worker script (default: this file); tests pass a fake


def serve_python(serve_venv: str) -> str:
    """The serve venv's python, or a clear error when it is not there."""
    python = os.path.join(os.path.abspath(serve_venv), "bin", "python")  # absolute: the worker runs in a temp dir
    if not os.path.exists(python):
        raise FileNotFoundError(
            f"vllm_* bench methods need vLLM's CPU build in its own venv, and {serve_venv} has none: run "
            f"`make serve-check` first (it builds .venv-serve), or point --serve-venv at one")
    return python


def target_folder(spec: str) -> str:
    """The local folder vLLM loads for a model spec: for GGUF specs the de-quantised fp32 folder the assets make
    (the same weights `load_model` gives the bench), a local folder as is, otherwise the spec (a Hub id, which
    vLLM resolves from the local cache: HF_HUB_OFFLINE is set)."""
    from .assets import converted_gguf_folder, resolve_gguf

    gguf = resolve_gguf(spec)
    if gguf is not None:
        return converted_gguf_folder(gguf)
    return os.path.abspath(spec) if os.path.isdir(spec) else spec


def export_eagle3(card: str, out: str, target) -> str:
    """The EAGLE-3 head `card`, exported to `out` in the speculators layout (vLLM's `eagle3` method reads it)."""
    import shutil

    from ..heads.modeling_eagle3 import Eagle3DraftModel

    shutil.rmtree(out, ignore_errors=True)
    Eagle3DraftModel.from_pretrained(str(card)).save_pretrained(out, layout="speculators", target=target)
    return str(out)


class VllmPeer:
    """One vLLM configuration in a long-lived worker subprocess (its own process group)."""

    def __init__(self, name: str, python: str, config: dict, log_path: str, *, start_timeout: float = 900.0,
                 request_timeout: float = 600.0, worker: str | None = None):  # fmt: skip
        self.name, self.python, self.config, self.log_path = name, python, dict(config, name=name), log_path
        self.start_timeout, self.request_timeout = start_timeout, request_timeout
        self.worker = worker or os.path.abspath(__file__)
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self._log = None
        self._lines: queue.Queue = queue.Queue()

    def start(self) -> VllmPeer:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([self.python, self.worker, "--serve", json.dumps(self.config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     cwd=tempfile.gettempdir(), env=os.environ | WORKER_ENV, text=True, bufsize=1,
                                     start_new_session=True)  # fmt: skip
        atexit.register(self.close)
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()
        answer = self._read(self.start_timeout, "start")
        if "error" in answer:
            self.close()
            raise RuntimeError(f"vLLM ({self.name}) refused to start: {answer['error']} (log: {self.log_path})")
        self.info = answer
        return self

    def _pump(self, stream) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout: float, what: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close(grace=1)  # unresponsive: no long wait for a clean exit
            raise TimeoutError(f"vLLM ({self.name}): no answer to {what} within {timeout:.0f} s (log: {self.log_path})")
        if line is None:
            rc = self.proc.poll() if self.proc else None
            self.close()
            cause = root_cause(Path(self.log_path)) or f"exit {rc}"
            raise RuntimeError(f"vLLM ({self.name}) worker ended during {what}: {cause} (log: {self.log_path})")
        return json.loads(line)

    def generate(self, ids: list[int], max_new_tokens: int) -> dict:
        """{"tokens", "seconds", "spec"} for one greedy request."""
        if self.proc is None:
            raise RuntimeError(f"vLLM ({self.name}) worker is not running")
        try:
            self.proc.stdin.write(json.dumps({"ids": [int(i) for i in ids], "max_new_tokens": int(max_new_tokens)}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            raise RuntimeError(f"vLLM ({self.name}) worker is gone: {root_cause(Path(self.log_path))} (log: {self.log_path})")
        answer = self._read(self.request_timeout, "a request")
        if "error" in answer:
            raise RuntimeError(f"vLLM ({self.name}) failed a request: {answer['error']} (log: {self.log_path})")
        return answer

    def close(self, grace: float = 20) -> None:
        """Asks the worker to stop, waits `grace` s, then kills its process group (vLLM's engine included)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(proc.pid, signal.SIGKILL)  # vLLM's engine process, should it outlive the worker
            proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def _kill_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_peers(methods, options: VllmOptions, model=None) -> dict[str, VllmPeer]:
    """A started VllmPeer per vllm_* method in `methods` (one after the other); on a failure the ones started are
    closed and the error raised. `model`: the bench's target, which names the verifier in the head's export."""
    wanted = [m for m in methods if m in VLLM_METHODS]
    if not wanted:
        return {}
    python = serve_python(options.serve_venv)
    if options.target is None:
        raise ValueError("vllm_* methods need VllmOptions.target (a local model folder; see target_folder)")
    log_dir = options.log_dir or os.path.join(tempfile.gettempdir(), "hf_eagle2_vllm")
    os.makedirs(log_dir, exist_ok=True)
    dtype = VLLM_DTYPES.get(str(options.dtype).replace("torch.", ""), str(options.dtype))
    peers: dict[str, VllmPeer] = {}
    try:
        for m in wanted:
            spec = None
            if m == "vllm_eagle3":
                head = options.head_export or export_eagle3(options.draft, os.path.join(log_dir, "eagle3-speculators"), model)
                spec = {"method": "eagle3", "model": os.path.abspath(head), "num_speculative_tokens": int(options.k)}
            config = {"target": options.target, "dtype": dtype, "speculative_config": spec,
                      "max_model_len": options.max_model_len}  # fmt: skip
            peer = VllmPeer(m, python, config, os.path.join(log_dir, f"{m}.log"), start_timeout=options.start_timeout,
                            request_timeout=options.request_timeout, worker=options.worker)  # fmt: skip
            peers[m] = peer.start()
    except BaseException:
        close_peers(peers)
        raise
    return peers


def close_peers(peers: dict[str, VllmPeer]) -> None:
    for peer in peers.values():
        peer.close()


if __name__ == "__main__":  # the worker; vLLM may spawn its engine process, the guard keeps it from re-running this
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # our evaluate.py etc. must not shadow
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        sys.exit(serve(json.loads(sys.argv[2])))
    sys.exit("usage: vllm_peer.py --serve CONFIG_JSON")
