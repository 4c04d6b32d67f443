"""Publishers: how the learner makes new weights visible to the rollout fleet.

Every learner rank calls ``publish`` (all of them take part in the FSDP2 gathers); only rank 0 holds a
``WeightSender`` and talks to engines. ``publish`` returns a :class:`Publication`: the trainer announces the
version in Redis only when it says so, i.e. when every engine in the pool confirmed the update and at least one
did (or no engine is known at all: nobody to wait for). Engines that failed were quarantined and left the pool;
before every sync the sender probes the engines, and a quarantined one that answers again, or a member that
restarted (its ``weight_version`` is not the one it was given), rejoins the group and gets the current weights
in that same sync. While the learner waits for data it asks :meth:`WeightSyncPublisher.wants_resync` now and
then, so an engine that comes back while no step runs still gets the policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from torch import nn

from broker.registry import read_registry
from common.config import SharedConfig
from common.versioning import may_announce
from weight_sync.config import WeightSyncConfig
from weight_sync.sender import WeightSender, sync_weights

log = logging.getLogger("streamrl.learner.publish")


@dataclass
class Publication:
    """What one ``publish`` did (rank 0's is the one that counts): ``announce`` when the version may be announced
    in Redis (every engine in the pool has it, and at least one does), and the sync's metrics."""

    announce: bool
    metrics: dict[str, float] = field(default_factory=dict)


class VersionOnlyPublisher:
    """No engines to update (tests of the learner alone, or engines that reload from the HF export): the
    learner's Redis version announcement is the whole publication."""

    def publish(self, model: nn.Module, version: int, initial: bool) -> Publication:
        return Publication(announce=True)

    def before_train(self) -> None:
        pass

    def after_train(self, model: nn.Module, version: int) -> None:
        pass

    def wants_resync(self) -> bool:
        return False

    def close(self) -> None:
        pass


def registry_engines(redis_url: str, shared: SharedConfig) -> Callable[[], list[tuple[str, int]]]:
    """Engines listed in the fleet's registry (broker.registry) that are not dead or stopped, as (url, ranks)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)

    def read() -> list[tuple[str, int]]:
        alive = [e for e in read_registry(client, shared) if e.health not in ("dead", "stopped")]
        return sorted((e.url.rstrip("/"), e.ranks) for e in alive)

    return read


class WeightSyncPublisher:
    """Broadcast new weights to the engines over SGLang's update protocol (weight_sync)."""

    def __init__(
        self,
        config: WeightSyncConfig,
        engines: Callable[[], list[tuple[str, int]]] | None,
        is_main: bool,
        wait_for_engines_s: float = 120.0,
        api_key: str | None = None,
    ) -> None:
        self.config = config
        self.engines = engines
        self.sender: WeightSender | None = None
        self._sleep_seconds = 0.0  # the latest before_train's pause and release
        if is_main and engines is not None:
            members = self._wait_for_engines(wait_for_engines_s)
            self.sender = WeightSender(members, config, api_key)
            failed = self.sender.connect()
            if failed:
                log.error("engines quarantined while building the update group: %s", failed)

    def _wait_for_engines(self, wait_s: float) -> list[tuple[str, int]]:
        assert self.engines is not None
        deadline = time.monotonic() + wait_s
        while True:
            members = self.engines()
            if members or time.monotonic() > deadline:
                return members
            time.sleep(0.5)

    def _refresh_membership(self) -> None:
        if self.sender is None or self.engines is None:
            return
        current = sorted(self.engines())
        known = sorted((e.url, e.ranks) for e in self.sender.engines)
        if current and current != known:  # the same engines in another order are no change
            log.info("engine membership changed: %s -> %s; rebuilding the update group", known, current)
            self.sender.set_engines(current)  # rebuilds the group with the engines present

    def before_train(self) -> None:
        """Colocated (``weight_sync.transport = tensor``): before a step trains, the engines pause and release
        ``weight_sync.release_memory`` (their KV pool by default), so the learner has the device to itself."""
        if self.sender is None or not self.config.sleeps:
            return
        started = time.perf_counter()
        failed = self.sender.sleep(self.config.release_memory)
        self._sleep_seconds = time.perf_counter() - started
        if failed:
            log.error("engines that could not release their memory (quarantined): %s", failed)

    def after_train(self, model: nn.Module, version: int) -> None:
        """Colocated, after a step that publishes nothing (skipped, or between two ``publish_every``): the engines
        get back what :meth:`before_train` took. Released weights are sent again (every rank gathers); else the
        memory is resumed and generation continues on the unchanged weights."""
        if not self.config.sleeps:
            return
        if "weights" in self.config.release_memory:
            self.publish(model, version, initial=False)
            return
        if self.sender is not None:
            self.sender.wake(self.config.release_memory)
            self.sender.continue_generation()

    def publish(self, model: nn.Module, version: int, initial: bool) -> Publication:
        if initial:
            return Publication(announce=True)  # engines start from the same weights, labelled "0"
        rejoined: dict[str, str] = {}
        wake_seconds = 0.0
        if self.sender is not None:
            if self.config.sleeps:  # memory back first (a no-op where it is not released: a learner restart)
                started = time.perf_counter()
                self.sender.wake(self.config.release_memory)
                wake_seconds = time.perf_counter() - started
            self._refresh_membership()
            rejoined = self.sender.rejoin()
        result = sync_weights(model, version, self.sender, lora_sync=self.config.lora_sync)
        if result is None:  # not rank 0: rank 0's publication decides
            return Publication(announce=True)
        assert self.sender is not None
        if result.engines_failed:
            log.error("weight sync v%d: engines failed: %s", version, result.engines_failed)
        pool = {e.url for e in self.sender.healthy}
        announce = may_announce(pool, result.engines_ok, known=bool(self.sender.engines))
        if not announce:
            log.error(
                "weight sync v%d reached %s of the pool %s: version not announced; the learner retries",
                version, result.engines_ok or "none", sorted(pool),
            )  # fmt: skip
        return Publication(
            announce=announce,
            metrics={
                "sync_seconds": result.seconds,
                "sync_paused_seconds": result.paused_seconds,
                "sync_bytes": float(result.bytes),
                "sync_engines_ok": float(len(result.engines_ok)),
                "sync_engines_failed": float(len(result.engines_failed)),
                "sync_engines_quarantined": float(len(result.quarantined)),
                "sync_engines_rejoined": float(len(rejoined)),
                **(
                    {"colocated_sleep_seconds": self._sleep_seconds, "colocated_wake_seconds": wake_seconds}
                    if self.config.sleeps
                    else {}
                ),
            },
        )

    def wants_resync(self) -> bool:
        """Rank 0, while no step runs: whether an engine is back (or restarted) and should get the current weights
        now rather than at the next step's sync."""
        if self.sender is None:
            return False
        back, _ = self.sender.rejoin_plan()
        return bool(back)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
