"""A background load like the test suite's, for measurements that must meet the machine CI meets.

The suite's load is not two busy cores: tests start and kill process trees (2-rank learners, Redis servers,
supervised roles), write and fsync checkpoints and load the disk, all at once. A timing window that busy loops
never hit (issue 34: a kill landing between a checkpoint's rename and its pointer update) is hit there. So the
load here *is* a slice of the suite: :data:`LOAD_TESTS`, run again and again by pytest in the background, each
round in a fresh temporary directory and its own process group, until the load is stopped.

    with SuiteLoad(work_dir) as load:
        ...                       # the measurement
    load.stats()                  # rounds run, how many failed, seconds

``python -m benchmarks.load --seconds N`` runs it alone (to watch what it does to a machine).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parent.parent
# Process trees started and killed, checkpoints written and read back, Redis servers started and killed.
LOAD_TESTS = (
    "tests/test_learner_checkpoint.py",
    "tests/test_learner_train.py::test_learner_trains_filters_stale_and_acknowledges",
    "tests/test_broker_crash.py",
    "tests/test_supervisor.py",
    "tests/test_learner_fsdp.py",
)


class SuiteLoad:
    """Runs :data:`LOAD_TESTS` in a loop in the background while the ``with`` block runs."""

    def __init__(self, work_dir: Path, tests: Sequence[str] = LOAD_TESTS) -> None:
        self.work_dir = Path(work_dir)
        self.tests = list(tests)
        self.rounds = 0  # finished rounds
        self.failed_rounds = (
            0  # rounds whose pytest exited non-zero (the load's own tests, not the measurement)
        )
        self.started = 0.0
        self.stopped = 0.0
        self._stop = threading.Event()
        self._current: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._loop, name="suite-load", daemon=True)

    def __enter__(self) -> SuiteLoad:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        current = self._current
        if current is not None and current.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(current.pid, signal.SIGKILL)
        self._thread.join(60)
        self.stopped = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.is_set():
            round_dir = self.work_dir / f"round-{self.rounds}"
            command = [
                sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not slow",
                f"--basetemp={round_dir}", "-o", "addopts=-p no:valkey", *self.tests,
            ]  # fmt: skip
            with open(self.work_dir / "load.log", "a") as log:
                self._current = subprocess.Popen(
                    command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                code = self._current.wait()
            if self._stop.is_set():
                break
            self.rounds += 1
            self.failed_rounds += code != 0
            subprocess.run(["rm", "-rf", str(round_dir)], check=False)

    def stats(self) -> dict[str, float]:
        """What the load did: finished rounds, failed rounds, seconds it ran."""
        end = self.stopped or time.monotonic()
        return {
            "rounds": self.rounds,
            "failed_rounds": self.failed_rounds,
            "seconds": round(end - self.started, 1),
            "tests": ", ".join(self.tests),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60, help="how long to run the load (default 60)")
    parser.add_argument("--work", type=Path, required=True, help="directory for the load's temporary files")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds = {args.seconds}: must be > 0")
    with SuiteLoad(args.work) as load:
        time.sleep(args.seconds)
    print(load.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
