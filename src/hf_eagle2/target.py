"""`TargetModel`: drives a Hugging Face causal LM through its public forward for tree verification.

The target is run as its base decoder (`model.get_decoder()`) so that we get the final hidden states (the
draft head's features) and apply the lm_head only to the rows that need logits. Tree passes use a 4D
*additive float* mask in the model's dtype plus explicit `position_ids`; models with mixed attention layers
(sliding window and full, e.g. Gemma3) get one mask per layer type, sized by the cache's own
`get_mask_sizes`, and sliding layers also get the window cut-off at each node's own position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from .tree import DraftTree

TREE_MASK_ATTENTION = ("sdpa", "eager")
_KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


class TargetModel:
    """A thin view of a causal LM: decoder forward, lm_head, embeddings and the attention layout."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.config = model.config.get_text_config()
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in TREE_MASK_ATTENTION:
            raise ValueError(
                f"Tree speculation verifies a tree with a 4D float attention mask, which attn_implementation="
                f"'{impl}' cannot take. Load the target with attn_implementation='sdpa' (or 'eager'), or call "
                f"model.set_attn_implementation('sdpa') before generate()."
            )
        self.decoder = model.get_decoder()
        if self.decoder is model:
            raise ValueError(f"{type(model).__name__} is not a causal LM with a separate decoder and lm_head")
        self.lm_head = model.get_output_embeddings()
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
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

    def forward(self, input_ids, position_ids, attention_mask, cache: Cache) -> torch.Tensor:
        """Decoder forward; returns final hidden states (B, T, H) (after the final norm)."""
        out = self.decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> float32 logits (..., V), with the model's final logit soft-capping if it has one."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.device)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

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


def greedy_tokens(logits: torch.Tensor) -> torch.LongTensor:
    return logits.argmax(dim=-1)


def log_softmax_float(x: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(x.float(), dim=-1)
