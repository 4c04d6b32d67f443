"""Admission and prompt dispatch in Redis: the one home of their Lua scripts, their keys and their answers.

Everything that admits a group, leases a prompt, hands a lease back or expires it, completes a prompt, or records
a drop and gives the group's admission capacity back is a Lua script of this module, behind a small API:

- :class:`RedisCounters`: the global admission counters (``broker.staleness.StalenessCounters`` in a Redis hash,
  fields ``running accepted started rejected dropped consumed``); :data:`COUNTERS_LUA` holds their transitions
  (``admit``, ``move``), which the lease, completion, release and drop scripts below call in the same atomic step.
- :class:`PromptLeases`: one worker's handle on the run's prompt leases (``lease``, ``renew``, ``complete``,
  ``release``, ``expire_own`` and inspection). Which prompt a position is, epochs and group ids are the rollout
  side's policy (``rollout_fleet.dispatch``); here positions are only numbers.
- :class:`DropRecorder`: a group's drop record in the dropped stream, once per group id, giving its admission
  capacity back (accepted -> dropped) in the same script (the learner's drops, through ``broker.consumer``).

**Leases.** Handing out position ``p`` creates a lease: ``p`` in a sorted set scored by its expiry (Redis server
time, so worker clocks do not matter) and its holder in a hash. A lease that expires (its holder died, or
stalled longer than the TTL) is handed to the next worker that asks, before any fresh position; then a position
handed back (front of the requeue list), then the cursor. A position is *done* when its group was produced or
dropped; done positions are below the done low-watermark or members of a per-epoch set (the sets hold only those
at or above it: docs/broker.md, "Bounded state") and are never handed out again. Completion and drop are
single scripts, so a prompt is never both done and leased, and a prompt is recorded as dropped only by its
current holder and only when not already done.

**Admission without leaks.** Every lease holds exactly one ``running`` slot of the admission counters. The lease
script *is* the admission's ``try_start`` (``admit``, in the same atomic step as granting a fresh position),
completion is ``accept`` (produced) or ``reject`` (dropped), and a release is ``reject``. Taking over an expired
lease transfers its slot to the new holder without touching the counters. Hence ``running`` always equals the
number of leases, and a worker killed with SIGKILL leaks nothing: its slots live on in its leases and pass to
whoever takes them over. A slot move the counters cannot make is counted (``admission_anomalies``), never raised.

Position strings, not ints, are what Redis stores; the API speaks ints. Every key, field and value is part of a
running deployment's state: change none of them without a migration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from broker.client import BrokerKeys
from broker.config import BrokerConfig
from broker.outcomes import RECORDS_LUA, Outcome
from broker.protocols import DropRecord
from broker.staleness import CounterError, CounterSnapshot, StalenessCounters, _check_consumed, _check_n
from common.config import SharedConfig

ADMISSION_HASH = "admission"  # SharedConfig.key(...) of the admission counters hash
DISPATCH = "dispatch"  # SharedConfig.key(...) prefix of the prompt dispatch's keys

# The admission counters' transitions, as Lua functions over the counters hash. RedisCounters' scripts, the lease
# script (which grants a prompt and admits it in one step), completion, release and drop are built from these.
COUNTERS_LUA = """
-- admit: running += n, started += n iff running + n <= max_running and
--   accepted + running + n <= base + consumed (base = (eta + 1) * groups_per_step). Returns 1, or 0 (wait).
local function admit(key, n, max_running, base)
  local running = tonumber(redis.call('HGET', key, 'running') or '0')
  local accepted = tonumber(redis.call('HGET', key, 'accepted') or '0')
  local consumed = tonumber(redis.call('HGET', key, 'consumed') or '0')
  if running + n > max_running or accepted + running + n > base + consumed then return 0 end
  redis.call('HINCRBY', key, 'running', n)
  redis.call('HINCRBY', key, 'started', n)
  return 1
end
-- move: src -= n, dst += n iff src >= n (src '' only adds). Returns 1, or 0 when src holds less than n.
local function move(key, src, dst, n)
  if src ~= '' then
    local have = tonumber(redis.call('HGET', key, src) or '0')
    if have < n then return 0 end
    redis.call('HINCRBY', key, src, -n)
  end
  redis.call('HINCRBY', key, dst, n)
  return 1
end
"""

# The done low-watermark: every position below it is done, and the per-epoch done sets hold only done positions at
# or above it (docs/broker.md, "Bounded state"). is_done answers for any position; mark_done adds one and advances
# the watermark over the positions now contiguous with it, taking them out of their sets (at most 10,000 a call,
# so a deployment that predates the watermark catches up over a few calls without blocking Redis).
DONE_LUA = """
local function done_below(below)
  return tonumber(redis.call('GET', below) or '0')
end
local function is_done(below, set, pos)
  return tonumber(pos) < done_below(below) or redis.call('SISMEMBER', set, pos) == 1
end
local function is_done_at(below, meta, prefix, pos)  -- the set found through the run's prompt count
  if tonumber(pos) < done_below(below) then return true end
  local n = tonumber(redis.call('HGET', meta, 'num_prompts') or '0')
  return n > 0 and redis.call('SISMEMBER', prefix .. math.floor(tonumber(pos) / n), pos) == 1
end
local function mark_done(below, set, prefix, n, pos)
  redis.call('SADD', set, pos)
  if not n then return end  -- no lease was ever granted (no meta): nothing to advance over
  local w = done_below(below)
  local start = w
  while w - start < 10000 and redis.call('SREM', prefix .. math.floor(w / n), tostring(w)) == 1 do
    w = w + 1
  end
  if w > start then redis.call('SET', below, w) end
end
"""

_MOVE_LUA = (
    COUNTERS_LUA
    + """
if move(KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])) == 0 then
  local have = redis.call('HGET', KEYS[1], ARGV[1]) or '0'
  return redis.error_reply('cannot move ' .. ARGV[3] .. ' from ' .. ARGV[1] .. ' = ' .. have .. ' to ' .. ARGV[2])
end
return 1
"""
)

_TRY_START_LUA = (
    COUNTERS_LUA
    + """
return admit(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]))
"""
)


class RedisCounters:
    """Counters in the Redis hash ``shared.key(name)``, changed only by Lua scripts (atomic server-side),
    so every worker of the fleet and the learner see one global count."""

    def __init__(self, client: aioredis.Redis, shared: SharedConfig, name: str = ADMISSION_HASH) -> None:
        self.client = client
        self.key = shared.key(name)
        self._move_script = client.register_script(_MOVE_LUA)
        self._try_start_script = client.register_script(_TRY_START_LUA)

    async def snapshot(self) -> CounterSnapshot:
        names = [f.name for f in CounterSnapshot.__dataclass_fields__.values()]
        values = await self.client.hmget(self.key, names)
        return CounterSnapshot(**{k: int(v or 0) for k, v in zip(names, values, strict=True)})

    async def _move(self, source: str, target: str, n: int) -> None:
        _check_n(n)
        try:
            await self._move_script(keys=[self.key], args=[source, target, n])
        except ResponseError as exc:
            raise CounterError(f"{self.key}: {exc}") from None

    async def start(self, n: int) -> None:
        _check_n(n)
        # try_start with limits no count reaches: the same two increments, in one script.
        if not await self._try_start_script(keys=[self.key], args=[n, 2**52, 2**52]):
            raise CounterError(f"{self.key}: unconditional start of {n} groups was refused")

    async def try_start(self, n: int, max_running: int, base_outstanding: int) -> bool:
        _check_n(n)
        return bool(await self._try_start_script(keys=[self.key], args=[n, max_running, base_outstanding]))

    async def accept(self, n: int) -> None:
        await self._move("running", "accepted", n)

    async def reject(self, n: int) -> None:
        await self._move("running", "rejected", n)

    async def drop(self, n: int) -> None:
        await self._move("accepted", "dropped", n)

    async def set_consumed(self, n: int) -> None:
        _check_consumed(n)
        await self.client.hset(self.key, "consumed", n)


_LEASE = (
    COUNTERS_LUA
    + DONE_LUA
    + """
-- KEYS: 1 meta, 2 cursor, 3 leases, 4 holders, 5 requeue, 6 stats, 7 admission counters, 8 done watermark
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
  if is_done(KEYS[8], ARGV[9] .. math.floor(tonumber(head) / n), head) then
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


_SLOT_LUA = (
    COUNTERS_LUA
    + """
local function move_slot(adm, stats, src, dst)
  if move(adm, src, dst, 1) == 0 then redis.call('HINCRBY', stats, 'admission_anomalies', 1) end
end
"""
)

_COMPLETE = (
    _SLOT_LUA
    + RECORDS_LUA
    + DONE_LUA
    + """
-- KEYS: 1 leases, 2 holders, 3 done set (the position's epoch), 4 requeue, 5 stats, 6 admission counters,
--       7 dropped stream, 8 dropped index, 9 broker counters, 10 outcomes, 11 outcome conflicts,
--       12 done watermark, 13 meta, 14 retired groups (broker.retention)
-- ARGV: 1 worker, 2 position, 3 outcome ('produced' | 'dropped'), 4 group id, 5 reason,
--       6 outcome document of a drop, 7 done-set key prefix (+ epoch), 8.. drop fields
local pos = ARGV[2]
local leased = redis.call('ZSCORE', KEYS[1], pos)
local holder = redis.call('HGET', KEYS[2], pos) or ''
if is_done(KEYS[12], KEYS[3], pos) then
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
mark_done(KEYS[12], KEYS[3], ARGV[7], tonumber(redis.call('HGET', KEYS[13], 'num_prompts')), pos)
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
  for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
  record_drop(KEYS[7], KEYS[8], KEYS[9], ARGV[4], ARGV[5], fields)
  record_outcome(KEYS[10], KEYS[11], ARGV[4], ARGV[6])  -- final: the group never reaches the stream
  redis.call('RPUSH', KEYS[14], ARGV[4] .. '|' .. pos .. '|')  -- nothing but the audit reads it any more
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
    _SLOT_LUA
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
_DROP = (
    RECORDS_LUA
    + COUNTERS_LUA
    + """
-- KEYS: 1 dropped stream, 2 dropped index hash, 3 counters hash, 4 (optional) the admission counters hash
-- ARGV: 1 group id, 2 reason, 3.. field name/value pairs
-- Returns {record id, 1 if this call recorded it (0: an earlier drop of the group did), 1 if it gave the group's
-- admission capacity back}. The record and the give-back are one step: a crash cannot separate them, and a
-- group's capacity comes back once however often it is dropped again after restarts.
local existing = redis.call('HGET', KEYS[2], ARGV[1])
if existing then return {existing, 0, 0} end
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = record_drop(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], fields)
local gave = 0
if KEYS[4] then gave = move(KEYS[4], 'accepted', 'dropped', 1) end
return {id, 1, gave}
"""
)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


@dataclass(frozen=True)
class DispatchKeys:
    """The prompt dispatch's Redis keys, namespaced by run (``SharedConfig.key``) under ``name``."""

    meta: str  # hash: num_prompts, seed, task the run's dispatch was started with
    cursor: str  # the next fresh position
    leases: str  # sorted set: leased position -> expiry (ms, Redis server time)
    holders: str  # hash: leased position -> worker id
    requeue: str  # list of handed-back positions, handed out first
    stats: str  # hash of counters (leased, requeued, taken_over, produced, dropped, released, anomalies, ...)
    workers: str  # hash: worker id -> last renewal (s, Redis server time)
    done_prefix: str  # + epoch: set of the epoch's done positions at or above the watermark
    done_below: str  # the done low-watermark: every position below it is done (in no set any more)

    @classmethod
    def of(cls, shared: SharedConfig, name: str = DISPATCH) -> DispatchKeys:
        base = shared.key(name)
        return cls(
            meta=f"{base}:meta",
            cursor=f"{base}:cursor",
            leases=f"{base}:leases",
            holders=f"{base}:holders",
            requeue=f"{base}:requeue",
            stats=f"{base}:stats",
            workers=f"{base}:workers",
            done_prefix=f"{base}:done:",
            done_below=f"{base}:done_below",
        )

    def done(self, epoch: int) -> str:
        """The set of ``epoch``'s done positions."""
        return f"{self.done_prefix}{epoch}"


@dataclass(frozen=True)
class Grant:
    """The lease script's answer. ``lease``: ``position`` from ``source`` (leased: fresh, requeued: handed back,
    taken_over: expired, from ``previous_holder``); ``wait``: no admission capacity; ``exhausted``: every position
    below the limit handed out, ``leases_left`` still held, the first expiring in ``next_expiry_ms``;
    ``mismatch``: the run's dispatch was started with ``run_meta`` = (num_prompts, seed, task)."""

    status: str  # lease | wait | exhausted | mismatch
    position: int = -1
    source: str = ""
    previous_holder: str = ""
    leases_left: int = 0
    next_expiry_ms: int = 0
    run_meta: tuple[str, str, str] = ("", "", "")


class PromptLeases:
    """One worker's handle on the run's prompt leases and their admission slots (see the module docstring).
    ``counters`` are the admission counters every lease holds a slot of."""

    def __init__(
        self,
        client: aioredis.Redis,
        shared: SharedConfig,
        broker: BrokerConfig,
        counters: RedisCounters,
        *,
        worker_id: str,
        ttl_ms: int,
        name: str = DISPATCH,
    ) -> None:
        self.client = client
        self.run_id = shared.run_id
        self.worker_id = worker_id
        self.ttl_ms = ttl_ms
        self.counters_key = counters.key
        self.keys = DispatchKeys.of(shared, name)
        self.broker_keys = BrokerKeys.of(shared, broker)
        self._lease = client.register_script(_LEASE)
        self._complete = client.register_script(_COMPLETE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._expire_own = client.register_script(_EXPIRE_OWN)

    async def lease(
        self,
        *,
        max_running: int,
        base_outstanding: int,
        num_prompts: int,
        max_positions: int,
        seed: int,
        task: str,
    ) -> Grant:
        """An expired lease if there is one, else a handed-back or fresh position (below ``max_positions``, 0:
        unbounded) if the admission bound allows one more group (``StalenessCounters.try_start``'s
        ``max_running`` and ``base_outstanding``); the run's (num_prompts, seed, task) are stored on first use
        and checked on every later one."""
        k = self.keys
        res = await self._lease(
            keys=[k.meta, k.cursor, k.leases, k.holders, k.requeue, k.stats, self.counters_key, k.done_below],
            args=[
                self.worker_id,
                self.ttl_ms,
                num_prompts,
                max_positions,
                max_running,
                base_outstanding,
                seed,
                task,
                k.done_prefix,
            ],
        )
        status = _text(res[0])
        if status == "LEASE":
            return Grant("lease", int(_text(res[1])), _text(res[2]), _text(res[3]))
        if status == "WAIT":
            return Grant("wait")
        if status == "EXHAUSTED":
            return Grant(
                "exhausted", leases_left=int(_text(res[1])), next_expiry_ms=int(float(_text(res[2])))
            )
        if status == "MISMATCH":
            return Grant("mismatch", run_meta=(_text(res[1]), _text(res[2]), _text(res[3])))
        raise RuntimeError(f"unexpected answer from the lease script: {res!r}")

    async def renew(self, positions: list[int]) -> list[int]:
        """Extend this worker's leases; returns the positions it no longer holds (taken over or finished)."""
        k = self.keys
        lost = await self._renew(
            keys=[k.leases, k.holders, k.workers],
            args=[self.worker_id, self.ttl_ms, *(str(p) for p in positions)],
        )
        return [int(_text(p)) for p in lost]

    async def complete(
        self,
        position: int,
        epoch: int,
        group_id: str,
        outcome: str,
        *,
        reason: str = "",
        fields: Mapping[str, Any] | None = None,
    ) -> str:
        """Mark ``position`` (of ``epoch``, group ``group_id``) done, ``produced`` or ``dropped``; a drop is
        recorded with ``reason`` and ``fields`` in the dropped stream and as the group's final outcome. Returns
        ``OK``, ``OK_OTHER`` (produced while another worker held the lease), ``DUP`` (already done) or ``LOST``
        (a drop by a non-holder: not recorded)."""
        drop_fields: list[Any] = []
        doc = ""
        if outcome == "dropped":
            doc = Outcome("dropped", reason=reason, source="rollout").to_json()
            extra = {"run_id": self.run_id, "source": "rollout", "consumer": self.worker_id, **(fields or {})}
            for name, value in extra.items():
                drop_fields += [name, str(value)]
        k, b = self.keys, self.broker_keys
        res = await self._complete(
            keys=[
                k.leases,
                k.holders,
                k.done(epoch),
                k.requeue,
                k.stats,
                self.counters_key,
                b.dropped,
                b.dropped_index,
                b.counters,
                b.outcomes,
                b.outcome_conflicts,
                k.done_below,
                k.meta,
                b.retired,
            ],
            args=[self.worker_id, str(position), outcome, group_id, reason, doc, k.done_prefix, *drop_fields],
        )
        return _text(res[0])

    async def release(self, positions: list[int]) -> int:
        """Hand this worker's unfinished leases back (front of the queue) and give their admission slots back."""
        if not positions:
            return 0
        k = self.keys
        return int(
            await self._release(
                keys=[k.leases, k.holders, k.requeue, k.stats, self.counters_key],
                args=[self.worker_id, *(str(p) for p in positions)],
            )
        )

    async def expire_own(self) -> int:
        """Expire every lease held under this worker id, so they are taken over at once."""
        return int(await self._expire_own(keys=[self.keys.leases, self.keys.holders], args=[self.worker_id]))

    async def done(self, epoch: int) -> set[int]:
        """Positions of ``epoch`` that are done: those below the done watermark and the members of its set."""
        return await done_positions(self.client, self.keys, epoch)

    async def holders(self) -> dict[int, str]:
        """Every live lease: position -> holder."""
        raw = await self.client.hgetall(self.keys.holders)
        return {int(_text(p)): _text(w) for p, w in raw.items()}

    async def progress(self, num_prompts: int) -> dict[str, Any]:
        """Cursor, current epoch and how much of it is done, leases, requeued positions and counters."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.get(k.cursor)
        pipe.zcard(k.leases)
        pipe.llen(k.requeue)
        pipe.hgetall(k.stats)
        cursor, leases, requeued, stats = await pipe.execute()
        cursor = int(cursor or 0)
        epoch = max(0, cursor - 1) // num_prompts
        done = len(await self.done(epoch))
        return {
            "cursor": cursor,
            "epoch": epoch,
            "epoch_done": int(done),
            "epoch_size": num_prompts,
            "epochs_handed_out": cursor / num_prompts,
            "leases": int(leases),
            "requeued": int(requeued),
            "stats": {_text(a): int(b) for a, b in stats.items()},
        }


async def done_positions(client: aioredis.Redis, keys: DispatchKeys, epoch: int) -> set[int]:
    """Positions of ``epoch`` that are done: below the done watermark, or members of the epoch's set."""
    pipe = client.pipeline(transaction=False)
    pipe.hget(keys.meta, "num_prompts")
    pipe.get(keys.done_below)
    pipe.smembers(keys.done(epoch))
    num_prompts, below, members = await pipe.execute()
    done = {int(_text(p)) for p in members}
    if num_prompts is not None:
        n = int(num_prompts)
        done.update(range(epoch * n, min(int(below or 0), (epoch + 1) * n)))
    return done


class DropRecorder:
    """Records that a group is not trained on, in the durable dropped stream, once per group id."""

    def __init__(self, client: aioredis.Redis, keys: BrokerKeys) -> None:
        self.keys = keys
        self._drop = client.register_script(_DROP)

    async def record(
        self,
        group_id: str,
        reason: str,
        fields: Mapping[str, Any],
        counters: RedisCounters | str | None = None,
    ) -> DropRecord:
        """The group's drop record with ``reason`` and ``fields``; a repeat returns the first record's id and
        changes nothing. With ``counters`` (RedisCounters, or its hash key) the first drop also gives the group's
        admission capacity back (accepted -> dropped) in the same script."""
        args: list[Any] = [group_id, reason]
        for k, v in fields.items():
            args += [k, v]
        keys = [self.keys.dropped, self.keys.dropped_index, self.keys.counters]
        if counters is not None:
            keys.append(counters if isinstance(counters, str) else counters.key)
        record_id, first, gave_back = await self._drop(keys=keys, args=args)
        return DropRecord(_text(record_id), bool(first), bool(gave_back))


async def give_back(counters: StalenessCounters) -> bool:
    """A dropped group's admission capacity back (accepted -> dropped) through counters outside Redis's drop
    script; False when nothing accepted is left (a group produced outside admission control)."""
    try:
        await counters.drop(1)
    except CounterError:
        return False
    return True
