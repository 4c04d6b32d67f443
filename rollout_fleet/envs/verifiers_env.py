"""Environments of prime-rl's ``verifiers`` library (v1 API, the ``verifiers`` extra) as episodes of the worker.

A verifiers environment drives its own rollout: ``Env.run_episode`` runs the env's ``run()``, a harness program
calls an OpenAI-compatible model through verifiers' interception server, and the task's rubric scores the
trace. streamrl's episode loop drives the model instead (token-in / token-out, :mod:`rollout_fleet.envs.episode`).
The adapter bridges the two inversions of control (:mod:`rollout_fleet.envs.verifiers_bridge`): verifiers'
model client is a bridge whose call hands the conversation to this environment and waits for the model's turn.

    reset()       start the verifiers rollout; its first model call's messages, rendered by the tokenizer's
                  chat template with the assistant header, are the prompt
    step(action)  the turn's text (end-of-turn token stripped) answers that call as the assistant message;
                  the next call's new messages (user / tool) rendered as the rest of the template
                  (:func:`tools.chat_observation`) are the observation, or, when the rollout returns, done with
                  the rubric's reward (component ``env``)

Each call's conversation must be the previous call's plus the assistant message streamrl answered, then new
messages: streamrl's sample is one token sequence and never re-tokenises earlier turns. A rollout that rewrites
history (a compacting harness, an env editing messages) raises :class:`HistoryRewritten`, and the worker drops
the group with reason ``env_error``. When the call declares tools, the turn's Hermes-style ``<tool_call>`` blocks
become the assistant message's ``tool_calls``; the tool results come back as the next call's tool messages.

verifiers is imported lazily, so this module (and the reward processes that import the task) loads without it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import Field

from rollout_fleet.envs.base import Environment, EnvironmentTask, StepResult
from rollout_fleet.envs.tools import chat_observation
from rollout_fleet.tasks.base import (
    TEST,
    TRAIN,
    Prompt,
    RewardResult,
    Size,
    TaskError,
    TaskOptions,
    strip_special,
)

INSTALL_HINT = "the verifiers task needs verifiers: pip install 'streamrl[verifiers]'"


class HistoryRewritten(RuntimeError):
    """The verifiers rollout sent a conversation that does not extend what the episode holds."""


def _bridge() -> Any:
    try:
        from rollout_fleet.envs import verifiers_bridge
    except ImportError as exc:
        raise TaskError(f"{INSTALL_HINT} ({exc})") from None
    return verifiers_bridge


def new_messages(history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages after ``history`` (the previous call's conversation plus the answered assistant message);
    HistoryRewritten naming the first message that differs, or when nothing new follows."""
    for i, old in enumerate(history):
        new = messages[i] if i < len(messages) else None
        if new is None or _differs(old, new):
            raise HistoryRewritten(
                f"verifiers rewrote the conversation at message {i} ({old.get('role')}): "
                f"{_short(old)} became {_short(new)}; a sample is one token sequence, so it is dropped"
            )
    tail = messages[len(history) :]
    if not tail:
        raise HistoryRewritten("verifiers called the model again with no new message")
    return tail


def _differs(old: dict[str, Any], new: dict[str, Any]) -> bool:
    if old.get("role") == "assistant":  # streamrl's answer: its content and tool calls are what counts
        return any((new.get(k) or None) != (old.get(k) or None) for k in ("role", "content", "tool_calls"))
    return old != new


def _short(message: dict[str, Any] | None) -> str:
    return "nothing" if message is None else repr(str(message.get("content"))[:60])


class VerifiersEnvironment(Environment):
    """One episode: one verifiers rollout of one task, started at reset and cancelled at close if unfinished."""

    def __init__(self, runner: Any, vf_task: Any, tokenizer: Any, timeout_s: float) -> None:
        self.runner = runner
        self.vf_task = vf_task
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.channel: Any = None
        self.call: Any = None  # the model call waiting for the next action
        self.history: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None

    async def _next(self) -> Any:
        """The rollout's next model call, or its Finished; an exception the rollout raised is re-raised."""
        event = await asyncio.wait_for(self.channel.events.get(), self.timeout_s)
        if isinstance(event, BaseException):
            raise event
        return event

    async def reset(self) -> str:
        await self.close()
        bridge = _bridge()
        self.channel = await self.runner.start(self.vf_task)
        event = await self._next()
        if isinstance(event, bridge.Finished):
            _, _, turns = bridge.episode_reward(event.episode)  # raises with verifiers' error if it failed
            raise RuntimeError(f"the verifiers rollout ended without calling the model ({turns} turns)")
        self.call, self.history, self.tools = event, list(event.messages), event.tools
        extra = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(
            self.history, tokenize=False, add_generation_prompt=True, **extra
        )

    async def step(self, action: str) -> StepResult:
        if self.call is None:
            raise RuntimeError("step before reset, or after the verifiers rollout finished")
        call = self.call
        call.answer.set_result(strip_special(action))
        event = await self._next()
        # what the bridge returned (the turn's text, its tool calls parsed when the call declared tools)
        self.history.append(call.reply or {"role": "assistant", "content": strip_special(action)})
        bridge = _bridge()
        if isinstance(event, bridge.Finished):
            self.call = None
            reward, components, turns = bridge.episode_reward(event.episode)
            info: dict[str, Any] = {"verifiers_turns": turns}
            info.update({f"verifiers_reward/{k}": v for k, v in components.items()})
            return StepResult(reward=reward, done=True, info=info)
        tail = new_messages(self.history, event.messages)
        if event.tools != self.tools:
            raise HistoryRewritten("verifiers changed the tools between two model calls")
        self.call, self.history = event, list(event.messages)
        return StepResult(observation=chat_observation(self.tokenizer, tail, self.tools))

    async def close(self) -> None:
        channel, call, self.channel, self.call = self.channel, self.call, None, None
        if call is not None and not call.answer.done():
            call.answer.cancel()  # the bridge's handler waiting for an answer that will not come
        if channel is not None:
            await self.runner.stop(channel)


class VerifiersConfig(TaskOptions):
    """verifiers: episodes of a verifiers environment (the verifiers extra)."""

    name: Literal["verifiers"] = Field("verifiers", description="The task.")
    verifiers_taskset: str = Field(
        min_length=1, description="The taskset id (an installed package or a module path)."
    )
    verifiers_env: str | None = Field(
        None, description="The Env id to pair with the taskset (default: its own)."
    )
    verifiers_config: dict[str, Any] | None = Field(
        None,
        description="The rest of the env config (verifiers' [env] block: taskset options, agents, harness, runtime).",
    )
    train_size: Size = Field(100, description="Train prompts: tasks 0 .. train_size - 1 of the taskset.")
    heldout_size: Size = Field(
        20, description="Held-out prompts: the next heldout_size tasks of the taskset."
    )
    env_timeout_s: float = Field(
        60.0, gt=0, description="Seconds to wait for each model call or the rollout's end."
    )


class VerifiersTask(EnvironmentTask):
    """Episodes of a verifiers environment: train prompt i is task i of its taskset, held-out prompt i is task
    ``train_size + i`` (disjoint from the train prompts)."""

    name = "verifiers"
    version = "1"
    Config = VerifiersConfig

    def __init__(
        self, config: VerifiersConfig | None = None, /, tokenizer: Any = None, **options: Any
    ) -> None:
        c = self.configure(config, options)
        self.taskset_id, self.env_id = c.verifiers_taskset, c.verifiers_env
        self.env_config = dict(c.verifiers_config or {})
        self.train_size, self.heldout_size = c.train_size, c.heldout_size
        self.timeout_s = c.env_timeout_s
        self.tokenizer = tokenizer
        self._runner: Any = None
        self._tasks: list[Any] | None = None

    def runner(self) -> Any:
        """The loaded verifiers env and its bridge (loaded on first use: reward processes never need it)."""
        if self._runner is None:
            bridge = _bridge()
            try:
                env = bridge.load_env(self.taskset_id, self.env_id, self.env_config)
            except Exception as exc:  # noqa: BLE001 - a bad id or config, reported with verifiers' message
                raise TaskError(
                    f"task verifiers: cannot load taskset {self.taskset_id!r} ({type(exc).__name__}: {exc})"
                ) from None
            self._runner = bridge.Runner(env)
            self._tasks = bridge.task_list(env, self.train_size + self.heldout_size)
        return self._runner

    def vf_task(self, split: str, index: int) -> Any:
        self.runner()
        assert self._tasks is not None
        position = index if split == TRAIN else self.train_size + index
        if not 0 <= index < self.num_prompts(split) or position >= len(self._tasks):
            raise TaskError(
                f"task verifiers: {split} index {index} (task {position}) out of range: the taskset has "
                f"{len(self._tasks)} tasks, train_size {self.train_size}, heldout_size {self.heldout_size}"
            )
        return self._tasks[position]

    def num_prompts(self, split: str = TRAIN) -> int:
        self._check_request(0, split)
        return self.train_size if split == TRAIN else self.heldout_size

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        """The prompt's identity; its text is the rollout's first model call, filled in by prepare_prompt."""
        self._check_request(index, split)
        if not 0 <= index < self.num_prompts(split):
            raise TaskError(f"task verifiers: {split} index {index} out of range ({self.num_prompts(split)})")
        return Prompt(
            prompt_id=f"verifiers/{self.taskset_id}/{split}/{index}",
            text="",
            answer="",
            split=split if split in (TRAIN, TEST) else TEST,
            index=index,
            metadata={"verifiers_taskset": self.taskset_id},
        )

    def make_env(self, prompt: Prompt) -> VerifiersEnvironment:
        if self.tokenizer is None:
            raise TaskError("task verifiers: make_env needs the tokenizer (conversations are templated)")
        split = TRAIN if prompt.split == TRAIN else TEST
        return VerifiersEnvironment(
            self.runner(), self.vf_task(split, prompt.index), self.tokenizer, self.timeout_s
        )

    async def prepare_prompt(self, prompt: Prompt) -> Prompt:
        """A rollout started to its first model call and cancelled: that call's rendering is the prompt (every
        sample's rollout must open the same way, so the env must be deterministic given its task)."""
        return await self.prompt_from_reset(prompt)

    async def check(self) -> str:
        """At worker start: verifiers imports, the env loads and is served (its interception server up), and
        its taskset has every configured task."""
        await self.runner().serve()
        assert self._tasks is not None
        wanted = self.train_size + self.heldout_size
        if len(self._tasks) < wanted:
            raise TaskError(
                f"task verifiers: taskset {self.taskset_id!r} has {len(self._tasks)} tasks, "
                f"train_size + heldout_size = {wanted}"
            )
        return f"verifiers taskset {self.taskset_id} ({len(self._tasks)} tasks)"

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        """No verifier of its own: the rubric's reward is the environment's (component ``env``)."""
        return RewardResult(reward=0.0, components={})
