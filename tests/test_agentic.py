"""Multi-turn rollouts: the episode runner on its own, the worker running episodes against a real engine and a
real Redis (records of schema v2, token-in/token-out across turns, masks, versions), the learner training on
them unchanged, and the built-in calculator task's environment and verifier."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from learner.attention import register_packed_attention
from learner.config import LearnerConfig
from learner.intake import drop_reason
from learner.step import train_step
from learner.trainer import build_sequences, plan_step_inputs
from rollout_fleet.envs.base import StepResult
from rollout_fleet.envs.episode import EpisodeBudgets, TurnOutput, run_episode
from rollout_fleet.envs.tools import ToolCallError, calculate, parse_tool_call, tool_observation
from rollout_fleet.model import build_tokenizer
from rollout_fleet.tasks import TEST, TRAIN, get_task
from rollout_fleet.tasks.config import task_config
from tests.agentic_tasks import EchoEnv
from tests.test_rollout_worker import (
    configs,
    model_dir,
    read_records,
    reference_logprobs,
    run_worker,
    serving,
)

pytestmark = pytest.mark.timeout(120)
__all__ = ["model_dir"]  # the module fixture, shared


# -- the episode runner on its own ---------------------------------------------------------------------------


def _scripted(turns: list[tuple[list[int], int, str]]):  # noqa: ANN202
    """generate_turn answering turn k with turns[k] = (tokens, version, finish), recording its inputs."""
    seen: list[tuple[list[int], int]] = []

    async def generate(input_ids: list[int], budget: int, k: int) -> TurnOutput:
        seen.append((list(input_ids), budget))
        tokens, version, finish = turns[k]
        return TurnOutput(tokens, [-0.5] * len(tokens), [version] * len(tokens), finish, "e0")

    return generate, seen


def _encode(text: str) -> list[int]:
    return [100 + ord(c) % 50 for c in text]


def _decode(ids: list[int]) -> str:
    return "".join(chr(48 + i % 10) for i in ids)


async def test_an_episode_is_one_sequence_with_masked_observations_and_turn_versions() -> None:
    env = EchoEnv(prompt=None, observations=1, bump_url="")  # type: ignore[arg-type]
    generate, seen = _scripted([([1, 2, 3], 4, "stop"), ([5, 6], 5, "stop")])
    budgets = EpisodeBudgets(max_turns=4, max_total_tokens=100, max_tokens_per_turn=10)
    ep = await run_episode(env, [7, 8], generate, _encode, _decode, budgets)
    obs = _encode("<|im_start|>tool\nok 1<|im_end|>\n")
    assert ep.tokens == [1, 2, 3, *obs, 5, 6]
    assert ep.loss_mask == [1, 1, 1] + [0] * len(obs) + [1, 1]
    assert ep.logprobs == [-0.5] * 3 + [0.0] * len(obs) + [-0.5] * 2
    assert ep.versions == [4] * 3 + [4] * len(obs) + [5, 5]  # observations carry the causing turn's version
    assert ep.turn_bounds == [0, 3, 3 + len(obs), 5 + len(obs)]
    # turn 2 was prompted with the prompt, turn 1's ids and the observation's ids: nothing re-tokenised
    assert seen == [([7, 8], 10), ([7, 8, 1, 2, 3, *obs], 10)]
    assert (ep.end, ep.finish_reason, ep.truncated, ep.env_reward) == ("done", "stop", False, 0.5)
    assert ep.stats() == {"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0,
                          "observation_tokens": float(len(obs)), "env_reward": 0.5}  # fmt: skip


@pytest.mark.parametrize(
    ("budgets", "turns", "end", "n_turns"),
    [
        (EpisodeBudgets(2, 1000, 10), [([1], 0, "stop")] * 3, "max_turns", 2),
        (EpisodeBudgets(8, 1000, 3), [([1, 2, 3], 0, "length")], "turn_length", 1),
        (
            EpisodeBudgets(8, 30, 10),
            [([1] * 10, 0, "stop")] * 3,
            "max_total_tokens",
            1,
        ),  # the obs would not fit
        (EpisodeBudgets(8, 1000, 10), [([1, 9], 0, "stop")], "eos", 1),  # 9 is EOS: no step, episode over
    ],
)
async def test_budgets_end_episodes_truncated_with_a_model_turn_last(budgets, turns, end, n_turns) -> None:  # noqa: ANN001
    env = EchoEnv(prompt=None, observations=100, bump_url="")  # type: ignore[arg-type]
    generate, seen = _scripted(turns)
    ep = await run_episode(env, [7], generate, _encode, _decode, budgets, eos_token_ids=(9,))
    assert (ep.end, len(ep.turns)) == (end, n_turns)
    assert ep.truncated == (end != "eos") and ep.finish_reason == ("stop" if end == "eos" else "length")
    assert ep.turn_bounds[-1] == len(ep.tokens) <= budgets.max_total_tokens
    assert all(b <= budgets.max_tokens_per_turn for _, b in seen)


# -- the worker: episodes against a real engine and Redis -----------------------------------------------------


@pytest.mark.parametrize("batch", [True, False])
async def test_the_worker_writes_multi_turn_records_token_in_token_out(
    redis_url: str, model_dir: Path, batch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tok = build_tokenizer()
    with serving(model_dir) as srv:
        monkeypatch.setenv("ECHO_BUMP_URL", srv.url)  # a weight version change after the first turn
        shared, engine, rollout = configs(
            model_dir, [srv.url], group_size=2, max_new_tokens=64, max_tokens_per_turn=4,
            task=task_config(name="tests.agentic_tasks:EchoTask", train_size=3), batch_group_requests=batch,
        )  # fmt: skip
        stats = await run_worker(redis_url, shared, engine, rollout)
    groups = await read_records(redis_url, shared)
    assert stats.finished and len(groups) == 3 and stats.episodes == 6
    obs = {
        k: tok(f"<|im_start|>tool\nok {k}<|im_end|>\n", add_special_tokens=False)["input_ids"] for k in (1, 2)
    }
    three_turns = changed = 0
    for g in groups:
        assert g.schema_version == 2
        for s in g.samples:
            turns = s.turns()
            assert s.episode["turns"] == len(turns) and turns[0][0] == 0 and turns[-1][1] == s.num_tokens()
            ids = [int(t) for t in s.output_ids]
            for k, ((_, end), (start, _)) in enumerate(zip(turns, turns[1:], strict=False), start=1):
                assert ids[end:start] == obs[k], (
                    tok.decode(ids),
                    ids,
                    turns,
                    obs[k],
                )  # the observation's ids, between the turns
                assert not s.loss_mask[end:start].any() and not s.logprobs[end:start].any()
                assert (s.versions[end:start] == s.versions[end - 1]).all()
            for start, end in turns:
                assert s.loss_mask[start:end].all()
            assert (np.diff(s.versions) >= 0).all()
            changed += int(s.versions[0] == 0 and s.versions[-1] == 1)  # the update between its turns shows
            if len(turns) == 3:
                three_turns += 1
                assert s.episode["tool_calls"] == 2 and s.episode["tool_errors"] == 1
                assert s.reward == s.reward_components["correct"] + 0.5 and s.reward_components["env"] == 0.5
            # every model token's log-prob is the engine's given the whole sequence before it (teacher-forced)
            ref = reference_logprobs(hf, list(g.prompt_ids), ids)
            model_tokens = s.loss_mask.astype(bool)
            np.testing.assert_allclose(s.logprobs[model_tokens], ref[model_tokens], atol=1e-4)
    assert changed >= 1
    assert three_turns >= 4  # the untrained model ends a turn with EOS only now and then
    assert stats.turns == sum(s.episode["turns"] for g in groups for s in g.samples)

    # The learner takes them unchanged: staleness by the oldest token, packing, and a loss step where the masked
    # observation tokens carry no gradient (changing their log-probs changes nothing).
    assert drop_reason(groups[0], learner_version=1, eta=0, drop_zero_signal=False) is not None
    assert drop_reason(groups[0], learner_version=1, eta=1, drop_zero_signal=False) is None
    config = LearnerConfig(world_size=1, groups_per_step=3, micro_batch_tokens=256, max_grad_norm=1e9)
    updated = []
    for perturb in (False, True):
        gs = copy.deepcopy(groups)
        if perturb:
            for g in gs:
                for s in g.samples:
                    s.logprobs = np.where(s.loss_mask.astype(bool), s.logprobs, -7.0).astype(np.float32)
        seqs, temps = build_sequences(gs, config)
        plan = plan_step_inputs(seqs, temps, config, 1)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation=register_packed_attention()
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        result = train_step(
            model, optimizer, plan.micro_batches[0], plan.temperatures[0], config, plan.normaliser, 1
        )
        assert result.applied
        updated.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(updated[0], torch.cat([p.detach().flatten() for p in hf.parameters()]))
    torch.testing.assert_close(updated[0], updated[1], rtol=0, atol=0)


# -- the calculator task --------------------------------------------------------------------------------------


async def test_the_calculator_environment_answers_tool_calls_and_errors() -> None:
    tok = build_tokenizer()
    task = get_task("tool_arithmetic", tokenizer=tok)
    prompt = next(p for p in (task.make_prompt(i) for i in range(50)) if p.metadata["needs_tool"])
    a, b = prompt.metadata["a"], prompt.metadata["b"]
    env = task.make_env(prompt)
    assert await env.reset() == prompt.text
    call = await env.step(f"<calc>{a}*{b}</calc><|im_end|>")
    assert (call.done, call.info["tool_status"]) == (False, "ok")
    assert call.observation == f"\n<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n"
    bad = await env.step("<calc>__import__('os')</calc><|im_end|>")
    assert bad.info["tool_status"] == "error" and "error: calc: only integers" in bad.observation
    assert (await env.step(f"#{a * b}<|im_end|>")).done
    transcript = f"<calc>{a}*{b}</calc><|im_end|>" + call.observation + f"#{a * b}<|im_end|>"
    assert task.score(prompt, transcript).components == {"correct": 1.0, "format": 1.0}
    assert task.score(prompt, transcript.replace(f"#{a * b}", f"#{a * b + 1}")).components["correct"] == 0.0
    # a tool result is not the model's answer: only the last turn counts
    assert (
        task.score(prompt, f"<calc>{a}*{b}</calc><|im_end|>" + call.observation).components["correct"] == 0.0
    )


def test_calculator_task_splits_are_disjoint_and_some_need_the_tool() -> None:
    task = get_task("tool_arithmetic", heldout_size=200)
    key = lambda p: tuple(sorted((p.metadata["a"], p.metadata["b"])))  # noqa: E731
    train = {key(task.make_prompt(i, TRAIN)) for i in range(2000)}
    test = [task.make_prompt(i, TEST) for i in range(200)]
    assert not train & {key(p) for p in test}
    share = sum(p.metadata["needs_tool"] for p in test) / len(test)
    assert 0.25 < share < 0.55 and {task.difficulty(p) for p in test} == {"needs_tool", "direct"}


def test_tool_calls_parse_in_both_formats_and_the_calculator_runs_no_code() -> None:
    assert parse_tool_call("think <calc>1+2</calc>", "tags").argument == "1+2"
    assert parse_tool_call("#12", "tags") is None
    hermes = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    assert (parse_tool_call(hermes, "hermes").name, parse_tool_call(hermes, "hermes").argument) == (
        "python",
        "print(1)",
    )
    with pytest.raises(ToolCallError, match="not JSON"):
        parse_tool_call("<tool_call>{nope</tool_call>", "hermes")
    assert calculate("(12+3)*4 - 7 // 2") == "57"
    for bad in ("2**100000", "open('x')", "1/0", "9" * 40 + "*" + "9" * 40):
        with pytest.raises(ToolCallError):
            calculate(bad)
    assert (
        tool_observation(build_tokenizer(), "5") == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )


def test_step_result_defaults() -> None:
    assert StepResult() == StepResult(observation="", reward=0.0, done=False, info={}, observation_ids=None)
    assert asyncio.iscoroutinefunction(EchoEnv.step)


async def test_held_out_evaluation_runs_multi_turn_tasks_as_episodes(model_dir: Path) -> None:
    """The evaluator runs an environment task's held-out prompts through the same episode runner: each answer
    it scores is a whole transcript (turns and observations), not a single generation."""
    from rollout_fleet.config import EvalConfig
    from rollout_fleet.evaluator import (
        Scoring,
        eval_reward,
        evaluate_through_engines,
        reward_pool,
    )
    from rollout_fleet.model import load_tokenizer
    from rollout_fleet.tasks.config import build_task

    config = EvalConfig(every_versions=2, heldout_prompts=3, max_new_tokens=32, concurrency=4, poll_s=0.05)
    with serving(model_dir) as srv:
        _, _, rollout = configs(model_dir, [srv.url], task=task_config(name="tests.agentic_tasks:EchoTask"))
        tokenizer = load_tokenizer(model_dir)
        task = build_task(rollout.task, tokenizer)
        async with reward_pool(rollout) as pool:
            before = srv.engine.stats()["finished_requests"]
            result = await evaluate_through_engines(
                [srv.url], task, tokenizer, config, (), Scoring(eval_reward(rollout, config), pool), 30.0
            )
            requests = srv.engine.stats()["finished_requests"] - before
    assert result.n == 3
    # 3 greedy + 3 sampled episodes of up to 3 turns each, one request per turn (EOS may end one early)
    assert 6 < requests <= 18


async def test_python_tool_calls_run_in_the_sandbox_and_escapes_come_back_as_tool_errors(
    tmp_path: Path,
) -> None:
    """A <python> call of the calculator task runs in a fresh sandbox process (rollout_fleet.sandbox, tested in
    depth in test_sandbox.py): its output is the observation, and a fork bomb or a socket is a tool error the
    model sees while the episode goes on."""
    from rollout_fleet.sandbox import SandboxConfig

    task = get_task("tool_arithmetic", tokenizer=build_tokenizer())
    task.sandbox = SandboxConfig(timeout_s=5.0, cpu_time_s=5)
    env = task.make_env(task.make_prompt(0))
    await env.reset()
    ok = await env.step("<python>print(6 * 7)</python><|im_end|>")
    assert (ok.done, ok.info["tool"], ok.info["tool_status"]) == (False, "python", "ok")
    assert "\n<|im_start|>tool\n42<|im_end|>\n" in ok.observation
    bomb = await env.step("<python>import os\nwhile True: os.fork()</python><|im_end|>")
    assert bomb.info["tool_status"] != "ok" and "error:" in bomb.observation and not bomb.done
    sock = await env.step(
        "<python>import socket\nsocket.create_connection(('127.0.0.1', 1), timeout=1)</python><|im_end|>"
    )
    assert sock.info["tool_status"] == "error" and "error:" in sock.observation
    task.sandbox = None  # without a sandbox the python tool is refused, never run in this process
    off = await task.make_env(task.make_prompt(0)).step("<python>print(1)</python><|im_end|>")
    assert off.info["tool_status"] == "error" and "not enabled" in off.observation
