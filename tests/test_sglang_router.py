"""The real SGLang router binary (PyPI ``sglang-router``) in front of two built-in engine processes, over real
HTTP: requests spread over both engines and come back token-exact, a rollout worker runs an epoch through it,
a worker's samples aborted by a pause are resubmitted through it with both versions recorded, a rid abort
reaches the engine that holds the request and its partial rollout is resubmitted through the router, an engine
killed under load is routed around, and ``streamrl up`` starts the router as a role."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from broker.registry import engine_id_for
from common.auth import run_secret
from common.config import SharedConfig
from rollout_fleet.config import EngineConfig
from rollout_fleet.fleet import engine_command
from rollout_fleet.generate_client import EngineClient, GenerateResult, SamplingConfig, build_generate_request
from rollout_fleet.model import init_tiny_model
from rollout_fleet.router import Router
from rollout_fleet.sglang_router import healthy_workers, running_router
from tests.test_rollout_worker import configs, read_records, run_worker

pytestmark = pytest.mark.timeout(180)
GREEDY = SamplingConfig(temperature=0.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class EngineProcess:
    url: str
    process: subprocess.Popen

    def finished_requests(self) -> int:
        """The engine's own count of requests it finished (its Prometheus /metrics)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        match = re.search(r"^streamrl_engine_finished_requests\S*\s+([0-9.e+]+)$", text, re.M)
        assert match, "no finished_requests in the engine's /metrics"
        return int(float(match.group(1)))


@contextlib.contextmanager
def engine_processes(model_dir: Path, run_dir: Path, count: int = 2) -> Iterator[list[EngineProcess]]:
    """``count`` built-in engines, each its own ``python -m streamrl engine`` process (the fleet's command)."""
    shared = SharedConfig(run_id="sglrouter", model_path=model_dir, run_dir=run_dir)
    engine = EngineConfig(seed=0, max_context_len=320, max_running_requests=16, health_generation=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    out: list[EngineProcess] = []
    try:
        for i in range(count):
            port = free_port()
            log = open(run_dir / f"engine-{i}.log", "wb")  # noqa: SIM115 - closed with the process
            proc = subprocess.Popen(
                engine_command(shared, engine, port, i), stdout=log, stderr=subprocess.STDOUT
            )
            log.close()
            out.append(EngineProcess(f"http://127.0.0.1:{port}", proc))
        deadline = time.monotonic() + 120
        for e in out:
            while True:
                assert e.process.poll() is None, f"engine {e.url} exited"
                assert time.monotonic() < deadline, f"engine {e.url} did not come up"
                try:
                    with urllib.request.urlopen(f"{e.url}/model_info", timeout=2):
                        break
                except OSError:
                    time.sleep(0.2)
        yield out
    finally:
        for e in out:
            if e.process.poll() is None:
                e.process.send_signal(signal.SIGTERM)
        for e in out:
            try:
                e.process.wait(15)
            except subprocess.TimeoutExpired:
                e.process.kill()
                e.process.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("sglrouter") / "tiny")


@pytest.fixture(scope="module")
def fleet(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[EngineProcess], str]]:
    """Two engine processes and a round-robin sglang-router in front of them (shared by the tests that keep
    both engines alive)."""
    run_dir = tmp_path_factory.mktemp("sglrouter-run")
    with (
        engine_processes(model_dir, run_dir) as engines,
        running_router(
            [e.url for e in engines], free_port(), policy="round_robin", log_path=run_dir / "router.log"
        ) as url,
    ):
        yield engines, url


def prompt(i: int) -> list[int]:
    return [10 + (i * 7 + k * 3) % 80 for k in range(4 + i % 5)]


def long_payload(ids: list[int], budget: int, rid: str) -> dict:
    payload = build_generate_request(ids, GREEDY, budget, rid)
    payload["sampling_params"]["ignore_eos"] = True  # a random tiny model: make the length known
    return payload


async def test_requests_spread_over_both_engines_and_come_back_token_exact(fleet) -> None:
    engines, url = fleet
    before = [e.finished_requests() for e in engines]
    n = 8
    async with aiohttp.ClientSession() as session:
        via = EngineClient(session, url, 60, 10)
        direct = EngineClient(session, engines[0].url, 60, 10)
        payloads = [build_generate_request(prompt(i), GREEDY, 12, f"tok-{i}") for i in range(n)]
        routed: list[GenerateResult] = await asyncio.gather(*(via.generate(p) for p in payloads))
        after = [e.finished_requests() for e in engines]
        served = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(served) == n and min(served) >= n // 2 - 1, served  # round robin: both engines serve
        for p, r in zip(payloads, routed, strict=True):
            mine = await direct.generate({**p, "rid": p["rid"] + "-direct"})
            assert r.rid == p["rid"]  # the router passes the rid through
            assert r.output_ids == mine.output_ids and len(r.output_ids) >= 1
            assert r.logprobs == pytest.approx(mine.logprobs, abs=1e-5)
            assert r.versions == mine.versions


async def test_the_router_rejects_a_batch_of_rids_so_the_worker_sends_samples_alone(
    fleet, redis_url: str, model_dir: Path
) -> None:
    engines, url = fleet
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/generate",
            json={"input_ids": [[5, 6], [5, 6]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 2}},
        ) as resp,
    ):
        assert resp.status == 422  # what rollout.batch_group_requests would meet behind it
    before = [e.finished_requests() for e in engines]
    shared, engine, rollout = configs(
        model_dir,
        [e.url for e in engines],
        run_id="viarouter",
        router="sglang",
        sglang_router_url=url,
        group_size=3,
    )
    stats = await run_worker(redis_url, shared, engine, rollout)
    assert stats.finished and stats.groups_produced == 6 and stats.batch_requests == 0
    assert stats.rejected_requests == 0 and stats.engine_failures == 0
    records = await read_records(redis_url, shared)
    assert sorted(g.prompt_index for g in records) == list(range(6))
    for g in records:
        for s in g.samples:
            assert s.engine_id == engine_id_for(url)  # the router's address: it does not say which engine
            assert s.num_tokens() >= 1 and (s.versions == 0).all() and s.reward_status == "ok"
    served = [a - b for a, b in zip((e.finished_requests() for e in engines), before, strict=True)]
    assert sum(served) == 18 and min(served) >= 1, served


async def test_a_worker_resubmits_samples_aborted_by_a_pause_through_the_router(
    fleet, redis_url: str, model_dir: Path
) -> None:
    """An abort-mode pause of both engines (what a weight update does) while a worker generates through the
    router, then a new version label: the worker resubmits each partial sample (prompt + tokens so far) through
    the router, and the records carry the old version's prefix then the new version's tokens."""
    from rollout_fleet.tasks.config import task_config

    engines, url = fleet
    shared, engine, rollout = configs(
        model_dir,
        [e.url for e in engines],
        run_id="pausedviarouter",
        router="sglang",
        sglang_router_url=url,
        group_size=4,
        max_new_tokens=200,
        task=task_config(name="arithmetic", seed=0, train_size=4),
    )
    old = int((await model_info_of(engines[0].url))["weight_version"])
    worker = asyncio.create_task(run_worker(redis_url, shared, engine, rollout))
    async with aiohttp.ClientSession() as session:
        clients = [EngineClient(session, e.url, 30, 30) for e in engines]
        deadline = time.monotonic() + 30
        while True:  # both engines decoding the worker's samples
            loads = [await c.control("GET", "/v1/loads") for c in clients]
            if all(x["loads"][0]["num_running_reqs"] for x in loads):
                break
            assert time.monotonic() < deadline and not worker.done()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # some tokens generated
        await asyncio.gather(*(c.pause("abort") for c in clients))  # answered: aborted with partial output
        await asyncio.gather(*(c.update_weight_version(old + 1) for c in clients))
        await asyncio.gather(*(c.resume() for c in clients))
    stats = await asyncio.wait_for(worker, 120)
    assert stats.finished and stats.resubmits > 0 and stats.engine_failures == 0
    samples = [s for g in await read_records(redis_url, shared) for s in g.samples]
    resubmitted = [s for s in samples if s.num_resubmits > 0]
    assert resubmitted and len(samples) == 16
    for s in resubmitted:
        v = s.versions
        switch = int(np.argmax(v == old + 1))
        assert v[0] == old and switch >= 1 and (v[:switch] == old).all() and (v[switch:] == old + 1).all()
        assert s.timings["requests"] >= 2 and s.engine_id == engine_id_for(url)


async def model_info_of(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        return await EngineClient(session, url, 10, 10).model_info()


async def test_a_rid_abort_reaches_its_engine_and_the_partial_rollout_is_resubmitted(fleet) -> None:
    engines, url = fleet
    ids, budget = prompt(3), 280
    async with aiohttp.ClientSession() as session:
        router = Router(session, None, request_timeout_s=60, control_timeout_s=5, proxy_url=url)
        for e in engines:
            router.add(e.url)
        await router.probe_all()
        assert router.proxy is not None and router.proxy.healthy and len(router.healthy()) == 2
        handle = await router.acquire(prefer=engine_id_for(engines[1].url))
        assert handle is router.proxy  # prefer does not apply: the sglang-router picks the engine
        task = asyncio.create_task(handle.client.generate(long_payload(ids, budget, "long:r0")))
        deadline = time.monotonic() + 30
        while True:  # until one engine decodes it
            loads = [await EngineClient(session, e.url, 5, 5).control("GET", "/v1/loads") for e in engines]
            if any(x["loads"][0]["num_running_reqs"] for x in loads):
                break
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.01)
        router.abort_later(handle, "long:r0")  # to every engine, directly: the router does not proxy it
        await router.aclose()
        first = await task
        router.release(handle)
        assert first.aborted and 0 < len(first.output_ids) < budget, len(first.output_ids)
        # resubmitted as prompt + tokens so far, through the router, with the rest of the budget
        rest = await router.proxy.client.generate(
            long_payload(ids + first.output_ids, budget - len(first.output_ids), "long:r1")
        )
        assert rest.finish_reason == "length" and len(first.output_ids) + len(rest.output_ids) == budget
        whole = await EngineClient(session, engines[0].url, 60, 5).generate(
            long_payload(ids, budget, "whole")
        )
        assert first.output_ids + rest.output_ids == whole.output_ids  # greedy: the same tokens as one go


def test_a_killed_engine_is_routed_around(model_dir: Path, tmp_path: Path) -> None:
    """kill -9 of one engine under load: the router retries what the dead engine was generating on the live one
    (from the prompt: the client never saw the lost tokens), so every in-flight request is answered in full; new
    requests all go to the live engine, and the router's health check takes the dead one out."""

    async def scenario(engines: list[EngineProcess], url: str) -> None:
        async with aiohttp.ClientSession() as session:
            via = EngineClient(session, url, 60, 10)
            inflight = [
                asyncio.create_task(via.generate(long_payload(prompt(i), 200, f"k{i}"))) for i in range(4)
            ]
            deadline = time.monotonic() + 30
            while True:  # both engines decoding
                loads = [
                    await EngineClient(session, e.url, 5, 5).control("GET", "/v1/loads") for e in engines
                ]
                if all(x["loads"][0]["num_running_reqs"] for x in loads):
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            os.kill(engines[1].process.pid, signal.SIGKILL)
            outcomes = await asyncio.gather(*inflight, return_exceptions=True)
            done = [o for o in outcomes if isinstance(o, GenerateResult)]
            errors = [o for o in outcomes if not isinstance(o, GenerateResult)]
            assert not errors, errors
            for o in done:
                assert o.finish_reason == "length" and len(o.output_ids) == 200
            assert engines[0].finished_requests() == 4  # its own two and the two it took over
            before = engines[0].finished_requests()
            again = await asyncio.gather(
                *(via.generate(build_generate_request(prompt(i), GREEDY, 8, f"after{i}")) for i in range(6))
            )
            assert all(len(r.output_ids) >= 1 for r in again)
            assert engines[0].finished_requests() - before == 6  # every new request went to the live engine

    with (
        engine_processes(model_dir, tmp_path) as engines,
        running_router(
            [e.url for e in engines],
            free_port(),
            policy="round_robin",
            health_check_interval_s=1,
            log_path=tmp_path / "router.log",
        ) as url,
    ):
        asyncio.run(scenario(engines, url))
        deadline = time.monotonic() + 30
        while healthy_workers(url) != [engines[0].url]:  # 3 failed probes a second apart
            assert time.monotonic() < deadline, healthy_workers(url)
            time.sleep(0.5)


def test_up_starts_the_router_as_a_role_after_the_engines(fleet, model_dir: Path, tmp_path: Path) -> None:
    """``rollout.router = sglang`` with no URL: ``streamrl up`` picks the router's port, points every worker at
    it, and starts ``streamrl router`` (a real process, the router binary by exec) before the learner, ready when
    the router counts every engine healthy; with an external URL it starts none."""
    from streamrl.config import StreamRLConfig
    from streamrl.up import child_specs, resolve, write_config

    engines, _ = fleet
    # With the run secret on: the router gets --api-key (sent to the engines, which ignore it here), and
    # requires it of its own clients, up's readiness check included.
    shared = {"model_path": str(model_dir), "run_dir": str(tmp_path), "auth": "on"}
    cfg = StreamRLConfig.model_validate({"shared": shared, "rollout": {"router": "sglang"}})
    cfg = resolve(cfg)
    port = cfg.rollout.sglang_router_port
    assert port > 0 and cfg.rollout.sglang_router_url == f"http://127.0.0.1:{port}"
    cfg.rollout.engine_urls = [e.url for e in engines]  # the module's engines stand in for up's
    write_config(cfg)
    before, _ = child_specs(cfg, tmp_path / "config.toml")
    *earlier, last = [[s.name for s in stage] for stage in before]
    assert last[-1] == "router" and any(
        "engine-0" in stage for stage in earlier
    )  # once the engines are ready
    spec = before[-1][-1]
    assert spec.ready is not None and spec.ready() is False
    proc = subprocess.Popen(spec.argv)
    try:
        deadline = time.monotonic() + 60
        while not spec.ready():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.25)
        key = run_secret(cfg.shared)
        assert sorted(healthy_workers(cfg.rollout.sglang_router_url, api_key=key)) == sorted(
            e.url for e in engines
        )
        with pytest.raises(urllib.error.HTTPError, match="401"):
            healthy_workers(cfg.rollout.sglang_router_url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    external = StreamRLConfig.model_validate(
        {
            "shared": {"model_path": str(model_dir), "run_dir": str(tmp_path)},
            "rollout": {"router": "sglang", "sglang_router_url": "http://10.0.0.9:8000"},
        }
    )
    external = resolve(external)
    assert external.rollout.sglang_router_url == "http://10.0.0.9:8000"
    assert "router" not in [
        s.name for stage in child_specs(external, tmp_path / "config.toml")[0] for s in stage
    ]
