"""The warm-started tiny models: each task's dataset and recipe (rollout_fleet) trained by the one supervised
trainer (learner.sft), built once and cached.

Three warm starts: the arithmetic one (what ``streamrl up`` serves by default, built in a child process under
:data:`~rollout_fleet.warmstart.PINNED_NUMERICS` so every x86-64 machine builds the same bits), the tool-format
one (``tool_arithmetic``) and the long-context one (``long_multiplication``). Each is cached under
``cache_root()/models/`` by a fingerprint of model spec, recipe and task; concurrent builders wait on a lock file,
and the directory appears atomically with ``warmstart.json`` (loss curve, validation checks, held-out evaluation)
inside. ``streamrl model init`` (or ``python -m streamrl.warm_start``) builds one from a shell.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from learner.sft import Progress, TrainRecipe, make_optimizer, train_loop
from rollout_fleet import long_warmstart as long_ws
from rollout_fleet import tool_warmstart as tool_ws
from rollout_fleet import warmstart as arith_ws
from rollout_fleet.local_eval import evaluate
from rollout_fleet.model import LONG_CONTEXT_SPEC, TinyModelSpec, build_model, build_tokenizer, save_model_dir
from rollout_fleet.tasks.arithmetic import ArithmeticTask
from rollout_fleet.tasks.long_multiplication import LongMultiplicationTask
from rollout_fleet.tasks.tool_arithmetic import ToolArithmeticTask
from rollout_fleet.warmstart import MARKER, PINNED_NUMERICS, WarmStartRecipe

ProgressFn = Callable[[str], None] | None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---- the recipes as the trainer reads them ----------------------------------------------------------------


def arithmetic_recipe(recipe: WarmStartRecipe) -> TrainRecipe:
    return TrainRecipe(
        max_steps=recipe.max_steps, lr=recipe.lr, warmup_steps=recipe.warmup_steps, lr_schedule="cosine",
        final_lr_ratio=recipe.final_lr_ratio, weight_decay=recipe.weight_decay, micro_batches=recipe.micro_batches,
        seed=recipe.seed,
    )  # fmt: skip


def tool_recipe(recipe: tool_ws.ToolWarmStartRecipe) -> TrainRecipe:
    return TrainRecipe(
        max_steps=recipe.max_steps, lr=recipe.lr, warmup_steps=recipe.warmup_steps, lr_schedule="constant",
        micro_batches=recipe.micro_batches, seed=recipe.seed,
    )  # fmt: skip


def long_recipe(recipe: long_ws.LongWarmStartRecipe) -> TrainRecipe:
    return TrainRecipe(
        max_steps=recipe.max_steps, lr=recipe.lr, warmup_steps=recipe.warmup_steps, lr_schedule="cosine",
        final_lr_ratio=recipe.final_lr_ratio, micro_batches=recipe.micro_batches, seed=recipe.seed,
    )  # fmt: skip


# ---- caching -----------------------------------------------------------------------------------------------


def _is_built(path: Path, key: str) -> bool:
    marker = path / MARKER
    if not (marker.is_file() and (path / "model.safetensors").is_file()):
        return False
    try:
        return json.loads(marker.read_text()).get("fingerprint") == key
    except (OSError, json.JSONDecodeError):
        return False


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


def publish_model_dir(model: Any, tokenizer: Any, path: Path, record: dict[str, Any]) -> None:
    """Write a warm-started model with its ``warmstart.json`` beside ``path``, then rename it into place, so a
    reader never sees a half-written directory."""
    staging = save_model_dir(model, tokenizer, path.with_name(path.name + ".staging"))
    (staging / MARKER).write_text(json.dumps(record, indent=1))
    if path.exists():
        shutil.rmtree(path)
    staging.rename(path)


# ---- the shared build: train a fresh model on a task's data, then record and publish it -----------------------


def _train(
    model: Any,
    tokenizer: Any,
    recipe: TrainRecipe,
    data: Any,
    stop: Any,
    label: str,
    progress: ProgressFn,
    every: int | None = None,
) -> Any:
    """The supervised trainer's loop over ``data`` until ``stop`` says so or ``recipe.max_steps``; its log."""
    optimizer = make_optimizer(model, recipe)
    reporter = Progress(progress, label) if every is None else Progress(progress, label, every=every)
    return train_loop(model, optimizer, recipe, data, tokenizer.pad_token_id, stop, reporter)


def _record(key: str, spec: TinyModelSpec, recipe: Any, task: Any, log: Any, stop: Any) -> dict[str, Any]:
    """What every warm start records in ``warmstart.json``; each adds its own evaluation and timings."""
    return {
        "fingerprint": key,
        "model_spec": asdict(spec),
        "recipe": asdict(recipe),
        "task": {"name": task.name, "version": task.version, "seed": task.seed},
        "steps": log.steps,
        "reached_target": stop.reached_target,
        "validation": stop.validation,
        "losses": log.losses,
    }


# ---- arithmetic ----------------------------------------------------------------------------------------------


def init_warm_model(
    path: str | Path | None = None,
    steps: int | None = None,
    seed: int = 0,
    lr: float | None = None,
    target: float | None = None,
    spec: TinyModelSpec | None = None,
    progress: ProgressFn = _stderr,
) -> Path:
    """The warm-started tiny model directory, built (and evaluated) unless a matching one is already there.

    ``steps`` caps the training steps (default 500; training usually stops earlier, at the validation
    target). The build runs in a child process under pinned numerics (:func:`_build_in_child`)."""
    spec = spec or TinyModelSpec()
    recipe = arith_ws.make_recipe(steps, seed, lr, target)
    key = arith_ws.fingerprint(spec, recipe)
    path = Path(path) if path else arith_ws.default_path(spec, recipe)
    return build_once(path, key, lambda: _build_in_child(path, spec, recipe, progress))


def _build_in_child(path: Path, spec: TinyModelSpec, recipe: WarmStartRecipe, progress: ProgressFn) -> None:
    """Run the build in a child process under :data:`PINNED_NUMERICS` (they take effect only before torch is
    imported); its progress lines go to ``progress``."""
    job = json.dumps({"path": str(path), "spec": asdict(spec), "recipe": asdict(recipe)})
    command = [sys.executable, "-m", "streamrl.warm_start", "--build-job", job]
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
    _build_arithmetic(Path(spec_and_recipe["path"]), spec, recipe, _stderr)
    return 0


def _build_arithmetic(path: Path, spec: TinyModelSpec, recipe: WarmStartRecipe, progress: ProgressFn) -> None:
    started, cpu_started = time.monotonic(), time.process_time()
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)  # the same weights as init_tiny_model(spec)
    task = ArithmeticTask()
    before = evaluate(model, tokenizer, task)
    train_start = time.monotonic()
    stop = arith_ws.ValidationStop(model, tokenizer, task, recipe)
    data = arith_ws.dataset(task, tokenizer, recipe)
    log = _train(model, tokenizer, arithmetic_recipe(recipe), data, stop, "warm-start", progress)
    train_s = time.monotonic() - train_start
    after = evaluate(model, tokenizer, task)
    if progress:
        progress(
            f"warm-start stopped at step {log.steps} (target reached: {stop.reached_target}); held-out greedy "
            f"{before['greedy_accuracy']:.3f} -> {after['greedy_accuracy']:.3f}, sampled "
            f"{before['sampled_accuracy']:.3f} -> {after['sampled_accuracy']:.3f}"
        )
    record = {
        **_record(arith_ws.fingerprint(spec, recipe), spec, recipe, task, log, stop),
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


# ---- tool_arithmetic ---------------------------------------------------------------------------------------


def init_tool_warm_model(
    path: str | Path | None = None,
    recipe: tool_ws.ToolWarmStartRecipe | None = None,
    spec: TinyModelSpec | None = None,
    progress: ProgressFn = _stderr,
) -> Path:
    """The tool warm-started model directory, built unless a matching one is there (in this process, at its
    torch thread count)."""
    spec = spec or TinyModelSpec()
    recipe = (recipe or tool_ws.ToolWarmStartRecipe()).check()
    key = tool_ws.fingerprint(spec, recipe)
    path = Path(path) if path else tool_ws.default_path(spec, recipe)
    return build_once(path, key, lambda: _build_tool(path, spec, recipe, key, progress))


def _build_tool(
    path: Path, spec: TinyModelSpec, recipe: tool_ws.ToolWarmStartRecipe, key: str, progress: ProgressFn
) -> None:
    started = time.monotonic()
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    task = ToolArithmeticTask(tokenizer=tokenizer)
    stop = tool_ws.ToolValidationStop(model, tokenizer, task, recipe)
    data = tool_ws.dataset(task, tokenizer, recipe)
    log = _train(model, tokenizer, tool_recipe(recipe), data, stop, "tool warm-start", progress)
    after = tool_ws.evaluate_episodes(model, tokenizer, task, tool_ws.heldout_prompts(task))
    if progress:
        g, s = after["greedy"], after["sampled"]
        progress(
            f"tool warm-start stopped at step {log.steps} (target reached: {stop.reached_target}); held-out "
            f"greedy accuracy {g['accuracy']:.3f} (needs_tool {g['accuracy_needs_tool']:.3f}), sampled tool-call "
            f"rate on needs_tool {s['tool_call_rate_needs_tool']:.3f}"
        )
    record = {
        **_record(key, spec, recipe, task, log, stop),
        "eval_after": after,
        "total_seconds": round(time.monotonic() - started, 2),
        "torch_threads": torch.get_num_threads(),
    }
    publish_model_dir(model, tokenizer, path, record)


# ---- long_multiplication -----------------------------------------------------------------------------------


def init_long_warm_model(
    path: str | Path | None = None,
    steps: int | None = None,
    seed: int | None = None,
    target: float | None = None,
    spec: TinyModelSpec | None = None,
    recipe: long_ws.LongWarmStartRecipe | None = None,
    progress: ProgressFn = _stderr,
) -> Path:
    """The warm-started long-context model directory, built (and evaluated) unless a matching one is there.

    ``steps`` (the cap on training steps), ``seed`` and ``target`` (the validation format rate to stop at)
    override ``recipe`` (default :class:`~rollout_fleet.long_warmstart.LongWarmStartRecipe`) when given."""
    spec = spec or LONG_CONTEXT_SPEC
    recipe = recipe or long_ws.LongWarmStartRecipe()
    recipe = replace(
        recipe,
        max_steps=recipe.max_steps if steps is None else steps,
        target_format=recipe.target_format if target is None else target,
        seed=recipe.seed if seed is None else seed,
    ).check()
    key = long_ws.fingerprint(spec, recipe)
    path = Path(path) if path else long_ws.default_path(spec, recipe)
    return build_once(path, key, lambda: _build_long(path, spec, recipe, key, progress))


def _build_long(
    path: Path, spec: TinyModelSpec, recipe: long_ws.LongWarmStartRecipe, key: str, progress: ProgressFn
) -> None:
    started, cpu_started = time.monotonic(), time.process_time()
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    task = LongMultiplicationTask()
    stop = long_ws.FormatStop(model, tokenizer, task, recipe)
    data = long_ws.ShortDataset(task, tokenizer, recipe)
    log = _train(model, tokenizer, long_recipe(recipe), data, stop, "long warm-start", progress, every=25)
    train_s = time.monotonic() - started
    report = long_ws.heldout_report(model, tokenizer, task, recipe)
    if progress:
        progress(
            f"long warm-start stopped at step {log.steps} (target reached: {stop.reached_target}); {report}"
        )
    record = {
        **_record(key, spec, recipe, task, log, stop),
        "heldout": report,
        "train_seconds": round(train_s, 2),
        "total_seconds": round(time.monotonic() - started, 2),
        "cpu_seconds": round(time.process_time() - cpu_started, 2),
        "torch_threads": torch.get_num_threads(),
    }
    publish_model_dir(model, tokenizer, path, record)


# ---- which, and the command line ---------------------------------------------------------------------------


def warm_model_for_task(task: str) -> Path:
    """The cached warm-started model for a task (what ``streamrl up`` serves when no model is given): the
    long-context one for ``long_multiplication``, the tool-format one for ``tool_arithmetic``, the arithmetic
    one for every other task."""
    if task == "tool_arithmetic":
        return init_tool_warm_model()
    if task == "long_multiplication":
        return init_long_warm_model()
    return init_warm_model()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl model init",
        description="Supervised warm start of the tiny Qwen2 model on the arithmetic task, or with --task of the "
        "tool-format model (tool_arithmetic) or the long-context model (long_multiplication), by the supervised "
        "trainer of `streamrl sft` (cached: a second run with the same options returns the same directory at once).",
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
        "--tool-share",
        type=float,
        default=None,
        help="tool_arithmetic: share of needs-tool training episodes that call the tool "
        f"(default {tool_ws.ToolWarmStartRecipe.tool_share})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of the tool_arithmetic and long_multiplication builds (default 1; the "
        "arithmetic build always runs on one, in a child under pinned numerics, so that every machine builds the "
        "same model)",
    )
    parser.add_argument(
        "--task",
        choices=("arithmetic", "tool_arithmetic", "long_multiplication"),
        default="arithmetic",
        help="task to warm-start on (default arithmetic); long_multiplication builds the long-context model "
        "(--target is then the validation format rate; --lr is not taken)",
    )
    parser.add_argument("--build-job", help=argparse.SUPPRESS)  # the build's child process (_build_in_child)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``streamrl model init``: build the warm-started model and print its path and accuracy."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.build_job:
        return _run_build_job(args.build_job)
    torch.set_num_threads(args.threads)
    try:
        path = _init_for(args)
    except ValueError as e:
        parser.error(str(e))
    record = json.loads((path / MARKER).read_text())
    keys = ("steps", "reached_target", "heldout" if args.task == "long_multiplication" else "eval_after")
    summary = {key: record.get(key) for key in keys}
    print(json.dumps({"path": str(path), **summary}))
    return 0


def _init_for(args: argparse.Namespace) -> Path:
    """The command line's model: the arithmetic warm start, or the tool or long task's."""
    if args.task != "tool_arithmetic" and args.tool_share is not None:
        raise ValueError("--tool-share is an option of the tool_arithmetic warm start only")
    if args.task == "arithmetic":
        return init_warm_model(args.out, steps=args.steps, seed=args.seed, lr=args.lr, target=args.target)
    if args.lr is not None or args.target is not None and args.task == "tool_arithmetic":
        raise ValueError(f"--lr is not an option of the {args.task} warm start" if args.lr is not None else
                         "--target is not an option of the tool_arithmetic warm start")  # fmt: skip
    if args.task == "tool_arithmetic":
        defaults = tool_ws.ToolWarmStartRecipe()
        recipe = replace(
            defaults,
            max_steps=defaults.max_steps if args.steps is None else args.steps,
            seed=args.seed,
            tool_share=defaults.tool_share if args.tool_share is None else args.tool_share,
        ).check()
        return init_tool_warm_model(args.out, recipe)
    return init_long_warm_model(args.out, steps=args.steps, seed=args.seed, target=args.target)


if __name__ == "__main__":
    raise SystemExit(main())
