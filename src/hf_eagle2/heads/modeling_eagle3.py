"""`Eagle3DraftModel`: the EAGLE-3 draft head.

    target features  f_t = concat(h_low, h_mid, h_high)_t            (B, T, 3 * H_target)
    depth 1:         g_t = fc(f_t)                                   (3 * H_target -> H, no bias)
    depth >= 2:      g   = the head's own output at the parent (pre-norm), fed back as is (no fc)
    layer:           x = concat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t))   (2H wide)
                     h = g_t + o_proj(attn(q/k/v_proj(x)))          (q/k/v take 2H)
                     out = h + mlp(post_attention_layernorm(h))
    logits:          lm_head(norm(out)) over the draft vocabulary; draft id i is target id i + d2t[i]

Why a sibling class (a subclass of `EagleDraftModel`) and not a config switch: the module tree differs
(`midlayer` with two input norms and 2H-wide projections, a final `norm`, an own `lm_head`, `t2d`), the
vocabulary map has other semantics (official `d2t` holds offsets, EAGLE-1/2 heads here store target ids) and
the target features differ; a switch would put a branch into every method of the EAGLE-1/2 head. As a subclass
it still is an `EagleDraftModel` to `generate`, the drafter and the tree builders, which only use the shared
interface: `bind`, `embed`, `forward(tokens, features, positions, mask, cache)`, `draft_logits`,
`to_target_ids`, plus the two feature hooks `target_feature_ids` and `project_features`.

Target features. Official EAGLE-3 collects, in one target forward, the input of decoder layers 2, L // 2 and
L - 3 (L = number of target layers), i.e. entries 2, L // 2, L - 3 of transformers' `hidden_states` tuple
(entry 0 = embeddings), concatenated in layer order. `target_feature_ids` returns them (sorted; for L >= 7 that
is the official order; smaller toy models get the same formula, duplicates allowed), and `target.py` asks the
target forward for exactly those entries (`output_hidden_states=[...]`, transformers 5 records only the
selected layers), so verification needs no second pass.

Feed-back. The head's output before `norm` is both the input of `norm` + `lm_head` and the feature of the next
depth. Target features are 3H wide, the head's own H wide; rather than telling them apart by width inside
`forward` (as the official code does), the drafter calls `project_features` once when it queues target
features, so `forward` always takes H-wide features.

Checkpoints: the official layout (`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`,
`config.json` with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, optional
`target_hidden_size`), read strictly and written back by `save_pretrained`. When `target_hidden_size` differs
from `hidden_size`, the head cannot borrow the target's embeddings and carries its own `embed_tokens.weight`
(as official heads for such targets do); otherwise a shipped `embed_tokens.weight` is ignored.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from .configuration_eagle import Eagle3Config, official_feature_ids
from ..kernels.cpu import is_optimized
from .formats import save_head
from .modeling_eagle import EagleAttention, EagleDraftModel, EagleMLP, EagleRMSNorm, KVCache, _merged_vocab, _TargetBinding
from ..kernels.reserved_cache import KVBuffer


class Eagle3Attention(EagleAttention):
    """`EagleAttention` whose q/k/v projections read the 2H-wide concat(embedding, feature)."""

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        width, bias = 2 * config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)


class Eagle3DecoderLayer(nn.Module):
    """The EAGLE-3 `midlayer`: norms the embedding and the feature apart, attends over both, residual = feature."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = EagleMLP(config)
        self.input_layernorm = EagleRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = EagleRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = EagleRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, embeds, features, cos_sin, attention_mask, past_key_value):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        attn, new_kv = self.self_attn(x, cos_sin, attention_mask, past_key_value)
        h = features + attn
        return h + self.mlp(self.post_attention_layernorm(h)), new_kv


class Eagle3DraftModel(EagleDraftModel):
    """EAGLE-3 draft head. Load with `from_pretrained` (`EagleDraftModel.from_pretrained` dispatches here)."""

    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    _no_split_modules = ["Eagle3DecoderLayer"]
    _kind = "EAGLE-3"
    _ignored = re.compile(r"^(.*rotary_emb\.inv_freq)$")

    def __init__(self, config: Eagle3Config):
        PreTrainedModel.__init__(self, config)  # not EagleDraftModel.__init__: another module tree
        target_hidden = config.target_hidden_size or config.hidden_size
        num_draft = config.draft_vocab_size or config.vocab_size
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = EagleRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, num_draft, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        # own embeddings only when the target's are of another width (official heads ship them then)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if self.owns_embeddings else None
        self.register_buffer("d2t", torch.zeros(num_draft, dtype=torch.long))  # draft id i -> target id i + d2t[i]
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[:num_draft] = True
        self.register_buffer("t2d", t2d)  # target ids the draft vocabulary holds
        self._binding: _TargetBinding | None = None
        self.post_init()

    @property
    def owns_embeddings(self) -> bool:
        c = self.config
        return c.target_hidden_size is not None and c.target_hidden_size != c.hidden_size

    @property
    def target_hidden_size(self) -> int:
        return self.config.target_hidden_size or self.config.hidden_size

    # ------------------------------------------------------------------ vocabulary
    def set_draft_vocab(self, token_ids: torch.LongTensor | None) -> "Eagle3DraftModel":
        """Only for a head whose lm_head rows are the bound target's (`lm_head_is_targets`): its drafts then score
        any target tokens `token_ids` (N,), or all of them with None, as an EAGLE-1/2 head's do. A head with its own
        trained rows has none for the tokens it lacks: refused."""
        if not self.lm_head_is_targets():
            raise NotImplementedError(
                "an EAGLE-3 head scores its draft vocabulary with its own trained lm_head: it cannot be changed "
                "(unless its rows are the target's: train --freeze-lm-head)"
            )
        return self.borrow_target_lm_head(None if token_ids is None else torch.as_tensor(token_ids).sort().values)

    def lm_head_is_targets(self) -> bool:
        """Whether the lm_head rows are the bound target's rows of the draft vocabulary, to fp16 rounding (a head
        trained with `freeze_lm_head`, saved in any dtype): then any vocabulary is a choice of the target's rows."""
        if self._binding is None:
            raise RuntimeError("bind the EAGLE-3 head to its target first: its lm_head rows are compared with the "
                               "target's")  # fmt: skip
        rows = self.lm_head.weight.detach().float()
        ids = self.to_target_ids(torch.arange(rows.shape[0], device=self.d2t.device))
        target_rows = self.binding.source_weight.detach()[ids.to(self.binding.source_weight.device)]
        target_rows = target_rows.float().to(rows.device)
        return rows.shape == target_rows.shape and torch.allclose(rows, target_rows, rtol=1e-3, atol=1e-6)

    def num_head_parameters(self) -> int:
        """Parameters the head adds to its target. lm_head rows that are the bound target's (`freeze_lm_head`) are
        borrowed, like the embeddings, so not counted; an unbound head cannot tell, and counts them."""
        total = sum(p.numel() for p in self.parameters())
        if self._binding is not None and self.lm_head_is_targets():
            total -= self.lm_head.weight.numel()
        return total

    def grow_draft_vocab(self, token_ids: torch.LongTensor) -> "Eagle3DraftModel":
        """Adds the target tokens `token_ids` (K,) to the draft vocabulary (continued training on data whose
        frequent tokens it lacks): trained lm_head rows are kept, a new token's row starts at zero (logit 0, learnt
        from there), so the grown head drafts as before until trained. Not the target's row, as a new head's whole
        lm_head starts: beside trained rows those win argmaxes they should not (SmolLM2's EAGLE-3 head grown from
        8,192 to 12,288 tokens: held-out first-token accuracy 0.51 with target rows, 0.72 with zero rows, 0.73
        before growing; benchmarks/grow_vocab_start.py). d2t and t2d follow, in target-id order."""
        if self.full_vocab:
            raise ValueError("this head drafts over the full vocabulary: there is nothing to grow")
        current = self.to_target_ids(torch.arange(self.d2t.numel(), device=self.d2t.device))
        merged, order = _merged_vocab(current, token_ids, self.config.vocab_size)
        old = self.lm_head.weight
        self.lm_head = nn.Linear(old.shape[1], merged.numel(), bias=False, device=old.device, dtype=old.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.cat([old, old.new_zeros(merged.numel() - old.shape[0], old.shape[1])])[order])
        self._set_draft_ids(merged)
        self._binding = None  # the binding holds the old lm_head weight
        return self

    def borrow_target_lm_head(self, token_ids: torch.LongTensor | None) -> "Eagle3DraftModel":
        """Replaces the head's own lm_head by the bound target's lm_head rows of `token_ids` (N,) increasing target
        ids, or of the whole vocabulary with None, frozen (`requires_grad` False); d2t, t2d and
        `config.draft_vocab_size` follow. Training then fits the head's body (and `norm`) to the target's own
        output space, as an EAGLE-1/2 head's is, so the draft vocabulary costs no trained parameters and can be as
        large as the target's (SmolLM2's tied lm_head is its input embedding). Checkpoints still carry the rows as
        `lm_head.weight` (the official layout needs them)."""
        weight = self.binding.source_weight
        vocab = self.config.vocab_size
        ids = torch.arange(vocab) if token_ids is None else torch.as_tensor(token_ids, dtype=torch.long).flatten()
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        self._set_draft_ids(ids.to(device))  # checks the ids first
        self.lm_head = nn.Linear(weight.shape[1], ids.numel(), bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight.detach()[ids.to(weight.device)])
        self.lm_head.weight.requires_grad_(False)
        self._binding = None  # the binding holds the old lm_head weight
        return self

    def _set_draft_ids(self, ids: torch.LongTensor) -> None:
        """Makes `ids` (N,), increasing target ids, the draft vocabulary: d2t, t2d and `config.draft_vocab_size`
        (None when `ids` is the whole vocabulary). The lm_head is the caller's to match."""
        vocab = self.config.vocab_size
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ValueError("a draft vocabulary must be increasing target ids in [0, vocab_size)")
        self.d2t = ids - torch.arange(ids.numel(), device=ids.device)
        self.t2d = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
        self.t2d[ids] = True
        self.config.draft_vocab_size = None if ids.numel() == vocab else ids.numel()

    @property
    def full_vocab(self) -> bool:
        """Whether the draft vocabulary is the target's: then, as in the official code, d2t is not consulted."""
        return self.d2t.numel() == self.config.vocab_size

    def to_target_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        return draft_ids if self.full_vocab else draft_ids + self.d2t[draft_ids]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) head outputs -> (..., N) logits over the draft vocabulary (own norm and lm_head)."""
        return self.lm_head(self.norm(hidden))

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self.binding.embed_tokens(input_ids)

    # ------------------------------------------------------------------ target
    def bind(self, target: PreTrainedModel) -> "Eagle3DraftModel":
        """Borrows `target`'s input embeddings (unless the head has its own); moves the head to the device and
        dtype of the target's lm_head. The head's own lm_head scores the drafts."""
        head = target.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise ValueError(f"{type(target).__name__} has no output embeddings (lm_head)")
        weight = head.weight
        b = self._binding
        fast = is_optimized(head)  # optimize_for_cpu(target) reaches its lm_head too
        if b is not None and b.target_id == id(target) and b.source_weight is weight and fast == is_optimized(self):
            return self
        tc = target.config.get_text_config()
        if tc.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"This EAGLE-3 head reads target hidden states of width {self.target_hidden_size}, but "
                f"{type(target).__name__} has hidden size {tc.hidden_size}: this head was trained for another model."
            )
        if tc.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"EAGLE-3 head vocabulary size {self.config.vocab_size} differs from the target's {tc.vocab_size}: "
                "the head and target must share a tokenizer."
            )
        self.target_feature_ids(target)  # validates the layer ids against the target's depth
        if self.fc.weight.device != weight.device or self.fc.weight.dtype != weight.dtype:
            self.to(device=weight.device, dtype=weight.dtype)
        self._follow_target_kernels(head)  # all its linears, its own lm_head included
        self._binding = _TargetBinding(id(target), target.get_input_embeddings(), self.lm_head.weight, None, weight)
        return self

    def target_feature_ids(self, target: PreTrainedModel) -> tuple[int, ...]:
        """Entries of `target`'s `hidden_states` tuple concatenated into the feature: `config.feature_layer_ids`,
        or officially the inputs of decoder layers 2, L // 2 and L - 3 (entry i = input of layer i)."""
        num_layers = target.config.get_text_config().num_hidden_layers
        ids = self.config.feature_layer_ids
        if ids is None:
            ids = official_feature_ids(num_layers)
        ids = tuple(int(i) for i in ids)
        if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
            raise ValueError(
                f"EAGLE-3 reads three target hidden states, entries in [0, {num_layers}) of hidden_states; got {ids} "
                f"for a target of {num_layers} layers (the default 2, L // 2, L - 3 needs L >= 3)"
            )
        return ids

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """(B, T, 3 * H_target) concatenated target hidden states -> (B, T, H) through `fc`."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"EAGLE-3 target features must be {self.fc.in_features} wide (three hidden states), got "
                f"{features.shape[-1]}: was the target run with this head's target_feature_ids?"
            )
        return self.fc(features.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype))

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
        """One head step over T pairs (feature_t, token_{t+1}); features (B, T, H): `project_features` of the
        target's, or the head's own outputs. Returns the pre-norm outputs (B, T, H) and the cache (see
        `EagleDraftModel.forward`, also for cos_sin)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        embeds = inputs_embeds.to(features.dtype)
        if cos_sin is None:
            cos_sin = self.rotary(features, position_ids)
        return self.midlayer(embeds, features, cos_sin, attention_mask, past_key_value)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, target: PreTrainedModel, *, draft_vocab: torch.LongTensor | None = None,
                    seed: int | None = None, **overrides) -> "Eagle3DraftModel":  # fmt: skip
        """A randomly initialised EAGLE-3 head sized to `target` and bound to it (tests; training later).

        draft_vocab: optional (N,) increasing target ids of the draft vocabulary (sets d2t and t2d)."""
        base = EagleDraftModel.config_for_target(target).to_dict()
        for key in ("model_type", "architectures", "transformers_version", "rope_theta", "rope_scaling", "bias"):
            base.pop(key, None)
        if draft_vocab is not None:
            base["draft_vocab_size"] = int(draft_vocab.numel())
        base.update(overrides)
        config = Eagle3Config(**base)
        config.architectures = ["LlamaForCausalLMEagle3"]
        if seed is not None:
            torch.manual_seed(seed)
        model = cls(config)
        if draft_vocab is not None:
            model._set_draft_ids(draft_vocab)
        weight = target.get_output_embeddings().weight
        model.to(device=weight.device, dtype=weight.dtype)
        return model.bind(target).eval()

    # ------------------------------------------------------------------ loading and saving
    def _check_loaded(self, source: str) -> None:
        """d2t must map the draft vocabulary one to one onto the target ids t2d marks (unless it is the full one)."""
        if self.full_vocab:
            return
        n = self.d2t.numel()
        ids = torch.arange(n, device=self.d2t.device) + self.d2t
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"{source}: d2t maps draft tokens outside the target vocabulary [0, {self.config.vocab_size})")
        if ids.unique().numel() != n:
            raise ValueError(f"{source}: d2t maps two draft tokens to the same target token")
        if int(self.t2d.sum()) != n or not bool(self.t2d[ids].all()):
            raise ValueError(
                f"{source}: d2t and t2d disagree: t2d marks {int(self.t2d.sum())} target tokens, d2t maps the "
                f"{n} draft tokens to target ids of which {int((~self.t2d[ids]).sum())} are not marked"
            )

    def load_head_state_dict(self, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
        """As `EagleDraftModel`'s; a shipped `embed_tokens.weight` is dropped unless the head owns embeddings."""
        if self.embed_tokens is None:
            state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
        super().load_head_state_dict(state, source)

    def save_pretrained(self, save_directory: str | os.PathLike, layout: str = "official", **kwargs: Any) -> None:
        """Writes `config.json` and `model.safetensors` in the official layout (`LlamaForCausalLMEagle3`; "hf_eagle2"
        means the same for EAGLE-3 heads) or, with layout="speculators", in vLLM's speculators format
        (kwargs: `target=` names the verifier and its feature layers, `speculative_tokens=`; `head_formats.py`)."""
        if kwargs.pop("push_to_hub", False):
            raise NotImplementedError("push_to_hub is not wired for EAGLE-3 heads yet: save, then upload the folder")
        save_head(self, save_directory, "official" if layout == "hf_eagle2" else layout, **kwargs)
