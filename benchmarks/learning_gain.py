"""The distribution of the learning gain that ``tests/test_up.py`` asserts, so its threshold is sized from data.

    python -m benchmarks.learning_gain --runs 10 --out FILE                  # the correct learner
    python -m benchmarks.learning_gain --runs 3 --broken lr0 --out FILE      # learning rate ~0
    python -m benchmarks.learning_gain --runs 3 --broken inverted --out FILE # advantages of the wrong sign
    python -m benchmarks.learning_gain --colocated --runs 10 --out FILE      # tests/test_colocated_up.py's run
    python -m benchmarks.learning_gain --smoke --from-run RUN_DIR --out FILE # 5 runs of 2 steps, none started

Each run is the test's own ``streamrl up`` (:data:`RUN_ARGS`, :data:`STEPS` steps on the warm-started tiny model,
eta 1, the default 200 held-out problems). Two statistics per run: the final gain (held-out greedy accuracy of
the final policy minus that of the warm start), which tests/test_up.py asserts, and the best gain (the best
evaluation of a trained policy minus before: ``summary.json``'s ``eval_best_greedy``), reported beside it. The
final evaluation is of one fixed version, the last; the live evaluations between run on a clock, so a loaded
machine evaluates fewer versions and the best of them depends on the load. ``late_falls`` counts runs whose final
evaluation is 0.1 or more below their best. The result records every run, the mean and standard deviation of
both statistics and the threshold a correct system passes with probability at least 1 - 1/1000 under a normal fit
(mean - 3.09 sd) and under a Student t prediction interval for one more run (wider: the sd is estimated from few
runs). ``--load`` runs everything beside benchmarks.load's SuiteLoad, a slice of the test suite in a loop, as
the test meets it inside ``make test``. ``--colocated`` runs tests/test_colocated_up.py's run instead: the same
steps with :data:`COLOCATED_ARGS` (engines on the learner's devices, eta 0, weights by handle) and the kill -9s of
:data:`COLOCATED_KILLS` at their steps, so its bound comes from runs that met the same faults. A broken learner must fail the test's threshold in every run: ``lr0``
trains at learning rate 1e-12 (0 is refused by the config), ``inverted`` rewards wrong answers (the task's reward
r becomes 1.1 - r, so every advantage changes sign).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (
    SMOKE_HELP,
    one_in_a_thousand,
    recorded_run_of,
    smoke_run,
    write_partial,
    write_result,
)
from benchmarks.load import SuiteLoad
from rollout_fleet.tasks import Prompt, RewardResult

STEPS = 40
SMOKE_STEPS = 2
SMOKE_RUNS = 5  # the fewest with the Student t bound (one_in_a_thousand)


def run_args(steps: int) -> list[str]:
    """The run's settings besides the model, the run directory and the ports, for ``steps`` learner steps."""
    return [
        "--learner.wandb_mode=disabled", "--learner.checkpoint_every=5", "--up.status_interval_s=5",
        f"--learner.max_steps={steps}", "--learner.keep_checkpoints=100", f"--learner.snapshot_every={steps // 2}",
    ]  # fmt: skip


RUN_ARGS = run_args(STEPS)  # tests/test_up.py uses exactly these
BROKEN = {
    "lr0": ["--learner.lr=1e-12"],
    "inverted": ["--rollout.reward.function=benchmarks.learning_gain:inverted_reward"],
}


# tests/test_colocated_up.py: one colocated run that must learn and lose nothing across these kills.
COLOCATED_ARGS = [
    "--shared.placement=colocated", "--shared.eta=0", "--eval.every_versions=0",
]  # fmt: skip
COLOCATED_KILLS = ((4, "engine-0"), (8, "learner-rank-1"))  # (learner step, process) killed with SIGKILL


def inverted_reward(prompt: Prompt, completion: str) -> RewardResult:
    """The arithmetic task's reward turned upside down (1.1 - r): the learner is pushed away from right answers."""
    from rollout_fleet.tasks.arithmetic import score_completion

    scored = score_completion(prompt.answer, completion)
    return RewardResult(reward=1.1 - scored.reward, components=scored.components)


LATE_FALL = 0.1  # a final evaluation this far below the run's best counts as a late fall


def start_and_wait(args: list[str], run_dir: Path, kills: tuple[tuple[int, str], ...]) -> dict:
    """Run ``streamrl up`` (``args``), with ``kills`` at their steps; returns its summary.json."""
    recorded = smoke_run()
    if recorded is not None:  # smoke: no process started, so no step to wait for and nothing to kill
        return recorded.answer(args, run_dir)
    from benchmarks.crash_cost import kill, wait_for_step

    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for step, target in kills:
            wait_for_step(run_dir, step, proc)
            kill(run_dir, target)
        out, _ = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"streamrl up failed:\n{out[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def run_once(
    run_dir: Path,
    model: Path,
    extra: list[str],
    kills: tuple[tuple[int, str], ...] = (),
    steps: int = STEPS,
) -> dict:
    args = [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.model_path={model}",
        "--dashboard.port=0", "--dashboard.metrics_base_port=0", *run_args(steps), *extra,
    ]  # fmt: skip
    summary = start_and_wait(args, run_dir, kills)
    return {
        "before": summary["eval_greedy_accuracy_before"],
        "after": summary["eval_greedy_accuracy_after"],
        "gain": summary["eval_greedy_accuracy_after"] - summary["eval_greedy_accuracy_before"],
        "best": summary["eval_best_greedy"],
        "best_version": summary["eval_best_version"],
        "best_gain": summary["eval_best_greedy"] - summary["eval_greedy_accuracy_before"],
        "eval_version_after": summary["eval_version_after"],
        "evaluations": summary.get("eval_trained_count"),
        "stale_fraction": summary["audit"]["dropped_by_reason"].get("stale", 0)
        / max(1, summary["audit"]["generated"]),
        "wall_seconds": summary["wall_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.learning_gain",
        description=__doc__.split("\n")[0],
        epilog="Any other --section.field=value is passed to streamrl up (an ablation of the test's run).",
    )
    parser.add_argument(
        "--runs", type=int, help=f"Runs of the test's configuration (default 10; smoke: {SMOKE_RUNS})."
    )
    parser.add_argument("--broken", choices=sorted(BROKEN), help="Run a learner that cannot learn instead.")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="tests/test_colocated_up.py's run: colocated at eta 0, with its kill -9s (COLOCATED_KILLS).",
    )
    parser.add_argument("--out", type=Path, required=True, help="Result JSON.")
    parser.add_argument(
        "--load",
        action="store_true",
        help="Run beside a slice of the test suite in a loop (benchmarks.load).",
    )
    parser.add_argument(
        "--smoke", action="store_true", help=f"{SMOKE_RUNS} runs of {SMOKE_STEPS} steps: {SMOKE_HELP}"
    )
    parser.add_argument(
        "--from-run",
        type=Path,
        help="--smoke: a finished `streamrl up` run directory that stands for every run",
    )
    args, up_options = parser.parse_known_args(argv)
    if any(not o.startswith("--") or "=" not in o for o in up_options):
        parser.error(f"{up_options}: other options go to streamrl up, each as --section.field=value")
    if args.runs is not None and args.runs < 1:
        parser.error(f"--runs = {args.runs}: must be >= 1")
    recorded = recorded_run_of(parser, args)
    args.runs = args.runs or (SMOKE_RUNS if recorded else 10)
    steps = SMOKE_STEPS if recorded else STEPS
    if recorded is not None:
        model = recorded.model()
    else:
        from streamrl.warm_start import init_warm_model

        model = init_warm_model()
    extra = BROKEN.get(args.broken or "", []) + (COLOCATED_ARGS if args.colocated else []) + up_options
    kills = COLOCATED_KILLS if args.colocated else ()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="learning-gain-") as tmp:
        load = SuiteLoad(Path(tmp) / "load") if args.load else contextlib.nullcontext()
        with load:
            for i in range(args.runs):
                run = run_once(Path(tmp) / f"run-{i}", model, extra, kills, steps)
                runs.append(run)
                print(
                    f"run {i + 1}/{args.runs}: {run['before']:.3f} -> {run['after']:.3f} (gain "
                    f"{run['gain']:+.3f}), best {run['best']:.3f} at version {run['best_version']:.0f} (gain "
                    f"{run['best_gain']:+.3f}), {run['evaluations']} evaluations, {run['wall_seconds']:.0f} s",
                    flush=True,
                )
                write_partial(args.out, runs)
    load_stats = load.stats() if isinstance(load, SuiteLoad) else None
    headline = {
        **one_in_a_thousand("gain", [r["gain"] for r in runs]),
        **one_in_a_thousand("best_gain", [r["best_gain"] for r in runs]),
        "late_falls": sum(1 for r in runs if r["best"] - r["after"] >= LATE_FALL),
    }
    variant = (args.broken or "correct") + (" colocated" if args.colocated else "")
    write_result(
        args.out, "learning_gain", "smoke" if recorded else variant,
        {"runs": args.runs, "steps": steps, "run_args": run_args(steps) + extra, "kills": kills, "load": load_stats},
        {"runs": runs}, {}, headline,
        model=model,
    )  # fmt: skip
    print(json.dumps(headline, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
