"""The summary of a run stopped before its final evaluation (SIGTERM): built from the eval records a real Redis
holds, it names the last evaluated version and the final one, and never passes the last number off as "after"."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from broker.config import BrokerConfig
from broker.version import PolicyVersion
from streamrl.config import SharedConfig, StreamRLConfig
from streamrl.status import StatusReader
from streamrl.summary import GREEDY_AFTER, LAST_GREEDY, LAST_IS_FINAL, LAST_VERSION
from streamrl.up import format_summary, summary_record, write_summary
from tests.test_status import write_evals


def publish(url: str, shared: SharedConfig, version: int) -> None:
    async def run() -> None:
        client = aioredis.Redis.from_url(url)
        await PolicyVersion(client, shared, BrokerConfig()).publish(version)
        await client.aclose()

    asyncio.run(run())


BEFORE = {
    "greedy_accuracy": 0.485,
    "sampled_accuracy": 0.30,
    "policy_version": 0.0,
    "policy_version_max": 0.0,
}


def test_a_stopped_run_reports_its_last_evaluation_and_says_it_is_not_the_final_policy(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    shared = SharedConfig(run_id="stopped", redis_url=redis_url, run_dir=tmp_path)
    cfg = StreamRLConfig(shared=shared)
    reader = StatusReader(cfg)
    # stopped before any live evaluation: only up's baseline (v0) was scored
    write_evals(redis_url, shared, [BEFORE])
    publish(redis_url, shared, 7)
    early = summary_record(cfg, {"eval_before": BEFORE}, 0.0, reader.final_totals())
    assert (
        "48.5% (v0) -> n/a (no evaluation after it; the final policy is v7, not evaluated)"
        in format_summary(early)
    )
    # the live evaluator scored v1265 (and an engine still at v1264 answered part of v1264's), then SIGTERM at v1295
    write_evals(redis_url, shared, [
        {"greedy_accuracy": 0.86, "sampled_accuracy": 0.7, "policy_version": 1264, "policy_version_max": 1264},
        {"greedy_accuracy": 0.805, "sampled_accuracy": 0.6, "policy_version": 1265, "policy_version_max": 1265},
    ])  # fmt: skip
    publish(redis_url, shared, 1295)
    write_summary(cfg, {"eval_before": BEFORE}, 0.0, reader.final_totals())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[GREEDY_AFTER] is None  # no number is labelled "after": none is of the final policy
    assert (summary[LAST_GREEDY], summary[LAST_VERSION], summary["final_policy_version"]) == (
        0.805,
        1265,
        1295,
    )
    assert summary[LAST_IS_FINAL] is False
    out = capsys.readouterr().out
    assert (
        "held-out accuracy (greedy): 48.5% (v0) -> 80.5% (v1265, last evaluation; the final policy is v1295, "
        "not evaluated)" in out
    )
    assert "held-out accuracy (sampled): 30.0% (v0) -> 60.0% (v1265, last evaluation;" in out
    # the last evaluation of the final policy is said to be of it
    totals = {**reader.final_totals(), "published_version": 1265}
    reader.close()
    summary = summary_record(cfg, {"eval_before": BEFORE}, 0.0, totals)
    assert summary[LAST_IS_FINAL] is True
    assert "-> 80.5% (v1265, last evaluation: the final policy)" in format_summary(summary)
