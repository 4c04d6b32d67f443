"""A multi-turn task for tests, importable by the reward processes as ``tests.agentic_tasks:EchoTask``.

Every printable character ends a model turn, so with the untrained tiny model each turn is one token long and
an episode's shape is known in advance: the environment answers the first ``observations`` turns with a tool
message and ends the episode at the next. With ``$ECHO_BUMP_URL`` set (the task config has no field for it),
the environment's first step moves that engine's weight version to 1 (as a weight update between turns would),
so later turns carry version 1.
"""

from __future__ import annotations

import os
import string
from typing import Any

import aiohttp

from rollout_fleet.envs.base import Environment, EnvironmentTask, StepResult
from rollout_fleet.tasks.base import TRAIN, Prompt, RewardResult

TURN_END = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")


class EchoEnv(Environment):
    def __init__(self, prompt: Prompt, observations: int, bump_url: str) -> None:
        self.prompt, self.observations, self.bump_url = prompt, observations, bump_url
        self.steps = 0

    async def reset(self) -> str:
        return self.prompt.text

    async def step(self, action: str) -> StepResult:
        self.steps += 1
        if self.steps == 1 and self.bump_url:
            async with aiohttp.ClientSession() as http:
                body = {"new_version": "1", "abort_all_requests": False}
                async with http.post(self.bump_url + "/update_weight_version", json=body) as resp:
                    assert resp.status == 200
        if self.steps > self.observations:
            return StepResult(done=True, reward=0.5)
        text = f"<|im_start|>tool\nok {self.steps}<|im_end|>\n"
        return StepResult(
            observation=text, info={"tool": "echo", "tool_status": "ok" if self.steps % 2 else "error"}
        )


class EchoTask(EnvironmentTask):
    name = "echo"
    version = "1"
    turn_end_tokens = TURN_END

    def __init__(self, train_size: int = 4, observations: int = 2, **_: Any) -> None:
        self.train_size, self.observations = train_size, observations

    def num_prompts(self, split: str = TRAIN) -> int:
        return self.train_size

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        return Prompt(f"echo/{split}/{index}", f"<|im_start|>user\n{index}*7=<|im_end|>\n", "0", split, index)

    def make_env(self, prompt: Prompt) -> Environment:
        return EchoEnv(prompt, self.observations, os.environ.get("ECHO_BUMP_URL", ""))

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        return RewardResult(
            reward=float(len(completion) % 2), components={"correct": float(len(completion) % 2)}
        )
