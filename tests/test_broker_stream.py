"""Producer and consumer against a real Redis: idempotence, consumer groups, acknowledgement and the backlog
counter, duplicates, dead letters, drops, trimming, recovery of own pending entries, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgpack
import numpy as np
import pytest
import redis.asyncio as aioredis

from broker.admission import RedisCounters
from broker.client import BrokerKeys, connect
from broker.codec import SAMPLE_KEYS, encode
from broker.config import BrokerConfig
from broker.consumer import Consumer, DropRecord, dead_letters, dropped
from broker.metrics import BrokerMetrics, MetricsReader, MetricsWriter
from broker.producer import Producer
from broker.record import synthetic_group
from common.config import SharedConfig

SHARED = SharedConfig(run_id="t")


@pytest.fixture
def cfg() -> BrokerConfig:
    return BrokerConfig(block_ms=20, read_count=8, claim_idle_ms=50, max_deliveries=3, retry_attempts=3)


@pytest.fixture
async def client(redis_url: str, cfg: BrokerConfig) -> AsyncIterator[aioredis.Redis]:
    c = connect(redis_url, cfg)
    yield c
    await c.aclose()


def group(i: int, tokens: int = 16, version: int = 0, attempt: int = 0):
    return synthetic_group(
        np.random.default_rng(i),
        prompt_index=i,
        num_samples=2,
        num_tokens=tokens,
        version=version,
        attempt=attempt,
    )


async def drain(consumer: Consumer, rounds: int = 50) -> list:
    """Read until a read returns nothing twice in a row (bounded)."""
    out, empty = [], 0
    for _ in range(rounds):
        got = await consumer.read()
        out += got
        empty = 0 if got else empty + 1
        if empty == 2:
            break
    return out


async def backlog(client: aioredis.Redis, cfg: BrokerConfig) -> int:
    return int(await client.get(BrokerKeys.of(SHARED, cfg).backlog) or 0)


async def test_send_is_idempotent_by_group_id(client, cfg) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    first = await producer.send(group(1))
    again = await producer.send(group(1))  # e.g. a worker retrying after a lost reply
    other = await producer.send(group(1, attempt=1))  # a new attempt is a new group
    assert again == first != other
    assert await client.xlen(SHARED.key(cfg.stream)) == 2
    assert (producer.sent, producer.resent) == (2, 1)
    assert await backlog(client, cfg) == 2


async def test_round_trip_and_ack_moves_backlog(client, cfg) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    consumer = Consumer(client, SHARED, cfg, "c0")
    sent = {i: group(i, tokens=1024) for i in range(5)}
    ids = {await producer.send(g): i for i, g in sent.items()}
    got = await drain(consumer)
    assert [ids[d.entry_id] for d in got] == list(range(5))
    assert all(d.group == sent[ids[d.entry_id]] and d.delivery_count == 1 for d in got)
    assert await backlog(client, cfg) == 5 and consumer.outstanding == 5
    assert await consumer.ack(got[:2]) == 2
    assert await consumer.ack([got[0].entry_id]) == 0  # a repeated ack changes nothing
    assert await backlog(client, cfg) == 3
    assert await consumer.ack(got) == 3
    assert await backlog(client, cfg) == 0 and consumer.outstanding == 0
    info = (await client.xinfo_groups(SHARED.key(cfg.stream)))[0]
    assert info["pending"] == 0 and info["lag"] == 0


async def test_two_consumers_share_a_group_each_entry_once(client, cfg, redis_url) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    ids = [await producer.send(group(i)) for i in range(40)]
    other = connect(redis_url, cfg)
    a, b = Consumer(client, SHARED, cfg, "a"), Consumer(other, SHARED, cfg, "b")
    got_a, got_b = [], []
    for _ in range(20):
        got_a += await a.read(count=3)
        got_b += await b.read(count=3)
        if len(got_a) + len(got_b) >= 40:
            break
    ids_a, ids_b = {d.entry_id for d in got_a}, {d.entry_id for d in got_b}
    assert ids_a and ids_b and not ids_a & ids_b
    assert sorted(ids_a | ids_b) == sorted(ids) and len(got_a) + len(got_b) == 40
    # A second consumer group is independent: it sees every entry, and does not touch the learner's backlog.
    monitor = Consumer(other, SHARED, cfg, "m", consumer_group="monitor")
    seen = await drain(monitor)
    assert sorted(d.entry_id for d in seen) == sorted(ids)
    await monitor.ack(seen)
    assert await backlog(client, cfg) == 40
    await a.ack(got_a)
    await b.ack(got_b)
    assert await backlog(client, cfg) == 0
    await other.aclose()


async def test_malformed_entries_are_dead_lettered_while_good_ones_flow(client, cfg) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    consumer = Consumer(client, SHARED, cfg, "c0")
    await consumer.ensure_group()
    stream = SHARED.key(cfg.stream)

    def corrupt(g, mutate) -> bytes:
        m = msgpack.unpackb(encode(g), raw=False)
        mutate(m)
        return msgpack.packb(m, use_bin_type=True)

    nan = group(101)
    nan.samples[1].logprobs = nan.samples[1].logprobs.copy()
    nan.samples[1].logprobs[5] = np.nan
    unequal = group(102)
    unequal.samples[0].versions = unequal.samples[0].versions[:-3]
    bad = {
        "random bytes": (
            {"v": 1, "gid": "x", "d": np.random.default_rng(0).bytes(300)},
            "decode",
            "<payload>",
        ),
        "schema version field": (
            {"v": 3, "gid": group(103).group_id, "d": encode(group(103))},
            "schema_version",
            "v = 3",
        ),
        "schema version mismatch": (
            {"v": 2, "gid": group(108).group_id, "d": encode(group(108))},
            "schema_version",
            "v = 2 differs from the payload's 1",
        ),
        "schema version inside": (
            {"v": 1, "gid": group(104).group_id, "d": corrupt(group(104), lambda m: m.update(sv=9))},
            "schema_version",
            "schema_version = 9",
        ),
        "nan logprobs": (
            {"v": 1, "gid": nan.group_id, "d": encode(nan, validate=False)},
            "invalid",
            "samples[1].logprobs[5] = nan",
        ),
        "unequal arrays": (
            {"v": 1, "gid": unequal.group_id, "d": encode(unequal, validate=False)},
            "invalid",
            "samples[0].versions = 'length 13'",
        ),
        "missing payload field": (
            {
                "v": 1,
                "gid": group(105).group_id,
                "d": corrupt(group(105), lambda m: m["s"][0].pop(SAMPLE_KEYS["reward"])),
            },
            "missing_field",
            "samples[0].reward = None: missing",
        ),
        "missing entry field": ({"v": 1, "gid": group(106).group_id}, "missing_field", "['d'] missing"),
        "missing payload key": (
            {"v": 1, "gid": group(107).group_id, "n": "ten", "ref": SHARED.key("nowhere")},
            "missing_payload",
            "does not exist",
        ),
    }
    good_ids, bad_ids = [], {}
    for i, (name, (fields, _, _)) in enumerate(bad.items()):
        good_ids.append(await producer.send(group(i)))
        bad_ids[_text(await client.xadd(stream, fields))] = name
    good_ids.append(await producer.send(group(99)))

    got = await drain(consumer)
    assert [d.entry_id for d in got] == good_ids
    letters = {d["entry_id"].decode(): d for d in await dead_letters(client, SHARED, cfg)}
    assert set(letters) == set(bad_ids)
    for entry_id, name in bad_ids.items():
        _, reason, needle = bad[name]
        assert letters[entry_id]["reason"].decode() == reason, name
        assert needle in letters[entry_id]["error"].decode(), (name, letters[entry_id]["error"])
    assert letters[next(iter(bad_ids))]["raw:d"] == bad["random bytes"][0]["d"]  # raw fields kept
    # Dead letters are acknowledged; raw XADDs never entered the backlog counter, so it counts only good ones.
    assert (await client.xpending(stream, cfg.consumer_group))["pending"] == len(good_ids)
    assert await backlog(client, cfg) == len(good_ids)
    snap = await BrokerMetrics(client, SHARED, cfg).snapshot()
    assert snap["counters"]["dead_lettered"] == len(bad)
    assert snap["dead_lettered_by_reason"] == {
        "decode": 1,
        "schema_version": 3,
        "invalid": 2,
        "missing_field": 2,
        "missing_payload": 1,
    }


async def test_duplicate_group_ids_are_acknowledged_not_delivered(client, cfg) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    consumer = Consumer(client, SHARED, cfg, "c0")
    await consumer.ensure_group()
    stream = SHARED.key(cfg.stream)
    g = group(7)
    first = await producer.send(g)
    raw = {"v": 1, "gid": g.group_id, "d": encode(g)}
    await client.xadd(stream, raw)  # a copy that bypassed the idempotent producer, while the first is held
    got = await drain(consumer)
    assert [d.entry_id for d in got] == [first]
    assert await consumer.is_duplicate(g.group_id)
    await consumer.ack(got)
    await client.xadd(stream, raw)  # and one after the first was acknowledged
    assert await drain(consumer) == []
    assert await consumer.is_duplicate(g.group_id) and not await consumer.is_duplicate("nope")
    assert (await client.xpending(stream, cfg.consumer_group))["pending"] == 0
    snap = await BrokerMetrics(client, SHARED, cfg).snapshot()
    assert snap["counters"]["duplicates"] == 2 and snap["counters"]["acknowledged"] == 1
    assert snap["backlog"] == 0


async def test_redelivered_too_often_goes_to_dead_letters(client, cfg, redis_url) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    poison = await producer.send(group(1))
    # Each consumer process "crashes" (is dropped without acking); the next one reclaims the entry.
    seen = []
    for k in range(cfg.max_deliveries + 1):
        c = Consumer(client, SHARED, cfg, f"c{k}")
        got = await c.read() if k == 0 else await _claim(c)
        seen += [d.delivery_count for d in got]
    assert seen == [1, 2, 3]  # the fourth delivery exceeds max_deliveries = 3
    letters = await dead_letters(client, SHARED, cfg)
    assert [(d["entry_id"].decode(), d["reason"].decode()) for d in letters] == [(poison, "max_deliveries")]
    assert await backlog(client, cfg) == 0


async def _claim(c: Consumer, attempts: int = 200) -> list:
    for _ in range(attempts):  # bounded: claim_idle_ms is 50 ms in these tests
        await asyncio.sleep(0.02)
        got = await c.claim_stale()
        if got or await c.client.xlen(c.keys.dead_letter):
            return got
    raise AssertionError("nothing became claimable")


async def test_restarted_consumer_gets_its_unacked_entries_back(client, cfg) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    ids = [await producer.send(group(i)) for i in range(4)]
    first = Consumer(client, SHARED, cfg, "learner-0")
    got = await first.read(count=3)
    await first.ack(got[:1])
    # A new process under the same name (the learner resumed): the two unacked come back, then the new one.
    second = Consumer(client, SHARED, cfg, "learner-0")
    again = await second.read()
    assert [d.entry_id for d in again] == ids[1:3]
    assert [d.delivery_count for d in again] == [2, 2]
    assert [d.entry_id for d in await second.read()] == ids[3:]
    assert await second.read() == []


async def test_trim_never_drops_unacknowledged_entries(client, cfg, redis_url) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    consumer = Consumer(client, SHARED, cfg, "c0")
    ids = [await producer.send(group(i)) for i in range(10)]
    got = await consumer.read(count=6)
    await consumer.ack([got[0], got[1], got[3]])  # 2 stays pending
    assert await consumer.trim() == 2  # only ids[0], ids[1]: everything from the oldest pending on stays
    left = [i.decode() for i, _ in await client.xrange(SHARED.key(cfg.stream))]
    assert left == ids[2:]
    # A second group that has read nothing pins the whole stream.
    other = Consumer(client, SHARED, cfg, "m", consumer_group="monitor")
    await other.ensure_group()
    await consumer.ack(got)
    assert await consumer.trim() == 0
    await other.ack(await drain(other))
    # Now the learner group still has 4 undelivered entries: they stay.
    assert await consumer.trim() == 4
    assert [i.decode() for i, _ in await client.xrange(SHARED.key(cfg.stream))] == ids[6:]
    await consumer.ack(await drain(consumer))
    assert await consumer.trim() == 4 and await client.xlen(SHARED.key(cfg.stream)) == 0


async def test_drop_is_durable_and_once_per_group(client, cfg) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    consumer = Consumer(client, SHARED, cfg, "c0")
    await producer.send(group(3, version=1))
    (d,) = await consumer.read()
    counters = RedisCounters(client, SHARED)
    await counters.start(1)
    await counters.accept(1)  # admitted through the fleet's admission control
    first = await consumer.drop(d, "stale", detail="staleness 5 > eta 2", admission=counters.key)
    assert first.first and first.gave_back
    again = await consumer.drop(d, "zero_signal", admission=counters.key)  # a learner after a restart
    assert again == DropRecord(first.record_id, first=False, gave_back=False)
    snapshot = await counters.snapshot()
    assert (snapshot.accepted, snapshot.dropped) == (0, 1)  # the capacity came back once
    assert await consumer.recorded_drop(d.group.group_id) == "stale"
    assert await consumer.recorded_drop("never-dropped") is None
    rows = await dropped(client, SHARED, cfg)
    assert len(rows) == 1
    assert rows[0]["gid"] == d.group.group_id and rows[0]["reason"] == "stale"
    assert (
        rows[0]["entry_id"] == d.entry_id and rows[0]["num_tokens"] == "32" and rows[0]["min_version"] == "1"
    )
    assert consumer.outstanding == 1  # still to be acknowledged with the next checkpoint
    with pytest.raises(ValueError, match="reason = 'Too Old'"):
        await consumer.drop(d, "Too Old")
    snap = await BrokerMetrics(client, SHARED, cfg).snapshot()
    assert snap["dropped_by_reason"] == {"stale": 1}


async def test_metrics_snapshot_and_metrics_streams(client, cfg) -> None:
    producer = Producer(client, SHARED, cfg, "worker-1")
    consumer = Consumer(client, SHARED, cfg, "c0")
    payload_bytes = 0
    for i in range(6):
        g = group(i)
        payload_bytes += len(encode(g))
        await producer.send(g)
    got = await consumer.read(count=4)
    await consumer.ack(got[:3])
    snap = await BrokerMetrics(client, SHARED, cfg).snapshot()
    c = snap["counters"]
    assert (c["produced"], c["consumed"], c["acknowledged"]) == (6, 4, 3)
    assert c["produced_bytes"] == payload_bytes
    assert snap["backlog"] == 3 and snap["stream_length"] == 6
    assert snap["groups"][cfg.consumer_group] | {"last_delivered_id": None} == {
        "lag": 2,
        "pending": 1,
        "consumers": 1,
        "last_delivered_id": None,
    }
    p = snap["producers"]["worker-1"]
    assert (
        p["produced"] == 6 and p["bytes"] == payload_bytes and p["entries_per_s"] > 0 and p["waiting"] == ""
    )

    writer = MetricsWriter(client, SHARED, "learner", maxlen=50)
    for step in range(300):
        await writer.write({"step": step, "loss": 0.5 / (step + 1)}, ts=1000.0 + step)
    reader = MetricsReader(client, SHARED)
    rows = await reader.read("learner")
    assert 50 <= len(rows) < 300  # approximate trimming of metrics streams
    assert rows[-1][1] == {"ts": 1299.0, "step": 299, "loss": 0.5 / 300}
    assert (await reader.latest("learner"))["step"] == 299
    assert await reader.latest("nobody") is None
    with pytest.raises(ValueError, match=r"metrics\['loss'\] = 'x'"):
        await writer.write({"loss": "x"})


def _text(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


async def payload_keys(client: aioredis.Redis, cfg: BrokerConfig) -> list[str]:
    prefix = BrokerKeys.of(SHARED, cfg).payload_prefix
    return sorted([k.decode() async for k in client.scan_iter(match=prefix + "*")])


@pytest.mark.parametrize("num_tokens", [1024, 8192])
async def test_large_groups_travel_by_reference_and_leave_nothing_behind(client, cfg, num_tokens) -> None:
    producer = Producer(client, SHARED, cfg, "p0")
    consumer = Consumer(client, SHARED, cfg, "c0")
    big = synthetic_group(
        np.random.default_rng(num_tokens), prompt_index=1, num_samples=8, num_tokens=num_tokens
    )
    size = len(encode(big))
    assert size > cfg.inline_max_bytes
    await producer.send(group(0))
    await client.script_flush()  # what a restarted server looks like: scripts are loaded again on NOSCRIPT
    entry_id = await producer.send(big)
    assert await producer.send(big) == entry_id  # a resend stores nothing extra
    await consumer.ack(await consumer.read(count=1))
    ((_, fields),) = await client.xrange(SHARED.key(cfg.stream), min=entry_id)
    assert set(fields) == {b"v", b"gid", b"n", b"ref"} and int(fields[b"n"]) == size
    (key,) = await payload_keys(client, cfg)
    assert fields[b"ref"].decode() == key and await client.ttl(key) == -1  # permanent once referenced
    (d,) = await consumer.read()
    assert d.group == big and d.nbytes == size
    assert await consumer.ack([d]) == 1
    assert await payload_keys(client, cfg) == []
    snap = await BrokerMetrics(client, SHARED, cfg).snapshot()
    assert (
        snap["counters"]["produced_bytes"]
        == snap["counters"]["consumed_bytes"]
        == size + len(encode(group(0)))
    )
