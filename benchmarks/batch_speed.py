"""Batch-3 EAGLE-2 vs three batch-1 EAGLE-2 runs and vs plain batched greedy (same prompts, interleaved, 2 reps)."""
import time

import torch

import hf_eagle2
from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.evaluation.evaluate import chat_input_ids

torch.set_num_threads(2)
model, tok = load_model("smollm2")
draft = hf_eagle2.EagleDraftModel.from_pretrained("model_cards/smollm2-135m-instruct-eagle2")
texts = ["Write a short poem about the sea.", "Explain recursion to a five year old.", "Give me three tips for learning to cook."]
tok.padding_side = "left"
rendered = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False) for t in texts]
enc = tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
tree = dict(tree="eagle2", tree_total_tokens=16, tree_depth=6, tree_top_k=4)
N = 128
model.generate(**enc, assistant_model=draft, max_new_tokens=8, **tree)
times = {"batch3_eagle": [], "3x_batch1_eagle": [], "batch3_plain": [], "3x_batch1_plain": []}
for rep in range(2):
    t = time.perf_counter(); out = model.generate(**enc, assistant_model=draft, max_new_tokens=N, return_dict_in_generate=True, **tree); times["batch3_eagle"].append(time.perf_counter() - t)
    t = time.perf_counter()
    for x in texts:
        model.generate(chat_input_ids(tok, [{"role": "user", "content": x}]), assistant_model=draft, max_new_tokens=N, **tree)
    times["3x_batch1_eagle"].append(time.perf_counter() - t)
    t = time.perf_counter(); model.generate(**enc, do_sample=False, max_new_tokens=N); times["batch3_plain"].append(time.perf_counter() - t)
    t = time.perf_counter()
    for x in texts:
        model.generate(chat_input_ids(tok, [{"role": "user", "content": x}]), do_sample=False, max_new_tokens=N)
    times["3x_batch1_plain"].append(time.perf_counter() - t)
best = {k: min(v) for k, v in times.items()}
print({k: round(v, 2) for k, v in best.items()})
print("tau per row", [round(x, 2) for x in out.eagle_stats.tau_per_row], "overall", round(out.eagle_stats.tau, 2))
print("batch-3 eagle vs 3 x batch-1 eagle: %.2fx" % (best["3x_batch1_eagle"] / best["batch3_eagle"]))
print("batch-3 eagle vs batch-3 plain: %.2fx" % (best["batch3_plain"] / best["batch3_eagle"]))
print("batch-3 plain vs 3 x batch-1 plain: %.2fx" % (best["3x_batch1_plain"] / best["batch3_plain"]))
