"""`streamrl up --up.launcher=ray` on a real multi-node Ray cluster on one host (ray.cluster_utils.Cluster: a
head and a worker node, each its own raylet with its own resources), and the learner's check that every rank
sees the same checkpoint directory.

The cluster's custom resources force the placement: the engines, the rollout worker and the evaluator need
``head_slot`` (only the head has it), and each learner rank needs one ``learner_slot`` (one on each node), so the
two ranks of the learner's placement group run on different nodes. A run of a few steps ends with summary.json
and an audit with nothing lost. Then, mid-run, the worker node is removed (its raylet, its actors and, with
them, learner rank 1): the run stops cleanly, naming the learner, and ``up --resume`` on the cluster with a new
worker node finishes it with every group accounted for and none trained twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.crash_cost import audit, learner_step
from broker.server import free_port

pytestmark = pytest.mark.timeout(600)

ray = pytest.importorskip("ray", reason="the ray extra (pip install 'streamrl[ray]')")

STEPS = 6


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


def test_learner_ranks_that_see_different_checkpoint_directories_stop_with_a_clear_error(
    tmp_path: Path,
) -> None:
    """Two real learner ranks (gloo) whose run directories differ, as on two nodes without shared storage: both
    exit 2 before training anything, naming the directory and the rank that did not see rank 0's nonce."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "streamrl", "learner", f"--shared.run_dir={tmp_path / f'node{rank}'}"],
            env=rank_env(rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    checkpoints = tmp_path / "node0" / "checkpoints"
    for out in outs:
        assert f"checkpoint directory {checkpoints} is not shared by every rank" in out, out
        assert "but rank 1 on" in out and "rank 0 on" in out and "from " + str(tmp_path / "node1") in out, out
    assert (checkpoints / ".shared-check").is_file()


def test_learner_ranks_that_share_the_checkpoint_directory_pass_the_check(tmp_path: Path) -> None:
    """The same check passes when both ranks see one directory (in-process: a real 2-rank gloo group)."""
    code = (
        "import sys, torch.distributed as dist; from pathlib import Path; "
        "from learner.checkpoint import check_shared_directory as c; "
        "dist.init_process_group('gloo'); c(Path(sys.argv[1]), dist.get_rank(), 2); print('ok')"
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "ck")],
            env=rank_env(r, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and all("ok" in o for o in outs), outs
