"""Engine side of the weight sync: join the update group, receive buckets, hand them to the model. Colocated
engines take the same buckets by handle (``update_weights_from_tensor``, ``weight_sync.tensor_transport``): no
group, the same turns, session rules and replies.

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

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

from weight_sync import protocol
from weight_sync.buckets import TensorMeta, layout, unflatten
from weight_sync.group import UpdateGroup, join_group
from weight_sync.lora import LoraSpec
from weight_sync.tensor_transport import unpack

NamedTensors = list[tuple[str, torch.Tensor]]
LoadWeights = Callable[[NamedTensors], None]
# An engine that serves LoRA adapters: apply one bucket of adapter tensors (``M.lora_A.weight`` ...).
LoadAdapter = Callable[[NamedTensors, LoraSpec], None]
Destination = Callable[[TensorMeta], "torch.Tensor | None"]


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
    """One engine TP rank's receiver (tp_rank 0 for the built-in engine).

    Updates run in two ordered stages, receive then load, so that bucket k+1 can be received while bucket k is
    loaded (the sender sends k+1 once the broadcast of k has completed, before k's reply; with gloo a
    broadcast completes only after every receiver posted its receive, so requests arrive in order). Tickets
    are taken in arrival order (``take_ticket``, called by the HTTP handler on its event loop); two receive
    buffers alternate. Control calls (init, destroy, begin, end) wait until no update is in flight.
    """

    def __init__(
        self,
        load_weights: LoadWeights,
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        timeout_s: float = 120.0,
        require_session: bool = True,
        on_weight_version: Callable[[str], None] | None = None,
        reuse_buffers: bool = True,
        destination: Destination | None = None,
        load_adapter: LoadAdapter | None = None,
    ) -> None:
        self.load_weights = load_weights
        # Set on engines that take LoRA adapters over the group (``/load_lora_adapter_from_distributed``).
        self.load_adapter = load_adapter
        # Per-tensor updates (load_format null) may be received straight into the model's own tensors when the
        # engine names one of matching dtype, shape and device (``model_destination``): no receive buffer, no
        # load copy. Only while generation is paused (the sender always pauses); a failed receive leaves those
        # tensors partly written, which ``consistent`` reports as for any partial update.
        self.destination = destination
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.timeout_s = timeout_s
        self.require_session = require_session
        self.on_weight_version = on_weight_version
        # Receive into buffers kept across updates (on CPU a fresh one page-faults at every bucket; on GPU the
        # caching allocator does the same). The tensors handed to ``load_weights`` are views into them, valid
        # only during the call: copy them, as ``copy_into`` does.
        self.reuse_buffers = reuse_buffers
        self._buffers: list[torch.Tensor | None] = [None, None]
        self.groups: dict[str, UpdateGroup] = {}
        self.session_open = False
        self.session_loaded = False
        self.session_failed = False
        self.consistent = True
        self.weight_version: str | None = None
        self.stats = ReceiverStats()
        self._cv = threading.Condition()
        self._next_ticket = 0
        self._recv_turn = 0  # the ticket whose receive may run
        self._load_turn = 0  # the ticket whose load may run
        self._busy = False  # a control call is running

    # ----------------------------------------------------------------------------------- coordination

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding ``_cv``) until ``ready``; everything ahead is itself bounded by ``timeout_s``."""
        if not self._cv.wait_for(ready, timeout=3 * self.timeout_s + 10):
            raise RuntimeError(f"weight receiver: waited too long for {what}")

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run a control call (or an engine's own collective on the group) with no update in flight."""
        with self._cv:
            self._wait(
                lambda: (
                    self._recv_turn == self._next_ticket
                    and self._load_turn == self._next_ticket
                    and not self._busy
                ),
                "in-flight updates",
            )
            self._busy = True
        try:
            yield
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def take_ticket(self) -> int:
        """Reserve this update's place in line; call in arrival order (the HTTP handler's event loop)."""
        with self._cv:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    # ------------------------------------------------------------------------------------------- group

    def init_group(self, req: protocol.InitGroupRequest) -> tuple[bool, str]:
        """Join as rank ``rank_offset + tp_rank``; blocks until every rank has joined (or the timeout)."""
        with self.exclusive():
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
        with self.exclusive():
            group = self.groups.pop(group_name, None)
            if group is None:
                return False, protocol.MSG_DESTROY_MISSING
            group.destroy()
            return True, protocol.MSG_DESTROY_OK

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group(name)

    # ----------------------------------------------------------------------------------------- session

    def begin(self) -> tuple[bool, str]:
        with self.exclusive():
            if self.session_open:
                return False, protocol.MSG_BEGIN_TWICE
            self.session_open, self.session_loaded, self.session_failed = True, False, False
            self.stats.begins += 1
            return True, protocol.MSG_SESSION_OK

    def end(self) -> tuple[bool, str]:
        with self.exclusive():
            if not self.session_open:
                return False, protocol.MSG_END_WITHOUT_BEGIN
            self.session_open = False
            if self.session_loaded and not self.session_failed:
                self.consistent = True
            self.stats.ends += 1
            return True, protocol.MSG_SESSION_OK

    def mark_consistent(self, weight_version: str | None = None) -> None:
        """After a full reload (``/update_weights_from_disk``): the weights are whole again."""
        with self.exclusive():
            self.consistent = True
            if weight_version is not None:
                self._set_version(weight_version)

    # ------------------------------------------------------------------------------------------ update

    def update(
        self, req: protocol.UpdateRequest | protocol.TensorUpdateRequest, ticket: int | None = None
    ) -> tuple[bool, str]:
        """Receive one bucket and load it: broadcast from rank 0 (``update_weights_from_distributed``; blocks until
        the data arrived or timed out), or unpacked from the handles of ``update_weights_from_tensor`` (colocated:
        the sender's memory, mapped here). Both take the same turns and session rules."""
        ticket = self.take_ticket() if ticket is None else ticket
        outcome, named = None, None
        with self._cv:  # receive stage: in ticket order, once the load that used this buffer is done
            self._wait(
                lambda: self._recv_turn == ticket and self._load_turn >= ticket - 1 and not self._busy,
                f"the turn of update {ticket}",
            )
            outcome, group = self._admit(req)
        try:
            if outcome is None and isinstance(req, protocol.TensorUpdateRequest):
                named = unpack(req.serialized_named_tensors, req.load_format, self.tp_rank)
            elif outcome is None:
                named = self._receive(group, req.metas, req.load_format, ticket % 2, req.adapter is None)
        except Exception as exc:
            outcome = self._fail(f"Failed to receive weights: {exc}", partial=True)
            _drop_frames(exc)
        finally:
            with self._cv:
                self._recv_turn += 1
                self._cv.notify_all()
        with self._cv:  # load stage: in ticket order
            self._wait(lambda: self._load_turn == ticket, f"the load turn of update {ticket}")
        try:
            if outcome is None:
                outcome = self._load(req, named)
        finally:
            named = None  # a colocated payload maps the sender's memory: close it before replying
            with self._cv:
                self._load_turn += 1
                self._cv.notify_all()
        return outcome

    def _admit(
        self, req: protocol.UpdateRequest | protocol.TensorUpdateRequest
    ) -> tuple[tuple[bool, str] | None, UpdateGroup | None]:
        tensor = isinstance(req, protocol.TensorUpdateRequest)
        if self.require_session and not self.session_open:
            return (
                False,
                protocol.MSG_TENSOR_SESSION_REQUIRED if tensor else protocol.MSG_SESSION_REQUIRED,
            ), None
        if tensor:
            return None, None  # no group: the payload names shared memory
        if req.adapter is not None and self.load_adapter is None:
            return self._fail("Failed to load LoRA adapter: this engine does not serve LoRA adapters."), None
        group = self.groups.get(req.group_name)
        if group is None:
            known = list(self.groups)
            message = (
                f"Failed to receive weights: Group {req.group_name} not in {known}. "
                "Please call `init_weights_update_group` first."
            )
            return self._fail(message), None
        return None, group

    def _load(
        self, req: protocol.UpdateRequest | protocol.TensorUpdateRequest, named: NamedTensors
    ) -> tuple[bool, str]:
        adapter = getattr(req, "adapter", None)
        try:
            if named and adapter is not None:
                self.load_adapter(named, adapter)  # _admit refused the update if there is none
            elif named:
                self.load_weights(named)
        except Exception as exc:
            _drop_frames(exc)
            return self._fail(f"Failed to load weights: {exc}", partial=True)
        metas = (
            req.metas if isinstance(req, protocol.UpdateRequest) else [TensorMeta.of(n, t) for n, t in named]
        )
        with self._cv:
            if self.session_open:
                self.session_loaded = True
                self.consistent = False  # whole again only when end() closes a session without failures
            self.stats.updates += 1
            self.stats.tensors += len(metas)
            self.stats.bytes += sum(m.nbytes for m in metas)
            if req.weight_version is not None:
                self._set_version(req.weight_version)
        return True, protocol.MSG_UPDATE_OK + protocol.version_suffix(req.weight_version)

    def _buffer(self, nbytes: int, slot: int) -> torch.Tensor:
        """Receive buffer ``slot`` (0 or 1), reused across updates; grows to the largest bucket."""
        if not self.reuse_buffers:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            self._buffers[slot] = None  # free the smaller one first
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def _receive(
        self,
        group: UpdateGroup,
        metas: list[TensorMeta],
        load_format: str | None,
        slot: int,
        direct_ok: bool = True,
    ) -> NamedTensors:
        timeout = timedelta(seconds=self.timeout_s)
        if load_format == "flattened_bucket":
            ranges = layout(metas)  # raises "Unaligned received tensor" before any receive is posted
            flat = self._buffer(ranges[-1][1] if ranges else 0, slot)
            group.broadcast(flat, async_op=True).wait(timeout)
            return unflatten(flat, metas)
        direct = [self._direct(m) if direct_ok else None for m in metas]
        rest = [m for m, d in zip(metas, direct, strict=True) if d is None]
        try:  # per tensor: views of the reusable buffer when the layout allows, else fresh tensors
            ranges = layout(rest)
            buf = self._buffer(ranges[-1][1] if ranges else 0, slot)
            staged = [buf[a:b].view(m.dtype).reshape(m.shape) for m, (a, b) in zip(rest, ranges, strict=True)]
        except ValueError:
            staged = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in rest]
        pending = iter(staged)
        tensors = [d if d is not None else next(pending) for d in direct]
        works = [group.broadcast(t, async_op=True) for t in tensors]
        for work in works:
            work.wait(timeout)
        return [(m.name, t) for m, t, d in zip(metas, tensors, direct, strict=True) if d is None]

    def _direct(self, meta: TensorMeta) -> torch.Tensor | None:
        """The model's own tensor for ``meta`` when it can receive the broadcast as is."""
        if self.destination is None:
            return None
        target = self.destination(meta)
        ok = (
            target is not None
            and target.dtype == meta.dtype
            and tuple(target.shape) == meta.shape
            and target.device == self.device
            and target.is_contiguous()
        )
        return target if ok else None

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


def _drop_frames(exc: BaseException | None) -> None:
    """Cut a failed update's traceback: its frames hold the received tensors, and an error that crossed threads
    (the scheduler's future keeps it) sits in a reference cycle, so a colocated payload's shared memory would
    stay mapped until the next garbage collection."""
    while exc is not None:
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


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


def model_destination(model: nn.Module) -> Destination:
    """A ``destination`` for a Hugging Face model whose parameter names are the HF checkpoint names (no fused
    or sharded layers): broadcasts land in ``param.data`` directly."""
    params = {name: p.data for name, p in model.named_parameters()}
    return lambda meta: params.get(meta.name)


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
