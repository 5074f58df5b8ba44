"""Head checkpoints in the layouts serving stacks read, so a head trained here can be served on a cluster.

`head.save_pretrained(folder, layout=...)` writes one of:

* `"hf_eagle2"` (default): this package's layout. EAGLE-1/2: `config.json` of an `EagleConfig`
  (`model_type: "eagle"`) and `model.safetensors` under the official tensor names. EAGLE-3 heads have no layout
  of their own here: they are written in the official one.
* `"official"`: what SafeAILab/EAGLE, SGLang and vLLM (`method="eagle"`) load. EAGLE-1/2: a Llama-style
  `config.json` (`model_type: "llama"`, `architectures: ["LlamaForCausalLMEagle", "LlamaForCausalLM"]`: SGLang
  serves the first, vLLM skips it as unknown and serves the second as `EagleLlamaForCausalLM`; SafeAILab ignores
  both), tensors `fc.*`, `layers.0.*` and, when the head is bound to a target, the target's
  `embed_tokens.weight` (official heads ship it; SGLang and vLLM use the target's own when equal). SGLang's `fc`
  always has a bias, so a bias-free head is written with a zero `fc.bias`: the same function, loadable
  everywhere. The config carries no `bias` key: SafeAILab's default for a missing one is the fc bias it needs,
  while vLLM's and SGLang's Llama layers read `bias: true` as *attention* biases (q/k/v/o) that no EAGLE
  checkpoint has, left uninitialised (vLLM 0.32 then accepted 0 of 162 drafted tokens). vLLM's EAGLE-1 `fc`
  has no bias and drops a shipped one (a trained bias is lost there; the SmolLM2 head's top-1 barely moved
  without it). A reduced draft
  vocabulary has no place in that layout and is dropped with a warning (drafting then scores the full
  vocabulary; outputs are unchanged, as verification is exact). SafeAILab computes head_dim as hidden /
  heads: heads of targets with another head_dim (e.g. Qwen3) load in SGLang, not there.
  EAGLE-3: `LlamaForCausalLMEagle3`, `midlayer.*`, `d2t` (offsets), `t2d`.
* `"speculators"` (EAGLE-3 only): vLLM's `speculators` format: `config.json` with
  `speculators_model_type: "eagle3"`, a Llama `transformer_layer_config`, `draft_vocab_size`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (strictly increasing: vLLM captures them in layer
  order) and a `speculators_config` (algorithm, greedy proposal, verifier); tensors as in the official layout
  but with the decoder layer under `layers.0.` instead of `midlayer.`. `norm_before_residual: false` is
  written out, as vLLM's default for a missing key is true (another head). A head drafting over the full
  vocabulary ships no `d2t` / `t2d`: vLLM has no place for them then and refuses the checkpoint
  (tests/test_export_vllm.py lists what vLLM 0.32's loader requires).

`EagleDraftModel.from_pretrained` reads all three (`is_speculators_config` picks the translation below). Only
speculators EAGLE-3 heads that compute what the official head computes load: one Llama decoder layer, no
extra norms (`norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output` all false), embeddings borrowed
from the target (`embed_requires_grad` false); anything else is refused by name rather than loaded into a head
that would draft something else. Feature layer ids are sorted, as serving stacks concatenate them in layer order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

LAYOUTS = ("hf_eagle2", "official", "speculators")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes (read from vllm-project/speculators)
# speculators switches that change the head's computation; the official EAGLE-3 head has all of them off
SPECULATORS_UNSUPPORTED_SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                                    "embed_requires_grad")  # fmt: skip
# transformer_layer_config fields the head's config takes over
LAYER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                "attention_bias", "mlp_bias")  # fmt: skip


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what from_pretrained reads, in its order
# SGLang's EAGLE-1/2 class first; vLLM skips it (unregistered) and serves the second as EagleLlamaForCausalLM
OFFICIAL_EAGLE12_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLM")


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """Tensors of one of WEIGHT_FILES: safetensors, or a torch pickle read with `weights_only=True`."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def weights_sha256(path: str | os.PathLike) -> str | None:
    """sha256 of a head's weights file (`path` is the file, or a folder holding one of WEIGHT_FILES; None if it has
    none): the identity that evaluations, benchmarks and a card's results.json record, so measurements of one
    head are never presented as another's."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = [os.path.join(path, name) for name in WEIGHT_FILES if os.path.exists(os.path.join(path, name))]
        if not files:
            return None
        path = files[0]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_head(head, save_directory: str | os.PathLike, layout: str, *, target=None,
              speculative_tokens: int = 3) -> None:  # fmt: skip
    """Writes `head` in `layout` (see the module doc). target: the model the head drafts for (names the verifier
    and fixes the feature layers in the speculators config; defaults to the bound target's embeddings only)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    eagle3 = head.config.model_type == "eagle3"  # Eagle3Config's
    if layout == "speculators" and not eagle3:
        raise ValueError("the speculators layout is written for EAGLE-3 heads only (vLLM serves EAGLE-1/2 heads "
                         "from the official layout): use layout='official'")  # fmt: skip
    os.makedirs(save_directory, exist_ok=True)
    if eagle3:
        config = head.config.to_official_dict()
        state = _tensors(head)
        if layout == "speculators":
            config = speculators_config(head, target, speculative_tokens)
            state = {_rename(k, "midlayer.", "layers.0."): v for k, v in state.items()}
            if head.full_vocab:  # vLLM builds no draft->target map then, and refuses a checkpoint that has one
                state.pop("d2t", None)
                state.pop("t2d", None)
    elif layout == "official":
        config, state = _official_eagle12(head)
    else:
        raise AssertionError("the hf_eagle2 layout of EAGLE-1/2 heads is EagleDraftModel.save_pretrained's own")
    _write(save_directory, config, state)


def _tensors(head) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}


def _rename(name: str, old: str, new: str) -> str:
    return new + name[len(old) :] if name.startswith(old) else name


def _write(folder, config: dict, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _official_eagle12(head) -> tuple[dict, dict[str, torch.Tensor]]:
    config = head.config.to_dict()
    # no `bias` key: SafeAILab reads a missing one as the fc bias written below, while vLLM and SGLang would read
    # `bias: true` as q/k/v/o biases (see the module doc)
    config.pop("bias", None)
    config.update(model_type="llama", architectures=list(OFFICIAL_EAGLE12_ARCHITECTURES), num_hidden_layers=1,
                  attention_bias=False, mlp_bias=False)  # fmt: skip
    state = _tensors(head)
    if "fc.bias" not in state:  # SGLang's fc always has a bias: a zero one computes the same
        state["fc.bias"] = torch.zeros(head.fc.out_features, dtype=head.fc.weight.dtype)
    if config.pop("draft_vocab_size", None) is not None or "d2t" in state:
        logger.warning("the official EAGLE-1/2 layout has no reduced draft vocabulary: it is left out, and "
                       "stacks serving this folder draft over the full vocabulary")  # fmt: skip
        state.pop("d2t", None)
    if head._binding is not None:
        embed = head.binding.embed_tokens.weight
        state["embed_tokens.weight"] = embed.detach().to(head.fc.weight.dtype).contiguous().cpu()
    return config, state


def speculators_config(head, target=None, speculative_tokens: int = 3) -> dict[str, Any]:
    """The `config.json` of an EAGLE-3 head in vLLM's speculators format."""
    c = head.config
    layer = {name: getattr(c, name) for name in LAYER_FIELDS}
    # older readers (transformers 4.x) look for rope_theta / rope_scaling beside rope_parameters
    layer["rope_theta"], layer["rope_scaling"] = c.rope_theta, c.to_dict()["rope_scaling"]
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1, tie_word_embeddings=False)
    feature_ids = [int(i) for i in c.feature_layer_ids] if c.feature_layer_ids is not None else None
    verifier = {"name_or_path": c.target_model, "architectures": []}
    if target is not None:
        feature_ids = [int(i) for i in head.target_feature_ids(target)]
    if feature_ids is not None and any(a >= b for a, b in zip(feature_ids, feature_ids[1:])):
        # vLLM (EagleModelMixin._set_aux_hidden_state_layers) captures sorted(set(ids)): the head would read
        # its three features in another order, or fewer of them
        raise ValueError(f"the head's feature layer ids {feature_ids} are not strictly increasing: serving stacks "
                         "concatenate the target's hidden states in layer order, so this head cannot be served")  # fmt: skip
    if target is not None:
        # as speculators' own converter: the draft's context never shorter than the target's
        target_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None) or 0
        layer["max_position_embeddings"] = max(layer["max_position_embeddings"], target_positions)
        verifier = {"name_or_path": getattr(target, "name_or_path", None) or c.target_model,
                    "architectures": list(target.config.architectures or [type(target).__name__])}  # fmt: skip
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": head.d2t.numel(),
        "target_hidden_size": int(c.target_hidden_size or c.hidden_size),  # fc reads 3 x this
        "eagle_aux_hidden_state_layer_ids": feature_ids,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "dtype": str(head.fc.weight.dtype).replace("torch.", ""),
    }


# ---------------------------------------------------------------------- reading
def is_speculators_config(raw: dict[str, Any]) -> bool:
    return "speculators_model_type" in raw


def official_config_from_speculators(raw: dict[str, Any]) -> dict[str, Any]:
    """A speculators `config.json` dict -> the official EAGLE-3 dict `Eagle3Config.from_official_dict` reads."""
    from transformers import AutoConfig

    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(f"speculators heads of type {kind!r} are not supported here: only 'eagle3' (EAGLE-1/2 heads "
                         "load from the official layout)")  # fmt: skip
    switched = [name for name in SPECULATORS_UNSUPPORTED_SWITCHES if raw.get(name)]
    if switched:
        raise ValueError(f"this speculators EAGLE-3 head sets {', '.join(switched)}: that head computes something "
                         "other than the official EAGLE-3 head (with the target's embeddings) this package "
                         "implements, so it is not loaded")  # fmt: skip
    layer_raw = dict(raw.get("transformer_layer_config") or {})
    # as speculators does: a missing model_type means its default (qwen3) layer, missing fields that type's defaults
    layer_type = layer_raw.pop("model_type", "qwen3")
    if layer_type != "llama":
        raise ValueError(f"this speculators EAGLE-3 head uses a {layer_type!r} decoder layer; only 'llama' layers "
                         "(the official EAGLE-3 head) are supported")  # fmt: skip
    layer = AutoConfig.for_model("llama", **layer_raw)
    if layer.num_hidden_layers != 1:
        raise ValueError(f"this speculators EAGLE-3 head has {layer.num_hidden_layers} decoder layers; the "
                         "EAGLE-3 head here has exactly one")  # fmt: skip
    if getattr(layer, "attention_bias", False) or getattr(layer, "mlp_bias", False):
        raise ValueError("this speculators EAGLE-3 head has attention or MLP biases; the official head has none")
    out = {name: getattr(layer, name) for name in LAYER_FIELDS if getattr(layer, name, None) is not None}
    out.pop("attention_bias", None)
    out.pop("mlp_bias", None)
    out.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
               draft_vocab_size=raw.get("draft_vocab_size") or layer.vocab_size)  # fmt: skip
    if raw.get("target_hidden_size") is not None:
        out["target_hidden_size"] = raw["target_hidden_size"]
    if raw.get("eagle_aux_hidden_state_layer_ids") is not None:
        out["feature_layer_ids"] = sorted(raw["eagle_aux_hidden_state_layer_ids"])
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("name_or_path"):
        out["target_model"] = verifier["name_or_path"]
    return out


def official_state_from_speculators(state: dict[str, torch.Tensor], head) -> dict[str, torch.Tensor]:
    """speculators tensor names -> the official ones; frozen verifier copies dropped; a full draft vocabulary
    without `d2t`/`t2d` gets the identity map."""
    out = {_rename(k, "layers.0.", "midlayer."): v for k, v in state.items() if not k.startswith("verifier_")}
    if "d2t" not in out and "t2d" not in out:
        out["d2t"] = head.d2t.detach().clone()
        out["t2d"] = head.t2d.detach().clone()
    return out
