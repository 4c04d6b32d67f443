"""The records the trajectory transport hands its callers: a delivery, a drop record, the drop reason rule."""

from __future__ import annotations

import re
from dataclasses import dataclass

from broker.record import TrajectoryGroup

_REASON = re.compile(r"^[a-z][a-z0-9_]*$")


def check_drop_reason(reason: str) -> None:
    """A drop reason is a short code (``stale``, ``zero_signal``, ...): it names a counter and a metric."""
    if not _REASON.match(reason):
        raise ValueError(f"reason = {reason!r}: must be a short code like 'stale' ([a-z0-9_])")


@dataclass
class Delivery:
    """One entry handed to the caller: acknowledge it with ``ack`` once its effect is durable."""

    entry_id: str
    group: TrajectoryGroup
    delivery_count: int
    nbytes: int  # payload size


@dataclass(frozen=True)
class DropRecord:
    """What a drop did: the group's record in the dropped stream, whether this call wrote it (a repeat returns the
    first one's id), and whether it gave the group's admission capacity back."""

    record_id: str
    first: bool
    gave_back: bool
