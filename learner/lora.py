"""LoRA in the learner: peft adapters injected into the Hugging Face model before FSDP2 shards it.

Why injection (``peft.inject_adapter_in_model``) rather than ``get_peft_model``: the model stays the same
``Qwen2ForCausalLM`` object, so everything the learner does with it (the packed-attention forward, the lm-head
read by the chunked loss, ``model.model.layers`` for sharding and activation checkpointing, DCP state dicts)
works unchanged. Only the adapted projections change: each becomes a peft ``lora.Linear`` holding the frozen
``base_layer`` and the trainable ``lora_A`` / ``lora_B``.

FSDP2 then shards frozen base weights and trainable adapters alike (each decoder layer one unit); only the
adapters get gradients, are reduced, and are in the optimizer. Checkpoints hold both (the base never changes,
so a resume is exact); Hugging Face exports hold the merged model, which engines and the evaluator load as any
other; weight syncs send only the adapter (weight_sync.lora).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from common.configlib import ConfigError
from weight_sync.lora import lora_layers, merge_delta

if TYPE_CHECKING:
    from learner.config import LoraSection

log = logging.getLogger("streamrl.learner")


def linear_leaf_names(model: nn.Module) -> set[str]:
    """Leaf names of the model's ``nn.Linear`` layers (``q_proj``, ``down_proj``, ``lm_head`` ...)."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def apply_lora(model: nn.Module, section: LoraSection) -> nn.Module:
    """Inject LoRA adapters into ``model`` (in place) and freeze everything else; call before ``shard_model``.

    A target name the model has no linear layer of is a config error naming ``learner.lora.target_modules`` and
    the value: peft's own message would come later and say less. The adapters start as peft initialises them
    (B = 0), so the adapted model equals the base until the first step.
    """
    if not section.enabled:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    available = linear_leaf_names(model)
    unknown = [name for name in section.target_modules if name not in available]
    if unknown:
        raise ConfigError(
            f"learner.lora.target_modules = {section.target_modules!r}: {unknown!r} name no linear layer of "
            f"{type(model).__name__}; its linear layers are {sorted(available)}"
        )
    config = LoraConfig(
        r=section.rank,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=list(section.target_modules),
        bias="none",
    )
    model = inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_A." in name or ".lora_B." in name)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA rank %d alpha %g on %s: %d trainable parameters of %d (%.2f%%)",
        section.rank, section.alpha, ",".join(section.target_modules), trainable, total, 100 * trainable / total,
    )  # fmt: skip
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates: the adapters with LoRA, every parameter without."""
    return [p for p in model.parameters() if p.requires_grad]


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict of ``model`` (``get_model_state_dict(full_state_dict=True)``) with every adapted layer
    merged (``M.weight = W_base + scaling * B @ A``, ``M.bias`` the base's) and the adapter tensors dropped: the
    Hugging Face checkpoint of the policy the learner trains. Unchanged when the model has no LoRA layers."""
    layers = lora_layers(model)
    if not layers:
        return state
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        owner, sep, leaf = key.rpartition(".base_layer.")
        if sep and owner in layers:
            module = layers[owner]
            adapter = module.active_adapters[0]
            if leaf == "weight":
                a, b = state[f"{owner}.lora_A.{adapter}.weight"], state[f"{owner}.lora_B.{adapter}.weight"]
                tensor = merge_delta(tensor, a, b, float(module.scaling[adapter]))
            out[f"{owner}.{leaf}"] = tensor
        elif ".lora_A." not in key and ".lora_B." not in key:
            out[key] = tensor
    return out


def adapter_state(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, parameter)`` of the adapter tensors (what a LoRA step may change), in parameter order."""
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            yield name, param
