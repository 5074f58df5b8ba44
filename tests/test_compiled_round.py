"""`tree_compile=True`: every draft level of the dynamic tree is one `torch.compile`d call (fullgraph, static
shapes over a `StaticKV`). After a warm-up call, 30 and more rounds compile nothing new and break no graph, and the
output is plain greedy `generate`'s (fp32), on tiny random Llama / Qwen2 / Gemma3 models and on SmolLM2 with the
shipped head."""

import pytest
import torch
from conftest import chat_ids, tiny_model
from torch._dynamo.utils import counters

from hf_eagle2 import EagleDraftModel
from hf_eagle2.engine import drafter
from hf_eagle2.kernels.cpu import optimize_for_cpu

GREEDY = dict(do_sample=False, eos_token_id=None, return_dict_in_generate=True)


def compiled_state() -> tuple[int, int]:
    """(graphs dynamo has compiled, graph breaks it has met) in this process."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def check_compiled_rounds(model, draft, ids, monkeypatch, new_tokens: int, **tree) -> None:
    calls = []
    real = drafter.compiled_level_step
    monkeypatch.setattr(drafter, "compiled_level_step", lambda device: lambda *a: calls.append(1) or real(device)(*a))
    plain = model.generate(ids, max_new_tokens=new_tokens, **GREEDY)
    model.generate(ids, assistant_model=draft, tree="eagle2", tree_compile=True, max_new_tokens=8, **tree, **GREEDY)
    before, levels_before = compiled_state(), len(calls)
    out = model.generate(ids, assistant_model=draft, tree="eagle2", tree_compile=True, max_new_tokens=new_tokens,
                         **tree, **GREEDY)  # fmt: skip
    assert out.eagle_stats.rounds >= 30, out.eagle_stats.rounds
    assert len(calls) - levels_before >= out.eagle_stats.rounds  # the levels ran compiled
    assert compiled_state() == before, "recompiled or broke a graph after warm-up"
    assert torch.equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_compiled_draft_levels_on_tiny_models(family, monkeypatch):
    model = tiny_model(family, seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    check_compiled_rounds(model, draft, torch.tensor([[5, 9, 3, 7, 11, 4, 6]]), monkeypatch, new_tokens=80,
                          tree_total_tokens=12, tree_depth=4, tree_top_k=4, tree_ngram=0)  # fmt: skip


@pytest.mark.parametrize("kernels", ["stock", "fast"])
def test_compiled_draft_levels_on_smollm2_with_the_defaults(smollm2, kernels, monkeypatch):
    """The CPU defaults (per-round budget, n-gram branch), on stock and prepacked linears (which step aside for
    the compiler)."""
    model, tokenizer = smollm2
    draft = EagleDraftModel.from_pretrained("model_cards/smollm2-135m-instruct-eagle2")
    optimize_for_cpu(model, enable=kernels == "fast")
    try:
        ids = chat_ids(tokenizer, "Explain in three sentences why the sky is blue.")
        check_compiled_rounds(model, draft, ids, monkeypatch, new_tokens=96)
    finally:
        optimize_for_cpu(model, enable=False)


def test_tree_compile_is_for_the_dynamic_tree():
    model = tiny_model("llama", seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    with pytest.raises(ValueError, match="tree_compile"):
        model.generate(torch.tensor([[5, 9, 3]]), assistant_model=draft, tree="eagle1", tree_compile=True,
                       max_new_tokens=4)  # fmt: skip
