"""Supervised warm start of the tiny model on ``tool_arithmetic``: it teaches the tool-call format, not the
policy that RL is meant to find.

The model is trained with cross-entropy on reference episodes (tokens of the model's turns only: the prompt
and the tool's observation carry no loss). A one-digit problem is answered directly; a problem that needs the
tool (2x2 and 3x2 digits) is, in the reference, solved with the calculator in only ``tool_share`` of the
training episodes and answered directly in the rest. So the warm-started model knows how to call the tool and
copy its result, but calls it on a minority of the problems that need it, and greedy decoding mostly answers
those directly, and wrongly: RL, rewarded on the answer alone, has the tool-call rate to raise
(``benchmarks/agentic.py``).

Evaluation runs whole episodes in process through the same episode runner as the worker
(``rollout_fleet.envs.episode.run_episode``), the turns of all prompts batched into one forward pass per token.
The model is cached under ``cache_root()/models/tiny-qwen2-tool-<fingerprint>`` like the arithmetic warm start;
``python -m rollout_fleet.tool_warmstart --help`` builds it from a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rollout_fleet.envs.episode import Episode, EpisodeBudgets, TurnOutput, run_episode
from rollout_fleet.envs.tools import tool_observation
from rollout_fleet.eval_stats import solved
from rollout_fleet.evaluation import generate_ids
from rollout_fleet.model import TinyModelSpec, build_model, build_tokenizer, cache_root
from rollout_fleet.tasks import TEST, Prompt
from rollout_fleet.tasks.tool_arithmetic import ToolArithmeticTask
from rollout_fleet.warmstart import MARKER, build_once, publish_model_dir

EVAL_MAX_TURNS = 4  # a reference episode has two turns; four leave room for a repeated call
EVAL_MAX_TOKENS = 64  # the longest reference episode's model tokens are under 40


@dataclass(frozen=True)
class ToolWarmStartRecipe:
    """The supervised recipe; every field is part of the cache fingerprint.

    ``tool_share`` is the fraction of the training episodes of needs-tool problems whose reference calls the
    calculator (the rest answer directly). Training stops after ``max_steps``, or earlier at the first check
    (every ``eval_every`` steps from ``min_steps``) where the greedy format rate of validation episodes reaches
    ``target_format`` and the sampled tool calls on needs-tool validation problems succeed (``tool_accuracy``:
    the answer after a tool call is right) at least ``target_tool_accuracy`` of the time.
    """

    max_steps: int = 1200
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 20
    tool_share: float = 0.3
    val_size: int = 200
    eval_every: int = 50
    min_steps: int = 200
    target_format: float = 0.95
    target_tool_accuracy: float = 0.9
    micro_batches: int = 2
    seed: int = 0

    def check(self) -> ToolWarmStartRecipe:
        for name in ("max_steps", "batch_size", "val_size", "eval_every", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tool warm-start {name} must be an int >= 1, got {value!r}")
        for name in ("warmup_steps", "min_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"tool warm-start {name} must be an int >= 0, got {value!r}")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"tool warm-start lr must be a finite number > 0, got {self.lr!r}")
        for name in ("tool_share", "target_format", "target_tool_accuracy"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value <= 1):
                raise ValueError(f"tool warm-start {name} must be in [0, 1], got {value!r}")
        return self


def fingerprint(spec: TinyModelSpec, recipe: ToolWarmStartRecipe) -> str:
    payload = json.dumps(
        {
            "model": spec.fingerprint(),
            "recipe": asdict(recipe),
            "task": f"{ToolArithmeticTask.name}-{ToolArithmeticTask.version}",
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_path(spec: TinyModelSpec, recipe: ToolWarmStartRecipe) -> Path:
    return cache_root() / "models" / f"tiny-qwen2-tool-{fingerprint(spec, recipe)}"


def episode_example(
    task: ToolArithmeticTask, tokenizer: Any, prompt: Prompt, use_tool: bool
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one reference episode: prompt (mask 0), then each model turn (mask 1) and,
    between turns, the tool's observation as the environment renders it (mask 0)."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = encode(prompt.text)
    mask = [0] * len(ids)
    turns = task.reference_turns(prompt, use_tool)
    for k, turn in enumerate(turns):
        if k:
            a, b = prompt.metadata["a"], prompt.metadata["b"]
            observation = encode(tool_observation(tokenizer, str(a * b)))
            ids, mask = ids + observation, mask + [0] * len(observation)
        out = encode(turn)
        ids, mask = ids + out, mask + [1] * len(out)
    return ids, mask


def training_examples(
    task: ToolArithmeticTask, tokenizer: Any, recipe: ToolWarmStartRecipe, step: int
) -> list[tuple[list[int], list[int]]]:
    """The step's batch of train-split reference episodes (a pure function of the recipe and the step)."""
    rng = random.Random(f"tool-warmstart:{recipe.seed}:{step}")
    base = (recipe.seed * 1_000_003 + step * recipe.batch_size) % task.num_prompts()
    examples = []
    for i in range(recipe.batch_size):
        prompt = task.make_prompt((base + i) % task.num_prompts())
        use_tool = bool(prompt.metadata["needs_tool"]) and rng.random() < recipe.tool_share
        examples.append(episode_example(task, tokenizer, prompt, use_tool))
    return examples


def masked_step_loss(
    model: Any, examples: list[tuple[list[int], list[int]]], pad_id: int, micro_batches: int
) -> torch.Tensor:
    """Mean cross-entropy over every mask-1 token of the step, backpropagated micro-batch by micro-batch
    (examples sorted by length so padding stays small). Returns the loss, detached."""
    ordered = sorted(examples, key=lambda e: len(e[0]))
    n_targets = sum(sum(mask) for _, mask in examples)
    size = math.ceil(len(ordered) / micro_batches)
    total = torch.zeros(())
    for start in range(0, len(ordered), size):
        chunk = ordered[start : start + size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in chunk])  # (B, L)
        labels = torch.tensor(
            [
                [t if m else -100 for t, m in zip(ids, mask, strict=True)] + [-100] * (width - len(ids))
                for ids, mask in chunk
            ]
        )  # (B, L)
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


class _TurnBatcher:
    """Batches the concurrent episodes' turn requests into one ``generate_ids`` call: a request waits until
    every live episode has asked for its next turn (or ended), then all of them are generated together."""

    def __init__(self, model: Any, tokenizer: Any, stop_ids: Sequence[int], temperature: float, seed: int):
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids, self.temperature, self.seed = tuple(stop_ids), temperature, seed
        self.live = 0  # episodes not finished yet
        self.pending: list[tuple[list[int], int, asyncio.Future[TurnOutput]]] = []
        self.rounds = 0

    async def turn(self, input_ids: list[int], budget: int, _turn: int) -> TurnOutput:
        future: asyncio.Future[TurnOutput] = asyncio.get_running_loop().create_future()
        self.pending.append((input_ids, budget, future))
        self.flush_if_ready()
        return await future

    def finished(self) -> None:
        self.live -= 1
        self.flush_if_ready()

    def flush_if_ready(self) -> None:
        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = self.pending, []
        outputs = generate_ids(
            self.model,
            self.tokenizer,
            [ids for ids, _, _ in batch],
            max_new_tokens=max(budget for _, budget, _ in batch),
            temperature=self.temperature,
            seed=self.seed + self.rounds,
            stop_token_ids=self.stop_ids,
        )
        self.rounds += 1
        for (_, budget, future), out in zip(batch, outputs, strict=True):
            tokens = out[:budget] or [self.tokenizer.eos_token_id]  # an empty turn ended at EOS at once
            finish = "stop" if tokens[-1] in self.stop_ids else "length"
            future.set_result(TurnOutput(tokens, [0.0] * len(tokens), [0] * len(tokens), finish))


def run_episodes(
    model: Any,
    tokenizer: Any,
    task: ToolArithmeticTask,
    prompts: list[Prompt],
    temperature: float = 0.0,
    seed: int = 0,
) -> list[Episode]:
    """One episode per prompt through the worker's episode runner, turns batched across prompts."""
    im_end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    eos = int(tokenizer.eos_token_id)
    batcher = _TurnBatcher(model, tokenizer, (im_end, eos), temperature, seed)
    budgets = EpisodeBudgets(EVAL_MAX_TURNS, EVAL_MAX_TOKENS, EVAL_MAX_TOKENS)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    async def one(prompt: Prompt) -> Episode:
        env = task.make_env(prompt)
        try:
            first = await env.reset()
            return await run_episode(
                env,
                encode(first),
                batcher.turn,
                encode,
                lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                budgets,
                (eos,),
            )
        finally:
            batcher.finished()

    async def every() -> list[Episode]:
        batcher.live = len(prompts)
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    with torch.inference_mode():
        return asyncio.run(every())


def episode_metrics(
    task: ToolArithmeticTask, tokenizer: Any, prompts: list[Prompt], episodes: list[Episode]
) -> dict[str, float | int]:
    """Accuracy overall and per bucket (needs_tool, direct), tool-call rate per bucket, tool accuracy (share
    of episodes with a tool call whose answer is right), format rate, turns per episode, share of masked
    tokens of the episodes."""
    rows: dict[str, list[tuple[float, float, bool]]] = {"needs_tool": [], "direct": []}
    turns = masked = tokens = 0
    tool_hits = tool_episodes = 0
    for prompt, episode in zip(prompts, episodes, strict=True):
        score = task.score(prompt, tokenizer.decode(episode.tokens, skip_special_tokens=False))
        correct, fmt = float(solved(score)), score.components["format"]
        rows[task.difficulty(prompt) or "direct"].append((correct, fmt, episode.tool_calls > 0))
        turns += len(episode.turns)
        tokens += len(episode.tokens)
        masked += len(episode.tokens) - sum(episode.loss_mask)
        if episode.tool_calls:
            tool_episodes += 1
            tool_hits += int(correct)
    every = rows["needs_tool"] + rows["direct"]
    n = max(len(every), 1)
    out: dict[str, float | int] = {
        "n": len(every),
        "accuracy": sum(r[0] for r in every) / n,
        "format_rate": sum(r[1] for r in every) / n,
        "tool_call_rate": sum(r[2] for r in every) / n,
        "tool_accuracy": tool_hits / tool_episodes if tool_episodes else 0.0,
        "turns_per_episode": turns / n,
        "masked_token_share": masked / max(tokens, 1),
    }
    for bucket, items in rows.items():
        k = max(len(items), 1)
        out[f"n_{bucket}"] = len(items)
        out[f"accuracy_{bucket}"] = sum(r[0] for r in items) / k
        out[f"tool_call_rate_{bucket}"] = sum(r[2] for r in items) / k
    return out


def evaluate_episodes(
    model: Any, tokenizer: Any, task: ToolArithmeticTask, prompts: list[Prompt], seed: int = 0
) -> dict[str, dict[str, float | int]]:
    """Greedy and sampled (T = 1) episode metrics of ``model`` on ``prompts``."""
    was_training = model.training
    model.eval()
    try:
        return {
            mode: episode_metrics(
                task, tokenizer, prompts, run_episodes(model, tokenizer, task, prompts, temperature, seed)
            )
            for mode, temperature in (("greedy", 0.0), ("sampled", 1.0))
        }
    finally:
        model.train(was_training)


def lr_at(step: int, recipe: ToolWarmStartRecipe) -> float:
    """Linear warm-up over ``warmup_steps``, then constant."""
    return recipe.lr * min(1.0, (step + 1) / max(recipe.warmup_steps, 1))


def train(
    model: Any,
    tokenizer: Any,
    task: ToolArithmeticTask,
    recipe: ToolWarmStartRecipe,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train in place; returns the loss curve, the validation checks and the step count."""
    val = [task.validation_prompt(i) for i in range(recipe.val_size)]
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)
    losses: list[float] = []
    checks: list[dict[str, Any]] = []
    reached, start = False, time.monotonic()
    for step in range(recipe.max_steps):
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        optimizer.zero_grad(set_to_none=True)
        examples = training_examples(task, tokenizer, recipe, step)
        loss = masked_step_loss(model, examples, tokenizer.pad_token_id, recipe.micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(round(float(loss), 5))
        line = f"tool warm-start step {step + 1}/{recipe.max_steps} loss {losses[-1]:.4f}"
        if step + 1 >= recipe.min_steps and (step + 1) % recipe.eval_every == 0:
            metrics = evaluate_episodes(model, tokenizer, task, val, seed=recipe.seed)
            greedy, sampled = metrics["greedy"], metrics["sampled"]
            checks.append({"step": step + 1, **{f"greedy_{k}": v for k, v in greedy.items()}})
            checks[-1].update({f"sampled_{k}": v for k, v in sampled.items()})
            reached = (
                greedy["format_rate"] >= recipe.target_format
                and sampled["tool_accuracy"] >= recipe.target_tool_accuracy
            )
            line += (
                f" validation: format {greedy['format_rate']:.2f}, tool calls (sampled, needs_tool) "
                f"{sampled['tool_call_rate_needs_tool']:.2f}, tool accuracy {sampled['tool_accuracy']:.2f}"
            )
            if progress:
                progress(f"{line} ({time.monotonic() - start:.1f} s)")
            if reached:
                return {"losses": losses, "validation": checks, "steps": step + 1, "reached_target": True}
        elif progress and (step + 1) % 50 == 0:
            progress(f"{line} ({time.monotonic() - start:.1f} s)")
    return {"losses": losses, "validation": checks, "steps": recipe.max_steps, "reached_target": reached}


def heldout_prompts(task: ToolArithmeticTask) -> list[Prompt]:
    return [task.make_prompt(i, TEST) for i in range(task.num_prompts(TEST))]


def _build(
    path: Path,
    spec: TinyModelSpec,
    recipe: ToolWarmStartRecipe,
    key: str,
    progress: Callable[[str], None] | None,
) -> None:
    started = time.monotonic()
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    task = ToolArithmeticTask(tokenizer=tokenizer)
    log = train(model, tokenizer, task, recipe, progress)
    after = evaluate_episodes(model, tokenizer, task, heldout_prompts(task))
    if progress:
        g, s = after["greedy"], after["sampled"]
        progress(
            f"tool warm-start stopped at step {log['steps']} (target reached: {log['reached_target']}); held-out "
            f"greedy accuracy {g['accuracy']:.3f} (needs_tool {g['accuracy_needs_tool']:.3f}), sampled tool-call "
            f"rate on needs_tool {s['tool_call_rate_needs_tool']:.3f}"
        )
    record = {
        "fingerprint": key,
        "model_spec": asdict(spec),
        "recipe": asdict(recipe),
        "task": {"name": task.name, "version": task.version, "seed": task.seed},
        **log,
        "eval_after": after,
        "total_seconds": round(time.monotonic() - started, 2),
        "torch_threads": torch.get_num_threads(),
    }
    publish_model_dir(model, tokenizer, path, record)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def init_tool_warm_model(
    path: str | Path | None = None,
    recipe: ToolWarmStartRecipe | None = None,
    spec: TinyModelSpec | None = None,
    progress: Callable[[str], None] | None = _stderr,
) -> Path:
    """The tool warm-started model directory, built unless a matching one is there (concurrent callers wait on
    a lock; the directory appears atomically, with ``warmstart.json`` inside)."""
    spec = spec or TinyModelSpec()
    recipe = (recipe or ToolWarmStartRecipe()).check()
    key = fingerprint(spec, recipe)
    path = Path(path) if path else default_path(spec, recipe)
    return build_once(path, key, lambda: _build(path, spec, recipe, key, progress))


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_fleet.tool_warmstart``: build the tool warm start and print its path and accuracy."""
    parser = argparse.ArgumentParser(
        prog="python -m rollout_fleet.tool_warmstart",
        description="Supervised warm start of the tiny Qwen2 model on tool_arithmetic: the calculator's call "
        "format, used on a minority of the problems that need it (cached: a second run returns the same "
        "directory at once).",
    )
    defaults = ToolWarmStartRecipe()
    parser.add_argument("--out", type=Path, default=None, help="model directory (default: under the cache)")
    parser.add_argument("--steps", type=int, default=defaults.max_steps, help="cap on optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    parser.add_argument(
        "--tool-share",
        type=float,
        default=defaults.tool_share,
        help=f"share of needs-tool training episodes that call the tool (default {defaults.tool_share})",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        recipe = ToolWarmStartRecipe(max_steps=args.steps, seed=args.seed, tool_share=args.tool_share).check()
    except ValueError as e:
        parser.error(str(e))
    path = init_tool_warm_model(args.out, recipe)
    record = json.loads((path / MARKER).read_text())
    print(json.dumps({"path": str(path), "steps": record["steps"], "eval_after": record["eval_after"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
