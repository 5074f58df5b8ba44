"""`EagleCandidateGenerator`: an EAGLE head as a chain `CandidateGenerator` for the stock assisted-decoding loop.

`generate(..., assistant_model=<EagleDraftModel>)` without `tree=` runs transformers' own assisted loop; this
class plugs the head into it. The loop passes the target's outputs in (`requires_model_outputs`), from which the
head takes the features of the newly accepted tokens; the drafting itself is `EagleDrafter`'s chain tree.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .drafter import EagleDrafter, TreeOptions
from .target import hidden_states_request, select_features


class EagleCandidateGenerator(CandidateGenerator):
    """Proposes a chain of up to `options.depth` head tokens per round (batch size 1, as the stock loop)."""

    requires_model_outputs = True  # the head reads the target's hidden states

    def __init__(self, draft: torch.nn.Module, target_model, options: TreeOptions, max_length: int | None = None):
        device = target_model.get_output_embeddings().weight.device
        self.drafter = EagleDrafter(draft, target_model, replace(options, tree="chain").resolved(device))
        self.options = self.drafter.options
        self.max_length = max_length
        self.feature_ids = draft.target_feature_ids(target_model)
        self.model_kwargs_overrides = {"output_hidden_states": hidden_states_request(self.feature_ids)}

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs: Any) -> tuple[torch.LongTensor, None]:
        """Called with `model_outputs`, `is_first_iteration`, `n_last_matches` by the stock loop; returns
        `(input_ids + drafted chain, None)` (no draft logits: the head's drafts are deterministic)."""
        if kwargs.get("is_first_iteration"):
            return input_ids, None  # let the target prefill first: the head needs its features
        if input_ids.shape[0] != 1:
            raise ValueError("the stock assisted-decoding loop supports batch size 1 only")
        if self.max_length is not None and input_ids.shape[1] >= self.max_length:
            # the stock loop cuts every round's tokens at generation_config.max_length, so a round asked for here
            # can never add a token: it would repeat forever (a MaxLengthCriteria of the caller's, which replaces
            # generate's own, kept the loop going past that length)
            raise ValueError(
                f"transformers' assisted-decoding loop cannot go past max_length={self.max_length}, but the stopping "
                "criteria did not stop it there (a MaxLengthCriteria longer than max_length?): set max_new_tokens / "
                "max_length instead, or pass tree='chain' (tree speculation honours the caller's criterion)"
            )
        drafter = self.drafter
        hidden = select_features(kwargs["model_outputs"].hidden_states, self.feature_ids)
        fresh = drafter.fed == 0 and not drafter.pending
        new = hidden if fresh else hidden[:, : kwargs.get("n_last_matches", 0) + 1]
        drafter.add_features(new.to(drafter.draft.fc.weight.device))
        budget = self.options.depth
        if self.max_length is not None:
            budget = min(budget, self.max_length - input_ids.shape[1] - 1)
        if budget < 1:
            drafter.discard_pending()
            return input_ids, None
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        tree = drafter.draft_tree(input_ids, positions, budget, options=replace(self.options, depth=budget))
        return torch.cat([input_ids, tree.tokens[:, 1:].to(input_ids.device)], dim=1), None

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one round drafts (transformers >= 5.25 asks it of every candidate generator: it sizes
        the past a recurrent cache layer records for rollback)."""
        return self.options.depth

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Nothing to do: the accepted tokens' features arrive with the next `get_candidates` call."""
