"""The live status line of ``streamrl up`` and the totals of its summary, read from the run's Redis."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from broker.client import BrokerKeys, connect
from broker.metrics import RUN_INFO_KEY, metrics_key
from broker.outcomes import audit
from common.discovery import RedisNotFound, resolve_redis_url
from common.numbers import parse_number
from streamrl.config import StreamRLConfig
from streamrl.summary import LAST_GREEDY, LAST_SAMPLED, LAST_VERSION, LAST_VERSION_MAX


def _numbers(fields: dict[bytes, bytes]) -> dict[str, float]:
    """The numeric fields of a metrics point (as floats)."""
    parsed = {k.decode(): parse_number(v) for k, v in fields.items()}
    return {k: float(v) for k, v in parsed.items() if not isinstance(v, str)}


class StatusReader:
    """Reads the latest learner, rollout and eval points and the stream backlog (synchronous client)."""

    def __init__(self, config: StreamRLConfig) -> None:
        self.config = config
        self.keys = BrokerKeys.of(config.shared, config.broker)
        self._client: redis.Redis | None = None

    @property
    def client(self) -> redis.Redis | None:
        if self._client is None:
            try:
                url = resolve_redis_url(self.config.shared)
            except RedisNotFound:
                return None
            self._client = redis.Redis.from_url(url, socket_timeout=5)
        return self._client

    def latest(self, role: str) -> dict[str, float]:
        if self.client is None:
            return {}
        rows = self.client.xrevrange(metrics_key(self.config.shared, role), count=1)
        return _numbers(rows[0][1]) if rows else {}

    def rollout_totals(self) -> dict[str, float]:
        """Sum of the latest point of every rollout worker (each writes its own role stream)."""
        if self.client is None:
            return {}
        total: dict[str, float] = {}
        for key in self.client.scan_iter(metrics_key(self.config.shared, "rollout*")):
            rows = self.client.xrevrange(key, count=1)
            for k, v in (_numbers(rows[0][1]) if rows else {}).items():
                total[k] = total.get(k, 0.0) + v
        return total

    def archive_totals(self) -> dict[str, float] | None:
        """The archiver's counters as it last wrote them (groups, rows, parts, bytes, waiting, its CPU seconds
        ``cpu_s``); None when no archiver ran."""
        if self.client is None:
            return None
        fields = self.client.hgetall(self.keys.archive_status)
        return _numbers(fields) if fields else None

    def backlog(self) -> int:
        if self.client is None:
            return 0
        return int(self.client.get(self.keys.backlog) or 0)

    def snapshot(self) -> dict[str, Any]:
        try:
            return {
                "learner": self.latest("learner"),
                "eval": self.latest("eval"),
                "rollout": self.rollout_totals(),
                "backlog": self.backlog(),
            }
        except redis.RedisError:
            return {}

    def ticker(self, interval_s: float) -> Callable[[], None]:
        """An on_tick callback for the supervisor that prints a status line every ``interval_s``."""
        last = [0.0]

        def tick() -> None:
            if time.monotonic() - last[0] < interval_s:
                return
            last[0] = time.monotonic()
            snap = self.snapshot()
            if snap:
                print(format_status(snap), file=sys.stdout, flush=True)

        return tick

    def final_totals(self) -> dict[str, Any]:
        try:
            learner = self.latest("learner")
        except (redis.RedisError, OSError):
            learner = {}
        dropped = {
            k.split("/", 1)[1]: int(v)
            for k, v in learner.items()
            if k.startswith("samples/") and k != "samples/trained"
        }
        try:
            first = (
                self.client.hget(self.config.shared.key(RUN_INFO_KEY), "first_request_at")
                if self.client
                else None
            )
        except (redis.RedisError, OSError):
            first = None
        try:
            rollout = self.rollout_totals()
        except (redis.RedisError, OSError):
            rollout = {}
        try:
            archive = self.archive_totals()  # read once the archiver stopped: its last part included
        except (redis.RedisError, OSError):
            archive = None
        return {
            **self.learner_aggregates(),
            "episodes": episode_totals(rollout),
            "archive": archive,
            "audit": self.audit(),
            **self.best_evaluation(),
            **self.last_evaluation(),
            "published_version": self.published_version(),
            "first_request_at": float(first) if first else None,
            "steps": int(learner.get("step", 0)),
            "policy_version": int(learner.get("policy_version", 0)),
            "samples_trained": int(learner.get("samples/trained", 0)),
            "samples_dropped": sum(dropped.values()),
            "samples_dropped_by_reason": dropped,
        }

    def audit(self) -> dict[str, Any] | None:
        """``streamrl audit``'s figures for the run (broker.outcomes), None when Redis does not answer."""
        try:
            url = resolve_redis_url(self.config.shared)
        except RedisNotFound:
            return None

        async def run() -> dict[str, Any]:
            client = connect(url, self.config.broker)
            try:
                return (await audit(client, self.config.shared, self.config.broker)).as_dict()
            finally:
                await client.aclose()

        try:
            return asyncio.run(run())
        except (redis.RedisError, OSError):
            return None

    def best_evaluation(self) -> dict[str, float | None]:
        """The run's best held-out greedy accuracy among its evaluations of trained policies (version > 0: the
        live evaluator's and the final one), the version it was of, and how many such evaluations there were
        (the live ones run on a clock: a loaded machine makes fewer). A run that learned and then fell shows it
        here beside ``eval_greedy_accuracy_after``."""
        try:
            rows = self.client.xrange(metrics_key(self.config.shared, "eval")) if self.client else []
        except (redis.RedisError, OSError):
            rows = []
        points = [p for p in (_numbers(f) for _, f in rows) if p.get("policy_version", 0) > 0]
        points = [p for p in points if "greedy_accuracy" in p]
        if not points:
            return {"eval_best_greedy": None, "eval_best_version": None, "eval_trained_count": 0}
        best = max(points, key=lambda p: p["greedy_accuracy"])
        return {
            "eval_best_greedy": best["greedy_accuracy"],
            "eval_best_version": best["policy_version"],
            "eval_trained_count": len(points),
        }

    def last_evaluation(self) -> dict[str, float | None]:
        """The run's newest held-out evaluation (``summary.LAST_*``): its greedy and sampled accuracy and the
        lowest and highest policy version its answers came from; Nones when there was none."""
        none: dict[str, float | None] = dict.fromkeys(
            (LAST_GREEDY, LAST_SAMPLED, LAST_VERSION, LAST_VERSION_MAX)
        )
        try:
            rows = (
                self.client.xrevrange(metrics_key(self.config.shared, "eval"), count=50)
                if self.client
                else []
            )
        except (redis.RedisError, OSError):
            return none
        points = [
            p for p in (_numbers(f) for _, f in rows) if "greedy_accuracy" in p and "policy_version" in p
        ]
        if not points:
            return none
        last = points[0]
        return {
            LAST_GREEDY: last["greedy_accuracy"],
            LAST_SAMPLED: last.get("sampled_accuracy"),
            LAST_VERSION: last["policy_version"],
            LAST_VERSION_MAX: last.get("policy_version_max", last["policy_version"]),
        }

    def published_version(self) -> int | None:
        """The policy version the learner last announced (the final policy once it stopped); None when none."""
        try:
            raw = self.client.get(self.keys.version) if self.client else None
        except (redis.RedisError, OSError):
            return None
        return None if raw is None else int(raw)

    def learner_aggregates(self) -> dict[str, float]:
        """Sums over every learner step of the run: time waiting for data (generation, when synchronous), time
        training, the token-weighted mean staleness, the mean output length of the samples taken and how many of
        them were cut at the output budget."""
        try:
            rows = self.client.xrange(metrics_key(self.config.shared, "learner")) if self.client else []
        except (redis.RedisError, OSError):
            rows = []
        points = [_numbers(fields) for _, fields in rows]
        wait = sum(p.get("wait_seconds", 0.0) for p in points)
        step = sum(p.get("step_seconds", 0.0) for p in points)
        tokens = sum(p.get("staleness/tokens", 0.0) for p in points)
        stale = sum(p.get("staleness/mean", 0.0) * p.get("staleness/tokens", 0.0) for p in points)
        samples = sum(p.get("samples", 0.0) for p in points)
        outputs = sum(p.get("output_tokens", 0.0) for p in points)
        truncated = sum(p.get("truncated_fraction", 0.0) * p.get("samples", 0.0) for p in points)
        return {
            "learner_wait_seconds": wait,
            "learner_train_seconds": step - wait,
            "mean_staleness": stale / tokens if tokens else 0.0,
            # output lengths of the samples the steps took (long-output tasks: how long the rollouts ran)
            "mean_output_tokens": outputs / samples if samples else 0.0,
            "truncated_samples": round(truncated),
        }

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def episode_totals(rollout: dict[str, float]) -> dict[str, Any] | None:
    """The rollout workers' multi-turn counters summed (None for a single-turn run): episodes, turns and tool
    calls per episode, tool errors, observation tokens and why episodes ended."""
    episodes = rollout.get("episodes", 0.0)
    if not episodes:
        return None
    return {
        "episodes": int(episodes),
        "turns_per_episode": rollout.get("turns", 0.0) / episodes,
        "tool_calls": int(rollout.get("tool_calls", 0.0)),
        "tool_errors": int(rollout.get("tool_errors", 0.0)),
        "observation_tokens": int(rollout.get("observation_tokens", 0.0)),
        "ends": {k.split("/", 1)[1]: int(v) for k, v in rollout.items() if k.startswith("episode_end/")},
    }


def format_status(snap: dict[str, Any]) -> str:
    learner, ev, rollout = snap.get("learner", {}), snap.get("eval", {}), snap.get("rollout", {})

    def f(d: dict[str, float], key: str, fmt: str = "{:.3f}") -> str:
        return fmt.format(d[key]) if key in d else "-"

    return (
        f"step {f(learner, 'step', '{:.0f}')} | version {f(learner, 'policy_version', '{:.0f}')} | "
        f"reward {f(learner, 'reward_mean')} | held-out {f(ev, 'greedy_accuracy')} greedy, "
        f"{f(ev, 'sampled_accuracy')} sampled (v{f(ev, 'policy_version', '{:.0f}')}) | "
        f"staleness {f(learner, 'staleness/mean', '{:.2f}')} (max {f(learner, 'staleness/max', '{:.0f}')}) | "
        f"gen {f(rollout, 'tokens_per_s', '{:.0f}')} tok/s, "
        f"train {f(learner, 'trained_tokens_per_s', '{:.0f}')} tok/s | backlog {snap.get('backlog', 0)}"
        + _episode_status(rollout)
    )


def _episode_status(rollout: dict[str, float]) -> str:
    """`` | 1.8 turns/episode, 0.8 tool calls (2% failed)`` for a multi-turn run, empty otherwise."""
    e = episode_totals(rollout)
    if e is None:
        return ""
    failed = e["tool_errors"] / e["tool_calls"] if e["tool_calls"] else 0.0
    return (
        f" | {e['turns_per_episode']:.2f} turns/episode, {e['tool_calls'] / e['episodes']:.2f} tool calls "
        f"({100 * failed:.0f}% failed)"
    )
