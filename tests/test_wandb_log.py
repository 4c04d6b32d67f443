"""The run's one wandb run, written by the dashboard from a real Redis in offline mode: the files wandb writes
hold every held-out evaluation with the version it is of, every learner step, the newest rollout point, the
config and device plan; a restarted dashboard resumes the same run and logs no point twice."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from broker.config import BrokerConfig
from broker.metrics import MetricsWriter
from common.config import SharedConfig
from common.wandb_run import run_id_of
from streamrl.config import DashboardConfig
from streamrl.dashboard import DashboardState, log_to_wandb, wandb_forever
from streamrl.wandb_log import open_logger
from tests.wandb_records import config, history, run_record

pytestmark = pytest.mark.timeout(120)
EVALS = [(0, 0.485), (2, 0.6), (5, 0.705)]  # (policy version, held-out greedy accuracy)


async def write(url: str, shared: SharedConfig, role: str, points: list[dict[str, float]]) -> None:
    client = aioredis.Redis.from_url(url)
    writer = MetricsWriter(client, shared, role)
    for point in points:
        await writer.write(point)
    await client.aclose()


def wait_for_rows(path: Path, timeout_s: float = 30.0) -> list[dict]:
    """The log's rows once its last record, the archive's artifact (logged at finish, after every row), is in:
    wandb's service process writes the last records after finish() returns."""
    deadline = time.monotonic() + timeout_s
    while b"part-000000.parquet" not in path.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    return history(path)


def test_the_dashboard_logs_the_run_with_its_evaluations_to_one_wandb_run(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    shared = SharedConfig(run_id="wb", redis_url=redis_url, run_dir=run_dir)
    devices = {"mode": "disaggregated", "learner": ["0", "1"], "engines": [["2"], ["3"]]}
    archive = run_dir / "archive"  # a part the archiver wrote: the run's artifact when the dashboard stops
    archive.mkdir(parents=True)
    (archive / "part-000000.parquet").write_bytes(b"PAR1 rows PAR1")

    async def dashboard(final_evals: list[tuple[int, float]]) -> None:
        client = aioredis.Redis.from_url(redis_url)
        state = DashboardState(client, shared, DashboardConfig(), BrokerConfig())
        logger = await asyncio.to_thread(open_logger, shared, "offline", {"eta": 1}, devices, archive)
        await log_to_wandb(state, logger)
        # up's final evaluation is written just before the dashboard is stopped: the last poll logs it
        await write(
            redis_url, shared, "eval", [{"policy_version": v, "greedy_accuracy": a} for v, a in final_evals]
        )
        stop = asyncio.Event()
        stop.set()
        await wandb_forever(state, logger, 60.0, stop)
        await client.aclose()

    async def first_run() -> None:
        await write(redis_url, shared, "learner", [{"step": s, "staleness/mean": s / 10} for s in (1, 2, 3)])
        await write(redis_url, shared, "rollout-0", [{"tokens_per_s": 100.0}, {"tokens_per_s": 120.0}])
        await write(
            redis_url, shared, "eval", [{"policy_version": v, "greedy_accuracy": a} for v, a in EVALS[:2]]
        )
        await dashboard(EVALS[2:])

    asyncio.run(first_run())
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wait_for_rows(log)
    evals = [
        (r["eval/policy_version"], r["eval/greedy_accuracy"]) for r in rows if "eval/policy_version" in r
    ]
    assert evals == EVALS  # each held-out evaluation with the version it is of
    assert [r["learner/step"] for r in rows if "learner/step" in r] == [1, 2, 3]
    assert [r["learner/staleness/mean"] for r in rows if "learner/step" in r] == [0.1, 0.2, 0.3]
    assert [r["rollout-0/tokens_per_s"] for r in rows if "rollout-0/tokens_per_s" in r] == [
        120.0
    ]  # the newest
    run = run_record(log)
    assert run.run_id == run_id_of(run_dir) and run.project == "streamrl"
    assert config(log)["devices"] == devices and config(log)["streamrl"] == {"eta": 1}  # the device plan
    assert (
        b"wb-trajectories" in log.read_bytes() and b"part-000000.parquet" in log.read_bytes()
    )  # the archive

    # a restarted dashboard (or `up --resume`) opens the same run and logs only what is new
    asyncio.run(dashboard([(7, 0.71)]))
    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    (resumed,) = [p for p in logs if p != log]
    rows = wait_for_rows(resumed)
    assert len(logs) == 2 and {run_record(p).run_id for p in logs} == {run_id_of(run_dir)}
    assert [r["eval/policy_version"] for r in rows if "eval/policy_version" in r] == [7]
    assert not any("learner/step" in r for r in rows)
