"""The names of ``summary.json``'s held-out accuracy fields, and a reader that accepts older run directories.

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
