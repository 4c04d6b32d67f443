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

import ctypes
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

from broker.config import BrokerConfig
from common.config import SharedConfig

BACKOFF_CAP_S = 2.0


@dataclass
class ConnectionStats:
    """How many connections a client has opened: a count above the pool's concurrency means reconnects."""

    connects: int = 0


CLIENT_NAME = "streamrl"  # CLIENT SETNAME of every role's connections: the embedded Redis stops after them
LEARNER_CLIENT_NAME = "streamrl-learner"


def connect(url: str, config: BrokerConfig | None = None, name: str = CLIENT_NAME) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` with retries, back-off, health checks and socket timeouts from
    ``config``; ``name`` (CLIENT SETNAME) starts with ``streamrl``. Responses are bytes (payloads are binary)."""
    cfg = config or BrokerConfig()
    if cfg.tune_allocator:
        tune_allocator()
    stats = ConnectionStats()

    async def on_connect(conn: aioredis.connection.AbstractConnection) -> None:
        stats.connects += 1
        await conn.on_connect()
        _keep_reader_buffer(conn)

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
        client_name=name,
    )
    client.streamrl_stats = stats  # type: ignore[attr-defined]
    return client


def connection_stats(client: aioredis.Redis) -> ConnectionStats:
    """The reconnect counter of a client made by :func:`connect` (a fresh zero one for any other client)."""
    return getattr(client, "streamrl_stats", ConnectionStats())


# hiredis frees its read buffer whenever it is empty and larger than 16 KiB, so every large reply (a payload of
# a megabyte) regrows it from nothing: measured 0.1 ms per megabyte reply with the buffer kept, up to 1.4 ms
# without (fresh pages). Keep buffers up to this size.
READER_MAX_BUFFER = 64 * 2**20


# glibc serves allocations above a dynamic threshold (128 KiB at first) with mmap and unmaps them on free, so
# payload-sized buffers (encode, reply, decode) keep landing on fresh pages: on the development VM, copying an
# 850 KB payload into a fresh buffer took 1.1 ms, into a reused one 0.2 ms. A fixed 32 MiB mmap threshold
# (glibc's maximum) and a 256 MiB trim threshold keep freed buffers in the heap for reuse. Process-wide, once.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_allocator_tuned = False


def tune_allocator() -> bool:
    """Keep large freed buffers for reuse (glibc mallopt); True if applied. Idempotent; a no-op off glibc."""
    global _allocator_tuned
    if _allocator_tuned:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, 256 * 2**20) == 1
        )
    except (OSError, AttributeError):
        return False
    _allocator_tuned = ok
    return ok


def _keep_reader_buffer(conn: aioredis.connection.AbstractConnection) -> None:
    reader = getattr(getattr(conn, "_parser", None), "_reader", None)
    if reader is not None and hasattr(reader, "setmaxbuf"):
        reader.setmaxbuf(READER_MAX_BUFFER)


@dataclass(frozen=True)
class BrokerKeys:
    """Every Redis key the broker uses, namespaced by run through ``SharedConfig.key``."""

    stream: str  # the trajectory stream: fields v (schema version), gid (group id), d (msgpack payload)
    group_ids: str  # hash group id -> entry id of every group the producer path accepted (idempotence)
    payload_prefix: str  # + group id + ":" + token: a large payload stored beside its (small) stream entry
    acked_prefix: str  # + consumer group: set of group ids that group acknowledged (duplicate recognition)
    backlog: str  # counter: entries produced and not yet acknowledged by the learner's group
    dead_letter: str  # stream of entries that failed to decode/validate or were delivered too often
    dropped: str  # durable stream of groups dropped by the learner, with the reason
    dropped_index: str  # hash group id -> entry id in the dropped stream (the ledger is keyed by group id)
    outcomes: (
        str  # hash group id -> the group's final outcome (broker.outcomes): trained, dropped, dead-lettered
    )
    outcome_conflicts: str  # hash group id -> a second outcome that differed from the first (trained twice)
    counters: str  # hash of broker counters that dashboards read
    version: str  # the published policy version
    version_token: str  # the token of the last publication, so a retried publish is recognised
    lineage: (
        str  # hash version -> resume point (broker.staleness.Lineage): the weights a resumed version holds
    )
    control: str  # control stream of version announcements (also the pub/sub channel name)
    retired: (
        str  # list "gid|position|entry id" of groups nothing but the audit reads any more (broker.retention)
    )
    pruned: str  # hash: counts of the pruned groups by outcome, which the audit adds to the live ones
    archive_recent: str  # list of the latest samples the archiver read, JSON (the dashboard's live viewer)
    archive_status: str  # hash: the archiver's counters and its last error (archiver.archive)

    @classmethod
    def of(cls, shared: SharedConfig, config: BrokerConfig) -> BrokerKeys:
        s = config.stream
        return cls(
            stream=shared.key(s),
            group_ids=shared.key(f"{s}:gids"),
            payload_prefix=shared.key(f"{s}:payload:"),
            acked_prefix=shared.key(f"{s}:acked:"),
            backlog=shared.key(f"{s}:backlog"),
            dead_letter=shared.key(config.dead_letter_stream),
            dropped=shared.key(config.dropped_stream),
            dropped_index=shared.key(f"{config.dropped_stream}:index"),
            outcomes=shared.key("outcomes"),
            outcome_conflicts=shared.key("outcomes:conflicts"),
            counters=shared.key("broker:counters"),
            version=shared.key("policy_version"),
            version_token=shared.key("policy_version:token"),
            lineage=shared.key("policy_version:lineage"),
            control=shared.key(config.control_stream),
            retired=shared.key(f"{s}:retired"),
            pruned=shared.key("outcomes:pruned"),
            archive_recent=shared.key("archive:recent"),
            archive_status=shared.key("archive:status"),
        )

    def acked(self, consumer_group: str) -> str:
        """The set of group ids that ``consumer_group`` has acknowledged."""
        return self.acked_prefix + consumer_group

    def payload(self, group_id: str, token: str) -> str:
        """The key of one send attempt's payload (unique per attempt, so no attempt overwrites another's)."""
        return f"{self.payload_prefix}{group_id}:{token}"
