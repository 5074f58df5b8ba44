import os
import sys

import pytest
import torch

import hf_eagle2  # noqa: F401  (installs the generate hook)

torch.set_num_threads(int(os.environ.get("HF_EAGLE2_TEST_THREADS", "2")))
# optional packages kept outside the venv (e.g. vLLM's speculators, which pins another transformers): appended,
# so they never shadow what the venv has
sys.path += [p for p in os.environ.get("HF_EAGLE2_TEST_EXTRA_PATH", "").split(os.pathsep) if p]

CHAT_PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a binary search tree is.",
    "Give me three tips for learning to cook.",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that returns the factorial of n.",
    "What are the main causes of climate change?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List five fruits that are red.",
    "How do I make a cup of tea?",
    "What is 12 times 13?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What is the difference between weather and climate?",
    "Give a one-line definition of machine learning.",
    "Name the planets of the solar system in order.",
    "Write a limerick about a programmer.",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion to a five year old.",
    "Say hi.",
    "Reply with just the word yes.",
]


@pytest.fixture(scope="session")
def smollm2():
    from hf_eagle2.evaluation.assets import load_model

    model, tokenizer = load_model("smollm2", dtype="float32")
    return model, tokenizer


def chat_ids(tokenizer, text):
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
    return out["input_ids"] if hasattr(out, "keys") else out


TINY_VOCAB = 32


def emulate_bf16(monkeypatch, native: bool):
    """Makes this machine look like an x86 CPU with (native=True) or without AVX512-BF16 / AMX."""
    monkeypatch.setattr("hf_eagle2.kernels.cpu.platform.machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def tiny_model(family: str, seed: int = 0, vocab: int = TINY_VOCAB, dtype=torch.float32, **overrides):
    """A tiny random causal LM (sdpa; eager for Gemma2, whose attention soft-capping sdpa cannot do) of the given
    family; small vocab so random drafts often agree. Cohere, Granite and Gemma2 post-process their logits (scale,
    divide, soft-cap), with values chosen so that it matters."""
    from transformers import (
        AutoModelForCausalLM, CohereConfig, Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, Qwen2Config,
    )  # fmt: skip

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if family == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False)
    elif family == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False)
    elif family == "gemma3":
        config = Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
    elif family == "cohere":
        config = CohereConfig(**common, logit_scale=0.25)
    elif family == "granite":
        config = GraniteConfig(**common, logits_scaling=4.0, tie_word_embeddings=False)
    elif family == "gemma2":
        config = Gemma2Config(
            **{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=8, final_logit_softcapping=2.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    attn = "eager" if family == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).to(dtype)
    # sharpen the output distribution: greedy text becomes more predictable, so drafts get accepted
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.pad_token_id = 0
    return model.eval()


_TRAINED = {}


def trained_tiny_draft(model, key, steps=300, seed=0):
    """An EAGLE head quickly trained on the tiny model's own greedy continuations, so that drafts are often
    accepted and long accepted paths (and EOS inside them) get exercised."""
    import tempfile

    from hf_eagle2.training.features import forward_features
    from hf_eagle2.training.train import FeatureSet, TrainConfig, Trainer

    if key in _TRAINED:
        return _TRAINED[key]
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    rows, masks = [], []
    for _ in range(48):
        prompt = torch.randint(3, vocab, (1, int(torch.randint(2, 20, (1,), generator=g))), generator=g)
        out = model.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None)
        rows.append(out[0].tolist())
        masks.append([0] * prompt.shape[1] + [1] * (out.shape[1] - prompt.shape[1]))
    feats, _ = forward_features(model, rows, pad_id=0)
    lengths = torch.tensor([len(r) for r in rows])
    data = FeatureSet(
        ids=torch.tensor([t for r in rows for t in r]),
        features=torch.cat(feats).half(),
        mask=torch.tensor([m for ms in masks for m in ms], dtype=torch.bool),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    )
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(data=[], out=out, draft_vocab_size=None, epochs=steps, lr=3e-3, warmup_steps=20,
                             batch_tokens=1024, max_steps=steps, save_every=10**9, eval_every=10**9, seed=seed)  # fmt: skip
        head = Trainer(config, model, data=data, progress=False).run(resume=False)
    _TRAINED[key] = head.bind(model).eval()
    return _TRAINED[key]
