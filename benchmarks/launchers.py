"""What the Ray launcher costs: the same `streamrl up` under the local supervisor and under `--up.launcher=ray`.

    python -m benchmarks.launchers --quick --out FILE     # 2 pairs of 15-step runs
    python -m benchmarks.launchers --out FILE             # 4 pairs of 30-step runs
    python -m benchmarks.launchers --smoke --from-run RUN --out FILE --work DIR   # 1 pair, answered by RUN

Each pair runs the default recipe (warm-started model, eta 1, benchmarks.async_vs_sync.run_up: engines and learner
on their own halves of the cores) once with each launcher, in alternating order (local-ray, ray-local, ...) so a
drift of the machine favours neither. The Ray runs join a one-node Ray cluster this benchmark starts
(ray.cluster_utils, no dashboard, a small object store) and keep its head processes (GCS, raylet) running beside
the roles, as a cluster would; the cluster's start is not counted, the actors' start is (it is part of `up`).

Measured per run: the learner's seconds per step, its loop (waiting for data and training: summary.json
``learner_wait_seconds + learner_train_seconds``) over the steps, and its training time alone; ``up``'s wall
time. Headline (declared before any run): ``ratio_ray_vs_local`` = mean seconds per learner step under Ray / under
the local supervisor (target <= 1.1), the per-pair ratios beside it.

``--smoke`` (benchmarks.common.RecordedRun): one pair of 2-step runs, each command line checked and answered by
the recorded run; the Ray cluster is started as in the other modes (nothing joins it).

Without ``--work`` the run directories go to a temporary directory, removed at the end (also on an error).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync import run_up
from benchmarks.common import add_recorded_run_flags, check_smoke_path, mode_of, recorded_run_of, write_result

MODES = {
    "smoke": {"pairs": 1, "steps": 2},
    "quick": {"pairs": 2, "steps": 15},
    "full": {"pairs": 4, "steps": 30},
}
TARGET = 1.1


def one(run_dir: Path, steps: int, model: Path, launcher: str, address: str | None) -> dict[str, Any]:
    extra = [f"--up.launcher={launcher}"] + ([f"--ray.address={address}"] if launcher == "ray" else [])
    started = time.monotonic()
    summary = run_up(run_dir, 1, steps, model, seed=0, extra=extra)
    loop = summary["learner_train_seconds"] + summary["learner_wait_seconds"]
    return {
        "launcher": launcher,
        "seconds_per_step": loop / summary["steps"],
        "train_seconds_per_step": summary["learner_train_seconds"] / summary["steps"],
        "steps": summary["steps"],
        "up_wall_seconds": time.monotonic() - started,
        "audit_lost": summary["audit"]["lost"],
        "audit_trained_twice": summary["audit"]["trained_twice"],
    }


def run_pairs(work: Path, pairs: int, steps: int, model: Path) -> list[dict[str, Any]]:
    """``pairs`` pairs of runs, one under each launcher, in alternating order, beside a one-node Ray cluster."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 16, "object_store_memory": 100 * 1024**2, "include_dashboard": False},
    )
    runs: list[dict[str, Any]] = []
    try:
        for pair in range(pairs):
            order = ("local", "ray") if pair % 2 == 0 else ("ray", "local")
            for launcher in order:
                r = one(work / f"pair{pair}-{launcher}", steps, model, launcher, cluster.address)
                r["pair"] = pair
                runs.append(r)
                print(f"pair {pair} {launcher:<5}: {r['seconds_per_step']:.3f} s/step "
                      f"(training {r['train_seconds_per_step']:.3f}), up {r['up_wall_seconds']:.0f} s",
                      flush=True)  # fmt: skip
    finally:
        cluster.shutdown()
    return runs


@contextlib.contextmanager
def work_directory(work: Path | None) -> Iterator[Path]:
    """``--work`` as given (left in place), else a temporary directory removed afterwards, also on an error."""
    if work is not None:
        yield work
        return
    with tempfile.TemporaryDirectory(prefix="launchers-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recorded_run_flags(parser, "2 pairs of 15-step runs (about 8 minutes)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument(
        "--work", type=Path, help="run directories, kept (default: a temporary one, removed at the end)"
    )
    args = parser.parse_args(argv)
    recorded = recorded_run_of(parser, args)
    mode = mode_of(parser, args)
    if mode == "smoke" and args.work is not None:
        check_smoke_path(args.work, parser.error, "--work")
    pairs, steps = MODES[mode]["pairs"], MODES[mode]["steps"]
    if recorded is not None:
        model = recorded.model()
    else:
        from streamrl.warm_start import init_warm_model

        model = init_warm_model()
    with work_directory(args.work) as work:
        runs = run_pairs(work, pairs, steps, model)

    def mean(launcher: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs if r["launcher"] == launcher)

    def of(pair: int, launcher: str) -> dict[str, Any]:
        return next(r for r in runs if r["pair"] == pair and r["launcher"] == launcher)

    ratio = mean("ray", "seconds_per_step") / mean("local", "seconds_per_step")
    headline = {
        "ratio_ray_vs_local": ratio,
        "ratio_per_pair": [
            of(p, "ray")["seconds_per_step"] / of(p, "local")["seconds_per_step"] for p in range(pairs)
        ],
        "ratio_train_seconds_ray_vs_local": mean("ray", "train_seconds_per_step")
        / mean("local", "train_seconds_per_step"),
        "ratio_up_wall_ray_vs_local": mean("ray", "up_wall_seconds") / mean("local", "up_wall_seconds"),
        "nothing_lost": all(r["audit_lost"] == 0 and r["audit_trained_twice"] == 0 for r in runs),
    }
    doc = write_result(
        args.out, "launchers", mode,
        {"pairs": pairs, "steps": steps, "eta": 1, "ray_cluster": "one node, ray.cluster_utils, 16 logical CPUs"},
        {"runs": runs}, {"ratio_ray_vs_local": ("<=", TARGET)}, headline, model=model,
    )  # fmt: skip
    print(f"ratio_ray_vs_local {ratio:.3f} (pairs {', '.join(f'{x:.3f}' for x in headline['ratio_per_pair'])}), "
          f"passed: {doc['passed']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
