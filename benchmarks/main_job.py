"""The main job's learning: `make run`'s `streamrl up` (the embedded default, 200 steps) over several seeds, held-out
greedy accuracy on 1,000 problems after the final policy, and the training wall time.

    python -m benchmarks.main_job --quick --out FILE      # one seed
    python -m benchmarks.main_job --out FILE              # three seeds
    python -m benchmarks.main_job --out FILE --extra=--learner.lr=2e-4   # a candidate recipe
    python -m benchmarks.main_job --smoke --from-run RUN_DIR --out FILE --work DIR   # 2 steps, no run started

Aim (issue 18): >= 0.85 within 300 s of training on 2 cores. ``training_wall_seconds`` is the learner's loop,
from its first request for data to its last step (process start-up and the evaluations are outside it).
Processes float over every core, as under `make run` (no pinning).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.async_vs_sync import run_up
from benchmarks.common import add_recorded_run_flags, mode_of, recorded_run_of, work_of, write_result
from benchmarks.staleness_ablation import HELDOUT, cell_stats

STEPS = 200  # make run's RUN_ARGS
WORK = Path("runs/main_job")
ETA = 1  # the embedded default's shared.eta


def _greedy_buckets(buckets: dict) -> dict:
    return {b: {"greedy": v.get("greedy"), "n": int(v.get("n", 0))} for b, v in buckets.items()}


def _one_run(s: dict) -> dict:
    """One run's figures from its summary.json."""
    return {
        "eval_reward": s["eval_greedy_accuracy_after"],
        "eval_reward_before": s["eval_greedy_accuracy_before"],
        "eval_sampled": s["eval_sampled_accuracy_after"],
        "training_wall_seconds": s["learner_wait_seconds"] + s["learner_train_seconds"],
        "process_wall_seconds": s["wall_seconds"],
        "mean_staleness": s["mean_staleness"],
        "samples_trained": s["samples_trained"],
        # Held-out greedy accuracy per digit bucket, before and after ({"digits=3": {"greedy", "n"}}).
        "buckets_before": _greedy_buckets(s.get("eval_buckets_before", {})),
        "buckets_after": _greedy_buckets(s.get("eval_buckets_after", {})),
    }


def _ceiling(runs: list[dict], stuck_below: float = 0.1) -> dict:
    """The accuracy reachable if the buckets the final policies barely solve (greedy below ``stuck_below`` after,
    every seed) stay where they are and every other bucket were solved perfectly (per run, then the mean)."""
    if not runs or not runs[0]["buckets_after"]:
        return {}
    stuck = [
        b
        for b in runs[0]["buckets_after"]
        if all((r["buckets_after"].get(b, {}).get("greedy") or 0) < stuck_below for r in runs)
    ]
    per_run = []
    for r in runs:
        buckets = r["buckets_after"]
        total = sum(v["n"] for v in buckets.values())
        reach = sum(v["n"] * (v["greedy"] if b in stuck else 1.0) for b, v in buckets.items())
        per_run.append(reach / total)
    return {
        "stuck_buckets": stuck,
        "stuck_below": stuck_below,
        "stuck_share": sum(v["n"] for b, v in runs[0]["buckets_after"].items() if b in stuck)
        / sum(v["n"] for v in runs[0]["buckets_after"].values()),
        "ceiling_if_stuck_stay": statistics.fmean(per_run),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recorded_run_flags(parser, "one seed (about 7 minutes)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--seeds", type=int, help="seeds (1 quick and smoke, 3 full)")
    parser.add_argument("--steps", type=int, help=f"learner steps (make run: {STEPS}; smoke: 2)")
    parser.add_argument("--work", type=Path, help=f"run directories (default {WORK}; --smoke: required)")
    parser.add_argument("--extra", action="append", default=[], help="one more override for every run")
    args = parser.parse_args(argv)
    recorded = recorded_run_of(parser, args)
    mode = mode_of(parser, args)
    work = work_of(parser, args, WORK)
    seeds = args.seeds or (3 if mode == "full" else 1)
    steps = args.steps or (2 if mode == "smoke" else STEPS)
    if recorded is not None:
        model = recorded.model()
    else:
        from streamrl.warm_start import init_warm_model

        model = init_warm_model()
    heldout = [f"--rollout.task.heldout_size={HELDOUT}", f"--eval.heldout_prompts={HELDOUT}"]
    runs = []
    for seed in range(seeds):
        print(f"seed {seed}: {steps} steps ...", flush=True)
        run_dir = work / f"s{seed}-{len(list(work.glob(f's{seed}-*')))}"
        s = run_up(run_dir, ETA, steps, model, seed, "shared", [*heldout, *args.extra])
        if not s.get("eval_after_is_final_policy"):
            raise RuntimeError(f"seed {seed}: the 'after' evaluation is not of the final policy: {s}")
        runs.append(_one_run(s))
        print(
            f"  held-out {runs[-1]['eval_reward']:.3f} after {runs[-1]['training_wall_seconds']:.0f} s",
            flush=True,
        )
    cell = cell_stats([r["eval_reward"] for r in runs], HELDOUT)
    ceiling = _ceiling(runs)
    wall = statistics.fmean(r["training_wall_seconds"] for r in runs)
    doc = write_result(
        args.out,
        benchmark="main_job",
        mode=mode,
        params={
            "steps": steps,
            "seeds": seeds,
            "eta": ETA,
            "heldout_problems": HELDOUT,
            "extra": args.extra,
            "model": str(model),
        },  # fmt: skip
        results={"runs": runs, "heldout_greedy": cell, "training_wall_seconds": wall, "ceiling": ceiling},
        targets={"heldout_greedy_mean": (">=", 0.85), "training_wall_seconds": ("<=", 300.0)},
        headline={
            "heldout_greedy_mean": cell["mean"],
            "heldout_greedy_se": cell["se"],
            "training_wall_seconds": wall,
        },  # fmt: skip
        model=model,
    )
    print(f"held-out greedy {cell['mean']:.3f} +- {cell['se']:.3f} in {wall:.0f} s; passed: {doc['passed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
