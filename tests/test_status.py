"""StatusReader's summary figures, read from a real Redis the way `streamrl up` writes them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from broker.metrics import MetricsWriter
from streamrl.config import SharedConfig, StreamRLConfig
from streamrl.status import StatusReader


def write_evals(url: str, shared: SharedConfig, points: list[dict[str, float]]) -> None:
    async def write() -> None:
        client = aioredis.Redis.from_url(url)
        writer = MetricsWriter(client, shared, "eval")
        for point in points:
            await writer.write(point)
        await client.aclose()

    asyncio.run(write())


def test_best_evaluation_is_the_best_trained_policy_and_its_version(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    shared = SharedConfig(run_id="best", redis_url=redis_url, run_dir=tmp_path)
    reader = StatusReader(StreamRLConfig(shared=shared))
    assert reader.best_evaluation() == {
        "eval_best_greedy": None,
        "eval_best_version": None,
        "eval_trained_count": 0,
    }
    write_evals(redis_url, shared, [
        {"policy_version": 0, "greedy_accuracy": 0.9},  # the warm start is not a trained policy
        {"policy_version": 5, "greedy_accuracy": 0.5},
        {"policy_version": 10, "greedy_accuracy": 0.65},
        {"policy_version": 15, "sampled_accuracy": 0.99},  # a point without greedy accuracy does not count
        {"policy_version": 20, "greedy_accuracy": 0.55},  # a late fall: the best stays version 10's
    ])  # fmt: skip
    assert reader.best_evaluation() == {
        "eval_best_greedy": 0.65,
        "eval_best_version": 10.0,
        "eval_trained_count": 3,
    }
    assert reader.final_totals()["eval_best_greedy"] == 0.65  # what summary.json is built from
