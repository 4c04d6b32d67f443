"""The built-in task: multi-digit addition worked digit by digit on a scratchpad.

A miniature of long chain-of-thought RLVR: the output length varies widely across prompts (a few dozen
characters for most, several times that for the 6- and 8-digit tail), and a verifier checks the final answer.
See docs/tasks.md for the exact format and the measured length distribution.

Prompt (raw text, no chat template, to keep prompts short):  ``"57+68="``
Completion (one step per digit from the least significant, then the sum, then EOS):
``"7+8+0=5c1;5+6+1=2c1;#125"``.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from rollout_fleet.tasks.base import (
    TEST,
    TRAIN,
    GeneratedTaskOptions,
    Prompt,
    RewardResult,
    Task,
    TaskError,
    strip_special,
    weighted_reward,
)

DIGIT_COUNTS = (1, 2, 3, 4, 6, 8)
DIGIT_WEIGHTS = (30, 30, 20, 10, 6, 4)
STEP = r"\d\+\d\+[01]=\dc[01];"
FORMAT_RE = re.compile(rf"(?:{STEP})+#\d+")
MAX_ATTEMPTS = 1000
HELDOUT_SHARE = 4  # one problem pair in 4 belongs to the held-out space


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def text(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def key(self) -> tuple[int, int]:
        """Unordered pair: a+b and b+a count as the same problem for held-out disjointness."""
        return (min(self.a, self.b), max(self.a, self.b))


def scratchpad(a: int, b: int) -> str:
    """The reference completion: ``da+db+carry=digit c<carry>;`` per digit from the right, then ``#<sum>``.

    Steps run over max(len(a), len(b)) digits; a shorter number contributes 0 digits. The last carry is not a
    step of its own: it is the leading digit of the sum.
    """
    if a < 0 or b < 0:
        raise ValueError(f"scratchpad needs non-negative numbers, got a={a}, b={b}")
    steps, carry = [], 0
    for i in range(max(len(str(a)), len(str(b)))):
        da, db = a // 10**i % 10, b // 10**i % 10
        total = da + db + carry
        steps.append(f"{da}+{db}+{carry}={total % 10}c{total // 10};")
        carry = total // 10
    return "".join(steps) + f"#{a + b}"


def final_answer(completion: str) -> str | None:
    """The text after the last ``#``, or None when there is no ``#``."""
    text = strip_special(completion)
    if "#" not in text:
        return None
    return text.rsplit("#", 1)[1].strip()


def score_completion(answer: str, completion: str, format_weight: float = 0.0) -> RewardResult:
    """correct: the text after the last ``#`` is exactly the decimal sum (so the model must stop after it);
    format: the whole completion is one or more well-formed steps followed by ``#<digits>``."""
    got = final_answer(completion)
    # compared as digit strings: int() refuses more than 4,300 digits, and a long output can hold that many
    digits = got is not None and got.isascii() and got.isdigit()
    correct = 1.0 if digits and (got.lstrip("0") or "0") == (answer.lstrip("0") or "0") else 0.0
    fmt = 1.0 if FORMAT_RE.fullmatch(strip_special(completion)) else 0.0
    return weighted_reward(correct, fmt, format_weight)


class ArithmeticConfig(GeneratedTaskOptions):
    """arithmetic: addition worked digit by digit on a scratchpad (the tiny model's task)."""

    name: Literal["arithmetic"] = Field("arithmetic", description="The task.")


def in_heldout_space(seed: int, key: tuple[int, int], heldout_fraction: int = HELDOUT_SHARE) -> bool:
    """Whether an (unordered) problem belongs to the held-out part of the problem space for this seed."""
    digest = hashlib.sha256(f"arithmetic:{seed}:{key[0]}+{key[1]}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % heldout_fraction == 0


class ArithmeticTask(Task):
    """Addition of two numbers with the same digit count, drawn from DIGIT_COUNTS with DIGIT_WEIGHTS.

    Prompts are a pure function of (seed, split, index). The problem space is split by a hash of the unordered
    pair (a, b): one pair in HELDOUT_SHARE belongs to the held-out (test) space, the rest to train. A draw that
    lands in the other split's space is redrawn with the same digit count, so both splits keep the exact digit
    mix, and no train prompt equals a held-out problem in either order. There are only 55 unordered one-digit
    pairs, so the test split repeats its ~14 one-digit problems (a sample with replacement, like the rest).
    """

    name = "arithmetic"
    version = "1"
    Config = ArithmeticConfig

    def __init__(self, config: ArithmeticConfig | None = None, /, **options: Any) -> None:
        c = self.configure(config, options)
        self.seed, self.train_size, self.heldout_size = c.seed, c.train_size, c.heldout_size
        self.format_weight = c.format_weight

    def num_prompts(self, split: str = TRAIN) -> int:
        self._check_request(0, split)
        return self.train_size if split == TRAIN else self.heldout_size

    def problem(self, index: int, split: str = TRAIN) -> Problem:
        """The problem at (seed, split, index)."""
        self._check_request(index, split)
        if split == TEST and index >= self.heldout_size:
            raise TaskError(
                f"task arithmetic: test index {index} out of range (heldout_size {self.heldout_size})"
            )
        return self._draw(split, index, heldout=split == TEST)

    def validation_prompt(self, index: int) -> Prompt:
        """A prompt from the held-out problem space, from a stream separate from the test split's.

        For model selection (the warm-start's stopping rule): like the test split, it is never trained on,
        so memorised train problems cannot inflate it. It is not the test split, but the held-out space has
        only ~14 one-digit pairs, so its one-digit problems coincide with the test split's.
        """
        if not isinstance(index, int) or index < 0:
            raise TaskError(f"task arithmetic: validation index must be a non-negative int, got {index!r}")
        return self._prompt(self._draw("validation", index, heldout=True), "validation", index)

    def _draw(self, stream: str, index: int, heldout: bool) -> Problem:
        """str seeds are hashed with sha512 by random.Random: stable across runs and PYTHONHASHSEED."""
        rng = random.Random(f"arithmetic:{self.seed}:{stream}:{index}")
        digits = rng.choices(DIGIT_COUNTS, DIGIT_WEIGHTS)[0]
        low = 0 if digits == 1 else 10 ** (digits - 1)
        for _ in range(MAX_ATTEMPTS):
            problem = Problem(rng.randrange(low, 10**digits), rng.randrange(low, 10**digits))
            if self.is_heldout(problem) == heldout:
                return problem
        raise TaskError(f"task arithmetic: no {stream} problem found at index {index}")

    def is_heldout(self, problem: Problem) -> bool:
        """Whether the problem (in either order) belongs to the held-out space."""
        return in_heldout_space(self.seed, problem.key)

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        return self._prompt(self.problem(index, split), split, index)

    def _prompt(self, p: Problem, split: str, index: int) -> Prompt:
        return Prompt(
            prompt_id=f"arithmetic/{self.seed}/{split}/{index}",
            text=p.text,
            answer=str(p.a + p.b),
            split=split,
            index=index,
            metadata={"a": p.a, "b": p.b, "digits": len(str(max(p.a, p.b)))},
        )

    def reference_completion(self, prompt: Prompt) -> str:
        """The target the supervised warm-start trains on (without the EOS token)."""
        return scratchpad(int(prompt.metadata["a"]), int(prompt.metadata["b"]))

    def difficulty(self, prompt: Prompt) -> str | None:
        """The digit count of the larger operand: what the warm model's accuracy falls with."""
        return f"digits={prompt.metadata['digits']}" if "digits" in prompt.metadata else None

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        return score_completion(prompt.answer, completion, self.format_weight)
