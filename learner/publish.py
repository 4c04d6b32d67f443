"""Publishers: how the learner makes new weights visible to the rollout fleet.

Every learner rank calls ``publish`` (all of them take part in the FSDP2 gathers); only rank 0 holds a
``WeightSender`` and talks to engines. The trainer announces the new version in Redis after ``publish``
returns, i.e. after every engine in the pool confirmed the update (engines that failed were quarantined and
left the pool; they come back from the next Hugging Face export).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import redis
from torch import nn

from broker.config import SharedConfig
from weight_sync.config import WeightSyncConfig
from weight_sync.sender import WeightSender, sync_weights

log = logging.getLogger("streamrl.learner.publish")


class VersionOnlyPublisher:
    """No engines to update (tests of the learner alone, or engines that reload from the HF export): the
    learner's Redis version announcement is the whole publication."""

    def publish(self, model: nn.Module, version: int, initial: bool) -> dict[str, float]:
        return {}

    def after_export(self, export_dir: Path, version: int) -> None:
        pass

    def close(self) -> None:
        pass


def registry_engines(redis_url: str, shared: SharedConfig) -> Callable[[], list[tuple[str, int]]]:
    """Engines listed in the fleet's registry (``shared.key("engines")``, docs/rollout.md) that are not dead or
    stopped, as (url, ranks); read without importing the rollout fleet."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    key = shared.key("engines")

    def read() -> list[tuple[str, int]]:
        entries = [json.loads(raw) for raw in client.hvals(key)]
        alive = [e for e in entries if e.get("health") not in ("dead", "stopped")]
        return sorted((e["url"].rstrip("/"), int(e.get("ranks", 1))) for e in alive)

    return read


class WeightSyncPublisher:
    """Broadcast new weights to the engines over SGLang's update protocol (weight_sync)."""

    def __init__(
        self,
        config: WeightSyncConfig,
        engines: Callable[[], list[tuple[str, int]]] | None,
        is_main: bool,
        wait_for_engines_s: float = 120.0,
    ) -> None:
        self.config = config
        self.engines = engines
        self.sender: WeightSender | None = None
        if is_main and engines is not None:
            members = self._wait_for_engines(wait_for_engines_s)
            self.sender = WeightSender(members, config)
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
        current = self.engines()
        known = sorted((e.url, e.ranks) for e in self.sender.engines)
        if current and current != known:
            log.info("engine membership changed: %s -> %s; rebuilding the update group", known, current)
            self.sender.set_engines(current)  # rebuilds the group with the engines present

    def publish(self, model: nn.Module, version: int, initial: bool) -> dict[str, float]:
        if initial:
            return {}  # engines start from the same weights, labelled "0"
        self._refresh_membership()
        result = sync_weights(model, version, self.sender)
        if result is None:
            return {}
        if result.engines_failed:
            log.error("weight sync v%d: engines failed and left the pool: %s", version, result.engines_failed)
        return {
            "sync_seconds": result.seconds,
            "sync_paused_seconds": result.paused_seconds,
            "sync_bytes": float(result.bytes),
            "sync_engines_ok": float(len(result.engines_ok)),
            "sync_engines_failed": float(len(result.engines_failed)),
        }

    def after_export(self, export_dir: Path, version: int) -> None:
        """Bring quarantined engines back from a fresh Hugging Face export of ``version``'s weights."""
        if self.sender is None:
            return
        for url in list(self.sender.quarantined):
            ok = self.sender.recover(url, str(export_dir), str(version), wait_s=5.0)
            log.info("recovery of %s from %s: %s", url, export_dir, "ok" if ok else "still quarantined")

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
