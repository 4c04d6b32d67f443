"""The learner's intake on the in-memory trajectory source (broker.memory), without Redis: which groups a step
takes, what is dropped and why, that a drop gives its admission capacity back once across a restart, and what the
acknowledgement of a checkpoint records. tests/test_trajectory_seam.py holds the in-memory source to Redis's
semantics."""

from __future__ import annotations

import numpy as np
import pytest

from broker.config import BrokerConfig
from broker.memory import MemoryProducer, MemorySource, MemoryStream
from broker.record import TrajectoryGroup, synthetic_group
from broker.staleness import InMemoryCounters, StalenessManager
from learner.checkpoint import ALREADY_CONTAINED
from learner.config import LearnerConfig
from learner.intake import TOO_LONG, Intake, NotReady

pytestmark = pytest.mark.timeout(30)

ETA = 1


def group(index: int, version: int, num_tokens: int = 4) -> TrajectoryGroup:
    rng = np.random.default_rng(index)
    return synthetic_group(
        rng, "mem", index, num_samples=2, num_tokens=num_tokens, prompt_len=4, version=version
    )


class Learner:
    """A stream, admission counters and an intake reading the stream as consumer ``learner-0``."""

    def __init__(self, order: str = "arrival", groups_per_step: int = 2, **intake: object) -> None:
        self.stream = MemoryStream(BrokerConfig(block_ms=10))
        self.producer = MemoryProducer(self.stream, "p0")
        self.counters = InMemoryCounters()
        self.config = LearnerConfig(groups_per_step=groups_per_step, intake_order=order)
        self.intake = self.restart(**intake)

    def restart(self, eta: int = ETA, **intake: object) -> Intake:
        """A fresh intake under the same consumer name: what a restarted learner has."""
        source = MemorySource(self.stream, "learner-0")
        return Intake(source, self.counters, self.config, eta, lambda: False, **intake)  # type: ignore[arg-type]

    async def produce(self, *groups: TrajectoryGroup) -> None:
        for g in groups:
            await self.counters.start(1)
            await self.counters.accept(1)
            await self.producer.send(g)


async def steps(learner: Learner, versions: list[int]) -> list[list[int]]:
    out = []
    for step, version in enumerate(versions):
        learner.intake.step = step
        batch = await learner.intake.next_batch(version, max_wait_s=2)
        assert batch is not None
        out.append([g.prompt_index for g in batch.groups])
    return out


ARRIVALS = [(0, 2), (1, 2), (2, 1), (3, 2), (4, 2)]  # prompt 2 is late, started under version 1


async def test_oldest_first_trains_the_late_group_within_the_bound() -> None:
    learner = Learner("oldest_first")
    await learner.produce(*(group(i, v) for i, v in ARRIVALS))
    assert await steps(learner, [2, 3]) == [[2, 0], [1, 3]]
    assert learner.intake.totals == {"trained": 4}


async def test_arrival_order_lets_the_late_group_go_stale_and_gives_its_capacity_back() -> None:
    learner = Learner("arrival")
    await learner.produce(*(group(i, v) for i, v in ARRIVALS))
    assert await steps(learner, [2, 3]) == [[0, 1], [3, 4]]
    assert learner.intake.totals == {"trained": 4, "stale": 1}
    snap = await learner.counters.snapshot()
    assert (snap.accepted, snap.dropped) == (4, 1)
    assert learner.stream.drops[group(2, 1).group_id][1] == "stale"


async def test_a_restarted_learner_keeps_a_recorded_drop_and_gives_capacity_back_once() -> None:
    learner = Learner("arrival", groups_per_step=1)
    await learner.produce(group(0, 0), group(1, 2))
    assert await steps(learner, [2]) == [[1]]  # group 0 is 2 versions behind: stale
    assert (await learner.counters.snapshot()).dropped == 1
    # A crash before the checkpoint: nothing was acknowledged. The restarted learner (now with eta 3, where
    # group 0 would be fresh) meets it again: the recorded decision stands, the capacity comes back once.
    learner.intake = learner.restart(eta=3)
    batch = await learner.intake.next_batch(2, max_wait_s=2)
    assert batch is not None and [g.prompt_index for g in batch.groups] == [1]
    assert learner.intake.totals == {"stale": 1, "trained": 1}
    snap = await learner.counters.snapshot()
    assert (snap.accepted, snap.dropped) == (1, 1)
    assert [e.outcome for e in learner.intake.ledger] == ["dropped:stale", "trained"]


async def test_groups_the_restored_checkpoint_contains_are_never_trained_again() -> None:
    learner = Learner("arrival", groups_per_step=1)
    await learner.produce(group(0, 0), group(1, 0))
    learner.intake.contained = {group(0, 0).group_id}
    assert await steps(learner, [0]) == [[1]]
    assert [e.outcome for e in learner.intake.ledger] == [f"dropped:{ALREADY_CONTAINED}", "trained"]
    assert (await learner.counters.snapshot()).dropped == 0  # its drop was counted before the crash


async def test_a_sample_past_max_seq_len_drops_its_group_as_too_long() -> None:
    learner = Learner("arrival", groups_per_step=1, max_seq_len=10)
    await learner.produce(group(0, 0, num_tokens=7), group(1, 0, num_tokens=6))  # prompts of 4 tokens
    assert await steps(learner, [0]) == [[1]]
    assert learner.intake.totals == {TOO_LONG: 1, "trained": 1}


async def test_a_short_stream_raises_not_ready_and_keeps_what_it_collected() -> None:
    learner = Learner("arrival", groups_per_step=2)
    await learner.produce(group(0, 0))
    with pytest.raises(NotReady):
        await learner.intake.next_batch(0, max_wait_s=0.05)
    await learner.produce(group(1, 0))
    assert await steps(learner, [0]) == [[0, 1]]


async def test_a_stop_while_collecting_withdraws_the_ledger_lines() -> None:
    learner = Learner("arrival", groups_per_step=2)
    stop = [False]
    intake = Intake(
        MemorySource(learner.stream, "learner-0"), learner.counters, learner.config, ETA, lambda: stop[0]
    )
    await learner.produce(group(0, 0))
    with pytest.raises(NotReady):
        await intake.next_batch(0, max_wait_s=0.05)
    stop[0] = True
    assert await intake.next_batch(0, max_wait_s=1) is None
    assert intake.ledger == [] and intake.totals["trained"] == 0


async def test_acknowledging_a_checkpoint_records_outcomes_and_trims() -> None:
    learner = Learner("arrival", groups_per_step=2)
    await learner.produce(*(group(i, v) for i, v in ARRIVALS))
    await steps(learner, [2, 3])
    assert await learner.intake.acknowledge(learner.intake.ledger) == 5
    outcomes = learner.stream.outcomes
    assert {g.prompt_index: (outcomes[g.group_id].outcome, outcomes[g.group_id].step) for g in
            (group(i, v) for i, v in ARRIVALS)} == {0: ("trained", 0), 1: ("trained", 0), 2: ("dropped", 1),
                                                     3: ("trained", 1), 4: ("trained", 1)}  # fmt: skip
    assert learner.stream.entries == {} and learner.stream.backlog == 0
    assert await learner.intake.acknowledge(learner.intake.ledger) == 0  # a retried acknowledgement


async def test_a_trained_outcome_records_its_place_in_the_batch_and_the_steps_lr() -> None:
    """What `streamrl replay` rebuilds a step from: the batch's order (oldest first here, not the stream's) and
    the lr; a step tried again after a non-finite loss continues its count."""
    learner = Learner("oldest_first")
    await learner.produce(*(group(i, v) for i, v in ARRIVALS), group(5, 2))
    learner.intake.lr = 0.25
    assert await steps(learner, [2, 3]) == [[2, 0], [1, 3]]
    learner.intake.lr = 0.5  # (a real retry has the same lr: this one tells the two batches apart)
    retry = await learner.intake.next_batch(3, max_wait_s=2)  # step 1 again: its batch was skipped
    assert retry is not None and [g.prompt_index for g in retry.groups] == [4, 5]
    await learner.intake.acknowledge(learner.intake.ledger)
    placed = {i: learner.stream.outcomes[group(i, v).group_id] for i, v in [*ARRIVALS, (5, 2)]}
    assert {i: (o.step, o.position, o.lr) for i, o in placed.items()} == {
        2: (0, 0, 0.25),
        0: (0, 1, 0.25),
        1: (1, 0, 0.25),
        3: (1, 1, 0.25),
        4: (1, 2, 0.5),
        5: (1, 3, 0.5),
    }


def test_a_staleness_manager_stands_for_its_counters() -> None:
    counters = InMemoryCounters()
    manager = StalenessManager(ETA, 2, 100, counters)
    learner = Learner()
    intake = Intake(MemorySource(learner.stream, "x"), manager, learner.config, ETA, lambda: False)
    assert intake.counters is counters
