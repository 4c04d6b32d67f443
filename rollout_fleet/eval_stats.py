"""Held-out statistics from scored completions: accuracy, pass@k, accuracy per difficulty bucket.

This module is the one definition of held-out accuracy: ``summary.json`` (through the evaluator), the warm
starts' stopping rules and checks, and the TRL comparison (``rollout_fleet.local_eval``) all use
:func:`accuracy` / :func:`solved`.

What counts as solved (``solved``): the reward's ``correct`` component when it has one (every built-in task's
verifier has; a custom reward function may return it too), else a reward above 0, so a function that only
returns a number counts as pass/fail. A reward that timed out or failed is unsolved (and counted apart as
``reward_errors``). Accuracy is the fraction solved, never the mean reward: a reward with format or step
credit would otherwise read as accuracy (the mean reward is reported beside it).

pass@k over n samples of a problem with c solved is the unbiased estimator of Chen et al. (2021),
1 - C(n - c, k) / C(n, k), averaged over problems; k runs over 1, 2, 4, ... up to n and n itself.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from rollout_fleet.tasks import RewardResult


def solved(result: RewardResult) -> bool:
    """Whether a scored completion counts as a right answer (see the module docstring)."""
    if result.status != "ok":
        return False
    if "correct" in result.components:
        return result.components["correct"] > 0
    return result.reward > 0


def accuracy(results: Sequence[RewardResult]) -> float:
    """The fraction of results :func:`solved` (0.0 when there are none)."""
    return sum(solved(r) for r in results) / len(results) if results else 0.0


def format_rate(results: Sequence[RewardResult]) -> float:
    """The mean ``format`` component (0 where a result has none), 0.0 when there are no results."""
    return sum(r.components.get("format", 0.0) for r in results) / len(results) if results else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, hold a
    solved one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a solved sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n: the k reported for n samples per problem."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i < n]
    return [*ks, n]


def pass_at_ks(solved_counts: Sequence[int], n: int) -> dict[int, float]:
    """{k: mean pass@k over problems} from the number solved of each problem's n samples."""
    if not solved_counts:
        return {}
    return {k: sum(pass_at_k(n, c, k) for c in solved_counts) / len(solved_counts) for k in k_values(n)}


def bucket_order(label: str) -> tuple[str, float, str]:
    """Sort key of bucket labels: ``digits=2`` before ``digits=10`` (by the first number in the label)."""
    number = re.search(r"\d+", label)
    return (label.split("=", 1)[0], float(number.group()) if number else math.inf, label)


def by_bucket(buckets: Iterable[str | None], values: Iterable[float]) -> dict[str, tuple[float, int]]:
    """{bucket: (mean value, count)} in bucket order; prompts without a bucket (None) are left out."""
    sums: dict[str, list[float]] = defaultdict(list)
    for bucket, value in zip(buckets, values, strict=True):
        if bucket is not None:
            sums[bucket].append(value)
    return {b: (sum(sums[b]) / len(sums[b]), len(sums[b])) for b in sorted(sums, key=bucket_order)}


def component_means(results: Sequence[RewardResult]) -> dict[str, float]:
    """Mean of every reward component over the results that have it."""
    seen: dict[str, list[float]] = defaultdict(list)
    for r in results:
        for name, value in r.components.items():
            seen[name].append(value)
    return {name: sum(v) / len(v) for name, v in sorted(seen.items())}


def pass_at_k_of(metrics: Mapping[str, float]) -> dict[str, float]:
    """{"1": pass@1, "8": pass@8, ...} from an evaluation's flat metrics (``pass@1``, ``pass@8``)."""
    found = {k[5:]: v for k, v in metrics.items() if re.fullmatch(r"pass@\d+", k)}
    return dict(sorted(found.items(), key=lambda kv: int(kv[0])))


def buckets_of(metrics: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """{bucket: {"greedy", "sampled", "n"}} from an evaluation's flat metrics (``bucket/greedy/digits=3``...)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for key, value in metrics.items():
        parts = key.split("/", 2)
        if len(parts) == 3 and parts[0] == "bucket":
            out[parts[2]][parts[1]] = value
    return {b: out[b] for b in sorted(out, key=bucket_order)}
