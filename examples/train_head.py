"""Train a draft head with one command, then decode with it.

Run from the repository root: `.venv/bin/python examples/train_head.py` (about a minute on 2 cores). It runs the
`smoke` recipe on SmolLM2-135M-Instruct, a handful of ShareGPT conversations and three training steps, so the
head is weak; a real head is the same command with `--recipe eagle3-sharegpt` or `eagle2-sharegpt` (hours on a
CPU: `hf-eagle2 train-head --list-recipes`). Run it again and every finished step is skipped.
"""

import json

import torch

import hf_eagle2
from hf_eagle2 import cli
from hf_eagle2.evaluation.assets import load_model

out = "runs/heads/smoke-smollm2"
cli.main(["train-head", "--target", "smollm2", "--recipe", "smoke", "--out", out, "--threads", "2"])
with open(f"{out}/train-head.json") as f:
    log = json.load(f)
print(f"compute spent so far: {log['compute_seconds']:.0f} s over {len(log['runs'])} invocation(s)")

model, tokenizer = load_model("smollm2")
draft = hf_eagle2.EagleDraftModel.from_pretrained(f"{out}/head")
messages = [{"role": "user", "content": "What is a prime number?"}]
ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
out_ids = model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=48, return_dict_in_generate=True)
print(tokenizer.decode(out_ids.sequences[0, ids.shape[1]:], skip_special_tokens=True))
print("identical to plain greedy:", torch.equal(out_ids.sequences, model.generate(ids, do_sample=False, max_new_tokens=48)))
print(out_ids.eagle_stats.summary())
