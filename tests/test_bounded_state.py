"""Bounded per-group Redis state (broker.retention, docs/broker.md "Bounded state") against a real Redis and the
real scripts: thousands of groups through dispatch, producer, both consumer groups and trim leave every
per-group key below a bound independent of the count; a pruned group's late send is refused and never trained
twice; a done position below the watermark is never handed out again; the audit stays exact over the pruned part
and still catches a loss; the in-memory stream keeps its acknowledged set bounded the same way."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from broker.admission import DispatchKeys, RedisCounters
from broker.client import BrokerKeys, connect
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.memory import MemoryProducer, MemorySource, MemoryStream
from broker.metrics import key_sizes
from broker.outcomes import Outcome, audit
from broker.producer import Producer
from broker.record import TrajectoryGroup, synthetic_group
from broker.retention import Pruner
from broker.staleness import StalenessManager
from common.config import SharedConfig
from rollout_fleet.dispatch import Lease, PromptDispatcher

pytestmark = pytest.mark.timeout(120)

SHARED = SharedConfig(run_id="bounded")
CFG = BrokerConfig(block_ms=0, read_count=64, keep_groups=50, prune_batch=200, retry_attempts=3)
PROMPTS = 40
# Keys that gain an entry per group without pruning (the done sets: dispatch:done:<epoch>).
PER_GROUP = ("trajectories:gids", "outcomes", "trajectories:acked:learner", "trajectories:acked:archive")
PER_GROUP += ("dropped:index", "dropped", "trajectories:retired", "trajectories")


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = connect(redis_url, CFG)
    yield c
    await c.aclose()


class Pipeline:
    """One rollout worker's dispatch and producer, the learner's and the archive's consumer groups."""

    def __init__(self, client: aioredis.Redis, config: BrokerConfig, worker: str = "w0") -> None:
        self.client, self.config = client, config
        counters = RedisCounters(client, SHARED)
        self.admission = StalenessManager(10_000, 1, 1 << 20, counters)
        self.dispatch = self.worker(worker)
        self.producer = Producer(client, SHARED, config, worker)
        self.learner = Consumer(client, SHARED, config, "learner-0")
        self.archive = Consumer(client, SHARED, config, "archiver", config.archive_group, dead_letters=False)

    def worker(self, worker: str) -> PromptDispatcher:
        return PromptDispatcher(
            self.client, SHARED, self.config, self.admission, num_prompts=PROMPTS, worker_id=worker, seed=1
        )

    async def start(self) -> None:
        await self.learner.ensure_group()
        await self.archive.ensure_group()

    async def generate(self, n: int) -> None:
        """Lease ``n`` prompts; every tenth position is dropped by the rollout worker, the rest produced."""
        for _ in range(n):
            lease = (await self.dispatch.lease()).lease
            assert lease is not None
            if lease.position % 10 == 9:
                assert await self.dispatch.complete(lease, "dropped", reason="engine_failures") == "OK"
            else:
                await self.producer.send(group_of(lease), lease.position)
                assert await self.dispatch.complete(lease, "produced") == "OK"

    async def consume(self, step: int) -> None:
        """The learner trains (or drops as stale, prompt index divisible by 7) what is new and acknowledges it
        with the outcomes; the archive reads and acknowledges it; the learner trims."""
        got = await self.learner.read(count=64, block_ms=0)
        outcomes = []
        for d in got:
            if d.group.prompt_index % 7 == 0:
                await self.learner.drop(d, "stale", admission=self.admission.counters)
                outcomes.append((d.group.group_id, Outcome("dropped", step, "stale")))
            else:
                outcomes.append((d.group.group_id, Outcome("trained", step)))
        await self.learner.ack(got, outcomes)
        await self.archive.ack(await self.archive.read(count=64, block_ms=0))
        await self.learner.trim()


def group_of(lease: Lease) -> TrajectoryGroup:
    rng = np.random.default_rng(lease.position)
    return synthetic_group(
        rng, SHARED.run_id, lease.prompt_index, num_samples=1, num_tokens=4, prompt_len=4, epoch=lease.epoch
    )


async def test_every_per_group_key_stays_bounded_and_the_audit_exact(client) -> None:
    p = Pipeline(client, CFG)
    await p.start()
    largest: dict[str, int] = {}
    rounds, per_round = 80, 25
    for step in range(rounds):
        await p.generate(per_round)
        await p.consume(step)
        if step % 4:
            continue
        for name, size in (await key_sizes(client, SHARED)).items():
            if name in PER_GROUP or name.startswith("dispatch:done:"):
                largest[name] = max(largest.get(name, 0), size)
    # keep_groups retired groups plus at most a round in flight, whatever the number of groups
    assert largest and max(largest.values()) <= CFG.keep_groups + 2 * per_round, largest
    total = rounds * per_round
    report = await audit(client, SHARED, CFG)
    assert report.ok and report.lost == 0 and report.trained_twice == 0 and report.pending == 0
    assert report.generated == total and report.produced == total - total // 10
    assert report.dropped_by_reason["engine_failures"] == total // 10
    assert report.trained + report.dropped == total and report.pruned >= total - CFG.keep_groups
    # the done watermark answers for the positions no set holds any more
    assert await p.dispatch.done(0) == set(range(PROMPTS))
    assert (await p.dispatch.progress())["epoch_done"] == PROMPTS


async def test_a_late_send_of_a_pruned_group_is_refused_and_a_done_position_never_handed_out(client) -> None:
    cfg = CFG.model_copy(update={"keep_groups": 0})
    p = Pipeline(client, cfg, worker="b")
    await p.start()
    dead = p.worker("a")
    dead_producer = Producer(client, SHARED, cfg, "a")
    keys = BrokerKeys.of(SHARED, cfg)
    leased = (await dead.lease()).lease  # a's worker dies holding position 0 ...
    assert leased is not None and leased.position == 0
    await dead.expire_own()
    taken = (await p.dispatch.lease()).lease  # ... which b takes over, produces, and the learner trains
    assert taken is not None and (taken.position, taken.source) == (0, "taken_over")
    gid = taken.group_id(SHARED.run_id)
    await p.producer.send(group_of(taken), taken.position)
    assert await p.dispatch.complete(taken, "produced") == "OK"
    await p.generate(5)
    await p.consume(step=1)
    assert not await client.hexists(keys.group_ids, gid) and not await client.hexists(keys.outcomes, gid)
    # a's late send (a retry after a lost reply, or the dead holder waking up) adds nothing
    assert await dead_producer.send(group_of(leased), leased.position) == ""
    assert dead_producer.refused == 1 and await client.xlen(keys.stream) == 0
    assert await p.learner.read(count=64, block_ms=0) == []
    assert await dead.complete(leased, "produced") == "DUP"
    report = await audit(client, SHARED, cfg)
    assert (report.generated, report.trained_twice, report.lost, report.pending) == (6, 0, 0, 0)
    # a done position below the watermark that turns up in the hand-back queue is skipped, not handed out again
    below = int(await client.get(DispatchKeys.of(SHARED).done_below))
    assert below == 6 and not await client.sismember(DispatchKeys.of(SHARED).done(0), "0")
    await client.lpush(DispatchKeys.of(SHARED).requeue, "0")
    fresh = (await p.dispatch.lease()).lease
    assert fresh is not None and (fresh.position, fresh.source) == (6, "leased")


async def test_a_group_whose_holder_died_before_completing_is_kept_until_its_position_is_done(client) -> None:
    cfg = CFG.model_copy(update={"keep_groups": 0})
    p = Pipeline(client, cfg, worker="b")
    await p.start()
    dead = p.worker("a")
    keys = BrokerKeys.of(SHARED, cfg)
    leased = (await dead.lease()).lease
    assert leased is not None
    # a produces, then dies before completing; the learner trains the group, both groups ack it, it is trimmed
    await Producer(client, SHARED, cfg, "a").send(group_of(leased), leased.position)
    await dead.expire_own()
    await p.consume(step=1)
    gid = leased.group_id(SHARED.run_id)
    assert await client.xlen(keys.stream) == 0 and await client.hexists(keys.group_ids, gid)
    taken = (await p.dispatch.lease()).lease  # b takes the prompt over and sends it again: the index answers
    assert taken is not None and taken.position == leased.position
    assert await p.producer.send(group_of(taken), taken.position) != "" and p.producer.resent == 1
    assert await p.dispatch.complete(taken, "produced") == "OK"
    await p.consume(step=2)  # nothing new to read; the trim's prune now takes the group
    assert not await client.hexists(keys.group_ids, gid)
    report = await audit(client, SHARED, cfg)
    assert (report.generated, report.trained, report.trained_twice, report.pruned) == (1, 1, 0, 1)


async def test_a_late_send_of_a_rollout_dropped_group_is_refused(client) -> None:
    p = Pipeline(client, CFG, worker="b")
    await p.start()
    dead = p.worker("a")
    leased = (await dead.lease()).lease
    assert leased is not None
    await dead.expire_own()
    taken = (await p.dispatch.lease()).lease
    assert taken is not None and taken.position == leased.position
    assert await p.dispatch.complete(taken, "dropped", reason="engine_failures") == "OK"
    # the late send stores its payload beside the entry first: the refusal deletes it
    by_reference = CFG.model_copy(update={"inline_max_bytes": 0})
    assert await Producer(client, SHARED, by_reference, "a").send(group_of(leased), leased.position) == ""
    assert await p.learner.read(count=64, block_ms=0) == []
    assert not [k async for k in client.scan_iter(match=BrokerKeys.of(SHARED, CFG).payload_prefix + "*")]
    assert (await audit(client, SHARED, CFG)).ok


async def test_the_audit_catches_a_loss_before_and_after_it_is_pruned(client) -> None:
    cfg = CFG.model_copy(update={"keep_groups": 10})
    p = Pipeline(client, cfg)
    await p.start()
    await p.generate(3)  # positions 0, 1, 2: all produced
    got = await p.learner.read(count=64, block_ms=0)
    # the first group is acknowledged without its outcome: generated, not in the stream, no outcome = lost
    outcomes = [None] + [(d.group.group_id, Outcome("trained", 1)) for d in got[1:]]
    await p.learner.ack(got, outcomes)
    await p.archive.ack(await p.archive.read(count=64, block_ms=0))
    await p.learner.trim()
    report = await audit(client, SHARED, cfg)
    lost_gid = got[0].group.group_id
    assert (report.lost, report.lost_ids, report.ok, report.pruned) == (1, [lost_gid], False, 0)
    assert await Pruner(client, SHARED, cfg.model_copy(update={"keep_groups": 0})).prune() == 3
    report = await audit(client, SHARED, cfg)
    assert (report.lost, report.lost_ids, report.ok, report.pruned) == (1, [], False, 3)
    assert (report.generated, report.trained) == (3, 2)


async def test_the_memory_stream_prunes_its_acknowledged_set_and_stays_idempotent() -> None:
    stream = MemoryStream(BrokerConfig(keep_groups=2))
    producer, source = MemoryProducer(stream, "p"), MemorySource(stream, "learner-0")
    groups = [synthetic_group(np.random.default_rng(i), "mem", i, num_samples=1) for i in range(6)]
    for g in groups:
        await producer.send(g)
    got = await source.read(count=16, block_ms=0)
    await source.ack(got, [(d.group.group_id, Outcome("trained", 1)) for d in got])
    assert await source.trim() == 6
    assert stream.acked == {g.group_id for g in groups[-2:]}
    await producer.send(groups[0])  # the index is kept: no position, no pruning of it
    assert producer.resent == 1 and not stream.entries and await source.read(block_ms=0) == []


async def test_one_trim_and_one_prune_do_bounded_work(client) -> None:
    cfg = CFG.model_copy(update={"keep_groups": 0, "prune_batch": 10})
    p = Pipeline(client, cfg)
    await p.start()
    await p.generate(25)  # 23 produced (positions 9 and 19 dropped by the rollout worker, retired at once)
    await p.learner.ack(await p.learner.read(count=64, block_ms=0))
    await p.archive.ack(await p.archive.read(count=64, block_ms=0))
    keys = BrokerKeys.of(SHARED, cfg)
    assert [await p.learner.trim() for _ in range(4)] == [10, 10, 3, 0]
    assert await client.llen(keys.retired) == 0 and await client.hlen(keys.group_ids) == 0
