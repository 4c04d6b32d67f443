"""Prometheus endpoints scraped over real HTTP and parsed with prometheus_client's parser: the standalone server
(roles without an HTTP server), the aiohttp route (fed from Redis through MetricsWriter / MetricsReader), and
the built-in engine's ``/metrics`` after real generations."""

from __future__ import annotations

import asyncio
import math
import socket
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from broker.client import connect
from broker.config import BrokerConfig
from broker.metrics import MetricsReader, MetricsWriter
from common.config import SharedConfig
from common.prometheus import (
    LatestMetrics,
    add_metrics_route,
    metric_name,
    redis_info_source,
    render,
    start_metrics_server,
)
from rollout_fleet.engine.core import Engine
from rollout_fleet.engine.server import ServerSettings, ServerThread
from rollout_fleet.model import init_tiny_model
from streamrl.config import DashboardConfig, StreamRLConfig
from streamrl.dashboard import serve_role_metrics
from tests.prom import samples, scrape

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(60)


def test_names_follow_prometheus_rules_and_integer_suffixes_become_buckets() -> None:
    assert metric_name("learner", "staleness/mean") == "streamrl_learner_staleness_mean"
    assert metric_name("rollout", "engine.0-outstanding") == "streamrl_rollout_engine_0_outstanding"
    text = render("learner", {"staleness/hist/0": 5, "staleness/hist/12": 2, "loss": 0.25, "reward_mean": 1})
    got = samples(text.decode())
    per_engine = {"engine/127.0.0.1:30000/outstanding": 3, "engine/127.0.0.1:30001/outstanding": 5}
    got_engines = samples(render("rollout", per_engine).decode())
    assert got_engines[("streamrl_rollout_engine_outstanding", (("engine", "127.0.0.1:30000"),))] == 3
    assert got_engines[("streamrl_rollout_engine_outstanding", (("engine", "127.0.0.1:30001"),))] == 5
    assert got[("streamrl_learner_staleness_hist", (("bucket", "0"),))] == 5
    assert got[("streamrl_learner_staleness_hist", (("bucket", "12"),))] == 2
    assert got[("streamrl_learner_loss", ())] == 0.25
    assert got[("streamrl_learner_source_ok", ())] == 1
    # Two keys that sanitise to one name: the first is kept, the scrape stays valid.
    clash = samples(render("x", {"a/b": 1.0, "a_b": 2.0}).decode())
    assert clash[("streamrl_x_a_b", ())] == 1.0
    with pytest.raises(ValueError, match="role = 'bad role'"):
        render("bad role", {})
    with pytest.raises(ValueError, match=r"labels\['bucket'\]"):
        render("x", {}, {"bucket": "1"})


def test_standalone_server_serves_the_latest_values_and_reports_a_failing_source() -> None:
    latest = LatestMetrics()
    latest.update({"step": 3, "loss": 0.5, "staleness/hist/1": 7, "note": "warmup", "nan_metric": math.nan})
    broken = {"fail": False}

    def source() -> dict:
        if broken["fail"]:
            raise RuntimeError("source exploded")
        return latest()

    server = start_metrics_server("127.0.0.1", 0, "learner", source, labels={"run": "r1"})
    try:
        assert server.port > 0
        got = scrape(server.url)
        run = (("run", "r1"),)
        assert got[("streamrl_learner_step", run)] == 3
        assert got[("streamrl_learner_loss", run)] == 0.5
        assert got[("streamrl_learner_staleness_hist", (("bucket", "1"), ("run", "r1")))] == 7
        assert got[("streamrl_learner_note_info", (("run", "r1"), ("value", "warmup")))] == 1
        assert math.isnan(got[("streamrl_learner_nan_metric", run)])
        assert got[("streamrl_learner_source_ok", run)] == 1
        assert any(name.startswith("process_") for name, _ in got)  # process CPU / memory come along

        latest.update({"step": 4, "loss": 0.25})  # the next scrape sees the role's newest numbers
        got = scrape(server.url)
        assert got[("streamrl_learner_step", run)] == 4
        assert got[("streamrl_learner_loss", run)] == 0.25

        broken["fail"] = True
        got = scrape(server.url)
        assert got[("streamrl_learner_source_ok", run)] == 0
        assert ("streamrl_learner_step", run) not in got
    finally:
        server.stop()
    with pytest.raises(OSError):  # the port is free again: nothing answers
        urllib.request.urlopen(server.url, timeout=2)


async def test_route_serves_a_roles_latest_point_from_redis(redis_url: str) -> None:
    shared = SharedConfig(run_id="prom")
    client = connect(redis_url, BrokerConfig(retry_attempts=2))
    writer = MetricsWriter(client, shared, "rollout")
    reader = MetricsReader(client, shared)
    await writer.write({"generated_tokens_per_s": 812.5, "in_flight": 12, "idle_ratio": 0.125}, ts=100.0)

    async def source() -> dict | None:
        return await reader.latest("rollout")

    app = web.Application()
    add_metrics_route(app, "rollout", source, {"run": shared.run_id})
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                assert resp.status == 200
                got = samples(await resp.text())
            run = (("run", "prom"),)
            assert got[("streamrl_rollout_generated_tokens_per_s", run)] == 812.5
            assert got[("streamrl_rollout_in_flight", run)] == 12
            assert got[("streamrl_rollout_idle_ratio", run)] == 0.125
            assert got[("streamrl_rollout_ts", run)] == 100.0

            await writer.write({"generated_tokens_per_s": 900.0, "in_flight": 3, "idle_ratio": 0.5})
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                got = samples(await resp.text())
            assert got[("streamrl_rollout_generated_tokens_per_s", run)] == 900.0
            assert got[("streamrl_rollout_in_flight", run)] == 3
    finally:
        await runner.cleanup()
        await client.aclose()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("prom") / "tiny")


async def test_engine_metrics_count_real_generations(model_dir: Path) -> None:
    engine = Engine(model_dir, max_running_requests=4, max_context_len=128).start()
    settings = ServerSettings(request_timeout_s=30, control_timeout_s=10, shutdown_timeout_s=5)
    srv = ServerThread(engine, settings=settings)
    await asyncio.to_thread(srv.start)
    try:
        async with aiohttp.ClientSession() as http:
            body = {
                "text": ["12+34=", "5+6="],
                "sampling_params": {"max_new_tokens": 7, "ignore_eos": True, "temperature": 1.0},
            }
            async with http.post(f"{srv.url}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
            async with http.post(f"{srv.url}/update_weight_version", json={"new_version": "5"}) as resp:
                assert resp.status == 200
            async with http.get(f"{srv.url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                assert resp.status == 200
                got = samples(await resp.text())
        stats = engine.stats()
        assert got[("streamrl_engine_generated_tokens", ())] == stats["generated_tokens"] == 14
        assert got[("streamrl_engine_prefill_tokens_computed", ())] == stats["prefill_tokens_computed"] > 0
        assert got[("streamrl_engine_finished_requests", ())] == 2
        assert got[("streamrl_engine_num_running_reqs", ())] == 0
        assert got[("streamrl_engine_num_waiting_reqs", ())] == 0
        assert got[("streamrl_engine_weight_version", ())] == 5
        assert got[("streamrl_engine_paused", ())] == 0
    finally:
        await asyncio.to_thread(srv.stop)
        engine.shutdown(5)


def test_redis_role_exposes_the_servers_info(own_redis) -> None:
    server = start_metrics_server("127.0.0.1", 0, "redis", redis_info_source(own_redis.url, timeout_s=1.0))
    try:
        got = scrape(server.url)
        assert got[("streamrl_redis_used_memory", ())] > 0
        assert got[("streamrl_redis_connected_clients", ())] >= 1
        assert got[("streamrl_redis_aof_enabled", ())] == 1  # the embedded server runs with AOF
        assert got[("streamrl_redis_source_ok", ())] == 1
        own_redis.kill()
        got = scrape(server.url)  # a dead server is a value, not a failed scrape
        assert got[("streamrl_redis_source_ok", ())] == 0
    finally:
        server.stop()


def free_base_port(offsets: tuple[int, ...]) -> int:
    """A base port whose base + offset ports are all free now (bounded search)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + max(offsets) > 65000:
            continue
        try:
            for off in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        return base
    raise AssertionError("no free base port found")


def test_role_endpoints_serve_what_each_role_wrote(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    base = free_base_port((0, 1, 11))
    shared = SharedConfig(run_id="roles", redis_url=redis_url, run_dir=tmp_path)
    config = StreamRLConfig(shared=shared, dashboard=DashboardConfig(metrics_base_port=base))

    async def write() -> None:
        client = connect(redis_url)
        await MetricsWriter(client, shared, "learner").write(
            {"step": 7.0, "staleness/hist/1": 12, "loss": 0.5}
        )
        await MetricsWriter(client, shared, "rollout").write({"tokens_per_s": 321.5})
        await client.aclose()

    asyncio.run(write())
    learner = serve_role_metrics(config, "learner")
    worker = serve_role_metrics(config, "rollout", index=1)
    assert learner is not None and worker is not None
    try:
        assert (learner.port, worker.port) == (base, base + 11)
        got = scrape(learner.url)
        run = (("run", "roles"),)
        assert got[("streamrl_learner_step", run)] == 7.0
        assert got[("streamrl_learner_loss", run)] == 0.5
        assert got[("streamrl_learner_staleness_hist", (("bucket", "1"), ("run", "roles")))] == 12
        assert any(name == "process_resident_memory_bytes" for name, _ in got)
        got = scrape(worker.url)
        assert got[("streamrl_rollout_tokens_per_s", (("run", "roles"), ("worker", "1")))] == 321.5
        # A taken port or a disabled base gives no endpoint, and no exception for the role to die of.
        assert serve_role_metrics(config, "learner") is None
        disabled = StreamRLConfig(shared=shared, dashboard=DashboardConfig(metrics_base_port=0))
        assert serve_role_metrics(disabled, "learner") is None
    finally:
        learner.stop()
        worker.stop()
    # No Redis yet (embedded server not started, no URL): the endpoint answers and says the source failed.
    lonely = StreamRLConfig(
        shared=SharedConfig(run_dir=tmp_path / "none"), dashboard=DashboardConfig(metrics_base_port=base)
    )
    server = serve_role_metrics(lonely, "eval")
    assert server is not None
    try:
        assert scrape(server.url)[("streamrl_eval_source_ok", (("run", "default"),))] == 0
    finally:
        server.stop()
