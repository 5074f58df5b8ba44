"""`TargetModel`: drives a Hugging Face causal LM through its public forward for tree verification.

Every pass is the causal LM's own forward (`model(...)`), so the logits are exactly what the model computes,
post-processing included (Cohere's `logit_scale`, Granite's `logits_scaling`, Gemma2's soft-cap in the model's
dtype, ...), and are cast to float32 as plain `generate` casts them. `output_hidden_states=-1` returns only the
final hidden state, after the final norm: the lm_head input at *every* position, which the draft head needs
for the whole prompt while the prefill computes logits for its last position only (`logits_to_keep=1`).

Tree passes use a 4D *additive float* mask in the model's dtype plus explicit `position_ids` (exact with sdpa
and eager; a bool mask would be silently wrong with eager); models with mixed attention layers (sliding window
and full, e.g. Gemma3) get one mask per layer type, sized by the cache's own `get_mask_sizes`, and sliding
layers also get the window cut-off at each node's own position.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.utils import logging

from . import constants
from .tree import DraftTree

logger = logging.get_logger(__name__)

TREE_MASK_ATTENTION = ("sdpa", "eager")
_KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


def causal_lm_forward(
    model: PreTrainedModel, input_ids, position_ids, attention_mask, cache: Cache | None, logits_to_keep: int = 0,
    feature_ids: tuple[int, ...] = (-1,), call=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the causal LM itself (through `call`, e.g. its `get_compiled_call`, when given).

    input_ids, position_ids: (B, T); attention_mask: 2D (B, S), 4D additive (B, 1, T, S) (or a dict of them per
    layer type) or None. Returns (features (B, T, H): the final hidden state at every position, logits (B, K, V)
    float32 for the last K = logits_to_keep positions, all T if 0).

    feature_ids: the entries of the `hidden_states` tuple the features concatenate, (B, T, len * H); the
    default (-1,) is the final hidden state (EAGLE-1/2), EAGLE-3 heads ask for three (`target_feature_ids`).
    transformers records only the selected entries (`output_hidden_states` takes indices), in this one forward.
    """
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                  use_cache=cache is not None, output_hidden_states=hidden_states_request(feature_ids))  # fmt: skip
    keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
    if keeps:
        inputs["logits_to_keep"] = logits_to_keep
    out = (call or model)(**inputs)
    if not out.hidden_states:
        raise NotImplementedError(f"{type(model).__name__} returns no hidden states: the draft head has no features")
    logits = out.logits if keeps or not logits_to_keep else out.logits[:, -logits_to_keep:]
    # as `generate` does: float32, on the device of the tokens
    return select_features(out.hidden_states, feature_ids), logits.to(dtype=torch.float32, device=input_ids.device)


def hidden_states_request(feature_ids: tuple[int, ...]) -> int | list[int]:
    """The `output_hidden_states` value that records just `feature_ids` (an int for one, as before)."""
    return feature_ids[0] if len(feature_ids) == 1 else list(feature_ids)


def select_features(hidden_states: tuple, feature_ids: tuple[int, ...]) -> torch.Tensor:
    """The `feature_ids` entries of a `hidden_states` tuple (unselected entries are None), concatenated."""
    parts = [hidden_states[i] for i in feature_ids]
    if any(p is None for p in parts):
        raise NotImplementedError(f"the target returned no hidden states at {list(feature_ids)}: no draft features")
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class TargetModel:
    """A thin view of a causal LM for tree verification: its forward, dtype/device and attention layout."""

    def __init__(self, model: PreTrainedModel, feature_ids: tuple[int, ...] = (-1,)):
        """feature_ids: the hidden states the forward returns as features (the draft head's `target_feature_ids`)."""
        self.model = model
        self.feature_ids = tuple(feature_ids)
        self.config = model.config.get_text_config()
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in TREE_MASK_ATTENTION:
            raise ValueError(
                f"Tree speculation verifies a tree with a 4D float attention mask, which attn_implementation="
                f"'{impl}' cannot take. Load the target with attn_implementation='sdpa' (or 'eager'), or call "
                f"model.set_attn_implementation('sdpa') before generate()."
            )
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None or getattr(self.lm_head, "weight", None) is None:
            raise ValueError(f"{type(model).__name__} is not a causal LM with an lm_head (output embeddings)")
        self._features_checked = False
        layer_types = getattr(self.config, "layer_types", None) or ["full_attention"] * self.config.num_hidden_layers
        unknown = sorted(set(layer_types) - set(_KNOWN_LAYER_TYPES))
        if unknown:
            raise NotImplementedError(f"tree verification does not support attention layer types {unknown}")
        self.layer_types = list(layer_types)
        # representative layer index per type (masks are built per type)
        self.type_layer = {t: self.layer_types.index(t) for t in dict.fromkeys(self.layer_types)}
        uses_window = getattr(self.config, "sliding_window", None) is not None and (
            "sliding_attention" in self.type_layer or not hasattr(self.config, "layer_types")
        )
        self.sliding_window = int(self.config.sliding_window) if uses_window else None
        self.max_positions = getattr(self.config, "max_position_embeddings", None)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(
        self, input_ids, position_ids, attention_mask, cache: Cache, logits_to_keep: int = 0, call=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`causal_lm_forward` on the target: (features (B, T, H), float32 logits (B, K, V)); `call`: the model's
        compiled call, if any (`verify_compiled`).

        The first call also checks that the features are the lm_head input (a hook sees what the lm_head reads).
        A model that transforms the hidden state after its final norm still gets exact logits, but its draft head
        features are not what EAGLE assumes, so drafts may be accepted less often: that is logged, not refused.
        """
        if self._features_checked or self.feature_ids != (-1,):  # the check is about the final hidden state
            return causal_lm_forward(
                self.model, input_ids, position_ids, attention_mask, cache, logits_to_keep, self.feature_ids, call
            )
        seen = []
        handle = self.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        try:
            features, logits = causal_lm_forward(
                self.model, input_ids, position_ids, attention_mask, cache, logits_to_keep
            )
        finally:
            handle.remove()
        self._features_checked = True
        if seen and not torch.equal(seen[-1][:, -1].to(features.device), features[:, -1]):
            logger.warning_once(
                f"{type(self.model).__name__}: the final hidden state is not the lm_head input (the model transforms "
                "it after the final norm). Verification stays exact, but the draft head's features differ from "
                "what its lm_head reads, so fewer drafts may be accepted."
            )
        return features, logits

    def tree_attention_mask(
        self, cache: Cache, tree: DraftTree, positions: torch.LongTensor, slot_pos: torch.LongTensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive masks for verifying `tree` on top of `cache`.

        positions: (B, q) logical position of each tree node; slot_pos: (B, C) logical position of each of the C
        cached tokens (-1 for padding). A node sees the cached tokens (within the sliding window at its own
        position, for sliding layers) and its ancestors-or-self in the tree. Returns one (B, 1, q, kv) mask, or a
        dict per layer type for models with mixed layer types.
        """
        masks = {}
        for layer_type, layer_idx in self.type_layer.items():
            window = self.sliding_window if layer_type == "sliding_attention" or len(self.type_layer) == 1 else None
            layer_pos = slot_pos
            if window is not None and getattr(cache.layers[layer_idx], "is_sliding", False):
                # batched pruning keeps each row's real tokens contiguous in sliding layers (see cache.py):
                # cache index c holds logical position root - (past - c), if that is a real position
                past = slot_pos.shape[1]
                root = positions[:, :1]
                layer_pos = root - past + torch.arange(past, device=root.device).view(1, past)
                layer_pos = layer_pos.clamp(min=-1)  # every row's first real token has position 0
            masks[layer_type] = self._mask_for_layer(cache, layer_idx, tree, positions, layer_pos, window)
        if len(masks) == 1:
            return next(iter(masks.values()))
        return masks

    def _mask_for_layer(self, cache, layer_idx, tree, positions, slot_pos, window) -> torch.Tensor:
        bsz, q = tree.tokens.shape
        past = slot_pos.shape[1]
        kv_length, kv_offset = cache.get_mask_sizes(q, layer_idx)
        kv_length, kv_offset = int(kv_length), int(kv_offset)
        device = tree.tokens.device
        if window is None and kv_offset == 0 and kv_length >= past + q:  # keys = the cache, the tree (, free slots)
            parts = [(slot_pos >= 0).unsqueeze(1).expand(bsz, q, past), tree.ancestors]
            if kv_length > past + q:  # a static cache's unwritten slots
                parts.append(constants.scalar(False, torch.bool, device).expand(bsz, q, kv_length - past - q))
            return torch.where(torch.cat(parts, dim=-1).unsqueeze(1), *_mask_values(self.dtype, device))
        cache_index = kv_offset + torch.arange(kv_length, device=device)  # (kv,)
        # cached part
        in_past = cache_index < past
        pos = slot_pos[:, cache_index.clamp(max=past - 1)] if past else torch.full((bsz, kv_length), -1, device=device)
        allowed = (in_past & (pos >= 0)).unsqueeze(1).expand(bsz, q, kv_length)
        if window is not None:
            allowed = allowed & (pos.unsqueeze(1) > positions.unsqueeze(-1) - window)
        # tree part: cache index past + j is tree node j
        node = cache_index - past
        in_tree = (node >= 0) & (node < q)
        tree_allowed = tree.ancestors.gather(2, node.clamp(0, q - 1).view(1, 1, -1).expand(bsz, q, kv_length))
        allowed = allowed | (in_tree.view(1, 1, -1) & tree_allowed)
        mask = torch.zeros(bsz, 1, q, kv_length, dtype=self.dtype, device=device)
        return mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(self.dtype).min)



@functools.lru_cache(maxsize=16)
def _mask_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0 and the dtype's minimum as 0-dim tensors: `torch.where` with them makes an additive mask in one kernel."""
    return torch.zeros((), dtype=dtype, device=device), torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
