"""The verifiers adapter's environment-level checks against a real verifiers environment
(tests/vf_plugins/guess_digit.py), run by tests/test_verifiers.py in the verifiers virtualenv:
``python -m tests.vf_checks CHECK [ARGS]`` (exits 0 when it holds) or ``python -m tests.vf_checks all`` (every
check that needs no engine, results as one JSON line). Each check is plain asserts."""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from collections.abc import Awaitable, Callable

import pytest

from rollout_fleet.envs.tools import chat_observation
from rollout_fleet.envs.verifiers_env import HistoryRewritten, VerifiersTask
from rollout_fleet.model import build_tokenizer
from rollout_fleet.tasks import TaskError, get_task
from tests.guess_game import FIRST, WRONG, target_of

TOK = build_tokenizer()
PROMPT = f"<|im_start|>user\n{FIRST}<|im_end|>\n<|im_start|>assistant\n"


def guess_task(**options: object) -> VerifiersTask:
    settings = {"verifiers_taskset": "guess_digit", "train_size": 8, "heldout_size": 4, **options}
    task = get_task("verifiers", tokenizer=TOK, **settings)
    assert isinstance(task, VerifiersTask)
    return task


def observation(message: str) -> str:
    return f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"


async def rendering_and_reward() -> None:
    """The first model call is the prompt, each wrong guess's answer a user turn rendered after the model's turn,
    and the right guess ends the episode with the rubric's reward."""
    task = guess_task()
    assert await task.check() == "verifiers taskset guess_digit (12 tasks)"
    prompt = await task.prepare_prompt(task.make_prompt(2))
    assert prompt.text == PROMPT == TOK.apply_chat_template([{"role": "user", "content": FIRST}], tokenize=False,
                                                            add_generation_prompt=True)  # fmt: skip
    target = target_of(2)
    env = task.make_env(prompt)
    try:
        assert await env.reset() == prompt.text
        wrong = (target + 1) % 10
        first = await env.step(f"{wrong}<|im_end|>")
        message = "higher" if target > wrong else "lower"
        assert (first.done, first.reward) == (False, 0.0)
        assert (
            first.observation
            == observation(message)
            == chat_observation(TOK, [{"role": "user", "content": message}])
        )
        assert env.history[-1] == {"role": "user", "content": message}
        right = await env.step(f"it is {target}<|im_end|>")
        assert right.done and right.reward == pytest.approx(1.0 + WRONG), right
        assert right.info == {"verifiers_turns": 2, "verifiers_reward/game": pytest.approx(1.0 + WRONG)}
    finally:
        await env.close()
    # held-out prompts are the tasks after the train ones
    held = task.make_env(task.make_prompt(1, "test"))
    try:
        await held.reset()
        done = await held.step(f"{target_of(9)}<|im_end|>")
        assert done.done and done.reward == 1.0
    finally:
        await held.close()


async def concurrent_episodes() -> None:
    """Episodes run concurrently on one served env, each with its own rollout and conversation; three wrong
    guesses end the game with three WRONG rewards."""
    task = guess_task()
    envs = {i: task.make_env(task.make_prompt(i)) for i in range(4)}
    alive = dict(envs)
    try:
        assert await asyncio.gather(*(e.reset() for e in envs.values())) == [PROMPT] * 4
        for step in range(3):  # every episode guesses 0, then 1, then 2
            results = await asyncio.gather(*(e.step(f"x{step}<|im_end|>") for e in alive.values()))
            for i, result in zip(list(alive), results, strict=True):
                target = target_of(i)
                if target == step:
                    assert result.done and result.reward == pytest.approx(1.0 + step * WRONG), (i, result)
                elif step < 2:
                    assert not result.done, (i, result)
                    assert result.observation == observation("higher" if target > step else "lower")
                else:
                    assert result.done and result.reward == pytest.approx(3 * WRONG), (i, result)
                if result.done:
                    del alive[i]
        assert not alive
    finally:
        for e in envs.values():
            await e.close()
    assert not task.runner().client.routes  # every finished or closed episode unregistered its trace


async def history_rewrite_is_refused() -> None:
    """A harness that edits its earlier replies (as a compacting one does) makes the next step raise."""
    task = guess_task(
        verifiers_config={"player": {"harness": {"id": "guess_digit", "rewrite_history": True}}}
    )
    env = task.make_env(task.make_prompt(0))
    try:
        assert await env.reset() == PROMPT
        guess = (target_of(0) + 1) % 10
        with pytest.raises(HistoryRewritten, match=r"rewrote the conversation at message 1 \(assistant\): "
                                                    rf"'{guess}' became '\(compacted\)'"):  # fmt: skip
            await env.step(f"{guess}<|im_end|>")
    finally:
        await env.close()


async def tool_calls_round_trip() -> None:
    """With the harness's calculator declared, the prompt carries the tool, a ``<tool_call>`` block becomes the
    assistant's tool call, the harness's result comes back as a tool message, and the rubric counts only the
    replies that call no tool."""
    task = guess_task(verifiers_config={"player": {"harness": {"id": "guess_digit", "calculator": True}}})
    env = task.make_env(task.make_prompt(4))
    try:
        prompt = await env.reset()
        assert env.tools and env.tools[0]["function"]["name"] == "calc"
        assert prompt == TOK.apply_chat_template([{"role": "user", "content": FIRST}], tools=env.tools,
                                                 tokenize=False, add_generation_prompt=True)  # fmt: skip
        call = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'
        result = await env.step(f"let me add {call}<|im_end|>")
        assistant, tool = env.history[-2:]
        assert (
            assistant["content"] == "let me add" and assistant["tool_calls"][0]["function"]["name"] == "calc"
        )
        assert tool["role"] == "tool" and tool["content"] == "5" and tool["tool_call_id"] == "call_0"
        assert not result.done and result.observation == chat_observation(TOK, [tool], env.tools)
        bad = await env.step(
            "<tool_call>{not json}</tool_call><|im_end|>"
        )  # not a call: a guess with no digit
        assert bad.observation == chat_observation(TOK, [{"role": "user", "content": "no digit"}], env.tools)
        done = await env.step(f"{target_of(4)}<|im_end|>")
        assert done.done and done.reward == pytest.approx(1.0 + WRONG), done
    finally:
        await env.close()


async def close_cancels_the_rollout() -> None:
    """An episode that streamrl ends early (EOS, a budget) is closed mid-rollout: the rollout is cancelled,
    its trace unregistered, and the next episode of the same task runs."""
    task = guess_task()
    env = task.make_env(task.make_prompt(3))
    await env.reset()
    runner = task.runner()
    channel = env.channel
    assert list(runner.client.routes) == channel.trace_ids and len(channel.trace_ids) == 1
    await env.close()
    assert channel.runner is None and not runner.client.routes
    again = task.make_env(task.make_prompt(3))
    try:
        assert await again.reset() == PROMPT
        assert (await again.step(f"{target_of(3)}<|im_end|>")).reward == 1.0
    finally:
        await again.close()


async def bad_configs_are_task_errors() -> None:
    with pytest.raises(TaskError, match="cannot load taskset 'no_such_taskset'"):
        await get_task("verifiers", verifiers_taskset="no_such_taskset").check()
    with pytest.raises(TaskError, match="has 64 tasks, train_size \\+ heldout_size = 100"):
        await guess_task(train_size=90, heldout_size=10).check()


async def heldout_evaluation(engine_url: str, model_dir: str) -> None:
    """The evaluator runs held-out verifiers episodes through the same runner against the engine at
    ``engine_url``; their greedy score is the rubric's reward (the task's verifier gives 0), recomputed here
    from each greedy transcript's guesses."""
    import re
    from pathlib import Path

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
    from rollout_fleet.tasks.config import build_task, task_config
    from tests.guess_game import replay
    from tests.test_rollout_worker import configs

    observation_re = re.compile(
        r"\n<\|im_start\|>user\n(?:higher|lower|no digit)<\|im_end\|>\n<\|im_start\|>assistant\n"
    )
    config = EvalConfig(every_versions=2, heldout_prompts=4, max_new_tokens=96, concurrency=4, poll_s=0.05)
    task_section = task_config(
        name="tests.vf_worker:OneTokenTurns", verifiers_taskset="guess_digit", train_size=8, heldout_size=4
    )
    _, _, rollout = configs(Path(model_dir), [engine_url], task=task_section)
    tokenizer = load_tokenizer(Path(model_dir))
    task = build_task(rollout.task, tokenizer)
    expected = []
    async with aiohttp.ClientSession() as http:
        client = EngineClient(http, engine_url, 30.0, 30.0)
        for i in range(4):
            prompt = task.make_prompt(i, "test")
            ((text, _, env),) = await _answers(
                client, tokenizer, prompt, SamplingConfig(temperature=0.0), 96, 1, task
            )
            guesses = observation_re.split(text)
            ended_by_model = guesses[-1].endswith("<|endoftext|>")
            expected.append(0.0 if ended_by_model else replay(target_of(task.train_size + i), guesses)[1])
            assert env == pytest.approx(expected[-1]), (text, env)
    async with reward_pool(rollout) as pool:
        result = await evaluate_through_engines(
            [engine_url], task, tokenizer, config, (), Scoring(eval_reward(rollout, config), pool), 30.0
        )
    assert result.n == 4 and any(expected), expected
    assert result.details["greedy_reward"] == pytest.approx(sum(expected) / 4)


CHECKS: dict[str, Callable[..., Awaitable[None]]] = {
    f.__name__: f
    for f in (
        rendering_and_reward,
        concurrent_episodes,
        history_rewrite_is_refused,
        tool_calls_round_trip,
        close_cancels_the_rollout,
        bad_configs_are_task_errors,
        heldout_evaluation,
    )
}

ENV_CHECKS = [name for name in CHECKS if name != "heldout_evaluation"]  # the ones that need no engine


def run_all() -> dict[str, str]:
    """Every engine-free check, each on its own event loop in this one process (one interpreter start for
    all): name -> "ok" or its traceback."""
    results = {}
    for name in ENV_CHECKS:
        try:
            asyncio.run(CHECKS[name]())
            results[name] = "ok"
        except (Exception, pytest.fail.Exception):  # noqa: BLE001 - reported per check to the test that asked
            results[name] = traceback.format_exc()
    return results


if __name__ == "__main__":
    if sys.argv[1] == "all":
        print(json.dumps(run_all()))
    else:
        asyncio.run(CHECKS[sys.argv[1]](*sys.argv[2:]))
        print("ok", sys.argv[1])
