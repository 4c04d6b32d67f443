"""Reward failures inside a running worker: a verifier that hangs and one that raises end up as the samples'
reward_status, every group is still produced, and the worker does not stall.

This module stays light at import time (the reward worker processes import it to find ``flaky``); the engine
and worker helpers are imported inside the test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rollout_fleet.tasks import Prompt

pytestmark = pytest.mark.timeout(120)


def flaky(prompt: Prompt, completion: str) -> dict[str, float]:
    """Prompt 0 hangs, prompt 1 raises, the others score with two components."""
    if prompt.index == 0:
        time.sleep(3600)
    if prompt.index == 1:
        raise RuntimeError(f"verifier exploded on {prompt.prompt_id}")
    return {"reward": 0.5, "length": float(len(completion)), "one": 1.0}


async def test_a_hanging_and_a_raising_verifier_become_reward_statuses(
    redis_url: str, tmp_path: Path
) -> None:
    from rollout_fleet.model import init_tiny_model
    from rollout_fleet.tasks.config import RewardConfig, task_config
    from tests.test_rollout_worker import configs, read_records, run_worker, serving

    model_dir = init_tiny_model(tmp_path / "tiny")
    with serving(model_dir) as srv:
        shared, engine, rollout = configs(
            model_dir,
            [srv.url],
            group_size=2,
            task=task_config(name="arithmetic", train_size=4),
            reward=RewardConfig(function="tests.test_rollout_rewards:flaky", workers=2, timeout_s=1.0),
        )
        stats = await run_worker(redis_url, shared, engine, rollout)
    assert stats.finished and stats.groups_produced == 4
    assert stats.reward_status == {"timeout": 2, "error": 2, "ok": 4}
    by_prompt = {g.prompt_index: g for g in await read_records(redis_url, shared)}
    assert sorted(by_prompt) == [0, 1, 2, 3]
    for s in by_prompt[0].samples:
        assert (s.reward_status, s.reward, s.reward_components) == ("timeout", 0.0, {})
        assert "ran past 1.0 s" in s.reward_error
    for s in by_prompt[1].samples:
        assert (s.reward_status, s.reward) == ("error", 0.0)
        assert "RuntimeError: verifier exploded on arithmetic/0/train/1" in s.reward_error
    for index in (2, 3):
        for s in by_prompt[index].samples:
            assert (s.reward_status, s.reward, s.reward_error) == ("ok", 0.5, "")
            assert s.reward_components == {"length": float(s.reward_components["length"]), "one": 1.0}
            assert s.reward_components["length"] > 0
