"""The built-in engine: a Hugging Face model, its tokenizer, the runner and the scheduler thread.

This is the interface the HTTP server and the weight-sync receiver use. Everything that touches the model runs
on the scheduler thread between steps (``call_in_scheduler``), so a weight load never races a forward pass:

- ``engine.model``: the HF module whose parameters are served (HF names, e.g.
  ``model.layers.0.self_attn.q_proj.weight``);
- ``engine.load_weights(named_tensors, weight_version=None)``: copy full tensors in by HF name;
- ``engine.set_weight_version(label)``: the label later tokens carry in ``meta_info.weight_versions``;
- ``engine.get_weights_by_name(name, truncate_size)``: what SGLang's test endpoint returns;
- ``engine.call_in_scheduler(fn, timeout)``: run anything else (a broadcast receive) between steps;
- ``engine.release_memory(tags)`` / ``engine.resume_memory(tags)``: sleep and wake (colocated mode,
  :mod:`rollout_fleet.engine.memory`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common.versioning import INITIAL_LABEL
from rollout_fleet.engine.memory import WeightMemory, trim_heap
from rollout_fleet.engine.protocol import GenItem
from rollout_fleet.engine.runner import ModelRunner
from rollout_fleet.engine.scheduler import Scheduler, Sink
from rollout_fleet.model import load_tokenizer
from weight_sync.lora import AdapterApplier, LoraSpec

log = logging.getLogger("streamrl.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; anything else is taken as a torch device string."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.device = {name!r} but CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device, config_dtype: Any) -> torch.dtype:
    """``auto``: float32 on CPU (exact log-probs), the checkpoint's dtype (else bfloat16) on CUDA."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"engine.dtype = {name!r}: expected auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    if isinstance(config_dtype, torch.dtype) and config_dtype in _DTYPES.values():
        return config_dtype
    return _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.bfloat16)


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes: keys and values of every layer."""
    config = model.config
    layer = model.model.layers[0].self_attn
    per_layer = 2 * int(config.num_key_value_heads) * int(layer.head_dim)
    return per_layer * len(model.model.layers) * torch.empty((), dtype=dtype).element_size()


def default_total_tokens(
    max_running: int, context_len: int, bytes_per_token: int, device: torch.device
) -> int:
    """Unset ``engine.max_total_tokens``: room for every running request at full context, capped at half the
    memory free now (on CPU the pool's pages are committed only as the KV grows, so the cap is what matters)."""
    wanted = max_running * context_len
    try:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # no such sysconf name on this platform: no cap
        return wanted
    return max(1024, min(wanted, free // 2 // bytes_per_token))


class EngineBusy(ValueError):
    """A control call the engine refuses in its current state (requests running, memory released)."""


class Engine:
    """A served model: load it, start the scheduler, submit requests, update weights."""

    def __init__(
        self,
        model_path: Path | str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_running_requests: int = 64,
        max_context_len: int | None = None,
        max_prefill_tokens: int = 8192,
        max_total_tokens: int | None = None,
        kv_block_size: int = 16,
        chunked_prefill_size: int = 2048,
        disable_radix_cache: bool = False,
        seed: int = 0,
        step_log_size: int = 4096,
        weight_version: str = INITIAL_LABEL,
        served_model_name: str | None = None,
    ) -> None:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model_path {str(path)!r} is not a Hugging Face model directory")
        self.model_path = path
        self.served_model_name = served_model_name or str(path)
        self.device = resolve_device(device)
        started = time.monotonic()
        self.tokenizer = load_tokenizer(path)
        config_dtype = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "dtype", None)
        self.dtype = resolve_dtype(dtype, self.device, config_dtype)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        model_limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 4096
        self.context_len = min(max_context_len or model_limit, model_limit)
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_ids = _eos_ids(model, self.tokenizer)
        total = max_total_tokens or default_total_tokens(
            max_running_requests, self.context_len, kv_bytes_per_token(model, self.dtype), self.device
        )
        self.runner = ModelRunner(
            model, max_context_len=self.context_len, max_total_tokens=total, block_size=kv_block_size
        )
        self.max_total_tokens = self.runner.cache.allocator.capacity_tokens
        if self.max_total_tokens < self.context_len:
            # As SGLang's max_req_len: a request is limited to what the KV cache can hold.
            log.warning(
                "engine.max_total_tokens = %d holds fewer tokens than the context length %d: requests are "
                "limited to %d tokens",
                self.max_total_tokens,
                self.context_len,
                self.max_total_tokens,
            )
            self.context_len = self.max_total_tokens
        self.scheduler = Scheduler(
            self.runner,
            eos_token_ids=self.eos_token_ids,
            decode_text=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            disable_radix_cache=disable_radix_cache,
            seed=seed,
            step_log_size=step_log_size,
            weight_version=weight_version,
        )
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.kv_block_size = kv_block_size
        self._param_by_name = dict(self.model.state_dict(keep_vars=True))
        # LoRA adapters are merged into the served weights from a copy of each adapted base weight.
        self.adapters = AdapterApplier(self._param_by_name)
        self.lora_names: list[str] = []  # adapters loaded by name, newest last (SGLang's /load_lora_adapter)
        self.weight_memory = WeightMemory(self.model)
        log.info(
            "loaded %s (%s, %.2fM parameters) on %s as %s in %.1f s; context %d tokens; KV cache %d tokens "
            "in blocks of %d (%.0f MiB at most)",
            path,
            type(model).__name__,
            sum(p.numel() for p in model.parameters()) / 1e6,
            self.device,
            self.dtype,
            time.monotonic() - started,
            self.context_len,
            self.max_total_tokens,
            kv_block_size,
            self.max_total_tokens * self.runner.cache.bytes_per_token() / 2**20,
        )

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> Engine:
        self.scheduler.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort and answer every live request, then stop the scheduler thread."""
        self.scheduler.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.scheduler.alive

    # -- requests -----------------------------------------------------------------------------------------

    def submit(self, item: GenItem, sink: Sink) -> None:
        self.scheduler.submit(item, sink)

    def submit_batch(self, items: list[tuple[GenItem, Sink]]) -> None:
        """Queue the items of one ``/generate`` call together (see ``Scheduler.submit_batch``)."""
        self.scheduler.submit_batch(items)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.scheduler.abort(rid, abort_all)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- control (blocking; call from a worker thread, not the event loop) ---------------------------------

    def call_in_scheduler(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn()`` on the scheduler thread between two forward passes and return its result."""
        return self.scheduler.call(fn, timeout)

    def pause(self, mode: str, timeout: float) -> None:
        self.scheduler.pause(mode).result(timeout)

    def resume(self, timeout: float) -> None:
        self.scheduler.resume().result(timeout)

    def flush_cache(self, timeout: float) -> bool:
        return self.call_in_scheduler(self.scheduler.flush_cache, timeout)

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # -- sleep and wake (colocated mode) -----------------------------------------------------------------

    @property
    def memory_released(self) -> list[str]:
        """The memory tags released now (``kv_cache``, ``weights``, ``cuda_graph``), sorted."""
        return sorted(self.scheduler.released)

    def release_memory(self, tags: Iterable[str], timeout: float) -> None:
        """Free the memory of ``tags`` between steps. Raises ``EngineBusy`` unless no request is running or
        queued (SGLang asserts the same: it would free memory a request is using)."""
        tags = list(tags)

        def release() -> None:
            busy = self.scheduler.ongoing()
            if busy:
                raise EngineBusy(
                    f"release_memory_occupation should be called only when no ongoing request: {busy} (pause "
                    "generation with mode abort first)"
                )
            if "kv_cache" in tags:
                self.runner.cache.release()
            if "weights" in tags:
                self.weight_memory.release()
            self.scheduler.released.update(tags)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # back to the device, for the learner to use
            else:
                trim_heap()

        self.call_in_scheduler(release, timeout)

    def resume_memory(self, tags: Iterable[str], timeout: float) -> None:
        """Allocate the memory of ``tags`` again: an empty KV pool, zero weights (until the next update)."""
        tags = list(tags)

        def resume() -> None:
            if "kv_cache" in tags:
                self.runner.cache.resume()
            if "weights" in tags:
                self.weight_memory.resume()
            self.scheduler.released.difference_update(tags)

        self.call_in_scheduler(resume, timeout)

    def _check_weights_held(self, what: str) -> None:
        if self.weight_memory.released:
            raise EngineBusy(f"{what}: the weights are released; call /resume_memory_occupation first")

    def set_weight_version(self, label: str, timeout: float = 60.0) -> None:
        self.call_in_scheduler(lambda: self.scheduler.set_weight_version(label), timeout)

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        timeout: float = 300.0,
    ) -> int:
        """Copy full tensors into the served model by HF name (between steps); returns how many were loaded.

        Every name and shape is checked before anything is copied, so a bad update changes nothing."""
        tensors = list(named_tensors)

        def load() -> int:
            self._check_weights_held("load_weights")
            for name, tensor in tensors:
                self._check_tensor(name, tensor)
            try:
                with torch.no_grad():
                    for name, tensor in tensors:
                        param = self._param_by_name[name]
                        param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            finally:  # even a partial copy makes the cached KV stale
                self.scheduler.invalidate_prefix_cache()
                self.adapters.forget(name for name, _ in tensors)  # full weights are the new base
            if weight_version is not None:
                self.scheduler.set_weight_version(weight_version)
            return len(tensors)

        return self.call_in_scheduler(load, timeout)

    def load_adapter(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        spec: LoraSpec,
        weight_version: str | None = None,
        timeout: float = 300.0,
    ) -> int:
        """Serve a LoRA adapter (``M.lora_A.weight`` / ``M.lora_B.weight`` per adapted layer): each layer's weight
        becomes ``W_base + scaling * B @ A``, from the base it had before any adapter, so a new version replaces
        the previous one. Runs between steps; names and shapes are checked before anything changes."""
        tensors = list(named_tensors)

        def load() -> int:
            self.adapters.check(tensors, spec)
            try:
                return self.adapters.apply(tensors, spec)
            finally:
                self.scheduler.invalidate_prefix_cache()
                if weight_version is not None:
                    self.scheduler.set_weight_version(weight_version)

        return self.call_in_scheduler(load, timeout)

    def unload_adapter(self, timeout: float = 300.0) -> None:
        """Serve the base weights again."""

        def unload() -> None:
            self.adapters.unload()
            self.scheduler.invalidate_prefix_cache()

        self.call_in_scheduler(unload, timeout)

    def _check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        param = self._param_by_name.get(name)
        if param is None:
            raise KeyError(f"unknown parameter name {name!r} for {type(self.model).__name__}")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"parameter {name!r}: shape {list(tensor.shape)} != expected {list(param.shape)}"
            )

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The parameter as float32 nested lists, first ``truncate_size`` rows (SGLang's test endpoint)."""
        if name not in self._param_by_name:
            raise KeyError(f"unknown parameter name {name!r}")
        self._check_weights_held("get_weights_by_name")
        return self._param_by_name[name].detach()[:truncate_size].float().cpu().tolist()

    # -- introspection ----------------------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        config = self.model.config
        return {
            "model_path": str(self.model_path),
            "served_model_name": self.served_model_name,
            "tokenizer_path": str(self.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": list(getattr(config, "architectures", None) or [type(self.model).__name__]),
        }

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        return dict(vars(s))
