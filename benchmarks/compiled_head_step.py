"""What `torch.compile` buys one draft level of the head on this machine: the head's forward over k tree nodes on
top of a fixed context (its cached keys and values as a tuple, the tree mask, the round's shared rotary), eager
against compiled (`fullgraph=True, dynamic=False`, inductor's default mode), at static shapes. The measurement
issue 46 asks for before the compiled round is built: if a static level does not run faster compiled on a CPU,
the compiled round is for accelerators only.

    python benchmarks/compiled_head_step.py --heads smollm2,qwen1.5b --k 4,10 --context 256

`smollm2` is the shipped SmolLM2 EAGLE-2 head; `qwen1.5b` a random head of Qwen2.5-Coder-1.5B's shape (hidden
1536, 12 heads, 2 KV heads, MLP 8960), bound to a one-layer stand-in target of that width (no download). Prints
the compile time and the median of `--repeats` timed steps each way, and the largest difference between the two
outputs.
"""

import argparse
import os
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from hf_eagle2 import EagleDraftModel

HERE = os.path.dirname(os.path.abspath(__file__))


def head(name: str):
    if name == "smollm2":
        from hf_eagle2.evaluation.assets import load_model

        target, _ = load_model("smollm2")
        return EagleDraftModel.from_pretrained(os.path.join(HERE, "..", "model_cards", "smollm2-135m-instruct-eagle2")).bind(target)
    config = Qwen2Config(vocab_size=4096, hidden_size=1536, intermediate_size=8960, num_hidden_layers=1,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768)  # fmt: skip
    target = AutoModelForCausalLM.from_config(config).eval()
    return EagleDraftModel.from_target(target, seed=0)


def inputs(draft, k: int, context: int):
    g = torch.Generator().manual_seed(0)
    hidden, kv_heads = draft.config.hidden_size, draft.config.num_key_value_heads
    dim = hidden // draft.config.num_attention_heads
    past = (torch.randn(1, kv_heads, context, dim, generator=g), torch.randn(1, kv_heads, context, dim, generator=g))
    embeds = torch.randn(1, k, hidden, generator=g) * 0.02
    feats = torch.randn(1, k, hidden, generator=g)
    mask = torch.ones(1, 1, k, context + k, dtype=torch.bool)
    mask[..., context:] = torch.eye(k, dtype=torch.bool)
    cos_sin = draft.rotary(feats, torch.full((1, 1), context))
    return embeds, feats, mask, past, cos_sin


def step(draft, embeds, feats, mask, past, cos_sin):
    return draft(None, feats, None, mask, past, inputs_embeds=embeds, cos_sin=cos_sin)[0]


def timed(fn, args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="smollm2,qwen1.5b")
    ap.add_argument("--k", default="4,10")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())  # fmt: skip
    print(f"CPU: {cpu}, {args.threads} threads, torch {torch.__version__}, context {args.context}")
    print("| head | k | eager ms | compiled ms | speed-up | compile s | max abs diff |\n|---|---:|---:|---:|---:|---:|---:|")
    for name in args.heads.split(","):
        draft = head(name).eval()
        for k in map(int, args.k.split(",")):
            torch._dynamo.reset()
            xs = inputs(draft, k, args.context)
            with torch.inference_mode():
                compiled = torch.compile(lambda *a: step(draft, *a), fullgraph=True, dynamic=False)
                start = time.perf_counter()
                out_c = compiled(*xs)
                compile_s = time.perf_counter() - start
                out_e = step(draft, *xs)
                eager_ms = 1000 * timed(lambda *a: step(draft, *a), xs, args.repeats)
                compiled_ms = 1000 * timed(compiled, xs, args.repeats)
            diff = (out_c - out_e).abs().max().item()
            print(f"| {name} | {k} | {eager_ms:.3f} | {compiled_ms:.3f} | {eager_ms / compiled_ms:.2f}x | "
                  f"{compile_s:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
