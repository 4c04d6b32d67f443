"""Asynchronous against synchronous: the same `streamrl up` run (model, task, samples, steps, processes and thread
counts) with eta = 0 (generation waits for training and the reverse) and with eta = 1, 2 and 4; only eta changes.

    python -m benchmarks.async_vs_sync --quick --out FILE

Per eta: wall time of the training phase (the learner's loop from its first request for data to the last step;
held-out evaluation is outside it; process start-up is reported apart as ``process_wall_seconds``), held-out greedy accuracy reached, mean staleness, and ``speedup`` = wall(eta=0) / wall(eta). From the
synchronous run, ``ideal_speedup`` = (t_gen + t_train) / max(t_gen, t_train), with t_gen the learner's total wait
for data and t_train its total training time. Target: speedup at eta = 2 >= 0.8 x ideal, reward no worse beyond noise.

Placement: the engines are pinned to the first half of the cores and the learner ranks to the second half
(``--placement split``, the default), the CPU stand-in for separate rollout and training GPUs, which is the
deployment asynchrony is for. With ``--placement shared`` every process floats over every core: then the
synchronous run already keeps all cores busy in each phase and overlap has nothing to win (reported, not a
target).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    add_recorded_run_flags,
    mode_of,
    recorded_run_of,
    smoke_run,
    write_result,
)
from benchmarks.plot import figure, line_chart

ETAS = (0, 1, 2, 4)


PLACEMENTS = ("split", "shared", "rollout_heavy")


def placement_args(placement: str) -> list[str]:
    """Engine and learner core sets: ``split`` gives the engines the first half of the cores and the learner
    the rest; ``rollout_heavy`` gives the engines every core and the learner only the last one (a rollout fleet
    with more capacity than the trainer: generation runs ahead until the staleness bound stops it); ``shared``
    pins nothing."""
    if placement == "shared":
        return []
    if placement not in PLACEMENTS:
        raise SystemExit(f"--placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"--placement {placement} needs at least 2 cores; use --placement shared")
    half = len(cores) // 2
    engines = cores if placement == "rollout_heavy" else cores[:half]
    learner = cores[-1:] if placement == "rollout_heavy" else cores[half:]
    return [
        f"--engine.cpu_affinity={json.dumps(engines)}",
        f"--learner.cpu_affinity={json.dumps(learner)}",
    ]


def run_up(
    run_dir: Path,
    eta: int,
    steps: int,
    model: Path,
    seed: int,
    placement: str = "split",
    extra: Sequence[str] = (),
) -> dict:
    """One `streamrl up` run; ``extra`` overrides come last. Returns its summary.json."""
    args = [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.eta={eta}",
        f"--shared.model_path={model}", f"--learner.max_steps={steps}", "--learner.wandb_mode=disabled",
        f"--learner.seed={seed}", f"--rollout.shuffle_seed={seed}",
        "--dashboard.port=0", "--dashboard.metrics_base_port=0", "--eval.every_versions=1000000",
        "--up.status_interval_s=30", *placement_args(placement), *extra,
    ]  # fmt: skip
    recorded = smoke_run()
    if recorded is not None:
        return recorded.answer(args, run_dir)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"eta={eta}: streamrl up failed:\n{proc.stdout[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def one_run(summary: dict) -> dict:
    return {
        # The learner's loop (waiting for data + training), first request for data to the last step: process
        # start-up (imports, model load) is the same for every eta and would only dilute the ratio.
        "wall_seconds": summary["learner_wait_seconds"] + summary["learner_train_seconds"],
        "process_wall_seconds": summary["training_wall_seconds"],
        "eval_reward": summary["eval_greedy_accuracy_after"],
        "eval_reward_before": summary["eval_greedy_accuracy_before"],
        "eval_sampled": summary["eval_sampled_accuracy_after"],
        "mean_staleness": summary["mean_staleness"],
        "learner_wait_seconds": summary["learner_wait_seconds"],
        "learner_train_seconds": summary["learner_train_seconds"],
    }


def aggregate(per_seed: list[dict]) -> dict:
    """Means over seeds, with the reward's spread (min, max) so 'no worse beyond noise' can be read off."""
    mean = {k: statistics.fmean(r[k] for r in per_seed) for k in per_seed[0]}
    rewards = [r["eval_reward"] for r in per_seed]
    return {**mean, "eval_reward_min": min(rewards), "eval_reward_max": max(rewards), "seeds": per_seed}


def plot(path: Path, runs: dict[str, dict]) -> None:
    etas = sorted(runs, key=int)
    charts = [
        line_chart(
            {"speedup": [(int(e), runs[e]["speedup"]) for e in etas]}, "speedup over eta = 0", "eta", "x"
        ),
        line_chart(
            {
                "mean": [(int(e), runs[e]["eval_reward"]) for e in etas],
                "min": [(int(e), runs[e]["eval_reward_min"]) for e in etas],
                "max": [(int(e), runs[e]["eval_reward_max"]) for e in etas],
            },
            "held-out greedy accuracy reached",
            "eta",
            "accuracy",
            (0, 1),
        ),
    ]
    path.write_text(figure(charts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recorded_run_flags(parser, "15 steps per eta, one seed (about 10 minutes)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (15 quick, 40 full)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per eta (1 quick, 2 full)")
    parser.add_argument(
        "--placement", choices=("split", "shared"), default="split",
        help="split: engines and learner on disjoint cores (default); shared: every process on every core",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, required=True, help="result JSON (an SVG plot is written beside it)"
    )
    args = parser.parse_args(argv)
    recorded = recorded_run_of(parser, args)
    mode = mode_of(parser, args)
    steps = args.steps or {"smoke": 2, "quick": 15, "full": 40}[mode]
    seeds = args.seeds or (2 if mode == "full" else 1)
    if recorded is not None:
        model = recorded.model()
    else:
        from streamrl.warm_start import init_warm_model

        model = init_warm_model()
    per_eta: dict[str, list[dict]] = {str(eta): [] for eta in ETAS}
    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as tmp:
        for seed in range(seeds):
            for eta in ETAS:
                print(f"seed {seed} eta={eta}: {steps} steps ...", flush=True)
                r = one_run(run_up(Path(tmp) / f"s{seed}-eta{eta}", eta, steps, model, seed, args.placement))
                per_eta[str(eta)].append(r)
                print(f"  wall {r['wall_seconds']:.1f} s, held-out {r['eval_reward']:.3f}, "
                      f"staleness {r['mean_staleness']:.2f}", flush=True)  # fmt: skip
    runs = {eta: aggregate(rs) for eta, rs in per_eta.items()}
    sync = runs["0"]
    for r in runs.values():
        r["speedup"] = sync["wall_seconds"] / r["wall_seconds"]
    t_gen, t_train = sync["learner_wait_seconds"], sync["learner_train_seconds"]
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup_2 = runs["2"]["speedup"]
    noise = max(0.05, sync["eval_reward_max"] - sync["eval_reward_min"])
    headline = {
        "speedup": speedup_2,
        "ideal_speedup": ideal,
        "speedup_over_ideal": speedup_2 / ideal,
        "reward_eta2_minus_eta0": runs["2"]["eval_reward"] - sync["eval_reward"],
        "reward_noise": noise,
        "reward_margin_over_noise": runs["2"]["eval_reward"] - sync["eval_reward"] + noise,
    }
    doc = write_result(
        args.out,
        benchmark="async_vs_sync",
        mode=mode,
        params={
            "steps": steps,
            "seeds": seeds,
            "placement": args.placement,
            "etas": list(ETAS),
            "model": str(model),
        },
        results={"etas": runs},
        targets={"speedup_over_ideal": (">=", 0.8), "reward_margin_over_noise": (">=", 0.0)},
        headline=headline,
        model=model,
    )
    plot(args.out.with_suffix(".svg"), runs)
    print(f"speedup at eta=2: {speedup_2:.2f} (ideal {ideal:.2f}); passed: {doc['passed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
