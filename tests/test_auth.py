"""Authenticated endpoints beyond loopback (issue 38): the run secret of common.auth.

A real ``streamrl engine`` process bound to 0.0.0.0 (``shared.auth = "auto"`` turns the secret on) answers 401
on every endpoint but its probes without the key or with a wrong one, and such a request changes nothing (the
weight version, memory state and request counters read back with the key); with the key it works. The
dashboard answers 401 without the key, 200 with it (bearer header, or the cookie a ``?token=`` visit sets). The
config refuses a bind beyond loopback with ``shared.auth = "off"``, naming the fields, in a real process too;
the secret file is 0600, created once by racing processes, and kept by a resume.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from broker.config import BrokerConfig
from common.auth import (
    ENGINE_OPEN_PATHS,
    SECRET_FILE,
    AuthError,
    auth_headers,
    read_or_create_secret,
    run_secret,
)
from common.config import SharedConfig
from common.configlib import ConfigError
from rollout_fleet.engine.server import EngineServer, ServerSettings
from rollout_fleet.engine.weights import weight_sync_extension
from rollout_fleet.model import init_tiny_model
from streamrl.config import DashboardConfig, load
from streamrl.dashboard import start_dashboard
from weight_sync import protocol
from weight_sync.buckets import TensorMeta

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def call(url: str, method: str = "GET", body: Any = None, key: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **auth_headers(key)}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def engine_routes() -> list[tuple[str, str]]:
    """Every (method, path) the built-in engine serves, read from its own app with the weight extension: an
    endpoint added later is checked without this test naming it."""

    class Stand:  # what the extension reads of an engine when it adds its routes
        model = torch.nn.Linear(2, 2)
        weight_version = "0"

    app = EngineServer(Stand(), ServerSettings()).make_app([weight_sync_extension()])  # type: ignore[arg-type]
    routes = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method != "HEAD":
            routes.add(("POST" if route.method == "*" else route.method, path))
    return sorted(routes)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """A real engine process bound beyond loopback, auth left at "auto": (url, model dir, run dir)."""
    tmp = tmp_path_factory.mktemp("auth")
    model, run, port = init_tiny_model(tmp / "tiny"), tmp / "run", free_port()
    cmd = [
        sys.executable, "-m", "streamrl", "engine", f"--shared.model_path={model}", "--shared.torch_threads=1",
        f"--shared.run_dir={run}", "--engine.host=0.0.0.0", f"--engine.port={port}",
        "--engine.max_context_len=256", "--engine.max_running_requests=2",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    try:
        while True:  # /health is open, as on SGLang: a supervisor's probe carries no secret
            assert proc.poll() is None, "".join(output)
            assert time.monotonic() < deadline, "".join(output)
            try:
                if call(url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        yield url, model, run
    finally:
        proc.terminate()
        proc.wait(30)


def secret_of(run: Path) -> str:
    return (run / SECRET_FILE).read_text().strip()


def test_the_engine_wrote_a_0600_secret_and_leaves_only_its_probes_open(
    engine: tuple[str, Path, Path],
) -> None:
    url, _, run = engine
    assert stat.S_IMODE((run / SECRET_FILE).stat().st_mode) == 0o600
    key = secret_of(run)
    routes = engine_routes()
    assert ("POST", protocol.UPDATE_DISTRIBUTED) in routes and ("POST", protocol.LOAD_LORA) in routes
    refused = {}
    for method, path in routes:
        body = {} if method == "POST" else None
        answers = [call(url + path, method, body, k) for k in (None, "wrong", key[:-1], key + "x")]
        if path in ENGINE_OPEN_PATHS:
            assert answers[0][0] == 200, (path, answers[0])
        else:
            refused[path] = {status for status, _ in answers}
            assert answers[0][1] == {"error": "Unauthorized"}, (path, answers[0])
    assert set(refused) and all(statuses == {401} for statuses in refused.values()), refused
    assert call(url + "/model_info", key=key)[0] == 200


def state(url: str, key: str) -> dict[str, Any]:
    status, info = call(url + "/server_info", key=key)
    assert status == 200, info
    stats = info["internal_states"][0]
    return {"version": info["weight_version"], "released": info["memory_released"], "stats": stats}


def test_a_request_without_the_key_changes_nothing_and_with_it_works(engine: tuple[str, Path, Path]) -> None:
    url, model, run = engine
    key = secret_of(run)
    generate = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    metas = [TensorMeta("lm_head.weight", torch.float32, (4, 4))]
    changes = [
        ("/generate", generate),
        (protocol.UPDATE_FROM_DISK, protocol.update_from_disk_body(str(model), "7")),
        (protocol.UPDATE_WEIGHT_VERSION, protocol.update_weight_version_body("8")),
        (protocol.UPDATE_DISTRIBUTED, protocol.update_distributed_body(metas, weight_version="9")),
        (protocol.LOAD_LORA, protocol.load_lora_body("intruder", str(model))),
        (protocol.RELEASE_MEMORY, protocol.memory_body(None)),
    ]
    before = state(url, key)
    for wrong in (None, "not-the-key"):
        for path, body in changes:
            assert call(url + path, "POST", body, wrong) == (401, {"error": "Unauthorized"}), path
    assert before["released"] == []  # the tags released: none
    assert state(url, key) == before
    status, reply = call(url + protocol.UNLOAD_LORA, "POST", protocol.unload_lora_body("intruder"), key)
    assert status == 400 and reply["loaded_adapters"] == {}  # never loaded
    # With the key the same calls do what they say.
    status, out = call(url + "/generate", "POST", generate, key)
    assert status == 200 and len(out["output_ids"]) == 2
    assert call(url + protocol.UPDATE_FROM_DISK, "POST", changes[1][1], key)[0] == 200
    assert state(url, key)["version"] == "7"
    assert call(url + protocol.RELEASE_MEMORY, "POST", protocol.memory_body(None), key) == (200, None)
    assert state(url, key)["released"]  # every tag
    assert call(url + protocol.RESUME_MEMORY, "POST", protocol.memory_body(None), key) == (200, None)


async def test_the_dashboard_needs_the_key_or_its_cookie(redis_url: str, tmp_path: Path) -> None:
    open_dashboard = DashboardConfig(host="0.0.0.0")
    with pytest.raises(AuthError, match="dashboard.host = '0.0.0.0' binds beyond loopback"):
        await start_dashboard(
            redis_url, SharedConfig(run_dir=tmp_path), open_dashboard, BrokerConfig(), port=0
        )
    shared = SharedConfig(run_id="auth", run_dir=tmp_path, auth="on")
    key = run_secret(shared)
    assert key is not None
    running = await start_dashboard(redis_url, shared, DashboardConfig(refresh_s=5), BrokerConfig(), port=0)
    jar = aiohttp.CookieJar(unsafe=True)  # unsafe: keep cookies of an IP address such as 127.0.0.1
    try:
        async with aiohttp.ClientSession(cookie_jar=jar) as http:

            async def get(path: str, **kw: Any) -> aiohttp.ClientResponse:
                async with http.get(running.url + path, allow_redirects=False, **kw) as resp:
                    await resp.read()
                    return resp

            for path in ("/", "/api/summary", "/api/series?role=learner", "/static/dashboard.js"):
                assert (await get(path)).status == 401, path
                assert (await get(path, headers=auth_headers("wrong"))).status == 401, path
            assert (await get("/metrics")).status == 200  # a Prometheus scrape, as SGLang leaves /metrics
            assert (await get("/api/summary", headers=auth_headers(key))).status == 200
            assert (await get("/?token=wrong")).status == 401 and not jar.filter_cookies(running.url)
            login = await get("/?token=" + key)
            assert login.status == 303 and login.headers["Location"] == "/"
            cookie = login.cookies[f"streamrl_dashboard_{running.port}"]
            assert cookie["httponly"] and cookie["samesite"] == "Strict" and key not in cookie.value
            assert (await get("/")).status == 200 and (await get("/api/summary")).status == 200
            jar.clear()
            forged = {"Cookie": f"streamrl_dashboard_{running.port}={key}"}  # the secret is not the token
            assert (await get("/api/summary", headers=forged)).status == 401
    finally:
        await running.stop()


def test_a_bind_beyond_loopback_with_auth_off_is_refused_naming_the_fields() -> None:
    with pytest.raises(ConfigError) as refused:
        load(["--engine.host=0.0.0.0", "--dashboard.host=10.1.2.3", "--shared.auth=off"])
    for named in ("shared.auth = 'off'", "engine.host = '0.0.0.0'", "dashboard.host = '10.1.2.3'"):
        assert named in str(refused.value)
    with pytest.raises(ConfigError, match=r"rollout.engine_urls = \['http://10.0.0.5:30000'\]"):
        load(['--rollout.engine_urls=["http://10.0.0.5:30000"]', "--shared.auth=off"])
    assert load(["--engine.host=0.0.0.0"]).shared.auth == "on"  # auto: on beyond loopback
    assert load(['--weight_sync.engine_urls=["http://node-3:30000"]']).shared.auth == "on"
    assert load([]).shared.auth == "auto" and load(["--engine.host=::1"]).shared.auth == "auto"
    # The Ray launcher checks again once it has put the engines on node addresses (resolve_auth).
    placed = load([])
    placed.rollout.engine_urls = ["http://10.0.0.5:30000"]
    placed.resolve_auth()
    assert placed.shared.auth == "on"
    placed = load(["--shared.auth=off"])
    placed.weight_sync.engine_urls = ["http://10.0.0.5:30000"]
    with pytest.raises(ValueError, match=r"shared.auth = 'off' with weight_sync.engine_urls"):
        placed.resolve_auth()
    # ...and at a role's start, in its own process, before anything is loaded or bound.
    cmd = [sys.executable, "-m", "streamrl", "engine", "--engine.host=0.0.0.0", "--shared.auth=off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "shared.auth = 'off' with engine.host = '0.0.0.0'" in proc.stderr


def test_the_secret_is_created_once_0600_refused_when_loose_and_kept_on_resume(tmp_path: Path) -> None:
    from streamrl.up import child_specs, resolve, write_config

    path = tmp_path / "race" / SECRET_FILE
    # Processes starting together agree on one secret (the first hard link wins).
    code = "import sys, pathlib, common.auth as a; print(a.read_or_create_secret(pathlib.Path(sys.argv[1])))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]  # fmt: skip
    seen = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert seen == {read_or_create_secret(path)} and len(seen.pop()) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and os.listdir(path.parent) == [SECRET_FILE]
    path.chmod(0o644)
    with pytest.raises(AuthError, match="mode 0644"):
        read_or_create_secret(path)
    # up: auto turns on for engines beyond loopback, the secret exists before any role starts, and a resume
    # (the run's config.toml read back) has the same one.
    run = tmp_path / "run"
    cfg = resolve(load([f"--shared.run_dir={run}", "--engine.host=0.0.0.0", "--shared.model_path=/m"]))
    write_config(cfg)
    child_specs(cfg, run / "config.toml")
    first = secret_of(run)
    resumed = load(["--config", str(run / "config.toml"), f"--shared.run_dir={run}"])
    assert resumed.shared.auth == "on" and run_secret(resumed.shared) == first
