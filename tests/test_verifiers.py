"""The verifiers adapter end to end. verifiers 0.4.0 pins ``mcp==2.0.0`` and ``openai<3``, which the main dev
environment cannot hold beside openenv-core, so its side runs in a second virtualenv (`.venv-verifiers`, the
Makefile's `verifiers-venv` target, which `make test` builds): a real verifiers environment
(tests/vf_plugins/guess_digit.py, built with verifiers' Taskset / Task / Env / Harness classes) driven by the
adapter's checks (tests/vf_checks.py) and by a real rollout worker process (tests/vf_worker.py) against a real
built-in engine and Redis started here; the records are checked against the game's rules from this side."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from common.config import SharedConfig
from rollout_fleet.envs.tools import chat_observation
from rollout_fleet.model import build_tokenizer
from rollout_fleet.tasks import TaskError, get_task
from tests.guess_game import FIRST, MAX_STEPS, answer, replay, target_of
from tests.test_rollout_worker import model_dir, read_drops, read_records, serving

pytestmark = pytest.mark.timeout(240)
__all__ = ["model_dir"]  # the module fixture, shared
ROOT = Path(__file__).resolve().parents[1]
VF_PYTHON = ROOT / os.environ.get("VERIFIERS_VENV", ".venv-verifiers") / "bin" / "python"


async def run_in_verifiers_venv(*args: str, timeout: float = 180.0) -> str:
    """``python -m ARGS`` in the verifiers virtualenv with the repository and the test plugins importable; its
    stdout, or a failure with both streams."""
    if not VF_PYTHON.exists():
        pytest.fail(f"{VF_PYTHON} is missing: build it with `make verifiers-venv` (`make test` does)")
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'vf_plugins'}",
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    proc = await asyncio.create_subprocess_exec(
        str(VF_PYTHON), "-m", *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{out.decode()}\n{err.decode()[-4000:]}"
    return out.decode()


ENV_CHECKS = [
    "rendering_and_reward",
    "concurrent_episodes",
    "history_rewrite_is_refused",
    "tool_calls_round_trip",
    "close_cancels_the_rollout",
    "bad_configs_are_task_errors",
]


@pytest.fixture(scope="module")
def env_checks() -> dict[str, str]:
    """tests/vf_checks.py's engine-free checks, run once in one verifiers-venv process: name -> ok or traceback."""
    out = asyncio.run(run_in_verifiers_venv("tests.vf_checks", "all"))
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("check", ENV_CHECKS)
def test_the_adapter_runs_a_verifiers_environment(env_checks: dict[str, str], check: str) -> None:
    assert sorted(env_checks) == sorted(ENV_CHECKS)
    assert env_checks[check] == "ok", env_checks[check]


async def test_held_out_evaluation_scores_verifiers_episodes_with_the_rubric(model_dir: Path) -> None:
    with serving(model_dir) as srv:
        out = await run_in_verifiers_venv("tests.vf_checks", "heldout_evaluation", srv.url, str(model_dir))
    assert out.strip().endswith("ok heldout_evaluation")


async def test_without_verifiers_the_task_says_how_to_install_it() -> None:
    """The main environment has no verifiers: the task builds (reward processes import it) and says what to
    install when it is used."""
    with pytest.raises(TaskError, match="verifiers_taskset: Field required"):
        get_task("verifiers")
    task = get_task("verifiers", verifiers_taskset="guess_digit", tokenizer=build_tokenizer())
    assert task.score(task.make_prompt(0), "anything").reward == 0.0
    with pytest.raises(TaskError, match=r"pip install 'streamrl\[verifiers\]'"):
        await task.check()


async def run_vf_worker(model_dir: Path, redis_url: str, **task: object) -> dict:
    """A rollout worker process in the verifiers venv running the guess_digit taskset's ``task`` options
    against a built-in engine started here; its stats."""
    with serving(model_dir) as srv:
        args = {
            "model_dir": str(model_dir), "engine_url": srv.url, "redis_url": redis_url,
            "task": {"verifiers_taskset": "guess_digit", "heldout_size": 1, **task},
            "rollout": {"group_size": 2, "max_new_tokens": 96, "max_tokens_per_turn": 4, "temperature": 1.0},
        }  # fmt: skip
        out = await run_in_verifiers_venv("tests.vf_worker", json.dumps(args))
    return json.loads(out.splitlines()[-1])


async def test_a_worker_in_the_verifiers_venv_trains_on_the_engines_ids(
    redis_url: str, model_dir: Path
) -> None:
    tok = build_tokenizer()
    stats = await run_vf_worker(model_dir, redis_url, train_size=4)
    groups = await read_records(redis_url, shared(model_dir))
    assert stats["finished"] and len(groups) == 4 and not await read_drops(redis_url, shared(model_dir))
    prompt_ids = tok(
        f"<|im_start|>user\n{FIRST}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    rubric_ended = 0
    for g in groups:
        assert g.schema_version == 2 and list(g.prompt_ids) == prompt_ids["input_ids"]
        for s in g.samples:
            rubric_ended += check_sample(tok, s, target_of(g.prompt_index))
    assert rubric_ended >= 4  # most episodes end through verifiers' own env and rubric
    assert stats["turns"] == sum(s.episode["turns"] for g in groups for s in g.samples)


async def test_a_rollout_that_rewrites_history_drops_its_group_with_the_reason(
    redis_url: str, model_dir: Path
) -> None:
    """A harness that rewrites its earlier replies (tests/vf_plugins/guess_digit.py, ``rewrite_history``): the
    second model call of an episode no longer extends what the episode holds, so the worker drops the group
    (reason env_error, the message named) instead of training on a sequence verifiers never saw."""
    harness = {"id": "guess_digit", "rewrite_history": True}
    stats = await run_vf_worker(
        model_dir, redis_url, train_size=3, verifiers_config={"player": {"harness": harness}}
    )
    drops = await read_drops(redis_url, shared(model_dir))
    groups = await read_records(redis_url, shared(model_dir))
    assert stats["finished"] and len(drops) + len(groups) == 3 and drops, (drops, stats)
    for drop in drops:
        assert drop["reason"] == "env_error", drop
        assert "rewrote the conversation at message 1 (assistant)" in drop["detail"], drop
    for g in groups:  # a group kept only where no sample reached a second model call
        assert all(s.episode["turns"] == 1 for s in g.samples)


def shared(model_dir: Path) -> SharedConfig:
    """The shared config tests/vf_worker.py's worker ran with (tests/test_rollout_worker.py's configs)."""
    return SharedConfig(run_id="run", eta=100, model_path=model_dir, http_timeout_s=10.0)


def check_sample(tok: object, s: object, target: int) -> bool:
    """One record against the game: model turns masked 1, each observation the chat-template rendering of the
    environment's answer to the decoded guess (masked 0, log-prob 0, its turn's version), the reward the
    rubric's replay of the guesses when verifiers ended the episode (0 when streamrl ended it first: EOS or a
    budget, the rollout cancelled). Whether the rubric ended it."""
    ids = [int(t) for t in s.output_ids]
    turns = s.turns()
    assert turns[0][0] == 0 and turns[-1][1] == len(ids) == s.num_tokens()
    guesses = [tok.decode(ids[a:b], skip_special_tokens=False) for a, b in turns]
    messages, total = replay(target, guesses)
    for k, (start, end) in enumerate(turns):
        assert s.loss_mask[start:end].all()
        if k + 1 < len(turns):
            nxt = turns[k + 1][0]
            expected = chat_observation(tok, [{"role": "user", "content": messages[k]}])
            assert ids[end:nxt] == tok(expected, add_special_tokens=False)["input_ids"]
            assert not s.loss_mask[end:nxt].any() and not s.logprobs[end:nxt].any()
            assert (s.versions[end:nxt] == s.versions[end - 1]).all()
    assert (np.diff(s.versions) >= 0).all() and s.episode["turns"] == len(turns) <= MAX_STEPS
    last_done = answer(target, guesses[-1], len(guesses))[2]
    rubric_ended = last_done and not s.truncated and ids[-1] != tok.eos_token_id
    expected_reward = total if rubric_ended else 0.0
    assert s.reward == pytest.approx(expected_reward)
    assert s.episode["env_reward"] == pytest.approx(expected_reward)
    assert s.reward_components.get("env", 0.0) == pytest.approx(expected_reward)
    return rubric_ended
