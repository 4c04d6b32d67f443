"""``streamrl audit RUN_DIR``: account for every prompt group of a run, from its records in Redis.

Prints generated / trained / dropped (by reason) / dead-lettered / pending / trained twice / lost
(broker.outcomes.audit) and exits 0 when nothing is lost and nothing was trained twice, 1 otherwise. It reads
the run's Redis: the live one while the run is up, else the embedded server is started on the run's own data
(its AOF) for the time of the audit and stopped again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import redis

from broker.client import connect
from broker.outcomes import AuditReport, audit, format_audit
from broker.server import EmbeddedRedis
from common.configlib import ConfigError, load_config
from common.discovery import RedisNotFound, resolve_redis_url, url_file
from streamrl.config import StreamRLConfig

USAGE = """usage: streamrl audit RUN_DIR [--json]

Account for every prompt group of the run in RUN_DIR: generated, trained, dropped (by reason), dead-lettered,
pending in the stream, trained twice, lost. Exit code 0 when none is lost or trained twice, 1 otherwise.
Reads the run's Redis while it runs; after the run, starts the embedded server on the run's AOF for the audit.

  --json   print the figures as JSON instead of a table"""


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


@contextlib.contextmanager
def runs_redis(config: StreamRLConfig) -> Iterator[str]:
    """The URL of the run's Redis: the live server when it answers, else the embedded one started on the run's
    data directory until the block ends."""
    try:
        url = resolve_redis_url(config.shared)
    except RedisNotFound:
        url = None
    if url is not None and _answers(url):
        yield url
        return
    if config.shared.redis_url:
        raise ConfigError(f"shared.redis_url = {config.shared.redis_url!r} does not answer")
    data_dir = url_file(config.shared).parent
    if not (data_dir / "password").is_file():
        raise ConfigError(f"{data_dir} holds no Redis data of a run")
    server = EmbeddedRedis(data_dir, config.redis)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


async def audit_url(url: str, config: StreamRLConfig) -> AuditReport:
    client = connect(url, config.broker)
    try:
        return await audit(client, config.shared, config.broker)
    finally:
        await client.aclose()


def load_run_config(run_dir: Path) -> StreamRLConfig:
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"RUN_DIR = {str(run_dir)!r}: no run directory with a config.toml there")
    return load_config(
        StreamRLConfig, ["--config", str(run_dir / "config.toml"), f"--shared.run_dir={run_dir}"]
    )


def main(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    as_json = "--json" in args
    rest = [a for a in args if a != "--json"]
    if len(rest) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        config = load_run_config(Path(rest[0]).resolve())
        with runs_redis(config) as url:
            report = asyncio.run(audit_url(url, config))
    except ConfigError as exc:
        print(f"streamrl audit: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if as_json else format_audit(report))
    return 0 if report.ok else 1
