"""EAGLE-2 through `pipeline("text-generation")` with chat messages, greedy and sampling.

Run from the repository root: `.venv/bin/python examples/pipeline_chat.py`.
"""

import torch
from transformers import pipeline

import hf_eagle2
from hf_eagle2.evaluation.assets import load_model

model, tokenizer = load_model("smollm2")
draft = hf_eagle2.EagleDraftModel.from_pretrained("model_cards/smollm2-135m-instruct-eagle2")
chat = pipeline("text-generation", model=model, tokenizer=tokenizer)

messages = [{"role": "user", "content": "Give me two tips for writing clear emails."}]
greedy = chat(messages, assistant_model=draft, tree="eagle2", tree_total_tokens=16, tree_top_k=4,
              max_new_tokens=96, do_sample=False)
print("greedy:", greedy[0]["generated_text"][-1]["content"])

torch.manual_seed(0)  # sampling is lossless: same distribution as plain sampling, reproducible with a seed
sampled = chat(messages, assistant_model=draft, tree="eagle2", tree_total_tokens=16, tree_top_k=4,
               max_new_tokens=96, do_sample=True, temperature=0.7, top_p=0.9)
print("sampled:", sampled[0]["generated_text"][-1]["content"])
