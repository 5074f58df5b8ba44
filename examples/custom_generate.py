"""EAGLE-2 as a `custom_generate` recipe: the same loop, loaded the way the Hub serves it.

Run from the repository root: `.venv/bin/python examples/custom_generate.py`. On the Hub the recipe is a repo id
(`custom_generate="<user>/eagle2-generate"`, pushed with `hf-eagle2 push --custom-generate`); here it is this
repository, whose `custom_generate/` folder is the recipe, and the head a local folder (a Hub id works the same).
"""

import torch

from hf_eagle2.evaluation.assets import load_model

model, tokenizer = load_model("smollm2")
messages = [{"role": "user", "content": "Name three uses of a paper clip."}]
ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]

out = model.generate(ids, custom_generate=".", trust_remote_code=True,
                     assistant_model="model_cards/smollm2-135m-instruct-eagle2", tree="eagle2", max_new_tokens=64)
plain = model.generate(ids, do_sample=False, max_new_tokens=64)
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print("identical to plain greedy generate:", torch.equal(out, plain))
