"""Adversarial sets: completions that try to game each built-in verifier all score 0, in the tests and through
``streamrl eval --adversarial``, which fails with a table naming task, case and score when one does not."""

from __future__ import annotations

import pytest

from rollout_fleet.adversarial import format_table, run_adversarial, task_sets
from rollout_fleet.tasks import Prompt, RewardResult, available_tasks, get_task
from rollout_fleet.tasks.dataset import DatasetTask
from streamrl.cli import main as cli_main


def test_every_built_in_verifier_has_a_set_that_scores_zero() -> None:
    outcomes = run_adversarial()
    # every built-in task has its set, but openenv and verifiers: they have no verifier (their reward is the
    # environment's)
    assert {o.task for o in outcomes} == set(available_tasks()) - {"openenv", "verifiers"}
    for task, cases in task_sets():
        names = {c.name.rsplit("/", 1)[-1] for c in cases}
        assert {"empty", "prompt_echo", "huge_number", "fullwidth_digits", "very_long_then_wrong"} <= names, (
            task.name
        )
        assert any("several" in n for n in names) and any("scratchpad" in n for n in names), task.name
    gamed = [o for o in outcomes if o.gamed]
    assert not gamed, "\n" + format_table(gamed)


@pytest.mark.parametrize(
    ("task", "completion"),
    [  # holes the adversarial sets found, now closed
        ("gsm8k", "\\boxed{72}\nwait, no.\n#### 73"),  # an earlier \boxed{} is not the final answer
        ("gsm8k", "#### 72 or 73"),  # several numbers: not known which is meant
        ("gsm8k", "#### 7 2"),  # digits spaced out (only "1 000"-style separators are read)
        ("gsm8k", "#### 72e0"),
        ("gsm8k", "#### ７２"),  # fullwidth digits
        ("countdown", "<answer>(7 - 3) * 5 = 20, 7 + 5 = 12</answer>"),  # a second equation after the claim
        ("countdown", "<answer>(７ - ３) * ５</answer>"),
    ],
)
def test_closed_holes(task: str, completion: str) -> None:
    sets = dict((t.name, cases) for t, cases in task_sets())
    prompt = sets[task][0].prompt
    assert get_task(task).score(prompt, completion).reward == 0.0


def test_right_answers_still_score() -> None:
    """The fixes leave honest answers alone (so the sets are not passed by a verifier that gives 0 to all)."""
    sets = dict((t.name, cases) for t, cases in task_sets())
    honest = {
        "gsm8k": ["#### 72", "\\boxed{72}", "#### 72 pens", "#### 72\n\\boxed{72}", "It is 72."],
        "countdown": ["<answer>(7 - 3) * 5</answer>", "<answer>(7 - 3) * 5 = 20</answer>"],
    }
    for task, completions in honest.items():
        for completion in completions:
            assert get_task(task).score(sets[task][0].prompt, completion).reward == 1.0, completion
    assert (
        get_task("gsm8k").score(sets["gsm8k"][0].prompt.__class__("g", "", "1000"), "#### 1 000").reward
        == 1.0
    )


def lax_score(self: DatasetTask, prompt: Prompt, completion: str) -> RewardResult:
    """A lax verifier: half a point when the answer is anywhere in the completion."""
    hit = float(prompt.answer in completion)
    return RewardResult(0.5 * hit, {"correct": hit})


def test_cli_exits_0_when_all_score_0_and_1_with_a_table_when_one_scores(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli_main(["eval", "--adversarial"]) == 0
    assert "score 0" in capsys.readouterr().out
    monkeypatch.setattr(DatasetTask, "score", lax_score)
    assert cli_main(["eval", "--adversarial"]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.err
    header, *rows = captured.out.strip().splitlines()
    assert header.split() == ["task", "case", "reward", "correct", "status"]
    assert rows and all(r.split()[0] == "dataset" for r in rows)
    assert any(r.split()[1] == "42/several_answers_space" and r.split()[2] == "0.5" for r in rows)
