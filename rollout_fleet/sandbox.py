"""A tool that runs untrusted Python in a sandbox: a fresh process per call, every limit set before ``exec``.

Tool code never runs in a worker's process. :func:`run_python` writes the code into a new empty directory and
starts ``sandbox_launcher.py``, which forks the interpreter under rlimits (CPU time, address space, file size,
processes, open files), its own uid, no network (a network namespace, else a seccomp filter), a Landlock domain
(writes beneath the work directory only) and a scrubbed environment, enforces the wall-clock timeout and kills
everything of the call at the end. Whatever the code does ends as a :class:`SandboxResult`; its
:meth:`~SandboxResult.observation` is the text the model sees. :class:`SandboxError` is reserved for the
infrastructure (the isolation asked for is unavailable, the interpreter cannot start), never for what the model
wrote. docs/rollout.md ("Tool sandbox") says what is isolated and what is not.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import random
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from common.configlib import Section

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
FALLBACK_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
DEFAULT_READ_PATHS = [
    "/usr",
    "/lib",
    "/lib64",
    "/lib32",
    "/bin",
    "/sbin",
    "/etc",
    "/dev/urandom",
    "/dev/random",
]
_GRACE_S = 5.0  # past the launcher's own timeout before the worker kills the launcher itself


class SandboxConfig(Section):
    """The Python tool's sandbox: one process per call, limits set before exec (docs/rollout.md)."""

    timeout_s: float = Field(
        10.0, gt=0, description="Wall-clock seconds a call may run; then everything of it is killed."
    )
    cpu_time_s: int = Field(
        10, ge=1, description="CPU seconds per process (RLIMIT_CPU); SIGXCPU, then SIGKILL."
    )
    max_memory_bytes: int = Field(1 << 30, ge=1 << 24, description="Address space per process (RLIMIT_AS).")
    max_file_bytes: int = Field(16 << 20, ge=0, description="Largest file a call may write (RLIMIT_FSIZE).")
    max_processes: int = Field(
        32, ge=1, description="Processes and threads of the call's uid together (RLIMIT_NPROC)."
    )
    max_open_files: int = Field(64, ge=8, description="Open file descriptors per process (RLIMIT_NOFILE).")
    max_output_bytes: int = Field(
        64 << 10,
        ge=1,
        description="Bytes kept of stdout and of stderr each; more kills the call, flagged truncated.",
    )
    network: Literal["auto", "netns", "seccomp", "none"] = Field(
        "auto",
        description="No network: netns (an empty network namespace, plus AF_UNIX sockets refused by seccomp where "
        "pyseccomp is installed), seccomp (socket() refused), auto (netns where the kernel allows, else seccomp) "
        "or none (not isolated).",
    )
    filesystem: Literal["auto", "landlock", "none"] = Field(
        "auto",
        description="landlock: writes only beneath the work dir, reads only beneath read_paths; auto: landlock "
        "where the kernel has it, else uid and permissions only; none: uid and permissions only.",
    )
    read_paths: list[str] = Field(
        default_factory=lambda: list(DEFAULT_READ_PATHS),
        description="Paths a call may read under Landlock (besides its work dir and the interpreter's prefix).",
    )
    run_as: Literal["auto", "uid", "self"] = Field(
        "auto",
        description="uid: each call under its own uid from uid_base (needs root); self: the worker's uid; auto: uid "
        "when root, else self.",
    )
    uid_base: int = Field(40000, ge=1000, description="First uid (and gid) of the per-call uids.")
    uid_count: int = Field(1000, ge=1, description="Per-call uids available; also the most concurrent calls.")
    python: str | None = Field(
        None,
        description="Interpreter the code runs in; unset: this interpreter if a call uid can execute it, else "
        "the first of /usr/bin/python3, /usr/local/bin/python3.",
    )
    python_flags: list[str] = Field(
        default_factory=lambda: ["-I"],
        description="Interpreter flags before the code file; -I ignores PYTHON* variables and the user site.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables; the environment is otherwise scrubbed.",
    )
    work_root: Path | None = Field(
        None,
        description="Where each call's empty work dir is made (and removed after); unset: TMPDIR/streamrl-sandbox.",
    )


class SandboxError(RuntimeError):
    """The sandbox itself failed (isolation unavailable, interpreter missing): not the model's doing."""


Kind = Literal[
    "ok", "error", "timeout", "cpu_time", "memory", "file_size", "processes", "output_limit", "killed"
]


@dataclasses.dataclass
class SandboxResult:
    """What one call did. ``kind`` is ok or the tool error; ``message`` is that error in one line."""

    ok: bool
    kind: Kind
    message: str
    stdout: str
    stderr: str
    truncated: bool
    exit_code: int | None
    signal: int | None
    wall_s: float
    cpu_s: float = 0.0
    network: str = "none"
    filesystem: str = "none"
    uid: int | None = None

    def observation(self) -> str:
        """The text the model sees: stdout (and stderr when the call succeeded), then one error line."""
        parts = []
        if self.stdout:
            parts.append(self.stdout if self.stdout.endswith("\n") else self.stdout + "\n")
        if self.ok and self.stderr:
            parts.append("stderr:\n" + self.stderr + ("" if self.stderr.endswith("\n") else "\n"))
        if not self.ok:
            parts.append(f"error: {self.message}\n")
        return "".join(parts)


@dataclasses.dataclass(frozen=True)
class _Plan:
    python: str
    note: str  # why this interpreter, when it is not the configured one
    run_as_uid: bool
    work_root: Path


def _executable_by_others(path: str) -> bool:
    """Can a uid that is neither the owner nor in the group execute ``path`` (every directory on the way)?"""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return False
    if not (st.st_mode & stat.S_IXOTH and st.st_mode & stat.S_IROTH):
        return False
    parent = os.path.dirname(real)
    while True:
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


_warned: set[str] = set()


def _plan(config: SandboxConfig) -> _Plan:
    is_root = os.geteuid() == 0
    if config.run_as == "uid" and not is_root:
        raise SandboxError("sandbox.run_as=uid needs root (setuid to a per-call uid); use auto or self")
    as_uid = config.run_as == "uid" or (config.run_as == "auto" and is_root)
    note = ""
    if config.python:
        python = config.python
    else:
        python = sys.executable
        if as_uid and not _executable_by_others(python):
            found = next((p for p in FALLBACK_PYTHONS if _executable_by_others(p)), None)
            if found is None:
                raise SandboxError(
                    f"no Python a per-call uid can execute: {python} is not (a directory on its path is not "
                    f"world-executable) and none of {', '.join(FALLBACK_PYTHONS)} is; set sandbox.python"
                )
            note = f"{python} is not executable by a per-call uid, using {found}"
            python = found
    if not as_uid and not is_root:
        note = (note + "; " if note else "") + (
            "not root: calls run under the worker's own uid (RLIMIT_NPROC counts the worker's processes too, "
            "leftovers are found as descendants)"
        )
    if note and note not in _warned:
        _warned.add(note)
        log.warning("sandbox: %s", note)
    work_root = config.work_root or Path(tempfile.gettempdir()) / "streamrl-sandbox"
    return _Plan(python=python, note=note, run_as_uid=as_uid, work_root=work_root)


def _uids_running(uid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


@contextlib.contextmanager
def _lease_uid(config: SandboxConfig, lock_dir: Path):
    """A per-call uid no other call (of any process sharing work_root) holds, with no process left running."""
    start = random.randrange(config.uid_count)
    for i in range(config.uid_count):
        uid = config.uid_base + (start + i) % config.uid_count
        fd = os.open(lock_dir / str(uid), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _uids_running(uid):  # left over by a worker that died mid-call: nobody holds the uid, so kill them
            _kill_uid_now(uid)
            if _uids_running(uid):
                os.close(fd)
                continue
        try:
            yield uid
        finally:
            os.close(fd)
        return
    raise SandboxError(f"all {config.uid_count} sandbox uids from {config.uid_base} are busy")


def _prepare_root(work_root: Path, as_uid: bool) -> Path:
    work_root.mkdir(parents=True, exist_ok=True)
    if as_uid:
        parent = os.path.dirname(os.path.realpath(work_root))
        while parent != "/" and os.stat(parent).st_mode & stat.S_IXOTH:
            parent = os.path.dirname(parent)
        if parent != "/" or not os.stat("/").st_mode & stat.S_IXOTH:
            raise SandboxError(
                f"sandbox.work_root {work_root}: {parent} is not world-executable, so a per-call uid cannot "
                "reach its work dir; choose a work_root under a traversable directory"
            )
    os.chmod(work_root, 0o711)  # a call uid may enter its own dir, not list the others
    locks = work_root / ".locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    return locks


def _scrubbed_env(config: SandboxConfig, workdir: str) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }
    env.update(config.env)
    return env


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


# A traceback's last line: the exception's name, a colon, its message ("BlockingIOError: [Errno 11] ...").
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(:|$)")


def _last_line(text: str) -> str:
    """The last exception line of ``text``, else its last line. Forked children write their tracebacks to the
    same stderr at once (a fork bomb's do), so the last line is often the middle of another child's traceback."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    return errors[-1] if errors else (lines[-1] if lines else "")


def _classify(config: SandboxConfig, exit_info: dict, stderr: str, truncated: bool) -> tuple[Kind, str]:
    sig = exit_info.get("signal")
    code = exit_info.get("exit_code")
    last = _last_line(stderr)
    if exit_info["reason"] == "timeout":
        return "timeout", f"timeout after {config.timeout_s:.1f}s (killed)"
    if truncated:
        return "output_limit", f"output truncated at {config.max_output_bytes} bytes (killed)"
    if exit_info["reason"] == "killed":
        return "killed", "killed"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and exit_info["cpu_s"] >= config.cpu_time_s - 0.05):
        return "cpu_time", f"CPU time limit {config.cpu_time_s}s exceeded (killed)"
    if code == 0 and sig is None:
        return "ok", ""
    if "MemoryError" in last or "Cannot allocate memory" in last:
        return "memory", f"memory limit {_fmt_bytes(config.max_memory_bytes)} exceeded ({last})"
    if sig == signal.SIGXFSZ or "File too large" in last:
        return "file_size", f"file size limit {_fmt_bytes(config.max_file_bytes)} exceeded ({last})"
    if "Resource temporarily unavailable" in last and (
        "fork" in stderr or "thread" in stderr or "spawn" in stderr
    ):
        return "processes", f"process limit {config.max_processes} reached ({last})"
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return "killed", f"killed by signal {name}"
    return "error", last or f"exit code {code}"


async def _read_capped(stream: asyncio.StreamReader, cap: int, on_overflow) -> tuple[bytes, bool]:
    kept = bytearray()
    over = False
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(kept), over
        if not over:
            room = cap - len(kept)
            kept += chunk[:room]
            if len(chunk) > room:
                over = True
                on_overflow()


def _parse_status(data: bytes) -> dict:
    out: dict = {}
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.update(json.loads(line))
    return out


def _read_all_nonblocking(fd: int) -> bytes:
    os.set_blocking(fd, False)
    data = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return bytes(data)
        if not chunk:
            return bytes(data)
        data += chunk


def _kill_uid_now(uid: int) -> None:
    """Last resort when the launcher itself hung: SIGKILL every process of the uid, as root, until none."""
    for _ in range(20):
        found = False
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}").st_uid == uid:
                        found = True
                        os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass
        if not found:
            return
        time.sleep(0.01)


async def run_python(code: str, config: SandboxConfig, stdin: str = "") -> SandboxResult:
    """Run ``code`` in a fresh sandbox process; every outcome the code can cause is a SandboxResult."""
    plan = _plan(config)
    locks = await asyncio.to_thread(_prepare_root, plan.work_root, plan.run_as_uid)
    lease = _lease_uid(config, locks) if plan.run_as_uid else contextlib.nullcontext(None)
    with lease as uid:
        workdir = Path(tempfile.mkdtemp(prefix="call-", dir=plan.work_root))
        try:
            (workdir / "main.py").write_text(code)
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chown(workdir / "main.py", uid, uid)
            return await _run(config, plan, uid, str(workdir), stdin)
        finally:
            await asyncio.to_thread(shutil.rmtree, workdir, True)


async def _run(config: SandboxConfig, plan: _Plan, uid: int | None, workdir: str, stdin: str):
    read_paths = list(config.read_paths)
    for python in (plan.python, os.path.realpath(plan.python)):  # a venv and the installation under it
        prefix = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        if prefix not in ("/", "/usr") and prefix not in read_paths:
            read_paths.append(prefix)
    nproc = config.max_processes
    if uid is None and os.geteuid() != 0:
        nproc += _uids_running(os.getuid())  # RLIMIT_NPROC counts every process of the worker's uid
    r, w = os.pipe()
    spec = {
        "status_fd": w,
        "python": plan.python,
        "flags": list(config.python_flags),
        "script": "main.py",
        "workdir": workdir,
        "uid": uid,
        "network": config.network,
        "filesystem": config.filesystem,
        "read_paths": read_paths,
        "env": _scrubbed_env(config, workdir),
        "timeout_s": config.timeout_s,
        "limits": {
            "cpu": config.cpu_time_s,
            "as": config.max_memory_bytes,
            "fsize": config.max_file_bytes,
            "nproc": nproc,
            "nofile": config.max_open_files,
        },
    }
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            str(LAUNCHER),
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(w,),
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
            cwd="/",
        )
    except OSError as exc:
        os.close(r)
        raise SandboxError(f"cannot start the sandbox launcher: {exc}") from exc
    finally:
        os.close(w)

    def overflow() -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # the launcher kills the call and reports "killed"

    async def feed() -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if stdin:
                proc.stdin.write(stdin.encode())
                await proc.stdin.drain()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.close()

    cap = config.max_output_bytes
    hung = False
    try:
        async with asyncio.timeout(config.timeout_s + _GRACE_S):
            _, (out, out_over), (err, err_over), _ = await asyncio.gather(
                feed(),
                _read_capped(proc.stdout, cap, overflow),
                _read_capped(proc.stderr, cap, overflow),
                proc.wait(),
            )
    except TimeoutError:
        hung = True
        out, err, out_over, err_over = b"", b"", False, False
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        if uid is not None:
            await asyncio.to_thread(_kill_uid_now, uid)
    finally:
        status = _parse_status(_read_all_nonblocking(r))
        os.close(r)
    wall = time.monotonic() - t0
    if "setup_error" in status:
        raise SandboxError(f"sandbox setup failed: {status['setup_error']}")
    if hung or "exit" not in status:
        launcher_err = err.decode(errors="replace").strip()
        if "setup" not in status:
            raise SandboxError(
                f"the sandbox launcher failed (exit {proc.returncode}): {launcher_err[-2000:]}"
            )
        # the launcher was killed (by the worker's grace timeout, or by the code itself under run_as=self)
        status["exit"] = {
            "reason": "timeout" if hung else "killed",
            "signal": None,
            "exit_code": None,
            "cpu_s": 0.0,
        }
    exit_info = status["exit"]
    setup = status["setup"]
    truncated = out_over or err_over
    stdout = out.decode(errors="replace")
    stderr = err.decode(errors="replace")
    kind, message = _classify(config, exit_info, stderr, truncated)
    return SandboxResult(
        ok=kind == "ok",
        kind=kind,
        message=message,
        stdout=stdout,
        stderr=stderr,
        truncated=truncated,
        exit_code=exit_info.get("exit_code"),
        signal=exit_info.get("signal"),
        wall_s=wall,
        cpu_s=exit_info.get("cpu_s", 0.0),
        network=setup["network"],
        filesystem=setup["filesystem"],
        uid=setup["uid"],
    )


_PROBE = r"""
import os, socket, sys
report = {"uid": os.getuid()}
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(1.0)
    s.connect(("127.0.0.1", 9))
    report["net"] = "connected"
except OSError as exc:
    report["net"] = type(exc).__name__ + ": " + str(exc)
try:
    with open(OUTSIDE, "w") as f:
        f.write("x")
    report["fs"] = "wrote outside"
except OSError as exc:
    report["fs"] = type(exc).__name__
print(repr(report))
"""


async def check_sandbox(config: SandboxConfig) -> str:
    """Run a trivial program in the sandbox and verify the isolation; a one-line description of it, or raise.

    A worker calls this at start so that a misconfigured host fails loudly once, not as a tool error per call.
    """
    plan = _plan(config)
    outside = (
        Path(tempfile.gettempdir()) / f"streamrl-sandbox-probe-{os.getpid()}-{random.randrange(1 << 30)}"
    )
    result = await run_python(_PROBE.replace("OUTSIDE", repr(str(outside))), config)
    if not result.ok:
        raise SandboxError(
            f"the sandbox cannot run a trivial program: {result.kind}: {result.message} {result.stderr[-500:]}"
        )
    report = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    if outside.exists():
        outside.unlink()
        if result.filesystem.startswith("landlock"):
            raise SandboxError("the sandbox wrote outside its work dir under Landlock")
    if config.network != "none" and report["net"] == "connected":
        raise SandboxError(
            f"the sandbox reached the network with network={config.network} ({result.network})"
        )
    if plan.run_as_uid and report["uid"] == os.getuid():
        raise SandboxError("the sandbox kept the worker's uid although run_as asks for a per-call uid")
    who = f"per-call uid {config.uid_base}+" if plan.run_as_uid else f"the worker's uid {os.getuid()}"
    text = (
        f"sandbox: {plan.python}, {who}, network {result.network}, filesystem {result.filesystem}, "
        f"{result.wall_s * 1000:.0f} ms a trivial call"
    )
    if plan.note:
        text += f" ({plan.note})"
    return text
