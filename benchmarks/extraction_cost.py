"""What recording features during generation, and dropping finished rows, save in a self-distilled extraction.

Answers one batch of training-split user turns as `extract --responses target --turns all` batches them: with
`generate_with_features` in generate calls of each `--chunk-steps` decode steps (rows whose answer ended leave the
batch between calls; 0: one call for the whole answer), and with `--second-pass` plain `generate` followed by one
padded forward over prompt + answer (`forward_features`, what head-drafted extraction does). Prints each way's time
and tokens/s, how many answers are the same tokens as the first way's, and for those how far apart the features
are (relative to each row's largest feature).

    python benchmarks/extraction_cost.py --dtype bfloat16 --batch-size 64 --max-new-tokens 384 --chunk-steps 0,32

`--min-prompt-tokens 384 --max-prompt-tokens 1024` times a batch of the long-prompt band instead.

`--kernels stock,fast` repeats each way with the target's linears on oneDNN prepacked weights (`optimize_for_cpu`,
as `bench` and `eval-head --kernels fast` run them), in the order given, and compares with the first way's answers.
On a Zen 4 EPYC (2 threads, bf16, 64 prompts, 32 steps per call) both ran 201 tokens/s with bit-identical answers
and features: stock bf16 linears already run oneDNN there (a 64-row gate_proj: 0.39 ms stock, 0.36 ms prepacked,
equal outputs), so `extract` keeps the stock kernels.

`--reserve none,256` compares the default `DynamicCache` (which copies every layer's keys and values on every
step, and lets generate prefill the whole batch in one forward) with `extract`'s reserved cache (spare slots
written in place, `reserved_cache.py`; the prompts prefilled in row groups of 4,096 padded tokens). On the Zen 4
(2 threads, bf16, one band batch: 64 prompts of 399-1,024 tokens, 70,050 tokens with the answers, 32 steps per
call, `--min-prompt-tokens 384 --max-prompt-tokens 1024 --chunk-steps 32 --reserve none,256 --fp32-ties`) the
DynamicCache way took 356.2 s and the reserved one 241.2 s (1.48x; 400.7 vs 254.5 s in an earlier run, and the
reserved cache with generate's own one-forward prefill took 270.4 s against 372.9). Their bf16 answers are the
same token for token in 19 of 64 rows: the others part at a near tie (fp32's top two logits a median 0.065, at most
0.208 apart) that the two roundings break differently, and there fp32 picks the DynamicCache way's token 21 times,
the reserved way's 22 and neither twice, so neither is the truer answer.
"""

import argparse
import itertools
import time

import torch

from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.kernels.cpu import optimize_for_cpu
from hf_eagle2.training.data import iter_sharegpt
from hf_eagle2.training.features import (_left_pad, answered_rows, aux_layer_ids, forward_features,
                                        generate_with_features, pad_and_eos_ids, turn_prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--min-prompt-tokens", type=int, default=0,
                        help="only prompts longer than this, as extract --min-prompt-tokens picks a band's")
    parser.add_argument("--skip-conversations", type=int, default=4000, help="where in the training split to start")
    parser.add_argument("--chunk-steps", default="0,32", help="decode steps per generate call, comma-separated")
    parser.add_argument("--reserve", default="256",
                        help="spare KV slots per cache growth (ReservedLayer), comma-separated; none: DynamicCache")
    parser.add_argument("--fp32-ties", action="store_true",
                        help="where answers differ, which way an fp32 forward sides with (run after the timings)")
    parser.add_argument("--second-pass", action="store_true", help="also time generate + one forward over the answers")
    parser.add_argument("--kernels", default="stock", help="stock, fast or both, comma-separated, run in that order")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not set(args.kernels.split(",")) <= {"stock", "fast"}:
        parser.error(f"--kernels takes stock and/or fast, comma-separated, not {args.kernels!r}")
    reserves = [None if r == "none" else int(r) for r in args.reserve.split(",")]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    prompts = []
    for conv in itertools.islice(iter_sharegpt(split="train"), args.skip_conversations, None):
        band = [p for p in turn_prompts(tokenizer, conv) if args.min_prompt_tokens < len(p) <= args.max_prompt_tokens]
        prompts += band
        if len(prompts) >= args.batch_size:
            break
    prompts = sorted(prompts[: args.batch_size], key=len)
    pad_id, eos_ids = pad_and_eos_ids(model, tokenizer)  # as extraction does
    layers = aux_layer_ids(model)

    runs = {}
    for kernels in args.kernels.split(","):
        optimize_for_cpu(model, enable=kernels == "fast")
        for chunk, reserve in itertools.product([int(c) for c in args.chunk_steps.split(",")], reserves):
            start = time.perf_counter()
            results = generate_with_features(model, prompts, args.max_new_tokens, eos_ids, pad_id, aux_layers=layers,
                                             chunk_steps=chunk or None, reserve=reserve)  # fmt: skip
            cache = "DynamicCache" if reserve is None else f"reserve {reserve}"
            runs[f"{kernels} kernels, recorded, {chunk or 'all'} decode steps per generate call, {cache}"] = (
                time.perf_counter() - start, results)
    if args.second_pass:
        start = time.perf_counter()
        ids, mask = _left_pad(prompts, pad_id, "cpu")  # as generate_with_features pads
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=pad_id)  # fmt: skip
        generate_s = time.perf_counter() - start
        rows = answered_rows(out, prompts, args.max_new_tokens, eos_ids)
        features, aux = forward_features(model, rows, pad_id, layers)
        second_pass_s = time.perf_counter() - start
        results = [(torch.tensor(r), f, a, 0) for r, f, a in zip(rows, features, aux)]
        runs[f"{kernels} kernels, generate ({generate_s:.1f} s) + forward"] = (second_pass_s, results)

    first = next(iter(runs.values()))[1]
    tokens = sum(len(r[0]) for r in first)
    print(f"{len(prompts)} answers, {tokens} tokens (prompt + answer) in the first way")
    for way, (seconds, results) in runs.items():
        same = [(r, f) for r, f in zip(results, first) if torch.equal(r[0], f[0])]
        line = f"{way}: {seconds:.1f} s, {sum(len(r[0]) for r in results) / seconds:.0f} tokens/s, "
        line += f"{len(same)}/{len(first)} answers the same tokens"
        if same:  # features of the same tokens: the ways differ by rounding only
            final = max(float((r[1] - f[1]).abs().max() / f[1].abs().max()) for r, f in same)
            layer = max(float((r[2] - f[2]).abs().max() / f[2].abs().max()) for r, f in same)
            line += f" (largest feature difference: final {final:.4f}, EAGLE-3 layers {layer:.4f})"
        print(line)
    if args.fp32_ties:
        fp32_ties(model, first, runs)


@torch.inference_mode()
def fp32_ties(model, first: list, runs: dict) -> None:
    """Where a way's answer first differs from the first way's, which token an fp32 forward over the shared
    prefix picks, and how far apart its top two logits are: a near tie that bf16 rounding flips either way."""
    model.float()
    for way, (_, results) in list(runs.items())[1:]:
        picks, gaps = {"first way": 0, "this way": 0, "neither": 0}, []
        for r, f in zip(results, first):
            n = min(len(r[0]), len(f[0]))
            differ = (r[0][:n] != f[0][:n]).nonzero()
            if not differ.numel():
                continue
            at = int(differ[0])
            top = model(f[0][:at].unsqueeze(0), logits_to_keep=1).logits[0, -1].float().topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            pick = int(top.indices[0])
            picks["first way" if pick == f[0][at] else "this way" if pick == r[0][at] else "neither"] += 1
        if gaps:
            print(f"{way}: where {len(gaps)} answers first differ, fp32 picks {picks}; its top-2 logit gap there: "
                  f"median {sorted(gaps)[len(gaps) // 2]:.3f}, max {max(gaps):.3f}")


if __name__ == "__main__":
    main()
