"""What every rollout workflow shares: one group of ``rollout.group_size`` samples of one leased prompt.

:class:`GroupWorkflow` turns a lease into a :class:`~broker.record.TrajectoryGroup`:

1. The prompt is made by the task and prepared by the workflow (an environment may give its text), then
   tokenised once (``add_special_tokens=False``; a chat template's markers are in the text), cached by index.
2. With ``rollout.batch_group_requests`` (default) every sample's first request goes in one batched
   ``/generate`` (the prompt once per sample, a rid each): one HTTP call per group instead of one per sample.
   A batch that fails falls back to one request per sample; behind an sglang-router every request goes alone.
3. The samples run side by side (:meth:`GroupWorkflow.sample`, the subclass's part); the first to fail abandons
   the group and cancels the others.

A subclass says how one sample is generated and scored; it reaches the engines only through its
:class:`~rollout_fleet.workflows.session.EngineSession`.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from broker.record import Sample, TrajectoryGroup
from rollout_fleet.config import RolloutConfig
from rollout_fleet.dispatch import Lease
from rollout_fleet.rewards import SampleLength, overlong_penalty
from rollout_fleet.tasks import TRAIN, Prompt, RewardResult, Task
from rollout_fleet.workflows.abandon import DROP, GroupAbandoned
from rollout_fleet.workflows.session import Answer, EngineSession
from rollout_fleet.workflows.stats import WorkerStats

PROMPT_CACHE_SIZE = 1024  # token ids of recent prompts (each is tokenised once per group at least)


@dataclass
class Scorer:
    """The verifier every sample is scored with: a scorer of the reward process pool and its options, and DAPO's
    soft overlong punishment on top (``overlong_buffer`` tokens, 0: off; component ``overlong``)."""

    pool: Any  # rollout_fleet.rewards.RewardPool (or anything with its ``score``)
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0

    async def score(self, prompt: Prompt, text: str, length: SampleLength | None = None) -> RewardResult:
        """The verifier's result (``length`` goes to a reward function that asks for it), shaped by the
        overlong penalty when one is configured and the verifier succeeded."""
        result = await self.pool.score(self.name, prompt, text, self.options, length)
        if self.overlong_buffer <= 0 or length is None or result.status != "ok":
            return result
        penalty = overlong_penalty(
            length.output_tokens, length.max_output_tokens, self.overlong_buffer, self.overlong_penalty_factor
        )
        components = {**result.components, "overlong": penalty}
        return replace(result, reward=result.reward + penalty, components=components)


@dataclass
class WorkflowContext:
    """What a workflow needs besides its engine session: the task, its tokenizer, the config, the scorer and
    the worker's counters."""

    task: Task
    tokenizer: Any
    rollout: RolloutConfig
    scorer: Scorer
    stats: WorkerStats


@dataclass
class SampleResult:
    """One finished sample and its decoded text (made only for the verifier)."""

    sample: Sample
    text: str


async def all_or_nothing(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run the coroutines as tasks; the first exception cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def eos_ids(tokenizer: Any) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {int(eos)} if eos is not None else set()


class GroupWorkflow(ABC):
    """One group per lease; a subclass generates and scores each sample."""

    def __init__(self, context: WorkflowContext, session: EngineSession) -> None:
        self.task, self.tokenizer, self.config = context.task, context.tokenizer, context.rollout
        self.scorer, self.stats, self.session = context.scorer, context.stats, session
        self.eos_ids = eos_ids(context.tokenizer)
        self._prompt_ids: dict[int, list[int]] = {}

    @classmethod
    def stop_ids(cls, task: Task, tokenizer: Any) -> set[int]:
        """Token ids that end a request besides ``rollout.stop_token_ids``: EOS."""
        return eos_ids(tokenizer)

    @property
    def first_budget(self) -> int:
        """``max_new_tokens`` of a sample's first request (the batched one)."""
        return self.config.max_new_tokens

    async def prepare(self, prompt: Prompt) -> Prompt:
        """The prompt as the engine receives it (awaited once per group before it is tokenised)."""
        return prompt

    @abstractmethod
    async def sample(
        self, group_id: str, index: int, prompt_ids: list[int], prompt: Prompt, first: Answer | None
    ) -> SampleResult:
        """Sample ``index`` of the group, generated and scored; ``first`` is the answer to its first request
        when the group's batch already made it."""

    async def generate_group(
        self, lease: Lease, group_id: str, run_id: str, worker_id: str
    ) -> TrajectoryGroup:
        """The group of ``lease``'s prompt; raises :class:`GroupAbandoned` when it cannot be made."""
        try:
            prompt = self.task.make_prompt(lease.prompt_index, TRAIN)
        except Exception as exc:  # noqa: BLE001 - a bad prompt is dropped, never retried forever
            raise GroupAbandoned("bad_prompt", DROP, f"{type(exc).__name__}: {exc}") from exc
        prompt = await self.prepare(prompt)
        prompt_ids = self._encode_prompt(prompt)
        n = self.config.group_size
        first = (
            await self.session.first_requests(group_id, prompt_ids, self.first_budget, n)
            if self.config.batch_group_requests and self.session.can_batch
            else None
        )
        results: list[SampleResult] = await all_or_nothing(
            [self.sample(group_id, i, prompt_ids, prompt, first[i] if first else None) for i in range(n)]
        )
        return TrajectoryGroup(
            run_id=run_id,
            epoch=lease.epoch,
            prompt_index=lease.prompt_index,
            attempt=0,
            prompt_id=prompt.prompt_id,
            task=self.task.name,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            samples=[r.sample for r in results],
            worker_id=worker_id,
            created_at=time.time(),
            extra={"answer": str(prompt.answer)},
            group_id=group_id,
        )

    def _encode_prompt(self, prompt: Prompt) -> list[int]:
        try:
            prompt_ids = self._encode(prompt)
        except Exception as exc:  # noqa: BLE001 - a bad prompt is dropped, never retried forever
            raise GroupAbandoned("bad_prompt", DROP, f"{type(exc).__name__}: {exc}") from exc
        if not prompt_ids:
            raise GroupAbandoned("bad_prompt", DROP, f"prompt {prompt.prompt_id!r} tokenises to nothing")
        return prompt_ids

    def _encode(self, prompt: Prompt) -> list[int]:
        ids = self._prompt_ids.get(prompt.index)
        if ids is None:
            ids = [int(t) for t in self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]]
            if len(self._prompt_ids) >= PROMPT_CACHE_SIZE:
                self._prompt_ids.clear()
            self._prompt_ids[prompt.index] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def reward_fields(self, reward: RewardResult) -> dict[str, Any]:
        """The record fields every sample takes from its reward and the sampling config (a failed reward is 0,
        its status recorded, and the learner drops the group)."""
        ok = reward.status == "ok"
        self.stats.reward_status[reward.status] += 1
        return {
            "reward_components": {str(k): float(v) for k, v in reward.components.items()} if ok else {},
            "reward_status": reward.status,
            "reward_error": "" if ok else (reward.error or reward.status),
            "temperature": float(self.config.temperature),
            "top_p": float(self.config.top_p),
            "top_k": int(self.config.top_k),
        }
