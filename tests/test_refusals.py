"""Every generate() option the tree loop cannot reproduce exactly is refused by name before any target forward;
per-row processors work per row."""

import pytest
import torch
from conftest import tiny_model
from transformers import CompileConfig, SynthIDTextWatermarkingConfig, WatermarkingConfig

from hf_eagle2 import EagleDraftModel
from hf_eagle2.evaluation.bench import ForwardCounter  # counts target forwards (a hook on the decoder)
from hf_eagle2.engine.decoding import _check_supported

REFUSED = {
    "contrastive": (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    "dola": (dict(dola_layers="high"), "dola_layers"),
    "constraints": (dict(constraints=[[5, 6]]), "constraints"),  # the Constraint classes left transformers 5
    "force_words_ids": (dict(force_words_ids=[[5]]), "force_words_ids"),
    "prompt_lookup": (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    "guidance_scale": (dict(guidance_scale=1.5), "guidance_scale"),
    "prefill_chunk_size": (dict(prefill_chunk_size=4), "prefill_chunk_size"),
    "synced_gpus": (dict(synced_gpus=True), "synced_gpus"),
    "compile_config": (dict(compile_config=CompileConfig()), "compile_config"),
    "synthid": (dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[3, 5, 7, 11], ngram_len=2)), "SynthID"),
    "unknown_model_input": (dict(output_router_logits=True), "output_router_logits"),
    "position_ids": (dict(position_ids=torch.arange(5, 12).unsqueeze(0)), "position_ids"),
    "paged": (dict(cache_implementation="paged"), "paged"),
}


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama", seed=1)
    return model, EagleDraftModel.from_target(model, seed=0)


@pytest.mark.parametrize("case", REFUSED)
def test_refused_by_name_before_any_forward(llama, case):
    model, draft = llama
    kwargs, name = REFUSED[case]
    ids = torch.randint(3, 32, (1, 7), generator=torch.Generator().manual_seed(0))
    counter = ForwardCounter(model)
    try:
        with pytest.raises((ValueError, NotImplementedError), match=name):
            model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=5, **kwargs)
    finally:
        counter.close()
    assert counter.calls == 0


@pytest.mark.parametrize(
    "rope",
    [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
     {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 64}],
    ids=["dynamic", "longrope"],
)  # fmt: skip
def test_position_dependent_rope_is_refused(rope):
    model = tiny_model("llama", seed=2, rope_parameters=rope)
    draft = EagleDraftModel.from_target(model, seed=0)
    counter = ForwardCounter(model)
    with pytest.raises(NotImplementedError, match=rope["rope_type"]):
        model.generate(torch.tensor([[5, 6, 7]]), assistant_model=draft, tree="eagle2", max_new_tokens=5)
    assert counter.calls == 0


def test_model_inputs_the_tree_cannot_pass_on_are_refused():
    """GPT-2 takes token_type_ids, so transformers lets them through; the tree loop would drop them."""
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_embd=64, n_layer=2, n_head=4, n_positions=512)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    draft = EagleDraftModel.from_target(tiny_model("llama"), seed=0)  # same hidden size and vocabulary
    ids = torch.tensor([[5, 6, 7, 8]])
    counter = ForwardCounter(model)
    with pytest.raises(ValueError, match="token_type_ids"):
        model.generate(ids, token_type_ids=torch.ones_like(ids), assistant_model=draft, tree="eagle2", max_new_tokens=5)
    assert counter.calls == 0
    # a multimodal input, as a vision-language model's generate would hand it on
    model_kwargs = {"attention_mask": None, "cache": None, "use_cache": True, "pixel_values": torch.zeros(1, 3, 8, 8)}
    with pytest.raises(ValueError, match="pixel_values"):
        _check_supported(model, ids, model.generation_config, model_kwargs, None, False)


def allowed_tokens(batch_id, ids):
    """A per-row constraint that depends on the prefix: row 0 even tokens, row 1 odd ones; never the last token."""
    allowed = [t for t in range(3, 32) if t % 2 == batch_id % 2 and t != int(ids[-1])]
    return allowed[int(ids.sum()) % 3 :]


@pytest.mark.parametrize("tree", ["eagle2", "chain"])
@pytest.mark.parametrize("penalty", ["repetition_penalty", "encoder_repetition_penalty"])
def test_prompt_penalties_see_each_rows_own_prompt(llama, tree, penalty):
    """In a padded batch transformers builds these processors per prompt (padding lengths skipped; the prompt ids
    favoured): a tree pass shows them one row's nodes, so they must hold that row's prompt."""
    model, draft = llama
    ids = torch.tensor([[0, 0, 5, 9, 4, 5], [7, 3, 12, 30, 6, 3], [0, 21, 22, 23, 21, 22]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0], [1]])).long()
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, **{penalty: 3.0})
    ref = model.generate(ids, **kw)
    assert not torch.equal(ref, model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))
    assert torch.equal(model.generate(ids, assistant_model=draft, tree=tree, **kw), ref)


@pytest.mark.parametrize("tree", ["eagle2", "chain"])
def test_prefix_allowed_tokens_fn_gets_each_rows_batch_id(llama, tree):
    model, draft = llama
    ids = torch.tensor([[0, 0, 5, 9, 4], [7, 3, 12, 30, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=20, prefix_allowed_tokens_fn=allowed_tokens)
    ref = model.generate(ids, do_sample=False, **kw)
    assert all(t % 2 == 0 for t in ref[0, 5:].tolist()) and all(t % 2 == 1 for t in ref[1, 5:].tolist())
    out = model.generate(ids, assistant_model=draft, tree=tree, **kw)
    assert torch.equal(out, ref)


def test_empty_allowed_list_on_a_drafted_prefix_is_reported(llama):
    model, draft = llama
    ref_fn = lambda batch_id, ids: [4]  # noqa: E731  (plain decoding only ever sees prefixes ending in 4)
    ids = torch.tensor([[5, 6, 4]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=6, prefix_allowed_tokens_fn=ref_fn)
    assert ref[0, 3:].tolist() == [4] * 6
    strict = lambda batch_id, ids: [4] if int(ids[-1]) == 4 else []  # noqa: E731
    # a fixed tree with 4 children per node drafts prefixes ending in other tokens by construction; the default
    # "auto" size follows this machine's cost model and may keep a tree of 4s only (it did on a Zen 5)
    with pytest.raises(ValueError, match="every drafted prefix"):
        model.generate(ids, assistant_model=draft, tree="eagle2", tree_total_tokens=8, tree_top_k=4, max_new_tokens=6,
                       prefix_allowed_tokens_fn=strict)  # fmt: skip


def test_stateless_watermarking_is_exact(llama):
    """The green-list watermark re-seeds from each prefix on every call: per-node processing reproduces it."""
    model, draft = llama
    kw = dict(max_new_tokens=20, watermarking_config=WatermarkingConfig(bias=3.0, context_width=2))
    for seed in range(3):
        ids = torch.randint(3, 32, (1, 6), generator=torch.Generator().manual_seed(seed))
        ref = model.generate(ids, do_sample=False, **kw)
        assert torch.equal(model.generate(ids, assistant_model=draft, tree="eagle2", tree_top_k=4, **kw), ref)
