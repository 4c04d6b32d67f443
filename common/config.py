"""The shared config section: what several roles must agree on (run id and directory, Redis, eta, model,
devices). Every role may import it; the application package fills it in once. Every field carries a
one-line doc that ``streamrl <role> --help`` shows."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from common.configlib import Section


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
    auth: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Run secret (RUN_DIR/run_secret, 0600) on engine and dashboard HTTP: on, off, or auto (on "
        "once a server binds or is reached beyond loopback; off beyond loopback is refused).",
    )
    http_timeout_s: float = Field(
        30.0, gt=0, description="Timeout of every HTTP call between roles, seconds."
    )

    def key(self, name: str) -> str:
        """The Redis key ``name`` inside this run's namespace."""
        return f"streamrl:{self.run_id}:{name}"
