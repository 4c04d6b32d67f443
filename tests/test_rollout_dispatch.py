"""Prompt dispatch against a real Redis: exactly-once hand-out across workers, lease expiry and takeover with the
admission slot, hand-back, drops recorded once, and the refusal of a worker configured differently."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from broker.admission import RedisCounters
from broker.client import connect
from broker.config import BrokerConfig
from broker.consumer import dropped
from broker.record import make_group_id
from broker.staleness import StalenessManager
from common.config import SharedConfig
from rollout_fleet.dispatch import DispatchMismatch, PromptDispatcher

pytestmark = pytest.mark.timeout(60)

SHARED = SharedConfig(run_id="disp")
BROKER = BrokerConfig()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = connect(redis_url, BROKER)
    yield c
    await c.aclose()


def admission(client: aioredis.Redis, eta: int = 100, groups_per_step: int = 100) -> StalenessManager:
    return StalenessManager(eta, groups_per_step, 1 << 20, RedisCounters(client, SHARED))


def dispatcher(
    client: aioredis.Redis, worker: str, adm: StalenessManager | None = None, **kw
) -> PromptDispatcher:
    options = {"num_prompts": 10, "seed": 7, "task": "t", "lease_ttl_s": 30.0, "max_epochs": 2, **kw}
    return PromptDispatcher(client, SHARED, BROKER, adm or admission(client), worker_id=worker, **options)


async def test_every_prompt_of_every_epoch_is_handed_out_once_across_concurrent_workers(client) -> None:
    workers = [dispatcher(client, f"w{i}") for i in range(3)]
    got: list[tuple[int, int, int]] = []

    async def run(d: PromptDispatcher) -> None:
        while True:
            answer = await d.lease()
            if answer.status == "exhausted":
                if answer.leases_left == 0:
                    return
                await asyncio.sleep(0.01)
                continue
            assert answer.status == "lease"
            lease = answer.lease
            got.append((lease.position, lease.epoch, lease.prompt_index))
            await asyncio.sleep(0)
            assert await d.complete(lease, "produced") == "OK"

    await asyncio.gather(*(run(d) for d in workers))
    positions = sorted(p for p, _, _ in got)
    assert positions == list(range(20))
    per_epoch = Counter((e, i) for _, e, i in got)
    assert set(per_epoch) == {(e, i) for e in range(2) for i in range(10)} and set(per_epoch.values()) == {1}
    # The hand-out order inside an epoch is the seeded permutation, the same for every worker.
    by_pos = {p: i for p, _, i in got}
    for e in range(2):
        assert [by_pos[e * 10 + k] for k in range(10)] == list(workers[0].order(e))
    assert list(workers[0].order(0)) != list(workers[0].order(1))
    snap = await workers[0].admission.counters.snapshot()
    assert (snap.running, snap.accepted, snap.started) == (0, 20, 20)
    assert await workers[0].done(0) == set(range(10)) and await workers[0].done(1) == set(range(10, 20))


async def test_an_expired_lease_is_taken_over_with_its_admission_slot(client) -> None:
    adm = admission(client, eta=0, groups_per_step=3)  # capacity: 3 groups in flight, none consumed
    a = dispatcher(client, "a", adm, lease_ttl_s=0.3)
    b = dispatcher(client, "b", adm, lease_ttl_s=30.0)
    held = [(await a.lease()).lease for _ in range(3)]
    assert all(x is not None for x in held)
    assert (await b.lease()).status == "wait"  # no capacity, nothing expired yet
    await asyncio.sleep(0.4)
    taken = [(await b.lease()).lease for _ in range(3)]
    assert sorted(x.position for x in taken) == sorted(x.position for x in held)
    assert {x.source for x in taken} == {"taken_over"} and {x.previous_holder for x in taken} == {"a"}
    snap = await adm.counters.snapshot()
    assert (snap.running, snap.started) == (
        3,
        3,
    )  # the slots moved with the leases; nothing leaked or doubled
    assert sorted(await a.renew([x.position for x in held])) == sorted(x.position for x in held)
    # The stalled old holder may not record a drop; it may report a production (idempotent XADD upstream).
    assert await a.complete(held[0], "dropped", reason="engine_failures") == "LOST"
    assert await a.complete(held[1], "produced") == "OK_OTHER"
    assert await b.complete(taken_by(taken, held[1]), "produced") == "DUP"
    assert await b.complete(taken_by(taken, held[0]), "produced") == "OK"
    snap = await adm.counters.snapshot()
    assert (snap.running, snap.accepted) == (1, 2)
    lost = await b.renew([x.position for x in taken])
    assert sorted(lost) == sorted([held[0].position, held[1].position])
    assert await dropped(client, SHARED, BROKER) == []


def taken_by(taken: list, lease) -> object:
    return next(x for x in taken if x.position == lease.position)


async def test_handed_back_leases_go_first_and_give_capacity_back(client) -> None:
    adm = admission(client, eta=0, groups_per_step=2)
    a, b = dispatcher(client, "a", adm), dispatcher(client, "b", adm)
    first = [(await a.lease()).lease for _ in range(2)]
    assert (await b.lease()).status == "wait"
    assert await a.release([x.position for x in first]) == 2
    snap = await adm.counters.snapshot()
    assert (snap.running, snap.rejected) == (0, 2)
    again = [(await b.lease()).lease for _ in range(2)]
    assert {x.position for x in again} == {x.position for x in first}
    assert {x.source for x in again} == {"requeued"}
    assert await a.release([x.position for x in first]) == 0  # not a's any more


async def test_a_drop_is_recorded_once_with_its_reason_and_the_prompt_is_done(client) -> None:
    d = dispatcher(client, "w", max_epochs=1)
    lease = (await d.lease()).lease
    status = await d.complete(lease, "dropped", reason="bad_request", detail="prompt too long")
    assert status == "OK"
    assert await d.complete(lease, "dropped", reason="bad_request") == "DUP"
    rows = await dropped(client, SHARED, BROKER)
    assert len(rows) == 1
    row = rows[0]
    assert row["gid"] == make_group_id("disp", lease.epoch, lease.prompt_index, 0) == lease.group_id("disp")
    assert (row["reason"], row["source"], row["detail"], row["consumer"]) == (
        "bad_request",
        "rollout",
        "prompt too long",
        "w",
    )
    snap = await d.admission.counters.snapshot()
    assert (snap.running, snap.rejected, snap.accepted) == (0, 1, 0)
    assert await d.done(0) == {lease.position}


async def test_renewed_leases_survive_their_ttl(client) -> None:
    a = dispatcher(client, "a", lease_ttl_s=0.3)
    b = dispatcher(client, "b")
    held = (await a.lease()).lease
    for _ in range(5):
        await asyncio.sleep(0.1)
        assert await a.renew([held.position]) == []
    other = (await b.lease()).lease
    assert other.position != held.position and other.source == "leased"


async def test_a_restarted_worker_expires_its_previous_leases(client) -> None:
    first = dispatcher(client, "same")
    held = (await first.lease()).lease
    again = dispatcher(client, "same")
    assert await again.expire_own() == 1
    lease = (await dispatcher(client, "other").lease()).lease
    assert (lease.position, lease.source, lease.previous_holder) == (held.position, "taken_over", "same")


async def test_exhausted_reports_leases_still_held_elsewhere(client) -> None:
    a = dispatcher(client, "a", num_prompts=2, max_epochs=1)
    b = dispatcher(client, "b", num_prompts=2, max_epochs=1)
    x, y = (await a.lease()).lease, (await a.lease()).lease
    answer = await b.lease()
    assert (answer.status, answer.leases_left) == ("exhausted", 2)
    await a.complete(x, "produced")
    await a.complete(y, "produced")
    assert (await b.lease()).leases_left == 0


async def test_a_worker_with_another_prompt_set_is_refused(client) -> None:
    await dispatcher(client, "a").lease()
    with pytest.raises(DispatchMismatch, match="num_prompts=11.*num_prompts=10"):
        await dispatcher(client, "b", num_prompts=11).lease()
    with pytest.raises(DispatchMismatch, match="seed=8"):
        await dispatcher(client, "b", seed=8).lease()
