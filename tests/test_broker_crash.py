"""Crashes for real: a consumer process killed with SIGKILL between reading and acknowledging, and kill -9 of the
Redis server while producers and a consumer run, then a restart on the same AOF."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

from broker.client import BrokerKeys, connect, connection_stats
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.producer import Producer
from broker.record import synthetic_group
from broker.server import EmbeddedRedis
from common.config import SharedConfig

SHARED = SharedConfig(run_id="crash")
ROOT = Path(__file__).resolve().parents[1]

VICTIM = """
import asyncio, json, sys, time
from broker.client import connect
from broker.config import BrokerConfig
from common.config import SharedConfig
from broker.consumer import Consumer

async def main() -> None:
    cfg = BrokerConfig.model_validate_json(sys.argv[2])
    consumer = Consumer(connect(sys.argv[1], cfg), SharedConfig(run_id="crash"), cfg, "victim")
    got = await consumer.read(count=5)
    print(json.dumps([d.entry_id for d in got]), flush=True)
    await asyncio.sleep(600)  # "training" on them: killed before it acknowledges anything

asyncio.run(main())
"""


def group(i: int):
    return synthetic_group(np.random.default_rng(i), prompt_index=i, num_samples=2, num_tokens=64)


async def test_killed_consumer_entries_are_reclaimed_and_processed_once(redis_url: str) -> None:
    cfg = BrokerConfig(claim_idle_ms=100, block_ms=20, retry_attempts=3)
    client = connect(redis_url, cfg)
    producer = Producer(client, SHARED, cfg, "w0")
    ids = [await producer.send(group(i)) for i in range(12)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", VICTIM, redis_url, cfg.model_dump_json(),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    victim_ids = json.loads(line)
    assert victim_ids == ids[:5]
    proc.send_signal(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL
    stream = SHARED.key(cfg.stream)
    consumers = {
        c["name"].decode(): c["pending"] for c in await client.xinfo_consumers(stream, cfg.consumer_group)
    }
    assert consumers == {"victim": 5}

    survivor = Consumer(client, SHARED, cfg, "survivor")
    processed: list[tuple[str, int]] = []
    for _ in range(300):  # bounded; the victim's entries become claimable after claim_idle_ms
        got = await survivor.read() + await survivor.claim_stale()
        processed += [(d.entry_id, d.delivery_count) for d in got]
        await survivor.ack(got)
        if len(processed) >= 12:
            break
        await asyncio.sleep(0.02)
    assert sorted(i for i, _ in processed) == sorted(ids)  # every entry exactly once
    assert {i: n for i, n in processed if i in victim_ids} == dict.fromkeys(victim_ids, 2)
    assert await survivor.claim_stale() == [] and await survivor.read() == []
    assert (await client.xpending(stream, cfg.consumer_group))["pending"] == 0
    assert int(await client.get(BrokerKeys.of(SHARED, cfg).backlog)) == 0
    await client.aclose()


async def test_redis_kill9_and_restart_loses_and_duplicates_nothing(own_redis: EmbeddedRedis) -> None:
    cfg = BrokerConfig(
        max_backlog=10,
        backpressure_poll_s=0.01,
        block_ms=20,
        read_count=4,
        retry_attempts=40,
        retry_backoff_s=0.02,
        socket_timeout_s=2.0,
        health_check_interval_s=1,
        inline_max_bytes=1000,  # producer 0 sends inline entries, the others by reference
    )
    url = own_redis.url
    n_producers, per_producer = 3, 40
    clients = [connect(url, cfg) for _ in range(n_producers + 1)]
    consumer = Consumer(clients[-1], SHARED, cfg, "learner-0")
    await consumer.ensure_group()
    acked_to_producer: dict[str, str] = {}  # group id -> entry id the producer was told
    delivered: list[tuple[str, str]] = []  # (group id, entry id) handed to the learner
    done = asyncio.Event()
    at_kill: list[int] = []

    async def produce(k: int) -> None:
        p = Producer(clients[k], SHARED, cfg, f"w{k}")
        for j in range(per_producer):
            g = synthetic_group(
                np.random.default_rng(j), prompt_index=1000 * k + j, num_samples=2, num_tokens=8 + 40 * k
            )
            acked_to_producer[g.group_id] = await p.send(g)

    async def consume() -> None:
        while len(delivered) < n_producers * per_producer and not done.is_set():
            got = await consumer.read()
            delivered.extend((d.group.group_id, d.entry_id) for d in got)
            await consumer.ack(got)

    async def crash() -> None:
        while len(delivered) < 30:
            await asyncio.sleep(0.005)
        old_pid = own_redis.process.pid
        at_kill.append(len(acked_to_producer))
        own_redis.kill()
        await asyncio.sleep(0.3)
        await asyncio.to_thread(own_redis.start)
        assert own_redis.process.pid != old_pid

    consumer_task = asyncio.create_task(consume())
    await asyncio.wait_for(asyncio.gather(crash(), *(produce(k) for k in range(n_producers))), timeout=120)
    await asyncio.wait_for(consumer_task, timeout=60)

    # The crash hit a running pipeline: it happened mid-production, and the clients really reconnected.
    assert at_kill[0] < n_producers * per_producer == len(acked_to_producer)
    assert all(connection_stats(c).connects >= 2 for c in clients)
    gids = [g for g, _ in delivered]
    assert len(gids) == len(set(gids)), "a group was delivered twice"
    assert (
        dict(delivered) == acked_to_producer
    )  # everything acknowledged to a producer arrived, same entry id
    keys = BrokerKeys.of(SHARED, cfg)
    assert await clients[0].xlen(keys.stream) == n_producers * per_producer
    assert int(await clients[0].get(keys.backlog)) == 0
    assert sum(1 for _, f in await clients[0].xrange(keys.stream) if b"ref" in f) == 2 * per_producer
    assert [k async for k in clients[0].scan_iter(match=keys.payload_prefix + "*")] == []  # all acknowledged
    for c in clients:
        await c.aclose()


async def test_a_read_reply_lost_with_the_connection_is_recovered(redis_url: str) -> None:
    cfg = BrokerConfig(block_ms=20, retry_attempts=5, retry_backoff_s=0.01)
    client, admin = connect(redis_url, cfg), connect(redis_url, cfg)
    producer = Producer(admin, SHARED, cfg, "w0")
    ids = [await producer.send(group(i)) for i in range(3)]
    consumer = Consumer(client, SHARED, cfg, "c0")
    assert [d.entry_id for d in await consumer.read(count=1)] == ids[:1]
    # The server records ids[1] as delivered to c0, but the reply never reaches it: the connection drops.
    stream = SHARED.key(cfg.stream)
    await admin.xreadgroup(cfg.consumer_group, "c0", {stream: ">"}, count=1)
    assert await admin.client_kill_filter(_id=await client.client_id()) == 1
    again = await consumer.read(count=5)  # reconnects inside XREADGROUP, then recovers what was lost
    assert [(d.entry_id, d.delivery_count) for d in again] == [(ids[1], 2), (ids[2], 1)]
    assert await consumer.read(count=5) == []
    assert await consumer.ack([ids[0], ids[1], ids[2]]) == 3
    await client.aclose()
    await admin.aclose()
