"""Weight sync end to end, all real: two FSDP2 learner ranks over gloo, two engine processes serving SGLang's
weight-update endpoints over HTTP (benchmarks.mini_engine: a Hugging Face Qwen2 behind a WeightReceiver),
broadcasts over the independent update group.

- After each sync the engines' weights are bit-identical to the learner's, and their log-probs for a fixed
  sequence equal the learner's forward pass; flattened_bucket and per-tensor; one engine has sessions (SGLang
  0.5.23) and the other answers 404 to /begin_weight_update (0.5.10).
- An engine SIGKILLed in the middle of a sync is quarantined, the other gets the whole model, the learner does
  not hang; the dead engine comes back by restart + /update_weights_from_disk of the learner's HF export.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from weight_sync.receiver import weights_checksum

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 15.0
SEQUENCE = list(range(5, 45))  # a fixed token sequence scored by learner and engines


def http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> Any:
    """GET (no body) or POST a JSON body with the standard library; the parsed JSON reply (None when empty)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        text = resp.read()
    return json.loads(text) if text else None


def launch_engine(model_dir: Path, *flags: str, port: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks.mini_engine", "--model-dir", str(model_dir)]
    cmd += ["--port", str(port), "--timeout-s", str(TIMEOUT_S), *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def await_engine(proc: subprocess.Popen) -> str:
    """The engine's URL once it answers /health."""
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"engine did not start: {line!r}")
    url = f"http://127.0.0.1:{int(line.split()[1])}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if http_json(url + "/health", timeout=2) is None:
                return url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"engine at {url} never became healthy")


def engine_view(url: str) -> dict:
    checksum = http_json(url + "/weights_checker", {"action": "checksum"})
    scored = http_json(url + "/score", {"input_ids": SEQUENCE})
    stats = http_json(url + "/stats")
    return {"checksum": checksum["checksum"], "logprobs": scored["logprobs"], "stats": stats}


# ------------------------------------------------------------------------------------- learner processes


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(5, 90, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _observe(model: torch.nn.Module, result, urls: list[str], rank: int) -> dict | None:
    """Learner-side truth (every rank takes part in the gathers and the forward) and what engines serve."""
    from learner.distributed import full_parameters

    checksum = weights_checksum(full_parameters(model))
    with torch.no_grad():
        ids = torch.tensor([SEQUENCE])
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
        logprobs = logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
    if rank != 0:
        return None
    engines = {url: engine_view(url) for url in urls}
    return {"checksum": checksum, "logprobs": logprobs, "result": result.__dict__, "engines": engines}


def _learner(
    rank: int, world: int, port: int, model_dir: str, urls: list[str], scenario: str, out: str
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from transformers import AutoModelForCausalLM

    from learner.checkpoint import export_hf
    from learner.distributed import init_distributed, shard_model
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender, sync_weights

    info = init_distributed(timeout_s=120, threads=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model = shard_model(model, info.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _train_step(model, opt, seed=0)  # the learner's weights now differ from what the engines serve
    cfg = WeightSyncConfig(bucket_mb=0.25, timeout_s=TIMEOUT_S, master_address="127.0.0.1")
    sender = WeightSender(urls, cfg) if rank == 0 else None
    report: dict = {}
    if scenario == "protocol":
        for version, load_format in ((1, "flattened_bucket"), (2, "per_tensor")):
            if sender is not None:
                sender.config = cfg.model_copy(update={"load_format": load_format})
            result = sync_weights(model, version, sender)
            report[str(version)] = _observe(model, result, urls, rank)
            _train_step(model, opt, seed=version)
        # Membership change: the first engine leaves; the group is rebuilt with the second alone.
        if sender is not None:
            report["left"] = sender.set_engines(urls[1:])
        result = sync_weights(model, 3, sender)
        report["3"] = _observe(model, result, urls, rank)
    else:  # "fault": urls[1] SIGKILLs itself on its 3rd update call
        result = sync_weights(model, 1, sender)
        report["1"] = _observe(model, result, urls[:1], rank)
        export = export_hf(model, Path(model_dir), Path(out).parent / "export-v1")
        if rank == 0:
            dead_port = int(urls[1].rsplit(":", 1)[1])
            proc = launch_engine(Path(model_dir), port=dead_port)  # the supervisor's restart
            report["restarted_pid"] = proc.pid
            report["recovered"] = sender.recover(urls[1], str(export), "1", wait_s=90)
            report["after_recovery"] = {url: engine_view(url) for url in urls}
        _train_step(model, opt, seed=1)
        result = sync_weights(model, 2, sender)
        report["2"] = _observe(model, result, urls, rank)
    if sender is not None:
        sender.close()
        Path(out).write_text(json.dumps(report))
    # Both ranks leave together: one CI run lost rank 1 to a SIGABRT ("terminate called without an active
    # exception") after the quarantine, not reproduced in 40 runs beside the suite's load; a rank that tears its
    # group down while the other still uses it is the one teardown race left in this test.
    dist.barrier()
    dist.destroy_process_group()


def run_learners(model_dir: Path, urls: list[str], scenario: str, out: Path) -> dict:
    import torch.multiprocessing as mp

    from broker.server import free_port

    mp.start_processes(
        _learner,
        args=(2, free_port(), str(model_dir), urls, scenario, str(out)),
        nprocs=2,
        start_method="spawn",
    )
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_fleet.model import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("weight-sync") / "tiny")


@pytest.fixture
def engines(request: pytest.FixtureRequest):
    procs: list[subprocess.Popen] = []

    def start(model_dir: Path, *flag_sets: tuple[str, ...]) -> list[str]:
        """Start engines concurrently (one per flag set); their URLs once all answer."""
        launched = [launch_engine(model_dir, *flags) for flags in flag_sets]
        procs.extend(launched)
        return [await_engine(proc) for proc in launched]

    yield start, procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _assert_serves_learner_weights(view: dict, truth: dict) -> None:
    assert view["checksum"] == truth["checksum"]
    diff = max(abs(a - b) for a, b in zip(view["logprobs"], truth["logprobs"], strict=True))
    assert diff < 1e-5, diff


def test_sync_two_learner_ranks_to_two_engines(model_dir: Path, engines, tmp_path: Path) -> None:
    start, _ = engines
    # SGLang 0.5.23 behaviour (update refused outside begin/end) and 0.5.10 (/begin_weight_update is a 404).
    # The second also loads per-tensor updates through load_weights (no in-place receive into the model).
    url_new, url_old = start(model_dir, (), ("--no-sessions", "--no-direct"))
    initial = engine_view(url_new)["checksum"]
    report = run_learners(model_dir, [url_new, url_old], "protocol", tmp_path / "report.json")

    from safetensors.torch import load_file

    model_bytes = sum(t.nbytes for t in load_file(str(model_dir / "model.safetensors")).values())
    for version in ("1", "2"):
        step = report[version]
        result = step["result"]
        assert result["engines_ok"] == [url_new, url_old] and result["engines_failed"] == {}
        assert result["attempts"] == 1 and result["buckets"] > 1  # bucketed: 0.25 MiB buckets, ~3.5 MB model
        assert result["bytes"] == model_bytes
        for url in (url_new, url_old):
            _assert_serves_learner_weights(step["engines"][url], step)
            stats = step["engines"][url]["stats"]
            assert stats["weight_version"] == version and stats["paused"] is None and stats["consistent"]
    assert len({initial, report["1"]["checksum"], report["2"]["checksum"]}) == 3  # each sync changed them

    after = report["3"]  # url_new left the pool: it keeps version 2 and no longer holds the group
    assert report["left"] == {} and after["result"]["engines_ok"] == [url_old]
    _assert_serves_learner_weights(after["engines"][url_old], after)
    assert after["engines"][url_new]["checksum"] == report["2"]["checksum"]
    assert (
        after["engines"][url_new]["stats"]["groups"] == []
        and after["engines"][url_old]["stats"]["groups_joined"] == 2
    )

    new = report["2"]["engines"][url_new]["stats"]
    old = report["2"]["engines"][url_old]["stats"]
    assert new["begins"] == new["ends"] == 2 and not new["session_open"]
    assert old["begins"] == 0 and old["calls"]["/begin_weight_update"] == 1  # asked once, got 404, remembered
    assert "/end_weight_update" not in old["calls"]
    for stats in (new, old):
        assert stats["versions"] == ["1", "2"] and stats["failures"] == 0
        assert stats["calls"]["/pause_generation"] == stats["calls"]["/continue_generation"] == 2
        assert stats["bytes"] == 2 * model_bytes


def test_engine_killed_mid_sync_is_quarantined_and_recovers(model_dir: Path, engines, tmp_path: Path) -> None:
    start, procs = engines
    url_ok, url_dead = start(model_dir, (), ("--kill-at-update", "3"))
    report = run_learners(model_dir, [url_ok, url_dead], "fault", tmp_path / "report.json")
    procs.append(_Pid(report["restarted_pid"]))

    assert procs[1].wait(timeout=10) == -signal.SIGKILL  # it really died, in the middle of the first sync
    first = report["1"]
    result = first["result"]
    assert result["engines_ok"] == [url_ok]
    assert list(result["engines_failed"]) == [url_dead]
    assert result["engines_failed"][url_dead].startswith("transport:")
    assert result["attempts"] == 2  # rebuilt without the dead engine, whole model re-sent to the survivor
    assert result["seconds"] < 2 * TIMEOUT_S  # bounded by the timeout; the learner never hangs
    survivor = first["engines"][url_ok]
    _assert_serves_learner_weights(survivor, first)
    assert survivor["stats"]["consistent"] and not survivor["stats"]["session_open"]
    assert survivor["stats"]["groups_joined"] == 2

    assert report["recovered"] is True
    recovered = report["after_recovery"][url_dead]
    assert recovered["checksum"] == first["checksum"]  # reloaded from the learner's export of version 1
    assert recovered["stats"]["weight_version"] == "1"

    second = report["2"]
    assert second["result"]["engines_ok"] == [url_ok, url_dead] and second["result"]["engines_failed"] == {}
    assert second["result"]["quarantined"] == {}
    for url in (url_ok, url_dead):
        _assert_serves_learner_weights(second["engines"][url], second)


class _Pid:
    """The restarted engine, started inside the learner process: killed by pid at teardown."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        return 0
