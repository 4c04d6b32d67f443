"""The rollout worker end to end: real built-in engines over HTTP (in-process server threads), a real Redis, the
real reward process pool and producer; records read back with the broker's consumer.

Also home of the helpers the other rollout/fleet tests import (engines, configs, running a worker, reading back
what it wrote)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from broker.admission import RedisCounters
from broker.client import connect
from broker.config import BrokerConfig
from broker.consumer import Consumer, dropped
from broker.metrics import MetricsReader
from broker.record import TrajectoryGroup, make_group_id
from broker.version import PolicyVersion
from common.config import SharedConfig
from rollout_fleet.config import EngineConfig, RolloutConfig
from rollout_fleet.engine.core import Engine
from rollout_fleet.engine.scheduler import StepRecord
from rollout_fleet.engine.server import ServerSettings, ServerThread
from rollout_fleet.main import open_worker
from rollout_fleet.model import init_tiny_model
from rollout_fleet.tasks.config import RewardConfig, task_config
from rollout_fleet.worker import RequestsRejected, WorkerStats

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(90)

BROKER = BrokerConfig()
SETTINGS = ServerSettings(
    request_timeout_s=60, control_timeout_s=20, health_check_timeout_s=10, shutdown_timeout_s=5
)


# -- helpers shared with the other rollout / fleet tests ------------------------------------------------------


@contextlib.contextmanager
def serving(model_dir: Path, **engine_kwargs: Any) -> Iterator[ServerThread]:
    """A built-in engine behind a real HTTP server on a free port, in this process."""
    kwargs = {"max_running_requests": 32, "max_context_len": 256, **engine_kwargs}
    engine = Engine(model_dir, **kwargs).start()
    server = ServerThread(engine, settings=SETTINGS).start()
    try:
        yield server
    finally:
        server.stop()
        engine.shutdown()


def configs(
    model_dir: Path, urls: list[str], run_id: str = "run", eta: int = 100, **rollout: Any
) -> tuple[SharedConfig, EngineConfig, RolloutConfig]:
    shared = SharedConfig(run_id=run_id, eta=eta, model_path=model_dir, http_timeout_s=10.0)
    task = rollout.pop("task", task_config(name="arithmetic", seed=0, train_size=6))
    options = {
        "group_size": 3,
        "max_new_tokens": 16,
        "max_epochs": 1,
        "task": task,
        "reward": RewardConfig(workers=1, timeout_s=10.0),
        "engine_urls": urls,
        "lease_ttl_s": 5.0,
        "health_interval_s": 0.5,
        "metrics_interval_s": 0.5,
        "admission_poll_s": 0.05,
        "version_poll_s": 0.2,
        "drain_timeout_s": 10.0,
        "worker_id": "w0",
        **rollout,
    }
    return shared, EngineConfig(), RolloutConfig(**options)


async def run_worker(
    redis_url: str,
    shared: SharedConfig,
    engine: EngineConfig,
    rollout: RolloutConfig,
    groups_per_step: int = 100,
    stop: asyncio.Event | None = None,
) -> WorkerStats:
    """Run one worker in this event loop until it finishes its epochs (or ``stop`` is set)."""
    async with open_worker(shared, BROKER, engine, rollout, groups_per_step, redis_url) as worker:
        return await worker.run(stop or asyncio.Event())


async def read_records(redis_url: str, shared: SharedConfig) -> list[TrajectoryGroup]:
    """Every group in the stream, decoded and validated by the broker's consumer (a side consumer group)."""
    client = connect(redis_url, BROKER)
    try:
        consumer = Consumer(client, shared, BROKER, "check", consumer_group="check")
        out: list[TrajectoryGroup] = []
        while batch := await consumer.read(count=100, block_ms=0):
            out += [d.group for d in batch]
        return out
    finally:
        await client.aclose()


async def read_drops(redis_url: str, shared: SharedConfig) -> list[dict]:
    client = connect(redis_url, BROKER)
    try:
        return await dropped(client, shared, BROKER)
    finally:
        await client.aclose()


async def admission_counts(redis_url: str, shared: SharedConfig) -> Any:
    client = connect(redis_url, BROKER)
    try:
        return await RedisCounters(client, shared).snapshot()
    finally:
        await client.aclose()


def reference_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> np.ndarray:
    """Teacher-forced log softmax of each output token at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0].numpy()


class StepGate:
    """Holds an engine's scheduler thread after the first forward pass where ``when(record)`` holds."""

    def __init__(self, srv: ServerThread, when: Any) -> None:
        self.when, self.hit, self._go = when, threading.Event(), threading.Event()
        self._remove = srv.engine.scheduler.add_step_listener(self._on_step)

    def _on_step(self, record: StepRecord) -> None:
        if not self.hit.is_set() and self.when(record):
            self.hit.set()
            self._go.wait(30)

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.hit.wait, 60), "the gated step never happened"

    def release(self) -> None:
        self._go.set()
        self._remove()


# -- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("rollout") / "tiny")


@pytest.fixture(scope="module")
def two_engines(model_dir: Path) -> Iterator[list[ServerThread]]:
    with serving(model_dir) as a, serving(model_dir) as b:
        yield [a, b]


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()


# -- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [True, False])
async def test_a_worker_with_two_engines_writes_one_valid_record_per_prompt(
    redis_url: str, model_dir: Path, two_engines: list[ServerThread], hf: torch.nn.Module, batch: bool
) -> None:
    """batch: each group's first requests go in one batched /generate (the default), else one per sample."""
    urls = [srv.url for srv in two_engines]
    shared, engine, rollout = configs(model_dir, urls, group_size=3, batch_group_requests=batch)
    stats = await run_worker(redis_url, shared, engine, rollout)
    assert stats.finished and stats.groups_produced == 6
    assert (stats.requests, stats.batch_requests, stats.batch_fallbacks) == (18, 6 if batch else 0, 0)

    groups = await read_records(redis_url, shared)
    assert sorted(g.group_id for g in groups) == sorted(make_group_id("run", 0, i, 0) for i in range(6))
    engine_ids = {srv.url.removeprefix("http://"): srv for srv in two_engines}
    used: set[str] = set()
    for g in groups:
        assert (g.task, g.worker_id, g.attempt, g.epoch) == ("arithmetic", "w0", 0, 0)
        assert g.prompt_id == f"arithmetic/0/train/{g.prompt_index}"
        prompt = list(g.prompt_ids)
        assert len(g.samples) == 3 and sorted(s.sample_index for s in g.samples) == [0, 1, 2]
        for s in g.samples:
            assert 1 <= s.num_tokens() <= 16
            assert (s.versions == 0).all() and (s.loss_mask == 1).all() and s.num_resubmits == 0
            assert s.reward_status == "ok" and set(s.reward_components) == {"correct", "format"}
            assert s.reward == s.reward_components["correct"]  # format_weight 0
            assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, -1)
            assert s.truncated == (s.finish_reason == "length")
            # The request went where the record says, under the documented rid.
            rid = f"{g.group_id}:s{s.sample_index}:r0"
            srv = engine_ids[s.engine_id]
            assert any(rid in rec.rids for rec in srv.engine.scheduler.step_log)
            used.add(s.engine_id)
            # Token ids and log-probs are the engine's, aligned: a teacher-forced forward agrees.
            ref = reference_logprobs(hf, prompt, [int(t) for t in s.output_ids])
            np.testing.assert_allclose(s.logprobs, ref, atol=1e-4)
    assert used == set(engine_ids)  # least-outstanding routing spread the requests over both engines
    counts = await admission_counts(redis_url, shared)
    assert (counts.running, counts.accepted, counts.started) == (0, 6, 6)
    client = connect(redis_url, BROKER)
    try:
        point = await MetricsReader(client, shared).latest("rollout")
    finally:
        await client.aclose()
    assert point["groups_produced"] == 6 and point["samples"] == 18 and point["tokens"] == stats.tokens > 0
    assert point["groups_in_flight"] == 0 and point["engines_healthy"] == 2
    assert {f"engine/{e}/outstanding" for e in engine_ids} <= set(point)


@pytest.mark.parametrize("mask_prefix", [False, True])
async def test_resubmission_after_an_abort_mode_pause_records_both_versions(
    redis_url: str, model_dir: Path, mask_prefix: bool
) -> None:
    with serving(model_dir) as srv:
        shared, engine, rollout = configs(
            model_dir,
            [srv.url],
            group_size=2,
            max_new_tokens=40,
            task=task_config(name="arithmetic", train_size=2),
            mask_resubmitted_prefix=mask_prefix,
        )
        # Hold the scheduler at the 6th decode step: every running sample has partial output by then.
        gate = StepGate(
            srv, lambda rec: rec.kind == "decode" and srv.engine.scheduler.stats.decode_steps >= 6
        )
        worker = asyncio.create_task(run_worker(redis_url, shared, engine, rollout))
        await gate.reached()
        async with aiohttp.ClientSession() as http:

            async def post(path: str, body: dict) -> int:
                async with http.post(srv.url + path, json=body) as resp:
                    return resp.status

            pause = asyncio.create_task(post("/pause_generation", {"mode": "abort"}))
            await asyncio.sleep(0.2)
            gate.release()
            assert await pause == 200  # every in-flight request was answered (aborted, partial output)
            assert (
                await post("/update_weight_version", {"new_version": "1", "abort_all_requests": False}) == 200
            )
            assert await post("/continue_generation", {}) == 200
        stats = await asyncio.wait_for(worker, 60)
    assert stats.resubmits > 0
    samples = [s for g in await read_records(redis_url, shared) for s in g.samples]
    resubmitted = [s for s in samples if s.num_resubmits > 0]
    assert resubmitted, "no sample was resubmitted"
    for s in resubmitted:
        v = s.versions
        switch = int(np.argmax(v == 1))
        assert (
            v[0] == 0 and v[-1] == 1 and switch >= 1
        )  # the old policy's prefix, then the new policy's tokens
        assert (v[:switch] == 0).all() and (v[switch:] == 1).all()
        # Optionally the old policy's prefix is masked out of the loss; by default everything is trained.
        assert list(s.loss_mask) == ([0] * switch + [1] * (len(v) - switch) if mask_prefix else [1] * len(v))
        assert s.timings["requests"] >= 2


async def test_admission_with_eta_0_starts_one_step_of_groups_per_version(
    redis_url: str, model_dir: Path, two_engines: list[ServerThread]
) -> None:
    shared, engine, rollout = configs(
        model_dir, [srv.url for srv in two_engines], eta=0, task=task_config(name="arithmetic", train_size=20)
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(redis_url, shared, engine, rollout, groups_per_step=2, stop=stop))
    client: aioredis.Redis = connect(redis_url, BROKER)
    try:

        async def produced() -> int:
            return await client.xlen(shared.key(BROKER.stream))

        for _ in range(200):  # bounded by counts, not time: the worker stalls at the bound
            if await produced() >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # it would have started more by now if admission let it
        counts = await RedisCounters(client, shared).snapshot()
        assert (counts.started, counts.accepted, counts.running) == (2, 2, 0)
        assert await produced() == 2
        # what the learner does after a step: the engines get version 1, then it is announced with the count of
        # groups its weights contain
        for srv in two_engines:
            srv.engine.set_weight_version("1")
        await PolicyVersion(client, shared, BROKER).publish(1)
        await RedisCounters(client, shared).set_consumed(2)
        for _ in range(200):
            if await produced() >= 4:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        counts = await RedisCounters(client, shared).snapshot()
        assert (counts.started, counts.accepted) == (4, 4) and await produced() == 4
    finally:
        stop.set()
        stats = await asyncio.wait_for(worker, 30)
        await client.aclose()
    assert stats.wait_capacity_s > 0 and not stats.finished


async def test_a_worker_whose_requests_are_all_rejected_stops_and_hands_the_prompts_back(
    redis_url: str, model_dir: Path, two_engines: list[ServerThread]
) -> None:
    """A wrong request (here max_new_tokens beyond the engine's context, a real HTTP 400) would drop every
    prompt of the run one group at a time. After max_rejected_in_a_row rejected groups the worker stops with
    the engine's message, and every later group goes back to the dispatcher instead of the dropped stream: a
    worker with the request fixed then produces all of them."""
    shared, engine, rollout = configs(
        model_dir, [], task=task_config(name="arithmetic", seed=0, train_size=12), max_rejected_in_a_row=4
    )
    with serving(model_dir, max_context_len=16) as short:  # prompts of 4-18 tokens + 16 new never fit
        bad = rollout.model_copy(update={"engine_urls": [short.url]})
        with pytest.raises(RequestsRejected, match=r"4 groups in a row .*maximum context length of 16"):
            await run_worker(redis_url, shared, engine, bad)
    drops = await read_drops(redis_url, shared)
    # at most the 3 rejected before the 4th: groups run side by side, and one whose drop was still being written
    # when the worker stopped is handed back instead; the 4th and later are handed back; none is lost (below)
    assert len(drops) <= 3 and all(d["reason"] == "bad_request" for d in drops), drops
    good = rollout.model_copy(update={"engine_urls": [srv.url for srv in two_engines], "worker_id": "w1"})
    stats = await run_worker(redis_url, shared, engine, good)
    assert stats.finished and stats.groups_produced == 12 - len(drops)  # every prompt handed back is produced
    produced = {g.prompt_index for g in await read_records(redis_url, shared)}
    assert produced | {int(d["prompt_index"]) for d in drops} == set(range(12))
