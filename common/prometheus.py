"""Prometheus ``/metrics`` for every daemon, from a callable returning the role's latest numbers.

Each role already has its numbers as a flat dict (what it writes with broker.metrics' ``MetricsWriter``);
this module exposes such a dict in Prometheus' text format, two ways:

* :func:`start_metrics_server` - a standalone server on its own port (prometheus_client's WSGI server in a
  daemon thread), for roles without an HTTP server of their own (learner rank 0, rollout workers, redis).
  The source is called on the server's thread, so it must be a plain function; async roles keep a
  :class:`LatestMetrics` that their loop updates and the server reads.
* :func:`metrics_route` / :func:`add_metrics_route` - an aiohttp handler for roles that already serve HTTP
  (engines, the dashboard); there the source may also be a coroutine function.

Names: ``streamrl_<role>_<key>`` with every character outside ``[A-Za-z0-9_:]`` replaced by ``_``
(``staleness/mean`` -> ``streamrl_learner_staleness_mean``). A key whose last segment is an integer becomes a
labelled series (``staleness/hist/3`` -> ``streamrl_learner_staleness_hist{bucket="3"}``), so a histogram
is one metric, and so is a per-engine key (``engine/<id>/outstanding`` ->
``streamrl_rollout_engine_outstanding{engine="<id>"}``). String values become ``<name>_info{value="..."} 1``. Every scrape also reports
``streamrl_<role>_source_ok`` (0 when the source raised), so a broken source shows up as a value, not as a
silent gap.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST, start_http_server
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.numbers import parse_number

log = logging.getLogger("streamrl.prometheus")

Values = Mapping[str, Any]
MetricsSource = Callable[[], Values | None]
AsyncMetricsSource = Callable[[], Values | None | Awaitable[Values | None]]

_BAD = re.compile(r"[^A-Za-z0-9_:]")
_SEGMENT_INT = re.compile(r"^(?P<base>.+)/(?P<bucket>-?\d+)$")
_PER_ENGINE = re.compile(r"^engine/(?P<engine>[^/]+)/(?P<name>[^/]+)$")
_LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def metric_name(role: str, key: str) -> str:
    """``streamrl_<role>_<key>`` with invalid characters replaced by ``_`` (a Prometheus metric name)."""
    name = _BAD.sub("_", f"streamrl_{role}_{key}")
    return re.sub(r"__+", "_", name).rstrip("_")


def _check_role(role: str) -> str:
    if not role or _BAD.search(role):
        raise ValueError(f"role = {role!r}: must be a non-empty name of letters, digits and '_'")
    return role


def _check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(labels or {})
    for name, value in out.items():
        if not _LABEL.match(name) or name in ("bucket", "value"):
            raise ValueError(f"labels[{name!r}]: not a usable Prometheus label name")
        if not isinstance(value, str):
            raise ValueError(f"labels[{name!r}] = {value!r}: must be a string")
    return out


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def families(role: str, values: Values | None, labels: Mapping[str, str] | None = None) -> list[Metric]:
    """The gauge families for one snapshot of ``values`` (see the module doc for the naming rules)."""
    const = dict(labels or {})
    gauges: dict[str, GaugeMetricFamily] = {}
    label_names: dict[str, tuple[str, ...]] = {}

    def gauge(name: str, doc: str, extra: tuple[str, ...]) -> GaugeMetricFamily | None:
        names = (*const, *extra)
        if name not in gauges:
            gauges[name] = GaugeMetricFamily(name, doc, labels=list(names))
            label_names[name] = names
        elif label_names[name] != names:  # e.g. "a/1" and "a" both present: keep the first shape
            log.debug("metric %s: key %r clashes with another key's shape; dropped", name, doc)
            return None
        return gauges[name]

    for key, raw in (values or {}).items():
        key = str(key)
        number = _as_number(raw)
        if number is None and isinstance(raw, str):
            fam = gauge(metric_name(role, key) + "_info", f"{role} {key!r} (text)", ("value",))
            if fam is not None:
                fam.add_metric([*const.values(), raw], 1.0)
            continue
        if number is None:
            continue  # lists, dicts, None: not a sample
        per_engine = _PER_ENGINE.match(key)
        match = _SEGMENT_INT.match(key)
        if per_engine:
            name = metric_name(role, f"engine_{per_engine['name']}")
            fam = gauge(name, f"{role} 'engine/<id>/{per_engine['name']}'", ("engine",))
            if fam is not None:
                fam.add_metric([*const.values(), per_engine["engine"]], number)
        elif match:
            fam = gauge(metric_name(role, match["base"]), f"{role} {match['base']!r} by bucket", ("bucket",))
            if fam is not None:
                fam.add_metric([*const.values(), match["bucket"]], number)
        else:
            fam = gauge(metric_name(role, key), f"{role} {key!r}", ())
            if fam is not None:
                if fam.samples:
                    continue  # a second key that sanitises to the same name: keep the first
                fam.add_metric(list(const.values()), number)
    return list(gauges.values())


def _status_family(role: str, ok: bool, labels: Mapping[str, str]) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(
        metric_name(role, "source_ok"), f"1 when the {role} metrics source answered", labels=list(labels)
    )
    fam.add_metric(list(labels.values()), 1.0 if ok else 0.0)
    return fam


class SourceCollector(Collector):
    """A prometheus_client collector that calls a plain ``source()`` on every scrape."""

    def __init__(self, role: str, source: MetricsSource, labels: Mapping[str, str] | None = None) -> None:
        self.role = _check_role(role)
        self.source = source
        self.labels = _check_labels(labels)

    def collect(self) -> Iterator[Metric]:
        try:
            values = self.source()
            if inspect.isawaitable(values):
                if inspect.iscoroutine(values):
                    values.close()
                raise TypeError("the source of a standalone metrics server must be a plain function")
        except Exception:
            log.exception("metrics source of %s failed", self.role)
            yield _status_family(self.role, False, self.labels)
            return
        yield from families(self.role, values, self.labels)
        yield _status_family(self.role, True, self.labels)


class _StaticCollector(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


def render(
    role: str, values: Values | None, labels: Mapping[str, str] | None = None, ok: bool = True
) -> bytes:
    """Prometheus text exposition of one snapshot (what both the server and the route answer)."""
    labels = _check_labels(labels)
    registry = CollectorRegistry(auto_describe=False)
    metrics = families(_check_role(role), values, labels) if ok else []
    registry.register(_StaticCollector([*metrics, _status_family(role, ok, labels)]))
    return generate_latest(registry)


@dataclass
class MetricsServer:
    """A running standalone ``/metrics`` server; :meth:`stop` frees the port."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self, timeout: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)


def start_metrics_server(
    host: str,
    port: int,
    role: str,
    source: MetricsSource,
    labels: Mapping[str, str] | None = None,
    process_metrics: bool = True,
) -> MetricsServer:
    """Serve ``role``'s numbers from ``source()`` at ``http://host:port/metrics`` (any path answers) from a
    daemon thread. ``port`` 0 binds a free port (see ``.port``). ``process_metrics`` adds the process' CPU and
    memory (``process_*``). Bind beyond loopback only when asked: ``host`` has no default on purpose."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SourceCollector(role, source, labels))
    if process_metrics:
        ProcessCollector(registry=registry)
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("prometheus metrics of %s at http://%s:%d/metrics", role, host, bound)
    return MetricsServer(host, bound, server, thread)


def metrics_route(
    role: str, source: AsyncMetricsSource, labels: Mapping[str, str] | None = None
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler answering ``role``'s numbers from ``source()`` (plain or coroutine function)."""
    _check_role(role)
    checked = _check_labels(labels)

    async def handler(request: web.Request) -> web.Response:
        ok = True
        values: Values | None = None
        try:
            values = source()
            if inspect.isawaitable(values):
                values = await values
        except Exception:
            log.exception("metrics source of %s failed", role)
            ok = False
        body = render(role, values, checked, ok)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handler


def add_metrics_route(
    app: web.Application,
    role: str,
    source: AsyncMetricsSource,
    labels: Mapping[str, str] | None = None,
    path: str = "/metrics",
) -> None:
    """Mount :func:`metrics_route` at ``path`` (GET) on an aiohttp app."""
    app.router.add_get(path, metrics_route(role, source, labels))


REDIS_INFO_SECTIONS = ("server", "clients", "memory", "persistence", "stats")


def redis_info_source(url: str, timeout_s: float = 2.0, client_name: str | None = None) -> MetricsSource:
    """A source for the ``redis`` role: the numeric fields of INFO (memory, clients, persistence / AOF, command
    stats) of the server at ``url``, read with a plain client on every scrape (``timeout_s`` bounds it)."""
    import redis

    client = redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, client_name=client_name
    )

    def source() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for section in REDIS_INFO_SECTIONS:
            for key, value in client.info(section).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[key] = value
        return out

    return source


def stream_latest_source(
    url: str | Callable[[], str], stream_key: str, timeout_s: float = 2.0
) -> MetricsSource:
    """A source reading the newest point of a metrics stream (``MetricsWriter``'s ``metrics:<role>``) from Redis
    on every scrape: a role can expose exactly what it writes without any hook in its loop. ``url`` may be a
    function (e.g. resolving the embedded server's URL file), called until it returns; until then, and
    whenever Redis does not answer, the scrape reports ``source_ok 0``."""
    import redis

    state: dict[str, Any] = {}

    def client() -> redis.Redis:
        if "client" not in state:
            target = url() if callable(url) else url
            state["client"] = redis.Redis.from_url(
                target, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
        return state["client"]

    def source() -> dict[str, Any]:
        rows = client().xrevrange(stream_key, "+", "-", count=1)
        if not rows:
            return {}
        return {_decode(k): parse_number(_decode(v)) for k, v in rows[0][1].items()}

    return source


def _decode(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class LatestMetrics:
    """The latest numbers of a role, updated by its loop and read by a metrics server (thread-safe).

    ``update`` merges (so counters from different places can share one holder); ``replace`` swaps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, Any] = {}

    def update(self, values: Values) -> None:
        with self._lock:
            self._values.update(values)

    def replace(self, values: Values) -> None:
        with self._lock:
            self._values = dict(values)

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._values)
