"""Where a grown draft vocabulary's new lm_head rows should start: held-out metrics of an EAGLE-3 head before
growing, grown with zero rows (what `train --grow-vocab` does) and grown with the target's rows.

    python benchmarks/grow_vocab_start.py --head model_cards/smollm2-135m-instruct-eagle3 \
        --data runs/data/distill-all-fp32feat --val runs/data/distill-val-fp32feat --size 12288

Measured on the stage-4 head (8,192 tokens), which that folder held until stage 5 (commit 8b4cfff has it).
"""

import argparse

import torch

from hf_eagle2 import EagleDraftModel
from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.training.train import TrainConfig, Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--data", required=True, help="features whose frequent tokens grow the vocabulary")
    parser.add_argument("--val", required=True)
    parser.add_argument("--size", type=int, default=12288)
    parser.add_argument("--batches", type=int, default=20, help="held-out batches evaluated")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, _ = load_model("smollm2", dtype="float32")
    run = dict(data=[args.data], val_data=[args.val], head="eagle3", init=args.head, out="/tmp/grow_vocab_start")
    size = EagleDraftModel.from_pretrained(args.head).draft_vocab_size
    before = Trainer(TrainConfig(draft_vocab_size=size, **run), model, progress=False)
    print("before growing", before.evaluate(args.batches))
    grown = Trainer(TrainConfig(draft_vocab_size=args.size, grow_vocab=True, **run), model, progress=False)
    print("grown, zero rows", grown.evaluate(args.batches))
    ids = grown.head.to_target_ids(torch.arange(args.size))
    new = ~torch.isin(ids, before.head.to_target_ids(torch.arange(before.head.draft_vocab_size)))
    with torch.no_grad():
        grown.head.lm_head.weight[new] = grown.lm_weight[new]  # the target's rows of the new tokens
    print("grown, target rows", grown.evaluate(args.batches))


if __name__ == "__main__":
    main()
