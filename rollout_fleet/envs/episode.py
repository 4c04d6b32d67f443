"""Running one episode token-in / token-out: the engine's output ids and the observations' ids appended turn
after turn into one sequence, earlier turns never re-tokenised.

The sequence that results is one sample of schema v2 (:mod:`broker.record`): model tokens carry the engine's
log-probs and policy versions and loss mask 1; observation tokens carry log-prob 0.0, loss mask 0 and the
version of the turn that caused them; ``turn_bounds`` marks where each model turn starts and ends. A weight
update between two turns, or inside one (the engine's pause and the worker's resubmission), shows in the
per-token versions.

Budgets: at most ``max_turns`` model turns, at most ``max_total_tokens`` tokens in the whole output (model and
observation tokens), at most ``max_tokens_per_turn`` per turn. An episode that runs out of any budget ends
truncated (finish reason ``length``); an observation that would not fit is not appended, so the output always
ends with a model turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_fleet.envs.base import Environment, StepResult


class EpisodeError(RuntimeError):
    """The environment itself failed (raised, or answered nonsense): an infrastructure failure, not something
    the model did, so the group is dropped with this reason instead of trained on."""


@dataclass
class TurnOutput:
    """What the engine generated for one turn, over every request the turn took (aborts resubmitted)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str  # stop | length
    engine_id: str = ""
    resubmits: int = 0


# (input ids: prompt + the episode so far, token budget of this turn, turn index) -> the turn's output
GenerateTurn = Callable[[list[int], int, int], Awaitable[TurnOutput]]


@dataclass(frozen=True)
class EpisodeBudgets:
    max_turns: int
    max_total_tokens: int
    max_tokens_per_turn: int

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_tokens_per_turn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"episode budget {name} must be an int >= 1, got {value!r}")


@dataclass
class TurnLog:
    """One turn for logs and the sample viewer: the action's text and the observation that answered it."""

    action: str
    observation: str = ""
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One finished episode as one token sequence with its masks, versions and turn boundaries."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_bounds: list[int] = field(default_factory=list)  # start, end of each model turn
    finish_reason: str = "stop"
    truncated: bool = False
    end: str = "done"  # done (the environment ended it) | eos | turn_length | max_turns | max_total_tokens
    env_reward: float = 0.0
    turns: list[TurnLog] = field(default_factory=list)
    engine_id: str = ""
    resubmits: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0

    def stats(self) -> dict[str, float]:
        """The per-sample episode counters of the record (schema v2 ``episode``)."""
        return {
            "turns": float(len(self.turns)),
            "tool_calls": float(self.tool_calls),
            "tool_errors": float(self.tool_errors),
            "observation_tokens": float(self.observation_tokens),
            "env_reward": float(self.env_reward),
        }

    def _append_turn(self, out: TurnOutput, mask_resubmitted: bool) -> None:
        start = len(self.tokens)
        self.tokens.extend(out.tokens)
        self.logprobs.extend(out.logprobs)
        self.versions.extend(out.versions)
        if mask_resubmitted and out.resubmits:
            last = out.versions[-1]  # tokens of an older policy than the one that finished the turn
            self.loss_mask.extend(0 if v < last else 1 for v in out.versions)
        else:
            self.loss_mask.extend([1] * len(out.tokens))
        self.turn_bounds += [start, len(self.tokens)]
        self.engine_id = out.engine_id or self.engine_id
        self.resubmits += out.resubmits

    def _append_observation(self, ids: Sequence[int]) -> None:
        version = self.versions[-1]  # the version of the turn that caused it
        self.tokens.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([version] * len(ids))
        self.loss_mask.extend([0] * len(ids))
        self.observation_tokens += len(ids)


def _count_tool(episode: Episode, result: StepResult) -> None:
    if result.info.get("tool"):
        episode.tool_calls += 1
        if result.info.get("tool_status", "ok") != "ok":
            episode.tool_errors += 1


async def run_episode(
    env: Environment,
    prompt_ids: list[int],
    generate_turn: GenerateTurn,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    budgets: EpisodeBudgets,
    eos_token_ids: Sequence[int] = (),
    mask_resubmitted: bool = False,
) -> Episode:
    """Run ``env`` (already reset; ``prompt_ids`` is its first observation's ids) to the end of the episode.

    Each turn sends prompt + the whole episode so far as token ids; the action text given to the environment is
    the decoded turn alone. A turn that ends with an EOS id ends the episode without a step (the model said it
    is finished). Raises :class:`EpisodeError` when the environment raises or returns something that is not a
    StepResult.
    """
    episode = Episode()
    eos = set(eos_token_ids)
    while True:
        used = len(episode.tokens)
        budget = min(budgets.max_tokens_per_turn, budgets.max_total_tokens - used)
        out = await generate_turn(prompt_ids + episode.tokens, budget, len(episode.turns))
        if not out.tokens:
            raise EpisodeError(f"turn {len(episode.turns)}: the engine returned no token")
        episode._append_turn(out, mask_resubmitted)
        action = decode(out.tokens)
        log = TurnLog(action=action)
        episode.turns.append(log)
        if out.finish != "stop":  # the turn ran out of its budget: its action is cut, so it is not taken
            episode.end = (
                "max_total_tokens" if len(episode.tokens) >= budgets.max_total_tokens else "turn_length"
            )
            break
        if out.tokens[-1] in eos:
            episode.end = "eos"
            break
        result = await _step(env, action, len(episode.turns) - 1)
        log.reward, log.info = float(result.reward), dict(result.info)
        episode.env_reward += float(result.reward)
        _count_tool(episode, result)
        if result.done:
            break
        if len(episode.turns) >= budgets.max_turns:
            episode.end = "max_turns"
            break
        ids = result.observation_ids if result.observation_ids is not None else encode(result.observation)
        log.observation = result.observation if result.observation_ids is None else decode(list(ids))
        if len(episode.tokens) + len(ids) >= budgets.max_total_tokens:  # no room left for another turn
            episode.end = "max_total_tokens"
            break
        episode._append_observation([int(t) for t in ids])
    episode.truncated = episode.end not in ("done", "eos")
    episode.finish_reason = "length" if episode.truncated else "stop"
    return episode


async def _step(env: Environment, action: str, turn: int) -> StepResult:
    try:
        result = await env.step(action)
    except Exception as exc:  # noqa: BLE001 - the environment's failure, reported as such
        raise EpisodeError(f"environment step {turn} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, StepResult):
        raise EpisodeError(f"environment step {turn} returned {type(result).__name__}, not a StepResult")
    return result
