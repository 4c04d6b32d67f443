"""The engine registry in Redis: which engines exist, where, how many weight-sync ranks each has, and whether
they are healthy. Its one definition: the fleet writes it, routers and the learner's publisher and the dashboard
read it, all through this module (the async :class:`EngineRegistry`, or :func:`read_registry` with a plain
client).

Layout: one hash ``shared.key("engines")`` (:func:`registry_key`), field = engine id, value = a JSON object

    {"engine_id", "url", "ranks", "health", "weight_version", "last_seen", "updated", "kind", "pid", "source",
     "error"}

- ``engine_id`` is ``host:port`` of the URL (:func:`engine_id_for`), so an engine registered by the fleet and by a
  worker configured with its URL is one entry.
- ``ranks``: the engine's ranks in the weight-update process group (SGLang's tensor parallelism; 1 for the
  built-in engine).
- ``health``: ``starting`` (launched, not answering yet), ``healthy``, ``unhealthy`` (a probe or a request
  failed), ``dead`` (its process exited), ``stopped`` (shut down on purpose), ``unknown`` (registered by URL,
  not probed yet).
- ``weight_version``: the engine's label (an int) at its last probe; ``last_seen``: unix time of the last
  successful probe.

Whoever runs the engines writes them (the :class:`~rollout_fleet.fleet.Fleet`, or a worker for the URLs it is
configured with); routers read the registry and write what their health probes observe. Every change is one
Lua script that merges a JSON patch into the entry, so two writers never lose each other's fields.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis

from common.config import SharedConfig

HEALTH_STATES = ("unknown", "starting", "healthy", "unhealthy", "dead", "stopped")

# KEYS[1] registry hash. ARGV: 1 engine id, 2 JSON patch, 3 mode: 'upsert' | 'create' (only if absent) |
# 'update' (only if present). Returns the stored JSON, or false when nothing was written.
_MERGE = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and ARGV[3] == 'create' then return false end
if (not cur) and ARGV[3] == 'update' then return false end
local entry = {}
if cur then entry = cjson.decode(cur) end
for k, v in pairs(cjson.decode(ARGV[2])) do entry[k] = v end
local out = cjson.encode(entry)
redis.call('HSET', KEYS[1], ARGV[1], out)
return out
"""


class RegistryError(ValueError):
    """A registry entry or argument that cannot be accepted; the message names the field and value."""


def engine_id_for(url: str) -> str:
    """``host:port`` of an engine URL (``http://127.0.0.1:30000`` -> ``127.0.0.1:30000``)."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if not parts.hostname or parts.port is None:
        raise RegistryError(f"engine url = {url!r}: must look like http://host:port")
    return f"{parts.hostname}:{parts.port}"


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash; a bare ``host:port`` gets ``http://``."""
    url = url.strip().rstrip("/")
    if "//" not in url:
        url = f"http://{url}"
    engine_id_for(url)  # validates
    return url


@dataclass
class EngineInfo:
    """One registry entry (see the module docstring for the meaning of each field)."""

    engine_id: str
    url: str
    ranks: int = 1
    health: str = "unknown"
    weight_version: int | None = None
    last_seen: float = 0.0
    updated: float = 0.0
    kind: str = ""
    pid: int | None = None
    source: str = ""
    error: str = ""

    @classmethod
    def from_json(cls, raw: bytes | str) -> EngineInfo:
        """The entry; ValueError when it is not a JSON object with an engine_id and a url."""
        data = json.loads(raw)
        if not isinstance(data, dict) or "engine_id" not in data or "url" not in data:
            raise ValueError(f"not a registry entry: {str(data)[:200]}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _check_patch(patch: dict[str, Any]) -> None:
    health = patch.get("health")
    if health is not None and health not in HEALTH_STATES:
        raise RegistryError(f"health = {health!r}: must be one of {HEALTH_STATES}")
    ranks = patch.get("ranks")
    if ranks is not None and (not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1):
        raise RegistryError(f"ranks = {ranks!r}: must be an int >= 1")
    known = {f.name for f in fields(EngineInfo)}
    unknown = sorted(set(patch) - known)
    if unknown:
        raise RegistryError(f"unknown registry field(s) {unknown}; known: {sorted(known)}")


REGISTRY_NAME = "engines"


def registry_key(shared: SharedConfig, name: str = REGISTRY_NAME) -> str:
    return shared.key(name)


def read_registry(client: redis.Redis, shared: SharedConfig) -> list[EngineInfo]:
    """Every registered engine, ordered by id, with a plain (synchronous) client; an entry that cannot be
    parsed is skipped."""
    out = []
    for raw in client.hvals(registry_key(shared)):
        try:
            out.append(EngineInfo.from_json(raw))
        except (ValueError, TypeError):
            continue
    return sorted(out, key=lambda e: e.engine_id)


class EngineRegistry:
    """Read and write the run's engine registry."""

    def __init__(self, client: aioredis.Redis, shared: SharedConfig, name: str = REGISTRY_NAME) -> None:
        self.client = client
        self.key = registry_key(shared, name)
        self._merge = client.register_script(_MERGE)

    async def _write(self, engine_id: str, patch: dict[str, Any], mode: str) -> EngineInfo | None:
        _check_patch(patch)
        patch = {**patch, "updated": time.time()}
        raw = await self._merge(keys=[self.key], args=[engine_id, json.dumps(patch), mode])
        return None if raw is None else EngineInfo.from_json(raw)

    async def register(
        self,
        url: str,
        *,
        ranks: int = 1,
        kind: str = "",
        source: str = "",
        pid: int | None = None,
        health: str = "unknown",
        overwrite: bool = True,
    ) -> EngineInfo:
        """Add (or with ``overwrite``, replace the identity fields of) the engine at ``url``; returns the entry.
        ``overwrite=False`` leaves an existing entry as it is (a worker naming an engine the fleet registered)."""
        url = normalize_url(url)
        engine_id = engine_id_for(url)
        patch = {
            "engine_id": engine_id,
            "url": url,
            "ranks": ranks,
            "kind": kind,
            "source": source,
            "pid": pid,
            "health": health,
        }
        written = await self._write(engine_id, patch, "upsert" if overwrite else "create")
        if written is not None:
            return written
        existing = await self.get(engine_id)
        assert existing is not None
        return existing

    async def update(self, engine_id: str, **patch: Any) -> EngineInfo | None:
        """Merge ``patch`` into an existing entry; None (and nothing written) when the engine is not registered."""
        return await self._write(engine_id, patch, "update")

    async def remove(self, engine_id: str) -> bool:
        return bool(await self.client.hdel(self.key, engine_id))

    async def get(self, engine_id: str) -> EngineInfo | None:
        raw = await self.client.hget(self.key, engine_id)
        return None if raw is None else EngineInfo.from_json(raw)

    async def list(self) -> list[EngineInfo]:
        """Every registered engine, ordered by id."""
        raw = await self.client.hgetall(self.key)
        return sorted((EngineInfo.from_json(v) for v in raw.values()), key=lambda e: e.engine_id)

    async def snapshot(self) -> list[dict[str, Any]]:
        """The entries as plain dicts (dashboards, logs)."""
        return [asdict(e) for e in await self.list()]
