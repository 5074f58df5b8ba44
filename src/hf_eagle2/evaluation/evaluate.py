"""Evaluation prompts (MT-bench, HumanEval, ShareGPT's held-out split, a built-in smoke list) and `eval_head`: τ of a head under real
EAGLE-2 generation, with the calibration log of every drafted node."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .assets import humaneval_problems, mtbench_questions
from ..heads.calibration import calibration_report, merge_logs
from ..integration import used_tree_options
from ..engine.stats import tau_of
from ..training.data import conversation_base, is_heldout, iter_sharegpt

BUILTIN_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a good night's sleep.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the water cycle for a ten year old.",
]
DATASETS = ("mtbench", "mtbench2", "humaneval", "sharegpt", "builtin")
SHAREGPT_PROMPT_CHARS = 2000  # held-out first turns longer than this are skipped (pasted documents, not chat)


@dataclass
class Prompt:
    """A chat to answer. `follow_up` (MT-bench's second turns): the user turn that comes after the model's own
    answer to `messages`; `bench` measures it beside the first, `eval-head --dataset mtbench2` alone."""

    id: str
    messages: list[dict]
    follow_up: str | None = None


def parse_limit(text: str | None, datasets: list[str] | None = None) -> int | dict[str, int] | None:
    """`--limit` text: "5" (every dataset) or "mtbench=80,humaneval=40" (per dataset; a dataset not named is not
    capped). A name not in `datasets` is refused: a misspelt one would leave its dataset uncapped."""
    if text is None or not text.strip():
        return None
    if "=" not in text:
        return int(text)
    caps = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"--limit takes N or name=N,name=N (e.g. mtbench=10,humaneval=20), got {text!r}")
        if name.strip() in caps:
            raise ValueError(f"--limit names {name.strip()} twice: {text!r}")
        caps[name.strip()] = int(value)
    unknown = sorted(set(caps) - set(datasets)) if datasets is not None else []
    if unknown:
        raise ValueError(f"--limit names {', '.join(unknown)}, not among the datasets {', '.join(datasets)}")
    return caps


def load_prompts(dataset: str, limit: int | dict[str, int] | None = None) -> list[Prompt]:
    """First-turn chat prompts of a dataset, the first `limit` of them (one cap, or a cap per dataset name).
    MT-bench's carry their second turns (`Prompt.follow_up`), and "mtbench2" is the same list, for `eval_head` to
    measure those. HumanEval prompts are the problem's code, given as the user turn; "sharegpt":
    `sharegpt_heldout_first_turns`."""
    if isinstance(limit, dict):
        limit = limit.get(dataset)
    if dataset in ("mtbench", "mtbench2"):
        items = [Prompt(f"mtbench-{q['question_id']}", [{"role": "user", "content": q["turns"][0]}], q["turns"][1])
                 for q in mtbench_questions()]  # fmt: skip
    elif dataset == "humaneval":
        items = [Prompt(p["task_id"], [{"role": "user", "content": p["prompt"]}]) for p in humaneval_problems()]
    elif dataset == "sharegpt":
        items = sharegpt_heldout_first_turns()
    elif dataset == "builtin":
        items = [Prompt(f"builtin-{i}", [{"role": "user", "content": t}]) for i, t in enumerate(BUILTIN_PROMPTS)]
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {DATASETS}")
    return items[:limit] if limit else items


def sharegpt_heldout_first_turns() -> list[Prompt]:
    """First user turns of held-out ShareGPT conversations (`training.data.is_heldout`) that no training chunk
    continues: only first chunks (`<base>_0`) of conversations with no chunk in the training split, and at most
    SHAREGPT_PROMPT_CHARS long. The prompts of a τ comparison between data sources that no head trained on."""
    conversations = list(iter_sharegpt(split="all"))
    trained = {conversation_base(c.id) for c in conversations if not is_heldout(c.id)}
    return [Prompt(f"sharegpt-{c.id}", c.messages[:1]) for c in conversations
            if is_heldout(c.id) and c.id.endswith("_0") and conversation_base(c.id) not in trained
            and c.messages[0]["role"] == "user" and len(c.messages[0]["content"]) <= SHAREGPT_PROMPT_CHARS]  # fmt: skip


def follow_up_chat(prompt: Prompt, first_answer: str) -> list[dict]:
    """The chat of `prompt`'s follow-up: its first turn, the model's answer to it, then the follow-up."""
    return [*prompt.messages, {"role": "assistant", "content": first_answer},
            {"role": "user", "content": prompt.follow_up}]  # fmt: skip


def chat_input_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return out["input_ids"] if hasattr(out, "keys") else out


def add_histograms(a: list[int], b: list[int]) -> list[int]:
    width = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(width)]


@torch.inference_mode()
def eval_head(model, tokenizer, draft, datasets=("mtbench", "humaneval"), limit=None, max_new_tokens=256,
              tree_kwargs: dict | None = None, calibration: bool = True, progress: bool = True,
              kernels: str = "stock") -> dict:  # fmt: skip
    """τ per dataset under greedy tree speculation (defaults: EAGLE-2, m=60, depth 6, k=10, no n-gram branch:
    τ here is the head's own, not helped by prompt lookup).

    kernels="fast" runs the target (and an EAGLE-2 head) on `optimize_for_cpu`'s prepacked linears, "stock" on
    `nn.Linear`'s, and the model's own kernels are restored after: "fast" evaluates τ on the kernels the bench and
    demo run. τ may differ slightly between the two (another summation order can flip a near-tied greedy token), so
    compare heads evaluated on the same kernels (recorded in the result). At m=60 a round cost about the same on
    both in the one comparison made (~210 ms for SmolLM2 on 2 cores): the 60-token verify is past the range where
    the packed kernels gain most."""
    if kernels not in ("stock", "fast"):
        raise ValueError(f"kernels must be 'stock' or 'fast', got {kernels!r}")
    from ..kernels.cpu import is_optimized, optimize_for_cpu

    was = is_optimized(model)
    optimize_for_cpu(model, enable=kernels == "fast", release=False)  # the head follows when it binds
    try:
        if kernels == "fast" and not is_optimized(model):
            raise ValueError("kernels='fast' needs a CPU model and a torch build with oneDNN (optimize_for_cpu "
                             "left this model on its stock kernels)")  # fmt: skip
        out = _eval_head(model, tokenizer, draft, datasets, limit, max_new_tokens, tree_kwargs, calibration, progress)
    finally:
        optimize_for_cpu(model, enable=was)  # packed copies made for this evaluation alone are released
        draft.bind(model)  # and the head follows the model's kernels again
    return out | {"kernels": kernels}


def _eval_head(model, tokenizer, draft, datasets, limit, max_new_tokens, tree_kwargs, calibration, progress) -> dict:
    """Per dataset: τ, the acceptance histogram and tokens/s over its prompts ("mtbench2": over MT-bench's second
    turns, each asked after the target's greedy first answer of up to max_new_tokens, which is not counted)."""
    tree_kwargs = dict(tree="eagle2", tree_total_tokens=60, tree_depth=6, tree_top_k=10, tree_ngram=0) | dict(tree_kwargs or {})
    tree_kwargs = used_tree_options(tree_kwargs)
    results, logs = {}, []
    for dataset in datasets:
        prompts = load_prompts(dataset, limit)
        new_tokens = prefill_tokens = forwards = 0
        hist: list[int] = []
        seconds = 0.0
        for prompt in tqdm(prompts, desc=f"eval {dataset}", disable=not progress):
            messages = prompt.messages
            if dataset == "mtbench2":  # the second turn, after the target's own first answer (not measured)
                first_answer = _answer(model, tokenizer, draft, messages, max_new_tokens, tree_kwargs)
                messages = follow_up_chat(prompt, first_answer)
            ids = chat_input_ids(tokenizer, messages)
            start = time.perf_counter()
            out = model.generate(
                ids, assistant_model=draft, max_new_tokens=max_new_tokens, do_sample=False,
                return_dict_in_generate=True, eagle_record_calibration=calibration, **tree_kwargs,
            )  # fmt: skip
            seconds += time.perf_counter() - start
            stats = out.eagle_stats
            new_tokens += stats.new_tokens
            prefill_tokens += sum(stats.prefill_tokens_per_row)
            forwards += stats.target_forwards
            hist = add_histograms(hist, stats.accept_hist)
            if calibration and stats.calibration is not None:
                logs.append(stats.calibration)
        results[dataset] = {
            "prompts": len(prompts),
            "new_tokens": new_tokens,
            "prefill_tokens": prefill_tokens,  # one per prompt, produced by no round: not in tau
            "target_forwards": forwards,
            "tau": tau_of(new_tokens, prefill_tokens, forwards) or 0.0,
            "accept_hist": hist,
            "tokens_per_second": new_tokens / max(seconds, 1e-9),
        }
    out = {"max_new_tokens": max_new_tokens, "tree": tree_kwargs, "datasets": results}
    if calibration and logs:
        out["calibration"] = calibration_report(merge_logs(logs))
    return out


def _answer(model, tokenizer, draft, messages: list[dict], max_new_tokens: int, tree_kwargs: dict) -> str:
    """The target's greedy reply to `messages` (up to max_new_tokens, through the head: in fp32 the tokens of plain
    greedy decoding), as the text a chat would keep in its history."""
    ids = chat_input_ids(tokenizer, messages)
    out = model.generate(ids, assistant_model=draft, max_new_tokens=max_new_tokens, do_sample=False, **tree_kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
