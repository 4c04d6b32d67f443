"""A thin process supervisor: each role a child process with its own log; one dies, all stop (or it restarts).

Modelled on prime-rl's ``rl`` entrypoint and PipelineRL's launcher: children are started in order, each waits
for its readiness check before the next starts, and the supervisor then watches them. When a child exits
unexpectedly the supervisor says which one died, with its exit code and the tail of its log, and either
restarts it (``restart="on-failure"``, bounded) or stops the others in reverse order: SIGTERM, a grace
period, then SIGKILL. A SIGTERM or SIGINT to the supervisor stops everything the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

log = logging.getLogger("streamrl.supervisor")


@dataclass
class ChildSpec:
    """One role process."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready: Callable[[], bool] | None = None  # polled after start until True (or the child dies)
    ready_timeout_s: float = 120.0
    restart: Literal["never", "on-failure"] = "never"
    max_restarts: int = 3
    # A child that exits 0 on its own (a one-shot job) ends the run when it is `finishes_run`.
    finishes_run: bool = False


@dataclass
class ChildState:
    spec: ChildSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    restarts: int = 0


class ChildFailed(RuntimeError):
    """A child exited unexpectedly; the message names it, its exit code and its log tail."""


def tail(path: Path, lines: int = 15) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Supervisor:
    def __init__(self, log_dir: Path, grace_s: float = 20.0, poll_s: float = 0.2) -> None:
        self.log_dir = Path(log_dir)
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.children: list[ChildState] = []
        self.stop_requested = threading.Event()
        self.failure: str | None = None

    def _spawn(self, spec: ChildSpec) -> ChildState:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "ab") as fh:
            process = subprocess.Popen(
                spec.argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **spec.env},
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops children in order
            )
        log.info("started %s (pid %d), log %s", spec.name, process.pid, log_path)
        return ChildState(spec, process, log_path)

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
        return f"{state.spec.name} (pid {state.process.pid}) died with {how}; last lines of {state.log_path}:\n{tail(state.log_path)}"

    def start(self, spec: ChildSpec) -> ChildState:
        state = self._spawn(spec)
        self.children.append(state)
        self._wait_ready(state)
        return state

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self._on_signal(signum))

    def _on_signal(self, signum: int) -> None:
        log.info("received %s: stopping all roles", signal.Signals(signum).name)
        self.stop_requested.set()

    def watch(self, on_tick: Callable[[], None] | None = None, stop_at_end: bool = True) -> int:
        """Supervise until a stop is requested, a finishing child exits 0, or a child fails; then stop all
        (unless ``stop_at_end`` is False and the run finished cleanly: the caller still needs the others).

        Returns 0 for a clean stop and 1 when a child failed (``self.failure`` says which and why).
        """
        try:
            while not self.stop_requested.is_set():
                if self._check_children():
                    break
                if on_tick is not None:
                    on_tick()
                self.stop_requested.wait(self.poll_s)
        except ChildFailed as exc:
            self.failure = str(exc)
        finally:
            if stop_at_end or self.failure or self.stop_requested.is_set():
                self.stop_all()
        if self.failure:
            log.error("%s", self.failure)
            return 1
        return 0

    def _check_children(self) -> bool:
        """True when the run is finished; raises ChildFailed for an unexpected death."""
        for state in list(self.children):
            code = state.process.poll()
            if code is None:
                continue
            if code == 0 and state.spec.finishes_run:
                log.info("%s finished", state.spec.name)
                return True
            if state.spec.restart == "on-failure" and state.restarts < state.spec.max_restarts:
                log.warning(
                    "%s; restarting (%d/%d)",
                    self._death_message(state),
                    state.restarts + 1,
                    state.spec.max_restarts,
                )
                fresh = self._spawn(state.spec)
                fresh.restarts = state.restarts + 1
                self.children[self.children.index(state)] = fresh
                continue
            raise ChildFailed(self._death_message(state))
        return False

    def stop_all(self) -> None:
        """SIGTERM every live child in reverse start order, wait the grace period, then SIGKILL."""
        for state in reversed(self.children):
            if state.process.poll() is None:
                log.info("stopping %s (pid %d)", state.spec.name, state.process.pid)
                state.process.send_signal(signal.SIGTERM)
                try:
                    state.process.wait(timeout=self.grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs: killing it", state.spec.name, self.grace_s)
                    state.process.kill()
                    state.process.wait()
