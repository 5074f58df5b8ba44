"""Feature extraction: run the frozen target over conversations and store, per token, its final hidden state
(after the final norm: the lm_head input), the token id and the assistant loss mask; for EAGLE-3 heads also the
three hidden states the head reads (`aux_layers`), taken from the same forward.

Two sources of assistant text:

* `responses="sharegpt"`: the ShareGPT conversations as written (the EAGLE-1/2 recipe), all turns;
* `responses="target"`: self-distillation. The target answers user turns greedily with `model.generate`, which
  also records the features: the hidden states of the very forwards that wrote the answer (prefill, then one
  decode step per token), so no second pass over prompt + answer (a third of the time, measured). With a head
  (tree-speculative answers) a teacher-forced forward after generation gives them. A head trained on the target's
  own outputs sees at training time exactly the text it has to predict at inference time. `turns="first"` answers
  each conversation's first user turn; `turns="all"` every user turn, each prompted with the conversation up to
  it (earlier answers as written): one sequence per turn.

Storage: fp16 shards (`shard_00000.safetensors`, one per batch) with `input_ids` (N,), `features` (N, H),
optionally `aux_features` (N, 3 * H), `loss_mask` (N,) and `offsets` (S + 1,) over the S sequences. Shards are
written atomically and named by their batch index over a deterministic ordering of the data, so a stopped run
resumes where it left off. They are read back memory-mapped (`open_shard`): an EAGLE-3 set (4.6 kB per token for
SmolLM2) outgrows RAM at a few million tokens, and the page cache then holds what training touches.
"""

from __future__ import annotations

import json
import os
import re
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from ..heads.configuration_eagle import official_feature_ids
from ..kernels.cpu import device_name
from ..kernels.reserved_cache import DEFAULT_RESERVE, ReservedLayer, concat_rows, reserved_cache
from ..engine.target import causal_lm_forward, hidden_states_request, select_features
from .data import Conversation, iter_sharegpt, render_with_loss_mask


@dataclass
class Sequence:
    input_ids: torch.Tensor  # (T,) int64
    features: torch.Tensor  # (T, H) fp16
    loss_mask: torch.Tensor  # (T,) bool
    aux_features: torch.Tensor | None = None  # (T, 3 * H) fp16: the EAGLE-3 head's three target layers


def turn_prompts(tokenizer, conversation: Conversation, max_turns: int | None = None) -> list[list[int]]:
    """Chat-template ids of the conversation up to each user turn, with the generation prompt (earlier
    assistant turns as written): the prompts whose answers self-distillation asks the target for."""
    prompts = []
    for i, m in enumerate(conversation.messages):
        if m["role"] != "user" or (max_turns is not None and len(prompts) >= max_turns):
            continue
        out = tokenizer.apply_chat_template(conversation.messages[: i + 1], tokenize=True, add_generation_prompt=True)
        prompts.append(list(out["input_ids"] if hasattr(out, "keys") else out))
    return prompts


def aux_layer_ids(model) -> tuple[int, ...]:
    """The three `hidden_states` entries an EAGLE-3 head of `model` reads (`official_feature_ids`)."""
    return official_feature_ids(model.config.get_text_config().num_hidden_layers)


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


class _EosFedBack(StoppingCriteria):
    """Stops a row one step after its EOS: the step that feeds the EOS back records its hidden state, the feature
    of the answer's last token (generate's own EOS stop ends the row before that forward)."""

    def __init__(self, eos_ids: list[int], prompt_width: int):
        self.eos_ids, self.prompt_width = eos_ids, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:  # (B, W + n) -> (B,) bool
        if input_ids.shape[1] - self.prompt_width < 2:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return torch.isin(input_ids[:, -2], torch.tensor(self.eos_ids, device=input_ids.device))


@dataclass(frozen=True)
class Sampling:
    """Sampled self-distillation: answers drawn from the target's own distribution at `temperature`, unshaped (no
    top-k, top-p, repetition penalty or any other logits processor a model's generation_config may set: each is
    overridden), the global generators seeded with `seed` for one `generate_with_features` call (the caller derives
    one seed per call: `for_call`). The soft labels training reads stay the target's full distribution at every
    position; sampling only changes which prefixes the answers visit."""

    temperature: float
    seed: int

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"a sampling temperature must be > 0 (greedy answers need no Sampling), got "
                             f"{self.temperature}")  # fmt: skip

    def generate_kwargs(self) -> dict:
        return {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0, "min_p": None,
                "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "repetition_penalty": 1.0,
                "no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
                "begin_suppress_tokens": None, "min_length": 0, "min_new_tokens": None,
                "exponential_decay_length_penalty": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                "guidance_scale": None, "watermarking_config": None}  # fmt: skip

    def meta(self) -> dict:
        """What an archive records in its meta's `sampling` (None there means greedy), with the caller's own keys."""
        return {"temperature": self.temperature, "seed": self.seed}

    def for_call(self, *keys: int) -> "Sampling":
        """The same temperature with a seed derived from this one and `keys` (e.g. first shard, call index)."""
        return Sampling(self.temperature, int(np.random.SeedSequence([self.seed, *keys]).generate_state(1)[0]))


@contextmanager
def _seeded(sampling: Sampling | None, device: torch.device):
    """Runs the block with the global generators seeded from `sampling` (restored after: the caller's random state
    is left as it was); without sampling, as it is."""
    if sampling is None:
        yield
        return
    # torch.manual_seed seeds every CUDA device, so every one's state is restored after
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if device.type == "cuda" else []):
        torch.manual_seed(sampling.seed)
        yield


# decode steps per `generate` call of a self-distilled extraction: between calls, the rows whose answer ended leave
# the batch and its cache. One call for the whole answer computes every row until the longest answer ends: 28% of
# a 64-row batch's decode slots on the archive's shards 60-99 (`benchmarks/decode_slots.py`). On 2 cores (SmolLM2
# bf16, 64 all-turn prompts, `benchmarks/extraction_cost.py`) 32 steps ran 1.25-1.28x faster than one call (16:
# slower, more calls; 48, 64: no better)
GENERATE_CHUNK_STEPS = 32


@torch.inference_mode()
def generate_with_features(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int], pad_id: int,
                           draft=None, aux_layers: tuple[int, ...] = (), chunk_steps: int | None = GENERATE_CHUNK_STEPS,
                           reserve: int | None = DEFAULT_RESERVE, sampling: Sampling | None = None):
    """Batched greedy answers (or, with `sampling`, answers sampled at its temperature from its seed) with every
    token's final hidden state.

    The answers come from `model.generate`, so extraction has no decode loop of its own. Without a head, generate
    also returns the features (`output_hidden_states` recording only the entries asked for): the prefill's for the
    prompt, then decode step j's for answer token j - 1; it runs until each row's EOS was fed back (one more
    token, dropped) or max_new_tokens + 1 tokens, so every kept token has its own. It runs in calls of
    `chunk_steps` decode steps (None: one call), continuing the same cache, with the finished rows dropped
    between calls. With `draft` (an EAGLE head: the same tokens, sooner, through the tree-speculative loop) the
    features come from a teacher-forced forward over prompt + answer (`forward_features`). The two agree to float
    rounding (another order of summation).
    Returns, per prompt, (ids (T,), features (T, H) float, aux (T, 3H) float or None, response_start) with
    T = prompt + response tokens; the response ends with the first EOS (kept) or after max_new_tokens tokens."""
    device = model.get_output_embeddings().weight.device
    if sampling is not None and draft is not None:
        raise ValueError("sampled answers are written without a head (a head's tree speculation answers greedily "
                         "here)")  # fmt: skip
    ids, attn = _left_pad(prompts, pad_id, device)
    width = ids.shape[1]
    feature_ids = (*aux_layers, -1)
    if draft is None:
        with _seeded(sampling, device):
            sequences, hidden = _generate_in_chunks(model, ids, attn, max_new_tokens + 1, eos_ids, pad_id,
                                                    feature_ids, chunk_steps, reserve, sampling)  # fmt: skip
    else:
        sequences = model.generate(ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=eos_ids, pad_token_id=pad_id, assistant_model=draft,
                                   tree="eagle2")  # fmt: skip
    rows = answered_rows(sequences, prompts, max_new_tokens, eos_ids)
    if draft is not None:
        feats, aux = forward_features(model, rows, pad_id, aux_layers)
    else:
        if any(len(r) - len(p) > h.shape[0] - width for r, p, h in zip(rows, prompts, hidden)):
            raise RuntimeError("generate stopped before feeding back every kept token")  # the criterion's contract
        kept = [h[width - len(p) : width - len(p) + len(r)] for h, r, p in zip(hidden, rows, prompts)]
        feats, aux = _split_features(kept, len(aux_layers))
    return [(torch.tensor(r), f, a, len(p)) for r, f, a, p in zip(rows, feats, aux, prompts)]


def _generate_in_chunks(model, ids: torch.Tensor, attn: torch.Tensor, max_steps: int, eos_ids: list[int], pad_id: int,
                        feature_ids: tuple[int, ...], chunk_steps: int | None, reserve: int | None,
                        sampling: Sampling | None = None):  # fmt: skip
    """Greedy (or `sampling`'s) `generate` of left-padded prompts (B, W) for up to `max_steps` tokens per row,
    stopping a row one step after its EOS (`_EosFedBack`), in calls of `chunk_steps` steps; between calls the rows
    that stopped leave the batch (`Cache.batch_select_indices`) and the others continue from the same cache
    (generate feeds only the uncached last token). Returns sequences (B, W + n), right-padded with pad_id, and per
    row the `feature_ids` states of every position it fed (W + n_b - 1, F).

    reserve: the cache is a `reserved_cache` with that many spare slots per growth (None: generate's own
    DynamicCache, which copies itself every step), and all but the last prompt token are prefilled in row groups
    (`_prefill_in_groups`) before the first call."""
    width, eos = ids.shape[1], torch.tensor(eos_ids, device=ids.device)
    rows = list(range(ids.shape[0]))  # the input row of each batch row
    sequences, hidden = [None] * len(rows), [[] for _ in rows]
    criteria = StoppingCriteriaList([_EosFedBack(eos_ids, width)])
    decoding = {"do_sample": False} if sampling is None else sampling.generate_kwargs()
    cache, done_steps = (None if reserve is None else reserved_cache(model.config, reserve)), 0
    if cache is not None and width > 1 and all(type(layer) is ReservedLayer for layer in cache.layers):
        cache, prompt_states = _prefill_in_groups(model, ids[:, :-1], attn[:, :-1], feature_ids, reserve)
        for b in rows:
            hidden[b].append(prompt_states[b])
    while True:
        out = model.generate(ids, attention_mask=attn, cache=cache, **decoding,
                             max_new_tokens=min(chunk_steps or max_steps, max_steps - done_steps), eos_token_id=None,
                             pad_token_id=pad_id, return_dict_in_generate=True, stopping_criteria=criteria,
                             output_hidden_states=hidden_states_request(feature_ids))  # fmt: skip
        # (b, fed, F): this call's prefill (the uncached part), then the token each decode step fed
        states = torch.cat([select_features(step, feature_ids) for step in out.hidden_states], dim=1)
        for b, row in enumerate(rows):
            hidden[row].append(states[b])
        new = out.sequences.shape[1] - ids.shape[1]
        done_steps += new
        # a row stopped once its EOS was fed back: decode step j + 1 feeds answer token j, so done_steps - 1 are fed
        stopped = torch.isin(out.sequences[:, width : width + done_steps - 1], eos).any(-1).tolist()
        finished = done_steps >= max_steps or all(stopped)
        for b, row in enumerate(rows):
            if stopped[b] or finished:
                sequences[row] = out.sequences[b]
        if finished:
            break
        keep = [b for b in range(len(rows)) if not stopped[b]]
        cache = out.cache
        if len(keep) < len(rows):
            cache.batch_select_indices(torch.tensor(keep, device=ids.device))
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], new)], dim=1)[keep]
        ids, rows = out.sequences[keep], [rows[b] for b in keep]
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=pad_id)
    return padded, [torch.cat(parts) for parts in hidden]


def _prefill_in_groups(model, ids: torch.Tensor, attn: torch.Tensor, feature_ids: tuple[int, ...], reserve: int,
                       max_batch_tokens: int | None = None):  # fmt: skip
    """Runs left-padded prompts (B, W) through the model in groups of rows of at most `max_batch_tokens` padded
    tokens (default FORWARD_BATCH_TOKENS), at generate's positions (mask cumsum; padding at 0). Returns their
    reserved cache (all B rows, W entries) and features (B, W, F).

    One forward over a whole 64-row batch of long prompts is slower than its parts (its (B, heads, W, W) masks,
    as in `forward_features`): in `benchmarks/extraction_cost.py --reserve` the band batch took 270.4 s with the
    reserved cache and generate's own prefill, 254.5 s and 241.2 s (two runs) with this one. A row's keys, values
    and features do not depend on the rows beside it (explicit positions, padding mask) up to kernel rounding; its
    last prompt token runs in generate's first step, so answers differ from generate's own prefill by bf16
    rounding only (see the example)."""
    group = max(1, (max_batch_tokens or FORWARD_BATCH_TOKENS) // ids.shape[1])
    pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)
    caches, states = [], []
    for start in range(0, ids.shape[0], group):
        part = slice(start, start + group)
        cache = reserved_cache(model.config, reserve)
        states.append(causal_lm_forward(model, ids[part], pos[part], attn[part], cache, logits_to_keep=1,
                                        feature_ids=feature_ids)[0])  # fmt: skip
        caches.append(cache)
    return concat_rows(caches), torch.cat(states)


def answered_rows(sequences: torch.Tensor, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int]):
    """Prompt + answer ids per row of left-padded `generate` output (B, width + n): the answer cut after its first
    EOS (kept) or after max_new_tokens tokens."""
    width = max(len(p) for p in prompts)
    eos = torch.tensor(eos_ids, device=sequences.device)
    rows = []
    for b, prompt in enumerate(prompts):
        answer = sequences[b, width : width + max_new_tokens]
        ends = torch.isin(answer, eos).nonzero()
        rows.append(prompt + answer[: int(ends[0]) + 1 if ends.numel() else answer.numel()].tolist())
    return rows


def device_description(model) -> str:
    """Where answers are written, for a folder's or archive's record: device, torch and transformers versions."""
    device = model.get_output_embeddings().weight.device
    return f"{device.type}: {device_name(device)}; torch {torch.__version__}; transformers {transformers.__version__}"


def pad_and_eos_ids(model, tokenizer) -> tuple[int, list[int]]:
    """The pad id extraction left-pads prompts with (the tokenizer's, else 0) and the ids that end an answer (the
    generation config's EOS, else the tokenizer's)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = model.generation_config.eos_token_id
    return pad_id, [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])


def _split_features(rows: list[torch.Tensor], num_aux: int):
    """Per row (T_i, (num_aux + 1) * H) -> final features (T_i, H) and aux features (T_i, num_aux * H) or None,
    float32 on the CPU."""
    size = rows[0].shape[-1] // (num_aux + 1)
    final = [r[:, -size:].float().cpu() for r in rows]
    return final, [r[:, :-size].float().cpu() if num_aux else None for r in rows]


# padded tokens per forward of `forward_features`: one forward over a whole shard (64 rows) spends ~30% on padding
# and slows on its (B, heads, T, T) masks; on 2 cores (SmolLM2 bf16, two shards of the token archive,
# `benchmarks/rebuild_cost.py`) length-sorted groups of 4096 padded tokens ran 731 tokens/s against 431 for one
# forward per shard (2048: 735, 16384: 536)
FORWARD_BATCH_TOKENS = 4096


def pack_by_length(indices, lengths, budget: int) -> list[list[int]]:
    """`indices` sorted by `lengths[i]` (stable) and cut into consecutive groups with (rows x longest) <= budget;
    a row longer than the budget forms a group alone. Training batches and feature forwards pack by this rule."""
    groups, group = [], []
    for i in sorted(indices, key=lambda i: lengths[i]):
        if group and lengths[i] * (len(group) + 1) > budget:
            groups.append(group)
            group = []
        group.append(i)
    return groups + [group] if group else groups


@torch.inference_mode()
def forward_features(model, rows: list[list[int]], pad_id: int, aux_layers: tuple[int, ...] = (),
                     max_batch_tokens: int = FORWARD_BATCH_TOKENS):  # fmt: skip
    """Final hidden states (T_i, H) of each row (the features verification passes on), and, for `aux_layers`,
    those `hidden_states` entries concatenated (T_i, 3H) from the same forward (else None). Rows run in padded
    forwards of similar lengths, at most `max_batch_tokens` padded tokens each (a longer row runs alone); each
    row's states are its own whatever its group (explicit positions and padding mask), up to kernel rounding."""
    final, aux = [None] * len(rows), [None] * len(rows)
    for group in pack_by_length(range(len(rows)), [len(r) for r in rows], max_batch_tokens):
        group_final, group_aux = _padded_forward(model, [rows[i] for i in group], pad_id, aux_layers)
        for i, f, a in zip(group, group_final, group_aux):
            final[i], aux[i] = f, a
    return final, aux


def _padded_forward(model, rows: list[list[int]], pad_id: int, aux_layers: tuple[int, ...]):
    """`forward_features` of one right-padded batch with no attention mask: causality alone keeps every real token
    from the padding after it, so sdpa runs its causal kernel (`is_causal`, half the attention of an explicit
    mask, which left padding needs). On 2 cores (SmolLM2 bf16, the band archive's shards 200-201) it ran 1.13x
    faster than left-padded under a mask, its features as far from those as another grouping's rounding makes them
    (`benchmarks/rebuild_cost.py --left-padded`)."""
    device = model.get_output_embeddings().weight.device
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    pos = torch.arange(width, device=device).expand(len(rows), width)
    hidden = causal_lm_forward(model, ids, pos, None, None, logits_to_keep=1, feature_ids=(*aux_layers, -1))[0]
    return _split_features([hidden[i, : len(r)] for i, r in enumerate(rows)], len(aux_layers))


def _batches(items: list, batch_size: int, bucket: int = 8) -> Iterator[list]:
    """Deterministic batches of similar lengths: each window of batch_size * bucket consecutive items, sorted by
    length, cut into batches. `items` may be a lazy iterator: a window is built only when it is reached, so a
    run with a small token budget (or one resuming early in the data) does not render the whole dataset first."""
    window = []
    for item in items:
        window.append(item)
        if len(window) == batch_size * bucket:
            yield from _sorted_window(window, batch_size)
            window = []
    if window:
        yield from _sorted_window(window, batch_size)


def _sorted_window(window: list, batch_size: int) -> list[list]:
    ordered = sorted(window, key=lambda item: len(item[1]))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def check_work_settings(responses: str, turns: str, min_prompt_tokens: int, max_prompt_tokens: int) -> None:
    """Refuses work-list settings that select nothing or mean nothing (ValueError)."""
    if responses not in ("target", "sharegpt"):
        raise ValueError("responses must be 'target' or 'sharegpt'")
    if min_prompt_tokens and responses != "target":
        raise ValueError("min_prompt_tokens selects the prompts self-distillation answers (responses='target'); "
                         "original answers are cut by max_seq_tokens")  # fmt: skip
    if not 0 <= min_prompt_tokens < max_prompt_tokens:
        raise ValueError(f"min_prompt_tokens ({min_prompt_tokens}) must be in [0, max_prompt_tokens = "
                         f"{max_prompt_tokens})")  # fmt: skip
    if turns not in ("first", "all"):
        raise ValueError("turns must be 'first' or 'all'")


def work_items(tokenizer, *, responses: str, split: str, turns: str, min_prompt_tokens: int, max_prompt_tokens: int,
               max_seq_tokens: int, max_conversations: int | None = None, sharegpt_file: str | None = None,
               counts: dict | None = None) -> Iterator[tuple[str, list[int], list[int] | None]]:  # fmt: skip
    """Extraction's work list before batching, lazily: (sequence id, ids, loss mask or None) per conversation
    (responses="sharegpt": the conversation as written, cut to max_seq_tokens), or per user turn answered by the
    target (responses="target": the prompt up to that turn, kept when min_prompt_tokens < length <=
    max_prompt_tokens; turns="first" takes each conversation's first user turn only). `counts` (if given) tracks
    "sequences" and "conversations" (those that gave at least one sequence; max_conversations counts these)."""
    counts = {"sequences": 0, "conversations": 0} if counts is None else counts
    for conv in iter_sharegpt(sharegpt_file, split=split):
        if max_conversations is not None and counts["conversations"] >= max_conversations:
            return
        if responses == "target":
            prompts = turn_prompts(tokenizer, conv, max_turns=1 if turns == "first" else None)
            kept = [(f"{conv.id}/{t}", p, None) for t, p in enumerate(prompts)
                    if min_prompt_tokens < len(p) <= max_prompt_tokens]  # fmt: skip
        else:
            ids, mask = render_with_loss_mask(tokenizer, conv.messages, max_tokens=max_seq_tokens)
            kept = [(conv.id, ids, mask)] if sum(mask) else []
        counts["sequences"] += len(kept)
        counts["conversations"] += bool(kept)
        yield from kept


# settings a folder or archive from before them lacks, read as what it was made with (no lower bound, greedy)
SETTING_DEFAULTS = {"min_prompt_tokens": 0, "sampling": None}


def extraction_meta(model, *, responses: str, split: str, turns: str, max_new_tokens: int, max_prompt_tokens: int,
                    min_prompt_tokens: int, max_seq_tokens: int, batch_size: int, aux_layers: tuple[int, ...]) -> dict:
    """What a folder's shards are a function of (shard i holds batch i of the work list): a folder resumes only
    with the same. dtype: the target's when it wrote the answers; feature_dtype: when it computed the features
    (stored as fp16 either way); the two differ only in a folder rebuilt in another dtype (`rebuild_features`).
    sampling: None for greedy answers (all `extract` writes); `answer --temperature` records its sampling, so
    `extract` and `rebuild_features` refuse to mix sampled and greedy shards in one folder (a folder from before
    a setting reads as its `SETTING_DEFAULTS` value)."""
    dtype = str(model.dtype).removeprefix("torch.")
    return {"responses": responses, "split": split, "turns": turns, "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens, "min_prompt_tokens": min_prompt_tokens,
            "max_seq_tokens": max_seq_tokens, "batch_size": batch_size, "dtype": dtype, "hidden_size": None,
            "aux_layers": list(aux_layers), "feature_dtype": dtype, "sampling": None}  # fmt: skip


def extract_features(
    model,
    tokenizer,
    out_dir: str,
    *,
    responses: str = "target",
    split: str = "train",
    max_tokens: int | None = None,
    max_conversations: int | None = None,
    max_prompt_tokens: int = 512,
    min_prompt_tokens: int = 0,
    max_new_tokens: int = 384,
    max_seq_tokens: int = 1024,
    batch_size: int = 32,
    sharegpt_file: str | None = None,
    progress: bool = True,
    draft=None,
    turns: str = "first",
    eagle3: bool = False,
) -> dict:
    """Writes feature shards to `out_dir` until `max_tokens` tokens (or the data) are exhausted. Resumable.

    draft: an EAGLE head that speeds up self-distilled answers (same tokens: greedy tree speculation is exact);
    turns: "first" or "all" user turns answered by the target (responses="target"); eagle3: also store the
    three hidden states an EAGLE-3 head reads (`aux_layer_ids`); min_prompt_tokens: self-distillation answers only
    prompts longer than this (and at most max_prompt_tokens long), so a second folder can hold the turns a first
    one's smaller max_prompt_tokens left out, with no answer in both."""
    check_work_settings(responses, turns, min_prompt_tokens, max_prompt_tokens)
    aux_layers = aux_layer_ids(model) if eagle3 else ()
    os.makedirs(out_dir, exist_ok=True)
    pad_id, eos_ids = pad_and_eos_ids(model, tokenizer)
    counts = {"sequences": 0, "conversations": 0}
    items = work_items(tokenizer, responses=responses, split=split, turns=turns, min_prompt_tokens=min_prompt_tokens,
                       max_prompt_tokens=max_prompt_tokens, max_seq_tokens=max_seq_tokens,
                       max_conversations=max_conversations, sharegpt_file=sharegpt_file, counts=counts)  # fmt: skip
    meta = extraction_meta(model, responses=responses, split=split, turns=turns, max_new_tokens=max_new_tokens,
                           max_prompt_tokens=max_prompt_tokens, min_prompt_tokens=min_prompt_tokens,
                           max_seq_tokens=max_seq_tokens, batch_size=batch_size, aux_layers=aux_layers)  # fmt: skip
    meta_path = os.path.join(out_dir, "meta.json")
    done = shard_paths([out_dir])
    if done and os.path.exists(meta_path):
        with open(meta_path) as f:
            saved = SETTING_DEFAULTS | json.load(f)
        changed = setting_changes(saved, meta, skip=("hidden_size",))
        if saved.get("feature_dtype", saved.get("dtype")) != saved.get("dtype"):
            raise ValueError(f"{out_dir} holds answers written in {saved.get('dtype')} and features rebuilt in "
                             f"{saved['feature_dtype']}: new shards would hold one dtype for both; extend the "
                             f"{saved.get('dtype')} folder the answers came from (or rebuild it from the archive in "
                             f"{saved.get('dtype')}), export its tokens and rebuild")  # fmt: skip
        if saved.get("max_prompt_context") is not None:
            raise ValueError(f"{out_dir} keeps only {saved['max_prompt_context']} prompt positions before each answer "
                             "(a folder cut for training): new shards would keep whole prompts; extend a folder of "
                             "whole prompts (rebuild-features without --max-prompt-context)")  # fmt: skip
        if changed:
            raise ValueError(f"{out_dir} holds shards extracted with other settings ({'; '.join(changed)}): resume "
                             "with the same ones, or extract into another folder")  # fmt: skip
        meta["hidden_size"] = saved.get("hidden_size")
        if saved.get("answer_sources"):  # shards answered elsewhere (join-tokens): keep the record, add ours
            meta["answer_sources"] = [dict(source) for source in saved["answer_sources"]]
    done_tokens = sum(int(open_shard(path)["offsets"][-1]) for path in done)

    def record_source(index: int) -> None:  # shard `index` was answered here, by extract
        if "answer_sources" not in meta:
            return
        where = f"extract, {device_description(model)}"
        last = meta["answer_sources"][-1]
        if last["answered_on"] == where and last["shards"][1] == index - 1:
            last["shards"][1] = index
        else:
            meta["answer_sources"].append({"shards": [index, index], "answered_on": where})

    def write_meta(**final):  # after every shard, so an interrupted extraction leaves its true size
        meta.update(tokens=done_tokens, shards=len(shard_paths([out_dir])), **final)
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f, indent=2)
        os.replace(meta_path + ".tmp", meta_path)

    bar = tqdm(total=max_tokens or None, initial=done_tokens, unit="tok", desc=f"features[{responses}]", disable=not progress)
    for index, batch in enumerate(_batches(items, batch_size)):
        path = os.path.join(out_dir, shard_name(index))
        if os.path.exists(path):
            continue
        if max_tokens is not None and done_tokens >= max_tokens:
            break
        if responses == "target":
            results = generate_with_features(model, [b[1] for b in batch], max_new_tokens, eos_ids, pad_id, draft=draft,
                                             aux_layers=aux_layers)  # fmt: skip
            seqs = []
            for ids, feats, aux, start in results:
                mask = torch.zeros(ids.numel(), dtype=torch.bool)
                mask[start:] = True
                seqs.append(Sequence(ids, feats.half(), mask, None if aux is None else aux.half()))
        else:
            feats, aux = forward_features(model, [b[1] for b in batch], pad_id, aux_layers)
            seqs = [Sequence(torch.tensor(b[1]), f.half(), torch.tensor(b[2], dtype=torch.bool),
                             None if a is None else a.half()) for b, f, a in zip(batch, feats, aux)]  # fmt: skip
        meta["hidden_size"] = seqs[0].features.shape[-1]
        num = write_shard(path, seqs, ids=[b[0] for b in batch])
        record_source(index)
        done_tokens += num
        bar.update(num)
        write_meta()
    bar.close()
    write_meta(sequences_reached=counts["sequences"])  # items rendered up to the stop (all without a budget)
    return meta


def write_shard(path: str, seqs: list[Sequence], ids: list[str] | None = None) -> int:
    lengths = torch.tensor([s.input_ids.numel() for s in seqs])
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in seqs]).to(torch.int32),
        "features": torch.cat([s.features for s in seqs]).to(torch.float16).contiguous(),
        "loss_mask": torch.cat([s.loss_mask for s in seqs]).to(torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    }
    if seqs[0].aux_features is not None:
        tensors["aux_features"] = torch.cat([s.aux_features for s in seqs]).to(torch.float16).contiguous()
    if not all(torch.isfinite(tensors[k].float()).all() for k in ("features", "aux_features") if k in tensors):
        raise ValueError("features overflow fp16")
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"ids": json.dumps(ids or [])})
    os.replace(tmp, path)
    return int(lengths.sum())


_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
           "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


def open_shard(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors shard as views of a copy-on-write memory map of the file: nothing is read
    until touched and nothing is copied into the process, so a feature set larger than RAM trains from the page
    cache. (safetensors' own loaders copy every tensor.)"""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + header_size)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if end > data.size or info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} ({info['dtype']}, bytes {start}-{end}) is truncated or of an "
                             "unknown dtype; delete the shard and extract again (extraction resumes)")  # fmt: skip
        dtype = _DTYPES[info["dtype"]]
        raw = torch.from_numpy(data[start:end])
        tensors[name] = (raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype)).view(info["shape"])
    return tensors


def setting_changes(saved: dict, now: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """Lists "key: old -> new" for each setting of `now` that `saved` records with another value (keys it lacks are
    not compared): what refuses a resume, of an extraction folder or of a training checkpoint."""
    return [f"{k}: {saved[k]!r} -> {v!r}" for k, v in now.items() if k not in skip and k in saved and saved[k] != v]


_SHARD_NAME = re.compile(r"shard_([0-9]{5}|[1-9][0-9]{5,})\.safetensors")  # what shard_name writes, and only that


def shard_name(index: int) -> str:
    """The file name of a folder's shard `index` (batch `index` of its work list): shard_00042.safetensors."""
    return f"shard_{index:05d}.safetensors"


def shard_index(path: str) -> int:
    """The index that a shard's file name holds (the inverse of `shard_name`); a ValueError for any other name."""
    match = _SHARD_NAME.fullmatch(os.path.basename(path))
    if match is None:
        raise ValueError(f"{path} is not a feature shard's name (shard_<index, 5+ digits>.safetensors)")
    return int(match.group(1))


def shard_paths(folders: list[str]) -> list[str]:
    """Every shard under the given folders, in folder then shard-index order (past 99,999 the names grow a digit,
    so their string order is not their index order)."""
    return [os.path.join(folder, name) for folder in folders
            for name in sorted((n for n in os.listdir(folder) if _SHARD_NAME.fullmatch(n)), key=shard_index)]


def shard_spans(shard: dict[str, torch.Tensor]) -> Iterator[tuple[int, int]]:
    """(first row, end row) of each sequence of an opened shard."""
    offsets = shard["offsets"].tolist()
    return zip(offsets[:-1], offsets[1:])


def shard_sequence_ids(path: str) -> list[str]:
    """The sequence ids a shard names (kept in its safetensors header's metadata)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return json.loads(header.get("__metadata__", {}).get("ids", "[]"))


def stored_prompt_context(folder: str) -> int | None:
    """The prompt positions a folder keeps before each answer (`rebuild_features(max_prompt_context=)`, `cut_folder`);
    None: whole prompts."""
    path = os.path.join(folder, "meta.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("max_prompt_context")


def context_start(loss_mask: torch.Tensor, max_prompt_context: int | None) -> int:
    """Where a sequence ((T,) loss mask) starts when cut to at most `max_prompt_context` positions before its first
    assistant token: 0 for None or a shorter prompt. The features of what is cut still shaped the ones kept (they
    come from the target's forward over the whole sequence), so a cut row is for training, not for a rebuild."""
    if max_prompt_context is None:
        return 0
    answers = loss_mask.nonzero()  # (A, 1)
    first = int(answers[0]) if answers.numel() else loss_mask.numel()
    return max(0, first - max_prompt_context)


def cut_prompt(seq: Sequence, max_prompt_context: int | None) -> Sequence:
    """`seq` from `context_start` on (views, no copy)."""
    a = context_start(seq.loss_mask, max_prompt_context)
    return Sequence(seq.input_ids[a:], seq.features[a:], seq.loss_mask[a:],
                    None if seq.aux_features is None else seq.aux_features[a:])  # fmt: skip


def shard_sequences(data: dict[str, torch.Tensor]) -> Iterator[Sequence]:
    """The sequences of an opened shard (features as views of it)."""
    aux = data.get("aux_features")
    for a, b in shard_spans(data):
        yield Sequence(data["input_ids"][a:b].long(), data["features"][a:b], data["loss_mask"][a:b].bool(),
                       None if aux is None else aux[a:b])  # fmt: skip


def iter_shards(paths: list[str]) -> Iterator[Sequence]:
    """Sequences of every shard under the given folders, in shard order (views of the memory-mapped shards)."""
    for path in shard_paths(paths):
        yield from shard_sequences(open_shard(path))
