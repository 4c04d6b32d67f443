r"""GSM8K-style math: the final answer is extracted from the completion and compared numerically.

Extraction, in order: the last ``\boxed{...}`` (nested braces allowed), else the last ``#### x``, else the last
number in the text. Numbers tolerate thousands separators, ``$``, ``%``, a trailing period, ``\frac{a}{b}``,
``a/b`` and a trailing ``.0``. Integer gold answers must match exactly; non-integer ones within a relative
1e-6 (so ``0.3333333`` matches ``1/3``). The format component is 1 when the answer came from ``\boxed`` or
``####`` (the formats the prompt asks for), 0 when it fell back to the last number or found nothing.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Literal

from pydantic import Field

from rollout_fleet.tasks.base import RewardResult, strip_special, weighted_reward
from rollout_fleet.tasks.dataset import DatasetConfig, DatasetTask

# ASCII digits only: int() and Fraction() also read Unicode digits (fullwidth, Arabic-Indic), a way around a
# "the answer must be a plain number" rule that rollout_fleet/adversarial.py checks
NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?", re.ASCII)
CLEAN_RE = re.compile(r"^-?\d+(?:\.\d+)?(?:/\d+)?$", re.ASCII)
THOUSANDS_SPACE_RE = re.compile(r"(?<=\d) (?=\d{3}(?!\d))", re.ASCII)  # "1 000": a separator, "7 2" is not
FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` or ``\fbox{...}``, braces matched; None if absent or unclosed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None


def extract_answer(completion: str) -> tuple[str | None, str]:
    """(answer text, how it was found: ``boxed``, ``hash``, ``last_number`` or ``none``)."""
    text = strip_special(completion)
    boxed = last_boxed(text)
    # the later of the two markers is the final answer: an earlier \boxed{} is scratchpad, not the answer
    boxed_at, hash_at = max(text.rfind("\\boxed{"), text.rfind("\\fbox{")), text.rfind("####")
    if boxed is not None and boxed_at > hash_at:
        return boxed.strip(), "boxed"
    if hash_at >= 0:
        tail = text.rsplit("####", 1)[1].strip()
        return (tail.splitlines()[0].strip() if tail else ""), "hash"
    numbers = NUMBER_RE.findall(text)
    if numbers:
        return numbers[-1], "last_number"
    return None, "none"


def parse_number(text: str) -> Fraction | None:
    """A number from an answer string, exactly, or None; no scientific notation (it could be made huge). An
    answer holding several numbers ("72 or 73", "7 2", "72e0") is None: which one is meant is not known."""
    s = TEXT_RE.sub(r"\1", text.strip())
    s = FRAC_RE.sub(r"(\1)/(\2)", s)
    s = THOUSANDS_SPACE_RE.sub("", s)
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", ",", "(", ")", "{", "}"):
        s = s.replace(junk, "")
    s = s.strip().rstrip(".")
    if not CLEAN_RE.fullmatch(s):
        found = NUMBER_RE.findall(text)  # e.g. "72 dollars": its one number
        if len(found) != 1 or found[0] == text.strip():
            return None
        return parse_number(found[0])
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, gold: str) -> bool:
    if predicted is None:
        return False
    p, g = parse_number(predicted), parse_number(gold)
    if p is None or g is None:
        return predicted.strip() == gold.strip() != ""
    if p == g:
        return True
    return g.denominator != 1 and math.isclose(float(p), float(g), rel_tol=1e-6)


def gold_from_solution(solution: str) -> str:
    r"""The reference answer of a GSM8K-style solution: after ``####``, else in ``\boxed{}``, else all of it."""
    if "####" in solution:
        return solution.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = last_boxed(solution)
    return (boxed if boxed is not None else solution).strip()


def score_completion(gold: str, completion: str, format_weight: float = 0.0) -> RewardResult:
    predicted, how = extract_answer(completion)
    correct = 1.0 if answers_match(predicted, gold) else 0.0
    fmt = 1.0 if how in ("boxed", "hash") else 0.0
    return weighted_reward(correct, fmt, format_weight)


class GSM8KConfig(DatasetConfig):
    """gsm8k: GSM8K-shaped data (question / answer with #### x) or any math set with numeric answers."""

    name: Literal["gsm8k"] = Field("gsm8k", description="The task.")  # type: ignore[assignment]
    prompt_field: str = Field("question", description="Field (dotted path allowed) holding the prompt text.")
    instruction: str | None = Field(
        'Think step by step, then give the final answer after "####".',
        description="Text appended on a new line to every prompt.",
    )


class GSM8KTask(DatasetTask):
    """GSM8K-shaped data (``question`` / ``answer`` with ``#### x``) or any math set with numeric answers."""

    name = "gsm8k"
    version = "2"  # 2: the adversarial sets' holes closed (rollout_fleet/adversarial.py)
    Config = GSM8KConfig

    def gold_answer(self, raw: str) -> str:
        return gold_from_solution(raw)

    def score(self, prompt, completion: str) -> RewardResult:  # type: ignore[override]
        return score_completion(prompt.answer, completion, self.format_weight)
