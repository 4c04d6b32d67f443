"""Config sections owned by the rollout fleet (engines and workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from broker.configlib import Section


class EngineConfig(Section):
    """Inference engines: the built-in CPU engine or SGLang servers."""

    kind: str = Field("builtin", description="Engine kind: builtin (torch, CPU or CUDA) or sglang.")
    count: int = Field(2, ge=1, description="Number of engine servers the fleet runs.")
    host: str = Field("127.0.0.1", description="Address engines bind; loopback unless set explicitly.")
    base_port: int = Field(30000, ge=1, le=65535, description="Port of the first engine; the others follow.")
    port: int = Field(0, ge=0, le=65535, description="Port this engine binds; 0 means base_port.")
    model_path: Path | None = Field(None, description="Model directory served; unset uses shared.model_path.")
    served_model_name: str | None = Field(
        None, description="Name reported by /model_info; unset is the path."
    )
    device: str = Field(
        "auto", description="Torch device: auto (cuda when present, else cpu), cpu, cuda, cuda:N."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV dtype: auto is float32 on CPU, the checkpoint's dtype on CUDA."
    )
    max_running_requests: int = Field(
        64, ge=1, description="Requests decoded together at most (KV cache rows)."
    )
    max_context_len: int | None = Field(
        None, ge=2, description="Prompt + output token limit; unset is the model's max_position_embeddings."
    )
    max_prefill_tokens: int = Field(
        8192, ge=1, description="Padded token budget of one batched prefill (a longer prompt runs alone)."
    )
    seed: int = Field(0, description="Seed of the engine's generator for requests without sampling_seed.")
    request_timeout_s: float = Field(
        3600.0, gt=0, description="A /generate still running after this long is aborted and answered."
    )
    control_timeout_s: float = Field(
        60.0, gt=0, description="Wait for the scheduler to acknowledge pause / continue / flush / aborts."
    )
    health_check_timeout_s: float = Field(
        20.0,
        gt=0,
        description="/health and /health_generate answer 503 if a 1-token generation takes longer.",
    )
    health_generation: bool = Field(
        True, description="/health runs a 1-token generation like SGLang; false answers from liveness alone."
    )
    shutdown_timeout_s: float = Field(
        10.0, gt=0, description="On SIGTERM, how long to wait for aborted in-flight requests to be answered."
    )
    step_log_size: int = Field(
        4096, ge=1, description="Forward passes kept in the batch-composition log (tests, debugging)."
    )


class RolloutConfig(Section):
    """Rollout workers: prompts in, one trajectory record per prompt group out."""

    workers: int = Field(1, ge=1, description="Number of rollout worker processes.")
    group_size: int = Field(8, ge=1, description="Samples per prompt (the GRPO group).")
