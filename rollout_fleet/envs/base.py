"""The environment interface of multi-turn (agentic) rollouts.

An episode alternates model turns and environment steps: the first observation is the prompt, each model turn is
an action (its text, decoded from the engine's token ids only to be read), and the environment answers with an
observation (a tool result, a game state) that is appended to the sequence as tokens the loss never trains on.

    env = task.make_env(prompt)          # one environment per sample
    first = await env.reset()            # the first observation: what the engine is prompted with
    result = await env.step(action)      # StepResult(observation, reward, done, info)
    await env.close()

The same contract serves the built-in tasks and the adapters for environments from other libraries
(:mod:`rollout_fleet.envs`). Nothing here imports torch: the reward processes import tasks that subclass
:class:`EnvironmentTask`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rollout_fleet.tasks.base import Prompt, Task


@dataclass
class StepResult:
    """The environment's answer to one action.

    ``observation`` is the text appended after the model's turn (already in the chat template's form, e.g. a
    tool message followed by the next assistant header); it is ignored when ``done``. An environment that
    tokenises for itself gives ``observation_ids`` too, and those are used as they are. ``info`` holds
    strings and numbers for logs and counters: ``tool`` (the tool called, if any) and ``tool_status`` (``ok``
    or an error kind) are counted per episode.
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    observation_ids: list[int] | None = None


class Environment(ABC):
    """One episode's environment. Methods are coroutines: a tool call or an HTTP environment may take time,
    and the worker runs many episodes on one event loop."""

    @abstractmethod
    async def reset(self) -> str:
        """Start the episode; the first observation (the prompt text the engine receives)."""

    @abstractmethod
    async def step(self, action: str) -> StepResult:
        """Apply the model's action (one turn's text, stop token included) and observe the result."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most environments hold nothing
        """Release what the episode holds (a sandbox, a remote session)."""


class EnvironmentTask(Task):
    """A task whose samples are episodes: the worker runs :meth:`make_env`'s environment turn by turn.

    ``score(prompt, transcript)`` stays the verifier: it receives the whole decoded output (every model turn
    and every observation) and runs in the reward process pool like any task's. Rewards that the environment
    gives along the way (:attr:`StepResult.reward`) are added to it as the component ``env``.
    """

    multi_turn = True
    # the python tool's sandbox (rollout.sandbox), set by the worker and the evaluator before make_env
    sandbox: Any = None
    uses_sandbox = False  # whether the worker checks the sandbox at start (a task whose tools run code)
    # token strings that end a model turn (besides EOS, which ends the episode); resolved to ids by the worker
    turn_end_tokens: tuple[str, ...] = ("<|im_end|>",)

    @abstractmethod
    def make_env(self, prompt: Prompt) -> Environment:
        """A fresh environment for one sample of ``prompt``."""

    async def prepare_prompt(self, prompt: Prompt) -> Prompt:
        """The prompt as the engine receives it, awaited once per group before it is tokenised: a task whose
        first observation comes from a remote environment (OpenEnv) fills its text in here. Every sample's
        ``reset()`` must return this text."""
        return prompt

    async def prompt_from_reset(self, prompt: Prompt) -> Prompt:
        """``prompt`` with the text of a fresh environment's first observation (reset, then closed): what a task
        whose environment makes the prompt (OpenEnv, verifiers) returns from :meth:`prepare_prompt`."""
        env = self.make_env(prompt)
        try:
            text = await env.reset()
        finally:
            await env.close()
        return dataclasses.replace(prompt, text=text)

    async def check(self) -> str | None:
        """At worker start: raise (TaskError) when what the environments need is unreachable; a line for the
        log, or None when there is nothing to check."""
        return None


def is_multi_turn(task: Task) -> bool:
    """Whether the worker runs this task's samples as episodes."""
    return isinstance(task, EnvironmentTask)
