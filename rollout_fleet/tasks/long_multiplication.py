"""The long-output task: multi-digit multiplication worked digit by digit on a scratchpad that carries its state.

A miniature of long chain-of-thought RLVR at the lengths where systems hurt: with the default digit mix the
reference scratchpad is a few hundred characters for most prompts (median ~500) with a tail of several
thousand (p95 ~5,000) up to 15,985 for 27 x 27 digits, one token per character with the tiny model's
tokenizer. See docs/tasks.md for the format, the measured distribution and the reward.

Prompt (raw text):  ``"347*29="``
Completion: one line per digit of the multiplier, from the least significant; then ``#`` and the product::

    29:|7*9+0=3c6>0+3+0=3c0;4*9+6=2c4>0+2+0=2c0;3*9+4=1c3>0+1+0=1c0;0*9+3=3c0>0+3+0=3c0;
    2:3|7*2+0=4c1>2+4+0=6c0;4*2+1=9c0>1+9+0=0c1;3*2+0=6c0>3+6+1=0c1;0*2+0=0c0>0+0+1=1c0;
    #10063

Line ``j`` starts with a header ``{multiplier digits left}:{final product digits so far}|`` and has one step
per digit of the multiplicand (least significant first) plus a flush step for a leading 0. A step multiplies
a digit by the line's multiplier digit with the multiply carry (``a*b+c=dcC``), then adds the result digit to
the running total's digit at that place with the add carry (``r+d+s=eS``). Everything a step needs is in the
previous step or at the same place of the previous line (all lines of a problem have the same length), never
thousands of tokens back in the prompt: the format is meant to stay writable at lengths never trained on.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from rollout_fleet.tasks.base import (
    TEST,
    TRAIN,
    GeneratedTaskOptions,
    Prompt,
    RewardResult,
    Task,
    TaskError,
    strip_special,
)

MAX_DIGITS_LIMIT = 100  # bounds the verifier's work (a 100 x 100 scratchpad is ~0.2M characters)
DEFAULT_MAX_DIGITS = 27  # the longest reference (27 x 27 digits) is 15,985 characters: fits 16,384 with EOS
MAX_ATTEMPTS = 1000
HELDOUT_SHARE = 4  # one problem pair in 4 belongs to the held-out space
STEP = r"\d\*\d\+\d=\dc\d>\d\+\d\+[01]=\dc[01];"
FORMAT_RE = re.compile(rf"(?:\d+:\d*\|(?:{STEP})+\n)+#\d+")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def text(self) -> str:
        return f"{self.a}*{self.b}="

    @property
    def key(self) -> tuple[int, int]:
        """Unordered pair: a*b and b*a count as the same problem for held-out disjointness."""
        return (min(self.a, self.b), max(self.a, self.b))


def scratchpad_lines(a: int, b: int) -> list[tuple[str, list[str]]]:
    """The reference scratchpad as (header, steps) per line, before ``#<product>``.

    Line j multiplies ``a`` (digits a_0.. from the least significant, plus a 0 that flushes the multiply carry)
    by b_j, the j-th digit of ``b`` from the right, and adds each digit of that partial product into the running
    total R at place j + k. Its header holds ``b // 10**j`` (so b_j is its last digit) and the places 0 .. j-1 of
    the product, already final. The add carry out of the last step is always 0: R after line j is below
    10**(len(a) + j + 1).
    """
    if a < 0 or b < 0:
        raise ValueError(f"scratchpad needs non-negative numbers, got a={a}, b={b}")
    digits_a = [int(c) for c in reversed(str(a))] + [0]
    multiplier = str(b)
    total = [0] * (len(digits_a) + len(multiplier))  # running total R, least significant place first
    lines, low = [], ""
    for j in range(len(multiplier)):
        bj, steps, carry, add_carry = int(multiplier[-1 - j]), [], 0, 0
        for k, ak in enumerate(digits_a):
            product = ak * bj + carry
            d, next_carry = product % 10, product // 10
            r = total[j + k]
            added = r + d + add_carry
            e, next_add_carry = added % 10, added // 10
            steps.append(f"{ak}*{bj}+{carry}={d}c{next_carry}>{r}+{d}+{add_carry}={e}c{next_add_carry};")
            total[j + k], carry, add_carry = e, next_carry, next_add_carry
        lines.append((f"{multiplier[: len(multiplier) - j]}:{low}|", steps))
        low = f"{total[j]}{low}"
    return lines


def scratchpad(a: int, b: int) -> str:
    """The reference completion (without EOS): every line of :func:`scratchpad_lines`, then ``#<a*b>``."""
    body = "".join(header + "".join(steps) + "\n" for header, steps in scratchpad_lines(a, b))
    return f"{body}#{a * b}"


def reference_length(n_digits_a: int, n_digits_b: int, product_digits: int) -> int:
    """Characters of the reference for an n x m digit problem: m lines of (header m + 2, 20 per step, newline)."""
    return n_digits_b * (n_digits_b + 2 + 20 * (n_digits_a + 1) + 1) + 1 + product_digits


def final_answer(completion: str) -> str | None:
    """The text after the last ``#``, or None when there is no ``#``."""
    text = strip_special(completion)
    if "#" not in text:
        return None
    return text.rsplit("#", 1)[1].strip()


def is_number(text: str, value: int) -> bool:
    """Whether ``text`` is the decimal digits of ``value`` (leading zeros allowed), compared as strings: int()
    refuses strings of more than 4,300 digits, and a model can write that many."""
    return text.isascii() and text.isdigit() and (text.lstrip("0") or "0") == str(value)


def completion_steps(completion: str) -> list[list[str]]:
    """The steps of each scratchpad line of a completion, parsed leniently (a broken line keeps its steps)."""
    body = strip_special(completion).rsplit("#", 1)[0]
    lines = []
    for line in body.split("\n"):
        if not line:
            continue
        steps = line.split("|", 1)[-1]
        lines.append([s + ";" for s in steps.split(";")[:-1]])
    return lines


def score_completion(
    a: int, b: int, completion: str, format_weight: float = 0.0, step_weight: float = 0.0
) -> RewardResult:
    """Components: ``correct`` (the text after the last ``#`` is the product's digits), ``format`` (the whole
    completion follows the grammar with the reference's shape: one line per digit of b, len(a) + 1 steps each),
    ``steps`` (the fraction of the reference's steps the completion has, exactly, at the same line and place).
    reward = correct + format_weight * format + step_weight * steps."""
    reference = scratchpad_lines(a, b)
    got = final_answer(completion)
    correct = 1.0 if got is not None and is_number(got, a * b) else 0.0
    lines = completion_steps(completion)
    shape_ok = len(lines) == len(reference) and all(
        len(steps) == len(ref) for steps, (_, ref) in zip(lines, reference, strict=True)
    )
    fmt = 1.0 if shape_ok and FORMAT_RE.fullmatch(strip_special(completion)) else 0.0
    total = sum(len(ref) for _, ref in reference)
    hits = sum(
        s == r
        for steps, (_, ref) in zip(lines, reference, strict=False)
        for s, r in zip(steps, ref, strict=False)
    )
    steps_fraction = hits / total
    return RewardResult(
        reward=correct + format_weight * fmt + step_weight * steps_fraction,
        components={"correct": correct, "format": fmt, "steps": steps_fraction},
    )


def in_heldout_space(seed: int, key: tuple[int, int], heldout_fraction: int = HELDOUT_SHARE) -> bool:
    """Whether an (unordered) problem belongs to the held-out part of the problem space for this seed."""
    digest = hashlib.sha256(f"long_multiplication:{seed}:{key[0]}*{key[1]}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % heldout_fraction == 0


class LongMultiplicationConfig(GeneratedTaskOptions):
    """long_multiplication: multiplication on a scratchpad, outputs of hundreds to ~16,000 tokens."""

    name: Literal["long_multiplication"] = Field("long_multiplication", description="The task.")
    min_digits: int = Field(1, strict=True, ge=1, description="Fewest digits of each factor.")
    max_digits: int = Field(
        DEFAULT_MAX_DIGITS,
        strict=True,
        ge=1,
        le=MAX_DIGITS_LIMIT,
        description=f"Most digits of each factor ({DEFAULT_MAX_DIGITS}: outputs <= 16k tokens).",
    )
    step_weight: float = Field(
        0.5, ge=0, allow_inf_nan=False, description="reward adds step_weight * the fraction of right steps."
    )

    @model_validator(mode="after")
    def _digit_range(self) -> LongMultiplicationConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits = {self.min_digits} is above max_digits = {self.max_digits}")
        return self


class LongMultiplicationTask(Task):
    """a * b with the digit counts of a and b drawn independently from min_digits..max_digits, weight 1/d.

    The 1/d weights make the output length long-tailed: the reference grows as 20 * len(a) * len(b), and most
    problems are small. Prompts are a pure function of (seed, split, index); the problem space is split by a
    hash of the unordered pair as in the arithmetic task (one pair in HELDOUT_SHARE is held out, a draw in the
    other split's space is redrawn with the same digit counts), so no train prompt is a held-out problem in
    either order.
    """

    name = "long_multiplication"
    version = "1"

    Config = LongMultiplicationConfig

    def __init__(self, config: LongMultiplicationConfig | None = None, /, **options: Any) -> None:
        c = self.configure(config, options)
        self.seed, self.train_size, self.heldout_size = c.seed, c.train_size, c.heldout_size
        self.min_digits, self.max_digits = c.min_digits, c.max_digits
        self.format_weight, self.step_weight = c.format_weight, c.step_weight
        self.digit_counts = tuple(range(self.min_digits, self.max_digits + 1))
        self.digit_weights = tuple(1 / d for d in self.digit_counts)

    def num_prompts(self, split: str = TRAIN) -> int:
        self._check_request(0, split)
        return self.train_size if split == TRAIN else self.heldout_size

    def problem(self, index: int, split: str = TRAIN) -> Problem:
        """The problem at (seed, split, index)."""
        self._check_request(index, split)
        if split == TEST and index >= self.heldout_size:
            raise TaskError(
                f"task long_multiplication: test index {index} out of range (heldout_size {self.heldout_size})"
            )
        return self._draw(split, index, heldout=split == TEST)

    def validation_prompt(self, index: int) -> Prompt:
        """A prompt from the held-out problem space, from a stream separate from the test split's (never
        trained on): the warm-start's measure."""
        if not isinstance(index, int) or index < 0:
            raise TaskError(
                f"task long_multiplication: validation index must be a non-negative int, got {index!r}"
            )
        return self._prompt(self._draw("validation", index, heldout=True), "validation", index)

    def _draw(self, stream: str, index: int, heldout: bool) -> Problem:
        """str seeds are hashed with sha512 by random.Random: stable across runs and PYTHONHASHSEED."""
        rng = random.Random(f"long_multiplication:{self.seed}:{stream}:{index}")
        n, m = rng.choices(self.digit_counts, self.digit_weights, k=2)
        for _ in range(MAX_ATTEMPTS):
            problem = Problem(_number(rng, n), _number(rng, m))
            if in_heldout_space(self.seed, problem.key) == heldout:
                return problem
        raise TaskError(f"task long_multiplication: no {stream} problem found at index {index}")

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        return self._prompt(self.problem(index, split), split, index)

    def _prompt(self, p: Problem, split: str, index: int) -> Prompt:
        # a and b travel as strings: 27-digit numbers do not fit msgpack's 64-bit integers
        return Prompt(
            prompt_id=f"long_multiplication/{self.seed}/{split}/{index}",
            text=p.text,
            answer=str(p.a * p.b),
            split=split,
            index=index,
            metadata={"a": str(p.a), "b": str(p.b), "digits": [len(str(p.a)), len(str(p.b))]},
        )

    def reference_completion(self, prompt: Prompt) -> str:
        """The target the supervised warm-start trains on (without the EOS token)."""
        return scratchpad(int(prompt.metadata["a"]), int(prompt.metadata["b"]))

    def difficulty(self, prompt: Prompt) -> str | None:
        """The digits of the larger factor, in bins (the scratchpad grows as len(a) * len(b); 27 single-digit
        buckets would hold a handful of held-out problems each)."""
        if "digits" not in prompt.metadata:
            return None
        return difficulty_bin(max(int(d) for d in prompt.metadata["digits"]))

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        a, b = int(prompt.metadata["a"]), int(prompt.metadata["b"])
        return score_completion(a, b, completion, self.format_weight, self.step_weight)


DIFFICULTY_BINS = ((1, 3), (4, 6), (7, 12), (13, 20), (21, MAX_DIGITS_LIMIT))


def difficulty_bin(digits: int) -> str:
    """``"digits=4-6"``: the bin of DIFFICULTY_BINS holding a factor of ``digits`` digits."""
    low, high = next((lo, hi) for lo, hi in DIFFICULTY_BINS if lo <= digits <= hi)
    return f"digits={low}-{high}"


def _number(rng: random.Random, digits: int) -> int:
    """Uniform over the numbers with exactly ``digits`` digits (0..9 for one digit)."""
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)
