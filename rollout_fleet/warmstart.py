"""The arithmetic warm start as data plus a recipe for the supervised trainer (learner.sft).

RL needs a policy that solves some but not most held-out prompts, so the base model is trained with plain
next-token cross-entropy on reference scratchpads (loss on the output tokens and EOS only, never the prompt)
until greedy accuracy on validation prompts reaches a target. This module holds what is the task's: the recipe,
the dataset (:func:`dataset`), the stopping rule (:class:`ValidationStop`) and the cache fingerprint; the build
(``streamrl.warm_start``, ``streamrl model init``) runs them through the trainer and caches the result under
``cache_root()/models/tiny-qwen2-warm-<fingerprint>``, with ``warmstart.json`` inside.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from common.supervised import Example
from rollout_fleet.eval_stats import solved
from rollout_fleet.local_eval import generate
from rollout_fleet.model import TinyModelSpec, cache_root
from rollout_fleet.tasks import Prompt
from rollout_fleet.tasks.arithmetic import ArithmeticTask

MARKER = "warmstart.json"
SEED_STRIDE = 10**7  # seed s trains on train indices s * SEED_STRIDE onwards
# The numerics every build runs under, whatever the caller's environment: one thread (a reduction split over
# threads sums in another order), ATen's AVX2 kernels and MKL's and oneDNN's AVX2 code paths (the default picks
# AVX-512 where the CPU has it, and another kernel rounds differently). Set before torch is imported, so the
# build runs in a child process. With them the same torch builds the same bits on any x86-64 machine with
# AVX2: without them the default model's held-out greedy accuracy read 0.445, 0.454, 0.464 and 0.465 on four
# machines, and the RL tests' learning bounds met a different model on each.
PINNED_NUMERICS = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


@dataclass(frozen=True)
class WarmStartRecipe:
    """The supervised recipe; every field is part of the cache fingerprint.

    Training stops at the first check where greedy accuracy on ``val_size`` validation prompts reaches
    ``target_accuracy``, or after ``max_steps``. Checks run every ``eval_every`` steps from ``min_steps``, and
    every ``eval_every_close`` steps once accuracy has passed half the target: the transition can add 0.2 in
    ten steps, and coarse checks overshoot. A fixed step count
    would not do: the model learns to add digits in a sudden transition whose timing varies by a hundred
    steps and more across seeds (docs/tasks.md), so a fixed count lands anywhere from 0.05 to 0.8.
    Validation prompts come from the held-out problem space (``ArithmeticTask.validation_prompt``), never
    trained on: the tiny model memorises whole train problems, and train-split validation read 0.45 when the
    held-out set read 0.24.
    """

    max_steps: int = 500
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 20
    final_lr_ratio: float = 1.0
    weight_decay: float = 0.0
    target_accuracy: float = 0.45
    val_size: int = 200
    eval_every: int = 10
    eval_every_close: int = 2
    min_steps: int = 150
    micro_batches: int = 4
    seed: int = 0

    def check(self) -> WarmStartRecipe:
        for name in (
            "max_steps",
            "batch_size",
            "val_size",
            "eval_every",
            "eval_every_close",
            "micro_batches",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"warm-start {name} must be an int >= 1, got {value!r}")
        for name in ("warmup_steps", "min_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"warm-start {name} must be an int >= 0, got {value!r}")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"warm-start lr must be a finite number > 0, got {self.lr!r}")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"warm-start target_accuracy must be in (0, 1], got {self.target_accuracy!r}")
        if self.max_steps * self.batch_size > SEED_STRIDE:
            raise ValueError(f"warm-start max_steps * batch_size must stay below {SEED_STRIDE}")
        return self


def fingerprint(spec: TinyModelSpec, recipe: WarmStartRecipe) -> str:
    payload = json.dumps(
        {
            "model": spec.fingerprint(),
            "recipe": asdict(recipe),
            "task": f"{ArithmeticTask.name}-{ArithmeticTask.version}",
            "numerics": PINNED_NUMERICS,
            "torch": torch.__version__,  # another torch may round differently: another model
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_path(spec: TinyModelSpec, recipe: WarmStartRecipe) -> Path:
    return cache_root() / "models" / f"tiny-qwen2-warm-{fingerprint(spec, recipe)}"


def make_examples(task: ArithmeticTask, tokenizer: Any, indices: list[int]) -> list[Example]:
    """Prompt + reference completion + EOS per train index, loss on the completion and EOS."""
    examples = []
    for index in indices:
        prompt = task.make_prompt(index)
        prompt_ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        output_ids = tokenizer(task.reference_completion(prompt), add_special_tokens=False)["input_ids"]
        examples.append(Example.prompt_and_output(prompt_ids, output_ids + [tokenizer.eos_token_id]))
    return examples


def dataset(task: ArithmeticTask, tokenizer: Any, recipe: WarmStartRecipe) -> Callable[[int], list[Example]]:
    """The warm start's data: step s trains on train indices ``seed * SEED_STRIDE + s * batch_size`` onwards."""
    base = recipe.seed * SEED_STRIDE

    def batch_at(step: int) -> list[Example]:
        first = base + step * recipe.batch_size
        return make_examples(task, tokenizer, list(range(first, first + recipe.batch_size)))

    return batch_at


def validation_accuracy(model: Any, tokenizer: Any, task: ArithmeticTask, prompts: list[Prompt]) -> float:
    """Greedy accuracy on train-split validation prompts (the stopping rule's measure)."""
    outputs = generate(model, tokenizer, [p.text for p in prompts])
    hits = sum(solved(task.score(p, tokenizer.decode(ids))) for p, ids in zip(prompts, outputs, strict=True))
    return hits / len(prompts)


class ValidationStop:
    """The recipe's stopping rule, called after each step: greedy validation accuracy every ``eval_every`` steps
    from ``min_steps`` (every ``eval_every_close`` once past half the target); stop at the target."""

    def __init__(self, model: Any, tokenizer: Any, task: ArithmeticTask, recipe: WarmStartRecipe) -> None:
        self.model, self.tokenizer, self.task, self.recipe = model, tokenizer, task, recipe
        self.prompts = [task.validation_prompt(i) for i in range(recipe.val_size)]
        self.validation: list[tuple[int, float]] = []  # (step, greedy accuracy) at each check
        self.reached_target = False

    def __call__(self, steps: int) -> tuple[str, bool] | None:
        recipe = self.recipe
        close = bool(self.validation) and self.validation[-1][1] >= recipe.target_accuracy / 2
        every = recipe.eval_every_close if close else recipe.eval_every
        if steps < recipe.min_steps or steps % every:
            return None
        self.model.eval()
        accuracy = validation_accuracy(self.model, self.tokenizer, self.task, self.prompts)
        self.validation.append((steps, accuracy))
        self.reached_target = accuracy >= recipe.target_accuracy
        return f" validation greedy {accuracy:.2f} (target {recipe.target_accuracy})", self.reached_target


def make_recipe(
    steps: int | None = None, seed: int = 0, lr: float | None = None, target: float | None = None
) -> WarmStartRecipe:
    """The default recipe with the given overrides (``steps`` is the cap, ``max_steps``)."""
    defaults = WarmStartRecipe()
    return WarmStartRecipe(
        max_steps=defaults.max_steps if steps is None else steps,
        lr=defaults.lr if lr is None else lr,
        target_accuracy=defaults.target_accuracy if target is None else target,
        seed=seed,
    ).check()
