"""Config section owned by the learner."""

from __future__ import annotations

from pydantic import Field

from broker.configlib import Section


class LearnerConfig(Section):
    """The FSDP2 learner: batches from the stream, off-policy corrected loss, checkpoints."""

    world_size: int = Field(2, ge=1, description="Learner ranks (gloo on CPU, NCCL on GPU).")
    groups_per_step: int = Field(8, ge=1, description="Prompt groups consumed per optimizer step.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    checkpoint_every: int = Field(5, ge=1, description="Optimizer steps between durable checkpoints.")
    checkpoint_interval_s: float = Field(
        60.0, gt=0, description="Upper bound on the wall time between checkpoints, seconds."
    )
