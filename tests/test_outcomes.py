"""Every group's durable outcome and the audit over them, against a real Redis and the real producer, consumer
and prompt dispatch: trained and dropped groups get their outcome when they are acknowledged (after the
checkpoint), a dead letter and a rollout drop get theirs when they happen, a retried acknowledgement changes
nothing, a group trained at two steps is counted as trained twice, and a group that vanishes is counted lost."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from broker.admission import RedisCounters
from broker.client import BrokerKeys, connect
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.outcomes import Outcome, audit, format_audit, read_outcomes
from broker.producer import Producer
from broker.record import synthetic_group
from broker.staleness import StalenessManager
from common.config import SharedConfig
from rollout_fleet.dispatch import PromptDispatcher

SHARED = SharedConfig(run_id="audit")
CFG = BrokerConfig(block_ms=20, read_count=16, max_deliveries=1, retry_attempts=3)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = connect(redis_url, CFG)
    yield c
    await c.aclose()


def group(i: int):
    # epoch 3: never the same group id as the dispatch's prompts of epoch 0 below
    return synthetic_group(
        np.random.default_rng(i), run_id=SHARED.run_id, prompt_index=i, num_samples=2, epoch=3
    )


def trained(step: int) -> Outcome:
    return Outcome("trained", step, learner_version=step - 1)


async def test_the_audit_accounts_for_every_group(client: aioredis.Redis) -> None:
    keys = BrokerKeys.of(SHARED, CFG)
    producer = Producer(client, SHARED, CFG, "p0")
    groups = [group(i) for i in range(6)]
    for g in groups:
        await producer.send(g)
    learner = Consumer(client, SHARED, CFG, "learner-0")
    got = await learner.read(count=5)
    assert len(got) == 5

    # groups 0-2 trained at step 1, group 3 dropped as stale: acknowledged with the checkpoint that holds them
    await learner.drop(got[3], "stale")
    outcomes = [(d.group.group_id, trained(1)) for d in got[:3]]
    outcomes.append((got[3].group.group_id, Outcome("dropped", 1, "stale")))
    assert await learner.ack(got[:4], outcomes) == 4
    assert await learner.ack(got[:4], outcomes) == 0  # retried: nothing new

    # group 4 is read again by a restarted learner: delivered twice > max_deliveries 1, so dead-lettered; the
    # restarted learner then reads group 5, which stays pending (not trained yet)
    restarted = Consumer(client, SHARED, CFG, "learner-0")
    assert [d.group.prompt_index for d in await restarted.read()] == [5]

    # a rollout worker gives one more prompt up before it ever reaches the stream
    admission = StalenessManager(1, 4, 100, RedisCounters(client, SHARED))
    dispatch = PromptDispatcher(client, SHARED, CFG, admission, num_prompts=50, worker_id="w0", task="t")
    lease = (await dispatch.lease()).lease
    assert lease is not None
    assert await dispatch.complete(lease, "dropped", reason="engine_failures") == "OK"

    report = await audit(client, SHARED, CFG)
    assert (report.generated, report.trained, report.dropped, report.dead_lettered) == (7, 3, 2, 1)
    assert report.dropped_by_reason == {"engine_failures": 1, "stale": 1}
    assert (report.pending, report.trained_twice, report.lost, report.ok) == (1, 0, 0, True)
    recorded = await read_outcomes(client, keys)
    assert recorded[groups[4].group_id].outcome == "dead_lettered"
    assert recorded[groups[4].group_id].reason == "max_deliveries"
    assert recorded[lease.group_id(SHARED.run_id)].source == "rollout"
    assert "lost           0" in format_audit(report) and "OK" in format_audit(report)

    # group 0 trained again at step 2 (what exactly-once forbids): the audit says so
    await restarted.ack([got[0].entry_id], [(groups[0].group_id, trained(2))])
    # group 5's entry vanishes from the stream with no outcome (what a MAXLEN trim would do)
    pending = await client.xrange(keys.stream)
    (entry_id, _) = next((i, f) for i, f in pending if f[b"gid"] == groups[5].group_id.encode())
    await client.xdel(keys.stream, entry_id)
    report = await audit(client, SHARED, CFG)
    assert (report.trained_twice, report.lost, report.lost_ids, report.ok) == (
        1,
        1,
        [groups[5].group_id],
        False,
    )
    assert "NOT OK" in format_audit(report)
