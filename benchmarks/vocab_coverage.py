"""How many held-out answer tokens a reduced draft vocabulary holds (a token outside it is a guaranteed rejection).

Prints the coverage of a head's draft vocabulary, of that vocabulary grown as `train --grow-vocab` grows it (the
most frequent assistant tokens of some shards it lacks), and of a vocabulary chosen afresh from those shards, for
each size; answer tokens are the loss-mask positions of the token archives in training_data/.

    python benchmarks/vocab_coverage.py --head model_cards/smollm2-135m-instruct-eagle3 \
        --tokens training_data/smollm2-distill-all-bf16.npz --shards 117-173 \
        --val training_data/smollm2-distill-val-bf16.npz --sizes 8192,10240,12288,16384

The numbers in the README were measured on the stage-4 head (8,192 tokens), which that folder held until its
stage 5 grew it to 12,288: `git worktree add /tmp/stage4 8b4cfff` and `--head /tmp/stage4/model_cards/...` see it.
"""

import argparse

import numpy as np
import torch

from hf_eagle2 import EagleDraftModel
from hf_eagle2.cli import shard_range
from hf_eagle2.training.tokens import read_tokens


def answer_tokens(path: str, shards: tuple[int, int | None] | None = None) -> np.ndarray:
    """Target ids at the loss-mask positions of an archive's shards ((first, last) inclusive; all when None)."""
    archive = read_tokens(path)
    first, last = shards or (0, None)
    last = archive.shard_sequences.size - 1 if last is None else last
    start = sum(archive.shard_tokens(i) for i in range(first))
    end = start + sum(archive.shard_tokens(i) for i in range(first, last + 1))
    return archive.input_ids[start:end].astype(np.int64)[archive.loss_mask[start:end]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--tokens", required=True, help="the archive whose shards choose the added tokens")
    parser.add_argument("--shards", type=shard_range, default=None, help="A-B, A- or A (default: all)")
    parser.add_argument("--val", required=True, help="the held-out archive whose answers are counted")
    parser.add_argument("--sizes", default="8192,10240,12288,16384")
    args = parser.parse_args()
    head = EagleDraftModel.from_pretrained(args.head)
    vocab_size = head.config.vocab_size
    has = head.to_target_ids(torch.arange(head.draft_vocab_size)).numpy()
    val = answer_tokens(args.val)
    counts = np.bincount(answer_tokens(args.tokens, args.shards), minlength=vocab_size)
    print(f"{val.size:,} held-out answer tokens; the head's {has.size:,}-token vocabulary holds {np.isin(val, has).mean():.2%}")
    lacked = counts.copy()
    lacked[has] = -1
    grow_order = np.argsort(-lacked, kind="stable")  # ties by id, as the Trainer's stable sort
    fresh_order = np.argsort(-counts, kind="stable")
    print("| size | grown from the head's | chosen afresh from the shards |\n|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        grown = np.concatenate([has, grow_order[: max(0, size - has.size)]])
        print(f"| {size:,} | {np.isin(val, grown).mean():.2%} | {np.isin(val, fresh_order[:size]).mean():.2%} |")


if __name__ == "__main__":
    main()
