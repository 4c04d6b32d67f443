"""Shared by every benchmark: the machine description, the git sha, targets, a readable table, and the
result file ``{benchmark, mode, git_sha, machine, manifest, params, results, targets, passed}`` (plus the headline
keys an issue names, repeated at the top level). ``manifest`` is streamrl.manifest.environment(): code, Python and
package versions, machine (with GPUs), and the model's file hashes when the benchmark names its model."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Z_ONE_IN_A_THOUSAND = 3.09  # one-sided normal quantile of 0.999
# one-sided 0.999 quantiles of Student's t by degrees of freedom (n - 1), for the prediction bound
T_ONE_IN_A_THOUSAND = {4: 7.173, 5: 5.893, 6: 5.208, 7: 4.785, 8: 4.501, 9: 4.297, 10: 4.144, 11: 4.025,
                       12: 3.930, 13: 3.852, 14: 3.787, 15: 3.733, 16: 3.686, 17: 3.646, 18: 3.610, 19: 3.579,
                       29: 3.396}  # fmt: skip
OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


def git_sha(root: Path | None = None) -> str:
    """HEAD of the checkout the benchmark runs from, with '-dirty' when tracked files differ; 'unknown' outside
    git."""
    cwd = root or Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory and platform: what a reader needs to compare numbers across machines."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": memory_gb,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def one_in_a_thousand(name: str, values: Sequence[float], side: str = "lower") -> dict[str, float]:
    """Mean, sd, range, and the bound one more run of a correct system crosses with probability at most 1/1000:
    below it (``side="lower"``, a gain) or above it (``"upper"``, a cost). Two bounds: a normal fit (mean -/+ 3.09
    sd), and a Student t prediction interval for one more run (mean -/+ t sd sqrt(1 + 1/n); wider, because the sd
    is estimated from few runs), the latter for the run counts in :data:`T_ONE_IN_A_THOUSAND`."""
    if side not in ("lower", "upper"):
        raise ValueError(f"side = {side!r}: expected lower or upper")
    sign = -1 if side == "lower" else 1
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    summary = {
        f"{name}_mean": mean,
        f"{name}_sd": sd,
        f"{name}_min": min(values),
        f"{name}_max": max(values),
        f"{name}_threshold_one_in_a_thousand": mean + sign * Z_ONE_IN_A_THOUSAND * sd,
    }
    dof = len(values) - 1
    if dof in T_ONE_IN_A_THOUSAND:
        t = T_ONE_IN_A_THOUSAND[dof]
        summary[f"{name}_t_prediction_one_in_a_thousand"] = (
            mean + sign * t * sd * (1 + 1 / len(values)) ** 0.5
        )
    return summary


def write_partial(out: Path, runs: Sequence[Any]) -> None:
    """The runs so far, beside the result (a long measurement that stops early keeps what it measured)."""
    partial = out.with_name(out.stem + ".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps(runs, indent=1))


def evaluate_targets(
    values: Mapping[str, float], targets: Mapping[str, tuple[str, float]]
) -> tuple[dict[str, dict[str, Any]], bool]:
    """Check each ``name: (op, threshold)`` against ``values[name]``; returns the per-target record and whether
    all passed."""
    out: dict[str, dict[str, Any]] = {}
    for name, (op, threshold) in targets.items():
        actual = values.get(name)
        ok = actual is not None and OPS[op](actual, threshold)
        out[name] = {"op": op, "value": threshold, "actual": actual, "passed": bool(ok)}
    return out, all(t["passed"] for t in out.values())


REPO = Path(__file__).resolve().parents[1]
SMOKE_HELP = (
    "the smallest shape, seconds: checks that the benchmark runs end to end (tests/test_benchmark_smoke.py); "
    "its numbers mean nothing; needs --out outside the checkout"
)


def add_mode_flags(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """``--quick`` and ``--smoke``, one at most; :func:`mode_of` reads them."""
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--quick", action="store_true", help=quick_help)
    modes.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def mode_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``smoke``, ``quick`` or ``full``; a smoke run must be told where to write (``--out``) and never writes into
    the checkout (its numbers are no results, and a test's run leaves the checkout as it was)."""
    if not getattr(args, "smoke", False):
        return "quick" if getattr(args, "quick", False) else "full"
    if getattr(args, "out", None) is None:
        parser.error("--smoke needs --out (outside the checkout)")
    check_smoke_path(Path(args.out), parser.error)
    return "smoke"


def check_smoke_path(path: Path, fail: Callable[[str], Any], flag: str = "--out") -> None:
    """Call ``fail`` with the reason when a smoke run's output ``path`` (given as ``flag``) lies inside the
    checkout."""
    if path.resolve().is_relative_to(REPO):
        fail(f"--smoke writes only outside the checkout ({flag} {path} is inside {REPO})")


def work_of(parser: argparse.ArgumentParser, args: argparse.Namespace, default: Path | None) -> Path | None:
    """``--work`` (a benchmark's run directories), else ``default``; a smoke run must be given one, outside the
    checkout (so never the default under runs/)."""
    if not getattr(args, "smoke", False):
        return args.work or default
    if args.work is None:
        parser.error("--smoke needs --work (outside the checkout)")
    if args.work.resolve().is_relative_to(REPO):
        parser.error(f"--smoke writes only outside the checkout (--work {args.work} is inside {REPO})")
    return args.work


def write_result(
    path: Path | str,
    benchmark: str,
    mode: str,
    params: Mapping[str, Any],
    results: Mapping[str, Any],
    targets: Mapping[str, tuple[str, float]],
    headline: Mapping[str, Any] | None = None,
    model: Path | str | None = None,
) -> dict[str, Any]:
    """Evaluate ``targets`` against ``headline`` (the top-level numbers) and write the result JSON atomically,
    with the run manifest's parts that make sense without a run (and ``model``'s hashes when given). Returns the
    written document."""
    from streamrl.manifest import environment

    if mode == "smoke":
        check_smoke_path(Path(path), _refuse)
    headline = dict(headline or {})
    checked, passed = evaluate_targets(headline, targets)
    doc: dict[str, Any] = {
        "benchmark": benchmark,
        "mode": mode,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_sha": git_sha(),
        "machine": machine_info(),
        "manifest": environment(model),
        "params": dict(params),
        **headline,
        "results": dict(results),
        "targets": checked,
        "passed": passed,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return doc


def _refuse(reason: str) -> None:
    raise ValueError(reason)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned numbers (floats to 3 significant digits, or thousands-separated)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in text]
    return "\n".join(lines)


# -- smoke mode of the benchmarks made of whole `streamrl up` runs -------------------------------------------------


class RecordedRun:
    """The smoke mode of a benchmark made of whole ``streamrl up`` runs (minutes each, several per benchmark).

    Every ``up`` command line the benchmark would start is checked by streamrl's own config loader with the root's
    cross-role rules (a renamed or refused field fails the smoke run, naming it), and instead of starting it, the
    run directory of one real short ``up`` run recorded beforehand (``--from-run``) is copied where the benchmark
    expected its run: the benchmark's own analysis then reads real files (summary.json, metrics, the archive, the
    run's Redis). What is not exercised is the launch itself and the numbers: a smoke result is no measurement."""

    def __init__(self, recorded: Path) -> None:
        self.recorded = Path(recorded)
        summary = self.recorded / "summary.json"
        if not summary.is_file():
            raise SystemExit(f"--from-run {recorded}: no summary.json there (a finished `streamrl up` run?)")

    def model(self) -> Path:
        """The recorded run's model, which stands for the warm-started one (no build in smoke mode)."""
        import tomllib

        config = tomllib.loads((self.recorded / "config.toml").read_text())
        return Path(config["shared"]["model_path"])

    def check(self, argv: Sequence[str]) -> None:
        """Validate ``argv`` (``streamrl up``'s arguments, with or without the ``python -m streamrl up`` prefix)."""
        from common.configlib import ConfigError
        from streamrl.cli import _resume_args
        from streamrl.config import load

        args = list(argv)
        if "up" in args and args.index("up") < 4:  # drop `python -m streamrl up`
            args = args[args.index("up") + 1 :]
        try:
            load(_resume_args("up", args))  # `--resume RUN_DIR`: that run's config.toml, then the overrides
        except ConfigError as exc:
            raise SystemExit(f"smoke: a command line this benchmark runs is refused: {exc}") from None

    def answer(self, argv: Sequence[str], run_dir: Path) -> dict[str, Any]:
        """Check ``argv``, put the recorded run at ``run_dir`` and return its summary.json."""
        import shutil

        self.check(argv)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        shutil.copytree(self.recorded, run_dir, symlinks=True, copy_function=self._copy_or_link)
        return json.loads((run_dir / "summary.json").read_text())

    def _copy_or_link(self, src: str, dst: str) -> None:
        """Weights (checkpoints, exports: two thirds of a run's bytes) are only read: hard-linked. Everything
        else is copied, since an analysis may write to it (an audit restarts the run's Redis on its AOF)."""
        import shutil

        part = Path(src).relative_to(self.recorded).parts[0]
        if part in ("checkpoints", "export"):
            try:
                os.link(src, dst)
                return
            except OSError:  # another file system
                pass
        shutil.copy2(src, dst)


# Set by a benchmark's --smoke --from-run (benchmarks.async_vs_sync.run_up and the benchmarks' own launches read it).
SMOKE_RUN: list[RecordedRun] = []


def add_recorded_run_flags(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """``--quick``, ``--smoke`` and ``--from-run`` of a benchmark made of ``up`` runs; :func:`recorded_run_of`."""
    add_mode_flags(parser, quick_help)
    parser.add_argument(
        "--from-run",
        type=Path,
        help="--smoke: a finished `streamrl up` run directory that stands for every run (see RecordedRun)",
    )


def recorded_run_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RecordedRun | None:
    """The smoke mode's recorded run (also installed for :data:`SMOKE_RUN`), or None outside smoke mode."""
    if mode_of(parser, args) != "smoke":
        if getattr(args, "from_run", None) is not None:
            parser.error("--from-run is only for --smoke")
        return None
    if args.from_run is None:
        parser.error("--smoke needs --from-run (a finished `streamrl up` run directory)")
    run = RecordedRun(args.from_run)
    SMOKE_RUN[:] = [run]
    return run


def smoke_run() -> RecordedRun | None:
    """The installed recorded run when a benchmark runs in smoke mode."""
    return SMOKE_RUN[0] if SMOKE_RUN else None
