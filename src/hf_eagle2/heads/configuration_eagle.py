"""`EagleConfig`: the configuration of an EAGLE-1/2 draft head.

The head is one Llama decoder layer, so the config is a `LlamaConfig` with three additions:

* `bias` (default `True`, as in the official heads): whether the 2H->H `fc` layer has a bias;
* `draft_vocab_size` (default `None` = the target's full vocabulary): size N of a reduced draft vocabulary
  (EAGLE-3 / FR-Spec style). The head then scores only N target tokens, listed in the `d2t` tensor saved with
  its weights; verification still uses the full target distribution;
* `target_model`: free-text name of the target the head was trained for (informational).

Official EAGLE-1/2 `config.json` files (`model_type: "llama"`, `num_hidden_layers: 1`, optional `bias`) load
unchanged through `EagleConfig.from_official_dict`.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import LlamaConfig


# Fields a head config.json must give: missing, LlamaConfig would fill in a 7B model's sizes, and a head of
# another shape (or, for the attention heads, one that loads but computes something else) would follow.
REQUIRED_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")


@strict
class EagleConfig(LlamaConfig):
    model_type = "eagle"

    num_hidden_layers: int = 1
    bias: bool = True
    draft_vocab_size: int | None = None
    target_model: str | None = None

    def validate_architecture(self):
        super().validate_architecture()
        if self.num_hidden_layers != 1:
            raise ValueError(
                f"An EAGLE-1/2 draft head has exactly one decoder layer, but this config has num_hidden_layers="
                f"{self.num_hidden_layers}. Is this the config of a full model rather than of a draft head?"
            )
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")

    @property
    def rope_theta(self) -> float:
        params = self.rope_parameters or {}
        return float(params.get("rope_theta", 10000.0))

    @classmethod
    def from_official_dict(cls, raw: dict[str, Any]) -> "EagleConfig":
        """Reads an official EAGLE-1/2 (Llama-style) or an hf_eagle2 `config.json` dict."""
        missing = [name for name in REQUIRED_FIELDS if raw.get(name) is None]
        if missing:
            raise ValueError(
                f"the head's config has no {', '.join(missing)}: a draft head config must give "
                f"{', '.join(REQUIRED_FIELDS)} (LlamaConfig's defaults would describe another model)"
            )
        raw = dict(raw)
        raw.pop("model_type", None)
        raw.pop("architectures", None)
        raw.pop("transformers_version", None)
        if "torch_dtype" in raw and "dtype" not in raw:
            raw["dtype"] = raw.pop("torch_dtype")
        raw.pop("torch_dtype", None)
        try:
            config = cls(**raw)
        except StrictDataclassClassValidationError as err:  # not a ValueError; surface the validator's message
            raise ValueError(str(err.__cause__ or err)) from err
        config.architectures = ["EagleDraftModel"]
        return config

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # Keys the official EAGLE code reads with older transformers, which know no `rope_parameters`.
        out["rope_theta"] = self.rope_theta
        params = self.rope_parameters or {}
        out["rope_scaling"] = None if params.get("rope_type", "default") == "default" else dict(params)
        return out


EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@strict
class Eagle3Config(EagleConfig):
    """Configuration of an EAGLE-3 draft head (official `config.json`: `architectures: ["LlamaForCausalLMEagle3"]`).

    Adds to `EagleConfig`:

    * `target_hidden_size` (default `None` = `hidden_size`): width of each of the three target hidden states
      the `fc` layer reads (3 * target_hidden_size -> hidden_size);
    * `feature_layer_ids` (default `None` = the official choice, see `Eagle3DraftModel.target_feature_ids`):
      indices into the target's `hidden_states` tuple (0 = embeddings, i = input of decoder layer i).

    `draft_vocab_size` is the row count of the head's own `lm_head` (`None` = the full vocabulary); `bias`
    is unused (the EAGLE-3 `fc` has no bias).
    """

    model_type = "eagle3"

    bias: bool = False
    target_hidden_size: int | None = None
    feature_layer_ids: list[int] | None = None

    @classmethod
    def from_official_dict(cls, raw: dict[str, Any]) -> "Eagle3Config":
        config = super().from_official_dict(raw)
        config.architectures = [EAGLE3_ARCHITECTURE]
        return config

    def to_official_dict(self) -> dict[str, Any]:
        """The `config.json` the official EAGLE-3 code reads: Llama-style, `LlamaForCausalLMEagle3`."""
        out = self.to_dict()
        out["model_type"] = "llama"
        out["architectures"] = [EAGLE3_ARCHITECTURE]
        out["draft_vocab_size"] = self.draft_vocab_size or self.vocab_size
        if out.get("target_hidden_size") is None:
            out.pop("target_hidden_size", None)  # the official code tests for the key's presence
        return out


def official_feature_ids(num_layers: int) -> tuple[int, ...]:
    """The `hidden_states` entries official EAGLE-3 reads from a target of `num_layers` layers: 2, L // 2, L - 3
    (the inputs of those decoder layers), in layer order."""
    return tuple(sorted([2, num_layers // 2, num_layers - 3]))


def is_eagle3_config(raw: dict[str, Any]) -> bool:
    """Whether a raw `config.json` dict describes an EAGLE-3 head."""
    return EAGLE3_ARCHITECTURE in (raw.get("architectures") or []) or raw.get("model_type") == "eagle3"
