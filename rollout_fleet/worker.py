"""The rollout worker shell: leases prompts, runs each through the task's workflow, and writes one trajectory
record per group to the stream.

One asyncio loop (uvloop in production) keeps up to ``rollout.max_concurrent_groups`` groups in flight. The shell
does what every workflow shares:

- leases from the dispatch (admission, the staleness bound, is applied by the lease script of
  :mod:`broker.admission`; the rollout-side policy is :mod:`rollout_fleet.dispatch`), renews them (heartbeats), and cancels a group whose lease was taken over;
- keeps the published policy version cached (:class:`VersionCache`) and the engines' health checked;
- sends each finished group through the idempotent producer, then marks its prompt done;
- writes the metrics (:class:`~rollout_fleet.workflows.stats.WorkerStats`, rates) to the metrics stream.

Generation is the workflow's (:mod:`rollout_fleet.workflows`: the single-turn group workflow, the multi-turn
episode workflow over the environment adapters of :mod:`rollout_fleet.envs`), through one engine session that
owns the HTTP calls, retries and resubmission (:mod:`rollout_fleet.workflows.session`).

A group that cannot be completed is either *dropped* (recorded in the dropped stream with a reason: the
engines rejected the request, answered nonsense, or kept failing on it) or *handed back* (no healthy engine,
shutdown: another worker, or this one later, runs it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from broker.client import BrokerKeys
from broker.config import BrokerConfig
from broker.metrics import RUN_INFO_KEY, MetricsWriter
from broker.producer import BackpressureTimeout
from broker.protocols import TrajectoryProducer
from broker.record import RecordError
from broker.staleness import StalenessManager
from broker.version import PolicyVersion
from common.config import SharedConfig
from common.versioning import Lineage
from rollout_fleet.config import RolloutConfig
from rollout_fleet.dispatch import Lease, PromptDispatcher
from rollout_fleet.workflows.abandon import DROP, HAND_BACK, GroupAbandoned
from rollout_fleet.workflows.base import GroupWorkflow
from rollout_fleet.workflows.stats import WorkerStats

__all__ = [
    "Coordination",
    "MetricsReporter",
    "GroupAbandoned",
    "RequestsRejected",
    "RolloutWorker",
    "VersionCache",
    "WorkerSettings",
    "WorkerStats",
]

log = logging.getLogger("streamrl.rollout")


class RequestsRejected(Exception):
    """``rollout.max_rejected_in_a_row`` groups in a row were rejected by the engines: the requests are wrong
    (a configuration error), not the prompts, and going on would drop every prompt of the run."""


class VersionCache:
    """The published policy version and its lineage, cached for the admission bound and the engines' staleness
    bound: re-read on every announcement on the control stream and at least every ``poll_s``. Nothing published
    yet counts as version 0."""

    def __init__(
        self,
        client: aioredis.Redis,
        shared: SharedConfig,
        broker: BrokerConfig,
        poll_s: float,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.policy = PolicyVersion(client, shared, broker)
        self.control = BrokerKeys.of(shared, broker).control
        self.poll_ms = max(1, int(poll_s * 1000))
        self.on_change = on_change
        self.eta = shared.eta
        self.value = 0
        self.lineage = Lineage()  # which weights each version holds, as of ``value``
        self._lineage_of: int | None = None  # the version whose lineage was read

    def __call__(self) -> int:
        return self.value

    async def refresh(self) -> int:
        version = await self.policy.get()
        value = 0 if version is None else version
        if value != self._lineage_of:
            # read after the version: a resume stores its lineage before it publishes, so this one has it
            self.lineage, self._lineage_of = await self.policy.lineage(), value
        if value != self.value:
            self.value = value
            if self.on_change is not None:
                self.on_change()
        return value

    def too_old(self, weight_version: int) -> bool:
        """Whether an engine serving ``weight_version`` is beyond the staleness bound of the published policy, by
        the learner's own test (lineage positions, not raw versions), so no rollout is generated that the
        learner would drop as stale."""
        return self.lineage.behind(self.value, weight_version, self.eta)

    async def run(self, stop: asyncio.Event) -> None:
        last = await self.client.xrevrange(self.control, "+", "-", count=1)
        last_id: Any = last[0][0] if last else "0-0"
        while not stop.is_set():
            try:
                await self.refresh()
                res = await self.client.xread({self.control: last_id}, block=self.poll_ms)
                if res:
                    last_id = res[0][1][-1][0]
            except Exception as exc:  # noqa: BLE001 - keep the cached value through a Redis hiccup
                log.warning("policy version refresh failed: %s", exc)
                await asyncio.sleep(self.poll_ms / 1000)


@dataclass(frozen=True)
class WorkerSettings:
    """Who the worker is and what it was configured with."""

    shared: SharedConfig
    rollout: RolloutConfig
    worker_id: str


@dataclass
class Coordination:
    """The worker's side of Redis: leases, admission, the published version, the stream and the metrics."""

    redis: aioredis.Redis
    dispatch: PromptDispatcher
    admission: StalenessManager
    versions: VersionCache
    producer: TrajectoryProducer  # broker.producer.Producer, or broker.memory's in tests
    metrics: MetricsWriter | None = None


class RolloutWorker:
    """One rollout worker. Build it with :func:`rollout_fleet.main.open_worker` (or by hand in tests)."""

    def __init__(self, settings: WorkerSettings, coordination: Coordination, workflow: GroupWorkflow) -> None:
        self.shared, self.config, self.worker_id = settings.shared, settings.rollout, settings.worker_id
        self.workflow = workflow
        c = coordination
        self.redis, self.dispatch, self.admission = c.redis, c.dispatch, c.admission
        self.versions, self.producer = c.versions, c.producer
        self.router = workflow.session.router
        self.stats: WorkerStats = workflow.stats  # shared with the workflow and its engine session
        self.metrics: MetricsReporter | None = None
        if c.metrics is not None:
            self.metrics = MetricsReporter(
                c.metrics, self.stats, self.config.metrics_interval_s, self._gauges
            )
        self._groups: dict[int, asyncio.Task] = {}
        self._lost: set[int] = set()
        self._wake = asyncio.Event()
        self.versions.on_change = self._on_new_version
        self.finished = False  # True when every prompt up to max_epochs is done
        self._first_request_marked = False
        # groups rejected by the engines (bad_request) since the last one produced
        self._rejected_in_a_row = 0
        self._rejection_failure: str | None = None  # set once they reach rollout.max_rejected_in_a_row

    # -- the main loop ---------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> WorkerStats:
        """Lease and run groups until ``stop`` is set (then drain) or every epoch up to ``max_epochs`` is done."""
        background_stop = asyncio.Event()
        background = [
            asyncio.create_task(self.versions.run(background_stop), name="versions"),
            asyncio.create_task(self.router.run_health_checks(background_stop), name="health"),
            asyncio.create_task(self._heartbeat(background_stop), name="heartbeat"),
        ]
        if self.metrics is not None:
            background.append(asyncio.create_task(self.metrics.run(background_stop), name="metrics"))
        stop_waiter = asyncio.create_task(self._forward(stop))
        await self.dispatch.expire_own()
        await self.versions.refresh()
        try:
            await self._lease_loop(stop)
            await self._drain(self.config.drain_timeout_s if stop.is_set() else None)
        finally:
            await self._drain(0.0)  # on an error: hand everything back
            background_stop.set()
            stop_waiter.cancel()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, stop_waiter, return_exceptions=True)
            if self.metrics is not None:
                with contextlib.suppress(Exception):
                    await self.metrics.write(0.0, self.stats.flat())
        return self.stats

    def _on_new_version(self) -> None:
        self._wake.set()  # admission capacity may have grown
        self.router.recheck_behind()  # engines that were behind may serve the new version now

    async def _forward(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake.set()

    async def _sleep(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _lease_loop(self, stop: asyncio.Event) -> None:
        poll = self.config.admission_poll_s
        while not stop.is_set():
            self._wake.clear()
            if self._rejection_failure is not None:
                raise RequestsRejected(self._rejection_failure)
            if len(self._groups) >= self.config.max_concurrent_groups:
                await self._sleep(poll)
                continue
            answer = await self.dispatch.lease()
            if answer.status == "lease":
                assert answer.lease is not None
                self._start(answer.lease)
            elif answer.status == "wait":
                started = time.monotonic()
                await self._sleep(poll)
                self.stats.wait_capacity_s += time.monotonic() - started
            else:  # exhausted: done once nothing is held anywhere (a dead worker's leases still expire to us)
                if not self._groups and answer.leases_left == 0:
                    self.finished = self.stats.finished = True
                    return
                wait = (
                    poll if answer.next_expiry_ms <= 0 else min(poll * 5, answer.next_expiry_ms / 1000 + 0.01)
                )
                await self._sleep(max(wait, 0.01))

    def _start(self, lease: Lease) -> None:
        self.stats.groups_started += 1
        task = asyncio.create_task(self._run_group(lease), name=f"group-{lease.position}")
        self._groups[lease.position] = task

        def done(_: asyncio.Task) -> None:
            if self._groups.get(lease.position) is task:
                del self._groups[lease.position]
            self._wake.set()

        task.add_done_callback(done)

    async def _drain(self, timeout: float | None) -> None:
        """Let in-flight groups finish (``timeout`` None: without limit), then cancel the rest and hand their
        prompts back."""
        if not self._groups:
            return
        pending = list(self._groups.items())
        if timeout is None or timeout > 0:
            await asyncio.wait([t for _, t in pending], timeout=timeout)
        unfinished = [(p, t) for p, t in pending if not t.done()]
        for _, task in unfinished:
            task.cancel()
        await asyncio.gather(*(t for _, t in pending), return_exceptions=True)
        mine = [p for p, _ in unfinished if p not in self._lost]
        if mine:
            with contextlib.suppress(Exception):
                released = await self.dispatch.release(mine)
                self.stats.groups_handed_back += released
                log.info("handed %d unfinished prompt(s) back", released)

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        interval = self.config.lease_ttl_s / 3
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                return
            try:
                lost = await self.dispatch.renew(list(self._groups))
            except Exception as exc:  # noqa: BLE001 - retried next beat; the TTL covers a short outage
                log.warning("lease renewal failed: %s", exc)
                continue
            for position in lost:
                task = self._groups.get(position)
                if task is not None and not task.done():
                    log.warning(
                        "lease of position %d was lost (expired and taken over); cancelling", position
                    )
                    self._lost.add(position)
                    self.stats.leases_lost += 1
                    task.cancel()

    # -- one group -------------------------------------------------------------------------------------------

    async def _run_group(self, lease: Lease) -> None:
        group_id = lease.group_id(self.shared.run_id)
        if not self._first_request_marked:
            self._first_request_marked = True
            await self._mark_first_request()
        try:
            group = await self.workflow.generate_group(lease, group_id, self.shared.run_id, self.worker_id)
            await self.producer.send(group, lease.position)
            status = await self.dispatch.complete(lease, "produced")
            self._rejected_in_a_row = 0
            self.stats.groups_produced += 1
            if status == "DUP":  # another worker had finished this prompt (the producer answered DUP too)
                self.stats.groups_duplicate += 1
            self.stats.count_group(group)
        except GroupAbandoned as gone:
            await self._abandon(lease, gone)
        except RecordError as exc:
            await self._abandon(lease, GroupAbandoned("invalid_record", DROP, str(exc)))
        except BackpressureTimeout as exc:  # the learner is not consuming: nothing wrong with the prompt
            await self._abandon(lease, GroupAbandoned("backpressure", HAND_BACK, str(exc)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.worker_errors += 1
            log.exception("group %s failed", group_id)
            with contextlib.suppress(Exception):
                await self._abandon(
                    lease, GroupAbandoned("worker_error", DROP, f"{type(exc).__name__}: {exc}")
                )

    async def _mark_first_request(self) -> None:
        """The run's first rollout request, across workers and restarts (benchmarks' time-to-target clock)."""
        with contextlib.suppress(Exception):
            await self.redis.hsetnx(self.shared.key(RUN_INFO_KEY), "first_request_at", repr(time.time()))

    def _count_rejection(self, gone: GroupAbandoned) -> GroupAbandoned:
        """Count a group the engines rejected. Once ``max_rejected_in_a_row`` were rejected since the last group
        produced, the worker stops (the lease loop raises :class:`RequestsRejected`), and this group and every
        later rejected one are handed back instead of dropped: a run resumed with the request fixed trains them."""
        self._rejected_in_a_row += 1
        limit = self.config.max_rejected_in_a_row
        if limit == 0 or (self._rejection_failure is None and self._rejected_in_a_row < limit):
            return gone
        if self._rejection_failure is None:
            self._rejection_failure = (
                f"{self._rejected_in_a_row} groups in a row were rejected by the engines "
                f"(rollout.max_rejected_in_a_row = {limit}), the last with {gone.detail}: the requests are "
                "wrong, not the prompts (check the sampling parameters, the LoRA adapter, the engine's limits)"
            )
            log.error("%s", self._rejection_failure)
            self._wake.set()
        return GroupAbandoned(gone.reason, HAND_BACK, gone.detail)

    async def _abandon(self, lease: Lease, gone: GroupAbandoned) -> None:
        if gone.reason == "bad_request":
            gone = self._count_rejection(gone)
        if gone.action == DROP:
            log.warning("dropping group of prompt %d (epoch %d): %s", lease.prompt_index, lease.epoch, gone)
            status = await self.dispatch.complete(lease, "dropped", reason=gone.reason, detail=gone.detail)
            if status == "OK":
                self.stats.groups_dropped[gone.reason] += 1
        else:
            log.info("handing prompt %d (epoch %d) back: %s", lease.prompt_index, lease.epoch, gone)
            self.stats.groups_handed_back += await self.dispatch.release([lease.position])

    async def _gauges(self) -> dict[str, float]:
        """The metrics that are states, not counters: groups in flight, the version, admission, the engines."""
        values = {"groups_in_flight": float(len(self._groups)), "policy_version": float(self.versions.value)}
        with contextlib.suppress(Exception):
            values["admission_capacity"] = float(await self.admission.capacity())
        values.update(self.router.stats())
        return values


class MetricsReporter:
    """A point in the stream ``metrics:rollout`` every ``interval_s``: the worker's counters, their rates over the
    interval, and its gauges."""

    def __init__(
        self,
        writer: MetricsWriter,
        stats: WorkerStats,
        interval_s: float,
        gauges: Callable[[], Awaitable[dict[str, float]]],
    ) -> None:
        self.writer, self.stats, self.interval_s, self.gauges = writer, stats, interval_s, gauges

    async def run(self, stop: asyncio.Event) -> None:
        previous = self.stats.flat()
        last = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            now = time.monotonic()
            current = self.stats.flat()
            with contextlib.suppress(Exception):
                await self.write(now - last, current, previous)
            previous, last = current, now

    async def write(
        self, elapsed: float, current: dict[str, float], previous: dict[str, float] | None = None
    ) -> None:
        values = dict(current)
        if previous is not None and elapsed > 0:

            def rate(name: str) -> float:
                return (current.get(name, 0.0) - previous.get(name, 0.0)) / elapsed

            values["groups_per_s"] = rate("groups_produced")
            values["tokens_per_s"] = rate("tokens")
            values["wait_capacity_ratio"] = min(1.0, rate("wait_capacity_s"))
            rewards = current["reward_count"] - previous["reward_count"]
            if rewards > 0:
                values["reward_mean"] = (current["reward_sum"] - previous["reward_sum"]) / rewards
        values.update(await self.gauges())
        await self.writer.write(values)
