"""The root of the config tree: assembles each role's section and checks the rules that span roles."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from archiver.config import ArchiveConfig
from broker.config import BrokerConfig, RedisServerConfig
from common.auth import is_loopback
from common.config import SharedConfig
from common.configlib import Section, load_config
from common.versioning import admission_capacity
from learner.config import LearnerConfig, SftConfig
from rollout_fleet.config import EngineConfig, EvalConfig, RolloutConfig
from weight_sync.config import WeightSyncConfig

# Offsets from dashboard.metrics_base_port of the Prometheus endpoints of roles without an HTTP server of their
# own; rollout worker i serves at base + METRICS_PORT_OFFSETS["rollout"] + i.
METRICS_PORT_OFFSETS = {"learner": 0, "eval": 1, "redis": 2, "rollout": 10}


class DashboardConfig(Section):
    """The live web dashboard (read-only) and the Prometheus endpoints of roles without an HTTP server."""

    host: str = Field("127.0.0.1", description="Address to bind; binding beyond loopback must be explicit.")
    port: int = Field(8265, ge=0, le=65535, description="HTTP port of the dashboard.")
    refresh_s: float = Field(
        1.5,
        ge=0.2,
        le=60,
        description="How often the page polls the JSON API (and samples the broker), seconds.",
    )
    history_points: int = Field(
        2000, ge=10, le=100_000, description="Points per role (and broker samples) the page loads and keeps."
    )
    engine_urls: list[str] = Field(
        default_factory=list,
        description="Engine base URLs to show and probe besides those in the engine registry.",
    )
    probe_engines: bool = Field(
        True, description="Ask each engine for its weight version and load (GET /model_info, /v1/loads)."
    )
    probe_timeout_s: float = Field(1.0, gt=0, description="Timeout of one engine probe, seconds.")
    api_timeout_s: float = Field(
        10.0, gt=0, description="An API call whose Redis reads take longer answers 503, seconds."
    )
    redis_wait_s: float = Field(
        60.0, ge=0, description="How long to wait for the embedded Redis to write its URL at start, seconds."
    )
    wandb_interval_s: float = Field(
        10.0,
        gt=0,
        description="How often the dashboard logs what is new in the run to its wandb run (learner.wandb_mode).",
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address of the Prometheus endpoints of roles without an HTTP server."
    )
    metrics_base_port: int = Field(
        9400,
        ge=0,
        le=65000,
        description="First Prometheus port (learner +0, eval +1, redis +2, rollout worker i +10+i); 0 disables.",
    )

    def metrics_port(self, role: str, index: int = 0) -> int | None:
        """The Prometheus port of ``role`` (worker ``index`` for rollout), or None when disabled."""
        if role not in METRICS_PORT_OFFSETS:
            raise ValueError(f"role = {role!r}: no metrics port (known: {sorted(METRICS_PORT_OFFSETS)})")
        if index < 0 or (index > 0 and role != "rollout"):
            raise ValueError(f"index = {index} for role {role!r}: only rollout workers have an index above 0")
        if self.metrics_base_port == 0:
            return None
        return self.metrics_base_port + METRICS_PORT_OFFSETS[role] + index


class UpConfig(Section):
    """``streamrl up``: the supervisor of every role, on this node or on a Ray cluster (``launcher``). A role that
    dies is restarted; the run stops only when a role died more often than its budget within ``restart_window_s``."""

    grace_s: float = Field(40.0, gt=0, description="SIGTERM grace per role before it is killed, seconds.")
    engine_restarts: int = Field(
        3, ge=0, description="Restarts of each engine within the restart window before up stops the run."
    )
    redis_restarts: int = Field(
        5, ge=0, description="Restarts of the embedded Redis (same port, same AOF) within the restart window."
    )
    learner_restarts: int = Field(
        3, ge=0, description="Restarts of the learner (from its last durable checkpoint) within the window."
    )
    rollout_restarts: int = Field(
        5, ge=0, description="Restarts of each rollout worker within the restart window."
    )
    eval_restarts: int = Field(5, ge=0, description="Restarts of the evaluator within the restart window.")
    archive_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of the archiver within the restart window; then the run goes on without it.",
    )
    dashboard_restarts: int = Field(
        5, ge=0, description="Restarts of the dashboard within the restart window."
    )
    restart_window_s: float = Field(
        3600.0,
        gt=0,
        description="Deaths of a role older than this no longer count against its budget, seconds.",
    )
    restart_delay_s: float = Field(
        1.0,
        ge=0,
        description="Wait before restarting a role that died; doubles with each death in the window (max 30 s).",
    )
    status_interval_s: float = Field(10.0, gt=0, description="Seconds between two live status lines.")
    log_max_mb: float = Field(
        50.0, gt=0, description="Rotate a role's log in RUN_DIR/logs once it passes this size, MiB."
    )
    log_keep: int = Field(
        5, ge=0, description="Rotated files kept of each role's log (NAME.log.1 newest); 0: none."
    )
    launcher: Literal["local", "ray"] = Field(
        "local",
        description="Where the roles run: 'local' (child processes of up) or 'ray' (Ray actors: [ray]).",
    )
    allow_changed_run: bool = Field(
        False,
        description="Resume a run whose model or grader changed since its manifest.json (this up only).",
    )


class RayConfig(Section):
    """``streamrl up --up.launcher=ray`` (streamrl.ray_launcher): each role the same process as under the local
    supervisor, started by a Ray actor on a node with the role's resources (docs/cluster.md). Empty resources
    mean: GPUs on a cluster that has them, else one CPU."""

    address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', host:port, ray://...); unset: join the local one, else start it.",
    )
    namespace: str = Field("streamrl", description="Ray namespace of the run's actors.")
    local_num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a Ray cluster up starts here (no address, none running); unset: all."
    )
    local_object_store_mb: int = Field(
        200, ge=75, description="Object store of a Ray cluster up starts here, MiB (roles pass no objects)."
    )
    engine_resources: dict[str, float] = Field(
        default_factory=dict,
        description='Ray resources of each engine, e.g. {"GPU": 1}; empty: engine.tp_size GPUs, else 1 CPU.',
    )
    learner_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources of each learner rank (one bundle of its placement group); empty: 1 GPU or CPU.",
    )
    learner_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Placement-group strategy of the learner ranks (STRICT_SPREAD: one rank per node).",
    )
    rollout_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0}, description="Ray resources of each rollout worker."
    )
    eval_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0}, description="Ray resources of the evaluator."
    )
    archive_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.5},
        description="Ray resources of the archiver (Redis and the dashboard run on the head node).",
    )
    placement_timeout_s: float = Field(
        300.0, gt=0, description="How long a role may wait for its resources before its start fails, seconds."
    )


class StreamRLConfig(Section):
    """The whole run. Sections are owned by the role packages; this class only assembles and cross-checks."""

    shared: SharedConfig = Field(default_factory=SharedConfig, description="Settings every role shares.")
    redis: RedisServerConfig = Field(
        default_factory=RedisServerConfig, description="The embedded Redis server."
    )
    broker: BrokerConfig = Field(default_factory=BrokerConfig, description="The trajectory stream transport.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engines.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout workers.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The FSDP2 learner.")
    sft: SftConfig = Field(
        default_factory=SftConfig, description="Supervised training on a JSONL dataset (streamrl sft)."
    )
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Learner-to-engine sync."
    )
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig, description="The live dashboard.")
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="Held-out evaluation alongside training."
    )
    archive: ArchiveConfig = Field(
        default_factory=ArchiveConfig, description="The trajectory archive (Parquet, every sample)."
    )
    up: UpConfig = Field(default_factory=UpConfig, description="The supervisor of every role (streamrl up).")
    ray: RayConfig = Field(default_factory=RayConfig, description="up's Ray launcher (up.launcher = ray).")

    @model_validator(mode="after")
    def _check_cross_role_rules(self) -> StreamRLConfig:
        # The backlog must hold everything that may be in flight between two checkpoints, or producers wait
        # for acknowledgements that only the next checkpoint can give: a deadlock.
        gps = self.learner.groups_per_step
        needed = self.learner.checkpoint_every * gps + admission_capacity(self.shared.eta, gps)
        if self.broker.max_backlog < needed:
            raise ValueError(
                f"broker.max_backlog = {self.broker.max_backlog} is below (learner.checkpoint_every + "
                f"shared.eta + 1) x learner.groups_per_step = {needed}: the pipeline would deadlock"
            )
        if self.broker.archive_group == self.broker.consumer_group:
            raise ValueError(
                f"broker.archive_group = {self.broker.archive_group!r} is the learner's consumer group: the "
                "archiver would take the learner's entries"
            )
        # A live learner holds entries pending until its next checkpoint; reclaiming sooner would steal them.
        min_idle_ms = 2 * self.learner.checkpoint_interval_s * 1000
        if self.broker.claim_idle_ms <= min_idle_ms:
            raise ValueError(
                f"broker.claim_idle_ms = {self.broker.claim_idle_ms} must exceed twice "
                f"learner.checkpoint_interval_s ({min_idle_ms:.0f} ms), or a live learner's entries get stolen"
            )
        # Colocation pairs each engine with learner ranks on the same GPUs (CUDA IPC); Ray's GPU resources cannot
        # promise that pairing, so the config refuses it rather than let the launcher place them apart.
        if self.shared.placement == "colocated" and self.up.launcher == "ray":
            raise ValueError(
                "shared.placement = 'colocated' with up.launcher = 'ray': colocated engines and learner ranks "
                "share GPUs on one node; run it with up.launcher = 'local' on that node (docs/devices.md)"
            )
        # Colocated engines that release their memory while a step trains cannot generate meanwhile: a staleness
        # bound above 0 promises that they do. Handles carry full tensors, not adapters.
        sync = self.weight_sync
        resolved = sync.for_placement(self.shared.placement, self.shared.eta)
        if resolved.sleeps and self.shared.eta >= 1:
            raise ValueError(
                f"weight_sync.release_memory = {sync.release_memory} with shared.eta = {self.shared.eta}: colocated "
                "engines that release memory while the learner trains cannot generate meanwhile; set "
                "weight_sync.release_memory = [] (both resident) or shared.eta = 0 (alternation)"
            )
        if resolved.transport == "tensor" and self.learner.lora.enabled and sync.lora_sync == "adapter":
            raise ValueError(
                "weight_sync.lora_sync = 'adapter' with the tensor transport (colocated): no engine endpoint "
                "takes adapter tensors by handle; use 'merged' or 'adapter_path'"
            )
        # SGLang's adapter path reads what the learner writes: without a directory the first sync would fail.
        if self.learner.lora.enabled and sync.lora_sync == "adapter_path" and not sync.adapter_dir:
            raise ValueError(
                "weight_sync.lora_sync = 'adapter_path' with learner.lora.rank = "
                f"{self.learner.lora.rank} needs weight_sync.adapter_dir (a directory every engine reads)"
            )
        # Rollout requests name the published version's adapter; the next one is loaded before it is announced.
        if self.served_adapter_name() is not None and sync.keep_adapters < 2:
            raise ValueError(
                f"weight_sync.keep_adapters = {sync.keep_adapters}: with adapters served by name, requests name "
                "the published version's adapter while the next one loads; keep at least 2"
            )
        return self

    @model_validator(mode="after")
    def _check_auth(self) -> StreamRLConfig:
        self.resolve_auth()
        return self

    def resolve_auth(self) -> None:
        """``shared.auth = "auto"`` becomes "on" when a server of the run binds, or is reached at, an address
        beyond loopback; "off" then is refused, naming each such field. Called again by whoever changes the
        addresses after loading (the Ray launcher places engines on node addresses)."""
        beyond = self.beyond_loopback()
        if not beyond:
            return
        if self.shared.auth == "off":
            raise ValueError(
                f"shared.auth = 'off' with {'; '.join(beyond)}: anyone who reaches these addresses could "
                "control the engines; use shared.auth = 'auto' or 'on' (docs/running.md, Authentication)"
            )
        self.shared.auth = "on"

    def beyond_loopback(self) -> list[str]:
        """'field = value' for each server address of the run that is not loopback: the engines' and the
        dashboard's bind addresses and the engine (or router) URLs clients call. Redis has its own password;
        the Prometheus endpoints (dashboard.metrics_host) are read-only and open, as SGLang's /metrics is."""
        found = [
            f"{name} = {host!r}"
            for name, host in (("engine.host", self.engine.host), ("dashboard.host", self.dashboard.host))
            if not is_loopback(host)
        ]
        urls = {
            "rollout.engine_urls": self.rollout.engine_urls,
            "weight_sync.engine_urls": self.weight_sync.engine_urls,
            "dashboard.engine_urls": self.dashboard.engine_urls,
            "rollout.sglang_router_url": [u for u in [self.rollout.sglang_router_url] if u],
        }
        for name, listed in urls.items():
            outside = [str(u) for u in listed if not is_loopback(urlsplit(str(u)).hostname or "")]
            if outside:
                found.append(f"{name} = {outside}")
        return found

    def served_adapter_name(self) -> Callable[[int], str] | None:
        """With LoRA adapters that engines serve by name (``weight_sync.lora_sync = adapter_path``, SGLang's
        way), the name of a policy version's adapter, which rollout requests carry as ``lora_path``; else None
        (the adapter, or the merged weights, are the engine's own weights)."""
        if self.learner.lora.enabled and self.weight_sync.lora_sync == "adapter_path":
            return self.weight_sync.adapter_name
        return None


def env_defaults() -> dict[str, Any]:
    """Values taken from the environment before the config file and overrides apply."""
    base: dict[str, Any] = {}
    if os.environ.get("REDIS_URL"):
        base["shared"] = {"redis_url": os.environ["REDIS_URL"]}
    return base


def load(args: list[str]) -> StreamRLConfig:
    """Defaults < environment < ``--config FILE`` < ``--section.field=value`` overrides."""
    return load_config(StreamRLConfig, args, base=env_defaults())
