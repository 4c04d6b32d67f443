"""Shared fixtures: real Redis servers started with the project's own embedded-server code."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.config import RedisServerConfig
from broker.server import EmbeddedRedis

os.environ.setdefault("WANDB_MODE", "disabled")


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
