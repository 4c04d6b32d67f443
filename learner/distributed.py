"""Process-group setup and FSDP2 sharding for the learner: gloo on CPU, NCCL on GPU, the same code."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float, threads: int) -> DistInfo:
    """Join the learner's process group from torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    torch.set_num_threads(threads)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    return DistInfo(rank=rank, world_size=world_size, device=device, backend=backend)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` for Qwen2 / Llama)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}: expected model.model.layers")
    return list(layers)


def shard_model(model: nn.Module, device: torch.device, activation_checkpointing: bool = False) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root. bf16 compute with fp32 master weights and reductions
    on GPU; plain fp32 on CPU (gloo has no bf16 reduction worth using and the tiny model gains nothing)."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def full_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter as a full (unsharded) tensor, in ``named_parameters`` order.

    Every rank must call this (each ``full_tensor()`` is an all-gather); all ranks get the full tensors.
    """
    named = []
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        named.append((name, tensor.detach()))
    return named


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
