"""Held-out statistics, computed by hand: pass@k (the unbiased estimator), accuracy per difficulty bucket,
what counts as solved, and each built-in task's difficulty bucket."""

from __future__ import annotations

import math

import pytest

from rollout_fleet.eval_stats import (
    accuracy,
    buckets_of,
    by_bucket,
    format_rate,
    k_values,
    pass_at_k,
    pass_at_k_of,
    pass_at_ks,
    solved,
)
from rollout_fleet.evaluator import EvalReward, summarise
from rollout_fleet.tasks import TEST, TRAIN, Prompt, RewardResult, Task, get_task


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (4, 1, 1, 1 / 4),  # pass@1 is c / n
        (4, 0, 4, 0.0),
        (8, 8, 1, 1.0),
        (3, 1, 3, 1.0),  # n - c < k: every draw of 3 holds the solved one
        (6, 2, 3, 1 - 4 / 20),  # 1 - C(4,3)/C(6,3)
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int, expected: float) -> None:
    assert math.isclose(pass_at_k(n, c, k), expected)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_k_values_and_the_mean_over_problems() -> None:
    assert (k_values(1), k_values(6), k_values(8)) == ([1], [1, 2, 4, 6], [1, 2, 4, 8])
    # problems with 2 and 0 solved of 5: pass@1 = (0.4 + 0) / 2, pass@2 = (0.7 + 0) / 2, pass@4 = (1 + 0) / 2
    got = pass_at_ks([2, 0], 5)
    assert list(got) == [1, 2, 4, 5]
    assert [round(v, 9) for v in got.values()] == [0.2, 0.35, 0.5, 0.5]


def test_solved_is_the_correct_component_else_a_positive_reward() -> None:
    assert solved(RewardResult(1.0, {"correct": 1.0, "format": 1.0}))
    assert not solved(
        RewardResult(0.5, {"correct": 0.0, "format": 1.0})
    )  # format credit is not a right answer
    assert solved(RewardResult(0.25, {"hit": 0.0}))  # no `correct`: pass/fail on the reward
    assert not solved(RewardResult(0.0)) and not solved(RewardResult(-1.0))
    assert not solved(RewardResult.failed("timeout", "ran past 5 s"))


# one of each kind: no `correct` but a reward (solved), format credit only, a failed scorer, a right answer
KINDS = (
    RewardResult(1.0),
    RewardResult(0.5, {"correct": 0.0, "format": 1.0}),
    RewardResult.failed("error", "boom"),
    RewardResult(1.0, {"correct": 1.0, "format": 1.0}),
)


def test_accuracy_is_the_fraction_solved() -> None:
    assert accuracy(KINDS) == 2 / 4 and format_rate(KINDS) == 2 / 4
    assert accuracy([]) == 0.0 and format_rate([]) == 0.0


class _FixedScores(Task):
    """Scores each prompt with KINDS[index], whatever the model wrote."""

    name, version = "fixed_scores", "1"

    def num_prompts(self, split: str = TRAIN) -> int:
        return len(KINDS)

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        return Prompt(f"f{index}", "1+1=", "2", split, index)

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        return KINDS[prompt.index]


def test_the_model_evaluation_counts_accuracy_as_the_evaluator_does() -> None:
    """rollout_fleet.local_eval (warm starts, the TRL comparison) and summary.json's evaluator agree: the reward
    without a `correct` component counts as solved (the `correct` mean alone said 1 / 4)."""
    from rollout_fleet.local_eval import evaluate
    from rollout_fleet.model import TinyModelSpec, build_model, build_tokenizer

    tokenizer = build_tokenizer()
    got = evaluate(build_model(TinyModelSpec(), tokenizer), tokenizer, _FixedScores(), max_new_tokens=2)
    assert (got["greedy_accuracy"], got["sampled_accuracy"], got["format_rate"], got["n"]) == (
        0.5,
        0.5,
        0.5,
        4,
    )
    scored = [[(r, 1)] for r in KINDS]
    prompts = [_FixedScores().make_prompt(i, TEST) for i in range(4)]
    out = summarise(_FixedScores(), prompts, scored, scored, EvalReward("fixed_scores", {}, "task"))
    assert (out["greedy_accuracy"], out["sampled_accuracy"]) == (
        got["greedy_accuracy"],
        got["sampled_accuracy"],
    )


def test_buckets_are_ordered_by_their_number_and_skip_prompts_without_one() -> None:
    got = by_bucket(["digits=10", "digits=2", None, "digits=2"], [1.0, 0.0, 1.0, 1.0])
    assert got == {"digits=2": (0.5, 2), "digits=10": (1.0, 1)}


def _prompt(i: int, digits: int) -> Prompt:
    return Prompt(
        prompt_id=f"p{i}", text=f"{i}+0=", answer=str(i), split=TEST, index=i, metadata={"digits": digits}
    )


def test_summarise_by_hand() -> None:
    """Four arithmetic prompts (1, 1, 10 and 2 digits), greedy solved 1 0 1 1, two samples each solved 2 1 0 1."""
    task = get_task("arithmetic")
    prompts = [_prompt(0, 1), _prompt(1, 1), _prompt(2, 10), _prompt(3, 2)]
    right, wrong = (
        RewardResult(1.0, {"correct": 1.0, "format": 1.0}),
        RewardResult(0.5, {"correct": 0.0, "format": 1.0}),
    )
    failed = RewardResult.failed("error", "boom")
    greedy = [[(right, 3)], [(wrong, 3)], [(right, 4)], [(right, 3)]]
    sampled = [
        [(right, 3), (right, 3)],
        [(right, 3), (failed, 3)],
        [(wrong, 4), (wrong, 4)],
        [(wrong, 3), (right, 3)],
    ]
    out = summarise(task, prompts, greedy, sampled, EvalReward("arithmetic", {}, "task"))
    d = out["details"]
    assert (out["greedy_accuracy"], out["sampled_accuracy"], out["n"]) == (0.75, 0.5, 4)
    assert (out["version"], out["max_version"], out["format_rate"]) == (3, 4, 1.0)
    assert (d["pass@1"], d["pass@2"]) == (0.5, 0.75)  # mean of c/2; mean of [1, 1, 0, 1]
    assert d["greedy_reward"] == (1 + 0.5 + 1 + 1) / 4 and d["reward_errors"] == 1.0
    assert d["reward_source/task"] == 1.0 and d["greedy_component/correct"] == 0.75
    assert buckets_of(d) == {
        "digits=1": {"greedy": 0.5, "sampled": 0.75, "n": 2.0},
        "digits=2": {"greedy": 1.0, "sampled": 0.5, "n": 1.0},
        "digits=10": {"greedy": 1.0, "sampled": 0.0, "n": 1.0},
    }
    assert list(buckets_of(d)) == ["digits=1", "digits=2", "digits=10"]
    assert pass_at_k_of(d) == {"1": 0.5, "2": 0.75}


def test_each_built_in_task_defines_its_bucket() -> None:
    arithmetic = get_task("arithmetic").make_prompt(0, TEST)
    assert get_task("arithmetic").difficulty(arithmetic) == f"digits={arithmetic.metadata['digits']}"
    long = get_task("long_multiplication")
    factors = Prompt("l", "123*4567=", "561741", metadata={"a": "123", "b": "4567", "digits": [3, 4]})
    assert long.difficulty(factors) == "digits=4-6"  # the larger factor's digits, binned
    assert long.difficulty(Prompt("l", "", "", metadata={"digits": [27, 1]})) == "digits=21-100"
    countdown = get_task("countdown")
    assert countdown.difficulty(countdown.make_prompt(0, TEST)) in ("numbers=3", "numbers=4")
    for name in ("gsm8k", "dataset"):  # no notion of difficulty: no buckets
        assert get_task(name).difficulty(Prompt("d", "q", "a", metadata={"row": 0})) is None
