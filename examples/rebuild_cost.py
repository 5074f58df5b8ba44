"""What `forward_features`' padded-token budget does to a feature rebuild (`hf-eagle2 rebuild-features`).

Runs the target (bf16, as the archive's answers were written) over shards of the token archive in
`training_data/` with several `max_batch_tokens`: 0 means one padded forward per 64-row shard (what the rebuild
did before the budget), the others length-sorted groups of at most that many padded tokens. Prints each one's
tokens/s and how far its features are from the budget-0 ones (relative to each row's largest feature).

    python examples/rebuild_cost.py --shards 60,100 --budgets 0,2048,4096,16384 --threads 2
"""

import argparse
import time

import torch

from hf_eagle2.assets import load_model
from hf_eagle2.training.features import aux_layer_ids, forward_features
from hf_eagle2.training.tokens import read_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", default="training_data/smollm2-distill-all-bf16.npz")
    parser.add_argument("--shards", default="60,100")
    parser.add_argument("--budgets", default="0,2048,4096,16384")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    archive = read_tokens(args.tokens)
    model, _ = load_model(args.model, dtype=archive.meta["dtype"])
    shards = [[ids for _, ids, _ in archive.shard(int(i))] for i in args.shards.split(",")]
    tokens = sum(len(row) for shard in shards for row in shard)
    layers = aux_layer_ids(model)
    forward_features(model, shards[0][:2], 0, layers)  # warm-up
    reference = None
    for budget in map(int, args.budgets.split(",")):
        start = time.perf_counter()
        # a budget of 0 stands for "no grouping": one forward over each shard's rows
        features = [f for shard in shards for f in forward_features(
            model, shard, 0, layers, max_batch_tokens=budget or len(shard) * max(map(len, shard)))[0]]  # fmt: skip
        seconds = time.perf_counter() - start
        reference = reference or features
        diff = max(float((f - r).abs().max() / r.abs().max()) for f, r in zip(features, reference))
        print(f"max_batch_tokens {budget or 'one forward per shard'}: {tokens / seconds:.0f} tokens/s "
              f"({seconds:.1f} s for {tokens} tokens); largest difference from the first: {diff:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
