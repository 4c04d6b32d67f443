"""Back-pressure: several concurrent producers and a slow consumer; the backlog (XINFO lag + pending) never
exceeds max_backlog, waiting producers show why in the metrics, and nothing accepted is lost or doubled."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from redis.exceptions import ResponseError

from broker.client import BrokerKeys, connect
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.metrics import BrokerMetrics
from broker.outcomes import Outcome, read_outcomes
from broker.producer import BackpressureTimeout, Producer
from broker.record import synthetic_group
from common.config import SharedConfig

SHARED = SharedConfig(run_id="bp")
PRODUCERS, PER_PRODUCER, BOUND = 4, 15, 8


def group(i: int):
    return synthetic_group(np.random.default_rng(i), prompt_index=i, num_samples=2, num_tokens=8)


async def lag_plus_pending(client, stream: str, group_name: str) -> int:
    info = (await client.xinfo_groups(stream))[0]
    return info["lag"] + info["pending"]


async def test_backlog_stays_under_bound_with_concurrent_producers(redis_url: str) -> None:
    cfg = BrokerConfig(max_backlog=BOUND, backpressure_poll_s=0.01, block_ms=10, retry_attempts=3)
    keys = BrokerKeys.of(SHARED, cfg)
    clients = [connect(redis_url, cfg) for _ in range(PRODUCERS + 1)]
    reader = clients[-1]
    consumer = Consumer(reader, SHARED, cfg, "slow")
    await consumer.ensure_group()
    producers = [Producer(clients[k], SHARED, cfg, f"w{k}") for k in range(PRODUCERS)]
    sent: dict[str, str] = {}

    async def produce(k: int) -> None:
        for j in range(PER_PRODUCER):
            g = group(k * 100 + j)
            sent[g.group_id] = await producers[k].send(g)

    tasks = [asyncio.create_task(produce(k)) for k in range(PRODUCERS)]
    metrics = BrokerMetrics(reader, SHARED, cfg)
    # Before anything is consumed, all producers end up waiting with exactly BOUND entries in the stream.
    for _ in range(500):
        snap = await metrics.snapshot()
        waiting = [p.get("waiting") for p in snap["producers"].values()]
        if waiting.count("backpressure") == PRODUCERS:
            break
        await asyncio.sleep(0.01)
    assert waiting == ["backpressure"] * PRODUCERS, snap["producers"]
    assert snap["backlog"] == BOUND and await reader.xlen(keys.stream) == BOUND
    assert await lag_plus_pending(reader, keys.stream, cfg.consumer_group) == BOUND

    delivered: list[str] = []
    worst = 0
    held = []
    while len(delivered) < PRODUCERS * PER_PRODUCER:
        got = await consumer.read(count=1)
        delivered += [d.group.group_id for d in got]
        held += got
        if len(held) >= 3:  # acknowledge in small batches, as a learner does at checkpoints
            await consumer.ack(held)
            held = []
        backlog_now = await lag_plus_pending(reader, keys.stream, cfg.consumer_group)
        worst = max(worst, backlog_now, int(await reader.get(keys.backlog)))
        assert worst <= BOUND
        if not got and all(t.done() for t in tasks):
            await consumer.ack(held)
            held = []
    await asyncio.gather(*tasks)
    await consumer.ack(held)

    assert len(delivered) == len(set(delivered)) == PRODUCERS * PER_PRODUCER
    assert set(delivered) == set(sent)
    snap = await metrics.snapshot()
    assert snap["backlog"] == 0
    for k, p in enumerate(producers):
        stats = snap["producers"][f"w{k}"]
        assert p.waits >= 1 and stats["waits"] == p.waits and stats["wait_s"] > 0
        assert stats["waiting"] == "" and stats["produced"] == PER_PRODUCER
    assert snap["counters"]["backpressure_waits"] == sum(p.waits for p in producers)
    for c in clients:
        await c.aclose()


async def test_backpressure_timeout_adds_nothing_and_leaves_no_payload(redis_url: str) -> None:
    cfg = BrokerConfig(
        max_backlog=2,
        backpressure_poll_s=0.01,
        backpressure_timeout_s=0.3,
        inline_max_bytes=100,
        retry_attempts=3,
    )
    client = connect(redis_url, cfg)
    producer = Producer(client, SHARED, cfg, "w0")
    await producer.send(group(1))
    await producer.send(group(2))
    keys = BrokerKeys.of(SHARED, cfg)

    async def stored() -> list[bytes]:
        return [k async for k in client.scan_iter(match=keys.payload_prefix + "*")]

    task = asyncio.create_task(producer.send(group(3)))
    for _ in range(100):  # bounded: until the third send is waiting
        await asyncio.sleep(0.01)
        if producer.waits:
            break
    # While it waits its payload is stored, expiring unless the entry gets added.
    pending = [k for k in await stored() if b"p3:" in k]
    assert len(pending) == 1 and 0 < await client.ttl(pending[0]) <= cfg.payload_ttl_s
    try:
        await task
        raise AssertionError("send should have timed out")
    except BackpressureTimeout as exc:
        assert "max_backlog = 2" in str(exc)
    assert await client.xlen(keys.stream) == 2
    assert len(await stored()) == 2  # the two added entries' payloads; the refused one's is gone
    snap = await BrokerMetrics(client, SHARED, cfg).snapshot()
    assert snap["producers"]["w0"]["waiting"] == "" and snap["producers"]["w0"]["waits"] == 1
    await client.aclose()


async def test_a_redis_at_its_maxmemory_is_waited_out_not_an_error(redis_url: str) -> None:
    """The server refuses writes at its maxmemory (noeviction): a send waits (inline and by reference) instead of
    failing, adds its group once memory is back, and gives up only after backpressure_timeout_s, adding nothing."""
    # the small group (814 bytes) goes inline, the large one (8,366 bytes) by reference
    cfg = BrokerConfig(backpressure_poll_s=0.02, backpressure_timeout_s=30.0, inline_max_bytes=4096)
    client = connect(redis_url, cfg)
    configured = (await client.config_get("maxmemory"))["maxmemory"]
    keys = BrokerKeys.of(SHARED, cfg)
    consumer = Consumer(client, SHARED, cfg, "c")
    await consumer.ensure_group()
    await Producer(client, SHARED, cfg, "early").send(group(899))
    [delivery] = await consumer.read(count=1, block_ms=10)
    for i in range(32):  # 2 MB of other data, then a maxmemory below what the server holds: it is full
        await client.set(f"fill:{i}", b"x" * 65536)
    used = int((await client.info("memory"))["used_memory"])
    await client.config_set("maxmemory", used - (1 << 20))
    try:
        with pytest.raises(ResponseError, match="maxmemory"):
            await client.set("one:more", b"x")
        # the learner's acknowledgement (with its outcome) still goes through: it is what frees memory
        outcome = Outcome("trained", step=1, learner_version=1, entry_id=delivery.entry_id)
        assert await consumer.ack([delivery.entry_id], [(delivery.group.group_id, outcome)]) == 1
        assert (await read_outcomes(client, keys))[delivery.group.group_id].outcome == "trained"
        assert (
            await consumer.trim() == 1
        )  # and so does the trim that follows it (the entry leaves the stream)
        producer = Producer(client, SHARED, cfg, "full")
        small, large = group(900), synthetic_group(np.random.default_rng(1), prompt_index=901, num_tokens=64)
        sends = [asyncio.create_task(producer.send(g)) for g in (small, large)]
        while producer.full_waits < 2:
            assert not any(t.done() for t in sends), [t.exception() for t in sends if t.done()]
            await asyncio.sleep(0.02)
        assert await client.xlen(keys.stream) == 0
        await client.delete(*[f"fill:{i}" for i in range(32)])  # memory back: both go in, once each
        ids = await asyncio.gather(*sends)
        assert len(set(ids)) == 2 and await client.xlen(keys.stream) == 2
        # a server that stays full: the send gives up after its timeout, naming maxmemory, having added nothing
        await client.config_set("maxmemory", int((await client.info("memory"))["used_memory"]) // 2)
        impatient = Producer(client, SHARED, cfg.model_copy(update={"backpressure_timeout_s": 0.3}), "late")
        with pytest.raises(BackpressureTimeout, match="maxmemory"):
            await impatient.send(group(902))
        assert await client.xlen(keys.stream) == 2
    finally:
        await client.config_set("maxmemory", configured)
        await client.aclose()


async def test_a_payload_that_expires_during_a_wait_is_stored_again(redis_url: str) -> None:
    """A by-reference send whose stored payload expires between two polls (each WAIT renews its ttl; a poll
    interval past the ttl lets it lapse): the script answers NOPAYLOAD, the producer stores it again and the
    group is added whole once the backlog has room."""
    cfg = BrokerConfig(max_backlog=1, backpressure_poll_s=1.5, inline_max_bytes=256, payload_ttl_s=1)
    client = connect(redis_url, cfg)
    keys = BrokerKeys.of(SharedConfig(run_id="ttl"), cfg)
    consumer = Consumer(client, SharedConfig(run_id="ttl"), cfg, "c")
    await consumer.ensure_group()
    producer = Producer(client, SharedConfig(run_id="ttl"), cfg, "w0")
    await producer.send(group(11))
    late = group(12)
    task = asyncio.create_task(producer.send(late))
    while not producer.waits:
        await asyncio.sleep(0.01)
    await asyncio.sleep(2.0)  # past the payload's ttl while the backlog is full: at least one NOPAYLOAD
    assert not task.done()
    [first] = await consumer.read(count=1, block_ms=10)
    await consumer.ack([first.entry_id])
    entry_id = await asyncio.wait_for(task, 30)
    [second] = await consumer.read(count=1, block_ms=1000)
    assert second.entry_id == entry_id and second.group.group_id == late.group_id
    assert [s.output_ids.tolist() for s in second.group.samples] == [
        s.output_ids.tolist() for s in late.samples
    ]
    assert await client.xlen(keys.stream) == 2
    await client.aclose()
