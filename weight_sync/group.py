"""An independent process group between the learner's rank 0 and every engine rank, built the way SGLang's
``init_custom_process_group`` builds it, so one side can be SGLang and the other ours.

The layout both sides must agree on:

- rendezvous on ``tcp://<master_address>:<master_port>``; the TCPStore server is hosted by rank 0 (the trainer);
- the store is wrapped in ``PrefixStore(group_name, store)`` and handed to torch's
  ``_new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=...)``;
- ranks map to themselves (``pg_group_ranks[pg] = {i: i}``), so ``broadcast(src=0, group=pg)`` means rank 0.

Why not ``torch.distributed.rendezvous``: under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) it makes every
rank, rank 0 included, a *client* of the elastic agent's store, so rank 0 would wait for a server nobody starts.
We create the TCPStore ourselves with exactly the arguments ``rendezvous`` would use otherwise (``is_master =
rank == 0``, ``multi_tenant=True``). Rank 0 may bind port 0 and read the port back, which removes the
pick-a-free-port race; the engines are then told the real port.

The group is independent of the default group (FSDP's, on the learner; none on an engine) and may coexist with
it in the same process: it is never the default group, and destroying it leaves the default group alone.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import Backend, PrefixStore, TCPStore
from torch.distributed.distributed_c10d import _new_process_group_helper, _world


def default_backend() -> str:
    """nccl when a GPU is present, else gloo: the same code on both."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def host_address() -> str:
    """An address of this host that other hosts can reach (the interface of the default route), else
    loopback. Only a guess; set ``weight_sync.master_address`` explicitly on multi-homed hosts."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))  # no packet is sent for UDP connect
            return sock.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def open_store(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> TCPStore:
    """The rendezvous store: a server on rank 0 (``port`` 0 picks a free one), a client elsewhere."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank} must be in [0, world_size = {world_size})")
    if not 0 <= port < 2**16:
        raise ValueError(f"master_port = {port} must be in [0, 65535]")
    if rank != 0 and port == 0:
        raise ValueError("master_port = 0: only rank 0 may pick a free port; other ranks need the real one")
    return TCPStore(
        host_name=address,
        port=port,
        world_size=world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )


@dataclass
class UpdateGroup:
    """A joined weight-update group: rank 0 is the sender, ranks 1.. are engine ranks."""

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    store: TCPStore = field(repr=False)
    destroyed: bool = False

    def broadcast(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Broadcast from rank 0 (sender) into ``tensor`` on every other rank."""
        return dist.broadcast(tensor, src=0, group=self.pg, async_op=async_op)

    def destroy(self) -> None:
        """Tear the group down (idempotent). Safe after a member died: nothing here is collective."""
        if self.destroyed:
            return
        self.destroyed = True
        try:
            dist.destroy_process_group(self.pg)
        except (ValueError, RuntimeError):  # already unregistered, or the backend is broken: nothing to free
            _world.pg_names.pop(self.pg, None)


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str | None = None,
    timeout_s: float = 120.0,
    store: TCPStore | None = None,
) -> UpdateGroup:
    """Join (rank 0: create) the group. Blocks until all ``world_size`` ranks have joined or ``timeout_s``.

    Rank 0 may pass the ``store`` it opened earlier with ``open_store`` (to learn the port before the engines
    are told it); otherwise the store is opened here.
    """
    if not group_name:
        raise ValueError("group_name must be non-empty")
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend = {backend!r}: expected 'gloo' or 'nccl'")
    if group_name in _world.pg_names.values():
        raise ValueError(f"group_name = {group_name!r} is already in use in this process; destroy it first")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = open_store(master_address, master_port, rank, world_size, timeout_s)
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), prefixed, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return UpdateGroup(pg, rank, world_size, group_name, backend, timeout_s, store)
