"""Supervised warm-start of the tiny model on the built-in arithmetic task.

RL needs a policy that solves some but not most held-out prompts, so the base model is trained with plain
next-token cross-entropy on reference scratchpads (loss on the output tokens and EOS only, never the prompt)
until greedy accuracy on train-split validation prompts reaches a target. The result is cached under
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
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rollout_fleet.eval_stats import solved
from rollout_fleet.evaluation import evaluate, generate
from rollout_fleet.model import TinyModelSpec, build_model, build_tokenizer, cache_root, save_model_dir
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


def lr_at(step: int, recipe: WarmStartRecipe) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from ``lr`` to ``final_lr_ratio * lr`` at ``max_steps``."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(recipe.max_steps - recipe.warmup_steps, 1)
    ratio = recipe.final_lr_ratio + (1 - recipe.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return recipe.lr * ratio


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


def validation_accuracy(model: Any, tokenizer: Any, task: ArithmeticTask, prompts: list[Prompt]) -> float:
    """Greedy accuracy on train-split validation prompts (the stopping rule's measure)."""
    outputs = generate(model, tokenizer, [p.text for p in prompts])
    hits = sum(solved(task.score(p, tokenizer.decode(ids))) for p, ids in zip(prompts, outputs, strict=True))
    return hits / len(prompts)


@dataclass
class TrainLog:
    losses: list[float]
    validation: list[tuple[int, float]]  # (step, greedy accuracy) at each check
    steps: int
    reached_target: bool


def train(
    model: Any,
    tokenizer: Any,
    recipe: WarmStartRecipe,
    task: ArithmeticTask | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainLog:
    """Train in place until the validation target or ``max_steps``; examples are train-split prompts only."""
    task = task or ArithmeticTask()
    val = [task.validation_prompt(i) for i in range(recipe.val_size)]
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay
    )
    log = TrainLog(losses=[], validation=[], steps=0, reached_target=False)
    start, base = time.monotonic(), recipe.seed * SEED_STRIDE
    for step in range(recipe.max_steps):
        model.train()
        indices = range(base + step * recipe.batch_size, base + (step + 1) * recipe.batch_size)
        examples = make_examples(task, tokenizer, list(indices))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss(model, examples, tokenizer.pad_token_id, recipe.micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        log.losses.append(round(float(loss), 5))
        log.steps = step + 1
        line = f"warm-start step {log.steps}/{recipe.max_steps} loss {log.losses[-1]:.4f}"
        close = bool(log.validation) and log.validation[-1][1] >= recipe.target_accuracy / 2
        every = recipe.eval_every_close if close else recipe.eval_every
        checked = log.steps >= recipe.min_steps and log.steps % every == 0
        if checked:
            model.eval()
            accuracy = validation_accuracy(model, tokenizer, task, val)
            log.validation.append((log.steps, accuracy))
            log.reached_target = accuracy >= recipe.target_accuracy
            line += f" validation greedy {accuracy:.2f} (target {recipe.target_accuracy})"
        if progress and (checked or log.steps % 50 == 0 or log.steps == recipe.max_steps):
            progress(f"{line} ({time.monotonic() - start:.1f} s)")
        if log.reached_target:
            break
    model.eval()
    return log


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


def init_warm_model(
    path: str | Path | None = None,
    steps: int | None = None,
    seed: int = 0,
    lr: float | None = None,
    target: float | None = None,
    spec: TinyModelSpec | None = None,
    progress: Callable[[str], None] | None = _stderr,
) -> Path:
    """The warm-started tiny model directory, built (and evaluated) unless a matching one is already there.

    ``steps`` caps the training steps (default 500; training usually stops earlier, at the validation
    target). Concurrent callers for the same path wait on a lock file instead of training twice; the
    directory appears atomically (written beside it, then renamed), with ``warmstart.json`` inside.
    """
    spec = spec or TinyModelSpec()
    recipe = make_recipe(steps, seed, lr, target)
    key = fingerprint(spec, recipe)
    path = Path(path) if path else default_path(spec, recipe)
    return build_once(path, key, lambda: _build_in_child(path, spec, recipe, progress))


def _build_in_child(
    path: Path, spec: TinyModelSpec, recipe: WarmStartRecipe, progress: Callable[[str], None] | None
) -> None:
    """Run the build in a child process under :data:`PINNED_NUMERICS` (they take effect only before torch is
    imported); its progress lines go to ``progress``."""
    job = json.dumps({"path": str(path), "spec": asdict(spec), "recipe": asdict(recipe)})
    command = [sys.executable, "-m", "rollout_fleet.warmstart", "--build-job", job]
    env = {**os.environ, **PINNED_NUMERICS}
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as child:
        assert child.stderr is not None
        tail: list[str] = []
        for line in child.stderr:
            tail = [*tail[-40:], line.rstrip()]
            if progress and line.startswith("warm-start"):
                progress(line.rstrip())
    if child.returncode != 0:
        raise RuntimeError(
            f"the warm-start build of {path} failed (exit {child.returncode}):\n" + "\n".join(tail)
        )


def _run_build_job(job: str) -> int:
    """The child's side of :func:`_build_in_child`: deterministic kernels, one thread, the build."""
    spec_and_recipe = json.loads(job)
    spec = TinyModelSpec(**spec_and_recipe["spec"])
    recipe = WarmStartRecipe(**spec_and_recipe["recipe"]).check()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    _build(Path(spec_and_recipe["path"]), spec, recipe, fingerprint(spec, recipe), _stderr)
    return 0


def build_once(path: Path, key: str, build: Callable[[], None]) -> Path:
    """``build()`` writes the model directory ``path`` unless it is there already with fingerprint ``key``;
    concurrent callers wait on a lock file beside it instead of building twice."""
    if _is_built(path, key):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_built(path, key):
            build()
    return path


def _build(
    path: Path, spec: TinyModelSpec, recipe: WarmStartRecipe, key: str, progress: Callable[[str], None] | None
) -> None:
    started, cpu_started = time.monotonic(), time.process_time()
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)  # the same weights as init_tiny_model(spec)
    task = ArithmeticTask()
    before = evaluate(model, tokenizer, task)
    train_start = time.monotonic()
    log = train(model, tokenizer, recipe, task, progress)
    train_s = time.monotonic() - train_start
    after = evaluate(model, tokenizer, task)
    if progress:
        progress(
            f"warm-start stopped at step {log.steps} (target reached: {log.reached_target}); held-out greedy "
            f"{before['greedy_accuracy']:.3f} -> {after['greedy_accuracy']:.3f}, sampled "
            f"{before['sampled_accuracy']:.3f} -> {after['sampled_accuracy']:.3f}"
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
        "eval_before": before,
        "eval_after": after,
        "train_seconds": round(train_s, 2),
        "total_seconds": round(time.monotonic() - started, 2),
        "cpu_seconds": round(time.process_time() - cpu_started, 2),  # what a quiet core would take
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numerics": {name: os.environ.get(name) for name in PINNED_NUMERICS},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    publish_model_dir(model, tokenizer, path, record)


def publish_model_dir(model: Any, tokenizer: Any, path: Path, record: dict[str, Any]) -> None:
    """Write a warm-started model with its ``warmstart.json`` beside ``path``, then rename it into place, so a
    reader never sees a half-written directory."""
    staging = save_model_dir(model, tokenizer, path.with_name(path.name + ".staging"))
    (staging / MARKER).write_text(json.dumps(record, indent=1))
    if path.exists():
        shutil.rmtree(path)
    staging.rename(path)


def warm_model_for_task(task: str) -> Path:
    """The cached warm-started model for a task (what ``streamrl up`` serves when no model is given): the
    long-context one for ``long_multiplication``, the tool-format one for ``tool_arithmetic``, the arithmetic
    one for every other task."""
    if task == "tool_arithmetic":
        from rollout_fleet.tool_warmstart import init_tool_warm_model

        return init_tool_warm_model()
    if task == "long_multiplication":
        from rollout_fleet.long_warmstart import init_long_warm_model

        return init_long_warm_model()
    return init_warm_model()


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_fleet.warmstart``: build the warm-started model and print its path and accuracy."""
    parser = argparse.ArgumentParser(
        prog="python -m rollout_fleet.warmstart",
        description="Supervised warm-start of the tiny Qwen2 model on the arithmetic task, or with --task "
        "long_multiplication of its long-context variant on the long-output task (cached: a second run with the "
        "same options returns the same directory at once).",
    )
    parser.add_argument("--out", type=Path, default=None, help="model directory (default: under the cache)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"cap on optimizer steps (default {WarmStartRecipe.max_steps})",
    )
    parser.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    parser.add_argument(
        "--lr", type=float, default=None, help=f"learning rate (default {WarmStartRecipe.lr})"
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help=f"stop at this validation greedy accuracy (default {WarmStartRecipe.target_accuracy})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of the long_multiplication build (default 1; the arithmetic build always "
        "runs on one, in a child under pinned numerics, so that every machine builds the same model)",
    )
    parser.add_argument(
        "--task",
        choices=("arithmetic", "long_multiplication"),
        default="arithmetic",
        help="task to warm-start on (default arithmetic); long_multiplication builds the long-context model "
        "(--target is then the validation format rate; --lr is not taken)",
    )
    parser.add_argument("--build-job", help=argparse.SUPPRESS)  # the build's child process (_build_in_child)
    args = parser.parse_args(argv)
    if args.build_job:
        return _run_build_job(args.build_job)
    torch.set_num_threads(args.threads)
    try:
        path = _init_for(args)
    except ValueError as e:
        parser.error(str(e))
    record = json.loads((path / MARKER).read_text())
    keys = ("steps", "reached_target", "eval_after" if args.task == "arithmetic" else "heldout")
    summary = {key: record.get(key) for key in keys}
    print(json.dumps({"path": str(path), **summary}))
    return 0


def _init_for(args: argparse.Namespace) -> Path:
    """The command line's model: the arithmetic warm-start, or the long task's."""
    if args.task == "arithmetic":
        return init_warm_model(args.out, steps=args.steps, seed=args.seed, lr=args.lr, target=args.target)
    if args.lr is not None:
        raise ValueError("--lr is not an option of the long_multiplication warm-start")
    from rollout_fleet.long_warmstart import init_long_warm_model

    return init_long_warm_model(args.out, steps=args.steps, seed=args.seed, target=args.target)


if __name__ == "__main__":
    raise SystemExit(main())
