"""The engine's HTTP server: SGLang 0.5.23's endpoints (reference sections 1, 2 and 4) over aiohttp.

Handlers never run torch: they parse with :mod:`protocol`, hand items to the scheduler thread and await its
snapshots through an ``asyncio.Queue`` fed with ``call_soon_threadsafe``. Two pieces of SGLang's tokenizer
manager are reproduced because clients depend on them:

- the pause gate: after any ``/pause_generation``, new ``/generate`` calls wait (before taking the lock) until
  ``/continue_generation``;
- the model-update lock: each in-flight ``/generate`` holds a reader until its answer is written; a weight update
  made without a pause takes the writer (waits for in-flight generates, holds new ones back). ``abort`` mode
  pauses return once the readers are gone, i.e. once every in-flight request has been answered.

Weight-sync endpoints plug in through ``extensions``: callables ``(app, server)`` that add routes and use
``server.engine`` (load_weights, set_weight_version, call_in_scheduler), ``server.is_paused`` and
``server.update_lock.writer(timeout)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from common.auth import require_secret
from common.prometheus import metrics_route
from common.versioning import LabelError, decode_label
from rollout_fleet.engine import openai_api, protocol
from rollout_fleet.engine.core import Engine, EngineBusy
from rollout_fleet.engine.memory import resident_bytes
from rollout_fleet.engine.protocol import (
    HEALTH_CHECK_RID_PREFIX,
    ContractError,
    GenerateCall,
    GenItem,
    RequestError,
    RequestSnapshot,
    SamplingParams,
)
from rollout_fleet.engine.scheduler import PAUSE_MODES
from weight_sync import protocol as wsp

log = logging.getLogger("streamrl.engine.server")

SGLANG_VERSION = "0.5.23"
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

Extension = Callable[[web.Application, "EngineServer"], None]
SERVER_KEY: web.AppKey[EngineServer] = web.AppKey("engine_server")


@dataclass
class ServerSettings:
    """Timeouts and switches of the HTTP layer (filled from EngineConfig by ``main``)."""

    request_timeout_s: float = 3600.0
    control_timeout_s: float = 60.0
    health_check_timeout_s: float = 20.0
    health_generation: bool = True
    shutdown_timeout_s: float = 10.0
    server_args: dict[str, Any] = field(default_factory=dict)
    # The run secret (common.auth): every endpoint but the probes and /metrics answers 401 without it, as
    # SGLang's --api-key does. None: open (loopback-only runs).
    api_key: str | None = field(default=None, repr=False)


class ValidationFailure(Exception):
    """A control body FastAPI would refuse: answered 400 in SGLang's RequestValidationError shape."""


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json")


def _label_value(label: str) -> int | str:
    """An engine's ``weight_version`` label as the policy version it names, for ``/metrics`` (a label that
    names none stays text: an ``_info`` metric)."""
    try:
        return decode_label(label)
    except LabelError:
        return label


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's common error helper shape: ``{"error": {"message": ...}}``."""
    return json_response({"error": {"message": message}}, status)


def validation_response(message: str) -> web.Response:
    """FastAPI's RequestValidationError as SGLang answers it: 400, OpenAI-style error object."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return json_response(body, 400)


class ModelUpdateLock:
    """SGLang's ``model_update_lock``: readers are in-flight generates, the writer is a weight update.

    Writer-preferring: while a writer waits, new readers wait too, so an update is not starved."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def reader(self, timeout: float) -> AsyncIterator[None]:
        async with self._cond:
            await asyncio.wait_for(
                self._cond.wait_for(lambda: not self._writer and not self._writers_waiting), timeout
            )
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self, timeout: float) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: not self._writer and self.readers == 0), timeout
                )
                self._writer = True
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    async def wait_no_readers(self, timeout: float) -> bool:
        """True once no generate is in flight; False after ``timeout`` seconds."""
        try:
            async with self._cond:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.readers == 0), timeout)
            return True
        except TimeoutError:
            return False


class EngineServer:
    """Routes and state of one engine's HTTP server (one event loop)."""

    def __init__(self, engine: Engine, settings: ServerSettings | None = None) -> None:
        self.engine = engine
        self.settings = settings or ServerSettings()
        self.update_lock = ModelUpdateLock()
        self.is_paused = False
        self.pause_mode: str | None = None
        self.shutting_down = False
        self.live_rids: set[str] = set()
        self.started = time.time()
        self._pause_cond = asyncio.Condition()
        self._chat_stop_ids: list[int] | None = (
            None  # the chat template's end-of-turn ids, found on first use
        )

    def make_app(self, extensions: Iterable[Extension] = ()) -> web.Application:
        key = self.settings.api_key
        app = web.Application(
            client_max_size=256 * 1024 * 1024, middlewares=[require_secret(key)] if key else []
        )
        app[SERVER_KEY] = self
        add = app.router.add_route
        for method in ("POST", "PUT"):
            add(method, "/generate", self.generate)
        add("POST", "/v1/completions", self.completions)
        add("POST", "/v1/chat/completions", self.chat_completions)
        add("GET", "/v1/models", self.models)
        for path in ("/health", "/health_generate"):
            add("GET", path, self.health)
        add("GET", "/ready", self.ready)
        for path in ("/model_info", "/get_model_info"):
            add("GET", path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            add("GET", path, self.server_info)
        add("GET", "/v1/loads", self.loads)
        add("POST", "/pause_generation", self.pause_generation)
        add("POST", "/continue_generation", self.continue_generation)
        add("POST", "/abort_request", self.abort_request)
        add("POST", "/update_weight_version", self.update_weight_version)
        for method in ("GET", "POST"):
            add(method, "/flush_cache", self.flush_cache)
            add(method, "/release_memory_occupation", self.release_memory_occupation)
            add(method, "/resume_memory_occupation", self.resume_memory_occupation)
        add("GET", "/metrics", metrics_route("engine", self.metrics_values))
        for extend in extensions:
            extend(app, self)
        return app

    def metrics_values(self) -> dict[str, Any]:
        """Numbers for Prometheus ``/metrics``: scheduler counters (generated and prefill tokens, steps,
        aborts...), the current load (running / waiting requests), pause state and the weight version."""
        version = self.engine.weight_version
        return {
            **self.engine.stats(),
            **self.engine.scheduler.loads(),
            "paused": self.is_paused,
            "http_requests_in_flight": len(self.live_rids),
            "weight_version": _label_value(version),
        }

    # -- helpers ----------------------------------------------------------------------------------------------

    async def scheduler_op(self, future: Future) -> Any:
        """Await a scheduler command's future within the control timeout."""
        return await asyncio.wait_for(asyncio.wrap_future(future), self.settings.control_timeout_s)

    async def control_body(self, request: web.Request, fields: dict[str, type]) -> dict[str, Any]:
        """A control endpoint's JSON body: required (send ``{}``), an object, unknown keys ignored."""
        raw = await request.read()
        if not raw.strip():
            raise ValidationFailure("[{'type': 'missing', 'loc': ('body',), 'msg': 'Field required'}]")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValidationFailure(
                f"[{{'type': 'json_invalid', 'loc': ('body',), 'msg': '{exc}'}}]"
            ) from None
        if not isinstance(body, dict):
            raise ValidationFailure(
                "[{'type': 'model_type', 'loc': ('body',), 'msg': 'Input should be an object'}]"
            )
        for name, kind in fields.items():
            value = body.get(name)
            if value is not None and not isinstance(value, kind):
                raise ValidationFailure(
                    f"[{{'type': '{kind.__name__}_type', 'loc': ('body', '{name}'), "
                    f"'msg': 'Input should be a valid {kind.__name__}', 'input': {value!r}}}]"
                )
        return body

    def _sink(self, queue: asyncio.Queue, position: int) -> Callable[[RequestSnapshot], None]:
        loop = asyncio.get_running_loop()

        def push(snap: RequestSnapshot) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(queue.put_nowait, (position, snap))

        return push

    def _response_dict(self, call: GenerateCall, snap: RequestSnapshot) -> dict[str, Any]:
        return protocol.build_response(
            snap,
            decode=self.engine.decode,
            return_text_in_logprobs=call.return_text_in_logprobs,
            return_prompt_token_ids=call.return_prompt_token_ids,
        )

    async def _wait_unpaused(self) -> None:
        async with self._pause_cond:
            await asyncio.wait_for(
                self._pause_cond.wait_for(lambda: not self.is_paused), self.settings.request_timeout_s
            )

    async def set_paused(self, paused: bool, mode: str | None = None) -> None:
        async with self._pause_cond:
            self.is_paused, self.pause_mode = paused, mode if paused else None
            self._pause_cond.notify_all()

    # -- /generate --------------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"request body is not valid JSON: {exc}")
        try:
            protocol.check_contract(body)
        except ContractError as exc:
            return json_response({"error": str(exc)}, 400)
        return await self._admitted(lambda: self._generate_locked(request, body), error_response)

    async def _admitted(
        self,
        run: Callable[[], Awaitable[web.StreamResponse]],
        error: Callable[[str, int], web.Response],
    ) -> web.StreamResponse:
        """Run a generation handler as SGLang admits one: after the pause gate, refused while shutting down,
        inside a reader of the model-update lock (so an abort-mode pause returns after its answer is out)."""
        try:
            await self._wait_unpaused()
        except TimeoutError:
            return error("the engine stayed paused past the request timeout", 503)
        if self.shutting_down:
            return error("the engine is shutting down", 503)
        try:
            async with self.update_lock.reader(self.settings.request_timeout_s):
                return await run()
        except TimeoutError:
            return error("timed out waiting for a weight update to finish", 503)

    def _check_lora_path(self, lora_path: Any) -> None:
        """SGLang refuses a request whose ``lora_path`` names an adapter it has not loaded (or has unloaded);
        so does this engine, so a worker that names the wrong adapter version fails here as it would there.
        (What the built-in engine serves is its one merged adapter, the newest loaded.)"""
        if lora_path is None:
            return
        names = lora_path if isinstance(lora_path, list) else [lora_path]
        if not all(n is None or isinstance(n, str) for n in names):
            raise RequestError(f"lora_path = {lora_path!r}: expected a string, null or a list of them")
        missing = sorted({n for n in names if n is not None} - set(self.engine.lora_names))
        if missing:
            raise RequestError(f"The following requested LoRA adapters are not loaded: {missing}")

    async def _generate_locked(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        try:
            call = protocol.parse_generate(
                body,
                encode=self.engine.encode,
                vocab_size=self.engine.vocab_size,
                context_len=self.engine.context_len,
            )
            clash = next((i.rid for i in call.items if i.rid in self.live_rids), None)
            if clash is not None:
                raise RequestError(f"Duplicate request ID: {clash!r} is already in flight")
            self._check_lora_path(body.get("lora_path"))
        except RequestError as exc:
            if body.get("stream") is True:
                return await self._stream_error(request, str(exc))
            return error_response(str(exc))
        if call.stream:
            return await self._submitted(call, lambda queue: self._stream(request, call, queue))
        return await self._submitted(call, lambda queue: self._complete(request, call, queue))

    async def _submitted(
        self, call: GenerateCall, answer: Callable[[asyncio.Queue], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Submit a call's items to the scheduler (one batch) and answer from their snapshots' queue."""
        queue: asyncio.Queue = asyncio.Queue()
        self.live_rids.update(item.rid for item in call.items)
        self.engine.submit_batch([(item, self._sink(queue, i)) for i, item in enumerate(call.items)])
        try:
            return await answer(queue)
        finally:
            self.live_rids.difference_update(i.rid for i in call.items)

    async def _next(
        self, call: GenerateCall, queue: asyncio.Queue, deadline: float
    ) -> tuple[int, RequestSnapshot]:
        """The next snapshot; past the request timeout the call's requests are aborted (and still answered)."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            log.warning("request timeout: aborting %s", [i.rid for i in call.items])
            for item in call.items:
                self.engine.abort(item.rid)
            return await asyncio.wait_for(queue.get(), self.settings.control_timeout_s)

    async def _finished(self, call: GenerateCall, queue: asyncio.Queue) -> list[RequestSnapshot]:
        """Every item's final snapshot, in item order."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_timeout_s
        results: list[RequestSnapshot | None] = [None] * len(call.items)
        remaining = len(results)
        while remaining:
            position, snap = await self._next(call, queue, deadline)
            if snap.finished and results[position] is None:
                results[position] = snap
                remaining -= 1
        return [r for r in results if r is not None]

    @staticmethod
    async def _write(request: web.Request, response: web.Response) -> web.Response:
        # Written before the reader lock is released: a pause in abort mode returns after the answers are out.
        await response.prepare(request)
        await response.write_eof()
        return response

    async def _complete(
        self, request: web.Request, call: GenerateCall, queue: asyncio.Queue
    ) -> web.StreamResponse:
        final = await self._finished(call, queue)
        failed = next((s for s in final if protocol.error_status(s)), None)
        if failed is not None:
            response = error_response(failed.finish_reason["message"], protocol.error_status(failed) or 500)
        else:
            bodies = [self._response_dict(call, s) for s in final]
            response = json_response(bodies if call.is_batch else bodies[0])
        return await self._write(request, response)

    async def _stream(
        self, request: web.Request, call: GenerateCall, queue: asyncio.Queue
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_timeout_s
        done: set[int] = set()
        try:
            while len(done) < len(call.items):
                position, snap = await self._next(call, queue, deadline)
                if position in done:
                    continue
                chunk = self._response_dict(call, snap)
                if call.is_batch:
                    chunk["index"] = position
                await response.write(f"data: {_dumps(chunk)}\n\n".encode())
                if snap.finished:
                    done.add(position)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            log.debug("stream client went away: aborting %s", [i.rid for i in call.items])
            for item in call.items:
                self.engine.abort(item.rid)
            raise
        return response

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        error = {
            "error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
        }
        await response.write(f"data: {_dumps(error)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # -- OpenAI-compatible /v1/completions and /v1/chat/completions (openai_api) ---------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "chat")

    async def models(self, request: web.Request) -> web.Response:
        name = self.engine.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "sglang",
            "root": name,
        }
        card["max_model_len"] = self.engine.context_len
        return json_response({"object": "list", "data": [card]})

    def _parse_openai(self, kind: str, body: Any) -> openai_api.OpenAICall:
        engine = self.engine
        common = {
            "encode": engine.encode,
            "vocab_size": engine.vocab_size,
            "context_len": engine.context_len,
            "model": engine.served_model_name,
        }
        if kind == "completion":
            return openai_api.parse_completion(body, **common)
        if self._chat_stop_ids is None:
            self._chat_stop_ids = openai_api.end_of_turn_ids(engine.tokenizer)
        return openai_api.parse_chat(body, tokenizer=engine.tokenizer, stop_ids=self._chat_stop_ids, **common)

    async def _openai(self, request: web.Request, kind: str) -> web.StreamResponse:
        """Translate to /generate items (openai_api), run them through the same gate, lock and scheduler as
        /generate, and answer with the OpenAI object (token ids and log-probs included)."""

        def error(message: str, status: int = 400, param: str | None = None) -> web.Response:
            return json_response(openai_api.error_body(message, param, status), status)

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(f"request body is not valid JSON: {exc}")
        try:
            parsed = self._parse_openai(kind, body)
            clash = next((i.rid for i in parsed.call.items if i.rid in self.live_rids), None)
            if clash is not None:
                raise openai_api.OpenAIRequestError(
                    f"Duplicate request ID: {clash!r} is already in flight", "rid"
                )
        except openai_api.OpenAIRequestError as exc:
            return error(str(exc), 400, exc.param)

        async def answer(queue: asyncio.Queue) -> web.StreamResponse:
            final = await self._finished(parsed.call, queue)
            failed = next((s for s in final if protocol.error_status(s)), None)
            if failed is not None:
                status = protocol.error_status(failed) or 500
                return await self._write(request, error(failed.finish_reason["message"], status))
            body = openai_api.build_response(parsed, final, self.engine.decode)
            return await self._write(request, json_response(body))

        return await self._admitted(lambda: self._submitted(parsed.call, answer), error)

    # -- health and info ----------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 if a one-token generation (``input_ids=[0]``) comes back within the health timeout, else 503."""
        if self.shutting_down or not self.engine.alive:
            return web.Response(status=503)
        if request.path == "/health" and not self.settings.health_generation:
            return web.Response(status=200)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        item = GenItem(f"{HEALTH_CHECK_RID_PREFIX}{uuid.uuid4().hex}", [0], params, max_new_tokens=1)
        queue: asyncio.Queue = asyncio.Queue()
        self.engine.submit(item, self._sink(queue, 0))
        try:
            await asyncio.wait_for(queue.get(), self.settings.health_check_timeout_s)
        except TimeoutError:
            self.engine.abort(item.rid)
            return web.Response(status=503)
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive and not self.shutting_down else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(self.engine.model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        engine = self.engine
        info = dict(self.settings.server_args)
        info.update(
            {
                "model_path": str(engine.model_path),
                "served_model_name": engine.served_model_name,
                "context_length": engine.context_len,
                "max_running_requests": engine.max_running_requests,
                "max_prefill_tokens": engine.max_prefill_tokens,
                "device": str(engine.device),
                "dtype": str(engine.dtype).removeprefix("torch."),
                "weight_version": engine.weight_version,
                "memory_released": engine.memory_released,
                "kv_pool_bytes": engine.runner.cache.pool_bytes,
                "weights_bytes": engine.weight_memory.nbytes,
                "resident_bytes": resident_bytes(),
                "max_total_num_tokens": engine.max_total_tokens,
                "chunked_prefill_size": engine.chunked_prefill_size,
                "page_size": engine.kv_block_size,
                "disable_radix_cache": engine.scheduler.disable_radix_cache,
                "max_req_input_len": engine.context_len - 1,
                "internal_states": [
                    {**engine.stats(), "paused": self.is_paused, "pause_mode": self.pause_mode}
                ],
                "kv_events": None,
                "startup_time": self.started,
                "launch_command": " ".join(sys.argv),
                "version": SGLANG_VERSION,
                "engine": "streamrl-builtin",
                "frontend": "python",
            }
        )
        return json_response(info)

    async def loads(self, request: web.Request) -> web.Response:
        device = self.engine.device
        return json_response(
            {
                "timestamp": time.time(),
                "version": SGLANG_VERSION,
                "accelerator": device.type,
                "num_accelerators": 1 if device.type == "cuda" else 0,
                "loads": [{"dp_rank": 0, **self.engine.scheduler.loads()}],
            }
        )

    # -- generation control -----------------------------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self.control_body(request, {"mode": str})
        except ValidationFailure as exc:
            return validation_response(str(exc))
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            return validation_response(
                f"[{{'type': 'literal_error', 'loc': ('body', 'mode'), "
                f"'msg': \"Input should be 'abort', 'retract' or 'in_place'\", 'input': {mode!r}}}]"
            )
        await self.set_paused(True, mode)
        try:
            if mode == "abort":
                if not await self._abort_in_flight(self.settings.control_timeout_s):
                    return error_response("in-flight requests did not finish after abort", 500)
            else:
                await self.scheduler_op(self.engine.scheduler.pause(mode))
        except TimeoutError:
            return error_response(f"the scheduler did not acknowledge pause ({mode}) in time", 500)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _abort_in_flight(self, timeout: float) -> bool:
        """SGLang's abort-mode loop: abort all, wait up to 1 s for the readers to go, repeat until none."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.update_lock.readers > 0:
            self.engine.abort(abort_all=True)
            if await self.update_lock.wait_no_readers(min(1.0, max(deadline - loop.time(), 0.01))):
                return True
            if loop.time() >= deadline:
                return False
        return True

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            await self.control_body(request, {"torch_empty_cache": bool})
        except ValidationFailure as exc:
            return validation_response(str(exc))
        try:
            await self.scheduler_op(self.engine.scheduler.resume())
        except TimeoutError:
            return error_response("the scheduler did not acknowledge continue in time", 500)
        await self.set_paused(False)
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        """Fire and forget: rid must name a live request; every rid it prefixes is aborted (or all)."""
        try:
            body = await self.control_body(request, {"rid": str, "abort_all": bool})
        except ValidationFailure as exc:
            return validation_response(str(exc))
        rid = body.get("rid") or ""
        if body.get("abort_all"):
            self.engine.abort(abort_all=True)
        elif rid and rid in self.live_rids:
            self.engine.abort(rid)
        return web.Response(status=200)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """Section 3.8: change only the label (aborting everything first unless told not to)."""
        try:
            body = await self.control_body(request, {"new_version": str, "abort_all_requests": bool})
        except ValidationFailure as exc:
            return validation_response(str(exc))
        new_version = body.get("new_version")
        if new_version is None:
            return validation_response(
                "[{'type': 'missing', 'loc': ('body', 'new_version'), 'msg': 'Field required'}]"
            )
        if body.get("abort_all_requests", True):
            self.engine.abort(abort_all=True)
        await self.scheduler_op(
            self.engine.scheduler.post(lambda: self.engine.scheduler.set_weight_version(new_version))
        )
        return json_response(
            {
                "success": True,
                "message": f"Weight version updated to {new_version}",
                "new_version": new_version,
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout", "0") or 0)
        except ValueError:
            return validation_response(f"timeout must be a number, got {request.query.get('timeout')!r}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            scheduler = self.engine.scheduler
            ok = await self.scheduler_op(scheduler.post(scheduler.flush_cache))
            if ok or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        if ok:
            return web.Response(text=FLUSH_OK, status=200, content_type="text/plain")
        load = self.engine.scheduler.loads()
        text = (
            f"Flush cache failed: {load['num_running_reqs']} requests running, "
            f"{load['num_waiting_reqs']} waiting.\n"
        )
        return web.Response(text=text, status=400, content_type="text/plain")

    # -- sleep and wake (colocated mode, rollout_fleet.engine.memory) --------------------------------------------

    async def _memory_tags(self, request: web.Request) -> tuple[str, ...]:
        body = await self.control_body(request, {"tags": list})
        try:
            return wsp.parse_memory_tags(body, request.path)
        except ValueError as exc:
            raise ValidationFailure(
                f"[{{'type': 'literal_error', 'loc': ('body', 'tags'), 'msg': {str(exc)!r}}}]"
            ) from None

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """Section 4: free the memory of ``tags`` (null: all); 200 ``null``. Refused (400) unless idle: SGLang
        asserts that no request is ongoing. Requests that arrive while paused wait at the pause gate, as on
        SGLang; without a pause, or after ``/continue_generation``, they are refused until a resume."""
        try:
            tags = await self._memory_tags(request)
        except ValidationFailure as exc:
            return validation_response(str(exc))
        if self.live_rids or self.update_lock.readers:
            return error_response(
                "release_memory_occupation should be called only when no ongoing request: "
                f"{len(self.live_rids)} requests in flight (pause generation with mode abort first)"
            )
        try:
            await asyncio.to_thread(self.engine.release_memory, tags, self.settings.control_timeout_s)
        except (EngineBusy, TimeoutError) as exc:
            return error_response(str(exc) or "the scheduler did not release memory in time")
        log.info("memory released: %s", ", ".join(tags))
        return json_response(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        """Section 4: allocate the memory of ``tags`` (null: all) again; 200 ``null``."""
        try:
            tags = await self._memory_tags(request)
        except ValidationFailure as exc:
            return validation_response(str(exc))
        try:
            await asyncio.to_thread(self.engine.resume_memory, tags, self.settings.control_timeout_s)
        except TimeoutError:
            return error_response("the scheduler did not resume memory in time")
        log.info("memory resumed: %s", ", ".join(tags))
        return json_response(None)

    # -- shutdown ------------------------------------------------------------------------------------------------

    async def shutdown(self, timeout: float) -> None:
        """Refuse new work, abort and answer everything in flight (bounded by ``timeout``)."""
        self.shutting_down = True
        await self.set_paused(False)
        self.engine.abort(abort_all=True)
        if not await self._abort_in_flight(timeout):
            log.warning("requests still in flight after %.1f s of shutdown", timeout)


async def serve(
    engine: Engine,
    host: str,
    port: int,
    stop: asyncio.Event,
    settings: ServerSettings | None = None,
    on_ready: Callable[[EngineServer, int], None] | None = None,
    extensions: Iterable[Extension] = (),
) -> None:
    """Serve until ``stop`` is set, then answer in-flight requests (aborted) and free the port."""
    server = EngineServer(engine, settings)
    runner = web.AppRunner(server.make_app(extensions), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = runner.addresses[0][1]
    log.info("engine serving %s at http://%s:%d (pid %d)", engine.served_model_name, host, bound, os.getpid())
    if on_ready is not None:
        on_ready(server, bound)
    try:
        await stop.wait()
    finally:
        await server.shutdown(server.settings.shutdown_timeout_s)
        await runner.cleanup()
        log.info("engine server on port %d stopped", bound)


class ServerThread:
    """Serve an engine from a background thread with its own event loop (tests, benchmarks, embedding).

    ``with ServerThread(engine) as srv: srv.url`` binds a free port on 127.0.0.1 unless one is given."""

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        settings: ServerSettings | None = None,
        extensions: Iterable[Extension] = (),
    ) -> None:
        self.engine, self.host, self.port = engine, host, port
        self.settings, self.extensions = settings, list(extensions)
        self.server: EngineServer | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(server: EngineServer, port: int) -> None:
                self.server, self.port = server, port
                self._ready.set()

            await serve(self.engine, self.host, self.port, self._stop, self.settings, ready, self.extensions)

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"engine HTTP server did not start within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"engine HTTP server failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
