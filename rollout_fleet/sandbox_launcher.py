"""The sandbox launcher: one process per tool call, between the worker and the untrusted interpreter.

Run as ``python -I sandbox_launcher.py SPEC_JSON`` by :func:`rollout_fleet.sandbox.run_python` (a script, not a
module of the package, so it needs no import path and imports nothing of streamrl). It forks once:

- the child isolates itself and ``execve``\\ s the interpreter on the code file: a new session, no new privileges,
  a network namespace (``unshare(CLONE_NEWNET)``) or a seccomp filter (``pyseccomp``) that refuses every socket
  but AF_UNIX, a Landlock domain (writes only beneath the work directory, reads only beneath the read paths,
  no signals or abstract unix sockets out of the domain), then the call's own uid and gid, the work directory,
  the rlimits, and a scrubbed environment. Everything is set before ``exec``; nothing of it can be undone after.
- the parent stays outside (as the worker's user), waits for the child with the wall-clock timeout, and then
  kills everything the call left behind: every process of the call's uid (``kill(-1)`` as that uid, which the
  kernel does under one lock, so a fork bomb cannot outrun it), else every descendant (it is a subreaper).

Both write one JSON line each to the status descriptor: the child ``{"setup": ...}`` just before ``exec`` (or
``{"setup_error": ...}`` if isolation could not be put in place), the parent ``{"exit": ...}`` at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import sys
import time

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1

# Landlock (include/uapi/linux/landlock.h); the syscall numbers are the same on every architecture.
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6
FILE_ONLY_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    """Isolation that was asked for and could not be put in place."""


class _Stop(Exception):
    """SIGTERM from the worker: kill the call now."""


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
    ret = _libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    return max(int(ret), 0)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(workdir: str, read_paths: list[str], abi: int) -> None:
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    write = (
        FS_WRITE_FILE
        | FS_REMOVE_DIR
        | FS_REMOVE_FILE
        | FS_MAKE_CHAR
        | FS_MAKE_DIR
        | FS_MAKE_REG
        | FS_MAKE_SOCK
        | FS_MAKE_FIFO
        | FS_MAKE_BLOCK
        | FS_MAKE_SYM
    )
    if abi >= 2:
        write |= FS_REFER
    if abi >= 3:
        write |= FS_TRUNCATE
    if abi >= 5:
        write |= FS_IOCTL_DEV
    handled = read | write
    attr = _RulesetAttr(
        handled_access_fs=handled,
        handled_access_net=0,
        scoped=(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0,
    )
    size = 24 if abi >= 6 else 8  # the struct grew with handled_access_net (ABI 4) and scoped (ABI 6)
    ruleset = _check(
        _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0),
        "landlock_create_ruleset",
    )
    rules = [(workdir, handled)] + [(p, read) for p in read_paths]
    # Character devices a program writes to as a matter of course.
    rules += [(p, FS_READ_FILE | FS_WRITE_FILE) for p in ("/dev/null", "/dev/zero")]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a read path this host lacks
        try:
            if not os.path.isdir(path):
                access &= FILE_ONLY_RIGHTS
            rule = _PathBeneath(allowed_access=access & handled, parent_fd=fd)
            _check(
                _libc.syscall(
                    SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
                ),
                f"landlock_add_rule {path}",
            )
        finally:
            os.close(fd)
    _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)


def _pyseccomp():
    try:
        import pyseccomp
    except (ImportError, RuntimeError):  # RuntimeError: libseccomp.so.2 missing
        return None
    return pyseccomp


def _seccomp(all_sockets: bool) -> None:
    """Refuse socket() (every family when ``all_sockets``, else AF_UNIX only), socketpair() but AF_UNIX's
    (asyncio's self-pipe needs it; a pair reaches nothing outside), and io_uring, which can open and connect
    sockets without the socket() syscall. Everything else is allowed; other architectures' syscalls kill."""
    pyseccomp = _pyseccomp()
    if pyseccomp is None:
        raise SetupError(
            "network=seccomp needs the pyseccomp package (the sandbox extra) and libseccomp.so.2"
        )
    deny = pyseccomp.ERRNO(errno.EPERM)
    f = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    if all_sockets:
        f.add_rule(deny, "socket")
    else:
        f.add_rule(deny, "socket", pyseccomp.Arg(0, pyseccomp.EQ, socket.AF_UNIX))
    f.add_rule(deny, "socketpair", pyseccomp.Arg(0, pyseccomp.NE, socket.AF_UNIX))
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        f.add_rule(deny, name)
    f.load()


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _network(mode: str, is_root: bool) -> str:
    if mode == "none":
        return "none"
    if mode in ("auto", "netns"):
        try:
            _unshare(CLONE_NEWNET if is_root else CLONE_NEWUSER | CLONE_NEWNET)
        except OSError as exc:
            if mode == "netns":
                raise SetupError(f"network=netns: the kernel refused a network namespace ({exc})") from exc
        else:
            # A network namespace leaves the host's unix sockets reachable by path (a world-writable Docker or
            # Redis socket): refuse AF_UNIX sockets too where seccomp is at hand.
            if _pyseccomp() is None:
                return "netns"
            _seccomp(all_sockets=False)
            return "netns+seccomp"
    _seccomp(all_sockets=True)
    return "seccomp"


def _filesystem(mode: str, workdir: str, read_paths: list[str]) -> str:
    if mode == "none":
        return "none"
    abi = landlock_abi()
    if abi < 1:
        if mode == "landlock":
            raise SetupError("filesystem=landlock: this kernel has no Landlock (or it is disabled)")
        return "none"
    _landlock(workdir, read_paths, abi)
    return f"landlock(abi {abi})"


def _child(spec: dict, status_fd: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.setsid()
    os.set_inheritable(status_fd, False)
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, 65536)
    is_root = os.geteuid() == 0
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    network = _network(spec["network"], is_root)
    filesystem = _filesystem(spec["filesystem"], spec["workdir"], spec["read_paths"])
    uid = spec["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    # The launcher gone (killed by the worker's last-resort timeout): so is the call. Set after the uid change,
    # which clears it.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        os._exit(127)
    os.chdir(spec["workdir"])
    limits = spec["limits"]
    for name, value in (
        ("RLIMIT_CORE", 0),
        ("RLIMIT_CPU", limits["cpu"]),
        ("RLIMIT_FSIZE", limits["fsize"]),
        ("RLIMIT_NPROC", limits["nproc"]),
        ("RLIMIT_NOFILE", limits["nofile"]),
        ("RLIMIT_AS", limits["as"]),
    ):
        soft = hard = value
        if name == "RLIMIT_CPU":
            hard = value + 1  # SIGXCPU at the soft limit, SIGKILL a second later
        resource.setrlimit(getattr(resource, name), (soft, hard))
    line = {"setup": {"network": network, "filesystem": filesystem, "uid": os.getuid()}}
    os.write(status_fd, (json.dumps(line) + "\n").encode())
    argv = [spec["python"], *spec["flags"], spec["script"]]
    os.execve(spec["python"], argv, spec["env"])


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        parents[int(name)] = int(fields[1])
    found: list[int] = []
    frontier = {root}
    while frontier:
        kids = [pid for pid, ppid in parents.items() if ppid in frontier and pid not in found]
        found += kids
        frontier = set(kids)
    return found


def _kill_all(child: int, uid: int | None) -> None:
    # Descendants first (the only way without a uid of our own), then everything of the call's uid.
    for _ in range(50):
        pids = _descendants(os.getpid())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _reap()
    if uid is not None and os.geteuid() == 0:
        # kill(-1) as the call's uid reaches exactly its processes, all at once under the kernel's task list
        # lock (no fork can slip in between); it reports success whenever any process exists, so the loop
        # ends on /proc showing none of the uid left.
        os.setresuid(uid, uid, 0)
        try:
            for _ in range(2000):
                with contextlib.suppress(OSError):
                    os.kill(-1, signal.SIGKILL)
                _reap()
                if not _running_as(uid):
                    break
                time.sleep(0.001)
        finally:
            os.setresuid(0, 0, 0)
    _reap()


def _running_as(uid: int) -> bool:
    me = os.getpid()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    return True
            except OSError:
                pass
    return False


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _stop(signum, frame):  # noqa: ARG001
    raise _Stop()


def main() -> int:
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]
    signal.signal(signal.SIGTERM, _stop)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the worker died: so do we (and then the call)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child(spec, status_fd)
            msg = "execve returned"
        except BaseException as exc:  # noqa: BLE001 - reported to the worker, never raised past the fork
            msg = f"{type(exc).__name__}: {exc}"
        try:
            os.write(status_fd, (json.dumps({"setup_error": msg}) + "\n").encode())
        finally:
            os._exit(127)
    reason = "exited"
    rusage = None
    status = None
    try:
        pidfd = os.pidfd_open(pid)
        remaining = spec["timeout_s"]
        while remaining > 0:
            ready, _, _ = select.select([pidfd], [], [], remaining)
            if ready:
                break
            remaining = spec["timeout_s"] - (time.monotonic() - t0)
        else:
            reason = "timeout"
    except _Stop:
        reason = "killed"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if reason != "exited":
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    _, status, rusage = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    _kill_all(pid, spec["uid"])
    exit_info = {
        "reason": reason,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "cpu_s": rusage.ru_utime + rusage.ru_stime,
        "max_rss_kib": rusage.ru_maxrss,
        "wall_s": wall,
    }
    os.write(status_fd, (json.dumps({"exit": exit_info}) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
