"""Advantage estimators as pure functions over reward tensors.

Every group-relative estimator takes ``rewards`` of shape ``[G, N]`` (G prompt groups, N samples per group) and
returns advantages of the same shape, one scalar per sample; the loss broadcasts a sample's advantage to its
tokens. Groups of different sizes are estimated one at a time with shape ``[1, n]``.

The REINFORCE++ estimators (:data:`BATCH_ESTIMATORS`) normalise over the whole step instead: they take the
step's rewards flat, ``[S]`` for S samples, with each sample's loss-token count ``[S]`` (and, for the baseline
variant, its group ``[S]``), and whiten token-weighted, as verl's ``masked_whiten`` whitens per-token returns
that are constant along a sequence (outcome rewards, gamma 1). :func:`step_advantages` runs either kind over a
step's groups.

Edge cases, decided once here (docs/losses.md repeats them):

- NaN or infinite rewards raise ``ValueError`` naming the offending groups: one bad reward would otherwise
  poison its whole group's statistics (TRL #5773). Reward errors are dropped upstream with a reason.
- A group whose rewards are all equal carries no signal: its advantages are exactly 0, never NaN and never
  the rounding residue ``(r - mean(r)) / eps`` that a naive GRPO division would blow up.
- A one-sample group (N = 1) has no baseline to compare against: every estimator returns 0 for it
  (RLOO's leave-one-out mean over zero samples is undefined; GRPO's unbiased std is NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from learner.config import AdvantageConfig


def check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Validate ``rewards [G, N]`` and return it as float32 (float64 stays float64)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [G, N], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] == 0:
        raise ValueError(f"rewards has empty groups: shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    bad = ~torch.isfinite(rewards)
    if bad.any():
        groups = torch.nonzero(bad.any(dim=1)).flatten().tolist()
        values = rewards[bad].tolist()
        raise ValueError(f"rewards contain non-finite values {values[:8]} in groups {groups[:8]}")
    return rewards


def zero_signal_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[G, N] -> bool [G]``: True where every reward of the group is equal (exact comparison).

    Such a group has zero advantage under every estimator, so it adds no gradient, only compute; DAPO's
    dynamic sampling drops it and counts it. One-sample groups are zero-signal by this definition.
    """
    rewards = check_rewards(rewards)
    return (rewards == rewards[:, :1]).all(dim=1)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: ``A = r - mean_group(r)``, no std division ([G, N] -> [G, N]).

    Dr. GRPO's other half, no per-sequence length normalisation, lives in the loss aggregation
    (``seq-mean-token-sum`` or ``token-mean``), not here.
    """
    rewards = check_rewards(rewards)
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    return _zero_flat_groups(adv, rewards)


def grpo_advantages(rewards: torch.Tensor, std_normalise: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A = (r - mean_group(r)) / (std_group(r) + eps)`` ([G, N] -> [G, N]).

    The std is the unbiased (N - 1) sample std, as TRL and verl compute it. With ``std_normalise=False``
    this is :func:`dr_grpo_advantages`.
    """
    rewards = check_rewards(rewards)
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if std_normalise and rewards.shape[1] > 1:
        adv = adv / (rewards.std(dim=1, keepdim=True) + eps)
    return _zero_flat_groups(adv, rewards)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j = N / (N - 1) * (r_i - mean(r))`` ([G, N] -> [G, N]).

    Each sample's baseline excludes itself, so the estimate stays unbiased; N = 1 gives 0 (see module doc).
    """
    rewards = check_rewards(rewards)
    n = rewards.shape[1]
    if n == 1:
        return torch.zeros_like(rewards)
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return _zero_flat_groups(rewards - baseline, rewards)


def _zero_flat_groups(adv: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    # mean() of equal floats can differ from them in the last bit; force exact zeros for no-signal groups.
    flat = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(adv), adv)


def batch_whiten(values: torch.Tensor, tokens: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``[S], [S] -> [S]``: ``(v - mean) / sqrt(var + eps)`` with the mean and the variance over the step's
    tokens (each sample's value counted once per loss token), the variance unbiased over the token count: verl's
    ``masked_whiten`` of a ``[S, T]`` tensor whose rows hold ``v`` on their ``tokens`` masked positions. A step
    of fewer than two tokens, or whose values are all equal, gets zeros."""
    weights = tokens.to(values.dtype)
    total = weights.sum()
    if float(total) < 2:
        return torch.zeros_like(values)
    mean = (values * weights).sum() / total
    var = ((values - mean) ** 2 * weights).sum() / total * (total / (total - 1))
    return (values - mean) * torch.rsqrt(var + eps)


def reinforce_pp_advantages(rewards: torch.Tensor, tokens: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++ on outcome rewards: each sample's reward whitened over the step (``[S], [S] -> [S]``).

    No per-prompt baseline: the step's token-weighted mean is the baseline, so a group whose rewards are all
    equal still has signal (its reward against the step's)."""
    return batch_whiten(_checked_flat(rewards), tokens, eps)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, tokens: torch.Tensor, groups: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++-baseline: ``r - mean_group(r)`` (0 for a one-sample group's mean, as verl), then whitened
    over the step (``[S], [S], [S] group ids -> [S]``)."""
    rewards = _checked_flat(rewards)
    centered = rewards.clone()
    for group in torch.unique(groups):
        members = groups == group
        if int(members.sum()) > 1:
            centered[members] = rewards[members] - rewards[members].mean()
    return batch_whiten(centered, tokens, eps)


def _checked_flat(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"step rewards must have shape [S], got shape {tuple(rewards.shape)}")
    return check_rewards(rewards[None, :])[0]


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(rewards: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    """Advantages ``[G, N]`` from ``rewards [G, N]`` with the estimator the config names."""
    if config.estimator == "grpo":
        return grpo_advantages(rewards, std_normalise=config.std_normalise, eps=config.eps)
    if config.estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage.estimator = {config.estimator!r} is not one of {list(ADVANTAGE_ESTIMATORS)}"
        )
    return ADVANTAGE_ESTIMATORS[config.estimator](rewards)


BATCH_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")


def step_advantages(
    rewards: list[torch.Tensor], tokens: list[torch.Tensor], config: AdvantageConfig
) -> list[torch.Tensor]:
    """Advantages of a step's groups: ``rewards`` and loss-token counts ``tokens`` per group (``[N_g]`` each)
    -> ``[N_g]`` per group. Group-relative estimators see one group at a time; the REINFORCE++ ones the step."""
    if config.estimator not in BATCH_ESTIMATORS:
        return [compute_advantages(r[None, :], config)[0] for r in rewards]
    if not rewards:
        return []
    flat, counts = torch.cat(rewards), torch.cat(tokens)
    if config.estimator == "reinforce_pp":
        advantages = reinforce_pp_advantages(flat, counts, config.whiten_eps)
    else:
        groups = torch.cat([torch.full((len(r),), g) for g, r in enumerate(rewards)])
        advantages = reinforce_pp_baseline_advantages(flat, counts, groups, config.whiten_eps)
    return list(torch.split(advantages, [len(r) for r in rewards]))
