"""The supervisor with real child processes: per-child logs, one dies -> all stop, restart, SIGTERM stop."""

from __future__ import annotations

import sys
from pathlib import Path

from streamrl.supervisor import ChildSpec, Supervisor

SLEEPER = "import signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: (print('drained', flush=True), sys.exit(0))); print('up', flush=True); time.sleep(600)"


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_one_dies_all_stop_with_reason(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs", grace_s=10, poll_s=0.05)
    sleeper = sup.start(ChildSpec("sleeper", _py(SLEEPER)))
    sup.start(ChildSpec("crasher", _py("import sys; print('boom: bad weights', flush=True); sys.exit(3)")))
    assert sup.watch() == 1
    assert sup.failure is not None
    assert "crasher" in sup.failure and "exit code 3" in sup.failure and "boom: bad weights" in sup.failure
    assert sleeper.process.returncode == 0  # stopped by SIGTERM and drained, not killed
    assert "drained" in (tmp_path / "logs" / "sleeper.log").read_text()


def test_restart_on_failure_is_bounded(tmp_path: Path) -> None:
    counter = tmp_path / "count"
    code = f"import pathlib,sys; p=pathlib.Path({str(counter)!r}); p.write_text(p.read_text()+'x' if p.exists() else 'x'); sys.exit(1)"
    sup = Supervisor(tmp_path / "logs", grace_s=5, poll_s=0.05)
    sup.start(ChildSpec("flaky", _py(code), restart="on-failure", max_restarts=2))
    assert sup.watch() == 1
    assert counter.read_text() == "xxx"  # first run + 2 restarts, then the supervisor gives up


def test_finishing_child_ends_run_cleanly(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs", grace_s=10, poll_s=0.05)
    sleeper = sup.start(ChildSpec("daemon", _py(SLEEPER)))
    sup.start(ChildSpec("job", _py("print('done')"), finishes_run=True))
    assert sup.watch() == 0
    assert sleeper.process.returncode == 0


def test_stop_request_and_readiness(tmp_path: Path) -> None:
    marker = tmp_path / "ready"
    sup = Supervisor(tmp_path / "logs", grace_s=10, poll_s=0.05)
    code = f"import pathlib,time; time.sleep(0.3); pathlib.Path({str(marker)!r}).write_text('1'); " + SLEEPER
    state = sup.start(ChildSpec("slow-start", _py(code), ready=marker.exists))
    assert marker.exists()  # start() returned only after the readiness probe passed
    sup.stop_requested.set()
    assert sup.watch() == 0
    assert state.process.returncode == 0


def test_killer_does_not_wait_forever(tmp_path: Path) -> None:
    stubborn = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    sup = Supervisor(tmp_path / "logs", grace_s=0.5, poll_s=0.05)
    state = sup.start(
        ChildSpec(
            "stubborn",
            _py(stubborn),
            ready=lambda: (tmp_path / "logs" / "stubborn.log").read_text() == "up\n",
        )
    )
    sup.stop_requested.set()
    sup.watch()
    assert state.process.returncode == -9
