"""The dashboard's held-out evaluation panel in headless Chromium: the latest evaluation's pass@k, accuracy per
difficulty bucket (in bucket order: digits=2 before digits=10) and the reward that scored it, exactly as the
evaluator wrote them to ``metrics:eval``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from broker.client import connect
from broker.config import BrokerConfig
from broker.metrics import MetricsWriter
from common.config import SharedConfig
from streamrl.config import DashboardConfig
from streamrl.dashboard import start_dashboard
from tests.dashboard_page import chromium, wait_for

pytestmark = pytest.mark.timeout(90)

BROKER = BrokerConfig(block_ms=20, retry_attempts=2, socket_timeout_s=2)
DASH = DashboardConfig(refresh_s=0.3, history_points=500, probe_timeout_s=1.0)
READ_EVAL = """
const rows = (sel) => [...document.querySelectorAll(sel)].map(tr => [...tr.cells].map(c => c.textContent));
return {passk: rows('#eval-passk tbody tr'), buckets: rows('#eval-buckets tbody tr'),
        reward: document.getElementById('eval-reward').textContent};
"""
POINT = {  # what the evaluator writes after an evaluation of the arithmetic task with 4 samples per prompt
    "greedy_accuracy": 0.5, "sampled_accuracy": 0.375, "policy_version": 7.0, "n": 8.0,
    "pass@1": 0.375, "pass@2": 0.5, "pass@4": 0.625, "reward_source/training": 1.0,
    "bucket/greedy/digits=10": 0.0, "bucket/sampled/digits=10": 0.25, "bucket/n/digits=10": 2.0,
    "bucket/greedy/digits=2": 0.75, "bucket/sampled/digits=2": 0.5, "bucket/n/digits=2": 4.0,
    "bucket/greedy/digits=1": 0.5, "bucket/sampled/digits=1": 0.25, "bucket/n/digits=1": 2.0,
}  # fmt: skip


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


async def test_eval_panel_shows_pass_at_k_buckets_and_the_reward(browser: Any, redis_url: str) -> None:
    shared = SharedConfig(run_id="eval-panel")
    client = connect(redis_url, BROKER)
    await MetricsWriter(client, shared, "eval").write({"greedy_accuracy": 0.1, "policy_version": 0.0})
    await MetricsWriter(client, shared, "eval").write(POINT)
    running = await start_dashboard(client, shared, DASH, BROKER, port=0)
    try:
        await asyncio.to_thread(browser.get, running.url)
        await asyncio.to_thread(wait_for, browser, lambda s: s["ready"], "the first poll")
        shown = await asyncio.to_thread(browser.execute_script, READ_EVAL)
    finally:
        await running.stop()
        await client.aclose()
    assert shown["passk"] == [["pass@1", "0.375"], ["pass@2", "0.5"], ["pass@4", "0.625"]]
    assert shown["buckets"] == [
        ["digits=1", "0.5", "0.25", "2"],
        ["digits=2", "0.75", "0.5", "4"],
        ["digits=10", "0", "0.25", "2"],
    ]
    assert shown["reward"] == "(scored with the training reward)"
