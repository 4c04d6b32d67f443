"""Config sections owned by the rollout fleet (engines and workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.configlib import Section
from rollout_fleet.sandbox import SandboxConfig
from rollout_fleet.tasks.arithmetic import ArithmeticConfig
from rollout_fleet.tasks.config import RewardConfig, TaskConfig


class EngineConfig(Section):
    """Inference engines: the built-in CPU engine or SGLang servers."""

    kind: Literal["builtin", "sglang"] = Field(
        "builtin",
        description="Engine kind: builtin (torch, CPU or CUDA) or sglang (SGLang's server; the streamrl[sglang] "
        "extra).",
    )
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
        64, ge=1, description="Requests prefilling or decoding together at most."
    )
    max_context_len: int | None = Field(
        None, ge=2, description="Prompt + output token limit; unset is the model's max_position_embeddings."
    )
    max_prefill_tokens: int = Field(
        8192, ge=1, description="Padded token budget of one batched prefill (sequences x longest chunk)."
    )
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="KV cache capacity in tokens (the engine's memory bound); unset: max_running_requests x "
        "context length, at most half the free memory.",
    )
    kv_block_size: int = Field(16, ge=1, description="Tokens per KV cache block (SGLang's page size).")
    disable_radix_cache: bool = Field(
        False,
        description="As SGLang's flag: no prefix cache and no prompt blocks shared within a group; every "
        "request computes its whole prompt (a baseline for benchmarks and debugging).",
    )
    chunked_prefill_size: int = Field(
        2048, ge=1, description="Most prompt tokens one prefill pass computes; longer prompts run in chunks."
    )
    seed: int | None = Field(
        None,
        description="Sampling seed for requests without sampling_seed (engine i of a fleet gets seed + i); None: a "
        "fresh random seed per engine process, as SGLang does.",
    )
    cpu_affinity: list[int] = Field(
        default_factory=list,
        description="CPU cores engine processes are pinned to (empty: not pinned); disjoint from the learner's "
        "they stand in for separate rollout GPUs.",
    )
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
    # -- fleet: how rollout_fleet.fleet.Fleet launches and keeps engines (builtin or sglang) ---------------
    tp_size: int = Field(
        1,
        ge=1,
        description="SGLang tensor parallelism per engine (--tp-size); its ranks in the weight group.",
    )
    mem_fraction_static: float = Field(
        0.8, gt=0, lt=1, description="SGLang --mem-fraction-static: GPU memory for weights and KV cache."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Extra command-line arguments appended to each launched engine."
    )
    launch_timeout_s: float = Field(
        600.0, gt=0, description="How long a launched engine may take to answer /health with 200."
    )
    max_restarts: int = Field(
        3, ge=0, description="Restarts of one launched engine that died before the fleet gives up on it."
    )

    def seed_of(self, index: int) -> int | None:
        """Engine ``index``'s sampling seed: seed + index (engines sharing a seed draw identical samples for the
        same batch), or None for a random one."""
        return None if self.seed is None else self.seed + index


class RolloutConfig(Section):
    """Rollout workers: prompts in, one trajectory record per prompt group out."""

    workers: int = Field(
        1,
        ge=1,
        description="Number of rollout worker processes (streamrl up starts this many; each runs one).",
    )
    group_size: int = Field(8, ge=1, description="Samples per prompt (the GRPO group).")
    worker_id: str | None = Field(
        None, description="This worker's name (unique in the run, no ':'); unset is host-pid-random."
    )
    task: TaskConfig = Field(
        default_factory=ArithmeticConfig,
        description="The task: prompts plus verifier; rollout.task.name selects it and its fields.",
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="The reward process pool.")
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="The Python tool's sandbox (agentic tasks; docs/rollout.md).",
    )
    tokenizer_path: Path | None = Field(
        None, description="Tokenizer directory; unset uses engine.model_path, else shared.model_path."
    )
    max_concurrent_groups: int = Field(
        32,
        ge=1,
        description="Prompt groups this worker has in flight at most (each sends group_size requests).",
    )
    max_new_tokens: int = Field(
        256,
        ge=1,
        description="Output token budget of each sample (of a multi-turn episode: model and observation tokens "
        "together).",
    )
    max_turns: int = Field(8, ge=1, description="Multi-turn tasks: model turns per episode at most.")
    max_tokens_per_turn: int | None = Field(
        None, ge=1, description="Multi-turn tasks: token budget of one model turn; unset is max_new_tokens."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (below 1e-6 is greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Stop tokens besides the tokenizer's EOS (always included)."
    )
    mask_resubmitted_prefix: bool = Field(
        False, description="Loss-mask tokens of a resubmitted sample generated under an older policy version."
    )
    engine_urls: list[str] = Field(
        default_factory=list,
        description="Engines to route to and register; empty: engine.count engines at engine.host:base_port+i.",
    )
    router: Literal["fleet", "sglang"] = Field(
        "fleet",
        description="What spreads /generate over the engines: fleet (the worker's own router) or sglang (an "
        "sglang-router in front of them; weight updates, aborts and probes still go to each engine).",
    )
    sglang_router_url: str | None = Field(
        None,
        description="URL of a running sglang-router (router = sglang); unset: streamrl up starts one as a role.",
    )
    sglang_router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = Field(
        "cache_aware", description="Routing policy of the sglang-router that streamrl up starts."
    )
    sglang_router_port: int = Field(
        0, ge=0, le=65535, description="Port of the sglang-router streamrl up starts; 0 picks a free one."
    )
    launch_engines: bool = Field(
        False,
        description="Launch engine.count engines (engine.kind) from this process and stop them on exit.",
    )
    request_timeout_s: float = Field(
        3600.0, gt=0, description="Timeout of one /generate call (long outputs take long), seconds."
    )
    batch_group_requests: bool = Field(
        True,
        description="Send a group's first requests as one batched /generate (one HTTP call per group, not per "
        "sample); later requests of a sample (after an abort) go alone.",
    )
    max_request_failures: int = Field(
        5,
        ge=0,
        description="Engine failures or invalid answers one sample may meet before its group is given up.",
    )
    no_engine_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long a request waits for a healthy engine before its group is handed back.",
    )
    health_interval_s: float = Field(
        2.0, gt=0, description="Period of the engine liveness probe (GET /model_info) and registry refresh."
    )
    lease_ttl_s: float = Field(
        60.0,
        gt=0,
        description="Prompt lease expiry; the holder renews every third of it, a dead one's expire.",
    )
    shuffle_seed: int = Field(
        0, ge=0, description="Seed of the per-epoch prompt order (the same for every worker)."
    )
    max_epochs: int = Field(
        0, ge=0, description="Epochs of prompts to produce, then exit; 0 runs until stopped."
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long in-flight groups may take to finish before they are handed back.",
    )
    max_rejected_in_a_row: int = Field(
        32,
        ge=0,
        description="Groups in a row the engines reject (HTTP 4xx: bad_request) before the worker stops with "
        "exit code 2: a wrong request (sampling key, LoRA name) would drop every prompt; 0: never stop.",
    )
    admission_poll_s: float = Field(
        0.2,
        gt=0,
        description="How often a worker without admission capacity checks again (also woken by versions).",
    )
    version_poll_s: float = Field(
        1.0, gt=0, description="Longest wait for a policy-version announcement before the version is re-read."
    )
    metrics_interval_s: float = Field(5.0, gt=0, description="Period of the rollout metrics points in Redis.")

    @model_validator(mode="after")
    def _check_overlong_buffer(self) -> RolloutConfig:
        if self.reward.overlong_buffer >= self.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer = {self.reward.overlong_buffer} must be below max_new_tokens = "
                f"{self.max_new_tokens}: the penalty starts at max_new_tokens - overlong_buffer tokens"
            )
        return self


class EvalConfig(Section):
    """Held-out evaluation through the engines while training runs."""

    every_versions: int = Field(
        5,
        ge=0,
        description="Evaluate whenever the policy version advanced this much; 0: no live evaluator "
        "(`streamrl up` still evaluates before and after).",
    )
    heldout_prompts: int = Field(
        200, ge=1, description="Held-out prompts per evaluation (the task's test split)."
    )
    max_new_tokens: int = Field(128, ge=1, description="Output budget of an evaluation sample.")
    sampled_temperature: float = Field(1.0, gt=0, description="Temperature of the sampled accuracy.")
    concurrency: int = Field(64, ge=1, description="Evaluation requests in flight at once.")
    poll_s: float = Field(1.0, gt=0, description="How often the evaluator checks the policy version.")
    reward: str = Field(
        "training",
        description="Held-out scoring: training (rollout.reward.function, else the task's verifier), task, or "
        "package.module:function.",
    )
    samples_per_prompt: int = Field(
        0,
        ge=0,
        description="Sampled answers per held-out prompt before and after training (pass@k up to it); 0: "
        "rollout.group_size.",
    )
    live_samples_per_prompt: int = Field(
        1,
        ge=1,
        description="Sampled answers per held-out prompt in live evaluations (each one is a generation).",
    )

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, value: str) -> str:
        if value not in ("training", "task") and ":" not in value:
            raise ValueError(f"{value!r}: expected training, task or package.module:function")
        return value
