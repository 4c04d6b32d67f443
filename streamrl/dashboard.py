"""``streamrl dashboard``: a read-only web page over the run's metrics in Redis, and the JSON API it polls.

Everything shown comes from Redis, namespaced by ``shared.run_id``:

- the per-role metrics streams ``metrics:<role>`` (:class:`broker.metrics.MetricsWriter`: learner, rollout,
  eval, ... - any role that writes one appears, none is required);
- the broker counters, backlog and consumer-group lag / pending (:class:`broker.metrics.BrokerMetrics`), which
  have no history in Redis: the server samples them every ``refresh_s`` into a ring of ``history_points``,
  served as the pseudo-role ``broker`` (so ``broker`` is reserved as a metrics role name);
- the policy version (:class:`broker.version.PolicyVersion`);
- the engine registry (the hash ``engines``: engine id -> JSON, layout in docs/rollout.md), read without
  importing the fleet, tolerating entries it cannot parse; each engine (and each URL in
  ``dashboard.engine_urls``) is probed with ``GET /model_info`` and ``GET /v1/loads`` - the same on SGLang
  and on the built-in engine - from the sampling loop, so open tabs do not multiply the load on engines.

JSON API (GET only; non-finite numbers are sent as null, since JSON has none):

- ``/api/summary``: run id, policy version, the latest point of every role with its age, the broker snapshot,
  the engines, the page settings;
- ``/api/series?role=R&since=ID&limit=N``: points of role R newer than entry id ID (exclusive), oldest first,
  at most N (``more`` says whether more wait); without ``since``, the newest N. Each point is
  ``{"id", "values"}`` with the values exactly as the writer stored them;
- ``/api/samples?limit=N``: the latest trajectories the archiver read (archiver.archive: prompt, each completion
  token's text and policy version, reward and components), newest first, with the archiver's status;
- ``/metrics``: the same numbers in Prometheus' text format (role ``dashboard``).

With the run secret on (``shared.auth``, common.auth; always beyond loopback) everything but ``/metrics``
answers 401 without it: a bearer header, or the cookie one visit of ``/?token=SECRET`` sets
(:func:`login_middleware`); the engine probes send it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import signal
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from archiver.archive import read_recent, read_status
from broker.client import BrokerKeys, connect
from broker.config import BrokerConfig
from broker.metrics import BrokerMetrics, MetricsReader, metrics_key
from broker.registry import EngineInfo, registry_key
from broker.version import PolicyVersion
from common.auth import (
    AuthError,
    auth_headers,
    check_bind,
    derived_token,
    require_secret,
    run_secret,
    same_secret,
    secret_path,
    unauthorized,
)
from common.config import SharedConfig
from common.discovery import RedisNotFound, resolve_redis_url
from common.numbers import parse_number
from common.prometheus import MetricsServer, metrics_route, start_metrics_server, stream_latest_source
from common.versioning import LabelError, decode_label
from streamrl.config import DashboardConfig, StreamRLConfig
from streamrl.devices import read_plan
from streamrl.wandb_log import RunLogger, open_logger, safe_name

log = logging.getLogger("streamrl.dashboard")

STATIC_DIR = Path(__file__).parent / "static"
BROKER_ROLE = "broker"  # pseudo-role: the server's samples of the broker snapshot
ROLES_CACHE_S = 5.0
_ROLE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_STREAM_ID = re.compile(r"^\d+(-\d+)?$")
STATE_KEY: web.AppKey[DashboardState] = web.AppKey("dashboard_state")
DASHBOARD_OPEN_PATHS = frozenset({"/metrics"})  # Prometheus scrapes carry no secret (SGLang's rule too)
TOKEN_PARAM = "token"
WANDB_BATCH = 5000  # stream points read per role and wandb poll
WANDB_FINISH_S = 30.0  # a stopping dashboard's last wandb poll and finish, at most (up.grace_s is 40 s)


class BadRequest(ValueError):
    """A query parameter the API refuses; the message names it and its value."""


def clean(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, recursively (JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def broker_sample(snapshot: Mapping[str, Any], consumer_group: str) -> dict[str, float]:
    """The numbers of one broker snapshot that the page charts: backlog, lag and pending of the learner's
    consumer group, stream lengths and the main counters."""
    group = snapshot.get("groups", {}).get(consumer_group, {})
    counters = snapshot.get("counters", {})
    out: dict[str, float] = {
        "ts": float(snapshot.get("ts", time.time())),
        "backlog": float(snapshot.get("backlog", 0)),
        "max_backlog": float(snapshot.get("max_backlog", 0)),
        "stream_length": float(snapshot.get("stream_length", 0)),
        "dead_letter_length": float(snapshot.get("dead_letter_length", 0)),
        "dropped_length": float(snapshot.get("dropped_length", 0)),
        "pending": float(group.get("pending") or 0),
        "lag": float(group.get("lag") or 0),
        "consumers": float(group.get("consumers") or 0),
    }
    for name, value in counters.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"counters/{name}"] = float(value)
    return out


@dataclass
class EngineView:
    """One engine as the page shows it: the registry's entry (if any) and what the last probe saw."""

    url: str
    engine_id: str
    registry: dict[str, Any] | None = None
    reachable: bool | None = None  # None: not probed (yet, or probing is off)
    weight_version: str | None = None
    loads: dict[str, Any] | None = None
    probe_error: str = ""
    probed_at: float | None = None

    def as_json(self) -> dict[str, Any]:
        reg = self.registry or {}
        loads = self.loads or {}
        return {
            "engine_id": self.engine_id,
            "url": self.url,
            "health": reg.get("health"),
            "registry_weight_version": reg.get("weight_version"),
            "ranks": reg.get("ranks"),
            "kind": reg.get("kind"),
            "last_seen": reg.get("last_seen"),
            "registry_error": reg.get("error") or "",
            "reachable": self.reachable,
            "weight_version": self.weight_version,
            "running": loads.get("num_running_reqs"),
            "waiting": loads.get("num_waiting_reqs"),
            "gen_throughput": loads.get("gen_throughput"),
            "token_usage": loads.get("token_usage"),
            "probe_error": self.probe_error,
            "probed_at": self.probed_at,
            "in_registry": self.registry is not None,
        }


def _engine_id(url: str) -> str:
    return re.sub(r"^[a-z]+://", "", url).rstrip("/")


class DashboardState:
    """Reads Redis for the API and keeps the broker samples and engine probes between polls."""

    def __init__(
        self,
        client: aioredis.Redis,
        shared: SharedConfig,
        dashboard: DashboardConfig,
        broker: BrokerConfig,
    ) -> None:
        self.client = client
        self.shared = shared
        self.secret = run_secret(shared)  # required of the browser, sent to the engines (common.auth)
        self.config = dashboard
        self.broker_config = broker
        self.reader = MetricsReader(client, shared)
        self.broker_metrics = BrokerMetrics(client, shared, broker)
        self.version = PolicyVersion(client, shared, broker)
        self.broker_history: deque[tuple[int, dict[str, float]]] = deque(maxlen=dashboard.history_points)
        self.broker_latest: dict[str, Any] | None = None
        self.broker_error = ""
        self.engines: dict[str, EngineView] = {}
        # Broker sample ids start at the start time in ms, so a restarted dashboard's ids exceed the old ones
        # and an open page keeps polling with its last id (at most 5 samples a second: refresh_s >= 0.2).
        self._sample_seq = int(time.time() * 1000)
        self._roles: tuple[float, list[str]] = (0.0, [])
        self._devices: dict[str, Any] | None = None  # the run's device plan, read once up has written it
        self._http: aiohttp.ClientSession | None = None

    # -- sampling (one loop per server) ---------------------------------------------------------------------

    async def sample_broker(self) -> None:
        """Take one broker snapshot into the history ring (errors are kept for the page, not raised)."""
        try:
            snap = await self.broker_metrics.snapshot()
        except (aioredis.RedisError, OSError) as exc:
            self.broker_error = f"{type(exc).__name__}: {exc}"
            return
        self.broker_error = ""
        self.broker_latest = snap
        self._sample_seq += 1
        self.broker_history.append((self._sample_seq, broker_sample(snap, self.broker_config.consumer_group)))

    async def read_registry(self) -> list[dict[str, Any]]:
        """The registry's entries (broker.registry.EngineInfo) as dicts; an entry that cannot be read becomes
        ``{"engine_id", "error"}``."""
        raw = await self.client.hgetall(registry_key(self.shared))
        out: list[dict[str, Any]] = []
        for field, value in sorted(raw.items()):
            engine_id = _text(field)
            try:
                entry = asdict(EngineInfo.from_json(value))
            except (ValueError, TypeError) as exc:
                entry = {"engine_id": engine_id, "error": f"unreadable registry entry: {exc}"}
            out.append(entry)
        return out

    async def refresh_engines(self) -> None:
        """Merge the registry and the configured URLs, then probe each engine (concurrently)."""
        try:
            entries = await self.read_registry()
        except (aioredis.RedisError, OSError) as exc:
            log.debug("engine registry unreadable: %s", exc)
            entries = None
        views: dict[str, EngineView] = {}
        for entry in entries if entries is not None else []:
            url = str(entry.get("url") or "")
            key = url or str(entry["engine_id"])
            old = self.engines.get(key)
            view = old or EngineView(url=url, engine_id=str(entry["engine_id"]))
            view.registry = entry
            views[key] = view
        for url in self.config.engine_urls:
            url = url.rstrip("/")
            if url not in views:
                views[url] = self.engines.get(url) or EngineView(url=url, engine_id=_engine_id(url))
        if entries is None:  # keep what we knew rather than blanking the table during a Redis outage
            views = {**self.engines, **views}
        self.engines = views
        if self.config.probe_engines:
            await asyncio.gather(*(self.probe(v) for v in views.values() if v.url))

    async def probe(self, view: EngineView) -> None:
        """``/model_info`` (weight version) and ``/v1/loads`` (running, waiting, throughput) of one engine."""
        if self._http is None:
            self._http = aiohttp.ClientSession(headers=auth_headers(self.secret))
        timeout = aiohttp.ClientTimeout(total=self.config.probe_timeout_s)
        try:
            async with self._http.get(f"{view.url}/model_info", timeout=timeout) as resp:
                resp.raise_for_status()
                info = await resp.json(content_type=None)
            async with self._http.get(f"{view.url}/v1/loads", timeout=timeout) as resp:
                loads = (await resp.json(content_type=None)) if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
            view.reachable, view.probe_error = False, f"{type(exc).__name__}: {exc}"[:300]
        else:
            version = info.get("weight_version") if isinstance(info, dict) else None
            view.weight_version = None if version is None else str(version)
            rows = loads.get("loads") if isinstance(loads, dict) else None
            view.loads = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else None
            view.reachable, view.probe_error = True, ""
        view.probed_at = time.time()

    async def sample_forever(self, stop: asyncio.Event) -> None:
        """Every ``refresh_s``: a broker sample and an engine refresh, until ``stop``."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(
                    asyncio.gather(self.sample_broker(), self.refresh_engines()),
                    timeout=max(self.config.api_timeout_s, self.config.probe_timeout_s * 2),
                )
            except TimeoutError:
                self.broker_error = "sampling timed out"
            except Exception:  # never let the sampler die: the page would freeze silently
                log.exception("dashboard sampling failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.refresh_s)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    # -- reads for the API ----------------------------------------------------------------------------------

    async def roles(self) -> list[str]:
        """Roles that have a metrics stream in this run (cached for a few seconds; SCAN is not free)."""
        at, cached = self._roles
        if time.monotonic() - at < ROLES_CACHE_S and cached:
            return cached
        prefix = metrics_key(self.shared)
        found = set()
        async for key in self.client.scan_iter(match=_glob_escape(prefix) + "*", count=500):
            role = _text(key)[len(prefix) :]
            if _ROLE.match(role) and role != BROKER_ROLE:
                found.add(role)
        roles = sorted(found)
        self._roles = (time.monotonic(), roles)
        return roles

    async def summary(self) -> dict[str, Any]:
        now = time.time()
        roles: dict[str, Any] = {}
        for role in await self.roles():
            rows = await self.client.xrevrange(self.reader.key(role), "+", "-", count=1)
            if rows:
                entry_id, values = rows[0][0], rows[0][1]
                point = {_text(k): parse_number(v) for k, v in values.items()}
                ts = point.get("ts")
                age = now - ts if isinstance(ts, (int, float)) else None
                roles[role] = {"id": _text(entry_id), "age_s": age, "values": point}
        broker: dict[str, Any] = dict(self.broker_latest or {})
        if self.broker_latest is not None:
            broker["sample"] = self.broker_history[-1][1] if self.broker_history else None
        broker["error"] = self.broker_error
        return {
            "run_id": self.shared.run_id,
            "ts": now,
            "policy_version": await self.version.get(),
            "eta": self.shared.eta,
            "consumer_group": self.broker_config.consumer_group,
            "roles": roles,
            "broker": broker,
            "engines": [v.as_json() for v in self.engines.values()],
            "devices": self.device_plan(),
            "settings": {"refresh_s": self.config.refresh_s, "history_points": self.config.history_points},
        }

    def device_plan(self) -> dict[str, Any] | None:
        """The device plan ``up`` wrote for this run (RUN_DIR/devices.json), None before it is there."""
        if self._devices is None:
            with contextlib.suppress(OSError, ValueError):
                self._devices = read_plan(Path(self.shared.run_dir))
        return self._devices

    async def samples(self, limit: int) -> dict[str, Any]:
        """The live sample viewer's data: the archiver's latest samples and its status."""
        keys = BrokerKeys.of(self.shared, self.broker_config)
        return {
            "samples": await read_recent(self.client, keys, limit),
            "archive": await read_status(self.client, keys),
            "policy_version": await self.version.get(),
            "eta": self.shared.eta,
        }

    async def series(self, role: str, since: str | None, limit: int) -> dict[str, Any]:
        if role == BROKER_ROLE:
            return self._broker_series(since, limit)
        key = self.reader.key(role)
        if since is None:
            rows = list(reversed(await self.client.xrevrange(key, "+", "-", count=limit)))
            more = False
        else:
            rows = await self.client.xrange(key, f"({since}", "+", count=limit + 1)
            more = len(rows) > limit
            rows = rows[:limit]
        points = [
            {"id": _text(i), "values": {_text(k): parse_number(v) for k, v in f.items()}} for i, f in rows
        ]
        last = points[-1]["id"] if points else since
        return {"role": role, "points": points, "last_id": last, "more": more}

    def _broker_series(self, since: str | None, limit: int) -> dict[str, Any]:
        after = int(since.split("-")[0]) if since else None
        rows = [(n, v) for n, v in self.broker_history if after is None or n > after]
        more = False
        if after is None:
            rows = rows[-limit:]
        else:
            more, rows = len(rows) > limit, rows[:limit]
        points = [{"id": str(n), "values": v} for n, v in rows]
        return {
            "role": BROKER_ROLE,
            "points": points,
            "last_id": points[-1]["id"] if points else since,
            "more": more,
        }

    async def prometheus_values(self) -> dict[str, Any]:
        """Flat numbers for the dashboard's own ``/metrics``: ``<role>/<key>`` of every role's latest point,
        ``broker/<key>`` of the last broker sample, ``policy_version`` and per-engine health."""
        summary = await self.summary()
        out: dict[str, Any] = {}
        if summary["policy_version"] is not None:
            out["policy_version"] = summary["policy_version"]
        for role, point in summary["roles"].items():
            out.update({f"{role}/{k}": v for k, v in point["values"].items()})
        for key, value in (summary["broker"].get("sample") or {}).items():
            out[f"broker/{key}"] = value
        for i, engine in enumerate(summary["engines"]):
            if engine["reachable"] is not None:
                out[f"engine/reachable/{i}"] = float(engine["reachable"])
            with contextlib.suppress(LabelError):  # an engine that reports no label, or a foreign one
                if engine["weight_version"] is not None:
                    out[f"engine/weight_version/{i}"] = decode_label(engine["weight_version"])
        return out


# -- HTTP ----------------------------------------------------------------------------------------------------


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(clean(obj), separators=(",", ":"), allow_nan=False),
        status=status,
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def parse_series_query(query: Mapping[str, str], default_limit: int) -> tuple[str, str | None, int]:
    """``role``, ``since`` and ``limit`` of ``/api/series``, checked; raises BadRequest naming the field."""
    role = query.get("role", "")
    if not _ROLE.match(role):
        raise BadRequest(f"role = {role!r}: must be 1-64 letters, digits, '_', '.' or '-'")
    since = query.get("since") or None
    if since is not None and not _STREAM_ID.match(since):
        raise BadRequest(f"since = {since!r}: must be a stream entry id like 1700000000000-0")
    raw_limit = query.get("limit") or str(default_limit)
    try:
        limit = int(raw_limit)
    except ValueError:
        raise BadRequest(f"limit = {raw_limit!r}: must be an integer") from None
    if not 1 <= limit <= 100_000:
        raise BadRequest(f"limit = {limit}: must be between 1 and 100000")
    return role, since, limit


async def _guarded(request: web.Request, make: Any) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        return _json(await asyncio.wait_for(make(state), state.config.api_timeout_s))
    except BadRequest as exc:
        return _json({"error": str(exc)}, 400)
    except (TimeoutError, aioredis.RedisError, OSError) as exc:
        return _json({"error": f"Redis unavailable: {type(exc).__name__}: {exc}"}, 503)


async def api_summary(request: web.Request) -> web.Response:
    return await _guarded(request, lambda s: s.summary())


async def api_series(request: web.Request) -> web.Response:
    async def make(state: DashboardState) -> dict[str, Any]:
        role, since, limit = parse_series_query(request.query, state.config.history_points)
        return await state.series(role, since, limit)

    return await _guarded(request, make)


MAX_SAMPLES = 100


def parse_samples_query(query: Mapping[str, str]) -> int:
    """``limit`` of ``/api/samples`` (default 12, at most MAX_SAMPLES); raises BadRequest naming the field."""
    raw = query.get("limit", "12")
    try:
        limit = int(raw)
    except ValueError:
        raise BadRequest(f"limit = {raw!r}: not an integer") from None
    if not 1 <= limit <= MAX_SAMPLES:
        raise BadRequest(f"limit = {limit}: must be between 1 and {MAX_SAMPLES}")
    return limit


async def api_samples(request: web.Request) -> web.Response:
    return await _guarded(request, lambda s: s.samples(parse_samples_query(request.query)))


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-store"})


def _cookie_name(request: web.Request) -> str:
    # one per port: a browser sends a host's cookies to each of its ports (two runs' dashboards, say)
    return f"streamrl_dashboard_{request.url.port}"


def login_middleware(secret: str) -> Any:
    """The run secret for everything but ``/metrics`` (open, as SGLang's): a bearer header (scripts) or the
    cookie a browser gets by opening any page once with ``?token=SECRET``, as Jupyter does. The cookie holds
    a token derived from the secret (common.auth.derived_token), HttpOnly and SameSite=Strict, and the
    redirect drops the secret from the address bar."""
    cookie = derived_token(secret, "dashboard")
    check = require_secret(
        secret, DASHBOARD_OPEN_PATHS, lambda r: same_secret(r.cookies.get(_cookie_name(r), ""), cookie)
    )

    @web.middleware
    async def login(request: web.Request, handler: Any) -> web.StreamResponse:
        token = request.query.get(TOKEN_PARAM)
        if token is None:
            return await check(request, handler)
        if not same_secret(token, secret):
            return unauthorized()
        rest = [(k, v) for k, v in request.query.items() if k != TOKEN_PARAM]
        response = web.Response(status=303, headers={"Location": str(request.rel_url.with_query(rest))})
        response.set_cookie(_cookie_name(request), cookie, httponly=True, samesite="Strict", path="/")
        return response

    return login


def make_app(state: DashboardState) -> web.Application:
    """The read-only app: the page, its static files, the JSON API and ``/metrics``. GET only; with a run
    secret, behind :func:`login_middleware`."""
    app = web.Application(middlewares=[login_middleware(state.secret)] if state.secret else [])
    app[STATE_KEY] = state
    app.router.add_get("/", index)
    app.router.add_get("/api/summary", api_summary)
    app.router.add_get("/api/series", api_series)
    app.router.add_get("/api/samples", api_samples)
    app.router.add_get(
        "/metrics", metrics_route("dashboard", state.prometheus_values, {"run": state.shared.run_id})
    )
    app.router.add_static("/static/", STATIC_DIR)
    return app


@dataclass
class RunningDashboard:
    """A dashboard serving in the current event loop; ``await stop()`` ends it."""

    url: str
    port: int
    state: DashboardState
    _runner: web.AppRunner
    _stop: asyncio.Event
    _sampler: asyncio.Task
    _owns_client: bool

    async def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._sampler, 10)
        await self._runner.cleanup()
        await self.state.close()
        if self._owns_client:
            await self.state.client.aclose()


async def start_dashboard(
    redis: str | aioredis.Redis,
    shared: SharedConfig,
    dashboard: DashboardConfig,
    broker: BrokerConfig,
    port: int | None = None,
) -> RunningDashboard:
    """Serve the dashboard on ``dashboard.host`` : ``port`` (default ``dashboard.port``; 0 picks a free one)
    from the running event loop. ``redis`` is a URL or a client (then the caller closes it)."""
    check_bind("dashboard.host", dashboard.host, run_secret(shared))
    owns = isinstance(redis, str)
    client = connect(redis, broker) if isinstance(redis, str) else redis
    state = DashboardState(client, shared, dashboard, broker)
    runner = web.AppRunner(make_app(state), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, dashboard.host, dashboard.port if port is None else port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        if owns:
            await client.aclose()
        raise
    bound = runner.addresses[0][1]
    stop = asyncio.Event()
    sampler = asyncio.create_task(state.sample_forever(stop), name="dashboard-sampler")
    host = dashboard.host if ":" not in dashboard.host else f"[{dashboard.host}]"
    return RunningDashboard(f"http://{host}:{bound}", bound, state, runner, stop, sampler, owns)


def engine_sample(view: EngineView) -> dict[str, float] | None:
    """An engine's last probe as wandb numbers (None before one answered)."""
    if not view.reachable or view.probed_at is None:
        return None
    loads = view.loads or {}
    out = {k: loads.get(k) for k in ("num_running_reqs", "num_waiting_reqs", "gen_throughput", "token_usage")}
    with contextlib.suppress(LabelError, TypeError, ValueError):
        out["weight_version"] = decode_label(view.weight_version)
    return {"ts": view.probed_at, **{k: v for k, v in out.items() if isinstance(v, (int, float))}}


async def log_to_wandb(state: DashboardState, logger: RunLogger) -> None:
    """Log what is new since the last call: the points of every role's stream after the logger's cursor, the
    newest broker sample and each engine's last probe (streamrl.wandb_log says what goes where)."""
    points = []
    for role in await state.roles():
        rows = await state.reader.read(role, start=logger.since(role), count=WANDB_BATCH)
        points.append((role, rows))
    broker = state.broker_history[-1][1] if state.broker_history else None
    engines = [(f"engine/{safe_name(v.engine_id)}", engine_sample(v)) for v in state.engines.values()]

    def write() -> None:
        for role, rows in points:
            logger.log_points(role, rows)
        if broker is not None:
            logger.log_sample("broker", broker)
        for prefix, sample in engines:
            if sample is not None:
                logger.log_sample(prefix, sample)

    await asyncio.to_thread(write)


async def wandb_forever(
    state: DashboardState, logger: RunLogger, interval_s: float, stop: asyncio.Event
) -> None:
    """Log to wandb every ``interval_s`` until ``stop``, then once more (up's final evaluation is written just
    before the dashboard is stopped) and finish the run. A failure is logged, never raised: the page goes on."""
    try:
        while True:
            stopping = stop.is_set()
            try:
                await log_to_wandb(state, logger)
            except Exception:  # noqa: BLE001 - wandb or Redis trouble must not take the dashboard down
                log.exception("logging to wandb failed; trying again in %.0f s", interval_s)
            if stopping:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        await asyncio.to_thread(logger.finish)


async def start_wandb(
    state: DashboardState,
    mode: str,
    config: Mapping[str, Any],
    archive: Path | None,
    stop: asyncio.Event,
) -> asyncio.Task | None:
    """Open the run's wandb run (common.wandb_run) and start :func:`wandb_forever`; None when wandb is off or
    cannot be opened (said in the log: the dashboard serves on without it)."""
    try:
        logger = await asyncio.to_thread(
            open_logger, state.shared, mode, config, state.device_plan(), archive
        )
    except Exception:  # noqa: BLE001 - e.g. online mode without credentials
        log.exception("cannot open the run's wandb run; nothing is logged to wandb")
        return None
    if logger is None:
        return None
    interval = state.config.wandb_interval_s
    return asyncio.create_task(wandb_forever(state, logger, interval, stop), name="dashboard-wandb")


def run_dashboard(
    shared: SharedConfig,
    dashboard: DashboardConfig,
    broker: BrokerConfig,
    wandb_mode: str = "disabled",
    config: Mapping[str, Any] | None = None,
    archive: Path | None = None,
) -> int:
    """Serve until SIGTERM / SIGINT, logging the run to wandb in ``wandb_mode`` with ``config`` (the whole
    config tree) as the run's config and, when it stops, the ``archive`` directory's parts as an artifact;
    returns the exit code (2: no Redis, 1: cannot bind)."""
    try:
        url = resolve_redis_url(shared, wait_s=dashboard.redis_wait_s)
    except RedisNotFound as exc:
        log.error("%s", exc)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        running = await start_dashboard(url, shared, dashboard, broker)
        log.info("dashboard of run %r at %s (read-only)", shared.run_id, running.url)
        if running.state.secret:  # the secret itself stays out of the log, which is not 0600
            log.info("open %s/?%s=SECRET once, SECRET being the contents of %s", running.url, TOKEN_PARAM,
                     secret_path(shared))  # fmt: skip
        wandb = await start_wandb(running.state, wandb_mode, config or {}, archive, stop)
        try:
            await stop.wait()
        finally:
            if wandb is not None:  # its last points first, while Redis is still there
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(wandb, WANDB_FINISH_S)
            await running.stop()
            log.info("dashboard stopped")

    try:
        asyncio.run(main())
    except OSError as exc:
        log.error("cannot serve the dashboard on %s:%d: %s", dashboard.host, dashboard.port, exc)
        return 1
    except AuthError as exc:
        log.error("%s", exc)
        return 2
    return 0


def serve_role_metrics(config: StreamRLConfig, role: str, index: int = 0) -> MetricsServer | None:
    """Start the Prometheus endpoint of a role without an HTTP server of its own (learner, eval, rollout worker
    ``index``) at ``dashboard.metrics_host : dashboard.metrics_port(role, index)``, serving the newest point
    the role wrote to ``metrics:<role>`` plus its process' CPU and memory. Call it in the role's process
    before it starts. None when disabled (``metrics_base_port = 0``) or when the port is taken: a missing
    metrics endpoint is logged, never a reason for the role itself to fail."""
    port = config.dashboard.metrics_port(role, index)
    if port is None:
        return None
    shared = config.shared
    source = stream_latest_source(lambda: resolve_redis_url(shared), metrics_key(shared, role))
    labels = {"run": shared.run_id} if role != "rollout" else {"run": shared.run_id, "worker": str(index)}
    try:
        return start_metrics_server(config.dashboard.metrics_host, port, role, source, labels)
    except OSError as exc:
        log.warning("no Prometheus endpoint for %s: port %d: %s", role, port, exc)
        return None


def run(config: StreamRLConfig) -> int:
    """Entry point for ``streamrl dashboard`` (the CLI passes the whole config tree)."""
    return run_dashboard(config.shared, config.dashboard, config.broker)
