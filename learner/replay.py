"""Replay: the learner's own step code re-run, without Redis, on the batches a run trained (``streamrl replay``).

:class:`ReplayLearner` is the :class:`learner.trainer.Learner` of the run (same config, world size, seed, model
build and lr schedule), started from the run's initial weights or one of its checkpoints. Rank 0 takes each
archived step's groups in the order the step trained them instead of reading the stream, and from there the
trainer's path runs unchanged: ``_payloads`` plans and scatters the micro-batches, ``_train`` runs
``train_batch`` and steps the schedule. Nothing is published, checkpointed or exported. After every step that has
a checkpoint in the run, the replayed weights are gathered and compared with it, tensor by tensor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from broker.config import BrokerConfig
from broker.protocols import Delivery
from broker.record import TrajectoryGroup
from common.config import SharedConfig
from learner.checkpoint import model_state_from_checkpoint
from learner.config import LearnerConfig
from learner.distributed import DistInfo
from learner.intake import StepBatch
from learner.publish import Publication, VersionOnlyPublisher
from learner.trainer import Learner

log = logging.getLogger("streamrl.learner")


class ArchivedStep(Protocol):
    """One step as the run's archive holds it (archiver.batches.TrainedStep)."""

    step: int
    learner_version: int
    lr: float
    groups: list[TrajectoryGroup]


class NoPublisher(VersionOnlyPublisher):
    """Replay publishes nothing: no version is announced, no engine is updated."""

    def publish(self, model: nn.Module, version: int, initial: bool) -> Publication:
        return Publication(announce=False)


@dataclass
class Comparison:
    """The replayed weights against the run's checkpoint of one step."""

    step: int
    checkpoint: str
    bit_identical: bool
    max_abs_diff: float
    tensors: dict[str, float] = field(default_factory=dict)  # name -> largest absolute difference


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def compare_states(step: int, checkpoint: Path, replayed: dict[str, torch.Tensor]) -> Comparison:
    """Tensor by tensor: equal bits, and the largest absolute difference (inf for a missing or reshaped one)."""
    recorded = model_state_from_checkpoint(checkpoint)
    diffs: dict[str, float] = {}
    identical = recorded.keys() == replayed.keys()
    for name in sorted(recorded.keys() | replayed.keys()):
        a, b = recorded.get(name), replayed.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            diffs[name], identical = math.inf, False
            continue
        same = torch.equal(_bits(a), _bits(b))  # NaN included
        identical &= same
        diffs[name] = 0.0 if same else float((a.double() - b.double()).abs().max())
    largest = max(diffs.values(), default=0.0)
    return Comparison(step, checkpoint.name, identical, largest, diffs)


class ReplayLearner(Learner):
    """One rank of a replay (module docstring). Construct on every rank, then call :meth:`replay`."""

    def __init__(
        self, shared: SharedConfig, broker: BrokerConfig, config: LearnerConfig, info: DistInfo
    ) -> None:
        # what only writes files or talks to others is off; none of it touches the weights
        quiet = {"snapshot_every": 0, "export_every": 0, "export_at_end": False, "async_checkpoint": False}
        super().__init__(shared, broker, config.model_copy(update=quiet), info, NoPublisher(), redis_url="")
        self.step_log: list[dict[str, Any]] = []  # rank 0: per trained batch, the step's metrics
        self.lr_mismatches: list[dict[str, float]] = []  # rank 0: steps whose schedule gave another lr
        self.replayed: list[int] = []  # the steps replayed
        self._step_lr = 0.0  # rank 0: the lr the batch being trained trains with

    def replay(
        self, steps: list[ArchivedStep] | str | None, checkpoints: dict[int, Path]
    ) -> list[Comparison]:
        """Train ``steps`` (rank 0's, or why it has none; None on the other ranks) in order, comparing with
        ``checkpoints`` (step -> the run's committed checkpoint) after each step that has one; every rank returns
        the comparisons, or raises ValueError with rank 0's reason."""
        mine = steps if isinstance(steps, str) or steps is None else self._plan(steps)
        plan = self._broadcast(mine)
        if isinstance(plan, str):
            raise ValueError(plan)  # on every rank: rank 0 found the archive's steps unusable
        assert not isinstance(steps, str)
        self.replayed = [step for step, _ in plan]
        comparisons = []
        for i, (step, batches) in enumerate(plan):
            for b in range(batches):
                batch = self._batch_of(steps[i], b) if steps is not None else None
                self._train(self._scatter(self._payloads(batch) if batch is not None else None))
            if self.step != step:
                raise RuntimeError(
                    f"archived step {step} replayed as step {self.step}: an update applied differently"
                )
            if step in checkpoints:
                comparisons.append(self._compare(step, checkpoints[step]))
        return comparisons

    def _plan(self, steps: list[ArchivedStep]) -> list[tuple[int, int]] | str:
        """(step, batches) of each step, or why they cannot be replayed: consecutive steps from the start, each
        of whole batches of ``groups_per_step`` (more than one: a retry after a non-finite loss)."""
        size, plan = self.config.groups_per_step, []
        for expected, s in enumerate(steps, start=self.step + 1):
            if s.step != expected:
                return f"the archive has no trained groups of step {expected} (next: step {s.step})"
            if not s.groups or len(s.groups) % size:
                return (
                    f"step {s.step}: {len(s.groups)} groups archived, not a multiple of "
                    f"learner.groups_per_step = {size}"
                )
            plan.append((s.step, len(s.groups) // size))
        return plan

    def _batch_of(self, step: ArchivedStep, index: int) -> StepBatch:
        """Rank 0: the step's ``index``-th batch, as the intake handed it to the trainer."""
        lr = self._step_lr = float(self.scheduler.get_last_lr()[0])
        if index == 0 and step.lr != lr:  # the schedule comes from the config: a changed config shows here
            self.lr_mismatches.append({"step": step.step, "recorded": step.lr, "replayed": lr})
            log.warning("step %d: replayed lr %r, the run recorded %r", step.step, lr, step.lr)
        size = self.config.groups_per_step
        groups = step.groups[index * size : (index + 1) * size]
        self._batch = StepBatch([Delivery("", g, 1, 0) for g in groups], step.learner_version)
        return self._batch

    def _log_step(self, train_metrics: dict[str, float], applied: bool) -> None:
        """Rank 0: the step's metrics into the replay's log (the run's went to Redis)."""
        self.step_log.append({"step": self.step, "applied": applied, "lr": self._step_lr, **train_metrics})
        log.info("replayed step %d loss %.6f grad norm %.6f", self.step, train_metrics["loss"],
                 train_metrics["grad_norm"])  # fmt: skip

    def _compare(self, step: int, checkpoint: Path) -> Comparison:
        """Gather the replayed weights (every rank) and compare them on rank 0; every rank gets the result."""
        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        result = compare_states(step, checkpoint, state) if self.info.is_main else None
        result = self._broadcast(result)
        log.info("step %d vs %s: bit-identical %s, largest difference %g", step, checkpoint.name,
                 result.bit_identical, result.max_abs_diff)  # fmt: skip
        return result
