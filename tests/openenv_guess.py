"""A guess-the-digit OpenEnv environment served by openenv-core's own server (``create_app``), for the OpenEnv
adapter's end-to-end test; run as ``python -m tests.openenv_guess PORT``.

reset(seed): the target is a digit drawn from ``random.Random(seed)``; the first observation asks for it.
step({"message": text}): the first digit in text is the guess; right: reward 1, done; wrong: "higher" / "lower"
(or "no digit"), reward WRONG (nonzero, so every episode's reward shows); the episode ends after MAX_STEPS steps.
:func:`answer` is the same logic, for the tests.
"""

from __future__ import annotations

import random
import sys

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from rollout_fleet.envs.openenv import OpenEnvTask
from tests.agentic_tasks import TURN_END

MAX_STEPS = 3
WRONG = -0.125
FIRST = "Guess a digit from 0 to 9."


class GuessAction(Action):
    message: str = Field(..., description="The guess")


class GuessObservation(Observation):
    message: str = Field("", description="What the environment says")


def target_of(seed: int | None) -> int:
    return random.Random(seed).randrange(10)


def answer(target: int, text: str, step: int) -> tuple[str, float, bool]:
    """(message, reward, done) of one guess."""
    digit = next((int(c) for c in text if c.isdigit()), None)
    if digit == target:
        return "right", 1.0, True
    message = "no digit" if digit is None else ("higher" if target > digit else "lower")
    return message, WRONG, step >= MAX_STEPS


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(step_count=0)
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: object) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.target = target_of(seed)
        return GuessObservation(message=FIRST, done=False, reward=0.0)

    def step(self, action: GuessAction, **_: object) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        message, reward, done = answer(self.target, action.message, self._state.step_count)
        return GuessObservation(message=message, done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state


class OneTokenTurns(OpenEnvTask):
    """The OpenEnv task with every printable character ending a turn, so the untrained tiny model's turns are
    one token each and its episodes always reach the environment (the task config has no such field)."""

    turn_end_tokens = TURN_END


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
