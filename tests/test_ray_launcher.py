"""`streamrl up --up.launcher=ray` on a real multi-node Ray cluster on one host (ray.cluster_utils.Cluster: a
head and a worker node, each its own raylet with its own resources), and the learner's check that every rank
sees the same checkpoint directory.

The cluster's custom resources force the placement: the engine needs ``head_slot`` (only the head has it), and
each learner rank one ``learner_slot`` (one on each node), so the two ranks of the learner's placement group run
on different nodes. Early in the run the rollout worker's process is killed and restarted through its actor.
Then the worker node is removed mid-run (its raylet, its actors and, with them, learner rank 1): the run stops
cleanly, naming the learner, and ``up --resume`` on the cluster with a new worker node finishes it, with every
group accounted for and none trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    # the ranks that do share it pass the same check: the two-node run below, whose ranks run on two nodes


MB = 1024**2
KILL_AT = 3  # checkpoints every 2 steps: the learner killed after step 3 goes back to step 2


@pytest.fixture
def cluster() -> Iterator[Any]:
    """A head node (the only one with ``head_slot``) and a worker node, each with one ``learner_slot``; small,
    no dashboard, and a node that stops answering is declared dead within ~1.5 s."""
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8, "resources": {"head_slot": 8, "learner_slot": 1}, "object_store_memory": 80 * MB,
            "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )  # fmt: skip
    try:
        yield c
    finally:
        c.shutdown()


def add_worker(c: Any) -> Any:
    node = c.add_node(num_cpus=4, resources={"learner_slot": 1}, object_store_memory=80 * MB)
    c.wait_for_nodes()
    return node


def up_args(run_dir: Path, model: Path, address: str) -> list[str]:
    return [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.model_path={model}",
        "--up.launcher=ray", f"--ray.address={address}",
        # engines and the evaluator on the head; one learner rank per node; the rest anywhere
        '--ray.engine_resources={"CPU": 1, "head_slot": 1}',
        '--ray.learner_resources={"CPU": 1, "learner_slot": 1}', "--ray.learner_strategy=STRICT_SPREAD",
        "--ray.placement_timeout_s=60", "--engine.count=1",
        f"--learner.max_steps={STEPS}", "--learner.checkpoint_every=2", "--learner.wandb_mode=disabled",
        "--dashboard.port=0", "--dashboard.metrics_base_port=0", "--eval.heldout_prompts=10",
        # 2 cores: no live evaluator and no archiver (the audit reads the learner's durable outcomes)
        "--eval.samples_per_prompt=2", "--eval.every_versions=0", "--archive.enabled=false",
        "--up.status_interval_s=5",
    ]  # fmt: skip


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def live_processes_of(run_dir: Path) -> list[str]:
    """Command lines of processes still running with this run directory in their arguments (read from /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(run_dir) in cmd and state != "Z" and "pytest" not in cmd:
            found.append(f"{proc.name}: {cmd[:200]}")
    return found


def test_up_on_a_two_node_ray_cluster_survives_a_node_loss_by_resuming(
    cluster: Any, warm_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    worker = add_worker(cluster)
    proc = start(up_args(run_dir, warm_model, cluster.address))
    deadline = time.monotonic() + 300

    def wait_for_step(step: int) -> None:
        while learner_step(run_dir) < step:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.5)

    # a role process that dies is restarted through its actor, as the local supervisor restarts its child
    wait_for_step(1)
    killed = json.loads((run_dir / "placement.json").read_text())["rollout-0"]["pid"]
    os.kill(killed, signal.SIGKILL)
    wait_for_step(KILL_AT)
    # the learner's two ranks run on the two nodes (the launcher asked each rank's actor where it runs)
    nodes = json.loads((run_dir / "placement.json").read_text())
    assert len({nodes[f"learner-rank-{r}"]["node_id"] for r in range(2)}) == 2, nodes
    assert nodes["learner-rank-1"]["node_id"] == worker.node_id, nodes
    assert nodes["engine-0"]["node_id"] == nodes["dashboard"]["node_id"] == nodes["redis"]["node_id"]
    assert nodes["engine-0"]["node_id"] != worker.node_id

    cluster.remove_node(worker, allow_graceful=False)  # its raylet and every actor on it, learner rank 1's
    out, _ = proc.communicate(timeout=180)
    # a learner failure stops the run cleanly: the reason named, every role stopped, summary.json written
    assert proc.returncode == 1, out[-4000:]
    assert "stopped because learner" in out and "learner rank 1" in out, out[-4000:]
    assert f"rollout-0 (pid {killed}) died with signal 9; restarting it" in out, out[-4000:]
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert KILL_AT <= stopped["steps"] < STEPS, stopped
    assert stopped["audit"]["lost"] == 0 and stopped["audit"]["trained_twice"] == 0, stopped["audit"]
    assert live_processes_of(run_dir) == []

    # resumed on the cluster with a new worker node: it finishes the run, with every group accounted for
    add_worker(cluster)
    resume = [
        sys.executable,
        "-m",
        "streamrl",
        "up",
        "--resume",
        str(run_dir),
        "--dashboard.metrics_base_port=0",
    ]
    done = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    report = audit(run_dir)
    assert summary["steps"] == STEPS and report["trained"] == STEPS * 16, (summary, report)
    assert report["lost"] == 0 and report["trained_twice"] == 0 and report["ok"], report
    assert summary["eval_after_is_final_policy"] is True, summary
    for role in ("redis", "engine-0", "learner", "learner-rank1", "rollout-0", "dashboard"):
        assert (run_dir / "logs" / f"{role}.log").stat().st_size > 0, role  # each role's log in the run dir
    assert "learner ranks on 2 node(s)" in done.stdout
    assert live_processes_of(run_dir) == []
