"""The root of the config tree: assembles each role's section and checks the rules that span roles."""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, model_validator

from broker.config import BrokerConfig, RedisServerConfig, SharedConfig
from broker.configlib import Section, load_config
from learner.config import LearnerConfig
from rollout_fleet.config import EngineConfig, RolloutConfig
from weight_sync.config import WeightSyncConfig


class DashboardConfig(Section):
    """The live web dashboard (read-only)."""

    host: str = Field("127.0.0.1", description="Address to bind; binding beyond loopback must be explicit.")
    port: int = Field(8265, ge=0, le=65535, description="HTTP port of the dashboard.")


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
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Learner-to-engine sync."
    )
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig, description="The live dashboard.")

    @model_validator(mode="after")
    def _check_cross_role_rules(self) -> StreamRLConfig:
        # The backlog must hold everything that may be in flight between two checkpoints, or producers wait
        # for acknowledgements that only the next checkpoint can give: a deadlock.
        needed = (self.learner.checkpoint_every + self.shared.eta + 1) * self.learner.groups_per_step
        if self.broker.max_backlog < needed:
            raise ValueError(
                f"broker.max_backlog = {self.broker.max_backlog} is below (learner.checkpoint_every + "
                f"shared.eta + 1) x learner.groups_per_step = {needed}: the pipeline would deadlock"
            )
        # A live learner holds entries pending until its next checkpoint; reclaiming sooner would steal them.
        min_idle_ms = 2 * self.learner.checkpoint_interval_s * 1000
        if self.broker.claim_idle_ms <= min_idle_ms:
            raise ValueError(
                f"broker.claim_idle_ms = {self.broker.claim_idle_ms} must exceed twice "
                f"learner.checkpoint_interval_s ({min_idle_ms:.0f} ms), or a live learner's entries get stolen"
            )
        return self


def env_defaults() -> dict[str, Any]:
    """Values taken from the environment before the config file and overrides apply."""
    base: dict[str, Any] = {}
    if os.environ.get("REDIS_URL"):
        base["shared"] = {"redis_url": os.environ["REDIS_URL"]}
    return base


def load(args: list[str]) -> StreamRLConfig:
    """Defaults < environment < ``--config FILE`` < ``--section.field=value`` overrides."""
    return load_config(StreamRLConfig, args, base=env_defaults())
