"""Model card generation from a results JSON, and Hub upload up to the network boundary."""

import json

import pytest
import yaml
from conftest import tiny_model

from hf_eagle2 import EagleDraftModel
from hf_eagle2.card import parse_front_matter, render_card, write_card
from hf_eagle2.hub import push_head_folder

RESULTS = {
    "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "hub_name": "someone/smollm2-135m-instruct-eagle2",
    "hardware": "2-core CPU",
    "training": {"config": {"lr": 0.001, "draft_vocab_size": 8192, "ce_weight": 0.1, "noise_std": 0.2,
                            "warmup_steps": 100, "grad_clip": 0.5, "batch_tokens": 4096, "seed": 0},
                 "tokens_seen": 1234567, "epochs": 3.0, "train_tokens": 411522, "train_sequences": 1000,
                 "train_seconds": 7200.0, "head_parameters": 4203648},
    "eval": {"max_new_tokens": 256, "tree": {"tree": "eagle2", "tree_total_tokens": 60, "tree_depth": 6, "tree_top_k": 10},
             "datasets": {"mtbench": {"prompts": 80, "tau": 3.1}, "humaneval": {"prompts": 164, "tau": 3.4}},
             "calibration": {"nodes": 10, "local": {"edges": [0, 0.5, 1], "count": [4, 6], "confidence": [0.3, 0.8],
                                                    "accepted": [0.25, 0.75], "ece": 0.05, "total": 10},
                             "path": {"edges": [0, 0.5, 1], "count": [5, 5], "confidence": [0.2, 0.7],
                                      "accepted": [0.2, 0.6], "ece": 0.05, "total": 10}}},
    "speed": {"mtbench": {"speedup": 1.8}, "humaneval": {"speedup": 2.1}},
    "curve": [{"tokens_seen": 1000, "tau_mtbench": 2.0}],
    "commands": {"eval": "hf-eagle2 eval-head ...", "train": "hf-eagle2 train ...", "card": "hf-eagle2 card ..."},
}  # fmt: skip


def test_card_front_matter_is_valid_yaml():
    text = render_card(RESULTS)
    meta = parse_front_matter(text)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["license"] == "apache-2.0" and meta["pipeline_tag"] == "text-generation"
    assert {"eagle", "eagle-2", "speculative-decoding"} <= set(meta["tags"])
    assert meta["library_name"] and meta["datasets"]
    yaml.safe_load(yaml.safe_dump(meta))
    for needle in ("3.10", "3.40", "1.80x", "ECE", "tree=\"eagle2\"", "hf-eagle2 eval-head", "Limitations"):
        assert needle in text, needle


def test_card_needs_front_matter():
    with pytest.raises(ValueError):
        parse_front_matter("# no metadata")


class FakeApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, **kw):
        self.calls.append(("create_repo", kw))

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw))
        return type("Info", (), {"commit_url": "https://huggingface.co/x/y/commit/abc"})()


def test_push_uploads_card_config_and_weights(tmp_path):
    head = EagleDraftModel.from_target(tiny_model("llama"), seed=0)
    head.save_pretrained(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(RESULTS))
    write_card(str(tmp_path))
    (tmp_path / "scratch.txt").write_text("not uploaded")
    api = FakeApi()
    url = push_head_folder(str(tmp_path), "someone/head", api=api)
    assert url.endswith("/commit/abc")
    assert api.calls[0] == ("create_repo", {"repo_id": "someone/head", "repo_type": "model", "private": False, "exist_ok": True})
    upload = api.calls[1][1]
    assert set(upload["allow_patterns"]) == {"README.md", "config.json", "model.safetensors", "results.json"}
    assert upload["repo_id"] == "someone/head"


def test_push_refuses_a_folder_without_a_head(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        push_head_folder(str(tmp_path), "someone/head", api=FakeApi())


def test_real_hub_client_reaches_the_network_boundary(tmp_path, monkeypatch):
    """With the real huggingface_hub client, the call gets as far as the HTTP request (offline here)."""
    head = EagleDraftModel.from_target(tiny_model("llama"), seed=0)
    head.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Exception) as err:
        push_head_folder(str(tmp_path), "someone/head", token="hf_fake")
    text = f"{type(err.value).__name__}: {err.value}".lower()
    assert any(word in text for word in ("offline", "connect", "name or service", "resolve", "network")), text
