"""``python -m rollout_fleet.engine`` as a real process: serves, and on SIGTERM answers in-flight requests
(aborted, with their partial output), exits 0 and frees its port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rollout_fleet.model import init_tiny_model

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as err:
        return err.code, None


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"engine exited early with {proc.returncode}"
        try:
            if request(url + "/health", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError("engine never became healthy")


def test_sigterm_answers_in_flight_requests_and_frees_the_port(tmp_path: Path) -> None:
    model = init_tiny_model(tmp_path / "tiny")
    port = free_port()
    cmd = [
        sys.executable, "-m", "streamrl", "engine",
        f"--shared.model_path={model}", "--shared.torch_threads=1", f"--shared.run_dir={tmp_path / 'run'}",
        f"--engine.port={port}", "--engine.max_context_len=4096", "--engine.max_running_requests=4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        status, body = request(
            url + "/generate",
            # ignore_eos: the random tiny model samples its end-of-sequence token first now and then
            {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        )
        assert status == 200 and len(body["output_ids"]) == 3
        answer: dict = {}
        long = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}

        def send_long() -> None:
            answer["status"], answer["body"] = request(url + "/generate", long, 60)

        worker = threading.Thread(target=send_long)
        worker.start()
        deadline = time.monotonic() + 30
        while request(url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        worker.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=10)[0]
    assert answer["status"] == 200, output
    meta = answer["body"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert (
        0 < meta["completion_tokens"] < 4000
        and len(answer["body"]["output_ids"]) == meta["completion_tokens"]
    )
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # nothing listens any more
    with (
        socket.socket() as sock
    ):  # and a restarted engine can bind it (TIME_WAIT sockets aside, as aiohttp does)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
    assert "engine serving" in output
