"""The per-round tree budget: expected tokens per second from node values and a measured cost curve."""

import math

import pytest
import torch

from hf_eagle2.engine.budget import CostModel
from hf_eagle2.engine.drafter import AUTO_MAX_DEPTH, AUTO_MAX_TOKENS, DEFAULT_CPU_NGRAM, TreeOptions
from hf_eagle2.engine.tree import RoundBudget

COST = CostModel(verify_q=[1, 3, 5, 9], verify_s=[0.040, 0.045, 0.050, 0.070], draft_step_s=0.005, overhead_s=0.0)


def test_cost_interpolation():
    assert COST.verify(1) == pytest.approx(0.040)
    assert COST.verify(7) == pytest.approx(0.060)  # halfway between q=5 (0.050) and q=9 (0.070)
    assert COST.verify(13) == pytest.approx(0.090)  # linear beyond the last point
    assert COST.round_s(4, 2) == pytest.approx(0.050 + 2 * 0.005)


def budget(verify=(0.0, 0.040, 0.050, 0.060, 0.070, 0.200), step=0.005, overhead=0.0):
    return RoundBudget(torch.tensor(verify), step, overhead)


def test_best_size_hand_computed():
    # values 0.9, 0.5, 0.1, 0.05 with 2 head steps (0.010 s):
    #   m=0: 1/.050=20.0  m=1: 1.9/.060=31.7  m=2: 2.4/.070=34.3  m=3: 2.5/.080=31.3  m=4: 2.55/.210=12.1
    logv = torch.tensor([[0.9, 0.5, 0.1, 0.05]]).log()
    assert budget().best_size(logv, levels=2) == 2
    # a batch verifies one size: the largest any row wants (row 2 is confident throughout -> 3)
    logv2 = torch.tensor([[0.9, 0.5, 0.1, 0.05], [0.99, 0.99, 0.99, 0.01]]).log()
    assert budget().best_size(logv2, levels=2) == 3
    # hopeless drafts: verify the root alone (a plain step)
    assert budget().best_size(torch.full((1, 4), math.log(1e-3)), levels=2) == 0


def test_a_lagged_budget_keeps_the_previous_rounds_choice():
    """Accelerators: round r keeps the size chosen from round r-1's values (the first round: all candidates), so
    the choice is read after round r-1's own sync instead of as a sync of its own."""
    b = budget()
    b.early_stop, b.lagged = False, True
    confident, doubtful = torch.tensor([[0.9, 0.5, 0.1, 0.05]]).log(), torch.full((1, 4), math.log(1e-3))
    assert b.best_size(confident, levels=2) == 4  # no choice yet: every candidate
    assert b.best_size(doubtful, levels=2) == 2  # the confident round's choice (as the unlagged test above)
    assert b.best_size(confident, levels=2) == 0  # the doubtful round's
    assert b.best_size(confident[:, :1], levels=2) == 1  # never more than this round's candidates


def test_worth_expanding_compares_gain_with_a_head_step():
    b = budget(step=0.005)  # a plain step costs 0.040 s: a depth is worth it when its frontier holds > 0.125 tokens
    assert b.worth_expanding(torch.tensor([[0.1, 0.05]]).log())
    assert not b.worth_expanding(torch.tensor([[0.06, 0.05]]).log())


def test_tree_options_auto_resolution():
    opts = TreeOptions()
    assert opts.per_round_budget
    cpu = opts.resolved(torch.device("cpu"))
    assert (cpu.total_tokens, cpu.depth, cpu.top_k, cpu.ngram) == (AUTO_MAX_TOKENS, 6, 4, DEFAULT_CPU_NGRAM)
    gpu = opts.resolved(torch.device("cuda"))  # resolution only reads the device type; no GPU needed
    assert (gpu.top_k, gpu.ngram) == (10, 0)
    assert TreeOptions(tree="chain").resolved(torch.device("cpu")).ngram == 0  # the branch needs a dynamic tree
    assert TreeOptions(rerank=False).resolved(torch.device("cpu")).ngram == 0
    assert TreeOptions(ngram=0).resolved(torch.device("cpu")).ngram == 0
    assert TreeOptions(depth="auto").resolved(torch.device("cpu")).depth == AUTO_MAX_DEPTH
    assert not TreeOptions(total_tokens=16).per_round_budget
    with pytest.raises(ValueError, match="tree_depth='auto'"):
        TreeOptions(tree="chain", depth="auto")
    with pytest.raises(ValueError, match="tree_top_k"):
        TreeOptions(top_k="auto")
