"""Config section owned by weight sync."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.configlib import Section


class WeightSyncConfig(Section):
    """Moving weights from the learner's rank 0 to every engine."""

    group_name: str = Field(
        "weight_update_group", min_length=1, description="Name (and store prefix) of the update group."
    )
    transport: Literal["auto", "distributed", "tensor"] = Field(
        "auto",
        description="distributed: broadcast over a process group; tensor: colocated, by CUDA IPC / shared-memory "
        "handle through /update_weights_from_tensor; auto: tensor when shared.placement is colocated.",
    )
    release_memory: list[Literal["kv_cache", "weights", "cuda_graph"]] | None = Field(
        None,
        description="transport tensor (colocated): what engines release while the learner trains; unset: "
        "kv_cache at shared.eta = 0 (they alternate), nothing at eta >= 1 (both resident, generating meanwhile).",
    )
    bucket_mb: float = Field(256, gt=0, description="Bucket size for the broadcast, MiB (fractions allowed).")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "in_place",
        description="How engines pause during an update: in_place (keep requests and KV, decode on with the "
        "new weights), retract (re-prefill under them) or abort (the rollout worker resubmits).",
    )
    timeout_s: float = Field(120.0, gt=0, description="Timeout of every broadcast and update call, seconds.")
    load_format: Literal["auto", "flattened_bucket", "per_tensor"] = Field(
        "auto",
        description="flattened_bucket: one broadcast (or handle) of a packed uint8 buffer per bucket; per_tensor: "
        "one per tensor (CPU engines receive them in place); auto: flattened_bucket on nccl and with transport "
        "tensor, per_tensor on gloo.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Backend of the update group; auto is nccl with a GPU, else gloo."
    )
    master_address: str | None = Field(
        None, description="Address engines use to reach the learner's rank 0; unset guesses this host's."
    )
    master_port: int = Field(
        0, ge=0, le=65535, description="TCPStore port on the learner's rank 0; 0 picks a free one per group."
    )
    flush_cache: bool | None = Field(
        None,
        description="flush_cache sent with each bucket; unset: true except with pause_mode in_place "
        "(a flush fails while paused requests hold the KV cache).",
    )
    send_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Cast floating weights to this dtype before sending; auto sends them as trained."
    )
    pipeline_depth: int = Field(
        2,
        ge=1,
        le=2,
        description="Buckets sent before the oldest is confirmed: 2 overlaps an engine's load of bucket k "
        "with the broadcast of k+1; 1 waits for every reply.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Attempts per sync; after a failure the group is rebuilt with the healthy engines.",
    )

    engines: Literal["registry", "none"] = Field(
        "registry",
        description="Which engines the learner updates: engine_urls if set, else the fleet's registry; "
        "none: publish versions only.",
    )
    engine_urls: list[str] = Field(
        default_factory=list,
        description="Engine URLs to update (each with engine_ranks ranks); empty: use the registry.",
    )
    engine_ranks: int = Field(
        1, ge=1, description="Ranks each engine of engine_urls has in the update group (SGLang's tp size)."
    )
    wait_for_engines_s: float = Field(
        120.0, gt=0, description="How long the learner waits at start for at least one engine to update."
    )

    lora_sync: Literal["adapter", "merged", "adapter_path"] = Field(
        "adapter",
        description="With learner.lora: adapter sends only the adapter tensors over the update group (built-in "
        "engine); merged sends every weight with the adapter merged (any engine); adapter_path writes a PEFT "
        "adapter to adapter_dir for SGLang's /load_lora_adapter.",
    )
    lora_name: str = Field(
        "policy",
        min_length=1,
        description="Adapter name prefix: version N is loaded as <lora_name>-v<N> (requests' lora_path on SGLang).",
    )
    adapter_dir: str | None = Field(
        None, description="lora_sync adapter_path: a directory the learner writes and every engine reads."
    )
    keep_adapters: int = Field(
        2,
        ge=1,
        description="lora_sync adapter_path: adapter versions kept loaded, so requests started on one finish.",
    )

    def for_placement(self, placement: str, eta: int) -> WeightSyncConfig:
        """This config with what is left to the run decided: ``transport = auto`` by the device plan's placement
        (colocated engines share the learner's GPUs, where NCCL cannot join them: weights go by handle), and an
        unset ``release_memory`` by the staleness bound (at eta 0 engines idle while the learner trains, so they
        release their KV pool; at eta >= 1 they generate meanwhile and keep it)."""
        transport = self.transport
        if transport == "auto":
            transport = "tensor" if placement == "colocated" else "distributed"
        release = self.release_memory
        if release is None:
            release = ["kv_cache"] if eta == 0 else []
        return self.model_copy(update={"transport": transport, "release_memory": release})

    @property
    def sleeps(self) -> bool:
        """Whether engines release memory while the learner trains (colocated, something to release)."""
        return self.transport == "tensor" and bool(self.release_memory)

    def adapter_name(self, version: int) -> str:
        """The name version ``version``'s adapter is loaded under (SGLang's ``lora_name`` / ``lora_path``)."""
        return f"{self.lora_name}-v{version}"

    def resolved_load_format(self, backend: str) -> str:
        """The wire format for ``backend``: on GPUs one NCCL call per bucket wins; on CPU engines per-tensor
        broadcasts land in the model's own tensors, saving the unpack copy (docs/weight_sync.md, numbers)."""
        if self.load_format != "auto":
            return self.load_format
        if self.transport == "tensor":  # one handle per bucket; per tensor would only add handles
            return "flattened_bucket"
        return "flattened_bucket" if backend == "nccl" else "per_tensor"

    def flush(self) -> bool:
        """The flush_cache flag to send: explicit, else derived from the pause mode."""
        return self.pause_mode != "in_place" if self.flush_cache is None else self.flush_cache
