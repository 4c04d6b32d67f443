"""The dashboard page in headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium):
the page loads, every tile and chart shows the values that are in Redis for this run (learner steps, held-out
evaluation, rollout throughput, real stream traffic, a real built-in engine in the registry), it updates live
when a new step is written, and a screenshot is kept under test-artifacts/."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from broker.client import connect
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.metrics import MetricsReader, MetricsWriter
from broker.producer import Producer
from broker.record import synthetic_group
from broker.registry import EngineRegistry
from broker.staleness import staleness_stats
from broker.version import PolicyVersion
from common.auth import run_secret
from common.config import SharedConfig
from rollout_fleet.engine.core import Engine
from rollout_fleet.engine.server import ServerSettings, ServerThread
from rollout_fleet.model import init_tiny_model
from streamrl.config import DashboardConfig
from streamrl.dashboard import start_dashboard
from tests.dashboard_page import chromium, screenshot, tile, wait_for
from tests.synth import sample_groups

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(90)

SHARED = SharedConfig(run_id="browser", eta=2)
BROKER = BrokerConfig(block_ms=20, retry_attempts=2, socket_timeout_s=2)
DASH = DashboardConfig(refresh_s=0.3, history_points=500, probe_timeout_s=1.0)
STEPS = 12


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("browser") / "tiny")


@pytest.fixture
async def engine_url(model_dir: Path, tmp_path: Path) -> AsyncIterator[str]:
    """An engine that requires the run secret of the test's run directory (common.auth)."""
    engine = Engine(model_dir, max_running_requests=2, max_context_len=64).start()
    key = run_secret(SHARED.model_copy(update={"run_dir": tmp_path, "auth": "on"}))
    srv = ServerThread(
        engine, settings=ServerSettings(request_timeout_s=30, shutdown_timeout_s=5, api_key=key)
    )
    await asyncio.to_thread(srv.start)
    yield srv.url
    await asyncio.to_thread(srv.stop)
    engine.shutdown(5)


def learner_point(step: int) -> dict[str, float]:
    """One learner step with the trainer's metric names; staleness from the real statistics helper."""
    versions = [step - 1] * 30 + [step - 2] * (10 + step) + [max(0, step - 3)] * 5
    stats = staleness_stats(step - 1, versions).as_metrics()
    return {
        "step": float(step),
        "policy_version": float(step),
        "reward_mean": round(0.2 + 0.05 * step, 4),
        "reward/correct": round(0.15 + 0.05 * step, 4),
        "reward/format": 1.0,
        "loss": 0.3 / step,
        "entropy": 1.5 - 0.05 * step,
        "grad_norm": 0.8,
        "is_weight_mean": 1.0 - 0.005 * step,
        "is_weight_max": 1.5 + 0.1 * step,
        "clip_frac": 0.01 * step,
        "mismatch_abs": 0.002,
        "trained_tokens_per_s": 1000.0 + 10 * step,
        "idle_ratio": 0.2,
        "total/trained": float(16 * step),
        "total/stale": 2.0,
        **stats,
    }


def rollout_point(step: int, engine_id: str) -> dict[str, float]:
    """A rollout worker's point with the names rollout_fleet/worker.py writes."""
    return {
        "tokens_per_s": 400.0 + step,
        "groups_per_s": 2.0,
        "groups_in_flight": 16.0,
        "wait_capacity_ratio": 0.05,
        "policy_version": float(step - 1),
        "episodes": 10.0 * step,  # a multi-turn task's counters (cumulative, as the worker writes them)
        "turns": 18.0 * step,
        "tool_calls": 8.0 * step,
        "tool_errors": float(step),
        f"engine/{engine_id}/outstanding": 3.0,
        f"engine/{engine_id}/healthy": 1.0,
    }


async def write_run(client: aioredis.Redis, engine_url: str) -> dict[str, Any]:
    """What a short run leaves in Redis: learner steps, evaluations, rollout points, stream traffic, the
    published version and the engine registry. Returns the values the page must show."""
    engine_id = engine_url.removeprefix("http://")
    learner = MetricsWriter(client, SHARED, "learner")
    rollout = MetricsWriter(client, SHARED, "rollout")
    evaluation = MetricsWriter(client, SHARED, "eval")
    for step in range(1, STEPS + 1):
        await learner.write(learner_point(step))
        await rollout.write(rollout_point(step, engine_id))
        if step % 4 == 0:
            await evaluation.write(
                {"policy_version": step, "greedy_accuracy": 0.3 + 0.1 * step / 4, "sampled_accuracy": 0.25}
            )
    await PolicyVersion(client, SHARED, BROKER).publish(STEPS)
    await MetricsWriter(client, SharedConfig(run_id="someone-else"), "learner").write({"step": 999.0})
    producer = Producer(client, SHARED, BROKER, "w0")
    for i in range(6):
        await producer.send(synthetic_group(np.random.default_rng(i), prompt_index=i, num_samples=2))
    assert len(await Consumer(client, SHARED, BROKER, "learner-0").read(count=4)) == 4
    registry = EngineRegistry(client, SHARED)
    await registry.register(engine_url, kind="builtin", source="test")
    await registry.update(engine_id, health="healthy", weight_version=0, last_seen=time.time())
    last = learner_point(STEPS)
    return {"last": last, "engine_id": engine_id, "backlog": 6, "pending": 4, "lag": 2}


async def test_page_shows_the_runs_values_and_updates_live(
    browser, engine_url: str, redis_url: str, tmp_path: Path
) -> None:
    from streamrl.devices import resolve_plan, write_plan

    client = connect(redis_url, BROKER)
    # the device plan up writes into the run directory: the page's header shows it
    write_plan(resolve_plan(["0", "1", "2", "3"], "disaggregated", 2, 2, 1), tmp_path)
    # With the run secret on: the page opens once with ?token=, which leaves a cookie the page's calls carry, and
    # the dashboard's probes of the engine carry the key (the engine row reads reachable).
    shared = SHARED.model_copy(update={"run_dir": tmp_path, "auth": "on"})
    running = await start_dashboard(client, shared, DASH, BROKER, port=0)
    try:
        expect = await write_run(client, engine_url)
        last = expect["last"]
        await asyncio.to_thread(browser.get, f"{running.url}/?token={run_secret(shared)}")

        def complete(s: dict[str, Any]) -> bool:
            engines = {row[0]: row for row in s["engines"]}
            row = engines.get(expect["engine_id"])
            return bool(s["ready"] and tile(s, "pending") == expect["pending"] and row and row[3] == "yes")

        state = await asyncio.to_thread(wait_for, browser, complete, "the run's data")

        assert state["run"] == "browser" and state["status"].startswith("live")
        assert state["devices"] == "disaggregated: learner GPU 0,1 · engine-0 GPU 2 · engine-1 GPU 3"
        assert tile(state, "step") == STEPS and state["tiles"]["stat-step"][1] == str(STEPS)
        assert tile(state, "version") == STEPS
        assert tile(state, "reward") == last["reward_mean"]
        assert tile(state, "greedy") == pytest.approx(0.6) and tile(state, "sampled") == 0.25
        assert tile(state, "generated") == 400.0 + STEPS
        assert tile(state, "trained") == last["trained_tokens_per_s"]
        assert tile(state, "staleness") == pytest.approx(last["staleness/mean"])
        assert (tile(state, "backlog"), tile(state, "pending"), tile(state, "lag")) == (6, 4, 2)
        assert tile(state, "idle-learner") == 0.2 and tile(state, "idle-rollout") == 0.05
        assert sorted(state["pills"]) == ["eval", "learner", "rollout"]  # not the other run's
        assert tile(state, "turns") == pytest.approx(1.8) and tile(state, "tool-calls") == pytest.approx(0.8)

        charts = state["charts"]
        assert charts["chart-reward"]["lines"]["reward_mean"] == [STEPS, last["reward_mean"]]
        assert charts["chart-reward"]["lines"]["reward/correct"] == [STEPS, last["reward/correct"]]
        assert charts["chart-accuracy"]["lines"]["greedy"] == [STEPS // 4, pytest.approx(0.6)]
        assert charts["chart-accuracy"]["lines"]["sampled"][0] == STEPS // 4
        assert charts["chart-staleness"]["lines"]["staleness/max"] == [STEPS, last["staleness/max"]]
        assert charts["chart-staleness"]["lines"]["staleness/mean"][1] == pytest.approx(
            last["staleness/mean"]
        )
        assert charts["chart-is"]["lines"]["is_weight_max"] == [STEPS, pytest.approx(last["is_weight_max"])]
        assert charts["chart-clip"]["lines"]["clip_frac"] == [STEPS, pytest.approx(last["clip_frac"])]
        assert charts["chart-throughput"]["lines"]["generated"] == [STEPS, 400.0 + STEPS]
        assert charts["chart-throughput"]["lines"]["trained"][0] == STEPS
        assert charts["chart-idle"]["lines"]["learner"][0] == STEPS
        assert charts["chart-stream"]["lines"]["pending"][1] == 4
        assert charts["chart-loss"]["points"] == 3 * STEPS
        # The histogram sums the per-step token counts of every loaded step.
        hist: dict[int, float] = {}
        for step in range(1, STEPS + 1):
            for key, n in learner_point(step).items():
                if key.startswith("staleness/hist/"):
                    s = int(key.rsplit("/", 1)[1])
                    hist[s] = hist.get(s, 0) + n
        assert dict(state["bars"]) == hist

        engines = {row[0]: row for row in state["engines"]}
        row = engines[expect["engine_id"]]
        assert row[2] == "healthy" and row[3] == "yes" and row[4] == "0"  # health, reachable, weight version
        assert row[7] == "3"  # requests the rollout workers have outstanding on it
        assert row[9].endswith("s ago")  # the registry's last successful probe
        assert state["outcomes"]["learner totals/trained"] == str(16 * STEPS)
        assert state["outcomes"]["broker/produced"] == "6"

        # Live: a new step and a new version appear without a reload.
        await MetricsWriter(client, SHARED, "learner").write(learner_point(STEPS + 1))
        await PolicyVersion(client, SHARED, BROKER).publish(STEPS + 1)
        state = await asyncio.to_thread(
            wait_for,
            browser,
            lambda s: tile(s, "step") == STEPS + 1 and tile(s, "version") == STEPS + 1,
            "step 13",
        )
        assert state["charts"]["chart-reward"]["lines"]["reward_mean"][0] == STEPS + 1

        await asyncio.to_thread(screenshot, browser, "dashboard.png")
    finally:
        await running.stop()
        await client.aclose()


async def test_page_of_an_empty_run_loads_and_says_so(browser, redis_url: str) -> None:
    client = connect(redis_url, BROKER)
    running = await start_dashboard(client, SharedConfig(run_id="empty"), DASH, BROKER, port=0)
    try:
        await asyncio.to_thread(browser.get, running.url)
        state = await asyncio.to_thread(wait_for, browser, lambda s: s["ready"], "the first poll")
        assert state["status"].startswith("live")
        assert state["tiles"]["stat-step"] == [None, "-"] and state["tiles"]["stat-greedy"] == [None, "-"]
        assert tile(state, "backlog") == 0
        assert state["charts"]["chart-reward"]["points"] == 0
        assert state["pills"] == [None]  # the "no role has written metrics yet" pill
    finally:
        await running.stop()
        await client.aclose()


async def test_rollout_workers_with_a_role_each_add_up_before_the_learner_starts(
    browser, redis_url: str
) -> None:
    client = connect(redis_url, BROKER)
    shared = SharedConfig(run_id="workers")
    running = await start_dashboard(client, shared, DASH, BROKER, port=0)
    try:
        for i, (tps, idle) in enumerate([(300.0, 0.5), (200.0, 0.25)]):
            await MetricsWriter(client, shared, f"rollout-{i}").write(
                {"tokens_per_s": tps, "wait_capacity_ratio": idle, "groups_in_flight": 4.0}
            )
        await asyncio.to_thread(browser.get, running.url)
        state = await asyncio.to_thread(
            wait_for, browser, lambda s: s["ready"] and len(s["pills"]) == 2, "2 roles"
        )
        assert tile(state, "generated") == 500.0 and tile(state, "idle-rollout") == 0.375
        assert state["tiles"]["stat-step"] == [None, "-"]  # no learner yet: shown as absent, not as 0
        assert state["tiles"]["stat-turns"] == [None, "-"]  # a single-turn task: no episode counters
        lines = state["charts"]["chart-throughput"]["lines"]
        assert lines["generated rollout-0"] == [1, 300.0] and lines["generated rollout-1"] == [1, 200.0]
    finally:
        await running.stop()
        await client.aclose()


@pytest.mark.slow  # a learner process: ~25 s on an idle 2-core machine, several times that under load
@pytest.mark.timeout(400)
async def test_page_follows_a_real_learner_run(
    browser, model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """A real learner process (1 rank, 2 steps on groups sampled from the tiny model) writes its metrics while
    the page is open: every learner tile and chart shows what the learner wrote, under the learner's names."""
    shared = SharedConfig(run_id="real", eta=2)
    groups = sample_groups(str(model_dir), 8, 4, version=0, run_id="real")
    client = connect(redis_url, BROKER)
    producer = Producer(client, shared, BROKER, "synth")
    for g in groups:
        await producer.send(g)
    running = await start_dashboard(client, shared, DASH, BROKER, port=0)
    args = [
        sys.executable, "-m", "streamrl", "learner", f"--shared.run_dir={tmp_path / 'run'}", f"--shared.redis_url={redis_url}",
        f"--shared.model_path={model_dir}", "--shared.run_id=real", "--shared.eta=2", "--learner.world_size=1",
        "--learner.groups_per_step=4", "--learner.wandb_mode=disabled", "--learner.max_steps=2",
        "--learner.micro_batch_tokens=256", "--learner.export_at_end=false",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        await asyncio.to_thread(browser.get, running.url)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=300)
        assert proc.returncode == 0, out
        points = await MetricsReader(client, shared).read("learner")
        assert [p["step"] for _, p in points] == [1.0, 2.0]
        last = points[-1][1]
        state = await asyncio.to_thread(
            wait_for,
            browser,
            lambda s: tile(s, "step") == 2 and tile(s, "version") == 2,
            "the learner's step 2",
        )
        for name, key in [("reward", "reward_mean"), ("trained", "trained_tokens_per_s"),
                          ("staleness", "staleness/mean"), ("idle-learner", "idle_ratio")]:  # fmt: skip
            assert tile(state, name) == pytest.approx(last[key]), name
        charts = state["charts"]
        assert charts["chart-reward"]["lines"]["reward_mean"] == [2, pytest.approx(last["reward_mean"])]
        for chart, series in [("chart-staleness", "staleness/max"), ("chart-is", "is_weight_mean"),
                              ("chart-clip", "clip_frac"), ("chart-loss", "loss"), ("chart-idle", "learner"),
                              ("chart-throughput", "trained")]:  # fmt: skip
            assert charts[chart]["lines"][series][0] == 2, (chart, series)
        tokens = sum(v for k, v in last.items() if k.startswith("staleness/hist/"))
        assert sum(n for _, n in state["bars"]) == tokens + sum(
            v for k, v in points[0][1].items() if k.startswith("staleness/hist/")
        )
        assert state["outcomes"]["learner totals/trained"] == str(int(last["total/trained"]))
        await asyncio.to_thread(screenshot, browser, "dashboard-learner.png")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        await running.stop()
        await client.aclose()


async def test_sample_viewer_colours_each_token_by_its_policy_version(
    browser, model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """The archiver's feed of a real stream, shown token by token: text from the model's tokenizer, each token
    coloured by how far its version is behind the published policy."""
    from archiver.archive import Archiver, TokenText
    from archiver.config import ArchiveConfig
    from broker.record import Sample, TrajectoryGroup

    shared = SharedConfig(run_id="viewer", eta=4, model_path=model_dir)
    client = connect(redis_url, BROKER)
    archiver = Archiver(
        client, shared, BROKER, ArchiveConfig(dir=tmp_path / "archive", poll_s=0.05, recent=8)
    )
    await archiver.start()
    ids = [5, 77, 6, 77, 5, 85, 12, 40]
    versions = [3, 3, 4, 4, 5, 5, 5, 5]  # a sample whose generation spanned three weight updates
    sample = Sample(sample_index=0, output_ids=ids, logprobs=[-0.5] * 8, versions=versions, loss_mask=[1] * 8,
                    finish_reason="stop", truncated=False, reward=1.0, reward_components={"correct": 1.0, "format": 1.0})  # fmt: skip
    group = TrajectoryGroup(run_id="viewer", epoch=0, prompt_index=3, attempt=0, prompt_id="p3", task="arithmetic",
                            prompt_ids=[5, 77, 6], samples=[sample])  # fmt: skip
    await Producer(client, shared, BROKER, "w0").send(group)
    await PolicyVersion(client, shared, BROKER).publish(6)
    for _ in range(20):
        await archiver.step()
        if archiver.waiting:
            break
    running = await start_dashboard(client, shared, DASH, BROKER, port=0)
    try:
        await asyncio.to_thread(browser.get, running.url)
        state = await asyncio.to_thread(wait_for, browser, lambda s: s["samples"], "the latest trajectory")
        (shown,) = state["samples"]
        text = TokenText(model_dir)
        assert shown["group"] == group.group_id and shown["reward"] == 1.0
        assert "correct 1" in shown["meta"] and "format 1" in shown["meta"]
        assert shown["prompt"] == text.text([5, 77, 6])
        assert [t[0] for t in shown["tokens"]] == text.pieces(ids)
        assert [t[1] for t in shown["tokens"]] == versions
        assert [t[2] for t in shown["tokens"]] == [3, 3, 2, 2, 1, 1, 1, 1]  # 6 - version
        colours = {t[2]: t[3] for t in shown["tokens"]}
        assert len(set(colours.values())) == 3  # one colour per lag
        assert "1 groups awaiting an outcome" in state["archive"]
        await asyncio.to_thread(screenshot, browser, "dashboard-samples.png")
    finally:
        await running.stop()
        await client.aclose()
