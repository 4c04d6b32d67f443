"""The built-in engine's weight-update endpoints: SGLang's protocol on top of ``weight_sync.WeightReceiver``.

Routes: ``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/update_weights_from_tensor``
(colocated: the buckets arrive as shared-memory or CUDA IPC handles), ``/begin_weight_update``,
``/end_weight_update``, ``/destroy_weights_update_group`` and streamrl's ``/load_lora_adapter_from_distributed``
(from ``weight_sync.engine_routes``), plus the engine's own ``/update_weights_from_disk``, SGLang's
``/load_lora_adapter`` and ``/unload_lora_adapter`` (a PEFT directory; docs/lora.md), ``/get_weights_by_name``
and ``/weights_checker`` (a checksum for tests). Received tensors are copied into the served model by the scheduler thread between two forward
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
from weight_sync.lora import LoraSpec, read_peft_adapter
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

        def load_adapter(named: Any, spec: LoraSpec) -> None:
            engine.load_adapter(named, spec, timeout=timeout_s)

        receiver = WeightReceiver(
            load,
            device=next(engine.model.parameters()).device,
            timeout_s=timeout_s,
            on_weight_version=lambda label: engine.set_weight_version(label, timeout=timeout_s),
            load_adapter=load_adapter,
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

        async def load_lora(request: web.Request) -> web.Response:
            """SGLang's ``/load_lora_adapter``: a PEFT adapter directory. The built-in engine serves one adapter
            at a time, merged into its weights: the newest load wins, whatever ``lora_path`` a request names."""
            try:
                req = protocol.parse_load_lora(await read_json(request))
            except ValueError as exc:
                return validation_error(str(exc))
            try:
                named, spec = await asyncio.to_thread(read_peft_adapter, req.lora_path)
                await asyncio.to_thread(engine.load_adapter, named, spec, None, timeout_s)
            except Exception as exc:  # checked before anything changes: the served adapter stays
                return lora_reply(False, f"Failed to load LoRA adapter {req.lora_name}: {exc}")
            engine.lora_names = [n for n in engine.lora_names if n != req.lora_name] + [req.lora_name]
            receiver.mark_consistent()
            return lora_reply(True)

        async def unload_lora(request: web.Request) -> web.Response:
            try:
                name = protocol.parse_unload_lora(await read_json(request))
            except ValueError as exc:
                return validation_error(str(exc))
            if name not in engine.lora_names:
                return lora_reply(False, f"LoRA adapter {name} is not loaded")
            if name == engine.lora_names[-1]:  # the one being served: back to the base weights
                await asyncio.to_thread(engine.unload_adapter, timeout_s)
            engine.lora_names.remove(name)
            return lora_reply(True)

        def lora_reply(success: bool, error: str | None = None) -> web.Response:
            """SGLang's ``LoRAUpdateOutput``: 200 or 400 with ``success``, ``error_message``, the loaded names."""
            loaded = {n: {"lora_name": n} for n in engine.lora_names}
            body = {"success": success, "error_message": error, "loaded_adapters": loaded}
            return web.json_response(body, status=200 if success else 400)

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
            if engine.weight_memory.released:
                message = "the weights are released; call /resume_memory_occupation first"
                return web.json_response({"success": False, "message": message}, status=400)
            named = [(n, p.detach()) for n, p in engine.model.named_parameters()]
            digest = await asyncio.to_thread(weights_checksum, named)
            return web.json_response({"success": True, "message": "Success.", "checksum": digest})

        app.add_routes(
            [
                web.post(protocol.UPDATE_FROM_DISK, update_from_disk),
                web.post(protocol.LOAD_LORA, load_lora),
                web.post(protocol.UNLOAD_LORA, unload_lora),
                web.route("*", protocol.GET_WEIGHTS_BY_NAME, get_weights),
                web.route("*", "/weights_checker", checksum),
            ]
        )

    return extend
