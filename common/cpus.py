"""CPU pinning of a role's processes: on a CPU-only machine, disjoint cores for the engines and the learner play
the part of separate rollout and training GPUs (and keep one role from starving the other)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from common.configlib import ConfigError


def pin_to_cpus(cores: Sequence[int], field: str) -> None:
    """Restrict this process and the processes it starts to ``cores``; an empty list leaves it alone.

    Raises ConfigError naming ``field`` when a core is not available to this process.
    """
    if not cores:
        return
    available = os.sched_getaffinity(0)
    missing = sorted(set(cores) - available)
    if missing:
        raise ConfigError(
            f"{field} = {list(cores)}: core(s) {missing} are not available here (available: {sorted(available)})"
        )
    os.sched_setaffinity(0, set(cores))
