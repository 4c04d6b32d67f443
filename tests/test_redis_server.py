"""The embedded Redis server: a real process, password, AOF, noeviction, restart on the same data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from broker.config import RedisServerConfig
from broker.server import EmbeddedRedis, RedisServerError


def test_server_settings(own_redis: EmbeddedRedis) -> None:
    client = redis.Redis.from_url(own_redis.url)
    assert client.ping()
    assert client.config_get("appendonly")["appendonly"] == "yes"
    assert client.config_get("appendfsync")["appendfsync"] == "everysec"
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert client.config_get("bind")["bind"].split()[0] == "127.0.0.1"
    assert Path(client.config_get("dir")["dir"]) == own_redis.data_dir
    assert oct((own_redis.data_dir / "password").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=own_redis.port).ping()


def test_always_fsync_selectable(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path, RedisServerConfig(appendfsync="always")) as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendfsync")["appendfsync"] == "always"


def test_kill9_and_restart_keeps_acknowledged_writes(own_redis: EmbeddedRedis) -> None:
    client = redis.Redis.from_url(own_redis.url)
    ids = [client.xadd("s", {"i": str(i)}) for i in range(200)]
    own_redis.kill()
    with pytest.raises(RedisServerError, match="exited with code"):
        own_redis.check()
    own_redis.start()
    client = redis.Redis.from_url(own_redis.url)
    assert [entry_id for entry_id, _ in client.xrange("s")] == ids


def test_crashed_server_is_reported(own_redis: EmbeddedRedis) -> None:
    assert own_redis.process is not None
    os.kill(own_redis.process.pid, signal.SIGKILL)
    own_redis.process.wait()
    assert not own_redis.alive
    with pytest.raises(RedisServerError):
        own_redis.check()


def test_bad_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RedisServerError, match="redis.binary"):
        EmbeddedRedis(tmp_path, RedisServerConfig(binary="/nonexistent/redis-server"))


def test_redis_command_runs_until_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "redis", f"--shared.run_dir={tmp_path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url_file = tmp_path / "redis" / "url"
    deadline = time.monotonic() + 30
    client = None
    while time.monotonic() < deadline:
        if url_file.is_file():
            try:
                client = redis.Redis.from_url(url_file.read_text().strip())
                client.ping()
                break
            except redis.ConnectionError:
                pass
        time.sleep(0.1)
    assert client is not None and client.ping()
    client.set("k", "v")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopping redis" in err
    assert client.connection_pool.connection_kwargs["password"] not in err
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url_file.read_text().strip(), socket_connect_timeout=1).ping()


OWNER = """
import sys, time
from pathlib import Path
from broker.config import RedisServerConfig
from broker.server import EmbeddedRedis
server = EmbeddedRedis(Path(sys.argv[1]), RedisServerConfig())
server.start()
print(server.process.pid, server.port, flush=True)
time.sleep(600)
"""


def test_the_server_dies_with_its_owner_and_a_leftover_is_stopped(tmp_path: Path) -> None:
    from common.lifecycle import read_records

    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pid, port = (int(x) for x in owner.stdout.readline().split())
    (record,) = read_records(tmp_path / "pid")
    assert record.pid == pid and record.alive()
    redis.Redis.from_url((tmp_path / "url").read_text().strip()).set("k", "kept")
    owner.send_signal(
        signal.SIGKILL
    )  # kill -9 of `streamrl redis`: its server must not keep the port and AOF
    owner.wait(timeout=10)
    deadline = time.monotonic() + 10
    while record.alive():
        assert time.monotonic() < deadline, "redis-server outlived the process that started it"
        time.sleep(0.05)
    # the restart takes the same port and the same data
    with EmbeddedRedis(tmp_path, RedisServerConfig()) as again:
        assert again.port == port and redis.Redis.from_url(again.url).get("k") == b"kept"
        # a second owner of the same directory (the first one's server still alive) stops that server first
        second = EmbeddedRedis(tmp_path, RedisServerConfig())
        assert not again.alive and second.port == port
        with second:
            assert redis.Redis.from_url(second.url).get("k") == b"kept"


# The main thread ends alone (the exit system call, not exit_group) while another thread, like Redis's background
# thread blocked in an fsync, still runs and so still holds the process's listening socket. Waits for a line on
# stdin before that thread ends.
ZOMBIE_LEADER = """
import ctypes, platform, socket, sys, threading
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", 0))
server.listen()
print(server.getsockname()[1], flush=True)
threading.Thread(target=sys.stdin.readline).start()
exit_thread = {"x86_64": 60, "aarch64": 93}[platform.machine()]
ctypes.CDLL(None).syscall(exit_thread, 0)
"""


def test_a_process_whose_main_thread_is_a_zombie_is_alive_while_a_thread_holds_its_files() -> None:
    """CI failed once on the test above: the restarted server found its port taken and chose another. The killed
    server's main thread was a zombie, which read as dead, while a thread still exiting held the port."""
    from broker.server import port_is_free
    from common.lifecycle import ProcessRecord

    child = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE_LEADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert child.stdin is not None and child.stdout is not None
    port = int(child.stdout.readline())
    record = ProcessRecord.of("zombie-leader", child.pid)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the main thread did not end"
        time.sleep(0.02)
    assert not port_is_free("127.0.0.1", port)  # its other thread still holds the socket
    assert record.alive()
    child.stdin.write(b"end\n")
    child.stdin.flush()
    child.wait(timeout=10)
    assert not record.alive() and port_is_free("127.0.0.1", port)


def test_a_port_taken_by_another_process_gets_a_new_one(tmp_path: Path) -> None:
    import socket

    with EmbeddedRedis(tmp_path, RedisServerConfig()) as first:
        old = first.port
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", old))
    squatter.listen()
    try:
        with EmbeddedRedis(tmp_path, RedisServerConfig()) as second:
            assert second.port != old
            assert (tmp_path / "url").read_text().strip() == second.url  # where every role looks for it
            assert redis.Redis.from_url(second.url).ping()
    finally:
        squatter.close()


def test_ports_promised_to_other_servers_are_never_drawn(tmp_path: Path) -> None:
    """`streamrl up` gives the engines their ports before it starts Redis, which draws its own: told those ports,
    Redis never takes one (here every port but one of the range it draws from is promised)."""
    from broker.server import ephemeral_port_range, port_is_free

    low = ephemeral_port_range()[0]
    candidates = range(max(1024, low - 12000), low)
    left = next(p for p in reversed(candidates) if port_is_free("127.0.0.1", p))
    promised = set(candidates) - {left}
    with EmbeddedRedis(tmp_path, RedisServerConfig(), avoid_ports=promised) as server:
        assert server.port == left and redis.Redis.from_url(server.url).ping()
