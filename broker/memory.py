"""The trajectory seam in the memory of one process (``broker.protocols``): a stream, its producers and the
learner's consumer group, for unit tests of the roles without Redis.

It keeps the semantics of the Redis implementation that the roles rely on: a send is idempotent by group id and
waits while the backlog is at ``max_backlog``; an entry handed out stays pending until acknowledged, comes back to
a source of the same consumer name that starts again (delivery count + 1), and can be claimed by another after
``claim_idle_ms``; an entry delivered more than ``max_deliveries`` times is dead-lettered; a drop is recorded once
per group id and gives the group's admission capacity back once; an acknowledgement records the group's final
outcome (the first one stays, a different second one is a conflict) and a repeat changes nothing. Payloads go
through the codec both ways, so what a source hands out is validated and decoded as from Redis.

Not kept: more than one consumer group, payloads by reference, trimming by the archive's group, reconnects, the
prompt dispatch (so of the pruning of broker.retention only the acknowledged set's applies).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass

from broker.admission import give_back
from broker.codec import decode, encode
from broker.config import BrokerConfig
from broker.outcomes import Outcome
from broker.producer import BackpressureTimeout
from broker.protocols import Delivery, DropRecord, check_drop_reason
from broker.record import TrajectoryGroup
from broker.staleness import StalenessCounters


@dataclass
class _Pending:
    consumer: str
    deliveries: int
    since: float  # time.monotonic() of the last delivery


class MemoryStream:
    """One trajectory stream with the learner's consumer group, and what the broker records about its groups."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self.entries: dict[str, tuple[str, bytes]] = {}  # entry id -> (group id, payload), in stream order
        self.group_ids: dict[str, str] = {}  # group id -> entry id of its first send
        self.pending: dict[str, _Pending] = {}  # entry id -> its current delivery, until acknowledged
        self.delivered = 0  # entries of `entries` delivered so far, in order (the group's last-delivered id)
        self.acked: set[str] = set()  # group ids acknowledged (pruned past keep_groups trimmed groups)
        self.retired: deque[str] = deque()  # group ids of trimmed entries, oldest first
        self.drops: dict[str, tuple[str, str]] = {}  # group id -> (record id, reason)
        self.dead_letters: dict[str, str] = {}  # entry id -> reason
        self.outcomes: dict[str, Outcome] = {}  # group id -> its final outcome (the first one recorded)
        self.conflicts: dict[str, Outcome] = {}  # group id -> a second, different outcome
        self.counters: Counter[str] = Counter()
        self._seq = 0

    @property
    def backlog(self) -> int:
        """Entries produced and not yet acknowledged."""
        return len(self.entries) - self.delivered + len(self.pending)

    def _next_id(self) -> str:
        self._seq += 1
        return f"{self._seq}-0"

    def add(self, group_id: str, payload: bytes) -> str | None:
        """Add an entry: its id, the first one's for a group id already added, None while the backlog is full."""
        if group_id in self.group_ids:
            return self.group_ids[group_id]
        if self.backlog >= self.config.max_backlog:
            return None
        entry_id = self._next_id()
        self.entries[entry_id] = (group_id, payload)
        self.group_ids[group_id] = entry_id
        self.counters["produced"] += 1
        return entry_id

    def record_outcome(self, group_id: str, outcome: Outcome) -> None:
        first = self.outcomes.setdefault(group_id, outcome)
        same = (first.outcome, first.step, first.reason) == (outcome.outcome, outcome.step, outcome.reason)
        if not same:
            self.conflicts[group_id] = outcome

    async def wait_for_entries(self, timeout_s: float) -> None:
        """Return once an entry is waiting to be delivered, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.delivered >= len(self.entries) and time.monotonic() < deadline:
            await asyncio.sleep(min(0.005, timeout_s))


class MemoryProducer:
    """``TrajectoryProducer`` into a :class:`MemoryStream`."""

    def __init__(self, stream: MemoryStream, producer_id: str) -> None:
        self.stream = stream
        self.producer_id = producer_id
        self.sent = 0  # groups this producer added
        self.resent = 0  # sends whose group id was already in the stream

    async def send(self, group: TrajectoryGroup, position: int | None = None) -> str:
        """Validate and add ``group`` once (idempotent by group id), waiting while the backlog is at its bound.
        ``position`` is accepted for the seam and not used: there is no prompt dispatch in memory, so the group-id
        index is never pruned (as for a Redis producer without a position)."""
        payload = encode(group)  # validates; a RecordError names the field
        config = self.stream.config
        known = group.group_id in self.stream.group_ids
        waited_since = time.monotonic()
        while (entry_id := self.stream.add(group.group_id, payload)) is None:
            if time.monotonic() - waited_since > config.backpressure_timeout_s:
                raise BackpressureTimeout(
                    f"group {group.group_id!r}: backlog stayed at max_backlog = {config.max_backlog}"
                )
            await asyncio.sleep(config.backpressure_poll_s)
        if known:
            self.resent += 1
        else:
            self.sent += 1
        return entry_id


class MemorySource:
    """``TrajectorySource`` reading a :class:`MemoryStream` as consumer ``name`` of the learner's group. A new
    source under a name that had entries pending gets them back on its first read, as a restarted learner."""

    def __init__(self, stream: MemoryStream, name: str) -> None:
        if not name:
            raise ValueError(f"consumer name = {name!r}: must not be empty")
        self.stream = stream
        self.config = stream.config
        self.name = name
        self._handed: set[str] = set()  # entry ids this source handed out and has not acknowledged
        self._recovered = False

    def _hand_out(self, entry_ids: list[str]) -> list[Delivery]:
        """Deliveries of entries already made pending to this source; those delivered too often are
        dead-lettered instead (acknowledged, with their outcome)."""
        out = []
        for entry_id in entry_ids:
            group_id, payload = self.stream.entries[entry_id]
            pending = self.stream.pending[entry_id]
            if pending.deliveries > self.config.max_deliveries:
                self._dead_letter(entry_id, group_id, "max_deliveries")
                continue
            self._handed.add(entry_id)
            out.append(Delivery(entry_id, decode(payload), pending.deliveries, len(payload)))
        return out

    def _dead_letter(self, entry_id: str, group_id: str, reason: str) -> None:
        del self.stream.pending[entry_id]
        self.stream.dead_letters[entry_id] = reason
        self.stream.counters["dead_lettered"] += 1
        outcome = Outcome("dead_lettered", reason=reason, source="consumer", entry_id=entry_id)
        self.stream.record_outcome(group_id, outcome)

    def _recover_own(self) -> list[Delivery]:
        """This name's pending entries that this source never handed out (a previous process's)."""
        self._recovered = True
        mine = [
            i for i, p in self.stream.pending.items() if p.consumer == self.name and i not in self._handed
        ]
        for entry_id in mine:
            pending = self.stream.pending[entry_id]
            pending.deliveries, pending.since = pending.deliveries + 1, time.monotonic()
        return self._hand_out(mine)

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` new groups, waiting up to ``block_ms`` (0: no wait) for the first."""
        if not self._recovered and (recovered := self._recover_own()):
            return recovered
        count = count or self.config.read_count
        block = self.config.block_ms if block_ms is None else block_ms
        ids = list(self.stream.entries)
        if self.stream.delivered >= len(ids) and block:
            await self.stream.wait_for_entries(block / 1000)
            ids = list(self.stream.entries)
        new = ids[self.stream.delivered : self.stream.delivered + count]
        self.stream.delivered += len(new)
        now = time.monotonic()
        for entry_id in new:
            self.stream.pending[entry_id] = _Pending(self.name, 1, now)
        self.stream.counters["consumed"] += len(new)
        return self._hand_out(new)

    async def claim_stale(self, count: int | None = None) -> list[Delivery]:
        """Take over entries another consumer left pending for more than ``claim_idle_ms``."""
        count = count or self.config.read_count
        idle_s, now = self.config.claim_idle_ms / 1000, time.monotonic()
        stale = [
            i
            for i, p in self.stream.pending.items()
            if i not in self._handed and now - p.since >= idle_s and p.consumer != self.name
        ][:count]
        for entry_id in stale:
            pending = self.stream.pending[entry_id]
            self.stream.pending[entry_id] = _Pending(self.name, pending.deliveries + 1, now)
        self.stream.counters["reclaimed"] += len(stale)
        return self._hand_out(stale)

    async def ack(
        self,
        entries: list[str] | list[Delivery],
        outcomes: list[tuple[str, Outcome] | None] | None = None,
    ) -> int:
        """Acknowledge entries, recording each ``(group id, final outcome)``; returns how many were pending."""
        ids = [e.entry_id if isinstance(e, Delivery) else e for e in entries]
        outcomes = outcomes if outcomes is not None else [None] * len(ids)
        if len(outcomes) != len(ids):
            raise ValueError(f"{len(outcomes)} outcomes for {len(ids)} entries")
        done = 0
        for entry_id, outcome in zip(ids, outcomes, strict=True):
            if outcome is not None:
                self.stream.record_outcome(*outcome)
            self._handed.discard(entry_id)
            if self.stream.pending.pop(entry_id, None) is not None:
                self.stream.acked.add(self.stream.entries[entry_id][0])
                done += 1
        self.stream.counters["acknowledged"] += done
        return done

    async def drop(
        self,
        item: Delivery | TrajectoryGroup,
        reason: str,
        detail: str = "",
        admission: StalenessCounters | None = None,
    ) -> DropRecord:
        """Record once per group id that the group is not trained on; the first drop gives its admission
        capacity back to ``admission`` (accepted -> dropped)."""
        check_drop_reason(reason)
        group = item.group if isinstance(item, Delivery) else item
        if group.group_id in self.stream.drops:
            return DropRecord(self.stream.drops[group.group_id][0], first=False, gave_back=False)
        record_id = self.stream._next_id()
        self.stream.drops[group.group_id] = (record_id, reason)
        self.stream.counters["dropped"] += 1
        self.stream.counters[f"dropped:{reason}"] += 1
        gave_back = admission is not None and await give_back(admission)
        return DropRecord(record_id, first=True, gave_back=gave_back)

    async def recorded_drop(self, group_id: str) -> str | None:
        """The reason the group was dropped with, or None when it never was."""
        record = self.stream.drops.get(group_id)
        return record[1] if record is not None else None

    async def trim(self) -> int:
        """Forget the entries below the oldest one pending or not yet delivered; returns how many."""
        ids = list(self.stream.entries)
        keep_from = min([ids.index(i) for i in self.stream.pending] + [self.stream.delivered])
        for entry_id in ids[:keep_from]:
            self.stream.retired.append(self.stream.entries.pop(entry_id)[0])
        self.stream.delivered -= keep_from
        # Bounded state (broker.retention) for groups without a dispatch position, the only kind here: past the
        # newest keep_groups, a retired group leaves the acknowledged set; its index entry and outcome stay.
        while len(self.stream.retired) > self.config.keep_groups:
            self.stream.acked.discard(self.stream.retired.popleft())
        return keep_from
