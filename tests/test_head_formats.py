"""Head layouts for serving stacks: vLLM speculators (EAGLE-3) and official EAGLE-1/2, written and read back."""

import json
import logging

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file
from test_eagle3 import LAYERS, N, official_eagle3_config, official_eagle3_state, write_official

from hf_eagle2 import Eagle3DraftModel, EagleDraftModel


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    return write_official(tmp_path_factory.mktemp("official3"))


def greedy_identical(target, head, **tree):
    ids = torch.randint(3, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=12)
    return torch.equal(target.generate(ids, do_sample=False, max_new_tokens=12, assistant_model=head, **tree), plain)


def test_speculators_round_trip(tmp_path, target, official_dir):
    head = EagleDraftModel.from_pretrained(official_dir)
    head.save_pretrained(tmp_path / "spec", layout="speculators", target=target, speculative_tokens=5)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == N
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, LAYERS // 2, LAYERS - 3]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["head_dim"] == 16
    assert layer["rope_theta"] == 10000.0 and layer["rope_scaling"] is None
    assert layer["vocab_size"] == target.config.vocab_size and layer["hidden_size"] == 64
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    saved = load_file(str(tmp_path / "spec" / "model.safetensors"))
    official = official_eagle3_state()
    assert sorted(saved) == sorted(k.replace("midlayer.", "layers.0.") for k in official)
    assert torch.equal(saved["layers.0.hidden_norm.weight"], official["midlayer.hidden_norm.weight"])
    again = EagleDraftModel.from_pretrained(str(tmp_path / "spec"))
    assert type(again) is Eagle3DraftModel and again.config.feature_layer_ids == [2, LAYERS // 2, LAYERS - 3]
    for name, tensor in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert greedy_identical(target, again, tree="eagle2", tree_total_tokens=10)


def speculators_folder(tmp_path, name, **changes):
    """A speculators EAGLE-3 folder written from the official head, with config changes applied."""
    head = EagleDraftModel.from_pretrained(write_official(tmp_path / f"{name}_src"))
    head.save_pretrained(tmp_path / name, layout="speculators")
    path = tmp_path / name / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "layer":
            config["transformer_layer_config"].update(value)
        elif value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return str(tmp_path / name)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(norm_before_residual=True), "sets norm_before_residual"),
        (dict(norm_output=True, fc_norm=True), "sets fc_norm, norm_output"),
        (dict(embed_requires_grad=True), "sets embed_requires_grad"),
        (dict(speculators_model_type="eagle"), "type 'eagle' are not supported"),
        (dict(layer={"model_type": "qwen3"}), "'qwen3' decoder layer"),
        (dict(layer={"num_hidden_layers": 2}), "2 decoder layers"),
    ],
    ids=["norm_before_residual", "norm_output", "own_embeddings", "eagle1", "qwen3_layer", "two_layers"],
)
def test_speculators_heads_that_compute_otherwise_are_refused(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        EagleDraftModel.from_pretrained(speculators_folder(tmp_path, "refused", **changes))


def test_speculators_full_vocabulary_without_maps(tmp_path, target):
    """A speculators head whose draft vocabulary is the target's may ship no d2t / t2d; verifier copies are skipped."""
    from safetensors.torch import save_file

    V = target.config.vocab_size
    state = official_eagle3_state(draft_ids=torch.arange(V))
    folder = write_official(tmp_path / "full_src", state, official_eagle3_config(draft_vocab_size=V))
    EagleDraftModel.from_pretrained(folder).save_pretrained(tmp_path / "full", layout="speculators")
    weights = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert "d2t" not in weights and "t2d" not in weights  # the export ships none either (vLLM refuses them then)
    weights["verifier_norm.weight"] = torch.ones(64)
    save_file(weights, str(tmp_path / "full" / "model.safetensors"))
    head = EagleDraftModel.from_pretrained(str(tmp_path / "full"))
    assert head.full_vocab and bool(head.t2d.all())
    assert greedy_identical(target, head, tree="chain")


def test_official_eagle12_layout(tmp_path, caplog):
    target = tiny_model("llama", seed=2)
    head = EagleDraftModel.from_target(target, seed=0)
    head.save_pretrained(tmp_path / "official", layout="official")
    config = json.loads((tmp_path / "official" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLMEagle", "LlamaForCausalLM"]
    # no `bias` key: vLLM and SGLang would read it as attention biases (tests/test_export_vllm.py)
    assert config["num_hidden_layers"] == 1 and "bias" not in config and "draft_vocab_size" not in config
    saved = load_file(str(tmp_path / "official" / "model.safetensors"))
    assert torch.equal(saved["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert set(saved) == set(head.state_dict()) | {"embed_tokens.weight"}
    again = EagleDraftModel.from_pretrained(str(tmp_path / "official"))
    for name, tensor in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert greedy_identical(target, again, tree="eagle2", tree_total_tokens=10)

    reduced = EagleDraftModel.from_target(target, seed=0, draft_vocab=torch.arange(0, target.config.vocab_size, 2))
    with caplog.at_level(logging.WARNING, logger="hf_eagle2.heads.formats"):
        reduced.save_pretrained(tmp_path / "reduced", layout="official")
    assert "no reduced draft vocabulary" in caplog.text
    assert "d2t" not in load_file(str(tmp_path / "reduced" / "model.safetensors"))
    assert EagleDraftModel.from_pretrained(str(tmp_path / "reduced")).d2t is None
    biasless = EagleDraftModel.from_target(target, seed=0, bias=False)
    biasless.save_pretrained(tmp_path / "biasless", layout="official")
    saved = load_file(str(tmp_path / "biasless" / "model.safetensors"))
    assert not saved["fc.bias"].any()  # SGLang's fc always has a bias: a zero one
    assert greedy_identical(target, EagleDraftModel.from_pretrained(str(tmp_path / "biasless")), tree="chain")
    with pytest.raises(ValueError, match="EAGLE-3 heads only"):
        head.save_pretrained(tmp_path / "nope", layout="speculators")
    with pytest.raises(ValueError, match="layout must be one of"):
        head.save_pretrained(tmp_path / "nope", layout="sglang")


def test_speculators_package_loads_the_export(tmp_path, target, official_dir):
    """When vLLM's `speculators` package is importable, its own EAGLE-3 model loads our export with equal tensors
    (not installed by `make test`: it pins an older transformers; run as the README says)."""
    core = pytest.importorskip("speculators.models.eagle3.core")
    target.save_pretrained(tmp_path / "verifier")  # speculators reads the verifier's embeddings and lm_head
    target.name_or_path = str(tmp_path / "verifier")
    head = EagleDraftModel.from_pretrained(official_dir)
    head.save_pretrained(tmp_path / "spec", layout="speculators", target=target)
    theirs = core.Eagle3DraftModel.from_pretrained(str(tmp_path / "spec"))
    their_state = theirs.state_dict()
    for name, tensor in load_file(str(tmp_path / "spec" / "model.safetensors")).items():
        assert torch.equal(their_state[name].to(tensor.dtype), tensor), name
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, LAYERS // 2, LAYERS - 3]
