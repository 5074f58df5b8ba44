"""What `unrolled_attention` saves an EAGLE-3 training step: training-time-test passes >= 2 in one causal kernel
(`UnrolledMask`) against the same passes under their dense boolean mask (what `eagle_loss` passed before).

One process, one head, the same batches: each batch is trained once each way, in alternating order, so the
machine's drift falls on both. Prints tokens/s each way and their ratio. The head is the shipped EAGLE-3 head;
`--data` is a feature folder of EAGLE-3 features (a few shards are enough; the rows are cut as training cuts them).

    python benchmarks/unrolled_attention_cost.py --data runs/data/distill-p1024-bf16 --batches 12
"""

import argparse
import time

import torch
import torch.nn.functional as F

import hf_eagle2.heads.modeling_eagle as modeling_eagle
from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.training.train import TrainConfig, Trainer, epoch_batches
from hf_eagle2.kernels.unrolled_attention import UnrolledMask, unrolled_attention


def dense_attention(q, k, v, passes):
    """The masked kernel over all passes' keys: what the unrolled passes ran before."""
    length = q.shape[2]
    mask = UnrolledMask(passes).dense(length, q.device).view(1, 1, length, passes * length)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--head", default="model_cards/smollm2-135m-instruct-eagle3")
    parser.add_argument("--draft-vocab-size", type=int, default=12288, help="the init head's")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--first-batch", type=int, default=1)
    parser.add_argument("--unroll", type=int, default=3)
    parser.add_argument("--max-prompt-context", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="/tmp/unrolled_attention_cost")
    args = parser.parse_args()
    model, _ = load_model("smollm2", dtype="bfloat16")
    config = TrainConfig(data=[args.data], out=args.out, head="eagle3", init=args.head,
                         draft_vocab_size=args.draft_vocab_size,
                         batch_tokens=4096, autocast="bfloat16", max_prompt_context=args.max_prompt_context,
                         unroll=args.unroll, threads=args.threads)  # fmt: skip
    trainer = Trainer(config, model, progress=False)
    batches = epoch_batches(trainer.data.lengths(), config.batch_tokens, 0, 0)
    trainer.train_step(batches[0])  # warm-up
    ways = {"unrolled (one causal kernel)": unrolled_attention, "dense mask": dense_attention}
    seconds, tokens = dict.fromkeys(ways, 0.0), 0
    for n, batch in enumerate(batches[args.first_batch : args.first_batch + args.batches]):
        tokens += sum(int(trainer.data.offsets[i + 1] - trainer.data.offsets[i]) for i in batch)
        for name in list(ways) if n % 2 else list(ways)[::-1]:
            modeling_eagle.unrolled_attention = ways[name]
            start = time.perf_counter()
            trainer.train_step(batch)
            seconds[name] += time.perf_counter() - start
    for name, s in seconds.items():
        print(f"{name}: {tokens / s:.0f} tokens/s ({s:.1f} s for {tokens} tokens)")
    print(f"ratio: {seconds['dense mask'] / seconds['unrolled (one causal kernel)']:.3f}")


if __name__ == "__main__":
    main()
