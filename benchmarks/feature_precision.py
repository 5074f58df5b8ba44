"""What bf16 feature extraction costs in precision and buys in speed (`hf-eagle2 extract --dtype bfloat16`).

Runs the target in fp32 and in bf16 over the same held-out ShareGPT conversations and prints, for the features
a head trains on (final hidden states and the three EAGLE-3 layers, both stored as fp16): their relative error,
the share of positions where the lm_head's argmax agrees, and each dtype's forward throughput.

    python benchmarks/feature_precision.py --conversations 8 --threads 2
"""

import argparse
import time

import torch

from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.training.data import iter_sharegpt, render_with_loss_mask
from hf_eagle2.training.features import aux_layer_ids, forward_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fp32, tokenizer = load_model(args.model, dtype="float32")
    bf16, _ = load_model(args.model, dtype="bfloat16")
    rows = []
    for conv in iter_sharegpt(split="validation"):
        rows.append(render_with_loss_mask(tokenizer, conv.messages, max_tokens=args.max_tokens)[0])
        if len(rows) == args.conversations:
            break
    layers = aux_layer_ids(fp32)
    outputs, seconds = {}, {}
    for name, model in (("fp32", fp32), ("bf16", bf16)):
        forward_features(model, rows[:1], 0, layers)  # warm-up
        start = time.perf_counter()
        outputs[name] = forward_features(model, rows, 0, layers)
        seconds[name] = time.perf_counter() - start
    weight = fp32.get_output_embeddings().weight.detach().float()
    tokens = sum(len(r) for r in rows)
    for index, label in ((0, "final features"), (1, "EAGLE-3 layers")):
        ref = torch.cat(outputs["fp32"][index]).half().float()
        low = torch.cat(outputs["bf16"][index]).half().float()
        print(f"{label}: relative error {float((low - ref).norm() / ref.norm()):.4f}")
    ref, low = (torch.cat(outputs[n][0]).half().float() for n in ("fp32", "bf16"))
    agree = float(((ref @ weight.T).argmax(-1) == (low @ weight.T).argmax(-1)).float().mean())
    print(f"lm_head argmax agreement: {agree:.4f} over {tokens} tokens")
    for name in ("fp32", "bf16"):
        print(f"{name}: {tokens / seconds[name]:.0f} tokens/s")
    print(f"bf16 speed-up: {seconds['fp32'] / seconds['bf16']:.2f}x")


if __name__ == "__main__":
    main()
