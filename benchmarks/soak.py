"""Soak: what grows while `streamrl up` runs as a daemon (no step limit) for a fixed time.

    python -m benchmarks.soak --quick --out FILE    # 10 minutes; slopes after the first 4
    python -m benchmarks.soak --out FILE            # 2 hours; slopes after the first 10 minutes
    python -m benchmarks.soak --smoke --from-run RUN_DIR --out FILE --work DIR   # no run started

Every ``interval_s`` it samples: each role's RSS, open fds and threads (the role's process and its descendants,
pids from the run's ``processes.json``; the Redis server from ``redis/pid``), Redis ``INFO used_memory`` and the
size of every key of the run (HLEN, SCARD, XLEN, ... : ``broker.metrics.key_sizes``), the Redis data directory
(the AOF) and the run directory by part (archive, checkpoints, logs, snapshots, redis, other), against the
learner's step. For each series, the least-squares slope per 1,000 steps over the samples after the warm-up, with
its standard error, and an SVG plot of the series (``--svg``, default beside ``--out``).

Targets (issue 38): Redis used memory and every key's size flat (slope below 1% of the value per 1,000 steps; keys
capped by design, metrics streams, the control stream and the live viewer's list, pass while under their cap),
every role's RSS slope under 1 MB per 1,000 steps, and the run directory growing only by the archive (every other
part's slope under 1 MB per 1,000 steps; the AOF, most of ``redis/``, is reported: Redis rewrites it once it
doubles past 64 MB, which only the full mode lasts long enough to show). A series passes when its slope is not
above its bound by more than two standard errors (small keys such as the leases jitter, RSS moves by megabytes);
``strict`` says whether the slope itself is under the bound. The quick mode keeps 200 retired groups
(``--broker.keep_groups=200``) so the pruned keys reach their plateau inside its window. The smoke mode checks the
command line and samples a recorded run's files and its Redis (started on its AOF) three times: its numbers are no
measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_recorded_run_flags,
    mode_of,
    recorded_run_of,
    work_of,
    write_partial,
    write_result,
)
from benchmarks.plot import figure, line_chart
from broker.client import connect
from broker.metrics import key_sizes, metrics_key
from broker.version import CONTROL_MAXLEN
from common.lifecycle import read_records

# quick keeps 200 retired groups instead of 1,000 (broker.keep_groups), so the pruned keys reach their plateau
# inside its 10 minutes on 2 loaded cores (about 15 steps a minute, 17 groups a step)
MODES = {
    "smoke": {"seconds": 0, "warmup_s": 0, "interval_s": 0, "extra": []},
    "quick": {"seconds": 600, "warmup_s": 240, "interval_s": 30, "extra": ["--broker.keep_groups=200"]},
    "full": {"seconds": 7200, "warmup_s": 600, "interval_s": 30, "extra": []},
}
PARTS = ("archive", "checkpoints", "logs", "snapshots", "redis")
# keys trimmed to a length by design (a prefix -> its cap), besides the pruned per-group state
MB = 2**20


# -- sampling ------------------------------------------------------------------------------------------------


def _proc_children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # the task ended meanwhile
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _proc_stats(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, open fds, threads) of one process; zeros when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = {line.split(":")[0]: line.split(":")[1].split() for line in status if ":" in line}
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, IndexError):
        return 0, 0, 0
    return int(fields.get("VmRSS", ["0"])[0]) * 1024, fds, int(fields.get("Threads", ["0"])[0])


def role_stats(run_dir: Path) -> dict[str, dict[str, int]]:
    """Per role (supervisor name): RSS, fds and threads summed over its process tree (the redis role's holds the
    server); ``up``, the supervisor, by itself (its tree is every role)."""
    roles = [(r.name, r.pid) for r in read_records(run_dir / "processes.json")]
    if "redis" not in dict(roles):  # a server the supervisor did not start (the smoke's replay)
        roles += [("redis-server", r.pid) for r in read_records(run_dir / "redis" / "pid")]
    out: dict[str, dict[str, int]] = {}
    for name, pid in roles:
        tree, todo = [], [pid]
        while todo and name != "up":
            pid = todo.pop()
            tree.append(pid)
            todo += _proc_children(pid)
        stats = [_proc_stats(p) for p in tree or [pid]]
        if any(s[0] for s in stats):
            out[name] = {k: sum(s[i] for s in stats) for i, k in enumerate(("rss", "fds", "threads"))}
    return out


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def dir_parts(run_dir: Path) -> dict[str, int]:
    """Bytes of the run directory by part; the Redis data directory's AOF files apart as ``aof``."""
    out = {p: 0 for p in (*PARTS, "other")}
    for entry in run_dir.iterdir():
        out[entry.name if entry.name in PARTS else "other"] += _size(entry)
    redis_dir = run_dir / "redis"
    out["aof"] = (
        sum(f.stat().st_size for f in redis_dir.rglob("*aof*") if f.is_file()) if redis_dir.is_dir() else 0
    )
    return out


async def redis_sample(url: str, shared: Any, broker: Any) -> dict[str, Any]:
    """The learner's step, used memory and every key's size."""
    client = connect(url, broker)
    try:
        rows = await client.xrevrange(metrics_key(shared, "learner"), count=1)
        step = int(float(rows[0][1][b"step"])) if rows else 0
        memory = await client.info("memory")
        return {
            "step": step,
            "used_memory": int(memory["used_memory"]),
            "keys": await key_sizes(client, shared),
        }
    finally:
        await client.aclose()


def sample(run_dir: Path, url: str, config: Any, started: float) -> dict[str, Any]:
    doc = asyncio.run(redis_sample(url, config.shared, config.broker))
    doc.update(t=time.monotonic() - started, roles=role_stats(run_dir), dir=dir_parts(run_dir))
    return doc


# -- analysis ------------------------------------------------------------------------------------------------


def slope(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares slope of y on x and its standard error; None without two distinct x."""
    n = len(points)
    if n < 2:
        return None
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in points)
    se = (resid / (n - 2) / sxx) ** 0.5 if n > 2 else 0.0
    return b, se


def per_key(sizes: dict[str, int]) -> dict[str, int]:
    """Key sizes with the keys made per group (a payload stored by reference) counted together under one name."""
    out: dict[str, int] = {"trajectories:payload:*": 0}
    for key, size in sizes.items():
        name = "trajectories:payload:*" if key.startswith("trajectories:payload:") else key
        out[name] = out.get(name, 0) + size
    return out


def series(samples: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Every sampled quantity as (step, value) points, by a flat name."""
    out: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, step: float, value: float) -> None:
        out.setdefault(name, []).append((step, float(value)))

    for s in samples:
        add("redis/used_memory", s["step"], s["used_memory"])
        for key, size in per_key(s["keys"]).items():
            add(f"key/{key}", s["step"], size)
        for role, stats in s["roles"].items():
            for k, v in stats.items():
                add(f"role/{role}/{k}", s["step"], v)
        for part, size in s["dir"].items():
            add(f"dir/{part}", s["step"], size)
    return out


def limit_of(name: str, last: float) -> float | None:
    """The target's bound on a series' slope per 1,000 steps; None for a series without a target."""
    if name.startswith("role/") and name.endswith("/rss"):
        return MB
    if name.startswith("dir/") and name not in ("dir/archive", "dir/aof", "dir/redis"):
        return MB  # the AOF (most of redis/) is rewritten by Redis once past 64 MB: reported, not judged
    if name == "redis/used_memory" or name.startswith("key/"):
        return 0.01 * max(last, 1.0)
    return None


def judge(name: str, points: list[tuple[float, float]], caps: dict[str, int]) -> dict[str, Any]:
    """Slope per 1,000 steps (and its standard error) of one series after the warm-up, against its target:
    ``passed`` when the slope is under the bound (``strict``), or not above it by more than two standard errors
    (a short window and a jittery series: growth beyond the bound is not shown)."""
    fit = slope(points)
    last = points[-1][1] if points else 0.0
    row: dict[str, Any] = {"last": last, "samples": len(points), "slope_per_1000_steps": None, "passed": None}
    row["change"] = last - points[0][1] if points else 0.0  # over the window, beside the extrapolated slope
    limit = limit_of(name, last)
    if fit is None:
        return row
    b, se = fit[0] * 1000, fit[1] * 1000
    row.update(slope_per_1000_steps=b, stderr=se, limit=limit)
    if limit is None:
        return row
    cap = next((c for prefix, c in caps.items() if name.startswith("key/" + prefix)), None)
    capped = cap is not None and last <= cap * 1.1  # approximate trimming overshoots a little
    row.update(strict=capped or b < limit, passed=capped or b - 2 * se < limit, capped=capped)
    return row


def svg(all_series: dict[str, list[tuple[float, float]]]) -> str:
    """Redis memory, the largest keys, role RSS and the run directory by part, against the step."""

    def pick(prefix: str, scale: float, top: int = 6) -> dict[str, list[tuple[float, float]]]:
        chosen = sorted(
            (n for n in all_series if n.startswith(prefix) and (prefix != "role/" or n.endswith("/rss"))),
            key=lambda n: -max(y for _, y in all_series[n]),
        )[:top]
        return {n[len(prefix) :]: [(x, y / scale) for x, y in all_series[n]] for n in chosen}

    panels = [
        (pick("redis/", MB), "Redis used memory", "MB"),
        (pick("key/", 1), "largest Redis keys", "elements"),
        (pick("role/", MB), "RSS by role", "MB"),
        (pick("dir/", MB), "run directory by part", "MB"),
    ]
    charts = [line_chart(data, title, "learner step", unit) for data, title, unit in panels if data]
    return figure(charts)


# -- the run -------------------------------------------------------------------------------------------------


def up_args(run_dir: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", "--learner.max_steps=0",
        "--learner.wandb_mode=disabled", "--rollout.task.seed=11", "--dashboard.port=0",
        "--dashboard.metrics_base_port=0", "--up.status_interval_s=60", *extra,
    ]  # fmt: skip


def soak(
    run_dir: Path, seconds: float, interval_s: float, extra: list[str], partial: Path
) -> list[dict[str, Any]]:
    """Run `streamrl up` for ``seconds``, sampling every ``interval_s``; then stop it with SIGTERM."""
    from common.discovery import resolve_redis_url
    from streamrl.audit import load_run_config

    log = open(run_dir.parent / f"{run_dir.name}.up.log", "w")  # noqa: SIM115 - the child's, closed below
    proc = subprocess.Popen(
        up_args(run_dir, extra), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    samples: list[dict[str, Any]] = []
    try:
        while not (run_dir / "config.toml").is_file() or not (run_dir / "redis" / "url").is_file():
            if proc.poll() is not None:
                raise RuntimeError(f"streamrl up exited with {proc.returncode}: see {log.name}")
            time.sleep(1)
        config = load_run_config(run_dir)
        url = resolve_redis_url(config.shared, wait_s=60)
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            if proc.poll() is not None:
                raise RuntimeError(f"streamrl up exited with {proc.returncode}: see {log.name}")
            samples.append(sample(run_dir, url, config, started))
            write_partial(partial, samples)  # a soak cut short keeps what it sampled
            s = samples[-1]
            print(
                f"t {s['t']:6.0f} s  step {s['step']:5d}  used_memory {s['used_memory'] / MB:6.2f} MB",
                flush=True,
            )
            time.sleep(max(0.0, interval_s - (time.monotonic() - started - s["t"])))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(300)
        log.close()
    return samples


def replay(run_dir: Path) -> list[dict[str, Any]]:
    """Smoke: three samples of a recorded run's files and its Redis started on its AOF (no processes)."""
    from streamrl.audit import load_run_config, runs_redis

    config = load_run_config(run_dir)
    started = time.monotonic()
    with runs_redis(config) as url:
        return [sample(run_dir, url, config, started) for _ in range(3)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recorded_run_flags(parser, "10 minutes of `streamrl up`, slopes after the first 4")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--svg", type=Path, help="the plot (default: --out with .svg)")
    parser.add_argument("--work", type=Path, help="the run directory's parent (default: a temporary one)")
    args = parser.parse_args(argv)
    recorded = recorded_run_of(parser, args)
    mode = mode_of(parser, args)
    params = MODES[mode]
    work = work_of(parser, args, None) or Path(tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    if recorded is not None:
        recorded.answer(up_args(run_dir, params["extra"]), run_dir)
        samples = replay(run_dir)
    else:
        samples = soak(run_dir, params["seconds"], params["interval_s"], params["extra"], args.out)
    # after the warm-up, and only once the learner has stepped (start-up takes minutes on a loaded machine)
    after = [s for s in samples if s["t"] >= params["warmup_s"] and s["step"] > 0]
    from streamrl.audit import load_run_config

    config = load_run_config(run_dir)
    caps = {
        "metrics:": config.broker.metrics_maxlen,
        "control": CONTROL_MAXLEN,
        "archive:recent": config.archive.recent,
    }
    judged = {name: judge(name, pts, caps) for name, pts in series(after).items()}
    failing = sorted(n for n, r in judged.items() if r["passed"] is False)
    not_strict = sorted(n for n, r in judged.items() if r.get("strict") is False)
    steps = after[-1]["step"] - after[0]["step"] if after else 0
    memory = judged.get("redis/used_memory", {})
    headline = {
        "steps_after_warmup": steps,
        "redis_used_memory_slope_share_per_1000_steps": (
            memory["slope_per_1000_steps"] / memory["last"] if memory.get("slope_per_1000_steps") is not None else None
        ),
        "series_failing": len(failing),
        "failing": failing,
        "series_over_the_bound_within_noise": not_strict,
        "worst_role_rss_slope_mb_per_1000_steps": max(
            (r["slope_per_1000_steps"] / MB for n, r in judged.items()
             if n.startswith("role/") and n.endswith("/rss") and r.get("slope_per_1000_steps") is not None),
            default=None,
        ),
    }  # fmt: skip
    svg_path = args.svg or args.out.with_suffix(".svg")
    svg_path.parent.mkdir(parents=True, exist_ok=True)
    svg_path.write_text(svg(series(samples)))
    targets = {"series_failing": ("<=", 0), "redis_used_memory_slope_share_per_1000_steps": ("<", 0.01)}
    doc = write_result(
        args.out, "soak", mode, {**params, "run_args": up_args(Path("RUN_DIR"), params["extra"])[3:]},
        {"series": judged, "samples": samples}, targets, headline,
    )  # fmt: skip
    print(
        f"{steps} steps after the warm-up; failing: {failing or 'none'}; plot {svg_path}; passed: {doc['passed']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
