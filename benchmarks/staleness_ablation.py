"""Staleness ablation: the same `streamrl up` on the built-in arithmetic task at eta in {0, 1, 2, 4, 8} x the
off-policy correction, several seeds each, held-out greedy accuracy on 1,000 problems after the same number of
trained samples (same steps x groups_per_step x group_size), and the mean staleness each eta really reached.

    python -m benchmarks.staleness_ablation --quick --out FILE     # eta {0, 4, 8}, one seed
    python -m benchmarks.staleness_ablation --out FILE             # full: eta {0, 1, 2, 4, 8}, 3 seeds
    python -m benchmarks.staleness_ablation --smoke --from-run RUN_DIR --out FILE --work DIR   # no run started

Corrections (everything else is the default recipe):

- ``decoupled``: the issue's "default", decoupled PPO with its trust region binding: 2 optimizer updates a step
  (``learner.ppo_minibatches = 2``), the second clipped against the proximal policy (the weights the step started
  from), at half the learning rate so the step budget stays (with AdamW each update moves the weights by about
  the learning rate; 2 updates at the full rate overshot in the pilot, docs/losses.md);
- ``none``: ``ppo``, PPO-clip with the behaviour policy as the old policy, which the issue took for what a naive
  asynchronous system does. It is streamrl's default loss since the quick ablation of 2026-12-02;
- ``tis``: truncated importance sampling; ``icepop``: masked IS (one update a step, the default recipe);
- ``decoupled_m1`` (only with ``--corrections``): decoupled PPO with one update a step, the default loss before
  2026-12-02, whose ratio to its proximal policy is 1 (no trust region).

Statistics: per (eta, correction) the mean over seeds and its standard error (sample standard deviation over
seeds / sqrt(n)); with one seed the only noise that can be measured is the evaluation's own, the binomial
standard error sqrt(p (1 - p) / problems), reported as such (``se_kind``). A difference of two cells has the
standard error sqrt(se_a^2 + se_b^2). Targets, as the issue defines them with its "default" (``decoupled``): the
default at eta 4 no worse than eta 0 beyond two standard errors (``default_eta4_margin`` = diff + 2 se >= 0);
``none`` at eta 8 worse than the default beyond two standard errors (``none_eta8_gap`` = default - none - 2 se >
0). Beside them the same margin for the loss streamrl ships as its default (``none``): ``none_eta4_margin``.

Placement as in benchmarks.async_vs_sync (engines and learner on disjoint cores, the CPU stand-in for separate
rollout and training GPUs). Generation only lags as far as the engines outrun the learner: on 2 CPU cores they
do not by themselves (at eta 0 a step waits ~1.2 s for generation and trains in ~0.6 s), so a first quick run
(2026-12-02, ``--step-interval 0``) reached a mean staleness of 1.4-1.7 at eta 4 and at eta 8 alike. So every
run paces the learner (``--step-interval``, default 2.5 s: ``learner.min_step_interval_s``, a batch taken at
least that long after the previous one) while the fleet runs at full speed: a trainer slower than its fleet,
as a large model's is, and the generation lags up to the bound. The ``mean_staleness`` column says how far
each cell really lagged. Each run's result is kept in ``--work`` (one JSON per run, reused when its parameters
match), so a long full run can be stopped and resumed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync import PLACEMENTS, one_run, run_up
from benchmarks.common import add_recorded_run_flags, mode_of, recorded_run_of, work_of, write_result
from benchmarks.plot import figure, line_chart

CORRECTIONS: dict[str, list[str]] = {
    "decoupled": [
        "--learner.loss.policy_loss=decoupled_ppo",
        "--learner.ppo_minibatches=2",
        "--learner.lr=5e-5",
    ],
    "none": ["--learner.loss.policy_loss=ppo"],
    "tis": ["--learner.loss.policy_loss=tis"],
    "icepop": ["--learner.loss.policy_loss=icepop"],
    "decoupled_m1": ["--learner.loss.policy_loss=decoupled_ppo"],
}
DEFAULT_CORRECTIONS = ["decoupled", "none", "tis", "icepop"]
ISSUE_DEFAULT = "decoupled"  # the issue's "default (decoupled PPO with the trust region)"
SHIPPED_DEFAULT = "none"  # learner.loss.policy_loss's default, ppo
MODES = {
    "quick": {"etas": [0, 4, 8], "seeds": 1, "steps": 40},
    "full": {"etas": [0, 1, 2, 4, 8], "seeds": 3, "steps": 40},
    # quick's cells (every default correction's command line checked; etas 0, 4 and 8 give every headline number)
    "smoke": {"etas": [0, 4, 8], "seeds": 1, "steps": 2},
}
WORK = Path("runs/staleness_ablation")
HELDOUT = 1000


def cell_stats(rewards: Sequence[float], problems: int) -> dict[str, Any]:
    """Mean and standard error of one (eta, correction) cell's held-out accuracies, one per seed."""
    if not rewards:
        raise ValueError("a cell needs at least one run")
    mean = statistics.fmean(rewards)
    if len(rewards) > 1:
        se, kind = statistics.stdev(rewards) / math.sqrt(len(rewards)), "seeds"
    else:
        se, kind = math.sqrt(max(mean * (1 - mean), 0.0) / problems), "binomial (one seed)"
    return {"mean": mean, "se": se, "se_kind": kind, "n": len(rewards)}


def difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """``a - b`` of two cells' means and its standard error."""
    return a["mean"] - b["mean"], math.sqrt(a["se"] ** 2 + b["se"] ** 2)


def _margin(cells: dict[str, dict[str, Any]], eta: str) -> float | None:
    """``cells[eta] - cells["0"] + 2 se``: >= 0 when eta is no worse than eta 0 beyond two standard errors."""
    if eta not in cells or "0" not in cells:
        return None
    diff, se = difference(cells[eta], cells["0"])
    return diff + 2 * se


def headline(table: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The issue's named numbers from ``table[correction][eta]``; None where a cell was not run.

    ``_default`` is the issue's default (``ISSUE_DEFAULT``); the loss streamrl ships is ``none``.
    """
    out: dict[str, Any] = {"issue_default": ISSUE_DEFAULT, "shipped_default": SHIPPED_DEFAULT}
    for label, corr in (("default", ISSUE_DEFAULT), ("none", "none")):
        cells = table.get(corr, {})
        for eta in ("4", "8"):
            ok = eta in cells and "0" in cells
            out[f"reward_eta{eta}_minus_eta0_{label}"] = difference(cells[eta], cells["0"])[0] if ok else None
    out["default_eta4_margin"] = _margin(table.get(ISSUE_DEFAULT, {}), "4")
    out["none_eta4_margin"] = _margin(table.get("none", {}), "4")
    default, none = table.get(ISSUE_DEFAULT, {}), table.get("none", {})
    if "8" in default and "8" in none:
        diff, se = difference(default["8"], none["8"])
        out["none_eta8_gap"] = diff - 2 * se
    else:
        out["none_eta8_gap"] = None
    ses = [c["se"] for cells in table.values() for c in cells.values()]
    out["noise"] = math.sqrt(statistics.fmean(s * s for s in ses)) if ses else None
    return out


def run_key(eta: int, correction: str, seed: int, steps: int, extra: Sequence[str]) -> dict[str, Any]:
    return {"eta": eta, "correction": correction, "seed": seed, "steps": steps, "extra": list(extra)}


def cached_run(work: Path, key: dict[str, Any], model: Path, placement: str) -> dict[str, Any]:
    """One run's result, from ``work`` when a run with the same parameters finished before."""
    path = work / f"eta{key['eta']}-{key['correction']}-s{key['seed']}.json"
    if path.exists():
        kept = json.loads(path.read_text())
        if kept.get("key") == key:
            return kept["result"]
    args = [
        *CORRECTIONS[key["correction"]],
        f"--rollout.task.heldout_size={HELDOUT}",
        f"--eval.heldout_prompts={HELDOUT}",
        "--eval.samples_per_prompt=1",  # the ablation reads greedy accuracy; pass@k's 8 samples would add minutes
        *key["extra"],
    ]
    run_dir = work / "runs" / path.stem
    summary = run_up(run_dir, key["eta"], key["steps"], model, key["seed"], placement, args)
    result = one_run(summary)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "result": result}))
    tmp.replace(path)  # atomic: a killed run leaves no half-written result to be reused
    return result


def plot(path: Path, table: dict[str, dict[str, dict[str, Any]]]) -> None:
    def series(field: str) -> dict[str, list[tuple[float, float]]]:
        return {
            corr: [(int(eta), cells[eta][field]) for eta in sorted(cells, key=int)]
            for corr, cells in table.items()
        }

    charts = [
        line_chart(series("mean"), "held-out greedy accuracy after the same samples", "eta", "accuracy"),
        line_chart(series("mean_staleness"), "mean staleness reached", "eta", "versions"),
    ]
    path.write_text(figure(charts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recorded_run_flags(parser, "eta {0, 4, 8}, one seed (about 45 minutes)")
    parser.add_argument(
        "--out", type=Path, required=True, help="result JSON (an SVG plot is written beside it)"
    )
    parser.add_argument("--etas", type=int, nargs="+", help="override the mode's etas")
    parser.add_argument("--corrections", nargs="+", choices=sorted(CORRECTIONS), help="subset of corrections")
    parser.add_argument("--seeds", type=int, help="seeds per cell (1 quick, 3 full)")
    parser.add_argument("--steps", type=int, help="learner steps per run (40; smoke: 2)")
    parser.add_argument(
        "--work", type=Path, help=f"per-run results, reused on resume (default {WORK}; --smoke: required)"
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="split",
        help="core sets (benchmarks.async_vs_sync.placement_args); rollout_heavy: the engines on every core, "
        "the learner on one",
    )
    parser.add_argument(
        "--step-interval",
        type=float,
        default=2.5,
        help="learner.min_step_interval_s of every run: seconds a step waits for at least, so the fleet runs "
        "ahead of the learner (0: unpaced)",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        help="one more override for every run, e.g. --extra=--learner.lr=2e-4",
    )
    args = parser.parse_args(argv)
    recorded = recorded_run_of(parser, args)
    mode = mode_of(parser, args)
    work = work_of(parser, args, WORK)
    etas = args.etas or MODES[mode]["etas"]
    seeds = args.seeds or MODES[mode]["seeds"]
    steps = args.steps or MODES[mode]["steps"]
    corrections = args.corrections or DEFAULT_CORRECTIONS
    extra = [f"--learner.min_step_interval_s={args.step_interval}", *args.extra]
    if recorded is not None:
        model = recorded.model()
    else:
        from streamrl.warm_start import init_warm_model

        model = init_warm_model()
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {str(e): [] for e in etas} for c in corrections}
    total, done = len(etas) * len(corrections) * seeds, 0
    for seed in range(seeds):
        for eta in etas:
            for corr in corrections:
                done += 1
                print(f"[{done}/{total}] seed {seed} eta={eta} {corr} ...", flush=True)
                r = cached_run(work, run_key(eta, corr, seed, steps, extra), model, args.placement)
                runs[corr][str(eta)].append(r)
                print(f"  held-out {r['eval_reward']:.3f}, staleness {r['mean_staleness']:.2f}, "
                      f"wall {r['wall_seconds']:.0f} s", flush=True)  # fmt: skip
    table = {
        corr: {
            eta: {
                **cell_stats([r["eval_reward"] for r in rs], HELDOUT),
                "mean_staleness": statistics.fmean(r["mean_staleness"] for r in rs),
                "wall_seconds": statistics.fmean(r["wall_seconds"] for r in rs),
                "seeds": rs,
            }
            for eta, rs in cells.items()
        }
        for corr, cells in runs.items()
    }
    head = headline(table)
    targets = {}
    if head["default_eta4_margin"] is not None:
        targets["default_eta4_margin"] = (">=", 0.0)
    if head["none_eta8_gap"] is not None:
        targets["none_eta8_gap"] = (">", 0.0)
    if head["none_eta4_margin"] is not None:
        targets["none_eta4_margin"] = (">=", 0.0)
    doc = write_result(
        args.out,
        benchmark="staleness_ablation",
        mode=mode,
        params={
            "etas": etas,
            "seeds": seeds,
            "steps": steps,
            "corrections": corrections,
            "correction_overrides": {c: CORRECTIONS[c] for c in corrections},
            "heldout_problems": HELDOUT,
            "placement": args.placement,
            "step_interval_s": args.step_interval,
            "extra": args.extra,
            "model": str(model),
        },  # fmt: skip
        results={"table": table},
        targets=targets,
        headline=head,
        model=model,
    )
    plot(args.out.with_suffix(".svg"), table)
    for corr in corrections:
        row = "  ".join(
            f"eta {e}: {table[corr][str(e)]['mean']:.3f}+-{table[corr][str(e)]['se']:.3f} "
            f"(stale {table[corr][str(e)]['mean_staleness']:.1f})"
            for e in etas
        )
        print(f"{corr:8s} {row}")
    print(f"passed: {doc['passed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
