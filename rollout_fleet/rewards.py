"""Rewards in a pool of worker processes with a timeout, so a verifier can never stall a rollout worker.

    async with RewardPool(workers=2, timeout_s=5.0) as pool:
        result = await pool.score("arithmetic", prompt, completion)          # a task's verifier, by name
        result = await pool.score("my_pkg.rewards:fn", prompt, completion)   # a custom function, by import path

A scorer is a task name (``get_task(name, **options).score``), a Task class by import path, or a function by
import path called as ``fn(prompt, completion, **options)`` that returns a number, a mapping with a ``"reward"``
key (the other keys are components), or a :class:`RewardResult`. A function that names them (or takes
``**kwargs``) also gets the sample's length as keyword arguments (:class:`SampleLength`: ``truncated``,
``output_tokens``, ``max_output_tokens``), what DAPO's length shaping needs; a two-argument function keeps
working. :func:`overlong_penalty` is DAPO's soft overlong punishment (``rollout.reward.overlong_buffer``).

Outcomes: ``ok``; ``timeout`` (the call ran past ``timeout_s``: the worker is killed with SIGKILL and replaced,
reward 0); ``error`` (the function raised, returned something unusable or non-finite, or its process died:
reward 0, the message says which). Every component comes back, not only the total. Workers start with the
``forkserver`` (default) or ``spawn`` method, never ``fork`` (the parent has threads), and limit torch to one
thread if the scorer imports it. Each worker caps its own address space (``RLIMIT_AS``, ``max_memory_bytes``)
before it loads any scorer, so a verifier that allocates without bound gets a MemoryError (an ``error``), not
the host's memory. ``pool.stats`` counts outcomes and restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import multiprocessing as mp
import os
import resource
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from multiprocessing.connection import Connection
from typing import Any

from rollout_fleet.tasks import Prompt, RewardResult, Task, get_task, load_object

START_METHODS = ("forkserver", "spawn")


class RewardFunctionError(ValueError):
    """A reward function returned something that is not a usable reward."""


@dataclass(frozen=True)
class SampleLength:
    """A scored sample's length: whether it hit the output budget, its generated tokens and that budget."""

    truncated: bool
    output_tokens: int
    max_output_tokens: int


LENGTH_ARGUMENTS = tuple(f.name for f in fields(SampleLength))  # the keyword arguments a function may name


def overlong_penalty(output_tokens: int, max_output_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_output_tokens - buffer`` tokens, then falling linearly to
    ``-factor`` at the budget (and below it past the budget): ``min(0, -(L - (L_max - buffer)) / buffer *
    factor)``, as DAPO's reward manager computes it. ``buffer`` 0 turns it off."""
    if buffer <= 0:
        return 0.0
    exceed = output_tokens - (max_output_tokens - buffer)
    return min(0.0, -exceed / buffer * factor)


# ---- worker side -------------------------------------------------------------------------------------------
def resolve_scorer(scorer: str, options: Mapping[str, Any]) -> Callable[..., Any]:
    """The callable behind a scorer name or import path, as ``f(prompt, completion, length=None)`` (see the
    module docstring: only a function that asks for the length gets it)."""
    obj = load_object(scorer, "reward function") if ":" in scorer else None
    if obj is None or (isinstance(obj, type) and issubclass(obj, Task)):
        task_score = get_task(scorer, **options).score  # a task's verifier: (prompt, completion)
        return lambda prompt, completion, length=None: task_score(prompt, completion)
    if not callable(obj):
        raise RewardFunctionError(f"reward function {scorer!r} is a {type(obj).__name__}, not callable")
    takes = length_arguments(obj)
    return lambda prompt, completion, length=None: obj(
        prompt, completion, **options, **_length_kwargs(length, takes)
    )


def length_arguments(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Which of :data:`LENGTH_ARGUMENTS` ``fn`` takes by keyword (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: two arguments only
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return LENGTH_ARGUMENTS
    return tuple(name for name in LENGTH_ARGUMENTS if name in params)


def _length_kwargs(length: SampleLength | None, takes: tuple[str, ...]) -> dict[str, Any]:
    if length is None:
        return {}
    return {k: v for k, v in asdict(length).items() if k in takes}


def normalize(value: Any, scorer: str) -> tuple[float, dict[str, float]]:
    """(reward, components) from what a scorer returned; non-finite or non-numeric values are errors."""
    if isinstance(value, RewardResult):
        reward, components = value.reward, dict(value.components)
    elif isinstance(value, Mapping):
        if "reward" not in value:
            raise RewardFunctionError(
                f"reward function {scorer!r} returned a mapping without a 'reward' key: {value!r}"
            )
        reward, components = value["reward"], {k: v for k, v in value.items() if k != "reward"}
    else:
        reward, components = value, {}
    named = {"reward": reward, **{f"component {k!r}": v for k, v in components.items()}}
    for name, number in named.items():
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise RewardFunctionError(
                f"reward function {scorer!r} returned {name} = {number!r}, not a number"
            )
        if not math.isfinite(number):
            raise RewardFunctionError(f"reward function {scorer!r} returned a non-finite {name}: {number}")
    return float(reward), {str(k): float(v) for k, v in components.items()}


def _limit_threads() -> bool:
    """One torch thread once torch is imported (by a scorer); True when done."""
    if "torch" not in sys.modules:
        return False
    sys.modules["torch"].set_num_threads(1)
    return True


def _worker_main(conn: Connection, max_memory_bytes: int | None = None) -> None:
    """Serve (job, scorer, options, prompt, completion, length) requests until a None or EOF arrives."""
    if max_memory_bytes is not None:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        if hard != resource.RLIM_INFINITY:
            max_memory_bytes = min(max_memory_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, hard))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"  # read by torch / numpy when a scorer imports them
    torch_limited = False
    scorers: dict[str, Callable[..., Any]] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job, scorer, options, prompt, completion, length = message
        key = scorer + json.dumps(options, sort_keys=True, default=repr)
        try:
            if key not in scorers:
                scorers[key] = resolve_scorer(scorer, options)
        except Exception as e:  # noqa: BLE001 - reported to the caller, never kills the worker
            conn.send((job, "error", f"cannot load reward {scorer!r}: {type(e).__name__}: {e}"))
            continue
        conn.send((job, "begin"))
        try:
            value = scorers[key](prompt, completion, length)
            torch_limited = torch_limited or _limit_threads()
            reward, components = normalize(value, scorer)
        except MemoryError:
            limit = resource.getrlimit(resource.RLIMIT_AS)[0]
            conn.send(
                (job, "error", f"MemoryError: the reward worker's memory limit ({limit} bytes) was reached")
            )
            continue
        except Exception as e:  # noqa: BLE001
            conn.send((job, "error", f"{type(e).__name__}: {e}"))
            continue
        conn.send((job, "ok", reward, components))


# ---- parent side -------------------------------------------------------------------------------------------
@dataclass
class _Slot:
    process: Any = None
    conn: Connection | None = None
    healthy: bool = False
    starts: int = 0


class RewardPool:
    """A fixed number of reward worker processes; ``score`` is a coroutine, one job per worker at a time.

    ``timeout_s`` bounds the reward call itself; ``load_timeout_s`` bounds starting a worker and importing a
    scorer the first time (imports can be slow, and they are not the verifier's fault). ``max_memory_bytes``
    is each worker's address-space limit (RLIMIT_AS), None for none.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 5.0,
        load_timeout_s: float = 60.0,
        start_method: str = "forkserver",
        max_memory_bytes: int | None = None,
    ) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"reward workers must be an int >= 1, got {workers!r}")
        if not timeout_s > 0 or not load_timeout_s > 0:
            raise ValueError(
                f"reward timeouts must be > 0, got timeout_s={timeout_s}, load_timeout_s={load_timeout_s}"
            )
        if start_method not in START_METHODS:
            raise ValueError(f"reward start_method must be one of {START_METHODS}, got {start_method!r}")
        if max_memory_bytes is not None and max_memory_bytes < 1 << 26:
            raise ValueError(f"reward max_memory_bytes must be >= 64 MiB or None, got {max_memory_bytes!r}")
        self.workers, self.timeout_s, self.load_timeout_s = workers, timeout_s, load_timeout_s
        self.max_memory_bytes = max_memory_bytes
        self._ctx = mp.get_context(start_method)
        self._slots = [_Slot() for _ in range(workers)]
        self._idle: asyncio.Queue[_Slot] | None = None
        self._jobs = 0
        self.stats: Counter[str] = Counter()

    async def __aenter__(self) -> RewardPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def start(self) -> None:
        """Start every worker and wait until each is ready."""
        if self._idle is not None:
            return
        self._idle = asyncio.Queue()
        try:
            await asyncio.gather(*(self._restart(slot) for slot in self._slots))
        except BaseException:
            self.close()  # no half-started pool: callers would wait forever for a free worker
            raise
        for slot in self._slots:
            self._idle.put_nowait(slot)

    def pids(self) -> list[int]:
        """Worker process ids (for tests and diagnostics)."""
        return [s.process.pid for s in self._slots if s.process is not None and s.process.is_alive()]

    async def score(
        self,
        scorer: str,
        prompt: Prompt,
        completion: str,
        options: Mapping[str, Any] | None = None,
        length: SampleLength | None = None,
    ) -> RewardResult:
        """The reward of one completion; never raises for anything the scorer does. ``length`` goes to a
        function that asks for it (module docstring)."""
        await self.start()
        assert self._idle is not None
        slot = await self._idle.get()
        try:
            result = await self._run(slot, scorer, dict(options or {}), prompt, completion, length)
        finally:
            self._idle.put_nowait(slot)
        self.stats[result.status] += 1
        return result

    async def _run(
        self,
        slot: _Slot,
        scorer: str,
        options: dict[str, Any],
        prompt: Prompt,
        completion: str,
        length: SampleLength | None,
    ) -> RewardResult:
        if not slot.healthy or not slot.process.is_alive():
            try:
                await self._restart(slot)
            except RuntimeError as e:
                return RewardResult.failed("error", f"reward {scorer!r} not run: {e}")
        self._jobs += 1
        job, limit = self._jobs, self.load_timeout_s
        try:
            assert slot.conn is not None
            slot.conn.send((job, scorer, options, prompt, completion, length))
            reply = await self._receive(slot, limit)
            if reply[:2] == (job, "begin"):
                limit = self.timeout_s
                reply = await self._receive(slot, limit)
        except asyncio.CancelledError:  # the caller gave up: a late answer would confuse the next job
            self._kill(slot)
            raise
        except TimeoutError:
            pid = slot.process.pid
            self._kill(slot)
            await self._replace(slot)
            return RewardResult.failed(
                "timeout", f"reward {scorer!r} ran past {limit} s; worker {pid} killed"
            )
        except (EOFError, OSError):
            code = self._kill(slot)
            await self._replace(slot)
            return RewardResult.failed("error", f"reward worker running {scorer!r} died (exit code {code})")
        if reply[0] != job:
            self._kill(slot)
            return RewardResult.failed("error", f"reward worker answered {reply!r} to job {job}")
        if reply[1] == "ok":
            return RewardResult(reward=reply[2], components=reply[3])
        return RewardResult.failed("error", f"reward {scorer!r} failed: {reply[2]}")

    async def _receive(self, slot: _Slot, timeout: float) -> tuple[Any, ...]:
        """The worker's next message, waiting on the pipe's descriptor in the event loop (no thread)."""
        assert slot.conn is not None
        if not slot.conn.poll():
            loop = asyncio.get_running_loop()
            readable = loop.create_future()
            fd = slot.conn.fileno()
            loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
            try:
                await asyncio.wait_for(readable, timeout)
            finally:
                loop.remove_reader(fd)
        return slot.conn.recv()

    async def _replace(self, slot: _Slot) -> None:
        """Start a replacement now, so the pool is back to full strength; a failure is retried on next use."""
        try:
            await self._restart(slot)
        except RuntimeError:
            self._kill(slot)

    async def _restart(self, slot: _Slot) -> None:
        self._kill(slot)
        if slot.starts:
            self.stats["restarts"] += 1
        slot.starts += 1
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.max_memory_bytes), name="streamrl-reward", daemon=True
        )
        process.start()
        child.close()
        slot.process, slot.conn = process, parent
        try:
            reply = await self._receive(slot, self.load_timeout_s)
        except TimeoutError:
            self._kill(slot)
            raise RuntimeError(f"reward worker did not start within {self.load_timeout_s} s") from None
        except (EOFError, OSError):
            code = self._kill(slot)
            raise RuntimeError(
                f"reward worker exited while starting (exit code {code}); see its stderr"
            ) from None
        if reply[0] != "ready":
            self._kill(slot)
            raise RuntimeError(f"reward worker sent {reply!r} instead of ready")
        slot.healthy = True

    def _kill(self, slot: _Slot) -> int | None:
        """SIGKILL the slot's process (if any) and reap it; returns its exit code."""
        slot.healthy = False
        code = None
        if slot.process is not None:
            if slot.process.is_alive():
                slot.process.kill()
            slot.process.join(timeout=5)
            code = slot.process.exitcode
        if slot.conn is not None:
            slot.conn.close()
        slot.process, slot.conn = None, None
        return code

    def close(self) -> None:
        """Ask every worker to exit, then kill any that has not within a second."""
        for slot in self._slots:
            if slot.conn is not None and slot.process is not None and slot.process.is_alive():
                with contextlib.suppress(OSError):
                    slot.conn.send(None)
        for slot in self._slots:
            if slot.process is not None:
                slot.process.join(timeout=1)
            self._kill(slot)
        self._idle = None
