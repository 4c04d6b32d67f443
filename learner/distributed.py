"""Process-group setup and FSDP2 sharding for the learner: gloo on CPU, NCCL on GPU, the same code."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from common.configlib import ConfigError
from learner.config import MixedPrecision
from weight_sync.sender import hf_name

log = logging.getLogger("streamrl.learner")


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
        if local_rank >= torch.cuda.device_count():
            # NCCL refuses two ranks on one GPU; say which numbers disagree instead of failing inside it.
            raise ConfigError(
                f"learner rank {rank} (LOCAL_RANK {local_rank}) needs GPU {local_rank}, but this process sees "
                f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES = {os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
                "lower learner.world_size or give the learner more GPUs (shared.devices)"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    return DistInfo(rank=rank, world_size=world_size, device=device, backend=backend)


def _layer_list(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}: expected model.model.layers")
    return layers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` for Qwen2 / Llama)."""
    return list(_layer_list(model))


def checkpoint_layers(model: nn.Module) -> int:
    """Wrap every decoder layer in torch's non-reentrant ``checkpoint_wrapper``; returns how many were wrapped.

    Call it before ``fully_shard`` (as torchtitan does): FSDP2's hooks then sit on the wrapper, outside the
    recomputed region, so the recompute in backward runs on the parameters FSDP2's pre-backward hook already
    gathered, and nothing is all-gathered twice. The wrapper adds ``_checkpoint_wrapped_module.`` to parameter
    names; DCP state dicts and exports drop it, and so do :func:`full_parameters` and the weight sender.
    """
    # A KV cache written in the forward would be written a second time by the recompute (and the learner never
    # decodes): the recomputed keys would differ from the saved ones.
    model.config.use_cache = False
    layers = _layer_list(model)
    wrapped = 0
    for i, layer in enumerate(layers):
        if not isinstance(layer, CheckpointWrapper):
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            wrapped += 1
    return wrapped


def compute_dtype(mixed_precision: MixedPrecision, device: torch.device) -> torch.dtype | None:
    """The dtype the forward and backward run in, or None for the parameters' own (fp32).

    ``auto`` is bf16 on a GPU that has it and fp32 on CPU, where bf16 matmuls are slower without AVX-512 BF16
    (docs/vs_trl.md) and the tiny model gains nothing; ``bf16`` asks for it anywhere torch can run it.
    """
    if mixed_precision == "off":
        return None
    bf16_gpu = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if mixed_precision == "auto":
        return torch.bfloat16 if bf16_gpu else None
    if device.type == "cuda" and not bf16_gpu:
        raise ConfigError(
            f"learner.mixed_precision = 'bf16': {torch.cuda.get_device_name(device)} has no bf16; "
            "set it to 'off' or 'auto'"
        )
    return torch.bfloat16


def precision_policy(dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """The FSDP2 policy of every sharded module for compute ``dtype`` (None: the parameters' own, fp32).

    Sharded parameters stay in their own dtype (fp32 master weights, and so fp32 optimizer state); each unshard
    casts them to ``dtype`` for the forward and backward; gradients are reduced in fp32. Outputs stay in
    ``dtype``: the loss upcasts the logits it makes to fp32 before the log-softmax (learner.logprobs), and an
    fp32 cast of the root's outputs would copy every layer's hidden states whenever they are returned.
    """
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_model(
    model: nn.Module,
    device: torch.device,
    activation_checkpointing: bool = False,
    mixed_precision: MixedPrecision = "auto",
    offload: bool = False,
) -> nn.Module:
    """``fully_shard`` each decoder layer (checkpointed first when ``activation_checkpointing``), then the
    root, under the compute dtype ``mixed_precision`` selects (:func:`compute_dtype`). ``offload`` keeps the
    shards in host memory (FSDP2's ``CPUOffloadPolicy``, pinned on a GPU node), copied to ``device`` for each
    forward: for a model that is only read, such as the KL reference."""
    if activation_checkpointing:
        checkpoint_layers(model)
    dtype = compute_dtype(mixed_precision, device)
    mp = precision_policy(dtype)
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mp_policy=mp, offload_policy=policy)
    log.info(
        "sharded %d decoder layers: activation checkpointing %s, compute dtype %s%s",
        len(layers), "on" if activation_checkpointing else "off", dtype or "float32 (parameters' own)",
        ", shards in host memory" if offload else "",
    )  # fmt: skip
    return model


def full_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter as a full (unsharded) tensor, in ``named_parameters`` order, under its Hugging Face name
    (wrapper prefixes such as activation checkpointing's removed).

    Every rank must call this (each ``full_tensor()`` is an all-gather); all ranks get the full tensors.
    """
    named = []
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        named.append((hf_name(name), tensor.detach()))
    return named


def ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
