"""Prompt dispatch shared by every rollout worker of a run, through Redis: each prompt of an epoch is handed out
exactly once, a dead worker's prompts are handed out again, and admission control cannot leak.

**Positions.** Prompts are handed out by a global cursor over positions ``0, 1, 2, ...``; position ``p`` is
prompt ``order(e)[p mod N]`` of epoch ``e = p div N``, where ``N`` is the number of prompts and ``order(e)`` is a
permutation drawn from ``(seed, e)`` (every worker computes the same one). Epochs are therefore driven by the
cursor: epoch ``e + 1`` starts being handed out as soon as epoch ``e``'s last prompt is, while ``e``'s long
rollouts are still running, so no worker idles at an epoch boundary. ``max_epochs`` bounds the cursor at
``max_epochs * N``. The run's ``N``, seed and task are stored on first use; a worker configured differently is
refused (:class:`DispatchMismatch`), since it would map positions to different prompts.

**Leases.** Handing out position ``p`` creates a lease held by this worker, renewed every third of the TTL
(:meth:`PromptDispatcher.renew`). A lease that expires (its holder died, or stalled longer than the TTL) is handed
to the next worker that asks, before any fresh position. A position is *done* when its group was produced (the
producer's XADD was acknowledged) or dropped, and is never handed out again. A worker that stops early hands its
unfinished leases back (:meth:`PromptDispatcher.release`): they are handed out next.

**Exactly once.** Group ids are ``make_group_id(run, epoch, prompt_index, 0)``: a re-leased prompt keeps attempt
0, so if the dead holder had in fact produced its group just before dying, the new holder's XADD is recognised
by the producer's idempotence check (DUP) and the stream holds one entry. The worker gives the producer the
lease's position, so once the position is done a late send is refused (DONE) even after the group's index entry
was pruned (docs/broker.md, "Bounded state").

**Admission.** Every lease holds one ``running`` slot of the global admission counters; the lease grants a fresh
position only within the bound of the worker's :class:`~broker.staleness.StalenessManager`, and completion,
release and takeover move the slot so that nothing leaks, even when a worker is killed. The scripts, keys and
slot moves live in :mod:`broker.admission` (the one home of admission and dispatch in Redis); this module is the
rollout side's policy on top: which prompt a position is, epochs, group ids and what a drop record says.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from broker.admission import DISPATCH, PromptLeases, RedisCounters
from broker.config import BrokerConfig
from broker.record import make_group_id
from broker.staleness import StalenessManager
from common.config import SharedConfig

OUTCOMES = ("produced", "dropped")
ATTEMPT = (
    0  # a re-leased prompt keeps its group id: the producer's idempotent XADD makes duplicates impossible
)


class DispatchMismatch(RuntimeError):
    """This worker's prompt count, seed or task differs from what the run's dispatch was started with."""


@dataclass(frozen=True)
class Lease:
    """One handed-out prompt: position ``position`` = prompt ``prompt_index`` of ``epoch``."""

    position: int
    epoch: int
    prompt_index: int
    source: str  # leased (fresh) | requeued (handed back) | taken_over (expired)
    previous_holder: str = ""

    def group_id(self, run_id: str) -> str:
        return make_group_id(run_id, self.epoch, self.prompt_index, ATTEMPT)


@dataclass(frozen=True)
class LeaseAnswer:
    """What :meth:`PromptDispatcher.lease` got: a lease, ``wait`` (no admission capacity), or ``exhausted``
    (every position up to ``max_epochs`` handed out; ``leases_left`` are still held by someone)."""

    status: str  # lease | wait | exhausted
    lease: Lease | None = None
    leases_left: int = 0
    next_expiry_ms: int = 0


def epoch_order(seed: int, epoch: int, num_prompts: int) -> np.ndarray:
    """The prompt indices of ``epoch`` in hand-out order: a permutation drawn from ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(num_prompts)


class PromptDispatcher:
    """One worker's handle on the run's shared prompt dispatch (see the module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        shared: SharedConfig,
        broker: BrokerConfig,
        admission: StalenessManager,
        *,
        num_prompts: int,
        worker_id: str,
        seed: int = 0,
        task: str = "",
        lease_ttl_s: float = 60.0,
        max_epochs: int = 0,
        name: str = DISPATCH,
    ) -> None:
        if not isinstance(num_prompts, int) or num_prompts < 1:
            raise ValueError(f"num_prompts = {num_prompts!r}: must be an int >= 1")
        if not worker_id or ":" in worker_id:
            raise ValueError(f"worker_id = {worker_id!r}: must be a non-empty name without ':'")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s = {lease_ttl_s}: must be > 0")
        if not isinstance(admission.counters, RedisCounters):
            raise TypeError(
                "prompt dispatch needs the global admission counters in Redis (broker.admission.RedisCounters)"
            )
        self.client = client
        self.shared = shared
        self.admission = admission
        self.num_prompts, self.seed, self.task = num_prompts, int(seed), task
        self.worker_id = worker_id
        self.max_epochs = max_epochs
        self.leases_in_redis = PromptLeases(
            client,
            shared,
            broker,
            admission.counters,
            worker_id=worker_id,
            ttl_ms=max(1, int(lease_ttl_s * 1000)),
            name=name,
        )
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()

    # -- the position -> prompt mapping ----------------------------------------------------------------------

    def order(self, epoch: int) -> np.ndarray:
        """The prompt indices of ``epoch`` in hand-out order: a permutation drawn from ``(seed, epoch)``."""
        order = self._orders.get(epoch)
        if order is None:
            order = epoch_order(self.seed, epoch, self.num_prompts)
            self._orders[epoch] = order
            while len(self._orders) > 4:
                self._orders.popitem(last=False)
        return order

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, prompt index) of a position."""
        epoch, offset = divmod(position, self.num_prompts)
        return epoch, int(self.order(epoch)[offset])

    @property
    def max_positions(self) -> int:
        return self.max_epochs * self.num_prompts if self.max_epochs > 0 else 0

    # -- leases ----------------------------------------------------------------------------------------------

    async def lease(self) -> LeaseAnswer:
        """An expired lease if there is one, else a fresh position if the admission bound allows it (the bound
        of ``admission`` at its current version: ``StalenessManager.try_start``, applied by the script)."""
        grant = await self.leases_in_redis.lease(
            max_running=self.admission.max_concurrent,
            base_outstanding=self.admission.base_outstanding,
            num_prompts=self.num_prompts,
            max_positions=self.max_positions,
            seed=self.seed,
            task=self.task,
        )
        if grant.status == "lease":
            epoch, index = self.locate(grant.position)
            return LeaseAnswer(
                "lease", Lease(grant.position, epoch, index, grant.source, grant.previous_holder)
            )
        if grant.status == "mismatch":
            num_prompts, seed, task = grant.run_meta
            raise DispatchMismatch(
                f"this worker has num_prompts={self.num_prompts}, seed={self.seed}, task={self.task!r}, but run "
                f"{self.shared.run_id!r} dispatches num_prompts={num_prompts}, seed={seed}, "
                f"task={task!r}; use the same task and rollout.shuffle_seed (or a new run_id)"
            )
        return LeaseAnswer(grant.status, leases_left=grant.leases_left, next_expiry_ms=grant.next_expiry_ms)

    async def renew(self, positions: list[int]) -> list[int]:
        """Extend this worker's leases; returns the positions it no longer holds (taken over or finished)."""
        return await self.leases_in_redis.renew(positions)

    async def complete(
        self,
        lease: Lease,
        outcome: str,
        *,
        reason: str = "",
        detail: str = "",
        fields: dict[str, Any] | None = None,
    ) -> str:
        """Mark the lease's prompt done: ``produced`` (its group is in the stream) or ``dropped`` (recorded with
        ``reason`` in the broker's dropped stream, keyed by group id). Returns ``OK``, ``OK_OTHER`` (produced
        while another worker held the lease), ``DUP`` (already done) or ``LOST`` (a drop by a non-holder: not
        recorded, the holder finishes it)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome = {outcome!r}: must be one of {OUTCOMES}")
        if outcome == "dropped" and not reason:
            raise ValueError("a dropped prompt needs a reason")
        record = None
        if outcome == "dropped":
            record = {
                "epoch": lease.epoch,
                "prompt_index": lease.prompt_index,
                "detail": detail[:2000],
                **(fields or {}),
            }
        return await self.leases_in_redis.complete(
            lease.position,
            lease.epoch,
            lease.group_id(self.shared.run_id),
            outcome,
            reason=reason,
            fields=record,
        )

    async def release(self, positions: list[int]) -> int:
        """Hand this worker's unfinished leases back (front of the queue) and give their admission slots back."""
        return await self.leases_in_redis.release(positions)

    async def expire_own(self) -> int:
        """Expire every lease held under this worker id (a previous incarnation that died with the same id),
        so they are taken over at once instead of after their TTL. Worker ids must be unique among live workers."""
        return await self.leases_in_redis.expire_own()

    # -- inspection ------------------------------------------------------------------------------------------

    async def done(self, epoch: int) -> set[int]:
        """Positions of ``epoch`` that are done."""
        return await self.leases_in_redis.done(epoch)

    async def leases(self) -> dict[int, str]:
        """Every live lease: position -> holder."""
        return await self.leases_in_redis.holders()

    async def progress(self) -> dict[str, Any]:
        """Cursor, current epoch and how much of it is done, leases, requeued positions and counters."""
        return await self.leases_in_redis.progress(self.num_prompts)
