"""One tree pass == a sequential forward of every path; pruning leaves exactly the accepted sequence's cache."""

import pytest
import torch
from conftest import tiny_model
from transformers.cache_utils import DynamicCache, StaticCache

from hf_eagle2.cache import prune_tree_cache
from hf_eagle2.target import TargetModel
from hf_eagle2.tree import DraftTree, _ancestors_from_parents


def random_tree(root_token, vocab, num_nodes, max_depth, seed):
    """A random depth-major tree below `root_token` with random tokens."""
    g = torch.Generator().manual_seed(seed)
    parents, depths = [-1], [0]
    for i in range(1, num_nodes):
        candidates = [j for j in range(i) if depths[j] < max_depth and (j == 0 or depths[j] >= depths[-1] - 1)]
        candidates = [j for j in candidates if depths[j] + 1 >= depths[-1]] or candidates
        p = candidates[int(torch.randint(len(candidates), (1,), generator=g))]
        parents.append(p)
        depths.append(depths[p] + 1)
    order = sorted(range(num_nodes), key=lambda i: (depths[i], i))
    remap = {old: new for new, old in enumerate(order)}
    parents = [-1 if parents[o] < 0 else remap[parents[o]] for o in order]
    depths = [depths[o] for o in order]
    tokens = torch.randint(0, vocab, (1, num_nodes), generator=g)
    tokens[0, 0] = root_token
    p, d = torch.tensor([parents]), torch.tensor([depths])
    return DraftTree(tokens, p, d, _ancestors_from_parents(p, d, max(depths)), torch.zeros(1, num_nodes), torch.zeros(1, num_nodes))


def path_to(tree, i):
    path = []
    while i > 0:
        path.append(i)
        i = int(tree.parents[0, i])
    return list(reversed(path))


@torch.no_grad()
def check_tree_pass(model, prefix, num_nodes, max_depth, seed, cache=None):
    target = TargetModel(model)
    vocab = model.config.get_text_config().vocab_size
    past = prefix.shape[1] - 1
    cache = cache if cache is not None else DynamicCache(config=model.config)
    cache.activate_past_recording()
    if past:
        target.forward(prefix[:, :-1], torch.arange(past).unsqueeze(0), None, cache)
    tree = random_tree(int(prefix[0, -1]), vocab, num_nodes, max_depth, seed)
    tree.check()
    positions = past + tree.depths
    mask = target.tree_attention_mask(cache, tree, positions, torch.arange(past).unsqueeze(0))
    logits = target.logits(target.forward(tree.tokens, positions, mask, cache))[0]
    for i in range(num_nodes):
        seq = torch.cat([prefix, tree.tokens[:, path_to(tree, i)]], dim=1)
        ref = model(seq).logits[0, -1].float()
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
    # prune to the path of the deepest node and compare with the cache of a plain forward of that sequence
    deepest = int(tree.depths[0].argmax())
    keep = torch.tensor([[0] + path_to(tree, deepest)])
    prune_tree_cache(cache, keep, num_nodes)
    accepted = torch.cat([prefix, tree.tokens[:, keep[0, 1:]]], dim=1)
    assert cache.get_seq_length() == accepted.shape[1]
    ref_cache = DynamicCache(config=model.config)
    model(accepted, cache=ref_cache)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        n = ref_layer.keys.shape[-2]
        keys = layer.keys[:, :, :n] if isinstance(cache, StaticCache) else layer.keys
        values = layer.values[:, :, :n] if isinstance(cache, StaticCache) else layer.values
        assert keys.shape == ref_layer.keys.shape
        torch.testing.assert_close(keys, ref_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, ref_layer.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("prefix_len", [1, 5, 23])
def test_tiny_tree_pass_equals_sequential(family, prefix_len):
    model = tiny_model(family, seed=prefix_len)
    prefix = torch.randint(3, 32, (1, prefix_len), generator=torch.Generator().manual_seed(prefix_len))
    # gemma3's sliding window is 8: prefixes of 23 tokens reach beyond it, at several tree depths
    for seed in range(3):
        check_tree_pass(model, prefix, num_nodes=12, max_depth=5, seed=seed + 10 * prefix_len)


def test_static_cache_tree_pass():
    model = tiny_model("llama", seed=3)
    prefix = torch.randint(3, 32, (1, 9), generator=torch.Generator().manual_seed(1))
    check_tree_pass(model, prefix, num_nodes=10, max_depth=4, seed=2, cache=StaticCache(config=model.config, max_cache_len=64))


def test_smollm2_tree_pass_equals_sequential(smollm2):
    model, tokenizer = smollm2
    from conftest import chat_ids

    prefix = chat_ids(tokenizer, "Tell me about tree attention.")
    check_tree_pass(model, prefix, num_nodes=16, max_depth=5, seed=0)
