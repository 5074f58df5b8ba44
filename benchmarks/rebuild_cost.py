"""What `forward_features`' padded-token budget does to a feature rebuild (`hf-eagle2 rebuild-features`).

Runs the target (bf16, as the archive's answers were written) over shards of the token archive in
`training_data/` with several `max_batch_tokens`: 0 means one padded forward per 64-row shard (what the rebuild
did before the budget), the others length-sorted groups of at most that many padded tokens. Prints each one's
tokens/s and how far its features are from the budget-0 ones (relative to each row's largest feature).

    python benchmarks/rebuild_cost.py --shards 60,100 --budgets 0,2048,4096,16384 --threads 2

`--left-padded` instead times `forward_features` (right-padded groups, no attention mask: sdpa's causal kernel)
against the same groups left-padded under an explicit padding mask (what it ran before), alternating shard by
shard, and prints how far apart their features are:

    python benchmarks/rebuild_cost.py --tokens training_data/smollm2-distill-p1024-bf16.npz --shards 200,201 --left-padded
"""

import argparse
import time

import torch

from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.engine.target import causal_lm_forward
from hf_eagle2.training import features as feature_module
from hf_eagle2.training.features import aux_layer_ids, forward_features
from hf_eagle2.training.tokens import read_tokens


@torch.inference_mode()
def left_padded_forward(model, rows, pad_id, aux_layers):
    """One group left-padded under its padding mask (the masked kernel), as `forward_features` ran before."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden = causal_lm_forward(model, ids, pos, mask, None, logits_to_keep=1, feature_ids=(*aux_layers, -1))[0]
    return feature_module._split_features([hidden[i, width - len(r) :] for i, r in enumerate(rows)], len(aux_layers))


def compare_left_padded(model, shards, layers) -> None:
    right_padded = feature_module._padded_forward
    seconds = {"right-padded, causal kernel": 0.0, "left-padded, padding mask": 0.0}
    ways = dict(zip(seconds, (right_padded, left_padded_forward)))
    results = {name: [] for name in seconds}
    for n, shard in enumerate(shards):
        for name in list(ways) if n % 2 == 0 else list(ways)[::-1]:
            feature_module._padded_forward = ways[name]
            start = time.perf_counter()
            results[name] += forward_features(model, shard, 0, layers)[0]
            seconds[name] += time.perf_counter() - start
    feature_module._padded_forward = right_padded
    tokens = sum(len(row) for shard in shards for row in shard)
    for name, s in seconds.items():
        print(f"{name}: {tokens / s:.0f} tokens/s ({s:.1f} s for {tokens} tokens)")
    a, b = results.values()
    diff = max(float((f - r).abs().max() / r.abs().max()) for f, r in zip(a, b))
    print(f"ratio {seconds['left-padded, padding mask'] / seconds['right-padded, causal kernel']:.3f}; largest "
          f"feature difference {diff:.4f} (relative to the row's largest)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", default="training_data/smollm2-distill-all-bf16.npz")
    parser.add_argument("--shards", default="60,100")
    parser.add_argument("--budgets", default="0,2048,4096,16384")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--left-padded", action="store_true", help="compare with left-padded masked forwards")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    archive = read_tokens(args.tokens)
    model, _ = load_model(args.model, dtype=archive.meta["dtype"])
    shards = [[ids for _, ids, _ in archive.shard(int(i))] for i in args.shards.split(",")]
    tokens = sum(len(row) for shard in shards for row in shard)
    layers = aux_layer_ids(model)
    forward_features(model, shards[0][:2], 0, layers)  # warm-up
    if args.left_padded:
        compare_left_padded(model, shards, layers)
        return
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
