"""The dashboard's JSON API and /metrics against a real Redis: what MetricsWriter, the broker and the policy
version put in Redis comes back exactly, for this run only; bad queries get 400 naming the field; a dead Redis
gets 503 instead of a hang."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from broker.client import connect
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.metrics import MetricsWriter
from broker.producer import Producer
from broker.record import synthetic_group
from broker.registry import EngineRegistry
from broker.server import EmbeddedRedis
from broker.version import PolicyVersion
from common.config import SharedConfig
from streamrl.config import DashboardConfig
from streamrl.dashboard import RunningDashboard, start_dashboard

pytestmark = pytest.mark.timeout(60)

SHARED = SharedConfig(run_id="dash")
BROKER = BrokerConfig(block_ms=20, read_count=8, retry_attempts=2, socket_timeout_s=2)
DASH = DashboardConfig(refresh_s=0.2, history_points=500, probe_timeout_s=0.5, api_timeout_s=3)
TIMEOUT = aiohttp.ClientTimeout(total=10)


def learner_point(step: int) -> dict[str, Any]:
    """A learner step as the trainer writes it (names from learner/trainer.py and broker/staleness.py)."""
    return {
        "step": float(step),
        "policy_version": float(step),
        "loss": 0.5 / step,
        "reward_mean": 0.125 * step,
        "reward/correct": 0.1 * step,
        "staleness/min": 0,
        "staleness/mean": 0.75,
        "staleness/max": 2,
        "staleness/hist/0": 40,
        "staleness/hist/1": 30 + step,
        "staleness/hist/2": 10,
        "is_weight_mean": 1.0 - 0.01 * step,
        "is_weight_max": 2.5,
        "clip_frac": 0.03125,
        "trained_tokens_per_s": 1234.5,
        "idle_ratio": 0.25,
        "total/trained": 8 * step,
    }


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = connect(redis_url, BROKER)
    yield c
    await c.aclose()


@pytest.fixture
async def dash(client: aioredis.Redis) -> AsyncIterator[RunningDashboard]:
    running = await start_dashboard(client, SHARED, DASH, BROKER, port=0)
    yield running
    await running.stop()


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url, timeout=TIMEOUT) as resp:
        text = await resp.text()
        return resp.status, (json.loads(text) if resp.content_type == "application/json" else text)


async def wait_summary(dash: RunningDashboard, ready: Any, rounds: int = 100) -> dict[str, Any]:
    """Poll /api/summary until ``ready(summary)`` (the broker sampler runs every refresh_s)."""
    for _ in range(rounds):
        status, body = await get(f"{dash.url}/api/summary")
        assert status == 200, body
        if ready(body):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"summary never became ready: {body}")


async def test_series_returns_exactly_the_points_written(client, dash) -> None:
    writer = MetricsWriter(client, SHARED, "learner")
    written = []
    for step in range(1, 8):
        point = learner_point(step)
        ts = 1_700_000_000.0 + step
        written.append((await writer.write(point, ts=ts), {"ts": ts, **point}))
    await writer.write({"step": 8.0, "loss": math.nan, "grad_norm": math.inf})
    other = MetricsWriter(client, SharedConfig(run_id="other-run"), "learner")
    await other.write({"step": 99.0, "reward_mean": 0.99})

    status, body = await get(f"{dash.url}/api/series?role=learner")
    assert status == 200
    points = body["points"]
    assert [(p["id"], p["values"]) for p in points[:7]] == written  # ids and values as stored, ints as ints
    assert isinstance(points[0]["values"]["staleness/hist/0"], int)
    assert points[7]["values"]["loss"] is None and points[7]["values"]["grad_norm"] is None  # NaN/inf -> null
    assert all(p["values"]["step"] != 99.0 for p in points)  # another run's points never show
    assert body["last_id"] == points[-1]["id"] and body["more"] is False

    # Incremental polling: since is exclusive; limit pages, `more` says whether to ask again.
    status, page = await get(f"{dash.url}/api/series?role=learner&since={written[1][0]}&limit=3")
    assert [p["id"] for p in page["points"]] == [w[0] for w in written[2:5]] and page["more"] is True
    status, page = await get(f"{dash.url}/api/series?role=learner&since={page['last_id']}&limit=3")
    assert [p["id"] for p in page["points"]][:2] == [w[0] for w in written[5:7]] and page["more"] is False
    status, page = await get(f"{dash.url}/api/series?role=learner&since={body['last_id']}")
    assert page["points"] == [] and page["last_id"] == body["last_id"]
    # Without since: the newest `limit` points.
    status, page = await get(f"{dash.url}/api/series?role=learner&limit=2")
    assert [p["id"] for p in page["points"]] == [p["id"] for p in points[-2:]]
    # A role that has written nothing is empty, not an error.
    status, page = await get(f"{dash.url}/api/series?role=eval")
    assert status == 200 and page["points"] == []


@pytest.mark.parametrize(
    "query, field",
    [
        ("role=", "role"),
        ("role=a%20b", "role"),
        ("role=learner&since=abc", "since"),
        ("role=x&limit=0", "limit"),
    ],
)
async def test_bad_series_queries_name_the_field(dash, query: str, field: str) -> None:
    status, body = await get(f"{dash.url}/api/series?{query}")
    assert status == 400 and body["error"].startswith(f"{field} = ")


async def test_summary_shows_latest_points_version_broker_and_engines(client, dash) -> None:
    learner = MetricsWriter(client, SHARED, "learner")
    for step in (1, 2, 3):
        await learner.write(learner_point(step))
    await MetricsWriter(client, SHARED, "eval").write(
        {"policy_version": 3, "greedy_accuracy": 0.625, "sampled_accuracy": 0.4375}
    )
    await PolicyVersion(client, SHARED, BROKER).publish(3)
    await MetricsWriter(client, SharedConfig(run_id="other-run"), "rollout").write({"x": 1})

    # Real stream traffic: 5 groups produced, 2 delivered and not acknowledged -> pending 2, lag 3, backlog 5.
    producer = Producer(client, SHARED, BROKER, "w0")
    for i in range(5):
        await producer.send(synthetic_group(np.random.default_rng(i), prompt_index=i, num_samples=2))
    consumer = Consumer(client, SHARED, BROKER, "learner-0")
    assert len(await consumer.read(count=2)) == 2

    # The engine registry as the fleet writes it, plus an entry no writer should make (read defensively).
    registry = EngineRegistry(client, SHARED)
    await registry.register("http://127.0.0.1:9", kind="builtin", health="dead")
    await registry.update("127.0.0.1:9", weight_version=2, last_seen=1.0)
    await client.hset(registry.key, "broken", b"\x00not json")

    summary = await wait_summary(
        dash,
        lambda s: (
            (s["broker"].get("sample") or {}).get("pending") == 2
            and any(e["reachable"] is not None for e in s["engines"])
        ),
    )
    assert summary["run_id"] == "dash" and summary["policy_version"] == 3
    assert set(summary["roles"]) == {"learner", "eval"}  # only this run's roles
    assert summary["roles"]["learner"]["values"]["step"] == 3.0
    assert summary["roles"]["learner"]["values"]["reward_mean"] == 0.375
    assert summary["roles"]["eval"]["values"]["greedy_accuracy"] == 0.625
    sample = summary["broker"]["sample"]
    assert (sample["backlog"], sample["pending"], sample["lag"], sample["stream_length"]) == (5, 2, 3, 5)
    assert summary["broker"]["counters"]["produced"] == 5 and summary["broker"]["counters"]["consumed"] == 2
    engines = {e["engine_id"]: e for e in summary["engines"]}
    dead = engines["127.0.0.1:9"]
    assert dead["health"] == "dead" and dead["registry_weight_version"] == 2
    assert dead["reachable"] is False and dead["probe_error"]  # nothing listens on port 9
    assert engines["broken"]["registry_error"].startswith("unreadable registry entry")

    # The broker history grows with each sample and serves as the pseudo-role "broker".
    status, series = await get(f"{dash.url}/api/series?role=broker")
    assert status == 200 and series["points"] and series["points"][-1]["values"]["pending"] == 2

    # The dashboard's own Prometheus endpoint carries the same numbers.
    status, text = await get(f"{dash.url}/metrics")
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    run = (("run", "dash"),)
    assert got[("streamrl_dashboard_policy_version", run)] == 3
    assert got[("streamrl_dashboard_learner_step", run)] == 3
    assert got[("streamrl_dashboard_eval_sampled_accuracy", run)] == 0.4375
    assert got[("streamrl_dashboard_broker_pending", run)] == 2
    assert got[("streamrl_dashboard_learner_staleness_hist", (("bucket", "1"), ("run", "dash")))] == 33


async def test_page_and_static_files_are_served_read_only(dash) -> None:
    status, html = await get(f"{dash.url}/")
    assert status == 200 and "/static/dashboard.js" in html
    for name in ("dashboard.js", "dashboard.css"):
        status, _ = await get(f"{dash.url}/static/{name}")
        assert status == 200
    async with aiohttp.ClientSession() as http, http.post(f"{dash.url}/api/summary", timeout=TIMEOUT) as resp:
        assert resp.status == 405


async def test_a_dead_redis_answers_503_not_a_hang(own_redis: EmbeddedRedis) -> None:
    broker = BrokerConfig(retry_attempts=1, retry_backoff_s=0.05, socket_timeout_s=0.5)
    running = await start_dashboard(own_redis.url, SHARED, DASH, broker, port=0)
    try:
        status, _ = await get(f"{running.url}/api/summary")
        assert status == 200
        own_redis.kill()
        status, body = await get(f"{running.url}/api/summary")
        assert status == 503 and "Redis unavailable" in body["error"]
    finally:
        await running.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_daemon_serves_until_sigterm_and_says_when_there_is_no_redis(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    args = [sys.executable, "-m", "streamrl", "dashboard", f"--shared.redis_url={redis_url}"]
    args += [f"--shared.run_dir={tmp_path / 'run'}"]  # its resolved config goes there, not into the checkout
    args += ["--shared.run_id=proc", f"--dashboard.port={port}", "--dashboard.refresh_s=0.2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        body = None
        for _ in range(150):  # bounded: the process imports torch-free config only, ~1-3 s
            assert proc.poll() is None, proc.communicate()[0]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/summary", timeout=2) as resp:
                    body = json.loads(resp.read())
                    break
            except OSError:
                time.sleep(0.1)
        assert body is not None and body["run_id"] == "proc"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert "dashboard stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl",
            "dashboard",
            f"--shared.run_dir={tmp_path}",
            "--dashboard.redis_wait_s=0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 2 and "no Redis" in res.stderr


async def test_summary_shows_the_run_device_plan_once_up_wrote_it(client, tmp_path: Path) -> None:
    from streamrl.devices import resolve_plan, write_plan

    shared = SharedConfig(run_id="dash-devices", run_dir=tmp_path)
    running = await start_dashboard(client, shared, DASH, BROKER, port=0)
    try:
        status, body = await get(f"{running.url}/api/summary")
        assert status == 200 and body["devices"] is None  # up has not written a plan (yet)
        write_plan(resolve_plan(["0", "1", "2", "3"], "disaggregated", 2, 2, 1), tmp_path)
        status, body = await get(f"{running.url}/api/summary")
        assert body["devices"]["learner"] == ["0", "1"] and body["devices"]["engines"] == [["2"], ["3"]]
        assert body["devices"]["placement"] == "disaggregated" and body["devices"]["device"] == "cuda"
    finally:
        await running.stop()
