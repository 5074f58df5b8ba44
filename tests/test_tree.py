"""Tree builder unit tests: structure, EAGLE-2 ordering by V_i, masks, and a brute-force reference."""

import heapq
import itertools

import pytest
import torch

from hf_eagle2.engine.tree import EAGLE1_TREE, StaticTreeSpec, build_dynamic_tree, build_static_tree, chain_tree

HIDDEN, VOCAB = 8, 12


class FakeDraft:
    """A deterministic 'head': hidden(child) = tanh(A hidden(parent) + E[token]); logp = log_softmax(W hidden)."""

    def __init__(self, seed=0, temperature=1.0):
        g = torch.Generator().manual_seed(seed)
        self.A = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
        self.E = torch.randn(VOCAB, HIDDEN, generator=g)
        self.W = torch.randn(VOCAB, HIDDEN, generator=g) * 2 / temperature
        self.calls = 0
        self.fed = []

    def step(self, tokens, parent_hidden, depth, anc):
        self.calls += 1
        self.fed.append((depth, anc.clone()))
        return torch.tanh(parent_hidden @ self.A.T + self.E[tokens])

    def logprobs(self, hidden):
        return torch.log_softmax(hidden @ self.W.T, dim=-1)


def build(draft, bsz=2, m=10, depth=4, k=3, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    root_hidden = torch.randn(bsz, HIDDEN, generator=g)
    root_tokens = torch.randint(0, VOCAB, (bsz,), generator=g)
    tree = build_dynamic_tree(
        root_tokens, root_hidden, draft.step, draft.logprobs, lambda x: x, total_tokens=m, depth=depth, top_k=k, **kw
    )
    return tree, root_hidden, root_tokens


def reference_eagle2(draft, root_hidden, m, depth, k):
    """Slow per-node EAGLE-2: expand the top-k nodes by V per depth, keep the top-m of all candidates by V."""
    candidates = []  # (logV, path tokens)
    lp = draft.logprobs(root_hidden)
    frontier = []
    for tok in torch.topk(lp, k).indices.tolist():
        candidates.append((lp[tok].item(), (tok,)))
        frontier.append((lp[tok].item(), (tok,), root_hidden))
    for _ in range(1, depth):
        children = []
        for logv, path, parent_h in frontier:
            h = torch.tanh(parent_h @ draft.A.T + draft.E[path[-1]])
            clp = draft.logprobs(h)
            for tok in torch.topk(clp, k).indices.tolist():
                children.append((logv + clp[tok].item(), path + (tok,), h))
        candidates += [(v, p) for v, p, _ in children]
        frontier = heapq.nlargest(k, children, key=lambda c: c[0])
    return {p for _, p in heapq.nlargest(m, candidates, key=lambda c: c[0])}


def node_paths(tree, b):
    paths = []
    for i in range(1, tree.num_nodes):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[b, j]))
            j = int(tree.parents[b, j])
        paths.append(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("m,depth,k", [(10, 4, 3), (6, 3, 2), (20, 5, 4), (3, 6, 2), (40, 3, 5)])
def test_dynamic_tree_matches_brute_force_reference(m, depth, k):
    draft = FakeDraft(seed=m + depth + k)
    tree, root_hidden, _ = build(draft, bsz=3, m=m, depth=depth, k=k, seed=m)
    tree.check()
    for b in range(3):
        assert set(node_paths(tree, b)) == reference_eagle2(draft, root_hidden[b], m, depth, k)
    assert draft.calls == depth - 1  # one head forward per depth after the first


def test_selected_nodes_dominate_unselected_candidates():
    draft = FakeDraft(seed=1)
    tree, _, _ = build(draft, bsz=4, m=15, depth=5, k=4)
    all_scores = tree.extras["candidate_scores"]
    selected = tree.extras["selected"]
    for b in range(4):
        chosen = torch.zeros(all_scores.shape[1], dtype=torch.bool)
        chosen[selected[b]] = True
        assert all_scores[b, chosen].min() >= all_scores[b, ~chosen].max()
        # and the tree's scores are the product of confidences (sum of log-probs) along each path
        anc = tree.ancestors[b].float()
        assert torch.allclose(tree.scores[b], anc @ tree.local_logp[b], atol=1e-5)


def test_structure_masks_and_depths():
    draft = FakeDraft(seed=2)
    tree, _, root_tokens = build(draft, bsz=2, m=25, depth=6, k=5)
    tree.check()
    assert torch.equal(tree.tokens[:, 0], root_tokens)
    for b in range(2):
        for i in range(tree.num_nodes):
            ancestors, j = {i}, i
            while tree.parents[b, j] >= 0:
                j = int(tree.parents[b, j])
                ancestors.add(j)
            assert set(tree.ancestors[b, i].nonzero().flatten().tolist()) == ancestors
            assert int(tree.depths[b, i]) == len(ancestors) - 1
    # paths: one per leaf, root first, each consistent with parents
    paths = tree.paths
    for b in range(2):
        leaves = set(range(tree.num_nodes)) - set(tree.parents[b, 1:].tolist())
        rows = [p[p >= 0].tolist() for p in paths[b] if p[0] >= 0]
        assert {r[-1] for r in rows} == leaves
        for r in rows:
            assert r[0] == 0 and all(int(tree.parents[b, c]) == p for p, c in zip(r, r[1:]))


def test_draft_side_tree_masks_are_ancestor_sets():
    """The head attends, at each expansion, to exactly the fed ancestors of each frontier node."""
    draft = FakeDraft(seed=3)
    build(draft, bsz=1, m=10, depth=4, k=3)
    for depth, anc in draft.fed:
        assert anc.shape[-1] == 3 * depth  # k slots fed per depth so far
        assert bool((anc.sum(-1) == depth).all())  # self + one fed ancestor per earlier depth


def test_ties_keep_the_tree_connected():
    """Certain tokens (log-prob 0) make children tie with their parents; the kept set must stay connected."""
    draft = FakeDraft(seed=4, temperature=1e-4)
    for m in range(1, 30):
        tree, _, _ = build(draft, bsz=2, m=m, depth=5, k=3)
        tree.check()


@pytest.mark.parametrize("kw", [dict(use_global_value=False), dict(rerank=False), dict(use_global_value=False, rerank=False)])
def test_ablations_give_connected_trees(kw):
    for seed in range(5):
        tree, _, _ = build(FakeDraft(seed=seed), bsz=2, m=12, depth=5, k=3, **kw)
        tree.check()
        assert tree.num_nodes == 13


def test_no_rerank_keeps_expanded_frontier():
    draft = FakeDraft(seed=5)
    tree, _, _ = build(draft, bsz=1, m=100, depth=4, k=3, rerank=False)
    assert tree.num_nodes == 1 + 3 * 4  # k frontier nodes per depth
    assert torch.equal(torch.bincount(tree.depths[0])[1:], torch.tensor([3, 3, 3, 3]))


def test_static_trees():
    spec = StaticTreeSpec.from_paths(EAGLE1_TREE)
    assert spec.num_nodes == 26 and spec.max_depth == 5
    draft = FakeDraft(seed=6)
    root_hidden = torch.randn(2, HIDDEN)
    tree = build_static_tree(torch.tensor([1, 2]), root_hidden, draft.step, draft.logprobs, lambda x: x, spec)
    tree.check()
    # node (0,) is the draft's top-1 token after the root, (1,) its second
    top = draft.logprobs(root_hidden).topk(4).indices
    assert torch.equal(tree.tokens[:, 1:5], top)
    # chain: every node is the top-1 child of the previous one
    chain = build_static_tree(
        torch.tensor([3]), root_hidden[:1], draft.step, draft.logprobs, lambda x: x, StaticTreeSpec.from_paths(chain_tree(4))
    )
    chain.check()
    assert chain.parents[0].tolist() == [-1, 0, 1, 2, 3]
    h, tokens = root_hidden[:1], []
    for _ in range(4):
        tokens.append(int(draft.logprobs(h).argmax()))
        h = torch.tanh(h @ draft.A.T + draft.E[tokens[-1]])
    assert chain.tokens[0, 1:].tolist() == tokens


def test_static_spec_rejects_orphans():
    with pytest.raises(ValueError, match="no parent"):
        StaticTreeSpec.from_paths([(0,), (1, 0, 0)])


@pytest.mark.parametrize("m,depth,k", list(itertools.product([1, 7], [1, 3], [1, 4])))
def test_small_parameter_corners(m, depth, k):
    tree, _, _ = build(FakeDraft(seed=7), bsz=2, m=m, depth=depth, k=k)
    tree.check()
    assert tree.num_nodes == 1 + min(m, k + (depth - 1) * k * k)
    assert tree.max_depth <= depth


def chain_of(tokens, rate, bsz=2):
    from hf_eagle2.engine.ngram import NgramChain

    t = torch.tensor(tokens).expand(bsz, -1)
    depth = torch.arange(1, t.shape[1] + 1, dtype=torch.float32)
    return NgramChain(t.clone(), torch.full((bsz,), t.shape[1]), (depth * torch.log(torch.tensor(rate))).expand(bsz, -1))


def assert_distinct_siblings(tree):
    for b in range(tree.tokens.shape[0]):
        seen = set()
        for i in range(1, tree.num_nodes):
            key = (int(tree.parents[b, i]), int(tree.tokens[b, i]))
            assert key not in seen, "two siblings carry the same token"
            seen.add(key)


def test_ngram_chain_with_high_value_is_kept_whole_and_merges_with_head_nodes():
    draft = FakeDraft(seed=3)
    base, root_hidden, _ = build(draft, m=10, depth=3, k=3)
    best_first = int(base.tokens[0, 1])  # the head's best depth-1 token for row 0
    chain = chain_of([best_first, 7, 7, 7, 7], rate=0.999)
    tree, _, _ = build(FakeDraft(seed=3), m=10, depth=3, k=3, chain=chain)
    tree.check()
    assert_distinct_siblings(tree)
    paths = {tuple(p) for p in node_paths(tree, 0)}
    for d in range(1, 6):  # the whole chain, deeper than the head's depth 3, is in the tree
        assert tuple([best_first, 7, 7, 7, 7][:d]) in paths
    assert tree.max_depth == 5
    # the chain's first token is the head's own depth-1 node: merged, not duplicated
    depth1 = [int(t) for t, d in zip(tree.tokens[0], tree.depths[0]) if d == 1]
    assert depth1.count(best_first) == 1
    nodes = tree.extras["chain_nodes"][0]
    assert (nodes > 0).all() and torch.equal(tree.tokens[0, nodes], torch.tensor([best_first, 7, 7, 7, 7]))


def test_ngram_chain_with_low_value_loses_to_head_nodes():
    chain = chain_of([5, 6, 7], rate=1e-4)
    tree, _, _ = build(FakeDraft(seed=3), m=6, depth=3, k=3, chain=chain)
    base, _, _ = build(FakeDraft(seed=3), m=6, depth=3, k=3)
    tree.check()
    for b in range(2):  # the same nodes as without the chain (a chain token the head also proposed may merge)
        assert {tuple(p) for p in node_paths(tree, b)} == {tuple(p) for p in node_paths(base, b)}


def test_ngram_proposer_finds_the_most_recent_match():
    from hf_eagle2.engine.ngram import NgramProposer

    prop = NgramProposer(length=3, max_ngram=2)
    seq = torch.tensor([1, 2, 3, 4, 9, 1, 2, 5, 6, 8, 1, 2])
    chain = prop.propose([seq, torch.tensor([4, 5, 6])], max_len=10)
    assert chain.tokens[0].tolist() == [5, 6, 8] and chain.lengths.tolist() == [3, 0]
    assert prop.propose([torch.tensor([4, 5, 6])], max_len=10) is None
    prop.update(proposed=4, accepted=4)
    assert prop.accept_rate > 0.5
    assert chain.logv[0, 1] < chain.logv[0, 0] < 0
