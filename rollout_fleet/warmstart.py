"""Supervised warm-start of the tiny model on the built-in arithmetic task.

RL needs a policy that solves some but not most held-out prompts, so the base model is trained with plain
next-token cross-entropy on reference scratchpads (loss on the output tokens and EOS only, never the prompt)
for a short, fixed number of steps. The result is cached under
``cache_root()/models/tiny-qwen2-warm-<fingerprint>``, where the fingerprint covers the model spec, the
training recipe and the task version, and ``warmstart.json`` inside it records the loss curve and the
held-out evaluation before and after. ``python -m rollout_fleet.warmstart --help`` builds it from a shell.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rollout_fleet.evaluation import evaluate
from rollout_fleet.model import TinyModelSpec, build_model, build_tokenizer, cache_root, save_model_dir
from rollout_fleet.tasks.arithmetic import ArithmeticTask

MARKER = "warmstart.json"


@dataclass(frozen=True)
class WarmStartRecipe:
    """The supervised recipe; every field is part of the cache fingerprint."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    micro_batches: int = 4
    seed: int = 0

    def check(self) -> WarmStartRecipe:
        for name in ("steps", "batch_size", "warmup_steps", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name in ("steps", "batch_size") else 0):
                raise ValueError(
                    f"warm-start {name} must be a non-negative int (steps, batch_size >= 1), got {value!r}"
                )
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"warm-start lr must be a finite number > 0, got {self.lr!r}")
        return self


def fingerprint(spec: TinyModelSpec, recipe: WarmStartRecipe) -> str:
    payload = json.dumps(
        {
            "model": spec.fingerprint(),
            "recipe": asdict(recipe),
            "task": f"{ArithmeticTask.name}-{ArithmeticTask.version}",
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_path(spec: TinyModelSpec, recipe: WarmStartRecipe) -> Path:
    return cache_root() / "models" / f"tiny-qwen2-warm-{fingerprint(spec, recipe)}"


def lr_at(step: int, recipe: WarmStartRecipe) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    span = max(recipe.steps - recipe.warmup_steps - 1, 1)
    progress = min((step - recipe.warmup_steps) / span, 1.0)
    floor = recipe.min_lr_ratio
    return recipe.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_examples(task: ArithmeticTask, tokenizer: Any, indices: list[int]) -> list[tuple[list[int], int]]:
    """(token ids of prompt + reference completion + EOS, prompt length) per train index."""
    examples = []
    for index in indices:
        prompt = task.make_prompt(index)
        prompt_ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        output_ids = tokenizer(task.reference_completion(prompt), add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids + output_ids + [tokenizer.eos_token_id], len(prompt_ids)))
    return examples


def make_batch(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (B, L), right-padded; labels are -100 on the prompt and the padding."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in examples])
    labels = torch.tensor(
        [[-100] * n_prompt + ids[n_prompt:] + [-100] * (width - len(ids)) for ids, n_prompt in examples]
    )
    return input_ids, labels


def step_loss(
    model: Any, examples: list[tuple[list[int], int]], pad_id: int, micro_batches: int
) -> torch.Tensor:
    """Mean cross-entropy over every output token of the step, backpropagated micro-batch by micro-batch.

    Examples are sorted by length and cut into ``micro_batches`` groups, so padding stays small: the task's
    lengths span 13 to 108 tokens and one padded batch would waste most of its compute. Returns the loss
    (detached); gradients are accumulated in the parameters.
    """
    ordered = sorted(examples, key=lambda e: len(e[0]))
    n_targets = sum(len(ids) - n_prompt for ids, n_prompt in examples)
    size = math.ceil(len(ordered) / micro_batches)
    total = torch.zeros(())
    for start in range(0, len(ordered), size):
        input_ids, labels = make_batch(ordered[start : start + size], pad_id)
        logits = model(input_ids=input_ids).logits[:, :-1]  # (B, L-1, V)
        loss = (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            / n_targets
        )
        loss.backward()
        total += loss.detach()
    return total


def train(
    model: Any,
    tokenizer: Any,
    recipe: WarmStartRecipe,
    task: ArithmeticTask | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[float]:
    """Train in place; returns the loss of every step. Examples are train-split prompts only.

    Each seed reads its own stretch of train indices (seed * 10^7 onwards), so seeds see different data.
    """
    task = task or ArithmeticTask()
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay
    )
    model.train()
    losses: list[float] = []
    start, base = time.monotonic(), recipe.seed * 10_000_000
    for step in range(recipe.steps):
        indices = list(range(base + step * recipe.batch_size, base + (step + 1) * recipe.batch_size))
        examples = make_examples(task, tokenizer, indices)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss(model, examples, tokenizer.pad_token_id, recipe.micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss))
        if progress and ((step + 1) % 50 == 0 or step + 1 == recipe.steps):
            elapsed = time.monotonic() - start
            progress(f"warm-start step {step + 1}/{recipe.steps} loss {losses[-1]:.4f} ({elapsed:.1f} s)")
    model.eval()
    return losses


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _is_built(path: Path, key: str) -> bool:
    marker = path / MARKER
    if not (marker.is_file() and (path / "model.safetensors").is_file()):
        return False
    try:
        return json.loads(marker.read_text()).get("fingerprint") == key
    except (OSError, json.JSONDecodeError):
        return False


def init_warm_model(
    path: str | Path | None = None,
    steps: int | None = None,
    seed: int = 0,
    lr: float | None = None,
    batch_size: int | None = None,
    spec: TinyModelSpec | None = None,
    progress: Callable[[str], None] | None = _stderr,
) -> Path:
    """The warm-started tiny model directory, built (and evaluated) unless a matching one is already there.

    Concurrent callers for the same path wait on a lock file instead of training twice; the directory
    appears atomically (written beside it, then renamed), with ``warmstart.json`` inside.
    """
    spec = spec or TinyModelSpec()
    defaults = WarmStartRecipe()
    recipe = WarmStartRecipe(
        steps=defaults.steps if steps is None else steps,
        lr=defaults.lr if lr is None else lr,
        batch_size=defaults.batch_size if batch_size is None else batch_size,
        seed=seed,
    ).check()
    key = fingerprint(spec, recipe)
    path = Path(path) if path else default_path(spec, recipe)
    if _is_built(path, key):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_built(path, key):
            return path
        _build(path, spec, recipe, key, progress)
    return path


def _build(
    path: Path, spec: TinyModelSpec, recipe: WarmStartRecipe, key: str, progress: Callable[[str], None] | None
) -> None:
    if True:
        started = time.monotonic()
        torch.manual_seed(recipe.seed)
        tokenizer = build_tokenizer()
        model = build_model(spec, tokenizer)
        task = ArithmeticTask()
        before = evaluate(model, tokenizer, task)
        train_start = time.monotonic()
        losses = train(model, tokenizer, recipe, task, progress)
        train_s = time.monotonic() - train_start
        after = evaluate(model, tokenizer, task)
        if progress:
            progress(
                f"warm-start held-out greedy {before['greedy_accuracy']:.3f} -> {after['greedy_accuracy']:.3f}, "
                f"sampled {before['sampled_accuracy']:.3f} -> {after['sampled_accuracy']:.3f}"
            )
        record = {
            "fingerprint": key,
            "model_spec": asdict(spec),
            "recipe": asdict(recipe),
            "task": {"name": task.name, "version": task.version, "seed": task.seed},
            "eval_before": before,
            "eval_after": after,
            "losses": losses,
            "train_seconds": round(train_s, 2),
            "total_seconds": round(time.monotonic() - started, 2),
            "torch_threads": torch.get_num_threads(),
        }
        staging = save_model_dir(model, tokenizer, path.with_name(path.name + ".staging"))
        (staging / MARKER).write_text(json.dumps(record, indent=1))
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_fleet.warmstart``: build the warm-started model and print its path and accuracy."""
    parser = argparse.ArgumentParser(
        prog="python -m rollout_fleet.warmstart",
        description="Supervised warm-start of the tiny Qwen2 model on the arithmetic task (cached).",
    )
    parser.add_argument("--out", type=Path, default=None, help="model directory (default: the cache)")
    parser.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps (default {WarmStartRecipe.steps})"
    )
    parser.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    parser.add_argument(
        "--lr", type=float, default=None, help=f"peak learning rate (default {WarmStartRecipe.lr})"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        path = init_warm_model(args.out, steps=args.steps, seed=args.seed, lr=args.lr)
    except ValueError as e:
        parser.error(str(e))
    record = json.loads((path / MARKER).read_text())
    print(json.dumps({"path": str(path), "eval_after": record["eval_after"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
