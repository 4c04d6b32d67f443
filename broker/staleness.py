"""The staleness rule: admission capacity for rollout workers and the consumption filter of the learner.

Staleness of a token = learner_version - token_version, in policy versions. The bound ``eta`` is enforced
twice (docs/losses.md, "Staleness"):

- At admission, :class:`StalenessManager` (after AReaL's staleness manager) lets a worker start a group only
  while ``capacity() > 0``, with

      capacity = min(max_concurrent - running,
                     (eta + 1) * groups_per_step + consumed - (accepted + running))

  ``consumed`` is the number of groups whose training the announced policy contains: the learner sets it each
  time it announces a version (:meth:`StalenessCounters.set_consumed`). Everything started so far (accepted or
  still running) is consumed in order; what is not yet consumed, ``accepted + running - consumed``, is bounded
  by ``(eta + 1) * groups_per_step``, so a group started now is consumed within ``eta + 1`` steps, i.e. by the
  learner at most ``eta`` versions after the one it was generated with. ``eta = 0`` allows exactly one step's
  worth of groups ahead of the learner: synchronous on-policy training. A group that is dropped (rejected by
  the worker, or dropped by the learner after acceptance) no longer counts, so it gives its capacity back.
  AReaL writes ``(eta + version + 1) * groups_per_step``, taking the version for the consumed steps; here the
  version jumps on a resume (versions are never reused) and advances once per ``publish_every`` steps, so the
  learner states the count instead. A resumed learner sets it back to its checkpoint's count, so the groups it
  reads again are counted as not yet consumed and nothing is over-admitted.
- At consumption, :func:`check_staleness` drops a group whose oldest token is more than ``eta`` versions
  behind the learner, with the reason ``"stale"`` and the staleness value.

The counters are an injected :class:`StalenessCounters` so that every worker of the fleet shares one global
count: :class:`InMemoryCounters` for one process and tests, ``broker.admission.RedisCounters`` backed by a Redis
hash updated by Lua scripts (atomic across processes and machines); ``broker.admission`` is the one home of those
scripts, the prompt dispatch's lease, completion and release and the learner's drop included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.versioning import Lineage, admission_capacity


@dataclass(frozen=True)
class CounterSnapshot:
    """Admission counters, in groups. ``running``, ``accepted`` and ``consumed`` enter the capacity formula;
    ``started``, ``rejected`` and ``dropped`` are cumulative, for metrics."""

    running: int = 0
    accepted: int = 0
    started: int = 0
    rejected: int = 0
    dropped: int = 0
    consumed: int = 0


class CounterError(RuntimeError):
    """A transition that would make a counter negative: a group accepted, rejected or dropped twice."""


class StalenessCounters(Protocol):
    """Shared admission counters. Every method is atomic with respect to every other caller."""

    async def snapshot(self) -> CounterSnapshot: ...

    async def start(self, n: int) -> None:
        """running += n, started += n, unconditionally."""

    async def try_start(self, n: int, max_running: int, base_outstanding: int) -> bool:
        """Start n groups iff running + n <= max_running and accepted + running + n <= base_outstanding +
        consumed."""

    async def accept(self, n: int) -> None:
        """running -= n, accepted += n (a finished group went into the stream)."""

    async def reject(self, n: int) -> None:
        """running -= n, rejected += n (a started group will never reach the stream)."""

    async def drop(self, n: int) -> None:
        """accepted -= n, dropped += n (the learner dropped an accepted group without training on it)."""

    async def set_consumed(self, n: int) -> None:
        """consumed = n: the announced policy contains the training of n groups (the learner only)."""


class InMemoryCounters:
    """Counters of one process (asyncio: each method runs without an await inside, hence atomically)."""

    def __init__(self) -> None:
        self._c = CounterSnapshot()

    async def snapshot(self) -> CounterSnapshot:
        return self._c

    def _move(self, source: str | None, target: str, n: int) -> None:
        _check_n(n)
        values = vars(self._c).copy()
        if source is not None:
            if values[source] < n:
                raise CounterError(f"cannot move {n} from {source} = {values[source]} to {target}")
            values[source] -= n
        values[target] += n
        self._c = CounterSnapshot(**values)

    async def start(self, n: int) -> None:
        self._move(None, "running", n)
        self._move(None, "started", n)

    async def try_start(self, n: int, max_running: int, base_outstanding: int) -> bool:
        c = self._c
        if c.running + n > max_running or c.accepted + c.running + n > base_outstanding + c.consumed:
            return False
        await self.start(n)
        return True

    async def accept(self, n: int) -> None:
        self._move("running", "accepted", n)

    async def reject(self, n: int) -> None:
        self._move("running", "rejected", n)

    async def drop(self, n: int) -> None:
        self._move("accepted", "dropped", n)

    async def set_consumed(self, n: int) -> None:
        _check_consumed(n)
        self._c = CounterSnapshot(**{**vars(self._c), "consumed": n})


def _check_n(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"group count n = {n!r} must be a positive integer")


def _check_consumed(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"consumed = {n!r}: must be an int >= 0")


class StalenessManager:
    """Admission control by the staleness bound (formula in the module docstring), counted in groups."""

    def __init__(
        self, eta: int, groups_per_step: int, max_concurrent: int, counters: StalenessCounters
    ) -> None:
        if eta < 0:
            raise ValueError(f"eta = {eta} must be >= 0")
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step = {groups_per_step} must be >= 1")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent = {max_concurrent} must be >= 1")
        self.eta = eta
        self.groups_per_step = groups_per_step
        self.max_concurrent = max_concurrent
        self.counters = counters

    @property
    def base_outstanding(self) -> int:
        """Groups that may be accepted or running beyond those consumed (common.versioning.admission_capacity)."""
        return admission_capacity(self.eta, self.groups_per_step)

    async def capacity(self) -> int:
        """Groups that may start now; 0 or negative means wait."""
        c = await self.counters.snapshot()
        return min(
            self.max_concurrent - c.running, self.base_outstanding + c.consumed - (c.accepted + c.running)
        )

    async def try_start(self, n: int = 1) -> bool:
        """Atomically start ``n`` groups if the capacity allows it: the check and the increment happen in
        one step, so concurrent workers can never overshoot the bound together."""
        return await self.counters.try_start(n, self.max_concurrent, self.base_outstanding)

    async def on_start(self, n: int = 1) -> None:
        """Count ``n`` groups as running without checking (the caller checked :meth:`capacity`)."""
        await self.counters.start(n)

    async def on_accept(self, n: int = 1) -> None:
        """``n`` running groups finished and went into the stream."""
        await self.counters.accept(n)

    async def on_reject(self, n: int = 1) -> None:
        """``n`` running groups will never reach the stream (reward error, abort): their capacity comes back."""
        await self.counters.reject(n)

    async def on_drop(self, n: int = 1) -> None:
        """The learner dropped ``n`` accepted groups (stale, zero signal, invalid): their capacity comes back,
        because the learner consumes replacements for them in the same step."""
        await self.counters.drop(n)

    async def on_consumed(self, n: int) -> None:
        """The announced policy contains the training of ``n`` groups in all (the learner, at each announcement;
        a resumed learner states its checkpoint's count)."""
        await self.counters.set_consumed(n)


def staleness(learner_version: int, token_version: int) -> int:
    """Versions between the policy a token was sampled from and the learner's: ``learner - token``."""
    return learner_version - token_version


@dataclass(frozen=True)
class StalenessDecision:
    """Whether a group is trained on; ``reason`` is None when kept, else why it was dropped."""

    keep: bool
    staleness: int
    reason: str | None = None


def check_staleness(
    learner_version: int, eta: int, token_versions: int | Iterable[int], lineage: Lineage | None = None
) -> StalenessDecision:
    """Keep a group iff every token is within the bound: at most ``eta`` (plus the lineage's allowance for
    tokens from before a resume) positions from the learner's weights, in either direction.

    ``token_versions``: the group's oldest token version, or every distinct token version. Reasons: ``"stale"``
    (too far), ``"future_version"`` (a token claims a version the learner has not published, which versions that
    are never reused rule out; kept out of training and counted rather than crashing the learner).
    ``staleness`` is the largest distance found.
    """
    if eta < 0:
        raise ValueError(f"eta = {eta} must be >= 0")
    lineage = lineage or Lineage()
    versions = [token_versions] if isinstance(token_versions, int) else sorted(set(token_versions))
    worst = 0
    for v in versions:
        if v > learner_version:
            return StalenessDecision(keep=False, staleness=learner_version - v, reason="future_version")
        d = lineage.distance(learner_version, v)
        worst = max(worst, abs(d))
        if lineage.behind(learner_version, v, eta):
            return StalenessDecision(keep=False, staleness=d, reason="stale")
    return StalenessDecision(keep=True, staleness=worst)


@dataclass(frozen=True)
class StalenessStats:
    """Token-weighted staleness of a step: min / mean / max and a histogram {staleness: token count}."""

    count: int
    min: int
    mean: float
    max: int
    histogram: dict[int, int] = field(default_factory=dict)

    def as_metrics(self, prefix: str = "staleness") -> dict[str, float]:
        """Flat metrics for wandb / Redis: ``staleness/min`` ... and ``staleness/hist/<s>``."""
        out: dict[str, float] = {
            f"{prefix}/min": self.min,
            f"{prefix}/mean": self.mean,
            f"{prefix}/max": self.max,
            f"{prefix}/tokens": self.count,
        }
        out.update({f"{prefix}/hist/{s}": n for s, n in sorted(self.histogram.items())})
        return out


def staleness_stats(
    learner_version: int, token_versions: Iterable[Sequence[int] | int], lineage: Lineage | None = None
) -> StalenessStats:
    """Stats over every token of a step; ``token_versions`` holds versions, or per-sequence arrays of them
    (lists, numpy arrays, tensors). Staleness is the lineage distance (``learner - token`` without resumes),
    as a magnitude. No tokens gives count 0 and zeros."""
    lineage = lineage or Lineage()
    hist: Counter[int] = Counter()
    for item in token_versions:
        values = [item] if isinstance(item, int) else _as_ints(item)
        hist.update(abs(lineage.distance(learner_version, v)) for v in values)
    count = sum(hist.values())
    if count == 0:
        return StalenessStats(count=0, min=0, mean=0.0, max=0, histogram={})
    total = sum(s * n for s, n in hist.items())
    return StalenessStats(count=count, min=min(hist), mean=total / count, max=max(hist), histogram=dict(hist))


def _as_ints(values: Sequence[int]) -> list[int]:
    tolist = getattr(values, "tolist", None)
    raw = tolist() if tolist is not None else list(values)
    return [int(v) for v in (raw if isinstance(raw, list) else [raw])]
