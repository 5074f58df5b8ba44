"""Batched EAGLE-2: left-padded prompts, each row with its own tree and accepted length.

Run from the repository root: `.venv/bin/python examples/batch_generate.py`.
"""

import hf_eagle2
from hf_eagle2.evaluation.assets import load_model

model, tokenizer = load_model("smollm2")
draft = hf_eagle2.EagleDraftModel.from_pretrained("model_cards/smollm2-135m-instruct-eagle2")
tokenizer.padding_side = "left"
questions = ["Say hi.", "What is a prime number?", "Write a limerick about a cat who loves boxes."]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
         for q in questions]
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
out = model.generate(**batch, assistant_model=draft, tree="eagle2", tree_total_tokens=16, tree_top_k=4,
                     max_new_tokens=80, return_dict_in_generate=True)
for q, row in zip(questions, out.sequences):
    print(f"Q: {q}\nA: {tokenizer.decode(row[batch['input_ids'].shape[1]:], skip_special_tokens=True)}\n")
print("tau per row:", [round(t, 2) for t in out.eagle_stats.tau_per_row])
