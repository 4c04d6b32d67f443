"""The producer: validated, idempotent, back-pressured XADD of trajectory groups.

One Lua script does, atomically: the idempotence check by group id (a retry after a lost reply returns the
entry id of the first XADD instead of adding a second entry), the back-pressure check against the backlog
counter (entries produced and not yet acknowledged by the learner's group = XINFO lag + pending), INCR of that
counter, the XADD and the producer's counters.

Entries are ``{v: schema version, gid: group id, d: payload}``. A payload larger than ``inline_max_bytes`` is
stored first in a key of its own that expires after ``payload_ttl_s``; the script then adds
``{v, gid, n: payload bytes, ref: key}`` and makes the key permanent (the consumer deletes it on acknowledgement).
Passing a payload of a megabyte through Lua costs two extra copies on the single-threaded server (measured:
Lua XADD takes twice a plain XADD's server time); the reference keeps the atomic script small. When the backlog is at its bound the script adds nothing and
answers WAIT; the producer then sleeps ``backpressure_poll_s`` and tries again, showing in the metrics that it
waits and why. A server at its ``maxmemory`` (policy noeviction: the embedded server's) refuses the script's
first write; the producer takes that as the same kind of wait (``FULL``: nothing was written, it logs why,
since the counters cannot be written either) and raises :class:`BackpressureTimeout` naming maxmemory only after
``backpressure_timeout_s``. An entry is never trimmed by length and never dropped once accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from broker.admission import DONE_LUA, DispatchKeys
from broker.client import BrokerKeys
from broker.codec import encode_buffer
from broker.config import BrokerConfig
from broker.metrics import producer_field
from broker.record import SCHEMA_VERSION, TrajectoryGroup
from common.config import SharedConfig

log = logging.getLogger("streamrl.producer")
FULL = b"FULL"  # the server is at its maxmemory and refused the send's first write: a wait, as WAIT is


def is_out_of_memory(exc: BaseException) -> bool:
    """A Redis server at its maxmemory (policy noeviction) refusing a write that needs memory."""
    return isinstance(exc, ResponseError) and "maxmemory" in str(exc)


_SEND = (
    DONE_LUA
    + """
-- KEYS: 1 group-id hash, 2 backlog counter, 3 stream, 4 counters hash, 5 payload key (by-reference sends),
--       6 done watermark, 7 dispatch meta (broker.admission.DispatchKeys)
-- ARGV: 1 group id, 2 max backlog, 3 schema version, 4 inline payload ('' by reference), 5 producer id,
--       6 payload bytes, 7 'ref' | 'inline', 8 payload ttl (s), 9 dispatch position ('' without one),
--       10 done-set key prefix
local ref = ARGV[7] == 'ref'
local existing = redis.call('HGET', KEYS[1], ARGV[1])
if existing then
  if ref then  -- keep our stored payload only if the existing entry is ours (a retry after a lost reply)
    local keep = false
    local e = redis.call('XRANGE', KEYS[3], existing, existing)
    if #e == 1 then
      local f = e[1][2]
      for j = 1, #f, 2 do if f[j] == 'ref' and f[j + 1] == KEYS[5] then keep = true end end
    end
    if not keep then redis.call('UNLINK', KEYS[5]) end
  end
  redis.call('HINCRBY', KEYS[4], 'resent', 1)
  return {'DUP', existing}
end
-- A done position's group is in the stream (the index answered above), pruned, or dropped by a rollout worker:
-- a late send (a dead holder's) must not add it again
if ARGV[9] ~= '' and is_done_at(KEYS[6], KEYS[7], ARGV[10], ARGV[9]) then
  if ref then redis.call('UNLINK', KEYS[5]) end
  redis.call('HINCRBY', KEYS[4], 'refused_done', 1)
  return {'DONE', ''}
end
if ref and redis.call('EXISTS', KEYS[5]) == 0 then return {'NOPAYLOAD', ''} end
local backlog = tonumber(redis.call('GET', KEYS[2]) or '0')
if backlog >= tonumber(ARGV[2]) then
  if ref then redis.call('EXPIRE', KEYS[5], ARGV[8]) end
  return {'WAIT', tostring(backlog)}
end
redis.call('INCR', KEYS[2])
local id
local fields = {'v', ARGV[3], 'gid', ARGV[1]}
if ARGV[9] ~= '' then fields[#fields + 1] = 'pos'; fields[#fields + 1] = ARGV[9] end
if ref then
  redis.call('PERSIST', KEYS[5])
  fields[#fields + 1] = 'n'; fields[#fields + 1] = ARGV[6]
  fields[#fields + 1] = 'ref'; fields[#fields + 1] = KEYS[5]
else
  fields[#fields + 1] = 'd'; fields[#fields + 1] = ARGV[4]
end
id = redis.call('XADD', KEYS[3], '*', unpack(fields))
redis.call('HSET', KEYS[1], ARGV[1], id)
local n = tonumber(ARGV[6])
local p = 'producer:' .. ARGV[5] .. ':'
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('HINCRBY', KEYS[4], 'produced', 1)
redis.call('HINCRBY', KEYS[4], 'produced_bytes', n)
redis.call('HINCRBY', KEYS[4], p .. 'produced', 1)
redis.call('HINCRBY', KEYS[4], p .. 'bytes', n)
redis.call('HSETNX', KEYS[4], p .. 'first_ts', now)
redis.call('HSET', KEYS[4], p .. 'last_ts', now)
return {'OK', id}
"""
)


class BackpressureTimeout(TimeoutError):
    """The backlog stayed at its bound for ``backpressure_timeout_s``; the group was NOT added."""


class Producer:
    """Sends trajectory groups to the stream. Safe to share between tasks of one event loop."""

    def __init__(
        self, client: aioredis.Redis, shared: SharedConfig, config: BrokerConfig, producer_id: str
    ) -> None:
        if not producer_id or ":" in producer_id:
            raise ValueError(f"producer_id = {producer_id!r}: must be a non-empty name without ':'")
        self.client = client
        self.config = config
        self.producer_id = producer_id
        self.keys = BrokerKeys.of(shared, config)
        self.dispatch = DispatchKeys.of(shared)
        self._send = client.register_script(_SEND)
        self.sent = 0  # groups this producer added
        self.resent = 0  # sends whose group id was already in the stream (retries, duplicates)
        self.refused = (
            0  # sends of a done dispatch position whose group is no longer indexed (DONE: not added)
        )
        self.waits = 0  # sends that had to wait for back-pressure
        self.wait_s = 0.0
        self.full_waits = 0  # of those, waits for a server at its maxmemory

    async def send(self, group: TrajectoryGroup, position: int | None = None) -> str:
        """Validate and encode ``group``, add it once (idempotent by group id), waiting while the backlog is at
        its bound. Returns the stream entry id (the first one, if the group id was already added).

        ``position``: the prompt-dispatch position the group was generated for (broker.admission). With it, a
        group whose position is already done and whose id the index no longer holds (pruned, or dropped by a
        rollout worker) is refused: nothing is added and ``''`` is returned; the entry carries the position,
        which lets the broker prune the group's state later (docs/broker.md, "Bounded state"). Without it the
        group-id index alone keeps sends idempotent, and the group's index entry is never pruned."""
        payload = encode_buffer(group)  # validates; a RecordError names the field
        return await self.send_payload(group.group_id, payload, group.schema_version, position)

    async def send_payload(
        self,
        group_id: str,
        payload: bytes | memoryview,
        schema_version: int = SCHEMA_VERSION,
        position: int | None = None,
    ) -> str:
        """The stream path of :meth:`send` for an already encoded payload (benchmark baselines use it)."""
        by_ref = len(payload) > self.config.inline_max_bytes
        # A large payload is stored first, under a key unique to this attempt that expires unless the script
        # adds the entry referencing it: Lua would otherwise copy it twice on the server.
        ref = self.keys.payload(group_id, uuid.uuid4().hex[:16]) if by_ref else self.keys.stream
        keys = [self.keys.group_ids, self.keys.backlog, self.keys.stream, self.keys.counters, ref]
        keys += [self.dispatch.done_below, self.dispatch.meta]
        args = [
            group_id,
            self.config.max_backlog,
            schema_version,
            b"" if by_ref else payload,
            self.producer_id,
            len(payload),
            "ref" if by_ref else "inline",
            self.config.payload_ttl_s,
            "" if position is None else int(position),
            self.dispatch.done_prefix,
        ]
        waited_since: float | None = None
        store = by_ref
        try:
            while True:
                status, value = await self._call(keys, args, (ref, payload) if store else None)
                # stored again on the next call: expired during a very long wait, or its SET refused when full
                store = status == b"NOPAYLOAD" or (by_ref and status == FULL)
                if status == b"NOPAYLOAD":
                    continue
                if status not in (b"WAIT", FULL):
                    break
                if waited_since is None:
                    waited_since = time.monotonic()
                    await self._mark_waiting(int(value) if status == b"WAIT" else -1, status)
                elif time.monotonic() - waited_since > self.config.backpressure_timeout_s:
                    if by_ref:
                        with contextlib.suppress(ResponseError):
                            await self.client.unlink(ref)
                    raise BackpressureTimeout(f"group {group_id!r}: {self._why(status)}; nothing was added")
                await asyncio.sleep(self.config.backpressure_poll_s)
        finally:
            if waited_since is not None:
                await self._clear_waiting(time.monotonic() - waited_since)
        if status == b"DUP":
            self.resent += 1
        elif status == b"DONE":
            self.refused += 1
        else:
            self.sent += 1
        return value.decode()

    def _why(self, status: bytes) -> str:
        timeout = self.config.backpressure_timeout_s
        if status == FULL:
            return f"Redis stayed at its maxmemory (writes refused) for {timeout}s"
        return f"backlog stayed at max_backlog = {self.config.max_backlog} for {timeout}s"

    async def _call(self, keys: list, args: list, store: tuple[str, bytes] | None) -> tuple[bytes, bytes]:
        """Run the send script, preceded in the same round trip by the SET of a by-reference payload. A server
        at its maxmemory (policy noeviction) refuses the first write of either: that answers ``FULL``, a wait
        like the backlog's, not an error (nothing was written: a script refused at its first write stops)."""
        try:
            if store is None:
                return await self._send(keys=keys, args=args)
            pipe = self.client.pipeline(transaction=False)
            pipe.set(store[0], store[1], ex=self.config.payload_ttl_s)
            pipe.evalsha(self._send.sha, len(keys), *keys, *args)
            stored, res = await pipe.execute(raise_on_error=False)
            if isinstance(res, NoScriptError):  # a restarted server lost its script cache
                return await self._send(keys=keys, args=args)
            for outcome in (res, stored):
                if isinstance(outcome, Exception):
                    raise outcome
            return res
        except ResponseError as exc:
            if not is_out_of_memory(exc):
                raise
            return FULL, b""

    async def _mark_waiting(self, backlog: int, status: bytes = b"WAIT") -> None:
        self.waits += 1
        if status == FULL:  # the counters cannot be written either: the log says why the producer waits
            self.full_waits += 1
            log.warning("producer %s: Redis is at its maxmemory, waiting to add a group", self.producer_id)
            return
        f = self.keys.counters
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(
            f,
            mapping={
                producer_field(self.producer_id, "waiting"): "backpressure",
                producer_field(self.producer_id, "waiting_since"): repr(time.time()),
                producer_field(self.producer_id, "waiting_backlog"): backlog,
            },
        )
        pipe.hincrby(f, producer_field(self.producer_id, "waits"), 1)
        pipe.hincrby(f, "backpressure_waits", 1)
        await pipe.execute()

    async def _clear_waiting(self, seconds: float) -> None:
        self.wait_s += seconds
        f = self.keys.counters
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(f, producer_field(self.producer_id, "waiting"), "")
        pipe.hincrbyfloat(f, producer_field(self.producer_id, "wait_s"), seconds)
        pipe.hincrbyfloat(f, "backpressure_wait_s", seconds)
        try:
            await pipe.execute()
        except ResponseError as exc:  # still full (a timed-out wait): the counters wait for the next send
            if not is_out_of_memory(exc):
                raise
