"""``streamrl engine``: serve a model over SGLang's HTTP protocol.

``engine.kind = "builtin"``: the built-in engine, in this process. It runs until SIGTERM or SIGINT; then it
stops taking requests, aborts and answers every in-flight one (``finish_reason.type == "abort"`` with the
partial output), frees the port and exits 0.

``engine.kind = "sglang"``: this process becomes SGLang's own server (``python -m sglang.launch_server`` with
the arguments the fleet builds from ``[engine]``, :func:`rollout_fleet.fleet.engine_command`), by ``exec``: same
pid, so a supervisor watches and signals SGLang itself. Without the ``streamrl[sglang]`` extra it exits 2 with
an error that names it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
from collections.abc import Iterable

import torch

from common.auth import AuthError, check_bind, run_secret
from common.config import SharedConfig
from common.configlib import ConfigError
from common.cpus import pin_to_cpus
from rollout_fleet.config import EngineConfig
from rollout_fleet.engine.core import Engine
from rollout_fleet.engine.server import Extension, ServerSettings, serve

log = logging.getLogger("streamrl.engine")


def build_engine(shared: SharedConfig, engine: EngineConfig) -> Engine:
    """Load the model named by the config (engine.model_path, else shared.model_path) and start its scheduler."""
    model_path = engine.model_path or shared.model_path
    if model_path is None:
        raise ConfigError("no model to serve: set engine.model_path or shared.model_path")
    return Engine(
        model_path,
        device=engine.device,
        dtype=engine.dtype,
        max_running_requests=engine.max_running_requests,
        max_context_len=engine.max_context_len,
        max_prefill_tokens=engine.max_prefill_tokens,
        max_total_tokens=engine.max_total_tokens,
        kv_block_size=engine.kv_block_size,
        chunked_prefill_size=engine.chunked_prefill_size,
        disable_radix_cache=engine.disable_radix_cache,
        seed=engine_seed(engine.seed),
        step_log_size=engine.step_log_size,
        served_model_name=engine.served_model_name,
    ).start()


def engine_seed(configured: int | None) -> int:
    """The configured seed, else a fresh one: engines that share a seed draw identical samples for the same batch
    layout, which duplicates samples inside a GRPO group split across them."""
    seed = configured if configured is not None else secrets.randbits(31)
    log.info("sampling seed %d%s", seed, "" if configured is not None else " (random)")
    return seed


def server_settings(engine: EngineConfig, api_key: str | None = None) -> ServerSettings:
    return ServerSettings(
        request_timeout_s=engine.request_timeout_s,
        control_timeout_s=engine.control_timeout_s,
        health_check_timeout_s=engine.health_check_timeout_s,
        health_generation=engine.health_generation,
        shutdown_timeout_s=engine.shutdown_timeout_s,
        server_args=engine.model_dump(mode="json"),
        api_key=api_key,
    )


def exec_sglang(shared: SharedConfig, engine: EngineConfig) -> int:
    """Replace this process with SGLang's server for ``engine`` (returns only on an error: exit code 2)."""
    from rollout_fleet.fleet import FleetError, engine_command

    port = engine.port or engine.base_port
    try:
        argv = engine_command(shared, engine, port)
    except FleetError as exc:
        log.error("cannot start the engine: %s", exc)
        return 2
    log.info("engine.kind = sglang: exec %s", " ".join(argv))
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.execv(argv[0], argv)
    return 2  # not reached


def run_engine(shared: SharedConfig, engine: EngineConfig, extensions: Iterable[Extension] = ()) -> int:
    """Serve on engine.host : (engine.port or engine.base_port) until SIGTERM / SIGINT; returns the exit code."""
    try:
        api_key = run_secret(shared)  # required of every client when set (SGLang's --api-key)
        check_bind("engine.host", engine.host, api_key)
    except (AuthError, OSError) as exc:
        log.error("cannot start the engine: %s", exc)
        return 2
    if engine.kind == "sglang":
        return exec_sglang(shared, engine)
    torch.set_num_threads(shared.torch_threads)
    try:
        pin_to_cpus(engine.cpu_affinity, "engine.cpu_affinity")
        served = build_engine(shared, engine)
    except (ConfigError, OSError, ValueError) as exc:
        log.error("cannot start the engine: %s", exc)
        return 2
    port = engine.port or engine.base_port

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        from rollout_fleet.engine.weights import weight_sync_extension

        all_extensions = [weight_sync_extension(engine.control_timeout_s), *extensions]
        settings = server_settings(engine, api_key)
        await serve(served, engine.host, port, stop, settings, extensions=all_extensions)

    try:
        asyncio.run(main())
    except OSError as exc:
        log.error("cannot serve on %s:%d: %s", engine.host, port, exc)
        return 1
    finally:
        served.shutdown(engine.shutdown_timeout_s)
    return 0
