"""Agentic rollouts: RL on the multi-turn calculator task (``tool_arithmetic``), and what an episode costs.

    python -m benchmarks.agentic --quick --out FILE      # one seed
    python -m benchmarks.agentic --out FILE              # three seeds
    python -m benchmarks.agentic --smoke --from-run RUN_DIR --out FILE --work DIR   # no run started

The same ``streamrl up`` (embedded default, eta 1) runs ``--rollout.task.name=tool_arithmetic`` from the tool
warm start (rollout_fleet.tool_warmstart: it knows the call format but calls the tool on a minority of the
problems that need it) and, for the cost comparison, the single-turn ``arithmetic`` task from its own warm start,
the same number of steps. Held-out episodes are run in process on the warm start (before) and on the run's
final export (after; ``RUN_DIR/export/latest``, the final policy), greedy and sampled at T = 1, through the
worker's episode runner: accuracy overall and on the problems that need the tool, tool-call rate, tool accuracy
(the answer right after a tool call), turns per episode and the share of tokens masked. The run's own evaluator
(through the engine) is reported beside them. ``seconds_per_step`` is the learner's loop (wait + train) per
step; the ratio is multi-turn over single-turn, per step and per output token (the tasks' outputs differ in
length: a calculator episode is about 12 tokens, an addition scratchpad about 29).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync import run_up
from benchmarks.common import (
    RecordedRun,
    add_recorded_run_flags,
    mode_of,
    recorded_run_of,
    work_of,
    write_result,
)
from benchmarks.staleness_ablation import cell_stats

STEPS = 60
ETA = 1
HELDOUT = 1000
# 3: the fewest held-out problems with one of each bucket (direct, needs_tool)
SMOKE = {"steps": 2, "heldout": 3}
WORK = Path("runs/agentic")


def heldout_metrics(model_dir: Path, problems: int) -> dict[str, Any]:
    """In-process held-out episode metrics (greedy and sampled) of a model directory."""
    from rollout_fleet.local_eval import load_model
    from rollout_fleet.tasks import TEST
    from rollout_fleet.tasks.tool_arithmetic import ToolArithmeticTask
    from rollout_fleet.tool_warmstart import evaluate_episodes

    model, tokenizer = load_model(model_dir)
    task = ToolArithmeticTask(heldout_size=problems, tokenizer=tokenizer)
    prompts = [task.make_prompt(i, TEST) for i in range(problems)]
    return evaluate_episodes(model, tokenizer, task, prompts)


def warm_models(recorded: RecordedRun | None) -> tuple[Path, Path]:
    """The tool and the single-turn warm starts; in smoke mode the recorded run's model stands for both."""
    if recorded is not None:
        return recorded.model(), recorded.model()
    from streamrl.warm_start import init_tool_warm_model, init_warm_model

    return init_tool_warm_model(), init_warm_model()


def seconds_per_step(summary: dict[str, Any]) -> float:
    return (summary["learner_wait_seconds"] + summary["learner_train_seconds"]) / max(summary["steps"], 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recorded_run_flags(parser, "one seed")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--seeds", type=int, help="seeds (1 quick and smoke, 3 full)")
    parser.add_argument("--steps", type=int, help=f"learner steps per run (default {STEPS}; smoke: 2)")
    parser.add_argument("--heldout", type=int, help=f"held-out problems (default {HELDOUT}; smoke: 3)")
    parser.add_argument("--work", type=Path, help=f"run directories (default {WORK}; --smoke: required)")
    parser.add_argument("--extra", action="append", default=[], help="one more override for the tool runs")
    args = parser.parse_args(argv)
    recorded = recorded_run_of(parser, args)
    mode = mode_of(parser, args)
    work = work_of(parser, args, WORK)
    seeds = args.seeds or (3 if mode == "full" else 1)
    steps = args.steps or (SMOKE["steps"] if recorded else STEPS)
    heldout = args.heldout or (SMOKE["heldout"] if recorded else HELDOUT)
    if recorded is not None:
        import torch

        # the tiny model's forwards in this process: beside other busy processes on 2 cores, each matmul's
        # threads wait for each other (a smoke run measured 7 s idle, 45 s inside the suite)
        torch.set_num_threads(1)
    tool_model, plain_model = warm_models(recorded)
    print(f"held-out episodes of the warm start ({heldout} problems) ...", flush=True)
    before = heldout_metrics(tool_model, heldout)
    evaluator = [f"--rollout.task.heldout_size={min(heldout, 500)}", "--eval.heldout_prompts=500"]
    runs = []
    for seed in range(seeds):
        tag = f"s{seed}-{len(list(work.glob(f'tool-s{seed}-*')))}"  # a fresh directory: never a resume
        print(f"seed {seed}: tool_arithmetic, {steps} steps ...", flush=True)
        tool_dir = work / f"tool-{tag}"
        tool = run_up(
            tool_dir, ETA, steps, tool_model, seed, "shared",
            ["--rollout.task.name=tool_arithmetic", *evaluator, *args.extra],
        )  # fmt: skip
        if not tool.get("eval_after_is_final_policy"):
            raise RuntimeError(f"seed {seed}: the 'after' evaluation is not of the final policy: {tool}")
        after = heldout_metrics(tool_dir / "export" / "latest", heldout)
        print(f"seed {seed}: arithmetic (single-turn), {steps} steps ...", flush=True)
        plain = run_up(work / f"plain-{tag}", ETA, steps, plain_model, seed, "shared", evaluator)
        runs.append(
            {
                "seed": seed,
                "after": after,
                "evaluator_greedy_before": tool["eval_greedy_accuracy_before"],
                "evaluator_greedy_after": tool["eval_greedy_accuracy_after"],
                "samples_trained": tool["samples_trained"],
                "mean_staleness": tool["mean_staleness"],
                "seconds_per_step_multi_turn": seconds_per_step(tool),
                "seconds_per_step_single_turn": seconds_per_step(plain),
                # output tokens per sample (an episode's model and observation tokens): the two tasks' lengths
                # differ, so the per-token cost is beside the per-step one
                "output_tokens_per_sample_multi_turn": tool["mean_output_tokens"],
                "output_tokens_per_sample_single_turn": plain["mean_output_tokens"],
            }
        )
        g = after["greedy"]
        print(
            f"  held-out greedy {before['greedy']['accuracy']:.3f} -> {g['accuracy']:.3f} (needs_tool "
            f"{before['greedy']['accuracy_needs_tool']:.3f} -> {g['accuracy_needs_tool']:.3f}); tool calls on "
            f"needs_tool {before['greedy']['tool_call_rate_needs_tool']:.3f} -> {g['tool_call_rate_needs_tool']:.3f}",
            flush=True,
        )
    after_greedy = cell_stats([r["after"]["greedy"]["accuracy"] for r in runs], heldout)
    after_tool = cell_stats([r["after"]["greedy"]["accuracy_needs_tool"] for r in runs], heldout)
    ratio = statistics.fmean(
        r["seconds_per_step_multi_turn"] / r["seconds_per_step_single_turn"] for r in runs
    )
    per_token = statistics.fmean(
        (r["seconds_per_step_multi_turn"] / r["output_tokens_per_sample_multi_turn"])
        / (r["seconds_per_step_single_turn"] / r["output_tokens_per_sample_single_turn"])
        for r in runs
    )
    gain = after_greedy["mean"] - before["greedy"]["accuracy"]
    gain_tool = after_tool["mean"] - before["greedy"]["accuracy_needs_tool"]
    doc = write_result(
        args.out,
        benchmark="agentic",
        mode=mode,
        params={
            "steps": steps,
            "seeds": seeds,
            "eta": ETA,
            "heldout_problems": heldout,
            "extra": args.extra,
            "tool_model": str(tool_model),
            "single_turn_model": str(plain_model),
        },
        results={
            "before": before,
            "runs": runs,
            "after_greedy_accuracy": after_greedy,
            "after_greedy_accuracy_needs_tool": after_tool,
        },
        targets={"heldout_gain": (">", 0.0), "heldout_gain_needs_tool": (">", 0.0)},
        headline={
            "heldout_greedy_before": before["greedy"]["accuracy"],
            "heldout_greedy_after": after_greedy["mean"],
            "heldout_gain": gain,
            "heldout_gain_needs_tool": gain_tool,
            "tool_call_rate_needs_tool_before": before["greedy"]["tool_call_rate_needs_tool"],
            "tool_call_rate_needs_tool_after": statistics.fmean(
                r["after"]["greedy"]["tool_call_rate_needs_tool"] for r in runs
            ),
            "tool_accuracy_after": statistics.fmean(r["after"]["sampled"]["tool_accuracy"] for r in runs),
            "turns_per_episode_after": statistics.fmean(
                r["after"]["sampled"]["turns_per_episode"] for r in runs
            ),
            "masked_token_share_after": statistics.fmean(
                r["after"]["sampled"]["masked_token_share"] for r in runs
            ),
            "ratio_seconds_per_step_multi_vs_single_turn": ratio,
            "ratio_seconds_per_output_token_multi_vs_single_turn": per_token,
        },
        model=tool_model,
    )
    print(
        f"held-out greedy {before['greedy']['accuracy']:.3f} -> {after_greedy['mean']:.3f} +- "
        f"{after_greedy['se']:.3f}; s/step multi/single {ratio:.2f}; passed: {doc['passed']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
