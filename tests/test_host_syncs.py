"""Host syncs per round: the tree loop reads the device once a round for batch-1 greedy decoding with a fixed tree
(with the per-round budget too: on accelerators its size choice is read a round late, with the next round's read).

On a GPU every `.item()`, `.tolist()`, `bool(t)`, `int(t)` or `.nonzero()` waits for the device to finish, so
they are what keeps a speculative loop from overlapping host and device work. `count_round_ops` counts them (the
aten reads under them, and `tolist`) per round: the difference between two runs of different lengths, so set-up
reads drop out."""

import torch
from conftest import tiny_model

import hf_eagle2.engine.budget as autotune
from hf_eagle2 import EagleDraftModel
from hf_eagle2.evaluation.opcount import count_round_ops


def syncs_per_round(model, draft, **tree) -> float:
    return count_round_ops(model, torch.tensor([[5, 9, 3, 7, 11, 4, 6]]), assistant_model=draft, **tree).host_reads


def test_fixed_tree_greedy_round_reads_the_host_once():
    model = tiny_model("llama", seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    per_round = syncs_per_round(model, draft, tree="eagle2", tree_total_tokens=12, tree_depth=4, tree_top_k=4,
                                tree_ngram=0)
    assert per_round <= 1, per_round


def test_per_round_budget_on_accelerators_reads_the_host_once(monkeypatch):
    """The accelerator setting (`round_budget` on a non-CPU device): no early stop (one read per depth, CPUs only),
    and the size choice lagged by a round, its copy read after the next round's own sync; so a round reads the
    device once, as with a fixed tree. Without the lag the choice is a second read. Output = plain greedy."""
    original = autotune.round_budget

    def accelerator_budget(lagged):
        def make(*args, **kwargs):
            budget = original(*args, **kwargs)
            budget.early_stop, budget.lagged = False, lagged
            return budget

        return make

    model = tiny_model("llama", seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    ids = torch.tensor([[5, 9, 3, 7, 11, 4, 6]])
    plain = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    for lagged, reads in ((True, 1), (False, 2)):
        monkeypatch.setattr(autotune, "round_budget", accelerator_budget(lagged))
        per_round = syncs_per_round(model, draft, tree="eagle2", tree_top_k=4, tree_ngram=0)
        assert per_round <= reads and (lagged or per_round > 1), (lagged, per_round)
        out = model.generate(ids, assistant_model=draft, tree="eagle2", tree_top_k=4, tree_ngram=0, max_new_tokens=24,
                             do_sample=False, eos_token_id=None)  # fmt: skip
        assert torch.equal(out, plain)


def test_cpu_default_ngram_branch_sync_count():
    """The CPU default adds the n-gram branch, whose per-row lookup reads the device (the match search and the
    running acceptance estimate): a few syncs a round, which cost nothing on a CPU and are why accelerators
    default to no branch. Bounded here so the lookup cannot creep into a per-node loop."""
    model = tiny_model("llama", seed=3)
    draft = EagleDraftModel.from_target(model, seed=0)
    per_round = syncs_per_round(model, draft, tree="eagle2", tree_top_k=4)
    print(f"syncs per round with the n-gram branch: {per_round:.2f}")
    assert per_round <= 10, per_round
