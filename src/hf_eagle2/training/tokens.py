"""Token archives: a feature folder without its features, and the folder rebuilt from one.

Self-distillation is the slow part of extraction (the target writes every answer token by token: ~200 tokens/s
on 2 CPU cores), the features are not (one teacher-forced forward per batch). A folder's tokens are a sliver of
its bytes (SmolLM2: 0.66 bytes per token compressed, against 1.2 kB of features, 4.6 kB with EAGLE-3's), so
`export_tokens` keeps them (ids, loss masks, the shard each sequence is in, its id and the folder's meta.json)
in one compressed `.npz` that can travel with the code, and `rebuild_features`
runs only the forward again, shard by shard, into a folder that `extract` then treats as its own: same
meta.json, shard i holding batch i of the same work list, so `extract --max-tokens` extends it with new answers
(when the rebuild ran in the answers' dtype; a folder rebuilt in another is for training only).

Rebuilt shards hold the original tokens, masks and boundaries; their features equal the extracted ones to float
rounding (extraction records them from generate's prefill and decode steps, the rebuild from teacher-forced
padded forwards; on another machine the kernels' rounding adds to that, as a new extraction's would). A folder
for training only may keep just the prompt positions a training run reads (`max_prompt_context`, `cut_folder`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .features import (SETTING_DEFAULTS, Sequence, aux_layer_ids, cut_prompt, forward_features, open_shard,
                       setting_changes, shard_index, shard_name, shard_paths, shard_sequence_ids, shard_sequences,
                       shard_spans, write_shard)

ARCHIVE_VERSION = 1


def export_tokens(folder: str, path: str) -> dict:
    """Writes `path` (.npz) from the feature folder: every shard's token ids, loss masks and sequence ids, and
    the folder's meta.json. Returns a summary (tokens, sequences, shards, bytes)."""
    shards, meta = _folder(folder, "export")
    if meta.get("max_prompt_context") is not None:
        raise ValueError(f"{folder} keeps only {meta['max_prompt_context']} prompt positions before each answer: the "
                         "features of its rows came from whole prompts, so an archive of the cut rows would rebuild "
                         "other features; export the folder of whole prompts (or keep the archive it was rebuilt "
                         "from)")  # fmt: skip
    indices = [shard_index(path) for path in shards]
    if indices != list(range(len(shards))):
        missing = [shard_name(i) for i in sorted(set(range(indices[-1] + 1)) - set(indices))]
        raise ValueError(f"{folder} lacks {len(missing)} shard(s) before its last ({missing[0]} first): an archive "
                         "numbers its shards 0..n-1, so it would renumber them; fill the gap first")
    shards_read = []
    for shard in shards:
        tensors = open_shard(shard)
        sequence_ids = shard_sequence_ids(shard)
        spans = list(shard_spans(tensors))
        if len(sequence_ids) != len(spans):
            raise ValueError(f"{shard} names {len(sequence_ids)} sequences but holds {len(spans)}")
        ids, mask = tensors["input_ids"].numpy(), tensors["loss_mask"].numpy()  # views of the memory map
        shards_read.append([(name, ids[a:b], mask[a:b]) for name, (a, b) in zip(sequence_ids, spans)])
    return write_archive(path, meta, shards_read)


def write_archive(path: str, meta: dict, shards: list[list[tuple[str, list[int] | np.ndarray, list[bool] | np.ndarray]]]
                  ) -> dict:  # fmt: skip
    """Writes `path` (.npz, atomically): per shard its sequences as (sequence id, token ids, loss mask), lists or
    numpy arrays, and `meta` (its tokens and shards counts set to what is written). Returns a summary (tokens,
    sequences, shards, bytes)."""
    seqs = [seq for shard in shards for seq in shard]
    return save_arrays(path, meta,
                       input_ids=np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids, _ in seqs]),
                       loss_mask=np.concatenate([np.asarray(mask, dtype=bool) for _, _, mask in seqs]),
                       lengths=np.array([len(ids) for _, ids, _ in seqs]),
                       shard_sequences=np.array([len(shard) for shard in shards]),
                       sequence_ids=[name for name, _, _ in seqs])  # fmt: skip


def save_arrays(path: str, meta: dict, *, input_ids: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray,
                shard_sequences: np.ndarray, sequence_ids: list[str]) -> dict:  # fmt: skip
    """Writes `path` (.npz, atomically) from the archive's arrays as `TokenArchive` holds them (all sequences end to
    end); `meta` gets its tokens and shards counts from them. Returns a summary (tokens, sequences, shards, bytes)."""
    small = input_ids.max(initial=0) < 2**16  # most vocabularies: half the bytes
    meta = meta | {"tokens": int(input_ids.size), "shards": len(shard_sequences)}
    tmp = path + ".tmp.npz"
    np.savez_compressed(
        tmp,
        version=np.array(ARCHIVE_VERSION),
        input_ids=input_ids.astype(np.uint16 if small else np.int32),
        loss_mask=np.packbits(loss_mask.astype(bool)),
        lengths=lengths.astype(np.int32),
        shard_sequences=shard_sequences.astype(np.int32),
        sequence_ids=np.array(sequence_ids, dtype=str),
        meta=np.array(json.dumps(meta)),
    )
    os.replace(tmp, path)
    return {"tokens": int(input_ids.size), "sequences": len(sequence_ids), "shards": len(shard_sequences),
            "bytes": os.path.getsize(path)}  # fmt: skip


@dataclass
class TokenArchive:
    """An archive's arrays as stored (all sequences end to end), read a shard at a time: tens of millions of
    tokens stay a few bytes each in numpy until their shard's forward needs them as lists."""

    meta: dict
    input_ids: np.ndarray  # (tokens,) uint16 or int32
    loss_mask: np.ndarray  # (tokens,) bool
    lengths: np.ndarray  # (sequences,) tokens per sequence
    shard_sequences: np.ndarray  # (shards,) sequences per shard
    sequence_ids: list[str]  # (sequences,)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def _sequences(self, index: int) -> range:
        first = int(self.shard_sequences[:index].sum())
        return range(first, first + int(self.shard_sequences[index]))

    def shard_ids(self, index: int) -> list[str]:
        """The sequence ids of shard `index`."""
        seqs = self._sequences(index)
        return self.sequence_ids[seqs.start : seqs.stop]

    def shard_tokens(self, index: int) -> int:
        """Tokens in shard `index`."""
        seqs = self._sequences(index)
        return int(self.lengths[seqs.start : seqs.stop].sum())

    def shard(self, index: int) -> list[tuple[str, list[int], list[bool]]]:
        """Shard `index`'s sequences as (sequence id, token ids, loss mask)."""
        seqs = self._sequences(index)
        lengths = self.lengths[seqs.start : seqs.stop]
        ends = int(self.lengths[: seqs.start].sum()) + np.cumsum(lengths)  # this shard's offsets only
        return [(self.sequence_ids[i], self.input_ids[end - n : end].tolist(), self.loss_mask[end - n : end].tolist())
                for i, n, end in zip(seqs, lengths.tolist(), ends.tolist())]  # fmt: skip


def read_tokens(path: str) -> TokenArchive:
    """The archive at `path` (checked: version, and one mask bit and one shard per sequence)."""
    with np.load(path, allow_pickle=False) as archive:
        if int(archive["version"]) != ARCHIVE_VERSION:
            raise ValueError(f"{path}: token archive version {int(archive['version'])}, this reader knows {ARCHIVE_VERSION}")
        lengths = archive["lengths"].astype(np.int64)
        read = TokenArchive(
            meta=json.loads(str(archive["meta"])),
            input_ids=archive["input_ids"],
            loss_mask=np.unpackbits(archive["loss_mask"], count=int(lengths.sum())).astype(bool),
            lengths=lengths,
            shard_sequences=archive["shard_sequences"].astype(np.int64),
            sequence_ids=archive["sequence_ids"].tolist(),
        )
    counts = (int(read.shard_sequences.sum()), len(read.sequence_ids), read.lengths.size)
    if read.input_ids.size != read.tokens or len(set(counts)) != 1:
        raise ValueError(f"{path}: token, sequence and shard counts disagree (a damaged archive)")
    return read


def rebuild_features(model, path: str, out_dir: str, *, pad_id: int = 0, eagle3: bool | None = None,
                     shards: range | None = None, max_prompt_context: int | None = None, progress: bool = True
                     ) -> dict:  # fmt: skip
    """Features of the archive's sequences under `model`, written to `out_dir` shard by shard (resumable: existing
    shards are kept). `eagle3` (default: as the archive's folder) also stores the three layers an EAGLE-3 head
    reads; `shards` (default: all) rebuilds only those shard indices, e.g. the answers a head has not been trained
    on yet (a later call with another range fills in more of the same folder; meta `tokens` and `shards` count
    the shards present). Returns the folder's meta.json.

    The target may run in another dtype than the one that wrote the answers (meta `dtype`), e.g. float32 on a CPU
    without native bf16, where a bf16 forward is ~4.5x slower: the meta then records it as `feature_dtype`, and
    `extract` refuses to extend that folder (its new answers and features would be of one dtype, its old ones not;
    extend the folder of the answers' dtype, export it and rebuild).

    `max_prompt_context` stores each sequence from at most that many positions before its first answer token on
    (meta `max_prompt_context`; features still from the forward over the whole sequence): what a training run of
    the same `max_prompt_context` or less reads, in ~30% less disk for prompts of 384-1,024 tokens. Such a folder
    is for training only (`export_tokens` and `extract` refuse it), and every shard of a folder has one cut
    (`cut_folder` cuts a folder's existing shards)."""
    if max_prompt_context is not None and max_prompt_context < 1:
        raise ValueError(f"max_prompt_context must be >= 1 (None keeps whole prompts), got {max_prompt_context}")
    archive = read_tokens(path)
    meta = archive.meta
    if meta.get("prompts_only"):
        raise ValueError(f"{path} holds prompts only (export-prompts): answer them first (hf-eagle2 answer)")
    if meta.get("first_shard", 0):
        raise ValueError(f"{path} starts at work-list shard {meta['first_shard']}: join it after the archive of the "
                         "shards before it (hf-eagle2 join-tokens), so shard files keep their "
                         "work-list numbers")  # fmt: skip
    dtype = str(model.dtype).removeprefix("torch.")
    vocab = model.get_output_embeddings().weight.shape[0]
    if archive.input_ids.max(initial=0) >= vocab:
        raise ValueError(f"{path} holds token ids outside this target's vocabulary ({vocab}): another target's tokens")
    aux_layers = aux_layer_ids(model) if (bool(meta.get("aux_layers")) if eagle3 is None else eagle3) else ()
    meta = meta | {"aux_layers": list(aux_layers), "feature_dtype": dtype}
    if max_prompt_context is not None:
        meta["max_prompt_context"] = max_prompt_context
    meta.pop("sequences_reached", None)  # where a budgeted run stopped in the work list: not known for a rebuild
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "meta.json")
    if shard_paths([out_dir]) and os.path.exists(meta_path):
        with open(meta_path) as f:
            saved = SETTING_DEFAULTS | json.load(f)
        if saved.get("max_prompt_context") != max_prompt_context:
            raise ValueError(f"{out_dir} keeps {_kept(saved.get('max_prompt_context'))}, this rebuild would keep "
                             f"{_kept(max_prompt_context)}: one folder, one cut (hf-eagle2 cut-features cuts a "
                             "folder's shards)")  # fmt: skip
        changed = setting_changes(saved, meta, skip=("tokens", "shards", "hidden_size"))
        if changed:
            raise ValueError(f"{out_dir} holds shards made with other settings ({'; '.join(changed)})")
    every = range(len(archive.shard_sequences))
    if shards is not None and (not shards or shards[0] not in every or shards[-1] not in every):
        raise ValueError(f"shards {shards.start}-{shards.stop - 1}: the archive holds shards 0-{every.stop - 1}")
    todo = every if shards is None else shards
    bar = tqdm(total=sum(archive.shard_tokens(i) for i in todo), unit="tok", desc="rebuild features",
               disable=not progress)  # fmt: skip
    stored: dict[int, int] = {}  # tokens in each shard file (fewer than the archive's where cut)
    for index in todo:
        out = os.path.join(out_dir, shard_name(index))
        size = archive.shard_tokens(index)
        if not os.path.exists(out):
            shard = archive.shard(index)
            feats, aux = forward_features(model, [seq[1] for seq in shard], pad_id, aux_layers)
            seqs = [cut_prompt(Sequence(torch.tensor(s[1]), f.half(), torch.tensor(s[2], dtype=torch.bool),
                                        None if a is None else a.half()), max_prompt_context)
                    for s, f, a in zip(shard, feats, aux)]  # fmt: skip
            meta["hidden_size"] = seqs[0].features.shape[-1]
            stored[index] = write_shard(out, seqs, ids=[s[0] for s in shard])
        bar.update(size)
        present = [i for i in every if os.path.exists(os.path.join(out_dir, shard_name(i)))]
        for i in present:
            if i not in stored:
                stored[i] = int(open_shard(os.path.join(out_dir, shard_name(i)))["offsets"][-1])
        meta.update(tokens=sum(stored[i] for i in present), shards=len(present))
        _write_meta(out_dir, meta)
    bar.close()
    return meta


def _kept(max_prompt_context: int | None) -> str:
    return "whole prompts" if max_prompt_context is None else f"{max_prompt_context} prompt positions before each " \
        "answer"


def cut_folder(folder: str, max_prompt_context: int, archive: str, progress: bool = True) -> dict:
    """Cuts a feature folder's shards in place to what `rebuild_features(max_prompt_context=)` would have stored:
    each sequence from at most `max_prompt_context` positions before its first answer token on. meta.json records
    the cut first, then each shard is rewritten atomically, so a stopped cut is finished by running it again.
    A cut never grows back: a folder already cut to fewer positions is refused. Returns the folder's meta.json.

    The cut drops prompt tokens for good (a cut folder cannot be exported), so `archive` must be a token archive
    that holds every shard of the folder, whole (`export_tokens` of it before the cut, or the archive it was
    rebuilt from): each shard's sequence ids are checked against it first."""
    if max_prompt_context < 1:
        raise ValueError(f"max_prompt_context must be >= 1, got {max_prompt_context}")
    shards, meta = _folder(folder, "cut")
    tokens_kept = read_tokens(archive)
    names = {path: shard_sequence_ids(path) for path in shards}
    for path in shards:
        index = shard_index(path)
        if index >= len(tokens_kept.shard_sequences) or names[path] != tokens_kept.shard_ids(index):
            raise ValueError(f"{archive} does not hold {os.path.basename(path)}'s sequences: the cut would drop "
                             "prompt tokens kept nowhere else; export the folder first (hf-eagle2 export-tokens) "
                             "and name that archive")  # fmt: skip
    kept = meta.get("max_prompt_context")
    if kept is not None and kept < max_prompt_context:
        raise ValueError(f"{folder} keeps only {kept} prompt positions before each answer: a cut cannot grow back "
                         f"to {max_prompt_context}")  # fmt: skip
    meta["max_prompt_context"] = max_prompt_context
    _write_meta(folder, meta)
    tokens = 0
    for path in tqdm(shards, unit="shard", desc="cut features", disable=not progress):
        data = open_shard(path)
        seqs = list(shard_sequences(data))
        cut = [cut_prompt(seq, max_prompt_context) for seq in seqs]
        if any(c.input_ids.numel() != s.input_ids.numel() for c, s in zip(cut, seqs)):
            tokens += write_shard(path, cut, ids=names[path])
        else:
            tokens += int(data["offsets"][-1])
    meta["tokens"] = tokens
    _write_meta(folder, meta)
    return meta


def _folder(folder: str, what: str) -> tuple[list[str], dict]:
    """A feature folder's shard paths and meta.json (ValueError if it has neither)."""
    meta_path = os.path.join(folder, "meta.json")
    shards = shard_paths([folder])
    if not shards or not os.path.exists(meta_path):
        raise ValueError(f"{folder} holds no extracted shards with a meta.json: nothing to {what}")
    with open(meta_path) as f:
        return shards, json.load(f)


def _write_meta(folder: str, meta: dict) -> None:
    """meta.json, atomically."""
    path = os.path.join(folder, "meta.json")
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(path + ".tmp", path)
