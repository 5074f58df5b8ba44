"""Publishing to the Hugging Face Hub: a head folder (card, config, weights, calibration plot) and the repo's
`custom_generate/` recipe (so `generate(custom_generate=<repo id>, trust_remote_code=True, ...)` finds it)."""

from __future__ import annotations

import os

REQUIRED = ("config.json", "model.safetensors")
UPLOADED = ("README.md", "config.json", "model.safetensors", "calibration.png", "tau_curve.png", "results.json")
CUSTOM_GENERATE_REQUIRED = ("generate.py", "requirements.txt")
CUSTOM_GENERATE_UPLOADED = ("generate.py", "requirements.txt", "README.md")


def check_head_folder(folder: str) -> list[str]:
    """The files of `folder` that go to the Hub; raises if the head itself is missing."""
    missing = [f for f in REQUIRED if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise FileNotFoundError(f"{folder} is not a head folder: missing {missing}")
    return [f for f in UPLOADED if os.path.exists(os.path.join(folder, f))]


def check_custom_generate_folder(folder: str) -> list[str]:
    """The files of a `custom_generate/` folder that go to the Hub; raises if the recipe itself is missing."""
    missing = [f for f in CUSTOM_GENERATE_REQUIRED if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise FileNotFoundError(f"{folder} is not a custom_generate folder: missing {missing}")
    return [f for f in CUSTOM_GENERATE_UPLOADED if os.path.exists(os.path.join(folder, f))]


def push_head_folder(folder: str, repo_id: str, *, token: str | None = None, private: bool = False,
                     commit_message: str = "Upload EAGLE-2 draft head", api=None) -> str:  # fmt: skip
    """Creates `repo_id` (if needed) and uploads the head folder's card, config and weights. Returns the commit URL.

    With a `results.json`, the card (README.md) is written again first, so that its usage snippet loads the repo's
    full `user/name` id (the Hub resolves a bare name to the caller's namespace).
    `api` defaults to `huggingface_hub.HfApi(token=token)`; tests pass a stand-in to stop at the network boundary."""
    check_head_folder(folder)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    url = api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    full_id = getattr(url, "repo_id", None) or repo_id
    if os.path.exists(os.path.join(folder, "results.json")):
        from .card import is_namespaced, write_card

        if is_namespaced(full_id):
            write_card(folder, repo_id=full_id)
    files = check_head_folder(folder)
    info = api.upload_folder(
        folder_path=folder, repo_id=repo_id, repo_type="model", allow_patterns=files, commit_message=commit_message
    )
    return str(getattr(info, "commit_url", info))


def push_custom_generate(folder: str, repo_id: str, *, card: bool = True, token: str | None = None,
                         private: bool = False, commit_message: str = "Upload EAGLE-2 custom_generate recipe",
                         api=None) -> str:  # fmt: skip
    """Creates `repo_id` (if needed) and uploads `folder` as its `custom_generate/`. Returns the last commit URL.

    With `card`, the folder's README.md also becomes the repo's card (a repo of its own, listed under the Hub's
    `custom_generate` tag); pushed next to a head, `card=False` keeps the head's card. `api` as in push_head_folder."""
    files = check_custom_generate_folder(folder)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(folder_path=folder, path_in_repo="custom_generate", repo_id=repo_id, repo_type="model",
                             allow_patterns=files, commit_message=commit_message)  # fmt: skip
    if card and "README.md" in files:
        info = api.upload_file(path_or_fileobj=os.path.join(folder, "README.md"), path_in_repo="README.md",
                               repo_id=repo_id, repo_type="model", commit_message=commit_message)  # fmt: skip
    return str(getattr(info, "commit_url", info))
