"""Held-out evaluation through the engines, alongside training (``streamrl eval``).

The engines serve the current policy, so evaluating through them measures exactly the weights the fleet is
sampling from, with no extra copy of the model. Each evaluation runs every held-out prompt greedily
(temperature 0: the accuracy ``summary.json`` reports) and sampled at temperature 1, scores with the task's
verifier (correctness only), and writes one point to the ``eval`` metrics stream with the policy version the
engines reported. Held-out prompts come from the task's test split, which the task keeps disjoint from its
training prompts (``rollout_fleet.tasks``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import Field

from broker.configlib import Section
from rollout_fleet.client import EngineClient, SamplingConfig, build_generate_request
from rollout_fleet.tasks import TEST, Prompt, Task

log = logging.getLogger("streamrl.eval")


class EvalConfig(Section):
    """Held-out evaluation through the engines while training runs."""

    every_versions: int = Field(5, ge=1, description="Evaluate whenever the policy version advanced this much.")
    heldout_prompts: int = Field(200, ge=1, description="Held-out prompts per evaluation (the task's test split).")
    max_new_tokens: int = Field(128, ge=1, description="Output budget of an evaluation sample.")
    sampled_temperature: float = Field(1.0, gt=0, description="Temperature of the sampled accuracy.")
    concurrency: int = Field(64, ge=1, description="Evaluation requests in flight at once.")
    poll_s: float = Field(1.0, gt=0, description="How often the evaluator checks the policy version.")


@dataclass(frozen=True)
class EvalResult:
    greedy_accuracy: float
    sampled_accuracy: float
    format_rate: float
    n: int
    version: int  # lowest weight version the engines answered with
    seconds: float

    def as_metrics(self) -> dict[str, float]:
        return {
            "greedy_accuracy": self.greedy_accuracy,
            "sampled_accuracy": self.sampled_accuracy,
            "format_rate": self.format_rate,
            "n": float(self.n),
            "policy_version": float(self.version),
            "eval_seconds": self.seconds,
        }


async def _one(
    client: EngineClient,
    task: Task,
    tokenizer: Any,
    prompt: Prompt,
    sampling: SamplingConfig,
    max_new_tokens: int,
    rid: str,
) -> tuple[float, float, int]:
    ids = tokenizer(prompt.text, add_special_tokens=False).input_ids
    result = await client.generate(build_generate_request(ids, sampling, max_new_tokens, rid))
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
    scored = task.score(prompt, text)
    correct = float(scored.components.get("correct", scored.reward))
    return correct, float(scored.components.get("format", 0.0)), result.weight_version


async def evaluate_through_engines(
    urls: list[str],
    task: Task,
    tokenizer: Any,
    config: EvalConfig,
    stop_token_ids: tuple[int, ...],
    timeout_s: float = 120.0,
) -> EvalResult:
    """Greedy and sampled accuracy over the first ``config.heldout_prompts`` held-out prompts, spread over
    ``urls`` round-robin with at most ``config.concurrency`` requests in flight."""
    started = time.monotonic()
    n = min(config.heldout_prompts, task.num_prompts(TEST))
    prompts = [task.make_prompt(i, TEST) for i in range(n)]
    modes = {
        "greedy": SamplingConfig(temperature=0.0, stop_token_ids=stop_token_ids),
        "sampled": SamplingConfig(temperature=config.sampled_temperature, stop_token_ids=stop_token_ids),
    }
    gate = asyncio.Semaphore(config.concurrency)
    async with aiohttp.ClientSession() as session:
        clients = [EngineClient(session, u, timeout_s, timeout_s) for u in urls]

        async def run(k: int, mode: str, prompt: Prompt) -> tuple[str, float, float, int]:
            async with gate:
                client = clients[k % len(clients)]
                rid = f"eval-{mode}-{prompt.index}-{time.monotonic_ns()}"
                scored = await _one(client, task, tokenizer, prompt, modes[mode], config.max_new_tokens, rid)
                return (mode, *scored)

        jobs = [run(k, mode, p) for mode in modes for k, p in enumerate(prompts)]
        results = await asyncio.gather(*jobs)
    greedy = [c for m, c, _, _ in results if m == "greedy"]
    sampled = [c for m, c, _, _ in results if m == "sampled"]
    formats = [f for m, _, f, _ in results if m == "greedy"]
    return EvalResult(
        greedy_accuracy=sum(greedy) / n,
        sampled_accuracy=sum(sampled) / n,
        format_rate=sum(formats) / n,
        n=n,
        version=min(v for _, _, _, v in results),
        seconds=time.monotonic() - started,
    )
