"""ReservedLayer keeps the values a DynamicLayer would, through every cache operation generate and pruning use."""

import pytest
import torch
from conftest import tiny_model
from transformers.cache_utils import DynamicLayer

from hf_eagle2.reserved_cache import ReservedLayer, concat_rows, reserved_cache


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
    assert reserved._key_buffer.shape[-2] > reserved.length  # spare slots remain after the last growth
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
    parts = [reserved_cache(model.config, reserve=2) for _ in range(3)]
    for i, cache in enumerate(parts):
        for index in range(len(cache.layers)):
            cache.update(*kv(i + 1, 5, seed=10 * i + index), index)
    expected = [torch.cat([c.layers[0].keys for c in parts])]
    joined = concat_rows(parts)
    assert torch.equal(joined.layers[0].keys, expected[0]) and joined.layers[0].keys.shape[0] == 6
    joined.update(*kv(6, 1, seed=99), 0)  # still writes in place into the joined buffers
    assert joined.layers[0].keys.shape[-2] == 6
    short = reserved_cache(model.config, reserve=2)
    for index in range(len(short.layers)):
        short.update(*kv(1, 4, seed=index), index)
    with pytest.raises(ValueError, match="equal lengths"):
        concat_rows([parts[1], short])
    with pytest.raises(ValueError, match="initialized ReservedLayer"):
        concat_rows([parts[1], reserved_cache(model.config, reserve=2)])
