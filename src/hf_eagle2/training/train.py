"""Training an EAGLE-1/2 or EAGLE-3 head on stored target features.

Loss, as in EAGLE-1/2, at every position t whose next token is an assistant token:

    input   (feature_t + noise, token_{t+1})            noise ~ U(-a, a), a = noise_std / 2 * 512 / seq_len
    output  feature^_{t+1} = head(...)
    loss    SmoothL1(feature^_{t+1}, feature_{t+1})  +  ce_weight * CE(p, softmax(W feature^_{t+1}))

where p = softmax(W feature_{t+1}) is the target's own next-token distribution (soft labels) and W is the target's
lm_head restricted to the draft vocabulary (all of it when `draft_vocab_size` is None; otherwise the N most
frequent assistant tokens of the training data, as in EAGLE-3 / FR-Spec, with p renormalised over them).

EAGLE-3 (`head="eagle3"`, features stored with `aux_features`): the head reads fc(low, mid, high target
layers) at depth 1 and its own output after, scores its own lm_head over the draft vocabulary, and is trained
on the CE term alone (no feature regression: its output is not the target's feature), with `unroll` >= 2
training-time-test passes as in the paper (default noise off: the passes on its own predictions replace it).

AdamW with linear warm-up and cosine decay, gradient clipping and a seed. The batch order of every epoch is a
function of (seed, epoch) and the noise of every step a function of (seed, step), so a run stopped at any
checkpoint and resumed reproduces the uninterrupted run exactly; resuming with other data or settings that shape
the run is refused (`RUN_FIELDS`). `init` starts a new run from a trained head instead (its weights and draft
vocabulary): more data for a head, a training-time-test phase after a plain one, or an official head fine-tuned;
`grow_vocab` then adds the new data's frequent tokens the head's vocabulary lacks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..kernels.cpu import warn_if_bf16_emulated
from ..heads.modeling_eagle import EagleDraftModel
from ..heads.modeling_eagle3 import Eagle3DraftModel
from ..kernels.unrolled_attention import UnrolledMask
from .features import (aux_layer_ids, context_start, open_shard, pack_by_length, setting_changes, shard_paths,
                       shard_spans, stored_prompt_context)


@dataclass
class TrainConfig:
    data: list[str]
    out: str
    val_data: list[str] = field(default_factory=list)
    draft_vocab_size: int | None = 8192
    epochs: float = 4.0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    batch_tokens: int = 8192
    max_seq_len: int = 1024
    max_prompt_context: int | None = None  # rows start at most this many positions before their first assistant
    # token (see FeatureSet.load): long prompts then cost the head's training only their last positions
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    ce_weight: float = 0.1
    noise_std: float | None = None  # None: 0.2 for eagle2, 0 for eagle3 (its training-time test replaces it)
    seed: int = 0
    save_every: int = 100
    eval_every: int = 200
    max_steps: int | None = None  # stop early (the schedule still spans `epochs`)
    unroll: int | None = None  # "training-time test" passes on the head's own predictions (see eagle_loss);
    # None: 1 for eagle2, 3 for eagle3 (which needs >= 2: it is fed its own outputs from depth 2 on)
    head: str = "eagle2"  # "eagle2" (EAGLE-1/2 layout) or "eagle3" (needs features extracted with eagle3=True)
    head_intermediate_size: int | None = None  # a new head's MLP width (None: the target's); the draft step's
    # cost is mostly its MLP: a 1.5B-shaped level (k=4, bf16, 2-core Xeon) took 8.0 ms at 8,960, 4.1 at 4,480
    loss_positions: str = "answers"  # "answers": the assistant tokens (loss mask); "all": every position, user turns
    # and templates too (teacher-forced data holds the target's features and distribution everywhere: more trained
    # tokens per extracted one); held-out numbers stay on answers

    def __post_init__(self):
        if self.head not in ("eagle2", "eagle3"):
            raise ValueError(f"head must be 'eagle2' or 'eagle3', got {self.head!r}")
        if self.head_intermediate_size is not None and (self.head_intermediate_size < 1 or self.init):
            raise ValueError("head_intermediate_size sizes a new head's MLP (a positive width); a run from init keeps "
                             "that head's")  # fmt: skip
        if self.loss_positions not in ("answers", "all"):
            raise ValueError(f"loss_positions must be 'answers' or 'all', got {self.loss_positions!r}")
        eagle3 = self.head == "eagle3"
        if self.unroll is None:
            self.unroll = 3 if eagle3 else 1
        if self.noise_std is None:
            self.noise_std = 0.0 if eagle3 else 0.2
        if self.autocast not in (None, "bfloat16"):
            raise ValueError(f"autocast must be None or 'bfloat16', got {self.autocast!r}")
        if self.soft_labels not in ("float32", "bfloat16"):
            raise ValueError(f"soft_labels must be 'float32' or 'bfloat16', got {self.soft_labels!r}")
        if eagle3 and self.unroll < 2:
            raise ValueError("an EAGLE-3 head needs unroll >= 2: without training-time test it never sees its own "
                             "outputs, which it is fed from depth 2 on (the official recipe unrolls 7)")  # fmt: skip
        if self.lm_head_init is not None and not eagle3:
            raise ValueError("lm_head_init is for EAGLE-3 heads: an EAGLE-1/2 head scores with the target's own "
                             "lm_head, it has none to initialise")  # fmt: skip
        if self.lm_head_init is not None and self.init:
            raise ValueError(f"lm_head_init={self.lm_head_init!r} and init={self.init!r}: a run started from a "
                             "trained head keeps that head's lm_head")  # fmt: skip
        if self.lm_head_init is None and eagle3 and not self.init:
            self.lm_head_init = "target"
        if self.grow_vocab and (not self.init or self.draft_vocab_size is None):
            raise ValueError("grow_vocab grows a trained head's reduced draft vocabulary to draft_vocab_size: it "
                             "needs init and a draft_vocab_size")  # fmt: skip
        if self.freeze_lm_head and (not eagle3 or self.lm_head_init == "random" or self.grow_vocab):
            raise ValueError("freeze_lm_head keeps an EAGLE-3 head's lm_head at the target's rows: it needs "
                             "head='eagle3' and excludes lm_head_init='random' and grow_vocab")  # fmt: skip
        if self.lm_head_init not in (None, "target", "random"):
            raise ValueError(f"lm_head_init must be 'target' or 'random', got {self.lm_head_init!r}")
    snapshot_every_tokens: int | None = None  # also keep head snapshots (for τ-vs-tokens curves)
    threads: int | None = None
    autocast: str | None = None  # "bfloat16": the training step's matmuls in bf16 (fp32 weights, optimizer,
    # soft labels and evaluation); on a 2-core Xeon (AMX) 1.78x the tokens/s of an EAGLE-2 step, 1.54x of EAGLE-3;
    # slower than float32 on CPUs that emulate bf16 (no AVX512-BF16 or AMX: the Trainer warns there)
    soft_labels: str = "float32"  # the precision of the target's distribution the CE term matches: "bfloat16" is
    # the bf16 target's own (its lm_head rows and logits in bf16, softmax in fp32). In fp32 that GEMM (tokens x
    # draft vocabulary x hidden) was 24% of a 1.5B head's bf16-autocast step (py-spy, 2-core Xeon); with bf16
    # labels the step ran 1.17x faster
    init: str | None = None  # a head (folder or Hub id) to start from instead of a random one; its draft
    # vocabulary is kept, so draft_vocab_size must match it (unless grow_vocab)
    grow_vocab: bool = False  # with init: grow the head's draft vocabulary to draft_vocab_size with the most
    # frequent assistant tokens of this run's data it lacks (trained rows kept; an EAGLE-3 head's new lm_head rows
    # start at zero: see Eagle3DraftModel.grow_draft_vocab). A vocabulary chosen on a first stage's data misses
    # tokens a larger corpus needs: the SmolLM2 EAGLE-3 head's 8,192 (from 0.5M tokens) hold 92.6% of held-out
    # answer tokens, grown to 12,288 95.8% (benchmarks/vocab_coverage.py)
    lm_head_init: str | None = None  # a new EAGLE-3 head's own lm_head: "target" (default) starts it as the
    # target's lm_head rows of the draft vocabulary, "random" as a fresh Linear (see Trainer)
    freeze_lm_head: bool = False  # EAGLE-3: the lm_head is the target's rows of the draft vocabulary and stays
    # frozen (`Eagle3DraftModel.borrow_target_lm_head`); with init, the init head's body is kept and its lm_head
    # replaced, its draft vocabulary too if draft_vocab_size differs (None: the full vocabulary, no parameter cost)


# the settings that shape a run: a checkpoint resumes only with the same ones (the others, e.g. max_steps or
# save_every, may change between sessions)
RUN_FIELDS = ("data", "head", "init", "draft_vocab_size", "epochs", "lr", "min_lr_ratio", "warmup_steps",
              "batch_tokens", "max_seq_len", "max_prompt_context", "grad_clip", "weight_decay", "ce_weight",
              "noise_std", "seed", "unroll", "autocast", "lm_head_init", "grow_vocab", "freeze_lm_head",
              "loss_positions", "head_intermediate_size", "soft_labels")  # fmt: skip
# what a checkpoint from before a setting existed was made with
RUN_DEFAULTS = {"loss_positions": "answers", "head_intermediate_size": None, "soft_labels": "float32"}


@dataclass
class FeatureSet:
    """Training sequences: ids (N,) int64, mask (N,) bool and offsets (S + 1,) in memory; features (N, H) and,
    for EAGLE-3, aux (N, 3H) fp16 either as one tensor each or, as `load` gives them, a list of memory-mapped
    per-shard tensors with `rows` (S, 2) = (shard, first row) of each sequence in them (the features are ~99% of
    the bytes; the page cache, not the process, holds them)."""

    ids: torch.Tensor
    features: torch.Tensor | list[torch.Tensor]
    mask: torch.Tensor
    offsets: torch.Tensor
    aux: torch.Tensor | list[torch.Tensor] | None = None
    rows: torch.Tensor | None = None
    max_prompt_context: int | None = None  # the cut `load` applied (None: whole prompts)
    all_positions: bool = False  # `batch` masks in every real position (TrainConfig.loss_positions="all")
    target_top: torch.Tensor | None = None  # (N,) the target's greedy token after each row (`attach_target_top`)

    @staticmethod
    def load(folders: list[str], max_seq_len: int, aux: bool = False,
             max_prompt_context: int | None = None) -> "FeatureSet":  # fmt: skip
        """Sequences of every shard, cut to max_seq_len; those with no assistant token to predict are skipped.
        aux: also use the EAGLE-3 features (an error if a shard has none).
        max_prompt_context: start each sequence at most this many positions before its first assistant token.
        The target's features there already carry the prompt, so a long prompt costs the head's training a
        forward per position for context it may not need (what a head loses without it:
        `benchmarks/draft_recall.py --max-prompt-context`)."""
        if max_prompt_context is not None and max_prompt_context < 1:
            raise ValueError(f"max_prompt_context must be >= 1 (None keeps whole prompts), got {max_prompt_context}")
        for folder in folders:
            stored = stored_prompt_context(folder)
            if stored is not None and (max_prompt_context is None or max_prompt_context > stored):
                raise ValueError(f"{folder} keeps only {stored} prompt positions before each answer (its shards were "
                                 f"cut when stored): train it with max_prompt_context (--max-prompt-context) {stored} "
                                 "or less, or rebuild it whole (held-out folders, --val-data, are read whole: "
                                 "rebuild them without a cut)")  # fmt: skip
        ids, masks, rows, lengths, feats, auxs = [], [], [], [], [], []
        for path in shard_paths(folders):
            shard = open_shard(path)
            if aux and "aux_features" not in shard:
                raise ValueError(f"{path}: a shard without aux_features; extract with eagle3=True (--eagle3) to "
                                 "train an EAGLE-3 head")  # fmt: skip
            for a, b in shard_spans(shard):
                a += context_start(shard["loss_mask"][a:b], max_prompt_context)
                n = min(b - a, max_seq_len)
                mask = shard["loss_mask"][a : a + n].bool()
                if n < 3 or not bool(mask[1:].any()):
                    continue
                ids.append(shard["input_ids"][a : a + n].long())
                masks.append(mask)
                rows.append((len(feats), a))
                lengths.append(n)
            feats.append(shard["features"])
            if aux:
                auxs.append(shard["aux_features"])
        if not ids:
            raise ValueError(f"no usable sequences in {folders}")
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])
        return FeatureSet(torch.cat(ids), feats, torch.cat(masks), offsets, auxs if aux else None, torch.tensor(rows),
                          max_prompt_context)  # fmt: skip

    @property
    def num_sequences(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def _rows(self, source, i: int, n: int) -> torch.Tensor:
        """Rows of sequence i in `source` (features or aux), as stored (fp16)."""
        if self.rows is None:
            a = int(self.offsets[i])
            return source[a : a + n]
        shard, a = self.rows[i].tolist()
        return source[shard][a : a + n]

    @torch.no_grad()
    def attach_target_top(self, lm_head: torch.Tensor, chunk: int = 2048, cache_folder: str | None = None) -> None:
        """`target_top`: the argmax of the target's whole lm_head (V, H) over each stored feature row, i.e. the
        target's greedy choice there, in bf16 (ties within bf16 rounding may flip). `batch` then carries it as
        `top` (B, T), and held-out accuracy can be counted against the target's full vocabulary, so heads of
        different draft vocabularies compare fairly (a token outside a draft vocabulary is a miss).
        cache_folder: keep the result there, named by the lm_head's and the rows' digests (a 1.5B's 150k-row
        lm_head over 40k held-out rows takes minutes on a CPU)."""
        weight = lm_head.detach().to(torch.bfloat16)
        path = None
        if cache_folder is not None:
            digest = hashlib.sha1(weight.view(torch.int16).numpy().tobytes())
            digest.update(self.ids.numpy().tobytes())
            path = os.path.join(cache_folder, f"target_top.{digest.hexdigest()[:16]}.pt")
            if os.path.isfile(path):
                self.target_top = torch.load(path)
                return
        tops = []
        for i in range(self.num_sequences):
            rows = self._rows(self.features, i, int(self.offsets[i + 1] - self.offsets[i]))
            tops += [F.linear(rows[a : a + chunk].to(weight), weight).argmax(-1) for a in range(0, len(rows), chunk)]
        self.target_top = torch.cat(tops)
        if path is not None:
            torch.save(self.target_top, path + ".tmp")
            os.replace(path + ".tmp", path)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Right-padded batch of sequences: ids (B, T), features (B, T, H) float, mask (B, T), with aux
        features aux (B, T, 3H) float, and with `target_top` top (B, T)."""
        lengths = [int(self.offsets[i + 1] - self.offsets[i]) for i in indices]
        width = max(lengths)
        hidden = self._rows(self.features, indices[0], 1).shape[-1]
        ids = torch.zeros(len(indices), width, dtype=torch.long)
        feats = torch.zeros(len(indices), width, hidden)
        aux = None if self.aux is None else torch.zeros(len(indices), width, self._rows(self.aux, indices[0], 1).shape[-1])
        mask = torch.zeros(len(indices), width, dtype=torch.bool)
        top = None if self.target_top is None else torch.zeros(len(indices), width, dtype=torch.long)
        for row, (i, n) in enumerate(zip(indices, lengths)):
            a = int(self.offsets[i])
            ids[row, :n] = self.ids[a : a + n]
            if top is not None:
                top[row, :n] = self.target_top[a : a + n]
            feats[row, :n] = self._rows(self.features, i, n).float()
            mask[row, :n] = True if self.all_positions else self.mask[a : a + n]
            if aux is not None:
                aux[row, :n] = self._rows(self.aux, i, n).float()
        out = {"ids": ids, "features": feats, "mask": mask}
        return out | ({} if aux is None else {"aux": aux}) | ({} if top is None else {"top": top})


def token_frequencies(data: FeatureSet, vocab_size: int) -> torch.Tensor:
    """Counts of every token in assistant positions (the tokens the draft has to propose)."""
    return torch.bincount(data.ids[data.mask], minlength=vocab_size)


def select_draft_vocab(counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (ties by id), forced to include `always` (e.g. EOS), sorted by id."""
    order = torch.argsort(counts, descending=True, stable=True)
    chosen = list(dict.fromkeys([*always, *order.tolist()]))[:size]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def epoch_batches(lengths: torch.Tensor, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled batches of similar-length sequences with (rows x longest row) <= batch_tokens."""
    rng = random.Random(seed * 1000003 + epoch)
    order = list(range(lengths.numel()))
    rng.shuffle(order)
    sizes = lengths.tolist()
    window = 64  # sort within windows of 64 sequences to limit padding, keep the shuffle otherwise
    batches = []
    for start in range(0, len(order), window):
        batches += pack_by_length(order[start : start + window], sizes, batch_tokens)
    rng.shuffle(batches)
    return batches


def eagle_loss(head: EagleDraftModel, lm_weight: torch.Tensor, batch: dict, noise_std: float, ce_weight: float,
               generator: torch.Generator | None = None, unroll: int = 1, measure_passes: int = 0,
               label_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """EAGLE loss on a right-padded batch; lm_weight: (N, H) target lm_head rows of the draft vocabulary;
    label_weight: the same rows in the soft labels' precision (None: fp32, outside autocast; bf16 makes the labels
    the bf16 target's own distribution, and cheaper: in fp32 they were a quarter of a 1.5B-head step).

    unroll > 1 adds "training-time test" passes (as in EAGLE-3 / HASS): pass s feeds the head its own
    prediction from pass s-1 at the previous position, attending to the true pairs before it, to its own earlier
    drafted positions and to itself, exactly as tree depth s does at inference. The loss averages the passes;
    `acc` is reported for pass 1 (depth 1), `acc_deep` for the last pass.

    measure_passes > unroll runs the extra passes for their numbers only (no loss; call it under no_grad), so
    heads trained with and without training-time test are measured alike. With the batch's `top` (the target's
    greedy token over its whole vocabulary, `FeatureSet.attach_target_top`), `agree` lists per pass the share of
    positions where the head's top draft token is the target's greedy one: `acc` counts within the draft
    vocabulary, `agree` against the full one, the number that compares heads of different draft vocabularies.

    EAGLE-3 heads (`Eagle3DraftModel`): pass 1 reads `head.project_features` of the batch's `aux` features,
    the draft distribution is the head's own (`draft_logits`), the loss is the CE term alone and pass s weighs
    0.8 ** (s - 1), as in the official recipe."""
    eagle3 = isinstance(head, Eagle3DraftModel)
    ids, feats, mask = batch["ids"], batch["features"], batch["mask"]
    bsz, width, hidden = feats.shape
    device = lm_weight.device
    ids, feats, mask = ids.to(device), feats.to(device), mask.to(device)
    steps = width - 1
    if eagle3 and "aux" not in batch:
        raise ValueError("an EAGLE-3 head trains on aux features (three target layers): extract with eagle3=True")
    inputs = batch["aux"].to(device)[:, :-1] if eagle3 else feats[:, :-1]
    if noise_std > 0:
        amplitude = noise_std / 2 * 512 / width
        noise = torch.rand(inputs.shape, generator=generator, device="cpu").to(device)
        inputs = inputs + (noise * 2 - 1) * amplitude
    if eagle3:
        inputs = head.project_features(inputs)
    draft_logits = head.draft_logits if eagle3 else (lambda h: F.linear(h, lm_weight))  # noqa: E731
    positions = torch.arange(steps, device=device).expand(bsz, steps)
    with torch.no_grad():
        embeds = head.embed(ids[:, 1:])  # the target's (frozen) embeddings
    target = feats[:, 1:]
    sel = mask[:, 1:]
    target_sel = target[sel]
    with torch.no_grad(), torch.autocast(device.type, enabled=False):  # the soft labels' precision is label_weight's
        w = lm_weight if label_weight is None else label_weight
        target_p = F.softmax(F.linear(target_sel.to(w.dtype), w).float(), dim=-1)
    i = torch.arange(steps, device=device)
    past, total, infos, agree = None, 0.0, [], []
    weights = [0.8 ** (s - 1) if eagle3 else 1.0 for s in range(1, unroll + 1)]
    top = batch["top"].to(device)[:, 1:] if "top" in batch else None
    for s in range(1, max(unroll, measure_passes) + 1):
        if s == 1:
            pred, kv = head(None, inputs, positions, inputs_embeds=embeds)
        else:
            shifted = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], dim=1)  # own prediction, one step back
            # the true pairs strictly before the drafted run, and its own drafted positions (every row sees itself)
            pred, kv = head(None, shifted, positions, UnrolledMask(s), past, inputs_embeds=embeds)
        past = kv if past is None else (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
        pass_sel = sel & (i >= s - 1).view(1, -1)
        pred_sel = pred[pass_sel]
        if eagle3:  # its output is its own feature, not the target's: no regression term
            feature_loss = pred_sel.new_zeros(())
        else:
            feature_loss = F.smooth_l1_loss(pred_sel, target[pass_sel], reduction="none").mean(-1).mean()
        logq = F.log_softmax(draft_logits(pred_sel), dim=-1)
        p = target_p if s == 1 else target_p[(i >= s - 1).expand(bsz, steps)[sel]]  # pass_sel's rows of target_p
        ce = -(p * logq).sum(-1).mean()
        if s <= unroll:
            total = total + weights[s - 1] * (ce if eagle3 else feature_loss + ce_weight * ce)
        with torch.no_grad():
            best = logq.argmax(-1)
            infos.append((feature_loss.item(), ce.item(), (best == p.argmax(-1)).float().mean().item()))
            if top is not None:
                agree.append((head.to_target_ids(best) == top[pass_sel]).float().mean().item())
    loss = total / sum(weights)
    info = {"loss": loss.item(), "feature_loss": infos[0][0], "ce": infos[0][1], "acc": infos[0][2],
            "tokens": int(sel.sum())}  # fmt: skip
    if unroll > 1:
        info["acc_deep"] = infos[unroll - 1][2]
    if agree:
        info["agree"] = agree
    return loss, info


class Trainer:
    """Holds the head, optimizer, schedule and data; `run()` trains with checkpoints, resuming if one exists."""

    def __init__(self, config: TrainConfig, target_model, *, data: FeatureSet | None = None,
                 val_data: FeatureSet | None = None, progress: bool = True):  # fmt: skip
        self.config = config
        self.progress = progress
        if config.threads:
            torch.set_num_threads(config.threads)
        if config.autocast == "bfloat16" and target_model.device.type == "cpu":
            warn_if_bf16_emulated("training with autocast")
        eagle3 = config.head == "eagle3"
        if data is not None and data.max_prompt_context != config.max_prompt_context:
            raise ValueError(f"the config's max_prompt_context is {config.max_prompt_context}, the preloaded data= set "
                             f"was loaded with {data.max_prompt_context}: the cut is made when a set is loaded, so "
                             "pass max_prompt_context to FeatureSet.load as well")  # fmt: skip
        self.data = data or FeatureSet.load(config.data, config.max_seq_len, eagle3, config.max_prompt_context)
        self.data.all_positions = config.loss_positions == "all"
        # held-out rows keep their whole prompts: the head is measured as generate runs it
        self.val = val_data if val_data is not None else (
            FeatureSet.load(config.val_data, config.max_seq_len, aux=eagle3) if config.val_data else None
        )  # fmt: skip
        if self.val is not None and self.val.target_top is None:
            folder = config.val_data[0] if len(config.val_data) == 1 and val_data is None else None
            self.val.attach_target_top(target_model.get_output_embeddings().weight, cache_folder=folder)
        vocab = target_model.config.get_text_config().vocab_size
        self.state_path = os.path.join(config.out, "checkpoint.pt")
        torch.manual_seed(config.seed)
        if config.init:
            self.head = self._initial_head(target_model, vocab)
        else:
            draft_vocab = None if config.draft_vocab_size is None else self._frequent_tokens(target_model, vocab)
            head_class = Eagle3DraftModel if eagle3 else EagleDraftModel
            width = {} if config.head_intermediate_size is None else {"intermediate_size": config.head_intermediate_size}
            self.head = head_class.from_target(target_model, draft_vocab=draft_vocab, seed=config.seed, **width)
        self.head.bind(target_model).float()  # bind first: it casts the head to the target's dtype
        if config.freeze_lm_head:
            self.head.borrow_target_lm_head(self._frozen_lm_head_vocab(target_model, vocab)).bind(target_model)
        # the target's lm_head rows of the draft vocabulary: its next-token distribution, the soft labels
        draft_ids = self.head.to_target_ids(torch.arange(self.head.draft_vocab_size))
        self.lm_weight = target_model.get_output_embeddings().weight.detach()[draft_ids].float()
        if config.lm_head_init == "target" and not config.init:
            # the head's output then starts in the space the target's lm_head reads (its norm is learnt): the
            # 4.7M-parameter lm_head of a SmolLM2 head need not be learnt from noise on a CPU budget
            with torch.no_grad():
                self.head.lm_head.weight.copy_(self.lm_weight)
        self.soft_label_digest = hashlib.sha1(self.lm_weight.cpu().numpy().tobytes()).hexdigest()  # fixed for the run
        self.label_weight = self.lm_weight.to(torch.bfloat16) if config.soft_labels == "bfloat16" else None
        self.head.train()
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
        self.steps_per_epoch = len(epoch_batches(self.data.lengths(), config.batch_tokens, config.seed, 0))
        self.total_steps = max(1, int(math.ceil(config.epochs * self.steps_per_epoch)))
        self.step = 0
        self.tokens_seen = 0
        self.elapsed = 0.0
        self.history: list[dict] = []
        # read at the start (a run saving its head over its own init must not find itself), kept in checkpoints
        self.lineage = init_lineage(config.init) if config.init else None

    def _frequent_tokens(self, target_model, vocab: int) -> torch.LongTensor:
        """The data's `draft_vocab_size` most frequent target tokens, EOS included (a new draft vocabulary)."""
        eos = target_model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        return select_draft_vocab(token_frequencies(self.data, vocab), self.config.draft_vocab_size, eos)

    def _frozen_lm_head_vocab(self, target_model, vocab: int) -> torch.LongTensor | None:
        """The target ids whose lm_head rows a freeze_lm_head run borrows: the head's own vocabulary when it is of
        `draft_vocab_size` already (an init head's is kept, as init keeps it), else the data's most frequent
        tokens; None for the full vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        if self.head.draft_vocab_size == self.config.draft_vocab_size:
            return self.head.to_target_ids(torch.arange(self.head.draft_vocab_size))
        return self._frequent_tokens(target_model, vocab)

    def _initial_head(self, target_model, vocab: int) -> EagleDraftModel:
        """The head named by `config.init`, checked against the run's head kind and draft vocabulary size."""
        c = self.config
        head = EagleDraftModel.from_pretrained(c.init)
        if isinstance(head, Eagle3DraftModel) != (c.head == "eagle3"):
            kind = "an EAGLE-3" if isinstance(head, Eagle3DraftModel) else "an EAGLE-1/2"
            raise ValueError(f"init head {c.init} is {kind} head, but this run trains head={c.head!r}")
        if c.head == "eagle3" and head.target_feature_ids(target_model) != aux_layer_ids(target_model):
            raise ValueError(f"init head {c.init} reads target layers {head.target_feature_ids(target_model)}, but "
                             f"features are extracted from {aux_layer_ids(target_model)} (the official choice): it "
                             "would be trained on other layers than it reads")  # fmt: skip
        has = head.config.draft_vocab_size or vocab
        if c.freeze_lm_head:  # its lm_head is replaced by the target's rows (and its vocabulary, if of another size)
            return head
        if c.grow_vocab:
            if has >= c.draft_vocab_size:
                raise ValueError(f"init head {c.init} drafts over {has} tokens: grow_vocab needs a larger "
                                 f"draft_vocab_size than that, got {c.draft_vocab_size}")  # fmt: skip
            counts = token_frequencies(self.data, vocab)
            counts[head.to_target_ids(torch.arange(has))] = -1  # only tokens the head lacks
            return head.grow_draft_vocab(select_draft_vocab(counts, c.draft_vocab_size - has))
        if has != (c.draft_vocab_size or vocab):
            raise ValueError(f"init head {c.init} drafts over {has} tokens, but draft_vocab_size is "
                             f"{c.draft_vocab_size or vocab}: pass --draft-vocab-size {has if has < vocab else 0} "
                             "(the head's vocabulary is kept) or grow it with --grow-vocab")  # fmt: skip
        return head

    def _run_identity(self) -> dict:
        """What a checkpoint must share with this run to resume it: the RUN_FIELDS, the data's size, the target
        and the draft vocabulary (a digest of the soft labels' lm_head rows: the target's rows of the draft ids)."""
        config = asdict(self.config)
        return {k: config[k] for k in RUN_FIELDS} | {
            "data": [os.path.realpath(folder) for folder in self.config.data],
            "data_sequences": self.data.num_sequences,
            "data_tokens": self.data.num_tokens,
            "soft_label_rows": self.soft_label_digest,
        }

    def lr_at(self, step: int) -> float:
        c = self.config
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        progress = min(1.0, (step - c.warmup_steps) / max(1, self.total_steps - c.warmup_steps))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def save_checkpoint(self) -> None:
        os.makedirs(self.config.out, exist_ok=True)
        state = {
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "elapsed": self.elapsed,
            "history": self.history,
            "config": asdict(self.config),
            "run": self._run_identity(),
            "lineage": self.lineage,
        }
        tmp = self.state_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def load_checkpoint(self) -> bool:
        if not os.path.exists(self.state_path):
            return False
        state = torch.load(self.state_path, map_location="cpu", weights_only=False)
        now = self._run_identity()
        # checkpoints from before the run identity: their config's RUN_FIELDS (data paths as given then)
        saved = state.get("run") or {k: v for k, v in state.get("config", {}).items() if k in RUN_FIELDS and k != "data"}
        saved = RUN_DEFAULTS | saved
        changed = setting_changes(saved, now)
        if changed:
            raise ValueError(f"{self.state_path} belongs to another run ({'; '.join(changed)}). Resume with the "
                             "same data and settings, pass restart (--restart) to start over, or, once a run has "
                             "saved its head, start a new run from that head with init (--init)")  # fmt: skip
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.elapsed = state["elapsed"]
        self.history = state["history"]
        if "lineage" in state:  # checkpoints from before it was kept: the lineage read at this start
            self.lineage = state["lineage"]
        return True

    @torch.no_grad()
    def evaluate(self, max_batches: int = 20, passes: int = 2) -> dict:
        """Held-out loss and accuracy (as trained), and `val_agree`: per pass 1..`passes` (depth 1, then the head
        on its own features), the share of answer positions where its top token is the target's greedy token
        over the full vocabulary (`eagle_loss`), the number that compares heads of any draft vocabulary, MLP
        width or training-time test."""
        if self.val is None:
            return {}
        self.head.eval()
        sums = {"loss": 0.0, "feature_loss": 0.0, "ce": 0.0, "acc": 0.0}
        agree = [0.0] * max(passes, self.config.unroll)
        total = 0
        for indices in epoch_batches(self.val.lengths(), self.config.batch_tokens, 0, 0)[:max_batches]:
            _, info = eagle_loss(self.head, self.lm_weight, self.val.batch(indices), 0.0, self.config.ce_weight,
                                 unroll=self.config.unroll, measure_passes=passes, label_weight=self.label_weight)  # fmt: skip
            for k in sums:
                sums[k] += info[k] * info["tokens"]
            agree = [a + x * info["tokens"] for a, x in zip(agree, info["agree"])]
            total += info["tokens"]
        self.head.train()
        out = {f"val_{k}": v / max(total, 1) for k, v in sums.items()}
        return out | {"val_agree": [round(a / max(total, 1), 5) for a in agree]}

    def train_step(self, indices: list[int]) -> dict:
        c = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        generator = torch.Generator().manual_seed(c.seed * 7919 + self.step)
        with torch.autocast(self.lm_weight.device.type, dtype=torch.bfloat16, enabled=c.autocast == "bfloat16"):
            loss, info = eagle_loss(self.head, self.lm_weight, self.data.batch(indices), c.noise_std, c.ce_weight,
                                    generator, c.unroll, label_weight=self.label_weight)  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        info["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.head.parameters(), c.grad_clip))
        self.optimizer.step()
        return info

    def run(self, resume: bool = True) -> EagleDraftModel:
        c = self.config
        if resume:
            self.load_checkpoint()
        last = self.total_steps if c.max_steps is None else min(self.total_steps, c.max_steps)
        bar = tqdm(total=last, initial=self.step, desc="train", unit="step", disable=not self.progress)
        epoch_cache: dict[int, list[list[int]]] = {}
        while self.step < last:
            epoch, index = divmod(self.step, self.steps_per_epoch)
            if epoch not in epoch_cache:
                epoch_cache = {epoch: epoch_batches(self.data.lengths(), c.batch_tokens, c.seed, epoch)}
            batches = epoch_cache[epoch]
            # every epoch has steps_per_epoch steps (the batch count of epoch 0): a packing with fewer batches
            # wraps around to its first ones, one with more leaves its last ones out
            batch = batches[index % len(batches)]
            start = time.perf_counter()
            info = self.train_step(batch)
            self.elapsed += time.perf_counter() - start
            self.step += 1
            batch_tokens = sum(int(self.data.offsets[i + 1] - self.data.offsets[i]) for i in batch)
            self.tokens_seen += batch_tokens
            info.update(step=self.step, lr=self.lr_at(self.step - 1), tokens_seen=self.tokens_seen, batch_tokens=batch_tokens)
            if self.step % c.eval_every == 0 or self.step == last:
                info.update(self.evaluate())
            self.history.append(info)
            bar.set_postfix(loss=f"{info['loss']:.3f}", acc=f"{info['acc']:.3f}")
            bar.update(1)
            if c.snapshot_every_tokens and self.tokens_seen // c.snapshot_every_tokens > (
                self.tokens_seen - self.history[-1]["batch_tokens"]
            ) // c.snapshot_every_tokens:
                self.save_snapshot()
            if self.step % c.save_every == 0 or self.step == last:
                self.save_checkpoint()
        bar.close()
        self.head.eval()
        return self.head

    def _summary_lineage(self, summary: dict) -> dict:
        """`summary` with the run's lineage and total tokens (a run from a head; an empty lineage says that head's
        training is not known here, which a card states)."""
        if self.lineage is None:
            return summary
        summary = summary | {"init_lineage": self.lineage}
        return summary | {"tokens_seen_total": total_tokens_seen(summary)}

    def save_snapshot(self) -> None:
        """`out/snapshots/tokens_<N>`: the head now, with a small training.json (tokens seen by this run and by
        the heads it started from), so a τ-vs-tokens curve counts all the training behind it."""
        folder = os.path.join(self.config.out, "snapshots", f"tokens_{self.tokens_seen:010d}")
        self.head.save_pretrained(folder)
        with open(os.path.join(folder, "training.json"), "w") as f:
            json.dump(self._summary_lineage({"snapshot": True, "config": asdict(self.config),
                                             "tokens_seen": self.tokens_seen}), f, indent=2)  # fmt: skip

    def save_head(self, folder: str, extra: dict | None = None, dtype: torch.dtype | None = None) -> None:
        """The trained head (config + safetensors, optionally cast to `dtype` to keep the file small) and a
        training summary `training.json`."""
        head = self.head
        if dtype is not None and dtype != head.fc.weight.dtype:
            head = head.unbound_copy().to(dtype)
        head.save_pretrained(folder)
        summary = {
            "config": asdict(self.config),
            "steps": self.step,
            "epochs": self.step / self.steps_per_epoch,
            "tokens_seen": self.tokens_seen,
            "train_tokens": self.data.num_tokens,
            "train_sequences": self.data.num_sequences,
            "train_seconds": self.elapsed,
            "head_parameters": self.head.num_head_parameters(),
            "final": self.history[-1] if self.history else {},
            **(extra or {}),
        }
        summary = self._summary_lineage(summary)
        with open(os.path.join(folder, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)


def init_lineage(init: str | None, _seen: frozenset = frozenset()) -> list[dict]:
    """The training summaries of the heads a run starts from, nearest first: `init`'s training.json (without its
    own lineage), then its init's, and so on. The chain ends at a head with no local training.json (a Hub id, an
    official checkpoint: what it saw is not known here) or at a folder already visited (a head retrained in
    place names itself as its init)."""
    path = os.path.join(init, "training.json") if init else None
    if not path or not os.path.isfile(path) or os.path.realpath(init) in _seen:
        return []
    with open(path, encoding="utf-8") as f:
        summary = json.load(f)
    ancestors = summary.pop("init_lineage", None)
    summary.pop("tokens_seen_total", None)
    if ancestors is None:  # written before summaries carried their lineage: follow the init it names
        ancestors = init_lineage(summary.get("config", {}).get("init"), _seen | {os.path.realpath(init)})
    return [summary, *ancestors]


def total_tokens_seen(summary: dict) -> int:
    """Tokens seen by a run and by every head in its lineage."""
    return int(summary["tokens_seen"]) + sum(int(s["tokens_seen"]) for s in summary.get("init_lineage", []))
