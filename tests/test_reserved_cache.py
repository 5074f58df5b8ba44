"""ReservedLayer keeps the values a DynamicLayer would, through every cache operation generate and pruning use."""

import pytest
import torch
from conftest import tiny_model
from transformers.cache_utils import DynamicLayer

from hf_eagle2.kernels.reserved_cache import ReservedLayer, concat_rows, reserved_cache


def kv(batch, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, n, 4, generator=g), torch.randn(batch, 2, n, 4, generator=g)


def test_reserved_layer_matches_a_dynamic_layer():
    reserved, dynamic = ReservedLayer(reserve=3), DynamicLayer()
    steps = [("update", 5), ("update", 1), ("update", 4), ("crop", -2), ("update", 1), ("select", [2, 0]),
             ("update", 6), ("repeat", 2), ("update", 1), ("crop", -3), ("update", 2)]  # fmt: skip
    batch = 3
    for i, (op, arg) in enumerate(steps):
        if op == "update":
            k, v = kv(batch, arg, seed=i)
            out, ref = reserved.update(k, v), dynamic.update(k, v)
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
        elif op == "crop":
            reserved.crop(arg), dynamic.crop(arg)
        elif op == "select":
            reserved.batch_select_indices(torch.tensor(arg)), dynamic.batch_select_indices(torch.tensor(arg))
            batch = len(arg)
        else:
            reserved.batch_repeat_interleave(arg), dynamic.batch_repeat_interleave(arg)
            batch *= arg
        assert torch.equal(reserved.keys, dynamic.keys) and torch.equal(reserved.values, dynamic.values), (i, op)
        assert reserved.get_seq_length() == dynamic.get_seq_length()
    assert reserved.buffer.keys.shape[-2] > reserved.buffer.length  # spare slots remain after the last growth
    with pytest.raises(ValueError, match="positive number of slots"):
        ReservedLayer(reserve=0)


def test_in_place_writes_reach_the_buffer():
    """prune_tree_cache moves accepted entries by writing into layer.keys / values: they must land in the buffer."""
    layer = ReservedLayer(reserve=4)
    layer.update(*kv(1, 6, seed=0))
    layer.keys[:, :, 2:4] = 7.0
    layer.crop(-2)
    layer.update(*kv(1, 1, seed=1))
    assert bool((layer.keys[:, :, 2:4] == 7.0).all()) and layer.keys.shape[-2] == 5


def test_concat_rows_joins_caches_of_equal_length_and_refuses_others():
    model = tiny_model("llama", seed=1)

    def filled(rows, n, seed):
        cache = reserved_cache(model.config, reserve=2)
        for index in range(len(cache.layers)):
            cache.update(*kv(rows, n, seed=seed + index), index)
        return cache

    parts = [filled(i + 1, 5, seed=10 * i) for i in range(3)]
    expected = [(torch.cat([c.layers[i].keys for c in parts]), torch.cat([c.layers[i].values for c in parts]))
                for i in range(len(parts[0].layers))]  # fmt: skip
    joined = concat_rows(parts)
    for layer, (keys, values) in zip(joined.layers, expected, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert not parts[1].layers[0].is_initialized  # the other caches were emptied as their rows moved
    new = kv(6, 1, seed=99)
    joined.update(*new, 0)  # still writes in place into the joined buffers
    assert torch.equal(joined.layers[0].keys, torch.cat([expected[0][0], new[0]], dim=2))
    with pytest.raises(ValueError, match="equal lengths"):
        concat_rows([filled(1, 5, seed=0), filled(1, 4, seed=0)])
    with pytest.raises(ValueError, match="initialized ReservedLayer"):
        concat_rows([filled(1, 5, seed=0), reserved_cache(model.config, reserve=2)])


def test_beam_reorder_and_reset():
    layer, dynamic = ReservedLayer(reserve=2), DynamicLayer()
    k, v = kv(3, 4, seed=5)
    layer.update(k, v), dynamic.update(k, v)
    beams = torch.tensor([2, 2, 0])
    layer.reorder_cache(beams), dynamic.reorder_cache(beams)
    layer.update(*kv(3, 1, seed=6)), dynamic.update(*kv(3, 1, seed=6))
    assert torch.equal(layer.keys, dynamic.keys) and torch.equal(layer.values, dynamic.values)
    layer.reset()
    assert layer.get_seq_length() == 0
    layer.update(k, v)
    assert torch.equal(layer.keys, k)
    with pytest.raises(NotImplementedError, match="offloading"):
        layer.offload()


def test_a_one_token_prompt_beside_longer_ones():
    """Its prefill row (all but the last prompt token) is padding only; the answers and features are those of
    generate's own DynamicCache prefill."""
    from hf_eagle2.training.features import aux_layer_ids, generate_with_features

    model = tiny_model("llama", seed=1)
    prompts = [[5], [3, 4, 5, 6, 7, 8, 9], [12, 13]]
    ref = generate_with_features(model, prompts, 10, [4], 0, aux_layers=aux_layer_ids(model), reserve=None)
    out = generate_with_features(model, prompts, 10, [4], 0, aux_layers=aux_layer_ids(model), reserve=3)
    for (ids, feats, aux, start), (ids1, feats1, aux1, start1) in zip(out, ref, strict=True):
        assert torch.equal(ids, ids1) and start == start1 and not feats.isnan().any()
        torch.testing.assert_close(feats, feats1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(aux, aux1, rtol=1e-4, atol=1e-5)


def test_a_stacked_cache_prunes_all_layers_in_one_move_like_per_layer_gathers():
    """`stack_empty_cache` puts every plain layer in one KVStore; `prune_tree_cache` then moves the kept tree
    entries of all layers at once, and the result is what per-layer gathers on a DynamicCache give."""
    from transformers.cache_utils import DynamicCache

    from hf_eagle2.engine.cache import prune_tree_cache
    from hf_eagle2.kernels.reserved_cache import KVStore, shared_store, stack_empty_cache

    model = tiny_model("llama", seed=1)
    stacked, plain = DynamicCache(config=model.config), DynamicCache(config=model.config)
    assert stack_empty_cache(stacked) and not stack_empty_cache(stacked)  # done once, on an empty cache only
    for step, n in enumerate((5, 3, 7)):  # prefill, then two "tree passes" of which a few entries are kept
        for index in range(len(plain.layers)):
            k, v = kv(2, n, seed=10 * step + index)
            stacked.update(k, v, index), plain.update(k, v, index)
        if step:
            keep = torch.tensor([[0, 2, 1], [0, 1, 2]])[:, : min(3, n)]
            prune_tree_cache(stacked, keep, n), prune_tree_cache(plain, keep, n)
    store = shared_store(stacked)
    assert isinstance(store, KVStore) and store.num_layers == len(plain.layers)
    for ours, theirs in zip(stacked.layers, plain.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    stacked.batch_select_indices(torch.tensor([1])), plain.batch_select_indices(torch.tensor([1]))
    assert shared_store(stacked) is None  # layers that left the store end the shared move: each prunes alone
    for index in range(len(plain.layers)):
        k, v = kv(1, 4, seed=90 + index)
        stacked.update(k, v, index), plain.update(k, v, index)
    prune_tree_cache(stacked, torch.tensor([[0, 3]]), 4), prune_tree_cache(plain, torch.tensor([[0, 3]]), 4)
    for ours, theirs in zip(stacked.layers, plain.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
