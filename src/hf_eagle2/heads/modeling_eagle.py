"""`EagleDraftModel`: the EAGLE-1/2 draft head.

    feature_t, token_{t+1}  ->  fc(concat(embed(token_{t+1}), feature_t))  ->  decoder layer  ->  feature^_{t+1}

* `fc` is a Linear 2H -> H (bias optional), the decoder layer is a Llama layer *without* input_layernorm
  (self-attention with RoPE, post-attention RMSNorm, MLP).
* The head owns neither embeddings nor an output head: it uses the target's, bound by `bind(target)`
  (done automatically by `generate`). `feature_t` is the target's final hidden state after its final norm,
  i.e. the input of its lm_head; the head's output goes through the same lm_head.
* With `config.draft_vocab_size = N`, the head scores only N target tokens (`d2t[i]` = target id of draft
  token i). Verification always uses the full target distribution, so output stays lossless.

Tensor names follow the official EAGLE-1/2 checkpoints (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...),
so `from_pretrained` reads official `pytorch_model.bin` / `model.safetensors` files and `save_pretrained`
writes a `model.safetensors` the official code reads back.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.utils import logging

from .configuration_eagle import EagleConfig
from ..kernels.cpu import NEVER, PackedWeight, is_optimized, min_rows_of, optimize_for_cpu, packed_linear
from ..kernels.fused_linear import FusedLinear
from .formats import (
    WEIGHT_FILES,
    is_speculators_config,
    official_config_from_speculators,
    official_state_from_speculators,
    read_weights,
    save_head,
    weights_sha256,
)
from ..kernels.reserved_cache import KVBuffer
from ..kernels.unrolled_attention import UnrolledMask, unrolled_attention

logger = logging.get_logger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

_REQUIRED = [
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
]
# Present in some official checkpoints, never needed: the target supplies embeddings; RoPE is recomputed.
_IGNORED = re.compile(r"^(embed_tokens\.weight|.*rotary_emb\.inv_freq)$")


class EagleRMSNorm(LlamaRMSNorm):
    """`LlamaRMSNorm` (same parameter, same result up to rounding) as one `F.rms_norm` kernel where input and weight
    share a dtype, instead of six: the head runs once per draft level, so its per-op overhead is the round's."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:
            return super().forward(hidden_states)
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


@functools.lru_cache(maxsize=16)
def _half_signs(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(dim,) -1 for the first half, +1 for the second (shared: never written to)."""
    return torch.cat([torch.full((dim // 2,), -1.0), torch.ones(dim - dim // 2)]).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, T, heads, D) with `EagleDraftModel.rotary`'s (cos, signed_sin), (B, T, D) each:
    x * cos + rotate_half(x) * sin as three kernels (rotate_half(x) = roll(x, D/2) with its first half negated,
    which signed_sin carries), the same values as transformers' `apply_rotary_pos_emb` up to rounding."""
    cos, signed_sin = cos.unsqueeze(2), signed_sin.unsqueeze(2)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


class EagleAttention(nn.Module):
    """Llama self-attention with an explicit (keys, values) cache and an explicit boolean mask."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self._qkv = FusedLinear()

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_value: KVCache | KVBuffer | None,
    ) -> tuple[torch.Tensor, KVCache | KVBuffer]:
        """x: (B, T, H); attention_mask: (B, 1, T, S) bool, True = attend, S = past + T; None = causal; an
        `UnrolledMask` for a training-time-test pass over a cache of the earlier passes.

        past_key_value: a (keys, values) tuple (returns this step's own (keys, values)), or a `KVBuffer` that
        this step appends to (returned)."""
        bsz, q_len, _ = x.shape
        qkv = self._qkv(x, (self.q_proj, self.k_proj, self.v_proj))  # (B, T, (heads + 2 kv_heads) * D): one GEMM
        qkv = qkv.view(bsz, q_len, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=2)
        q, k = rotate(qk, *cos_sin).transpose(1, 2).split([self.num_heads, self.num_kv_heads], 1)
        v = v.transpose(1, 2)
        new_kv = (k, v)
        if isinstance(past_key_value, KVBuffer):
            k, v = past_key_value.append(k, v)
            new_kv = past_key_value
        elif past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        is_causal = attention_mask is None and past_key_value is None and q_len > 1
        if attention_mask is None and past_key_value is not None and q_len > 1:
            raise ValueError("a mask is required when feeding several tokens on top of a cache")
        if isinstance(attention_mask, UnrolledMask):  # a training-time-test pass: one causal kernel, not a mask
            out = unrolled_attention(q, k, v, attention_mask.passes)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads
            )
        out = out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out), new_kv


class EagleMLP(LlamaMLP):
    """Llama's gated MLP with gate and up as one GEMM (`FusedLinear`); same modules and state dict."""

    def __init__(self, config):
        super().__init__(config)
        self._gate_up = FusedLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x, (self.gate_proj, self.up_proj)).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class EagleDecoderLayer(nn.Module):
    """A Llama decoder layer without input_layernorm (the EAGLE-1/2 head layer)."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.self_attn = EagleAttention(config)
        self.mlp = EagleMLP(config)
        self.post_attention_layernorm = EagleRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos_sin, attention_mask, past_key_value):
        attn, new_kv = self.self_attn(x, cos_sin, attention_mask, past_key_value)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), new_kv


@dataclass
class _TargetBinding:
    """The target modules the head borrows (kept out of the module tree so they are never saved)."""

    target_id: int
    embed_tokens: nn.Module
    head_weight: torch.Tensor  # (N, H): the target's lm_head rows for the draft vocabulary
    head_bias: torch.Tensor | None
    source_weight: torch.Tensor  # the target lm_head weight the rows were taken from
    head_packed: PackedWeight | None = None  # oneDNN copy of head_weight when the target runs `optimize_for_cpu`
    min_rows: int = 1


def _merged_vocab(current: torch.LongTensor, added: torch.LongTensor, vocab_size: int):
    """(sorted union of the target ids `current` (N,) and `added` (K,), order (N + K,)): entry j of the union is
    entry order[j] of cat(current, added). `added` must be new, distinct ids in [0, vocab_size)."""
    added = torch.as_tensor(added, dtype=torch.long, device=current.device).flatten()
    if added.numel() == 0:
        raise ValueError("no tokens to add to the draft vocabulary")
    if int(added.min()) < 0 or int(added.max()) >= vocab_size or added.unique().numel() != added.numel():
        raise ValueError(f"tokens added to the draft vocabulary must be distinct ids in [0, {vocab_size})")
    if bool(torch.isin(added, current).any()):
        raise ValueError("tokens added to the draft vocabulary must not be in it already")
    merged, order = torch.sort(torch.cat([current, added]))
    return merged, order


class EagleDraftModel(PreTrainedModel):
    """EAGLE-1/2 draft head. Load with `from_pretrained`, or make a fresh one with `from_target`."""

    config_class = EagleConfig
    base_model_prefix = "eagle"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["EagleDecoderLayer"]
    _supports_sdpa = True
    _kind = "EAGLE-1/2"  # named in loading errors
    _ignored = _IGNORED  # checkpoint tensors skipped on load

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList([EagleDecoderLayer(config)])
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        d2t = None if config.draft_vocab_size is None else torch.arange(config.draft_vocab_size, dtype=torch.long)
        self.register_buffer("d2t", d2t)  # a None buffer is left out of the state dict
        self._binding: _TargetBinding | None = None
        self.post_init()

    # ------------------------------------------------------------------ target binding
    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size or self.config.vocab_size

    def set_draft_vocab(self, token_ids: torch.LongTensor | None) -> "EagleDraftModel":
        """Restricts drafting to the target tokens `token_ids` (N,), or with None to the full vocabulary."""
        if token_ids is None:
            self.d2t = None
            self.config.draft_vocab_size = None
        else:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.fc.weight.device).flatten()
            if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
                raise ValueError("draft vocabulary ids must lie in [0, vocab_size)")
            if token_ids.unique().numel() != token_ids.numel():
                raise ValueError("draft vocabulary ids must be distinct")
            self.d2t = token_ids
            self.config.draft_vocab_size = token_ids.numel()
        self._binding = None  # the borrowed lm_head rows change: bind again
        return self

    def grow_draft_vocab(self, token_ids: torch.LongTensor) -> "EagleDraftModel":
        """Adds the target tokens `token_ids` (K,) to a reduced draft vocabulary (continued training on data
        whose frequent tokens it lacks). This head scores with the target's own lm_head, so only the ids change
        (an EAGLE-3 head's own lm_head grows rows). Kept in increasing target-id order."""
        if self.d2t is None:
            raise ValueError("this head drafts over the full vocabulary: there is nothing to grow")
        return self.set_draft_vocab(_merged_vocab(self.to_target_ids(torch.arange(self.draft_vocab_size)), token_ids,
                                                  self.config.vocab_size)[0])  # fmt: skip

    def bind(self, target: PreTrainedModel) -> "EagleDraftModel":
        """Borrow `target`'s input embeddings and lm_head; moves the head to the lm_head's device and dtype.

        Cheap to call again: nothing is redone while the same target (and lm_head weight) stays bound.
        """
        head = target.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise ValueError(f"{type(target).__name__} has no output embeddings (lm_head) for the draft head to use")
        weight = head.weight
        b = self._binding
        fast = is_optimized(head)  # optimize_for_cpu(target) reaches its lm_head too
        if b is not None and b.target_id == id(target) and b.source_weight is weight and fast == (b.head_packed is not None):
            return self
        text_config = target.config.get_text_config()
        if text_config.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"Draft head hidden size {self.config.hidden_size} differs from the target's "
                f"{text_config.hidden_size} ({type(target).__name__}): this head was trained for another model."
            )
        if text_config.vocab_size != self.config.vocab_size or weight.shape[0] != self.config.vocab_size:
            raise ValueError(
                f"Draft head vocabulary size {self.config.vocab_size} differs from the target's "
                f"{text_config.vocab_size} (lm_head rows: {weight.shape[0]}): the head and target must share a tokenizer."
            )
        if self.d2t is not None and int(self.d2t.max()) >= weight.shape[0]:
            raise ValueError("d2t maps draft tokens outside the target vocabulary")
        target_name = getattr(target, "name_or_path", None) or getattr(target.config, "_name_or_path", None)
        if _is_model_id(self.config.target_model) and _is_model_id(target_name):
            if self.config.target_model.lower() != target_name.lower():
                logger.warning(
                    f"This draft head was trained for {self.config.target_model}, but the target is {target_name}: the "
                    "output stays exact, but drafts are likely to be accepted less often."
                )
        if self.fc.weight.device != weight.device or self.fc.weight.dtype != weight.dtype:
            self.to(device=weight.device, dtype=weight.dtype)
        bias = getattr(head, "bias", None)
        if self.d2t is not None:
            head_weight = weight.detach()[self.d2t].contiguous()
            head_bias = None if bias is None else bias.detach()[self.d2t].contiguous()
        else:
            head_weight, head_bias = weight.detach(), None if bias is None else bias.detach()
        binding = _TargetBinding(id(target), target.get_input_embeddings(), head_weight, head_bias, weight)
        self._follow_target_kernels(head)
        if fast:  # the borrowed lm_head rows get their own packed copy
            binding.head_packed, binding.min_rows = PackedWeight(), min_rows_of(head).get(head_weight.dtype, NEVER)
        self._binding = binding
        return self

    def _follow_target_kernels(self, target_head: nn.Module) -> None:
        """Puts the head's own linears on the kernels of the target's lm_head: the oneDNN packed path with the
        target's dispatch when `optimize_for_cpu(target)` ran, stock `nn.Linear` otherwise."""
        if is_optimized(target_head):
            optimize_for_cpu(self, min_rows=min_rows_of(target_head))
        elif is_optimized(self):
            optimize_for_cpu(self, enable=False)

    def unbound_copy(self) -> "EagleDraftModel":
        """A deep copy of the head alone: the borrowed target modules are not copied (the copy is unbound)."""
        binding, self._binding = self._binding, None
        try:
            return copy.deepcopy(self)
        finally:
            self._binding = binding

    @property
    def binding(self) -> _TargetBinding:
        if self._binding is None:
            raise RuntimeError("EagleDraftModel is not bound to a target: call draft.bind(target_model) first")
        return self._binding

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        return self.binding.embed_tokens(input_ids)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., N) logits over the draft vocabulary."""
        b = self.binding
        if b.head_packed is not None:
            return packed_linear(hidden, b.head_weight, b.head_bias, b.head_packed, b.min_rows)
        return F.linear(hidden, b.head_weight, b.head_bias)

    def to_target_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Maps draft-vocabulary indices to target token ids."""
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    # ------------------------------------------------------------------ target features
    def target_feature_ids(self, target: PreTrainedModel) -> tuple[int, ...]:
        """Indices into `target`'s `hidden_states` whose concatenation is this head's target feature.

        EAGLE-1/2: the final hidden state (after the final norm) alone. The target forward returns only these."""
        return (-1,)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features as the target forward returns them -> the head's feature input (B, T, H).

        The drafter calls this once per feature when it is queued; the head's own outputs, fed back at depth
        >= 2, never pass through it. EAGLE-1/2: the identity (the target's final hidden state is the feature)."""
        return features

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None,
        features: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        past_key_value: KVCache | KVBuffer | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, KVCache | KVBuffer]:
        """One head step over T pairs (feature_t, token_{t+1}).

        input_ids: (B, T) tokens t+1 (or inputs_embeds (B, T, H)); features: (B, T, H) target (or drafted)
        features at t; position_ids: (B, T) = t; attention_mask: (B, 1, T, S) bool over past + new keys, or None
        for plain causal attention without a cache; cos_sin: the rotary (cos, sin) of position_ids, (B, T or 1, D)
        each, when the caller has them (`rotary`: one computation for all of a round's draft levels), else
        computed here. Returns the predicted features (B, T, H) and the new (keys, values) of these T positions,
        each (B, H_kv, T, D), or with a `KVBuffer` cache that cache.
        """
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        x = self.fc(torch.cat([inputs_embeds.to(features.dtype), features], dim=-1))
        if cos_sin is None:
            cos_sin = self.rotary(x, position_ids)
        return self.layers[0](x, cos_sin, attention_mask, past_key_value)

    def rotary(self, like: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each (B, T, D) in `like`'s dtype, of position_ids (B, T): the head's rotary
        embedding as `rotate` applies it (the sine's first half negated)."""
        cos, sin = self.rotary_emb(like, position_ids)
        return cos, sin * _half_signs(sin.shape[-1], sin.dtype, sin.device)

    # ------------------------------------------------------------------ construction
    @classmethod
    def config_for_target(cls, target: PreTrainedModel, **overrides) -> EagleConfig:
        """An EagleConfig sized to `target` (hidden size, heads, MLP width, vocabulary, RoPE theta)."""
        tc = target.config.get_text_config()
        num_heads = tc.num_attention_heads
        values = dict(
            vocab_size=tc.vocab_size,
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // num_heads,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(tc)},
            pad_token_id=getattr(tc, "pad_token_id", None),
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
            target_model=getattr(target, "name_or_path", None) or None,
        )
        values.update(overrides)
        return EagleConfig(**values)

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        *,
        draft_vocab: torch.LongTensor | None = None,
        bias: bool = True,
        seed: int | None = None,
        **overrides,
    ) -> "EagleDraftModel":
        """A randomly initialised head sized to `target` and bound to it (for tests and training).

        draft_vocab: optional (N,) target token ids the head may propose (reduced draft vocabulary); overrides:
        config values in place of the target's (e.g. a narrower `intermediate_size`: a cheaper draft step).
        """
        config = cls.config_for_target(
            target, bias=bias, draft_vocab_size=None if draft_vocab is None else int(draft_vocab.numel()), **overrides
        )
        if seed is not None:
            torch.manual_seed(seed)
        model = cls(config)
        if draft_vocab is not None:
            model.set_draft_vocab(draft_vocab)
        weight = target.get_output_embeddings().weight
        model.to(device=weight.device, dtype=weight.dtype)
        return model.bind(target).eval()

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, LlamaRMSNorm):
            module.weight.data.fill_(1.0)

    # ------------------------------------------------------------------ loading and saving
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        config: EagleConfig | PreTrainedConfig | str | os.PathLike | None = None,
        subfolder: str = "",
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
        proxies: dict | None = None,
        **kwargs: Any,
    ) -> "EagleDraftModel":
        """Loads a head from a local folder or a Hub repo: hf_eagle2, official EAGLE-1/2/3 or vLLM speculators
        (EAGLE-3) layout (`head_formats.py`).

        Reads `config.json` and `model.safetensors` (preferred) or `pytorch_model.bin`
        (`torch.load(weights_only=True)`). Unexpected or missing tensors raise a ValueError naming them.
        As in transformers: `config` (a config, or a folder / repo id holding one) is used instead of the
        folder's `config.json`; `subfolder` locates config and weights inside the folder or repo; `revision`
        picks the Hub revision.
        """
        from transformers.utils import cached_file

        torch_dtype = kwargs.pop("torch_dtype", None)
        dtype = dtype if dtype is not None else torch_dtype
        hub = dict(revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only,
                   force_download=force_download, proxies=proxies, subfolder=subfolder)  # fmt: skip
        path = str(pretrained_model_name_or_path)
        speculators = False  # a vLLM speculators folder (head_formats.py): its names are translated on load
        if isinstance(config, EagleConfig):
            config = copy.deepcopy(config)
        else:
            if isinstance(config, PreTrainedConfig):  # an official head's Llama-style config
                raw = config.to_dict()
            else:
                config_file = cached_file(str(config) if config is not None else path, "config.json", **hub)
                with open(config_file, encoding="utf-8") as f:
                    raw = json.load(f)
            if is_speculators_config(raw):
                raw, speculators = official_config_from_speculators(raw), True
            config = _config_class(raw).from_official_dict(raw)
        cls = _model_class(cls, config)
        weights_file = next((found for name in WEIGHT_FILES  # the first present, in WEIGHT_FILES' order
                             if (found := cached_file(path, name, _raise_exceptions_for_missing_entries=False, **hub))),
                            None)  # fmt: skip
        if weights_file is None:
            where = os.path.join(path, subfolder) if subfolder else path
            raise OSError(f"{where} has none of {', '.join(WEIGHT_FILES)}")
        state = read_weights(weights_file)
        model = cls(config)
        if speculators:
            state = official_state_from_speculators(state, model)
        model.load_head_state_dict(state, source=weights_file)
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype) or device is not None:
            model.to(device=device, dtype=dtype if isinstance(dtype, torch.dtype) else None)
        model.name_or_path = path
        model.weights_sha256 = weights_sha256(weights_file)  # recorded by eval-head and bench, checked by card
        return model.eval()

    def load_head_state_dict(self, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
        """Strictly loads official-layout tensors; ignores `embed_tokens.weight` and RoPE buffers."""
        state = {k: v for k, v in state.items() if not self._ignored.match(k)}
        expected = set(self.state_dict())
        unexpected = sorted(set(state) - expected)
        missing = sorted(expected - set(state))
        if unexpected or missing:
            raise ValueError(
                f"{source} does not hold an {self._kind} head of this config: unexpected tensors {unexpected}, "
                f"missing tensors {missing}. Expected names: {sorted(expected)}"
            )
        for name, tensor in self.state_dict().items():
            if state[name].shape != tensor.shape:
                raise ValueError(
                    f"{source}: tensor {name} has shape {tuple(state[name].shape)}, config expects {tuple(tensor.shape)}"
                )
        self.load_state_dict(state, strict=True)
        self._check_loaded(source)

    def _check_loaded(self, source: str) -> None:
        """Consistency checks of the loaded tensors beyond names and shapes (none for EAGLE-1/2)."""

    def save_pretrained(self, save_directory: str | os.PathLike, layout: str = "hf_eagle2", **kwargs: Any) -> None:
        """Writes `config.json` and `model.safetensors` (no embeddings; official tensor names).

        layout: "hf_eagle2" (this package's config), or "official" (Llama-style config for SafeAILab/EAGLE and
        SGLang; see `head_formats.py`)."""
        from safetensors.torch import save_file

        push_to_hub = kwargs.pop("push_to_hub", False)
        if layout != "hf_eagle2":
            if push_to_hub:
                raise NotImplementedError("push_to_hub writes the hf_eagle2 layout: save, then upload the folder")
            return save_head(self, save_directory, layout, **kwargs)
        os.makedirs(save_directory, exist_ok=True)
        self.config.architectures = ["EagleDraftModel"]
        self.config.save_pretrained(save_directory)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(save_directory, "model.safetensors"), metadata={"format": "pt"})
        if push_to_hub:
            from .hub import push_head_folder

            push_head_folder(save_directory, kwargs.pop("repo_id", None) or os.path.basename(str(save_directory)), **kwargs)

    def num_head_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _config_class(raw: dict) -> type[EagleConfig]:
    """The config class of a raw `config.json` dict: `Eagle3Config` for EAGLE-3 heads, else `EagleConfig`."""
    from .configuration_eagle import Eagle3Config, is_eagle3_config

    return Eagle3Config if is_eagle3_config(raw) else EagleConfig


def _model_class(requested: type, config: EagleConfig) -> type:
    """`EagleDraftModel.from_pretrained` loads EAGLE-3 heads as `Eagle3DraftModel`; a mismatch the other way fails.
    The EAGLE-3 class is the subclass whose `config_class` is `Eagle3Config` (the package imports
    `modeling_eagle3`), so this module does not import the module that builds on it."""
    from .configuration_eagle import Eagle3Config

    if isinstance(config, Eagle3Config):
        eagle3 = next(c for c in EagleDraftModel.__subclasses__() if c.config_class is Eagle3Config)
        if not issubclass(eagle3, requested):
            raise ValueError(f"this folder holds an EAGLE-3 head; {requested.__name__} cannot load it")
        return eagle3
    if issubclass(requested.config_class, Eagle3Config):
        raise ValueError(
            "this folder holds an EAGLE-1/2 head (its config.json does not name LlamaForCausalLMEagle3): "
            "load it with EagleDraftModel.from_pretrained"
        )
    return requested


def _is_model_id(name) -> bool:
    """Whether `name` names a model: a Hub repo id. A local folder does not say which model it holds."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or os.path.exists(name):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _rope_theta(text_config) -> float:
    params = getattr(text_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" not in params:  # per-layer-type dict (e.g. Gemma3)
        params = params.get("full_attention", next(iter(params.values()), {})) if params else {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(text_config, "rope_theta", None) or 10000.0)
