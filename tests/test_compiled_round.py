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


def check_compiled_rounds(model, draft, ids, monkeypatch, new_tokens: int, verify: bool = False, **tree) -> None:
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
    # the verify pass runs compiled exactly over a static cache with room for the padded tree
    assert out.eagle_stats.verify_compiled == (out.eagle_stats.rounds if verify else 0)
    assert int(out.cache.get_seq_length()) == out.sequences.shape[1] - 1  # all but the last token, once each


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_compiled_draft_levels_on_tiny_models(family, monkeypatch):
    model = tiny_model(family, seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    check_compiled_rounds(model, draft, torch.tensor([[5, 9, 3, 7, 11, 4, 6]]), monkeypatch, new_tokens=80,
                          tree_total_tokens=12, tree_depth=4, tree_top_k=4, tree_ngram=0)  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compiled_verify_over_a_static_cache(family, monkeypatch):
    """cache_implementation="static" (sized with max_cache_len to hold the last round's padded tree): each round's
    verify pass is one compiled call of the model (`get_compiled_call`), the tree padded to a bucket of 16 nodes."""
    model = tiny_model(family, seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    ids = torch.tensor([[5, 9, 3, 7, 11, 4, 6]])
    check_compiled_rounds(model, draft, ids, monkeypatch, new_tokens=80, verify=True, tree_total_tokens=12,
                          tree_depth=4, tree_top_k=4, tree_ngram=0, cache_implementation="static",
                          max_cache_len=ids.shape[1] + 80 + 16)  # fmt: skip


def test_only_full_attention_static_caches_compile_the_verify_pass():
    """Sliding static layers (Gemma3) keep a Python-int length the compiler would specialise on every round, and
    dynamic caches grow: the verify pass stays eager there (the draft levels still compile)."""
    from transformers.cache_utils import DynamicCache, StaticCache

    from hf_eagle2.engine.verify_compiled import compiles_verify

    llama, gemma3 = tiny_model("llama", seed=3), tiny_model("gemma3", seed=3)
    assert compiles_verify(StaticCache(config=llama.config, max_cache_len=64))
    assert not compiles_verify(StaticCache(config=gemma3.config, max_cache_len=64))
    assert not compiles_verify(DynamicCache(config=llama.config)) and not compiles_verify(None)


def test_padding_nodes_see_only_themselves_and_no_real_node_sees_them():
    from hf_eagle2.engine.tree import DraftTree
    from hf_eagle2.engine.verify_compiled import bucket, pad_tree

    anc = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    tree = DraftTree(tokens=torch.tensor([[4, 8, 9]]), parents=torch.tensor([[-1, 0, 0]]),
                     depths=torch.tensor([[0, 1, 1]]), ancestors=anc, scores=torch.zeros(1, 3),
                     local_logp=torch.zeros(1, 3))  # fmt: skip
    padded = pad_tree(tree, bucket(3))
    assert padded.num_nodes == 16 and torch.equal(padded.ancestors[:, :3, :3], anc)
    assert not padded.ancestors[:, :3, 3:].any() and not padded.ancestors[:, 3:, :3].any()
    assert torch.equal(padded.ancestors[0, 3:, 3:], torch.eye(13, dtype=torch.bool))
    assert padded.depths[0, 3:].eq(0).all() and padded.parents[0, 3:].eq(-1).all()
    assert bucket(16) == 16 and bucket(17) == 32 and bucket(10**6) is None


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
