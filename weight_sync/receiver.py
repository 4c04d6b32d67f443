"""Engine side of the weight sync: join the update group, receive buckets, hand them to the model.

The built-in engine's HTTP handlers call a ``WeightReceiver``; every method may block (``init_group`` until rank 0
joins, ``update`` until the broadcast arrives), so handlers run them in a thread. Replies are ``(success,
message)`` with SGLang 0.5.23's messages, including its session rules:

- ``update`` outside a begin/end session is refused *before* any receive is posted (the sender's broadcast then
  times out, as with SGLang);
- ``begin`` while a session is open fails; ``end`` without one fails.

``consistent`` is False from the first bucket loaded in a session until ``end`` closes a session in which
nothing failed, and after any failed receive or load: a partially updated engine must not serve. Without
sessions (``require_session=False``, SGLang before 0.5.23) only failures are tracked, and ``mark_consistent``
(after a reload from disk) restores it. The sender never closes a session it had to abort, so a receiver whose
update was cut short stays inconsistent until the full re-send ends the session.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from weight_sync import protocol
from weight_sync.buckets import TensorMeta, empty_flat, unflatten
from weight_sync.group import UpdateGroup, join_group

NamedTensors = list[tuple[str, torch.Tensor]]
LoadWeights = Callable[[NamedTensors], None]


@dataclass
class ReceiverStats:
    """Counters the tests and the engine's metrics read."""

    updates: int = 0
    tensors: int = 0
    bytes: int = 0
    begins: int = 0
    ends: int = 0
    failures: int = 0
    groups_joined: int = 0
    last_error: str = ""
    versions: list[str] = field(default_factory=list)


class WeightReceiver:
    """One engine TP rank's receiver (tp_rank 0 for the built-in engine)."""

    def __init__(
        self,
        load_weights: LoadWeights,
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        timeout_s: float = 120.0,
        require_session: bool = True,
        on_weight_version: Callable[[str], None] | None = None,
    ) -> None:
        self.load_weights = load_weights
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.timeout_s = timeout_s
        self.require_session = require_session
        self.on_weight_version = on_weight_version
        self.groups: dict[str, UpdateGroup] = {}
        self.session_open = False
        self.session_loaded = False
        self.session_failed = False
        self.consistent = True
        self.weight_version: str | None = None
        self.stats = ReceiverStats()
        # One operation at a time: a destroy waits for a receive in progress (bounded by its timeout).
        self._lock = threading.RLock()

    # ------------------------------------------------------------------------------------------- group

    def init_group(self, req: protocol.InitGroupRequest) -> tuple[bool, str]:
        """Join as rank ``rank_offset + tp_rank``; blocks until every rank has joined (or the timeout)."""
        with self._lock:
            if req.group_name in self.groups:
                return False, f"Failed to initialize custom process group: group {req.group_name!r} exists."
            try:
                group = join_group(
                    req.master_address,
                    req.master_port,
                    rank=req.rank_offset + self.tp_rank,
                    world_size=req.world_size,
                    group_name=req.group_name,
                    backend=req.backend,
                    timeout_s=self.timeout_s,
                )
            except Exception as exc:  # reported to the sender, which quarantines this engine
                return self._fail(f"Failed to initialize custom process group: {exc}.")
            self.groups[req.group_name] = group
            self.stats.groups_joined += 1
            return True, protocol.MSG_INIT_OK

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        with self._lock:
            group = self.groups.pop(group_name, None)
            if group is None:
                return False, protocol.MSG_DESTROY_MISSING
            group.destroy()
            return True, protocol.MSG_DESTROY_OK

    def close(self) -> None:
        with self._lock:
            for name in list(self.groups):
                self.destroy_group(name)

    # ----------------------------------------------------------------------------------------- session

    def begin(self) -> tuple[bool, str]:
        with self._lock:
            if self.session_open:
                return False, protocol.MSG_BEGIN_TWICE
            self.session_open, self.session_loaded, self.session_failed = True, False, False
            self.stats.begins += 1
            return True, protocol.MSG_SESSION_OK

    def end(self) -> tuple[bool, str]:
        with self._lock:
            if not self.session_open:
                return False, protocol.MSG_END_WITHOUT_BEGIN
            self.session_open = False
            if self.session_loaded and not self.session_failed:
                self.consistent = True
            self.stats.ends += 1
            return True, protocol.MSG_SESSION_OK

    def mark_consistent(self, weight_version: str | None = None) -> None:
        """After a full reload (``/update_weights_from_disk``): the weights are whole again."""
        with self._lock:
            self.consistent = True
            if weight_version is not None:
                self._set_version(weight_version)

    # ------------------------------------------------------------------------------------------ update

    def update(self, req: protocol.UpdateRequest) -> tuple[bool, str]:
        """Receive one bucket broadcast from rank 0 and load it. Blocks until the data arrived or timed out."""
        with self._lock:
            if self.require_session and not self.session_open:
                return False, protocol.MSG_SESSION_REQUIRED
            group = self.groups.get(req.group_name)
            if group is None:
                known = list(self.groups)
                return self._fail(
                    f"Failed to receive weights: Group {req.group_name} not in {known}. "
                    "Please call `init_weights_update_group` first."
                )
            try:
                named = self._receive(group, req.metas, req.load_format)
            except Exception as exc:
                return self._fail(f"Failed to receive weights: {exc}", partial=True)
            try:
                self.load_weights(named)
            except Exception as exc:
                return self._fail(f"Failed to load weights: {exc}", partial=True)
            if self.session_open:
                self.session_loaded = True
                self.consistent = False  # whole again only when end() closes a session without failures
            self.stats.updates += 1
            self.stats.tensors += len(named)
            self.stats.bytes += sum(m.nbytes for m in req.metas)
            if req.weight_version is not None:
                self._set_version(req.weight_version)
            return True, protocol.MSG_UPDATE_OK + protocol.version_suffix(req.weight_version)

    def _receive(self, group: UpdateGroup, metas: list[TensorMeta], load_format: str | None) -> NamedTensors:
        from datetime import timedelta

        timeout = timedelta(seconds=self.timeout_s)
        if load_format == "flattened_bucket":
            flat = empty_flat(metas, self.device)  # raises "Unaligned received tensor" before any receive
            work = group.broadcast(flat, async_op=True)
            work.wait(timeout)
            return unflatten(flat, metas)
        tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        works = [group.broadcast(t, async_op=True) for t in tensors]
        for work in works:
            work.wait(timeout)
        return [(m.name, t) for m, t in zip(metas, tensors, strict=True)]

    def _set_version(self, version: str) -> None:
        if version != self.weight_version:
            self.weight_version = version
            self.stats.versions.append(version)
            if self.on_weight_version is not None:
                self.on_weight_version(version)

    def _fail(self, message: str, partial: bool = False) -> tuple[bool, str]:
        self.stats.failures += 1
        self.stats.last_error = message
        if partial:
            self.session_failed = True
            self.consistent = False
        return False, message


# ------------------------------------------------------------------------------------------ helpers


def copy_into(model: nn.Module) -> LoadWeights:
    """A ``load_weights`` callback that copies tensors into a Hugging Face model's parameters by HF name.

    ``lm_head.weight`` of a model with tied embeddings is not a separate parameter; it is accepted and copied
    into the shared tensor. An unknown name or a shape mismatch is an error naming it (before anything is
    copied, so one bad bucket leaves the model as it was).
    """
    params = dict(model.named_parameters())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and "lm_head.weight" not in params and hasattr(model, "get_output_embeddings"):
        params["lm_head.weight"] = model.get_output_embeddings().weight

    def load(named: NamedTensors) -> None:
        for name, tensor in named:
            target = params.get(name)
            if target is None:
                raise KeyError(f"unknown parameter name {name!r}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {list(tensor.shape)} != model's {list(target.shape)}")
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)

    return load


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, in sorted name order.

    Bit-identical weights give the same digest on any host; used by tests and ``/weights_checker``.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        digest.update(t.flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_by_name(model: nn.Module, name: str, truncate_size: int = 100) -> list:
    """``/get_weights_by_name``: the parameter as float32, truncated to its first ``truncate_size`` rows."""
    params = dict(model.named_parameters())
    if name not in params:
        raise KeyError(f"unknown parameter name {name!r}")
    tensor = params[name].detach().float().cpu()
    return tensor[:truncate_size].tolist() if tensor.dim() else tensor.tolist()
