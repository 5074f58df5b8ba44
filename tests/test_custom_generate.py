"""The repo's `custom_generate/` folder: `model.generate(custom_generate=<repo>, trust_remote_code=True, tree=...)`
in an interpreter that imports only torch and transformers, and `hf-eagle2 push --custom-generate`."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_model

import hf_eagle2
from hf_eagle2 import EagleDraftModel
from hf_eagle2.heads import hub
from hf_eagle2.heads.card import parse_front_matter
from hf_eagle2.cli import main

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "custom_generate"
TREE = dict(tree="eagle2", tree_total_tokens=8, tree_depth=3, tree_top_k=4)
PROMPT = [[1, 5, 9, 3, 17, 4, 22, 8]]

# Runs in a fresh interpreter: its own code imports torch and transformers only (checked below). The tiny model
# is conftest.tiny_model("llama"), built inline; argv: repo folder, head folder, tree kwargs and prompt as JSON.
CHILD = """
import json, sys
import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig

repo, head_dir, tree, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
torch.set_num_threads(2)
config = LlamaConfig(
    vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
with torch.no_grad():
    model.get_output_embeddings().weight.mul_(4.0)
model.generation_config.pad_token_id = 0
model.eval()
ids = torch.tensor(prompt)
plain = model.generate(ids, max_new_tokens=24, do_sample=False)
assert "hf_eagle2" not in sys.modules, "the child imported hf_eagle2 before custom_generate did"

out = model.generate(ids, custom_generate=repo, trust_remote_code=True, assistant_model=head_dir, tree="eagle2",
                     max_new_tokens=24, do_sample=False)
assert torch.equal(out, plain), (out, plain)
assert "hf_eagle2" in sys.modules  # brought in by custom_generate/generate.py, not by this script

by_path = model.generate(ids, custom_generate=repo, trust_remote_code=True, assistant_model=head_dir,
                         max_new_tokens=24, do_sample=False, return_dict_in_generate=True, **tree)
# a loaded head object: AutoModel knows the "eagle" config type once the package is loaded
head = AutoModel.from_pretrained(head_dir)
assert type(head).__name__ == "EagleDraftModel", type(head)
by_object = model.generate(ids, custom_generate=repo, trust_remote_code=True, assistant_model=head,
                           max_new_tokens=24, do_sample=False, return_dict_in_generate=True, **tree)
for result in (by_path, by_object):
    assert torch.equal(result.sequences, plain)
    assert result.eagle_stats is not None and result.eagle_stats.target_forwards > 0
print(json.dumps({
    "sequences": plain.tolist(),
    "target_forwards": [by_path.eagle_stats.target_forwards, by_object.eagle_stats.target_forwards],
    "accept_hist": [by_path.eagle_stats.accept_hist, by_object.eagle_stats.accept_hist],
}))
"""


def _imported_packages(source: str) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    return imported


def test_custom_generate_in_a_fresh_interpreter(tmp_path):
    import torch

    assert _imported_packages(CHILD) == {"json", "sys", "torch", "transformers"}
    model = tiny_model("llama")
    head = EagleDraftModel.from_target(model, seed=0)
    head_dir = tmp_path / "head"
    head.save_pretrained(head_dir)
    # the same loop through `import hf_eagle2`: the child must match it round for round
    ids = torch.tensor(PROMPT)
    ref = model.generate(ids, assistant_model=head, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                         **TREE)  # fmt: skip

    env = dict(os.environ)
    env.update(
        HF_HOME=str(tmp_path / "hf_home"),
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),  # transformers copies generate.py here
        HF_HUB_OFFLINE="1",
        # the child imports this checkout's hf_eagle2 (the venv's editable install may point at another one)
        PYTHONPATH=os.pathsep.join([str(Path(hf_eagle2.__file__).parents[1]), env.get("PYTHONPATH", "")]),
    )
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), str(head_dir), json.dumps(TREE), json.dumps(PROMPT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["sequences"] == ref.sequences.tolist()
    assert result["target_forwards"] == [ref.eagle_stats.target_forwards] * 2
    assert result["accept_hist"] == [ref.eagle_stats.accept_hist] * 2


def test_hub_generate_loads_a_head_by_path_and_keeps_hub_kwargs_from_the_model(tmp_path):
    """The recipe's body in-process: a head folder string, plus the kwargs transformers used to fetch the recipe
    (they are not model kwargs), gives the `import hf_eagle2` result."""
    import torch

    from hf_eagle2.integration import hub_generate

    model = tiny_model("llama")
    head = EagleDraftModel.from_target(model, seed=0)
    head.save_pretrained(tmp_path)
    ids = torch.tensor(PROMPT)
    ref = model.generate(ids, assistant_model=head, max_new_tokens=24, return_dict_in_generate=True, **TREE)
    out = hub_generate(model, ids, assistant_model=str(tmp_path), max_new_tokens=24, return_dict_in_generate=True,
                       revision="main", local_files_only=True, **TREE)  # fmt: skip
    assert torch.equal(out.sequences, ref.sequences)
    assert out.eagle_stats.accept_hist == ref.eagle_stats.accept_hist


def test_folder_layout_and_card():
    assert (FOLDER / "generate.py").is_file()
    requirements = [line.strip() for line in (FOLDER / "requirements.txt").read_text().splitlines()]
    assert any(re.match(r"hf-eagle2\b", line) for line in requirements)
    meta = parse_front_matter((FOLDER / "README.md").read_text())
    assert "custom_generate" in meta["tags"] and meta["library_name"] == "transformers"


class FakeApi:
    def __init__(self, token=None):
        self.calls = []

    def create_repo(self, **kw):
        self.calls.append(("create_repo", kw))

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw))
        return type("Info", (), {"commit_url": "https://huggingface.co/x/y/commit/abc"})()

    def upload_file(self, **kw):
        self.calls.append(("upload_file", kw))
        return type("Info", (), {"commit_url": "https://huggingface.co/x/y/commit/def"})()


def test_push_custom_generate_to_its_own_repo():
    api = FakeApi()
    url = hub.push_custom_generate(str(FOLDER), "someone/eagle2-generate", api=api)
    assert url.endswith("/commit/def")
    assert [name for name, _ in api.calls] == ["create_repo", "upload_folder", "upload_file"]
    repo = {"repo_id": "someone/eagle2-generate", "repo_type": "model", "private": False, "exist_ok": True}
    assert api.calls[0][1] == repo
    folder = api.calls[1][1]
    assert folder["path_in_repo"] == "custom_generate" and folder["folder_path"] == str(FOLDER)
    assert set(folder["allow_patterns"]) == {"generate.py", "requirements.txt", "README.md"}
    card = api.calls[2][1]  # the folder's README is the repo's card: the Hub lists the repo under custom_generate
    assert card["path_in_repo"] == "README.md" and card["path_or_fileobj"] == str(FOLDER / "README.md")


def test_push_custom_generate_refuses_a_folder_without_generate_py(tmp_path):
    (tmp_path / "requirements.txt").write_text("hf-eagle2\n")
    with pytest.raises(FileNotFoundError, match="generate.py"):
        hub.push_custom_generate(str(tmp_path), "someone/x", api=FakeApi())


def test_cli_push_head_and_custom_generate_into_one_repo(tmp_path, monkeypatch):
    """`--head` and `--custom-generate` together: one repo serves as both custom_generate= and assistant_model=;
    the head's card stays the repo's card."""
    import huggingface_hub

    api = FakeApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda token=None: api)
    EagleDraftModel.from_target(tiny_model("llama"), seed=0).save_pretrained(tmp_path)
    (tmp_path / "README.md").write_text("---\ntags: [eagle]\n---\n# head card\n")
    monkeypatch.chdir(REPO)  # --custom-generate without a value: ./custom_generate
    assert main(["push", "--head", str(tmp_path), "--custom-generate", "--repo-id", "someone/head"]) == 0
    names = [name for name, _ in api.calls]
    assert names == ["create_repo", "upload_folder", "create_repo", "upload_folder"]
    assert "README.md" in api.calls[1][1]["allow_patterns"] and api.calls[1][1]["folder_path"] == str(tmp_path)
    assert api.calls[3][1]["path_in_repo"] == "custom_generate"


def test_cli_push_custom_generate_alone(monkeypatch):
    import huggingface_hub

    api = FakeApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda token=None: api)
    assert main(["push", "--custom-generate", str(FOLDER), "--repo-id", "someone/eagle2-generate"]) == 0
    assert [name for name, _ in api.calls] == ["create_repo", "upload_folder", "upload_file"]


def test_cli_push_needs_something_to_push():
    with pytest.raises(SystemExit, match="--custom-generate"):
        main(["push", "--repo-id", "someone/x"])
