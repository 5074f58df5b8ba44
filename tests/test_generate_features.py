"""Everything else generate() does, with tree speculation on SmolLM2: logits processors per node, batches,
streamers, stop strings, pipelines, device_map, bf16, and a long run's memory."""

import os
import threading

import pytest
import torch
from conftest import chat_ids
from transformers import LogitsProcessor, LogitsProcessorList, TextIteratorStreamer, TextStreamer, pipeline

from hf_eagle2 import EagleDraftModel

SHIPPED_HEAD = os.path.join(os.path.dirname(__file__), "..", "model_cards", "smollm2-135m-instruct-eagle2")
TREE = dict(tree="eagle2", tree_total_tokens=16, tree_depth=6, tree_top_k=4)
PROMPTS = ["Write a short poem about the sea.", "Explain recursion to a five year old."]


@pytest.fixture(scope="module")
def head():
    return EagleDraftModel.from_pretrained(SHIPPED_HEAD)


class ParityPenalty(LogitsProcessor):
    """A user processor that depends on the prefix: penalise tokens with the parity of the prefix length."""

    def __call__(self, input_ids, scores):
        penalty = torch.zeros_like(scores)
        parity = input_ids.shape[1] % 2
        penalty[:, parity::2] = -0.7
        return scores + penalty


def processor_cases(tokenizer):
    the = tokenizer(" the", add_special_tokens=False)["input_ids"]
    comma = tokenizer(",", add_special_tokens=False)["input_ids"][0]
    return {
        "repetition_penalty": dict(repetition_penalty=1.3),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=3),
        "bad_words_ids": dict(bad_words_ids=[the, [comma]]),
        "min_new_tokens": dict(min_new_tokens=30),
        "min_length": dict(min_length=64),
        "suppress_tokens": dict(suppress_tokens=[comma, 13]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[504, 1206, 378]),
        "forced_eos_token_id": dict(forced_eos_token_id=2),
        "sequence_bias": dict(sequence_bias={tuple(the): -4.0, (comma,): 3.0}),
        "custom_processor": dict(logits_processor=LogitsProcessorList([ParityPenalty()])),
    }


@pytest.mark.parametrize(
    "case",
    ["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_new_tokens", "min_length", "suppress_tokens",
     "begin_suppress_tokens", "forced_eos_token_id", "sequence_bias", "custom_processor"],
)  # fmt: skip
def test_logits_processor_greedy_identity(smollm2, head, case):
    model, tokenizer = smollm2
    kwargs = processor_cases(tokenizer)[case]
    for text in PROMPTS + ["Say hi."]:
        ids = chat_ids(tokenizer, text)
        ref = model.generate(ids, do_sample=False, max_new_tokens=48, **kwargs)
        out = model.generate(ids, assistant_model=head, max_new_tokens=48, **TREE, **kwargs)
        assert torch.equal(out, ref), f"{case}: {text}"


def test_batch_rows_equal_batch_of_one(smollm2, head):
    model, tokenizer = smollm2
    texts = ["Say hi.", "Write a short poem about the sea.", "Give me three tips for learning to cook, with details."]
    tokenizer.padding_side = "left"
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False) for t in texts]
    enc = tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
    assert len(set(enc["attention_mask"].sum(-1).tolist())) == 3  # three prompt lengths
    out = model.generate(**enc, assistant_model=head, max_new_tokens=64, return_dict_in_generate=True, **TREE)
    finished_at = []
    for i, t in enumerate(texts):
        single = model.generate(chat_ids(tokenizer, t), do_sample=False, max_new_tokens=64)
        n_pad = int((enc["attention_mask"][i] == 0).sum())
        row = out.sequences[i, n_pad:]
        assert torch.equal(row[: single.shape[1]], single[0]), t
        assert bool((row[single.shape[1] :] == tokenizer.pad_token_id).all())  # finished rows are padded
        finished_at.append(single.shape[1] - chat_ids(tokenizer, t).shape[1])
    stats = out.eagle_stats
    assert len(stats.tau_per_row) == 3 and sum(stats.new_tokens_per_row) == stats.new_tokens
    assert len(set(finished_at)) > 1  # rows finished at different times


class TokenRecorder(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True)
        self.tokens, self.ended = [], False

    def put(self, value):
        if not self.next_tokens_are_prompt:
            self.tokens += value.flatten().tolist()
        super().put(value)

    def end(self):
        self.ended = True
        super().end()


def test_streamers_receive_exactly_the_final_tokens(smollm2, head):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, PROMPTS[0])
    recorder = TokenRecorder(tokenizer)
    out = model.generate(ids, assistant_model=head, max_new_tokens=60, streamer=recorder, **TREE)
    assert recorder.ended and recorder.tokens == out[0, ids.shape[1] :].tolist()
    iterator = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=model.generate(
        ids, assistant_model=head, max_new_tokens=60, streamer=iterator, **TREE)))  # fmt: skip
    thread.start()
    text = "".join(iterator)
    thread.join()
    assert text == tokenizer.decode(result["out"][0, ids.shape[1] :], skip_special_tokens=True)


def test_stop_strings(smollm2, head):
    model, tokenizer = smollm2
    for text, stops in [(PROMPTS[0], ["sea", "\n"]), (PROMPTS[1], [".", "function"])]:
        ids = chat_ids(tokenizer, text)
        ref = model.generate(ids, do_sample=False, max_new_tokens=64, stop_strings=stops, tokenizer=tokenizer)
        out = model.generate(ids, assistant_model=head, max_new_tokens=64, stop_strings=stops, tokenizer=tokenizer, **TREE)
        assert torch.equal(out, ref)
        assert ref.shape[1] - ids.shape[1] < 64  # the stop string did stop it


def test_pipeline_with_chat_messages(smollm2, head):
    model, tokenizer = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ref = pipe(messages, max_new_tokens=40, do_sample=False)
    out = pipe(messages, assistant_model=head, max_new_tokens=40, do_sample=False, **TREE)
    assert out[0]["generated_text"] == ref[0]["generated_text"]
    assert out[0]["generated_text"][-1]["role"] == "assistant"
    plain_text = pipe("The capital of France is", max_new_tokens=20, do_sample=False)
    spec_text = pipe("The capital of France is", assistant_model=head, max_new_tokens=20, do_sample=False, **TREE)
    assert spec_text == plain_text


def test_device_map_cpu(head):
    """A target loaded through accelerate's device_map path (transformers 5.x sets no `hf_device_map` for a
    single-device map, so there is nothing more to check about the placement than the device)."""
    from hf_eagle2.evaluation.assets import load_model

    model, tokenizer = load_model("smollm2", device_map="cpu")
    assert model.device.type == "cpu" and model.lm_head.weight.device.type == "cpu"
    ids = chat_ids(tokenizer, PROMPTS[0])
    ref = model.generate(ids, do_sample=False, max_new_tokens=40)
    out = model.generate(ids, assistant_model=head, max_new_tokens=40, **TREE)
    assert torch.equal(out, ref)


def test_bf16_target_on_cpu():
    """A bf16 target (the head follows its dtype). Tree and sequential bf16 arithmetic round differently, so
    this checks that it runs, accepts drafts and mostly agrees with plain bf16 greedy decoding."""
    from hf_eagle2.evaluation.assets import load_model

    model, tokenizer = load_model("smollm2", dtype="bfloat16")
    head = EagleDraftModel.from_pretrained(SHIPPED_HEAD)
    ids = chat_ids(tokenizer, PROMPTS[0])
    ref = model.generate(ids, do_sample=False, max_new_tokens=48)
    out = model.generate(ids, assistant_model=head, max_new_tokens=48, return_dict_in_generate=True, **TREE)
    assert head.fc.weight.dtype == torch.bfloat16
    assert out.eagle_stats.tau > 1.5
    n = min(ref.shape[1], out.sequences.shape[1])
    agree = (ref[0, :n] == out.sequences[0, :n]).float().mean()
    assert agree > 0.5


def test_sampling_seed_reproducible_on_smollm2(smollm2, head):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, PROMPTS[1])
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(model.generate(ids, assistant_model=head, do_sample=True, temperature=0.8, top_p=0.9,
                                   max_new_tokens=40, **TREE))  # fmt: skip
    assert torch.equal(outs[0], outs[1])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_long_run_cache_and_memory(smollm2, head):
    """2048 new tokens: the cache holds exactly the sequence (minus the last token) and the process does not grow
    beyond the cache's own growth."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    model, tokenizer = smollm2
    samples = []

    class RecordMemory(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            samples.append((input_ids.shape[1], _rss_bytes()))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = chat_ids(tokenizer, "Write a very long story about a journey across the mountains.")
    out = model.generate(ids, assistant_model=head, max_new_tokens=2048, min_new_tokens=2048, return_dict_in_generate=True,
                         stopping_criteria=StoppingCriteriaList([RecordMemory()]), **TREE)  # fmt: skip
    assert out.sequences.shape[1] == ids.shape[1] + 2048
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1
    cfg = model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32 keys + values
    start = next(rss for n, rss in samples if n >= ids.shape[1] + 512)
    end = samples[-1][1]
    cache_growth = (2048 - 512) * kv_per_token
    assert end - start < 2 * cache_growth + 64 * 2**20, (end - start, cache_growth)
