"""EAGLE-2 tree speculative decoding as a Hub `custom_generate` recipe.

    model.generate(input_ids, custom_generate="<this repo or folder>", trust_remote_code=True,
                   assistant_model="<EAGLE head folder or repo id>", tree="eagle2", max_new_tokens=256)

transformers copies only this file into its module cache, so the decoding code is not here: it is the
`hf-eagle2` package named in requirements.txt (checked by transformers before this file runs), the same loop
`import hf_eagle2` gives. Importing it also installs its `generate()` hook, as `import hf_eagle2` does.
"""

from hf_eagle2.integration import hub_generate


def generate(model, *args, **kwargs):
    """The user's `generate` arguments, `model` in place of `self`; see README.md for the `tree*` arguments."""
    return hub_generate(model, *args, **kwargs)
