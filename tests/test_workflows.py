"""The rollout workflows and their engine session, on their own (no lease loop, no Redis): real built-in engines
over HTTP (in-process server threads), the real reward process pool, the real tokenizer of the tiny model.

The session's retries and resubmission run against engines that are paused in abort mode, stopped mid-request,
stopped before the request, or that reject it (HTTP 400)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from rollout_fleet.dispatch import Lease
from rollout_fleet.engine.server import ServerThread
from rollout_fleet.envs.base import Environment
from rollout_fleet.generate_client import SamplingConfig
from rollout_fleet.main import training_scorer
from rollout_fleet.model import load_tokenizer
from rollout_fleet.rewards import RewardPool
from rollout_fleet.router import Router
from rollout_fleet.tasks import TRAIN, Prompt
from rollout_fleet.tasks.config import RewardConfig, build_task, task_config
from rollout_fleet.workflows import WORKFLOWS, build_workflow, workflow_kind
from rollout_fleet.workflows.abandon import DROP, HAND_BACK, GroupAbandoned
from rollout_fleet.workflows.base import WorkflowContext
from rollout_fleet.workflows.multi_turn import EpisodeWorkflow
from rollout_fleet.workflows.session import EngineSession, Generation
from rollout_fleet.workflows.single_turn import SingleTurnWorkflow
from rollout_fleet.workflows.stats import WorkerStats
from tests.agentic_tasks import EchoEnv, EchoTask
from tests.test_rollout_worker import StepGate, configs, hf, model_dir, reference_logprobs, serving

__all__ = ["hf", "model_dir"]  # module fixtures shared with test_rollout_worker

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)


# -- helpers ----------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def routing(urls: list[str], no_engine_timeout_s: float = 10.0) -> AsyncIterator[Router]:
    """A router over ``urls``, every engine taken as healthy (no health checks run: a failed one stays out)."""
    async with aiohttp.ClientSession() as http:
        router = Router(
            http, None, request_timeout_s=60, control_timeout_s=5, no_engine_timeout_s=no_engine_timeout_s
        )
        for url in urls:
            router.add(url, healthy=True)
        try:
            yield router
        finally:
            await router.aclose()


def new_session(router: Router, tokenizer: Any, max_request_failures: int = 3) -> EngineSession:
    sampling = SamplingConfig(1.0, 1.0, -1, (int(tokenizer.eos_token_id),))
    return EngineSession(router, sampling, WorkerStats(), SimpleNamespace(value=0), max_request_failures)


@contextlib.contextmanager
def dead_engine(model_dir: Path) -> Iterator[str]:
    """The URL of an engine that was started and stopped: its port refuses connections."""
    with serving(model_dir) as srv:
        url = srv.url
    yield url


def rids(srv: ServerThread) -> set[str]:
    return {rid for rec in srv.engine.scheduler.step_log for rid in rec.rids}


def engine_id(srv: ServerThread) -> str:
    return srv.url.removeprefix("http://")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


@pytest.fixture
async def pool() -> AsyncIterator[RewardPool]:
    rewards = RewardPool(workers=1, timeout_s=10.0)
    await rewards.start()
    try:
        yield rewards
    finally:
        rewards.close()


def context_for(rollout: Any, tokenizer: Any, pool: RewardPool, task: Any = None) -> WorkflowContext:
    task = task if task is not None else build_task(rollout.task, tokenizer)
    return WorkflowContext(task, tokenizer, rollout, training_scorer(pool, rollout), WorkerStats())


def prompt_of(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


# -- the registry -------------------------------------------------------------------------------------------------


def test_the_task_kind_selects_the_workflow(tokenizer: Any) -> None:
    arithmetic = build_task(task_config("arithmetic", train_size=2), tokenizer)
    assert workflow_kind(arithmetic) == "single_turn" and WORKFLOWS["single_turn"] is SingleTurnWorkflow
    assert workflow_kind(EchoTask()) == "episode" and WORKFLOWS["episode"] is EpisodeWorkflow


# -- the single-turn group workflow -----------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [True, False])
async def test_the_single_turn_workflow_makes_a_group_of_the_engines_tokens_and_the_verifiers_rewards(
    model_dir: Path, tokenizer: Any, hf: torch.nn.Module, pool: RewardPool, batch: bool
) -> None:
    with serving(model_dir) as srv:
        _, _, rollout = configs(model_dir, [srv.url], group_size=3, batch_group_requests=batch)
        context = context_for(rollout, tokenizer, pool)
        async with routing([srv.url]) as router:
            workflow = build_workflow(context, router, SimpleNamespace(value=0))
            assert isinstance(workflow, SingleTurnWorkflow)
            group = await workflow.generate_group(Lease(7, 0, 2, "leased"), "g", "run", "w0")
        seen = rids(srv)
    prompt = context.task.make_prompt(2, TRAIN)
    assert (group.prompt_index, group.epoch, group.group_id, group.worker_id) == (2, 0, "g", "w0")
    assert list(group.prompt_ids) == prompt_of(tokenizer, prompt.text) and group.prompt_id == prompt.prompt_id
    assert group.extra == {"answer": str(prompt.answer)}
    for i, s in enumerate(group.samples):
        assert s.sample_index == i and f"g:s{i}:r0" in seen  # one request per sample, under its rid
        ids = [int(t) for t in s.output_ids]
        # the engine's ids and log-probs, aligned: a teacher-forced forward agrees
        np.testing.assert_allclose(s.logprobs, reference_logprobs(hf, list(group.prompt_ids), ids), atol=1e-4)
        assert (s.versions == 0).all() and (s.loss_mask == 1).all() and s.num_resubmits == 0
        expected = context.task.score(prompt, tokenizer.decode(ids, skip_special_tokens=False))
        assert (s.reward_status, s.reward) == ("ok", expected.reward)
        assert s.reward_components == expected.components
        assert set(s.timings) == {"generate_s", "requests", "reward_s"} and s.timings["requests"] == 1.0
        assert s.truncated == (s.finish_reason == "length") and 1 <= len(ids) <= rollout.max_new_tokens
    stats = context.stats
    assert (stats.requests, stats.batch_requests, stats.reward_status["ok"]) == (3, int(batch), 3)


async def test_a_training_sample_is_scored_with_its_length_and_dapos_overlong_penalty(
    model_dir: Path, tokenizer: Any, pool: RewardPool
) -> None:
    """The reward function that asks gets each sample's real length (the engine's tokens, whether it hit the
    budget, the budget), and the worker's scorer (training_scorer, as the rollout worker builds it) adds the
    overlong component: here every token past 4 of the 8-token budget costs 0.25."""
    reward = RewardConfig(
        workers=1, timeout_s=10.0, function="tests.reward_fns:length_echo", overlong_buffer=4
    )
    with serving(model_dir) as srv:
        _, _, rollout = configs(model_dir, [srv.url], group_size=4, max_new_tokens=8, reward=reward)
        context = context_for(rollout, tokenizer, pool)
        async with routing([srv.url]) as router:
            workflow = build_workflow(context, router, SimpleNamespace(value=0))
            group = await workflow.generate_group(Lease(3, 0, 1, "leased"), "g", "run", "w0")
    for s in group.samples:
        n, c = len(s.output_ids), s.reward_components
        assert (c["output_tokens"], c["max_output_tokens"], c["truncated"]) == (n, 8, float(s.truncated))
        assert c["overlong"] == pytest.approx(min(0.0, -(n - 4) / 4)) and s.reward == pytest.approx(
            1 + c["overlong"]
        )
    assert any(s.truncated for s in group.samples)  # the untrained model rarely stops within 8 tokens


# -- the multi-turn episode workflow ----------------------------------------------------------------------------


async def test_the_episode_workflow_runs_the_environment_turn_by_turn_token_in_token_out(
    model_dir: Path, tokenizer: Any, pool: RewardPool
) -> None:
    task = task_config("tests.agentic_tasks:EchoTask", train_size=2)
    with serving(model_dir) as srv:
        _, _, rollout = configs(
            model_dir, [srv.url], group_size=2, max_new_tokens=64, max_tokens_per_turn=4, task=task
        )
        context = context_for(rollout, tokenizer, pool)
        async with routing([srv.url]) as router:
            workflow = build_workflow(context, router, SimpleNamespace(value=0))
            assert isinstance(workflow, EpisodeWorkflow) and workflow.first_budget == 4
            # every printable character ends a turn: the task's turn-end tokens are stop tokens of the session
            assert set(workflow.session.sampling.stop_token_ids) >= {
                int(tokenizer.convert_tokens_to_ids("a"))
            }
            group = await workflow.generate_group(Lease(0, 0, 1, "leased"), "g", "run", "w0")
        seen = rids(srv)
    obs = {k: prompt_of(tokenizer, f"<|im_start|>tool\nok {k}<|im_end|>\n") for k in (1, 2)}
    for i, s in enumerate(group.samples):
        turns = s.turns()
        ids = [int(t) for t in s.output_ids]
        assert s.episode["turns"] == len(turns) and turns[0][0] == 0 and turns[-1][1] == len(ids)
        for k, ((_, end), (start, _)) in enumerate(zip(turns, turns[1:], strict=False), start=1):
            assert ids[end:start] == obs[k]  # the observation's own ids, appended as they are
            assert (s.loss_mask[end:start] == 0).all() and (s.logprobs[end:start] == 0.0).all()
            assert f"g:s{i}:t{k}:r0" in seen  # turn k's request
        for start, end in turns:
            assert (s.loss_mask[start:end] == 1).all()
        assert f"g:s{i}:r0" in seen
        # the environment's rewards are the component env, added to the verifier's
        assert s.reward_components.get("env", 0.0) == s.episode["env_reward"]
        assert s.reward == pytest.approx(s.reward_components["correct"] + s.episode["env_reward"])
        assert s.episode["tool_calls"] >= len(turns) - 1  # every observation answered a tool call
    stats = context.stats
    assert stats.episodes == 2 and stats.turns == sum(len(s.turns()) for s in group.samples)
    assert sum(stats.episode_ends.values()) == 2


class BrokenEnv(EchoEnv):
    closed = 0

    async def reset(self) -> str:
        raise ConnectionError("the environment server went away")

    async def close(self) -> None:
        BrokenEnv.closed += 1


class BrokenTask(EchoTask):
    def make_env(self, prompt: Prompt) -> Environment:
        return BrokenEnv(prompt, 2, "")


async def test_an_environment_that_fails_drops_the_group_and_every_environment_is_closed(
    model_dir: Path, tokenizer: Any, pool: RewardPool
) -> None:
    with serving(model_dir) as srv:
        _, _, rollout = configs(model_dir, [srv.url], group_size=2, max_new_tokens=64)
        context = context_for(rollout, tokenizer, pool, task=BrokenTask(train_size=2))
        async with routing([srv.url]) as router:
            workflow = build_workflow(context, router, SimpleNamespace(value=0))
            with pytest.raises(GroupAbandoned) as gone:
                await workflow.generate_group(Lease(0, 0, 0, "leased"), "g", "run", "w0")
    assert (gone.value.reason, gone.value.action) == ("env_error", DROP)
    assert "reset raised ConnectionError: the environment server went away" in gone.value.detail
    assert BrokenEnv.closed == 2 and context.stats.episodes == 0


# -- the engine session: retries and resubmission ---------------------------------------------------------------


async def test_an_abort_mode_pause_is_resubmitted_as_prompt_plus_tokens_so_far(
    model_dir: Path, tokenizer: Any, hf: torch.nn.Module
) -> None:
    prompt = prompt_of(tokenizer, "<|im_start|>user\n12+30=<|im_end|>\n")
    with serving(model_dir) as srv:
        # hold the scheduler at the 6th decode step: the request has partial output by then
        gate = StepGate(
            srv, lambda rec: rec.kind == "decode" and srv.engine.scheduler.stats.decode_steps >= 6
        )
        async with routing([srv.url]) as router, aiohttp.ClientSession() as http:
            session = new_session(router, tokenizer)
            session.sampling = SamplingConfig(1.0, 1.0, -1, ())  # no stop: the sample runs to its budget
            sample = asyncio.create_task(session.generate("g:s0", prompt, 40))
            await gate.reached()
            pause = asyncio.create_task(http.post(srv.url + "/pause_generation", json={"mode": "abort"}))
            await asyncio.sleep(0.2)
            gate.release()
            assert (await pause).status == 200
            body = {"new_version": "1", "abort_all_requests": False}
            assert (await http.post(srv.url + "/update_weight_version", json=body)).status == 200
            assert (await http.post(srv.url + "/continue_generation", json={})).status == 200
            gen: Generation = await asyncio.wait_for(sample, 60)
        seen = rids(srv)
    assert gen.resubmits >= 1 and session.stats.resubmits == gen.resubmits and {"g:s0:r0", "g:s0:r1"} <= seen
    assert len(gen.tokens) == 40 and gen.finish == "length"  # the budget spans the requests
    v = np.asarray(gen.versions)
    switch = int(np.argmax(v == 1))
    assert switch >= 1 and (v[:switch] == 0).all() and (v[switch:] == 1).all()
    # the resubmission continued from the ids it had (never re-tokenised): one teacher-forced pass agrees
    np.testing.assert_allclose(gen.logprobs, reference_logprobs(hf, prompt, gen.tokens), atol=1e-4)


async def test_an_engine_stopped_mid_request_is_left_and_the_sample_goes_on_elsewhere_from_its_tokens(
    model_dir: Path, tokenizer: Any, hf: torch.nn.Module
) -> None:
    prompt = prompt_of(tokenizer, "<|im_start|>user\n7*6=<|im_end|>\n")
    with serving(model_dir) as other:
        victim = serving(model_dir)
        srv = victim.__enter__()
        try:
            gate = StepGate(
                srv, lambda rec: rec.kind == "decode" and srv.engine.scheduler.stats.decode_steps >= 6
            )
            async with routing([srv.url]) as router:
                session = new_session(router, tokenizer)
                session.sampling = SamplingConfig(1.0, 1.0, -1, ())
                sample = asyncio.create_task(session.generate("g:s0", prompt, 40))
                await gate.reached()
                router.add(other.url, healthy=True)  # where the sample can go once its engine is gone
                stopping = asyncio.create_task(
                    asyncio.to_thread(srv.stop)
                )  # answers in-flight requests aborted
                await asyncio.sleep(0.2)
                gate.release()
                await stopping
                gen: Generation = await asyncio.wait_for(sample, 60)
                assert not router.engines[engine_id(srv)].healthy
        finally:
            victim.__exit__(None, None, None)
        assert "g:s0:r0" in rids(srv) and rids(other) & {"g:s0:r1", "g:s0:r2"}
    assert gen.engine_id == engine_id(other) and len(gen.tokens) == 40
    assert session.stats.engine_failures == 1 and gen.resubmits >= 1
    # the other engine went on from the partial output (same weights): one teacher-forced pass agrees
    np.testing.assert_allclose(gen.logprobs, reference_logprobs(hf, prompt, gen.tokens), atol=1e-4)


async def test_a_dead_engine_is_left_and_its_request_resent_to_a_live_one(
    model_dir: Path, tokenizer: Any
) -> None:
    prompt = prompt_of(tokenizer, "<|im_start|>user\n1+1=<|im_end|>\n")
    with dead_engine(model_dir) as dead, serving(model_dir) as live:
        async with routing([dead, live.url]) as router:
            session = new_session(router, tokenizer)
            # side by side, least-outstanding routing sends one of the two to the dead engine
            gens = await asyncio.gather(*(session.generate(f"g:s{i}", prompt, 8) for i in range(2)))
            assert not router.engines[dead.removeprefix("http://")].healthy
        seen = rids(live)
    assert session.stats.engine_failures == 1 and session.stats.requests == 3
    assert all(g.engine_id == engine_id(live) for g in gens)
    assert sorted(g.timings["requests"] for g in gens) == [1.0, 2.0]
    assert {"g:s0:r0", "g:s1:r0"} & seen and {"g:s0:r1", "g:s1:r1"} & seen


async def test_a_failed_batch_falls_back_to_one_request_per_sample(model_dir: Path, tokenizer: Any) -> None:
    prompt = prompt_of(tokenizer, "<|im_start|>user\n2+2=<|im_end|>\n")
    with dead_engine(model_dir) as dead, serving(model_dir) as live:
        async with routing([dead]) as router:
            session = new_session(router, tokenizer)
            assert await session.first_requests("g", prompt, 8, 3) is None
            router.add(live.url, healthy=True)
            answers = await session.first_requests("g", prompt, 8, 3)
    stats = session.stats
    assert (stats.batch_requests, stats.batch_fallbacks, stats.engine_failures, stats.requests) == (
        2,
        1,
        1,
        6,
    )
    assert answers is not None and [a.engine_id for a in answers] == [engine_id(live)] * 3
    assert all(a.result.output_ids for a in answers)


@pytest.mark.parametrize(
    ("max_failures", "reason", "action"), [(1, "engine_failures", DROP), (5, "no_engine", HAND_BACK)]
)
async def test_engines_that_keep_failing_drop_the_group_or_hand_it_back(
    model_dir: Path, tokenizer: Any, max_failures: int, reason: str, action: str
) -> None:
    """Two dead engines: with max_request_failures 1 the second failure drops the group; with more allowed, no
    engine is left to route to and the group goes back (another worker, or this one later, runs it)."""
    with dead_engine(model_dir) as a, dead_engine(model_dir) as b:
        async with routing([a, b], no_engine_timeout_s=0.5) as router:
            session = new_session(router, tokenizer, max_request_failures=max_failures)
            with pytest.raises(GroupAbandoned) as gone:
                await session.generate("g:s0", [1, 2, 3], 8)
    assert (gone.value.reason, gone.value.action) == (reason, action)
    assert session.stats.engine_failures == 2


async def test_a_rejected_request_drops_the_group_and_leaves_the_engine_in_routing(
    model_dir: Path, tokenizer: Any
) -> None:
    prompt = prompt_of(tokenizer, "<|im_start|>user\n12*34=<|im_end|>\n")
    with serving(model_dir, max_context_len=16) as short:  # prompt + 16 new tokens never fit: a real HTTP 400
        async with routing([short.url]) as router:
            session = new_session(router, tokenizer)
            with pytest.raises(GroupAbandoned) as gone:
                await session.generate("g:s0", prompt, 16)
            assert router.engines[engine_id(short)].healthy
    assert (gone.value.reason, gone.value.action) == ("bad_request", DROP)
    assert "maximum context length of 16" in gone.value.detail
    assert (session.stats.rejected_requests, session.stats.engine_failures, session.stats.requests) == (
        1,
        0,
        1,
    )
