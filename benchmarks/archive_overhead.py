"""What the trajectory archive costs and holds: the same `streamrl up` with the archiver on and off.

    python -m benchmarks.archive_overhead --quick --out FILE     # 2 pairs of 15-step runs
    python -m benchmarks.archive_overhead --out FILE             # 4 pairs of 30-step runs
    python -m benchmarks.archive_overhead --smoke --from-run RUN_DIR --out FILE --work DIR   # no run started

Each pair runs the default recipe (warm-started model, eta 1) once with ``archive.enabled`` and once without, in
alternating order (on-off, off-on, ...) so a drift of the machine does not favour one side. Measured per run:
the learner's seconds per step (its training time, summary.json ``learner_train_seconds`` / steps: the
archiver must not slow the learner) and its step wall time (waiting for data included). With the archiver on,
also: the archiver's own CPU seconds (summary.json ``archive.cpu_s``) as a share of the cores' time while
training ran, archive rows (parts plus the pending snapshot) against the samples generated into the stream (summary
``audit.produced`` x group size), and the archive's bytes per sample.

Headline numbers (declared before any run): ``ratio_learner_step_seconds_on_vs_off`` = mean learner seconds per
step over the runs with the archive / over the runs without (target <= 1.05), the per-pair ratios beside it;
``archive_rows_equal_samples_generated`` (every on-run); ``archive_bytes_per_sample``. Beside them:
``ratio_per_pair_stderr`` (the noise) and ``archiver_cpu_share``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync import run_up
from benchmarks.common import add_recorded_run_flags, mode_of, recorded_run_of, work_of, write_result

# smoke: 2 pairs, both orders and the per-pair noise
MODES = {
    "smoke": {"pairs": 2, "steps": 2},
    "quick": {"pairs": 2, "steps": 15},
    "full": {"pairs": 4, "steps": 30},
}
GROUP_SIZE = 8  # the default recipe's samples per prompt


def archive_figures(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Rows in the archive (parts + pending snapshot) against the samples the run produced, and bytes/sample."""
    from archiver.archive import PENDING_FILE, part_paths, read_archive

    directory = run_dir / "archive"
    rows = read_archive(directory, include_pending=True, columns=["group_id"]).num_rows
    part_rows = read_archive(directory, columns=["group_id"]).num_rows
    part_bytes = sum(p.stat().st_size for p in part_paths(directory))
    produced = summary["audit"]["produced"] * GROUP_SIZE
    return {
        "archive_rows": rows,
        "archive_pending_rows": rows - part_rows,
        "samples_generated": produced,
        "rows_equal_generated": rows == produced,
        "archive_part_bytes": part_bytes,
        "bytes_per_sample": part_bytes / part_rows if part_rows else None,
        "pending_file": (directory / PENDING_FILE).is_file(),
    }


def one(run_dir: Path, steps: int, model: Path, archive: bool) -> dict[str, Any]:
    summary = run_up(run_dir, 1, steps, model, seed=0, extra=[f"--archive.enabled={str(archive).lower()}"])
    out = {
        "archive": archive,
        "learner_step_seconds": summary["learner_train_seconds"] / summary["steps"],
        "step_wall_seconds": (summary["learner_train_seconds"] + summary["learner_wait_seconds"])
        / summary["steps"],
        "steps": summary["steps"],
    }
    if archive:
        out.update(archive_figures(run_dir, summary))
        # the archiver's own CPU time (to its stop), against what the machine's cores offered while training ran
        cpu_s = summary["archive"]["cpu_s"]
        out["archiver_cpu_seconds"] = cpu_s
        out["archiver_cpu_share"] = cpu_s / (summary["training_wall_seconds"] * (os.cpu_count() or 1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recorded_run_flags(parser, "2 pairs of 15-step runs (about 8 minutes)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument(
        "--work", type=Path, help="run directories (default: a temporary one; --smoke: required)"
    )
    args = parser.parse_args(argv)
    recorded = recorded_run_of(parser, args)
    mode = mode_of(parser, args)
    pairs, steps = MODES[mode]["pairs"], MODES[mode]["steps"]
    if recorded is not None:
        model = recorded.model()
    else:
        from streamrl.warm_start import init_warm_model

        model = init_warm_model()
    work = work_of(parser, args, None) or Path(tempfile.mkdtemp(prefix="archive-overhead-"))
    runs: list[dict[str, Any]] = []
    for pair in range(pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for archive in order:
            r = one(work / f"pair{pair}-{'on' if archive else 'off'}", steps, model, archive)
            r["pair"] = pair
            runs.append(r)
            print(f"pair {pair} archive {'on ' if archive else 'off'}: {r['learner_step_seconds']:.3f} s/step"
                  + (f", rows {r['archive_rows']} / generated {r['samples_generated']}" if archive else ""),
                  flush=True)  # fmt: skip
    on = [r for r in runs if r["archive"]]
    off = [r for r in runs if not r["archive"]]
    ratio = statistics.fmean(r["learner_step_seconds"] for r in on) / statistics.fmean(
        r["learner_step_seconds"] for r in off
    )
    per_pair = [
        next(r for r in on if r["pair"] == p)["learner_step_seconds"]
        / next(r for r in off if r["pair"] == p)["learner_step_seconds"]
        for p in range(pairs)
    ]
    headline = {
        "ratio_learner_step_seconds_on_vs_off": ratio,
        "ratio_per_pair": per_pair,
        "archive_rows_equal_samples_generated": all(r["rows_equal_generated"] for r in on),
        "archive_bytes_per_sample": statistics.fmean(r["bytes_per_sample"] for r in on),
        "archiver_cpu_share": statistics.fmean(r["archiver_cpu_share"] for r in on),
        # the noise: the standard error of the per-pair ratios (a pair's two runs share the machine's state)
        "ratio_per_pair_stderr": statistics.stdev(per_pair) / len(per_pair) ** 0.5 if pairs > 1 else None,
    }
    doc = write_result(
        args.out, "archive_overhead", mode, {"pairs": pairs, "steps": steps, "eta": 1, "group_size": GROUP_SIZE},
        {"runs": runs}, {"ratio_learner_step_seconds_on_vs_off": ("<=", 1.05)}, headline, model=model,
    )  # fmt: skip
    print(f"ratio {ratio:.3f} (pairs {', '.join(f'{x:.3f}' for x in per_pair)}), rows equal generated: "
          f"{headline['archive_rows_equal_samples_generated']}, {headline['archive_bytes_per_sample']:.0f} B/sample, "
          f"passed: {doc['passed']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
