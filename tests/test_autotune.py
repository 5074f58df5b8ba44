"""The auto tree budget: a pure optimiser over a measured cost curve and an acceptance model."""

import pytest
import torch

from hf_eagle2.autotune import CostModel, choose_budget, expected_tokens

COST = CostModel(verify_q=[1, 3, 5, 9], verify_s=[0.040, 0.045, 0.050, 0.070], draft_step_s=0.005, overhead_s=0.0)
# expected tokens per round E(m, depth) (hand-made, concave in both)
E = {(2, 1): 1.5, (2, 2): 1.8, (4, 1): 1.6, (4, 2): 2.2, (4, 3): 2.5, (8, 1): 1.7, (8, 2): 2.4, (8, 3): 3.0}


def test_cost_interpolation():
    assert COST.verify(1) == pytest.approx(0.040)
    assert COST.verify(7) == pytest.approx(0.060)  # halfway between q=5 (0.050) and q=9 (0.070)
    assert COST.verify(13) == pytest.approx(0.090)  # linear beyond the last point
    assert COST.round_s(4, 2) == pytest.approx(0.050 + 2 * 0.005)


def test_choose_budget_hand_computed_optimum():
    # tokens/s = E / (verify(m + 1) + 0.005 * depth):
    #   (2,1) 1.5/.050=30.0  (2,2) 1.8/.055=32.7  (4,1) 1.6/.055=29.1  (4,2) 2.2/.060=36.7  (4,3) 2.5/.065=38.5
    #   (8,1) 1.7/.075=22.7  (8,2) 2.4/.080=30.0  (8,3) 3.0/.085=35.3     -> optimum m=4, depth 3
    best = choose_budget(COST, lambda m, d: E[(m, d)], m_grid=(2, 4, 8), depths=(1, 2, 3))
    assert (best["m"], best["depth"]) == (4, 3)
    assert best["tokens_per_s"] == pytest.approx(2.5 / 0.065)
    assert all(v == v and v < float("inf") for v in best.values())


def test_expected_tokens_from_recorded_values():
    values = [torch.tensor([0.9, 0.5, 0.8, 0.1]), torch.tensor([0.6, 0.3])]
    depths = [torch.tensor([1, 1, 2, 3]), torch.tensor([1, 2])]
    # m=2, depth<=2: round 1 keeps 0.9+0.8, round 2 keeps 0.6+0.3 -> 1 + mean(1.7, 0.9) = 2.3
    assert expected_tokens(values, depths, 2, 2) == pytest.approx(2.3)
    # depth 1 only: 1 + mean(0.9 + 0.5, 0.6) = 2.0
    assert expected_tokens(values, depths, 4, 1) == pytest.approx(2.0)
