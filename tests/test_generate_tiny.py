"""Greedy identity of tree speculation against plain generate on tiny random Llama, Qwen2 and Gemma3 models."""

import pytest
import torch
from conftest import tiny_model, trained_tiny_draft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_eagle2 import EagleDraftModel

FAMILIES = ["llama", "qwen2", "gemma3"]
TREES = [
    dict(tree="eagle2", tree_total_tokens=12, tree_depth=4, tree_top_k=4),
    dict(tree="eagle2", tree_total_tokens=60, tree_depth=6, tree_top_k=10),  # the paper's setting
    dict(tree="eagle2"),  # defaults: each round sized by the measured cost curve (may verify the root alone)
    dict(tree="eagle1"),
    dict(tree="chain", tree_depth=3),
    dict(tree="eagle2", tree_total_tokens=12, tree_depth=3, tree_top_k=3, tree_ngram=8),  # n-gram branch
]


def prompts(n, seed, lo=1, hi=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32, (1, int(torch.randint(lo, hi, (1,), generator=g))), generator=g) for _ in range(n)]


def plain(model, ids, **kw):
    return model.generate(ids, do_sample=False, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request):
    model = tiny_model(request.param, seed=1)
    return request.param, model, trained_tiny_draft(model, request.param)


@pytest.mark.parametrize("tree_kwargs", TREES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_greedy_identity(family_models, tree_kwargs):
    family, model, draft = family_models
    total_accepted = 0
    for ids in prompts(6, seed=FAMILIES.index(family), hi=40 if family == "gemma3" else 30):
        ref = plain(model, ids, max_new_tokens=40)
        out = model.generate(ids, assistant_model=draft, max_new_tokens=40, return_dict_in_generate=True, **tree_kwargs)
        assert torch.equal(out.sequences, ref), f"{family} {tree_kwargs} diverged"
        stats = out.eagle_stats
        assert stats.new_tokens == ref.shape[1] - ids.shape[1]
        if stats.target_forwards:  # zero when the first token already ends generation
            assert stats.prefill_tokens_per_row == [1]  # the prefill's token: in new_tokens, in no round
            assert stats.tau == pytest.approx((stats.new_tokens - 1) / stats.target_forwards)
        assert sum(stats.accept_hist) == stats.target_forwards
        assert out.cache.get_seq_length() == out.sequences.shape[1] - 1  # all but the last token are cached
        total_accepted += sum(n * c for n, c in enumerate(stats.accept_hist))
    if tree_kwargs != dict(tree="eagle2"):  # the auto budget may rightly find drafting not worth it on a tiny model
        assert total_accepted > 0  # the small vocabulary makes random drafts agree sometimes: paths are exercised


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(FAMILIES),
    m=st.integers(1, 40),
    depth=st.integers(1, 7),
    k=st.integers(1, 8),
    prompt_len=st.integers(1, 30),
    seed=st.integers(0, 10_000),
    max_new=st.integers(1, 25),
)
def test_property_greedy_identity(family, m, depth, k, prompt_len, seed, max_new):
    model = _cached_model(family)
    draft = _cached_draft(family)
    ids = torch.randint(3, 32, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    ref = plain(model, ids, max_new_tokens=max_new)
    out = model.generate(
        ids, assistant_model=draft, tree="eagle2", tree_total_tokens=m, tree_depth=depth, tree_top_k=k, max_new_tokens=max_new
    )
    assert torch.equal(out, ref)


_MODELS = {}


def _cached_model(family):
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family, seed=5)
    return _MODELS[family]


def _cached_draft(family):
    key = family + "-draft"
    if key not in _MODELS:
        _MODELS[key] = EagleDraftModel.from_target(_cached_model(family), seed=6)
    return _MODELS[key]


def test_eos_inside_accepted_path_stops_exactly():
    model = tiny_model("llama", seed=7)
    draft = EagleDraftModel.from_target(model, seed=8)
    stopped = 0
    for ids in prompts(12, seed=3):
        free = plain(model, ids, max_new_tokens=30)
        generated = free[0, ids.shape[1] :].tolist()
        eos = max(set(generated[2:]), key=generated.count) if len(generated) > 2 else generated[-1]
        ref = plain(model, ids, max_new_tokens=30, eos_token_id=eos)
        for tree in ("eagle2", "eagle1", "chain"):
            out = model.generate(ids, assistant_model=draft, tree=tree, max_new_tokens=30, eos_token_id=eos)
            assert torch.equal(out, ref)
        stopped += int(ref.shape[1] < free.shape[1])
    assert stopped > 0


def test_eos_list_and_max_length():
    model = tiny_model("qwen2", seed=9)
    draft = EagleDraftModel.from_target(model, seed=10)
    for ids in prompts(5, seed=4):
        for kw in (dict(eos_token_id=[5, 7, 11], max_new_tokens=20), dict(max_length=ids.shape[1] + 7)):
            ref = plain(model, ids, **kw)
            assert torch.equal(model.generate(ids, assistant_model=draft, tree="eagle2", tree_top_k=6, **kw), ref)


def test_callers_max_length_criteria_replaces_generates_own():
    """transformers lets a MaxLengthCriteria in stopping_criteria replace its own (from max_length /
    max_new_tokens): plain decoding then stops at the caller's length, longer or shorter, and so must the trees.
    transformers' own assisted loop cannot go past generate's length: with a head, that is an error, not a hang."""
    from transformers import MaxLengthCriteria, StoppingCriteriaList

    model = tiny_model("llama", seed=9)
    draft = EagleDraftModel.from_target(model, seed=10)
    ids = prompts(1, seed=4)[0]
    for new, limit in ((None, 40), (10, 35), (30, 12)):  # None: generate's default max_length (20) is in force
        kw = dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + limit)]))
        kw |= {} if new is None else dict(max_new_tokens=new)
        ref = plain(model, ids, **kw)
        assert ref.shape[1] == ids.shape[1] + limit  # the caller's criterion, not generate's length
        for tree in (dict(tree="eagle2"), dict(tree="eagle1"), dict(tree="chain")):
            assert torch.equal(model.generate(ids, assistant_model=draft, **tree, **kw), ref), (new, limit, tree)
        if limit < (new or 20 - ids.shape[1]):  # the stock assisted loop stops at the criterion's length ...
            assert torch.equal(model.generate(ids, assistant_model=draft, **kw), ref)
        else:  # ... but cuts every round at its own max_length, so going past it would never end: refused
            with pytest.raises(ValueError, match="cannot go past max_length"):
                model.generate(ids, assistant_model=draft, **kw)


def test_returned_cache_stops_recording_past_states():
    """The loop records sliding-window layers' past states (to prune them to the accepted path); a cache handed
    back stops recording, as generate leaves its own, so later plain calls on it keep the window only."""
    model = tiny_model("gemma3", seed=1)
    draft = EagleDraftModel.from_target(model, seed=2)
    ids = prompts(1, seed=3, lo=20, hi=30)[0]
    out = model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=20, return_dict_in_generate=True)
    sliding = [layer for layer in out.cache.layers if hasattr(layer, "record_past")]
    assert sliding and not any(layer.record_past for layer in sliding)


def test_custom_stopping_criteria_get_the_scores_plain_decoding_passes():
    """_sample hands stopping criteria the tuple of every processed step's scores so far when scores are returned,
    else None; a criterion reading them stops the trees where it stops plain decoding."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class ConfidentStep(StoppingCriteria):  # stops after a step whose processed top score is high, or at 12 steps
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(None if scores is None else (len(scores), tuple(scores[-1].shape)))
            stop = len(scores) >= 12 or float(scores[-1].max()) > 0.85 if scores is not None else input_ids.shape[1] > 20
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool)

    model = tiny_model("llama", seed=11)
    draft = EagleDraftModel.from_target(model, seed=12)
    for ids in prompts(4, seed=5):
        for returned in (dict(return_dict_in_generate=True, output_scores=True), dict()):
            ref_criterion, tree_criterion = ConfidentStep(), ConfidentStep()
            ref = plain(model, ids, max_new_tokens=30, stopping_criteria=StoppingCriteriaList([ref_criterion]), **returned)
            out = model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=30,
                                 stopping_criteria=StoppingCriteriaList([tree_criterion]), **returned)  # fmt: skip
            if returned:
                assert torch.equal(out.sequences, ref.sequences)
                assert len(ref.scores) < 30  # the criterion stopped it
            else:
                assert torch.equal(out, ref)
            assert tree_criterion.seen[-1] == ref_criterion.seen[-1]  # the same scores at the stopping token


def test_scores_and_logits_match_plain():
    model = tiny_model("llama", seed=11)
    draft = EagleDraftModel.from_target(model, seed=12)
    ids = prompts(1, seed=5)[0]
    kw = dict(max_new_tokens=15, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = plain(model, ids, **kw)
    out = model.generate(ids, assistant_model=draft, tree="eagle2", **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 15
    for a, b in zip(out.scores + out.logits, ref.scores + ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_stock_assisted_loop_with_eagle_chain():
    """Without tree=, an EAGLE head runs in the stock assisted-decoding loop as a chain CandidateGenerator."""
    model = tiny_model("llama", seed=13)
    draft = EagleDraftModel.from_target(model, seed=14)
    for ids in prompts(4, seed=6):
        ref = plain(model, ids, max_new_tokens=25)
        assert torch.equal(model.generate(ids, assistant_model=draft, max_new_tokens=25), ref)
        assert torch.equal(model.generate(ids, assistant_model=draft, tree_depth=3, max_new_tokens=25), ref)


def verify_lengths(model, draft, ids, **kwargs):
    """Tokens per target forward after the prefill, in the stock assisted loop: drafted chain length + 1."""
    lengths = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out = model.generate(ids, assistant_model=draft, max_new_tokens=40, **kwargs)
    finally:
        handle.remove()
    return out, lengths[1:]


def test_stock_assisted_loop_chain_depth():
    """The documented chain depth (6) unless the caller sets num_assistant_tokens / tree_depth; transformers'
    default of 20 assistant tokens is not taken for a user choice."""
    from transformers import GenerationConfig

    model = tiny_model("llama", seed=13)
    draft = EagleDraftModel.from_target(model, seed=14)
    ids = prompts(1, seed=6)[0][:, :5]
    ref = plain(model, ids, max_new_tokens=40)
    for kwargs, depth in ((dict(), 6), (dict(num_assistant_tokens=3), 3), (dict(tree_depth=2), 2),
                          (dict(generation_config=GenerationConfig(num_assistant_tokens=4)), 4)):  # fmt: skip
        out, lengths = verify_lengths(model, draft, ids, **kwargs)
        assert torch.equal(out, ref)
        assert max(lengths) == depth + 1, (kwargs, lengths)


def test_stock_assisted_loop_refuses_what_it_cannot_honour():
    model = tiny_model("llama", seed=13)
    draft = EagleDraftModel.from_target(model, seed=14)
    ids = prompts(1, seed=6)[0]
    for kwargs, name in ((dict(num_assistant_tokens_schedule="heuristic"), "num_assistant_tokens_schedule"),
                         (dict(num_assistant_tokens_schedule="heuristic_transient"), "num_assistant_tokens_schedule"),
                         (dict(assistant_confidence_threshold=0.3), "assistant_confidence_threshold"),
                         (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
                         (dict(num_assistant_tokens=3, tree_depth=4), "disagree")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            verify_lengths(model, draft, ids, **kwargs)
    out, _ = verify_lengths(model, draft, ids, num_assistant_tokens_schedule="constant")
    assert torch.equal(out, plain(model, ids, max_new_tokens=40))


def test_generation_config_fields():
    from transformers import GenerationConfig

    model = tiny_model("llama", seed=15)
    draft = EagleDraftModel.from_target(model, seed=16)
    ids = prompts(1, seed=7)[0]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, tree="eagle2", tree_total_tokens=8, tree_top_k=3)
    out = model.generate(ids, generation_config=config, assistant_model=draft, return_dict_in_generate=True)
    assert out.eagle_stats.tree == "eagle2"
    assert torch.equal(out.sequences, plain(model, ids, max_new_tokens=12))


def test_plain_generate_is_untouched():
    model = tiny_model("llama", seed=17)
    ids = prompts(1, seed=8)[0]
    import hf_eagle2

    a = plain(model, ids, max_new_tokens=10)
    hf_eagle2.unregister()
    try:
        b = plain(model, ids, max_new_tokens=10)
    finally:
        hf_eagle2.register()
        hf_eagle2.register()  # idempotent
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="model_kwargs|not used"):
        model.generate(ids, max_new_tokens=3, not_a_generate_kwarg=1)


def test_clear_errors():
    model = tiny_model("llama", seed=19)
    draft = EagleDraftModel.from_target(model, seed=20)
    ids = prompts(1, seed=9)[0]
    with pytest.raises(ValueError, match="needs an EAGLE draft head"):
        model.generate(ids, tree="eagle2", max_new_tokens=5)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=0)
    with pytest.raises(ValueError, match="tree must be one of"):
        model.generate(ids, assistant_model=draft, tree="medusa", max_new_tokens=5)
    with pytest.raises(ValueError, match="positive int"):
        model.generate(ids, assistant_model=draft, tree="eagle2", tree_top_k=0, max_new_tokens=5)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(torch.randint(3, 32, (1, 600)), assistant_model=draft, tree="eagle2", max_new_tokens=5)
    with pytest.raises(ValueError, match="beam search"):
        model.generate(ids, assistant_model=draft, tree="eagle2", num_beams=2, max_new_tokens=5)


def test_tree_options_the_path_does_not_read_are_refused():
    """A tree option passed to generate is read by the chosen path or refused by name, never dropped."""
    model = tiny_model("llama", seed=19)
    draft = EagleDraftModel.from_target(model, seed=20)
    ids = prompts(1, seed=9)[0]
    cases = [
        (dict(tree="eagle1", tree_total_tokens=12), "tree='eagle1' does not use tree_total_tokens"),
        (dict(tree="eagle1", tree_depth=3, tree_top_k=3), "does not use tree_depth, tree_top_k"),
        (dict(tree="chain", tree_top_k=3, tree_rerank=False), "tree='chain' does not use tree_rerank, tree_top_k"),
        (dict(tree="eagle2", tree_static_paths=((0,), (0, 0))), "tree='eagle2' does not use tree_static_paths"),
        (dict(tree_total_tokens=12), "without tree= .* does not use tree_total_tokens"),
        (dict(eagle_record_calibration=True), "without tree= .* does not use eagle_record_calibration"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model.generate(ids, assistant_model=draft, max_new_tokens=5, **kwargs)
    with pytest.raises(ValueError, match="tree_depth: tree speculation options need assistant_model"):
        model.generate(ids, max_new_tokens=5, tree_depth=3)  # no head: stock generate would never read it
    model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=5)
    assert draft.last_stats is not None
    model.generate(ids, assistant_model=draft, max_new_tokens=5)  # the stock loop keeps no stats of its own
    assert draft.last_stats is None  # not the previous call's
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            model.generate(ids, assistant_model=draft, tree="eagle2", max_new_tokens=5)
    finally:
        model.config._attn_implementation = "sdpa"


def test_eager_attention_is_exact():
    """Eager attention takes the additive float mask too (a bool mask would be silently wrong there)."""
    model = tiny_model("llama", seed=21)
    model.set_attn_implementation("eager")
    draft = EagleDraftModel.from_target(model, seed=22)
    for ids in prompts(4, seed=10):
        ref = plain(model, ids, max_new_tokens=20)
        assert torch.equal(model.generate(ids, assistant_model=draft, tree="eagle2", tree_top_k=6, max_new_tokens=20), ref)


@pytest.mark.parametrize("tree", ["eagle2", "eagle1", "chain"])
def test_static_cache_generation(tree):
    """cache_implementation="static": trees are cut to fit the preallocated cache near max_length."""
    model = tiny_model("llama", seed=23)
    draft = trained_tiny_draft(model, "llama-static")
    for ids in prompts(4, seed=11):
        ref = plain(model, ids, max_new_tokens=30)
        out = model.generate(ids, assistant_model=draft, tree=tree, max_new_tokens=30, cache_implementation="static")
        assert torch.equal(out, ref)


@pytest.mark.parametrize("tree", ["eagle2", "chain", None])
def test_reserved_cache_generation(tree):
    """A `reserved_cache` (in-place KV writes into spare slots) passed as `cache=`: plain and tree generate give
    plain's tokens, in a batch with left padding (rows accepting different lengths leave holes) and alone, and a
    reserve of 3 slots makes the buffers grow (copy) many times in one answer."""
    from hf_eagle2.kernels.reserved_cache import ReservedLayer, reserved_cache

    model = tiny_model("llama", seed=1)
    draft = trained_tiny_draft(model, "llama")
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 8], [0, 9, 12, 3, 3]])
    mask = (ids != 0).long()
    kw = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    ref = model.generate(ids, **kw).sequences
    size = dict(tree_total_tokens=8) if tree == "eagle2" else dict(tree_depth=3)
    spec = {} if tree is None else dict(assistant_model=draft, tree=tree, **size)
    cache = reserved_cache(model.config, reserve=3)
    out = model.generate(ids, cache=cache, **spec, **kw)
    assert torch.equal(out.sequences, ref)
    assert out.cache is cache and all(type(layer) is ReservedLayer for layer in cache.layers)
    dynamic = model.generate(ids, **spec, **kw).cache  # as long as the default cache (tree rounds may leave holes)
    assert cache.layers[0].keys.shape[-2] == cache.get_seq_length() == dynamic.get_seq_length()
    for mine, theirs in zip(cache.layers, dynamic.layers):
        torch.testing.assert_close(mine.keys, theirs.keys)
    for row in range(ids.shape[0]):
        one = ids[row : row + 1, (1 - mask[row]).sum() :]
        alone = model.generate(one, cache=reserved_cache(model.config, reserve=3), max_new_tokens=30, do_sample=False,
                               **spec)  # fmt: skip
        assert torch.equal(alone, model.generate(one, max_new_tokens=30, do_sample=False))


def test_batched_cache_with_holes_is_refused_for_reuse():
    model = tiny_model("llama", seed=1)
    draft = trained_tiny_draft(model, "llama")
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 8]])
    mask = (ids != 0).long()
    mask[1] = 1
    out = model.generate(ids, attention_mask=mask, assistant_model=draft, tree="eagle2", tree_total_tokens=8,
                         max_new_tokens=30, return_dict_in_generate=True, do_sample=False)  # fmt: skip
    if getattr(out.cache, "_hf_eagle2_holes", False):  # rows accepted different lengths in some round
        longer = torch.cat([out.sequences, out.sequences[:, -1:]], dim=1)
        with pytest.raises(ValueError, match="holes"):
            model.generate(longer, cache=out.cache, max_new_tokens=2)
        with pytest.raises(ValueError, match="holes"):
            model.generate(longer, cache=out.cache, assistant_model=draft, tree="eagle2", max_new_tokens=2)


def test_static_cache_with_a_batch_is_refused():
    from transformers import StaticCache

    model = tiny_model("llama", seed=1)
    draft = EagleDraftModel.from_target(model, seed=0)
    ids = torch.tensor([[5, 6, 7], [3, 4, 5]])
    cache = StaticCache(config=model.config, max_cache_len=64)
    with pytest.raises(NotImplementedError, match="StaticCache supports batch size 1"):
        model.generate(ids, cache=cache, assistant_model=draft, tree="eagle2", max_new_tokens=4)
