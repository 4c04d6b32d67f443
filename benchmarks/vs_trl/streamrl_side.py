"""The streamrl side of the side-by-side: `streamrl up` with the shared recipe, one run per eta, then the
held-out curve from the learner's snapshots (evaluated after the run with the same function as the TRL side).

The clock starts at the run's first rollout request (process start-up and the baseline evaluation are before
it) and each point's time is when the learner wrote that step's snapshot, so held-out evaluation is
outside the clock, as on the TRL side. The curve ends at the final policy, as TRL's does: when the last step is no
multiple of the snapshot interval (``--streamrl-steps`` under or between evaluation points), the final point is
the learner's end-of-run export (RUN_DIR/export/latest), timed when it was written (after the final checkpoint, a
little late).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import smoke_run
from benchmarks.vs_trl.trl_side import Curve, GRPORecipe, heldout_task


def deployment(recipe: GRPORecipe) -> list[str]:
    """streamrl's best deployment on this 2-core machine (measured: docs/vs_trl.md); the recipe is unchanged."""
    return [
        "--engine.count=1",  # one engine decodes a whole step's samples in one batch
        f"--engine.max_running_requests={recipe.prompts_per_step * recipe.group_size}",
        "--learner.world_size=1",  # a second FSDP rank on 2 cores adds gloo traffic, not compute
        "--learner.micro_batch_tokens=2048",  # smaller micro-batches of similar lengths pad less
        "--eval.every_versions=0",  # no live evaluator on the engines: the curve comes from snapshots
    ]


def up_command(recipe: GRPORecipe, eta: int, run_dir: Path, model_dir: Path) -> list[str]:
    """The `streamrl up` command line of one run: the recipe's knobs, the deployment, snapshots for the curve."""
    return [
        sys.executable, "-m", "streamrl", "up",
        f"--shared.run_dir={run_dir}", f"--shared.eta={eta}", f"--shared.model_path={model_dir}",
        f"--learner.max_steps={recipe.steps}", f"--learner.groups_per_step={recipe.prompts_per_step}",
        f"--rollout.group_size={recipe.group_size}", f"--learner.lr={recipe.lr}",
        f"--rollout.temperature={recipe.temperature}", f"--rollout.max_new_tokens={recipe.max_new_tokens}",
        f"--rollout.shuffle_seed={recipe.shuffle_seed}", f"--learner.seed={recipe.seed}",
        f"--learner.snapshot_every={recipe.eval_every}", "--learner.export_at_end=true",  # the final policy
        "--learner.loss.eps_high=0.2",
        f"--learner.keep_snapshots={recipe.steps // recipe.eval_every + 1}",  # every point of the curve
        "--learner.loss.policy_loss=decoupled_ppo",  # what the committed side-by-side results ran (docs/vs_trl.md)
        "--learner.wandb_mode=disabled", "--dashboard.port=0", "--dashboard.metrics_base_port=0",
        "--up.status_interval_s=30", *deployment(recipe),
    ]  # fmt: skip


@functools.cache
def baseline(model_dir: Path, heldout: int, max_new_tokens: int) -> dict[str, Any]:
    """The starting model's held-out scores, once per invocation (the evaluation is seeded: every run's step 0)."""
    from rollout_fleet.local_eval import evaluate

    return evaluate(model_dir, task=heldout_task(heldout), n=heldout, max_new_tokens=max_new_tokens)


def run_streamrl(model_dir: Path, recipe: GRPORecipe, eta: int, run_dir: Path) -> dict[str, Any]:
    """One `streamrl up` run and its held-out curve (step, samples, training wall seconds, greedy, sampled)."""
    from rollout_fleet.local_eval import evaluate

    command = up_command(recipe, eta, run_dir, model_dir)
    recorded = smoke_run()
    if recorded is not None:  # smoke: checked, and answered by the recorded run (with its snapshots)
        summary = recorded.answer(command, run_dir)
    else:
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"streamrl up (eta={eta}) failed; see {run_dir}/logs:\n{proc.stdout[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
    # the clock starts at the run's first rollout request (the design brief's rule), recorded by the rollout worker
    started = summary.get("first_request_at") or summary["training_started_at"]
    curve, task = Curve(), heldout_task(recipe.heldout)
    curve.add(0, 0, 0.0, baseline(model_dir, recipe.heldout, recipe.max_new_tokens))
    for step, policy, written in evaluated_policies(run_dir, recipe.steps):
        scores = evaluate(policy, task=task, n=recipe.heldout, max_new_tokens=recipe.max_new_tokens)
        curve.add(step, step * recipe.prompts_per_step * recipe.group_size, written - started, scores)
        print(f"streamrl eta={eta} step {step}: held-out greedy {scores['greedy_accuracy']:.3f} "
              f"at {written - started:.1f} s", flush=True)  # fmt: skip
    keep = (
        "first_request_at",
        "training_started_at",
        "mean_staleness",
        "samples_trained",
        "samples_dropped",
        "training_wall_seconds",
        "steps",
    )
    return {"eta": eta, "curve": curve.points, "summary": {k: summary.get(k) for k in keep}}


def evaluated_policies(run_dir: Path, steps: int) -> list[tuple[int, Path, float]]:
    """(step, HF directory, when written) of each policy on the curve: every snapshot, then the final policy
    (export/latest) when no snapshot is of the last step (``steps`` is no multiple of the snapshot interval)."""
    points = []
    for snap in sorted((run_dir / "snapshots").glob("step-*")):
        info = json.loads((snap / "snapshot.json").read_text())
        points.append((info["step"], snap, info["time"]))
    if not points or points[-1][0] < steps:
        final = run_dir / "export" / "latest"
        if not (final / "export.json").is_file():
            raise RuntimeError(
                f"{run_dir}: no snapshot of step {steps} and no export/latest (the final policy)"
            )
        info = json.loads((final / "export.json").read_text())
        points.append((info["step"], final, info["time"]))
    return points
