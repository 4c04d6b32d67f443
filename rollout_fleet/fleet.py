"""Launching, health-checking and restarting engine servers, and keeping the engine registry current.

``Fleet(shared, engine, registry).start()`` launches ``engine.count`` servers on ports ``base_port + i``:

- ``engine.kind = "builtin"``: ``python -m streamrl engine --engine.port=P --shared.model_path=... ...`` (the
  engine role's entry path)
  (every ``[engine]`` field is passed through, so the child serves exactly the configured engine);
- ``engine.kind = "sglang"``: ``python -m sglang.launch_server --model-path ... --host ... --port P --tp-size T
  --mem-fraction-static F ...`` (plus ``engine.extra_args``). SGLang is the optional extra
  ``streamrl[sglang]``; without it the fleet refuses to start with an error that says so.

Each engine's output goes to ``<log_dir>/engine-<i>.log``. An engine counts as ready when ``GET /health``
answers 200 (a one-token generation: the model is loaded and serving) within ``engine.launch_timeout_s``.
:meth:`Fleet.supervise` watches the processes: an engine that exits unexpectedly is marked ``dead`` in the
registry and relaunched on the same port, at most ``engine.max_restarts`` times, then left dead. The registry
entry of each engine carries its URL, ranks (SGLang's tensor parallelism, 1 for the built-in engine), pid and
health. Routers probe the engines themselves; the fleet only reports what it knows about the processes.

In ``streamrl up`` the supervisor runs engines as its own children instead; then whoever knows their URLs
registers them (the rollout worker does, for ``rollout.engine_urls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from broker.registry import EngineRegistry, engine_id_for
from common.auth import auth_headers, run_secret
from common.config import SharedConfig
from rollout_fleet.config import EngineConfig
from rollout_fleet.generate_client import EngineClient, wait_until_healthy

log = logging.getLogger("streamrl.fleet")

ENGINE_KINDS = ("builtin", "sglang")
SGLANG_EXTRA = "streamrl[sglang]"


class FleetError(RuntimeError):
    """An engine that cannot be launched (bad kind, missing SGLang, died or never became healthy)."""


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _model_path(shared: SharedConfig, engine: EngineConfig) -> Path:
    path = engine.model_path or shared.model_path
    if path is None:
        raise FleetError("no model to serve: set engine.model_path or shared.model_path")
    return Path(path)


def engine_command(shared: SharedConfig, engine: EngineConfig, port: int, index: int = 0) -> list[str]:
    """The command line that serves engine ``index`` of the fleet, of ``engine.kind``, on ``port``; a configured
    seed becomes seed + index, so no two engines draw the same samples."""
    model = _model_path(shared, engine)
    engine = engine.model_copy(update={"seed": engine.seed_of(index)})
    if engine.kind == "builtin":
        args = [sys.executable, "-m", "streamrl", "engine"]
        for name, value in engine.model_dump(mode="json").items():
            if value is not None and name not in ("port", "model_path"):
                args.append(f"--engine.{name}={json.dumps(value)}")
        return args + [
            f"--engine.port={port}",
            f"--shared.model_path={json.dumps(str(model))}",
            f"--shared.torch_threads={shared.torch_threads}",
            f"--shared.run_dir={json.dumps(str(shared.run_dir))}",
            f"--shared.run_id={json.dumps(shared.run_id)}",
            f"--shared.auth={shared.auth}",
        ]
    if engine.kind == "sglang":
        if not sglang_available():
            raise FleetError(
                f"engine.kind = 'sglang' needs SGLang, which is not installed here: pip install '{SGLANG_EXTRA}' "
                "(or use engine.kind = 'builtin')"
            )
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *sglang_server_args(engine, model, engine.host, port, run_secret(shared)),
        ]
    raise FleetError(f"engine.kind = {engine.kind!r}: must be one of {ENGINE_KINDS}")


def sglang_server_args(
    engine: EngineConfig, model: Path | str, host: str, port: int, api_key: str | None = None
) -> list[str]:
    """The arguments of ``python -m sglang.launch_server`` that serve ``model`` as ``[engine]`` says, on
    ``host:port``, requiring ``api_key`` (the run secret) on all but its probes: the one home of the SGLang
    launch line (the fleet, the engine role, a generated compose file)."""
    args = [
        "--model-path", str(model),
        "--host", host,
        "--port", str(port),
        # The device plan (streamrl up) hands each engine only its own GPUs: its TP group starts at device 0.
        "--base-gpu-id", "0",
        "--tp-size", str(engine.tp_size),
        "--mem-fraction-static", str(engine.mem_fraction_static),
        "--max-running-requests", str(engine.max_running_requests),
    ]  # fmt: skip
    if engine.seed is not None:
        args += ["--random-seed", str(engine.seed)]
    if engine.served_model_name:
        args += ["--served-model-name", engine.served_model_name]
    if engine.max_context_len:
        args += ["--context-length", str(engine.max_context_len)]
    if engine.dtype != "auto":
        args += ["--dtype", engine.dtype]
    # Options whose unset value is SGLang's own default reach it only when set. (chunked_prefill_size,
    # kv_block_size and max_prefill_tokens have defaults sized for the built-in engine and stay its own; set
    # SGLang's through extra_args.)
    if engine.disable_radix_cache:
        args.append("--disable-radix-cache")
    if engine.max_total_tokens is not None:
        args += ["--max-total-tokens", str(engine.max_total_tokens)]
    if api_key:
        args += ["--api-key", api_key]
    return args + list(engine.extra_args)


def engine_ranks(engine: EngineConfig) -> int:
    """Ranks one engine contributes to the weight-update group."""
    return engine.tp_size if engine.kind == "sglang" else 1


@dataclass
class ManagedEngine:
    """One launched engine process."""

    index: int
    port: int
    url: str
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    state: str = "stopped"  # starting | healthy | dead | stopped

    @property
    def engine_id(self) -> str:
        return engine_id_for(self.url)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None


def _tail(path: Path, lines: int = 20) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Fleet:
    """Launches and keeps ``count`` engines (see the module docstring)."""

    def __init__(
        self,
        shared: SharedConfig,
        engine: EngineConfig,
        registry: EngineRegistry | None = None,
        *,
        count: int | None = None,
        ports: list[int] | None = None,
        log_dir: Path | None = None,
        poll_s: float = 0.5,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        if engine.kind not in ENGINE_KINDS:
            raise FleetError(f"engine.kind = {engine.kind!r}: must be one of {ENGINE_KINDS}")
        self.shared, self.engine, self.registry = shared, engine, registry
        n = engine.count if count is None else count
        ports = ports or [engine.base_port + i for i in range(n)]
        if len(ports) != n:
            raise FleetError(f"{n} engines need {n} ports, got {ports}")
        log_dir = Path(log_dir or Path(shared.run_dir) / "logs")
        self.engines = [
            ManagedEngine(i, port, f"http://{engine.host}:{port}", log_dir / f"engine-{i}.log")
            for i, port in enumerate(ports)
        ]
        self.poll_s = poll_s
        self.extra_env = dict(extra_env or {})
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.engines]

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> list[str]:
        """Launch every engine and wait until all answer /health; on a failure, stop the others and raise."""
        engine_command(self.shared, self.engine, self.engines[0].port)  # fail fast: kind, sglang, model path
        self._session = aiohttp.ClientSession(headers=auth_headers(run_secret(self.shared)))
        self._stopping = False
        try:
            await asyncio.gather(*(self._launch(m) for m in self.engines))
        except BaseException:
            await self.stop()
            raise
        return self.urls

    async def _launch(self, m: ManagedEngine) -> None:
        cmd = engine_command(self.shared, self.engine, m.port, m.index)
        m.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(m.log_path, "ab") as out:
            m.process = await asyncio.create_subprocess_exec(
                *cmd,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **self.extra_env},
            )
        m.state = "starting"
        log.info("launched engine %d (pid %d) on %s, log %s", m.index, m.process.pid, m.url, m.log_path)
        if self.registry is not None:
            await self.registry.register(
                m.url,
                ranks=engine_ranks(self.engine),
                kind=self.engine.kind,
                source="fleet",
                pid=m.pid,
                health="starting",
            )
        await self._wait_ready(m)
        m.state = "healthy"
        if self.registry is not None:
            await self.registry.update(m.engine_id, health="healthy", pid=m.pid, error="")

    async def _wait_ready(self, m: ManagedEngine) -> None:
        assert self._session is not None and m.process is not None
        client = EngineClient(self._session, m.url, self.engine.launch_timeout_s, 5.0)
        ready = asyncio.create_task(wait_until_healthy(client, self.engine.launch_timeout_s))
        exited = asyncio.create_task(m.process.wait())
        done, _ = await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        if ready in done:
            exited.cancel()
            try:
                ready.result()
                return
            except TimeoutError as exc:
                self._terminate(m, signal.SIGKILL)
                raise FleetError(f"{exc}; log tail of {m.log_path}:\n{_tail(m.log_path)}") from None
        ready.cancel()
        raise FleetError(
            f"engine {m.index} ({m.url}) exited with code {m.process.returncode} before it was healthy; "
            f"log tail of {m.log_path}:\n{_tail(m.log_path)}"
        )

    async def supervise(self, stop: asyncio.Event) -> None:
        """Until ``stop``: relaunch an engine that died (at most ``engine.max_restarts`` times each)."""
        while not stop.is_set():
            for m in self.engines:
                if m.state in ("healthy", "starting") and not m.alive() and not self._stopping:
                    await self._on_death(m)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_s)

    async def _on_death(self, m: ManagedEngine) -> None:
        code = None if m.process is None else m.process.returncode
        m.state = "dead"
        log.warning("engine %d (%s) exited with code %s", m.index, m.url, code)
        if self.registry is not None:
            await self.registry.update(m.engine_id, health="dead", error=f"exit code {code}")
        if m.restarts >= self.engine.max_restarts:
            log.error("engine %d died %d times; not restarting it", m.index, m.restarts + 1)
            return
        m.restarts += 1
        try:
            await self._launch(m)
            log.info("engine %d restarted (%d of %d)", m.index, m.restarts, self.engine.max_restarts)
        except FleetError as exc:
            m.state = "dead"
            log.error("restart of engine %d failed: %s", m.index, exc)
            if self.registry is not None:
                await self.registry.update(m.engine_id, health="dead", error=str(exc)[:500])

    def _terminate(self, m: ManagedEngine, sig: int) -> None:
        if m.alive():
            assert m.process is not None
            with contextlib.suppress(ProcessLookupError):
                m.process.send_signal(sig)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> int | None:
        """Send ``sig`` to engine ``index`` (tests and operators); returns its pid."""
        m = self.engines[index]
        self._terminate(m, sig)
        return m.pid

    async def stop(self) -> None:
        """SIGTERM every engine (they answer in-flight requests, then exit), SIGKILL what is left after the
        engine's shutdown timeout, and remove them from the registry."""
        self._stopping = True
        for m in self.engines:
            self._terminate(m, signal.SIGTERM)
        grace = self.engine.shutdown_timeout_s + 5.0
        for m in self.engines:
            if m.process is None:
                continue
            try:
                await asyncio.wait_for(m.process.wait(), grace)
            except TimeoutError:
                self._terminate(m, signal.SIGKILL)
                await m.process.wait()
            m.state = "stopped"
            if self.registry is not None:
                with contextlib.suppress(Exception):
                    await self.registry.remove(m.engine_id)
        if self._session is not None:
            await self._session.close()
            self._session = None
