"""Routing requests across engines: least outstanding requests among the healthy ones, sticky resubmits.

- :meth:`Router.acquire` picks an engine for one request: the preferred one (a resubmitted partial rollout goes
  back to the engine that has its prefix cached) when it is routable, else the routable engine with the fewest
  outstanding requests (ties broken round-robin). With no routable engine it waits, up to a timeout, for one to
  come back. :meth:`Router.release` gives the slot back.
- Routable = healthy and not *behind*: an engine whose weight version ``too_old`` says is beyond the staleness
  bound (the worker's: more than eta lineage positions from the published policy, measured as the learner
  measures its tokens, :meth:`common.versioning.Lineage.behind`) is left out until it has caught up, so no
  rollout is generated on weights older than the staleness bound allows (a restarted engine serves its initial
  weights until the learner brings it back). Its version comes from the probes and from every answer it gives
  (:meth:`Router.observe`); :meth:`Router.recheck_behind` probes the engines that are behind at once (the
  worker calls it when a new version is published, so a caught-up engine is back in routing within a round
  trip).
- :meth:`Router.mark_failed`: a request failed in a way that is the engine's fault (connection refused or
  reset, timeout, 5xx). The engine leaves routing at once; its other in-flight requests fail the same way and
  are resubmitted elsewhere by their owners.
- :meth:`Router.run_health_checks`: every ``interval`` the router re-reads the registry (engines added or removed
  by whoever runs them) and probes each engine with ``GET /model_info`` under a timeout. ``/model_info`` never
  runs a forward pass, so it answers while an engine is paused for a weight update (``/health`` and
  ``/health_generate`` would block and report 503 then, see sglang-api.md section 4); it also reports the
  engine's weight version. A successful probe puts a failed engine back into routing; what the probes see is
  written to the registry.
- With ``proxy_url`` (``rollout.router = "sglang"``, :mod:`rollout_fleet.sglang_router`) every request goes to
  that sglang-router, which picks the engine: :meth:`Router.acquire` returns the router's handle while it answers
  ``GET /health``, ``prefer`` and the staleness bound do not apply to it, and :meth:`Router.abort_later` sends the
  rid's abort to every engine directly. The engines are still probed and written to the registry as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from broker.registry import EngineRegistry, engine_id_for, normalize_url
from common.versioning import answer_version
from rollout_fleet.generate_client import EngineClient

log = logging.getLogger("streamrl.router")


class NoEngineAvailable(RuntimeError):
    """No healthy engine came back within the wait timeout."""


@dataclass
class EngineHandle:
    """The router's view of one engine."""

    engine_id: str
    url: str
    client: EngineClient
    healthy: bool = False
    outstanding: int = 0
    requests: int = 0  # requests sent, ever
    failures: int = 0  # times taken out of routing
    weight_version: int | None = None
    last_error: str = ""
    last_seen: float = 0.0
    removed: bool = False
    order: int = field(default=0)


class Router:
    """Routes a worker's requests over the engines of the registry (plus any it is given directly)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        registry: EngineRegistry | None,
        *,
        request_timeout_s: float,
        control_timeout_s: float,
        health_interval_s: float = 2.0,
        no_engine_timeout_s: float = 300.0,
        too_old: Callable[[int], bool] | None = None,
        proxy_url: str | None = None,
    ) -> None:
        self.session = session
        self.registry = registry
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_interval_s = health_interval_s
        self.no_engine_timeout_s = no_engine_timeout_s
        # whether an engine serving a weight version is beyond the staleness bound (default: none is)
        self.too_old = too_old or (lambda version: False)
        self.engines: dict[str, EngineHandle] = {}
        self._changed = asyncio.Event()  # set whenever an engine becomes routable
        self._counter = itertools.count()
        self._rr = 0
        self._background: set[asyncio.Task] = set()  # fire-and-forget calls, referenced until done
        self.proxy: EngineHandle | None = None  # an sglang-router that every request goes through
        if proxy_url is not None:
            url = normalize_url(proxy_url)
            client = EngineClient(session, url, request_timeout_s, control_timeout_s)
            self.proxy = EngineHandle(engine_id_for(url), url, client, order=-1)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- membership ------------------------------------------------------------------------------------------

    def add(self, url: str, healthy: bool = False) -> EngineHandle:
        """Route to the engine at ``url`` (idempotent); new engines wait for a probe unless ``healthy``."""
        url = normalize_url(url)
        engine_id = engine_id_for(url)
        handle = self.engines.get(engine_id)
        if handle is None or handle.url != url:
            client = EngineClient(self.session, url, self.request_timeout_s, self.control_timeout_s)
            handle = EngineHandle(engine_id, url, client, order=next(self._counter))
            self.engines[engine_id] = handle
        handle.removed = False
        if healthy:
            self._set_healthy(handle, True)
        return handle

    def remove(self, engine_id: str) -> None:
        handle = self.engines.pop(engine_id, None)
        if handle is not None:
            handle.removed = True
            handle.healthy = False

    async def refresh(self) -> None:
        """Take in the registry's engines: new ones are added (and probed), deleted ones leave routing."""
        if self.registry is None:
            return
        infos = await self.registry.list()
        ids = {info.engine_id for info in infos}
        for info in infos:
            if info.engine_id not in self.engines:
                self.add(info.url)
        for engine_id in list(self.engines):
            if engine_id not in ids:
                log.info("engine %s left the registry", engine_id)
                self.remove(engine_id)

    # -- routing ---------------------------------------------------------------------------------------------

    def healthy(self) -> list[EngineHandle]:
        return [h for h in self.engines.values() if h.healthy and not h.removed]

    def behind(self, handle: EngineHandle) -> bool:
        """Whether the engine serves weights older than the staleness bound allows (unknown counts as not)."""
        return handle.weight_version is not None and self.too_old(handle.weight_version)

    def routable(self) -> list[EngineHandle]:
        return [h for h in self.healthy() if not self.behind(h)]

    def pick(self, prefer: str | None = None) -> EngineHandle | None:
        """The preferred engine when routable, else the routable engine with the fewest outstanding requests
        (behind an sglang-router: the router's handle while it is healthy)."""
        if self.proxy is not None:
            return self.proxy if self.proxy.healthy else None
        if prefer is not None:
            handle = self.engines.get(prefer)
            if handle is not None and handle.healthy and not handle.removed and not self.behind(handle):
                return handle
        candidates = self.routable()
        if not candidates:
            return None
        least = min(h.outstanding for h in candidates)
        tied = sorted((h for h in candidates if h.outstanding == least), key=lambda h: h.order)
        self._rr += 1
        return tied[self._rr % len(tied)]

    async def acquire(self, prefer: str | None = None, timeout_s: float | None = None) -> EngineHandle:
        """An engine for one request (its outstanding count incremented); waits for a healthy one up to
        ``timeout_s`` (default ``no_engine_timeout_s``) and then raises :class:`NoEngineAvailable`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.no_engine_timeout_s if timeout_s is None else timeout_s)
        while True:
            self._changed.clear()  # before pick: a recovery after this point wakes the wait below
            handle = self.pick(prefer)
            if handle is not None:
                handle.outstanding += 1
                handle.requests += 1
                return handle
            remaining = deadline - loop.time()
            if remaining <= 0:
                known = ", ".join(f"{h.engine_id} ({self._why_not(h)})" for h in self.engines.values())
                raise NoEngineAvailable(
                    f"no routable engine within the wait timeout; engines: {known or 'none'}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, self.health_interval_s))

    def _why_not(self, handle: EngineHandle) -> str:
        if self.behind(handle):
            return f"weight version {handle.weight_version} is beyond the staleness bound"
        return handle.last_error or "not probed"

    def release(self, handle: EngineHandle) -> None:
        handle.outstanding = max(0, handle.outstanding - 1)

    def observe(self, handle: EngineHandle, weight_version: int) -> None:
        """An answer from the engine carried ``weight_version``. Higher than known: the engine was updated. Lower:
        an answer that started before an update, or the engine restarted on its initial weights; a probe
        (which reads its current label) decides. Answers through an sglang-router name no engine: ignored."""
        if handle is self.proxy:
            return
        if handle.weight_version is not None and weight_version < handle.weight_version:
            self._spawn(self._probe_quietly(handle))
            return
        was_behind = self.behind(handle)
        handle.weight_version = weight_version
        if was_behind and not self.behind(handle):
            self._changed.set()

    def recheck_behind(self) -> None:
        """Probe at once every healthy engine that is behind (a version was just published: it may have it)."""
        for handle in self.healthy():
            if self.behind(handle):
                self._spawn(self._probe_quietly(handle))

    async def _probe_quietly(self, handle: EngineHandle) -> None:
        with contextlib.suppress(Exception):
            await self.probe(handle)

    def _set_healthy(self, handle: EngineHandle, healthy: bool) -> None:
        if healthy and not handle.healthy:
            self._changed.set()
        handle.healthy = healthy

    def mark_failed(self, handle: EngineHandle, error: str) -> bool:
        """Take the engine out of routing after a failure that is its fault; True if it was routable."""
        was = handle.healthy
        if was:
            handle.failures += 1
            log.warning("engine %s taken out of routing: %s", handle.engine_id, error)
        handle.healthy = False
        handle.last_error = error
        if was and self.registry is not None and handle is not self.proxy:
            self._spawn(self._write(handle, "unhealthy", error))
        return was

    def abort_later(self, handle: EngineHandle, rid: str) -> None:
        """Best-effort ``/abort_request`` for a request whose caller went away (fire and forget). Sent through
        an sglang-router (which does not proxy it, and does not say which engine holds the rid): to every engine
        that is healthy, directly; an engine ignores a rid it does not hold."""

        async def abort(target: EngineHandle) -> None:
            with contextlib.suppress(
                Exception
            ):  # best effort: the engine also aborts a request whose client left
                await target.client.abort(rid)

        targets = self.healthy() if handle is self.proxy else [handle] if handle.healthy else []
        for target in targets:
            self._spawn(abort(target))

    # -- health ----------------------------------------------------------------------------------------------

    async def probe(self, handle: EngineHandle) -> bool:
        """GET /model_info under the control timeout; updates routing and the registry. True when alive."""
        if handle is self.proxy:
            return await self._probe_proxy(handle)
        try:
            info = await handle.client.model_info()
            version = answer_version(info)
        except Exception as exc:  # noqa: BLE001 - any failure means not routable
            error = f"probe: {type(exc).__name__}: {exc}"
            if handle.healthy:
                self.mark_failed(handle, error)
            else:
                handle.last_error = error
            return False
        back = not handle.healthy
        was_behind = self.behind(handle)
        handle.weight_version, handle.last_seen = version, time.time()
        if back:
            log.info("engine %s is healthy (weight version %s)", handle.engine_id, version)
        if was_behind and not self.behind(handle):
            log.info("engine %s caught up (weight version %s)", handle.engine_id, version)
            self._changed.set()
        self._set_healthy(handle, True)
        await self._write(handle, "healthy", "")
        return True

    async def _probe_proxy(self, handle: EngineHandle) -> bool:
        """The sglang-router's own liveness (``GET /health``, answered by the router, no generation)."""
        try:
            await handle.client.control("GET", "/health")
        except Exception as exc:  # noqa: BLE001 - any failure means not routable
            error = f"probe: {type(exc).__name__}: {exc}"
            if handle.healthy:
                self.mark_failed(handle, error)
            else:
                handle.last_error = error
            return False
        if not handle.healthy:
            log.info("sglang router %s is healthy", handle.url)
        handle.last_seen = time.time()
        self._set_healthy(handle, True)
        return True

    async def probe_all(self) -> None:
        handles = list(self.engines.values()) + ([self.proxy] if self.proxy is not None else [])
        await asyncio.gather(*(self.probe(h) for h in handles))

    async def _write(self, handle: EngineHandle, health: str, error: str) -> None:
        if self.registry is None:
            return
        patch: dict = {"health": health, "error": error}
        if health == "healthy":
            patch.update(weight_version=handle.weight_version, last_seen=handle.last_seen)
        try:
            await self.registry.update(handle.engine_id, **patch)
        except Exception as exc:  # noqa: BLE001 - the registry is advisory for routing; never fail a request
            log.warning("registry update for %s failed: %s", handle.engine_id, exc)

    async def run_health_checks(self, stop: asyncio.Event) -> None:
        """Refresh membership and probe every engine each ``health_interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            try:
                await self.refresh()
                await self.probe_all()
            except Exception as exc:  # noqa: BLE001 - a Redis hiccup must not end health checking
                log.warning("health check round failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.health_interval_s)

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Wait briefly for fire-and-forget calls (aborts, registry writes) before the session closes."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    def stats(self) -> dict[str, float]:
        """Per-engine outstanding requests and health, flat, for the metrics stream."""
        out: dict[str, float] = {
            "engines_healthy": float(len(self.healthy())),
            "engines_routable": float(len(self.routable())),
            "engines": float(len(self.engines)),
        }
        if self.proxy is not None:
            out["sglang_router/healthy"] = float(self.proxy.healthy)
            out["sglang_router/outstanding"] = float(self.proxy.outstanding)
            out["sglang_router/failures"] = float(self.proxy.failures)
        for h in self.engines.values():
            out[f"engine/{h.engine_id}/outstanding"] = float(h.outstanding)
            out[f"engine/{h.engine_id}/healthy"] = float(h.healthy)
            out[f"engine/{h.engine_id}/behind"] = float(self.behind(h))
            out[f"engine/{h.engine_id}/failures"] = float(h.failures)
        return out

    def urls(self) -> Iterable[str]:
        return [h.url for h in sorted(self.engines.values(), key=lambda h: h.order)]
