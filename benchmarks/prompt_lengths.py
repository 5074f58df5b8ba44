"""How many user turns of ShareGPT's training split each prompt-length band holds: what a self-distilled folder
with `extract --turns all --min-prompt-tokens A --max-prompt-tokens B` would answer, before spending hours on it.

A turn's prompt is the chat-template ids of the conversation up to it (`turn_prompts`), as extraction renders it;
the counts over the first `--conversations` conversations are scaled to the split's size (train: 98% of 17,671).

    python benchmarks/prompt_lengths.py --conversations 1500 --bands 384,1024,2048,4096
"""

import argparse
import itertools

import numpy as np
from transformers import AutoTokenizer

from hf_eagle2.evaluation.assets import converted_gguf_folder, resolve_gguf
from hf_eagle2.training.data import is_heldout, iter_json_array, iter_sharegpt, sharegpt_path
from hf_eagle2.training.features import turn_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--conversations", type=int, default=1500)
    parser.add_argument("--bands", default="384,1024,2048,4096", help="band edges in prompt tokens")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(converted_gguf_folder(resolve_gguf(args.model)))
    lengths = np.array([len(p) for c in itertools.islice(iter_sharegpt(split="train"), args.conversations)
                        for p in turn_prompts(tokenizer, c)])  # fmt: skip
    split = sum(1 for raw in iter_json_array(sharegpt_path()) if not is_heldout(str(raw.get("id", ""))))
    scale = split / args.conversations
    print(f"{args.conversations} conversations: {lengths.size} user turns; scaled to the {split} training "
          "conversations (before skipping incomplete ones):")
    edges = [0, *map(int, args.bands.split(",")), None]
    for low, high in zip(edges, edges[1:]):
        n = int(((lengths > low) & (lengths <= (high or lengths.max()))).sum())
        print(f"  ({low}, {high or 'max'}]: {n} turns, ~{n * scale:,.0f} in the split")


if __name__ == "__main__":
    main()
