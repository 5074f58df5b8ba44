"""How many tokens per second teacher-forced feature extraction (`data extract --responses sharegpt`) runs on a
target, per dtype and kernel choice: the number that sizes a fixed-budget head's data.

Renders the first `--conversations` ShareGPT training conversations as `extract` does (chat template, cut to
`--max-seq-tokens`), then times `forward_features` (length-sorted padded forwards of at most 4,096 tokens, the
final hidden state only, `logits_to_keep=1`) over them once per configuration, after one untimed warm-up group.
Prints real (unpadded) tokens/s per configuration and how far each configuration's features are from the first's.

    python benchmarks/teacher_forcing_rate.py --model qwen2.5-coder-1.5b --configs bfloat16:stock,bfloat16:fast,float32:fast
"""

import argparse
import platform
import time

import torch

from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.kernels.cpu import optimize_for_cpu
from hf_eagle2.training.data import iter_sharegpt, render_with_loss_mask
from hf_eagle2.training.features import forward_features, pad_and_eos_ids


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--configs", default="bfloat16:stock,bfloat16:fast", help="dtype:kernels, comma separated")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--max-seq-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    reference, rows = None, None
    for config in args.configs.split(","):
        dtype, kernels = config.split(":")
        model, tokenizer = load_model(args.model, dtype=dtype)
        if rows is None:
            rows = []
            for conv in iter_sharegpt(split="train"):
                ids, mask = render_with_loss_mask(tokenizer, conv.messages, max_tokens=args.max_seq_tokens)
                if sum(mask):
                    rows.append(ids)
                if len(rows) == args.conversations:
                    break
            print(f"{len(rows)} conversations, {sum(map(len, rows))} tokens (mean {sum(map(len, rows)) / len(rows):.0f})")
        optimize_for_cpu(model, enable=kernels == "fast")
        pad_id, _ = pad_and_eos_ids(model, tokenizer)
        forward_features(model, rows[:2], pad_id)  # warm-up (kernel choice, allocator)
        start = time.perf_counter()
        feats, _ = forward_features(model, rows, pad_id)
        seconds = time.perf_counter() - start
        tokens = sum(map(len, rows))
        line = f"{config:>16}: {seconds:7.1f} s, {tokens / seconds:6.1f} tokens/s"
        if reference is None:
            reference = [f.float() for f in feats]
        else:
            rel = max(((f.float() - r).abs().max() / r.abs().max()).item() for f, r in zip(feats, reference))
            line += f", features vs the first config: max relative difference {rel:.2e}"
        print(line, flush=True)
        del model, feats


if __name__ == "__main__":
    main()
