"""Held-out evaluation through the engines, alongside training (``streamrl eval``).

The engines serve the current policy, so evaluating through them measures exactly the weights the fleet is
sampling from, with no extra copy of the model. Each evaluation runs every held-out prompt greedily
(temperature 0: the accuracy ``summary.json`` reports) and sampled at temperature 1, scores with the task's
verifier (correctness only), and writes one point to the ``eval`` metrics stream with the policy version the
engines reported. Held-out prompts come from the task's test split, which the task keeps disjoint from its
training prompts (``rollout_fleet.tasks``).

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
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import Field

from broker.client import connect
from broker.config import BrokerConfig, SharedConfig
from broker.configlib import Section
from broker.discovery import resolve_redis_url
from broker.metrics import MetricsReader, MetricsWriter
from broker.version import PolicyVersion
from rollout_fleet.client import EngineClient, SamplingConfig, build_generate_request, parse_version
from rollout_fleet.config import RolloutConfig
from rollout_fleet.tasks import TEST, Prompt, Task

log = logging.getLogger("streamrl.eval")


class EvalConfig(Section):
    """Held-out evaluation through the engines while training runs."""

    every_versions: int = Field(
        5,
        ge=0,
        description="Evaluate whenever the policy version advanced this much; 0: no live evaluator "
        "(`streamrl up` still evaluates before and after).",
    )
    heldout_prompts: int = Field(
        200, ge=1, description="Held-out prompts per evaluation (the task's test split)."
    )
    max_new_tokens: int = Field(128, ge=1, description="Output budget of an evaluation sample.")
    sampled_temperature: float = Field(1.0, gt=0, description="Temperature of the sampled accuracy.")
    concurrency: int = Field(64, ge=1, description="Evaluation requests in flight at once.")
    poll_s: float = Field(1.0, gt=0, description="How often the evaluator checks the policy version.")


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

    def as_metrics(self) -> dict[str, float]:
        return {
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
            return parse_version(info.get("weight_version", "default"))
        except Exception as exc:  # noqa: BLE001 - any failure: this engine is not evaluated
            return f"{type(exc).__name__}: {exc}"

    seen = dict(zip(urls, await asyncio.gather(*(probe(u) for u in urls)), strict=True))
    ready = {u: v for u, v in seen.items() if isinstance(v, int) and v >= min_version}
    if not ready:
        raise NoEngineAtVersion(f"no engine serves policy version {min_version} or later: {seen}")
    return ready


async def _one(
    client: EngineClient,
    task: Task,
    tokenizer: Any,
    prompt: Prompt,
    sampling: SamplingConfig,
    max_new_tokens: int,
    rid: str,
) -> tuple[float, float, int]:
    ids = tokenizer(prompt.text, add_special_tokens=False).input_ids
    result = await client.generate(build_generate_request(ids, sampling, max_new_tokens, rid))
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
    scored = task.score(prompt, text)
    correct = float(scored.components.get("correct", scored.reward))
    return correct, float(scored.components.get("format", 0.0)), result.weight_version


async def evaluate_through_engines(
    urls: list[str],
    task: Task,
    tokenizer: Any,
    config: EvalConfig,
    stop_token_ids: tuple[int, ...],
    timeout_s: float = 120.0,
    min_version: int = 0,
    generate_timeout_s: float | None = None,
) -> EvalResult:
    """Greedy and sampled accuracy over the first ``config.heldout_prompts`` held-out prompts, spread
    round-robin over the engines of ``urls`` that serve ``min_version`` or later, with at most
    ``config.concurrency`` requests in flight. ``timeout_s`` bounds the control calls; a ``/generate`` call gets
    ``generate_timeout_s`` (default the same): long outputs take long."""
    started = time.monotonic()
    n = min(config.heldout_prompts, task.num_prompts(TEST))
    prompts = [task.make_prompt(i, TEST) for i in range(n)]
    modes = {
        "greedy": SamplingConfig(temperature=0.0, stop_token_ids=stop_token_ids),
        "sampled": SamplingConfig(temperature=config.sampled_temperature, stop_token_ids=stop_token_ids),
    }
    gate = asyncio.Semaphore(config.concurrency)
    async with aiohttp.ClientSession() as session:
        ready = await engines_at_version(session, urls, min_version, min(timeout_s, 10.0))
        clients = [EngineClient(session, u, generate_timeout_s or timeout_s, timeout_s) for u in ready]

        async def run(k: int, mode: str, prompt: Prompt) -> tuple[str, float, float, int]:
            async with gate:
                client = clients[k % len(clients)]
                rid = f"eval-{mode}-{prompt.index}-{time.monotonic_ns()}"
                scored = await _one(client, task, tokenizer, prompt, modes[mode], config.max_new_tokens, rid)
                return (mode, *scored)

        jobs = [run(k, mode, p) for mode in modes for k, p in enumerate(prompts)]
        results = await asyncio.gather(*jobs)
    greedy = [c for m, c, _, _ in results if m == "greedy"]
    sampled = [c for m, c, _, _ in results if m == "sampled"]
    formats = [f for m, _, f, _ in results if m == "greedy"]
    return EvalResult(
        greedy_accuracy=sum(greedy) / n,
        sampled_accuracy=sum(sampled) / n,
        format_rate=sum(formats) / n,
        n=n,
        version=min(v for _, _, _, v in results),
        seconds=time.monotonic() - started,
        max_version=max(v for _, _, _, v in results),
        engines=len(clients),
    )


def _tokenizer_and_task(shared: SharedConfig, rollout: RolloutConfig) -> tuple[Any, Task]:
    from transformers import AutoTokenizer

    from rollout_fleet.tasks.config import build_task

    path = rollout.tokenizer_path or shared.model_path
    if path is None:
        raise ValueError("shared.model_path is not set: the evaluator needs the model's tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, build_task(rollout.task, tokenizer)


def _stop_ids(tokenizer: Any, rollout: RolloutConfig) -> tuple[int, ...]:
    ids = set(rollout.stop_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


async def run_evaluation_once(
    shared: SharedConfig, rollout: RolloutConfig, config: EvalConfig, label: str = "", min_version: int = 0
) -> dict[str, float]:
    """One evaluation of what the engines serving ``min_version`` or later serve now, written to the ``eval``
    metrics stream; NoEngineAtVersion when no engine serves it."""
    tokenizer, task = _tokenizer_and_task(shared, rollout)
    result = await evaluate_through_engines(
        list(rollout.engine_urls),
        task,
        tokenizer,
        config,
        _stop_ids(tokenizer, rollout),
        shared.http_timeout_s * 4,
        min_version,
        rollout.request_timeout_s,
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
    try:
        while not stop.is_set():
            version = await versions.get()
            if version is not None and (last is None or version - last >= config.every_versions):
                try:
                    result = await evaluate_through_engines(
                        list(rollout.engine_urls), task, tokenizer, config, _stop_ids(tokenizer, rollout),
                        shared.http_timeout_s * 4, min_version=version,
                        generate_timeout_s=rollout.request_timeout_s,
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
