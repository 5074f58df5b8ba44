"""The speculative decoding loop, run by `generate(..., assistant_model=head, tree=...)` as a `custom_generate`.

    prefill            target(prompt) -> features, first token
    loop:  draft       head: feed new (feature, token) pairs, expand a tree below the last token (the root)
           verify      target(root + tree) in one forward: 4D tree mask, positions = root position + depth
           accept      longest agreeing path + bonus token; stops (EOS, max length, stop strings) cut inside it
           prune       target cache keeps root + path, head gets their features

`transformers.generate` prepares everything before the loop (generation config, logits processors, stopping
criteria, cache), exactly as for plain decoding.

Batches: every row has its own tree and accepted length. Each round appends (max accepted + 1) cache slots to
every row; a row that accepted fewer gets *holes* at the front of its block, masked out everywhere, so its
accepted run stays right before its new root. With one row there are never holes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import check_cache_supported, prune_tree_cache
from ..kernels.reserved_cache import stack_empty_cache, stack_static_cache
from .drafter import EagleDrafter, TreeOptions
from .stats import EagleStats, Timer
from .stopping import BlockStopper
from .target import TargetModel
from .verify import accept, process_node_logits, sample_choices
from .verify_compiled import CompiledVerify, compiles_verify


HOLES_MESSAGE = (
    "this cache comes from a batched tree-speculative generate call: rows accepted different numbers of tokens per "
    "round, so their cache rows hold masked-out holes that a later call cannot see. Reusing it would attend to "
    "them; reuse caches from batch-size-1 calls only (or re-run the prompt without a cache)"
)


@dataclass
class EagleGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `eagle_stats`."""

    eagle_stats: EagleStats | None = None


def eagle_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    *,
    draft: torch.nn.Module,
    options: TreeOptions,
    streamer=None,
    **model_kwargs,
):
    """Tree-speculative decoding (greedy or sampling); the `custom_generate` body behind `generate(..., tree=...)`."""
    _check_supported(model, input_ids, generation_config, model_kwargs, logits_processor, synced_gpus)
    target = TargetModel(model, feature_ids=draft.target_feature_ids(model))  # the head's features, same forward
    cache = model_kwargs.get("cache")
    if cache is None:
        cache = DynamicCache(config=model.config)
    stack_empty_cache(cache)  # an empty dynamic cache keeps every layer in one tensor: pruning is one gather
    check_cache_supported(cache)
    if getattr(cache, "_hf_eagle2_holes", False):
        raise ValueError(HOLES_MESSAGE)
    cached = cache.get_seq_length()  # > 0: a cache from an earlier turn, reused (multi-turn chat)
    cache.activate_past_recording()
    # a StaticCache has a fixed length: trees must fit in what is left of it
    full_layer = target.type_layer.get("full_attention", 0)
    static_capacity = cache.get_max_length(full_layer) if isinstance(cache, StaticCache) else None
    bsz, prompt_len = input_ids.shape
    device = input_ids.device
    stopper = BlockStopper(stopping_criteria, bsz)
    # a MaxLengthCriteria passed by the caller replaces generate's own (transformers merges them so): the length
    # plain decoding stops at is the criteria's, which may exceed generation_config.max_length
    max_length = stopper.max_length if stopper.max_length is not None else generation_config.max_length
    if target.max_positions is not None and prompt_len > target.max_positions:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, more than the model's max_position_embeddings={target.max_positions}"
        )
    if bsz > 1 and streamer is not None:
        raise ValueError("streamers support batch size 1 only")
    if bsz > 1 and static_capacity is not None:
        raise NotImplementedError(
            "tree speculation with a StaticCache supports batch size 1: batched rounds leave holes in the cache "
            "(rows accept different lengths), which would use up the preallocated room; use the default cache"
        )
    compiled_verify = None  # tree_compile over a static cache: the verify pass is one compiled call too
    if options.compile and compiles_verify(cache):
        compiled_verify = CompiledVerify(target, cache, generation_config.compile_config)
    elif generation_config.compile_config is not None:
        raise ValueError(
            "tree speculation compiles the target's forward only with tree_compile=True over a full-attention static "
            "cache (cache_implementation='static'), as transformers compiles decoding only over a static cache; "
            "otherwise the tree's passes change shape every round. Pass both, or drop compile_config"
        )
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if cached:
        if bsz > 1 or not bool(attention_mask.all()):
            raise NotImplementedError("reusing a cache from an earlier turn is supported for batch size 1 without padding")
        if cached >= prompt_len:
            raise ValueError(
                f"the cache passed in already holds {cached} tokens but input_ids has {prompt_len}: pass the whole "
                "conversation so far (the previous output plus the new turn) as input_ids"
            )
    valid_prompt = attention_mask.bool()
    prompt_pos = (attention_mask.long().cumsum(-1) - 1).masked_fill(~valid_prompt, 1)
    pad_id = generation_config._pad_token_tensor
    pad_id = int(pad_id) if pad_id is not None else 0

    do_sample = bool(generation_config.do_sample)
    stats = EagleStats(tree=options.tree, batch_size=bsz)
    stats.new_tokens_per_row = [0] * bsz
    stats.target_forwards_per_row = [0] * bsz
    timer = Timer(stats, device, sync=options.profile)
    calib = _CalibrationLog() if options.record_calibration else None
    want_scores = generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    )
    if want_scores and bsz > 1:
        raise NotImplementedError("output_scores/output_logits with tree speculation support batch size 1 only")
    scores_out, logits_out = [], []
    if streamer is not None:
        streamer.put(input_ids.cpu())

    # ---- prefill: plain forward over the prompt (only its uncached suffix when a cache is reused)
    with timer("prefill_s"):
        prefill_mask = attention_mask if not valid_prompt.all() else None
        hidden, raw = target.forward(input_ids[:, cached:], prompt_pos[:, cached:], prefill_mask, cache, logits_to_keep=1)
        raw = raw[:, -1]
        processed = logits_processor(input_ids, raw) if logits_processor else raw
        first = sample_choices(processed.unsqueeze(1))[:, 0] if do_sample else processed.argmax(-1)
    if want_scores:
        scores_out.append(processed[0])
        logits_out.append(raw[0])
    if static_capacity is not None:
        stack_static_cache(cache)  # full-attention static layers in one tensor: pruning is one gather
    budget = None
    per_round_budget = options.per_round_budget  # read before resolving: it asks whether a size is "auto"
    options = options.resolved(device)
    if per_round_budget:
        from .budget import round_budget

        budget = round_budget(model, draft.bind(model), options.top_k)
    # the head's context starts where this call's prefill does: the reused part has no features here, and the
    # head only proposes, so a shorter head context costs acceptance, never exactness
    drafter = EagleDrafter(draft, model, options, timer=timer, budget=budget, context_start=cached)
    drafter.add_features(hidden, valid_prompt[:, cached:])

    sequences = torch.full((bsz, max_length), pad_id, dtype=torch.long, device=device)
    sequences[:, :prompt_len] = input_ids
    seq_len = [prompt_len] * bsz
    unfinished = [True] * bsz
    # stopping criteria get what _sample hands them: every processed step's scores so far when they are returned
    # (return_dict_in_generate and output_scores; batch size 1 here), else None
    criteria_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    first_scores = _scores_so_far(scores_out) if criteria_scores else None  # scores_out holds the prefill's step
    stats.prefill_tokens_per_row = _emit(first.view(bsz, 1), first.view(bsz, 1).tolist(), sequences, seq_len,
                                         unfinished, stopper, streamer, stats, first_scores, pad_id)  # fmt: skip
    # slot state: one entry per target cache slot, plus the root (last token, not yet in the cache)
    slot_tokens = torch.cat([input_ids, first.view(bsz, 1)], dim=1)
    root_pos = valid_prompt.sum(-1)  # (B,) logical position of the root
    slot_pos = torch.cat([torch.where(valid_prompt, prompt_pos, -1), root_pos.view(bsz, 1)], dim=1)

    while any(unfinished):
        remaining = max(max_length - seq_len[b] for b in range(bsz) if unfinished[b])
        max_depth = max(0, min(64, remaining - 1))  # the drafter also caps it at the tree's own depth
        cached_now = slot_pos.shape[1] - 1  # entries in the target cache (the root is not cached yet)
        max_nodes = None if static_capacity is None else static_capacity - cached_now
        with timer("draft_s"):
            lookup_rows = [sequences[b, : seq_len[b]] for b in range(bsz)] if drafter.ngram is not None else None
            tree = drafter.draft_tree(slot_tokens, slot_pos.clamp(min=0), max_depth, max_nodes, rows=lookup_rows)
        num_nodes = num_written = tree.num_nodes
        verified = None
        if compiled_verify is not None:
            with timer("verify_s"):  # its mask included
                verified = compiled_verify(tree, root_pos, slot_pos[:, :-1], cached_now)
        if verified is not None:
            hidden, raw, num_written = verified  # the tree padded to num_written entries
        else:
            with timer("bookkeeping_s"):
                positions = root_pos.view(bsz, 1) + tree.depths
                mask = target.tree_attention_mask(cache, tree, positions, slot_pos[:, :-1])
            with timer("verify_s"):
                hidden, raw = target.forward(tree.tokens, positions, mask, cache)
        with timer("bookkeeping_s"):
            rows = [sequences[b, : seq_len[b]] for b in range(bsz)]
            processed = process_node_logits(raw, tree, rows, logits_processor)
            acc = accept(tree, sample_choices(processed) if do_sample else processed.argmax(-1))
            if calib is not None:
                calib.add(tree, acc)
            drafter.record_acceptance(tree, acc.valid, acc.correct)
            new_tokens = torch.cat([tree.tokens.gather(1, acc.path[:, 1:]), acc.next_token.view(bsz, 1)], dim=1)
            # new_tokens[b, :counts[b]] are the accepted draft tokens, new_tokens[b, counts[b]] is the bonus
            new_tokens.scatter_(1, acc.num_accepted.view(bsz, 1), acc.next_token.view(bsz, 1))
            # the round's one host sync: accepted counts, the block's tokens and the accepted path
            host = torch.cat([acc.num_accepted.view(bsz, 1), new_tokens, acc.path], dim=1).tolist()
            depth = new_tokens.shape[1]
            counts = [h[0] for h in host]
            paths = [h[1 + depth :] for h in host]
            active = [b for b in range(bsz) if unfinished[b]]
            for b in active:
                stats.record_accept(counts[b])
                stats.target_forwards_per_row[b] += 1
            stats.target_forwards += 1
            stats.tree_nodes += num_nodes - 1
            blocks = [h[1 : 2 + counts[b]] for b, h in enumerate(host)]
            block_scores = (_scores_so_far(scores_out, lambda i: processed[0, paths[0][i]].unsqueeze(0))
                            if criteria_scores else None)  # fmt: skip
            emitted = _emit(new_tokens, blocks, sequences, seq_len, unfinished, stopper, streamer, stats, block_scores,
                            pad_id, active)  # fmt: skip
            if want_scores:
                take = emitted[0]
                scores_out.extend(processed[0, acc.path[0, :take]].unbind(0))
                logits_out.extend(raw[0, acc.path[0, :take]].unbind(0))
            # prune: each row keeps root + the accepted nodes it emitted (all but a stop-cut tail), right-aligned
            # in a block of (max kept + 1) slots; the last emitted token is the next root, not cached yet
            kept_host = [min(counts[b], emitted[b] - 1) if emitted[b] else 0 for b in range(bsz)]
            width = max(kept_host) + 1
            holes_host = [width - 1 - k for k in kept_host]
            keep_host = [[paths[b][max(0, i - holes_host[b])] for i in range(width)] for b in range(bsz)]
            kept = torch.tensor(kept_host, device=device)
            src = torch.arange(width, device=device).view(1, width) - (width - 1 - kept).view(bsz, 1)
            keep = torch.tensor(keep_host, device=device)
            in_block = src >= 0
            prune_tree_cache(cache, keep, num_written, holes=width - 1 - kept,
                             identity=all(row == list(range(width)) for row in keep_host),
                             compact=any(holes_host), tree_start=cached_now)  # fmt: skip
            if any(holes_host):
                cache._hf_eagle2_holes = True  # see HOLES_MESSAGE
            # (a static cache's length is a device tensor: checked by the tests, not read every round)
            if static_capacity is None and cache.get_seq_length() != cached_now + width:
                raise RuntimeError("tree cache pruning left the cache out of sync with the accepted sequence")
            if not any(unfinished):
                break
            drafter.add_features(hidden.gather(1, _expand(keep, hidden)), in_block)
            block_pos = torch.where(in_block, root_pos.view(bsz, 1) + src, -1)
            root_pos = root_pos + kept + 1
            next_root = new_tokens.gather(1, kept.view(bsz, 1))
            slot_tokens = torch.cat([slot_tokens[:, :-1], tree.tokens.gather(1, keep), next_root], 1)
            slot_pos = torch.cat([slot_pos[:, :-1], block_pos, root_pos.view(bsz, 1)], 1)

    if streamer is not None:
        streamer.end()
    # the cache outlives the call (returned, or the caller's own): as generate does for caches it hands back, stop
    # recording past states, or sliding-window layers would keep growing in later plain calls on it
    for layer in cache.layers:
        if hasattr(layer, "record_past"):
            layer.record_past = False
    stats.total_s = stats.prefill_s + stats.round_s
    stats.verify_compiled = 0 if compiled_verify is None else compiled_verify.calls
    if calib is not None:
        stats.calibration = calib.as_dict()
    out_len = max(seq_len)
    output = sequences[:, :out_len]
    draft.last_stats = stats
    if not generation_config.return_dict_in_generate:
        return output
    return EagleGenerateOutput(
        sequences=output,
        scores=tuple(s.unsqueeze(0) for s in scores_out) if generation_config.output_scores else None,
        logits=tuple(s.unsqueeze(0) for s in logits_out) if generation_config.output_logits else None,
        cache=cache,
        eagle_stats=stats,
    )


def _scores_so_far(done: list[torch.Tensor], step: Callable[[int], torch.Tensor] | None = None) -> Callable:
    """`scores(j)` for BlockStopper: the steps in `done` ((V,) each), then a round's steps 0..j (`step(i)`: (1, V)),
    as the tuple of (1, V) tensors that `_sample` passes stopping criteria after that token."""
    return lambda j: tuple(s.unsqueeze(0) for s in done) + (tuple(step(i) for i in range(j + 1)) if step else ())


def _expand(index: torch.LongTensor, like: torch.Tensor) -> torch.LongTensor:
    return index.unsqueeze(-1).expand(*index.shape, like.shape[-1])


def _emit(new_tokens, blocks, sequences, seq_len, unfinished, stopper, streamer, stats, scores, pad_id, rows=None):
    """Appends each unfinished row's block (host ids; new_tokens[b, :len(blocks[b])] on the device) to its
    sequence, cut where plain decoding would have stopped (see stopping.py). Returns the tokens taken per row."""
    taken = [0] * len(seq_len)
    for b in rows if rows is not None else range(len(seq_len)):
        if not unfinished[b]:
            continue
        start = seq_len[b]
        block = blocks[b][: sequences.shape[1] - start]  # never past max_length (the stopper cuts there too)
        sequences[b, start : start + len(block)] = new_tokens[b, : len(block)]
        take, stop = stopper.take(sequences[b], start, block, scores)
        if take < len(block):
            sequences[b, start + take : start + len(block)] = pad_id  # rows shorter than the output end in padding
        if stop:
            unfinished[b] = False
        seq_len[b] = start + take
        taken[b] = take
        stats.new_tokens += take
        stats.new_tokens_per_row[b] += take
        if streamer is not None:
            streamer.put(new_tokens[b, :take].cpu())
    return taken


class _CalibrationLog:
    """Per drafted node: local draft log-confidence, path log V_i, and whether the target accepted it.

    `local_accept` counts only nodes whose parent was on an accepted path (the node's own acceptance given a
    correct prefix); `path_accept` is whether the whole path to the node was accepted."""

    def __init__(self):
        self.local_logp, self.parent_valid, self.correct, self.path_logv, self.valid, self.depth = [], [], [], [], [], []
        self.round = []

    def add(self, tree, acc):
        parent_valid = acc.valid.gather(1, tree.parents.clamp(min=0))
        sl = (slice(None), slice(1, None))
        self.round.append(torch.full((tree.tokens[sl].numel(),), len(self.round), dtype=torch.long))
        self.local_logp.append(tree.local_logp[sl].flatten().cpu())
        self.parent_valid.append(parent_valid[sl].flatten().cpu())
        self.correct.append(acc.correct[sl].flatten().cpu())
        self.path_logv.append(tree.scores[sl].flatten().cpu())
        self.valid.append(acc.valid[sl].flatten().cpu())
        self.depth.append(tree.depths[sl].flatten().cpu())

    def as_dict(self) -> dict:
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)  # noqa: E731
        return {
            "local_logp": cat(self.local_logp),
            "parent_valid": cat(self.parent_valid),
            "correct": cat(self.correct),
            "path_logv": cat(self.path_logv),
            "valid": cat(self.valid),
            "depth": cat(self.depth),
            "round": cat(self.round),
        }


# options that pick another drafter; the EAGLE head is the drafter (also refused in the stock assisted loop)
OTHER_DRAFTERS = (
    ("prompt_lookup_num_tokens", lambda g: g.prompt_lookup_num_tokens is not None,
     "prompt lookup is another drafter; the EAGLE head is the drafter"),
    ("assistant_early_exit", lambda g: getattr(g, "assistant_early_exit", None) is not None,
     "early-exit self-speculation is another drafter; the EAGLE head is the drafter"),
    ("use_mtp", lambda g: bool(getattr(g, "use_mtp", None)),
     "multi-token-prediction drafting is another drafter; the EAGLE head is the drafter"),
    ("speculation_type", lambda g: getattr(g, "speculation_type", None) is not None,
     "another speculation method; the EAGLE head is the drafter"),
    ("assistant_ensemble_weight", lambda g: getattr(g, "assistant_ensemble_weight", None) is not None,
     "it mixes the draft's distribution into the output, and EAGLE verification keeps the target's alone"),
)  # fmt: skip
# generate() options the tree loop cannot honour, refused by name before any forward: (option, is it set?, why)
REFUSED_OPTIONS = (
    ("penalty_alpha (contrastive search)",
     lambda g: (g.penalty_alpha or 0) > 0 and (g.top_k or 0) > 1 and g.do_sample is not True,
     "contrastive search re-ranks the top-k candidates by a degeneration penalty on hidden states; a tree pass "
     "verifies the model's own greedy or sampled choice"),
    ("dola_layers", lambda g: g.dola_layers is not None,
     "DoLa contrasts the final logits with early layers' logits, which the tree pass does not compute"),
    ("constraints", lambda g: g.constraints is not None, "constrained beam search is a beam search"),
    ("force_words_ids", lambda g: g.force_words_ids is not None, "constrained beam search is a beam search"),
    *OTHER_DRAFTERS,
    ("guidance_scale", lambda g: g.guidance_scale is not None and g.guidance_scale != 1,
     "classifier-free guidance runs its own unconditional forward, one token per call, with its own cache"),
    ("prefill_chunk_size", lambda g: getattr(g, "prefill_chunk_size", None) is not None,
     "the prompt is prefilled in one forward (chunked prefill is not implemented)"),
)  # fmt: skip
# stock logits processors that keep state across calls (they assume one call per generated token, on the same
# batch rows), while the tree loop calls the processors once per tree depth with one row per node
STATEFUL_PROCESSORS = {
    "SynthIDTextWatermarkLogitsProcessor": "it keeps each row's n-gram context across calls (SynthID watermarking)",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "it runs its own forward with its own cache (guidance_scale)",
    "ClassifierFreeGuidanceLogitsProcessor": "it expects the batch doubled into conditional and unconditional halves",
    "WhisperNoSpeechDetection": "it runs its own forward and keeps state across calls",
    "DiaEOSDelayPatternLogitsProcessor": "it keeps per-row state across calls",
}
# model inputs the tree loop passes on (it builds position ids and masks itself); any other is refused
PASSED_MODEL_INPUTS = ("attention_mask", "cache", "use_cache", "logits_to_keep", "position_ids")
# RoPE types whose frequencies depend on the largest position in the pass: a tree pass reaches deeper positions
# than each node's own sequence, so its nodes would be rotated with other frequencies than plain decoding uses
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def _check_supported(model, input_ids, generation_config, model_kwargs, logits_processor, synced_gpus) -> None:
    """Raises for anything the tree loop would not reproduce exactly: see the tables above."""
    if model.config.is_encoder_decoder:
        raise NotImplementedError("tree speculation supports decoder-only models")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("tree speculation cannot be combined with beam search (num_beams > 1)")
    if input_ids.shape[1] == 0:
        raise ValueError("tree speculation needs a non-empty prompt")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise NotImplementedError("output_attentions / output_hidden_states are not available with tree speculation")
    for option, is_set, why in REFUSED_OPTIONS:
        if is_set(generation_config):
            raise ValueError(f"tree speculation does not support {option}: {why}")
    if synced_gpus:
        raise NotImplementedError(
            "tree speculation does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP across ranks): its rounds do not "
            "keep every rank's forwards in lock-step"
        )
    for processor in logits_processor or ():
        name = next((c.__name__ for c in type(processor).__mro__ if c.__name__ in STATEFUL_PROCESSORS), None)
        if name is not None:
            raise ValueError(f"tree speculation cannot use {name}: {STATEFUL_PROCESSORS[name]}")
    if model_kwargs.get("inputs_embeds") is not None:
        raise NotImplementedError("tree speculation needs input_ids, not inputs_embeds")
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in PASSED_MODEL_INPUTS)
    if unknown:
        raise ValueError(
            f"tree speculation cannot pass the model inputs {unknown} on to the target (it feeds input_ids, its own "
            f"position ids and tree masks only); generate without tree= for these inputs"
        )
    position_ids = model_kwargs.get("position_ids")
    default_ids = _default_position_ids(input_ids, model_kwargs) if position_ids is not None else None
    if position_ids is not None and (  # generate may pass the uncached part's positions only: compare the tail
        position_ids.shape[-1] > default_ids.shape[-1]
        or not bool((position_ids == default_ids[..., -position_ids.shape[-1] :]).all())
    ):
        raise ValueError(
            "tree speculation computes position ids from the attention mask; custom position_ids are not supported"
        )
    config = model.config.get_text_config()
    rope = [t for t in _rope_types(config) if any(d in t for d in POSITION_DEPENDENT_ROPE)]
    if rope:
        raise NotImplementedError(
            f"tree speculation does not support rope_type {rope[0]!r}: its frequencies depend on the largest position "
            "in the forward, and a tree pass holds deeper positions than each node's own sequence"
        )


def _default_position_ids(input_ids, model_kwargs) -> torch.LongTensor:
    """The position ids `generate` derives when none are given (so explicit ones can be told apart)."""
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    # input_ids is the whole sequence, also when a cache holds its start (multi-turn reuse)
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)


def _rope_types(config) -> list[str]:
    """RoPE types of a config: `rope_parameters` (per layer type, or one dict) or the legacy `rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return [str(g.get("rope_type", g.get("type", "default"))) for g in groups]
