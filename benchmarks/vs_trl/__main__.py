"""The same GRPO experiment in TRL and in streamrl, on this machine, in one invocation.

    python -m benchmarks.vs_trl --quick --out FILE

Both sides start from the same warm-started tiny model and train on the same prompts (streamrl's hand-out order)
with the same group size, learning rate, temperature, max length and samples per step. TRL's GRPOTrainer
generates with transformers on the CPU (no vLLM) and uses every core in each phase; streamrl runs `streamrl up`
(one built-in engine, a rollout worker and a one-rank learner: ``deployment()``) at eta = 0 and at its default eta.

TRL trains ``--steps``; streamrl trains ``--streamrl-steps`` (1.5 x as many by default), because the question is
how long streamrl takes to REACH TRL's final reward: a run cut at TRL's step count reaches it only where it also
beats TRL per sample, a coin flip for two implementations of one update. streamrl's reward at TRL's sample count
is reported beside it (``streamrl_reward_at_trl_samples``), so the per-sample comparison stays in view.

Each side runs ``--seeds`` times (seed s: sampling, learner and prompt order); curves are averaged point-wise over
seeds. Each side evaluates every 5 steps and its final policy; a side's final reward is the mean of its last two
held-out greedy evaluations after the start (``final_reward_of``: one, when a run is shorter than 5 steps), the
same on every side. The target reward is TRL's; ``time_to_target_ratio`` = TRL's training time to reach it /
streamrl's (default eta), > 1 when streamrl is faster. Clocks count training only (held-out evaluation is
excluded on both sides).
Writes the JSON to --out and an SVG plot beside it (same name, .svg).

``--smoke --from-run RUN`` (benchmarks.common.RecordedRun; RUN recorded with ``--learner.snapshot_every=1``): one
seed of 2 steps on both sides at the smallest recipe (trl_side.SMOKE_SIZES), RUN's model for the warm one: TRL's
GRPOTrainer runs for real; each streamrl command line is checked and answered by RUN, whose snapshots are
evaluated.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_recorded_run_flags,
    check_smoke_path,
    mode_of,
    recorded_run_of,
    smoke_run,
    write_result,
)
from benchmarks.plot import figure, line_chart
from benchmarks.vs_trl.streamrl_side import deployment, run_streamrl
from benchmarks.vs_trl.trl_side import SMOKE_SIZES, GRPORecipe, one_thread
from common.config import SharedConfig

DEFAULT_ETA = SharedConfig().eta  # streamrl's default staleness bound


def run_trl_subprocess(model_dir: Path, recipe: GRPORecipe, out: Path) -> dict[str, Any]:
    """TRL in its own process, so its thread settings and imports do not touch ours."""
    cmd = [
        sys.executable, "-m", "benchmarks.vs_trl.trl_side", "--model", str(model_dir), "--out", str(out),
        "--steps", str(recipe.steps), "--lr", str(recipe.lr), "--seed", str(recipe.seed), "--shuffle-seed", str(recipe.shuffle_seed),
        "--eval-every", str(recipe.eval_every), *(["--smoke"] if smoke_run() is not None else []),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL side failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def final_reward_of(curve: list[dict[str, float]]) -> float:
    """A side's final reward: the mean of its last two held-out evaluations after the start (one evaluation is
    one step's draw; two halve the last-step noise; a run with one evaluation after the start, shorter than the
    evaluation interval, has its final policy's alone). TRL's is the target; every side's is measured this one
    way."""
    last = [p["greedy"] for p in curve[1:][-2:]]
    if not last:
        raise ValueError("a curve without an evaluation after the start has no final reward")
    return sum(last) / len(last)


def first_reaching(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first evaluation point at or above ``target`` (step 0 excluded), or None."""
    return next((p for p in curve[1:] if p["greedy"] >= target - 1e-9), None)


def side_summary(
    curve: list[dict[str, float]], target: float, trl_samples: float | None = None
) -> dict[str, Any]:
    """One side's mean curve against the target; ``trl_samples``: TRL's sample count, for the reward there."""
    hit = first_reaching(curve, target)
    steps = curve[-1]["step"]
    upto = [p["greedy"] for p in curve[1:] if trl_samples is None or p["samples"] <= trl_samples]
    at_trl = next((p["greedy"] for p in curve if p["samples"] == trl_samples), None)
    return {
        "final_reward": final_reward_of(curve),
        "last_evaluation": curve[-1]["greedy"],
        "final_step": steps,
        "reward_at_trl_samples": at_trl,
        "final_sampled": curve[-1]["sampled"],
        "wall_seconds": curve[-1]["wall_seconds"],
        "seconds_per_step": curve[-1]["wall_seconds"] / steps if steps else None,
        # the curve's mean over its evaluations after the start, up to TRL's sample count (comparable across
        # sides): learning per sample in one number; None when none falls there (a run shorter than the interval)
        "mean_reward_over_evaluations": statistics.fmean(upto) if upto else None,
        "time_to_target": hit["wall_seconds"] if hit else None,
        "samples_to_target": hit["samples"] if hit else None,
    }


def noise(p: float, n: int) -> float:
    """Two standard errors of an accuracy p measured on n prompts."""
    return 2 * math.sqrt(max(p * (1 - p), 1e-6) / n)


def seed_noise(finals_a: list[float], finals_b: list[float]) -> float | None:
    """Two standard errors of the difference of two means of per-seed final rewards (training and evaluation
    noise together); None with fewer than two seeds on a side."""
    if min(len(finals_a), len(finals_b)) < 2:
        return None
    return 2 * math.sqrt(sum(statistics.variance(f) / len(f) for f in (finals_a, finals_b)))


def plot(path: Path, curves: dict[str, list[dict[str, float]]]) -> None:
    by_time = {k: [(p["wall_seconds"], p["greedy"]) for p in c] for k, c in curves.items()}
    by_samples = {k: [(p["samples"], p["greedy"]) for p in c] for k, c in curves.items()}
    path.write_text(
        figure(
            [
                line_chart(by_time, "held-out greedy vs training time", "seconds", "accuracy", (0, 1)),
                line_chart(by_samples, "held-out greedy vs samples", "samples", "accuracy", (0, 1)),
            ]
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recorded_run_flags(parser, "30 TRL steps, 45 streamrl steps, one seed (about 12 minutes in all)")
    parser.add_argument("--steps", type=int, default=None, help="TRL's optimizer steps (30 quick, 60 full)")
    parser.add_argument(
        "--streamrl-steps",
        type=int,
        default=None,
        help="streamrl's optimizer steps (default 1.5 x --steps): time to reach TRL's final reward, not a "
        "same-length race",
    )
    parser.add_argument("--eta", type=int, default=DEFAULT_ETA, help="streamrl's asynchronous eta")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per side (1 quick, 5 full)")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="run seeds first-seed .. first-seed + seeds - 1"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="run nothing: recompute the summary from these result files' per-seed curves (their seeds are "
        "pooled; they must share the recipe, eta, model path and, where recorded, its weights' SHA-256)",
    )
    parser.add_argument(
        "--keep-runs",
        type=Path,
        default=None,
        help="keep every run's directory (streamrl's run dir with logs, metrics and snapshots; TRL's curve) "
        "under this directory instead of a temporary one",
    )
    parser.add_argument("--out", type=Path, required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    for flag, value in (("--steps", args.steps), ("--streamrl-steps", args.streamrl_steps)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: must be at least 1")
    check_smoke_args(parser, args)
    if args.from_json:
        runs = pooled_runs([json.loads(p.read_text()) for p in args.from_json])
    else:
        runs = run_all(args, mode)
    doc = summarise(runs, args.out)
    print(f"time_to_target_ratio {doc['time_to_target_ratio']:.2f} (target {doc['target_reward']:.3f}); "
          f"passed: {doc['passed']}")  # fmt: skip
    return 0


def check_smoke_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--smoke: a recorded run with snapshots (the streamrl side's curve is evaluated from them), and no file
    written into the checkout."""
    recorded = recorded_run_of(parser, args)
    if recorded is None:
        return
    if args.from_json:
        parser.error("--from-json runs nothing: not with --smoke")
    if args.keep_runs is not None:
        check_smoke_path(args.keep_runs, parser.error, "--keep-runs")
    if not any((recorded.recorded / "snapshots").glob("step-*")):
        parser.error(
            f"--from-run {recorded.recorded}: no snapshots/step-* (the streamrl side's curve is evaluated from "
            "them): record that run with --learner.snapshot_every=1"
        )


def run_all(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Every side for every seed; returns what :func:`summarise` takes."""
    steps = args.steps or {"smoke": 2, "quick": 30, "full": 60}[mode]
    # smoke: the recorded run's 2 steps on both sides (its snapshots are the streamrl curve)
    streamrl_steps = args.streamrl_steps or (steps if mode == "smoke" else default_streamrl_steps(steps))
    if streamrl_steps < steps:
        raise SystemExit(f"--streamrl-steps {streamrl_steps} must be at least --steps {steps}")
    seeds = args.seeds or (5 if mode == "full" else 1)
    model_dir = warm_model()
    if mode == "smoke":
        one_thread()  # this process evaluates the streamrl side's snapshots
    per_seed: dict[str, list[list[dict[str, float]]]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    trl: dict[str, Any] = {}
    with runs_directory(args.keep_runs) as tmp:
        for seed in range(args.first_seed, args.first_seed + seeds):
            recipe = recipe_of(mode, steps, seed)
            print(f"seed {seed}: TRL GRPOTrainer, {steps} steps ...", flush=True)
            trl = run_trl_subprocess(model_dir, recipe, Path(tmp) / f"trl{seed}.json")
            per_seed.setdefault("TRL", []).append(trl["curve"])
            for eta in sorted({0, args.eta}):
                print(f"seed {seed}: streamrl eta={eta}, {streamrl_steps} steps ...", flush=True)
                longer = dataclasses.replace(recipe, steps=streamrl_steps)
                run = run_streamrl(model_dir, longer, eta, Path(tmp) / f"s{seed}-eta{eta}")
                per_seed.setdefault(f"streamrl eta={eta}", []).append(run["curve"])
                runs.setdefault(str(eta), []).append(run["summary"])
    params = {
        # what every run shares; seed s sets sampling, the learner and the prompt order of run s
        "recipe": {k: v for k, v in trl["recipe"].items() if k not in ("seed", "shuffle_seed")},
        "seeds": list(range(args.first_seed, args.first_seed + seeds)),
        "streamrl_steps": streamrl_steps,
        "model": str(model_dir),
        "model_sha256": model_fingerprint(model_dir),
        "eta": args.eta,
        "trl_config": trl["trl_config"],
        "streamrl_deployment": deployment(recipe),
    }
    return {"mode": mode, "params": params, "curves_per_seed": per_seed, "streamrl_runs": runs}


def warm_model() -> Path:
    """The warm-started tiny model; in smoke mode the recorded run's (nothing built)."""
    recorded = smoke_run()
    if recorded is not None:
        return recorded.model()
    from streamrl.warm_start import init_warm_model

    return Path(init_warm_model())


def recipe_of(mode: str, steps: int, seed: int) -> GRPORecipe:
    """Seed ``seed``'s recipe: the shared one, evaluated every 5 steps; in smoke mode the smallest, every step."""
    if mode == "smoke":
        return GRPORecipe(steps=steps, eval_every=1, seed=seed, shuffle_seed=seed, **SMOKE_SIZES)
    return GRPORecipe(steps=steps, eval_every=5, seed=seed, shuffle_seed=seed)


def model_fingerprint(model_dir: Path) -> str:
    """The SHA-256 of the model's weights file: a warm model rebuilt on another machine keeps its path and may
    not keep its weights, and runs pooled across sittings must share them."""
    digest = hashlib.sha256()
    with (Path(model_dir) / "model.safetensors").open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def runs_directory(keep: Path | None) -> Iterator[str]:
    """Where the runs write: ``keep`` (created, left in place) or a temporary directory removed afterwards."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
            yield tmp
        return
    keep.mkdir(parents=True, exist_ok=True)
    if any(keep.iterdir()):
        raise SystemExit(
            f"--keep-runs {keep}: not empty (a run directory there would be mixed with old ones)"
        )
    yield str(keep)


def default_streamrl_steps(steps: int, eval_every: int = 5) -> int:
    """1.5 x TRL's steps, rounded up to an evaluation point."""
    return -(-(3 * steps) // (2 * eval_every)) * eval_every


def pooled_runs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-seed curves of several result files as one set of runs (for more seeds than one sitting)."""
    first = docs[0]
    for doc in docs[1:]:
        for key in ("recipe", "eta", "model", "streamrl_steps"):
            if doc["params"].get(key) != first["params"].get(key):
                raise SystemExit(
                    f"--from-json: {key} differs: {doc['params'].get(key)} vs {first['params'].get(key)}"
                )
        ours, theirs = doc["params"].get("model_sha256"), first["params"].get("model_sha256")
        if ours and theirs and ours != theirs:  # files from before the fingerprint carry none
            raise SystemExit(
                f"--from-json: model_sha256 differs: {ours} vs {theirs} (the same path, other weights)"
            )
    seeds = [s for doc in docs for s in _seed_list(doc["params"]["seeds"])]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--from-json: a seed appears twice among {seeds}")
    per_seed: dict[str, list[Any]] = {}
    runs: dict[str, list[Any]] = {}
    for doc in docs:
        for name, curves in doc["results"]["curves_per_seed"].items():
            per_seed.setdefault(name, []).extend(curves)
        for eta, summaries in doc["results"]["streamrl_runs"].items():
            runs.setdefault(eta, []).extend(summaries)
    params = {**first["params"], "seeds": seeds, "pooled_from": [d["git_sha"] for d in docs]}
    return {"mode": first["mode"], "params": params, "curves_per_seed": per_seed, "streamrl_runs": runs}


def _seed_list(seeds: int | list[int]) -> list[int]:
    return list(range(seeds)) if isinstance(seeds, int) else list(seeds)


def summarise(runs: dict[str, Any], out: Path) -> dict[str, Any]:
    """Mean curves over seeds, each side against TRL's final reward; writes the JSON and the plot."""
    params, per_seed = runs["params"], runs["curves_per_seed"]
    eta, n_seeds = params["eta"], len(_seed_list(params["seeds"]))
    curves = {name: mean_curve(cs) for name, cs in per_seed.items()}
    target = final_reward_of(curves["TRL"])
    trl_samples = curves["TRL"][-1]["samples"]
    sides = {name: side_summary(c, target, trl_samples) for name, c in curves.items()}
    ours = sides[f"streamrl eta={eta}"]
    trl_side = sides["TRL"]
    ratio = trl_side["time_to_target"] / ours["time_to_target"] if ours["time_to_target"] else 0.0
    margin = ours["final_reward"] - trl_side["final_reward"]
    eval_noise = noise(trl_side["final_reward"], params["recipe"]["heldout"] * n_seeds)
    headline = {
        "time_to_target_ratio": ratio,
        "target_reward": target,
        "trl_final_reward": trl_side["final_reward"],
        "streamrl_final_reward": ours["final_reward"],
        "streamrl_final_step": ours["final_step"],
        # context, not a target: the same sample count as TRL's whole run (the per-sample comparison)
        "streamrl_reward_at_trl_samples": ours["reward_at_trl_samples"],
        # the noise of one evaluation per seed: an upper bound for a mean of two on the same problems
        "final_reward_margin_over_noise": margin + eval_noise,
        # context, not a target: the same margin from each side's last evaluation alone
        "last_evaluation_margin_over_noise": ours["last_evaluation"]
        - trl_side["last_evaluation"]
        + eval_noise,
        # context, not a target: TRL's seconds per step over streamrl's
        "per_step_speed_ratio": trl_side["seconds_per_step"] / ours["seconds_per_step"],
        # context, not a target: the final-reward difference's noise from the seed-to-seed spread
        "final_reward_seed_noise": seed_noise(
            [final_reward_of(c) for c in per_seed["TRL"]],
            [final_reward_of(c) for c in per_seed[f"streamrl eta={eta}"]],
        ),
    }
    doc = write_result(
        out,
        benchmark="vs_trl",
        mode=runs["mode"],
        params=params,
        results={
            "sides": sides,
            "curves": curves,
            "curves_per_seed": per_seed,
            "streamrl_runs": runs["streamrl_runs"],
        },
        targets={"time_to_target_ratio": (">=", 2.0), "final_reward_margin_over_noise": (">=", 0.0)},
        headline=headline,
    )
    plot(out.with_suffix(".svg"), curves)
    return doc


def mean_curve(curves: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """The point-wise mean over seeds (every seed evaluates at the same steps)."""
    return [
        {key: sum(c[i][key] for c in curves) / len(curves) for key in curves[0][i]}
        for i in range(len(curves[0]))
    ]


if __name__ == "__main__":
    sys.exit(main())
