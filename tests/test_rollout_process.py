"""Rollout workers as real ``python -m rollout_fleet`` processes (uvloop, run_rollout).

- Killed with SIGKILL mid-epoch: its leased prompts are taken over by another worker once the leases expire;
  over records and drops every prompt of the epoch appears exactly once; the admission counters leak nothing.
- Stopped with SIGTERM: it stops leasing, hands its unfinished prompts back with their admission slots, and
  exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import tomli_w

from broker.admission import DispatchKeys, done_positions
from broker.client import connect
from broker.config import BrokerConfig
from common.config import SharedConfig
from rollout_fleet.config import RolloutConfig
from rollout_fleet.engine.server import ServerThread
from rollout_fleet.model import init_tiny_model
from rollout_fleet.tasks.config import task_config
from tests.test_rollout_worker import admission_counts, configs, read_drops, read_records, run_worker, serving

pytestmark = pytest.mark.timeout(150)
BROKER = BrokerConfig()
PROMPTS = 12


@contextlib.asynccontextmanager
async def slow_engine(tmp_path: Path) -> AsyncIterator[tuple[Path, ServerThread]]:
    """An in-process engine that sleeps 10 ms per forward pass: slow enough to catch a worker mid-epoch."""
    model_dir = init_tiny_model(tmp_path / "tiny")
    with serving(model_dir) as srv:
        srv.engine.scheduler.add_step_listener(lambda rec: time.sleep(0.01))
        yield model_dir, srv


def spawn_worker(
    tmp_path: Path, redis_url: str, shared: SharedConfig, rollout: RolloutConfig, **overrides: Any
) -> subprocess.Popen:
    """``streamrl rollout --config FILE`` with ``rollout`` plus ``overrides``; output in NAME.log, its resolved
    config in tmp_path/run (not the default runs/default, relative to the checkout)."""
    config = {
        "shared": {
            **shared.model_dump(mode="json", exclude_none=True),
            "redis_url": redis_url,
            "run_dir": str(tmp_path / "run"),
        },
        "rollout": {**rollout.model_dump(mode="json", exclude_none=True), **overrides},
        "learner": {"groups_per_step": 100},
        "broker": {"max_backlog": 20_000},  # the back-pressure bound of eta 100: (5 + 100 + 1) x 100 groups
    }
    name = overrides.get("worker_id", "worker")
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(config))
    with open(tmp_path / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "streamrl", "rollout", "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        )


async def wait_busy(
    client: aioredis.Redis, shared: SharedConfig, proc: subprocess.Popen, worker: str, log: Path
) -> dict[int, str]:
    """Wait (bounded) until the worker has produced two groups and holds leases; returns the leases."""
    held: dict[int, str] = {}
    for _ in range(1200):
        assert proc.poll() is None, log.read_text()[-3000:]
        produced = await client.xlen(shared.key(BROKER.stream))
        raw = await client.hgetall(shared.key("dispatch:holders"))
        held = {int(p): w.decode() for p, w in raw.items()}
        if produced >= 2 and worker in held.values():
            return held
        await asyncio.sleep(0.05)
    raise AssertionError(f"worker {worker} never got busy; log:\n{log.read_text()[-3000:]}")


async def test_prompts_of_a_killed_worker_are_produced_once_by_another(
    redis_url: str, tmp_path: Path
) -> None:
    async with slow_engine(tmp_path) as (model_dir, srv):
        shared, engine, rollout = configs(
            model_dir,
            [srv.url],
            group_size=2,
            max_new_tokens=32,
            task=task_config(name="arithmetic", train_size=PROMPTS),
            lease_ttl_s=2.0,
            worker_id="second",
        )
        proc = spawn_worker(tmp_path, redis_url, shared, rollout, worker_id="killed", max_concurrent_groups=3)
        client = connect(redis_url, BROKER)
        try:
            held = await wait_busy(client, shared, proc, "killed", tmp_path / "killed.log")
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            assert "killed" in held.values()

            stats = await asyncio.wait_for(run_worker(redis_url, shared, engine, rollout), 90)
            assert stats.finished
            dispatch_stats = await client.hgetall(shared.key("dispatch:stats"))
            assert int(dispatch_stats[b"taken_over"]) >= 1  # the killed worker's leases expired to "second"
            raw_gids = [f[b"gid"].decode() for _, f in await client.xrange(shared.key(BROKER.stream))]
        finally:
            if proc.poll() is None:
                proc.kill()
            await client.aclose()

    records = await read_records(redis_url, shared)
    drops = await read_drops(redis_url, shared)
    assert len(raw_gids) == len(set(raw_gids)) == len(records)  # one stream entry per group id
    seen = Counter([g.prompt_index for g in records] + [int(d["prompt_index"]) for d in drops])
    assert seen == Counter(range(PROMPTS)), seen  # each prompt of the epoch exactly once
    assert {g.worker_id for g in records} == {"killed", "second"}
    counts = await admission_counts(redis_url, shared)
    assert counts.running == 0 and counts.accepted == len(records)


async def test_sigterm_hands_unfinished_prompts_back_and_exits_0(redis_url: str, tmp_path: Path) -> None:
    async with slow_engine(tmp_path) as (model_dir, srv):
        shared, _, rollout = configs(
            model_dir,
            [srv.url],
            group_size=2,
            max_new_tokens=32,
            max_epochs=0,  # forever: only the signal stops it
            drain_timeout_s=0.0,  # hand everything in flight back at once
            max_concurrent_groups=3,
            task=task_config(name="arithmetic", train_size=PROMPTS),
        )
        proc = spawn_worker(tmp_path, redis_url, shared, rollout, worker_id="termed")
        client = connect(redis_url, BROKER)
        try:
            await wait_busy(client, shared, proc, "termed", tmp_path / "termed.log")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, (tmp_path / "termed.log").read_text()[-3000:]
            holders = await client.hgetall(shared.key("dispatch:holders"))
            requeued = [int(p) for p in await client.lrange(shared.key("dispatch:requeue"), 0, -1)]
            cursor = int(await client.get(shared.key("dispatch:cursor")))
            keys = DispatchKeys.of(shared)
            done = {p for e in range(cursor // PROMPTS + 1) for p in await done_positions(client, keys, e)}
        finally:
            if proc.poll() is None:
                proc.kill()
            await client.aclose()
    assert holders == {} and requeued, "nothing was in flight to hand back"
    assert set(range(cursor)) == done | set(requeued)  # every handed-out prompt is done or queued again
    counts = await admission_counts(redis_url, shared)
    assert counts.running == 0 and counts.rejected == len(requeued)
    assert counts.started == counts.accepted + counts.rejected
    log = (tmp_path / "termed.log").read_text()
    assert "handed" in log and "worker termed stopped" in log
