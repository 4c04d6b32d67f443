"""``streamrl rollout``: one rollout worker process.

``run_rollout(shared, broker, engine, rollout, groups_per_step)`` runs a worker on a uvloop event loop until
SIGTERM / SIGINT (it then drains: no new groups, in-flight ones get ``rollout.drain_timeout_s`` to finish, the
rest are handed back to the dispatch) or until every prompt of ``rollout.max_epochs`` epochs is done. It returns
the process exit code. ``groups_per_step`` is the learner's (``learner.groups_per_step``): the admission bound
counts in learner steps.

Engines: ``rollout.engine_urls`` when given (registered in the engine registry); else the registry's engines
when it has any; else ``engine.count`` engines at ``engine.host:engine.base_port + i``. With
``rollout.launch_engines`` the worker launches those engines itself (:class:`~rollout_fleet.fleet.Fleet`) and
stops them on exit. ``rollout.workers`` processes are started by ``streamrl up``; each runs one worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis
import uvloop

from broker.admission import RedisCounters
from broker.client import connect
from broker.config import BrokerConfig
from broker.metrics import MetricsWriter
from broker.producer import Producer
from broker.registry import EngineRegistry
from broker.staleness import StalenessManager
from common.auth import auth_headers, run_secret
from common.config import SharedConfig
from common.configlib import ConfigError
from common.discovery import RedisNotFound, resolve_redis_url
from rollout_fleet.config import EngineConfig, RolloutConfig
from rollout_fleet.dispatch import DispatchMismatch, PromptDispatcher
from rollout_fleet.envs.base import EnvironmentTask
from rollout_fleet.fleet import Fleet, FleetError
from rollout_fleet.rewards import RewardPool
from rollout_fleet.router import Router
from rollout_fleet.sandbox import check_sandbox
from rollout_fleet.tasks import TRAIN, TaskError
from rollout_fleet.tasks.config import build_task
from rollout_fleet.worker import Coordination, RequestsRejected, RolloutWorker, VersionCache, WorkerSettings
from rollout_fleet.workflows import build_workflow
from rollout_fleet.workflows.base import Scorer, WorkflowContext
from rollout_fleet.workflows.stats import WorkerStats

log = logging.getLogger("streamrl.rollout")


def default_worker_id() -> str:
    """``host-pid-random``, with anything but letters, digits, '.', '_' and '-' replaced (no ':')."""
    raw = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)


def load_tokenizer(path: Path):  # noqa: ANN201 - a transformers tokenizer
    """The model's tokenizer from a local directory (never the hub)."""
    from rollout_fleet.model import load_tokenizer as load

    return load(path)


def tokenizer_path(shared: SharedConfig, engine: EngineConfig, rollout: RolloutConfig) -> Path:
    path = rollout.tokenizer_path or engine.model_path or shared.model_path
    if path is None:
        raise ConfigError("no tokenizer: set rollout.tokenizer_path, engine.model_path or shared.model_path")
    return Path(path)


def scorer_of(rollout: RolloutConfig) -> tuple[str, dict]:
    """The reward pool's scorer: a custom function by import path, else the task's verifier by name."""
    if rollout.reward.function:
        return rollout.reward.function, {}
    return rollout.task.name, rollout.task.options()


def training_scorer(rewards: RewardPool, rollout: RolloutConfig) -> Scorer:
    """What every training sample is scored with: :func:`scorer_of` on ``rewards``, shaped by DAPO's overlong
    punishment when ``rollout.reward.overlong_buffer`` is set."""
    name, options = scorer_of(rollout)
    shaping = rollout.reward.overlong_buffer, rollout.reward.overlong_penalty_factor
    return Scorer(rewards, name, dict(options), *shaping)


def sglang_router_url(rollout: RolloutConfig) -> str | None:
    """The sglang-router every request goes through (``rollout.router = "sglang"``), else None."""
    if rollout.router != "sglang":
        return None
    if not rollout.sglang_router_url:
        raise ConfigError(
            "rollout.router = 'sglang' needs rollout.sglang_router_url (streamrl up starts a router and sets it)"
        )
    return rollout.sglang_router_url


async def engine_urls(
    registry: EngineRegistry, engine: EngineConfig, rollout: RolloutConfig, fleet: Fleet | None
) -> list[str]:
    """The engines to register and route to (see the module docstring)."""
    if fleet is not None:
        return fleet.urls
    if rollout.engine_urls:
        return list(rollout.engine_urls)
    if await registry.list():
        return []
    return [f"http://{engine.host}:{engine.base_port + i}" for i in range(engine.count)]


@contextlib.asynccontextmanager
async def open_worker(
    shared: SharedConfig,
    broker: BrokerConfig,
    engine: EngineConfig,
    rollout: RolloutConfig,
    groups_per_step: int,
    redis_url: str,
    *,
    fleet: Fleet | None = None,
    tokenizer: object | None = None,
    adapter_name: Callable[[int], str] | None = None,
) -> AsyncIterator[RolloutWorker]:
    """A ready worker (engines registered and probed, reward pool started); everything is closed on exit."""
    worker_id = rollout.worker_id or default_worker_id()
    tok = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_path(shared, engine, rollout))
    task = build_task(rollout.task, tok)
    if isinstance(task, EnvironmentTask):
        task.sandbox = rollout.sandbox
        if task.uses_sandbox:  # refuse to start with isolation the config asks for and the host cannot give
            log.info("tool sandbox: %s", await check_sandbox(rollout.sandbox))
        checked = await task.check()  # e.g. an OpenEnv server that does not answer: a clear error now
        if checked:
            log.info("environment: %s", checked)
    client: aioredis.Redis = connect(redis_url, broker)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), headers=auth_headers(run_secret(shared))
    )
    rewards = RewardPool(
        workers=rollout.reward.workers,
        timeout_s=rollout.reward.timeout_s,
        load_timeout_s=rollout.reward.load_timeout_s,
        start_method=rollout.reward.start_method,
        max_memory_bytes=rollout.reward.max_memory_bytes,
    )
    router: Router | None = None
    try:
        registry = EngineRegistry(client, shared)
        versions = VersionCache(client, shared, broker, rollout.version_poll_s)
        router = Router(
            session,
            registry,
            request_timeout_s=rollout.request_timeout_s,
            control_timeout_s=shared.http_timeout_s,
            health_interval_s=rollout.health_interval_s,
            no_engine_timeout_s=rollout.no_engine_timeout_s,
            # never generate on weights the learner would drop as stale against the published policy
            too_old=versions.too_old,
            proxy_url=sglang_router_url(rollout),
        )
        for url in await engine_urls(registry, engine, rollout, fleet):
            await registry.register(url, source=f"worker {worker_id}", overwrite=False)
        await versions.refresh()
        await router.refresh()
        await router.probe_all()
        admission = StalenessManager(
            eta=shared.eta,
            groups_per_step=groups_per_step,
            max_concurrent=rollout.max_concurrent_groups * rollout.workers,
            counters=RedisCounters(client, shared),
        )
        dispatch = PromptDispatcher(
            client,
            shared,
            broker,
            admission,
            num_prompts=task.num_prompts(TRAIN),
            worker_id=worker_id,
            seed=rollout.shuffle_seed,
            task=f"{task.name}/{getattr(task, 'version', '')}",
            lease_ttl_s=rollout.lease_ttl_s,
            max_epochs=rollout.max_epochs,
        )
        await rewards.start()
        context = WorkflowContext(task, tok, rollout, training_scorer(rewards, rollout), WorkerStats())
        coordination = Coordination(
            client,
            dispatch,
            admission,
            versions,
            Producer(client, shared, broker, producer_id=worker_id),
            MetricsWriter(client, shared, "rollout", maxlen=broker.metrics_maxlen),
        )
        yield RolloutWorker(
            WorkerSettings(shared, rollout, worker_id),
            coordination,
            build_workflow(context, router, versions, adapter_name),
        )
    finally:
        if router is not None:
            await router.aclose()
        rewards.close()
        await session.close()
        await client.aclose()


async def _serve(
    shared: SharedConfig,
    broker: BrokerConfig,
    engine: EngineConfig,
    rollout: RolloutConfig,
    groups_per_step: int,
    adapter_name: Callable[[int], str] | None,
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    redis_url = await asyncio.to_thread(resolve_redis_url, shared, 60.0)
    fleet: Fleet | None = None
    fleet_stop = asyncio.Event()
    supervisor: asyncio.Task | None = None
    try:
        if rollout.launch_engines:
            fleet = Fleet(shared, engine, EngineRegistry(connect(redis_url, broker), shared))
            await fleet.start()
            supervisor = asyncio.create_task(fleet.supervise(fleet_stop))
        async with open_worker(
            shared,
            broker,
            engine,
            rollout,
            groups_per_step,
            redis_url,
            fleet=fleet,
            adapter_name=adapter_name,
        ) as worker:
            log.info(
                "worker %s: %d engine(s), group_size %d, eta %d, groups_per_step %d",
                worker.worker_id,
                len(worker.router.engines),
                rollout.group_size,
                shared.eta,
                groups_per_step,
            )
            stats = await worker.run(stop)
            log.info(
                "worker %s stopped: %d groups produced, %d dropped, %d handed back%s",
                worker.worker_id,
                stats.groups_produced,
                sum(stats.groups_dropped.values()),
                stats.groups_handed_back,
                " (all epochs done)" if worker.finished else "",
            )
    finally:
        fleet_stop.set()
        if supervisor is not None:
            await asyncio.gather(supervisor, return_exceptions=True)
        if fleet is not None:
            await fleet.stop()
            await fleet.registry.client.aclose()  # type: ignore[union-attr]
    return 0


def run_rollout(
    shared: SharedConfig,
    broker: BrokerConfig,
    engine: EngineConfig,
    rollout: RolloutConfig,
    groups_per_step: int = 1,
    adapter_name: Callable[[int], str] | None = None,
) -> int:
    """Run one rollout worker on uvloop until SIGTERM / SIGINT or ``rollout.max_epochs``; the exit code.

    ``adapter_name``: with LoRA served by adapter name (SGLang), the name of a policy version's adapter, which
    every request then carries as ``lora_path``."""
    if groups_per_step < 1:
        log.error("groups_per_step = %d: must be >= 1", groups_per_step)
        return 2
    # The worker runs no torch compute; a library that imports torch later still gets the configured threads.
    os.environ.setdefault("OMP_NUM_THREADS", str(shared.torch_threads))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(shared.torch_threads)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(shared, broker, engine, rollout, groups_per_step, adapter_name))
    except (ConfigError, TaskError, DispatchMismatch, FleetError, RedisNotFound, OSError) as exc:
        log.error("rollout worker cannot run: %s", exc)
        return 2
    except RequestsRejected as exc:
        log.error("rollout worker stopped: %s", exc)
        return 2
