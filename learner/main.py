"""``streamrl learner``: run W learner ranks (spawned here, or under torchrun)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from broker.config import BrokerConfig
from broker.server import free_port
from common.auth import run_secret
from common.config import SharedConfig
from common.configlib import ConfigError
from common.cpus import pin_to_cpus
from common.discovery import resolve_redis_url
from common.lifecycle import die_with_parent
from learner.config import LearnerConfig
from weight_sync.config import WeightSyncConfig

log = logging.getLogger("streamrl.learner")


@dataclass(frozen=True)
class LearnerSections:
    """The config sections the learner reads (the application's root assembles and validates them)."""

    shared: SharedConfig
    broker: BrokerConfig
    learner: LearnerConfig
    weight_sync: WeightSyncConfig


def run_rank(cfg: LearnerSections) -> int:
    """The body of one rank (RANK / WORLD_SIZE / MASTER_* from the environment). Its imports are here: the
    launcher of the ranks (:func:`spawn_ranks`) never loads torch."""
    from learner.checkpoint import CheckpointDirNotShared, check_shared_directory
    from learner.distributed import init_distributed
    from learner.publish import VersionOnlyPublisher, WeightSyncPublisher, registry_engines
    from learner.trainer import Learner

    pin_to_cpus(cfg.learner.cpu_affinity, "learner.cpu_affinity")
    info = init_distributed(cfg.learner.pg_timeout_s, cfg.shared.torch_threads)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s learner[{info.rank}] %(levelname)s: %(message)s"
    )
    try:  # before anything is trained: a checkpoint only some ranks can see is no checkpoint
        check_shared_directory(Path(cfg.shared.run_dir) / "checkpoints", info.rank, info.world_size)
    except CheckpointDirNotShared as exc:
        log.error("%s", exc)
        print(f"streamrl learner: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # a configuration error (CONFIG_ERROR_EXIT): restarting cannot help
    url = resolve_redis_url(cfg.shared, wait_s=30)
    ws = cfg.weight_sync.for_placement(cfg.shared.placement, cfg.shared.eta)
    if ws.engines == "none":
        publisher = VersionOnlyPublisher()
    else:
        source = (
            (lambda: [(u.rstrip("/"), ws.engine_ranks) for u in ws.engine_urls]) if ws.engine_urls else None
        )
        source = source or registry_engines(url, cfg.shared)
        secret = run_secret(cfg.shared) if info.is_main else None  # rank 0 alone calls the engines
        publisher = WeightSyncPublisher(ws, source, info.is_main, ws.wait_for_engines_s, secret)
    learner = Learner(cfg.shared, cfg.broker, cfg.learner, info, publisher, url)
    learner.install_signal_handlers()
    code = learner.run()
    import torch.distributed as dist

    # Every rank leaves the group together: a rank that exits while the other still tears down its gloo
    # connections can abort it ("terminate called without an active exception") at interpreter exit.
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip C++ static destructors of the store and backend threads, which race at exit


# After one rank failed, how long the others get to notice (their collectives fail at once) before SIGKILL:
# none of them can make progress without it, and checkpoints are written atomically.
FAILED_RANK_GRACE_S = 5.0


def spawn_ranks(world: int, grace_s: float, rank_command: list[str]) -> int:
    """Start ``world`` rank processes and supervise them: SIGTERM is forwarded, one failure stops all.

    Each rank is SIGKILLed when this launcher dies: a restarted launcher's ranks must never run beside the
    old ones (two learners consuming as one consumer, writing one checkpoint directory)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        procs.append(subprocess.Popen(rank_command, env=env, preexec_fn=die_with_parent(signal.SIGKILL)))

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return max(abs(c) for c in codes)  # type: ignore[arg-type]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            log.error("learner rank %d exited with code %s: stopping the other ranks", rank, code)
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + min(grace_s, FAILED_RANK_GRACE_S)
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            return 2 if code == 2 else 1  # a configuration a rank refused stays one: restarting cannot help
        time.sleep(0.2)


def run_learner(cfg: LearnerSections, rank_command: list[str]) -> int:
    """Run as one rank under torchrun (RANK set), else spawn ``learner.world_size`` ranks, each running
    ``rank_command`` (the learner's entry path with the run's resolved config) with its RANK set."""
    if "RANK" in os.environ:
        return run_rank(cfg)
    if cfg.shared.model_path is None:
        raise ConfigError("shared.model_path is not set: the learner needs a Hugging Face model directory")
    return spawn_ranks(cfg.learner.world_size, cfg.learner.grace_s, rank_command)
