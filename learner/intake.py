"""Rank 0's intake: read prompt groups from the stream, filter them, and assemble one step's batch.

Every delivery ends in exactly one ledger line: ``trained`` when it goes into the step, or
``dropped:<reason>`` (stale, reward error, zero signal, too long, duplicate), written to the durable dropped
stream and handing its admission capacity back. The ledger lines of a checkpoint window are acknowledged only
after the checkpoint that contains them is durable (``learner.checkpoint``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from broker.protocols import Delivery, TrajectorySource
from broker.record import TrajectoryGroup
from broker.staleness import StalenessCounters, StalenessManager, check_staleness
from common.configlib import ConfigError
from common.lifecycle import crash_point
from common.versioning import Lineage, admission_capacity
from learner.advantages import step_advantages, zero_signal_groups
from learner.checkpoint import ALREADY_CONTAINED, LedgerEntry
from learner.config import LearnerConfig

log = logging.getLogger("streamrl.learner")

TOO_LONG = "too_long"  # a sample longer than the learner's maximum sequence length (bad input, never trained)


class NotReady(Exception):
    """No full batch within the wait slice; what was collected is kept for the next call."""


@dataclass
class StepBatch:
    """The groups of one optimizer step and the bookkeeping that goes with them."""

    deliveries: list[Delivery]
    learner_version: int
    wait_s: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> groups dropped while collecting

    @property
    def groups(self) -> list[TrajectoryGroup]:
        return [d.group for d in self.deliveries]


def sequence_limit(max_seq_len: int | None, model_context: int | None) -> int | None:
    """The longest sample (prompt + output tokens) the learner trains: ``learner.max_seq_len``, else the model's
    context (``max_position_embeddings``); None when neither is known. Past the context the model has no trained
    positions, so a larger ``max_seq_len`` is refused."""
    if max_seq_len is not None and model_context is not None and max_seq_len > model_context:
        raise ConfigError(
            f"learner.max_seq_len = {max_seq_len} exceeds the model's max_position_embeddings = {model_context}"
        )
    return max_seq_len if max_seq_len is not None else model_context


def longest_sample(group: TrajectoryGroup) -> tuple[int, int]:
    """(sample index, prompt + output tokens) of the group's longest sample."""
    lengths = [(len(group.prompt_ids) + len(s.output_ids), s.sample_index) for s in group.samples]
    length, index = max(lengths)
    return index, length


def drop_reason(
    group: TrajectoryGroup,
    learner_version: int,
    eta: int,
    drop_zero_signal: bool,
    lineage: Lineage | None = None,
    max_seq_len: int | None = None,
) -> str | None:
    """Why a group must not be trained on at ``learner_version``, or None to keep it."""
    if max_seq_len is not None and longest_sample(group)[1] > max_seq_len:
        return TOO_LONG  # bad input whatever its rewards and versions: first
    statuses = {s.reward_status for s in group.samples}
    if "timeout" in statuses:
        return "reward_timeout"
    if "error" in statuses:
        return "reward_error"
    versions = {int(v) for s in group.samples for v in np.unique(s.versions)}
    decision = check_staleness(learner_version, eta, versions, lineage)
    if not decision.keep:
        return decision.reason
    if drop_zero_signal and len(group.samples) > 1:
        rewards = torch.tensor([[s.reward for s in group.samples]], dtype=torch.float64)
        if bool(zero_signal_groups(rewards)[0]):
            return "zero_signal"
    return None


class Intake:
    """Collects ``groups_per_step`` trainable groups per step; runs on rank 0's event loop."""

    def __init__(
        self,
        consumer: TrajectorySource,
        admission: StalenessCounters | StalenessManager,
        config: LearnerConfig,
        eta: int,
        should_stop: Callable[[], bool],
        max_seq_len: int | None = None,
    ) -> None:
        self.consumer = consumer
        # The admission counters (a StalenessManager stands for its own): a drop gives its group's capacity back
        # to them with its record, once per group; the learner never admits, so it needs no bound.
        self.counters = admission.counters if isinstance(admission, StalenessManager) else admission
        self.max_seq_len = max_seq_len  # sequence_limit(): longer samples drop their group as too_long
        self.config = config
        self.eta = eta
        self.should_stop = should_stop
        self.ledger: list[LedgerEntry] = []  # since the last checkpoint
        self.contained: set[str] = (
            set()
        )  # group ids of the restored checkpoint window (already in the weights)
        self.totals: dict[str, int] = {}  # groups by outcome (trained or a drop reason), since the run began
        self.sample_totals: dict[str, int] = {}  # samples by outcome
        self.step = 0  # the learner step the batch being collected goes into (ledger lines carry it)
        self.lr = -1.0  # that step's learning rate (the trainer sets it; trained ledger lines carry it)
        self._positions = (0, 0)  # (step, groups recorded as trained at it): each trained group's position
        self.lineage = Lineage()  # which weights each version holds (a resumed learner's is not the identity)
        self._partial: StepBatch | None = None  # collected so far when next_batch ran out of time
        self._carry: list[Delivery] = []  # fetched beyond a full step: first in line for the next one
        self._last_claim = 0.0
        self._version = 0  # the learner version of the batch being collected

    async def next_batch(self, learner_version: int, max_wait_s: float) -> StepBatch | None:
        """A full step's batch, or None when a stop was requested. Waits at most ``max_wait_s``, then raises
        NotReady keeping what it collected, so the caller can keep its ranks' collectives alive and retry."""
        batch = self._partial or StepBatch(deliveries=[], learner_version=learner_version)
        self._partial = None
        self._version = batch.learner_version
        started = time.monotonic()
        while len(batch.deliveries) < self.config.groups_per_step:
            if self.should_stop():
                self._return_unused(batch)
                return None
            if time.monotonic() - started > max_wait_s:
                batch.wait_s += time.monotonic() - started
                self._partial = batch
                raise NotReady
            for delivery in await self._candidates(self.config.groups_per_step - len(batch.deliveries)):
                await self._admit(delivery, batch)
        batch.wait_s += time.monotonic() - started
        return batch

    async def _candidates(self, wanted: int) -> list[Delivery]:
        """The deliveries to consider next, in the order they are taken.

        ``arrival``: what was carried over, else the next ``wanted`` entries of the stream. ``oldest_first``:
        also everything else delivered by now (without waiting when the carry already fills the step), sorted
        by the group's oldest token version. Groups finish out of order (a group of long samples finishes after
        groups admitted later); in stream order such a group queues behind fresher ones and crosses the
        staleness bound, while oldest first trains it while it is still within the bound and leaves the
        fresher ones, which can wait, for the next step."""
        carry, self._carry = self._carry, []
        if self.config.intake_order == "arrival":
            return carry or await self._fetch(wanted)
        window = max(wanted, admission_capacity(self.eta, self.config.groups_per_step)) - len(carry)
        fresh = await self._fetch(window, wait=len(carry) < wanted) if window > 0 else []
        return sorted(carry + fresh, key=lambda d: d.group.min_version())  # stable: ties keep arrival order

    async def _fetch(self, wanted: int, wait: bool = True) -> list[Delivery]:
        now = time.monotonic()
        if now - self._last_claim > self.consumer.config.claim_idle_ms / 2000:
            self._last_claim = now
            claimed = await self.consumer.claim_stale()
            if claimed:
                return claimed
        return await self.consumer.read(count=wanted, block_ms=self.consumer.config.block_ms if wait else 0)

    async def _admit(self, delivery: Delivery, batch: StepBatch) -> None:
        group = delivery.group
        if group.group_id in self.contained:
            # Trained (or dropped) before the crash and inside the restored weights: acknowledge, never retrain.
            self._record(delivery, f"dropped:{ALREADY_CONTAINED}")
            return
        if len(batch.deliveries) >= self.config.groups_per_step:
            self._carry.append(delivery)
            return
        if delivery.delivery_count > 1 and (recorded := await self.consumer.recorded_drop(group.group_id)):
            # Dropped before a crash that lost the ledger line, not the drop record: the decision stands (a
            # fresh one could train a group the dropped stream and the admission counters call dropped).
            await self._drop(delivery, recorded, "", batch)
            return
        reason = drop_reason(
            group,
            batch.learner_version,
            self.eta,
            self.config.advantage.drop_zero_signal,
            self.lineage,
            self.max_seq_len,
        )
        if reason is None:
            batch.deliveries.append(delivery)
            self._record(delivery, "trained")
            return
        detail = self._refuse_too_long(group) if reason == TOO_LONG else ""
        await self._drop(delivery, reason, detail, batch)

    async def _drop(self, delivery: Delivery, reason: str, detail: str, batch: StepBatch) -> None:
        record = await self.consumer.drop(delivery, reason, detail, admission=self.counters)
        crash_point("intake.after_drop")
        if record.first and not record.gave_back:
            # Produced outside admission control (a test producer, an import): no capacity to give back.
            self.totals["drop_without_admission"] = self.totals.get("drop_without_admission", 0) + 1
        batch.dropped[reason] = batch.dropped.get(reason, 0) + 1
        self._record(delivery, f"dropped:{reason}")

    def _refuse_too_long(self, group: TrajectoryGroup) -> str:
        """Log the refusal of a group with a sample past ``max_seq_len``; returns the drop record's detail."""
        index, length = longest_sample(group)
        detail = (
            f"sample {index}: {length} tokens (prompt {len(group.prompt_ids)} + output "
            f"{length - len(group.prompt_ids)}) > the learner's max_seq_len {self.max_seq_len}"
        )
        log.error("group %s refused, dropped as %s: %s", group.group_id, TOO_LONG, detail)
        return detail

    def _record(self, delivery: Delivery, outcome: str) -> None:
        entry = LedgerEntry(delivery.entry_id, delivery.group.group_id, outcome, self.step, self._version)
        if outcome == "trained":
            # the batch's order, counted on across a retry of the step (a non-finite loss skips a batch)
            step, count = self._positions if self._positions[0] == self.step else (self.step, 0)
            entry.position, entry.lr = count, self.lr
            self._positions = (step, count + 1)
        self.ledger.append(entry)
        key = outcome.split(":", 1)[-1] if outcome != "trained" else "trained"
        self.totals[key] = self.totals.get(key, 0) + 1
        self.sample_totals[key] = self.sample_totals.get(key, 0) + len(delivery.group.samples)

    def _return_unused(self, batch: StepBatch) -> None:
        """A stop while collecting: groups already taken stay pending (unacknowledged) and are re-read after a
        restart, so their ledger lines are withdrawn."""
        unused = {d.entry_id for d in batch.deliveries}
        self._positions = (self._positions[0], self._positions[1] - len(unused))
        self.ledger = [e for e in self.ledger if e.entry_id not in unused]
        self.totals["trained"] = self.totals.get("trained", 0) - len(unused)
        samples = sum(len(d.group.samples) for d in batch.deliveries)
        self.sample_totals["trained"] = self.sample_totals.get("trained", 0) - samples

    async def acknowledge(self, entries: list[LedgerEntry]) -> int:
        """Acknowledge a durable checkpoint's ledger, recording each group's final outcome with it
        (broker.outcomes), and trim the stream below the oldest pending entry."""
        outcomes = [(e.group_id, o) if (o := e.final_outcome()) is not None else None for e in entries]
        done = await self.consumer.ack([e.entry_id for e in entries], outcomes)
        await self.consumer.trim()
        return done


def rewards_tensor(groups: list[TrajectoryGroup]) -> list[torch.Tensor]:
    """Per-group reward vectors [N_g] (groups may differ in size)."""
    return [torch.tensor([s.reward for s in g.samples], dtype=torch.float32) for g in groups]


def loss_tokens(groups: list[TrajectoryGroup], config: LearnerConfig) -> list[torch.Tensor]:
    """Per-group vectors [N_g] of the tokens each sample trains (its loss mask; none when truncated samples are
    masked): the weights of the REINFORCE++ estimators' whitening."""
    masked = config.loss.mask_truncated
    return [
        torch.tensor([0.0 if masked and s.truncated else float(s.loss_mask.sum()) for s in g.samples])
        for g in groups
    ]


def group_advantages(groups: list[TrajectoryGroup], config: LearnerConfig) -> list[torch.Tensor]:
    """Advantages per group [N_g] (groups may differ in size): each group on its own for the group-relative
    estimators, over the whole step's samples for REINFORCE++ (learner.advantages.step_advantages)."""
    return step_advantages(rewards_tensor(groups), loss_tokens(groups, config), config.advantage)


def run_coroutine(loop: asyncio.AbstractEventLoop, coro, timeout_s: float | None = None):  # noqa: ANN001, ANN201
    """Run ``coro`` on rank 0's background loop from the training thread and wait for its result."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)
