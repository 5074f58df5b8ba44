"""What recording features during generation saves in a self-distilled extraction (`hf-eagle2 extract`).

Answers one batch of training-split user turns twice, as `extract --responses target --turns all` batches them:
with `generate_with_features` (generate records the features of the forwards that wrote each token), and with
plain `generate` followed by one padded forward over prompt + answer (`forward_features`, what extraction did
before and still does for head-drafted answers). Prints both times, whether the answers are the same tokens, and
how far apart the two feature sets are (relative to each row's largest feature).

    python examples/extraction_cost.py --dtype bfloat16 --batch-size 64 --max-new-tokens 384 --threads 2
"""

import argparse
import itertools
import time

import torch

from hf_eagle2.assets import load_model
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
    parser.add_argument("--skip-conversations", type=int, default=4000, help="where in the training split to start")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    prompts = []
    for conv in itertools.islice(iter_sharegpt(split="train"), args.skip_conversations, None):
        prompts += [p for p in turn_prompts(tokenizer, conv) if len(p) <= args.max_prompt_tokens]
        if len(prompts) >= args.batch_size:
            break
    prompts = sorted(prompts[: args.batch_size], key=len)
    pad_id, eos_ids = pad_and_eos_ids(model, tokenizer)  # as extraction does
    layers = aux_layer_ids(model)

    start = time.perf_counter()
    recorded = generate_with_features(model, prompts, args.max_new_tokens, eos_ids, pad_id, aux_layers=layers)
    recorded_s = time.perf_counter() - start

    start = time.perf_counter()
    ids, mask = _left_pad(prompts, pad_id, "cpu")  # as generate_with_features pads
    out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                         eos_token_id=eos_ids, pad_token_id=pad_id)  # fmt: skip
    generate_s = time.perf_counter() - start
    rows = answered_rows(out, prompts, args.max_new_tokens, eos_ids)
    features, aux = forward_features(model, rows, pad_id, layers)
    second_pass_s = time.perf_counter() - start

    same = all(r[0].tolist() == row for r, row in zip(recorded, rows))
    tokens = sum(len(r) for r in rows)
    print(f"{len(prompts)} answers, {tokens} tokens (prompt + answer), same tokens both ways: {same}")
    print(f"generate + forward: {second_pass_s:.1f} s ({generate_s:.1f} s generate), {tokens / second_pass_s:.0f} "
          f"tokens/s")  # fmt: skip
    print(f"features recorded by generate: {recorded_s:.1f} s, {tokens / recorded_s:.0f} tokens/s "
          f"({second_pass_s / recorded_s:.2f}x)")  # fmt: skip
    if same:  # features of the same tokens: the two ways differ by rounding only
        final = max(float((r[1] - f).abs().max() / f.abs().max()) for r, f in zip(recorded, features))
        layer = max(float((r[2] - a).abs().max() / a.abs().max()) for r, a in zip(recorded, aux))
        print(f"largest difference, relative to the row's largest feature: final {final:.4f}, EAGLE-3 layers "
              f"{layer:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
