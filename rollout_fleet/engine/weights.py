"""The built-in engine's weight-update endpoints: SGLang's protocol on top of ``weight_sync.WeightReceiver``.

Routes: ``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/begin_weight_update``,
``/end_weight_update``, ``/destroy_weights_update_group`` (from ``weight_sync.engine_routes``), plus the
engine's own ``/update_weights_from_disk``, ``/get_weights_by_name`` and ``/weights_checker`` (a checksum
for tests). Received tensors are copied into the served model by the scheduler thread between two forward
passes, so a request never sees half a tensor; the sender pauses generation around a whole update, and an
update that fails leaves the receiver inconsistent until a full reload, so a partially updated engine
never resumes serving (the sender keeps it paused and quarantined).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from weight_sync import protocol
from weight_sync.engine_routes import read_json, reply, validation_error, weight_routes
from weight_sync.receiver import WeightReceiver, weights_checksum


def _load_safetensors(path: str) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    named: list[tuple[str, Any]] = []
    for file in files:
        named.extend(load_file(str(file)).items())
    return named


def weight_sync_extension(timeout_s: float = 300.0):  # noqa: ANN201 - an Extension(app, server)
    """An engine extension adding the weight endpoints; the receiver starts at the engine's version label."""

    def extend(app: web.Application, server: Any) -> None:
        engine = server.engine

        def load(named: Any) -> None:
            engine.load_weights(named, timeout=timeout_s)

        receiver = WeightReceiver(
            load,
            device=next(engine.model.parameters()).device,
            timeout_s=timeout_s,
            on_weight_version=lambda label: engine.set_weight_version(label, timeout=timeout_s),
        )
        receiver.weight_version = engine.weight_version
        app.add_routes(weight_routes(receiver))

        async def update_from_disk(request: web.Request) -> web.Response:
            try:
                body = await read_json(request)
                path = str(body["model_path"])
            except (ValueError, KeyError, TypeError) as exc:
                return validation_error(f"model_path: {exc}")
            version = body.get("weight_version")
            try:
                named = await asyncio.to_thread(_load_safetensors, path)
                await asyncio.to_thread(engine.load_weights, named, version, timeout_s)
            except Exception as exc:  # the old weights stay in place: load_weights checks before copying
                return reply(False, f"Failed to update weights: {exc}")
            receiver.mark_consistent(version)
            status, payload = protocol.reply_body(
                True, "Succeeded to update model weights.", num_paused_requests=0
            )
            return web.json_response(payload, status=status)

        async def get_weights(request: web.Request) -> web.Response:
            try:
                body = await read_json(request)
                values = await asyncio.to_thread(
                    engine.get_weights_by_name, str(body["name"]), int(body.get("truncate_size", 100))
                )
            except (ValueError, KeyError, TypeError):
                return web.json_response({"error": {"message": "Get parameter by name failed"}}, status=400)
            return web.json_response(values)

        async def checksum(request: web.Request) -> web.Response:
            named = [(n, p.detach()) for n, p in engine.model.named_parameters()]
            digest = await asyncio.to_thread(weights_checksum, named)
            return web.json_response({"success": True, "message": "Success.", "checksum": digest})

        app.add_routes(
            [
                web.post(protocol.UPDATE_FROM_DISK, update_from_disk),
                web.route("*", protocol.GET_WEIGHTS_BY_NAME, get_weights),
                web.route("*", "/weights_checker", checksum),
            ]
        )

    return extend
