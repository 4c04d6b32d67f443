"""Asynchronous against synchronous: the same `streamrl up` run (model, task, samples, steps, processes and thread
counts) with eta = 0 (generation waits for training and the reverse) and with eta = 1, 2 and 4; only eta changes.

    python -m benchmarks.async_vs_sync --quick --out FILE

Per eta: wall time of the training phase (first rollout request to the last step; held-out evaluation is outside
it), held-out greedy accuracy reached, mean staleness, and ``speedup`` = wall(eta=0) / wall(eta). From the
synchronous run, ``ideal_speedup`` = (t_gen + t_train) / max(t_gen, t_train), with t_gen the learner's total wait
for data and t_train its total training time. Target: speedup at eta = 2 >= 0.8 x ideal, reward no worse beyond noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import write_result

ETAS = (0, 1, 2, 4)


def run_up(run_dir: Path, eta: int, steps: int, model: Path) -> dict:
    args = [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.eta={eta}",
        f"--shared.model_path={model}", f"--learner.max_steps={steps}", "--learner.wandb_mode=disabled",
        "--dashboard.port=0", "--dashboard.metrics_base_port=0", "--eval.every_versions=1000000",
        "--up.status_interval_s=30",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"eta={eta}: streamrl up failed:\n{proc.stdout[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="15 steps per eta (about 10 minutes in all)")
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (default 15 quick, 60 full)"
    )
    parser.add_argument("--out", type=Path, required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    steps = args.steps or (15 if args.quick else 60)
    from rollout_fleet.warmstart import init_warm_model

    model = init_warm_model()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as tmp:
        for eta in ETAS:
            print(f"eta={eta}: {steps} steps ...", flush=True)
            s = run_up(Path(tmp) / f"eta{eta}", eta, steps, model)
            runs[str(eta)] = {
                "wall_seconds": s["training_wall_seconds"],
                "eval_reward": s["eval_reward_after"],
                "eval_reward_before": s["eval_reward_before"],
                "mean_staleness": s["mean_staleness"],
                "learner_wait_seconds": s["learner_wait_seconds"],
                "learner_train_seconds": s["learner_train_seconds"],
            }
            print(f"  wall {s['training_wall_seconds']:.1f} s, held-out {s['eval_reward_after']:.3f}, "
                  f"staleness {s['mean_staleness']:.2f}", flush=True)  # fmt: skip
    sync = runs["0"]
    for r in runs.values():
        r["speedup"] = sync["wall_seconds"] / r["wall_seconds"]
    t_gen, t_train = sync["learner_wait_seconds"], sync["learner_train_seconds"]
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup_2 = runs["2"]["speedup"]
    headline = {
        "speedup": speedup_2,
        "ideal_speedup": ideal,
        "speedup_over_ideal": speedup_2 / ideal,
        "reward_eta2_minus_eta0": runs["2"]["eval_reward"] - sync["eval_reward"],
    }
    doc = write_result(
        args.out,
        benchmark="async_vs_sync",
        mode="quick" if args.quick else "full",
        params={"steps": steps, "etas": list(ETAS), "model": str(model)},
        results={"etas": runs},
        targets={"speedup_over_ideal": (">=", 0.8), "reward_eta2_minus_eta0": (">=", -0.05)},
        headline=headline,
    )
    passed = doc["passed"]
    print(f"speedup at eta=2: {speedup_2:.2f} (ideal {ideal:.2f}); passed: {passed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
