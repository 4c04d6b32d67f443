"""The SGLang router (PyPI ``sglang-router``, a Rust binary) in front of the engines, as an option.

With ``rollout.router = "sglang"`` a rollout worker sends its ``/generate`` requests to an sglang-router, which
spreads them over the engines by its own policy (``cache_aware`` by default, ``round_robin``, ``power_of_two``,
``random``). Everything else still goes to each engine directly: the learner's weight updates, pauses and
version labels (``weight_sync.engine_urls``), and the worker's health and version probes (``GET /model_info``)
and its rid aborts, which it sends to every engine (the router does not proxy ``/abort_request``; an engine
ignores a rid it does not hold), as slime does through the router's ``/workers``.

What the router changes, measured against the fleet's own router (docs/rollout.md, benchmarks/router.py):

- A group's samples go one request each: the router's ``/generate`` rejects a batch with a list of rids (HTTP
  422), so ``rollout.batch_group_requests`` does not apply behind it.
- A resubmitted partial rollout is not pinned to the engine that has its prefix cached; the router's policy
  decides (``cache_aware`` usually picks the same engine, by prefix).
- An engine behind the staleness bound is not kept out of routing (the router knows nothing of versions); the
  learner still drops what is older than eta when it consumes it.
- A sample's ``engine_id`` is the router's address, not the engine's.
- A dead engine: the router retries a request that failed to connect on another engine (``--retry-max-retries``)
  and takes the engine out after ``--health-failure-threshold`` failed probes; the worker's own failure handling
  (resubmit from the tokens received so far) covers what reaches it as an error.

``python -m rollout_fleet.sglang_router`` (``streamrl router``, the role ``streamrl up`` starts when
``rollout.router = "sglang"`` and no ``rollout.sglang_router_url`` is given) runs the router for
``rollout.engine_urls`` by ``exec``: the same pid, so a supervisor signals the router itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.auth import auth_headers

if TYPE_CHECKING:
    from rollout_fleet.config import EngineConfig, RolloutConfig

SGLANG_ROUTER_PACKAGE = "sglang-router"
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# The engines' liveness probe: /model_info never runs a forward pass, so a paused engine (a weight update) stays
# in the router's rotation; /health would block and answer 503 then (sglang-api.md section 4).
HEALTH_ENDPOINT = "/model_info"


class SGLangRouterError(RuntimeError):
    """The router cannot be started (package missing) or did not come up with every engine."""


def sglang_router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def router_command(
    engine_urls: Sequence[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    policy: str = "cache_aware",
    health_check_interval_s: int = 5,
    request_timeout_s: float = 3600.0,
    prometheus_port: int | None = None,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
) -> list[str]:
    """``python -m sglang_router.launch_router`` for ``engine_urls`` on ``host:port``; its Prometheus endpoint
    on ``prometheus_port`` (a free port when None: the router's fixed default, 29000, allows one router a
    host). ``api_key``: the run secret, which the router sends to the engines and requires
    of its own clients (401 without it: measured with sglang-router 0.3.2)."""
    if policy not in POLICIES:
        raise SGLangRouterError(f"sglang router policy {policy!r}: must be one of {POLICIES}")
    if not engine_urls:
        raise SGLangRouterError("an sglang router needs at least one engine URL")
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", host,
        "--port", str(port),
        "--worker-urls", *engine_urls,
        "--policy", policy,
        "--health-check-endpoint", HEALTH_ENDPOINT,
        "--health-check-interval-secs", str(max(1, int(health_check_interval_s))),
        "--request-timeout-secs", str(max(1, int(request_timeout_s))),
        "--log-level", "warn",
        "--prometheus-host", host,
        "--prometheus-port", str(prometheus_port or _free_port(host)),
        *(["--api-key", api_key] if api_key else []),
        *extra_args,
    ]  # fmt: skip


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _get_json(url: str, timeout_s: float, api_key: str | None = None) -> object:
    request = urllib.request.Request(url, headers=auth_headers(api_key))
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"null")


def healthy_workers(router_url: str, timeout_s: float = 2.0, api_key: str | None = None) -> list[str]:
    """URLs of the engines the router has registered and counts healthy (its ``GET /workers``). A router
    started with ``--api-key`` requires that key of its own clients too (401 without it)."""
    body = _get_json(router_url.rstrip("/") + "/workers", timeout_s, api_key)
    workers = body.get("workers", []) if isinstance(body, dict) else []
    return [str(w["url"]) for w in workers if isinstance(w, dict) and w.get("is_healthy")]


def wait_until_ready(
    router_url: str,
    engines: int,
    timeout_s: float,
    process: subprocess.Popen | None = None,
    poll_s: float = 0.25,
    api_key: str | None = None,
) -> None:
    """Until the router answers and counts ``engines`` engines healthy; SGLangRouterError after ``timeout_s`` or
    when ``process`` exited."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while True:
        if process is not None and process.poll() is not None:
            raise SGLangRouterError(f"the sglang router exited with code {process.returncode}")
        with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
            seen = healthy_workers(router_url, api_key=api_key)
            if len(seen) >= engines:
                return
        if time.monotonic() >= deadline:
            raise SGLangRouterError(
                f"the sglang router at {router_url} has {len(seen)} of {engines} engines healthy after "
                f"{timeout_s} s: {seen}"
            )
        time.sleep(poll_s)


@contextlib.contextmanager
def running_router(
    engine_urls: Sequence[str],
    port: int,
    *,
    log_path: Path | None = None,
    ready_timeout_s: float = 120.0,
    **options: object,
) -> Iterator[str]:
    """A router process for ``engine_urls`` (tests, benchmarks); yields its URL once every engine is healthy
    in it, and stops it (SIGTERM, then SIGKILL) on exit."""
    if not sglang_router_available():
        raise SGLangRouterError(f"the sglang router is not installed: pip install {SGLANG_ROUTER_PACKAGE}")
    host = str(options.pop("host", "127.0.0.1"))
    cmd = router_command(engine_urls, port, host=host, **options)  # type: ignore[arg-type]
    out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://{host}:{port}"
    try:
        key = options.get("api_key")
        wait_until_ready(url, len(engine_urls), ready_timeout_s, proc, api_key=str(key) if key else None)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log_path is not None:
            out.close()  # type: ignore[union-attr]


def exec_router(
    engine_urls: Sequence[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    policy: str = "cache_aware",
    health_check_interval_s: int = 5,
    request_timeout_s: float = 3600.0,
    api_key: str | None = None,
) -> int:
    """Become the router (``exec``); returns 2 with a message when the package is missing."""
    if not sglang_router_available():
        print(
            f"streamrl router: the sglang router is not installed here: pip install {SGLANG_ROUTER_PACKAGE} "
            "(or use rollout.router = 'fleet')",
            file=sys.stderr,
        )
        return 2
    cmd = router_command(
        engine_urls,
        port,
        host=host,
        policy=policy,
        health_check_interval_s=health_check_interval_s,
        request_timeout_s=request_timeout_s,
        api_key=api_key,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


def router_port(rollout: RolloutConfig) -> int:
    """The port of the router: ``rollout.sglang_router_port``, else the port of ``rollout.sglang_router_url``."""
    if rollout.sglang_router_port:
        return rollout.sglang_router_port
    if rollout.sglang_router_url and rollout.sglang_router_url.rstrip("/").rsplit(":", 1)[-1].isdigit():
        return int(rollout.sglang_router_url.rstrip("/").rsplit(":", 1)[-1])
    raise SGLangRouterError("no port for the sglang router: set rollout.sglang_router_port")


def router_endpoint(engine: EngineConfig, rollout: RolloutConfig, api_key: str | None = None) -> int:
    """``streamrl router``: exec the router for ``rollout.engine_urls`` (else engine.count engines at
    engine.host:base_port+i) on ``engine.host:router_port``, sending ``api_key`` (the run secret) to them."""
    urls = list(rollout.engine_urls) or [
        f"http://{engine.host}:{engine.base_port + i}" for i in range(engine.count)
    ]
    return exec_router(
        urls,
        router_port(rollout),
        host=engine.host,
        policy=rollout.sglang_router_policy,
        health_check_interval_s=max(1, int(rollout.health_interval_s)),
        request_timeout_s=rollout.request_timeout_s,
        api_key=api_key,
    )
