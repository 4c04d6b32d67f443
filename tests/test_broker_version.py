"""The policy version: monotonic, never reused, announced on the control stream and over pub/sub."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from broker.client import connect
from broker.config import BrokerConfig
from broker.version import CONTROL_MAXLEN, PolicyVersion, VersionError
from common.config import SharedConfig

SHARED = SharedConfig(run_id="v")
CFG = BrokerConfig(retry_attempts=3)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = connect(redis_url, CFG)
    yield c
    await c.aclose()


async def test_versions_are_monotonic_and_never_reused(client) -> None:
    pv = PolicyVersion(client, SHARED, CFG)
    assert await pv.get() is None
    for v in (0, 1, 5):
        assert (await pv.publish(v)).version == v
    for v in (5, 3, 0):
        with pytest.raises(VersionError, match=rf"version = {v}: not greater than the published version 5"):
            await pv.publish(v)
    # A learner resumed from an older checkpoint (a new process) cannot reuse a version either.
    resumed = PolicyVersion(client, SHARED, CFG)
    with pytest.raises(VersionError):
        await resumed.publish(4)
    assert (await resumed.publish(6)).version == 6
    assert await pv.get() == 6
    announced = await pv.announcements()
    assert [a.version for a in announced] == [0, 1, 5, 6]
    assert all(a.ts <= b.ts for a, b in zip(announced, announced[1:], strict=False))
    assert [a.version for a in await pv.announcements(after=announced[1].entry_id)] == [5, 6]
    with pytest.raises(VersionError, match="version = -1"):
        await pv.publish(-1)


async def test_concurrent_publishers_of_one_version_only_one_wins(client, redis_url) -> None:
    others = [connect(redis_url, CFG) for _ in range(4)]
    pvs = [PolicyVersion(c, SHARED, CFG) for c in others]
    results = await asyncio.gather(*(p.publish(3) for p in pvs), return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in results) == 1
    assert all(isinstance(r, VersionError) for r in results if isinstance(r, Exception))
    assert [a.version for a in await pvs[0].announcements()] == [3]
    for c in others:
        await c.aclose()


async def test_a_retried_publish_is_recognised_not_refused(client) -> None:
    # A lost reply cannot be produced on demand; replay the exact call a redis-py retry would repeat.
    pv = PolicyVersion(client, SHARED, CFG)
    keys = [pv.keys.version, pv.keys.version_token, pv.keys.control]
    token = uuid.uuid4().hex
    args = [7, token, pv.keys.control, CONTROL_MAXLEN]
    assert (await pv._publish(keys=keys, args=args))[0] == b"OK"
    assert (await pv._publish(keys=keys, args=args))[0] == b"SAME"
    assert (await pv._publish(keys=keys, args=[7, "another-token", pv.keys.control, CONTROL_MAXLEN]))[
        0
    ] == b"STALE"
    assert [a.version for a in await pv.announcements()] == [7]


async def test_wait_for_sees_a_publication_and_times_out(client, redis_url) -> None:
    learner = connect(redis_url, CFG)
    pv, publisher = PolicyVersion(client, SHARED, CFG), PolicyVersion(learner, SHARED, CFG)
    await publisher.publish(1)
    assert await pv.wait_for(1, timeout_s=1.0) == 1

    async def publish_later() -> None:
        await asyncio.sleep(0.05)
        await publisher.publish(2)
        await publisher.publish(3)

    task = asyncio.create_task(publish_later())
    assert await pv.wait_for(3, timeout_s=10.0) == 3
    await task
    with pytest.raises(TimeoutError, match="did not reach 9"):
        await pv.wait_for(9, timeout_s=0.2)
    await learner.aclose()


async def test_pubsub_announces_each_publication(client, redis_url) -> None:
    learner = connect(redis_url, CFG)
    publisher = PolicyVersion(learner, SHARED, CFG)
    got = []

    async def listen() -> None:
        async for a in PolicyVersion(client, SHARED, CFG).subscribe(timeout_s=2.0):
            got.append(a.version)
            if a.version == 12:
                return

    task = asyncio.create_task(listen())
    for _ in range(100):  # bounded: wait until the subscription is registered on the server
        if (await learner.pubsub_numsub(publisher.keys.control))[0][1]:
            break
        await asyncio.sleep(0.01)
    await publisher.publish(10)
    await publisher.publish(12)
    await asyncio.wait_for(task, 5.0)
    assert got == [10, 12]
    await learner.aclose()
