"""Advantage estimators against values computed by hand, and their edge cases."""

from __future__ import annotations

import pytest
import torch

from learner.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    step_advantages,
    zero_signal_groups,
)
from learner.config import AdvantageConfig

torch.set_num_threads(1)


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=0)


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


# ---------------------------------------------------------------- REINFORCE++ (whitened over the step)


def test_reinforce_pp_by_hand() -> None:
    # rewards [1, 0, 1] on 2, 1 and 1 loss tokens: token values [1, 1, 0, 1], mean 0.75, deviations
    # [.25, .25, -.75, .25], sum of squares 0.75, unbiased variance 0.75 / 3 = 0.25, std 0.5
    got = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([2.0, 1.0, 1.0]))
    close(got, torch.tensor([0.25, -0.75, 0.25]) / (0.25 + 1e-8) ** 0.5)
    assert got.tolist() == pytest.approx([0.5, -1.5, 0.5], abs=1e-6)


def test_reinforce_pp_baseline_by_hand() -> None:
    # groups [0, 0, 1, 1, 2], one token each: centred [.5, -.5, 0, 0, 3] (a one-sample group keeps its reward:
    # its mean counts as 0), mean 0.6, deviations [-.1, -1.1, -.6, -.6, 2.4], sum of squares 7.7,
    # unbiased variance 7.7 / 4 = 1.925
    got = reinforce_pp_baseline_advantages(
        torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0]), torch.ones(5), torch.tensor([0, 0, 1, 1, 2])
    )
    close(got, torch.tensor([-0.1, -1.1, -0.6, -0.6, 2.4]) / (1.925 + 1e-8) ** 0.5)


def _token_level_whiten(rewards: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The token-level computation the REINFORCE++ papers and verl describe, written out on [S, T]: outcome
    returns (gamma 1: the reward on every response token), masked mean, unbiased masked variance, whitened,
    masked; then each row's value on its tokens."""
    length = int(tokens.max())
    mask = (torch.arange(length)[None, :] < tokens[:, None]).double()
    returns = rewards.double()[:, None] * mask
    mean = (returns * mask).sum() / mask.sum()
    var = (((returns - mean) ** 2) * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    whitened = (returns - mean) * torch.rsqrt(var + 1e-8) * mask
    return torch.stack(
        [row[0] if n > 0 else torch.tensor(0.0) for row, n in zip(whitened, tokens, strict=True)]
    )


@pytest.mark.parametrize("seed", range(5))
def test_reinforce_pp_equals_the_token_level_whitening_of_outcome_returns(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (12,), generator=g).double()
    tokens = torch.randint(1, 30, (12,), generator=g).double()
    close(reinforce_pp_advantages(rewards, tokens), _token_level_whiten(rewards, tokens), atol=1e-12)
    groups = torch.arange(12) // 4
    centred = rewards - torch.repeat_interleave(rewards.view(3, 4).mean(dim=1), 4)
    close(
        reinforce_pp_baseline_advantages(rewards, tokens, groups),
        _token_level_whiten(centred, tokens),
        atol=1e-12,
    )


def test_reinforce_pp_gives_a_flat_group_signal_against_the_step() -> None:
    # group 1 all 1.0: no signal within the group (GRPO: zeros), but above the step's mean under REINFORCE++
    rewards, tokens = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])], [torch.ones(2), torch.ones(2)]
    grpo = step_advantages(rewards, tokens, AdvantageConfig(estimator="grpo"))
    assert grpo[1].tolist() == [0.0, 0.0]
    rpp = step_advantages(rewards, tokens, AdvantageConfig(estimator="reinforce_pp"))
    assert all(v > 0 for v in rpp[1].tolist())
    close(torch.cat(rpp), reinforce_pp_advantages(torch.cat(rewards), torch.cat(tokens)))


def test_a_step_of_equal_rewards_or_one_token_gives_zeros() -> None:
    assert reinforce_pp_advantages(torch.ones(4), torch.full((4,), 3.0)).tolist() == [0.0] * 4
    assert reinforce_pp_advantages(torch.tensor([2.0]), torch.tensor([1.0])).tolist() == [0.0]
    with pytest.raises(ValueError, match="non-finite"):
        reinforce_pp_advantages(torch.tensor([1.0, float("nan")]), torch.ones(2))


def test_the_learner_whitens_over_the_steps_trained_tokens() -> None:
    """The trainer's advantages of a step's groups (learner.intake.group_advantages): weighted by each sample's
    loss tokens, and a truncated sample masked by loss.mask_truncated weighs nothing."""
    import numpy as np

    from broker.record import synthetic_group
    from learner.config import LearnerConfig, LossConfig
    from learner.intake import group_advantages

    rng = np.random.default_rng(0)
    groups = [synthetic_group(rng, prompt_index=i, num_samples=3, num_tokens=8 + 4 * i) for i in range(2)]
    for g in groups:
        for k, s in enumerate(g.samples):
            s.reward, s.truncated = float(k), k == 2
    rewards = torch.tensor([float(k) for _ in groups for k in range(3)])
    for masked in (False, True):
        config = LearnerConfig(
            advantage=AdvantageConfig(estimator="reinforce_pp"), loss=LossConfig(mask_truncated=masked)
        )
        tokens = torch.tensor(
            [0.0 if masked and s.truncated else float(s.loss_mask.sum()) for g in groups for s in g.samples]
        )
        assert tokens.sum() > 0
        close(torch.cat(group_advantages(groups, config)), reinforce_pp_advantages(rewards, tokens))


def test_dynamic_sampling_is_refused_where_a_flat_group_has_signal() -> None:
    from common.configlib import ConfigError
    from streamrl.config import load

    with pytest.raises(ConfigError, match="drop_zero_signal.*reinforce_pp"):
        load(["--learner.advantage.estimator=reinforce_pp", "--learner.advantage.drop_zero_signal=true"])
    cfg = load(
        ["--learner.advantage.estimator=reinforce_pp_baseline", "--learner.advantage.drop_zero_signal=true"]
    )
    assert cfg.learner.advantage.estimator == "reinforce_pp_baseline"
