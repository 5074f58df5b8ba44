"""Loading and saving heads: official EAGLE-1/2 layout (.bin and safetensors), our own format, clear errors."""

import json
import os

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file

from hf_eagle2 import EagleConfig, EagleDraftModel
from hf_eagle2.evaluation.bench import ForwardCounter  # counts target forwards (a hook on the decoder)
from hf_eagle2.heads.formats import weights_sha256


def official_config(head: EagleDraftModel) -> dict:
    """A config.json as the official EAGLE repo ships it: Llama-style, one layer, optional bias."""
    c = head.config
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": c.hidden_size, "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size, "max_position_embeddings": c.max_position_embeddings,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
        "use_cache": True, "vocab_size": c.vocab_size, "bias": c.bias,
    }  # fmt: skip


def head_outputs(head, target):
    head.bind(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (2, 7), generator=g)
    feats = torch.randn(2, 7, 64, generator=g)
    out, _ = head(ids, feats, torch.arange(7).expand(2, 7))
    return out


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("bias", [True, False])
def test_official_checkpoint_round_trip(tmp_path, fmt, bias):
    target = tiny_model("llama")
    head = EagleDraftModel.from_target(target, seed=1, bias=bias)
    state = {k: v.clone() for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = torch.randn(32, 64)  # shipped by some official heads; must be ignored
    (tmp_path / "config.json").write_text(json.dumps(official_config(head)))
    if fmt == "bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        save_file(state, str(tmp_path / "model.safetensors"))
    loaded = EagleDraftModel.from_pretrained(str(tmp_path))
    assert loaded.config.bias is bias and loaded.config.rope_theta == head.config.rope_theta
    assert loaded.weights_sha256 == weights_sha256(tmp_path)  # the file it read is the one the digest names
    torch.testing.assert_close(head_outputs(loaded, target), head_outputs(head, target), atol=0, rtol=0)
    os.remove(next(tmp_path.glob("pytorch_model.bin" if fmt == "bin" else "model.safetensors")))
    with pytest.raises(OSError, match="has none of model.safetensors, pytorch_model.bin"):
        EagleDraftModel.from_pretrained(str(tmp_path))


def test_save_pretrained_is_readable_as_official_layout(tmp_path):
    target = tiny_model("llama")
    head = EagleDraftModel.from_target(target, seed=2)
    head.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "fc.weight" in tensors and "layers.0.self_attn.q_proj.weight" in tensors
    assert not any("embed" in k for k in tensors)  # never duplicates the target's embeddings
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                "rms_norm_eps", "rope_theta", "bias", "num_hidden_layers", "max_position_embeddings"):  # fmt: skip
        assert key in config, key
    reloaded = EagleDraftModel.from_pretrained(str(tmp_path))
    torch.testing.assert_close(head_outputs(reloaded, target), head_outputs(head, target), atol=0, rtol=0)


def test_reduced_vocabulary_round_trip(tmp_path):
    target = tiny_model("llama")
    vocab = torch.tensor([2, 3, 5, 8, 13, 21])
    head = EagleDraftModel.from_target(target, draft_vocab=vocab, seed=3)
    assert head.binding.head_weight.shape == (6, 64)
    head.save_pretrained(tmp_path)
    loaded = EagleDraftModel.from_pretrained(str(tmp_path)).bind(target)
    assert torch.equal(loaded.d2t, vocab) and loaded.config.draft_vocab_size == 6
    assert torch.equal(loaded.to_target_ids(torch.tensor([0, 5])), torch.tensor([2, 21]))


def test_auto_model_loads_heads(tmp_path):
    from transformers import AutoConfig, AutoModel

    head = EagleDraftModel.from_target(tiny_model("llama"), seed=4)
    head.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(str(tmp_path)), EagleConfig)
    assert isinstance(AutoModel.from_pretrained(str(tmp_path)), EagleDraftModel)


def test_unexpected_and_missing_tensors_are_named(tmp_path):
    head = EagleDraftModel.from_target(tiny_model("llama"), seed=5)
    state = dict(head.state_dict())
    state["layers.0.input_layernorm.weight"] = torch.ones(64)
    (tmp_path / "config.json").write_text(json.dumps(official_config(head)))
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors.*input_layernorm"):
        EagleDraftModel.from_pretrained(str(tmp_path))
    del state["layers.0.input_layernorm.weight"], state["fc.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*fc.weight"):
        EagleDraftModel.from_pretrained(str(tmp_path))


def test_full_model_config_is_rejected(tmp_path):
    config = official_config(EagleDraftModel.from_target(tiny_model("llama")))
    config["num_hidden_layers"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="exactly one decoder layer"):
        EagleDraftModel.from_pretrained(str(tmp_path))


def test_mismatched_target_is_rejected():
    head = EagleDraftModel.from_target(tiny_model("llama"))
    with pytest.raises(ValueError, match="hidden size"):
        head.bind(tiny_model("llama", hidden_size=32, intermediate_size=64))
    with pytest.raises(ValueError, match="vocabulary size"):
        head.bind(tiny_model("llama", vocab=40))


def test_missing_folder_raises():
    with pytest.raises(OSError):
        EagleDraftModel.from_pretrained("/nonexistent/eagle-head", local_files_only=True)


@pytest.mark.parametrize("tree", ["eagle2", None], ids=["tree", "stock"])
def test_head_for_another_model_is_refused_before_the_prefill(tree):
    head = EagleDraftModel.from_target(tiny_model("llama"))
    kw = {} if tree is None else {"tree": tree}
    for target, message in ((tiny_model("llama", hidden_size=32, intermediate_size=64), "hidden size"),
                            (tiny_model("llama", vocab=40), "vocabulary size")):  # fmt: skip
        counter = ForwardCounter(target)
        with pytest.raises(ValueError, match=message):
            target.generate(torch.tensor([[5, 6, 7]]), assistant_model=head, max_new_tokens=4, **kw)
        assert counter.calls == 0


def test_a_head_trained_for_another_model_is_reported(caplog):
    target = tiny_model("llama")
    target.name_or_path = target.config._name_or_path = "org/model-a"
    head = EagleDraftModel.from_target(target, seed=0)
    assert head.config.target_model == "org/model-a"
    ids = torch.tensor([[5, 6, 7]])
    with caplog.at_level("WARNING"):
        target.generate(ids, assistant_model=head, tree="eagle2", max_new_tokens=3)
    assert "trained for" not in caplog.text  # the same model: nothing to say
    head.config.target_model = "org/model-b"
    head._binding = None
    with caplog.at_level("WARNING"):
        target.generate(ids, assistant_model=head, tree="eagle2", max_new_tokens=3)
    assert "trained for org/model-b, but the target is org/model-a" in caplog.text
    caplog.clear()
    target.name_or_path = target.config._name_or_path = "/some/local/folder"  # names no model: no comparison
    head._binding = None
    with caplog.at_level("WARNING"):
        target.generate(ids, assistant_model=head, tree="eagle2", max_new_tokens=3)
    assert "trained for" not in caplog.text


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_attention_heads"])
def test_config_without_a_size_field_is_rejected_by_name(tmp_path, field):
    head = EagleDraftModel.from_target(tiny_model("llama"), seed=0)
    config = official_config(head)
    del config[field]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(dict(head.state_dict()), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=field):
        EagleDraftModel.from_pretrained(str(tmp_path))


def test_from_pretrained_config_argument_replaces_config_json(tmp_path):
    target = tiny_model("llama")
    head = EagleDraftModel.from_target(target, seed=6)
    head.save_pretrained(tmp_path)
    override = EagleConfig.from_official_dict({**official_config(head), "rms_norm_eps": 0.5})
    loaded = EagleDraftModel.from_pretrained(str(tmp_path), config=override)
    assert loaded.config.rms_norm_eps == 0.5 and override.rms_norm_eps == 0.5
    assert loaded.config is not override  # the caller's config is not shared with the model
    os.remove(tmp_path / "config.json")  # weights alone, with the config given
    loaded = EagleDraftModel.from_pretrained(str(tmp_path), config=head.config)
    torch.testing.assert_close(head_outputs(loaded, target), head_outputs(head, target), atol=0, rtol=0)


def test_from_pretrained_subfolder_holds_config_and_weights(tmp_path):
    target = tiny_model("llama")
    root_head = EagleDraftModel.from_target(target, seed=7, bias=False)
    sub_head = EagleDraftModel.from_target(target, seed=8)
    root_head.save_pretrained(tmp_path)
    sub_head.save_pretrained(tmp_path / "eagle")
    loaded = EagleDraftModel.from_pretrained(str(tmp_path), subfolder="eagle")
    assert loaded.config.bias is True  # the subfolder's config, not the root's
    torch.testing.assert_close(head_outputs(loaded, target), head_outputs(sub_head, target), atol=0, rtol=0)


def test_from_pretrained_passes_revision_and_subfolder_to_every_file(tmp_path, monkeypatch):
    import transformers.utils

    head = EagleDraftModel.from_target(tiny_model("llama"), seed=9)
    head.save_pretrained(tmp_path / "sub")
    calls = []
    real = transformers.utils.cached_file

    def spy(path, filename, **kwargs):
        calls.append((filename, kwargs.get("revision"), kwargs.get("subfolder")))
        return real(path, filename, **kwargs)

    monkeypatch.setattr(transformers.utils, "cached_file", spy)
    EagleDraftModel.from_pretrained(str(tmp_path), subfolder="sub", revision="v1.0")
    assert calls and all(rev == "v1.0" and sub == "sub" for _, rev, sub in calls)
    assert {"config.json", "model.safetensors"} <= {name for name, _, _ in calls}
