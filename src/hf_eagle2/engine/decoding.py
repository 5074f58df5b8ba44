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
    bsz, prompt_len = input_ids.shape
    device = input_ids.device
    if target.max_positions is not None and prompt_len > target.max_positions:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, more than the model's max_position_embeddings={target.max_positions}"
        )
    if bsz > 1 and streamer is not None:
        raise ValueError("streamers support batch size 1 only")
    want_scores = generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    )
    if want_scores and bsz > 1:
        raise NotImplementedError("output_scores/output_logits with tree speculation support batch size 1 only")
    tc = _TargetCache.open(target, model_kwargs.get("cache"), bsz, options, generation_config.compile_config)
    cache, cached, static_capacity = tc.cache, tc.cached, tc.static_capacity
    attention_mask, valid_prompt, prompt_pos = _prompt_mask(input_ids, model_kwargs.get("attention_mask"), cached)
    stopper = BlockStopper(stopping_criteria, bsz)
    # a MaxLengthCriteria passed by the caller replaces generate's own (transformers merges them so): the length
    # plain decoding stops at is the criteria's, which may exceed generation_config.max_length
    max_length = stopper.max_length if stopper.max_length is not None else generation_config.max_length
    pad_id = generation_config._pad_token_tensor
    pad_id = int(pad_id) if pad_id is not None else 0

    do_sample = bool(generation_config.do_sample)
    stats = EagleStats(tree=options.tree, batch_size=bsz)
    stats.new_tokens_per_row = [0] * bsz
    stats.target_forwards_per_row = [0] * bsz
    timer = Timer(stats, device, sync=options.profile)
    calib = _CalibrationLog() if options.record_calibration else None
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
    drafter = _open_drafter(model, draft, options, timer, cached, device)
    drafter.add_features(hidden, valid_prompt[:, cached:])

    out = _Output(input_ids, max_length, pad_id, stopper, streamer, stats)
    # stopping criteria get what _sample hands them: every processed step's scores so far when they are returned
    # (return_dict_in_generate and output_scores; batch size 1 here), else None
    criteria_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    first_scores = _scores_so_far(scores_out) if criteria_scores else None  # scores_out holds the prefill's step
    stats.prefill_tokens_per_row = out.emit(first.view(bsz, 1), first.view(bsz, 1).tolist(), first_scores)
    slots = _Slots.after_prefill(input_ids, first, valid_prompt, prompt_pos)

    # ---- rounds: draft a tree, verify it in one pass, accept (the one host read), emit, prune, feed the head
    while any(out.unfinished):
        remaining = max(max_length - out.seq_len[b] for b in out.active())
        max_depth = max(0, min(64, remaining - 1))  # the drafter also caps it at the tree's own depth
        max_nodes = None if static_capacity is None else static_capacity - slots.cached
        with timer("draft_s"):
            rows = out.rows() if drafter.ngram is not None else None
            tree = drafter.draft_tree(slots.tokens, slots.pos.clamp(min=0), max_depth, max_nodes, rows=rows)
        hidden, raw, written = _verify(target, cache, tree, slots, tc.compiled_verify, timer)
        with timer("bookkeeping_s"):
            processed = process_node_logits(raw, tree, out.rows(), logits_processor)
            acc = accept(tree, sample_choices(processed) if do_sample else processed.argmax(-1))
            if calib is not None:
                calib.add(tree, acc)
            drafter.record_acceptance(tree, acc.valid, acc.correct)
            block = _Block.read(tree, acc)  # the round's one host sync
            active = out.active()
            stats.record_round(block.counts, active, tree.num_nodes)
            block_scores = (_scores_so_far(scores_out, lambda i: processed[0, block.paths[0][i]].unsqueeze(0))
                            if criteria_scores else None)  # fmt: skip
            emitted = out.emit(block.new_tokens, block.blocks, block_scores, active)
            if want_scores:
                scores_out.extend(processed[0, acc.path[0, : emitted[0]]].unbind(0))
                logits_out.extend(raw[0, acc.path[0, : emitted[0]]].unbind(0))
            keep = _Keep.plan(block, emitted, device)
            prune_tree_cache(cache, keep.index, written, holes=keep.holes, identity=keep.identity,
                             compact=keep.compact, tree_start=slots.cached)  # fmt: skip
            if keep.compact:
                cache._hf_eagle2_holes = True  # see HOLES_MESSAGE
            # (a static cache's length is a device tensor: checked by the tests, not read every round)
            if static_capacity is None and cache.get_seq_length() != slots.cached + keep.width:
                raise RuntimeError("tree cache pruning left the cache out of sync with the accepted sequence")
            if not any(out.unfinished):
                break
            drafter.add_features(hidden.gather(1, _expand(keep.index, hidden)), keep.in_block)
            slots.advance(tree, keep, block.new_tokens)

    if streamer is not None:
        streamer.end()
    # the cache outlives the call (returned, or the caller's own): as generate does for caches it hands back, stop
    # recording past states, or sliding-window layers would keep growing in later plain calls on it
    for layer in cache.layers:
        if hasattr(layer, "record_past"):
            layer.record_past = False
    stats.total_s = stats.prefill_s + stats.round_s
    stats.verify_compiled = 0 if tc.compiled_verify is None else tc.compiled_verify.calls
    if calib is not None:
        stats.calibration = calib.as_dict()
    output = out.sequences[:, : max(out.seq_len)]
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


@dataclass
class _TargetCache:
    """The target's cache for one call: `cache` (the caller's, reused, or a new dynamic one), `cached` tokens it
    held on entry (> 0: an earlier turn's, reused), `static_capacity` (a StaticCache's length: trees must fit in
    what is left of it; None otherwise), and `compiled_verify` (tree_compile over a full-attention static cache)."""

    cache: object
    cached: int
    static_capacity: int | None
    compiled_verify: CompiledVerify | None

    @classmethod
    def open(cls, target: TargetModel, cache, bsz: int, options: TreeOptions, compile_config) -> "_TargetCache":
        if cache is None:
            cache = DynamicCache(config=target.model.config)
        stack_empty_cache(cache)  # an empty dynamic cache keeps every layer in one tensor: pruning is one gather
        check_cache_supported(cache)
        if getattr(cache, "_hf_eagle2_holes", False):
            raise ValueError(HOLES_MESSAGE)
        full_layer = target.type_layer.get("full_attention", 0)
        static_capacity = cache.get_max_length(full_layer) if isinstance(cache, StaticCache) else None
        if bsz > 1 and static_capacity is not None:
            raise NotImplementedError(
                "tree speculation with a StaticCache supports batch size 1: batched rounds leave holes in the cache "
                "(rows accept different lengths), which would use up the preallocated room; use the default cache"
            )
        cached = cache.get_seq_length()
        cache.activate_past_recording()
        compiled_verify = None  # tree_compile over a static cache: the verify pass is one compiled call too
        if options.compile and compiles_verify(cache):
            compiled_verify = CompiledVerify(target, cache, static_capacity, compile_config)
        elif compile_config is not None:
            raise ValueError(
                "tree speculation compiles the target's forward only with tree_compile=True over a full-attention "
                "static cache (cache_implementation='static'), as transformers compiles decoding only over a static "
                "cache; otherwise the tree's passes change shape every round. Pass both, or drop compile_config"
            )
        return cls(cache, cached, static_capacity, compiled_verify)


def _open_drafter(model, draft, options: TreeOptions, timer, cached: int, device) -> EagleDrafter:
    """The head's side of the call, its options resolved for the inputs' device (and "auto" sizes given a
    per-round budget from the measured cost curve). The head's context starts where this call's prefill does
    (`cached`): a reused cache's part has no features here, and the head only proposes, so a shorter head context
    costs acceptance, never exactness."""
    budget, resolved = None, options.resolved(device)
    if options.per_round_budget:  # asked before resolving: whether a size is "auto"
        from .budget import round_budget

        budget = round_budget(model, draft.bind(model), resolved.top_k)
    return EagleDrafter(draft, model, resolved, timer=timer, budget=budget, context_start=cached)


def _prompt_mask(input_ids, attention_mask, cached: int):
    """(attention_mask, valid (B, S) bool, logical positions (B, S)) of the prompt; cached: tokens a reused cache
    holds already (batch size 1 without padding only)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if cached:
        if input_ids.shape[0] > 1 or not bool(attention_mask.all()):
            raise NotImplementedError("reusing a cache from an earlier turn is supported for batch size 1 without padding")
        if cached >= input_ids.shape[1]:
            raise ValueError(
                f"the cache passed in already holds {cached} tokens but input_ids has {input_ids.shape[1]}: pass the "
                "whole conversation so far (the previous output plus the new turn) as input_ids"
            )
    valid = attention_mask.bool()
    return attention_mask, valid, (attention_mask.long().cumsum(-1) - 1).masked_fill(~valid, 1)


def _scores_so_far(done: list[torch.Tensor], step: Callable[[int], torch.Tensor] | None = None) -> Callable:
    """`scores(j)` for BlockStopper: the steps in `done` ((V,) each), then a round's steps 0..j (`step(i)`: (1, V)),
    as the tuple of (1, V) tensors that `_sample` passes stopping criteria after that token."""
    return lambda j: tuple(s.unsqueeze(0) for s in done) + (tuple(step(i) for i in range(j + 1)) if step else ())


def _expand(index: torch.LongTensor, like: torch.Tensor) -> torch.LongTensor:
    return index.unsqueeze(-1).expand(*index.shape, like.shape[-1])


def _verify(target, cache, tree, slots: "_Slots", compiled_verify, timer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The target's one pass over the tree: (features (B, n, H), float32 logits (B, n, V), entries it wrote to the
    cache: n, or the padded size of a compiled pass)."""
    if compiled_verify is not None:
        with timer("verify_s"):  # its mask included
            verified = compiled_verify(tree, slots.root_pos, slots.pos[:, :-1], slots.cached)
        if verified is not None:
            return verified
    with timer("bookkeeping_s"):
        positions = slots.root_pos.view(-1, 1) + tree.depths
        mask = target.tree_attention_mask(cache, tree, positions, slots.pos[:, :-1])
    with timer("verify_s"):
        hidden, raw = target.forward(tree.tokens, positions, mask, cache)
    return hidden, raw, tree.num_nodes


@dataclass
class _Slots:
    """The target cache's entries plus the root: tokens (B, C + 1), logical positions pos (B, C + 1) (-1: padding
    or a hole), the root's position root_pos (B,). The last entry is the root, not cached yet."""

    tokens: torch.LongTensor
    pos: torch.LongTensor
    root_pos: torch.LongTensor

    @classmethod
    def after_prefill(cls, input_ids, first, valid_prompt, prompt_pos) -> "_Slots":
        bsz = input_ids.shape[0]
        root_pos = valid_prompt.sum(-1)
        pos = torch.cat([torch.where(valid_prompt, prompt_pos, -1), root_pos.view(bsz, 1)], dim=1)
        return cls(torch.cat([input_ids, first.view(bsz, 1)], dim=1), pos, root_pos)

    @property
    def cached(self) -> int:
        return self.pos.shape[1] - 1

    def advance(self, tree, keep: "_Keep", new_tokens: torch.LongTensor) -> None:
        """The kept block joins the cached entries; the last emitted token becomes the root."""
        bsz = self.tokens.shape[0]
        block_pos = torch.where(keep.in_block, self.root_pos.view(bsz, 1) + keep.src, -1)
        self.root_pos = self.root_pos + keep.kept + 1
        next_root = new_tokens.gather(1, keep.kept.view(bsz, 1))
        self.tokens = torch.cat([self.tokens[:, :-1], tree.tokens.gather(1, keep.index), next_root], 1)
        self.pos = torch.cat([self.pos[:, :-1], block_pos, self.root_pos.view(bsz, 1)], 1)


@dataclass
class _Block:
    """A round's outcome on the host: new_tokens (B, D + 1) on the device (row b: its counts[b] accepted draft
    tokens, then the bonus token), and on the host counts[b], the accepted path's node ids paths[b] and the block's
    token ids blocks[b] (accepted + bonus)."""

    new_tokens: torch.LongTensor
    counts: list[int]
    paths: list[list[int]]
    blocks: list[list[int]]

    @classmethod
    def read(cls, tree, acc) -> "_Block":
        bsz = tree.tokens.shape[0]
        new_tokens = torch.cat([tree.tokens.gather(1, acc.path[:, 1:]), acc.next_token.view(bsz, 1)], dim=1)
        new_tokens.scatter_(1, acc.num_accepted.view(bsz, 1), acc.next_token.view(bsz, 1))
        # one host read: accepted counts, the block's tokens and the accepted path
        host = torch.cat([acc.num_accepted.view(bsz, 1), new_tokens, acc.path], dim=1).tolist()
        depth = new_tokens.shape[1]
        counts = [h[0] for h in host]
        return cls(new_tokens, counts, [h[1 + depth :] for h in host],
                   [h[1 : 2 + counts[b]] for b, h in enumerate(host)])  # fmt: skip


@dataclass
class _Keep:
    """What each row keeps of its tree: root + the accepted nodes it emitted (all but a stop-cut tail), right-aligned
    in a block of `width` slots (rows that kept fewer start with holes); the last emitted token is the next root.

    index (B, width): tree node per slot; kept (B,): nodes kept after the root; src (B, width): offset of each slot
    from the root (< 0: a hole); in_block = src >= 0; holes (B,) = width - 1 - kept."""

    index: torch.LongTensor
    kept: torch.LongTensor
    src: torch.LongTensor
    in_block: torch.BoolTensor
    holes: torch.LongTensor
    width: int
    identity: bool  # every row keeps nodes 0 .. width - 1 (nothing moves)
    compact: bool  # some row has holes

    @classmethod
    def plan(cls, block: _Block, emitted: list[int], device) -> "_Keep":
        bsz = len(block.counts)
        kept_host = [min(block.counts[b], emitted[b] - 1) if emitted[b] else 0 for b in range(bsz)]
        width = max(kept_host) + 1
        holes_host = [width - 1 - k for k in kept_host]
        index_host = [[block.paths[b][max(0, i - holes_host[b])] for i in range(width)] for b in range(bsz)]
        kept = torch.tensor(kept_host, device=device)
        src = torch.arange(width, device=device).view(1, width) - (width - 1 - kept).view(bsz, 1)
        return cls(torch.tensor(index_host, device=device), kept, src, src >= 0, width - 1 - kept, width,
                   all(row == list(range(width)) for row in index_host), any(holes_host))  # fmt: skip


class _Output:
    """The rows' sequences (B, max_length), filled to seq_len[b], and which rows are still unfinished."""

    def __init__(self, input_ids, max_length: int, pad_id: int, stopper, streamer, stats):
        bsz, prompt_len = input_ids.shape
        self.sequences = torch.full((bsz, max_length), pad_id, dtype=torch.long, device=input_ids.device)
        self.sequences[:, :prompt_len] = input_ids
        self.seq_len = [prompt_len] * bsz
        self.unfinished = [True] * bsz
        self.pad_id, self.stopper, self.streamer, self.stats = pad_id, stopper, streamer, stats

    def active(self) -> list[int]:
        return [b for b, u in enumerate(self.unfinished) if u]

    def rows(self) -> list[torch.LongTensor]:
        return [self.sequences[b, :n] for b, n in enumerate(self.seq_len)]

    def emit(self, new_tokens, blocks, scores, rows=None) -> list[int]:
        """Appends each unfinished row's block (host ids; new_tokens[b, :len(blocks[b])] on the device) to its
        sequence, cut where plain decoding would have stopped (see stopping.py). Returns the tokens taken per row."""
        taken = [0] * len(self.seq_len)
        for b in rows if rows is not None else range(len(self.seq_len)):
            if not self.unfinished[b]:
                continue
            start = self.seq_len[b]
            block = blocks[b][: self.sequences.shape[1] - start]  # never past max_length (the stopper cuts there too)
            self.sequences[b, start : start + len(block)] = new_tokens[b, : len(block)]
            take, stop = self.stopper.take(self.sequences[b], start, block, scores)
            if take < len(block):  # rows shorter than the output end in padding
                self.sequences[b, start + take : start + len(block)] = self.pad_id
            if stop:
                self.unfinished[b] = False
            self.seq_len[b] = start + take
            taken[b] = take
            self.stats.new_tokens += take
            self.stats.new_tokens_per_row[b] += take
            if self.streamer is not None:
                self.streamer.put(new_tokens[b, :take].cpu())
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
