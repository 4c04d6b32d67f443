"""Config sections owned by the rollout fleet (engines and workers)."""

from __future__ import annotations

from pydantic import Field

from broker.configlib import Section


class EngineConfig(Section):
    """Inference engines: the built-in CPU engine or SGLang servers."""

    kind: str = Field("builtin", description="Engine kind: builtin (torch, CPU or CUDA) or sglang.")
    count: int = Field(2, ge=1, description="Number of engine servers the fleet runs.")
    host: str = Field("127.0.0.1", description="Address engines bind; loopback unless set explicitly.")
    base_port: int = Field(30000, ge=1, le=65535, description="Port of the first engine; the others follow.")


class RolloutConfig(Section):
    """Rollout workers: prompts in, one trajectory record per prompt group out."""

    workers: int = Field(1, ge=1, description="Number of rollout worker processes.")
    group_size: int = Field(8, ge=1, description="Samples per prompt (the GRPO group).")
