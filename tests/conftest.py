"""Shared fixtures: real Redis servers started with the project's own embedded-server code."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.config import RedisServerConfig
from broker.server import EmbeddedRedis
from streamrl.supervisor import RANK_ENV

os.environ.setdefault("WANDB_MODE", "disabled")
RENDEZVOUS_AT_START = {name: os.environ.get(name) for name in RANK_ENV}


@pytest.fixture(autouse=True)
def no_distributed_state_left_in_pytest() -> Iterator[None]:
    """A test that initialises torch.distributed in pytest's own process (not in a worker it starts) leaves a bound
    MASTER_PORT and RANK behind for every later test's subprocesses: fail that test, not the 24 after it."""
    yield
    left = {n: os.environ.get(n) for n in RANK_ENV if os.environ.get(n) != RENDEZVOUS_AT_START[n]}
    dist = sys.modules.get("torch.distributed")
    initialized = bool(dist is not None and dist.is_available() and dist.is_initialized())
    if left or initialized:
        for name, value in RENDEZVOUS_AT_START.items():  # the next tests start clean
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if initialized:
            dist.destroy_process_group()
        pytest.fail(
            f"the test left torch.distributed state in pytest's process: env {left}, group {initialized}"
        )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """One real Redis server for the whole session; tests isolate themselves with the `redis_url` fixture."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-session"), RedisServerConfig())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """The session server's URL, flushed before each test so tests never see each other's keys."""
    redis_server.check()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A private Redis server for tests that kill or restart it."""
    server = EmbeddedRedis(tmp_path / "redis", RedisServerConfig())
    server.start()
    yield server
    server.kill()
