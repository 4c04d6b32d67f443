"""`streamrl replay` against a real run: a 2-rank learner on a real Redis trains 3 steps, the archiver archives
them, and the replay of the archived batches (2 gloo ranks, no Redis) gives the run's checkpoints bit for bit; a
tampered sample shows as a difference, and an archive without batch positions is refused."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import redis
import torch

from archiver.archive import Archiver, TokenText, part_paths, read_archive, sample_rows, write_rows
from archiver.batches import NotReplayable, trained_steps
from archiver.config import ArchiveConfig
from broker.client import connect
from broker.config import BrokerConfig
from broker.outcomes import Outcome
from broker.record import synthetic_group
from common.config import SharedConfig
from rollout_fleet.model import init_tiny_model
from streamrl.replay import main as replay_main
from tests.synth import sample_groups
from tests.test_learner_train import produce, start_learner

pytestmark = pytest.mark.timeout(300)

STEPS, GROUPS_PER_STEP = 3, 4


async def _archive(url: str, shared: SharedConfig, groups: int | None) -> None:
    """Create the archive's consumer group (``groups`` None), or archive until ``groups`` groups are in parts."""
    client = connect(url, BrokerConfig(block_ms=10))
    archiver = Archiver(client, shared, BrokerConfig(block_ms=10), ArchiveConfig())
    await archiver.start()
    for _ in range(200 if groups else 0):
        await archiver.step()
        if archiver.totals["groups"] >= groups:
            break
    await archiver.flush()
    await client.aclose()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, redis_server) -> Path:  # noqa: ANN001
    """A finished 3-step run of a real learner (2 ranks, a checkpoint every step) with its archive."""
    root = tmp_path_factory.mktemp("replay")
    redis.Redis.from_url(redis_server.url).flushall()
    model_dir = init_tiny_model(root / "model")
    shared = SharedConfig(run_id="test", run_dir=root / "run")
    asyncio.run(_archive(redis_server.url, shared, None))  # its group holds every entry until archived
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # sampling with 2 threads on 2 busy cores takes 20x as long
    try:
        groups = sample_groups(str(model_dir), STEPS * GROUPS_PER_STEP, 4, version=0)
    finally:
        torch.set_num_threads(threads)
    for g in groups:  # signal in every group: each step trains all 16 samples, over several micro-batches per
        for s in g.samples:  # rank, so the groups' order changes the float sums (with 2 addends it would not)
            s.reward = float((g.prompt_index + s.sample_index) % 3)
    produce(redis_server.url, groups)
    proc = start_learner(
        root, redis_server.url, model_dir, f"--learner.max_steps={STEPS}", "--learner.checkpoint_every=1",
        "--shared.eta=8", "--learner.warmup_steps=2", "--learner.export_at_end=false",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    asyncio.run(_archive(redis_server.url, shared, STEPS * GROUPS_PER_STEP))
    return root / "run"


def _replay(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", "replay", str(run_dir), *args],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _rewrite_archive(run_dir: Path, change) -> None:  # noqa: ANN001
    """Rewrite every part of ``run_dir``'s archive through ``change(table) -> table``."""
    for part in part_paths(run_dir / "archive"):
        pq.write_table(change(pq.read_table(part)), part)


def test_the_replay_equals_the_runs_checkpoints_bit_for_bit(run_dir: Path, tmp_path: Path) -> None:
    archive = read_archive(run_dir / "archive")
    trained = archive.filter(pc.equal(archive.column("outcome"), "trained"))
    assert trained.num_rows == STEPS * GROUPS_PER_STEP * 4
    done = _replay(run_dir, "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert [c["step"] for c in report["comparisons"]] == [1, 2, 3]
    assert report["bit_identical"] and report["max_abs_diff"] == 0, report["comparisons"]
    assert report["world_size"] == 2 and report["steps_replayed"] == STEPS
    # the schedule warms up: each step's lr differs, and the replay's is the one the run recorded
    recorded = {
        s: lr
        for s, lr in zip(
            trained.column("outcome_step").to_pylist(), trained.column("outcome_lr").to_pylist(), strict=True
        )
    }
    assert len(set(recorded.values())) == STEPS and report["lr_mismatches"] == []
    assert [s["lr"] for s in report["steps"]] == [recorded[step] for step in range(1, STEPS + 1)]
    assert "bit-identical to the run" in done.stdout


def test_a_tampered_sample_shows_as_a_difference(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    tampered: list[str] = []

    def tamper(table: pa.Table) -> pa.Table:
        """One token of the last step's first group whose rewards differ (a group without signal is left out
        of the step: nothing of it reaches the weights)."""
        rows = table.to_pylist()
        last = [r for r in rows if r["outcome_step"] == STEPS]
        rewards: dict[str, set[float]] = {}
        for r in last:
            rewards.setdefault(r["group_id"], set()).add(r["reward"])
        signal = sorted(
            (r["outcome_position"], r["group_id"]) for r in last if len(rewards[r["group_id"]]) > 1
        )
        if signal and not tampered:
            row = next(r for r in rows if r["group_id"] == signal[0][1])
            row["completion_ids"][0] = (row["completion_ids"][0] + 1) % 100
            tampered.append(row["group_id"])
        return pa.Table.from_pylist(rows, schema=table.schema)

    _rewrite_archive(copy, tamper)
    assert tampered, "the last step has no group with signal"
    done = _replay(copy, "--from-checkpoint", str(STEPS - 1))
    assert done.returncode == 0, done.stderr
    report = json.loads((copy / "replay" / "replay.json").read_text())
    assert [c["step"] for c in report["comparisons"]] == [STEPS]
    assert not report["bit_identical"] and report["max_abs_diff"] > 0
    assert "NOT bit-identical" in done.stdout


def test_the_archive_gives_back_each_steps_groups_in_batch_order_as_they_were(tmp_path: Path) -> None:
    """archiver.batches over parts written by the archiver's own rows: the order is the positions', not the
    files'; the samples come back equal to the stream's; a missing position is named."""
    rng = np.random.default_rng(0)
    groups = [synthetic_group(rng, "r", i, num_samples=2, num_tokens=3 + i, prompt_len=4) for i in range(5)]
    placed = {0: (1, 1), 1: (1, 0), 2: (2, 0), 3: None, 4: (2, 1)}  # prompt -> (step, position); 3: dropped

    def rows(indices: list[int]) -> list[dict]:
        out = []
        for i in indices:
            step_position = placed[i]
            outcome = (
                Outcome("trained", step_position[0], learner_version=0, position=step_position[1], lr=0.5)
                if step_position
                else Outcome("dropped", 1, "stale")
            )
            out += sample_rows(groups[i], f"{i}-0", outcome, TokenText(None), 0.0)
        return out

    write_rows(tmp_path / "part-000000.parquet", rows([4, 0, 3]))
    write_rows(tmp_path / "part-000001.parquet", rows([1, 2]))
    steps = trained_steps(tmp_path)
    assert [(s.step, [g.prompt_index for g in s.groups], s.lr) for s in steps] == [
        (1, [1, 0], 0.5),
        (2, [2, 4], 0.5),
    ]
    assert all(g.samples == groups[g.prompt_index].samples for s in steps for g in s.groups)
    assert [s.step for s in trained_steps(tmp_path, until=1)] == [1]
    placed[4] = (2, 2)  # position 1 of step 2 is not archived
    write_rows(tmp_path / "part-000000.parquet", rows([4, 0, 3]))
    with pytest.raises(NotReplayable, match=r"step 2: the archive lacks the groups at positions \[1\]"):
        trained_steps(tmp_path)


def test_an_archive_without_batch_positions_is_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))

    def forget(table: pa.Table) -> pa.Table:  # as an archive written before positions were recorded
        index = table.schema.get_field_index("outcome_position")
        return table.set_column(index, "outcome_position", pa.nulls(table.num_rows, pa.int32()))

    _rewrite_archive(copy, forget)
    assert replay_main([str(copy)]) == 2  # refused before any rank starts: in this process
    stderr = capsys.readouterr().err
    assert "outcome_position" in stderr and "cannot be replayed" in stderr
