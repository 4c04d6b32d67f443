"""The Python tool's sandbox against escapes: each ends as a clear tool error, the caller alive, the host untouched.

Every test runs real code in a real sandbox process (the launcher, a per-call uid, a network namespace or a
seccomp filter, Landlock) and checks the outcome from outside: the files that must not exist, the TCP server that
must see no connection, the processes of the call's uid that must be gone.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from rollout_fleet.sandbox import SandboxConfig, SandboxError, check_sandbox, run_python
from rollout_fleet.sandbox_launcher import landlock_abi

pytestmark = pytest.mark.timeout(60)

IS_ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parent.parent


def _netns_works() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _seccomp_works() -> bool:
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


NETWORK_MODES = [
    pytest.param("netns", marks=pytest.mark.skipif(not _netns_works(), reason="no network namespaces here")),
    pytest.param("seccomp", marks=pytest.mark.skipif(not _seccomp_works(), reason="pyseccomp unavailable")),
]
needs_root = pytest.mark.skipif(not IS_ROOT, reason="per-call uids need root")
needs_landlock = pytest.mark.skipif(landlock_abi() < 1, reason="no Landlock in this kernel")


@pytest.fixture
def work_root():
    # tmp_path lies under a 0700 directory a per-call uid cannot traverse; /tmp can be.
    root = Path(tempfile.mkdtemp(prefix="sandbox-test-", dir="/tmp"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def config(work_root: Path) -> SandboxConfig:
    return SandboxConfig(work_root=work_root, timeout_s=5.0, cpu_time_s=5)


def _processes_of(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def _call_dirs(work_root: Path) -> list[str]:
    return [p.name for p in work_root.iterdir() if p.name.startswith("call-")]


async def test_normal_code_returns_stdout(config: SandboxConfig, work_root: Path):
    result = await run_python(
        "import sys\nprint('hello', sum(range(10)))\nprint(sys.stdin.read().upper())",
        config,
        stdin="from stdin",
    )
    assert result.ok and result.kind == "ok", result
    assert result.observation() == "hello 45\nFROM STDIN\n"
    assert result.exit_code == 0 and result.signal is None and not result.truncated
    if IS_ROOT:
        assert result.uid is not None and config.uid_base <= result.uid < config.uid_base + config.uid_count
    assert _call_dirs(work_root) == []  # the work dir is removed after the call


async def test_exception_gives_last_traceback_line(config: SandboxConfig):
    result = await run_python("def f():\n    return 1 / 0\nprint('before')\nf()\n", config)
    assert not result.ok and result.kind == "error"
    assert "Traceback" in result.stderr
    assert result.observation() == "before\nerror: ZeroDivisionError: division by zero\n"
    assert result.exit_code == 1


def test_a_process_limit_is_named_when_childrens_tracebacks_interleave() -> None:
    """A fork bomb's children write their tracebacks to one stderr at once: the last line can be another child's
    source line (seen inside `make test`: kind "error", message "os.fork()"); the last exception line decides."""
    from rollout_fleet.sandbox import _classify

    interleaved = (
        "Traceback (most recent call last):\nTraceback (most recent call last):\n"
        '  File "<call>", line 3, in <module>\n'
        "BlockingIOError: [Errno 11] Resource temporarily unavailable\n"
        '  File "<call>", line 3, in <module>\n'
        "    os.fork()\n"
    )
    exit_info = {"reason": "exited", "exit_code": 1, "signal": None, "cpu_s": 0.04}
    config = SandboxConfig(max_processes=16)
    assert _classify(config, exit_info, interleaved, False) == (
        "processes",
        "process limit 16 reached (BlockingIOError: [Errno 11] Resource temporarily unavailable)",
    )
    plain = (
        'Traceback (most recent call last):\n  File "<call>", line 4\nZeroDivisionError: division by zero\n'
    )
    assert _classify(config, exit_info, plain, False) == ("error", "ZeroDivisionError: division by zero")


@needs_root
async def test_fork_bomb_is_contained_and_leaves_nothing(config: SandboxConfig):
    config = config.model_copy(update={"max_processes": 16, "timeout_s": 3.0})
    bomb = "import os\nwhile True:\n    os.fork()\n"
    result = await run_python(bomb, config)
    assert not result.ok and result.kind in ("processes", "timeout"), result
    assert result.observation().startswith("error: ")
    if result.kind == "processes":
        assert "process limit 16 reached" in result.message
    assert _processes_of(result.uid) == []
    # A bomb that survives its failed forks runs into the wall clock, and still nothing is left.
    stubborn = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = await run_python(stubborn, config.model_copy(update={"timeout_s": 1.5}))
    assert result.kind == "timeout" and result.observation() == "error: timeout after 1.5s (killed)\n"
    assert result.wall_s < 1.5 + 2.0
    assert _processes_of(result.uid) == []
    assert (await run_python("print('still fine')", config)).ok


@needs_root
async def test_daemonized_child_is_killed_with_the_call(config: SandboxConfig):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')\n"
    result = await run_python(code, config)
    assert result.ok and result.stdout == "parent done\n"
    assert result.wall_s < 3.0  # the lingering child does not hold the call open
    assert _processes_of(result.uid) == []


async def test_infinite_loop_hits_cpu_limit(config: SandboxConfig):
    result = await run_python("while True:\n    pass\n", config.model_copy(update={"cpu_time_s": 1}))
    assert result.kind == "cpu_time"
    assert result.observation() == "error: CPU time limit 1s exceeded (killed)\n"


async def test_sleeping_forever_hits_wall_timeout(config: SandboxConfig):
    result = await run_python(
        "import time\nprint('start', flush=True)\ntime.sleep(600)\n",
        config.model_copy(update={"timeout_s": 1.0}),
    )
    assert result.kind == "timeout"
    assert result.observation() == "start\nerror: timeout after 1.0s (killed)\n"
    assert 1.0 <= result.wall_s < 3.0


async def test_memory_hog(config: SandboxConfig):
    result = await run_python("x = bytearray(3 << 30)\n", config)
    assert result.kind == "memory"
    assert result.observation() == "error: memory limit 1.0 GiB exceeded (MemoryError)\n"
    grow = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))\n"
    result = await run_python(grow, config.model_copy(update={"max_memory_bytes": 256 << 20}))
    assert result.kind == "memory" and "memory limit 256.0 MiB exceeded" in result.observation()


async def test_huge_output_is_truncated(config: SandboxConfig):
    config = config.model_copy(update={"max_output_bytes": 4096})
    result = await run_python("while True:\n    print('x' * 1000)\n", config)
    assert result.kind == "output_limit" and result.truncated
    assert len(result.stdout.encode()) <= 4096
    assert result.observation().endswith("\nerror: output truncated at 4096 bytes (killed)\n")
    assert result.wall_s < 3.0  # killed at the limit, not at the timeout
    result = await run_python("import sys\nsys.stderr.write('e' * 100000)\n", config)
    assert result.kind == "output_limit" and result.truncated and len(result.stderr) <= 4096


@needs_landlock
async def test_writing_outside_the_work_dir(config: SandboxConfig, work_root: Path):
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, REPO / name, work_root / name, Path(tempfile.gettempdir()) / f"{name}-2"]
    code = "import sys\nfor path in sys.argv[1:] or %r:\n    open(path, 'w').write('x')\n" % [
        str(t) for t in targets
    ]
    result = await run_python(code, config)
    assert result.kind == "error"
    assert result.observation().startswith("error: PermissionError: [Errno 13] Permission denied")
    for target in targets:
        assert not target.exists(), target
    # each target on its own, so the first failure does not hide the others
    for target in targets:
        result = await run_python(f"open({str(target)!r}, 'w').write('x')\n", config)
        assert result.kind == "error" and "PermissionError" in result.message
        assert not target.exists()
    # inside the work dir, writing works
    result = await run_python("open('here.txt', 'w').write('x')\nprint(open('here.txt').read())\n", config)
    assert result.ok and result.stdout == "x\n"


@pytest.mark.parametrize("network", NETWORK_MODES)
async def test_socket_reaches_no_server(config: SandboxConfig, network: str):
    connections = []

    async def handle(reader, writer):
        connections.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
    )
    try:
        result = await run_python(code, config.model_copy(update={"network": network}))
        assert result.network == ("netns+seccomp" if network == "netns" and _seccomp_works() else network)
        assert result.kind == "error" and "connected" not in result.stdout
        expected = "Network is unreachable" if network == "netns" else "Operation not permitted"
        assert expected in result.observation()
        udp = "import socket\nsocket.socket(socket.AF_INET6, socket.SOCK_DGRAM).sendto(b'x', ('::1', 9))\n"
        assert (await run_python(udp, config.model_copy(update={"network": network}))).kind == "error"
        # the control: with network=none the same code does connect, so the server is reachable
        control = await run_python(code, config.model_copy(update={"network": "none"}))
        assert control.ok and control.stdout == "connected\n" and control.network == "none"
        await asyncio.sleep(0.1)
        assert len(connections) == 1  # the control's, none from the isolated call
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("network", NETWORK_MODES)
async def test_unix_socket_on_the_host_is_unreachable(config: SandboxConfig, network: str, work_root: Path):
    if network == "netns" and not _seccomp_works():
        pytest.skip("a network namespace alone leaves pathname unix sockets reachable (docs/rollout.md)")
    connections = []
    path = str(
        work_root / "host.sock"
    )  # a world-writable socket of the host, as a careless service leaves it
    server = await asyncio.start_unix_server(lambda r, w: (connections.append(1), w.close()), path)
    os.chmod(path, 0o777)
    code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\nprint('connected')\n"
    pair = "import socket\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1))\n"
    try:
        result = await run_python(code, config.model_copy(update={"network": network}))
        assert result.kind == "error" and "Operation not permitted" in result.observation()
        # a socketpair reaches nothing outside and asyncio needs one: allowed
        assert (await run_python(pair, config.model_copy(update={"network": network}))).stdout == "b'x'\n"
        control = await run_python(code, config.model_copy(update={"network": "none"}))
        assert control.ok and control.stdout == "connected\n"
        await asyncio.sleep(0.1)
        assert len(connections) == 1  # the control's only
    finally:
        server.close()
        await server.wait_closed()


async def test_parent_environment_is_not_visible(config: SandboxConfig, monkeypatch: pytest.MonkeyPatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("STREAMRL_TEST_SECRET", secret)
    # /proc/<pid>/environ shows a process's environment as it started, so the worker stand-in is a process
    # started with the secret in it.
    holder = subprocess.Popen(["sleep", "60"], env={"STREAMRL_TEST_SECRET": secret})
    code = f"""
import os
print(dict(os.environ))
for pid in (os.getppid(), {holder.pid}):
    try:
        print(open(f"/proc/{{pid}}/environ", "rb").read())
    except OSError as exc:
        print("denied", pid, exc)
"""
    try:
        result = await run_python(code, config.model_copy(update={"env": {"ALLOWED": "yes"}}))
    finally:
        holder.kill()
        holder.wait()
    assert result.ok, result
    assert secret not in result.stdout and secret not in result.stderr
    assert "STREAMRL_TEST_SECRET" not in result.stdout
    assert "'ALLOWED': 'yes'" in result.stdout
    assert f"denied {holder.pid}" in result.stdout


async def test_huge_file_hits_file_size_limit(config: SandboxConfig, work_root: Path):
    config = config.model_copy(update={"max_file_bytes": 1 << 20})
    code = "with open('big', 'wb') as f:\n    for _ in range(100):\n        f.write(b'x' * (1 << 20))\n"
    result = await run_python(code, config)
    assert result.kind == "file_size"
    assert result.observation().startswith(
        "error: file size limit 1.0 MiB exceeded (OSError: [Errno 27] File too large"
    )


async def test_no_state_survives_between_calls(config: SandboxConfig, work_root: Path):
    first = await run_python("import os\nopen('state.txt', 'w').write('x')\nprint(os.getcwd())\n", config)
    assert first.ok
    cwd = first.stdout.strip()
    assert not Path(cwd).exists()
    second = await run_python(
        f"import os\nprint(os.path.exists('state.txt'), os.path.exists({cwd!r}), os.listdir('.'))\n", config
    )
    assert second.stdout == "False False ['main.py']\n"


async def test_many_concurrent_calls(config: SandboxConfig, work_root: Path):
    results = await asyncio.gather(
        *(run_python(f"import os\nprint({i} * {i}, os.getuid())", config) for i in range(16))
    )
    assert all(r.ok for r in results)
    assert [int(r.stdout.split()[0]) for r in results] == [i * i for i in range(16)]
    if IS_ROOT:
        assert len({r.uid for r in results}) == 16  # each call its own uid
    assert _call_dirs(work_root) == []


async def test_check_sandbox_reports_the_isolation(config: SandboxConfig):
    text = await check_sandbox(config)
    assert text.startswith("sandbox: ")
    if _netns_works():
        assert "network netns" in text
    if landlock_abi() >= 1:
        assert "filesystem landlock" in text
    if _seccomp_works():
        assert "network seccomp" in await check_sandbox(config.model_copy(update={"network": "seccomp"}))


async def test_infrastructure_failures_are_sandbox_errors(config: SandboxConfig, work_root: Path):
    broken = config.model_copy(update={"python": "/nonexistent/python3"})
    with pytest.raises(SandboxError, match="sandbox setup failed: FileNotFoundError"):
        await run_python("print(1)", broken)
    with pytest.raises(SandboxError):
        await check_sandbox(broken)
    assert _call_dirs(work_root) == []
    if IS_ROOT:
        hidden = work_root / "private"
        hidden.mkdir(mode=0o700)
        with pytest.raises(SandboxError, match="not world-executable"):
            await run_python("print(1)", config.model_copy(update={"work_root": hidden / "root"}))


@needs_root
def test_launcher_isolates_without_root(work_root: Path):
    """The non-root fallback, run for real: the launcher itself under an unprivileged uid (setpriv), no uid of
    its own for the call: a user + network namespace, Landlock, and leftovers found as descendants."""
    import json
    import random

    from rollout_fleet import sandbox_launcher

    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) missing")
    uid = 39000 + random.randrange(500)
    # A non-root worker reads its own checkout; the uid standing in for one here may not (a checkout under a 0700
    # directory, as mktemp makes): it runs a copy of the launcher it can read.
    launcher = work_root / "sandbox_launcher.py"
    shutil.copyfile(sandbox_launcher.__file__, launcher)
    os.chmod(launcher, 0o644)
    workdir = work_root / "call-nonroot"
    workdir.mkdir(mode=0o700)
    os.chown(workdir, uid, uid)
    outside = Path("/tmp") / f"sandbox-escape-{uuid.uuid4().hex}"
    code = f"""
import os, socket, time
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
except OSError as exc:
    print("net:", exc)
try:
    open({str(outside)!r}, "w")
except OSError as exc:
    print("fs:", type(exc).__name__)
print("uid:", os.getuid())
"""
    (workdir / "main.py").write_text(code)
    os.chown(workdir / "main.py", uid, uid)
    r, w = os.pipe()
    spec = {
        "status_fd": w,
        "python": "/usr/bin/python3",
        "flags": ["-I"],
        "script": "main.py",
        "workdir": str(workdir),
        "uid": None,
        "network": "auto",
        "filesystem": "auto",
        "read_paths": ["/usr", "/lib", "/lib64", "/etc"],
        "env": {"PATH": "/usr/bin:/bin"},
        "timeout_s": 10,
        "limits": {"cpu": 5, "as": 1 << 30, "fsize": 1 << 20, "nproc": 16, "nofile": 64},
    }
    argv = [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "/usr/bin/python3",
        "-I",
        str(launcher),
        json.dumps(spec),
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=(w,))
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as f:
        status = {k: v for line in f.read().decode().splitlines() for k, v in json.loads(line).items()}
    assert proc.returncode == 0, proc.stderr
    assert status["exit"]["exit_code"] == 0, (status, proc.stderr)
    assert "net: [Errno 101] Network is unreachable" in proc.stdout
    assert status["setup"]["network"] == "netns"
    if landlock_abi() >= 1:
        assert status["setup"]["filesystem"].startswith("landlock")
        assert "fs: PermissionError" in proc.stdout and not outside.exists()
    assert _processes_of(uid) == []  # the setsid'd sleeper was found as a descendant and killed
