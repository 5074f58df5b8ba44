"""Two token archives' answers to the same prompts, compared: e.g. answers written on a GPU (`hf-eagle2 answer`)
against the same shard answered on this CPU.

    hf-eagle2 export-prompts --out p36.npz --shards 36 --turns all --dtype bfloat16 --eagle3 --batch-size 64 \\
        --min-prompt-tokens 384 --max-prompt-tokens 1024
    hf-eagle2 answer --tokens p36.npz --out cpu36.npz --rows-per-call 64
    python benchmarks/compare_answers.py --a cpu36.npz --b training_data/smollm2-distill-p1024-bf16.npz --fp32-ties

Rows are matched by sequence id over the work-list shards both archives hold. Prints how many answers are the
same token for token, and with `--fp32-ties`, where they first differ, which of the two tokens an fp32 forward
over the shared prefix picks and how far apart its top two logits are: bf16 greedy answers part at near ties
that another kernel's rounding breaks the other way, and there fp32 sides with either about equally often.

Measured (2026-12-04), shard 36 of the (384, 1,024] band: answered on a 2-core Zen 4 EPYC (the commands above,
bf16, 188.6 s) as `a` and on an H200 (`answer --rows-per-call 1024`, bf16, the archive's shard) as `b`: 19 of 64
answers the same token for token (as between extract's two CPU code paths, `benchmarks/extraction_cost.py`); the
other 45 part at answer token 0-143 (median 33), at a near tie (fp32's top two logits a median 0.060, at most 0.238
apart), where fp32 picks the CPU's token 28 times and the GPU's 17.
"""

import argparse

import torch

from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.training.tokens import read_tokens


def rows_by_id(path: str) -> dict[str, tuple[list[int], int]]:
    """sequence id -> (token ids, answer start), over every shard of the archive."""
    archive = read_tokens(path)
    out = {}
    for index in range(len(archive.shard_sequences)):
        for sid, ids, mask in archive.shard(index):
            out[sid] = (ids, len(mask) - sum(mask))
    return out


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--fp32-ties", action="store_true")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    a, b = rows_by_id(args.a), rows_by_id(args.b)
    both = [sid for sid in a if sid in b]
    if not both:
        raise SystemExit("the archives share no sequence ids")
    differ = []
    for sid in both:
        (ids_a, start_a), (ids_b, start_b) = a[sid], b[sid]
        if start_a != start_b or ids_a[:start_a] != ids_b[:start_b]:
            raise SystemExit(f"{sid}: the archives hold other prompts for it")
        if ids_a != ids_b:
            n = min(len(ids_a), len(ids_b))
            at = next((i for i in range(n) if ids_a[i] != ids_b[i]), n)
            differ.append((sid, at))
    print(f"{len(both)} shared prompts: {len(both) - len(differ)} answers the same token for token")
    if differ:
        offsets = sorted(at - a[sid][1] for sid, at in differ)
        print(f"where they differ, the first differing answer token: median {offsets[len(offsets) // 2]}, "
              f"min {offsets[0]}, max {offsets[-1]}")
    if args.fp32_ties and differ:
        model, _ = load_model(args.model, dtype="float32")
        picks, gaps = {"a": 0, "b": 0, "neither": 0, "one ended": 0}, []
        for sid, at in differ:
            ids_a, ids_b = a[sid][0], b[sid][0]
            if at >= min(len(ids_a), len(ids_b)):
                picks["one ended"] += 1  # one answer is a prefix of the other (cap or EOS): no token to compare
                continue
            logits = model(torch.tensor([ids_a[:at]]), logits_to_keep=1).logits[0, -1].float()
            top = logits.topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            pick = int(top.indices[0])
            picks["a" if pick == ids_a[at] else "b" if pick == ids_b[at] else "neither"] += 1
        if gaps:
            print(f"fp32 at the first differing token picks {picks}; its top-2 logit gap there: median "
                  f"{sorted(gaps)[len(gaps) // 2]:.3f}, max {max(gaps):.3f}")


if __name__ == "__main__":
    main()
