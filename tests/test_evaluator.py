"""The live evaluator against a real built-in engine and a real Redis: it skips weights that were already
evaluated (``streamrl up``'s baseline) and evaluates each version that advanced by ``every_versions``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from broker.client import connect
from broker.config import BrokerConfig
from broker.metrics import MetricsReader, MetricsWriter
from broker.version import PolicyVersion
from common.config import SharedConfig
from rollout_fleet.config import EvalConfig
from rollout_fleet.evaluator import (
    Scoring,
    eval_reward,
    evaluator_loop,
    last_evaluated_version,
    reward_pool,
)
from rollout_fleet.model import init_tiny_model
from streamrl.config import StreamRLConfig
from streamrl.up import child_specs
from tests.test_rollout_worker import configs, serving

EVAL = EvalConfig(every_versions=2, heldout_prompts=4, max_new_tokens=8, concurrency=8, poll_s=0.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("evaluator") / "tiny")


async def wait_for(predicate, timeout_s: float = 60.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_evaluator_skips_the_baseline_and_evaluates_new_versions(
    model_dir: Path, redis_url: str
) -> None:
    with serving(model_dir) as server:
        shared, _, rollout = configs(model_dir, [server.url])
        shared = SharedConfig(**{**shared.model_dump(), "redis_url": redis_url})
        client = connect(redis_url)
        reader = MetricsReader(client, shared)
        versions = PolicyVersion(client, shared, BrokerConfig())
        assert await last_evaluated_version(reader) is None
        await versions.publish(0)
        # what `streamrl up` writes after its baseline evaluation of version 0
        await MetricsWriter(client, shared, "eval").write({"greedy_accuracy": 0.5, "policy_version": 0.0})
        assert await last_evaluated_version(reader) == 0

        stop = asyncio.Event()
        loop = asyncio.create_task(evaluator_loop(shared, BrokerConfig(), rollout, EVAL, stop))
        served_before = server.engine.stats()["finished_requests"]
        await asyncio.sleep(1.0)  # twenty polls of version 0
        assert len(await reader.read("eval")) == 1
        assert server.engine.stats()["finished_requests"] == served_before  # the engine was not asked

        await versions.publish(1)  # below every_versions: still nothing
        await asyncio.sleep(0.5)
        assert len(await reader.read("eval")) == 1

        server.engine.set_weight_version("2")
        await versions.publish(2)
        await wait_for(lambda: _count(reader, 2))
        latest = await reader.latest("eval")
        assert latest is not None and latest["policy_version"] == 2 and latest["n"] == 4
        assert server.engine.stats()["finished_requests"] == served_before + 2 * 4  # greedy + sampled
        stop.set()
        await asyncio.wait_for(loop, 30)
        await client.aclose()


async def _count(reader: MetricsReader, n: int) -> bool:
    return len(await reader.read("eval")) >= n


def test_every_versions_0_leaves_the_live_evaluator_out_of_up(tmp_path: Path) -> None:
    def roles(every: int) -> list[str]:
        cfg = StreamRLConfig.model_validate({"eval": {"every_versions": every}})
        cfg.shared.run_dir = tmp_path
        cfg.rollout.engine_urls = ["http://127.0.0.1:1"]
        before, after = child_specs(cfg, tmp_path / "config.toml")
        return [s.name for stage in before + after for s in stage]

    assert "eval" in roles(5)
    assert "eval" not in roles(0)


async def test_only_engines_serving_the_version_are_evaluated(model_dir: Path) -> None:
    """One engine restarted on its initial weights (version 0), the other serves version 3: an evaluation of
    version 3 runs on the second alone and records 3; asking for version 4 is refused, never answered with 0."""
    from rollout_fleet.evaluator import NoEngineAtVersion, evaluate_through_engines
    from rollout_fleet.tasks.config import build_task

    with serving(model_dir) as stale, serving(model_dir) as current:
        current.engine.set_weight_version("3")
        shared, _, rollout = configs(model_dir, [stale.url, current.url])
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        task = build_task(rollout.task, tokenizer)
        before = [s.engine.stats()["finished_requests"] for s in (stale, current)]
        async with reward_pool(rollout) as pool:
            scoring = Scoring(eval_reward(rollout, EVAL), pool)
            urls = [stale.url, current.url]
            result = await evaluate_through_engines(
                urls, task, tokenizer, EVAL, (), scoring, 30.0, min_version=3
            )
            after = [s.engine.stats()["finished_requests"] for s in (stale, current)]
            assert (result.version, result.max_version, result.engines) == (3, 3, 1)
            assert after[0] == before[0] and after[1] == before[1] + 2 * EVAL.heldout_prompts
            with pytest.raises(NoEngineAtVersion, match="version 4"):
                await evaluate_through_engines(urls, task, tokenizer, EVAL, (), scoring, 30.0, min_version=4)


async def test_a_generation_may_outlast_the_control_timeout(model_dir: Path) -> None:
    """A held-out answer of thousands of tokens takes minutes on a CPU: the /generate calls get their own
    timeout (rollout.request_timeout_s in the evaluator), not the short one of the control calls. Here the
    engine is paused for 3 s, longer than the 1 s control timeout, and the evaluation still completes."""
    import aiohttp
    from transformers import AutoTokenizer

    from rollout_fleet.evaluator import evaluate_through_engines
    from rollout_fleet.tasks.config import build_task

    with serving(model_dir) as srv:
        _, _, rollout = configs(model_dir, [srv.url])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        task = build_task(rollout.task, tokenizer)
        async with aiohttp.ClientSession() as http:
            paused = await http.post(srv.url + "/pause_generation", json={"mode": "in_place"})
            assert paused.status == 200

            async def resume_later() -> None:
                await asyncio.sleep(3.0)
                await http.post(srv.url + "/continue_generation", json={})

            resumer = asyncio.create_task(resume_later())
            async with reward_pool(rollout) as pool:
                scoring = Scoring(eval_reward(rollout, EVAL), pool)
                result = await evaluate_through_engines(
                    [srv.url], task, tokenizer, EVAL, (), scoring, 1.0, generate_timeout_s=60.0
                )
            await resumer
    assert result.engines == 1 and srv.engine.stats()["finished_requests"] >= 2 * EVAL.heldout_prompts


def test_a_final_evaluation_of_another_version_is_flagged_in_the_summary(
    model_dir: Path, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`streamrl up`'s final evaluation asks for the final policy; when no engine serves it (here: the engine is
    at 3, the run at 5) it evaluates what is served, warns, and summary.json says it is not the final policy."""
    from streamrl.up import evaluate_now, format_summary, is_of_version, write_summary

    with serving(model_dir) as engine:
        engine.engine.set_weight_version("3")
        cfg = StreamRLConfig.model_validate(
            {
                "shared": {"redis_url": redis_url, "run_dir": str(tmp_path), "model_path": str(model_dir)},
                "rollout": {"engine_urls": [engine.url], "task": {"name": "arithmetic", "train_size": 8}},
                "eval": {"heldout_prompts": 4, "max_new_tokens": 8},
            }
        )
        current = evaluate_now(cfg, "after", 3)
        stale = evaluate_now(cfg, "after", 5)
    assert is_of_version(current) is True and current["policy_version"] == 3
    assert is_of_version(stale) is False and stale["version_asked"] == 5 and stale["policy_version"] == 3
    assert "should be of policy version 5" in capsys.readouterr().err
    write_summary(cfg, {"eval_before": current, "eval_after": stale}, 0.0, {})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_after_is_final_policy"] is False and summary["final_policy_version"] == 5
    # accuracies are named for what they hold (the greedy one was eval_reward_*, which is not a reward)
    assert (summary["eval_greedy_accuracy_before"], summary["eval_greedy_accuracy_after"]) == (
        current["greedy_accuracy"],
        stale["greedy_accuracy"],
    )
    assert (
        summary["eval_sampled_accuracy_after"] == stale["sampled_accuracy"]
        and "eval_reward_after" not in summary
    )
    assert "NOT the final policy 5" in format_summary(summary)
    # pass@k over rollout.group_size (8) samples per prompt, and the arithmetic task's digit buckets
    assert list(summary["eval_pass_at_k_after"]) == ["1", "2", "4", "8"] and stale["samples_per_prompt"] == 8
    passes = list(summary["eval_pass_at_k_after"].values())
    assert passes == sorted(passes) and passes[0] == pytest.approx(stale["sampled_accuracy"])  # pass@1: c / n
    buckets = summary["eval_buckets_after"]
    assert buckets and all(b.startswith("digits=") for b in buckets)
    assert sum(b["n"] for b in buckets.values()) == 4 and "pass@k after: @1" in format_summary(summary)
    assert summary["eval_reward"] == {"source": "training", "scorer": "arithmetic"}


USER_REWARD = '''
import multiprocessing


def reward(prompt, completion):
    """A new user's lenient reward: the answer anywhere in the completion, else a little credit for trying."""
    hit = prompt.answer in completion
    in_pool = float(multiprocessing.current_process().name == "streamrl-reward")
    return {"reward": 1.0 if hit else 0.25, "hit": float(hit), "in_pool": in_pool}
'''


def test_held_out_scoring_uses_the_custom_training_reward(
    model_dir: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a new user hit it: JSONL rows of {"prompt", "answer"}, the dataset task, a ten-line reward function as
    rollout.reward.function. The held-out evaluation scores with that function, in the reward pool's processes
    (not with the task's exact-match verifier, which gives the random tiny model 0), with its components, and
    says so in the eval metrics and summary.json; eval.reward = task goes back to the verifier, and says so."""
    from streamrl.up import evaluate_now, write_summary

    (tmp_path / "user_reward.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned reward workers start with this sys.path
    rows = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:8]) + "\n")
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[8:]) + "\n")
    with serving(model_dir) as engine:

        def evaluate(reward: str) -> dict[str, float]:
            cfg = StreamRLConfig.model_validate(
                {
                    "shared": {"redis_url": redis_url, "run_dir": str(tmp_path), "model_path": str(model_dir)},
                    "rollout": {
                        "engine_urls": [engine.url],
                        "group_size": 4,
                        "task": {"name": "dataset", "dataset": str(tmp_path / "train.jsonl"),
                                 "test_dataset": str(tmp_path / "test.jsonl")},
                        "reward": {"function": "user_reward:reward", "start_method": "spawn", "workers": 1},
                    },
                    "eval": {"heldout_prompts": 4, "max_new_tokens": 8, "reward": reward},
                }
            )  # fmt: skip
            return cfg, evaluate_now(cfg, "after", 0)

        cfg, trained = evaluate("training")
        _, verifier = evaluate("task")
    # every answer got at least 0.25 from the user's function (no `correct` component: solved = reward > 0)
    assert trained["greedy_accuracy"] == trained["sampled_accuracy"] == trained["pass@4"] == 1.0
    assert trained["greedy_reward"] >= 0.25 and trained["greedy_component/in_pool"] == 1.0
    assert trained["reward_source/training"] == 1.0 and trained["samples_per_prompt"] == 4
    assert trained["reward_errors"] == 0 and set(trained) >= {"pass@1", "pass@2", "pass@4"}
    # the task's exact-match verifier: the random model never says exactly "16"
    assert verifier["greedy_accuracy"] == 0.0 and verifier["reward_source/task"] == 1.0
    assert "greedy_component/correct" in verifier and "greedy_component/in_pool" not in verifier
    write_summary(cfg, {"eval_before": verifier, "eval_after": trained}, 0.0, {})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_reward"] == {"source": "training", "scorer": "user_reward:reward"}
    assert summary["eval_pass_at_k_after"] == {"1": 1.0, "2": 1.0, "4": 1.0}
    assert summary["eval_buckets_after"] == {}  # the dataset task has no difficulty buckets
