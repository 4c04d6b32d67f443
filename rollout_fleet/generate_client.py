"""The rollout worker's side of SGLang's ``/generate`` protocol (reference: sglang-api.md sections 2, 4, 8).

Two layers, like AReaL's ``SGLangBackend``:

- Pure functions: :func:`build_generate_request` makes the JSON body of one sample's request (``input_ids``,
  never ``n > 1``, ``return_logprob``, the rid), and :func:`parse_generate_response` turns the answer into a
  :class:`GenerateResult`: output token ids and behaviour log-probs from ``meta_info.output_token_logprobs``
  (never re-tokenised), one policy version per token from the ``meta_info.weight_versions`` spans, and the
  finish reason. Anything that could corrupt training (a null log-prob, which is how SGLang encodes NaN; spans
  that do not tile the output; ids that disagree) raises :class:`InvalidResponse`, naming what was wrong.
- :class:`EngineClient`: the aiohttp calls to one engine, each with a timeout. Failures are classified so the
  router can act on them: :class:`EngineUnavailable` (connection refused or reset, timeout, 5xx: the engine is
  taken out of routing and the request goes elsewhere) versus :class:`RequestRejected` (4xx: the request is
  wrong and would fail anywhere).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from common.versioning import LabelError, answer_version, decode_label
from weight_sync import protocol

FINISH_TYPES = ("stop", "length", "abort")


class EngineError(RuntimeError):
    """Base class of everything an engine call can fail with."""


class EngineUnavailable(EngineError):
    """The engine did not answer usefully (connection error, timeout, 5xx): the engine's fault, not the request's."""


class RequestRejected(EngineError):
    """The engine answered 4xx: the request itself is wrong (too long, bad parameter) and would fail anywhere."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"HTTP {status}: {message}")


class InvalidResponse(EngineError):
    """A 200 answer that does not satisfy the protocol (missing fields, null log-probs, bad version spans)."""


@dataclass(frozen=True)
class SamplingConfig:
    """The sampling parameters the worker sends with every request (besides the per-request budget)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()

    def as_params(self, max_new_tokens: int) -> dict[str, Any]:
        """SGLang ``sampling_params``: only keys its 0.5.23 contract gate knows (unknown keys are a 400)."""
        return {
            "max_new_tokens": int(max_new_tokens),
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "stop_token_ids": [int(t) for t in self.stop_token_ids],
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }


def build_generate_request(
    input_ids: Sequence[int], sampling: SamplingConfig, max_new_tokens: int, rid: str
) -> dict[str, Any]:
    """The JSON body of one sample's ``/generate``: a single ``input_ids`` prompt (so the answer is one object),
    output log-probs only (``logprob_start_len = -1``), not streamed."""
    if not input_ids:
        raise ValueError("input_ids is empty: SGLang rejects an empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
    if not rid:
        raise ValueError("rid must be a non-empty string")
    return {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": sampling.as_params(max_new_tokens),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
        "rid": rid,
    }


def build_group_request(
    input_ids: Sequence[int], sampling: SamplingConfig, max_new_tokens: int, rids: Sequence[str]
) -> dict[str, Any]:
    """The JSON body of a group's first ``/generate``: the prompt once per sample as a batch (``input_ids``
    a list of lists, one rid each), so the answer is an array in the same order. One HTTP call instead of
    one per sample; the engine still generates every sample as its own request."""
    if not rids or len(set(rids)) != len(rids):
        raise ValueError(f"rids {list(rids)!r} must be non-empty and distinct (SGLang rejects duplicates)")
    one = build_generate_request(input_ids, sampling, max_new_tokens, rids[0])
    return {**one, "input_ids": [one["input_ids"]] * len(rids), "rid": list(rids)}


@dataclass(frozen=True)
class GenerateResult:
    """One answer of ``/generate``, reduced to what a trajectory needs. Lists have one entry per output token."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version of each output token (from the weight_versions spans)
    finish_reason: str  # stop | length | abort
    finish_message: str = ""
    matched: int | str | None = None  # the stop token id or string
    prompt_tokens: int | None = None
    weight_version: int = 0  # the engine's label when it answered
    num_retractions: int = 0
    e2e_latency: float = 0.0
    raw_meta: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


def _version(decode: Callable[..., int], *args: Any) -> int:
    """``decode(*args)``, a label decoder of common.versioning, with a bad label being an invalid answer."""
    try:
        return decode(*args)
    except LabelError as exc:
        raise InvalidResponse(str(exc)) from None


def versions_from_spans(meta: Mapping[str, Any], num_tokens: int) -> list[int]:
    """Per-token versions from ``meta_info.weight_versions`` spans ``[{version, start, end}]`` that must tile
    ``[0, num_tokens)``; without spans (SGLang 0.5.10) every token gets ``meta_info.weight_version``."""
    spans = meta.get("weight_versions")
    if not spans:
        if num_tokens == 0:
            return []
        if "weight_version" not in meta:
            raise InvalidResponse("meta_info has neither weight_versions nor weight_version")
        return [_version(decode_label, meta["weight_version"], "meta_info.weight_version")] * num_tokens
    if not isinstance(spans, list):
        raise InvalidResponse(f"meta_info.weight_versions = {spans!r}: must be a list of spans")
    versions: list[int] = []
    for i, span in enumerate(spans):
        where = f"meta_info.weight_versions[{i}]"
        if not isinstance(span, Mapping) or not {"version", "start", "end"} <= span.keys():
            raise InvalidResponse(f"{where} = {span!r}: must be {{version, start, end}}")
        start, end = span["start"], span["end"]
        if start != len(versions) or not isinstance(end, int) or end < start:
            raise InvalidResponse(
                f"{where} = {span!r}: spans must tile the output (expected start {len(versions)})"
            )
        versions.extend([_version(decode_label, span["version"], f"{where}.version")] * (end - start))
    if len(versions) != num_tokens:
        raise InvalidResponse(
            f"meta_info.weight_versions cover {len(versions)} tokens, the output has {num_tokens}"
        )
    return versions


def _tokens_and_logprobs(
    meta: Mapping[str, Any], body: Mapping[str, Any], aborted: bool
) -> tuple[list[int], list[float]]:
    triples = meta.get("output_token_logprobs")
    if triples is None and aborted and not body.get("output_ids"):
        return [], []  # an abort in the waiting queue may carry no log-prob keys at all
    if triples is None:
        raise InvalidResponse("meta_info.output_token_logprobs is missing (was return_logprob sent?)")
    if not isinstance(triples, list):
        raise InvalidResponse(f"meta_info.output_token_logprobs = {triples!r}: must be a list")
    ids: list[int] = []
    logprobs: list[float] = []
    for i, entry in enumerate(triples):
        where = f"meta_info.output_token_logprobs[{i}]"
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise InvalidResponse(f"{where} = {entry!r}: must be [logprob, token_id, text]")
        lp, tid = entry[0], entry[1]
        if lp is None or isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
            raise InvalidResponse(f"{where} log-prob = {lp!r}: must be a finite number (null is NaN)")
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise InvalidResponse(f"{where} token id = {tid!r}: must be an int >= 0")
        ids.append(tid)
        logprobs.append(float(lp))
    output_ids = body.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        raise InvalidResponse(
            f"output_ids ({len(output_ids)} tokens) disagree with meta_info.output_token_logprobs ({len(ids)})"
        )
    return ids, logprobs


def parse_generate_response(body: Any, expected_rid: str | None = None) -> GenerateResult:
    """The :class:`GenerateResult` of one non-streamed ``/generate`` answer (HTTP 200)."""
    if not isinstance(body, Mapping):
        raise InvalidResponse(f"expected one JSON object, got {type(body).__name__}")
    meta = body.get("meta_info")
    if not isinstance(meta, Mapping):
        raise InvalidResponse("meta_info is missing")
    rid = str(meta.get("id", ""))
    if expected_rid is not None and rid != expected_rid:
        raise InvalidResponse(f"meta_info.id = {rid!r}: expected {expected_rid!r}")
    finish = meta.get("finish_reason")
    if not isinstance(finish, Mapping) or finish.get("type") not in FINISH_TYPES:
        raise InvalidResponse(f"meta_info.finish_reason = {finish!r}: expected a type in {FINISH_TYPES}")
    kind = str(finish["type"])
    status_code = finish.get("status_code")
    if kind == "abort" and isinstance(status_code, int) and status_code >= 400:
        raise RequestRejected(status_code, str(finish.get("message", "")))
    ids, logprobs = _tokens_and_logprobs(meta, body, kind == "abort")
    return GenerateResult(
        rid=rid,
        output_ids=ids,
        logprobs=logprobs,
        versions=versions_from_spans(meta, len(ids)),
        finish_reason=kind,
        finish_message=str(finish.get("message") or ""),
        matched=finish.get("matched"),
        prompt_tokens=meta.get("prompt_tokens"),
        weight_version=_version(answer_version, meta, "meta_info.weight_version"),
        num_retractions=int(meta.get("num_retractions", meta.get("total_retractions", 0)) or 0),
        e2e_latency=float(meta.get("e2e_latency") or 0.0),
        raw_meta=meta,
    )


def error_message(status: int, text: str) -> str:
    """The message of an error body in any of SGLang's shapes (``{"error": str}``, ``{"error": {"message"}}``,
    FastAPI's ``{"message"}``), else the raw text."""
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text.strip()[:500] or f"HTTP {status}"
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, str):
            return err
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return text.strip()[:500]


class EngineClient:
    """HTTP calls to one engine over a shared aiohttp session; every call has a timeout.

    ``generate`` raises :class:`EngineUnavailable`, :class:`RequestRejected` or :class:`InvalidResponse`; the
    control calls raise :class:`EngineUnavailable` for anything but a 2xx answer.
    """

    def __init__(
        self, session: aiohttp.ClientSession, url: str, request_timeout_s: float, control_timeout_s: float
    ) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.request_timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.control_timeout = aiohttp.ClientTimeout(total=control_timeout_s)

    async def _call(
        self, method: str, path: str, body: Any, timeout: aiohttp.ClientTimeout
    ) -> tuple[int, str]:
        try:
            async with self.session.request(method, self.url + path, json=body, timeout=timeout) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineUnavailable(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}") from exc

    async def _post_generate(self, payload: Mapping[str, Any]) -> Any:
        """POST /generate; the decoded JSON answer of an HTTP 2xx, else the error that classifies the failure."""
        status, text = await self._call("POST", "/generate", payload, self.request_timeout)
        if status >= 500:
            raise EngineUnavailable(f"POST {self.url}/generate: HTTP {status}: {error_message(status, text)}")
        if status >= 400:
            raise RequestRejected(status, error_message(status, text))
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidResponse(f"POST {self.url}/generate: answer is not JSON ({exc})") from exc

    async def generate(self, payload: Mapping[str, Any]) -> GenerateResult:
        """POST /generate with one sample's request; returns the parsed answer."""
        return parse_generate_response(await self._post_generate(payload), payload.get("rid"))

    async def generate_batch(self, payload: Mapping[str, Any]) -> list[GenerateResult]:
        """POST /generate with a batch (``build_group_request``); returns one parsed answer per rid, in order."""
        body = await self._post_generate(payload)
        rids = list(payload["rid"])
        if not isinstance(body, list) or len(body) != len(rids):
            got = f"{len(body)} answers" if isinstance(body, list) else type(body).__name__
            raise InvalidResponse(f"batch of {len(rids)} prompts answered with {got}")
        return [parse_generate_response(item, rid) for item, rid in zip(body, rids, strict=True)]

    async def control(self, method: str, path: str, body: Any = None) -> Any:
        """A control or info call; returns the decoded JSON body (None when empty)."""
        status, text = await self._call(method, path, body, self.control_timeout)
        if not 200 <= status < 300:
            raise EngineUnavailable(
                f"{method} {self.url}{path}: HTTP {status}: {error_message(status, text)}"
            )
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    async def health(self) -> bool:
        """GET /health (a one-token generation on SGLang and the built-in engine): True on 200. Only for
        engines known not to be paused (at launch): a paused engine answers 503 after its timeout."""
        try:
            status, _ = await self._call("GET", "/health", None, self.control_timeout)
        except EngineUnavailable:
            return False
        return status == 200

    async def model_info(self) -> dict[str, Any]:
        """GET /model_info: liveness that never blocks on a pause, and the engine's ``weight_version``."""
        info = await self.control("GET", "/model_info")
        if not isinstance(info, dict):
            raise EngineUnavailable(f"GET {self.url}/model_info: answer is not a JSON object")
        return info

    async def abort(self, rid: str) -> None:
        """POST /abort_request for one live rid (fire and forget on the server side)."""
        await self.control("POST", protocol.ABORT_REQUEST, protocol.abort_body(rid))

    async def pause(self, mode: str = "abort") -> Any:
        return await self.control("POST", protocol.PAUSE, protocol.pause_body(mode))

    async def resume(self) -> Any:
        return await self.control("POST", protocol.CONTINUE, protocol.continue_body())

    async def update_weight_version(self, version: int | str, abort_all_requests: bool = False) -> Any:
        return await self.control(
            "POST",
            protocol.UPDATE_WEIGHT_VERSION,
            protocol.update_weight_version_body(str(version), abort_all_requests),
        )


async def wait_until_healthy(client: EngineClient, timeout_s: float, poll_s: float = 0.25) -> None:
    """Poll GET /health until 200; raises TimeoutError after ``timeout_s`` (used right after a launch)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await client.health():
        if loop.time() >= deadline:
            raise TimeoutError(f"engine {client.url} did not answer /health with 200 within {timeout_s} s")
        await asyncio.sleep(poll_s)
