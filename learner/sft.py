"""Supervised training: the learner's second mode, and the one trainer behind every warm start.

The core (:func:`train_loop`) trains any causal LM in place on examples (token ids with a loss mask, see
:mod:`learner.sft_data`): per step, the learning rate of :func:`lr_at`, the mean cross-entropy over every masked
token of the step (:func:`masked_step_loss`, backpropagated piece by piece), clipping by global norm and an AdamW
step. The warm starts (``streamrl.warm_start``) call it with a dataset and a recipe made from a task;
``streamrl sft`` (:func:`run_sft`) calls it on an FSDP2-sharded model loaded the learner's way, with a JSONL or
Parquet dataset, checkpoints and resume, and an HF export at the end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from common.config import SharedConfig
from common.configlib import ConfigError
from common.lifecycle import crash_point
from common.supervised import Example
from learner.config import SftConfig
from learner.sft_data import DataError, data_format, load_examples

log = logging.getLogger("streamrl.sft")


@dataclass(frozen=True)
class TrainRecipe:
    """What the trainer needs to know of a run besides its data."""

    max_steps: int
    lr: float
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    final_lr_ratio: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    max_grad_norm: float = 1.0
    micro_batches: int = 1
    seed: int = 0


def lr_at(step: int, recipe: TrainRecipe) -> float:
    """The learning rate of step ``step`` (0-based).

    ``cosine``: linear warm-up ``lr * (step + 1) / warmup_steps``, then cosine from ``lr`` to
    ``final_lr_ratio * lr`` at ``max_steps``. ``constant``: warm-up ``lr * min(1, (step + 1) / warmup_steps)``,
    then ``lr``. The two warm-ups are the same number rounded differently in the last bit (the arithmetic and
    long warm starts computed the first, the tool warm start the second); each is kept so that the cached warm
    models stay bit-identical to the ones the suite's bounds were measured on.
    """
    if recipe.lr_schedule == "constant":
        return recipe.lr * min(1.0, (step + 1) / max(recipe.warmup_steps, 1))
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(recipe.max_steps - recipe.warmup_steps, 1)
    ratio = recipe.final_lr_ratio + (1 - recipe.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return recipe.lr * ratio


def padded_batch(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (B, L), right-padded; labels are -100 where the mask is 0 and on the padding."""
    width = max(len(e.ids) for e in examples)
    input_ids = torch.tensor([e.ids + [pad_id] * (width - len(e.ids)) for e in examples])
    labels = torch.tensor(
        [
            [t if m else -100 for t, m in zip(e.ids, e.mask, strict=True)] + [-100] * (width - len(e.ids))
            for e in examples
        ]
    )
    return input_ids, labels


def masked_step_loss(
    model: nn.Module,
    examples: list[Example],
    pad_id: int,
    micro_batches: int,
    n_targets: int | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Summed cross-entropy of every mask-1 token over ``n_targets`` (default: this call's), backpropagated
    piece by piece; returns it detached. Examples are sorted by length and cut into ``micro_batches`` pieces so
    padding stays small. ``scale`` multiplies what is backpropagated only (FSDP2 averages gradients over ranks;
    ``world_size`` undoes that), so 1 leaves the single-process arithmetic untouched."""
    ordered = sorted(examples, key=lambda e: len(e.ids))
    n_targets = n_targets if n_targets is not None else sum(e.targets for e in examples)
    size = math.ceil(len(ordered) / micro_batches)
    total = torch.zeros(())
    for start in range(0, len(ordered), size):
        input_ids, labels = padded_batch(ordered[start : start + size], pad_id)
        device = next(model.parameters()).device
        logits = model(input_ids=input_ids.to(device)).logits[:, :-1]  # (B, L-1, V)
        loss = (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1).to(device),
                ignore_index=-100,
                reduction="sum",
            )
            / n_targets
        )
        (loss * scale if scale != 1.0 else loss).backward()
        total += loss.detach().cpu()
    return total


def make_optimizer(model: nn.Module, recipe: TrainRecipe) -> torch.optim.Optimizer:
    """Seed torch's RNG with the recipe's seed, then AdamW over the model's parameters."""
    torch.manual_seed(recipe.seed)
    return torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay
    )


# After step n: None (nothing checked), or (text for the progress line, stop now).
Check = Callable[[int], tuple[str, bool] | None]


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    stopped_early: bool = False  # a check asked to stop before max_steps


@dataclass(frozen=True)
class Progress:
    """Where progress lines go: ``report(line)`` at every check, every ``every`` steps and at the last step."""

    report: Callable[[str], None] | None
    label: str = "sft"
    every: int = 50


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _global_sum(value: float) -> float:
    if _world() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor.item())


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, recipe: TrainRecipe, step: int, examples: list[Example],
    pad_id: int,
) -> float:  # fmt: skip
    """One optimizer step on this rank's ``examples`` (every rank calls it together); returns the step's loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, recipe)
    optimizer.zero_grad(set_to_none=True)
    world = _world()
    if world == 1:  # the warm starts' path: no collective, the exact arithmetic their models were built with
        loss = float(masked_step_loss(model, examples, pad_id, recipe.micro_batches))
    else:
        n_targets = int(_global_sum(sum(e.targets for e in examples)))
        local = masked_step_loss(model, examples, pad_id, recipe.micro_batches, n_targets, scale=world)
        loss = _global_sum(float(local))
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
    optimizer.step()
    return loss


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe: TrainRecipe,
    batch_at: Callable[[int], list[Example]],
    pad_id: int,
    check: Check | None = None,
    progress: Progress | None = None,
    start_step: int = 0,
    after_step: Callable[[int], None] | None = None,
) -> TrainLog:
    """Train ``model`` in place from ``start_step`` to ``recipe.max_steps`` or until ``check`` says stop.

    ``batch_at(step)`` is this rank's examples of a step (a pure function of the step, so a resumed run sees
    the data an uninterrupted one would); ``after_step(n)`` runs after step n (checkpoints)."""
    log_ = TrainLog(steps=start_step)
    started = time.monotonic()
    for step in range(start_step, recipe.max_steps):
        model.train()
        loss = train_step(model, optimizer, recipe, step, batch_at(step), pad_id)
        log_.losses.append(round(loss, 5))
        log_.steps = step + 1
        result = check(log_.steps) if check else None
        if progress and progress.report:
            line = f"{progress.label} step {log_.steps}/{recipe.max_steps} loss {log_.losses[-1]:.4f}"
            if result is not None or log_.steps % progress.every == 0 or log_.steps == recipe.max_steps:
                text = result[0] if result else ""
                progress.report(f"{line}{text} ({time.monotonic() - started:.1f} s)")
        if after_step:
            after_step(log_.steps)
        if result is not None and result[1]:
            log_.stopped_early = True
            break
    model.eval()
    return log_


# ---- streamrl sft ------------------------------------------------------------------------------------------


def recipe_of(config: SftConfig) -> TrainRecipe:
    return TrainRecipe(
        max_steps=config.max_steps,
        lr=config.lr,
        warmup_steps=config.warmup_steps,
        lr_schedule=config.lr_schedule,
        final_lr_ratio=config.final_lr_ratio,
        weight_decay=config.weight_decay,
        betas=config.betas,
        max_grad_norm=config.max_grad_norm,
        micro_batches=config.micro_batches,
        seed=config.seed,
    )


def step_indices(n_examples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The dataset indices of a step: the data walked in a seeded shuffle per epoch, ``batch_size`` at a time
    (a batch may span two epochs); a pure function, so every rank and every resume agrees."""
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, n_examples)
        order = list(range(n_examples))
        random.Random(f"sft:{seed}:{epoch}").shuffle(order)
        out.append(order[offset])
    return out


def rank_share(indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's examples of a step: every world-th one, from its rank."""
    return indices[rank::world]


def run_sft(shared: SharedConfig, config: SftConfig, rank_command: list[str]) -> int:
    """One rank (RANK set: under torchrun, or spawned here), else spawn ``sft.world_size`` ranks."""
    if config.data is None:
        raise ConfigError(
            "sft.data is not set: give a JSONL or Parquet file of prompt/completion pairs or chat messages"
        )
    try:
        data_format(config.data)  # a wrong suffix is refused before any rank starts
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    if shared.model_path is None:
        raise ConfigError("shared.model_path is not set: streamrl sft trains a Hugging Face model directory")
    for name, value in (("sft.data", config.data), ("shared.model_path", shared.model_path)):
        if not Path(value).exists():
            raise ConfigError(f"{name} = {str(value)!r}: no such file or directory")
    if "RANK" in os.environ:
        return _run_rank(shared, config)
    from learner.main import spawn_ranks

    return spawn_ranks(config.world_size, config.grace_s, rank_command)


class _Stop:
    """SIGTERM / SIGINT: finish the step, checkpoint, exit."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, _signum: int, _frame: object) -> None:
        self.requested = True


def _run_rank(shared: SharedConfig, config: SftConfig) -> int:
    from transformers import AutoTokenizer

    from learner.checkpoint import CheckpointManager, CheckpointMeta, export_hf
    from learner.distributed import init_distributed
    from learner.loading import load_sharded

    info = init_distributed(config.pg_timeout_s, shared.torch_threads)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s sft[{info.rank}] %(levelname)s: %(message)s")
    model_path = Path(shared.model_path)  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        examples = load_examples(Path(config.data), tokenizer, config.max_seq_len)  # type: ignore[arg-type]
    except DataError as exc:
        print(f"streamrl sft: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # a configuration error: restarting cannot help
    recipe = recipe_of(config)
    torch.manual_seed(recipe.seed)
    model, _ = load_sharded(
        model_path,
        info.device,
        activation_checkpointing=config.activation_checkpointing,
        mixed_precision=config.mixed_precision,
    )
    optimizer = make_optimizer(model, recipe)
    run_dir = Path(shared.run_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=config.keep_checkpoints)
    start = 0
    latest = checkpoints.latest()
    if latest is not None:
        start = checkpoints.load(latest, model, optimizer).step
        log.info("resumed from %s at step %d", latest.name, start)
    stop = _Stop()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def batch_at(step: int) -> list[Example]:
        indices = step_indices(len(examples), config.batch_size, config.seed, step)
        return [examples[i] for i in rank_share(indices, info.rank, info.world_size)]

    def after_step(n: int) -> None:
        if n % config.checkpoint_every == 0 or n == recipe.max_steps:
            checkpoints.save(model, optimizer, CheckpointMeta(step=n, policy_version=n))
            crash_point("sft.checkpointed")

    def should_stop(_n: int) -> tuple[str, bool] | None:
        stopping = bool(_global_sum(float(stop.requested)))
        return ("; stop requested", True) if stopping else None

    reporter = Progress(log.info if info.is_main else None, "sft", every=10)
    result = train_loop(model, optimizer, recipe, batch_at, pad_id, should_stop, reporter, start, after_step)
    if result.stopped_early and result.steps % config.checkpoint_every:
        checkpoints.save(model, optimizer, CheckpointMeta(step=result.steps, policy_version=result.steps))
    if config.export_at_end and result.steps == recipe.max_steps:
        written = export_hf(model, model_path, run_dir / "export" / "latest")
        if written is not None:
            summary = {"step": result.steps, "losses": result.losses, "data": str(config.data)}
            (written / "sft.json").write_text(json.dumps(summary))
            log.info("exported step %d to %s", result.steps, written)
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
