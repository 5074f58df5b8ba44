"""Host syncs per round: the tree loop reads the device at most twice a round for batch-1 greedy decoding.

On a GPU every `.item()`, `.tolist()`, `bool(t)`, `int(t)` or `.nonzero()` waits for the device to finish, so
they are what keeps a speculative loop from overlapping host and device work. These tests wrap those Tensor
methods and count calls per round (the difference between two runs of different lengths, so set-up calls
drop out)."""

import pytest
import torch
from conftest import tiny_model

import hf_eagle2.engine.budget as autotune
from hf_eagle2 import EagleDraftModel

SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@pytest.fixture
def count_syncs(monkeypatch):
    counter = {"n": 0}
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, **kwargs):
            counter["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counter


def syncs_per_round(model, draft, counter, **tree):
    ids = torch.tensor([[5, 9, 3, 7, 11, 4, 6]])
    model.generate(ids, assistant_model=draft, max_new_tokens=4, **tree)  # one-time work (binding, cost curve)
    runs = []
    for new in (12, 40):
        counter["n"] = 0
        out = model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=new, eos_token_id=None,
                             return_dict_in_generate=True, **tree)  # fmt: skip
        runs.append((counter["n"], out.eagle_stats.rounds))
    (s1, r1), (s2, r2) = runs
    assert r2 > r1
    return (s2 - s1) / (r2 - r1)


def test_fixed_tree_greedy_round_has_at_most_two_syncs(count_syncs):
    model = tiny_model("llama", seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    per_round = syncs_per_round(model, draft, count_syncs, tree="eagle2", tree_total_tokens=12, tree_depth=4, tree_top_k=4,
                                tree_ngram=0)
    assert per_round <= 2, per_round


def test_per_round_budget_without_early_stop_has_at_most_two_syncs(count_syncs, monkeypatch):
    """The accelerator setting: the budget's size choice is the round's second sync (early stopping, one more
    sync per depth, is on for CPUs only)."""
    original = autotune.round_budget

    def accelerator_budget(*args, **kwargs):
        budget = original(*args, **kwargs)
        budget.early_stop = False
        return budget

    monkeypatch.setattr(autotune, "round_budget", accelerator_budget)
    model = tiny_model("llama", seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    per_round = syncs_per_round(model, draft, count_syncs, tree="eagle2", tree_top_k=4, tree_ngram=0)
    assert per_round <= 2, per_round


def test_cpu_default_ngram_branch_sync_count(count_syncs):
    """The CPU default adds the n-gram branch, whose per-row lookup reads the device (the match search and the
    running acceptance estimate): a few syncs a round, which cost nothing on a CPU and are why accelerators
    default to no branch. Bounded here so the lookup cannot creep into a per-node loop."""
    model = tiny_model("llama", seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    per_round = syncs_per_round(model, draft, count_syncs, tree="eagle2", tree_top_k=4)
    print(f"syncs per round with the n-gram branch: {per_round:.2f}")
    assert per_round <= 10, per_round
