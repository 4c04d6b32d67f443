"""The update group over real gloo processes: it coexists with the learner's default group in the same process,
works under torchrun's agent-store environment, and can be destroyed and rebuilt with a new membership."""

from __future__ import annotations

import os
import queue
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from weight_sync.group import join_group, open_store

pytestmark = pytest.mark.timeout(90)
TIMEOUT_S = 20.0


def _trainer(ports: mp.Queue, results: mp.Queue, default_port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{default_port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # the learner's own (FSDP) group
    # Under torchrun this is set; torch's rendezvous() would then make rank 0 a store *client* and hang.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    # Membership 1: trainer + engines A (rank 1) and B (rank 2).
    store = open_store("127.0.0.1", 0, 0, 3, TIMEOUT_S)
    ports.put(store.port)
    ports.put(store.port)
    group = join_group("127.0.0.1", store.port, 0, 3, "wug", "gloo", TIMEOUT_S, store=store)
    payload = torch.arange(1000, dtype=torch.float32)
    group.broadcast(payload)
    probe = torch.ones(1)
    dist.all_reduce(probe)  # the default group still works next to the update group
    group.destroy()
    # Membership 2: B alone, now rank 1; the same group name is reusable once destroyed.
    store = open_store("127.0.0.1", 0, 0, 2, TIMEOUT_S)
    ports.put(store.port)
    group = join_group("127.0.0.1", store.port, 0, 2, "wug", "gloo", TIMEOUT_S, store=store)
    group.broadcast(payload * 2)
    group.destroy()
    results.put(("trainer", dist.get_world_size(), float(probe.item()), dist.is_initialized()))
    dist.destroy_process_group()


def _engine(name: str, first_rank: int, ports: mp.Queue, results: mp.Queue, stays: bool) -> None:
    torch.set_num_threads(1)
    port = ports.get(timeout=TIMEOUT_S)
    group = join_group("127.0.0.1", port, first_rank, 3, "wug", "gloo", TIMEOUT_S)
    got = torch.empty(1000)
    group.broadcast(got)
    sums = [float(got.sum())]
    group.destroy()
    if stays:
        port = ports.get(timeout=TIMEOUT_S)
        group = join_group("127.0.0.1", port, 1, 2, "wug", "gloo", TIMEOUT_S)
        group.broadcast(got)
        sums.append(float(got.sum()))
        group.destroy()
    results.put((name, sums))


def test_group_coexists_with_default_group_and_rebuilds_with_new_membership() -> None:
    from broker.server import free_port

    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_trainer, args=(ports, results, free_port())),
        ctx.Process(target=_engine, args=("A", 1, ports, results, False)),
        ctx.Process(target=_engine, args=("B", 2, ports, results, True)),
    ]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            item = results.get(timeout=60)
            got[item[0]] = item[1:]
    except queue.Empty:
        pytest.fail(f"a group member did not finish; exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    expected = float(torch.arange(1000, dtype=torch.float32).sum())
    assert got["A"] == ([expected],)
    assert got["B"] == ([expected, 2 * expected],)
    assert got["trainer"] == (1, 1.0, True)  # default group intact after two update groups came and went
