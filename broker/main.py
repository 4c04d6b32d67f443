"""``streamrl redis``: run the embedded Redis server as a daemon until stopped."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Collection

import redis

from broker.client import CLIENT_NAME
from broker.config import RedisServerConfig
from broker.server import EmbeddedRedis, RedisServerError
from common.config import SharedConfig

log = logging.getLogger("streamrl.redis")


def run_redis(
    shared: SharedConfig,
    config: RedisServerConfig,
    metrics_port: int | None = None,
    avoid_ports: Collection[int] = (),
) -> int:
    """Start the server, announce its URL, and supervise it until SIGTERM / SIGINT or until it dies; with
    ``metrics_port``, serve its INFO numbers for Prometheus there. ``avoid_ports``: ports promised to the
    run's other servers that may not be bound yet."""
    if shared.redis_url:
        log.info("shared.redis_url names an existing server; nothing is started")
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = EmbeddedRedis(shared.run_dir / "redis", config, avoid_ports)
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
    """Stop last: when every role is told to stop at once (their supervisor died), the learner's final
    checkpoint still needs Redis to acknowledge what it contains, and the rollout workers to hand their
    unfinished prompts back. Waits until no role's connection (CLIENT SETNAME ``streamrl...``) is left, at
    most ``timeout_s``; other clients (a redis-cli, a test) are not waited for."""
    client = redis.Redis.from_url(url, socket_timeout=2, client_name=OWN_CLIENT_NAME)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            names = [c.get("name", "") for c in client.client_list()]
            roles = [n for n in names if n.startswith(CLIENT_NAME) and n != OWN_CLIENT_NAME]
            if not roles:
                return
            time.sleep(0.2)
        log.warning("roles still connected after %.0f s: stopping anyway", timeout_s)
    except redis.RedisError as exc:
        log.warning("could not list clients before stopping: %s", exc)
    finally:
        client.close()


def _start_metrics(host: str, port: int | None, url: str):  # noqa: ANN202 - MetricsServer | None
    if not port:
        return None
    from common.prometheus import redis_info_source, start_metrics_server

    try:
        return start_metrics_server(host, port, "redis", redis_info_source(url, client_name=OWN_CLIENT_NAME))
    except OSError as exc:
        log.warning("no Prometheus endpoint for redis on port %d: %s", port, exc)
        return None
