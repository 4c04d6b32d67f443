"""The supervisor with real child processes: per-child logs, restarts within a budget (then all stop, with the
reason), SIGTERM stop, and children that stop by themselves when the supervisor is killed outright."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.lifecycle import ProcessRecord, read_records
from streamrl.supervisor import ChildSpec, Supervisor

REPO = Path(__file__).resolve().parents[1]

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


def test_children_started_together_are_all_running_before_the_first_is_waited_for(tmp_path: Path) -> None:
    # each is ready only once the other has written its file: started one after the other, the first would
    # never be ready (its probe gives up after 10 s); started together, both are ready at once
    def child(name: str, other: str) -> ChildSpec:
        code = f"import pathlib,time; pathlib.Path({str(tmp_path / name)!r}).touch(); time.sleep(600)"
        return ChildSpec(name, _py(code), ready=lambda: (tmp_path / other).exists(), ready_timeout_s=10)

    sup = Supervisor(tmp_path / "logs", grace_s=5, poll_s=0.05)
    started = time.monotonic()
    a, b = sup.start_together([child("a", "b"), child("b", "a")])
    assert time.monotonic() - started < 10 and a.process.poll() is None and b.process.poll() is None
    sup.stop_all()
    assert a.process.returncode is not None and b.process.returncode is not None


def test_restart_on_failure_is_bounded(tmp_path: Path) -> None:
    counter = tmp_path / "count"
    code = f"import pathlib,sys; p=pathlib.Path({str(counter)!r}); p.write_text(p.read_text()+'x' if p.exists() else 'x'); sys.exit(1)"
    said: list[str] = []
    sup = Supervisor(tmp_path / "logs", grace_s=5, poll_s=0.05, restart_delay_s=0.01, say=said.append)
    sup.start(ChildSpec("flaky", _py(code), restart="on-failure", max_restarts=2))
    assert sup.watch() == 1
    assert counter.read_text() == "xxx"  # first run + 2 restarts, then the supervisor gives up
    assert sup.failure is not None and "died 3 times" in sup.failure and "budget of 2" in sup.failure
    assert len(said) == 2 and all("flaky" in m and "restarting" in m for m in said)


def test_an_inessential_child_out_of_restarts_is_left_stopped_and_the_run_goes_on(tmp_path: Path) -> None:
    # the archiver's case: an archive directory it cannot write makes it exit 1 on every start
    counter = tmp_path / "count"
    code = f"import pathlib,sys; p=pathlib.Path({str(counter)!r}); p.write_text(p.read_text()+'x' if p.exists() else 'x'); sys.exit(1)"
    said: list[str] = []
    sup = Supervisor(tmp_path / "logs", grace_s=5, poll_s=0.05, restart_delay_s=0.01, say=said.append)
    sleeper = sup.start(ChildSpec("daemon", _py(SLEEPER)))
    sup.start(ChildSpec("archive", _py(code), restart="on-failure", max_restarts=1, essential=False))
    sup.start(ChildSpec("job", _py("import time; time.sleep(1.5)"), finishes_run=True))
    assert (
        sup.watch() == 0 and sup.failure is None
    )  # the run ended when its job did, not when the archiver gave up
    assert counter.read_text() == "xx"  # first run + 1 restart, then left stopped
    assert any("archive is stopped for good" in m for m in said)
    assert sleeper.process.returncode == 0


def test_deaths_outside_the_window_do_not_spend_the_budget(tmp_path: Path) -> None:
    # dies every ~0.3 s, budget 1 per 0.2 s window: each death is alone in its window, so it keeps restarting
    counter = tmp_path / "count"
    code = f"import pathlib,sys,time; time.sleep(0.3); p=pathlib.Path({str(counter)!r}); p.write_text(p.read_text()+'x' if p.exists() else 'x'); sys.exit(1)"
    sup = Supervisor(tmp_path / "logs", grace_s=5, poll_s=0.02, restart_window_s=0.2, restart_delay_s=0.01)
    sup.start(ChildSpec("slow-flaky", _py(code), restart="on-failure", max_restarts=1))
    # the run ends once the flaky child has died 4 times (not after a fixed time: on a loaded machine each of
    # its starts takes longer, which only spaces the deaths further apart)
    wait = (
        f"import pathlib,time; p=pathlib.Path({str(counter)!r}); deadline=time.time()+120\n"
        "while time.time() < deadline and not (p.exists() and len(p.read_text()) >= 4): time.sleep(0.05)"
    )
    sup.start(ChildSpec("timer", _py(wait), finishes_run=True))
    assert sup.watch() == 0 and sup.failure is None
    assert len(counter.read_text()) >= 4  # restarted again and again, never more than once per window


def test_clean_exit_ends_a_child_and_a_config_error_stops_the_run(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs", grace_s=5, poll_s=0.05, restart_delay_s=0.01)
    done = sup.start(ChildSpec("done", _py("print('all epochs done')"), restart="on-failure"))
    sup.start(ChildSpec("daemon", _py(SLEEPER)))
    bad = "import sys; print('invalid configuration: learner.lr = -1', file=sys.stderr); sys.exit(2)"
    sup.start(ChildSpec("misconfigured", _py(bad), restart="on-failure", max_restarts=5))
    assert sup.watch() == 1
    assert done.process.returncode == 0 and done.restarts == 0  # a clean exit is not restarted
    assert sup.failure is not None and "misconfigured" in sup.failure and "learner.lr" in sup.failure
    assert "restarting" not in (sup.failure or "")  # exit code 2: restarting cannot help


def test_always_restarts_even_a_clean_exit(tmp_path: Path) -> None:
    counter = tmp_path / "count"
    code = f"import pathlib; p=pathlib.Path({str(counter)!r}); p.write_text(p.read_text()+'x' if p.exists() else 'x')"
    sup = Supervisor(tmp_path / "logs", grace_s=5, poll_s=0.05, restart_delay_s=0.01)
    sup.start(ChildSpec("engine", _py(code), restart="always", max_restarts=2))
    assert sup.watch() == 1 and counter.read_text() == "xxx"


SUPERVISED = """
import sys, time
from pathlib import Path
from streamrl.supervisor import ChildSpec, Supervisor
sup = Supervisor(Path(sys.argv[1]) / "logs", records_path=Path(sys.argv[1]) / "processes.json")
sup.start(ChildSpec("sleeper", [sys.executable, "-c", sys.argv[2]]))
print("watching", flush=True)
sup.watch()
"""


def test_children_stop_by_themselves_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    sup = subprocess.Popen(
        [sys.executable, "-c", SUPERVISED, str(tmp_path), SLEEPER], stdout=subprocess.PIPE, text=True
    )
    assert sup.stdout is not None and sup.stdout.readline().strip() == "watching"
    deadline = time.monotonic() + 30
    while "up" not in (tmp_path / "logs" / "sleeper.log").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    records = {r.name: r for r in read_records(tmp_path / "processes.json")}
    assert set(records) == {"up", "sleeper"} and records["up"].pid == sup.pid
    child = records["sleeper"]
    assert child.alive()
    sup.send_signal(signal.SIGKILL)
    sup.wait(timeout=10)
    while child.alive():  # the parent-death signal is SIGTERM: it drains and exits on its own
        assert time.monotonic() < deadline, "the child outlived its supervisor"
        time.sleep(0.05)
    assert "drained" in (tmp_path / "logs" / "sleeper.log").read_text()
    # a record of a process that exited is never mistaken for whatever gets its pid later
    assert not ProcessRecord(child.name, child.pid, child.started).alive()
    assert not ProcessRecord("other", os.getpid(), 1).alive()
    json.loads((tmp_path / "processes.json").read_text())


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


def test_stop_all_can_keep_a_child_for_a_later_stop(tmp_path: Path) -> None:
    """`up` stops every role but Redis first, so their last metrics points are in Redis when it reads them."""
    sup = Supervisor(tmp_path / "logs", grace_s=10, poll_s=0.05)
    redis_like = sup.start(ChildSpec("redis", _py(SLEEPER)))
    worker = sup.start(ChildSpec("worker", _py(SLEEPER)))
    time.sleep(0.5)  # both have set their SIGTERM handlers
    sup.stop_all(keep=("redis",))
    assert worker.process.returncode == 0 and redis_like.process.poll() is None
    sup.stop_all()
    assert redis_like.process.returncode == 0


def test_stop_all_stops_a_stage_together_and_the_stages_in_reverse_order(tmp_path: Path) -> None:
    """Children of one start stage get SIGTERM at once (each drains for a second: one after the other, the second
    would be signalled after the first had finished); an earlier stage is signalled only once the later one has
    stopped (a role may need what started before it, e.g. Redis, while it drains)."""

    def draining(name: str) -> ChildSpec:
        times = tmp_path / f"{name}.times"
        code = (
            "import signal,sys,time,pathlib\n"
            f"p = pathlib.Path({str(times)!r})\n"
            "def stop(*a):\n"
            "    p.write_text(repr(time.time())); time.sleep(1.0)\n"
            "    p.write_text(p.read_text() + ' ' + repr(time.time())); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            f"pathlib.Path({str(tmp_path / name)!r}).touch()\n"
            "time.sleep(600)\n"
        )
        return ChildSpec(name, _py(code), ready=lambda: (tmp_path / name).exists(), ready_timeout_s=30)

    sup = Supervisor(tmp_path / "logs", grace_s=20, poll_s=0.05)
    sup.start_together([draining("server")])
    sup.start_together([draining("client-a"), draining("client-b")])
    sup.stop_all()
    signalled, finished = {}, {}
    for name in ("server", "client-a", "client-b"):
        signalled[name], finished[name] = map(float, (tmp_path / f"{name}.times").read_text().split())
    assert max(signalled["client-a"], signalled["client-b"]) < min(finished["client-a"], finished["client-b"])
    assert signalled["server"] >= max(finished["client-a"], finished["client-b"])


def test_roles_never_inherit_the_supervisors_distributed_rendezvous(tmp_path: Path, monkeypatch) -> None:
    # `up` started inside a distributed job (or by a benchmark that initialised a group): a learner that saw
    # RANK would take itself for one rank of that job, and MASTER_PORT is already bound
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29512", "STREAMRL_PROBE": "kept"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    out = tmp_path / "env.json"
    code = f"import json, os; open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))"
    sup = Supervisor(tmp_path / "logs", grace_s=10, poll_s=0.05)
    sup.start(ChildSpec("probe", _py(code), env={"CUDA_VISIBLE_DEVICES": "3"}, finishes_run=True))
    assert sup.watch() == 0
    env = json.loads(out.read_text())
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} & set(env)
    assert env["STREAMRL_PROBE"] == "kept" and env["CUDA_VISIBLE_DEVICES"] == "3"


EXITING = """
import atexit, os, sys, threading, time
from common.lifecycle import exit_process

class Teardown:
    def __init__(self, fd=os.open({teardown!r}, os.O_WRONLY | os.O_CREAT)):
        self.fd = fd

    def __del__(self, write=os.write):  # run by the interpreter's teardown, not by an atexit handler
        write(self.fd, b"ran")

kept = Teardown()
atexit.register(lambda: open({atexit_file!r}, "w").write("ran"))
if {writer}:  # an unfinished non-daemon thread: its file must still be written
    threading.Thread(target=lambda: (time.sleep(0.5), open({written!r}, "w").write("done"))).start()
sys.stdout.write("buffered, no newline")
exit_process(7)
"""


@pytest.mark.parametrize("writer", [False, True])
def test_a_role_process_exits_without_teardown_but_runs_its_atexit_handlers(
    tmp_path: Path, writer: bool
) -> None:
    files = {name: tmp_path / name for name in ("teardown", "atexit_file", "written")}
    code = EXITING.format(writer=writer, **{k: str(v) for k, v in files.items()})
    out = subprocess.run(_py(code), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 7 and out.stdout == "buffered, no newline", out.stderr
    assert files["atexit_file"].read_text() == "ran"
    if writer:  # the normal exit: it waits for the thread (and tears the modules down)
        assert files["written"].read_text() == "done"
    else:  # the quick exit: no module teardown
        assert files["teardown"].read_text() == ""


# Writes lines 0..N-1 of 100 bytes, waits until its log (its own stdout) was truncated by a rotation, then writes
# lines N..2N-1 and exits.
ROTATED_WRITER = """
import os, sys, time
n = int(sys.argv[1])
line = lambda i: f"line {i:06d} ".ljust(99, "x") + "\\n"
sys.stdout.write("".join(line(i) for i in range(n))); sys.stdout.flush()
while os.fstat(1).st_size >= 100 * n:
    time.sleep(0.01)
sys.stdout.write("".join(line(i) for i in range(n, 2 * n))); sys.stdout.flush()
"""


def test_a_role_log_is_rotated_by_size_and_keeps_its_newest_lines(tmp_path: Path) -> None:
    """A role that writes 10x the limit: at most keep + 1 files of at most the limit are left, they hold the newest
    lines in order with none lost, and the role's writes after the truncation start the live file afresh."""
    limit, keep, n = 4000, 3, 200  # 100-byte lines: 2 x 20,000 bytes written, 4,000 kept per file
    sup = Supervisor(tmp_path / "logs", poll_s=0.02, log_max_bytes=limit, log_keep=keep)
    sup.start(ChildSpec("writer", [*_py(ROTATED_WRITER), str(n)], finishes_run=True))
    assert sup.watch() == 0
    log = tmp_path / "logs" / "writer.log"
    files = sorted(log.parent.iterdir())
    assert [p.name for p in files] == ["writer.log", "writer.log.1", "writer.log.2", "writer.log.3"]
    assert all(p.stat().st_size <= limit for p in files), [p.stat().st_size for p in files]
    text = "".join(p.read_text() for p in (*reversed(files[1:]), files[0]))  # oldest to newest
    numbers = [int(line.split()[1]) for line in text.splitlines()]
    assert numbers == list(range(2 * n - len(numbers), 2 * n)), numbers[:3]  # the newest, in order, none lost
    assert len(numbers) >= 3 * limit // 100
    assert "\0" not in log.read_text()  # written from offset 0 after the truncation, not past a hole
