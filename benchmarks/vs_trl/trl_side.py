"""The TRL side of the side-by-side: TRL's ``GRPOTrainer`` on the warm-started tiny model and the arithmetic task,
generating with transformers on the CPU (TRL without vLLM), with held-out evaluation every few steps.

The clock counts training only: it starts at the first generation and pauses while the held-out evaluation
runs (design brief: evaluation time is excluded on both sides).

    python -m benchmarks.vs_trl.trl_side --steps 25 --out trl.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class GRPORecipe:
    """What both sides share: the experiment the benchmark runs twice."""

    prompts_per_step: int = 16  # streamrl's default groups_per_step (8 x 8 measured too: README)
    group_size: int = 8
    lr: float = 1e-4
    temperature: float = 1.0
    max_new_tokens: int = 96
    steps: int = 25
    eval_every: int = 5
    heldout: int = 1000  # held-out prompts per evaluation: one standard error is about 0.015 (0.034 at 200)
    seed: int = 0
    lr_schedule: str = "constant"
    shuffle_seed: int = 0


# --smoke (benchmarks.vs_trl's and this module's): the smallest recipe that still trains groups and evaluates
SMOKE_SIZES = {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 16, "heldout": 8}


@dataclass
class Curve:
    """Held-out accuracy against optimizer steps, samples and training wall time (evaluation excluded)."""

    points: list[dict[str, float]] = field(default_factory=list)

    def add(self, step: int, samples: int, wall_s: float, scores: dict[str, Any]) -> None:
        self.points.append(
            {
                "step": step,
                "samples": samples,
                "wall_seconds": round(wall_s, 3),
                "greedy": scores["greedy_accuracy"],
                "sampled": scores["sampled_accuracy"],
            }
        )


def heldout_task(size: int) -> Any:
    """The arithmetic task with ``size`` test prompts (its first 200 are the default task's; training prompts do
    not depend on the held-out size)."""
    from rollout_fleet.tasks import get_task

    return get_task("arithmetic", heldout_size=size)


def trl_dataset(recipe: GRPORecipe) -> Any:
    """The training prompts in the order streamrl's rollout worker hands them out (its first epoch's
    permutation for ``rollout.shuffle_seed``)."""
    from datasets import Dataset

    from rollout_fleet.dispatch import epoch_order
    from rollout_fleet.tasks import get_task

    task = get_task("arithmetic")
    count = recipe.steps * recipe.prompts_per_step
    order = epoch_order(recipe.shuffle_seed, 0, task.num_prompts())[:count]
    prompts = [task.make_prompt(int(i)) for i in order]
    return Dataset.from_dict({"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]})


def correctness_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """The arithmetic task's verifier (correctness only, format weight 0, as streamrl's default)."""
    from rollout_fleet.tasks.arithmetic import score_completion

    return [score_completion(a, c).reward for c, a in zip(completions, answer, strict=True)]


def run_trl(model_dir: Path, recipe: GRPORecipe, work_dir: Path) -> dict[str, Any]:
    """Train with TRL's GRPOTrainer; returns the curve and the configuration actually used."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_fleet.local_eval import evaluate

    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    batch = recipe.prompts_per_step * recipe.group_size
    config = GRPOConfig(
        output_dir=str(work_dir),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=recipe.group_size,
        max_completion_length=recipe.max_new_tokens,
        temperature=recipe.temperature,
        learning_rate=recipe.lr,
        lr_scheduler_type=recipe.lr_schedule,
        max_steps=recipe.steps,
        beta=0.0,
        num_iterations=1,
        seed=recipe.seed,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        shuffle_dataset=False,
        dataloader_num_workers=0,
    )
    curve, clock = Curve(), TrainingClock()
    heldout = heldout_task(recipe.heldout)

    class HeldOut(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            clock.start()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            step = state.global_step
            if step % recipe.eval_every and step != recipe.steps:
                return
            with clock.paused():
                scores = evaluate(
                    model, tokenizer, task=heldout, n=recipe.heldout, max_new_tokens=recipe.max_new_tokens
                )
            curve.add(step, step * batch, clock.elapsed(), scores)
            print(f"trl step {step}: held-out greedy {scores['greedy_accuracy']:.3f} "
                  f"sampled {scores['sampled_accuracy']:.3f} at {clock.elapsed():.1f} s", flush=True)  # fmt: skip

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correctness_reward,
        args=config,
        train_dataset=trl_dataset(recipe),
        processing_class=tokenizer,
        callbacks=[HeldOut()],
    )
    before = evaluate(model, tokenizer, task=heldout, n=recipe.heldout, max_new_tokens=recipe.max_new_tokens)
    curve.add(0, 0, 0.0, before)
    trainer.train()
    return {"recipe": asdict(recipe), "curve": curve.points, "trl_config": trl_settings(config)}


def one_thread() -> None:
    """--smoke: torch on one thread; the smoke's model gains nothing from more, and on a loaded machine (tests
    run two at a time on 2 cores) each matmul's threads wait for each other, 100 x slower."""
    import torch

    torch.set_num_threads(1)


def trl_settings(config: Any) -> dict[str, Any]:
    """The GRPOConfig fields that decide the update, for the README's side-by-side."""
    names = (
        "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "adam_beta1",
        "adam_beta2", "adam_epsilon", "per_device_train_batch_size", "gradient_accumulation_steps",
        "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "beta", "epsilon",
        "epsilon_high", "num_iterations", "loss_type", "scale_rewards", "mask_truncated_completions",
    )  # fmt: skip
    return {n: _plain(getattr(config, n, None)) for n in names}


def _plain(value: Any) -> Any:
    return value if isinstance(value, int | float | str | bool | type(None)) else str(value)


class TrainingClock:
    """Wall time with pauses: held-out evaluation does not count."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._start: float | None = None
        self._paused = 0.0

    def start(self) -> None:
        self._start = self._now()

    def elapsed(self) -> float:
        return 0.0 if self._start is None else self._now() - self._start - self._paused

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        began = self._now()
        try:
            yield
        finally:
            self._paused += self._now() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps")
    parser.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every k steps")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of TRL's sampling")
    parser.add_argument(
        "--shuffle-seed", type=int, default=0, help="prompt order (streamrl's rollout.shuffle_seed)"
    )
    parser.add_argument(
        "--lr-schedule", default="constant", help="constant (streamrl's) or linear (TRL's default)"
    )
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the warm model)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"the smoke recipe's sizes {SMOKE_SIZES} (benchmarks.vs_trl --smoke)",
    )
    parser.add_argument("--out", type=Path, required=True, help="where to write the curve JSON")
    args = parser.parse_args(argv)
    from streamrl.warm_start import init_warm_model

    model_dir = args.model or init_warm_model()
    if args.smoke:
        one_thread()
    recipe = GRPORecipe(
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        shuffle_seed=args.shuffle_seed,
        lr_schedule=args.lr_schedule,
        eval_every=args.eval_every,
        **(SMOKE_SIZES if args.smoke else {}),
    )
    with tempfile.TemporaryDirectory(prefix="trl-") as tmp:
        result = run_trl(Path(model_dir), recipe, Path(tmp))
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
