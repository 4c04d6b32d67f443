"""The data seam between the roles and the trajectory transport: what a rollout worker uses to send a group
(:class:`TrajectoryProducer`) and what the learner's intake uses to read, acknowledge and drop groups
(:class:`TrajectorySource`), with the records they exchange.

Two implementations keep the same semantics: the Redis Stream (``broker.producer.Producer``,
``broker.consumer.Consumer``) and the in-memory one of one process (``broker.memory``), for unit tests of the
roles. The semantics that matter, checked on both by tests/test_trajectory_seam.py:

- a send is idempotent by group id: sending a group id again returns the first entry id and adds nothing;
- delivery is at least once until acknowledged: an entry handed out and never acknowledged comes back (to the
  same consumer name after a restart, or to another through :meth:`TrajectorySource.claim_stale`);
- a drop is recorded once per group id, and gives the group's admission capacity back once;
- an acknowledgement records the group's final outcome with it; a repeated acknowledgement changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from broker.config import BrokerConfig
from broker.record import TrajectoryGroup

if TYPE_CHECKING:
    from broker.outcomes import Outcome
    from broker.staleness import StalenessCounters


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


@runtime_checkable
class TrajectoryProducer(Protocol):
    """Sends trajectory groups (a rollout worker's side of the seam)."""

    async def send(self, group: TrajectoryGroup, position: int | None = None) -> str:
        """Validate and add ``group`` once (idempotent by group id); returns its entry id (the first one's).
        ``position``: its prompt-dispatch position, if it has one; a done position's group that is no longer
        indexed is refused (``''``)."""
        ...


@runtime_checkable
class TrajectorySource(Protocol):
    """Reads trajectory groups (the learner's intake's side of the seam). ``config`` gives the read timing
    (``block_ms``, ``claim_idle_ms``)."""

    config: BrokerConfig

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` new valid groups, waiting up to ``block_ms`` (0: no wait) for the first."""
        ...

    async def claim_stale(self, count: int | None = None) -> list[Delivery]:
        """Entries another consumer left unacknowledged for more than ``claim_idle_ms``, taken over."""
        ...

    async def ack(
        self,
        entries: list[str] | list[Delivery],
        outcomes: list[tuple[str, Outcome] | None] | None = None,
    ) -> int:
        """Acknowledge entries, recording each ``(group id, final outcome)`` with it; returns how many were
        still pending."""
        ...

    async def drop(
        self,
        item: Delivery | TrajectoryGroup,
        reason: str,
        detail: str = "",
        admission: StalenessCounters | None = None,
    ) -> DropRecord:
        """Record once per group id that the group is not trained on, and why; the first drop also gives its
        admission capacity back to ``admission`` (accepted -> dropped)."""
        ...

    async def recorded_drop(self, group_id: str) -> str | None:
        """The reason the group was dropped with, or None when it never was."""
        ...

    async def trim(self) -> int:
        """Forget acknowledged entries below the oldest unacknowledged one; returns how many."""
        ...
