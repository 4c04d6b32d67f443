"""Weight sync into the real built-in engine: two FSDP2 learner ranks (gloo), two `python -m rollout_fleet.engine`
processes. After a sync the engines' weights are bit-identical to the learner's and their log-probs of a fixed
sequence equal the learner's forward pass; an in-place update in the middle of a request gives that request
two weight_versions spans; an engine that is dead at sync time is quarantined and the other still updated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from broker.server import free_port
from tests.test_weight_sync_e2e import SEQUENCE, _train_step, http_json
from weight_sync.receiver import weights_checksum

pytestmark = pytest.mark.timeout(240)
TIMEOUT_S = 20.0


def start_engine(model_dir: Path, port: int, run_dir: Path) -> subprocess.Popen:
    """A ``streamrl engine`` process; its resolved config goes to ``run_dir`` (the default, runs/default, is
    relative to the working directory: the checkout, under pytest)."""
    cmd = [sys.executable, "-m", "streamrl", "engine", f"--shared.model_path={model_dir}", f"--engine.port={port}",
           f"--engine.control_timeout_s={TIMEOUT_S}", f"--shared.run_dir={run_dir}"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, "engine exited"
        try:
            http_json(url + "/model_info", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    raise AssertionError(f"{url} never answered")


def engine_logprobs(url: str) -> list[float]:
    body = {"input_ids": SEQUENCE, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0}  # fmt: skip
    meta = http_json(url + "/generate", body)["meta_info"]
    return [lp for lp, _, _ in meta["input_token_logprobs"][1:]]


def _learner(
    rank: int, world: int, port: int, model_dir: str, urls: list[str], scenario: str, out: str
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from transformers import AutoModelForCausalLM

    from learner.distributed import full_parameters, init_distributed, shard_model
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender, sync_weights

    info = init_distributed(timeout_s=120, threads=1)
    model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir), info.device)
    _train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), seed=0)
    mode = "in_place" if scenario == "in_place" else "abort"
    cfg = WeightSyncConfig(bucket_mb=0.25, timeout_s=TIMEOUT_S, master_address="127.0.0.1", pause_mode=mode)
    sender = WeightSender(urls, cfg) if rank == 0 else None
    if sender is not None:
        sender.connect()
        if scenario == "in_place":
            Path(out + ".ready").write_text("1")
            while not Path(out + ".go").exists():
                time.sleep(0.05)
    result = sync_weights(model, 1, sender)
    checksum = weights_checksum(full_parameters(model))
    with torch.no_grad():
        ids = torch.tensor([SEQUENCE])
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
        logprobs = logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
    if sender is not None:
        report = {
            "checksum": checksum,
            "logprobs": logprobs,
            "ok": result.engines_ok,
            "failed": {**result.engines_failed, **sender.quarantined},
        }
        Path(out).write_text(json.dumps(report))
        sender.close()
    dist.destroy_process_group()


def run_learners(model_dir: Path, urls: list[str], scenario: str, out: Path) -> threading.Thread:
    import torch.multiprocessing as mp

    def go() -> None:
        mp.start_processes(_learner, args=(2, free_port(), str(model_dir), urls, scenario, str(out)), nprocs=2,
                           start_method="spawn")  # fmt: skip

    thread = threading.Thread(target=go)
    thread.start()
    return thread


@pytest.fixture
def two_engines(tmp_path: Path):
    from rollout_fleet.model import init_tiny_model

    model_dir = init_tiny_model(tmp_path / "tiny")
    ports = [free_port(), free_port()]
    procs = [start_engine(model_dir, p, tmp_path / "run") for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:  # an engine that never answers still leaves no process behind
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        yield model_dir, urls, procs
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)


def test_sync_makes_engines_serve_the_learner_weights(two_engines, tmp_path: Path) -> None:
    model_dir, urls, _ = two_engines
    before = [http_json(u + "/weights_checker", {"action": "checksum"})["checksum"] for u in urls]
    run_learners(model_dir, urls, "abort", tmp_path / "out.json").join(timeout=200)
    report = json.loads((tmp_path / "out.json").read_text())
    assert sorted(report["ok"]) == sorted(urls) and not report["failed"]
    for url, old in zip(urls, before, strict=True):
        now = http_json(url + "/weights_checker", {"action": "checksum"})["checksum"]
        assert now == report["checksum"] != old
        assert http_json(url + "/model_info")["weight_version"] == "1"
        diff = max(abs(a - b) for a, b in zip(engine_logprobs(url), report["logprobs"], strict=True))
        assert diff < 1e-4, diff


def test_in_place_update_mid_request_gives_two_spans(two_engines, tmp_path: Path) -> None:
    model_dir, urls, _ = two_engines
    out = tmp_path / "out.json"
    learners = run_learners(model_dir, urls, "in_place", out)
    deadline = time.monotonic() + 120
    while not Path(str(out) + ".ready").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    answer: dict = {}
    body = {"input_ids": SEQUENCE[:4], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
            "return_logprob": True}  # fmt: skip
    request = threading.Thread(
        target=lambda: answer.update(http_json(urls[0] + "/generate", body, timeout=200))
    )
    request.start()
    time.sleep(0.5)  # the request is decoding when the update starts
    Path(str(out) + ".go").write_text("1")
    learners.join(timeout=200)
    request.join(timeout=200)
    spans = answer["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"], spans
    assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == len(answer["output_ids"]) == 1500
    assert answer["meta_info"]["finish_reason"]["type"] == "length"  # not an abort in disguise


def test_dead_engine_is_quarantined_and_the_other_updated(two_engines, tmp_path: Path) -> None:
    model_dir, urls, procs = two_engines
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait(timeout=10)
    run_learners(model_dir, urls, "abort", tmp_path / "out.json").join(timeout=200)
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["ok"] == [urls[0]] and urls[1] in report["failed"]
    assert http_json(urls[0] + "/weights_checker", {"action": "checksum"})["checksum"] == report["checksum"]
