"""Lossless sampling: tree speculation draws from the same joint distribution as plain sampling.

A tiny model with an 8-token vocabulary; a head that proposes 4 siblings per node (half the vocabulary), so most
rounds accept several tokens. The exact joint law of the first two tokens is computed from the model; samples of
tree speculation must pass a chi-square test against it, and a deliberately biased verifier must fail it."""

import pytest
import torch
from conftest import tiny_model
from scipy.stats import chisquare

import hf_eagle2.engine.verify as verify
from hf_eagle2 import EagleDraftModel

VOCAB = 8
SAMPLES = 3000


def step_probs(model, prefix, **gen):
    out = model.generate(prefix, do_sample=True, max_new_tokens=1, return_dict_in_generate=True, output_scores=True, **gen)
    return torch.softmax(out.scores[0][0].double(), -1)


def exact_joint(model, prompt, **gen):
    """P(x2, x3 | prompt), marginal over x1, under the warped distributions plain sampling uses (from the
    model's own scores). x1 comes from the prefill; x2 and x3 are the tokens a tree round accepts."""
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = step_probs(model, prompt, **gen)
    for x1 in range(VOCAB):
        if p1[x1] == 0:
            continue
        ext = torch.cat([prompt, torch.tensor([[x1]])], dim=1)
        p2 = step_probs(model, ext, **gen)
        for x2 in range(VOCAB):
            if p2[x2] > 0:
                p3 = step_probs(model, torch.cat([ext, torch.tensor([[x2]])], dim=1), **gen)
                joint[x2] += p1[x1] * p2[x2] * p3
    return joint


def sample_pairs(model, prompt, draft, n, seed, tree_ngram=0, **gen):
    torch.manual_seed(seed)
    batch = prompt.expand(100, -1)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    accepted = 0
    for _ in range(n // 100):
        out = model.generate(batch, assistant_model=draft, tree="eagle2", tree_total_tokens=12, tree_depth=3,
                             tree_top_k=4, tree_ngram=tree_ngram, do_sample=True, max_new_tokens=4,
                             return_dict_in_generate=True, **gen)  # fmt: skip
        pairs = out.sequences[:, prompt.shape[1] + 1 : prompt.shape[1] + 3]
        counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs), dtype=torch.long), accumulate=True)
        accepted += sum(i * c for i, c in enumerate(out.eagle_stats.accept_hist))
    return counts, accepted


def chi2_pvalue(counts, joint):
    expected = joint.flatten() * counts.sum()
    observed = counts.flatten().double()
    big = expected >= 5  # pool the rare cells into one
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    return chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", seed=30, vocab=VOCAB)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.35)  # undo most of the sharpening: a spread distribution
    draft = EagleDraftModel.from_target(model, seed=31)
    prompt = torch.tensor([[3, 5, 1, 6]])
    return model, draft, prompt


@pytest.mark.parametrize(
    "gen, tree_ngram",
    [(dict(), 0), (dict(temperature=0.7, top_k=6, top_p=0.95), 0), (dict(), 3)],
    ids=["plain", "warped", "ngram-branch"],
)
def test_joint_distribution_matches_plain_sampling(setup, gen, tree_ngram):
    model, draft, prompt = setup
    joint = exact_joint(model, prompt, **gen)
    assert (joint > 0.01).sum() >= 10  # a spread law, so the test has power
    counts, accepted = sample_pairs(model, prompt, draft, SAMPLES, seed=0, tree_ngram=tree_ngram, **gen)
    assert accepted > SAMPLES // 4  # drafts were accepted: the tree path is what is being tested
    pvalue = chi2_pvalue(counts, joint)
    print(f"tree sampling {gen} ngram={tree_ngram}: {SAMPLES} samples, {accepted} accepted drafts, chi-square p = {pvalue:.3g}")
    assert pvalue > 1e-3


def test_biased_verifier_fails_the_same_test(setup, monkeypatch):
    """Negative control: always accepting the first child must be detected."""
    model, draft, prompt = setup
    joint = exact_joint(model, prompt)
    original = verify.accept

    def biased(tree, choice):
        if tree.num_nodes > 1:
            choice = choice.clone()
            choice[:, 0] = tree.tokens[:, 1]  # pretend the target always agrees with the best depth-1 node
        return original(tree, choice)

    monkeypatch.setattr("hf_eagle2.engine.decoding.accept", biased)
    counts, _ = sample_pairs(model, prompt, draft, SAMPLES, seed=0)
    pvalue = chi2_pvalue(counts, joint)
    print(f"biased verifier: {SAMPLES} samples, chi-square p = {pvalue:.3g}")
    assert pvalue < 1e-6


def test_sampling_is_reproducible_with_a_seed(setup):
    model, draft, prompt = setup
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(prompt, assistant_model=draft, tree="eagle2", do_sample=True, max_new_tokens=20))
    assert torch.equal(runs[0], runs[1])
