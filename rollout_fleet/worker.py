"""The rollout worker: leases prompts, generates ``group_size`` samples per prompt across the engines, scores
them, and writes one trajectory record per group to the stream.

One asyncio loop (uvloop in production) keeps up to ``rollout.max_concurrent_groups`` groups in flight. For
each group:

1. The prompt text is tokenised once (``add_special_tokens=False``; a chat template's markers are in the text).
2. ``group_size`` engine requests (never ``n > 1``: SGLang's fan-out loses request ids), each with
   ``rid = f"{group_id}:s{i}:r{k}"`` for the k-th request of sample i, routed by :class:`Router`. With
   ``rollout.batch_group_requests`` (default) the first request of every sample goes in one batched
   ``/generate`` (the prompt once per sample, a rid each), which costs the engine and this worker one HTTP
   call per group instead of one per sample; every later request of a sample (after an abort or a failed
   engine) goes alone, and a batch that fails falls back to one request per sample. Behind an sglang-router
   (``rollout.router = "sglang"``) every request goes alone: the router rejects a batch of rids.
3. Output ids and behaviour log-probs come from ``meta_info.output_token_logprobs``, one policy version per
   token from the ``weight_versions`` spans (:mod:`rollout_fleet.client`). Decoded text is made only for the
   verifier.
4. An interrupted sample (``finish_reason`` abort: a pause in abort mode, an engine shutting down) is resubmitted
   as prompt + tokens so far with ``max_new_tokens`` reduced by what was generated, to the same engine while it
   is healthy (prefix cache), else to another; tokens, log-probs and per-token versions are appended, so the
   versions record the change. A request lost to a failed engine (connection error, 5xx, timeout) is resent
   from the tokens received so far to another engine. A 0-token abort is simply retried.
5. Each finished sample is scored in the reward process pool right away; a timeout or an error becomes the
   sample's ``reward_status`` with reward 0 (the learner drops such groups).
6. The group goes to the stream through the idempotent producer, then the dispatch marks its prompt done.

A group that cannot be completed is either *dropped* (recorded in the dropped stream with a reason: the
engines rejected the request, answered nonsense, or kept failing on it) or *handed back* (no healthy engine,
shutdown: another worker, or this one later, runs it again). Admission (the staleness bound) is applied by the
dispatch's lease script; see :mod:`rollout_fleet.dispatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from broker.client import BrokerKeys
from broker.config import BrokerConfig
from broker.metrics import RUN_INFO_KEY, MetricsWriter
from broker.producer import BackpressureTimeout, Producer
from broker.record import RecordError, Sample, TrajectoryGroup
from broker.staleness import StalenessManager
from broker.version import PolicyVersion
from common.config import SharedConfig
from common.versioning import Lineage
from rollout_fleet.client import (
    EngineUnavailable,
    GenerateResult,
    InvalidResponse,
    RequestRejected,
    SamplingConfig,
    build_generate_request,
    build_group_request,
)
from rollout_fleet.config import RolloutConfig
from rollout_fleet.dispatch import Lease, PromptDispatcher
from rollout_fleet.envs.base import EnvironmentTask, is_multi_turn
from rollout_fleet.envs.episode import Episode, EpisodeBudgets, EpisodeError, TurnOutput, run_episode
from rollout_fleet.router import NoEngineAvailable, Router
from rollout_fleet.tasks import TRAIN, Prompt, RewardResult, Task

log = logging.getLogger("streamrl.rollout")

PROMPT_CACHE_SIZE = 1024  # token ids of recent prompts (each is tokenised once per group at least)
MAX_ZERO_TOKEN_ABORTS = 1000  # a sample aborted this often before its first token is handed back
DROP, HAND_BACK = "drop", "hand_back"


class GroupAbandoned(Exception):
    """A group that will not be produced: ``action`` is drop (recorded with ``reason``) or hand_back."""

    def __init__(self, reason: str, action: str, detail: str = "") -> None:
        self.reason, self.action, self.detail = reason, action, detail
        super().__init__(f"{reason} ({action}): {detail}")


class RequestsRejected(Exception):
    """``rollout.max_rejected_in_a_row`` groups in a row were rejected by the engines: the requests are wrong
    (a configuration error), not the prompts, and going on would drop every prompt of the run."""


class VersionCache:
    """The published policy version and its lineage, cached for the admission bound and the engines' staleness
    bound: re-read on every announcement on the control stream and at least every ``poll_s``. Nothing published
    yet counts as version 0."""

    def __init__(
        self,
        client: aioredis.Redis,
        shared: SharedConfig,
        broker: BrokerConfig,
        poll_s: float,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.policy = PolicyVersion(client, shared, broker)
        self.control = BrokerKeys.of(shared, broker).control
        self.poll_ms = max(1, int(poll_s * 1000))
        self.on_change = on_change
        self.eta = shared.eta
        self.value = 0
        self.lineage = Lineage()  # which weights each version holds, as of ``value``
        self._lineage_of: int | None = None  # the version whose lineage was read

    def __call__(self) -> int:
        return self.value

    async def refresh(self) -> int:
        version = await self.policy.get()
        value = 0 if version is None else version
        if value != self._lineage_of:
            # read after the version: a resume stores its lineage before it publishes, so this one has it
            self.lineage, self._lineage_of = await self.policy.lineage(), value
        if value != self.value:
            self.value = value
            if self.on_change is not None:
                self.on_change()
        return value

    def too_old(self, weight_version: int) -> bool:
        """Whether an engine serving ``weight_version`` is beyond the staleness bound of the published policy, by
        the learner's own test (lineage positions, not raw versions), so no rollout is generated that the
        learner would drop as stale."""
        return self.lineage.behind(self.value, weight_version, self.eta)

    async def run(self, stop: asyncio.Event) -> None:
        last = await self.client.xrevrange(self.control, "+", "-", count=1)
        last_id: Any = last[0][0] if last else "0-0"
        while not stop.is_set():
            try:
                await self.refresh()
                res = await self.client.xread({self.control: last_id}, block=self.poll_ms)
                if res:
                    last_id = res[0][1][-1][0]
            except Exception as exc:  # noqa: BLE001 - keep the cached value through a Redis hiccup
                log.warning("policy version refresh failed: %s", exc)
                await asyncio.sleep(self.poll_ms / 1000)


@dataclass
class WorkerStats:
    """Cumulative counters of one worker (the metrics stream shows their rates)."""

    groups_started: int = 0
    groups_produced: int = 0
    groups_duplicate: int = 0  # produced, but the group id was already in the stream (a re-leased prompt)
    groups_dropped: Counter = field(default_factory=Counter)  # by reason
    groups_handed_back: int = 0
    leases_lost: int = 0
    samples: int = 0
    tokens: int = 0
    requests: int = 0  # engine requests (a batched /generate of n prompts counts n)
    batch_requests: int = 0  # batched /generate calls (one per group with batch_group_requests)
    batch_fallbacks: int = 0  # batches that failed, their samples then sent one by one
    resubmits: int = 0
    zero_token_aborts: int = 0
    engine_failures: int = 0
    invalid_responses: int = 0
    rejected_requests: int = 0
    worker_errors: int = 0
    reward_status: Counter = field(default_factory=Counter)
    episodes: int = 0  # multi-turn samples finished
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    episode_ends: Counter = field(default_factory=Counter)  # why episodes ended: done, eos, max_turns, ...
    reward_sum: float = 0.0
    reward_count: int = 0
    wait_capacity_s: float = 0.0
    finished: bool = False  # every prompt up to max_epochs is done

    def flat(self) -> dict[str, float]:
        out = {k: float(v) for k, v in vars(self).items() if isinstance(v, int | float)}
        out["groups_dropped"] = float(sum(self.groups_dropped.values()))
        out.update({f"groups_dropped/{k}": float(v) for k, v in self.groups_dropped.items()})
        out.update({f"reward_status/{k}": float(v) for k, v in self.reward_status.items()})
        out.update({f"episode_end/{k}": float(v) for k, v in self.episode_ends.items()})
        return out


@dataclass
class _SampleResult:
    sample: Sample
    text: str


async def _all_or_nothing(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run the coroutines as tasks; the first exception cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class RolloutWorker:
    """One rollout worker. Build it with :func:`rollout_fleet.main.open_worker` (or by hand in tests)."""

    def __init__(
        self,
        *,
        shared: SharedConfig,
        rollout: RolloutConfig,
        redis: aioredis.Redis,
        router: Router,
        dispatch: PromptDispatcher,
        admission: StalenessManager,
        versions: VersionCache,
        producer: Producer,
        task: Task,
        tokenizer: Any,
        rewards: Any,
        scorer: str,
        scorer_options: Mapping[str, Any],
        worker_id: str,
        metrics: MetricsWriter | None = None,
        adapter_name: Callable[[int], str] | None = None,
    ) -> None:
        self.shared, self.config = shared, rollout
        self.redis, self.router, self.dispatch = redis, router, dispatch
        self.admission, self.versions, self.producer = admission, versions, producer
        self.task, self.tokenizer, self.rewards = task, tokenizer, rewards
        self.scorer, self.scorer_options = scorer, dict(scorer_options)
        self.worker_id, self.metrics = worker_id, metrics
        # LoRA served by adapter name (SGLang): each request selects the published version's adapter
        self.adapter_name = adapter_name
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = {int(eos)} if eos is not None else set()
        stops = set(rollout.stop_token_ids) | self.eos_ids
        self.multi_turn = is_multi_turn(task)
        self.budgets: EpisodeBudgets | None = None
        if self.multi_turn:
            assert isinstance(task, EnvironmentTask)
            stops |= {int(tokenizer.convert_tokens_to_ids(t)) for t in task.turn_end_tokens}
            self.budgets = EpisodeBudgets(
                max_turns=rollout.max_turns,
                max_total_tokens=rollout.max_new_tokens,
                max_tokens_per_turn=min(
                    rollout.max_tokens_per_turn or rollout.max_new_tokens, rollout.max_new_tokens
                ),
            )
        self.sampling = SamplingConfig(
            rollout.temperature, rollout.top_p, rollout.top_k, tuple(sorted(stops))
        )
        self.stats = WorkerStats()
        self._groups: dict[int, asyncio.Task] = {}
        self._lost: set[int] = set()
        self._wake = asyncio.Event()
        self._prompt_ids: dict[int, list[int]] = {}
        self.versions.on_change = self._on_new_version
        self.finished = False  # True when every prompt up to max_epochs is done
        self._first_request_marked = False
        # groups rejected by the engines (bad_request) since the last one produced
        self._rejected_in_a_row = 0
        self._rejection_failure: str | None = None  # set once they reach rollout.max_rejected_in_a_row

    # -- the main loop ---------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> WorkerStats:
        """Lease and run groups until ``stop`` is set (then drain) or every epoch up to ``max_epochs`` is done."""
        background_stop = asyncio.Event()
        background = [
            asyncio.create_task(self.versions.run(background_stop), name="versions"),
            asyncio.create_task(self.router.run_health_checks(background_stop), name="health"),
            asyncio.create_task(self._heartbeat(background_stop), name="heartbeat"),
        ]
        if self.metrics is not None:
            background.append(asyncio.create_task(self._report(background_stop), name="metrics"))
        stop_waiter = asyncio.create_task(self._forward(stop))
        await self.dispatch.expire_own()
        await self.versions.refresh()
        try:
            await self._lease_loop(stop)
            await self._drain(self.config.drain_timeout_s if stop.is_set() else None)
        finally:
            await self._drain(0.0)  # on an error: hand everything back
            background_stop.set()
            stop_waiter.cancel()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, stop_waiter, return_exceptions=True)
            if self.metrics is not None:
                with contextlib.suppress(Exception):
                    await self._write_metrics(0.0, self.stats.flat())
        return self.stats

    def _on_new_version(self) -> None:
        self._wake.set()  # admission capacity may have grown
        self.router.recheck_behind()  # engines that were behind may serve the new version now

    async def _forward(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake.set()

    async def _sleep(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _lease_loop(self, stop: asyncio.Event) -> None:
        poll = self.config.admission_poll_s
        while not stop.is_set():
            self._wake.clear()
            if self._rejection_failure is not None:
                raise RequestsRejected(self._rejection_failure)
            if len(self._groups) >= self.config.max_concurrent_groups:
                await self._sleep(poll)
                continue
            answer = await self.dispatch.lease()
            if answer.status == "lease":
                assert answer.lease is not None
                self._start(answer.lease)
            elif answer.status == "wait":
                started = time.monotonic()
                await self._sleep(poll)
                self.stats.wait_capacity_s += time.monotonic() - started
            else:  # exhausted: done once nothing is held anywhere (a dead worker's leases still expire to us)
                if not self._groups and answer.leases_left == 0:
                    self.finished = self.stats.finished = True
                    return
                wait = (
                    poll if answer.next_expiry_ms <= 0 else min(poll * 5, answer.next_expiry_ms / 1000 + 0.01)
                )
                await self._sleep(max(wait, 0.01))

    def _start(self, lease: Lease) -> None:
        self.stats.groups_started += 1
        task = asyncio.create_task(self._run_group(lease), name=f"group-{lease.position}")
        self._groups[lease.position] = task

        def done(_: asyncio.Task) -> None:
            if self._groups.get(lease.position) is task:
                del self._groups[lease.position]
            self._wake.set()

        task.add_done_callback(done)

    async def _drain(self, timeout: float | None) -> None:
        """Let in-flight groups finish (``timeout`` None: without limit), then cancel the rest and hand their
        prompts back."""
        if not self._groups:
            return
        pending = list(self._groups.items())
        if timeout is None or timeout > 0:
            await asyncio.wait([t for _, t in pending], timeout=timeout)
        unfinished = [(p, t) for p, t in pending if not t.done()]
        for _, task in unfinished:
            task.cancel()
        await asyncio.gather(*(t for _, t in pending), return_exceptions=True)
        mine = [p for p, _ in unfinished if p not in self._lost]
        if mine:
            with contextlib.suppress(Exception):
                released = await self.dispatch.release(mine)
                self.stats.groups_handed_back += released
                log.info("handed %d unfinished prompt(s) back", released)

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        interval = self.config.lease_ttl_s / 3
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                return
            try:
                lost = await self.dispatch.renew(list(self._groups))
            except Exception as exc:  # noqa: BLE001 - retried next beat; the TTL covers a short outage
                log.warning("lease renewal failed: %s", exc)
                continue
            for position in lost:
                task = self._groups.get(position)
                if task is not None and not task.done():
                    log.warning(
                        "lease of position %d was lost (expired and taken over); cancelling", position
                    )
                    self._lost.add(position)
                    self.stats.leases_lost += 1
                    task.cancel()

    # -- one group -------------------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        ids = self._prompt_ids.get(prompt.index)
        if ids is None:
            ids = [int(t) for t in self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]]
            if len(self._prompt_ids) >= PROMPT_CACHE_SIZE:
                self._prompt_ids.clear()
            self._prompt_ids[prompt.index] = ids
        return ids

    async def _run_group(self, lease: Lease) -> None:
        group_id = lease.group_id(self.shared.run_id)
        if not self._first_request_marked:
            self._first_request_marked = True
            await self._mark_first_request()
        try:
            group = await self._generate_group(lease, group_id)
            await self.producer.send(group)
            status = await self.dispatch.complete(lease, "produced")
            self._rejected_in_a_row = 0
            self.stats.groups_produced += 1
            if status == "DUP":  # another worker had finished this prompt (the producer answered DUP too)
                self.stats.groups_duplicate += 1
            self._count_group(group)
        except GroupAbandoned as gone:
            await self._abandon(lease, gone)
        except RecordError as exc:
            await self._abandon(lease, GroupAbandoned("invalid_record", DROP, str(exc)))
        except BackpressureTimeout as exc:  # the learner is not consuming: nothing wrong with the prompt
            await self._abandon(lease, GroupAbandoned("backpressure", HAND_BACK, str(exc)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.worker_errors += 1
            log.exception("group %s failed", group_id)
            with contextlib.suppress(Exception):
                await self._abandon(
                    lease, GroupAbandoned("worker_error", DROP, f"{type(exc).__name__}: {exc}")
                )

    async def _mark_first_request(self) -> None:
        """The run's first rollout request, across workers and restarts (benchmarks' time-to-target clock)."""
        with contextlib.suppress(Exception):
            await self.redis.hsetnx(self.shared.key(RUN_INFO_KEY), "first_request_at", repr(time.time()))

    def _count_rejection(self, gone: GroupAbandoned) -> GroupAbandoned:
        """Count a group the engines rejected. Once ``max_rejected_in_a_row`` were rejected since the last group
        produced, the worker stops (the lease loop raises :class:`RequestsRejected`), and this group and every
        later rejected one are handed back instead of dropped: a run resumed with the request fixed trains them."""
        self._rejected_in_a_row += 1
        limit = self.config.max_rejected_in_a_row
        if limit == 0 or (self._rejection_failure is None and self._rejected_in_a_row < limit):
            return gone
        if self._rejection_failure is None:
            self._rejection_failure = (
                f"{self._rejected_in_a_row} groups in a row were rejected by the engines "
                f"(rollout.max_rejected_in_a_row = {limit}), the last with {gone.detail}: the requests are "
                "wrong, not the prompts (check the sampling parameters, the LoRA adapter, the engine's limits)"
            )
            log.error("%s", self._rejection_failure)
            self._wake.set()
        return GroupAbandoned(gone.reason, HAND_BACK, gone.detail)

    async def _abandon(self, lease: Lease, gone: GroupAbandoned) -> None:
        if gone.reason == "bad_request":
            gone = self._count_rejection(gone)
        if gone.action == DROP:
            log.warning("dropping group of prompt %d (epoch %d): %s", lease.prompt_index, lease.epoch, gone)
            status = await self.dispatch.complete(lease, "dropped", reason=gone.reason, detail=gone.detail)
            if status == "OK":
                self.stats.groups_dropped[gone.reason] += 1
        else:
            log.info("handing prompt %d (epoch %d) back: %s", lease.prompt_index, lease.epoch, gone)
            self.stats.groups_handed_back += await self.dispatch.release([lease.position])

    async def _generate_group(self, lease: Lease, group_id: str) -> TrajectoryGroup:
        try:
            prompt = self.task.make_prompt(lease.prompt_index, TRAIN)
        except Exception as exc:  # noqa: BLE001 - a bad prompt is dropped, never retried forever
            raise GroupAbandoned("bad_prompt", DROP, f"{type(exc).__name__}: {exc}") from exc
        if isinstance(self.task, EnvironmentTask):
            try:  # the first observation of a remote environment (OpenEnv) is the prompt's text
                prompt = await self.task.prepare_prompt(prompt)
            except Exception as exc:  # noqa: BLE001 - the environment's failure, not the model's
                raise GroupAbandoned(
                    "env_error", DROP, f"prepare_prompt: {type(exc).__name__}: {exc}"
                ) from exc
        try:
            prompt_ids = self._encode(prompt)
        except Exception as exc:  # noqa: BLE001 - a bad prompt is dropped, never retried forever
            raise GroupAbandoned("bad_prompt", DROP, f"{type(exc).__name__}: {exc}") from exc
        if not prompt_ids:
            raise GroupAbandoned("bad_prompt", DROP, f"prompt {prompt.prompt_id!r} tokenises to nothing")
        n = self.config.group_size
        budget = self.budgets.max_tokens_per_turn if self.budgets else self.config.max_new_tokens
        first = (
            await self._first_requests(group_id, prompt_ids, budget)
            if self.config.batch_group_requests
            and self.router.proxy is None  # an sglang-router takes no batch
            else None
        )
        results: list[_SampleResult] = await _all_or_nothing(
            [self._sample(group_id, i, prompt_ids, prompt, first[i] if first else None) for i in range(n)]
        )
        return TrajectoryGroup(
            run_id=self.shared.run_id,
            epoch=lease.epoch,
            prompt_index=lease.prompt_index,
            attempt=0,
            prompt_id=prompt.prompt_id,
            task=self.task.name,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            samples=[r.sample for r in results],
            worker_id=self.worker_id,
            created_at=time.time(),
            extra={"answer": str(prompt.answer)},
            group_id=group_id,
        )

    def _select_adapter(self, payload: dict[str, Any]) -> dict[str, Any]:
        """With LoRA served by name, the request names the adapter of the published policy version: the
        learner announces a version only once every engine has loaded it, and engines keep the previous
        ``weight_sync.keep_adapters - 1`` loaded, so a request started before an announcement still finds its
        adapter. Version 0 is the base model itself (peft starts every adapter at B = 0, and the initial weights
        are never synced): its requests name no adapter."""
        version = self.versions.value
        if self.adapter_name is None or version == 0:
            return payload
        return {**payload, "lora_path": self.adapter_name(version)}

    async def _first_requests(
        self, group_id: str, prompt_ids: list[int], budget: int
    ) -> list[_Answer] | None:
        """Every sample's first request in one batched ``/generate``; None when the batch failed and each
        sample should start on its own (a failed engine is taken out of routing as for a single request)."""
        n = self.config.group_size
        rids = [f"{group_id}:s{i}:r0" for i in range(n)]
        payload = self._select_adapter(build_group_request(prompt_ids, self.sampling, budget, rids))
        try:
            handle = await self.router.acquire()
        except NoEngineAvailable as exc:
            raise GroupAbandoned("no_engine", HAND_BACK, str(exc)) from exc
        self.stats.requests += n
        self.stats.batch_requests += 1
        try:
            results = await handle.client.generate_batch(payload)
            for result in results:
                self.router.observe(handle, result.weight_version)
                if len(result.output_ids) > budget:
                    raise InvalidResponse(f"{len(result.output_ids)} tokens for max_new_tokens = {budget}")
        except EngineUnavailable as exc:
            self.router.mark_failed(handle, str(exc))
            self.stats.engine_failures += 1
            self.stats.batch_fallbacks += 1
            return None
        except InvalidResponse as exc:
            self.stats.invalid_responses += 1
            self.stats.batch_fallbacks += 1
            log.warning("invalid answer from %s to the batch of %s: %s", handle.engine_id, group_id, exc)
            return None
        except RequestRejected as exc:
            self.stats.rejected_requests += 1
            raise GroupAbandoned("bad_request", DROP, f"{handle.engine_id}: {exc}") from exc
        except asyncio.CancelledError:
            for rid in rids:
                self.router.abort_later(handle, rid)
            raise
        finally:
            self.router.release(handle)
        return [_Answer(result, handle.engine_id) for result in results]

    async def _sample(
        self, group_id: str, index: int, prompt_ids: list[int], prompt: Prompt, first: _Answer | None = None
    ) -> _SampleResult:
        if self.multi_turn:
            return await self._episode(group_id, index, prompt_ids, prompt, first)
        generated = await self._generate(group_id, index, prompt_ids, first)
        text = self.tokenizer.decode(generated.tokens, skip_special_tokens=False)
        started = time.monotonic()
        reward = await self.rewards.score(self.scorer, prompt, text, self.scorer_options)
        generated.timings["reward_s"] = time.monotonic() - started
        return _SampleResult(self._build_sample(index, generated, reward), text)

    async def _episode(
        self, group_id: str, index: int, prompt_ids: list[int], prompt: Prompt, first: _Answer | None
    ) -> _SampleResult:
        """One multi-turn sample: the task's environment run turn by turn (rollout_fleet.envs.episode), each
        turn generated like a single-turn sample (aborts resubmitted, failed engines avoided), then the whole
        transcript scored by the task's verifier in the reward pool, plus the environment's own rewards."""
        assert isinstance(self.task, EnvironmentTask) and self.budgets is not None
        started = time.monotonic()

        async def turn(input_ids: list[int], budget: int, k: int) -> TurnOutput:
            gen = await self._generate(group_id, index, input_ids, first if k == 0 else None, budget, k)
            return TurnOutput(
                gen.tokens, gen.logprobs, gen.versions, gen.finish, gen.engine_id, gen.resubmits
            )

        env = self.task.make_env(prompt)
        try:
            try:
                observation = await env.reset()
            except Exception as exc:  # noqa: BLE001 - the environment's failure, not the model's
                raise EpisodeError(f"environment reset raised {type(exc).__name__}: {exc}") from exc
            if observation != prompt.text:  # the group shares one prompt: every sample must start from it
                raise EpisodeError(f"reset observation {observation[:60]!r} differs from the prompt's text")
            episode = await run_episode(
                env,
                prompt_ids,
                turn,
                self._encode_observation,
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
                self.budgets,
                tuple(self.eos_ids),
                self.config.mask_resubmitted_prefix,
            )
        except EpisodeError as exc:
            raise GroupAbandoned("env_error", DROP, str(exc)) from exc
        finally:
            with contextlib.suppress(Exception):
                await env.close()
        generate_s = time.monotonic() - started
        text = self.tokenizer.decode(episode.tokens, skip_special_tokens=False)
        started = time.monotonic()
        reward = await self.rewards.score(self.scorer, prompt, text, self.scorer_options)
        timings = {"generate_s": generate_s, "reward_s": time.monotonic() - started}
        self._count_episode(episode)
        return _SampleResult(self._build_episode_sample(index, episode, reward, timings), text)

    def _encode_observation(self, text: str) -> list[int]:
        """An observation's ids: its text tokenised alone (earlier turns are ids already, never re-tokenised)."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _count_episode(self, episode: Episode) -> None:
        self.stats.episodes += 1
        self.stats.turns += len(episode.turns)
        self.stats.tool_calls += episode.tool_calls
        self.stats.tool_errors += episode.tool_errors
        self.stats.observation_tokens += episode.observation_tokens
        self.stats.episode_ends[episode.end] += 1
        if log.isEnabledFor(logging.DEBUG):
            for k, t in enumerate(episode.turns):
                log.debug("turn %d: %r -> %r %s", k, t.action, t.observation, t.info)

    def _build_episode_sample(
        self, index: int, episode: Episode, reward: RewardResult, timings: dict[str, float]
    ) -> Sample:
        ok = reward.status == "ok"
        self.stats.reward_status[reward.status] += 1
        components = {str(k): float(v) for k, v in reward.components.items()} if ok else {}
        if ok and episode.env_reward:
            components["env"] = episode.env_reward
        return Sample(
            sample_index=index,
            output_ids=np.asarray(episode.tokens, dtype=np.int32),
            logprobs=np.asarray(episode.logprobs, dtype=np.float32),
            versions=np.asarray(episode.versions, dtype=np.int32),
            loss_mask=np.asarray(episode.loss_mask, dtype=np.uint8),
            finish_reason=episode.finish_reason,
            truncated=episode.truncated,
            reward=float(reward.reward) + episode.env_reward if ok else 0.0,
            reward_components=components,
            reward_status=reward.status,
            reward_error="" if ok else (reward.error or reward.status),
            temperature=float(self.config.temperature),
            top_p=float(self.config.top_p),
            top_k=int(self.config.top_k),
            engine_id=episode.engine_id,
            timings=timings,
            num_resubmits=episode.resubmits,
            turn_bounds=np.asarray(episode.turn_bounds, dtype=np.int32),
            episode=episode.stats(),
        )

    async def _generate(
        self,
        group_id: str,
        index: int,
        prompt_ids: list[int],
        first: _Answer | None = None,
        budget_total: int | None = None,
        turn: int = 0,
    ) -> _Generated:
        """Requests until the sample (or one turn of an episode: ``turn``, with its own ``budget_total``)
        finishes (stop or length), resubmitting interrupted partials; ``first`` is the answer to the first
        request when the group's batch already made it."""
        out = _Generated()
        budget_total = self.config.max_new_tokens if budget_total is None else budget_total
        rid_base = f"{group_id}:s{index}" if turn == 0 else f"{group_id}:s{index}:t{turn}"
        prefer: str | None = None
        failures = requests = 0
        started = time.monotonic()
        if first is not None:
            requests = 1
            if not self._take(out, first):
                prefer = first.engine_id
        while out.finish == "abort":  # not finished yet: (re)submit
            budget = budget_total - len(out.tokens)
            if budget <= 0:  # an abort arrived exactly at the budget: the sample is complete, cut at length
                out.finish = "length"
                break
            rid = f"{rid_base}:r{requests}"
            payload = self._select_adapter(
                build_generate_request(prompt_ids + out.tokens, self.sampling, budget, rid)
            )
            try:
                handle = await self.router.acquire(prefer)
            except NoEngineAvailable as exc:
                raise GroupAbandoned("no_engine", HAND_BACK, str(exc)) from exc
            requests += 1
            self.stats.requests += 1
            if out.tokens:
                out.resubmits += 1
                self.stats.resubmits += 1
            try:
                result = await handle.client.generate(payload)
                self.router.observe(handle, result.weight_version)
                if len(result.output_ids) > budget:
                    raise InvalidResponse(f"{len(result.output_ids)} tokens for max_new_tokens = {budget}")
            except EngineUnavailable as exc:
                self.router.mark_failed(handle, str(exc))
                self.stats.engine_failures += 1
                failures += 1
                prefer = None
                if failures > self.config.max_request_failures:
                    raise GroupAbandoned("engine_failures", DROP, str(exc)) from exc
                continue
            except InvalidResponse as exc:
                self.stats.invalid_responses += 1
                failures += 1
                prefer = None
                log.warning("invalid answer from %s to %s: %s", handle.engine_id, rid, exc)
                if failures > self.config.max_request_failures:
                    raise GroupAbandoned("invalid_response", DROP, str(exc)) from exc
                continue
            except RequestRejected as exc:
                self.stats.rejected_requests += 1
                raise GroupAbandoned("bad_request", DROP, f"{handle.engine_id}: {exc}") from exc
            except asyncio.CancelledError:
                self.router.abort_later(handle, rid)
                raise
            finally:
                self.router.release(handle)
            if self._take(out, _Answer(result, handle.engine_id)):
                break
            prefer = handle.engine_id  # back to the engine that has the prefix cached, while it is healthy
        if not out.tokens:
            raise GroupAbandoned("empty_output", DROP, "the engine finished a sample with no output token")
        out.timings = {"generate_s": time.monotonic() - started, "requests": float(requests)}
        return out

    def _take(self, out: _Generated, answer: _Answer) -> bool:
        """Append an engine answer to the sample; True when it finished the sample. An abort before any token is
        counted, and too many of them hand the group back."""
        out.append(answer.result.output_ids, answer.result.logprobs, answer.result.versions)
        out.engine_id = answer.engine_id
        if not answer.result.aborted:
            out.finish = answer.result.finish_reason
            return True
        if not answer.result.output_ids:
            out.zero_aborts += 1
            self.stats.zero_token_aborts += 1
            if out.zero_aborts > MAX_ZERO_TOKEN_ABORTS:
                raise GroupAbandoned("aborted", HAND_BACK, f"{out.zero_aborts} aborts before any token")
        return False

    def _build_sample(self, index: int, gen: _Generated, reward: RewardResult) -> Sample:
        versions = np.asarray(gen.versions, dtype=np.int32)
        mask = np.ones(len(gen.tokens), dtype=np.uint8)
        if self.config.mask_resubmitted_prefix and gen.resubmits:
            mask[versions < versions[-1]] = (
                0  # tokens of an older policy than the one that finished the sample
            )
        ok = reward.status == "ok"
        self.stats.reward_status[reward.status] += 1
        return Sample(
            sample_index=index,
            output_ids=np.asarray(gen.tokens, dtype=np.int32),
            logprobs=np.asarray(gen.logprobs, dtype=np.float32),
            versions=versions,
            loss_mask=mask,
            finish_reason=gen.finish,
            truncated=gen.finish == "length",
            reward=float(reward.reward) if ok else 0.0,
            reward_components={str(k): float(v) for k, v in reward.components.items()} if ok else {},
            reward_status=reward.status,
            reward_error="" if ok else (reward.error or reward.status),
            temperature=float(self.config.temperature),
            top_p=float(self.config.top_p),
            top_k=int(self.config.top_k),
            engine_id=gen.engine_id,
            timings=gen.timings,
            num_resubmits=gen.resubmits,
        )

    def _count_group(self, group: TrajectoryGroup) -> None:
        for s in group.samples:
            self.stats.samples += 1
            self.stats.tokens += s.num_tokens()
            if s.reward_status == "ok":
                self.stats.reward_sum += s.reward
                self.stats.reward_count += 1

    # -- metrics ---------------------------------------------------------------------------------------------

    async def _report(self, stop: asyncio.Event) -> None:
        interval = self.config.metrics_interval_s
        previous = self.stats.flat()
        last = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            now = time.monotonic()
            current = self.stats.flat()
            with contextlib.suppress(Exception):
                await self._write_metrics(now - last, current, previous)
            previous, last = current, now

    async def _write_metrics(
        self, elapsed: float, current: dict[str, float], previous: dict[str, float] | None = None
    ) -> None:
        assert self.metrics is not None
        values = dict(current)
        if previous is not None and elapsed > 0:

            def rate(name: str) -> float:
                return (current.get(name, 0.0) - previous.get(name, 0.0)) / elapsed

            values["groups_per_s"] = rate("groups_produced")
            values["tokens_per_s"] = rate("tokens")
            values["wait_capacity_ratio"] = min(1.0, rate("wait_capacity_s"))
            rewards = current["reward_count"] - previous["reward_count"]
            if rewards > 0:
                values["reward_mean"] = (current["reward_sum"] - previous["reward_sum"]) / rewards
        values["groups_in_flight"] = float(len(self._groups))
        values["policy_version"] = float(self.versions.value)
        with contextlib.suppress(Exception):
            values["admission_capacity"] = float(await self.admission.capacity())
        values.update(self.router.stats())
        await self.metrics.write(values)


@dataclass
class _Answer:
    """One engine answer to a sample's request, and the engine that gave it."""

    result: GenerateResult
    engine_id: str


@dataclass
class _Generated:
    """A sample's output so far, over every request it took."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = "abort"
    engine_id: str = ""
    resubmits: int = 0
    zero_aborts: int = 0  # aborts that came back before any token
    timings: dict[str, float] = field(default_factory=dict)

    def append(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.tokens.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
