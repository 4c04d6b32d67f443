"""Process lifetimes shared by every launcher: children that die with their parent, and leftovers found again.

- :func:`die_with_parent` is a ``preexec_fn`` for ``subprocess.Popen``: the child asks the kernel
  (``prctl(PR_SET_PDEATHSIG)``) for a signal when its parent dies, and sends it to itself at once if the parent
  is already gone. A role whose supervisor is killed (``kill -9 streamrl up``) thereby gets SIGTERM and drains
  by itself; a learner rank or a Redis server whose launcher is killed gets SIGKILL (a second copy of it
  starting beside the survivor would be worse than losing it: checkpoints and the AOF are crash-safe).
- :class:`ProcessRecord` names a process by pid *and* start time, so a record of a process that has since
  exited is never mistaken for an unrelated process that got the same pid; :func:`stop_leftovers` ends
  recorded processes that are still alive (SIGTERM, a grace period, SIGKILL).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` (runs in the child between fork and exec) that delivers ``sig`` to the child when the
    process that started it dies. Linux only; elsewhere it does nothing."""
    parent = os.getpid()

    def arm() -> None:
        if not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), sig)

    return arm


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None when it is gone
    (or this is not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its closing parenthesis
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])


@dataclass(frozen=True)
class ProcessRecord:
    """A process by pid and start time, and what it was (for messages)."""

    name: str
    pid: int
    started: int | None

    @classmethod
    def of(cls, name: str, pid: int) -> ProcessRecord:
        return cls(name, pid, start_time(pid))

    def alive(self) -> bool:
        """Still the same process (same pid, same start time), and not a zombie whose every thread has ended.

        A killed process's main thread can be a zombie while another of its threads is still exiting (Redis's
        background thread blocked in an fsync of the AOF, under disk load, for seconds): that thread still holds
        the process's files, its listening socket and its AOF among them, so the process is not gone yet."""
        if self.started is None or start_time(self.pid) != self.started:
            return False
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                return True
            return (
                len(os.listdir(f"/proc/{self.pid}/task")) > 1
            )  # the zombie leader, and threads still exiting
        except OSError:
            return False


def write_records(path: Path, records: Iterable[ProcessRecord]) -> None:
    """Write the records atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in records], indent=1) + "\n")
    tmp.replace(path)


def read_records(path: Path) -> list[ProcessRecord]:
    """The records in ``path``; none when it is missing or unreadable."""
    try:
        return [ProcessRecord(**r) for r in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return []


def stop_leftovers(records: Iterable[ProcessRecord], grace_s: float, log: Callable[[str], None]) -> int:
    """SIGTERM (and SIGCONT) every recorded process that is still alive, wait up to ``grace_s`` for them, SIGKILL
    the rest.
    Returns how many were found alive."""
    alive = [r for r in records if r.alive()]
    for r in alive:
        log(f"a process of an earlier run is still alive: {r.name} (pid {r.pid}); stopping it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.pid, signal.SIGTERM)
            os.kill(r.pid, signal.SIGCONT)  # a stopped process handles its SIGTERM only once it runs
    deadline = time.monotonic() + grace_s
    while any(r.alive() for r in alive) and time.monotonic() < deadline:
        time.sleep(0.1)
    for r in alive:
        if r.alive():
            log(f"{r.name} (pid {r.pid}) did not stop within {grace_s:.0f} s: killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(r.alive() for r in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(alive)


CRASH_AT_ENV = (
    "STREAMRL_CRASH_AT"  # "<point>" or "<point>@<n>": SIGKILL this process the n-th time it passes there
)
CRASH_RANK_ENV = "STREAMRL_CRASH_RANK"  # only the process whose RANK is this one (default: any)
CRASH_GROUP_ENV = "STREAMRL_CRASH_GROUP"  # "1": SIGKILL the whole process group (every learner rank at once)
_crash_passes: dict[str, int] = {}


def crash_point(name: str) -> None:
    """A named place where a test can kill this process with SIGKILL (``STREAMRL_CRASH_AT=name[@n]``), to put a
    crash exactly inside a window that load only hits now and then. Nothing happens unless the variable names
    this point; the tests that use it are the exactly-once tests (tests/test_learner_train.py)."""
    wanted = os.environ.get(CRASH_AT_ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition("@")
    if point != name:
        return
    rank = os.environ.get(CRASH_RANK_ENV)
    if rank is not None and os.environ.get("RANK", "0") != rank:
        return
    _crash_passes[name] = _crash_passes.get(name, 0) + 1
    if _crash_passes[name] < int(nth or 1):
        return
    sys.stderr.write(f"crash point {name} (pass {_crash_passes[name]}): SIGKILL\n")
    sys.stderr.flush()
    if os.environ.get(CRASH_GROUP_ENV) == "1":
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_process(code: int) -> NoReturn:
    """End a role process that returned ``code`` without the interpreter's teardown: the atexit handlers run
    (logging's flush, wandb, multiprocessing's clean-up, weakref finalizers), stdout and stderr are flushed, then
    ``os._exit``. What is skipped is freeing every module one by one: with torch, transformers and dynamo
    imported that took 0.5 to 2 CPU seconds per process here, paid by every role's stop and restart. A process
    that still runs a non-daemon thread (an unfinished writer) exits the normal way, which waits for it."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if any(t.is_alive() for t in others):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing left to flush
            stream.flush()
    os._exit(code)
