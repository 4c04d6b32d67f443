"""Tensors by handle between two processes of one host: SGLang's ``MultiprocessingSerializer`` for the colocated
path (``/update_weights_from_tensor``, docs/sglang_api.md 3.5).

What travels: ``serialize(obj)`` is the base64 text of a ``multiprocessing.reduction.ForkingPickler`` pickle with
torch's tensor reductions, so a tensor is never copied into the message: a CUDA tensor becomes a CUDA IPC handle
(``rebuild_cuda_tensor``), a CPU tensor the name of a shared-memory file (``rebuild_storage_filename``). The
receiver maps the same memory; its copy into the model is the only copy. SGLang deserializes the same bytes.

Why torch's ``file_system`` mechanism on CPU (and not the default ``file_descriptor`` strategy): that one sends the
descriptor through ``multiprocessing.resource_sharer``, a socket that authenticates with the sender's
``multiprocessing`` authkey. Only processes forked or spawned from one parent share that key; a learner and an
engine started by a supervisor do not, and the receiver fails with ``AuthenticationError: digest sent was
rejected`` (checked here with two unrelated processes). ``file_system`` names a file in /dev/shm instead, which
any process of the host may open. It is selected per pickle (a private reducer), never by changing the
process-wide ``torch.multiprocessing`` sharing strategy.

Who frees the memory. torch's shared files are reference counted in their own header: the sender's pickle adds
one reference for the receiver, the receiver's unpickle takes it over, and the last process to close the file
unlinks it. A receiver killed before or while it holds the mapping never gives its reference back, so the file
would stay in /dev/shm as long as the sender lives (torch's shm manager unlinks it only when the sender exits).
The sender therefore owns its buffers' names: :class:`SharedBuffers` allocates them and, once every receiver has
answered or been given up on, takes one extra reference (so that no later close reaches zero) and unlinks the
name itself. The memory goes back to the OS when the last mapping closes; a dead receiver's mapping closed with
its process. Hence: serialize only tensors whose names you control (a ``SharedBuffers`` buffer, or a view of
one): serializing any other CPU tensor moves its storage into shared memory in place, as torch always does.

The receiver's unpickler is restricted: only torch's rebuild functions, storage and tensor classes, dtypes and the
two payload classes below (also under SGLang's module paths) may be named, so a request cannot run code.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import io
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's ForkingPickler reductions (init_reductions)
from torch.multiprocessing import reductions
from torch.nn.parameter import Parameter

from weight_sync.buckets import TensorMeta, layout, unflatten

NamedTensors = list[tuple[str, torch.Tensor]]
SHM_DIR = "/dev/shm"


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a ``flattened_bucket`` payload: SGLang's ``weight_sync.tensor_bucket.FlattenedTensorMetadata``
    (``start_idx`` / ``end_idx`` are byte offsets into the uint8 ``flattened_tensor``)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    """SGLang's per-TP-rank wrapper (verl's per-tensor path): ``values[r]`` is TP rank r's own serialization."""

    values: list[Any] = field(default_factory=list)


@functools.cache
def _metadata_class() -> type:
    """SGLang's own class when it is importable here, so a real SGLang server can unpickle our buckets; else ours
    (which the built-in engine accepts under either path)."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as SglangMeta
    except Exception:  # no sglang in this environment (CPU runs): the built-in engine takes ours
        return FlattenedTensorMetadata
    return SglangMeta


# --------------------------------------------------------------------------------------------- serialize


def _reduce_storage(storage: torch.UntypedStorage) -> tuple:
    """torch's ``reduce_storage`` with its ``file_system`` branch chosen for CPU storages (see the module doc)."""
    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)  # CUDA storages travel inside their tensor's reduction
    if storage.nbytes() == 0:
        return (reductions.rebuild_storage_empty, (type(storage),))
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's reference, taken over by its rebuild_storage_filename
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return (reductions.rebuild_storage_filename, (type(storage), *metadata))


def serialize(obj: Any) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)``: base64 of a ForkingPickler pickle in which
    tensors are handles (CUDA IPC, or a /dev/shm name on CPU). CPU tensors are moved into shared memory in place:
    pass :class:`SharedBuffers` buffers (or views of them)."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ------------------------------------------------------------------------------------------- deserialize

_REBUILDS = {
    "rebuild_tensor",
    "rebuild_cuda_tensor",
    "rebuild_typed_storage",
    "rebuild_typed_storage_child",
    "rebuild_storage_filename",
    "rebuild_storage_empty",
}
_OWN = {"FlattenedTensorMetadata": FlattenedTensorMetadata, "LocalSerializedTensor": LocalSerializedTensor}
_SGLANG_MODULES = {
    "sglang.srt.weight_sync.tensor_bucket",
    "sglang.srt.utils",
    "sglang.srt.utils.common",
    __name__,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the names a tensor payload needs; anything else is refused before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name in _REBUILDS:
            return getattr(reductions, name)
        if module == "torch.multiprocessing.reductions" and name == "rebuild_storage_fd":
            raise pickle.UnpicklingError(
                "a CPU tensor shared by file descriptor (torch's default sharing strategy) cannot reach an "
                "unrelated process; serialize with weight_sync.tensor_transport.serialize (file_system)"
            )
        if module == "torch" and name in ("Tensor", "Size"):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in ("torch", "torch.storage") and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch.storage, name)
        if module == "torch.nn.parameter" and name == "Parameter":
            return Parameter
        if module in _SGLANG_MODULES and name in _OWN:
            return _OWN[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor payload")


def deserialize(data: str | bytes) -> Any:
    """The inverse of :func:`serialize` (base64 text, or SGLang's raw bytes inside ``LocalSerializedTensor``);
    raises ``ValueError`` for anything that is not such a payload."""
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64: {exc}") from None
    try:
        return _RestrictedUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:  # a truncated pickle, a handle that no longer opens (its sender is gone)
        raise ValueError(f"cannot unpickle: {type(exc).__name__}: {exc}") from None


# ------------------------------------------------------------------------------------ payload (both sides)


def bucket_payload(flat: torch.Tensor, metas: Sequence[TensorMeta], flattened: bool) -> Any:
    """What one TP rank deserializes for one bucket packed in ``flat`` (uint8): ``flattened_bucket`` is SGLang's
    ``{"flattened_tensor", "metadata"}``; otherwise (``load_format`` null) ``[(name, tensor)]`` of views of it."""
    if not flattened:
        return unflatten(flat, metas)
    cls = _metadata_class()
    metadata = [
        cls(m.name, torch.Size(m.shape), m.dtype, start, end, m.numel)
        for m, (start, end) in zip(metas, layout(metas), strict=True)
    ]
    return {"flattened_tensor": flat, "metadata": metadata}


def _tensor(value: Any, where: str, tp_rank: int) -> torch.Tensor:
    if isinstance(value, LocalSerializedTensor):
        if not 0 <= tp_rank < len(value.values):
            raise ValueError(f"{where}: LocalSerializedTensor has no entry for TP rank {tp_rank}")
        value = deserialize(value.values[tp_rank])
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: expected a tensor, got {type(value).__name__}")
    return value


def _unpack_list(obj: Any, where: str, tp_rank: int) -> NamedTensors:
    if not isinstance(obj, list | tuple) or not obj:
        raise ValueError(f"{where}: load_format null needs a non-empty list of (name, tensor)")
    named = []
    for i, item in enumerate(obj):
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not item[0]
        ):
            raise ValueError(f"{where}[{i}]: expected a (name, tensor) pair")
        named.append((item[0], _tensor(item[1], f"{where}[{i}] ({item[0]})", tp_rank)))
    return named


def _unpack_flattened(obj: Any, where: str) -> NamedTensors:
    if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
        raise ValueError(f"{where}: flattened_bucket needs a dict with flattened_tensor and metadata")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"{where}.flattened_tensor: expected a 1-D uint8 tensor")
    if not isinstance(metadata, list) or not metadata:
        raise ValueError(f"{where}.metadata: expected a non-empty list of FlattenedTensorMetadata")
    metas = []
    for i, m in enumerate(metadata):
        if not isinstance(m, FlattenedTensorMetadata):
            raise ValueError(
                f"{where}.metadata[{i}]: expected FlattenedTensorMetadata, got {type(m).__name__}"
            )
        shape = tuple(m.shape) if isinstance(m.shape, list | tuple) else None
        if not isinstance(m.name, str) or shape is None or not all(isinstance(d, int) for d in shape):
            raise ValueError(f"{where}.metadata[{i}]: name must be a string and shape a list of ints")
        if not isinstance(m.dtype, torch.dtype):
            raise ValueError(f"{where}.metadata[{i}] ({m.name}): dtype {m.dtype!r} is not a torch dtype")
        metas.append(TensorMeta(m.name, m.dtype, shape))
    try:
        ranges = layout(metas)
    except ValueError as exc:
        raise ValueError(f"{where}.metadata: {exc}") from None
    for i, (m, (start, end)) in enumerate(zip(metadata, ranges, strict=True)):
        if (m.start_idx, m.end_idx, m.numel) != (start, end, metas[i].numel):
            raise ValueError(
                f"{where}.metadata[{i}] ({m.name}): start_idx, end_idx, numel = {m.start_idx}, {m.end_idx}, "
                f"{m.numel}; the packed layout (in order, no padding) gives {start}, {end}, {metas[i].numel}"
            )
    try:
        return unflatten(flat, metas)
    except ValueError as exc:
        raise ValueError(f"{where}.flattened_tensor: {exc}") from None


def unpack(serialized: Sequence[str], load_format: str | None, tp_rank: int = 0) -> NamedTensors:
    """The named tensors TP rank ``tp_rank`` loads from ``serialized_named_tensors`` (views of the sender's
    memory: copy them, then drop them, so the mapping closes). Errors name the field."""
    where = f"serialized_named_tensors[{tp_rank}]"
    if not 0 <= tp_rank < len(serialized):
        raise ValueError(
            f"serialized_named_tensors has {len(serialized)} entries; TP rank {tp_rank} reads entry {tp_rank}"
        )
    try:
        obj = deserialize(serialized[tp_rank])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if load_format == "flattened_bucket":
        return _unpack_flattened(obj, where)
    return _unpack_list(obj, where, tp_rank)


# ---------------------------------------------------------------------------------- the sender's buffers


class SharedBuffers:
    """uint8 buffers that can travel by handle, whose names the owner unlinks itself (:meth:`close`).

    CPU: a file in /dev/shm (torch's ``file_system`` mechanism). CUDA: device memory (a CUDA IPC handle is
    released by torch's own reference counting once every receiver has closed it). Every buffer is held until
    ``close``, so none is freed, or its name reused, while a receiver may still open it."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, str | None]] = []

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        name = None
        if buf.device.type == "cpu" and nbytes > 0:
            name = buf.untyped_storage()._share_filename_cpu_()[1].decode()
        self._held.append((buf, name))
        return buf

    @property
    def names(self) -> list[str]:
        """The /dev/shm names of the CPU buffers held now (tests and leak checks)."""
        return [name for _, name in self._held if name is not None]

    def close(self) -> None:
        """Call once every receiver of every buffer has answered or been given up on: unlink each name (the
        memory is returned when the last mapping closes) and drop the buffers."""
        for buf, name in self._held:
            if name is None:
                continue
            buf.untyped_storage()._shared_incref()  # no close may reach zero: torch would unlink it again, and abort
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name.lstrip("/")))
        self._held.clear()


def leaked_files(pid: int | None = None) -> list[str]:
    """torch's shared-memory files in /dev/shm created by process ``pid`` (default: this one)."""
    prefix = f"torch_{os.getpid() if pid is None else pid}_"
    try:
        return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))
    except FileNotFoundError:
        return []
