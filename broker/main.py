"""``streamrl redis`` / ``python -m broker``: run the embedded Redis server as a daemon until stopped."""

from __future__ import annotations

import logging
import signal
import threading

from broker.config import RedisServerConfig, SharedConfig
from broker.configlib import Section, role_main
from broker.server import EmbeddedRedis, RedisServerError

log = logging.getLogger("streamrl.redis")


def run_redis(shared: SharedConfig, config: RedisServerConfig, metrics_port: int | None = None) -> int:
    """Start the server, announce its URL, and supervise it until SIGTERM / SIGINT or until it dies; with
    ``metrics_port``, serve its INFO numbers for Prometheus there."""
    if shared.redis_url:
        log.info("shared.redis_url names an existing server; nothing is started")
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = EmbeddedRedis(shared.run_dir / "redis", config)
    try:
        server.start()
    except RedisServerError as exc:
        log.error("%s", exc)
        return 1
    # The password stays out of logs: other roles read the full URL from the 0600 file.
    log.info(
        "redis ready at redis://%s:%d/0 (URL with password in %s)",
        config.host,
        server.port,
        server.data_dir / "url",
    )
    metrics = _start_metrics(config.host, metrics_port, server.url)
    try:
        while not stop.wait(0.5):
            server.check()
    except RedisServerError as exc:
        log.error("the Redis server died: %s", exc)
        return 1
    log.info("stopping redis")
    if metrics is not None:
        metrics.stop()
    server.stop()
    return 0


def _start_metrics(host: str, port: int | None, url: str):  # noqa: ANN202 - MetricsServer | None
    if not port:
        return None
    from broker.prometheus import redis_info_source, start_metrics_server

    try:
        return start_metrics_server(host, port, "redis", redis_info_source(url))
    except OSError as exc:
        log.warning("no Prometheus endpoint for redis on port %d: %s", port, exc)
        return None


class _RedisRoleConfig(Section):
    shared: SharedConfig = SharedConfig()
    redis: RedisServerConfig = RedisServerConfig()


def main(argv: list[str] | None = None) -> int:
    return role_main(
        "broker",
        _RedisRoleConfig,
        argv,
        lambda cfg: run_redis(cfg.shared, cfg.redis),
        log_format="%(asctime)s redis %(levelname)s: %(message)s",
    )
