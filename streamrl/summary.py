"""The names of ``summary.json``'s held-out accuracy fields, the printed held-out lines, and a reader that
accepts older run directories.

Until issue 37 the greedy accuracy was written as ``eval_reward_before/after`` (it is not a reward: it is the
fraction of held-out prompts solved, ``rollout_fleet.eval_stats.accuracy``) and the sampled accuracy as
``eval_sampled_before/after``. :func:`read_summary` renames those, so readers use the current names only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GREEDY_BEFORE, GREEDY_AFTER = "eval_greedy_accuracy_before", "eval_greedy_accuracy_after"
SAMPLED_BEFORE, SAMPLED_AFTER = "eval_sampled_accuracy_before", "eval_sampled_accuracy_after"
# The newest held-out evaluation of the run (the live evaluator's, up's before or after): what a run stopped
# before its final evaluation (SIGTERM, a role out of restarts) reports instead, with the version it was of.
LAST_GREEDY, LAST_SAMPLED = "eval_last_greedy_accuracy", "eval_last_sampled_accuracy"
LAST_VERSION, LAST_VERSION_MAX = "eval_last_version", "eval_last_version_max"
LAST_IS_FINAL = "eval_last_is_final_policy"
OLD_NAMES = {
    "eval_reward_before": GREEDY_BEFORE,
    "eval_reward_after": GREEDY_AFTER,
    "eval_sampled_before": SAMPLED_BEFORE,
    "eval_sampled_after": SAMPLED_AFTER,
}


def upgrade_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with its old field names (``OLD_NAMES``) replaced by the current ones."""
    out = {OLD_NAMES.get(key, key): value for key, value in summary.items() if key not in OLD_NAMES}
    for old, new in OLD_NAMES.items():
        if old in summary and new not in out:
            out[new] = summary[old]
    return out


def read_summary(path: Path) -> dict[str, Any]:
    """A run's ``summary.json`` (the file, or the run directory holding it), with the current field names."""
    path = path / "summary.json" if path.is_dir() else path
    return upgrade_summary(json.loads(path.read_text()))


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _v(low: Any, high: Any = None) -> str:
    """``v5``, or ``v5-7`` for an evaluation whose answers came from several versions (engines updated midway)."""
    if low is None:
        return "v?"
    return f"v{low:.0f}" if high is None or high == low else f"v{low:.0f}-{high:.0f}"


def accuracy_line(s: dict[str, Any], kind: str) -> str:
    """The printed held-out line of ``kind`` (greedy or sampled): before -> after, each with the policy version
    it is of. Without up's final evaluation (a stopped run) the right side is the run's last evaluation, said
    plainly to be of an earlier policy than the final one when it is: a number is never labelled "after" when it
    is not of the final policy."""
    before, after, last = {
        "greedy": (GREEDY_BEFORE, GREEDY_AFTER, LAST_GREEDY),
        "sampled": (SAMPLED_BEFORE, SAMPLED_AFTER, LAST_SAMPLED),
    }[kind]
    final = s.get("final_policy_version")
    left = f"{_pct(s.get(before))} ({_v(s.get('eval_version_before'))})"
    if s.get(after) is not None:
        right = f"{_pct(s[after])} ({_v(s.get('eval_version_after'))})"
        if s.get("eval_after_is_final_policy") is False:
            right += f"   (NOT the final policy {final}: no engine served it)"
        return f"  held-out accuracy ({kind}): {left} -> {right}"
    version = s.get(LAST_VERSION)
    ended = "the final policy is " + ("unknown" if final is None else _v(final))
    if version is None or version == s.get("eval_version_before") or s.get(last) is None:
        return f"  held-out accuracy ({kind}): {left} -> n/a (no evaluation after it; {ended}, not evaluated)"
    span = _v(version, s.get(LAST_VERSION_MAX))
    if s.get(LAST_IS_FINAL):
        return f"  held-out accuracy ({kind}): {left} -> {_pct(s[last])} ({span}, last evaluation: the final policy)"
    return f"  held-out accuracy ({kind}): {left} -> {_pct(s[last])} ({span}, last evaluation; {ended}, not evaluated)"
