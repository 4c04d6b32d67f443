"""The run secret: the bearer key that the run's HTTP servers (engines, the dashboard, a reward server) require
when ``shared.auth = "on"``, and that every client of theirs sends.

One secret per run, generated on first use into ``RUN_DIR/run_secret`` (mode 0600, like the Redis password in
``RUN_DIR/redis/password``) and kept across ``up --resume``. The root config turns ``shared.auth = "auto"`` into
"on" when any server of the run binds, or is reached at, an address beyond loopback, and refuses "off" then
(streamrl/config.py); "auto" on a loopback-only run means no secret and nothing checked.

The convention is SGLang's (its ``--api-key``): ``Authorization: Bearer <key>``, so one client works against
SGLang engines and the built-in engine alike; a missing or wrong key is answered 401 ``{"error":
"Unauthorized"}`` before the handler runs, so it changes nothing. Servers call :func:`run_secret` and
:func:`require_secret`; clients send :func:`auth_headers` of :func:`run_secret`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from aiohttp import web

from common.config import SharedConfig

SECRET_FILE = "run_secret"
HEADER = "Authorization"
# SGLang leaves its probes and Prometheus scrape open whatever the key (sglang.srt.utils.auth): a supervisor's
# liveness check and a scraper carry no secret, and none of these changes anything. The built-in engine's
# /health_generate runs a 1-token generation, as SGLang's does.
ENGINE_OPEN_PATHS = frozenset({"/health", "/health_generate", "/ready", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AuthError(RuntimeError):
    """The run secret cannot be used (loose permissions, empty file), or a server would bind beyond loopback
    without one."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name, as a server binds it or a URL names it) is this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other name may resolve anywhere


def secret_path(shared: SharedConfig) -> Path:
    return Path(shared.run_dir) / SECRET_FILE


def run_secret(shared: SharedConfig) -> str | None:
    """The run's secret when ``shared.auth`` is "on" (created on first use), else None. Every server and client
    of the run asks here, a future reward server included."""
    if shared.auth != "on":
        return None
    return read_or_create_secret(secret_path(shared))


def read_or_create_secret(path: Path) -> str:
    """The secret in ``path``, written first (0600) when there is none. Processes starting together agree: each
    writes a candidate and hard-links it into place, and only the first link succeeds."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        candidate = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(candidate, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(candidate)
    return _read_secret(path)


def _read_secret(path: Path) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise AuthError(f"{path} has mode {mode:04o}: others may read the run secret; chmod 600 {path}")
    secret = path.read_text().strip()
    if not secret:
        raise AuthError(f"{path} is empty: remove it and a new run secret is generated")
    return secret


def auth_headers(secret: str | None) -> dict[str, str]:
    """The header a client sends (SGLang's convention); none without a secret."""
    return {HEADER: f"Bearer {secret}"} if secret else {}


def same_secret(given: str, secret: str) -> bool:
    """Constant-time comparison: how long a refusal takes says nothing about how much of a guess was right."""
    return hmac.compare_digest(given.encode("utf-8", "replace"), secret.encode("utf-8", "replace"))


def bearer_ok(header: str | None, secret: str) -> bool:
    """Whether an ``Authorization`` header carries ``secret`` as its bearer token."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and same_secret(token, secret)


def derived_token(secret: str, purpose: str) -> str:
    """A token for one use only (the dashboard's cookie), from which the secret cannot be recovered: a leaked
    cookie opens the read-only page, not the engines."""
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).hexdigest()


def check_bind(field: str, host: str, secret: str | None) -> None:
    """Refuse to serve beyond loopback without a secret (the root config refuses it first; this guards a
    server started from code, not from the command line)."""
    if secret is None and not is_loopback(host):
        raise AuthError(
            f"{field} = {host!r} binds beyond loopback without a run secret: set shared.auth = 'on' (or 'auto')"
        )


def unauthorized() -> web.Response:
    """SGLang's answer to a missing or wrong key."""
    return web.json_response({"error": "Unauthorized"}, status=401, headers={"WWW-Authenticate": "Bearer"})


def require_secret(
    secret: str,
    open_paths: Collection[str] = ENGINE_OPEN_PATHS,
    also_ok: Callable[[web.Request], bool] | None = None,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware answering 401 to any request without the secret, before its handler reads the body;
    ``open_paths`` pass (exact paths, so no ``..`` trick reaches another route), and ``also_ok`` may accept
    another proof (the dashboard's cookie)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            request.path in open_paths
            or bearer_ok(request.headers.get(HEADER), secret)
            or (also_ok is not None and also_ok(request))
        ):
            return await handler(request)
        return unauthorized()

    return check
