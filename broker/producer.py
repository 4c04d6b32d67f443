"""The producer: validated, idempotent, back-pressured XADD of trajectory groups.

One Lua script does, atomically: the idempotence check by group id (a retry after a lost reply returns the
entry id of the first XADD instead of adding a second entry), the back-pressure check against the backlog
counter (entries produced and not yet acknowledged by the learner's group = XINFO lag + pending), INCR of that
counter, the XADD and the producer's counters. When the backlog is at its bound the script adds nothing and
answers WAIT; the producer then sleeps ``backpressure_poll_s`` and tries again, showing in the metrics that it
waits and why. An entry is never trimmed by length and never dropped once accepted.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from broker.client import BrokerKeys
from broker.codec import encode
from broker.config import BrokerConfig, SharedConfig
from broker.metrics import producer_field
from broker.record import SCHEMA_VERSION, TrajectoryGroup

_SEND = """
-- KEYS: 1 group-id hash, 2 backlog counter, 3 stream, 4 counters hash
-- ARGV: 1 group id, 2 max backlog, 3 schema version, 4 payload, 5 producer id
local existing = redis.call('HGET', KEYS[1], ARGV[1])
if existing then
  redis.call('HINCRBY', KEYS[4], 'resent', 1)
  return {'DUP', existing}
end
local backlog = tonumber(redis.call('GET', KEYS[2]) or '0')
if backlog >= tonumber(ARGV[2]) then
  return {'WAIT', tostring(backlog)}
end
redis.call('INCR', KEYS[2])
local id = redis.call('XADD', KEYS[3], '*', 'v', ARGV[3], 'gid', ARGV[1], 'd', ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], id)
local n = string.len(ARGV[4])
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
        self._send = client.register_script(_SEND)
        self.sent = 0  # groups this producer added
        self.resent = 0  # sends whose group id was already in the stream (retries, duplicates)
        self.waits = 0  # sends that had to wait for back-pressure
        self.wait_s = 0.0

    async def send(self, group: TrajectoryGroup) -> str:
        """Validate and encode ``group``, add it once (idempotent by group id), waiting while the backlog is at
        its bound. Returns the stream entry id (the first one, if the group id was already added)."""
        payload = encode(group)  # validates; a RecordError names the field
        return await self.send_payload(group.group_id, payload, group.schema_version)

    async def send_payload(self, group_id: str, payload: bytes, schema_version: int = SCHEMA_VERSION) -> str:
        """The stream path of :meth:`send` for an already encoded payload (benchmark baselines use it)."""
        keys = [self.keys.group_ids, self.keys.backlog, self.keys.stream, self.keys.counters]
        args = [group_id, self.config.max_backlog, schema_version, payload, self.producer_id]
        waited_since: float | None = None
        try:
            while True:
                status, value = await self._send(keys=keys, args=args)
                if status != b"WAIT":
                    break
                if waited_since is None:
                    waited_since = time.monotonic()
                    await self._mark_waiting(int(value))
                elif time.monotonic() - waited_since > self.config.backpressure_timeout_s:
                    raise BackpressureTimeout(
                        f"group {group_id!r}: backlog stayed at max_backlog = {self.config.max_backlog} "
                        f"for {self.config.backpressure_timeout_s}s; nothing was added"
                    )
                await asyncio.sleep(self.config.backpressure_poll_s)
        finally:
            if waited_since is not None:
                await self._clear_waiting(time.monotonic() - waited_since)
        if status == b"DUP":
            self.resent += 1
        else:
            self.sent += 1
        return value.decode()

    async def _mark_waiting(self, backlog: int) -> None:
        self.waits += 1
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
        await pipe.execute()
