"""The same fleet and worker code against a real SGLang server on a GPU (needs the ``streamrl[sglang]`` extra):
launch with the tiny model, readiness, registry entry with its ranks, and one epoch of valid records whose
tokens carry version 0 (SGLang starts labelled "default", which the client reads as version 0). Deselected in CI (``gpu``)."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import pytest

from broker.client import connect
from broker.config import BrokerConfig
from broker.registry import EngineRegistry
from common.config import SharedConfig
from rollout_fleet.config import EngineConfig
from rollout_fleet.fleet import Fleet
from rollout_fleet.model import init_tiny_model
from rollout_fleet.tasks.config import task_config
from tests.test_rollout_worker import configs, read_records, run_worker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
BROKER = BrokerConfig()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_worker_through_a_launched_sglang_server(redis_url: str, tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "tiny")
    shared = SharedConfig(run_id="sgl", model_path=model_dir, run_dir=tmp_path / "run", http_timeout_s=30.0)
    engine = EngineConfig(
        kind="sglang",
        count=1,
        mem_fraction_static=0.2,
        max_context_len=512,
        launch_timeout_s=600.0,
        extra_args=["--disable-cuda-graph"],
    )
    client = connect(redis_url, BROKER)
    registry = EngineRegistry(client, shared)
    fleet = Fleet(shared, engine, registry, ports=[free_port()])
    try:
        (url,) = await fleet.start()
        (entry,) = await registry.list()
        assert (entry.url, entry.health, entry.ranks, entry.kind) == (url, "healthy", 1, "sglang")
        _, engine_cfg, rollout = configs(
            model_dir, [url], run_id="sgl", group_size=4, task=task_config(name="arithmetic", train_size=8)
        )
        stats = await run_worker(redis_url, shared, engine_cfg, rollout)
    finally:
        await fleet.stop()
        await client.aclose()
    assert stats.finished and stats.groups_produced == 8
    records = await read_records(redis_url, shared)
    assert Counter(g.prompt_index for g in records) == Counter(range(8))
    for g in records:
        for s in g.samples:
            assert s.num_tokens() >= 1 and (s.versions == 0).all() and s.reward_status == "ok"
            assert s.logprobs.max() <= 1e-3


def test_streamrl_engine_of_kind_sglang_serves_and_stops(tmp_path: Path) -> None:
    """`streamrl engine --engine.kind=sglang` (what `streamrl up` starts for each engine) becomes a real SGLang
    server: it answers /model_info with SGLang's initial label, and exits on SIGTERM."""
    import json
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    model_dir = init_tiny_model(tmp_path / "tiny")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamrl",
            "engine",
            "--engine.kind=sglang",
            f"--shared.model_path={model_dir}",
            f"--shared.run_dir={tmp_path / 'run'}",
            f"--engine.port={port}",
            "--engine.mem_fraction_static=0.2",
            '--engine.extra_args=["--disable-cuda-graph"]',
        ],  # fmt: skip
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/model_info", timeout=5) as resp:
                    info = json.loads(resp.read())
                break
            except OSError:
                time.sleep(1)
        assert info["weight_version"] == "default"  # read as policy version 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
