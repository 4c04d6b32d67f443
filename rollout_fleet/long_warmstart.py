"""Supervised warm-start of the long-context tiny model on the long-output task (``long_multiplication``).

The untrained model writes garbage, so ``streamrl up --rollout.task.name=long_multiplication`` would measure
nothing. This teaches the scratchpad format on the *shorter* instances only (reference at most
``max_example_tokens`` tokens, the cheap part on a CPU), with the same next-token cross-entropy as the
arithmetic warm-start (the supervised trainer, learner.sft: loss on the output tokens and EOS). The
format carries its state line to line (docs/tasks.md), so a model that has learned it on short problems keeps
writing it on long ones: the record measures how far, on held-out problems longer than any trained on.

Training stops at the first check where the greedy format rate on ``val_size`` short validation prompts (from
the held-out problem space, never trained on) reaches ``target_format``, or after ``max_steps``. The result is
cached under ``cache_root()/models/tiny-qwen2-long-warm-<fingerprint>`` (model spec, recipe and task version),
built once under a lock and renamed into place by ``streamrl.warm_start``; ``warmstart.json`` inside holds the
loss curve, the validation checks and the held-out length report (short and long problems). ``streamrl model
init --task long_multiplication`` builds it from a shell.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.supervised import Example
from rollout_fleet.eval_stats import accuracy
from rollout_fleet.local_eval import generate
from rollout_fleet.model import TinyModelSpec, cache_root
from rollout_fleet.tasks import TEST, Prompt
from rollout_fleet.tasks.long_multiplication import LongMultiplicationTask
from rollout_fleet.warmstart import SEED_STRIDE


@dataclass(frozen=True)
class LongWarmStartRecipe:
    """The supervised recipe of the long task; every field is part of the cache fingerprint."""

    max_steps: int = 600
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 20
    final_lr_ratio: float = 1.0  # constant after warm-up (the trainer's cosine schedule is available)
    max_example_tokens: int = 800  # train (and validate) only on problems whose reference is this short
    target_format: float = 0.8
    val_size: int = 32
    eval_every: int = 50
    min_steps: int = 100
    micro_batches: int = 4
    eval_short: int = 32  # held-out problems within max_example_tokens in the final report
    eval_long: int = 8  # held-out problems longer than max_example_tokens in the final report
    eval_max_new_tokens: int = 16384
    seed: int = 0

    def check(self) -> LongWarmStartRecipe:
        for name in (
            "max_steps",
            "batch_size",
            "max_example_tokens",
            "val_size",
            "eval_every",
            "micro_batches",
        ):
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "min_steps", "eval_short", "eval_long", "seed"):
            _check_int(name, getattr(self, name), 0)
        _check_int("eval_max_new_tokens", self.eval_max_new_tokens, 1)
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"long warm-start lr must be a finite number > 0, got {self.lr!r}")
        if not 0 < self.target_format <= 1:
            raise ValueError(f"long warm-start target_format must be in (0, 1], got {self.target_format!r}")
        if self.max_steps * self.batch_size * 4 > SEED_STRIDE:  # ~1 train prompt in 4 is short enough
            raise ValueError(f"long warm-start max_steps * batch_size must stay below {SEED_STRIDE // 4}")
        return self


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"long warm-start {name} must be an int >= {low}, got {value!r}")


def fingerprint(spec: TinyModelSpec, recipe: LongWarmStartRecipe) -> str:
    task = f"{LongMultiplicationTask.name}-{LongMultiplicationTask.version}"
    payload = json.dumps(
        {"model": spec.fingerprint(), "recipe": asdict(recipe), "task": task}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_path(spec: TinyModelSpec, recipe: LongWarmStartRecipe) -> Path:
    return cache_root() / "models" / f"tiny-qwen2-long-warm-{fingerprint(spec, recipe)}"


def reference_tokens(task: LongMultiplicationTask, prompt: Prompt) -> int:
    """Output tokens of the reference (one per character) plus EOS."""
    return len(task.reference_completion(prompt)) + 1


def short_examples(
    task: LongMultiplicationTask, tokenizer: Any, start: int, count: int, max_tokens: int
) -> tuple[list[Example], int]:
    """``count`` examples from train indices ``start`` onwards, skipping problems whose reference (with EOS)
    is longer than ``max_tokens``; returns them and the next index to read."""
    examples, index = [], start
    while len(examples) < count:
        prompt = task.make_prompt(index)
        index += 1
        if reference_tokens(task, prompt) > max_tokens:
            continue
        prompt_ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        output_ids = tokenizer(task.reference_completion(prompt), add_special_tokens=False)["input_ids"]
        examples.append(Example.prompt_and_output(prompt_ids, output_ids + [tokenizer.eos_token_id]))
    return examples, index


class ShortDataset:
    """The warm start's data: each step the next ``batch_size`` short train problems, from train index
    ``seed * SEED_STRIDE`` on. Steps are read in order (where a step starts depends on the skips before it)."""

    def __init__(self, task: LongMultiplicationTask, tokenizer: Any, recipe: LongWarmStartRecipe) -> None:
        self.task, self.tokenizer, self.recipe = task, tokenizer, recipe
        self.index = recipe.seed * SEED_STRIDE
        self.next_step = 0

    def __call__(self, step: int) -> list[Example]:
        if step != self.next_step:
            raise ValueError(
                f"the long warm start's data is read step by step: asked for {step}, at {self.next_step}"
            )
        recipe = self.recipe
        examples, self.index = short_examples(
            self.task, self.tokenizer, self.index, recipe.batch_size, recipe.max_example_tokens
        )
        self.next_step += 1
        return examples


def pick_prompts(
    task: LongMultiplicationTask, source: Callable[[int], Prompt], count: int, keep: Callable[[int], bool]
) -> list[Prompt]:
    """The first ``count`` prompts of ``source`` (by index) whose reference length (tokens) passes ``keep``."""
    prompts, index = [], 0
    while len(prompts) < count:
        prompt = source(index)
        index += 1
        if keep(reference_tokens(task, prompt)):
            prompts.append(prompt)
    return prompts


def length_report(
    model: Any, tokenizer: Any, task: LongMultiplicationTask, prompts: list[Prompt], max_new_tokens: int
) -> dict[str, float]:
    """Greedy generation on ``prompts``: rates of the reward components, and output lengths (tokens, EOS
    counted) against the references'. ``truncated``: outputs that ran to ``max_new_tokens`` without EOS."""
    if not prompts:
        return {"n": 0}
    outputs = generate(model, tokenizer, [p.text for p in prompts], max_new_tokens=max_new_tokens)
    scores = [task.score(p, tokenizer.decode(ids)) for p, ids in zip(prompts, outputs, strict=True)]
    lengths = [len(ids) + (len(ids) < max_new_tokens) for ids in outputs]  # + EOS when it stopped
    references = [reference_tokens(task, p) for p in prompts]
    return {
        "n": len(prompts),
        "format_rate": statistics.mean(s.components["format"] for s in scores),
        "correct_rate": accuracy(scores),
        "steps_mean": statistics.mean(s.components["steps"] for s in scores),
        "mean_output_tokens": statistics.mean(lengths),
        "max_output_tokens": max(lengths),
        "mean_reference_tokens": statistics.mean(references),
        "max_reference_tokens": max(references),
        "truncated": sum(len(ids) >= max_new_tokens for ids in outputs) / len(outputs),
    }


def validation_format(
    model: Any, tokenizer: Any, task: LongMultiplicationTask, prompts: list[Prompt]
) -> float:
    """Greedy format rate on short validation prompts (the stopping rule's measure)."""
    longest = max(reference_tokens(task, p) for p in prompts)
    outputs = generate(model, tokenizer, [p.text for p in prompts], max_new_tokens=longest + 16)
    return statistics.mean(
        task.score(p, tokenizer.decode(ids)).components["format"]
        for p, ids in zip(prompts, outputs, strict=True)
    )


class FormatStop:
    """The recipe's stopping rule, called after each step: greedy format rate on short validation prompts every
    ``eval_every`` steps from ``min_steps``; stop at ``target_format``."""

    def __init__(
        self, model: Any, tokenizer: Any, task: LongMultiplicationTask, recipe: LongWarmStartRecipe
    ) -> None:
        self.model, self.tokenizer, self.task, self.recipe = model, tokenizer, task, recipe
        short = recipe.max_example_tokens
        self.prompts = pick_prompts(task, task.validation_prompt, recipe.val_size, lambda n: n <= short)
        self.validation: list[tuple[int, float]] = []
        self.reached_target = False

    def __call__(self, steps: int) -> tuple[str, bool] | None:
        recipe = self.recipe
        if steps < recipe.min_steps or steps % recipe.eval_every:
            return None
        self.model.eval()
        rate = validation_format(self.model, self.tokenizer, self.task, self.prompts)
        self.validation.append((steps, rate))
        self.reached_target = rate >= recipe.target_format
        return f" validation format {rate:.2f} (target {recipe.target_format})", self.reached_target


def heldout_report(
    model: Any, tokenizer: Any, task: LongMultiplicationTask, recipe: LongWarmStartRecipe
) -> dict[str, dict[str, float]]:
    """The length report on held-out (test split) problems: short ones (as trained) and long ones (never)."""
    short = recipe.max_example_tokens

    def test_prompt(index: int) -> Prompt:
        return task.make_prompt(index, TEST)

    n_test = task.num_prompts(TEST)
    count_short = min(recipe.eval_short, n_test)
    shorts = pick_prompts(task, test_prompt, count_short, lambda n: n <= short) if count_short else []
    longs = _long_test_prompts(task, recipe)
    return {
        "short": length_report(model, tokenizer, task, shorts, short + 16),
        "long": length_report(model, tokenizer, task, longs, recipe.eval_max_new_tokens),
    }


def _long_test_prompts(task: LongMultiplicationTask, recipe: LongWarmStartRecipe) -> list[Prompt]:
    """Test-split problems longer than any trained on and within the generation budget, up to eval_long."""
    fits = [
        p
        for p in task.prompts(TEST)
        if recipe.max_example_tokens < reference_tokens(task, p) <= recipe.eval_max_new_tokens
    ]
    return fits[: recipe.eval_long]
