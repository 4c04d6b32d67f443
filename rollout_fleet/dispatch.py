"""Prompt dispatch shared by every rollout worker of a run, through Redis: each prompt of an epoch is handed out
exactly once, a dead worker's prompts are handed out again, and admission control cannot leak.

**Positions.** Prompts are handed out by a global cursor over positions ``0, 1, 2, ...``; position ``p`` is
prompt ``order(e)[p mod N]`` of epoch ``e = p div N``, where ``N`` is the number of prompts and ``order(e)`` is a
permutation drawn from ``(seed, e)`` (every worker computes the same one). Epochs are therefore driven by the
cursor: epoch ``e + 1`` starts being handed out as soon as epoch ``e``'s last prompt is, while ``e``'s long
rollouts are still running, so no worker idles at an epoch boundary. ``max_epochs`` bounds the cursor at
``max_epochs * N``. The run's ``N``, seed and task are stored on first use; a worker configured differently is
refused (:class:`DispatchMismatch`), since it would map positions to different prompts.

**Leases.** Handing out position ``p`` creates a lease: ``p`` in a sorted set scored by its expiry (Redis server
time, so worker clocks do not matter) and its holder in a hash. The holder renews its leases every third of
the TTL (:meth:`PromptDispatcher.renew`). A lease that expires (its holder died, or stalled longer than the TTL)
is handed to the next worker that asks, before any fresh position. A position is *done* when its group was
produced (the producer's XADD was acknowledged) or dropped; done positions are members of a per-epoch set and
are never handed out again. A worker that stops early hands its unfinished leases back
(:meth:`PromptDispatcher.release`): they go to the front of a requeue list and are handed out next.

**Exactly once.** Group ids are ``make_group_id(run, epoch, prompt_index, 0)``: a re-leased prompt keeps attempt
0, so if the dead holder had in fact produced its group just before dying, the new holder's XADD is recognised
by the producer's idempotence check (DUP) and the stream holds one entry. Completion and drop are single Lua
scripts, so a prompt is never both done and leased, and a prompt is recorded as dropped only by its current
holder and only when not already done.

**Admission without leaks.** Every lease holds exactly one ``running`` slot of the global admission counters
(``broker.staleness.RedisCounters``' hash, same fields and semantics). The lease script *is* the admission's
``try_start`` (``admit`` of ``broker.staleness.COUNTERS_LUA``, in the same atomic step as granting a fresh
position),
completion is ``on_accept`` (produced) or ``on_reject`` (dropped), and a release is ``on_reject``. Taking over
an expired lease transfers its slot to the new holder without touching the counters. Hence ``running`` always
equals the number of leases, and a worker killed with SIGKILL leaks nothing: its slots live on in its leases
and pass to whoever takes them over. The worker's :class:`~broker.staleness.StalenessManager` gives the bound;
the script applies it. A dropped prompt's record in the dropped stream and its final outcome
(``broker.outcomes``) are written by the same script.

Position strings, not ints, are what Redis stores; the public API speaks ints.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from broker.client import BrokerKeys
from broker.config import BrokerConfig
from broker.outcomes import RECORDS_LUA, Outcome
from broker.record import make_group_id
from broker.staleness import COUNTERS_LUA, StalenessManager
from common.config import SharedConfig

OUTCOMES = ("produced", "dropped")
ATTEMPT = (
    0  # a re-leased prompt keeps its group id: the producer's idempotent XADD makes duplicates impossible
)

_LEASE = (
    COUNTERS_LUA
    + """
-- KEYS: 1 meta, 2 cursor, 3 leases, 4 holders, 5 requeue, 6 stats, 7 admission counters
-- ARGV: 1 worker, 2 ttl ms, 3 num prompts, 4 max positions (0: unbounded), 5 max running,
--       6 base outstanding ((eta + 1) * groups_per_step), 7 seed, 8 task, 9 done-set key prefix (+ epoch)
local n = tonumber(ARGV[3])
local meta_n = redis.call('HGET', KEYS[1], 'num_prompts')
if not meta_n then
  redis.call('HSET', KEYS[1], 'num_prompts', ARGV[3], 'seed', ARGV[7], 'task', ARGV[8])
else
  local seed = redis.call('HGET', KEYS[1], 'seed') or ''
  local task = redis.call('HGET', KEYS[1], 'task') or ''
  if meta_n ~= ARGV[3] or seed ~= ARGV[7] or task ~= ARGV[8] then
    return {'MISMATCH', meta_n, seed, task}
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function grant(pos, how, prev)
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), pos)
  redis.call('HSET', KEYS[4], pos, ARGV[1])
  redis.call('HINCRBY', KEYS[6], how, 1)
  return {'LEASE', pos, how, prev}
end
-- 1. an expired lease: its admission slot passes to the new holder, so no capacity is needed
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 1)
if #expired > 0 then
  return grant(expired[1], 'taken_over', redis.call('HGET', KEYS[4], expired[1]) or '')
end
-- 2. fresh work: a handed-back position (skipping any finished meanwhile), else the cursor
local pos = nil
local source = 'leased'
while true do
  local head = redis.call('LINDEX', KEYS[5], 0)
  if not head then break end
  if redis.call('SISMEMBER', ARGV[9] .. math.floor(tonumber(head) / n), head) == 1 then
    redis.call('LPOP', KEYS[5])
  else
    pos = head
    source = 'requeued'
    break
  end
end
local cursor = tonumber(redis.call('GET', KEYS[2]) or '0')
if not pos then
  local limit = tonumber(ARGV[4])
  if limit > 0 and cursor >= limit then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    local wait_ms = 0
    if #first > 0 then wait_ms = tonumber(first[2]) - now end
    return {'EXHAUSTED', tostring(redis.call('ZCARD', KEYS[3])), tostring(wait_ms)}
  end
  pos = tostring(cursor)
end
-- 3. admission (StalenessManager.try_start, atomically with the grant)
if admit(KEYS[7], 1, tonumber(ARGV[5]), tonumber(ARGV[6])) == 0 then
  return {'WAIT'}
end
if source == 'requeued' then
  redis.call('LPOP', KEYS[5])
else
  redis.call('SET', KEYS[2], cursor + 1)
end
return grant(pos, source, '')
"""
)

# One group's slot moves between admission counters; a move the counters cannot make is counted, never raised.
_MOVE = (
    COUNTERS_LUA
    + """
local function move_slot(adm, stats, src, dst)
  if move(adm, src, dst, 1) == 0 then redis.call('HINCRBY', stats, 'admission_anomalies', 1) end
end
"""
)

_COMPLETE = (
    _MOVE
    + RECORDS_LUA
    + """
-- KEYS: 1 leases, 2 holders, 3 done set (the position's epoch), 4 requeue, 5 stats, 6 admission counters,
--       7 dropped stream, 8 dropped index, 9 broker counters, 10 outcomes, 11 outcome conflicts
-- ARGV: 1 worker, 2 position, 3 outcome ('produced' | 'dropped'), 4 group id, 5 reason,
--       6 outcome document of a drop, 7.. drop fields
local pos = ARGV[2]
local leased = redis.call('ZSCORE', KEYS[1], pos)
local holder = redis.call('HGET', KEYS[2], pos) or ''
if redis.call('SISMEMBER', KEYS[3], pos) == 1 then
  if leased then  -- never granted for a done position; free the slot if it ever happens
    redis.call('ZREM', KEYS[1], pos)
    redis.call('HDEL', KEYS[2], pos)
    move_slot(KEYS[6], KEYS[5], 'running', 'rejected')
  end
  redis.call('HINCRBY', KEYS[5], 'duplicate_completions', 1)
  return {'DUP', holder}
end
if ARGV[3] == 'dropped' and ((not leased) or holder ~= ARGV[1]) then
  redis.call('HINCRBY', KEYS[5], 'lost_drops', 1)
  return {'LOST', holder}
end
redis.call('SADD', KEYS[3], pos)
if leased then
  redis.call('ZREM', KEYS[1], pos)
  redis.call('HDEL', KEYS[2], pos)
  if ARGV[3] == 'produced' then
    move_slot(KEYS[6], KEYS[5], 'running', 'accepted')
  else
    move_slot(KEYS[6], KEYS[5], 'running', 'rejected')
  end
else  -- produced after it was handed back (a send cut by a drain that still reached Redis)
  redis.call('LREM', KEYS[4], 0, pos)
  move_slot(KEYS[6], KEYS[5], 'rejected', 'accepted')
end
redis.call('HINCRBY', KEYS[5], ARGV[3], 1)
if ARGV[3] == 'dropped' then
  redis.call('HINCRBY', KEYS[5], 'dropped:' .. ARGV[5], 1)
  local fields = {}
  for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
  record_drop(KEYS[7], KEYS[8], KEYS[9], ARGV[4], ARGV[5], fields)
  record_outcome(KEYS[10], KEYS[11], ARGV[4], ARGV[6])  -- final: the group never reaches the stream
end
if holder == ARGV[1] or holder == '' then return {'OK', holder} end
return {'OK_OTHER', holder}
"""
)

_RENEW = """
-- KEYS: 1 leases, 2 holders, 3 workers. ARGV: 1 worker, 2 ttl ms, 3.. positions. Returns the positions lost.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lost = {}
for i = 3, #ARGV do
  local pos = ARGV[i]
  if redis.call('HGET', KEYS[2], pos) == ARGV[1] and redis.call('ZSCORE', KEYS[1], pos) then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), pos)
  else
    lost[#lost + 1] = pos
  end
end
redis.call('HSET', KEYS[3], ARGV[1], t[1])
return lost
"""

_RELEASE = (
    _MOVE
    + """
-- KEYS: 1 leases, 2 holders, 3 requeue, 4 stats, 5 admission counters. ARGV: 1 worker, 2.. positions
local n = 0
for i = 2, #ARGV do
  local pos = ARGV[i]
  if redis.call('HGET', KEYS[2], pos) == ARGV[1] and redis.call('ZSCORE', KEYS[1], pos) then
    redis.call('ZREM', KEYS[1], pos)
    redis.call('HDEL', KEYS[2], pos)
    redis.call('LPUSH', KEYS[3], pos)
    move_slot(KEYS[5], KEYS[4], 'running', 'rejected')
    n = n + 1
  end
end
redis.call('HINCRBY', KEYS[4], 'released', n)
return n
"""
)

_EXPIRE_OWN = """
-- KEYS: 1 leases, 2 holders. ARGV: 1 worker. Expire now every lease held under this worker id.
local all = redis.call('HGETALL', KEYS[2])
local n = 0
for i = 1, #all, 2 do
  if all[i + 1] == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', 0, all[i])
    n = n + 1
  end
end
return n
"""


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


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


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
        name: str = "dispatch",
    ) -> None:
        if not isinstance(num_prompts, int) or num_prompts < 1:
            raise ValueError(f"num_prompts = {num_prompts!r}: must be an int >= 1")
        if not worker_id or ":" in worker_id:
            raise ValueError(f"worker_id = {worker_id!r}: must be a non-empty name without ':'")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s = {lease_ttl_s}: must be > 0")
        counters_key = getattr(admission.counters, "key", None)
        if not isinstance(counters_key, str):
            raise TypeError(
                "prompt dispatch needs the global admission counters in Redis (broker.staleness.RedisCounters)"
            )
        self.client = client
        self.shared = shared
        self.admission = admission
        self._counters_key = counters_key
        self.num_prompts, self.seed, self.task = num_prompts, int(seed), task
        self.worker_id = worker_id
        self.ttl_ms = max(1, int(lease_ttl_s * 1000))
        self.max_epochs = max_epochs
        base = shared.key(name)
        self.keys = {
            "meta": f"{base}:meta",
            "cursor": f"{base}:cursor",
            "leases": f"{base}:leases",
            "holders": f"{base}:holders",
            "requeue": f"{base}:requeue",
            "stats": f"{base}:stats",
            "workers": f"{base}:workers",
        }
        self.done_prefix = f"{base}:done:"
        self.broker_keys = BrokerKeys.of(shared, broker)
        self._lease = client.register_script(_LEASE)
        self._complete = client.register_script(_COMPLETE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._expire_own = client.register_script(_EXPIRE_OWN)
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

    def done_key(self, epoch: int) -> str:
        return f"{self.done_prefix}{epoch}"

    # -- leases ----------------------------------------------------------------------------------------------

    async def lease(self) -> LeaseAnswer:
        """An expired lease if there is one, else a fresh position if the admission bound allows it (the bound
        of ``admission`` at its current version: ``StalenessManager.try_start``, applied by the script)."""
        admission = self.admission
        k = self.keys
        res = await self._lease(
            keys=[
                k["meta"],
                k["cursor"],
                k["leases"],
                k["holders"],
                k["requeue"],
                k["stats"],
                self._counters_key,
            ],
            args=[
                self.worker_id,
                self.ttl_ms,
                self.num_prompts,
                self.max_positions,
                admission.max_concurrent,
                admission.base_outstanding,
                self.seed,
                self.task,
                self.done_prefix,
            ],
        )
        status = _text(res[0])
        if status == "LEASE":
            position = int(_text(res[1]))
            epoch, index = self.locate(position)
            return LeaseAnswer("lease", Lease(position, epoch, index, _text(res[2]), _text(res[3])))
        if status == "WAIT":
            return LeaseAnswer("wait")
        if status == "EXHAUSTED":
            return LeaseAnswer(
                "exhausted", leases_left=int(_text(res[1])), next_expiry_ms=int(float(_text(res[2])))
            )
        if status == "MISMATCH":
            raise DispatchMismatch(
                f"this worker has num_prompts={self.num_prompts}, seed={self.seed}, task={self.task!r}, but run "
                f"{self.shared.run_id!r} dispatches num_prompts={_text(res[1])}, seed={_text(res[2])}, "
                f"task={_text(res[3])!r}; use the same task and rollout.shuffle_seed (or a new run_id)"
            )
        raise RuntimeError(f"unexpected answer from the lease script: {res!r}")

    async def renew(self, positions: list[int]) -> list[int]:
        """Extend this worker's leases; returns the positions it no longer holds (taken over or finished)."""
        k = self.keys
        lost = await self._renew(
            keys=[k["leases"], k["holders"], k["workers"]],
            args=[self.worker_id, self.ttl_ms, *(str(p) for p in positions)],
        )
        return [int(_text(p)) for p in lost]

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
        group_id = lease.group_id(self.shared.run_id)
        drop_fields: list[Any] = []
        doc = Outcome("dropped", reason=reason, source="rollout").to_json() if outcome == "dropped" else ""
        if outcome == "dropped":
            extra = {
                "run_id": self.shared.run_id,
                "source": "rollout",
                "consumer": self.worker_id,
                "epoch": lease.epoch,
                "prompt_index": lease.prompt_index,
                "detail": detail[:2000],
                **(fields or {}),
            }
            for name, value in extra.items():
                drop_fields += [name, str(value)]
        k, b = self.keys, self.broker_keys
        res = await self._complete(
            keys=[
                k["leases"],
                k["holders"],
                self.done_key(lease.epoch),
                k["requeue"],
                k["stats"],
                self._counters_key,
                b.dropped,
                b.dropped_index,
                b.counters,
                b.outcomes,
                b.outcome_conflicts,
            ],
            args=[self.worker_id, str(lease.position), outcome, group_id, reason, doc, *drop_fields],
        )
        return _text(res[0])

    async def release(self, positions: list[int]) -> int:
        """Hand this worker's unfinished leases back (front of the queue) and give their admission slots back."""
        if not positions:
            return 0
        k = self.keys
        return int(
            await self._release(
                keys=[k["leases"], k["holders"], k["requeue"], k["stats"], self._counters_key],
                args=[self.worker_id, *(str(p) for p in positions)],
            )
        )

    async def expire_own(self) -> int:
        """Expire every lease held under this worker id (a previous incarnation that died with the same id),
        so they are taken over at once instead of after their TTL. Worker ids must be unique among live workers."""
        return int(
            await self._expire_own(keys=[self.keys["leases"], self.keys["holders"]], args=[self.worker_id])
        )

    # -- inspection ------------------------------------------------------------------------------------------

    async def done(self, epoch: int) -> set[int]:
        """Positions of ``epoch`` that are done."""
        return {int(_text(p)) for p in await self.client.smembers(self.done_key(epoch))}

    async def leases(self) -> dict[int, str]:
        """Every live lease: position -> holder."""
        raw = await self.client.hgetall(self.keys["holders"])
        return {int(_text(p)): _text(w) for p, w in raw.items()}

    async def progress(self) -> dict[str, Any]:
        """Cursor, current epoch and how much of it is done, leases, requeued positions and counters."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys["cursor"])
        pipe.zcard(self.keys["leases"])
        pipe.llen(self.keys["requeue"])
        pipe.hgetall(self.keys["stats"])
        cursor, leases, requeued, stats = await pipe.execute()
        cursor = int(cursor or 0)
        epoch = max(0, cursor - 1) // self.num_prompts
        done = await self.client.scard(self.done_key(epoch))
        return {
            "cursor": cursor,
            "epoch": epoch,
            "epoch_done": int(done),
            "epoch_size": self.num_prompts,
            "epochs_handed_out": cursor / self.num_prompts,
            "leases": int(leases),
            "requeued": int(requeued),
            "stats": {_text(a): int(b) for a, b in stats.items()},
        }
