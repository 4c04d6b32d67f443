"""Metrics in Redis that dashboards and other roles read.

Two kinds:

* Broker counters, one hash (``BrokerKeys.counters``) updated by the producer's and consumer's Lua scripts in
  the same atomic step as the operation they count: produced, consumed, acknowledged, dead-lettered (by
  reason), duplicates, dropped (by reason), bytes, and per-producer counts, timestamps and back-pressure state.
  :class:`BrokerMetrics` turns them, the backlog counter and an XINFO GROUPS snapshot (lag, pending) into one
  dict with per-producer rates.
* Per-role metrics streams: :class:`MetricsWriter` appends a dict of numbers to ``metrics:<role>`` (trimmed
  approximately to ``metrics_maxlen``: only metrics streams are ever trimmed by length) and
  :class:`MetricsReader` reads them back for dashboards.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from broker.client import BrokerKeys
from broker.config import BrokerConfig
from common.config import SharedConfig
from common.numbers import parse_number

# Counter names (fields of the counters hash). Dead letters and drops also count per reason:
# "dead_lettered:<reason>", "dropped:<reason>". Producers count under "producer:<id>:<name>".
# A hash of run-wide facts written once (HSETNX), e.g. first_request_at: the run's first rollout request.
RUN_INFO_KEY = "run-info"
PRODUCED = "produced"
PRODUCED_BYTES = "produced_bytes"
RESENT = "resent"  # a send whose group id was already accepted (a retry after a lost reply, a duplicate)
CONSUMED = "consumed"
CONSUMED_BYTES = "consumed_bytes"
ACKNOWLEDGED = "acknowledged"
DEAD_LETTERED = "dead_lettered"
DUPLICATES = "duplicates"
DROPPED = "dropped"
RECLAIMED = "reclaimed"
RECOVERED = "recovered"  # own pending entries re-fetched after a reconnect or a restart


def producer_field(producer_id: str, name: str) -> str:
    """The counters-hash field of ``name`` (produced, bytes, waiting, wait_s, ...) for one producer."""
    return f"producer:{producer_id}:{name}"


METRICS_PREFIX = "metrics:"  # + role: the per-role metrics stream (under the run's namespace)


def metrics_key(shared: SharedConfig, role: str = "") -> str:
    """The metrics stream of ``role`` (``role`` empty: the prefix every role's stream starts with)."""
    return shared.key(f"{METRICS_PREFIX}{role}")


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class BrokerMetrics:
    """Reads the broker counters and the stream's consumer-group state into one snapshot dict."""

    def __init__(self, client: aioredis.Redis, shared: SharedConfig, config: BrokerConfig) -> None:
        self.client = client
        self.config = config
        self.keys = BrokerKeys.of(shared, config)

    async def snapshot(self) -> dict[str, Any]:
        """Counters, backlog, stream length, per-group lag/pending and per-producer counts and rates."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.counters)
        pipe.get(self.keys.backlog)
        pipe.xlen(self.keys.stream)
        pipe.xlen(self.keys.dead_letter)
        pipe.xlen(self.keys.dropped)
        raw, backlog, length, dead_len, dropped_len = await pipe.execute()
        fields = {_text(k): parse_number(v) for k, v in raw.items()}
        return {
            "ts": time.time(),
            "counters": {k: v for k, v in fields.items() if ":" not in k},
            "dead_lettered_by_reason": _by_prefix(fields, f"{DEAD_LETTERED}:"),
            "dropped_by_reason": _by_prefix(fields, f"{DROPPED}:"),
            "backlog": int(backlog or 0),
            "max_backlog": self.config.max_backlog,
            "stream_length": length,
            "dead_letter_length": dead_len,
            "dropped_length": dropped_len,
            "groups": await self.groups(),
            "producers": _producers(fields),
        }

    async def groups(self) -> dict[str, dict[str, Any]]:
        """XINFO GROUPS of the trajectory stream: lag (undelivered) and pending (delivered, unacknowledged)."""
        try:
            infos = await self.client.xinfo_groups(self.keys.stream)
        except aioredis.ResponseError:  # no such stream yet
            return {}
        out = {}
        for info in infos:
            info = {_text(k): v for k, v in info.items()}
            out[_text(info["name"])] = {
                "lag": info.get("lag"),
                "pending": info["pending"],
                "consumers": info["consumers"],
                "last_delivered_id": _text(info["last-delivered-id"]),
            }
        return out


def _by_prefix(fields: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in fields.items() if k.startswith(prefix)}


def _producers(fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group ``producer:<id>:<name>`` fields by producer and add rates over its active time."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in fields.items():
        if key.startswith("producer:"):
            pid, _, name = key[len("producer:") :].rpartition(":")
            out.setdefault(pid, {})[name] = value
    for stats in out.values():
        span = float(stats.get("last_ts", 0)) - float(stats.get("first_ts", 0))
        produced = stats.get("produced", 0)
        stats["entries_per_s"] = produced / span if span > 0 and produced > 1 else 0.0
        stats["bytes_per_s"] = stats.get("bytes", 0) / span if span > 0 and produced > 1 else 0.0
        stats.setdefault("waiting", "")
    return out


class MetricsWriter:
    """Appends dicts of numbers to the per-role stream ``metrics:<role>`` for dashboards and later analysis."""

    def __init__(self, client: aioredis.Redis, shared: SharedConfig, role: str, maxlen: int = 10_000) -> None:
        if not role or ":" in role:
            raise ValueError(f"role = {role!r}: must be a non-empty name without ':'")
        self.client = client
        self.key = metrics_key(shared, role)
        self.maxlen = maxlen

    async def write(self, values: Mapping[str, float | int], ts: float | None = None) -> str:
        """Append one point; ``ts`` (unix seconds) defaults to now. Returns the stream entry id."""
        fields: dict[str, str] = {"ts": repr(time.time() if ts is None else float(ts))}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"metrics[{name!r}] = {value!r}: must be a number")
            fields[name] = repr(value)
        entry_id = await self.client.xadd(self.key, fields, maxlen=self.maxlen, approximate=True)
        return _text(entry_id)


class MetricsReader:
    """Reads the per-role metrics streams that :class:`MetricsWriter` appends to."""

    def __init__(self, client: aioredis.Redis, shared: SharedConfig) -> None:
        self.client = client
        self.shared = shared

    def key(self, role: str) -> str:
        return metrics_key(self.shared, role)

    async def read(
        self, role: str, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[tuple[str, dict[str, float | int]]]:
        """Points of ``role`` between entry ids ``start`` and ``end``, oldest first."""
        rows = await self.client.xrange(self.key(role), start, end, count=count)
        return [(_text(i), {_text(k): parse_number(v) for k, v in f.items()}) for i, f in rows]

    async def latest(self, role: str) -> dict[str, float | int] | None:
        """The newest point of ``role``, or None when it has written none."""
        rows = await self.client.xrevrange(self.key(role), "+", "-", count=1)
        return {_text(k): parse_number(v) for k, v in rows[0][1].items()} if rows else None

    async def follow(
        self, role: str, last_id: str = "$", block_ms: int = 1000
    ) -> list[tuple[str, dict[str, float | int]]]:
        """Points newer than ``last_id``, waiting up to ``block_ms`` for the first (for live dashboards)."""
        res = await self.client.xread({self.key(role): last_id}, block=block_ms)
        if not res:
            return []
        return [(_text(i), {_text(k): parse_number(v) for k, v in f.items()}) for i, f in res[0][1]]


_SIZE_COMMANDS = {"hash": "HLEN", "set": "SCARD", "zset": "ZCARD", "list": "LLEN", "stream": "XLEN"}


async def key_sizes(client: aioredis.Redis, shared: SharedConfig) -> dict[str, int]:
    """Every key of the run (after its ``streamrl:<run>:`` prefix) -> its size in elements (HLEN, SCARD, ZCARD,
    LLEN, XLEN; a string is one): what grows with the run shows here (soak benchmark, bounded-state test)."""
    prefix = shared.key("")
    names = [_text(k) async for k in client.scan_iter(match=prefix + "*", count=1000)]
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.type(name)
    types = [_text(t) for t in await pipe.execute()]
    pipe = client.pipeline(transaction=False)
    for name, kind in zip(names, types, strict=True):
        pipe.execute_command(_SIZE_COMMANDS.get(kind, "EXISTS"), name)  # EXISTS: 1 for a string
    sizes = await pipe.execute(raise_on_error=False)
    return {
        n[len(prefix) :]: int(s) for n, s in zip(names, sizes, strict=True) if not isinstance(s, Exception)
    }
