"""A thin process supervisor: each role a child process with its own log; a role that dies is restarted within
its budget, and the run stops only when a budget is spent.

Modelled on prime-rl's ``rl`` entrypoint and PipelineRL's launcher: children are started in order, each waits
for its readiness check before the next starts, and the supervisor then watches them.

- A child that exits unexpectedly is named with its exit code and the tail of its log, and restarted after a
  back-off (``restart_delay_s``, doubling with each restart in the window, at most 30 s), as long as it died at
  most ``max_restarts`` times within ``restart_window_s`` (``restart="on-failure"``: not after a clean exit;
  ``"always"``: also after one). Exit code 2 means a configuration error in every role: restarting cannot
  help, so the run stops. When the budget is spent, the others are stopped in reverse order of their start
  stages (SIGTERM to a stage's children together, a grace period, SIGKILL) and ``failure`` says which role and
  why.
- A child that exits 0 with ``finishes_run`` ends the run. An inessential child (``essential=False``: the
  archiver) whose budget is spent is left stopped and the run goes on.
- Every child gets SIGTERM when the supervisor itself dies (``common.lifecycle.die_with_parent``), so a
  ``kill -9`` of the supervisor leaves nothing running; ``records_path`` keeps the children's pids and start
  times, so the next start of the same run can stop any that are still draining.
- SIGTERM or SIGINT to the supervisor stops everything the same way.
- With ``log_max_bytes`` set, every log in ``log_dir`` that passed it is rotated (streamrl.logs: at most
  ``log_keep`` older files of that size beside it) while the supervisor watches, and once more after a stop.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from common.lifecycle import ProcessRecord, die_with_parent, write_records
from streamrl.logs import rotate_logs

log = logging.getLogger("streamrl.supervisor")

CONFIG_ERROR_EXIT = 2  # what every role returns for a configuration it cannot accept
MAX_RESTART_DELAY_S = 30.0
# torch.distributed's rendezvous variables: a supervisor started inside a distributed job (torchrun, a benchmark
# that initialised a group) must not hand its own rank and port to the roles; the learner would take itself for
# one rank of that job and bind a port already taken.
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a role process: this one's without :data:`RANK_ENV`, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in RANK_ENV}, **(extra or {})}


@dataclass
class ChildSpec:
    """One role process."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready: Callable[[], bool] | None = None  # polled after the first start until True (or the child dies)
    ready_timeout_s: float = 120.0
    restart: Literal["never", "on-failure", "always"] = "never"
    max_restarts: int = 3  # restarts allowed within the supervisor's restart window
    # A child that exits 0 on its own (a one-shot job) ends the run when it is `finishes_run`.
    finishes_run: bool = False
    # An inessential child (the archiver) that cannot be restarted is left stopped; the run goes on.
    essential: bool = True


class Process(Protocol):
    """What the supervisor needs of a child process: a local ``subprocess.Popen``, or a launcher's handle on a
    process elsewhere (streamrl.ray_launcher) with the same methods. ``exit_note`` (optional) adds to the message
    of its death, e.g. that its node was lost."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...


# Starts one child: (its spec, the path of its log) -> its process.
Spawner = Callable[[ChildSpec, Path], Process]


@dataclass
class ChildState:
    spec: ChildSpec
    process: Process
    log_path: Path
    restarts: int = 0  # restarts so far, in all
    deaths: deque[float] = field(default_factory=deque)  # monotonic times of the deaths inside the window
    restart_at: float | None = None  # set while it waits out its back-off
    done: bool = False  # exited cleanly and is not restarted
    stage: int = 0  # which start_together call started it: children of one stage need nothing of each other


class ChildFailed(RuntimeError):
    """A child exited unexpectedly; the message names it, its exit code and its log tail."""


def tail(path: Path, lines: int = 15) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Supervisor:
    def __init__(
        self,
        log_dir: Path,
        grace_s: float = 20.0,
        poll_s: float = 0.2,
        restart_window_s: float = 3600.0,
        restart_delay_s: float = 1.0,
        records_path: Path | None = None,
        say: Callable[[str], None] | None = None,
        spawn: Spawner | None = None,
        log_max_bytes: int | None = None,
        log_keep: int = 5,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_max_bytes = log_max_bytes  # None: logs are never rotated
        self.log_keep = log_keep
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.restart_window_s = restart_window_s
        self.restart_delay_s = restart_delay_s
        self.records_path = records_path
        self.say = say or (lambda message: None)  # restarts are news for the user, not only the log
        self.spawn = spawn  # None: a local child process (the single-node supervisor)
        self.children: list[ChildState] = []
        self.stop_requested = threading.Event()
        self.failure: str | None = None

    def _spawn(self, spec: ChildSpec) -> Process:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        if self.spawn is not None:
            return self.spawn(spec, log_path)
        with open(log_path, "ab") as fh:
            process = subprocess.Popen(
                spec.argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_environment(spec.env),
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops children in order
                preexec_fn=die_with_parent(signal.SIGTERM),  # a supervisor killed outright still stops them
            )
        log.info("started %s (pid %d), log %s", spec.name, process.pid, log_path)
        return process

    def _write_records(self) -> None:
        if self.records_path is None:
            return
        records = [ProcessRecord.of("up", os.getpid())]
        # only local processes: a pid on another node means nothing here
        records += [
            ProcessRecord.of(c.spec.name, c.process.pid)
            for c in self.children
            if isinstance(c.process, subprocess.Popen)
        ]
        write_records(self.records_path, records)

    def _wait_ready(self, state: ChildState) -> None:
        if state.spec.ready is None:
            return
        deadline = time.monotonic() + state.spec.ready_timeout_s
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            if state.process.poll() is not None:
                raise ChildFailed(self._death_message(state))
            try:
                if state.spec.ready():
                    log.info("%s is ready", state.spec.name)
                    return
            except Exception as exc:  # a readiness probe that raises just means "not yet"
                log.debug("%s readiness probe: %s", state.spec.name, exc)
            time.sleep(self.poll_s)
        if not self.stop_requested.is_set():
            raise ChildFailed(
                f"{state.spec.name} was not ready within {state.spec.ready_timeout_s}s\n{tail(state.log_path)}"
            )

    def _death_message(self, state: ChildState) -> str:
        code = state.process.returncode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        note = getattr(state.process, "exit_note", None)
        how += f" ({note})" if note else ""
        return f"{state.spec.name} (pid {state.process.pid}) died with {how}; last lines of {state.log_path}:\n{tail(state.log_path)}"

    def start(self, spec: ChildSpec) -> ChildState:
        """Start ``spec`` and wait until it is ready."""
        return self.start_together([spec])[0]

    def start_together(self, specs: Sequence[ChildSpec]) -> list[ChildState]:
        """Start every spec at once, then wait until each is ready: roles that need nothing of each other start
        side by side (two engines' imports overlap each other's and Redis's start-up instead of queueing)."""
        states = self.spawn_together(specs)
        self.wait_ready(states)
        return states

    def spawn_together(self, specs: Sequence[ChildSpec]) -> list[ChildState]:
        """Start every spec at once as one stage, without waiting for readiness (:meth:`wait_ready` does)."""
        states = []
        stage = 1 + max((c.stage for c in self.children), default=-1)
        for spec in specs:
            log_path = self.log_dir / f"{spec.name}.log"
            states.append(ChildState(spec, self._spawn(spec), log_path, stage=stage))
            self.children.append(states[-1])
            self._write_records()
        return states

    def wait_ready(self, states: Sequence[ChildState]) -> None:
        """Wait until each of ``states`` is ready; ChildFailed names one that died or timed out first."""
        for state in states:
            self._wait_ready(state)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self._on_signal(signum))

    def _on_signal(self, signum: int) -> None:
        log.info("received %s: stopping all roles", signal.Signals(signum).name)
        self.stop_requested.set()

    def watch(self, on_tick: Callable[[], None] | None = None, stop_at_end: bool = True) -> int:
        """Supervise until a stop is requested, a finishing child exits 0, or a child's restart budget is spent;
        then stop all (unless ``stop_at_end`` is False: the caller still needs the others, to evaluate the final
        policy or to read the run's totals from Redis, and stops them itself).

        Returns 0 for a clean stop and 1 when a child failed (``self.failure`` says which and why).
        """
        try:
            while not self.stop_requested.is_set():
                if self._check_children():
                    break
                self.rotate_logs()
                if on_tick is not None:
                    on_tick()
                self.stop_requested.wait(self.poll_s)
        except ChildFailed as exc:
            self.failure = str(exc)
        finally:
            if stop_at_end:
                self.stop_all()
        if self.failure:
            log.error("%s", self.failure)
            return 1
        return 0

    def rotate_logs(self) -> None:
        """Rotate the logs that passed ``log_max_bytes`` (nothing when it is None)."""
        if self.log_max_bytes is not None:
            for path in rotate_logs(self.log_dir, self.log_max_bytes, self.log_keep):
                log.info("rotated %s", path)

    def _check_children(self) -> bool:
        """True when the run is finished; raises ChildFailed when a child cannot be restarted."""
        now = time.monotonic()
        for state in self.children:
            if state.done:
                continue
            if state.restart_at is not None:
                if now >= state.restart_at:
                    self._restart(state)
                continue
            code = state.process.poll()
            if code is None:
                continue
            if code == 0 and state.spec.finishes_run:
                log.info("%s finished", state.spec.name)
                return True
            self._on_exit(state, code, now)
        return False

    def _on_exit(self, state: ChildState, code: int, now: float) -> None:
        spec = state.spec
        if code == 0 and spec.restart != "always":
            log.info("%s exited cleanly", spec.name)
            state.done = True
            return
        while state.deaths and now - state.deaths[0] > self.restart_window_s:
            state.deaths.popleft()
        state.deaths.append(now)
        recent = len(state.deaths)
        if spec.restart == "never" or code == CONFIG_ERROR_EXIT:
            failure = self._death_message(state)
        elif recent > spec.max_restarts:
            failure = (
                f"{spec.name} died {recent} times within {self.restart_window_s:.0f} s, more than its restart "
                f"budget of {spec.max_restarts}; the last time: {self._death_message(state)}"
            )
        else:
            failure = None
        if failure and spec.essential:
            raise ChildFailed(failure)
        if failure:
            log.error("%s; the run goes on without it", failure)
            self.say(f"{spec.name} is stopped for good; the run goes on without it (see its log)")
            state.done = True
            return
        delay = min(MAX_RESTART_DELAY_S, self.restart_delay_s * 2 ** (recent - 1))
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        note = getattr(state.process, "exit_note", None)
        how += f" ({note})" if note else ""
        message = (
            f"{spec.name} (pid {state.process.pid}) died with {how}; restarting it in {delay:.1f} s "
            f"({recent} of {spec.max_restarts} restarts in {self.restart_window_s:.0f} s)"
        )
        log.warning("%s; last lines of its log:\n%s", message, tail(state.log_path))
        self.say(message)
        state.restart_at = now + delay

    def _restart(self, state: ChildState) -> None:
        state.process = self._spawn(state.spec)
        state.restarts += 1
        state.restart_at = None
        self._write_records()

    def stop_all(self, keep: Collection[str] = ()) -> None:
        """Stop every live child, stage by stage in reverse start order: SIGTERM to all children of a stage at
        once (they started together, so none needs another of its stage), then each gets the grace period from
        that signal before SIGKILL. The children named in ``keep`` are left running (a later call stops them)."""
        for stage in sorted({c.stage for c in self.children}, reverse=True):
            states = [c for c in self.children if c.stage == stage and c.spec.name not in keep]
            for state in states:
                state.restart_at = None
            live = [c for c in states if c.process.poll() is None]
            for state in live:
                log.info("stopping %s (pid %d)", state.spec.name, state.process.pid)
                state.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            for state in live:
                self._wait_or_kill(state, deadline)
        self.rotate_logs()  # what the roles wrote while they drained

    def _wait_or_kill(self, state: ChildState, deadline: float) -> None:
        try:
            state.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs: killing it", state.spec.name, self.grace_s)
            state.process.kill()
            state.process.wait()
