"""The chaos suite: ``kill -9`` of each process of ``streamrl up`` in the middle of a run, then the records say
what it cost.

Each run trains the warm-started tiny model for ``STEPS`` steps (eta 1, a checkpoint every 5 steps) and is
killed at learner step ``KILL_AT`` (between two checkpoints, so a learner crash rolls back). The supervisor
restarts what died; a run that stopped (its supervisor was the one killed) is resumed with ``up --resume``. Then,
from the run's records (``streamrl audit`` over the durable per-group outcomes, and summary.json):

- every generated group is trained, dropped with a reason, dead-lettered or still waiting in the stream: 0 lost;
- no group is trained twice;
- the last step is reached and the final evaluation is of the final policy;
- the share of generated groups dropped as stale stays bounded: for a learner rank, ``KILLED_STALE_BOUND``,
  sized from the measured distribution of that share over killed runs; for every other target, within the
  issue's ``STALE_MARGIN`` (not sized from data) of a run with no kill.

A learner rank killed under ``up`` is in the default run; every other kill, and the no-kill baseline they are
compared with, is ``slow``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from benchmarks.crash_cost import (
    KILL_AT,
    RESTARTED_ROLE,
    STEPS,
    audit,
    kill,
    resume_args,
    stale_fraction,
    start,
    target_pid,
    up_args,
    wait_for_step,
)
from common.lifecycle import read_records
from tests.test_up import assert_archive_complete, metrics_base_port

pytestmark = pytest.mark.timeout(900)
# The bound: within 5 points of a run with no kill (the targets not measured in pairs).
STALE_MARGIN = 0.05
# The stale share of a run whose learner rank 1 is killed at step KILL_AT. `python -m benchmarks.crash_cost
# --pairs 10 --load` measured 10 (no kill, kill) pairs beside benchmarks.load's SuiteLoad (the machine this test
# meets inside `make test`) on 2026-12-05 (benchmarks/results/crash_cost_pairs.2026-12-05_loaded.json): killed
# 0.041 to 0.092, mean 0.061, sd 0.014; no kill 0.059 to 0.086, mean 0.070; nothing lost or trained twice. One
# more killed run of a correct system exceeds the Student t prediction bound 0.126 (normal fit 0.105) once in a
# thousand. This test used to run a no-kill baseline beside it and bound the difference (pairs: sd 0.021, bound
# 0.084): the pair's difference varies more than the killed run alone (the baseline's own noise adds to it), and
# the baseline cost a whole `up` run of every `make test`.
KILLED_STALE_BOUND = 0.126


def check_run(run_dir: Path, out: str) -> tuple[dict, dict]:
    """The records of a finished run: nothing lost, nothing trained twice, the last step, a final evaluation of the
    final policy. Returns (summary, audit)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    report = audit(run_dir)
    assert report["lost"] == 0, (report, out[-3000:])
    assert report["trained_twice"] == 0 and report["conflicting"] == 0, report
    assert report["ok"]
    assert summary["steps"] == STEPS, out[-3000:]
    assert report["trained"] == STEPS * 16  # every step trained one batch, counted once however often it ran
    assert summary["eval_after_is_final_policy"] is True, summary
    assert summary["eval_version_after"] == summary["final_policy_version"] >= STEPS
    assert summary["audit"]["lost"] == 0  # the same figures, in summary.json
    assert_archive_complete(run_dir, report)  # whatever was killed, every group archived exactly once
    return summary, report


@pytest.fixture(scope="module")
def baseline(warm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run with no kill: the stale-drop share a kill is compared with."""
    run_dir = tmp_path_factory.mktemp("chaos-baseline") / "run"
    proc = start(up_args(run_dir, warm_model, metrics_base_port()))
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    _, report = check_run(run_dir, out)
    return report


def run_with_kill(warm_model: Path, run_dir: Path, target: str) -> tuple[str, dict, dict]:
    proc = start(up_args(run_dir, warm_model, metrics_base_port()))
    wait_for_step(run_dir, KILL_AT, proc)
    killed = kill(run_dir, target)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert not killed.alive()
    summary, report = check_run(run_dir, out)
    return out, summary, report


def test_kill_9_of_a_learner_rank_under_up_loses_nothing_and_costs_few_stale_drops(
    warm_model: Path, tmp_path: Path
) -> None:
    """In the default run, the kill that only this test covers: a learner rank under `up` (the learner role
    restarted, the run resumed from its checkpoint), checked from the records (check_run), and its stale share
    within KILLED_STALE_BOUND. An engine killed mid-run is covered end to end by
    test_fleet_engines.py and test_weight_sync_e2e.py, the Redis server killed by test_broker_crash.py."""
    out, summary, report = run_with_kill(warm_model, tmp_path / "run", "learner-rank-1")
    assert "learner (pid" in out and "restarting it" in out, out[-3000:]
    fraction = stale_fraction(report)
    assert fraction <= KILLED_STALE_BOUND, report
    print(f"learner-rank-1: stale {fraction:.3f}, audit {report}, wall {summary['wall_seconds']:.0f} s")


@pytest.mark.slow
@pytest.mark.parametrize(
    "target",
    [
        "engine-0", "redis-server", "learner-rank-0",
        "learner",  # the launcher of the ranks
        "rollout-0", "eval", "dashboard", "archive",
        "redis",  # `streamrl redis`, which runs the server
    ],
)  # fmt: skip
def test_kill_9_mid_run_loses_nothing_and_costs_few_stale_drops(
    target: str, warm_model: Path, baseline: dict, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    out, summary, report = run_with_kill(warm_model, run_dir, target)
    restarted = RESTARTED_ROLE.get(target, target)
    assert f"{restarted} (pid" in out and "restarting it" in out, out[-3000:]
    fraction, base = stale_fraction(report), stale_fraction(baseline)
    assert fraction <= base + STALE_MARGIN, (target, report, baseline)
    print(
        f"{target}: stale {fraction:.3f} (no kill {base:.3f}), audit {report}, wall {summary['wall_seconds']:.0f} s"
    )


@pytest.mark.slow
def test_kill_9_of_the_supervisor_then_resume(warm_model: Path, baseline: dict, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(up_args(run_dir, warm_model, metrics_base_port()))
    wait_for_step(run_dir, KILL_AT, proc)
    roles = [r for r in read_records(run_dir / "processes.json") if r.name != "up"]
    kill(run_dir, "up")
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 120
    while any(r.alive() for r in roles):  # every role notices its supervisor died and drains by itself
        assert time.monotonic() < deadline, [r for r in roles if r.alive()]
        time.sleep(0.2)
    (server,) = read_records(run_dir / "redis" / "pid")
    assert not server.alive()
    resumed = start(resume_args(run_dir, metrics_base_port()))
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    _, report = check_run(run_dir, out)
    assert stale_fraction(report) <= stale_fraction(baseline) + STALE_MARGIN, (report, baseline)


@pytest.mark.slow
def test_resume_stops_a_leftover_that_holds_the_port(warm_model: Path, tmp_path: Path) -> None:
    """A role of the stopped run that is still alive (here: `streamrl redis`, SIGSTOPped so it cannot react to
    its supervisor's death) holds the run's port; the resume stops it and carries on."""
    run_dir = tmp_path / "run"
    proc = start(up_args(run_dir, warm_model, metrics_base_port()))
    wait_for_step(run_dir, 3, proc)
    wrapper = target_pid(run_dir, "redis")
    url = (run_dir / "redis" / "url").read_text().strip()
    os.kill(wrapper, signal.SIGSTOP)
    kill(run_dir, "up")
    proc.communicate(timeout=60)
    assert redis.Redis.from_url(url).ping()  # the old server still answers on the run's port
    resumed = start(resume_args(run_dir, metrics_base_port(), "--up.grace_s=10"))
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    assert "a process of an earlier run is still alive: redis" in out
    check_run(run_dir, out)
