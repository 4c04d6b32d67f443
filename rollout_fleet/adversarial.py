"""Adversarial sets: completions that try to game each built-in verifier, every one of which must score 0.

Each case is a completion that does not give the right answer as its one final answer, yet carries it
somewhere a lax verifier might find it: several answers at once, the prompt echoed back, the answer in the
scratchpad before a wrong final one, format tricks (spaced digits, an exponent, a sign), huge numbers, Unicode
digits, empty or very long output. ``run_adversarial()`` scores every case with the task's own verifier at its
default options (what training uses unless configured otherwise) and ``streamrl eval --adversarial`` prints the
table, exiting 1 when any case scores above 0 (reward or ``correct``). The tests run the same sets.

Built-in verifiers are our own code and pure functions of (prompt, completion), so they are scored in process;
a custom reward function is not covered here (it runs in the reward pool, see ``rollout_fleet.rewards``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rollout_fleet.tasks import TEST, Prompt, Task, get_task
from rollout_fleet.tasks.countdown import PROMPT_TEMPLATE

FULLWIDTH = str.maketrans("0123456789", "０１２３４５６７８９")
ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
LONG = 100_000  # characters of filler in the very-long cases


@dataclass(frozen=True)
class Case:
    task: str
    name: str
    prompt: Prompt
    completion: str


@dataclass(frozen=True)
class Outcome:
    task: str
    case: str
    reward: float
    correct: float
    status: str

    @property
    def gamed(self) -> bool:
        """The verifier gave something for a completion that should get nothing."""
        return self.reward > 0 or self.correct > 0 or self.status != "ok"


def _wrong(right: str) -> str:
    return str(int(right) + 1) if right.isdigit() else right + "x"


def answer_cases(prompt: Prompt, slot: Callable[[str], str], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(name, completion) for a task whose final answer is written by ``slot`` (``#42``, ``\\boxed{42}``)."""
    right, wrong = prompt.answer, _wrong(prompt.answer)
    near = " ".join(str(int(right) + d) for d in range(-3, 4)) if right.isdigit() else f"{wrong} {right}"
    cases = {
        "empty": "",
        "whitespace_and_eos": "  \n<|endoftext|>",
        "prompt_echo": prompt.text,
        "prompt_echo_then_wrong": prompt.text + slot(wrong),
        "several_answers_space": slot(f"{right} {wrong}"),
        "several_answers_or": slot(f"{wrong} or {right}"),
        "several_answers_or_right_first": slot(f"{right} or {wrong}"),
        "several_answers_comma": slot(f"{right}, {wrong}"),
        "candidate_list": slot(near),
        "right_in_scratchpad_wrong_final": f"maybe {slot(right)} or {right}?\nno:\n{slot(wrong)}",
        "right_repeated_in_one_answer": slot(right * 50),
        "spaced_digits": slot(" ".join(right)),
        "exponent": slot(f"{right}e0"),
        "sign_flip": slot(f"-{right}"),
        "fullwidth_digits": slot(right.translate(FULLWIDTH)),
        "arabic_indic_digits": slot(right.translate(ARABIC_INDIC)),
        "huge_number": slot("9" * 5000),
        "right_then_many_digits": slot(right + "0" * 3000),
        "very_long_then_wrong": "x" * LONG + slot(wrong),
    }
    digit_only = ("spaced_digits", "exponent", "sign_flip", "fullwidth_digits", "arabic_indic_digits")
    for name, completion in cases.items():
        if right.isdigit() or name not in digit_only:  # the digit tricks mean nothing for a word answer
            yield prefix + name, completion


def countdown_cases(prompt: Prompt) -> Iterator[tuple[str, str]]:
    """Cases for nums [3, 5, 7], target 20 (solution (7 - 3) * 5)."""
    tag = "<answer>{}</answer>".format
    cases = {
        "empty": "",
        "prompt_echo": prompt.text,
        "prompt_echo_then_wrong": prompt.text + "\n" + tag("7 + 5"),
        "target_alone": tag("20"),
        "target_claim_on_wrong": tag("7 + 5 = 20"),
        "several_expressions": tag("7 + 5, (7 - 3) * 5"),
        "right_then_second_equation": tag("(7 - 3) * 5 = 20, 7 + 5 = 12"),
        "right_in_scratchpad_wrong_final": "try (7 - 3) * 5 = 20\n" + tag("7 + 5"),
        "number_reused": tag("5 * 5 - 5"),
        "number_not_offered": tag("(7 - 3) * 5 * 1"),
        "fullwidth_digits": tag("(７ - ３) * ５"),
        "arabic_indic_digits": tag("(٧ - ٣) * ٥"),
        "huge_number": tag("9" * 5000),
        "huge_number_times_zero": tag("(7 - 3) * 5 + 0 * 99999999999999999999"),
        "unclosed_tag": "<answer>(7 - 3) * 5",
        "very_long_then_wrong": "x" * LONG + "\n" + tag("7 + 5"),
    }
    yield from cases.items()


def _prompt(task: str, text: str, answer: str, **metadata: object) -> Prompt:
    return Prompt(prompt_id=f"{task}/adversarial", text=text, answer=answer, split=TEST, metadata=metadata)


def task_sets() -> list[tuple[Task, list[Case]]]:
    """Every built-in task (default options) with its adversarial cases."""
    out: list[tuple[Task, list[Case]]] = []
    for name in ("arithmetic", "long_multiplication", "tool_arithmetic"):
        task = get_task(name)
        prompt = task.make_prompt(0, TEST)
        if name == "tool_arithmetic":  # its test prompt 0 is a one-digit product: its cases need a longer one
            prompt = next(p for p in (task.make_prompt(i, TEST) for i in range(100)) if len(p.answer) > 2)
        out.append((task, [Case(name, n, prompt, c) for n, c in answer_cases(prompt, "#{}".format)]))
    tool_prompt = out[-1][1][0].prompt
    right, wrong = tool_prompt.answer, _wrong(tool_prompt.answer)
    result = f"<|im_end|>\n<|im_start|>tool\n{right}<|im_end|>\n<|im_start|>assistant\n"
    out[-1][1].extend(  # a right tool result is not the model's answer: only its last turn counts
        Case("tool_arithmetic", n, tool_prompt, c)
        for n, c in (
            ("tool_result_then_wrong", f"<calc>1*1</calc>{result}#{wrong}<|im_end|>"),
            ("tool_result_then_nothing", f"<calc>1*1</calc>{result}"),
            ("answer_then_tool_call", f"#{right}<|im_end|>\n<|im_start|>assistant\n<calc>{right}</calc>"),
        )
    )
    gsm = _prompt(
        "gsm8k", "Ann has 40 pens and buys 32 more. How many pens?\nGive the answer after ####.", "72"
    )
    gsm_cases = [
        *answer_cases(gsm, "#### {}".format, "hash/"),
        *answer_cases(gsm, "\\boxed{{{}}}".format, "boxed/"),
        ("boxed_right_then_hash_wrong", "\\boxed{72}\nwait, no.\n#### 73"),
        ("hash_right_then_boxed_wrong", "#### 72\nwait, no.\n\\boxed{73}"),
    ]
    out.append((get_task("gsm8k"), [Case("gsm8k", n, gsm, c) for n, c in gsm_cases]))
    data = [_prompt("dataset", "What is 6 times 7?", "42"), _prompt("dataset", "Capital of France?", "Paris")]
    data_cases = [Case("dataset", n, p, c) for p in data for n, c in answer_cases(p, str, f"{p.answer}/")]
    out.append((get_task("dataset"), data_cases))
    count = _prompt(
        "countdown", PROMPT_TEMPLATE.format(nums=[3, 5, 7], target=20), "20", nums=[3, 5, 7], target=20
    )
    out.append((get_task("countdown"), [Case("countdown", n, count, c) for n, c in countdown_cases(count)]))
    return out


def run_adversarial() -> list[Outcome]:
    """Score every case of every built-in task; an exception is an outcome too (status ``error``)."""
    outcomes = []
    for task, cases in task_sets():
        for case in cases:
            try:
                result = task.score(case.prompt, case.completion)
                reward, correct = result.reward, result.components.get("correct", 0.0)
                status = result.status
            except Exception as e:  # noqa: BLE001 - a verifier that raises is reported, not fatal
                reward, correct, status = 0.0, 0.0, f"error: {type(e).__name__}: {e}"
            outcomes.append(Outcome(case.task, case.name, float(reward), float(correct), status))
    return outcomes


def format_table(outcomes: list[Outcome], only_gamed: bool = False) -> str:
    """Plain aligned columns: task, case, reward, correct, status (every case, or only those that scored)."""
    rows = [o for o in outcomes if o.gamed or not only_gamed]
    header = ("task", "case", "reward", "correct", "status")
    cells = [header] + [(o.task, o.case, f"{o.reward:g}", f"{o.correct:g}", o.status) for o in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def main(argv: list[str] | None = None) -> int:
    """``streamrl eval --adversarial [--all]``: 0 when every case of every built-in verifier scores 0, else 1
    with a table of the cases that scored (``--all``: every case)."""
    args = list(sys.argv[1:] if argv is None else argv)
    outcomes = run_adversarial()
    gamed = [o for o in outcomes if o.gamed]
    tasks = sorted({o.task for o in outcomes})
    if gamed or "--all" in args:
        print(format_table(outcomes, only_gamed="--all" not in args))
    if gamed:
        print(
            f"\nFAIL: {len(gamed)} of {len(outcomes)} adversarial completions scored above 0", file=sys.stderr
        )
        return 1
    print(f"ok: all {len(outcomes)} adversarial completions score 0 ({', '.join(tasks)})")
    return 0
