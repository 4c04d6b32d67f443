"""The OpenEnv adapter end to end: a real OpenEnv environment server process (openenv-core's ``create_app``,
tests/openenv_guess.py), episodes run by the real worker against a real built-in engine and a real Redis, and
the records' turn bounds, masks, observation ids and rewards checked against the environment's own logic."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from rollout_fleet.envs.openenv import OpenEnvTask
from rollout_fleet.envs.tools import tool_observation
from rollout_fleet.model import build_tokenizer
from rollout_fleet.tasks import TaskError, get_task
from rollout_fleet.tasks.config import task_config
from tests.openenv_guess import FIRST, MAX_STEPS, WRONG, OneTokenTurns, answer, target_of
from tests.test_rollout_worker import configs, model_dir, read_drops, read_records, run_worker, serving

pytestmark = pytest.mark.timeout(180)
__all__ = ["model_dir"]  # the module fixture, shared
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    """A real OpenEnv server process on a free port (uvicorn), stopped after the module."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.openenv_guess", str(port)],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the OpenEnv server exited"
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the OpenEnv server did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


async def test_the_environment_speaks_openenv_and_renders_turns_with_the_chat_template(env_url: str) -> None:
    tok = build_tokenizer()
    task = get_task("openenv", env_url=env_url, train_size=5, env_observation_field="message", tokenizer=tok)
    assert await task.check() == f"OpenEnv server at {env_url}"
    prompt = await task.prepare_prompt(task.make_prompt(2))
    assert prompt.text == f"<|im_start|>user\n{FIRST}<|im_end|>\n<|im_start|>assistant\n"
    target = target_of(prompt.metadata["reset_seed"])
    env = task.make_env(prompt)
    try:
        assert await env.reset() == prompt.text  # the same seed, the same first observation
        wrong = (target + 1) % 10
        first = await env.step(f"{wrong}<|im_end|>")
        message = "higher" if target > wrong else "lower"
        assert (first.done, first.reward) == (False, WRONG)
        assert first.observation == tool_observation(tok, message, role="user")
        assert first.observation == f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
        right = await env.step(f"it is {target}<|im_end|>")
        assert (right.done, right.reward) == (True, 1.0)
    finally:
        await env.close()
    # sessions are separate: two environments at once keep their own targets and step counts
    a, b = task.make_env(prompt), task.make_env(task.make_prompt(3))
    try:
        await a.reset(), await b.reset()
        assert (await a.step("x")).observation.count("no digit") == 1
        assert not (await b.step("x")).done and (await a.step("y")).done is False
    finally:
        await a.close(), await b.close()


async def test_bad_urls_are_clear_errors_at_start() -> None:
    for bad in ("localhost:8000", "ftp://host", "http://", "http://h:notaport"):
        with pytest.raises(TaskError, match="env_url"):
            get_task("openenv", env_url=bad)
    with pytest.raises(TaskError, match="env_url: Field required"):
        get_task("openenv")
    task = get_task("openenv", env_url=f"http://127.0.0.1:{_free_port()}", env_timeout_s=2.0)
    with pytest.raises(TaskError, match="no OpenEnv server at env_url"):
        await task.check()


async def test_a_worker_with_an_unreachable_env_url_fails_at_start(redis_url: str, model_dir: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    shared, engine, rollout = configs(
        model_dir, ["http://127.0.0.1:1"], task=task_config(name="openenv", env_url=url, env_timeout_s=2.0)
    )
    with pytest.raises(TaskError, match=f"no OpenEnv server at env_url = '{url}'"):
        await run_worker(redis_url, shared, engine, rollout)


async def test_the_worker_runs_openenv_episodes_token_in_token_out(
    redis_url: str, model_dir: Path, env_url: str
) -> None:
    tok = build_tokenizer()
    with serving(model_dir) as srv:
        shared, engine, rollout = configs(
            model_dir, [srv.url], group_size=2, max_new_tokens=64, max_tokens_per_turn=4, temperature=1.0,
            task=task_config(name="tests.openenv_guess:OneTokenTurns", env_url=env_url, train_size=4,
                            env_observation_field="message"),
        )  # fmt: skip
        stats = await run_worker(redis_url, shared, engine, rollout)
    groups = await read_records(redis_url, shared)
    assert stats.finished and len(groups) == 4 and not await read_drops(redis_url, shared)
    task = OpenEnvTask(env_url=env_url, train_size=4)
    eos = tok.eos_token_id
    multi_turn = 0
    for g in groups:
        assert g.schema_version == 2
        prompt_text = f"<|im_start|>user\n{FIRST}<|im_end|>\n<|im_start|>assistant\n"
        assert list(g.prompt_ids) == tok(prompt_text, add_special_tokens=False)["input_ids"]
        target = target_of(task.reset_seed("train", g.prompt_index))
        for s in g.samples:
            ids = [int(t) for t in s.output_ids]
            turns = s.turns()
            assert turns[0][0] == 0 and turns[-1][1] == len(ids) == s.num_tokens()
            reward, step = 0.0, 0
            for k, (start, end) in enumerate(turns):
                assert s.loss_mask[start:end].all()
                action = tok.decode(ids[start:end], skip_special_tokens=False)
                if ids[end - 1] == eos:  # the model ended the episode itself: no step
                    assert k == len(turns) - 1
                    break
                step += 1
                message, r, done = answer(target, action, step)
                reward += r
                if k + 1 < len(turns):  # the observation between this turn and the next: the env's answer
                    nxt = turns[k + 1][0]
                    expected = tok(tool_observation(tok, message, "user"), add_special_tokens=False)[
                        "input_ids"
                    ]
                    assert ids[end:nxt] == expected, (action, tok.decode(ids[end:nxt]))
                    assert not s.loss_mask[end:nxt].any() and not s.logprobs[end:nxt].any()
                    assert (s.versions[end:nxt] == s.versions[end - 1]).all()
                    assert not done
                else:
                    assert done or len(turns) == rollout.max_turns or s.truncated
            assert step <= MAX_STEPS
            assert s.reward == pytest.approx(reward) and s.episode["env_reward"] == pytest.approx(reward)
            assert s.reward_components.get("env", 0.0) == pytest.approx(reward)
            assert s.episode["turns"] == len(turns)
            multi_turn += len(turns) >= 2
            assert (np.diff(s.versions) >= 0).all()
    assert multi_turn >= 4  # most episodes take several turns (3 guesses unless one is right)
    assert stats.turns == sum(s.episode["turns"] for g in groups for s in g.samples)


async def test_held_out_evaluation_scores_openenv_episodes_with_the_environment_rewards(
    model_dir: Path, env_url: str
) -> None:
    """The evaluator runs held-out OpenEnv episodes through the same runner, and their score is the
    environment's rewards (the task's verifier gives 0): recomputed here from each greedy transcript's actions."""
    import aiohttp

    from rollout_fleet.config import EvalConfig
    from rollout_fleet.evaluator import (
        Scoring,
        _answers,
        eval_reward,
        evaluate_through_engines,
        reward_pool,
    )
    from rollout_fleet.generate_client import EngineClient, SamplingConfig
    from rollout_fleet.model import load_tokenizer
    from rollout_fleet.tasks.config import build_task

    obs = re.compile(
        r"\n<\|im_start\|>user\n(?:higher|lower|no digit)<\|im_end\|>\n<\|im_start\|>assistant\n"
    )
    config = EvalConfig(every_versions=2, heldout_prompts=4, max_new_tokens=160, concurrency=4, poll_s=0.05)
    task_section = task_config(
        name="tests.openenv_guess:OneTokenTurns",
        env_url=env_url,
        heldout_size=4,
        env_observation_field="message",
    )
    with serving(model_dir) as srv:
        _, _, rollout = configs(model_dir, [srv.url], task=task_section)
        tokenizer = load_tokenizer(model_dir)
        task = build_task(rollout.task, tokenizer)
        assert isinstance(task, OneTokenTurns)
        expected = []
        async with aiohttp.ClientSession() as http:
            client = EngineClient(http, srv.url, 30.0, 30.0)
            for i in range(4):
                prompt = task.make_prompt(i, "test")
                ((text, _, env),) = await _answers(
                    client, tokenizer, prompt, SamplingConfig(temperature=0.0), 160, 1, task
                )
                target = target_of(prompt.metadata["reset_seed"])
                actions = obs.split(text)
                stepped = actions if not actions[-1].endswith("<|endoftext|>") else actions[:-1]
                replayed = [answer(target, a, k) for k, a in enumerate(stepped, start=1)]
                assert all(not done for _, _, done in replayed[:-1])
                expected.append(sum(r for _, r, _ in replayed))
                assert env == pytest.approx(expected[-1]) and env != 0.0
        async with reward_pool(rollout) as pool:
            result = await evaluate_through_engines(
                [srv.url], task, tokenizer, config, (), Scoring(eval_reward(rollout, config), pool), 30.0
            )
    assert result.n == 4
    assert result.details["greedy_reward"] == pytest.approx(sum(expected) / 4)
    assert result.greedy_accuracy == pytest.approx(sum(e > 0 for e in expected) / 4)
