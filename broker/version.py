"""The policy version: the number of optimizer steps whose weights have been published.

The learner owns it and advances it with :meth:`PolicyVersion.publish`; everyone else reads it. A Lua script
refuses any version that is not strictly greater than every version published before, so versions are never
reused (a resumed learner publishes its checkpoint's weights under a fresh version) and staleness is never
negative. Each publication is announced on the control stream (durable, replayable: :meth:`wait_for` and
:meth:`announcements` read it) and on the pub/sub channel of the same name (for listeners that only care
about the latest). A publish retried after a lost reply carries the same token and is recognised, not refused.

This module is the Redis side only (the keys, publish, get, wait, subscribe, the stored lineage); the protocol
itself (labels, lineage, behind-ness, the announce rule) is :mod:`common.versioning`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from broker.client import BrokerKeys
from broker.config import BrokerConfig
from common.config import SharedConfig
from common.versioning import Lineage, ResumePoint

CONTROL_MAXLEN = 10_000  # the control stream is trimmed approximately; the version key is the truth

_PUBLISH = """
-- KEYS: 1 version, 2 token, 3 control stream. ARGV: 1 version, 2 token, 3 channel, 4 control maxlen
local v = tonumber(ARGV[1])
local cur = redis.call('GET', KEYS[1])
if cur then
  if tonumber(cur) == v and redis.call('GET', KEYS[2]) == ARGV[2] then
    return {'SAME', cur}
  end
  if v <= tonumber(cur) then return {'STALE', cur} end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
local t = redis.call('TIME')
local ts = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'type', 'version', 'version', ARGV[1], 'ts', ts)
redis.call('PUBLISH', ARGV[3], '{"type": "version", "version": ' .. ARGV[1] .. ', "ts": ' .. ts .. '}')
return {'OK', id, ts}
"""


class VersionError(ValueError):
    """A publish of a version that is not greater than every published one (versions are never reused)."""


@dataclass(frozen=True)
class Announcement:
    """A published version as announced on the control stream."""

    version: int
    ts: float  # server time of publication, unix seconds
    entry_id: str  # control stream id ("" for pub/sub messages)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class PolicyVersion:
    """Read and (for the learner) advance the run's policy version."""

    def __init__(self, client: aioredis.Redis, shared: SharedConfig, config: BrokerConfig) -> None:
        self.client = client
        self.keys = BrokerKeys.of(shared, config)
        self._publish = client.register_script(_PUBLISH)

    async def publish(self, version: int) -> Announcement:
        """Publish ``version``; raises VersionError unless it is greater than every version published."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise VersionError(f"version = {version!r}: must be an int >= 0")
        token = uuid.uuid4().hex
        keys = [self.keys.version, self.keys.version_token, self.keys.control]
        res = await self._publish(keys=keys, args=[version, token, self.keys.control, CONTROL_MAXLEN])
        status = _text(res[0])
        if status == "STALE":
            raise VersionError(
                f"version = {version}: not greater than the published version {_text(res[1])}; "
                "versions are never reused"
            )
        if status == "SAME":  # our own publication, retried after a lost reply
            return Announcement(version, time.time(), "")
        return Announcement(version, float(_text(res[2])), _text(res[1]))

    async def get(self) -> int | None:
        """The published version, or None if nothing was published yet."""
        raw = await self.client.get(self.keys.version)
        return None if raw is None else int(raw)

    async def lineage(self) -> Lineage:
        """Which weights each version holds (every resume so far), for staleness in positions."""
        raw = await self.client.hgetall(self.keys.lineage)
        points = [ResumePoint(int(v), **json.loads(doc)) for v, doc in raw.items()]
        return Lineage(tuple(sorted(points, key=lambda p: p.version)))

    async def record_resume(self, point: ResumePoint) -> None:
        """Record that ``point.version`` will be published with the weights of ``point.position`` (before it is
        published, so no reader ever sees the version without its lineage)."""
        doc = json.dumps({"position": point.position, "rollback": point.rollback})
        await self.client.hset(self.keys.lineage, str(point.version), doc)

    async def announcements(self, after: str = "0", count: int | None = None) -> list[Announcement]:
        """Announcements on the control stream with ids greater than ``after``, oldest first."""
        rows = await self.client.xrange(self.keys.control, f"({after}" if after != "0" else "-", "+", count)
        return [_announcement(i, f) for i, f in rows if f.get(b"type") == b"version"]

    async def wait_for(self, min_version: int, timeout_s: float) -> int:
        """Wait until the published version is >= ``min_version``; returns it. Raises TimeoutError after
        ``timeout_s``. Reads the control stream, so a publication between two checks is never missed."""
        deadline = time.monotonic() + timeout_s
        last = await self.client.xrevrange(self.keys.control, "+", "-", count=1)
        last_id = _text(last[0][0]) if last else "0-0"
        while True:
            current = await self.get()
            if current is not None and current >= min_version:
                return current
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"policy version {current} did not reach {min_version} in {timeout_s}s")
            block = max(1, int(min(remaining, 1.0) * 1000))
            res = await self.client.xread({self.keys.control: last_id}, block=block)
            if res:
                last_id = _text(res[0][1][-1][0])

    async def subscribe(self, timeout_s: float) -> AsyncIterator[Announcement]:
        """Announcements from pub/sub as they happen (nothing from before the call); stops after ``timeout_s``
        without one. For replay or guaranteed delivery use :meth:`announcements`."""
        pubsub = self.client.pubsub()
        await pubsub.subscribe(self.keys.control)
        try:
            deadline = time.monotonic() + timeout_s
            while (remaining := deadline - time.monotonic()) > 0:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=remaining)
                if msg is None or msg.get("type") != "message":
                    continue  # a subscribe confirmation, or the timeout
                deadline = time.monotonic() + timeout_s
                data = json.loads(msg["data"])
                yield Announcement(int(data["version"]), float(data["ts"]), "")
        finally:
            await pubsub.unsubscribe(self.keys.control)
            await pubsub.aclose()


def _announcement(entry_id: Any, fields: dict[bytes, bytes]) -> Announcement:
    return Announcement(int(fields[b"version"]), float(fields[b"ts"]), _text(entry_id))
