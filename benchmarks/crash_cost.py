"""What a crash costs: ``kill -9`` of each process of ``streamrl up`` mid-run, against a run with no kill.

    python -m benchmarks.crash_cost --quick --out FILE     # the engine, learner rank 1, the Redis server
    python -m benchmarks.crash_cost --out FILE             # every process, and the supervisor itself
    python -m benchmarks.crash_cost --pairs 10 --load --out FILE   # 10 (no kill, learner-rank-1) pairs

Each run trains the warm-started tiny model for :data:`STEPS` steps (eta 1, a checkpoint every 5 steps); the
target is SIGKILLed at learner step :data:`KILL_AT` (two steps after a checkpoint). The supervisor restarts what
died; when the supervisor itself is the target the run is resumed with ``up --resume``. Per target, from the
run's records (``streamrl audit``, summary.json and the learner's metrics stream):

- ``lost`` and ``trained_twice`` (must be 0), ``stale_groups`` and ``stale_fraction`` (groups dropped as stale
  over groups generated), against the run with no kill;
- ``extra_wall_seconds``: the run's wall time (from the first start to the end, a resume included) minus the
  no-kill run's; ``restarts``: roles the supervisor restarted;
- ``stall_seconds``: the longest gap between two learner steps after the kill, minus the median gap;
- ``steps_redone``: learner steps run more than once (a learner crash goes back to its checkpoint), and
  ``entries_read_again``: stream entries a restarted learner read a second time (those it had taken before the
  crash and not yet acknowledged).

``--pairs N`` runs N pairs of (no kill, ``--target``) runs, optionally beside benchmarks.load's SuiteLoad (the
machine CI meets), and sizes the bound ``tests/test_chaos.py`` puts on the extra stale share (kill minus no kill
within a pair) from their distribution: the value one more pair of a correct system exceeds with probability at
most 1/1000 (benchmarks.common.one_in_a_thousand).

``tests/test_chaos.py`` runs the same targets with the same helpers and asserts on the same records.

``--smoke --from-run RUN`` (benchmarks.common.RecordedRun) checks every command line (``up``, and the supervisor's
``up --resume``) and analyses the recorded 2-step run for the no-kill run, the supervisor's kill and one pair
(its result beside ``--out``, ``.pairs.json``); nothing is killed there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.common import (
    add_recorded_run_flags,
    mode_of,
    one_in_a_thousand,
    recorded_run_of,
    smoke_run,
    write_partial,
    write_result,
)
from benchmarks.load import SuiteLoad
from broker.metrics import metrics_key
from common.config import SharedConfig
from common.lifecycle import ProcessRecord, read_records

STEPS = 30
KILL_AT = 12  # checkpoints at 5, 10, 15, ...: a learner killed here goes back to step 10
GROUPS_PER_STEP = 16
DEFAULT_TARGETS = ("engine-0", "learner-rank-1", "redis-server")
ALL_TARGETS = (
    *DEFAULT_TARGETS, "learner-rank-0", "learner", "rollout-0", "eval", "dashboard", "redis", "up",
)  # fmt: skip
# the role the supervisor restarts when a process inside it is killed
RESTARTED_ROLE = {"learner-rank-0": "learner", "learner-rank-1": "learner", "redis-server": "redis"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A run's steps and the learner step its target is killed at."""

    steps: int = STEPS
    kill_at: int = KILL_AT


DEFAULT_SHAPE = Shape()
# --smoke: the recorded run's 2 steps, and the step its analysis splits at (where a kill would have fallen)
SMOKE_SHAPE = Shape(steps=2, kill_at=1)
SMOKE_TARGETS = ("up",)  # the supervisor: the kill and the resume, every branch of a run


def up_args(
    run_dir: Path, model: Path, metrics_base_port: int = 0, *extra: str, steps: int = STEPS
) -> list[str]:
    return [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.model_path={model}",
        f"--learner.max_steps={steps}", "--learner.checkpoint_every=5", "--learner.wandb_mode=disabled",
        "--dashboard.port=0", f"--dashboard.metrics_base_port={metrics_base_port}", "--eval.heldout_prompts=50",
        "--eval.every_versions=5", "--up.restart_delay_s=0.5", "--up.status_interval_s=5", *extra,
    ]  # fmt: skip


def resume_args(run_dir: Path, metrics_base_port: int = 0, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "streamrl", "up", "--resume", str(run_dir),
        f"--dashboard.metrics_base_port={metrics_base_port}", *extra,
    ]  # fmt: skip


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def learner_step(run_dir: Path) -> int:
    """The learner's latest step from the run's metrics stream (-1 before the first, or without Redis)."""
    url_file = run_dir / "redis" / "url"
    if not url_file.is_file():
        return -1
    try:
        rows = redis.Redis.from_url(url_file.read_text().strip(), socket_timeout=2).xrevrange(
            metrics_key(SharedConfig(), "learner"), count=1
        )
    except redis.RedisError:
        return -1
    return int(float(rows[0][1][b"step"])) if rows else -1


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while learner_step(run_dir) < step:
        if proc.poll() is not None:
            raise RuntimeError(
                f"streamrl up exited before step {step}:\n{proc.stdout.read() if proc.stdout else ''}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"the learner never reached step {step}")
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def target_pid(run_dir: Path, target: str) -> int:
    """The pid of a process of the run: a role by its supervisor name (``up`` is the supervisor), a learner
    rank (``learner-rank-N``), or the Redis server itself (``redis-server``)."""
    records = {r.name: r for r in read_records(run_dir / "processes.json")}
    if target.startswith("learner-rank-"):
        rank = target.rsplit("-", 1)[1]
        for pid in _children(records["learner"].pid):
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        raise LookupError(f"no learner rank {rank} under pid {records['learner'].pid}")
    if target == "redis-server":
        (server,) = read_records(run_dir / "redis" / "pid")
        return server.pid
    return records[target].pid


def kill(run_dir: Path, target: str) -> ProcessRecord:
    pid = target_pid(run_dir, target)
    record = ProcessRecord.of(target, pid)
    os.kill(pid, signal.SIGKILL)
    return record


def audit(run_dir: Path) -> dict[str, Any]:
    """``streamrl audit RUN_DIR --json``."""
    done = subprocess.run(
        [sys.executable, "-m", "streamrl", "audit", str(run_dir), "--json"], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    if done.returncode not in (0, 1):
        raise RuntimeError(f"streamrl audit failed: {done.stderr}")
    return json.loads(done.stdout)


SERIES_FIELDS = (
    "step",
    "policy_version",
    "total/stale",
    "staleness/mean",
    "wait_seconds",
    "publish_seconds",
)


def run_records(run_dir: Path) -> tuple[list[tuple[float, int]], dict[str, float], list[list[float | None]]]:
    """(unix time, step) of every learner metrics point of a finished run, the broker's counters (its Redis
    is started for the read), and per point [unix time, *SERIES_FIELDS] (None where a point lacks one)."""
    from broker.client import BrokerKeys
    from broker.metrics import parse_number
    from streamrl.audit import load_run_config, runs_redis

    config = load_run_config(run_dir)

    async def read(url: str) -> tuple[list[tuple[float, int]], dict[str, float], list[list[float | None]]]:
        client = redis.asyncio.Redis.from_url(url)
        try:
            rows = await client.xrange(metrics_key(config.shared, "learner"))
            counters = await client.hgetall(BrokerKeys.of(config.shared, config.broker).counters)
        finally:
            await client.aclose()
        points = [(int(i.split(b"-")[0]) / 1000, int(float(f[b"step"]))) for i, f in rows]
        numbers = {k.decode(): parse_number(v) for k, v in counters.items()}
        series = [
            [t, *(float(f[k.encode()]) if k.encode() in f else None for k in SERIES_FIELDS)]
            for (t, _), (_, f) in zip(points, rows, strict=True)
        ]
        return points, {k: float(v) for k, v in numbers.items() if not isinstance(v, str)}, series

    with runs_redis(config) as url:
        return asyncio.run(read(url))


def stale_fraction(report: dict[str, Any]) -> float:
    return report["dropped_by_reason"].get("stale", 0) / max(1, report["generated"])


def launch(model: Path, run_dir: Path, target: str | None, shape: Shape) -> tuple[str, float | None]:
    """One run to its end, killing ``target`` at step ``shape.kill_at`` (None: no kill; ``up``: the run is
    resumed). Returns the supervisor's output and the unix time of the kill."""
    args = up_args(run_dir, model, steps=shape.steps)
    recorded = smoke_run()
    if recorded is not None:  # smoke: the recorded run, finished: no step to wait for, nothing to kill
        recorded.answer(args, run_dir)
        if target == "up":
            recorded.check(resume_args(run_dir))
        return "", None
    proc = start(args)
    killed_at = None
    if target is not None:
        wait_for_step(run_dir, shape.kill_at, proc)
        killed_at = time.time()
        kill(run_dir, target)
    if target == "up":
        proc.communicate(timeout=120)
        deadline = time.monotonic() + 180
        while any(r.alive() for r in read_records(run_dir / "processes.json")):
            if time.monotonic() > deadline:
                raise TimeoutError("roles outlived their killed supervisor")
            time.sleep(0.2)
        proc = start(resume_args(run_dir))
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{target}: streamrl up failed:\n{out[-3000:]}")
    return out, killed_at


def run_target(
    model: Path, run_dir: Path, target: str | None, shape: Shape = DEFAULT_SHAPE
) -> dict[str, Any]:
    """One run, killing ``target`` at step ``shape.kill_at`` (None: no kill); the figures of the module
    docstring."""
    began = time.monotonic()
    out, killed_at = launch(model, run_dir, target, shape)
    wall = time.monotonic() - began  # start to end, the resume of a killed supervisor included
    summary = json.loads((run_dir / "summary.json").read_text())
    report = audit(run_dir)
    points, counters, series = run_records(run_dir)
    if target is not None and killed_at is None:  # smoke: no kill; its time is the recorded step kill_at's
        killed_at = next(t for t, s in points if s >= shape.kill_at)
    steps = [s for _, s in points]
    after = [t for t, _ in points if killed_at is None or t >= killed_at - 1]
    gaps = [b - a for a, b in zip(after, after[1:], strict=False)]
    return {
        "target": target or "none",
        "wall_seconds": wall,
        "steps": summary["steps"],
        "lost": report["lost"],
        "trained_twice": report["trained_twice"],
        "trained": report["trained"],
        "generated": report["generated"],
        "stale_groups": report["dropped_by_reason"].get("stale", 0),
        "stale_fraction": stale_fraction(report),
        "steps_redone": len(steps) - len(set(steps)),
        # entries a restarted learner read again (handed out before its crash, not yet acknowledged)
        "entries_read_again": int(counters.get("recovered", 0)),
        "max_step_gap_seconds": max(gaps, default=0.0),
        "median_step_gap_seconds": statistics.median(gaps) if gaps else 0.0,
        "eval_after_is_final_policy": summary["eval_after_is_final_policy"],
        # the supervisor's own lines (its log repeats each one)
        "restarts": sum(
            1 for line in out.splitlines() if line.startswith("streamrl up:") and "restarting it" in line
        ),
        "killed_at": killed_at,
        "series_fields": ["unix_time", *SERIES_FIELDS],
        "series": series,  # every learner metrics point: where a kill's stale drops fall (before, after)
    }


def stale_per_step(run: dict[str, Any], kill_at: int = KILL_AT) -> tuple[float, float]:
    """Groups dropped as stale per learner step before and after the kill (a run with no kill: before and after
    the first point at step ``kill_at``), from the run's series."""
    rows = [dict(zip(run["series_fields"], row, strict=True)) for row in run["series"]]
    split = run["killed_at"] or next(r["unix_time"] for r in rows if r["step"] >= kill_at)
    before = [r for r in rows if r["unix_time"] < split]
    after = [r for r in rows if r["unix_time"] >= split]
    stale = "total/stale"
    rate_before = (before[-1][stale] or 0.0) / before[-1]["step"] if before else 0.0
    steps_after = after[-1]["step"] - after[0]["step"] if after else 0
    rate_after = ((after[-1][stale] or 0.0) - (after[0][stale] or 0.0)) / steps_after if steps_after else 0.0
    return rate_before, rate_after


def run_pairs(
    model: Path, work_dir: Path, target: str, pairs: int, out: Path, shape: Shape = DEFAULT_SHAPE
) -> list[dict[str, Any]]:
    """``pairs`` pairs of (no kill, ``target``) runs; each pair's figures and its extra stale share. The pairs so
    far are kept beside ``out`` (a long measurement that stops early keeps what it measured)."""
    results: list[dict[str, Any]] = []
    for i in range(pairs):
        base = run_target(model, work_dir / f"pair-{i}-none", None, shape)
        killed = run_target(model, work_dir / f"pair-{i}-{target}", target, shape)
        results.append(
            {
                "none": base,
                target: killed,
                "extra_stale_fraction": killed["stale_fraction"] - base["stale_fraction"],
                "stale_per_step_none": stale_per_step(base, shape.kill_at),
                "stale_per_step_killed": stale_per_step(killed, shape.kill_at),
            }
        )
        print(
            f"pair {i + 1}/{pairs}: stale share {base['stale_fraction']:.3f} without a kill, "
            f"{killed['stale_fraction']:.3f} with {target} killed (extra {results[-1]['extra_stale_fraction']:+.3f}); "
            f"lost {killed['lost']}, trained twice {killed['trained_twice']}",
            flush=True,
        )
        write_partial(out, results)
    return results


def pairs_main(
    args: argparse.Namespace, model: Path, mode: str = "full", shape: Shape = DEFAULT_SHAPE
) -> int:
    with tempfile.TemporaryDirectory(prefix="crash-cost-pairs-") as tmp:
        load = SuiteLoad(Path(tmp) / "load") if args.load else contextlib.nullcontext()
        with load:
            pairs = run_pairs(model, Path(tmp), args.target, args.pairs, args.out, shape)
    runs = [p[args.target] for p in pairs]
    headline = {
        **one_in_a_thousand("extra_stale_fraction", [p["extra_stale_fraction"] for p in pairs], side="upper"),
        **one_in_a_thousand(
            "stale_fraction_none", [p["none"]["stale_fraction"] for p in pairs], side="upper"
        ),
        # the killed run's own share: what tests/test_chaos.py bounds without running a no-kill baseline
        **one_in_a_thousand("stale_fraction_killed", [r["stale_fraction"] for r in runs], side="upper"),
        "lost": sum(r["lost"] for r in runs),
        "trained_twice": sum(r["trained_twice"] for r in runs),
        # (before, after) the kill, or step KILL_AT without one: does a restarted learner's run stay staler?
        "stale_per_step_none_mean": [
            statistics.fmean(p["stale_per_step_none"][i] for p in pairs) for i in (0, 1)
        ],
        "stale_per_step_killed_mean": [
            statistics.fmean(p["stale_per_step_killed"][i] for p in pairs) for i in (0, 1)
        ],
    }
    doc = write_result(
        args.out, "crash_cost", "smoke" if mode == "smoke" else "pairs",
        {"steps": shape.steps, "kill_at": shape.kill_at, "target": args.target, "pairs": args.pairs,
         "load": load.stats() if isinstance(load, SuiteLoad) else None},
        {"pairs": pairs}, {"lost": ("<=", 0), "trained_twice": ("<=", 0)}, headline, model=model,
    )  # fmt: skip
    print(json.dumps({k: doc[k] for k in (*headline, "passed")}, indent=2))
    return 0 if doc["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.crash_cost", description=__doc__.split("\n")[0]
    )
    add_recorded_run_flags(parser, f"only {', '.join(DEFAULT_TARGETS)}")
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="Run this many (no kill, --target) pairs instead of one run a target.",
    )
    parser.add_argument(
        "--target",
        default="learner-rank-1",
        choices=ALL_TARGETS,
        help="What --pairs kills (default learner-rank-1).",
    )
    parser.add_argument(
        "--load",
        action="store_true",
        help="With --pairs: beside a slice of the test suite in a loop (benchmarks.load).",
    )
    parser.add_argument("--out", type=Path, required=True, help="Result JSON.")
    args = parser.parse_args(argv)
    recorded = recorded_run_of(parser, args)
    mode = mode_of(parser, args)
    if args.pairs < 0:
        parser.error(f"--pairs = {args.pairs}: must be >= 0")
    if args.load and not args.pairs:
        parser.error("--load goes with --pairs")
    if recorded is not None:
        model = recorded.model()
    else:
        from streamrl.warm_start import init_warm_model

        model = init_warm_model()
    shape = SMOKE_SHAPE if mode == "smoke" else DEFAULT_SHAPE
    if args.pairs:
        return pairs_main(args, model, mode, shape)
    code = targets_main(args, model, mode, shape)
    if mode == "smoke":  # the --pairs flow too, one pair: its result beside --out
        out = args.out.with_name(args.out.stem + ".pairs.json")
        one_pair = argparse.Namespace(**{**vars(args), "pairs": 1, "out": out})
        code = max(code, pairs_main(one_pair, model, mode, shape))
    return code


def targets_main(args: argparse.Namespace, model: Path, mode: str, shape: Shape) -> int:
    """One run a target (and one without a kill), each against the run without."""
    targets = {"smoke": SMOKE_TARGETS, "quick": DEFAULT_TARGETS, "full": ALL_TARGETS}[mode]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="crash-cost-") as tmp:
        for target in (None, *targets):
            name = target or "none"
            results[name] = run_target(model, Path(tmp) / name, target, shape)
            print(json.dumps(results[name]), flush=True)
    base = results["none"]
    for name, r in results.items():
        r["extra_wall_seconds"] = r["wall_seconds"] - base["wall_seconds"]
        r["extra_stale_groups"] = r["stale_groups"] - base["stale_groups"]
        r["stall_seconds"] = (
            r["max_step_gap_seconds"] - base["median_step_gap_seconds"] if name != "none" else 0.0
        )
    headline = {
        "lost": sum(r["lost"] for r in results.values()),
        "trained_twice": sum(r["trained_twice"] for r in results.values()),
        "max_extra_stale_fraction": max(
            r["stale_fraction"] - base["stale_fraction"] for r in results.values()
        ),
    }
    targets_ = {"lost": ("<=", 0), "trained_twice": ("<=", 0), "max_extra_stale_fraction": ("<=", 0.05)}
    doc = write_result(
        args.out, "crash_cost", mode,
        {"steps": shape.steps, "kill_at": shape.kill_at, "targets": list(targets)}, {"runs": results}, targets_,
        headline, model=model,
    )  # fmt: skip
    print(json.dumps({k: doc[k] for k in (*headline, "passed")}, indent=2))
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
