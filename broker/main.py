"""``streamrl redis`` / ``python -m broker``: run the embedded Redis server as a daemon until stopped."""

from __future__ import annotations

import logging
import signal
import threading
import time

import redis

from broker.client import LEARNER_CLIENT_NAME
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
    _wait_for_clients_to_leave(server.url, config.drain_timeout_s)
    server.stop()
    return 0


OWN_CLIENT_NAME = "streamrl-redis-role"  # this process's own connections


def _wait_for_clients_to_leave(url: str, timeout_s: float) -> None:
    """Stop after the learner: when every role is told to stop at once (their supervisor died), the learner's
    final checkpoint still needs Redis to acknowledge what it contains. Waits until no learner connection is
    left, at most ``timeout_s``."""
    client = redis.Redis.from_url(url, socket_timeout=2, client_name=OWN_CLIENT_NAME)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            learners = [c for c in client.client_list() if c.get("name", "").startswith(LEARNER_CLIENT_NAME)]
            if not learners:
                return
            time.sleep(0.2)
        log.warning("the learner is still connected after %.0f s: stopping anyway", timeout_s)
    except redis.RedisError as exc:
        log.warning("could not list clients before stopping: %s", exc)
    finally:
        client.close()


def _start_metrics(host: str, port: int | None, url: str):  # noqa: ANN202 - MetricsServer | None
    if not port:
        return None
    from broker.prometheus import redis_info_source, start_metrics_server

    try:
        return start_metrics_server(host, port, "redis", redis_info_source(url, client_name=OWN_CLIENT_NAME))
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
