"""The trust region: several optimizer updates per step, each clipped against the proximal policy (the weights
before the step's first update), whose log-probs the step computes once, before that update.

The hand computation below is independent of ``learner.losses``: per sequence, unpadded, PPO-clip on
``r = pi / pi_prox`` with the behaviour weight ``pi_prox / mu`` (1 here: on-policy data), dual clip included,
and SGD's update is minus the learning rate times its gradient. On on-policy data mu = pi_prox, so the same
computation is every token-level loss's (``ppo`` takes its ratio to mu, the others to pi_prox; the weights of
``decoupled_ppo``, ``tis`` and ``icepop`` are 1) and, with the ratio taken per sequence (the mean log-ratio,
capped) and GSPO's epsilons, GSPO's. A learner that passed the current policy as the proximal one (the bug this
replaces) has ``r = 1`` in every update of the losses that take their ratio to it, never clips, and fails the
comparison.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from learner.attention import register_packed_attention
from learner.config import LearnerConfig, LossConfig
from learner.packing import TrainSequence
from learner.step import UpdateInputs, train_batch
from learner.trainer import plan_step_inputs
from rollout_fleet.model import init_tiny_model
from tests.learner_batch import make_sequences

pytestmark = pytest.mark.timeout(120)
LR = 40.0  # large enough that the first update moves some tokens' ratios past 1 + eps in the second


def _logp(model: torch.nn.Module, s: TrainSequence, temperature: float) -> torch.Tensor:
    ids = torch.cat([s.prompt_ids, s.output_ids])[None]
    logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[len(s.prompt_ids) - 1 :]


def _surrogate(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, dual: float | None):
    unclipped = -adv * ratio
    bounded = -adv * ratio.clamp(1 - low, 1 + high)
    per_token = torch.maximum(unclipped, bounded)
    if dual is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual * adv), per_token)
    return per_token, bounded > unclipped


def _hand_update(model, seqs, temps, prox, loss_cfg: LossConfig) -> int:  # noqa: ANN001
    """One SGD update of PPO-clip against ``prox`` over ``seqs`` (token-mean); returns the clipped tokens.

    GSPO: one ratio per sequence, exp of its mean log-ratio capped at +-gspo_log_ratio_cap, GSPO's epsilons."""
    model.zero_grad()
    tokens = sum(float(s.loss_mask.sum()) for s in seqs)
    clipped = 0
    for s in seqs:
        logp = _logp(model, s, temps[s.index])
        mask = s.loss_mask.float()
        if loss_cfg.policy_loss == "gspo":
            cap = loss_cfg.gspo_log_ratio_cap
            seq_log_ratio = ((logp - prox[s.index]) * mask).sum() / mask.sum()
            ratio = torch.exp(seq_log_ratio.clamp(-cap, cap)).expand_as(logp)
            low, high = loss_cfg.gspo_eps_low, loss_cfg.gspo_eps_high
        else:
            ratio = torch.exp(logp - prox[s.index])
            low, high = loss_cfg.eps_low, loss_cfg.eps_high
        adv = torch.full_like(ratio, float(s.advantages))
        per_token, clip = _surrogate(ratio, adv, low, high, loss_cfg.dual_clip)
        clipped += int((clip & (s.loss_mask > 0)).sum())
        (per_token * mask).sum().div(tokens).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return clipped


def _model(tmp_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        init_tiny_model(tmp_path / "m"), dtype=torch.float32, attn_implementation=register_packed_attention()
    )


def _on_policy(model, raw, temps) -> list[TrainSequence]:  # noqa: ANN001
    with torch.no_grad():
        return [
            TrainSequence(s.prompt_ids, s.output_ids, _logp(model, s, t), s.versions, s.loss_mask,
                          s.advantages, s.index)
            for s, t in zip(raw, temps, strict=True)
        ]  # fmt: skip


@pytest.mark.parametrize("policy_loss", ["ppo", "decoupled_ppo", "tis", "icepop", "gspo"])
def test_second_minibatch_clips_against_the_proximal_policy(tmp_path: Path, policy_loss: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(tmp_path)
    raw, temps = make_sequences(8, seed=5, group_size=2)
    seqs = _on_policy(model, raw, temps)
    halves = [seqs[:4], seqs[4:]]  # two minibatches, as the trainer splits a step of 4 groups of 2
    config = LearnerConfig(
        world_size=1,
        groups_per_step=4,
        ppo_minibatches=2,
        micro_batch_tokens=64,
        loss_chunk_tokens=16,
        max_grad_norm=1e9,
        loss=LossConfig(policy_loss=policy_loss, tis_cap=10.0),
    )
    updates = []
    for half in halves:
        plan = plan_step_inputs(half, temps, config, 1)
        updates.append(UpdateInputs(plan.micro_batches[0], plan.temperatures[0], plan.normaliser))

    hand = copy.deepcopy(model)
    with torch.no_grad():
        prox = {s.index: _logp(hand, s, temps[s.index]) for s in seqs}
    assert _hand_update(hand, halves[0], temps, prox, config.loss) == 0  # r = 1 at the first update
    clipped = _hand_update(hand, halves[1], temps, prox, config.loss)
    assert clipped > 0  # the first update moved the policy past eps on some tokens of the second minibatch

    result = train_batch(model, torch.optim.SGD(model.parameters(), lr=LR), updates, config, 0)
    assert result.applied and result.metrics["updates_taken"] == 2
    assert result.metrics["clip_frac"] > 0
    for (name, p), q in zip(model.named_parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), atol=2e-5, rtol=1e-4, msg=name)


def test_epochs_repeat_the_minibatches_and_empty_minibatches_are_not_taken(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = _model(tmp_path)
    raw, temps = make_sequences(4, seed=1)
    seqs = _on_policy(model, raw, temps)
    flat = [TrainSequence(s.prompt_ids, s.output_ids, s.logprobs, s.versions, s.loss_mask, 0.0, s.index)
            for s in seqs[2:]]  # fmt: skip
    config = LearnerConfig(
        world_size=1, groups_per_step=2, ppo_minibatches=2, ppo_epochs=3, max_grad_norm=1e9
    )
    live = plan_step_inputs(seqs[:2], temps, config, 1)
    dead = plan_step_inputs(flat, temps, config, 1)  # all advantages 0: skipped, nothing to train
    assert all(mb.is_empty for mb in dead.micro_batches[0])
    updates = [
        UpdateInputs(live.micro_batches[0], live.temperatures[0], live.normaliser),
        UpdateInputs(dead.micro_batches[0], dead.temperatures[0], dead.normaliser, trained=False),
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = train_batch(model, opt, updates, config, 0)
    assert result.metrics["updates_taken"] == 3  # three epochs of the one minibatch with data
    assert opt.state[next(iter(model.parameters()))]["step"] == 3


def test_kl_reward_penalty_recomputes_advantages_by_hand() -> None:
    """kl_mode = reward, k1: each sample's penalty is kl_coef x sum over its loss tokens of (log mu - log ref).
    Rewards [1, 0] and [1, 1]; penalties 0.1 x d x n_i with d = 0.5 nats per token: the second group's equal
    rewards become unequal and the estimator (dr_grpo: r - mean) sees the shaped rewards."""
    from learner.config import AdvantageConfig
    from learner.step import FixedLogprobs, RewardPenalty, penalise_rewards

    seqs, temps = make_sequences(4, seed=2, group_size=2)
    config = LearnerConfig(
        world_size=1, groups_per_step=2, micro_batch_tokens=32,
        loss=LossConfig(kl_coef=0.1, kl_mode="reward", kl_estimator="k1"),
        advantage=AdvantageConfig(estimator="dr_grpo"),
    )  # fmt: skip
    plan = plan_step_inputs(seqs, temps, config, 1)
    update = UpdateInputs(plan.micro_batches[0], plan.temperatures[0], plan.normaliser)
    fixed = [[FixedLogprobs(None, mb.logp_behaviour - 0.5) for mb in update.micro_batches]]
    rewards = [1.0, 0.0, 1.0, 1.0]
    n = [float(s.loss_mask.sum()) for s in seqs]
    mean_pen = penalise_rewards([update], fixed, RewardPenalty(rewards, [[0, 1], [2, 3]], n), config)

    shaped = [r - 0.1 * 0.5 * k for r, k in zip(rewards, n, strict=True)]
    want = [shaped[0] - (shaped[0] + shaped[1]) / 2, shaped[1] - (shaped[0] + shaped[1]) / 2,
            shaped[2] - (shaped[2] + shaped[3]) / 2, shaped[3] - (shaped[2] + shaped[3]) / 2]  # fmt: skip
    assert mean_pen == pytest.approx(0.05 * sum(n) / 4)
    assert want[2] != 0.0  # the flat group now has a signal
    for mb in update.micro_batches:
        for row, i in enumerate(mb.seq_index.tolist()):
            if i < 0:
                continue
            out = mb.versions[row] >= 0
            torch.testing.assert_close(mb.advantages[row][out], torch.full((int(out.sum()),), want[i]))
            assert bool((mb.advantages[row][~out] == 0).all())
