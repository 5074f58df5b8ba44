"""How many decode slots a self-distilled extraction spends on rows whose answer already ended.

Reads the answer lengths of an extracted folder's shards (one 64-row batch each) and prints, per number of decode
steps per `generate` call (`generate_with_features`' `chunk_steps`; 0: one call for the whole answer), the share of
slots that feed a kept token. A row answering n tokens needs n + 1 steps (its EOS fed back), capped at
max_new_tokens + 1; rows leave the batch only between calls.

    python benchmarks/decode_slots.py --data runs/data/distill-all-bf16 --shards 60-99 --chunk-steps 0,16,32,48,64
"""

import argparse
import json
import math
import os

from hf_eagle2.training.features import open_shard, shard_paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--shards", default="0-99", help="first-last shard index")
    parser.add_argument("--chunk-steps", default="0,16,32,48,64")
    args = parser.parse_args()
    with open(os.path.join(args.data, "meta.json")) as f:
        cap = json.load(f)["max_new_tokens"] + 1
    first, last = (int(x) for x in args.shards.split("-"))
    chunks = [int(c) for c in args.chunk_steps.split(",")]
    used, slots, answers = 0, dict.fromkeys(chunks, 0), []
    for path in shard_paths([args.data])[first : last + 1]:
        shard = open_shard(path)
        mask, offsets = shard["loss_mask"].bool(), shard["offsets"].tolist()
        steps = [min(int(mask[a:b].sum()) + 1, cap) for a, b in zip(offsets[:-1], offsets[1:])]
        answers += steps
        used += sum(steps)
        for chunk in chunks:  # a call of `chunk` steps runs all its rows; the batch ends with its longest row
            per_row = [min(math.ceil(s / chunk) * chunk, max(steps)) if chunk else max(steps) for s in steps]
            slots[chunk] += sum(per_row)
    print(f"{len(answers)} answers, {sum(s == cap for s in answers) / len(answers):.0%} at the {cap - 1}-token cap")
    for chunk in chunks:
        print(f"{chunk or 'all'} steps per call: {used / slots[chunk]:.1%} of decode slots feed a kept token")


if __name__ == "__main__":
    main()
