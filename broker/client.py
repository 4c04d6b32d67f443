"""Connections to Redis and the names of every broker key.

:func:`connect` builds a ``redis.asyncio.Redis`` that survives a Redis restart: every command is retried on
connection errors and timeouts with exponential back-off (capped at 2 s), and a health check pings idle
connections. Retrying is safe because every write the broker makes is idempotent (Lua scripts keyed by group
id, XACK, guarded version publication). Lua scripts are registered ``Script`` objects, which re-load
themselves on ``NOSCRIPT`` after the restarted server has lost its script cache.

A retried XREADGROUP can lose a reply whose entries the server already recorded as delivered; the consumer
detects reconnects with :func:`connection_stats` and re-fetches its own pending entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

from broker.config import BrokerConfig, SharedConfig

BACKOFF_CAP_S = 2.0


@dataclass
class ConnectionStats:
    """How many connections a client has opened: a count above the pool's concurrency means reconnects."""

    connects: int = 0


def connect(url: str, config: BrokerConfig | None = None) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` with retries, back-off, health checks and socket timeouts from
    ``config``. Responses are bytes (payloads are binary)."""
    cfg = config or BrokerConfig()
    stats = ConnectionStats()

    async def on_connect(conn: aioredis.connection.AbstractConnection) -> None:
        stats.connects += 1
        await conn.on_connect()

    retry = Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=cfg.retry_backoff_s), cfg.retry_attempts)
    client = aioredis.Redis.from_url(
        url,
        retry=retry,
        retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError],
        health_check_interval=cfg.health_check_interval_s,
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=cfg.socket_timeout_s,
        socket_keepalive=True,
        redis_connect_func=on_connect,
        decode_responses=False,
    )
    client.streamrl_stats = stats  # type: ignore[attr-defined]
    return client


def connection_stats(client: aioredis.Redis) -> ConnectionStats:
    """The reconnect counter of a client made by :func:`connect` (a fresh zero one for any other client)."""
    return getattr(client, "streamrl_stats", ConnectionStats())


@dataclass(frozen=True)
class BrokerKeys:
    """Every Redis key the broker uses, namespaced by run through ``SharedConfig.key``."""

    stream: str  # the trajectory stream: fields v (schema version), gid (group id), d (msgpack payload)
    group_ids: str  # hash group id -> entry id of every group the producer path accepted (idempotence)
    acked_prefix: str  # + consumer group: set of group ids that group acknowledged (duplicate recognition)
    backlog: str  # counter: entries produced and not yet acknowledged by the learner's group
    dead_letter: str  # stream of entries that failed to decode/validate or were delivered too often
    dropped: str  # durable stream of groups dropped by the learner, with the reason
    dropped_index: str  # hash group id -> entry id in the dropped stream (the ledger is keyed by group id)
    counters: str  # hash of broker counters that dashboards read
    version: str  # the published policy version
    version_token: str  # the token of the last publication, so a retried publish is recognised
    control: str  # control stream of version announcements (also the pub/sub channel name)

    @classmethod
    def of(cls, shared: SharedConfig, config: BrokerConfig) -> BrokerKeys:
        s = config.stream
        return cls(
            stream=shared.key(s),
            group_ids=shared.key(f"{s}:gids"),
            acked_prefix=shared.key(f"{s}:acked:"),
            backlog=shared.key(f"{s}:backlog"),
            dead_letter=shared.key(config.dead_letter_stream),
            dropped=shared.key(config.dropped_stream),
            dropped_index=shared.key(f"{config.dropped_stream}:index"),
            counters=shared.key("broker:counters"),
            version=shared.key("policy_version"),
            version_token=shared.key("policy_version:token"),
            control=shared.key(config.control_stream),
        )

    def acked(self, consumer_group: str) -> str:
        """The set of group ids that ``consumer_group`` has acknowledged."""
        return self.acked_prefix + consumer_group
