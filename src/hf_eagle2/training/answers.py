"""Self-distilled answers written on another machine: the work list's prompts go out as a token archive, the
target's greedy (or sampled: `Sampling`) answers come back as one, and `rebuild-features` computes the features
where the training runs.

Why: on 2 CPU cores the answers are the slow part of self-distillation (the (384, 1024] prompt band: ~105 answer
tokens/s from `extract`, against ~645 tokens/s for `rebuild-features` over prompt + answer), and an accelerator
writes a band's answers in minutes. Both directions are token ids, a few MB (what a lent machine can be sent
and can send back); the features (4.6 kB per token with EAGLE-3's) never travel.

* `export_prompts`: the prompts of work-list batches `shards` (the shards `extract` would write with the same
  settings: same `work_items`, same batching, same meta), as an archive of prompt-only sequences (loss masks all
  0), `prompts_only` and `first_shard` in its meta.
* `answer_prompts`: each prompt's greedy answer by `generate_with_features` (extract's own generate path: reserved
  cache, grouped prefill, EOS fed back, the answer cut at its first EOS or max_new_tokens), whole shards at a time
  in order, until the work or a time limit ends; writes the answered shards as a token archive (prompt + answer,
  the answer masked in) after every group, so a stopped run keeps its shards and a second run continues them.
* `join_archives`: archives of consecutive shards of one work list (e.g. `export-tokens` of the folder's first
  shards, then the answered rest) as one, which `rebuild-features` turns into the folder.

Answers written on another device are the same greedy answers but for rounding: in bf16 a near tie between the top
two logits can go either way under another kernel (as it does between two CPU code paths, training_data/README.md).
The joined archive records which machine answered which shards (`answer_sources`).
"""

from __future__ import annotations

import os
from time import monotonic

import numpy as np
from tqdm.auto import tqdm

from .features import (SETTING_DEFAULTS, Sampling, _batches, aux_layer_ids, check_work_settings, device_description,
                       extraction_meta, generate_with_features, pad_and_eos_ids, work_items)
from .tokens import TokenArchive, read_tokens, save_arrays, write_archive

# meta keys that say where or how much, or describe features rather than tokens: archives that differ only in these
# join (a resume also compares answered_on: one archive's answers come from one machine)
_PLACE_KEYS = ("tokens", "shards", "hidden_size", "feature_dtype", "first_shard", "answered_on", "answer_sources",
               "sequences_reached")  # fmt: skip


def _setting_differences(a: dict, b: dict, skip: tuple[str, ...]) -> list[str]:
    """'key: a -> b' for every setting (the union of both metas' keys, minus `skip`) the two disagree on."""
    a, b = SETTING_DEFAULTS | a, SETTING_DEFAULTS | b
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if k not in skip and a.get(k) != b.get(k)]  # fmt: skip


def export_prompts(model, tokenizer, path: str, shards: range, *, turns: str, max_prompt_tokens: int,
                   min_prompt_tokens: int, max_new_tokens: int, batch_size: int, split: str = "train",
                   eagle3: bool = False, sharegpt_file: str | None = None) -> dict:  # fmt: skip
    """Writes `path` (.npz): the prompts of work-list batches `shards` (to the list's end if it is shorter) as
    prompt-only sequences. The work-list settings have no defaults here: they must be the folder's (extract's own
    defaults differ from a band's). `model` gives the meta `extract` would write (its dtype is the one the answers
    are to be written in, its depth the EAGLE-3 layers). Returns a summary (shards, sequences, tokens, bytes)."""
    check_work_settings("target", turns, min_prompt_tokens, max_prompt_tokens)
    if not shards or shards.start < 0:
        raise ValueError(f"shards {shards.start}-{shards.stop - 1}: not a range of work-list batches")
    items = work_items(tokenizer, responses="target", split=split, turns=turns, min_prompt_tokens=min_prompt_tokens,
                       max_prompt_tokens=max_prompt_tokens, max_seq_tokens=1024,
                       sharegpt_file=sharegpt_file)  # fmt: skip
    meta = extraction_meta(model, responses="target", split=split, turns=turns, max_new_tokens=max_new_tokens,
                           max_prompt_tokens=max_prompt_tokens, min_prompt_tokens=min_prompt_tokens,
                           max_seq_tokens=1024, batch_size=batch_size,
                           aux_layers=aux_layer_ids(model) if eagle3 else ())  # fmt: skip
    picked = []
    for index, batch in enumerate(_batches(items, batch_size)):
        if index >= shards.stop:
            break
        if index >= shards.start:
            picked.append([(sid, ids, [False] * len(ids)) for sid, ids, _ in batch])
    if not picked:
        raise ValueError(f"the work list ends before shard {shards.start}: no prompts to export")
    meta |= {"prompts_only": True, "first_shard": shards.start}
    return write_archive(path, meta, picked)


def answer_prompts(model, tokenizer, prompts_path: str, out_path: str, *, rows_per_call: int = 64,
                   rows_per_write: int = 2048, time_limit: float | None = None, sampling: Sampling | None = None,
                   progress: bool = True) -> dict:  # fmt: skip
    """Greedy answers to the prompts of `prompts_path` (`export_prompts`), written to `out_path` as a token archive
    of the answered shards (resumes: shards already in `out_path` are kept). Groups of whole shards of about
    `rows_per_write` rows are answered in calls of `rows_per_call` rows of similar prompt lengths (sorted within
    the group: less padding), and the archive is rewritten after each group; no group is started that the last
    one's duration says would end past `time_limit` seconds. Returns a summary.

    sampling: answers drawn at its temperature instead; each call's seed derives from its seed, the group's first
    shard (of the whole work list) and the call's number within the group, so a resumed run draws what one whole
    run would have on the same machine. The meta's `sampling` records it with `rows_per_write` and
    `rows_per_call` (they set the groups and calls), so such an archive resumes and joins only with answers drawn
    alike."""
    prompts = read_tokens(prompts_path)
    if not prompts.meta.get("prompts_only"):
        raise ValueError(f"{prompts_path} is not a prompt archive (export-prompts): it holds answers already")
    dtype = str(model.dtype).removeprefix("torch.")
    if dtype != prompts.meta["dtype"]:
        raise ValueError(f"{prompts_path} was exported for answers in {prompts.meta['dtype']}; this target runs in "
                         f"{dtype} (answers of one folder are written in one dtype)")  # fmt: skip
    if prompts.input_ids.max(initial=0) >= model.get_output_embeddings().weight.shape[0]:
        raise ValueError(f"{prompts_path} holds token ids outside this target's vocabulary: another target's prompts")
    pad_id, eos_ids = pad_and_eos_ids(model, tokenizer)
    meta = {k: v for k, v in prompts.meta.items() if k != "prompts_only"} | {"answered_on": device_description(model)}
    meta["sampling"] = None if sampling is None else sampling.meta() | {"rows_per_write": rows_per_write,
                                                                          "rows_per_call": rows_per_call}
    total = len(prompts.shard_sequences)
    done = _answered_so_far(out_path, prompts, meta)
    max_new = int(meta["max_new_tokens"])
    clock, last_group_s = monotonic(), 0.0
    bar = tqdm(total=prompts.tokens, initial=sum(prompts.shard_tokens(i) for i in range(len(done))), unit="prompt tok",
               desc="answers", disable=not progress)  # fmt: skip
    while len(done) < total:
        if time_limit is not None and monotonic() - clock + last_group_s > time_limit:
            break
        started = monotonic()
        group, rows = [], 0
        while len(done) + len(group) < total and (not group or rows + prompts.shard_sequences[len(done) + len(group)]
                                                   <= rows_per_write):  # fmt: skip
            rows += int(prompts.shard_sequences[len(done) + len(group)])
            group.append(len(done) + len(group))
        seqs = [(sid, ids) for shard in group for sid, ids, _ in prompts.shard(shard)]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][1]))
        answered: list[list[int] | None] = [None] * len(seqs)
        for call, first_row in enumerate(range(0, len(order), rows_per_call)):
            picked = order[first_row : first_row + rows_per_call]
            drawn = None if sampling is None else sampling.for_call(int(meta["first_shard"]) + group[0], call)
            results = generate_with_features(model, [seqs[i][1] for i in picked], max_new, eos_ids, pad_id,
                                             sampling=drawn)  # fmt: skip
            for i, (ids, _, _, _) in zip(picked, results):
                answered[i] = ids.tolist()
        position = 0
        for shard in group:
            count = int(prompts.shard_sequences[shard])
            done.append([(sid, full, [False] * len(prompt) + [True] * (len(full) - len(prompt)))
                         for (sid, prompt), full in zip(seqs[position : position + count],
                                                        answered[position : position + count])])  # fmt: skip
            position += count
        write_archive(out_path, meta, done)
        last_group_s = monotonic() - started
        bar.update(sum(prompts.shard_tokens(i) for i in group))
    bar.close()
    answer_tokens = sum(sum(mask) for shard in done for _, _, mask in shard)
    return {"shards": len(done), "of": total, "first_shard": meta["first_shard"], "answer_tokens": answer_tokens,
            "seconds": round(monotonic() - clock, 1), "answered_on": meta["answered_on"],
            "sampling": meta["sampling"]}  # fmt: skip


def _answered_so_far(out_path: str, prompts: TokenArchive, meta: dict) -> list[list[tuple[str, list[int], list[bool]]]]:
    """The shards an earlier run wrote to `out_path`, checked to answer the same prompts with the same settings."""
    if not os.path.exists(out_path):
        return []
    previous = read_tokens(out_path)
    resume_skip = tuple(k for k in _PLACE_KEYS if k not in ("answered_on", "first_shard"))
    changed = _setting_differences(previous.meta, meta, resume_skip)
    if changed:
        raise ValueError(f"{out_path} holds answers to other prompts, settings or from another machine "
                         f"({'; '.join(changed)}): answer into another file (export-prompts from the next shard, "
                         "then join-tokens)")  # fmt: skip
    done = [previous.shard(i) for i in range(len(previous.shard_sequences))]
    for index, shard in enumerate(done):
        asked = prompts.shard(index)
        if len(shard) != len(asked) or [(sid, ids[: len(p)]) for (sid, ids, _), (_, p, _) in zip(shard, asked)] != \
                [(s, p) for s, p, _ in asked]:  # fmt: skip
            raise ValueError(f"{out_path}: shard {meta['first_shard'] + index} answers other prompts than {index} of "
                             "the prompt archive")  # fmt: skip
    return done


def join_archives(paths: list[str], out_path: str) -> dict:
    """One archive of consecutive shards from `paths` (each starting where the one before it ends, with the same
    settings, none prompt-only); its meta is the first's, with `answer_sources` listing which machine answered
    which shards. Returns a summary."""
    parts = [read_tokens(p) for p in paths]
    base = parts[0].meta
    first = int(base.get("first_shard", 0))
    sources, next_shard = [], first
    for path, part in zip(paths, parts):
        if part.meta.get("prompts_only"):
            raise ValueError(f"{path} holds prompts only: answer it first (hf-eagle2 answer)")
        changed = _setting_differences(base, part.meta, _PLACE_KEYS + ("prompts_only",))
        if changed:
            raise ValueError(f"{path} was made with other settings than {paths[0]} ({'; '.join(changed)})")
        start = int(part.meta.get("first_shard", 0))
        if start != next_shard:
            raise ValueError(f"{path} starts at shard {start}; the archives before it end at shard {next_shard - 1}")
        end = start + len(part.shard_sequences)
        where = part.meta.get("answered_on", "extract, on the machine that wrote the folder (not recorded)")
        sources += part.meta.get("answer_sources") or [{"shards": [start, end - 1], "answered_on": where}]
        next_shard = end
    seen = set()
    for path, part in zip(paths, parts):
        if seen & set(part.sequence_ids):
            raise ValueError(f"{path} holds sequences an archive before it holds too: not one work list's shards")
        seen |= set(part.sequence_ids)
    meta = {k: v for k, v in base.items() if k not in ("answered_on", "sequences_reached")}
    meta["answer_sources"] = sources
    if first == 0:
        meta.pop("first_shard", None)
    return save_arrays(out_path, meta,  # the parts' arrays end to end: no sequence is unpacked
                       input_ids=np.concatenate([part.input_ids.astype(np.int64) for part in parts]),
                       loss_mask=np.concatenate([part.loss_mask for part in parts]),
                       lengths=np.concatenate([part.lengths for part in parts]),
                       shard_sequences=np.concatenate([part.shard_sequences for part in parts]),
                       sequence_ids=[sid for part in parts for sid in part.sequence_ids])  # fmt: skip

