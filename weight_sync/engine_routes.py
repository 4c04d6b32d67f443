"""aiohttp handlers that put a ``WeightReceiver`` behind SGLang's weight-update endpoints.

For engines written with aiohttp (the built-in engine, ``benchmarks.mini_engine``): ``app.add_routes(
weight_routes(receiver))``. Generation control (``/pause_generation``, ``/continue_generation``) and
``/update_weights_from_disk`` belong to the engine, which owns the scheduler and the model.

Status codes and bodies follow SGLang 0.5.23: ``{"success", "message"}`` with 200 or 400; a body that fails
validation gets 400 ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``.
Receiver calls block (joining a group, receiving a broadcast), so they run in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from weight_sync import protocol
from weight_sync.receiver import WeightReceiver

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def validation_error(message: str) -> web.Response:
    """SGLang's reply to a body that does not validate (FastAPI RequestValidationError mapped to 400)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


async def read_json(request: web.Request) -> Any:
    """The JSON body; raises ``ValueError`` for a missing or malformed one (SGLang requires a body)."""
    text = await request.text()
    if not text:
        raise ValueError("Field required: the request body is missing (send {})")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"JSON decode error: {exc}") from exc


def reply(success: bool, message: str) -> web.Response:
    status, body = protocol.reply_body(success, message)
    return web.json_response(body, status=status)


def _handler(parse: Callable[[Any], Any], call: Callable[[Any], tuple[bool, str]]) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            parsed = parse(await read_json(request))
        except ValueError as exc:
            return validation_error(str(exc))
        success, message = await asyncio.to_thread(call, parsed)
        return reply(success, message)

    return handle


def _update_handler(receiver: WeightReceiver, parse: Callable[[Any], Any]) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            parsed = parse(await read_json(request))
        except ValueError as exc:
            return validation_error(str(exc))
        ticket = receiver.take_ticket()  # on the event loop: updates are served in arrival order
        success, message = await asyncio.to_thread(receiver.update, parsed, ticket)
        return reply(success, message)

    return handle


def weight_routes(receiver: WeightReceiver, sessions: bool = True) -> list[web.RouteDef]:
    """init / update (by broadcast, or colocated by handle) / destroy, plus begin / end when ``sessions`` (SGLang 0.5.23; without them, 404), plus the
    LoRA adapter update when the receiver has ``load_adapter``."""
    routes = [
        web.post(protocol.INIT_GROUP, _handler(protocol.parse_init_group, receiver.init_group)),
        web.post(protocol.UPDATE_DISTRIBUTED, _update_handler(receiver, protocol.parse_update_distributed)),
        web.post(protocol.UPDATE_TENSOR, _update_handler(receiver, protocol.parse_update_tensor)),
        web.post(protocol.DESTROY_GROUP, _handler(protocol.parse_group_name, receiver.destroy_group)),
    ]
    if receiver.load_adapter is not None:  # without it the route is absent (404), as on SGLang
        routes.append(
            web.post(
                protocol.LOAD_LORA_DISTRIBUTED, _update_handler(receiver, protocol.parse_lora_distributed)
            )
        )
    if sessions:
        routes += [
            web.post(protocol.BEGIN, _handler(lambda body: body, lambda _: receiver.begin())),
            web.post(protocol.END, _handler(lambda body: body, lambda _: receiver.end())),
        ]
    return routes
