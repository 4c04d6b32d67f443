"""Sharded loading: a Hugging Face model built on the meta device, sharded with FSDP2, then filled rank by rank.

The whole-model path (``from_pretrained`` in fp32, ``.to(device)``, then ``fully_shard``) holds the whole model
on every rank, in host memory and then on the GPU, before FSDP2 frees what a rank does not own: 8 ranks x 28 GB
for a 7B model. Here each rank holds only its own shards:

1. the model is built with its parameters on the meta device (no memory) and its buffers for real, on the CPU
   (a buffer such as the rotary ``inv_freq`` is computed at construction and is in no checkpoint);
2. LoRA adapters are injected (on the meta device too), then FSDP2 shards the model (``shard_model``);
3. ``to_empty`` allocates each rank's shards, uninitialised, on its device (the CPU for an offloaded model);
4. each rank reads from the ``*.safetensors`` files the rows of every tensor it owns (FSDP2 shards dim 0), with
   positioned reads into a buffer of that size: nothing is memory-mapped, because the pages of a mapping stay in
   the process's resident set until it is unmapped, and a rank would then hold every row it had read;
   the buffers are put back, and the adapters get peft's initialisation (A Kaiming-uniform, B zero).

A rank's peak host memory at start is then its shards plus one tensor's rows; the returned :class:`LoadReport`
says how many bytes the rank read, which the tests bound.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from common.configlib import ConfigError
from learner.distributed import shard_model
from learner.lora import apply_lora
from weight_sync.lora import lora_layers
from weight_sync.sender import hf_name

if TYPE_CHECKING:
    from learner.config import LoraSection, MixedPrecision

log = logging.getLogger("streamrl.learner")

# safetensors' dtype names (its format's header), as torch dtypes
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's place in a ``.safetensors`` file: its bytes are ``[start, end)`` of ``path``."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of dim 0 (the whole tensor for a scalar)."""
        rows = self.shape[0] if self.shape else 1
        return (self.end - self.start) // rows if rows else 0


def _header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header (an 8-byte length, then JSON)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    base = 8 + length
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ConfigError(
                f"{path}: tensor {name!r} has dtype {info['dtype']!r}, which the learner cannot load"
            )
        begin, end = info["data_offsets"]
        out[name] = StoredTensor(path, _DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, base + end)
    return out


def stored_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of a Hugging Face model directory by name (one ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` lists)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"shared.model_path = {str(model_dir)!r} holds no *.safetensors weights")
    found: dict[str, StoredTensor] = {}
    for name in files:
        found.update(_header(model_dir / name))
    return found


def read_rows(stored: StoredTensor, first: int, count: int) -> torch.Tensor:
    """Rows ``[first, first + count)`` of dim 0 of a stored tensor (all of a scalar), read into a new tensor of
    the file's dtype with one positioned read: only those rows' bytes enter memory."""
    shape = (count, *stored.shape[1:]) if stored.shape else ()
    out = torch.empty(shape, dtype=stored.dtype)
    if out.numel() == 0:
        return out
    raw = out.view(-1).view(torch.uint8) if out.dim() else out.view(1).view(torch.uint8)
    with open(stored.path, "rb", buffering=0) as fh:
        fh.seek(stored.start + first * stored.row_bytes)
        view = memoryview(raw.numpy())
        got = 0
        while got < len(view):
            n = fh.readinto(view[got:])
            if not n:
                raise OSError(
                    f"{stored.path}: the file ends inside a tensor ({got} of {len(view)} bytes read)"
                )
            got += n
    return out


@dataclass
class LoadReport:
    """What one rank's :func:`load_sharded` read."""

    tensors: int = 0  # parameters and buffers filled from the model directory
    bytes_read: int = 0  # bytes this rank read from the files
    largest_read: int = 0  # bytes of its largest single read
    stored_bytes: int = 0  # bytes of every tensor in the directory (the whole model, the files' dtype)
    initialised: list[str] = field(
        default_factory=list
    )  # not in the directory: LoRA adapters, computed buffers


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers inside this block is moved to the meta device as it is registered
    (its initialisation then runs on the meta tensor: no memory, no time); buffers stay real. A block under
    ``torch.device("meta")`` would make the computed buffers meta too, and nothing could restore them."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def stored_name(name: str) -> str:
    """The name a parameter of the (wrapped, LoRA-injected) learner model has in a Hugging Face checkpoint."""
    return hf_name(name).replace(".base_layer.", ".")


def adapter_initial_values(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """peft's default initialisation of every LoRA adapter (A Kaiming-uniform with a = sqrt(5), B zero, so the
    adapted model equals the base), as full CPU tensors by parameter name; every rank computes the same values
    (one generator, seeded, in module order)."""
    generator = torch.Generator().manual_seed(seed)
    values: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if ".lora_A." in name:
            tensor = torch.empty(param.shape, dtype=torch.float32)
            fan_in = tensor.shape[1]
            bound = math.sqrt(6 / ((1 + 5) * fan_in))  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + a^2))
            values[name] = tensor.uniform_(-bound, bound, generator=generator)
        elif ".lora_B." in name:
            values[name] = torch.zeros(param.shape, dtype=torch.float32)
    return values


def _owned_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local tensor, first row, rows)`` of what this rank owns of ``param`` (FSDP2 shards dim 0)."""
    if not isinstance(param, DTensor):
        return param.data, 0, param.shape[0] if param.dim() else 1
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"sharded loading expects FSDP2's Shard(0) placement, got {param.placements}")
    local = param.to_local()
    world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = math.ceil(param.shape[0] / world) if param.dim() else 0
    first = min(rank * chunk, param.shape[0])
    return local, first, local.shape[0] if local.dim() else 1


def fill_from_directory(
    model: nn.Module, stored: dict[str, StoredTensor], initial: dict[str, torch.Tensor]
) -> LoadReport:
    """Fill a sharded model that ``to_empty`` allocated: each parameter's owned rows from ``stored``, or from
    ``initial`` (full tensors: adapters, buffers) when the directory does not hold it."""
    report = LoadReport(stored_bytes=sum(s.end - s.start for s in stored.values()))
    missing = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, first, rows = _owned_rows(param)
            key = stored_name(name)
            if key in stored:
                source = stored[key]
                expected = tuple(param.shape)
                if source.shape != expected:
                    raise ConfigError(
                        f"{source.path}: tensor {key!r} has shape {source.shape}, the model {expected}"
                    )
                rows_read = read_rows(source, first, rows) if local.numel() else None
                if rows_read is not None:
                    local.copy_(rows_read.view(local.shape))
                    report.bytes_read += rows_read.numel() * rows_read.element_size()
                    report.largest_read = max(
                        report.largest_read, rows_read.numel() * rows_read.element_size()
                    )
                report.tensors += 1
            elif name in initial:
                if local.numel():
                    local.copy_(initial[name][first : first + rows].view(local.shape))
                report.initialised.append(name)
            else:
                missing.append(key)
        for name, buffer in model.named_buffers():
            key = stored_name(name)
            if key in stored:
                buffer.copy_(read_rows(stored[key], 0, stored[key].shape[0] if stored[key].shape else 1))
                report.tensors += 1
            elif name in initial:
                buffer.copy_(initial[name])
                report.initialised.append(name)
            else:
                missing.append(key)
    if missing:
        raise ConfigError(
            f"the model directory holds no tensor for {len(missing)} of the model's parameters and buffers "
            f"(first: {missing[:3]}): shared.model_path does not match the architecture its config.json names"
        )
    return report


def load_sharded(
    model_path: Path,
    device: torch.device,
    *,
    attention: str | None = None,
    lora: LoraSection | None = None,
    seed: int = 0,
    activation_checkpointing: bool = False,
    mixed_precision: MixedPrecision = "auto",
    offload: bool = False,
) -> tuple[nn.Module, LoadReport]:
    """The FSDP2-sharded fp32 model of a Hugging Face directory, each rank holding and reading only its shards.

    Every rank of the default process group calls this together. ``lora`` (enabled) injects adapters before
    sharding, their initial values seeded by ``seed``; ``offload`` keeps the shards on the CPU (FSDP2's
    ``CPUOffloadPolicy``: copied to ``device`` for each forward), for a model that is only read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    model_path = Path(model_path)
    stored = stored_tensors(model_path)
    config = AutoConfig.from_pretrained(model_path)
    kwargs = {"attn_implementation": attention} if attention else {}
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    initial = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    if lora is not None and lora.enabled:
        model = apply_lora(model, lora)
        for module in lora_layers(model).values():  # peft put its adapters on the base layer's (meta) device
            module.to("meta")
        initial.update(adapter_initial_values(model, seed))
    model = shard_model(model, device, activation_checkpointing, mixed_precision, offload=offload)
    model.to_empty(device="cpu" if offload else device)
    initial = _wrapped_names(model, initial)
    report = fill_from_directory(model, stored, initial)
    _check_tied(model)
    log.info(
        "loaded %s sharded: %d tensors, %.1f MB read of %.1f MB (largest read %.1f MB)%s",
        model_path, report.tensors, report.bytes_read / 1e6, report.stored_bytes / 1e6, report.largest_read / 1e6,
        ", shards offloaded to the CPU" if offload else "",
    )  # fmt: skip
    return model, report


def _wrapped_names(model: nn.Module, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` keyed by the names the sharded model gives them (activation checkpointing wraps each layer,
    after the values were recorded)."""
    names = {hf_name(n): n for n, _ in model.named_parameters()}
    names.update({hf_name(n): n for n, _ in model.named_buffers()})
    return {names.get(name, name): tensor for name, tensor in values.items()}


def _check_tied(model: nn.Module) -> None:
    """A model whose config ties the embeddings must still share one tensor after sharding and ``to_empty``."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is not None and outputs.weight is not inputs.weight:
        raise RuntimeError("sharded loading untied the input and output embeddings that the config ties")
