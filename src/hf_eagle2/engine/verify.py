"""Tree verification: per-node logits processing, the target's choice at every node, and acceptance.

Given the target's logits at every tree node (one forward over the whole tree), each node gets the target's
*choice*: the argmax of its processed logits (greedy) or one token sampled from its processed distribution
(sampling). Node i is *correct* when its token is the choice at its parent, and *valid* when it and all its
ancestors are correct. The accepted path is the deepest valid node's path (siblings carry distinct tokens, so
at most one valid node per depth), and the bonus token is the choice at that node.

Why this is exact:

* Greedy: every accepted token, and the bonus, is the target's argmax given its own prefix, which is what plain
  greedy decoding emits one step at a time.
* Sampling (`sample_choices`): this is multi-draft speculative sampling with deterministic drafts (the top-k
  children are proposals with point-mass draft distributions q = 1). Recursive rejection over the children
  c_1..c_r of an accepted node u accepts c_1 with probability p(c_1) and otherwise renormalises p without c_1
  and moves on; after r rejections it samples from p without {c_1..c_r}. Its outcome has exactly the law of
  one draw x ~ p(. | prefix of u), continuing into the child whose token is x if there is one, and emitting x
  as the bonus token otherwise: P(c_i) = prod_{j<i}(1 - p(c_j)/(1 - sum_{l<j} p(c_l))) * p(c_i)/(1 - sum_{l<i} p(c_l))
  = p(c_i), and every other token x keeps p(x). So each emitted token is drawn from the target's (warped)
  distribution given exactly its own prefix: by the chain rule the sequence has the law of plain sampling.
  Drawing the x of every node up front, independently, changes nothing: the draw at u is only *used* when u
  is reached, and reaching u depends only on draws at u's ancestors. This is also the best any lossless
  verifier can do with deterministic drafts: child c is accepted with probability p(c), the most possible.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EncoderRepetitionPenaltyLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from . import constants
from .tree import DraftTree


@dataclass
class Acceptance:
    """path: (B, D + 1) accepted nodes, root first, padded with the last accepted node; num_accepted: (B,)
    accepted draft nodes; next_token: (B,) bonus token; correct, valid: (B, n) per node (see module doc)."""

    path: torch.LongTensor
    num_accepted: torch.LongTensor
    next_token: torch.LongTensor
    correct: torch.BoolTensor
    valid: torch.BoolTensor


def path_tokens(tree: DraftTree) -> torch.LongTensor:
    """(B, n, D + 1): tokens from the root to each node by depth (entry d = ancestor at depth d; 0 past the node)."""
    bsz, n = tree.tokens.shape
    width = tree.max_depth + 1
    out = torch.zeros(bsz, n, width, dtype=torch.long, device=tree.tokens.device)
    src = torch.where(tree.ancestors, tree.tokens.unsqueeze(1), 0)
    return out.scatter_add_(2, tree.depths.unsqueeze(1).expand(bsz, n, n), src)


def process_node_logits(
    logits: torch.Tensor,
    tree: DraftTree,
    sequences: list[torch.LongTensor],
    logits_processor: LogitsProcessorList | None,
) -> torch.Tensor:
    """Applies `logits_processor` to each node's logits (B, n, V) with that node's own prefix.

    sequences[b]: (L_b,) row b's tokens so far, ending with the root. A depth-d node's prefix is that sequence
    followed by the d tokens of its path, so processors see exactly what plain decoding would show them.
    Nodes of equal depth are processed as one batch.
    """
    if not logits_processor:
        return logits
    out = logits.clone()
    prefix = path_tokens(tree)[:, :, 1:]
    for b, seq in enumerate(sequences):
        row_processor = _for_batch_row(logits_processor, b, len(sequences))
        for d in range(tree.max_depth + 1):
            rows = (tree.depths[b] == d).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            ids = torch.cat([seq.unsqueeze(0).expand(rows.numel(), -1), prefix[b, rows, :d]], dim=1)
            out[b, rows] = row_processor(ids, logits[b, rows])
    return out


def _for_batch_row(logits_processor: LogitsProcessorList, row: int, num_rows: int) -> LogitsProcessorList:
    """`logits_processor` for the nodes of batch row `row` (of `num_rows`).

    A tree pass hands a processor one row's nodes, where plain decoding hands it one node of every row, so the
    processors that hold per-prompt state index the wrong prompt (or fail on the shape) unless they are narrowed
    to the row. `generate` builds them before it repeats each prompt for num_return_sequences, so row r belongs to
    prompt r // copies (copies = num_rows / prompts):
    - `prefix_allowed_tokens_fn(batch_id, ids)`: its processor would number one call's nodes as rows; rebuilt with
      the row's batch id for every node. The tree also shows the function drafted prefixes plain decoding never
      reaches, so an empty answer is reported as such.
    - `repetition_penalty` with a padded batch: the per-prompt padding lengths it skips (`prompt_ignore_length`).
    - `encoder_repetition_penalty`: the per-prompt ids it favours (`encoder_input_ids`).
    """
    out = LogitsProcessorList()
    for p in logits_processor:
        if isinstance(p, PrefixConstrainedLogitsProcessor):
            fn, copies = getattr(p, "_prefix_allowed_tokens_fn", None), getattr(p, "_num_beams", None)
            if fn is None or copies is None:
                raise NotImplementedError(
                    "this transformers version's prefix_allowed_tokens_fn cannot be run per tree node"
                )
            p = PrefixConstrainedLogitsProcessor(functools.partial(_allowed_for_row, fn, row // copies), num_beams=1)
        elif isinstance(p, RepetitionPenaltyLogitsProcessor) and isinstance(p.prompt_ignore_length, torch.Tensor):
            p = copy.copy(p)  # as an int: it cuts the row's padding from every node's ids alike
            p.prompt_ignore_length = int(_prompt_entry(p.prompt_ignore_length, row, num_rows)[0])
        elif isinstance(p, EncoderRepetitionPenaltyLogitsProcessor):
            p = copy.copy(p)
            p.encoder_input_ids = _prompt_entry(p.encoder_input_ids, row, num_rows)
        out.append(p)
    return out


def _prompt_entry(per_prompt: torch.Tensor, row: int, num_rows: int) -> torch.Tensor:
    """per_prompt[(P, ...)]'s entry for batch row `row` of `num_rows` = P x copies, kept as a batch of one."""
    if num_rows % per_prompt.shape[0]:
        raise NotImplementedError(f"a logits processor holds {per_prompt.shape[0]} prompts for {num_rows} batch rows")
    prompt = row // (num_rows // per_prompt.shape[0])
    return per_prompt[prompt : prompt + 1]


def _allowed_for_row(fn, batch_id: int, _node: int, ids: torch.LongTensor) -> list[int]:
    allowed = fn(batch_id, ids)
    if len(allowed) == 0:
        raise ValueError(
            f"prefix_allowed_tokens_fn returned no allowed token for batch ID {batch_id}. Tree verification calls it "
            "on every drafted prefix too, including prefixes plain decoding would never reach, so it must allow at "
            "least one token for any prefix."
        )
    return allowed


def sample_choices(scores: torch.Tensor) -> torch.LongTensor:
    """(B, n, V) processed scores -> (B, n) one independent draw per node from softmax(scores)."""
    probs = torch.softmax(scores.float(), dim=-1)
    bsz, n, vocab = probs.shape
    return torch.multinomial(probs.reshape(bsz * n, vocab), num_samples=1).view(bsz, n)


def accept(tree: DraftTree, choice: torch.LongTensor) -> Acceptance:
    """choice: (B, n) the target's token at each node (argmax, or a draw from `sample_choices`)."""
    bsz, n = tree.tokens.shape
    parent_choice = choice.gather(1, tree.parents.clamp(min=0))
    correct = tree.tokens == parent_choice
    correct[:, 0] = True
    valid = ~(tree.ancestors & ~correct.unsqueeze(1)).any(-1)
    best = torch.where(valid, tree.depths, -1).argmax(dim=1)  # deepest valid node (B,)
    num_accepted = tree.depths.gather(1, best.unsqueeze(1)).squeeze(1)
    path = accepted_path(tree, best)
    return Acceptance(path, num_accepted, choice.gather(1, best.unsqueeze(1)).squeeze(1), correct, valid)


def accepted_path(tree: DraftTree, best: torch.LongTensor) -> torch.LongTensor:
    """(B, D + 1) the ancestors-or-self of node `best` (B,) in depth order (nodes are depth-major, so in index
    order), padded with `best`."""
    bsz, n = tree.tokens.shape
    on_path = tree.ancestors.gather(1, best.view(bsz, 1, 1).expand(bsz, 1, n)).squeeze(1)  # (B, n)
    idx = torch.where(on_path, constants.arange(n, best.device), n)
    idx = idx.sort(dim=1).values[:, : tree.max_depth + 1]
    return torch.where(idx < n, idx, best.unsqueeze(1))
