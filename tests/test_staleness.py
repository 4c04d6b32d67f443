"""The staleness rule: admission capacity by hand, in memory and on a real Redis, and the consumption filter."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
import torch

from broker.admission import RedisCounters
from broker.staleness import (
    CounterError,
    InMemoryCounters,
    StalenessManager,
    check_staleness,
    staleness,
    staleness_stats,
)
from common.config import SharedConfig
from common.versioning import Lineage, ResumePoint


async def _walk_capacity_by_hand(counters) -> None:
    # eta = 1, groups_per_step = 4, max_concurrent = 6
    # capacity = min(6 - running, (1 + 1) * 4 + consumed - (accepted + running))
    mgr = StalenessManager(eta=1, groups_per_step=4, max_concurrent=6, counters=counters)
    assert await mgr.capacity() == 6  # min(6 - 0, 8 - 0)
    await mgr.on_start(6)
    assert await mgr.capacity() == 0  # min(6 - 6, 8 - 6 = 2)
    await mgr.on_accept(4)
    assert await mgr.capacity() == 2  # running 2, accepted 4: min(6 - 2 = 4, 8 - 6 = 2)
    await mgr.on_start(2)
    assert await mgr.capacity() == 0  # running 4, accepted 4: min(2, 8 - 8 = 0): staleness-bound
    await mgr.on_consumed(4)  # the learner announced a version whose weights contain 4 groups
    assert await mgr.capacity() == 2  # min(6 - 4 = 2, 12 - 8 = 4): concurrency-bound
    await mgr.on_accept(4)
    assert await mgr.capacity() == 4  # running 0, accepted 8: min(6, 12 - 8 = 4)
    await mgr.on_consumed(12)
    assert await mgr.capacity() == 6  # min(6, 20 - 8 = 12)
    await mgr.on_consumed(4)  # a resumed learner states its checkpoint's count: the bound tightens again
    assert await mgr.capacity() == 4  # min(6, 12 - 8)
    snap = await counters.snapshot()
    assert (snap.running, snap.accepted, snap.started, snap.rejected, snap.dropped) == (0, 8, 8, 0, 0)
    assert snap.consumed == 4
    with pytest.raises(ValueError, match="consumed"):
        await mgr.on_consumed(-1)


async def test_capacity_by_hand_in_memory() -> None:
    await _walk_capacity_by_hand(InMemoryCounters())


async def test_capacity_by_hand_on_redis(redis_url: str) -> None:
    shared = SharedConfig(run_id="stale-test")
    client = aioredis.Redis.from_url(redis_url)
    try:
        await _walk_capacity_by_hand(RedisCounters(client, shared))
    finally:
        await client.aclose()
    # the counters live in the run's namespace, where every worker and the learner see them
    raw = redis.Redis.from_url(redis_url).hgetall("streamrl:stale-test:admission")
    assert {k.decode(): int(v) for k, v in raw.items()} == {
        "running": 0,
        "accepted": 8,
        "started": 8,
        "consumed": 4,
    }


async def test_eta_zero_is_synchronous_one_step_in_flight() -> None:
    # eta = 0, 4 groups per step, concurrency not binding: (0 + 1) * 4 + consumed - (accepted + running)
    mgr = StalenessManager(0, 4, 100, InMemoryCounters())
    started = [await mgr.try_start() for _ in range(10)]
    assert started.count(True) == 4  # exactly one step's worth in flight
    await mgr.on_accept(4)
    assert await mgr.capacity() == 0  # finished but not yet trained on: nothing new may start
    await mgr.on_consumed(4)  # version 1 announced, with the 4 groups in its weights
    assert await mgr.capacity() == 4  # 4 + 4 - 4


async def test_a_dropped_group_gives_its_capacity_back() -> None:
    # eta = 0, 2 groups per step: start 2, accept 2 -> capacity 0
    mgr = StalenessManager(0, 2, 10, InMemoryCounters())
    assert await mgr.try_start(2)
    await mgr.on_accept(2)
    assert await mgr.capacity() == 0
    await mgr.on_drop(1)  # the learner dropped one (stale / zero signal): it will consume a replacement
    assert await mgr.capacity() == 1  # 2 - (accepted 1 + running 0)
    assert await mgr.try_start(1)
    await mgr.on_reject(1)  # a started group that never reaches the stream (reward error)
    assert await mgr.capacity() == 1
    snap = await mgr.counters.snapshot()
    assert (snap.running, snap.accepted, snap.started, snap.rejected, snap.dropped) == (0, 1, 3, 1, 1)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_double_transitions_are_errors(backend: str, request: pytest.FixtureRequest) -> None:
    client = None
    if backend == "memory":
        counters = InMemoryCounters()
    else:
        client = aioredis.Redis.from_url(request.getfixturevalue("redis_url"))
        counters = RedisCounters(client, SharedConfig())
    try:
        mgr = StalenessManager(1, 2, 10, counters)
        await mgr.on_start(1)
        await mgr.on_accept(1)
        with pytest.raises(CounterError, match="running"):
            await mgr.on_accept(1)  # accepted twice
        with pytest.raises(CounterError, match="running"):
            await mgr.on_reject(1)
        await mgr.on_drop(1)
        with pytest.raises(CounterError, match="accepted"):
            await mgr.on_drop(1)  # dropped twice
        with pytest.raises(ValueError, match="group count"):
            await mgr.on_start(0)
        snap = await counters.snapshot()
        assert (snap.running, snap.accepted, snap.dropped) == (0, 0, 1)  # failed moves changed nothing
    finally:
        if client is not None:
            await client.aclose()


async def test_concurrent_workers_never_overshoot_on_redis(redis_url: str) -> None:
    # three workers with their own connections race 60 try_start calls against one global count:
    # capacity with nothing consumed, eta 2, 5 groups per step is (2 + 1) * 5 = 15 (concurrency 40 not binding)
    shared = SharedConfig(run_id="race")
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(3)]
    try:
        managers = [StalenessManager(2, 5, 40, RedisCounters(c, shared)) for c in clients]
        results = await asyncio.gather(*(managers[i % 3].try_start() for i in range(60)))
        assert sum(results) == 15
        assert await managers[0].capacity() == 0
        assert (await managers[1].counters.snapshot()).running == 15
    finally:
        for c in clients:
            await c.aclose()


def test_validation() -> None:
    with pytest.raises(ValueError, match="eta"):
        StalenessManager(-1, 3, 100, InMemoryCounters())
    with pytest.raises(ValueError, match="groups_per_step"):
        StalenessManager(0, 0, 100, InMemoryCounters())
    with pytest.raises(ValueError, match="max_concurrent"):
        StalenessManager(0, 3, 0, InMemoryCounters())


def test_consumption_filter() -> None:
    assert staleness(5, 3) == 2
    # learner at 5, eta 2: oldest token at 3 is 2 stale (kept); at 2 it is 3 stale (dropped)
    assert check_staleness(5, 2, 3).keep and check_staleness(5, 2, 3).staleness == 2
    dropped = check_staleness(5, 2, 2)
    assert (dropped.keep, dropped.reason, dropped.staleness) == (False, "stale", 3)
    # eta 0: only tokens of the learner's own version
    assert check_staleness(4, 0, 4).keep and check_staleness(4, 0, 3).reason == "stale"
    future = check_staleness(5, 2, 6)
    assert (future.keep, future.reason, future.staleness) == (False, "future_version", -1)
    with pytest.raises(ValueError, match="eta"):
        check_staleness(5, -1, 5)


def test_staleness_stats_by_hand() -> None:
    # learner 5; token versions [5, 5, 4], [3], [5] -> staleness [0, 0, 1, 2, 0]
    # min 0, max 2, mean 3 / 5 = 0.6, histogram {0: 3, 1: 1, 2: 1}
    for versions in (
        [[5, 5, 4], [3], [5]],
        [np.array([5, 5, 4]), np.array([3]), np.array([5])],
        [torch.tensor([5, 5, 4]), torch.tensor([3]), torch.tensor(5)],
        [5, 5, 4, 3, 5],
    ):
        stats = staleness_stats(5, versions)
        assert (stats.count, stats.min, stats.max) == (5, 0, 2)
        assert stats.mean == pytest.approx(0.6)
        assert stats.histogram == {0: 3, 1: 1, 2: 1}
    metrics = stats.as_metrics()
    assert metrics["staleness/mean"] == pytest.approx(0.6) and metrics["staleness/hist/2"] == 1
    empty = staleness_stats(5, [])
    assert (empty.count, empty.min, empty.max, empty.mean, empty.histogram) == (0, 0, 0, 0.0, {})


def test_lineage_positions_after_a_crash_and_after_a_clean_stop() -> None:
    # A run trains to version 13, crashes, and resumes from its checkpoint of version 10 as version 14:
    # 14 holds the weights of 10 (position 10), and 3 positions (11..13) were lost with the crash.
    crashed = Lineage().resumed(version=14, restored=10, published=13)
    assert crashed.points == (ResumePoint(14, 10, 3),)
    assert [crashed.position(v) for v in (9, 10, 12, 13, 14, 16)] == [9, 10, 12, 13, 10, 12]
    # learner at 14 (position 10): a group of version 12 from the lost branch is 2 positions ahead of it
    assert crashed.distance(14, 12) == -2 and crashed.distance(14, 9) == 1 and crashed.distance(16, 14) == 2
    # pre-resume tokens may be eta + 3 away, in either direction; post-resume tokens eta
    assert crashed.allowance(14, 13) == 3 and crashed.allowance(16, 14) == 0
    assert check_staleness(14, 1, [12, 13], crashed).keep  # -2, -3: within 1 + 3
    # learner at 17 = position 13: version 10's tokens are 3 behind (allowed 1 + 3), version 8's are 5 behind
    assert check_staleness(17, 1, [10], crashed).keep
    assert check_staleness(17, 1, [8], crashed).reason == "stale"
    assert (
        check_staleness(16, 1, [14], crashed).staleness == 2
        and not check_staleness(16, 1, [14], crashed).keep
    )
    # without the lineage the same resume made every group of version 12 stale at eta 1 (14 - 12 = 2)
    assert check_staleness(14, 1, 12).reason == "stale"

    # A clean stop at version 20 (its last checkpoint is version 20) resumed as 21: nothing rolled back, and
    # the groups waiting in the stream are exactly as stale as they were.
    clean = crashed.resumed(version=21, restored=20, published=20)
    assert clean.points[-1] == ResumePoint(21, 16, 0)  # version 20 sat at position 16 (14 -> 10, +6)
    assert clean.distance(21, 19) == 1 and clean.distance(21, 20) == 0
    assert (
        check_staleness(21, 1, [19, 20], clean).keep and check_staleness(21, 1, [18], clean).reason == "stale"
    )
    # a version that no resume touched: position = version, distance = learner - token, as before
    assert Lineage().distance(7, 5) == 2 and check_staleness(7, 2, [5, 6, 7], Lineage()).staleness == 2
    # the staleness metrics measure the same distance, as a magnitude
    stats = staleness_stats(14, [[12, 13, 14]], crashed)
    assert stats.histogram == {2: 1, 3: 1, 0: 1}
