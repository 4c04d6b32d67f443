"""The learning-rate schedule by hand, and as the learner's optimizer sees it through LambdaLR."""

from __future__ import annotations

import math

import pytest
import torch

from common.configlib import ConfigError
from learner.config import LearnerConfig
from learner.schedule import lr_multiplier
from streamrl.config import load


def _cfg(**kw: object) -> LearnerConfig:
    return LearnerConfig(world_size=1, **kw)


def test_warmup_then_constant() -> None:
    c = _cfg(warmup_steps=3)
    assert [lr_multiplier(s, c) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_by_hand() -> None:
    # warm-up 2, then from 1 at step 2 down to 0.1 at step 12: slope 0.9 / 10 per step
    c = _cfg(warmup_steps=2, lr_schedule="linear", lr_decay_steps=12, min_lr_ratio=0.1)
    got = [lr_multiplier(s, c) for s in (0, 1, 2, 7, 12, 20)]
    assert got == pytest.approx([1 / 3, 2 / 3, 1.0, 0.55, 0.1, 0.1])


def test_cosine_decay_by_hand_and_decay_steps_default_to_max_steps() -> None:
    # no warm-up, max_steps 10: halfway (step 5) cos(pi / 2) = 0 -> (1 + 0) / 2 = 0.5; floor 0
    c = _cfg(lr_schedule="cosine", max_steps=10)
    got = [lr_multiplier(s, c) for s in (0, 5, 10, 11)]
    assert got == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert lr_multiplier(2, c) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))


def test_the_optimizer_follows_it() -> None:
    c = _cfg(lr=0.1, warmup_steps=1, lr_schedule="linear", max_steps=5)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=c.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, c))
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warm-up 1: 0.5 x 0.1 at step 0; then 1 at step 1 down to 0 at step 5 (0.25 per step)
    assert seen == pytest.approx([0.05, 0.1, 0.075, 0.05, 0.025, 0.0])


def test_decay_without_an_end_is_refused() -> None:
    with pytest.raises(ConfigError, match="lr_decay_steps"):
        load(["--learner.lr_schedule=cosine", "--learner.max_steps=0"])
    with pytest.raises(ConfigError, match="ppo_minibatches = 5"):
        load(["--learner.groups_per_step=4", "--learner.ppo_minibatches=5"])
