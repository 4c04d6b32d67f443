"""The fleet with real engine processes (``python -m rollout_fleet.engine``): launch and readiness, an engine
SIGKILLed while a worker runs (the worker carries on with the other, no group is lost, the fleet restarts the
dead engine and the registry follows), a launch that fails, and SGLang's command line and missing extra."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from broker.client import connect
from broker.config import BrokerConfig
from broker.registry import EngineRegistry
from common.auth import run_secret
from common.config import SharedConfig
from rollout_fleet import fleet as fleet_module
from rollout_fleet.config import EngineConfig
from rollout_fleet.engine.main import engine_seed
from rollout_fleet.fleet import Fleet, FleetError, engine_command
from rollout_fleet.main import open_worker
from rollout_fleet.model import init_tiny_model
from rollout_fleet.tasks.config import task_config
from tests.test_rollout_worker import configs, read_drops, read_records

pytestmark = pytest.mark.timeout(180)
BROKER = BrokerConfig()
PROMPTS = 16


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def engine_config(**kw: object) -> EngineConfig:
    options = {
        "count": 2,
        "max_running_requests": 16,
        "max_context_len": 256,
        "launch_timeout_s": 120.0,
        "max_restarts": 1,
        "shutdown_timeout_s": 5.0,
        "health_check_timeout_s": 10.0,
        **kw,
    }
    return EngineConfig(**options)


async def test_a_killed_engine_is_routed_around_and_restarted_and_no_group_is_lost(
    redis_url: str, tmp_path: Path
) -> None:
    model_dir = init_tiny_model(tmp_path / "tiny")
    shared = SharedConfig(run_id="fleet", model_path=model_dir, run_dir=tmp_path / "run", http_timeout_s=10.0)
    engine = engine_config()
    client = connect(redis_url, BROKER)
    registry = EngineRegistry(client, shared)
    fleet = Fleet(shared, engine, registry, ports=free_ports(2), poll_s=0.2)
    stop_supervising = asyncio.Event()
    try:
        urls = await fleet.start()
        entries = await registry.list()
        assert [(e.url, e.health, e.ranks, e.kind, e.source) for e in entries] == [
            (u, "healthy", 1, "builtin", "fleet") for u in sorted(urls, key=lambda u: u.split("//")[1])
        ]
        first_pid = fleet.engines[0].pid
        supervisor = asyncio.create_task(fleet.supervise(stop_supervising))

        _, engine_cfg, rollout = configs(
            model_dir,
            [],  # the registry the fleet wrote is the source of engines
            run_id="fleet",
            group_size=2,
            max_new_tokens=48,
            max_concurrent_groups=4,
            task=task_config(name="arithmetic", train_size=PROMPTS),
        )
        async with open_worker(shared, BROKER, engine_cfg, rollout, 100, redis_url) as worker:
            assert sorted(worker.router.urls()) == sorted(urls)
            run = asyncio.create_task(worker.run(asyncio.Event()))
            victim = worker.router.engines[fleet.engines[0].engine_id]
            for _ in range(1200):  # kill engine 0 while it serves requests, after some groups were produced
                produced = await client.xlen(shared.key(BROKER.stream))
                if produced >= 2 and victim.outstanding > 0 and not run.done():
                    break
                await asyncio.sleep(0.02)
            assert victim.outstanding > 0, "engine 0 was never busy"
            fleet.kill(0)
            stats = await asyncio.wait_for(run, 120)
        assert stats.finished and stats.engine_failures >= 1 and victim.failures >= 1
        # every first request goes in a group's batch: the kill failed at least one, whose samples then
        # went one by one to the other engine
        assert stats.batch_requests >= PROMPTS and stats.batch_fallbacks >= 1

        # The fleet relaunched engine 0 and the registry says so.
        for _ in range(600):
            entry = await registry.get(fleet.engines[0].engine_id)
            if entry.health == "healthy" and entry.pid != first_pid:
                break
            await asyncio.sleep(0.1)
        assert entry.health == "healthy" and entry.pid == fleet.engines[0].pid != first_pid
        assert fleet.engines[0].restarts == 1
        stop_supervising.set()
        await supervisor
    finally:
        stop_supervising.set()
        await fleet.stop()
        assert await registry.list() == []
        await client.aclose()

    records = await read_records(redis_url, shared)
    assert await read_drops(redis_url, shared) == []
    assert Counter(g.prompt_index for g in records) == Counter(range(PROMPTS))
    assert all(s.num_tokens() > 0 for g in records for s in g.samples)


async def test_an_engine_that_cannot_start_fails_the_launch_with_its_log(tmp_path: Path) -> None:
    shared = SharedConfig(model_path=tmp_path / "missing-model", run_dir=tmp_path / "run")
    fleet = Fleet(shared, engine_config(count=1), ports=free_ports(1))
    with pytest.raises(
        FleetError, match=r"exited with code 2 before it was healthy(.|\n)*cannot start the engine"
    ):
        await fleet.start()
    assert not fleet.engines[0].alive()


def test_sglang_command_line_and_the_missing_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = SharedConfig(model_path=tmp_path / "m")
    engine = engine_config(
        kind="sglang", tp_size=2, mem_fraction_static=0.7, extra_args=["--log-level", "warning"]
    )
    monkeypatch.setattr(fleet_module, "sglang_available", lambda: True)
    cmd = engine_command(shared, engine, 30007)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    pairs = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert pairs["--model-path"] == str(tmp_path / "m") and pairs["--port"] == "30007"
    assert (pairs["--tp-size"], pairs["--mem-fraction-static"]) == ("2", "0.7")
    assert pairs["--base-gpu-id"] == "0"  # the device plan gives each engine only its own GPUs
    # SGLang 0.5.23's launch_server has no --weight-version: it starts at "default", which reads as version 0
    assert "--weight-version" not in cmd
    assert cmd[-2:] == ["--log-level", "warning"]
    assert "--api-key" not in cmd  # a loopback run: no run secret
    # With the run secret: SGLang's --api-key (its HTTP server then wants it as a bearer token), and the flags a
    # user adds still come last.
    secured = shared.model_copy(update={"auth": "on", "run_dir": tmp_path / "run"})
    cmd = engine_command(secured, engine, 30007)
    assert cmd[-4:] == ["--api-key", run_secret(secured), "--log-level", "warning"]
    assert fleet_module.engine_ranks(engine) == 2
    monkeypatch.setattr(fleet_module, "sglang_available", lambda: False)
    with pytest.raises(FleetError, match=r"pip install 'streamrl\[sglang\]'"):
        engine_command(shared, engine, 30007)
    with pytest.raises(ValidationError, match="kind"):  # an unknown kind is refused with the config
        engine_config(kind="vllm")


def test_builtin_command_passes_the_engine_section_through(tmp_path: Path) -> None:
    shared = SharedConfig(model_path=tmp_path / "m", torch_threads=1)
    cmd = engine_command(shared, engine_config(max_running_requests=5, extra_args=[]), 31000)
    assert cmd[1:4] == ["-m", "streamrl", "engine"]
    assert "--engine.port=31000" in cmd and "--engine.max_running_requests=5" in cmd
    assert f'--shared.model_path="{tmp_path / "m"}"' in cmd and '--engine.kind="builtin"' in cmd
    assert "--shared.auth=auto" in cmd  # the child resolves it as the fleet's config did


async def test_engines_of_a_fleet_never_share_a_sampling_seed(redis_url: str, tmp_path: Path) -> None:
    """Two engines with one seed return identical samples for the same batch: a GRPO group split across them
    would hold duplicates (measured: 4 of 4 identical before the fix). A real fleet on the default (a random seed
    per engine process); a configured seed becomes seed + index on each engine's command line."""
    import aiohttp

    from rollout_fleet.generate_client import EngineClient, SamplingConfig, build_generate_request

    model_dir = init_tiny_model(tmp_path / "tiny")
    shared = SharedConfig(run_id="seeds", model_path=model_dir, run_dir=tmp_path / "run", http_timeout_s=10.0)
    registry = EngineRegistry(connect(redis_url, BROKER), shared)
    fleet = Fleet(shared, engine_config(seed=None), registry, ports=free_ports(2), poll_s=0.2)
    try:
        urls = await fleet.start()
        async with aiohttp.ClientSession() as session:
            clients = [EngineClient(session, u, 60, 10) for u in urls]
            requests = [build_generate_request([5, 6, 7], SamplingConfig(), 24, f"r{k}") for k in range(4)]
            answers = await asyncio.gather(
                *(asyncio.gather(*(c.generate(r) for r in requests)) for c in clients)
            )
    finally:
        await fleet.stop()
    same = sum(a.output_ids == b.output_ids for a, b in zip(*answers, strict=True))
    assert same == 0, f"{same} of 4 samples identical across engines"
    commands = [engine_command(shared, engine_config(seed=7), 30000 + i, index=i) for i in range(2)]
    assert "--engine.seed=7" in commands[0] and "--engine.seed=8" in commands[1]
    assert engine_seed(7) == 7 and engine_seed(None) != engine_seed(
        None
    )  # a random draw of 31 bits each time


# A stand-in for SGLang's launcher, put first on PYTHONPATH: it records the command line it was started with and
# its pid. SGLang cannot run without a GPU; this checks the wiring (`streamrl engine` becomes SGLang's own
# server process, with the fleet's arguments). The real server runs in tests/test_fleet_sglang.py (gpu).
STAND_IN = """
import json, os, sys
from pathlib import Path
Path(os.environ["SGLANG_STAND_IN_OUT"]).write_text(json.dumps({"argv": sys.argv[1:], "pid": os.getpid()}))
"""


def test_streamrl_engine_of_kind_sglang_becomes_sglangs_server(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    model = init_tiny_model(tmp_path / "tiny")
    args = [sys.executable, "-m", "streamrl", "engine", "--engine.kind=sglang", f"--shared.model_path={model}",
            "--engine.port=30123", "--engine.tp_size=2", '--engine.extra_args=["--disable-cuda-graph"]',
            f"--shared.run_dir={tmp_path / 'run'}"]  # fmt: skip
    missing = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert "pip install 'streamrl[sglang]'" in missing.stderr + missing.stdout

    fake = tmp_path / "stand-in" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(STAND_IN)
    out = tmp_path / "launched.json"
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}:{os.environ.get('PYTHONPATH', '')}",
           "SGLANG_STAND_IN_OUT": str(out)}  # fmt: skip
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.wait(timeout=60) == 0, proc.stdout.read() if proc.stdout else ""
    launched = json.loads(out.read_text())
    assert launched["pid"] == proc.pid  # exec: the supervisor watches and signals SGLang itself
    argv = launched["argv"]
    pairs = dict(zip(argv[0::2], argv[1::2], strict=False))
    assert pairs["--model-path"] == str(model) and pairs["--port"] == "30123" and pairs["--tp-size"] == "2"
    assert argv[-1] == "--disable-cuda-graph"


def test_up_with_kind_sglang_and_no_sglang_stops_at_once_naming_the_extra(tmp_path: Path) -> None:
    import subprocess
    import sys

    model = init_tiny_model(tmp_path / "tiny")
    args = [sys.executable, "-m", "streamrl", "up", "--engine.kind=sglang", f"--shared.model_path={model}",
            f"--shared.run_dir={tmp_path / 'run'}", "--dashboard.port=0", "--dashboard.metrics_base_port=0"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "engine-0" in done.stderr and "streamrl[sglang]" in done.stderr
    assert "restarting" not in done.stdout  # a configuration error: restarting cannot help
