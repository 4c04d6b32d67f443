"""The engine registry (real Redis) and the router (real HTTP engines): least outstanding among healthy engines,
sticky resubmits, failed engines out of routing and back after a probe, liveness that works while paused."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from broker.client import connect
from broker.config import BrokerConfig
from broker.registry import EngineRegistry, RegistryError, engine_id_for
from broker.staleness import check_staleness
from broker.version import PolicyVersion
from common.config import SharedConfig
from common.versioning import Lineage, ResumePoint
from rollout_fleet.engine.core import Engine
from rollout_fleet.engine.server import ServerThread
from rollout_fleet.main import open_worker
from rollout_fleet.model import init_tiny_model
from rollout_fleet.router import NoEngineAvailable, Router
from tests.test_rollout_worker import BROKER, configs, serving

pytestmark = pytest.mark.timeout(60)
SHARED = SharedConfig(run_id="route")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = connect(redis_url, BrokerConfig())
    yield c
    await c.aclose()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("routing") / "tiny")


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[ServerThread]:
    with serving(model_dir, max_running_requests=4) as srv:
        yield srv


def router_for(session: aiohttp.ClientSession, registry: EngineRegistry | None) -> Router:
    return Router(
        session,
        registry,
        request_timeout_s=30,
        control_timeout_s=2.0,
        health_interval_s=0.1,
        no_engine_timeout_s=5.0,
    )


async def test_registry_entries_merge_and_are_validated(client) -> None:
    reg = EngineRegistry(client, SHARED)
    a = await reg.register(
        "127.0.0.1:30001/", ranks=2, kind="sglang", source="fleet", pid=7, health="starting"
    )
    assert (a.engine_id, a.url, a.ranks, a.health, a.pid) == (
        "127.0.0.1:30001",
        "http://127.0.0.1:30001",
        2,
        "starting",
        7,
    )
    # A worker naming the same engine does not clobber what the fleet wrote.
    again = await reg.register("http://127.0.0.1:30001", source="worker w", overwrite=False)
    assert (again.ranks, again.source, again.kind) == (2, "fleet", "sglang")
    updated = await reg.update("127.0.0.1:30001", health="healthy", weight_version=3, last_seen=1.5)
    assert (updated.health, updated.weight_version, updated.last_seen, updated.pid) == ("healthy", 3, 1.5, 7)
    assert await reg.update("127.0.0.1:9", health="healthy") is None  # never resurrects an unknown engine
    await reg.register("http://127.0.0.1:30000")
    assert [e.engine_id for e in await reg.list()] == ["127.0.0.1:30000", "127.0.0.1:30001"]
    with pytest.raises(RegistryError, match="health = 'fine'"):
        await reg.update("127.0.0.1:30000", health="fine")
    with pytest.raises(RegistryError, match="ranks = 0"):
        await reg.register("http://127.0.0.1:30002", ranks=0)
    with pytest.raises(RegistryError, match="http://host:port"):
        engine_id_for("nowhere")
    assert await reg.remove("127.0.0.1:30000") and [e.engine_id for e in await reg.list()] == [
        "127.0.0.1:30001"
    ]


async def test_routing_prefers_healthy_least_loaded_and_sticky_engines(client, live: ServerThread) -> None:
    reg = EngineRegistry(client, SHARED)
    dead_url = f"http://127.0.0.1:{free_port()}"
    for url in (live.url, dead_url):
        await reg.register(url)
    async with aiohttp.ClientSession() as session:
        router = router_for(session, reg)
        await router.refresh()
        await router.probe_all()
        live_id, dead_id = engine_id_for(live.url), engine_id_for(dead_url)
        assert [h.engine_id for h in router.healthy()] == [live_id]
        entry = await reg.get(live_id)
        assert (entry.health, entry.weight_version) == ("healthy", 0) and entry.last_seen > 0
        assert (await reg.get(dead_id)).health == "unknown"  # never seen alive: nothing to report yet

        # A second live engine (registered while the router runs): least outstanding wins, sticky beats it.
        await reg.register(f"http://127.0.0.1:{live.port}".replace("127.0.0.1", "localhost"))
        await router.refresh()
        await router.probe_all()
        other_id = f"localhost:{live.port}"
        first = await router.acquire()
        second = await router.acquire()
        assert {first.engine_id, second.engine_id} == {live_id, other_id}
        third = await router.acquire(prefer=first.engine_id)
        assert third is first and first.outstanding == 2 and second.outstanding == 1
        for h in (first, second, third):
            router.release(h)

        # A failure takes an engine out at once; a successful probe puts it back.
        assert router.mark_failed(first, "connection reset")
        assert (await router.acquire(prefer=first.engine_id)).engine_id == second.engine_id
        router.release(second)
        await asyncio.sleep(0.1)  # the registry write is a background task
        assert (await reg.get(first.engine_id)).health == "unhealthy"
        await router.probe(first)
        assert first.healthy and (await reg.get(first.engine_id)).health == "healthy"

        # Removed from the registry: out of routing.
        await reg.remove(other_id)
        await router.refresh()
        assert other_id not in router.engines


async def test_acquire_waits_for_an_engine_to_come_back_then_gives_up(model_dir: Path) -> None:
    port = free_port()
    async with aiohttp.ClientSession() as session:
        router = router_for(session, None)
        handle = router.add(f"http://127.0.0.1:{port}")
        await router.probe_all()
        with pytest.raises(NoEngineAvailable, match=f"127.0.0.1:{port}"):
            await router.acquire(timeout_s=0.3)
        stop = asyncio.Event()
        checks = asyncio.create_task(router.run_health_checks(stop))
        waiting = asyncio.create_task(router.acquire(timeout_s=30))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        engine = Engine(model_dir, max_running_requests=2, max_context_len=64).start()
        server = ServerThread(engine, port=port).start()  # the engine comes (back) on its port
        try:
            assert await asyncio.wait_for(waiting, 10) is handle and handle.outstanding == 1
        finally:
            stop.set()
            await checks
            server.stop()
            engine.shutdown()


async def test_a_paused_engine_stays_live_for_the_router(live: ServerThread) -> None:
    async with aiohttp.ClientSession() as session:
        router = router_for(session, None)
        handle = router.add(live.url)
        await handle.client.pause("retract")  # no forward pass runs: /health would hang then answer 503
        try:
            assert await asyncio.wait_for(router.probe(handle), 5) and handle.healthy
        finally:
            await handle.client.resume()


async def test_an_engine_behind_the_staleness_bound_is_not_routed_until_it_catches_up(
    model_dir: Path,
) -> None:
    """A restarted engine serves its initial weights (version 0) while the run is at version 5: with eta 1 no
    request may go to it until the learner brings it to version 4 or later."""
    published = [5]
    with serving(model_dir) as fresh, serving(model_dir) as current:
        current.engine.set_weight_version("5")
        async with aiohttp.ClientSession() as session:
            router = Router(
                session,
                None,
                request_timeout_s=30,
                control_timeout_s=2.0,
                health_interval_s=60,  # no periodic probe: only the ones the test asks for
                no_engine_timeout_s=5.0,
                too_old=lambda version: Lineage().behind(published[0], version, eta=1),
            )
            behind, ok = router.add(fresh.url), router.add(current.url)
            await router.probe_all()
            assert behind.healthy and router.behind(behind) and not router.behind(ok)
            picks = set()
            for _ in range(6):
                handle = await router.acquire()
                picks.add(handle.url)
                router.release(handle)
            assert picks == {current.url}  # only the engine within the bound
            assert router.stats()[f"engine/{behind.engine_id}/behind"] == 1.0
            assert router.pick(prefer=behind.engine_id) is ok  # not even a sticky resubmit goes there

            # the learner syncs version 5 to it; a new version is announced and the router re-probes at once
            current.engine.set_weight_version("6")
            published[0] = 6
            assert router.routable() == [ok]  # 5 is within eta 1 of 6; the fresh one is not probed yet
            fresh.engine.set_weight_version("6")
            router.recheck_behind()
            await router.aclose()
            assert not router.behind(behind) and {h.url for h in router.routable()} == {
                fresh.url,
                current.url,
            }

            # an answer with a lower version than known (a restart between probes) triggers a probe
            fresh.engine.set_weight_version("0")
            router.observe(behind, 0)
            await router.aclose()
            assert router.behind(behind) and behind.weight_version == 0


async def test_after_a_resume_from_an_older_checkpoint_the_engine_bound_agrees_with_the_learner(
    model_dir: Path, redis_url: str
) -> None:
    """A run published versions up to 10, crashed, and resumed from its checkpoint of version 6 as version 11
    (what the learner's resume records: 11 holds the weights of position 6, 4 positions rolled back). eta 1.

    By hand: an engine still serving version 7 (position 7) is 6 - 7 = -1 position from the published weights,
    within eta + 4; the learner keeps its tokens, so the worker routes to it, although the raw bound
    (11 - eta = 10) left it out. An engine that restarted on version 0 (position 0) is 6 positions behind, more
    than 1 + 4: both the learner and the worker refuse it. The worker's bound is the one ``open_worker`` wires."""
    shared = SharedConfig(run_id="resumed", eta=1)
    client = connect(redis_url, BROKER)
    policy = PolicyVersion(client, shared, BROKER)
    await policy.publish(10)
    lineage = (await policy.lineage()).resumed(version=11, restored=6, published=10)
    assert lineage.points == (ResumePoint(11, 6, 4),)
    await policy.record_resume(lineage.points[-1])  # as the learner does: the lineage before the version
    await policy.publish(11)
    try:
        with serving(model_dir) as restarted, serving(model_dir) as lagging, serving(model_dir) as current:
            lagging.engine.set_weight_version("7")
            current.engine.set_weight_version("11")
            urls = [restarted.url, lagging.url, current.url]
            shared, engine, rollout = configs(model_dir, urls, run_id="resumed", eta=1, health_interval_s=60)
            async with open_worker(shared, BROKER, engine, rollout, 4, redis_url) as worker:
                router = worker.router
                assert worker.versions.value == 11 and worker.versions.lineage == lineage
                assert {h.url for h in router.routable()} == {lagging.url, current.url}
                raw_bound = 11 - shared.eta  # before: engines below the published version minus eta were out
                assert raw_bound > 7
                assert check_staleness(11, shared.eta, 7, lineage).keep
                assert check_staleness(11, shared.eta, 0, lineage).reason == "stale"
                picks = set()
                for _ in range(6):
                    handle = await router.acquire()
                    picks.add(handle.url)
                    router.release(handle)
                assert restarted.url not in picks and lagging.url in picks

                # the learner trains on (12, 13 at positions 7, 8): for every engine version, at every published
                # version, the worker refuses an engine exactly when the learner would drop its tokens as stale
                for published in (11, 12, 13):
                    if published > 11:
                        await policy.publish(published)
                    await worker.versions.refresh()
                    for version in range(published + 1):
                        stale = check_staleness(published, shared.eta, version, lineage).reason == "stale"
                        assert worker.versions.too_old(version) == stale, (published, version)
                # at 13 (position 8) the lagging engine is 1 behind, allowed 1 + 4; version 2 is 6 behind: stale
                assert not worker.versions.too_old(7) and worker.versions.too_old(2)
    finally:
        await client.aclose()
