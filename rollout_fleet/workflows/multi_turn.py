"""The multi-turn episode workflow: each sample is one episode of the task's environment
(:mod:`rollout_fleet.envs`: the built-in tool tasks, and the adapters of OpenEnv and verifiers environments all
plug in as an :class:`~rollout_fleet.envs.base.EnvironmentTask` with its ``make_env``), run turn by turn by
:func:`rollout_fleet.envs.episode.run_episode`. Each turn is generated through the engine session like a
single-turn sample (aborts resubmitted, failed engines avoided; rids ``{group_id}:s{i}:t{k}:r{j}`` from the
second turn on); the whole transcript is then scored by the task's verifier in the reward pool, and the
environment's own rewards are added as the component ``env``. An environment that fails (raises, answers
nonsense) drops the group with the reason ``env_error``."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np

from broker.record import Sample
from rollout_fleet.envs.base import EnvironmentTask
from rollout_fleet.envs.episode import Episode, EpisodeBudgets, EpisodeError, TurnOutput, run_episode
from rollout_fleet.rewards import SampleLength
from rollout_fleet.tasks import Prompt, RewardResult, Task
from rollout_fleet.workflows.abandon import DROP, GroupAbandoned
from rollout_fleet.workflows.base import GroupWorkflow, SampleResult, WorkflowContext, eos_ids
from rollout_fleet.workflows.session import Answer, EngineSession

log = logging.getLogger("streamrl.rollout")


class EpisodeWorkflow(GroupWorkflow):
    """``group_size`` episodes of the task's environment, each one sample of record schema v2."""

    def __init__(self, context: WorkflowContext, session: EngineSession) -> None:
        super().__init__(context, session)
        assert isinstance(self.task, EnvironmentTask)
        self.env_task: EnvironmentTask = self.task
        rollout = context.rollout
        self.budgets = EpisodeBudgets(
            max_turns=rollout.max_turns,
            max_total_tokens=rollout.max_new_tokens,
            max_tokens_per_turn=min(
                rollout.max_tokens_per_turn or rollout.max_new_tokens, rollout.max_new_tokens
            ),
        )

    @classmethod
    def stop_ids(cls, task: Task, tokenizer: Any) -> set[int]:
        """EOS (ends the episode) and the task's turn-end tokens (end a model turn)."""
        assert isinstance(task, EnvironmentTask)
        return eos_ids(tokenizer) | {int(tokenizer.convert_tokens_to_ids(t)) for t in task.turn_end_tokens}

    @property
    def first_budget(self) -> int:
        return self.budgets.max_tokens_per_turn

    async def prepare(self, prompt: Prompt) -> Prompt:
        try:  # the first observation of a remote environment (OpenEnv) is the prompt's text
            return await self.env_task.prepare_prompt(prompt)
        except Exception as exc:  # noqa: BLE001 - the environment's failure, not the model's
            raise GroupAbandoned("env_error", DROP, f"prepare_prompt: {type(exc).__name__}: {exc}") from exc

    async def sample(
        self, group_id: str, index: int, prompt_ids: list[int], prompt: Prompt, first: Answer | None
    ) -> SampleResult:
        started = time.monotonic()
        episode = await self._run(group_id, index, prompt_ids, prompt, first)
        generate_s = time.monotonic() - started
        text = self.decode(episode.tokens)
        started = time.monotonic()
        generated = len(episode.tokens) - episode.observation_tokens  # the model's tokens over every turn
        length = SampleLength(episode.truncated, generated, self.budgets.max_total_tokens)
        reward = await self.scorer.score(prompt, text, length)
        timings = {"generate_s": generate_s, "reward_s": time.monotonic() - started}
        self._count_episode(episode)
        return SampleResult(self._build_sample(index, episode, reward, timings), text)

    async def _run(
        self, group_id: str, index: int, prompt_ids: list[int], prompt: Prompt, first: Answer | None
    ) -> Episode:
        """One episode of a fresh environment (closed afterwards, whatever happened)."""

        async def turn(input_ids: list[int], budget: int, k: int) -> TurnOutput:
            rid_base = f"{group_id}:s{index}" if k == 0 else f"{group_id}:s{index}:t{k}"
            gen = await self.session.generate(rid_base, input_ids, budget, first if k == 0 else None)
            return TurnOutput(
                gen.tokens, gen.logprobs, gen.versions, gen.finish, gen.engine_id, gen.resubmits
            )

        env = self.env_task.make_env(prompt)
        try:
            try:
                observation = await env.reset()
            except Exception as exc:  # noqa: BLE001 - the environment's failure, not the model's
                raise EpisodeError(f"environment reset raised {type(exc).__name__}: {exc}") from exc
            if observation != prompt.text:  # the group shares one prompt: every sample must start from it
                raise EpisodeError(f"reset observation {observation[:60]!r} differs from the prompt's text")
            return await run_episode(
                env,
                prompt_ids,
                turn,
                self._encode_observation,
                self.decode,
                self.budgets,
                tuple(self.eos_ids),
                self.config.mask_resubmitted_prefix,
            )
        except EpisodeError as exc:
            raise GroupAbandoned("env_error", DROP, str(exc)) from exc
        finally:
            with contextlib.suppress(Exception):
                await env.close()

    def _encode_observation(self, text: str) -> list[int]:
        """An observation's ids: its text tokenised alone (earlier turns are ids already, never re-tokenised)."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _count_episode(self, episode: Episode) -> None:
        self.stats.episodes += 1
        self.stats.turns += len(episode.turns)
        self.stats.tool_calls += episode.tool_calls
        self.stats.tool_errors += episode.tool_errors
        self.stats.observation_tokens += episode.observation_tokens
        self.stats.episode_ends[episode.end] += 1
        if log.isEnabledFor(logging.DEBUG):
            for k, t in enumerate(episode.turns):
                log.debug("turn %d: %r -> %r %s", k, t.action, t.observation, t.info)

    def _build_sample(
        self, index: int, episode: Episode, reward: RewardResult, timings: dict[str, float]
    ) -> Sample:
        fields = self.reward_fields(reward)
        ok = reward.status == "ok"
        if ok and episode.env_reward:
            fields["reward_components"]["env"] = episode.env_reward
        return Sample(
            sample_index=index,
            output_ids=np.asarray(episode.tokens, dtype=np.int32),
            logprobs=np.asarray(episode.logprobs, dtype=np.float32),
            versions=np.asarray(episode.versions, dtype=np.int32),
            loss_mask=np.asarray(episode.loss_mask, dtype=np.uint8),
            finish_reason=episode.finish_reason,
            truncated=episode.truncated,
            reward=float(reward.reward) + episode.env_reward if ok else 0.0,
            engine_id=episode.engine_id,
            timings=timings,
            num_resubmits=episode.resubmits,
            turn_bounds=np.asarray(episode.turn_bounds, dtype=np.int32),
            episode=episode.stats(),
            **fields,
        )
