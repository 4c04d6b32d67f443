"""The task interface every prompt source and verifier implements, and the values they exchange.

A task makes prompts (deterministically from an index and a split) and scores completions. Scoring is a pure
function of the prompt and the completion text, so the reward process pool can rebuild the task from its name
and options in another process without loading any data. Nothing here imports torch or transformers: the reward
workers import this module and must start fast.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

TRAIN, TEST = "train", "test"
SPLITS = (TRAIN, TEST)
REWARD_STATUSES = ("ok", "timeout", "error")


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``text`` is exactly what the engine receives (already chat-templated when that applies).

    Tokenise ``text`` with ``add_special_tokens=False``: a chat template's markers are in the text itself.
    ``answer`` is the reference answer the verifier compares against; ``metadata`` holds whatever else the
    verifier needs (e.g. the numbers of a countdown problem) and must be picklable and msgpack-friendly.
    """

    prompt_id: str
    text: str
    answer: str
    split: str = TRAIN
    index: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardResult:
    """The reward of one completion with every component, and whether scoring worked.

    ``status`` is ``ok``, ``timeout`` or ``error``; anything but ``ok`` has reward 0.0 and an ``error`` message,
    and its components are empty (nothing was measured).
    """

    reward: float
    components: Mapping[str, float] = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None

    @classmethod
    def failed(cls, status: str, error: str) -> RewardResult:
        return cls(reward=0.0, components={}, status=status, error=error)


class TaskError(ValueError):
    """Bad task options or a bad prompt request; the message names the option or index and its value."""


class Task(ABC):
    """A source of prompts plus their verifier.

    Subclasses set ``name`` and ``version`` (bump the version whenever prompts or scoring change, so caches keyed
    on it, like the warm-started model, are rebuilt).
    """

    name: ClassVar[str]
    version: ClassVar[str]

    @abstractmethod
    def num_prompts(self, split: str = TRAIN) -> int:
        """Prompts in one epoch of ``split``."""

    @abstractmethod
    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        """The prompt at ``index`` of ``split``; the same arguments always give the same prompt."""

    @abstractmethod
    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        """Score the completion text (without the prompt); never raises on bad model output."""

    def difficulty(self, prompt: Prompt) -> str | None:
        """The difficulty bucket of a prompt (``"digits=3"``), for held-out accuracy per bucket; None: this task
        has no notion of difficulty, and its evaluations report no buckets."""
        return None

    def prompts(self, split: str = TRAIN) -> Iterator[Prompt]:
        """Every prompt of one epoch of ``split``, in index order."""
        for index in range(self.num_prompts(split)):
            yield self.make_prompt(index, split)

    def _check_request(self, index: int, split: str) -> None:
        if split not in SPLITS:
            raise TaskError(f"task {self.name}: unknown split {split!r}; expected one of {SPLITS}")
        if not isinstance(index, int) or index < 0:
            raise TaskError(f"task {self.name}: prompt index must be a non-negative int, got {index!r}")


def weighted_reward(correct: float, fmt: float, format_weight: float) -> RewardResult:
    """reward = correct + format_weight * format, with both components recorded."""
    return RewardResult(reward=correct + format_weight * fmt, components={"correct": correct, "format": fmt})


def check_format_weight(task: str, value: float) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise TaskError(f"task {task}: format_weight must be a finite number >= 0, got {value!r}")
    return float(value)


def strip_special(completion: str, specials: tuple[str, ...] = ("<|endoftext|>", "<|im_end|>")) -> str:
    """The completion without trailing end markers or whitespace (engines may keep the stop token's text)."""
    text = completion.rstrip()
    changed = True
    while changed:
        changed = False
        for marker in specials:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                changed = True
    return text
