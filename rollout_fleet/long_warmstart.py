"""Supervised warm-start of the long-context tiny model on the long-output task (``long_multiplication``).

The untrained model writes garbage, so ``streamrl up --rollout.task.name=long_multiplication`` would measure
nothing. This teaches the scratchpad format on the *shorter* instances only (reference at most
``max_example_tokens`` tokens, the cheap part on a CPU), with the same next-token cross-entropy as the
arithmetic warm-start (:func:`rollout_fleet.warmstart.step_loss`: loss on the output tokens and EOS). The
format carries its state line to line (docs/tasks.md), so a model that has learned it on short problems keeps
writing it on long ones: the record measures how far, on held-out problems longer than any trained on.

Training stops at the first check where the greedy format rate on ``val_size`` short validation prompts (from
the held-out problem space, never trained on) reaches ``target_format``, or after ``max_steps``. The result is
cached under ``cache_root()/models/tiny-qwen2-long-warm-<fingerprint>`` (model spec, recipe and task version),
built once under a lock and renamed into place; ``warmstart.json`` inside holds the loss curve, the validation
checks and the held-out length report (short and long problems). ``python -m rollout_fleet.warmstart --task
long_multiplication`` builds it from a shell.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rollout_fleet.eval_stats import accuracy
from rollout_fleet.evaluation import generate
from rollout_fleet.model import (
    LONG_CONTEXT_SPEC,
    TinyModelSpec,
    build_model,
    build_tokenizer,
    cache_root,
)
from rollout_fleet.tasks import TEST, Prompt
from rollout_fleet.tasks.long_multiplication import LongMultiplicationTask
from rollout_fleet.warmstart import (
    SEED_STRIDE,
    TrainLog,
    _stderr,
    build_once,
    lr_at,
    publish_model_dir,
    step_loss,
)

Example = tuple[list[int], int]  # (prompt + output + EOS token ids, prompt length)


@dataclass(frozen=True)
class LongWarmStartRecipe:
    """The supervised recipe of the long task; every field is part of the cache fingerprint."""

    max_steps: int = 600
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 20
    final_lr_ratio: float = 1.0  # constant after warm-up (lr_at's cosine is available)
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
        examples.append((prompt_ids + output_ids + [tokenizer.eos_token_id], len(prompt_ids)))
    return examples, index


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


def train_long(
    model: Any,
    tokenizer: Any,
    recipe: LongWarmStartRecipe,
    task: LongMultiplicationTask,
    progress: Callable[[str], None] | None = None,
) -> TrainLog:
    """Train in place on short train problems until the validation format target or ``max_steps``."""
    short = recipe.max_example_tokens
    val = pick_prompts(task, task.validation_prompt, recipe.val_size, lambda n: n <= short)
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)
    log = TrainLog(losses=[], validation=[], steps=0, reached_target=False)
    started, index = time.monotonic(), recipe.seed * SEED_STRIDE
    for step in range(recipe.max_steps):
        model.train()
        examples, index = short_examples(task, tokenizer, index, recipe.batch_size, short)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)  # reads lr, warmup_steps, max_steps, final_lr_ratio
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss(model, examples, tokenizer.pad_token_id, recipe.micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        log.losses.append(round(float(loss), 5))
        log.steps = step + 1
        line = f"long warm-start step {log.steps}/{recipe.max_steps} loss {log.losses[-1]:.4f}"
        checked = log.steps >= recipe.min_steps and log.steps % recipe.eval_every == 0
        if checked:
            model.eval()
            rate = validation_format(model, tokenizer, task, val)
            log.validation.append((log.steps, rate))
            log.reached_target = rate >= recipe.target_format
            line += f" validation format {rate:.2f} (target {recipe.target_format})"
        if progress and (checked or log.steps % 25 == 0 or log.steps == recipe.max_steps):
            progress(f"{line} ({time.monotonic() - started:.1f} s)")
        if log.reached_target:
            break
    model.eval()
    return log


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


def init_long_warm_model(
    path: str | Path | None = None,
    steps: int | None = None,
    seed: int | None = None,
    target: float | None = None,
    spec: TinyModelSpec | None = None,
    recipe: LongWarmStartRecipe | None = None,
    progress: Callable[[str], None] | None = _stderr,
) -> Path:
    """The warm-started long-context model directory, built (and evaluated) unless a matching one is there.

    ``steps`` (the cap on training steps), ``seed`` and ``target`` (the validation format rate to stop at)
    override ``recipe`` (default :class:`LongWarmStartRecipe`) when given. Concurrent callers for one path
    wait on a lock file instead of training twice.
    """
    spec = spec or LONG_CONTEXT_SPEC
    recipe = recipe or LongWarmStartRecipe()
    recipe = replace(
        recipe,
        max_steps=recipe.max_steps if steps is None else steps,
        target_format=recipe.target_format if target is None else target,
        seed=recipe.seed if seed is None else seed,
    ).check()
    key = fingerprint(spec, recipe)
    path = Path(path) if path else default_path(spec, recipe)
    return build_once(path, key, lambda: _build(path, spec, recipe, key, progress))


def _build(
    path: Path,
    spec: TinyModelSpec,
    recipe: LongWarmStartRecipe,
    key: str,
    progress: Callable[[str], None] | None,
) -> None:
    started, cpu_started = time.monotonic(), time.process_time()
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    task = LongMultiplicationTask()
    log = train_long(model, tokenizer, recipe, task, progress)
    train_s = time.monotonic() - started
    report = heldout_report(model, tokenizer, task, recipe)
    if progress:
        progress(
            f"long warm-start stopped at step {log.steps} (target reached: {log.reached_target}); {report}"
        )
    record = {
        "fingerprint": key,
        "model_spec": asdict(spec),
        "recipe": asdict(recipe),
        "task": {"name": task.name, "version": task.version, "seed": task.seed},
        "steps": log.steps,
        "reached_target": log.reached_target,
        "validation": log.validation,
        "losses": log.losses,
        "heldout": report,
        "train_seconds": round(train_s, 2),
        "total_seconds": round(time.monotonic() - started, 2),
        "cpu_seconds": round(time.process_time() - cpu_started, 2),
        "torch_threads": torch.get_num_threads(),
    }
    publish_model_dir(model, tokenizer, path, record)
