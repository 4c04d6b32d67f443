"""Held-out evaluation through the engines, alongside training (``streamrl eval``).

The engines serve the current policy, so evaluating through them measures exactly the weights the fleet is
sampling from, with no extra copy of the model. Each evaluation runs every held-out prompt greedily
(temperature 0: the accuracy ``summary.json`` reports) and sampled at temperature 1 (``samples_per_prompt``
answers before and after training, ``live_samples_per_prompt`` in the live loop), and writes one point to the
``eval`` metrics stream with the policy version the engines reported. Held-out prompts come from the task's test
split, which the task keeps disjoint from its training prompts (``rollout_fleet.tasks``).

Scoring: with the training reward by default (``eval.reward = "training"``: ``rollout.reward.function`` when
set, else the task's verifier), or the task's verifier (``task``), or another function by import path. It runs
where training runs it, in a :class:`RewardPool` of sandboxed processes with ``rollout.reward``'s timeout,
on the text decoded as the rollout worker decodes it. Accuracy, pass@k and the per-bucket accuracy follow
``rollout_fleet.eval_stats.solved`` (the ``correct`` component, else reward > 0); the point carries the mean
reward and components too, and ``reward_source/<training|task|function>`` = 1 says which reward scored it.

Which engines: before it starts, an evaluation probes every engine's ``weight_version`` and uses only those
serving at least the version it was asked to evaluate (the published one), so an engine that restarted on its
initial weights, or fell out of the weight sync, is never evaluated as if it were the trained policy. With none
there it raises :class:`NoEngineAtVersion`; the live loop tries again at its next poll. The result records the
lowest and highest version that answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from broker.client import connect
from broker.config import BrokerConfig
from broker.metrics import MetricsReader, MetricsWriter
from broker.version import PolicyVersion
from common.auth import auth_headers, run_secret
from common.config import SharedConfig
from common.discovery import resolve_redis_url
from common.versioning import answer_version
from rollout_fleet.config import EvalConfig, RolloutConfig
from rollout_fleet.envs.base import EnvironmentTask
from rollout_fleet.envs.episode import EpisodeBudgets, TurnOutput, run_episode
from rollout_fleet.eval_stats import (
    accuracy,
    buckets_of,
    by_bucket,
    component_means,
    format_rate,
    pass_at_k_of,
    pass_at_ks,
    solved,
)
from rollout_fleet.generate_client import (
    EngineClient,
    SamplingConfig,
    build_generate_request,
    build_group_request,
)
from rollout_fleet.rewards import RewardPool
from rollout_fleet.tasks import TEST, Prompt, RewardResult, Task

log = logging.getLogger("streamrl.eval")


@dataclass(frozen=True)
class EvalReward:
    """What held-out answers are scored with: a reward pool scorer, its options, and where it came from."""

    scorer: str
    options: dict[str, Any]
    source: str  # training | task | function


def eval_reward(rollout: RolloutConfig, config: EvalConfig) -> EvalReward:
    """The evaluation's reward per ``eval.reward``; ``training`` is exactly what the rollout workers run."""
    from rollout_fleet.main import scorer_of

    if config.reward == "training":
        return EvalReward(*scorer_of(rollout), "training")
    if config.reward == "task":
        return EvalReward(rollout.task.name, rollout.task.options(), "task")
    return EvalReward(config.reward, {}, "function")


def reward_pool(rollout: RolloutConfig) -> RewardPool:
    """A reward pool set up as the rollout workers' (workers, timeout, start method, memory limit)."""
    r = rollout.reward
    return RewardPool(r.workers, r.timeout_s, r.load_timeout_s, r.start_method, r.max_memory_bytes)


@dataclass(frozen=True)
class Scoring:
    """An evaluation's reward and the pool it runs in."""

    reward: EvalReward
    pool: RewardPool

    async def score(self, prompt: Prompt, text: str) -> RewardResult:
        return await self.pool.score(self.reward.scorer, prompt, text, self.reward.options)


class NoEngineAtVersion(RuntimeError):
    """No engine serves the version an evaluation was asked for; the message lists what each one serves."""


@dataclass(frozen=True)
class EvalResult:
    greedy_accuracy: float
    sampled_accuracy: float
    format_rate: float
    n: int
    version: int  # lowest weight version the engines answered with
    seconds: float
    max_version: int = -1  # highest weight version the engines answered with
    engines: int = 0  # engines the prompts were spread over
    details: Mapping[str, float] = field(default_factory=dict)  # rewards, pass@k, buckets, reward source

    def as_metrics(self) -> dict[str, float]:
        return {
            **self.details,
            "greedy_accuracy": self.greedy_accuracy,
            "sampled_accuracy": self.sampled_accuracy,
            "format_rate": self.format_rate,
            "n": float(self.n),
            "policy_version": float(self.version),
            "policy_version_max": float(self.max_version),
            "engines": float(self.engines),
            "eval_seconds": self.seconds,
        }


async def engines_at_version(
    session: aiohttp.ClientSession, urls: list[str], min_version: int, timeout_s: float
) -> dict[str, int]:
    """{url: weight version} of the engines that answer ``GET /model_info`` with at least ``min_version``;
    raises NoEngineAtVersion when there is none."""

    async def probe(url: str) -> int | str:
        try:
            info = await EngineClient(session, url, timeout_s, timeout_s).model_info()
            return answer_version(info)
        except Exception as exc:  # noqa: BLE001 - any failure: this engine is not evaluated
            return f"{type(exc).__name__}: {exc}"

    seen = dict(zip(urls, await asyncio.gather(*(probe(u) for u in urls)), strict=True))
    ready = {u: v for u, v in seen.items() if isinstance(v, int) and v >= min_version}
    if not ready:
        raise NoEngineAtVersion(f"no engine serves policy version {min_version} or later: {seen}")
    return ready


_Scored = tuple[RewardResult, int]  # a scored answer and the weight version that produced it


class _Permits:
    """A semaphore of request slots that a batch of n samples takes n of at once (the lock keeps two batches
    from each holding part of what both need)."""

    def __init__(self, total: int) -> None:
        self.total, self._free, self._lock = total, asyncio.Semaphore(total), asyncio.Lock()

    @contextlib.asynccontextmanager
    async def hold(self, count: int) -> AsyncIterator[None]:
        count = min(count, self.total)
        async with self._lock:
            for _ in range(count):
                await self._free.acquire()
        try:
            yield
        finally:
            for _ in range(count):
                self._free.release()


EVAL_MAX_TURNS = 8  # model turns of one held-out episode at most (the worker's default rollout.max_turns)


async def _episode_answer(
    client: EngineClient,
    tokenizer: Any,
    task: EnvironmentTask,
    prompt: Prompt,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    budget: int,
    rid: str,
) -> tuple[str, int, float]:
    """(transcript, weight version of its last token, the environment's rewards) of one episode of a multi-turn
    task, run as the worker runs it (the same runner, the task's environment and turn-end tokens; ``budget``
    bounds the whole output)."""
    ends = {int(tokenizer.convert_tokens_to_ids(t)) for t in task.turn_end_tokens}
    turn_sampling = replace(sampling, stop_token_ids=tuple(sorted(set(sampling.stop_token_ids) | ends)))

    async def turn(input_ids: list[int], max_new: int, k: int) -> TurnOutput:
        r = await client.generate(build_generate_request(input_ids, turn_sampling, max_new, f"{rid}-t{k}"))
        return TurnOutput(list(r.output_ids), list(r.logprobs), list(r.versions), r.finish_reason)

    env = task.make_env(prompt)
    try:
        await env.reset()
        episode = await run_episode(
            env,
            list(prompt_ids),
            turn,
            lambda text: tokenizer(text, add_special_tokens=False).input_ids,
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            EpisodeBudgets(EVAL_MAX_TURNS, budget, budget),
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else (),
        )
    finally:
        with contextlib.suppress(Exception):
            await env.close()
    return (
        tokenizer.decode(episode.tokens, skip_special_tokens=False),
        episode.versions[-1],
        episode.env_reward,
    )


async def _answers(
    client: EngineClient,
    tokenizer: Any,
    prompt: Prompt,
    sampling: SamplingConfig,
    budget: int,
    count: int,
    task: Task | None = None,
) -> list[tuple[str, int, float]]:
    """(text, weight version, environment reward) of ``count`` answers to one prompt (the reward is 0.0 but
    for episodes); several single-turn answers go as one batched request."""
    if isinstance(task, EnvironmentTask):
        prompt = await task.prepare_prompt(prompt)
    ids = tokenizer(prompt.text, add_special_tokens=False).input_ids
    rid = f"eval-t{sampling.temperature:g}-{prompt.index}-{time.monotonic_ns()}"
    if isinstance(task, EnvironmentTask):
        return await asyncio.gather(
            *(
                _episode_answer(client, tokenizer, task, prompt, ids, sampling, budget, f"{rid}-{i}")
                for i in range(count)
            )
        )
    if count == 1:
        results = [await client.generate(build_generate_request(ids, sampling, budget, rid))]
    else:
        rids = [f"{rid}-{i}" for i in range(count)]
        results = await client.generate_batch(build_group_request(ids, sampling, budget, rids))
    # decoded as the rollout worker decodes (special tokens kept): the reward sees what it sees in training
    return [
        (tokenizer.decode(r.output_ids, skip_special_tokens=False), r.weight_version, 0.0) for r in results
    ]


def with_env_reward(result: RewardResult, env_reward: float) -> RewardResult:
    """An episode's score as the worker records it: the environment's rewards added, as component ``env``."""
    if not env_reward or result.status != "ok":
        return result
    components = {**result.components, "env": env_reward}
    return replace(result, reward=result.reward + env_reward, components=components)


async def evaluate_through_engines(
    urls: list[str],
    task: Task,
    tokenizer: Any,
    config: EvalConfig,
    stop_token_ids: tuple[int, ...],
    scoring: Scoring,
    timeout_s: float = 120.0,
    min_version: int = 0,
    generate_timeout_s: float | None = None,
    samples: int = 1,
    headers: Mapping[str, str] | None = None,
) -> EvalResult:
    """Greedy accuracy and ``samples`` sampled answers per prompt over the first ``config.heldout_prompts``
    held-out prompts, spread round-robin over the engines of ``urls`` that serve ``min_version`` or later, with
    at most ``config.concurrency`` requests in flight, scored by ``scoring``. ``timeout_s`` bounds the control
    calls; a ``/generate`` call gets ``generate_timeout_s`` (default the same): long outputs take long.
    ``headers`` go with every call (the run secret's, common.auth)."""
    started = time.monotonic()
    n = min(config.heldout_prompts, task.num_prompts(TEST))
    if n == 0:
        raise ValueError(f"task {task.name} has no held-out prompts (a dataset task needs test_dataset)")
    prompts = [task.make_prompt(i, TEST) for i in range(n)]
    greedy = SamplingConfig(temperature=0.0, stop_token_ids=stop_token_ids)
    sampled = SamplingConfig(temperature=config.sampled_temperature, stop_token_ids=stop_token_ids)
    permits = _Permits(config.concurrency)
    async with aiohttp.ClientSession(headers=headers) as session:
        ready = await engines_at_version(session, urls, min_version, min(timeout_s, 10.0))
        clients = [EngineClient(session, u, generate_timeout_s or timeout_s, timeout_s) for u in ready]

        async def run(k: int, prompt: Prompt, sampling: SamplingConfig, count: int) -> list[_Scored]:
            async with permits.hold(count):
                answers = await _answers(
                    clients[k % len(clients)], tokenizer, prompt, sampling, config.max_new_tokens, count, task
                )
            return [
                (with_env_reward(await scoring.score(prompt, text), env), version)
                for text, version, env in answers
            ]

        greedy_runs = asyncio.gather(*(run(k, p, greedy, 1) for k, p in enumerate(prompts)))
        sampled_runs = asyncio.gather(*(run(k, p, sampled, samples) for k, p in enumerate(prompts)))
        by_greedy, by_sampled = await asyncio.gather(greedy_runs, sampled_runs)
    result = summarise(task, prompts, by_greedy, by_sampled, scoring.reward)
    return EvalResult(**result, seconds=time.monotonic() - started, engines=len(clients))


def summarise(
    task: Task,
    prompts: Sequence[Prompt],
    greedy: Sequence[Sequence[_Scored]],
    sampled: Sequence[Sequence[_Scored]],
    reward: EvalReward,
) -> dict[str, Any]:
    """EvalResult's fields (but seconds and engines) from every prompt's scored greedy and sampled answers."""
    g = [answers[0][0] for answers in greedy]
    s = [[r for r, _ in answers] for answers in sampled]
    samples = len(s[0])
    flat = [r for answers in s for r in answers]
    versions = [v for answers in (*greedy, *sampled) for _, v in answers]
    g_solved = [float(solved(r)) for r in g]
    s_counts = [sum(solved(r) for r in answers) for answers in s]
    details = {
        "greedy_reward": sum(r.reward for r in g) / len(g),
        "sampled_reward": sum(r.reward for r in flat) / len(flat),
        "reward_errors": float(sum(r.status != "ok" for r in (*g, *flat))),
        "samples_per_prompt": float(samples),
        f"reward_source/{reward.source}": 1.0,
        **{f"greedy_component/{k}": v for k, v in component_means(g).items()},
        **{f"pass@{k}": v for k, v in pass_at_ks(s_counts, samples).items()},
        **_bucket_metrics(task, prompts, g_solved, [c / samples for c in s_counts]),
    }
    return {
        "greedy_accuracy": accuracy(g),
        "sampled_accuracy": accuracy(flat),
        "format_rate": format_rate(g),
        "n": len(g),
        "version": min(versions),
        "max_version": max(versions),
        "details": details,
    }


def _bucket_metrics(
    task: Task, prompts: Sequence[Prompt], greedy: list[float], sampled: list[float]
) -> dict[str, float]:
    """``bucket/greedy/<bucket>``, ``bucket/sampled/<bucket>``, ``bucket/n/<bucket>`` for a task with buckets."""
    buckets = [task.difficulty(p) for p in prompts]
    out = {}
    for name, values in (("greedy", greedy), ("sampled", sampled)):
        for bucket, (mean, count) in by_bucket(buckets, values).items():
            out[f"bucket/{name}/{bucket}"] = mean
            out[f"bucket/n/{bucket}"] = float(count)
    return out


def summary_fields(rollout: RolloutConfig, config: EvalConfig, before: dict, after: dict) -> dict[str, Any]:
    """What summary.json adds about the evaluations: the reward that scored them, pass@k and buckets."""
    reward = eval_reward(rollout, config)
    return {
        "eval_reward": {"source": reward.source, "scorer": reward.scorer},
        "eval_pass_at_k_before": pass_at_k_of(before),
        "eval_pass_at_k_after": pass_at_k_of(after),
        "eval_buckets_before": buckets_of(before),
        "eval_buckets_after": buckets_of(after),
    }


def _tokenizer_and_task(shared: SharedConfig, rollout: RolloutConfig) -> tuple[Any, Task]:
    from rollout_fleet.model import load_tokenizer
    from rollout_fleet.tasks.config import build_task

    path = rollout.tokenizer_path or shared.model_path
    if path is None:
        raise ValueError("shared.model_path is not set: the evaluator needs the model's tokenizer")
    tokenizer = load_tokenizer(path)
    task = build_task(rollout.task, tokenizer)
    if isinstance(task, EnvironmentTask):
        task.sandbox = rollout.sandbox
    return tokenizer, task


def _stop_ids(tokenizer: Any, rollout: RolloutConfig) -> tuple[int, ...]:
    ids = set(rollout.stop_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


async def run_evaluation_once(
    shared: SharedConfig, rollout: RolloutConfig, config: EvalConfig, label: str = "", min_version: int = 0
) -> dict[str, float]:
    """One evaluation of what the engines serving ``min_version`` or later serve now (``samples_per_prompt``
    sampled answers a prompt: ``streamrl up``'s before and after), written to the ``eval`` metrics stream;
    NoEngineAtVersion when no engine serves it."""
    tokenizer, task = _tokenizer_and_task(shared, rollout)
    async with reward_pool(rollout) as pool:
        result = await evaluate_through_engines(
            list(rollout.engine_urls),
            task,
            tokenizer,
            config,
            _stop_ids(tokenizer, rollout),
            Scoring(eval_reward(rollout, config), pool),
            shared.http_timeout_s * 4,
            min_version,
            rollout.request_timeout_s,
            samples=config.samples_per_prompt or rollout.group_size,
            headers=auth_headers(run_secret(shared)),
        )
    metrics = result.as_metrics()
    client = connect(resolve_redis_url(shared))
    try:
        await MetricsWriter(client, shared, "eval").write(metrics)
    finally:
        await client.aclose()
    log.info("eval %s: %s", label, metrics)
    return metrics


async def last_evaluated_version(reader: MetricsReader) -> int | None:
    """The policy version of the run's newest evaluation (``streamrl up``'s baseline, or this evaluator's
    before a restart), so the loop does not evaluate the same weights twice."""
    latest = await reader.latest("eval")
    if latest is None or "policy_version" not in latest:
        return None
    return int(latest["policy_version"])


async def evaluator_loop(
    shared: SharedConfig,
    broker: BrokerConfig,
    rollout: RolloutConfig,
    config: EvalConfig,
    stop: asyncio.Event,
) -> None:
    """Evaluate whenever the published policy version advanced by ``every_versions`` since the last one."""
    tokenizer, task = _tokenizer_and_task(shared, rollout)
    client = connect(resolve_redis_url(shared, wait_s=30), broker)
    versions = PolicyVersion(client, shared, broker)
    writer = MetricsWriter(client, shared, "eval")
    last = await last_evaluated_version(MetricsReader(client, shared))
    pool = reward_pool(rollout)
    scoring = Scoring(eval_reward(rollout, config), pool)
    try:
        while not stop.is_set():
            version = await versions.get()
            if version is not None and (last is None or version - last >= config.every_versions):
                try:
                    result = await evaluate_through_engines(
                        list(rollout.engine_urls), task, tokenizer, config, _stop_ids(tokenizer, rollout),
                        scoring, shared.http_timeout_s * 4, min_version=version,
                        generate_timeout_s=rollout.request_timeout_s, samples=config.live_samples_per_prompt,
                        headers=auth_headers(run_secret(shared)),
                    )  # fmt: skip
                except NoEngineAtVersion as exc:  # every engine behind (restarting, or out of the sync)
                    log.warning("eval of version %d postponed: %s", version, exc)
                else:
                    await writer.write(result.as_metrics())
                    log.info("eval at version %d: greedy %.3f sampled %.3f", result.version,
                             result.greedy_accuracy, result.sampled_accuracy)  # fmt: skip
                    last = version
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.poll_s)
    finally:
        pool.close()
        await client.aclose()


def run_evaluator(
    shared: SharedConfig, broker: BrokerConfig, rollout: RolloutConfig, config: EvalConfig
) -> int:
    """``streamrl eval``: evaluate alongside training until SIGTERM / SIGINT."""
    if not rollout.engine_urls:
        log.error("rollout.engine_urls is empty: the evaluator needs the engines' URLs")
        return 2
    if config.every_versions == 0:
        log.info("eval.every_versions = 0: live evaluation is off")
        return 0

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await evaluator_loop(shared, broker, rollout, config, stop)

    asyncio.run(main())
    return 0
