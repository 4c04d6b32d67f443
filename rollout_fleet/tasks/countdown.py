"""Countdown: reach a target with the given numbers using + - * / and parentheses, each number at most once.

The completion's final equation goes in ``<answer> ... </answer>`` tags (the last pair counts); without tags the
last non-empty line is tried. An ``= value`` suffix must be the target itself (``(7 - 3) * 5 = 20``), so a
second equation or a wrong claim after the ``=`` makes the answer wrong. The expression is parsed by a small recursive
descent parser over exact fractions (never ``eval``): only non-negative integer literals, binary + - * /, and
parentheses. Division by zero, an unknown character, a number not on offer, or a number used more often than
offered makes the answer wrong. format = 1 when answer tags hold a parsable expression.

Prompts are generated (deterministically from seed, split, index; a target reachable by construction) or read
from a dataset with a list-of-numbers field and a target field.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction
from functools import cached_property
from typing import Any, Literal

from pydantic import Field, model_validator

from rollout_fleet.datasets import ChatFormatter, DatasetError, get_field, read_rows
from rollout_fleet.tasks.base import (
    CHAT_TEMPLATE_DOC,
    TEST,
    TRAIN,
    ChatTemplate,
    FileTaskOptions,
    GeneratedTaskOptions,
    Prompt,
    RewardResult,
    Task,
    TaskError,
    strip_special,
    weighted_reward,
)

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TOKEN_RE = re.compile(r"\s*(?:(\d+)|([-+*/()]))", re.ASCII)  # int() also reads Unicode digits: refuse them
CLAIM_RE = re.compile(r"\s*(-?\d+)\s*", re.ASCII)
MAX_EXPRESSION_CHARS = 300
MAX_DEPTH = 64
MAX_ATTEMPTS = 1000
PROMPT_TEMPLATE = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use +, -, * and / and each "
    "number at most once. Give the final equation in <answer> </answer> tags, for example <answer> (1 + 2) * 3 "
    "</answer>."
)


class ExpressionError(ValueError):
    """An answer that is not a valid countdown expression; the message says why."""


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := INT | '(' expr ')'."""

    def __init__(self, text: str) -> None:
        if len(text) > MAX_EXPRESSION_CHARS:
            raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
        self.tokens: list[str] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = TOKEN_RE.match(text, pos)
            if not m:
                raise ExpressionError(f"unexpected character {text[pos:].lstrip()[:1]!r} at {pos}")
            self.tokens.append(m.group(1) or m.group(2))
            pos = m.end()
        self.pos, self.numbers = 0, []

    def parse(self) -> Fraction:
        if not self.tokens:
            raise ExpressionError("empty expression")
        value = self._expr(0)
        if self.pos != len(self.tokens):
            raise ExpressionError(f"unexpected {self.tokens[self.pos]!r} after a complete expression")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _expr(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._factor(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._factor(depth)
            if op == "/" and rhs == 0:
                raise ExpressionError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def _factor(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
        token = self._peek()
        if token is None:
            raise ExpressionError("expression ends early")
        self.pos += 1
        if token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        if token == "(":
            value = self._expr(depth + 1)
            if self._peek() != ")":
                raise ExpressionError("missing ')'")
            self.pos += 1
            return value
        raise ExpressionError(f"unexpected {token!r}")


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of an expression and the numbers it uses, in order; ExpressionError if invalid."""
    parser = _Parser(expression)
    return parser.parse(), parser.numbers


def extract_expression(completion: str) -> tuple[str | None, bool]:
    """(expression text, whether it came from answer tags). An ``= value`` suffix is dropped."""
    candidate, from_tags = _candidate(completion)
    return (None if candidate is None else candidate.split("=", 1)[0].strip()), from_tags


def claims_target(completion: str, target: int) -> bool:
    """Whether the answer's ``= value`` suffix, when it has one, is exactly the target (a lone number)."""
    candidate, _ = _candidate(completion)
    if candidate is None or "=" not in candidate:
        return True
    claim = CLAIM_RE.fullmatch(candidate.split("=", 1)[1])
    return claim is not None and claim.group(1) == str(target)  # as text: int() refuses > 4,300 digits


def _candidate(completion: str) -> tuple[str | None, bool]:
    """The last tagged answer (or, without tags, the last non-empty line) and whether it was tagged."""
    text = strip_special(completion)
    tagged = ANSWER_RE.findall(text)
    if tagged:
        candidate, from_tags = tagged[-1], True
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            return None, False
        candidate, from_tags = lines[-1], False
    return candidate, from_tags


def check_answer(
    expression: str | None, nums: list[int], target: int, use_all: bool = False
) -> tuple[bool, str]:
    """(correct, reason): the expression is valid, uses only offered numbers at most once, and hits target."""
    if expression is None:
        return False, "no answer"
    try:
        value, used = evaluate(expression)
    except ExpressionError as e:
        return False, str(e)
    extra = Counter(used) - Counter(nums)
    if extra:
        return False, f"uses {sorted(extra.elements())} beyond the numbers offered {nums}"
    if use_all and sorted(used) != sorted(nums):
        return False, f"uses {sorted(used)}, not all of {sorted(nums)}"
    if value != target:
        return False, f"evaluates to {value}, not {target}"
    return True, "ok"


def score_completion(
    nums: list[int], target: int, completion: str, use_all: bool = False, format_weight: float = 0.0
) -> RewardResult:
    expression, from_tags = extract_expression(completion)
    correct = check_answer(expression, nums, target, use_all)[0] and claims_target(completion, target)
    parsable = False
    if from_tags and expression is not None:
        try:
            evaluate(expression)
            parsable = True
        except ExpressionError:
            pass
    return weighted_reward(1.0 if correct else 0.0, 1.0 if parsable else 0.0, format_weight)


def _generate(rng: random.Random, max_number: int, max_target: int) -> tuple[list[int], int] | None:
    """Random numbers combined in a random order with random operations; None when the target is unusable."""
    nums = [rng.randint(1, max_number) for _ in range(rng.choice((3, 4)))]
    values = [Fraction(n) for n in nums]
    while len(values) > 1:
        a = values.pop(rng.randrange(len(values)))
        b = values.pop(rng.randrange(len(values)))
        op = rng.choice("+-*/")
        if op == "/" and (b == 0 or (a / b).denominator != 1):
            op = "+"
        values.append({"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op])
    target = values[0]
    if target.denominator != 1 or not 1 <= target <= max_target:
        return None
    return nums, int(target)


class CountdownConfig(GeneratedTaskOptions, FileTaskOptions):
    """countdown: reach a target with the given numbers and + - * /; generated, or read from dataset files."""

    name: Literal["countdown"] = Field("countdown", description="The task.")
    max_number: int = Field(99, strict=True, ge=1, description="Generated numbers are in 1..max_number.")
    max_target: int = Field(999, strict=True, ge=1, description="Generated targets are in 1..max_target.")
    use_all: bool = Field(False, description="Every number must be used (default: each at most once).")
    nums_field: str = Field("nums", description="Dataset field (dotted path allowed) of the list of numbers.")
    target_field: str = Field("target", description="Dataset field (dotted path allowed) of the target.")
    chat_template: ChatTemplate = Field("never", description=CHAT_TEMPLATE_DOC)

    @model_validator(mode="after")
    def _test_file_needs_train_file(self) -> CountdownConfig:
        if self.test_dataset and not self.dataset:
            raise ValueError("test_dataset needs dataset (the train prompts) too")
        return self


class CountdownTask(Task):
    """Countdown with 3 or 4 numbers in 1..max_number; targets in 1..max_target, reachable by construction."""

    name = "countdown"
    version = "2"  # 2: the adversarial sets' holes closed (rollout_fleet/adversarial.py)
    Config = CountdownConfig

    def __init__(
        self, config: CountdownConfig | None = None, /, tokenizer: Any = None, **options: Any
    ) -> None:
        c = self.configure(config, options)
        self.seed, self.train_size, self.heldout_size = c.seed, c.train_size, c.heldout_size
        self.max_number, self.max_target, self.use_all = c.max_number, c.max_target, c.use_all
        self.format_weight = c.format_weight
        self.files = {TRAIN: (c.dataset, c.dataset_split), TEST: (c.test_dataset, c.test_split)}
        self.fields = (c.nums_field, c.target_field)
        self.formatter = ChatFormatter(c.chat_template, tokenizer, c.system_prompt)

    # -- problems: (nums, target) -------------------------------------------------------------------------
    def _draw(self, split: str, index: int, avoid: frozenset | set) -> tuple[list[int], int]:
        """The first usable problem of the (seed, split, index) attempt sequence whose key is not in ``avoid``."""
        for attempt in range(MAX_ATTEMPTS):
            rng = random.Random(f"countdown:{self.seed}:{split}:{index}:{attempt}")
            problem = _generate(rng, self.max_number, self.max_target)
            if problem is not None and _key(problem) not in avoid:
                return problem
        raise TaskError(f"task countdown: no usable {split} problem at index {index}")

    def _read(self, split: str) -> list[tuple[list[int], int]]:
        path, data_split = self.files[split]
        problems = []
        for i, row in enumerate(read_rows(path, data_split)):
            where = f"dataset {path}: row {i}"
            nums, target = get_field(row, self.fields[0], where), get_field(row, self.fields[1], where)
            if not isinstance(nums, list) or not nums or not all(isinstance(n, int) and n >= 0 for n in nums):
                raise DatasetError(
                    f"{where}: field {self.fields[0]!r} must be a non-empty list of ints >= 0, got {nums!r}"
                )
            if not isinstance(target, int) or isinstance(target, bool):
                raise DatasetError(f"{where}: field {self.fields[1]!r} must be an int, got {target!r}")
            problems.append((nums, target))
        return problems

    @cached_property
    def heldout(self) -> list[tuple[list[int], int]]:
        if self.files[TRAIN][0]:
            return self._read(TEST) if self.files[TEST][0] else []
        seen: set[tuple[tuple[int, ...], int]] = set()
        problems = []
        for index in range(self.heldout_size):
            problem = self._draw(TEST, index, seen)
            seen.add(_key(problem))
            problems.append(problem)
        return problems

    @cached_property
    def heldout_keys(self) -> frozenset[tuple[tuple[int, ...], int]]:
        return frozenset(_key(p) for p in self.heldout)

    @cached_property
    def _train_rows(self) -> list[tuple[list[int], int]]:
        return [p for p in self._read(TRAIN) if _key(p) not in self.heldout_keys]

    def problem(self, index: int, split: str = TRAIN) -> tuple[list[int], int]:
        self._check_request(index, split)
        if index >= self.num_prompts(split):
            raise TaskError(
                f"task countdown: {split} index {index} out of range ({self.num_prompts(split)} prompts)"
            )
        if split == TEST:
            return self.heldout[index]
        return (
            self._train_rows[index] if self.files[TRAIN][0] else self._draw(TRAIN, index, self.heldout_keys)
        )

    # -- the Task interface -------------------------------------------------------------------------------
    def num_prompts(self, split: str = TRAIN) -> int:
        self._check_request(0, split)
        if split == TEST:
            return len(self.heldout)
        return len(self._train_rows) if self.files[TRAIN][0] else self.train_size

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        nums, target = self.problem(index, split)
        question = PROMPT_TEMPLATE.format(nums=nums, target=target)
        self.formatter.check(question, f"task countdown {split} prompt {index}")
        return Prompt(
            prompt_id=f"countdown/{self.seed}/{split}/{index}",
            text=self.formatter.render(question),
            answer=str(target),
            split=split,
            index=index,
            metadata={"nums": list(nums), "target": target},
        )

    def difficulty(self, prompt: Prompt) -> str | None:
        """How many numbers are on offer (3 or 4 when generated): the search space grows with them."""
        return f"numbers={len(prompt.metadata['nums'])}" if "nums" in prompt.metadata else None

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        nums = [int(n) for n in prompt.metadata["nums"]]
        return score_completion(
            nums, int(prompt.metadata["target"]), completion, self.use_all, self.format_weight
        )


def _key(problem: tuple[list[int], int]) -> tuple[tuple[int, ...], int]:
    return tuple(sorted(problem[0])), problem[1]
