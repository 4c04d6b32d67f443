"""Shared fixtures: real Redis servers started with the project's own embedded-server code."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.config import RedisServerConfig
from broker.server import EmbeddedRedis
from streamrl.supervisor import RANK_ENV

os.environ.setdefault("WANDB_MODE", "disabled")
# Two workers on two cores: each test process, and every process it starts that does not set its own, computes on
# one thread (inherited before torch is first imported). torch's default of one thread per core made in-process
# work spin against the other worker: synthetic sampling of 16 groups (tests/synth.py) took 29.5 CPU seconds at
# 2 threads against 6.8 s at 1 on the loaded machine. Roles set theirs from shared.torch_threads regardless.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")
RENDEZVOUS_AT_START = {name: os.environ.get(name) for name in RANK_ENV}
# The warm-started model's build, started in the background when the session will need it (see below).
WARM_MODEL_PREFETCH: list[subprocess.Popen] = []


# The modules of whole `streamrl up` runs: the learning and stale-drop bounds of those that train the warm-started
# model were measured beside one other test at a time (benchmarks.load's SuiteLoad), never beside another up run.
UP_RUN_MODULES = (
    "tests/test_long_task.py", "tests/test_up_agentic.py",  # no warm-started model: first, beside its build
    "tests/test_chaos.py", "tests/test_colocated_up.py", "tests/test_gpu_check.py", "tests/test_ray_launcher.py",
    "tests/test_up.py",
)  # fmt: skip
UP_RUNS_UNIT = "up-runs"


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


# A hook of pytest-xdist (the dev extra), which `make test` runs the suite with; optional for a plain pytest.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The work units of `make test` (2 workers, --dist loadscope): UP_RUN_MODULES are one unit, run one after
    another on one worker while the other worker runs the rest of the suite, so an up run meets one other test at
    a time, as its bounds were measured; every other module is a unit of its own (its module-scoped fixtures are
    built once)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UpRunsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return UP_RUNS_UNIT if _module(nodeid) in UP_RUN_MODULES else _module(nodeid)

    return UpRunsTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """UP_RUN_MODULES first, in their order (the scheduler above hands out units in collection order: the longest
    unit starts first), then every other test in collection order."""
    warm = {_module(item.nodeid) for item in items if "warm_model" in getattr(item, "fixturenames", ())}
    unlisted = warm - set(UP_RUN_MODULES)
    if unlisted:
        raise pytest.UsageError(
            f"tests/conftest.py: add {sorted(unlisted)} (warm_model users) to UP_RUN_MODULES"
        )
    order = {module: i for i, module in enumerate(UP_RUN_MODULES)}
    items.sort(key=lambda item: order.get(_module(item.nodeid), len(order)))  # stable within a module


def pytest_collection_finish(session: pytest.Session) -> None:
    """When a selected test needs the warm-started model, its build (about 120 CPU seconds at one thread on a fresh
    machine, cached after) starts now in a background process; the up runs that need no such model go first, so
    the build overlaps them. Concurrent builders of the model wait on its lock file (streamrl.warm_start.build_once), so the
    `warm_model` fixture gets the finished one."""
    warm = any("warm_model" in getattr(item, "fixturenames", ()) for item in session.items)
    if warm and not session.config.getoption("collectonly"):
        build = "from streamrl.warm_start import init_warm_model; init_warm_model(progress=None)"
        WARM_MODEL_PREFETCH.append(subprocess.Popen(
            [sys.executable, "-c", build], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        ))  # fmt: skip


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that ended before its warm-model tests (a failure with -x, ^C) stops the build it started;
    what it wrote is a staging directory that the next build overwrites."""
    for build in WARM_MODEL_PREFETCH:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGTERM)  # its session: the build runs in a child of its own
            build.wait()


CHECKOUT_RUNS = Path(__file__).resolve().parents[1] / "runs"


def _files_under(root: Path) -> dict[str, int]:
    """Every file under ``root`` (relative path -> mtime in ns); empty when ``root`` does not exist."""
    files: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            with contextlib.suppress(FileNotFoundError):  # a file that vanished while we looked
                files[str(path.relative_to(root))] = path.stat().st_mtime_ns
    return files


@pytest.fixture(scope="session", autouse=True)
def nothing_written_under_the_checkouts_runs() -> Iterator[None]:
    """Tests write under tmp_path only: the checkout's runs/ is where `make run` keeps its run (runs/default is
    every role's default run directory, relative to the working directory, which is the checkout here). A file
    that appears or changes there during the session fails it, naming the files: some test started a role, or
    a benchmark, without a run directory or output of its own."""
    before = _files_under(CHECKOUT_RUNS)
    yield
    after = _files_under(CHECKOUT_RUNS)
    written = sorted(name for name, mtime in after.items() if before.get(name) != mtime)
    if written:
        shown = ", ".join(str(CHECKOUT_RUNS / name) for name in written[:20])
        more = f" and {len(written) - 20} more" if len(written) > 20 else ""
        pytest.fail(
            f"tests wrote {len(written)} file(s) into the checkout's runs/ (tests write under tmp_path only; "
            f"give the role or benchmark a --shared.run_dir / --out under tmp_path): {shown}{more}",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def no_distributed_state_left_in_pytest() -> Iterator[None]:
    """A test that initialises torch.distributed in pytest's own process (not in a worker it starts) leaves a bound
    MASTER_PORT and RANK behind for every later test's subprocesses: fail that test, not the 24 after it."""
    yield
    left = {n: os.environ.get(n) for n in RANK_ENV if os.environ.get(n) != RENDEZVOUS_AT_START[n]}
    dist = sys.modules.get("torch.distributed")
    initialized = bool(dist is not None and dist.is_available() and dist.is_initialized())
    if left or initialized:
        for name, value in RENDEZVOUS_AT_START.items():  # the next tests start clean
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if initialized:
            dist.destroy_process_group()
        pytest.fail(
            f"the test left torch.distributed state in pytest's process: env {left}, group {initialized}"
        )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """One real Redis server for the whole session; tests isolate themselves with the `redis_url` fixture."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-session"), RedisServerConfig())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """The session server's URL, flushed before each test so tests never see each other's keys."""
    redis_server.check()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A private Redis server for tests that kill or restart it."""
    server = EmbeddedRedis(tmp_path / "redis", RedisServerConfig())
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def warm_model() -> Path:
    """The warm-started tiny model that `streamrl up` serves by default (built once per machine, cached): the
    one the learning bounds were measured with."""
    from streamrl.warm_start import init_warm_model

    return init_warm_model()  # the background build's, once it is done (pytest_collection_modifyitems)
