"""One tree pass == a sequential forward of every path; pruning leaves exactly the accepted sequence's cache."""

import pytest
import torch
from conftest import tiny_model
from transformers.cache_utils import DynamicCache, StaticCache

from hf_eagle2.engine.cache import prune_tree_cache
from hf_eagle2.engine.target import TargetModel
from hf_eagle2.engine.tree import DraftTree, _ancestors_from_parents


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
    logits = target.forward(tree.tokens, positions, mask, cache)[1][0]
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


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_rounds_with_holes_equal_sequential(family):
    """Two tree rounds on a left-padded batch whose rows accept different lengths (holes in the cache):
    every node's logits still equal a plain forward of that row's own sequence (gemma3: beyond its window)."""
    model = tiny_model(family, seed=4)
    target = TargetModel(model)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, 32, (n,), generator=g) for n in (14, 6, 21)]
    bsz, width = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(bsz, width, dtype=torch.long)
    attn = torch.zeros(bsz, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], attn[i, width - len(r) :] = r, 1
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    target.forward(ids[:, :-1], pos[:, :-1], attn[:, :-1], cache)
    slot_pos = torch.where(attn[:, :-1].bool(), pos[:, :-1], -1)
    root_pos = attn.sum(-1) - 1
    sequences = [r.tolist() for r in rows]  # real tokens, ending with the root
    roots = ids[:, -1]
    for round_ in range(2):
        trees = [random_tree(int(roots[b]), 32, 10, 4, seed=100 * round_ + b) for b in range(bsz)]
        tree = DraftTree(*(torch.cat([getattr(t, f) for t in trees]) for f in ("tokens", "parents", "depths", "ancestors", "scores", "local_logp")))
        positions = root_pos.view(bsz, 1) + tree.depths
        mask = target.tree_attention_mask(cache, tree, positions, slot_pos)
        logits = target.forward(tree.tokens, positions, mask, cache)[1]
        for b in range(bsz):
            for i in range(tree.num_nodes):
                path = path_to(DraftTree(*(getattr(tree, f)[b : b + 1] for f in ("tokens", "parents", "depths", "ancestors", "scores", "local_logp"))), i)
                seq = torch.tensor([sequences[b] + tree.tokens[b, path].tolist()])
                torch.testing.assert_close(logits[b, i], model(seq).logits[0, -1], atol=1e-4, rtol=1e-4)
        # rows accept: the deepest node, a depth-1 node, nothing
        accepted = []
        for b, choice in enumerate(("deepest", "depth1", "root")):
            t = DraftTree(*(getattr(tree, f)[b : b + 1] for f in ("tokens", "parents", "depths", "ancestors", "scores", "local_logp")))
            node = {"deepest": int(t.depths[0].argmax()), "depth1": 1, "root": 0}[choice]
            accepted.append([0] + path_to(t, node))
        kept = torch.tensor([len(a) - 1 for a in accepted])
        w = int(kept.max()) + 1
        keep = torch.tensor([[a[0]] * (w - len(a)) + a for a in accepted])
        holes = w - 1 - kept
        prune_tree_cache(cache, keep, tree.num_nodes, holes=holes)
        src = torch.arange(w).view(1, w) - holes.view(bsz, 1)
        block_pos = torch.where(src >= 0, root_pos.view(bsz, 1) + src, -1)
        slot_pos = torch.cat([slot_pos, block_pos], 1)
        new_roots = torch.randint(3, 32, (bsz,), generator=g)
        for b in range(bsz):
            sequences[b] += tree.tokens[b, accepted[b][1:]].tolist() + [int(new_roots[b])]
        root_pos = root_pos + kept + 1
        roots = new_roots
        assert cache.get_seq_length() == slot_pos.shape[1]
