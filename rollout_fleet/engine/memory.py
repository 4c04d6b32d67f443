"""Sleep and wake of the built-in engine: SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``.

Colocated mode puts the learner and the engine on one device; while the learner trains, the engine gives back its
memory. Tags (docs/sglang_api.md section 4): ``kv_cache`` frees the KV pool
(:meth:`~rollout_fleet.engine.kv_cache.PagedKVCache.release`), ``weights`` frees the weight tensors' storage
(:class:`WeightMemory`), ``cuda_graph`` is accepted and frees nothing (this engine captures no graphs). Resuming
allocates again; the KV starts empty, the weights read as zeros until the next update brings real ones (SGLang's
memory saver leaves them undefined; zeros are undefined too, but never NaN). The engine refuses generation while
``kv_cache`` or ``weights`` is released (scheduler), and a weight update while ``weights`` is.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class WeightMemory:
    """Frees and re-allocates a model's parameter storage in place, keeping every tensor object (and every view:
    the runner's fused q/k/v and gate/up matrices are storages the HF parameters are views of).

    A resizable storage is shrunk to 0 bytes and grown back (``UntypedStorage.resize_``, as FSDP frees unsharded
    parameters). A storage that cannot be resized (a parameter loaded from a memory-mapped safetensors file) is
    replaced: the parameter's ``.data`` becomes an empty tensor, and a new one of its shape at resume."""

    model: nn.Module
    _storages: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    _replaced: list[tuple[nn.Parameter, torch.Size]] = field(default_factory=list)
    released: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters' storage (each storage once), i.e. what a release frees."""
        seen: dict[int, int] = {}
        for p in self.model.parameters():
            storage = p.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values()) if not self.released else 0

    def release(self) -> None:
        if self.released:
            return
        storages: dict[int, torch.UntypedStorage] = {}
        for p in self.model.parameters():
            storage = p.untyped_storage()
            if storage.resizable():
                storages.setdefault(storage.data_ptr(), storage)
            else:
                self._replaced.append((p, p.shape))
        for storage in storages.values():
            self._storages.append((storage, storage.nbytes()))
            storage.resize_(0)
        for p, _ in self._replaced:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released = True

    def resume(self) -> None:
        if not self.released:
            return
        with torch.no_grad():
            for storage, nbytes in self._storages:
                storage.resize_(nbytes)
                torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
            for p, shape in self._replaced:
                p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self._storages, self._replaced = [], []
        self.released = False


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``): the weights' storages are mostly smaller
    than glibc's dynamic mmap threshold, so a free alone keeps their pages resident for reuse. No-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_bytes(pid: int | None = None) -> int:
    """The process's resident set size (``VmRSS`` of /proc/PID/status), bytes; 0 where /proc has no such file."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
