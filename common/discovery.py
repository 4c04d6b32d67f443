"""Finding the run's Redis: the configured URL, else the URL the embedded server wrote into the run directory."""

from __future__ import annotations

import time
from pathlib import Path

from common.config import SharedConfig


class RedisNotFound(RuntimeError):
    """No Redis URL is configured and the embedded server has not (yet) written one."""


def url_file(shared: SharedConfig) -> Path:
    return Path(shared.run_dir) / "redis" / "url"


def resolve_redis_url(shared: SharedConfig, wait_s: float = 0.0) -> str:
    """``shared.redis_url`` (where the config loader put REDIS_URL: streamrl.config.env_defaults), else
    ``RUN_DIR/redis/url``, waiting up to ``wait_s`` for the embedded server to write it."""
    if shared.redis_url:
        return shared.redis_url
    path = url_file(shared)
    deadline = time.monotonic() + wait_s
    while True:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        if time.monotonic() >= deadline:
            raise RedisNotFound(
                f"no Redis: shared.redis_url is unset and {path} does not exist (start `streamrl redis` "
                "or set REDIS_URL)"
            )
        time.sleep(0.1)
