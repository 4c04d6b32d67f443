"""Advantage estimators against values computed by hand, and their edge cases."""

from __future__ import annotations

import pytest
import torch

from learner.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
    zero_signal_groups,
)
from learner.config import AdvantageConfig

torch.set_num_threads(1)

# Two groups of four samples used throughout.
#   group 0: [1, 0, 0, 1]  mean 0.5, deviations [+.5, -.5, -.5, +.5], sum of squares 1.0
#   group 1: [3, 1, 2, 2]  mean 2.0, deviations [+1, -1, 0, 0],       sum of squares 2.0
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])


def test_grpo_by_hand() -> None:
    # unbiased std: group 0 sqrt(1/3) = 0.5773503, group 1 sqrt(2/3) = 0.8164966
    # group 0: 0.5 / (0.5773503 + 1e-6) = 0.8660239; group 1: 1 / (0.8164966 + 1e-6) = 1.2247434
    expected = torch.tensor(
        [[0.8660239, -0.8660239, -0.8660239, 0.8660239], [1.2247434, -1.2247434, 0.0, 0.0]]
    )
    torch.testing.assert_close(grpo_advantages(REWARDS), expected, atol=1e-6, rtol=0)


def test_grpo_without_std_is_dr_grpo_by_hand() -> None:
    # A = r - mean: the deviations listed above
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])
    torch.testing.assert_close(dr_grpo_advantages(REWARDS), expected)
    torch.testing.assert_close(grpo_advantages(REWARDS, std_normalise=False), expected)


def test_rloo_by_hand() -> None:
    # group 0: 1 - mean(0, 0, 1) = 2/3;  0 - mean(1, 0, 1) = -2/3
    # group 1: 3 - mean(1, 2, 2) = 3 - 5/3 = 4/3;  1 - mean(3, 2, 2) = 1 - 7/3 = -4/3;  2 - mean(3, 1, 2) = 0
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [4 / 3, -4 / 3, 0.0, 0.0]])
    torch.testing.assert_close(rloo_advantages(REWARDS), expected)


def test_grpo_eps_guards_a_tiny_std() -> None:
    # rewards [0, 1e-7]: deviations +-5e-8, unbiased std 7.0711e-8; with eps 1e-6 the divisor is
    # 1.0707e-6, so A = +-5e-8 / 1.0707e-6 = +-0.046698 (without eps it would be +-0.7071)
    adv = grpo_advantages(torch.tensor([[0.0, 1e-7]], dtype=torch.float64), eps=1e-6)
    torch.testing.assert_close(
        adv, torch.tensor([[-0.046698, 0.046698]], dtype=torch.float64), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_equal_rewards_give_exact_zeros(name: str) -> None:
    # 0.3 six times: float32 mean is 0.3 + 3e-8, so a naive (r - mean) / (0 + eps) gives 0.0289, not 0.
    rewards = torch.tensor([[0.3] * 6, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]])
    adv = ADVANTAGE_ESTIMATORS[name](rewards)
    assert torch.equal(adv[0], torch.zeros(6))
    assert torch.isfinite(adv).all() and adv[1].abs().sum() > 0


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_one_sample_group_is_zero_not_nan(name: str) -> None:
    adv = ADVANTAGE_ESTIMATORS[name](torch.tensor([[5.0], [-2.0]]))
    assert torch.equal(adv, torch.zeros(2, 1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_are_rejected_naming_the_group(bad: float) -> None:
    rewards = torch.tensor([[1.0, 0.0], [0.5, bad], [1.0, 1.0]])
    for fn in ADVANTAGE_ESTIMATORS.values():
        with pytest.raises(ValueError, match=r"non-finite.*groups \[1\]"):
            fn(rewards)


def test_bad_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"\[G, N\]"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


def test_zero_signal_groups_mask_and_count() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.3, 0.3, 0.3], [0.0, 0.0, 1e-9]])
    mask = zero_signal_groups(rewards)
    assert mask.tolist() == [True, False, True, False]
    assert int(mask.sum()) == 2


def test_compute_advantages_follows_the_config() -> None:
    torch.testing.assert_close(
        compute_advantages(REWARDS, AdvantageConfig(estimator="rloo")), rloo_advantages(REWARDS)
    )
    torch.testing.assert_close(
        compute_advantages(REWARDS, AdvantageConfig(estimator="grpo", std_normalise=False)),
        dr_grpo_advantages(REWARDS),
    )
    assert not torch.allclose(compute_advantages(REWARDS, AdvantageConfig()), dr_grpo_advantages(REWARDS))
