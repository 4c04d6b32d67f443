"""The learning-rate schedule as a pure function of the step: linear warm-up, then constant, linear or cosine
decay to a floor. The learner steps it once per learner step (one batch of groups), whatever the number of
optimizer updates in that step, so ``warmup_steps``, ``lr_decay_steps`` and ``max_steps`` count the same thing.
"""

from __future__ import annotations

import math

from learner.config import LearnerConfig


def lr_multiplier(step: int, config: LearnerConfig) -> float:
    """Factor on ``config.lr`` for the step after ``step`` completed steps (``LambdaLR``'s argument).

    - warm-up: ``(step + 1) / (warmup_steps + 1)`` while ``step < warmup_steps``;
    - then ``constant``: 1; ``linear``: from 1 down to ``min_lr_ratio`` at ``lr_decay_steps``;
      ``cosine``: ``min + (1 - min) (1 + cos(pi p)) / 2`` with ``p`` the fraction of the decay done;
    - after ``lr_decay_steps`` (``max_steps`` when 0): ``min_lr_ratio``.
    """
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.lr_schedule == "constant":
        return 1.0
    end = config.lr_decay_steps or config.max_steps
    span = max(1, end - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    floor = config.min_lr_ratio
    if config.lr_schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
