"""The engine session: the one place a workflow's requests meet the engines.

It owns the HTTP calls (through the :class:`~rollout_fleet.router.Router`'s engine clients), the choice of the
LoRA adapter, and the one copy of the error handling every workflow shares:

- An interrupted request (``finish_reason`` abort: a pause in abort mode, an engine shutting down) is resubmitted
  as prompt + tokens so far with ``max_new_tokens`` reduced by what was generated, to the same engine while it is
  healthy (prefix cache), else to another; tokens, log-probs and per-token versions are appended, so the versions
  record the change. A 0-token abort is simply retried (too many hand the group back).
- A request lost to a failed engine (connection error, 5xx, timeout) takes the engine out of routing and is resent
  from the tokens received so far to another engine; an answer that makes no sense is resent the same way. More
  than ``rollout.max_request_failures`` of either drop the group.
- A request the engine rejects (4xx) drops the group: the request is wrong, sending it again cannot help.
- No healthy engine hands the group back.

Request ids: ``f"{rid_base}:r{k}"`` for the k-th request of a sample (or of one turn of an episode).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_fleet.generate_client import (
    EngineUnavailable,
    GenerateResult,
    InvalidResponse,
    RequestRejected,
    SamplingConfig,
    build_generate_request,
    build_group_request,
)
from rollout_fleet.router import EngineHandle, NoEngineAvailable, Router
from rollout_fleet.workflows.abandon import DROP, HAND_BACK, GroupAbandoned
from rollout_fleet.workflows.stats import WorkerStats

log = logging.getLogger("streamrl.rollout")

MAX_ZERO_TOKEN_ABORTS = 1000  # a sample aborted this often before its first token is handed back


class PublishedVersion(Protocol):
    """The cached published policy version (:class:`rollout_fleet.worker.VersionCache`)."""

    value: int


@dataclass
class Answer:
    """One engine answer to a sample's request, and the engine that gave it."""

    result: GenerateResult
    engine_id: str


@dataclass
class Generation:
    """A sample's (or one turn's) output so far, over every request it took."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = "abort"
    engine_id: str = ""
    resubmits: int = 0
    zero_aborts: int = 0  # aborts that came back before any token
    failures: int = 0  # requests lost to a failed engine or answered with nonsense
    timings: dict[str, float] = field(default_factory=dict)

    def append(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.tokens.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)


class EngineSession:
    """Generation against the engines for every workflow of one worker, with retries and resubmission."""

    def __init__(
        self,
        router: Router,
        sampling: SamplingConfig,
        stats: WorkerStats,
        versions: PublishedVersion,
        max_request_failures: int,
        adapter_name: Callable[[int], str] | None = None,
    ) -> None:
        self.router, self.sampling, self.stats = router, sampling, stats
        self.versions = versions
        self.max_request_failures = max_request_failures
        # LoRA served by adapter name (SGLang): each request selects the published version's adapter
        self.adapter_name = adapter_name

    @property
    def can_batch(self) -> bool:
        """Whether a group's first requests may go in one batched ``/generate`` (an sglang-router takes none)."""
        return self.router.proxy is None

    def select_adapter(self, payload: dict[str, Any]) -> dict[str, Any]:
        """With LoRA served by name, the request names the adapter of the published policy version: the
        learner announces a version only once every engine has loaded it, and engines keep the previous
        ``weight_sync.keep_adapters - 1`` loaded, so a request started before an announcement still finds its
        adapter. Version 0 is the base model itself (peft starts every adapter at B = 0, and the initial weights
        are never synced): its requests name no adapter."""
        version = self.versions.value
        if self.adapter_name is None or version == 0:
            return payload
        return {**payload, "lora_path": self.adapter_name(version)}

    async def _acquire(self, prefer: str | None = None) -> EngineHandle:
        try:
            return await self.router.acquire(prefer)
        except NoEngineAvailable as exc:
            raise GroupAbandoned("no_engine", HAND_BACK, str(exc)) from exc

    async def first_requests(
        self, group_id: str, prompt_ids: list[int], budget: int, n: int
    ) -> list[Answer] | None:
        """Every sample's first request (rid ``{group_id}:s{i}:r0``) in one batched ``/generate``; None when the
        batch failed and each sample should start on its own (a failed engine is taken out of routing as for a
        single request)."""
        rids = [f"{group_id}:s{i}:r0" for i in range(n)]
        payload = self.select_adapter(build_group_request(prompt_ids, self.sampling, budget, rids))
        handle = await self._acquire()
        self.stats.requests += n
        self.stats.batch_requests += 1
        try:
            results = await handle.client.generate_batch(payload)
            for result in results:
                self._check(handle, result, budget)
        except (EngineUnavailable, InvalidResponse) as exc:
            self._failed(handle, exc, f"the batch of {group_id}")
            self.stats.batch_fallbacks += 1
            return None
        except RequestRejected as exc:
            raise self._rejected(handle, exc) from exc
        except asyncio.CancelledError:
            for rid in rids:
                self.router.abort_later(handle, rid)
            raise
        finally:
            self.router.release(handle)
        return [Answer(result, handle.engine_id) for result in results]

    async def generate(
        self, rid_base: str, prompt_ids: list[int], budget_total: int, first: Answer | None = None
    ) -> Generation:
        """Requests until the sample (or one turn of an episode) finishes (stop or length), resubmitting
        interrupted partials; ``first`` is the answer to the first request when the group's batch already made
        it."""
        out = Generation()
        prefer: str | None = None
        requests = 0
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
            payload = self.select_adapter(
                build_generate_request(prompt_ids + out.tokens, self.sampling, budget, rid)
            )
            handle = await self._acquire(prefer)
            requests += 1
            answer = await self._request(handle, payload, budget, out)
            if answer is None:  # the engine failed or answered nonsense: another engine, unless too many
                prefer = None
                continue
            if self._take(out, answer):
                break
            prefer = handle.engine_id  # back to the engine that has the prefix cached, while it is healthy
        if not out.tokens:
            raise GroupAbandoned("empty_output", DROP, "the engine finished a sample with no output token")
        out.timings = {"generate_s": time.monotonic() - started, "requests": float(requests)}
        return out

    async def _request(
        self, handle: EngineHandle, payload: dict[str, Any], budget: int, out: Generation
    ) -> Answer | None:
        """One request; None when it failed in a way another engine may not (the failure counted in ``out``)."""
        rid = str(payload["rid"])
        self.stats.requests += 1
        if out.tokens:  # a resubmission: the sample so far goes with it
            out.resubmits += 1
            self.stats.resubmits += 1
        try:
            result = await handle.client.generate(payload)
            self._check(handle, result, budget)
        except (EngineUnavailable, InvalidResponse) as exc:
            self._failed(handle, exc, rid)
            self._count_failure(out, exc)
            return None
        except RequestRejected as exc:
            raise self._rejected(handle, exc) from exc
        except asyncio.CancelledError:
            self.router.abort_later(handle, rid)
            raise
        finally:
            self.router.release(handle)
        return Answer(result, handle.engine_id)

    def _count_failure(self, out: Generation, exc: Exception) -> None:
        """Too many failed requests for one sample drop the group."""
        out.failures += 1
        if out.failures > self.max_request_failures:
            reason = "engine_failures" if isinstance(exc, EngineUnavailable) else "invalid_response"
            raise GroupAbandoned(reason, DROP, str(exc)) from exc

    def _check(self, handle: EngineHandle, result: GenerateResult, budget: int) -> None:
        self.router.observe(handle, result.weight_version)
        if len(result.output_ids) > budget:
            raise InvalidResponse(f"{len(result.output_ids)} tokens for max_new_tokens = {budget}")

    def _failed(self, handle: EngineHandle, exc: Exception, what: str) -> None:
        """Count a failed request; a failed engine leaves routing until its health check passes again."""
        if isinstance(exc, EngineUnavailable):
            self.router.mark_failed(handle, str(exc))
            self.stats.engine_failures += 1
        else:
            self.stats.invalid_responses += 1
            log.warning("invalid answer from %s to %s: %s", handle.engine_id, what, exc)

    def _rejected(self, handle: EngineHandle, exc: RequestRejected) -> GroupAbandoned:
        self.stats.rejected_requests += 1
        return GroupAbandoned("bad_request", DROP, f"{handle.engine_id}: {exc}")

    def _take(self, out: Generation, answer: Answer) -> bool:
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
