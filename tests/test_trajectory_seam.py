"""The trajectory seam (broker.protocols) on both of its implementations, the in-memory one (broker.memory) and
the Redis Stream: every test runs the same assertions on each, so the in-memory stand-in the roles' unit tests use
cannot drift from what Redis does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import pytest

from broker.admission import RedisCounters
from broker.client import BrokerKeys, connect
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.memory import MemoryProducer, MemorySource, MemoryStream
from broker.outcomes import Outcome, read_outcomes
from broker.producer import Producer
from broker.protocols import TrajectoryProducer, TrajectorySource
from broker.record import TrajectoryGroup, synthetic_group
from broker.staleness import InMemoryCounters, StalenessCounters
from common.config import SharedConfig
from learner.config import LearnerConfig
from learner.intake import Intake

pytestmark = pytest.mark.timeout(60)

CONFIG = BrokerConfig(block_ms=20, claim_idle_ms=100)


@dataclass
class Seam:
    """One implementation of the seam: a producer, sources by consumer name, the admission counters and the
    recorded outcomes."""

    producer: TrajectoryProducer
    source: Callable[[str], TrajectorySource]
    counters: StalenessCounters
    outcomes: Callable[[], Awaitable[dict[str, Outcome]]]


@pytest.fixture(params=["memory", "redis"])
async def seam(request: pytest.FixtureRequest) -> AsyncIterator[Seam]:
    if request.param == "memory":
        stream = MemoryStream(CONFIG)

        async def memory_outcomes() -> dict[str, Outcome]:
            return dict(stream.outcomes)

        yield Seam(
            MemoryProducer(stream, "p0"),
            lambda name: MemorySource(stream, name),
            InMemoryCounters(),
            memory_outcomes,
        )
        return
    url = request.getfixturevalue("redis_url")
    shared = SharedConfig(run_id="seam", redis_url=url)
    client = connect(url, CONFIG)
    yield Seam(
        Producer(client, shared, CONFIG, "p0"),
        lambda name: Consumer(client, shared, CONFIG, name),
        RedisCounters(client, shared),
        lambda: read_outcomes(client, BrokerKeys.of(shared, CONFIG)),
    )
    await client.aclose()


def group(index: int, version: int = 0) -> TrajectoryGroup:
    return synthetic_group(
        np.random.default_rng(index), "seam", index, num_samples=2, num_tokens=4, version=version
    )


async def admitted(seam: Seam, *groups: TrajectoryGroup) -> None:
    """Send groups counted through admission control first, as a rollout worker does (started, then accepted)."""
    for g in groups:
        await seam.counters.start(1)
        await seam.counters.accept(1)
        await seam.producer.send(g)


async def test_a_send_is_idempotent_by_group_id(seam: Seam) -> None:
    assert isinstance(seam.producer, TrajectoryProducer) and isinstance(seam.source("x"), TrajectorySource)
    first = await seam.producer.send(group(0))
    assert await seam.producer.send(group(0)) == first
    source = seam.source("learner-0")
    got = await source.read(count=10)
    assert [(d.entry_id, d.group.group_id, d.delivery_count) for d in got] == [(first, group(0).group_id, 1)]
    assert got[0].group.samples[0].output_ids.tolist() == group(0).samples[0].output_ids.tolist()
    assert await source.read(count=10, block_ms=0) == []


async def test_delivery_is_at_least_once_until_acknowledged(seam: Seam) -> None:
    for i in range(2):
        await seam.producer.send(group(i))
    source = seam.source("learner-0")
    a, b = await source.read(count=10)
    assert await source.ack([a], [(a.group.group_id, Outcome("trained", 0))]) == 1
    restarted = seam.source("learner-0")  # the same consumer name after a crash: b was never acknowledged
    again = await restarted.read(count=10)
    assert [(d.entry_id, d.delivery_count) for d in again] == [(b.entry_id, 2)]
    assert await restarted.ack([b.entry_id], [(b.group.group_id, Outcome("dropped", 1, "stale"))]) == 1
    assert await restarted.ack([b.entry_id], [(b.group.group_id, Outcome("dropped", 1, "stale"))]) == 0
    assert await restarted.read(count=10, block_ms=0) == []
    outcomes = await seam.outcomes()
    assert {gid: (o.outcome, o.step, o.reason) for gid, o in outcomes.items()} == {
        a.group.group_id: ("trained", 0, ""),
        b.group.group_id: ("dropped", 1, "stale"),
    }


async def test_another_consumer_claims_what_a_silent_one_left_pending(seam: Seam) -> None:
    await seam.producer.send(group(0))
    silent, other = seam.source("learner-0"), seam.source("learner-1")
    (held,) = await silent.read(count=10)
    assert await other.claim_stale() == []  # not idle for claim_idle_ms yet
    await asyncio.sleep(0.15)
    claimed = await other.claim_stale()
    assert [(d.entry_id, d.delivery_count) for d in claimed] == [(held.entry_id, 2)]


async def test_a_drop_is_recorded_once_and_gives_capacity_back_once(seam: Seam) -> None:
    await admitted(seam, group(0), group(1))
    await seam.producer.send(group(2))  # produced outside admission control
    source = seam.source("learner-0")
    d0, d1, d2 = await source.read(count=10)
    first = await source.drop(d0, "stale", detail="staleness 3 > eta 1", admission=seam.counters)
    assert (first.first, first.gave_back) == (True, True)
    again = await source.drop(d0, "zero_signal", admission=seam.counters)  # a learner after a restart
    assert (again.record_id, again.first, again.gave_back) == (first.record_id, False, False)
    assert await source.recorded_drop(d0.group.group_id) == "stale"
    assert await source.recorded_drop(d1.group.group_id) is None
    assert (await source.drop(d1, "zero_signal", admission=seam.counters)).gave_back
    # The counters are global: with every admitted group dropped, nothing is left to give back.
    unadmitted = await source.drop(d2, "reward_error", admission=seam.counters)
    assert (unadmitted.first, unadmitted.gave_back) == (True, False)
    snap = await seam.counters.snapshot()
    assert (snap.accepted, snap.dropped) == (0, 2)
    with pytest.raises(ValueError, match="short code"):
        await source.drop(d2, "Too Old", admission=seam.counters)


async def test_the_intake_takes_the_same_steps_and_drops_on_both(seam: Seam) -> None:
    """Learner at version 3 with eta 1, arrival order: the version-1 group is stale, dropped, its capacity given
    back; the checkpoint's acknowledgement records every outcome."""
    await admitted(seam, *(group(i, version) for i, version in [(0, 2), (1, 1), (2, 3), (3, 2), (4, 3)]))
    config = LearnerConfig(groups_per_step=2, intake_order="arrival")
    intake = Intake(seam.source("learner-0"), seam.counters, config, 1, lambda: False)
    steps = []
    for step in (0, 1):
        intake.step = step
        batch = await intake.next_batch(3, max_wait_s=5)
        assert batch is not None
        steps.append([g.prompt_index for g in batch.groups])
    assert steps == [[0, 2], [3, 4]]
    assert intake.totals == {"trained": 4, "stale": 1}
    snap = await seam.counters.snapshot()
    assert (snap.accepted, snap.dropped) == (4, 1)
    assert await intake.acknowledge(intake.ledger) == 5
    outcomes = {
        o.entry_id and gid: (o.outcome, o.step, o.reason) for gid, o in (await seam.outcomes()).items()
    }
    assert (
        sorted(outcomes.values())
        == [("dropped", 0, "stale")] + [("trained", 0, "")] * 2 + [("trained", 1, "")] * 2
    )
