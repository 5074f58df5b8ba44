"""`hf-eagle2`: train, evaluate, benchmark and publish EAGLE draft heads.

  train-head   one head end to end over a named recipe (extract, train, eval-head, card), resumable
  data STEP    the data pipeline's single steps, each resumable:
                 extract           target features of ShareGPT conversations or of the target's own answers
                 export-prompts    extract's work list as prompts, for `answer` on another machine
                 answer            answers to exported prompts (e.g. on a GPU), as a token archive
                 join-tokens       token archives of consecutive shards, as one
                 export-tokens     a feature folder's tokens as one small archive
                 rebuild-features  a feature folder again from a token archive (the target's forward only)
                 cut-features      a feature folder's stored prompts cut in place
                 train             a head on feature folders
  eval-head    τ and calibration of a head
  bench        speculative decoders side by side
  card         a head folder's model card
  push         a head folder and/or the custom_generate recipe to the Hub
  demo         EAGLE-2 against plain generate on one prompt

The data steps' old spellings (`hf-eagle2 train ...`, `hf-eagle2 extract ...`) still work: model cards record them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from .training.recipes import LOG_NAME, RECIPES

DEFAULT_HEAD = os.path.join("model_cards", "smollm2-135m-instruct-eagle2")
DEFAULT_CUSTOM_GENERATE = "custom_generate"


DATA_STEPS = ("extract", "export-prompts", "answer", "join-tokens", "export-tokens", "rebuild-features",
              "cut-features", "train")  # fmt: skip

# every verb's --help ends with these (each line a command the parser accepts: tests/test_cli.py parses them)
EXAMPLES = {
    "": "examples:\n"
        "  hf-eagle2 train-head --list-recipes\n"
        "  hf-eagle2 train-head --target smollm2 --recipe eagle3-sharegpt --out runs/heads/eagle3 --threads 2\n"
        "  hf-eagle2 data extract --out runs/data/sharegpt --responses sharegpt --max-tokens 500000\n"
        "  hf-eagle2 eval-head --draft model_cards/smollm2-135m-instruct-eagle3 --dataset mtbench --limit 10",
    "train-head": "examples:\n"
        "  hf-eagle2 train-head --list-recipes\n"
        "  hf-eagle2 train-head --target smollm2 --recipe eagle3-sharegpt --out runs/heads/eagle3 --threads 2\n"
        "  hf-eagle2 train-head --target smollm2 --recipe eagle2-sharegpt --out runs/heads/eagle2 --dtype float32 "
        "--max-tokens 1000000 --epochs 2",
    "data": "examples:\n"
        "  hf-eagle2 data extract --out runs/data/distill-val-bf16 --split validation --responses target --turns all "
        "--dtype bfloat16 --eagle3 --batch-size 64 --max-tokens 30000\n"
        "  hf-eagle2 data train --head eagle3 --data runs/data/distill-all-bf16 --val-data runs/data/distill-val-bf16 "
        "--out runs/train/e3",
    "extract": "example (self-distilled answers with the EAGLE-3 layers, as the shipped EAGLE-3 head's data):\n"
        "  hf-eagle2 data extract --out runs/data/distill-all-bf16 --responses target --turns all --dtype bfloat16 "
        "--eagle3 --batch-size 64 --max-tokens 500000",
    "export-prompts": "example (the work list's shards 36 on, to answer on a GPU):\n"
        "  hf-eagle2 data export-prompts --out prompts-p1024.npz --shards 36- --turns all --dtype bfloat16 --eagle3 "
        "--batch-size 64 --min-prompt-tokens 384 --max-prompt-tokens 1024",
    "answer": "example (on the GPU; run again to resume):\n"
        "  hf-eagle2 data answer --model SmolLM2-135M-Instruct.Q4_1.gguf --tokens prompts-p1024.npz "
        "--out answers-p1024.npz --rows-per-call 1024 --rows-per-write 1024 --time-limit 440",
    "join-tokens": "example:\n"
        "  hf-eagle2 data join-tokens --tokens shards-0-35.npz answers-p1024.npz --out smollm2-distill-p1024-bf16.npz",
    "export-tokens": "example:\n"
        "  hf-eagle2 data export-tokens --data runs/data/distill-all-bf16 --out smollm2-distill-all-bf16.npz",
    "rebuild-features": "example:\n"
        "  hf-eagle2 data rebuild-features --tokens training_data/smollm2-distill-val-bf16.npz "
        "--out runs/data/distill-val-bf16 --dtype bfloat16",
    "cut-features": "example:\n"
        "  hf-eagle2 data cut-features --folder runs/data/distill-p1024-bf16 --max-prompt-context 384 "
        "--tokens training_data/smollm2-distill-p1024-bf16.npz",
    "train": "example (the shipped EAGLE-3 head's first stage):\n"
        "  hf-eagle2 data train --head eagle3 --data runs/data/distill-all-bf16 --val-data runs/data/distill-val-bf16 "
        "--draft-vocab-size 8192 --epochs 3 --lr 1e-3 --warmup-steps 50 --batch-tokens 4096 --autocast bfloat16 "
        "--out runs/train/e3 --head-out runs/stage/eagle3 --head-dtype float16",
    "eval-head": "example:\n"
        "  hf-eagle2 eval-head --draft model_cards/smollm2-135m-instruct-eagle3 --dataset mtbench --limit 80 "
        "--kernels fast --out runs/eval/e3-mtbench.json",
    "bench": "example:\n"
        "  hf-eagle2 bench --draft model_cards/smollm2-135m-instruct-eagle3 --methods plain,eagle2 "
        "--dataset mtbench,humaneval --limit mtbench=5,humaneval=10 --first-turn-only --out runs/bench/e3.json",
    "card": "example:\n"
        "  hf-eagle2 card --head runs/stage/eagle3 --eval runs/eval/e3-mtbench.json --bench runs/bench/e3.json "
        "--set 'hardware=2 CPU cores'",
    "push": "example:\n"
        "  hf-eagle2 push --head model_cards/smollm2-135m-instruct-eagle3 --repo-id user/smollm2-135m-instruct-eagle3",
    "demo": "examples:\n"
        "  hf-eagle2 demo --draft model_cards/smollm2-135m-instruct-eagle3 --prompt 'Write a haiku about the sea.'\n"
        "  hf-eagle2 demo --model qwen2.5-coder-1.5b",
}


class _Raw(str):
    """Help text printed as written (the command tree, the examples), not re-wrapped."""


class _Formatter(argparse.HelpFormatter):
    def _fill_text(self, text, width, indent):
        if isinstance(text, _Raw):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _verb(sub, name: str, help: str):
    """A verb's parser: its help line also as its description, and its example as the epilog."""
    return sub.add_parser(name, help=help, description=help, epilog=_Raw(EXAMPLES[name]), formatter_class=_Formatter)


class _Parser(argparse.ArgumentParser):
    """The top parser: reads the data steps' old flat spellings (`hf-eagle2 train ...`) as `hf-eagle2 data train
    ...` (a note on stderr), and records the command line it parsed as `args.command_line` (what the verbs write
    into training.json, eval and bench results, cards)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if args and args[0] in DATA_STEPS:
            print(f"hf-eagle2: `hf-eagle2 {args[0]}` is now `hf-eagle2 data {args[0]}` (the old spelling still "
                  "works)", file=sys.stderr)  # fmt: skip
            args = ["data", *args]
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.command_line = "hf-eagle2 " + shlex.join(args)
        return parsed, rest


def _command(args) -> str | None:
    """The command line that made `args` (None for a namespace made elsewhere)."""
    return getattr(args, "command_line", None)


def load_draft(spec: str | None, model):
    """A head from a local folder or Hub id; `random` (or the default folder when it is missing) gives a fresh
    randomly initialised head, said so in the returned description."""
    from .heads.modeling_eagle import EagleDraftModel

    if spec and spec != "random" and (os.path.exists(spec) or spec != DEFAULT_HEAD):
        return EagleDraftModel.from_pretrained(spec), spec
    return EagleDraftModel.from_target(model, seed=0), "a randomly initialised head (no trained head given)"


def _threads(n: int | None) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


def cmd_extract(args) -> None:
    from .evaluation.assets import load_model
    from .training.features import extract_features

    _threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    if args.kernels == "fast":
        from .kernels.cpu import optimize_for_cpu

        optimize_for_cpu(model)
    draft = load_draft(args.draft, model)[0] if args.draft else None
    meta = extract_features(
        model,
        tokenizer,
        args.out,
        responses=args.responses,
        split=args.split,
        max_tokens=args.max_tokens,
        max_conversations=args.max_conversations,
        max_prompt_tokens=args.max_prompt_tokens,
        min_prompt_tokens=args.min_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        draft=draft,
        turns=args.turns,
        eagle3=args.eagle3,
    )
    print(json.dumps(meta, indent=2))


def cmd_export_tokens(args) -> None:
    from .training.tokens import export_tokens

    print(json.dumps(export_tokens(args.data, args.out), indent=2))


def cmd_export_prompts(args) -> None:
    from .evaluation.assets import load_model
    from .training.answers import export_prompts

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    first, last = args.shards
    summary = export_prompts(model, tokenizer, args.out, range(first, 2**62 if last is None else last + 1),
                             split=args.split, turns=args.turns, max_prompt_tokens=args.max_prompt_tokens,
                             min_prompt_tokens=args.min_prompt_tokens, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size, eagle3=args.eagle3)  # fmt: skip
    print(json.dumps(summary, indent=2))


def cmd_answer(args) -> None:
    from .evaluation.assets import load_model
    from .training.answers import answer_prompts
    from .training.features import Sampling
    from .training.tokens import read_tokens

    import torch

    if args.seed is not None and not args.temperature:
        raise ValueError("--seed draws sampled answers: give --temperature too (greedy answers use no seed)")
    sampling = Sampling(args.temperature, args.seed or 0) if args.temperature else None
    _threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype or read_tokens(args.tokens).meta["dtype"])
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    summary = answer_prompts(model.to(device), tokenizer, args.tokens, args.out, rows_per_call=args.rows_per_call,
                             rows_per_write=args.rows_per_write, time_limit=args.time_limit,
                             sampling=sampling)  # fmt: skip
    print(json.dumps(summary, indent=2))


def cmd_join_tokens(args) -> None:
    from .training.answers import join_archives

    print(json.dumps(join_archives(args.tokens, args.out), indent=2))


def cmd_rebuild_features(args) -> None:
    from .evaluation.assets import load_model
    from .training.tokens import read_tokens, rebuild_features

    _threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype or read_tokens(args.tokens).meta.get("dtype", "float32"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # as extract pads
    shards = None
    if args.shards:
        first, last = args.shards
        shards = range(first, len(read_tokens(args.tokens).shard_sequences) if last is None else last + 1)
    meta = rebuild_features(model, args.tokens, args.out, pad_id=pad_id, eagle3=args.eagle3, shards=shards,
                            max_prompt_context=args.max_prompt_context)  # fmt: skip
    print(json.dumps(meta, indent=2))


def cmd_cut_features(args) -> None:
    from .training.tokens import cut_folder

    print(json.dumps(cut_folder(args.folder, args.max_prompt_context, args.tokens), indent=2))


def shard_range(text: str) -> tuple[int, int | None]:
    """argparse type of --shards: "A-B" -> (A, B) inclusive, "A-" -> (A, None) (to the last), "A" -> (A, A)."""
    first, dash, last = text.partition("-")
    try:
        return int(first), (int(last) if last else None) if dash else int(first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: shards are 'A-B' (inclusive), 'A-' (to the last) or 'A'") from None


def cmd_train(args) -> None:
    from .evaluation.assets import HUB_NAMES, load_model, resolve_dtype
    from .training.train import TrainConfig, Trainer

    _threads(args.threads)
    model, _ = load_model(args.model, dtype="float32")
    config = TrainConfig(
        data=args.data, out=args.out, val_data=args.val_data or [],
        draft_vocab_size=None if args.draft_vocab_size == 0 else args.draft_vocab_size,
        epochs=args.epochs, lr=args.lr, warmup_steps=args.warmup_steps, batch_tokens=args.batch_tokens,
        max_seq_len=args.max_seq_len, max_prompt_context=args.max_prompt_context, grad_clip=args.grad_clip,
        ce_weight=args.ce_weight,
        noise_std=args.noise_std,
        seed=args.seed, save_every=args.save_every, eval_every=args.eval_every, max_steps=args.max_steps,
        snapshot_every_tokens=args.snapshot_every_tokens, unroll=args.unroll, head=args.head, autocast=args.autocast,
        init=args.init, lm_head_init=args.lm_head_init, grow_vocab=args.grow_vocab,
        freeze_lm_head=args.freeze_lm_head, loss_positions=args.loss_positions,
        head_intermediate_size=args.head_intermediate_size, soft_labels=args.soft_labels,
    )  # fmt: skip
    trainer = Trainer(config, model)
    # the Hub name, not the local cache folder, in every head this run writes (snapshots included)
    trainer.head.config.target_model = HUB_NAMES.get(args.model, trainer.head.config.target_model)
    print(f"train: {trainer.data.num_sequences} sequences, {trainer.data.num_tokens} tokens, "
          f"{trainer.steps_per_epoch} steps/epoch, {trainer.total_steps} steps")  # fmt: skip
    trainer.run(resume=not args.restart)
    head_dir = args.head_out or os.path.join(args.out, "head")
    trainer.save_head(head_dir, dtype=resolve_dtype(args.head_dtype) if args.head_dtype else None,
                      extra={"command": _command(args)})  # fmt: skip
    print(json.dumps(trainer.history[-1], indent=2))
    print(f"head saved to {head_dir}")


def cmd_train_head(args) -> None:
    """The recipe's steps, each run through this parser and its verb's function (the very `data extract`, `data
    train`, `eval-head` and `card` a user could type), skipping the finished ones; recorded in OUT/train-head.json."""
    from .evaluation.assets import HUB_NAMES
    from .training import recipes

    if args.list_recipes:
        print("\n\n".join(recipes.describe(recipe) for recipe in recipes.RECIPES.values()))
        return
    if not args.recipe or not args.out:
        raise SystemExit("hf-eagle2 train-head: give --recipe and --out (or --list-recipes)")
    if not args.eval and (args.eval_limit is not None or args.eval_max_new_tokens is not None):
        raise SystemExit("hf-eagle2 train-head: --eval-limit / --eval-max-new-tokens set eval-head's run, which "
                         "--no-eval skips; give one or the other")  # fmt: skip
    recipe = recipes.with_overrides(recipes.get_recipe(args.recipe), max_tokens=args.max_tokens,
                                    max_conversations=args.max_conversations, epochs=args.epochs, dtype=args.dtype,
                                    kernels=args.kernels, draft_vocab_size=args.draft_vocab_size,
                                    head_intermediate_size=args.head_intermediate_size,
                                    loss_positions=args.loss_positions, eval_limit=args.eval_limit,
                                    eval_max_new_tokens=args.eval_max_new_tokens)
    hub_name = HUB_NAMES.get(args.target) or (args.target if args.target.count("/") == 1 and not
                                              os.path.exists(args.target) else None)  # fmt: skip
    steps = recipes.plan(recipe, args.target, args.out, threads=args.threads, evaluate=args.eval,
                         card_set={"base_model": hub_name} if hub_name else None)  # fmt: skip
    try:
        log = recipes.RunLog.open(recipes.folders(args.out)["log"], recipe, args.target)
    except ValueError as e:  # another recipe's or target's run in --out
        raise SystemExit(f"hf-eagle2 train-head: {e}") from None
    run = log.start(_command(args) or "hf-eagle2 train-head", recipe)
    parser = build_parser()

    def execute(argv: list[str]) -> None:
        step_args = parser.parse_args(argv)
        step_args.func(step_args)

    ran = recipes.run_steps(steps, log, run, execute, dry_run=args.dry_run,
                            echo=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
    if args.dry_run:
        print(f"train-head: would run {', '.join(ran) or 'nothing (all done)'}")
        return
    print(f"train-head: {recipe.name} for {args.target}: ran {', '.join(ran) or 'nothing (all done)'}; "
          f"{run['seconds'] / 3600:.3g} h this time ({sum(r.get('cpu_seconds', 0.0) for r in run['steps']):.0f} CPU-s), "
          f"{log.data['compute_seconds'] / 3600:.3g} h over all runs "
          f"({log.path}); head: {recipes.folders(args.out)['head']}")  # fmt: skip


def cmd_eval_head(args) -> None:
    from .evaluation.assets import load_model
    from .heads.calibration import markdown_table, plot_reliability
    from .evaluation.evaluate import eval_head, parse_limit
    from .heads.modeling_eagle import EagleDraftModel

    limit = parse_limit(args.limit, args.dataset.split(","))  # before loading anything: a typo fails at once
    _threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    draft = EagleDraftModel.from_pretrained(args.draft)
    if args.full_vocab:
        draft.bind(model).set_draft_vocab(None)  # bound first: an EAGLE-3 head's rows are checked against the target's
    tree = dict(tree=args.tree, tree_total_tokens=args.tree_total_tokens, tree_depth=args.tree_depth, tree_top_k=args.tree_top_k)
    result = eval_head(model, tokenizer, draft, args.dataset.split(","), limit, args.max_new_tokens, tree,
                       kernels=args.kernels)  # fmt: skip
    result["draft"] = args.draft
    result["draft_sha256"] = draft.weights_sha256
    result["full_vocab"] = args.full_vocab  # the same weights over another vocabulary: a setting card compares
    result["command"] = _command(args)
    for ds, r in result["datasets"].items():
        print(f"{ds}: tau={r['tau']:.3f} new_tokens={r['new_tokens']} target_forwards={r['target_forwards']}")
    if "calibration" in result:
        print(markdown_table(result["calibration"]))
        if args.plot:
            plot_reliability(result["calibration"], args.plot, title=f"{args.draft} ({','.join(result['datasets'])})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def cmd_bench(args) -> None:
    from .evaluation.assets import load_model
    from .evaluation.bench import markdown, readme_section, run_bench, update_readme, write_outputs
    from .evaluation.evaluate import parse_limit

    if args.report:  # the journal as it stands: no model is loaded
        from .evaluation.bench import journal_report

        if not args.out:
            raise SystemExit("hf-eagle2 bench --report: give the bench's --out (its journal is <out>.journal.jsonl)")
        results = journal_report(args.out + ".journal.jsonl")
        meta = results["meta"]
        print(f"{meta['journal']}: {meta['prompts']} prompts measured, on {meta['cpu']}")
        print(markdown(results))
        return
    limit = parse_limit(args.limit, args.dataset.split(","))
    vllm = None
    if args.methods and any(m.startswith("vllm_") for m in args.methods.split(",")):
        from .evaluation.vllm_peer import VllmOptions, serve_python, target_folder

        serve_python(args.serve_venv)  # fails before the model loads: names `make serve-check`
        vllm = VllmOptions(serve_venv=args.serve_venv, target=target_folder(args.model), dtype=args.dtype,
                           draft=args.vllm_draft, k=args.vllm_k, request_timeout=args.vllm_timeout,
                           log_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "vllm"))  # fmt: skip
    _threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    draft, source = load_draft(args.draft, model)
    if source != args.draft and args.draft != "random":  # the default head folder is missing (another directory?)
        print(f"bench: {args.draft} not found; benchmarking {source}", file=sys.stderr)
    if args.cost_curve:
        from .evaluation.bench import cost_curve, cost_curve_markdown

        curve = cost_curve(model, draft.bind(model))
        print(cost_curve_markdown(curve))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(curve, f, indent=2)
        return
    params = {"m": args.tree_total_tokens, "depth": args.tree_depth, "k": args.tree_top_k, "chain_depth": args.chain_depth}
    assistant = load_model(args.assistant, dtype=args.dtype)[0] if args.assistant else None
    journal = args.out + ".journal.jsonl" if args.out else None  # one line per finished prompt: resumable
    if journal and args.restart and os.path.exists(journal):
        os.remove(journal)
    results = run_bench(
        model, tokenizer, draft, datasets=args.dataset.split(","), limit=limit,
        **({"methods": args.methods.split(",")} if args.methods else {}),
        max_new_tokens=args.max_new_tokens, tree_params=params, threads=args.threads, second_turn=not args.first_turn_only,
        kernels=args.kernels, vllm=vllm, assistant=assistant, journal=journal,
        settings={"model": args.model, "dtype": args.dtype, "draft": source,
                  "draft_sha256": getattr(draft, "weights_sha256", None), "assistant": args.assistant,
                  "threads": args.threads},
    )  # fmt: skip
    if args.profile:  # ops and host reads per round, on the first prompt (counted after the timed runs)
        from .evaluation.bench import profile_ops
        from .evaluation.evaluate import chat_input_ids, load_prompts

        first = load_prompts(args.dataset.split(",")[0], limit)[0]
        ids = chat_input_ids(tokenizer, list(first.messages))
        results["profile"] = profile_ops(model, draft, ids, results["meta"]["methods"], params, args.kernels)
    results["meta"].update(model=args.model, draft=source if source == args.draft else "random",
                           draft_sha256=getattr(draft, "weights_sha256", None),
                           dtype=args.dtype, command=_command(args))  # fmt: skip
    write_outputs(results, args.out)
    if args.readme:
        update_readme(args.readme, readme_section(results))
    print(markdown(results))
    print(f"results: {args.out}")
    if results["meta"]["exact"] and not results["all_identical"]:
        print("FAILURE: some methods did not reproduce plain greedy output (see failed_prompts)")
        sys.exit(1)


def cmd_card(args) -> None:
    from .heads.card import assemble_results, write_card

    extra = {key: _json_or_text(value) for key, value in (item.split("=", 1) for item in args.set or [])}
    extra["commands"] = {"card": _command(args)}
    if any("=" not in item for item in args.compare or []):
        raise SystemExit("hf-eagle2 card: --compare takes NAME=FOLDER entries")
    compare = dict(item.split("=", 1) for item in args.compare or [])
    results = assemble_results(args.head, args.eval, args.bench, args.curve, extra, compare)
    if results.get("dropped"):
        print(f"{args.head}/results.json described other weights: dropped {', '.join(results['dropped'])} "
              "(measure this head and pass them again)", file=sys.stderr)
    print(write_card(args.head, args.results, args.repo_id))


def cmd_push(args) -> None:
    from .heads.hub import push_custom_generate, push_head_folder

    if args.head is None and args.custom_generate is None:
        raise SystemExit("hf-eagle2 push: give --head and/or --custom-generate")
    if args.head is not None:
        print(push_head_folder(args.head, args.repo_id, private=args.private))
    if args.custom_generate is not None:  # next to a head, the head's card stays the repo's card
        print(push_custom_generate(args.custom_generate, args.repo_id, card=args.head is None, private=args.private))


# `hf-eagle2 demo --model M`: the head, dtype and prompt each demo target shows by default (flags override them).
# The 1.5B runs in bf16 (its fp32 weights are 7 GB a step to stream) with a coding prompt (a code model).
DEMO_DEFAULTS = {
    "smollm2": {"draft": DEFAULT_HEAD, "dtype": "float32",
                "prompt": "Write a short story about a robot who learns to paint."},
    "qwen2.5-coder-1.5b": {"draft": os.path.join("model_cards", "qwen2.5-coder-1.5b-instruct-eagle2"),
                           "dtype": "bfloat16",
                           "prompt": "Write a Python function that merges two sorted lists into one sorted list, "
                                     "with a docstring and a few doctests."},
}  # fmt: skip


def demo_settings(args) -> dict:
    """The demo's draft, dtype and prompt: the flags given, else `DEMO_DEFAULTS` for --model (smollm2's for others)."""
    defaults = DEMO_DEFAULTS.get(args.model, DEMO_DEFAULTS["smollm2"])
    return {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}


def cmd_demo(args) -> None:
    """Plain generate on stock kernels (what a user has today), plain generate on the fast CPU kernels, and EAGLE-2
    with the recommended CPU setting (fast kernels, per-round tree budget, n-gram branch), on one prompt."""
    import time

    import torch
    from transformers import TextStreamer

    from .evaluation.assets import load_model
    from .kernels.cpu import optimize_for_cpu
    from .evaluation.evaluate import chat_input_ids
    from .integration import used_tree_options

    _threads(args.threads)
    settings = demo_settings(args)
    model, tokenizer = load_model(args.model, dtype=settings["dtype"])
    draft, source = load_draft(settings["draft"], model)
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": settings["prompt"]}])
    tree = used_tree_options(dict(tree=args.tree, tree_total_tokens=args.tree_total_tokens, tree_depth=args.tree_depth,
                                  tree_top_k=args.tree_top_k, tree_ngram=args.tree_ngram))  # fmt: skip
    print(f"target: {args.model} ({settings['dtype']})  draft: {source}\nprompt: {settings['prompt']}\n")

    def timed(**kw):
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True, **kw)
        return out, time.perf_counter() - start

    optimize_for_cpu(model, enable=False, release=False)
    model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
    stock, stock_s = timed()
    optimize_for_cpu(model, release=False)  # measures the kernel crossover once per machine (cached)
    model.generate(ids, max_new_tokens=4, do_sample=False)
    model.generate(ids, assistant_model=draft, max_new_tokens=8, do_sample=False, **tree)  # cost curve (cached)
    plain, plain_s = timed()
    print("--- EAGLE-2 output (streamed) ---")
    out, eagle_s = timed(assistant_model=draft, streamer=TextStreamer(tokenizer, skip_prompt=True), **tree)
    stats = out.eagle_stats
    print("\n--- stats ---")
    rounding = "" if settings["dtype"] == "float32" else " (bf16/fp16: a many-token pass may round differently)"
    same = torch.equal(out.sequences, plain.sequences)
    print(f"identical to plain greedy generate (same kernels): {same}{rounding}; "
          f"plain stock vs fast kernels identical: {torch.equal(stock.sequences, plain.sequences)}")  # fmt: skip
    print(f"new tokens: {stats.new_tokens}   target forwards: {stats.target_forwards}   tau: {stats.tau:.2f}")
    print(f"wall time: plain (stock kernels) {stock_s:.2f}s, plain (fast kernels) {plain_s:.2f}s, eagle2 {eagle_s:.2f}s")
    print(f"speed-up: {plain_s / eagle_s:.2f}x over plain on the same kernels, {stock_s / eagle_s:.2f}x over stock plain")
    print(stats.summary())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-eagle2", description=_Raw(__doc__), epilog=_Raw(EXAMPLES[""]),
                     formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=argparse.ArgumentParser)  # only the top parser maps old spellings

    p = _verb(sub, "data", help="the data pipeline's single steps (extract, ..., train), each resumable: "
                                "`hf-eagle2 data STEP --help`")  # fmt: skip
    data = p.add_subparsers(dest="step", required=True, metavar="STEP")

    p = _verb(sub, "train-head", help="train a head end to end over a named recipe: extraction, training, eval-head "
                                      "and card, skipping the steps already done (resumable)")  # fmt: skip
    p.add_argument("--target", default="smollm2", help="the target: alias, local folder, GGUF file or Hub id (as "
                                                       "--model elsewhere)")  # fmt: skip
    p.add_argument("--recipe", choices=list(RECIPES), default=None, help="the recipe (--list-recipes shows them)")
    p.add_argument("--out", default=None, help="the run's folder: data/train, data/val, train (checkpoints), head "
                                               f"(the head and its card), eval.json and {LOG_NAME}")  # fmt: skip
    p.add_argument("--list-recipes", action="store_true", help="print the recipes and their settings, and exit")
    p.add_argument("--max-tokens", type=int, default=None, help="the training folder's token budget, in place of "
                                                                "the recipe's")  # fmt: skip
    p.add_argument("--max-conversations", type=int, default=None,
                   help="the training folder's conversation budget, in place of the recipe's")
    p.add_argument("--epochs", type=float, default=None, help="training epochs, in place of the recipe's")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the target's dtype in extraction, in place of the recipe's; training autocasts to bf16 "
                        "exactly when it is bfloat16 (use float32 on a CPU without native bf16)")  # fmt: skip
    p.add_argument("--kernels", choices=["stock", "fast"], default=None,
                   help="the target's kernels in extraction, in place of the recipe's (fast: optimize_for_cpu)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the head's draft vocabulary, in place of the recipe's (0: the full vocabulary)")
    p.add_argument("--head-intermediate-size", type=int, default=None,
                   help="the head's MLP width, in place of the target's (a cheaper draft step)")
    p.add_argument("--loss-positions", choices=["answers", "all"], default=None,
                   help="train on the assistant tokens (the recipes' choice) or on every position")
    p.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate the head (eval-head, the recipe's datasets) before the card (default: yes)")
    p.add_argument("--eval-limit", default=None, help="eval-head's prompts per dataset, in place of the recipe's "
                                                      "(as bench --limit: mtbench=10,humaneval=10)")  # fmt: skip
    p.add_argument("--eval-max-new-tokens", type=int, default=None,
                   help="eval-head's new tokens per prompt, in place of the recipe's")
    p.add_argument("--dry-run", action="store_true", help="print the steps and which are done, run nothing")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_train_head)

    p = _verb(data, "extract", help="store target features for training (ShareGPT or self-distilled)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True)
    p.add_argument("--responses", choices=["target", "sharegpt"], default="target")
    p.add_argument("--split", choices=["train", "validation"], default="train")
    p.add_argument("--max-tokens", type=int, default=None, help="token budget (prompt + response tokens)")
    p.add_argument("--max-conversations", type=int, default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--min-prompt-tokens", type=int, default=0,
                   help="self-distillation: only prompts longer than this (the turns another folder's smaller "
                   "--max-prompt-tokens left out)")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--draft", default=None, help="an EAGLE head folder: self-distilled answers by tree speculation")
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="self-distillation: answer the first user turn, or every user turn (one sequence each)")
    p.add_argument("--eagle3", action="store_true", help="also store the three target layers an EAGLE-3 head reads")
    p.add_argument("--kernels", choices=["stock", "fast"], default="stock",
                   help="fast: the target's linears on prepacked CPU kernels (optimize_for_cpu), as bench runs it; "
                        "1.10x the teacher-forcing rate of the 1.5B in bf16 on a 2-core Xeon "
                        "(benchmarks/teacher_forcing_rate.py), features equal up to bf16 rounding")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_extract)

    p = _verb(data, "export-tokens", help="a feature folder's tokens (answers, masks, shards) as one small .npz")
    p.add_argument("--data", required=True, help="a folder written by extract")
    p.add_argument("--out", required=True, help="the .npz to write")
    p.set_defaults(func=cmd_export_tokens)

    p = _verb(data, "export-prompts", help="the prompts of extract's work list (self-distillation), as a token "
                                              "archive that `answer` can answer on another machine")  # fmt: skip
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", help="the dtype the answers are to be written in (the folder's)")
    p.add_argument("--out", required=True, help="the .npz to write")
    p.add_argument("--shards", type=shard_range, required=True, help="work-list batches 'A-B', 'A-' or 'A' (the "
                                                                     "shard files extract would write)")  # fmt: skip
    p.add_argument("--split", choices=["train", "validation"], default="train")
    p.add_argument("--turns", choices=["first", "all"], default="first")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--min-prompt-tokens", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--eagle3", action="store_true", help="the folder stores the EAGLE-3 layers (recorded in the meta)")
    p.set_defaults(func=cmd_export_prompts)

    p = _verb(data, "answer", help="greedy (or sampled) answers to an export-prompts archive, as a token archive "
                                      "(resumes from --out; e.g. on a GPU)")  # fmt: skip
    p.add_argument("--tokens", required=True, help="a .npz written by export-prompts")
    p.add_argument("--out", required=True, help="the .npz of answered shards to write (or continue)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default=None, help="default: the one the prompts were exported for")
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--rows-per-call", type=int, default=64, help="prompts per generate call")
    p.add_argument("--rows-per-write", type=int, default=2048, help="about this many prompts (whole shards) between "
                                                                    "two writes of --out")  # fmt: skip
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds from the first group (after the model loads): start no group that would end later")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the answers at this temperature from the target's full distribution (0: greedy); "
                        "recorded in the archive, which then joins and resumes only with answers drawn alike")
    p.add_argument("--seed", type=int, default=None, help="with --temperature: the seed every call's own seed is "
                                                          "derived from (default 0; recorded)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_answer)

    p = _verb(data, "join-tokens", help="token archives of consecutive shards of one work list, as one")
    p.add_argument("--tokens", nargs="+", required=True, help="the archives, in shard order")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_join_tokens)

    p = _verb(data, "rebuild-features", help="a feature folder again from export-tokens' .npz: the target's "
                                                "forward only, no answers to write (resumes from --out)")  # fmt: skip
    p.add_argument("--tokens", required=True, help="a .npz written by export-tokens")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default=None, help="the target's dtype for the features (default: the one that wrote "
                                                 "the answers, which the .npz records; float32 where bf16 is emulated, "
                                                 "but then extract cannot extend the folder)")  # fmt: skip
    p.add_argument("--eagle3", action=argparse.BooleanOptionalAction, default=None,
                   help="store the three layers an EAGLE-3 head reads (default: as the exported folder did)")
    p.add_argument("--shards", type=shard_range, default=None, help="only these shards, 'A-B' (inclusive), 'A-' (to "
                                                                    "the last) or 'A': e.g. the answers a head has "
                                                                    "not been trained on yet")  # fmt: skip
    p.add_argument("--max-prompt-context", type=int, default=None,
                   help="store each sequence from at most N positions before its answer on (features still from the "
                        "whole sequence): what train --max-prompt-context N or less reads, in less disk; the folder "
                        "is then for training only")  # fmt: skip
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_rebuild_features)

    p = _verb(data, "cut-features", help="cut a feature folder's stored prompts in place, as rebuild-features "
                                            "--max-prompt-context would have stored them")  # fmt: skip
    p.add_argument("--folder", required=True)
    p.add_argument("--max-prompt-context", type=int, required=True)
    p.add_argument("--tokens", required=True, help="a token archive holding every shard of the folder whole (the "
                                                   "one it was rebuilt from, or export-tokens of it before the cut): "
                                                   "the cut drops prompt tokens for good")  # fmt: skip
    p.set_defaults(func=cmd_cut_features)

    p = _verb(data, "train", help="train an EAGLE head on extracted features (resumes from --out)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--val-data", nargs="*", default=[])
    p.add_argument("--out", required=True, help="run folder (checkpoint.pt, snapshots/)")
    p.add_argument("--head-out", default=None, help="where to save the trained head (default OUT/head)")
    p.add_argument("--head-dtype", default=None, help="save the head in this dtype (e.g. float16: half the file)")
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="0 = full vocabulary")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--max-prompt-context", type=int, default=None,
                   help="start each row at most this many positions before its first answer token (default: whole "
                        "prompts); the held-out rows stay whole")
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--noise-std", type=float, default=None, help="feature noise (default 0.2; EAGLE-3: 0)")
    p.add_argument("--head", choices=["eagle2", "eagle3"], default="eagle2",
                   help="eagle2: EAGLE-1/2 layout; eagle3: needs features extracted with --eagle3")
    p.add_argument("--autocast", choices=["bfloat16"], default=None,
                   help="run the training step's matmuls in bf16 (weights, optimizer, soft labels and evaluation "
                        "stay fp32)")
    p.add_argument("--unroll", type=int, default=None,
                   help="training-time-test passes on the head's own predictions (default 1; EAGLE-3: 3)")
    p.add_argument("--head-intermediate-size", type=int, default=None,
                   help="a new head's MLP width (default: the target's); the draft step's cost is mostly its MLP")
    p.add_argument("--loss-positions", choices=["answers", "all"], default="answers",
                   help="train on the assistant tokens (default) or on every position (user turns too: teacher-"
                        "forced features hold the target everywhere)")
    p.add_argument("--soft-labels", choices=["float32", "bfloat16"], default="float32",
                   help="precision of the target distribution the CE term matches: bfloat16 is the bf16 target's own "
                        "(its lm_head GEMM in bf16: a 1.5B head's step 1.17x faster on a 2-core Xeon with AMX)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--snapshot-every-tokens", type=int, default=None)
    p.add_argument("--init", default=None,
                   help="start from this trained head (folder or Hub id; its draft vocabulary is kept) instead of a "
                        "random one: more data, a training-time-test phase, or fine-tuning an official head")
    p.add_argument("--grow-vocab", action="store_true",
                   help="with --init: grow the head's draft vocabulary to --draft-vocab-size with the most frequent "
                        "assistant tokens of --data it lacks (trained rows kept; new EAGLE-3 lm_head rows start at "
                        "zero)")
    p.add_argument("--lm-head-init", choices=["target", "random"], default=None,
                   help="a new EAGLE-3 head's own lm_head: start from the target's rows of the draft vocabulary "
                        "(default) or at random")
    p.add_argument("--freeze-lm-head", action="store_true",
                   help="EAGLE-3: the lm_head is the target's rows of the draft vocabulary (0 = all of it), frozen; "
                        "with --init the init head's body is kept and its lm_head and vocabulary replaced")
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_train)

    p = _verb(sub, "eval-head", help="τ and calibration of a head under EAGLE-2 generation")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft", required=True)
    p.add_argument("--dataset", default="mtbench,humaneval",
                   help="comma list of mtbench, mtbench2 (MT-bench's second turns, after the target's own first "
                        "answer), humaneval, sharegpt (held-out first turns), builtin")
    p.add_argument("--limit", default=None,
                   help="prompts per dataset: N, or per name (mtbench=80,humaneval=40)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    _tree_args(p, total=60, depth=6, top_k=10)
    p.add_argument("--full-vocab", action="store_true", help="draft over the full vocabulary (ignore d2t)")
    p.add_argument("--kernels", choices=["stock", "fast"], default="stock",
                   help="fast: prepacked CPU linears (optimize_for_cpu), the kernels bench and demo use; τ may differ "
                        "slightly from stock (rounding can flip a near-tied greedy token): compare heads on the same "
                        "kernels")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="PNG reliability diagram")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_eval_head)

    p = _verb(sub, "bench", help="benchmark speculative decoders side by side (interleaved, identity-checked)")
    p.add_argument("--model", default="smollm2", help="local path, GGUF file, package:file.gguf or Hub id")
    p.add_argument("--draft", default=DEFAULT_HEAD)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--dataset", default="mtbench",
                   help="comma list of mtbench, humaneval, sharegpt (held-out first turns), builtin")
    p.add_argument("--limit", default=None,
                   help="prompts per dataset: N, or per name (mtbench=10,humaneval=20); MT-bench counts questions")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--methods", default=None, help="comma list (default: bench.DEFAULT_METHODS)")
    _tree_args(p, total=16, depth=6, top_k=4)
    p.add_argument("--chain-depth", type=int, default=4)
    p.add_argument("--first-turn-only", action="store_true", help="skip MT-bench second turns")
    p.add_argument("--kernels", choices=["fast", "stock"], default="fast",
                   help="kernels of every method but plain_stock (fast: hf_eagle2.optimize_for_cpu)")
    p.add_argument("--cost-curve", action="store_true",
                   help="only measure the target's verify cost per q on stock and fast kernels (written to --out)")
    p.add_argument("--profile", action="store_true",
                   help="also count aten ops, kernel launches and host reads per round outside the target's forward")
    p.add_argument("--serve-venv", default=".venv-serve",
                   help="venv with vLLM's CPU build, for the vllm_plain / vllm_eagle3 methods (`make serve-check` makes it)")
    p.add_argument("--vllm-draft", default="model_cards/smollm2-135m-instruct-eagle3",
                   help="EAGLE-3 head that vllm_eagle3 serves (exported in the speculators layout)")
    p.add_argument("--vllm-k", type=int, default=3, help="vllm_eagle3's num_speculative_tokens")
    p.add_argument("--vllm-timeout", type=float, default=600.0, help="seconds for one vLLM request")
    p.add_argument("--assistant", default=None,
                   help="the separate assistant model of the assisted / assisted_<n> methods (transformers' own "
                        "assisted decoding), e.g. qwen2.5-coder-0.5b for --model qwen2.5-coder-1.5b")
    p.add_argument("--out", default="runs/bench/results.json",
                   help="results JSON; OUT.journal.jsonl gets each finished prompt, and a bench run again with the "
                        "same settings resumes from it")
    p.add_argument("--restart", action="store_true", help="discard OUT.journal.jsonl and measure every prompt again")
    p.add_argument("--report", action="store_true",
                   help="print the results of OUT.journal.jsonl as it stands (finished prompts only; no model loaded)")
    p.add_argument("--readme", default=None, help="also write the results table into this README (RESULTS markers)")
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=cmd_bench)

    p = _verb(sub, "card", help="generate a head folder's README.md model card from its results.json")
    p.add_argument("--head", required=True)
    p.add_argument("--results", default=None, help="results JSON (default HEAD/results.json)")
    p.add_argument("--eval", nargs="+", default=None,
                   help="eval-head --out JSON(s) to record in results.json (several: one head's evaluations of "
                        "different datasets, made with the same settings)")
    p.add_argument("--bench", default=None, help="bench --out JSON to record in results.json")
    p.add_argument("--curve", nargs="*", default=None,
                   help="eval-head JSONs of training snapshots (τ curve), and the results.json of an earlier "
                        "stage's card to carry its measured points")
    p.add_argument("--set", nargs="*", default=None, help="KEY=VALUE strings to record (hardware=..., ...)")
    p.add_argument("--compare", nargs="*", default=None, metavar="NAME=FOLDER",
                   help="other head folders (with results.json) for the side-by-side table")
    p.add_argument("--repo-id", default=None, help="user/name: the Hub repo the card's usage snippet loads")
    p.set_defaults(func=cmd_card)

    p = _verb(sub, "push", help="upload a head folder (card, config, weights) and/or the custom_generate recipe")
    p.add_argument("--head", default=None, help="head folder")
    p.add_argument("--custom-generate", nargs="?", const=DEFAULT_CUSTOM_GENERATE, default=None, metavar="FOLDER",
                   help=f"also (or only) upload this recipe folder as the repo's custom_generate/ (default "
                   f"./{DEFAULT_CUSTOM_GENERATE}); with --head, the same repo id then serves as custom_generate= and "
                   "assistant_model=")  # fmt: skip
    p.add_argument("--repo-id", required=True,
                   help="user/name (a bare name goes to your namespace); the card is rewritten to load it")  # fmt: skip
    p.add_argument("--private", action="store_true")
    p.set_defaults(func=cmd_push)

    p = _verb(sub, "demo", help="greedy chat demo: EAGLE-2 against plain generate")
    p.add_argument("--model", default="smollm2", help=f"the target; {', '.join(DEMO_DEFAULTS)} come with their head, "
                                                     "dtype and prompt")  # fmt: skip
    p.add_argument("--draft", default=None, help="the head (default: the one shipped for --model)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default=None, help="default: float32; bfloat16 for the 1.5B")
    _tree_args(p, total="auto", depth=6, top_k=None)
    p.add_argument("--tree-ngram", type=int, default=None, help="n-gram branch length (0: none; default: 8 on CPU)")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_demo)
    return parser


def _json_or_text(value: str):
    """`--set` values: numbers and JSON literals as such (extract_hours=1.8), anything else as text."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _int_or_auto(value: str):
    return value if value == "auto" else int(value)


def _tree_args(p, total, depth, top_k) -> None:
    p.add_argument("--tree", default="eagle2", choices=["eagle2", "eagle1", "chain"])
    p.add_argument("--tree-total-tokens", type=_int_or_auto, default=total, help='an int, or "auto"')
    p.add_argument("--tree-depth", type=_int_or_auto, default=depth, help='an int, or "auto"')
    p.add_argument("--tree-top-k", type=int, default=top_k)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
