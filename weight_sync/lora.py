"""LoRA adapters on the wire: what a learner with adapters sends, and how an engine applies them.

Why a module of its own: with LoRA the learner trains a few small matrices per projection on a frozen base, so a
sync need not move the base at all. The sender sends, per adapted linear layer ``M`` (HF name, e.g.
``model.layers.0.self_attn.q_proj``), the two tensors ``M.lora_A.weight [r, in]`` and ``M.lora_B.weight
[out, r]`` plus the adapter's config (r, lora_alpha, scaling); the engine keeps a copy of each adapted base
weight and serves ``W = W_base + scaling * B @ A``, recomputed from the base for every version, so deltas of
successive versions never pile up.

Nothing here imports peft or a role package: adapted layers are recognised by the attributes peft's LoRA layers
carry (``base_layer``, ``lora_A`` / ``lora_B`` module dicts, ``scaling``), so weight_sync stays role-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Tensor-name suffixes of one adapted layer on the wire (PEFT's saved-adapter names, without its prefix).
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"
# PEFT's prefix in a saved adapter (adapter_model.safetensors), which SGLang's /load_lora_adapter reads.
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape and scale: what an engine needs besides the tensors."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    scaling: float

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA r = {self.r} must be >= 1")
        if not math.isfinite(self.scaling):
            raise ValueError(f"LoRA scaling = {self.scaling} must be finite")

    def config_dict(self) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` keys (what SGLang's LoRA endpoints read), plus the exact scaling."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "use_rslora": not math.isclose(self.scaling, self.lora_alpha / self.r),
            "target_modules": list(self.target_modules),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "scaling": self.scaling,
        }

    @classmethod
    def from_config_dict(cls, config: Any, where: str = "config_dict") -> LoraSpec:
        """Parse a PEFT adapter config; ``scaling`` defaults to alpha / r (alpha / sqrt(r) with use_rslora)."""
        if not isinstance(config, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(config).__name__}")
        try:
            r, alpha = int(config["r"]), float(config["lora_alpha"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: r and lora_alpha are required numbers ({exc})") from None
        if r < 1:
            raise ValueError(f"{where}: r = {r} must be >= 1")
        targets = config.get("target_modules") or []
        if isinstance(targets, str):
            targets = [targets]
        default = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        return cls(r, alpha, tuple(str(t) for t in targets), float(config.get("scaling", default)))


# ------------------------------------------------------------------------------------------ learner side


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's LoRA-adapted layers by HF name (wrapper prefixes removed), in module order."""
    found = {}
    for name, module in model.named_modules():
        if (
            isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
            and hasattr(module, "base_layer")
            and isinstance(getattr(module, "scaling", None), dict)
        ):
            found[_clean(name)] = module
    return found


def _adapter_name(module: nn.Module) -> str:
    active = getattr(module, "active_adapters", None) or ["default"]
    if len(active) != 1:
        raise ValueError(f"exactly one active LoRA adapter is supported, found {list(active)}")
    return active[0]


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter: an all-gather that every rank must join."""
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()


def lora_spec(model: nn.Module) -> LoraSpec | None:
    """The adapter's spec read from the model's LoRA layers, or None when the model has none."""
    layers = lora_layers(model)
    if not layers:
        return None
    specs = set()
    for module in layers.values():
        name = _adapter_name(module)
        specs.add((int(module.r[name]), float(module.lora_alpha[name]), float(module.scaling[name])))
        if getattr(module, "fan_in_fan_out", False):
            raise ValueError("LoRA layers with fan_in_fan_out are not supported")
    if len(specs) != 1:
        raise ValueError(f"every adapted layer must share one rank and scale, found {sorted(specs)}")
    ((r, alpha, scaling),) = specs
    targets = tuple(sorted({name.rsplit(".", 1)[-1] for name in layers}))
    return LoraSpec(r, alpha, targets, scaling)


def iter_adapter_tensors(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(M.lora_A.weight, A)``, ``(M.lora_B.weight, B)`` for every adapted layer ``M``, gathered one at a
    time (every learner rank must iterate to the end: each gather is a collective)."""
    for name, module in lora_layers(model).items():
        adapter = _adapter_name(module)
        for suffix, param in (
            (A_SUFFIX, module.lora_A[adapter].weight),
            (B_SUFFIX, module.lora_B[adapter].weight),
        ):
            tensor = _full(param)
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield name + suffix, tensor.contiguous()


def merge_delta(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * B @ A`` (peft's ``merge``), computed in float32, in ``base``'s dtype."""
    return torch.addmm(base.float(), b.float(), a.float(), alpha=scaling).to(base.dtype)


def iter_merged_tensors(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter as a full tensor under its HF name, adapted layers merged (``M.weight = W_base + s B A``,
    ``M.bias`` the base's): the model an engine without LoRA support must serve. Collective, like
    :func:`iter_adapter_tensors`."""
    layers = lora_layers(model)
    adapter_params = set()
    for module in layers.values():
        adapter = _adapter_name(module)
        adapter_params.update(id(p) for p in (module.lora_A[adapter].weight, module.lora_B[adapter].weight))
    for raw, param in model.named_parameters():
        if id(param) in adapter_params:
            continue  # gathered with its base weight below
        name = _clean(raw)
        owner, _, leaf = name.rpartition(".base_layer.")
        tensor = _full(param)
        if owner in layers:
            name = f"{owner}.{leaf}"
            if leaf == "weight":
                module = layers[owner]
                adapter = _adapter_name(module)
                a, b = _full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight)
                tensor = merge_delta(tensor, a, b, float(module.scaling[adapter]))
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor.contiguous()


def write_peft_adapter(path: Path, named: Iterable[tuple[str, torch.Tensor]], spec: LoraSpec) -> Path:
    """Save an adapter the way peft's ``save_pretrained`` does (``adapter_config.json`` and
    ``adapter_model.safetensors`` with ``base_model.model.`` names): SGLang's ``/load_lora_adapter`` reads it."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + name: t.detach().to("cpu").contiguous() for name, t in named}
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(spec.config_dict(), indent=1))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def read_peft_adapter(path: Path | str) -> tuple[list[tuple[str, torch.Tensor]], LoraSpec]:
    """An adapter directory written by peft (or :func:`write_peft_adapter`) as wire names and its spec."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a LoRA adapter directory ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})"
        )
    spec = LoraSpec.from_config_dict(json.loads(config_file.read_text()), str(config_file))
    named = []
    for name, tensor in load_file(str(weights_file)).items():
        name = (
            name.removeprefix(PEFT_PREFIX)
            .replace(".lora_A.default.", ".lora_A.")
            .replace(".lora_B.default.", ".lora_B.")
        )
        named.append((name, tensor))
    return named, spec


# ------------------------------------------------------------------------------------------- engine side


def split_adapter_name(name: str) -> tuple[str, str]:
    """``M.lora_A.weight`` -> (``M``, ``A``); anything else is an error naming it."""
    for suffix, half in ((A_SUFFIX, "A"), (B_SUFFIX, "B")):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], half
    raise KeyError(
        f"{name!r} is not a LoRA adapter tensor (expected <module>{A_SUFFIX} or <module>{B_SUFFIX})"
    )


class AdapterApplier:
    """Serves adapters on a model in place: ``W = W_base + scaling * B @ A`` for each adapted layer.

    ``params`` maps HF parameter names to the served tensors. The base of a layer is copied the first time an
    adapter reaches it and every version is computed from that copy, so version v+1 replaces version v instead
    of adding to it. A full-weight load of a layer (:meth:`forget`) makes the new weights its base. An adapter
    may arrive over several buckets: the half of a layer that arrives first waits for the other.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = params
        self.base: dict[str, torch.Tensor] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.active: LoraSpec | None = None
        self.applied_layers = 0

    def check(self, named: Iterable[tuple[str, torch.Tensor]], spec: LoraSpec) -> None:
        """Raise (naming the tensor) for an unknown layer or a shape that does not fit, before anything changes."""
        for name, tensor in named:
            module, half = split_adapter_name(name)
            weight = self.params.get(module + ".weight")
            if weight is None:
                raise KeyError(f"{name!r}: the model has no linear layer {module!r}")
            out_features, in_features = weight.shape
            expected = (spec.r, in_features) if half == "A" else (out_features, spec.r)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name!r}: shape {list(tensor.shape)} != expected {list(expected)}")

    def apply(self, named: Iterable[tuple[str, torch.Tensor]], spec: LoraSpec) -> int:
        """Stage the tensors (copied: they may be views of a receive buffer) and update every layer whose A
        and B are both here; returns how many layers were updated."""
        named = list(named)
        self.check(named, spec)
        if self.active is not None and spec != self.active:
            self.pending.clear()  # a new adapter shape: halves of the old one will never be completed
        self.active = spec
        done = 0
        with torch.no_grad():
            for name, tensor in named:
                module, half = split_adapter_name(name)
                staged = self.pending.setdefault(module, {})
                staged[half] = tensor.detach().clone()
                if len(staged) == 2:
                    weight = self.params[module + ".weight"]
                    base = self.base.setdefault(module + ".weight", weight.detach().clone())
                    a, b = staged["A"].to(weight.device), staged["B"].to(weight.device)
                    if weight.dtype == torch.float32 and a.dtype == b.dtype == torch.float32:
                        # one pass: read the base, write the served weight (no delta tensor, no extra copy)
                        torch.addmm(base, b, a, alpha=spec.scaling, out=weight)
                    else:
                        weight.copy_(merge_delta(base, a, b, spec.scaling))
                    del self.pending[module]
                    done += 1
        self.applied_layers += done
        return done

    def forget(self, names: Iterable[str]) -> None:
        """Full weights were loaded into these parameters: they are the base from now on (adapter gone)."""
        for name in names:
            self.base.pop(name, None)
        if not self.base:
            self.active = None

    def unload(self) -> None:
        """Serve the base again (SGLang's unload of the active adapter)."""
        with torch.no_grad():
            for name, base in self.base.items():
                self.params[name].copy_(base)
        self.base.clear()
        self.pending.clear()
        self.active = None
