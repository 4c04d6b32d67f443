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
This module holds what is the task's (recipe, dataset, stopping rule, evaluation, fingerprint); the build
(``streamrl.warm_start``) trains it with the supervised trainer (learner.sft) and caches the model under
``cache_root()/models/tiny-qwen2-tool-<fingerprint>`` like the arithmetic warm start.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from common.supervised import Example
from rollout_fleet.envs.episode import Episode, EpisodeBudgets, TurnOutput, run_episode
from rollout_fleet.envs.tools import tool_observation
from rollout_fleet.eval_stats import solved
from rollout_fleet.local_eval import generate_ids
from rollout_fleet.model import TinyModelSpec, cache_root
from rollout_fleet.tasks import TEST, Prompt
from rollout_fleet.tasks.tool_arithmetic import ToolArithmeticTask

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


def episode_example(task: ToolArithmeticTask, tokenizer: Any, prompt: Prompt, use_tool: bool) -> Example:
    """The token ids and loss mask of one reference episode: prompt (mask 0), then each model turn (mask 1) and,
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
    return Example(ids, mask)


def training_examples(
    task: ToolArithmeticTask, tokenizer: Any, recipe: ToolWarmStartRecipe, step: int
) -> list[Example]:
    """The step's batch of train-split reference episodes (a pure function of the recipe and the step)."""
    rng = random.Random(f"tool-warmstart:{recipe.seed}:{step}")
    base = (recipe.seed * 1_000_003 + step * recipe.batch_size) % task.num_prompts()
    examples = []
    for i in range(recipe.batch_size):
        prompt = task.make_prompt((base + i) % task.num_prompts())
        use_tool = bool(prompt.metadata["needs_tool"]) and rng.random() < recipe.tool_share
        examples.append(episode_example(task, tokenizer, prompt, use_tool))
    return examples


def dataset(
    task: ToolArithmeticTask, tokenizer: Any, recipe: ToolWarmStartRecipe
) -> Callable[[int], list[Example]]:
    """The warm start's data, step by step (:func:`training_examples`)."""
    return lambda step: training_examples(task, tokenizer, recipe, step)


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


class ToolValidationStop:
    """The recipe's stopping rule, called after each step: every ``eval_every`` steps from ``min_steps``, greedy
    and sampled validation episodes; stop once the format and tool-accuracy targets are both met."""

    def __init__(
        self, model: Any, tokenizer: Any, task: ToolArithmeticTask, recipe: ToolWarmStartRecipe
    ) -> None:
        self.model, self.tokenizer, self.task, self.recipe = model, tokenizer, task, recipe
        self.prompts = [task.validation_prompt(i) for i in range(recipe.val_size)]
        self.validation: list[dict[str, Any]] = []
        self.reached_target = False

    def __call__(self, steps: int) -> tuple[str, bool] | None:
        recipe = self.recipe
        if steps < recipe.min_steps or steps % recipe.eval_every:
            return None
        metrics = evaluate_episodes(self.model, self.tokenizer, self.task, self.prompts, seed=recipe.seed)
        greedy, sampled = metrics["greedy"], metrics["sampled"]
        self.validation.append({"step": steps, **{f"greedy_{k}": v for k, v in greedy.items()}})
        self.validation[-1].update({f"sampled_{k}": v for k, v in sampled.items()})
        self.reached_target = (
            greedy["format_rate"] >= recipe.target_format
            and sampled["tool_accuracy"] >= recipe.target_tool_accuracy
        )
        text = (
            f" validation: format {greedy['format_rate']:.2f}, tool calls (sampled, needs_tool) "
            f"{sampled['tool_call_rate_needs_tool']:.2f}, tool accuracy {sampled['tool_accuracy']:.2f}"
        )
        return text, self.reached_target


def heldout_prompts(task: ToolArithmeticTask) -> list[Prompt]:
    return [task.make_prompt(i, TEST) for i in range(task.num_prompts(TEST))]
