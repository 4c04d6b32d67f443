"""The trajectory archive over a real Redis: every group once, with the learner's outcome joined, in Parquet that
pyarrow and datasets read; nothing lost or doubled when the archiver dies or cannot write."""

from __future__ import annotations

import asyncio
import errno
import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import redis

import archiver.archive as archive
from archiver.archive import (
    PENDING_FILE,
    ArchiveError,
    Archiver,
    archived_group_ids,
    part_paths,
    read_archive,
    rejected_row,
    write_rows,
)
from archiver.config import ArchiveConfig
from broker.client import BrokerKeys, connect
from broker.config import BrokerConfig
from broker.consumer import Consumer, Rejected
from broker.outcomes import Outcome
from broker.producer import Producer
from broker.record import synthetic_group
from broker.version import PolicyVersion
from common.config import SharedConfig
from common.versioning import ResumePoint
from common.wandb_run import open_run

SHARED = SharedConfig(run_id="arch")


def _broker(**kw: object) -> BrokerConfig:
    return BrokerConfig(block_ms=10, **kw)


async def _produce(url: str, broker: BrokerConfig, n: int, start: int = 0) -> list:
    client = connect(url, broker)
    producer = Producer(client, SHARED, broker, "test")
    rng = np.random.default_rng(start)
    groups = [
        synthetic_group(
            rng, run_id="arch", prompt_index=start + i, num_samples=3, num_tokens=5 + i, version=i % 3
        )
        for i in range(n)
    ]
    for g in groups:
        await producer.send(g)
    await client.aclose()
    return groups


async def _learner_decides(url: str, broker: BrokerConfig, decide: dict[int, Outcome | None]) -> None:
    """The learner's consumer group reads everything and acknowledges with the given outcomes (None: pending)."""
    client = connect(url, broker)
    consumer = Consumer(client, SHARED, broker, "rank0")
    got = []
    while batch := await consumer.read(count=64, block_ms=50):
        got += batch
    done = [(d, decide[d.group.prompt_index]) for d in got if decide.get(d.group.prompt_index) is not None]
    await consumer.ack([d for d, _ in done], [(d.group.group_id, o) for d, o in done])
    await client.aclose()


async def _archive_until(arch: Archiver, rows: int, pending: int, steps: int = 50) -> None:
    for _ in range(steps):
        await arch.step()
        if len(arch.waiting) == pending and len(arch.rows) >= rows:
            return
    raise AssertionError(f"archiver has {len(arch.rows)} rows and {len(arch.waiting)} waiting")


def _archiver(url: str, broker: BrokerConfig, directory: Path) -> tuple[Archiver, object]:
    client = connect(url, broker)
    config = ArchiveConfig(dir=directory, poll_s=0.01, flush_s=3600, recent=4)
    return Archiver(client, SHARED, broker, config), client


def test_every_group_once_with_its_outcome(tmp_path: Path, redis_url: str) -> None:
    broker = _broker()

    async def go() -> None:
        arch, client = _archiver(redis_url, broker, tmp_path / "archive")
        await arch.start()  # its consumer group exists before anything is produced
        groups = await _produce(redis_url, broker, 6)
        raw = redis.Redis.from_url(redis_url)
        raw.xadd(BrokerKeys.of(SHARED, broker).stream, {"v": 1, "gid": "junk", "d": b"\x00not msgpack"})
        trained = Outcome("trained", step=7, learner_version=6)
        stale = Outcome("dropped", step=7, reason="stale", learner_version=6)
        await _learner_decides(redis_url, broker, {0: trained, 1: trained, 2: stale, 3: trained})
        await _archive_until(arch, rows=4 * 3 + 1, pending=2)  # 4 decided groups x 3 samples + the junk entry
        await arch.flush()
        await arch.finish()  # groups 4 and 5 have no outcome: the pending snapshot
        recent = await archive.read_recent(client, arch.keys, 10)
        await client.aclose()

        table = read_archive(tmp_path / "archive")
        rows = table.to_pylist()
        assert len(rows) == 13 and len(part_paths(tmp_path / "archive")) == 1
        by_gid = {}
        for r in rows:
            by_gid.setdefault(r["group_id"], []).append(r)
        assert (
            by_gid["junk"][0]["outcome"] == "dead_lettered"
            and by_gid["junk"][0]["outcome_reason"] == "decode"
        )
        for g in groups[:4]:
            got = sorted(by_gid[g.group_id], key=lambda r: r["sample_index"])
            assert [r["completion_ids"] for r in got] == [s.output_ids.tolist() for s in g.samples]
            assert got[0]["prompt_ids"] == g.prompt_ids.tolist() and got[0]["extra"] == json.dumps(g.extra)
            assert [r["versions"] for r in got] == [s.versions.tolist() for s in g.samples]
            np.testing.assert_allclose(got[1]["logprobs"], g.samples[1].logprobs, rtol=0, atol=0)
            assert got[1]["reward_components"] == [
                {"name": "correct", "value": 1.0},
                {"name": "format", "value": 1.0},
            ]
            if g.prompt_index == 2:
                assert {r["outcome"] for r in got} == {"dropped"} and got[0]["outcome_reason"] == "stale"
                assert got[0]["staleness_max"] is None
            else:
                assert {r["outcome"] for r in got} == {"trained"} and got[0]["outcome_step"] == 7
                assert got[0]["staleness_max"] == 6 - g.min_version()
        pending = pq.read_table(tmp_path / "archive" / PENDING_FILE).to_pylist()
        assert sorted({r["group_id"] for r in pending}) == sorted(g.group_id for g in groups[4:])
        assert {r["outcome"] for r in pending} == {"pending"}
        # the archive group still holds the pending groups' entries: a resumed run archives them for good
        info = {g["name"]: g for g in raw.xinfo_groups(arch.keys.stream)}
        assert info[b"archive"]["pending"] == 2
        assert (
            len(recent) == 4
            and "tokens" in recent[0]
            and len(recent[0]["tokens"]) == len(recent[0]["versions"])
        )

    asyncio.run(go())
    import datasets  # the dev extra installs it

    ds = datasets.load_dataset(
        "parquet", data_files=[str(p) for p in part_paths(tmp_path / "archive")], split="train",
        cache_dir=str(tmp_path / "hf"),
    )  # fmt: skip
    assert ds.num_rows == 13 and set(ds.column_names) == set(archive.ARCHIVE_SCHEMA.names)


def test_staleness_after_a_resume_is_in_lineage_positions(tmp_path: Path, redis_url: str) -> None:
    """Published up to 10, resumed from the checkpoint of version 6 as 11 (position 6). Trained at 11, a group of
    version 0 is 6 positions stale and one of version 1 is 5 (as the learner measures it), not 11 and 10."""
    broker = _broker()

    async def go() -> None:
        arch, client = _archiver(redis_url, broker, tmp_path / "archive")
        await arch.start()
        policy = PolicyVersion(client, SHARED, broker)
        await policy.publish(10)
        await policy.record_resume(ResumePoint(11, 6, 4))
        await policy.publish(11)
        groups = await _produce(redis_url, broker, 2)  # versions 0 and 1
        trained = Outcome("trained", step=1, learner_version=11)
        await _learner_decides(redis_url, broker, {0: trained, 1: trained})
        await _archive_until(arch, rows=6, pending=0)
        await arch.flush()
        await client.aclose()
        rows = read_archive(tmp_path / "archive").to_pylist()
        got = {(r["group_id"], r["staleness_max"], r["staleness_mean"]) for r in rows}
        assert got == {(groups[0].group_id, 6, 6.0), (groups[1].group_id, 5, 5.0)}

    asyncio.run(go())


def test_a_crash_between_part_and_acknowledgement_archives_nothing_twice(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = _broker()

    async def go() -> None:
        first, c1 = _archiver(redis_url, broker, tmp_path / "a")
        await first.start()
        groups = await _produce(redis_url, broker, 4)
        await _learner_decides(
            redis_url, broker, {i: Outcome("trained", step=1, learner_version=1) for i in range(4)}
        )
        await _archive_until(first, rows=12, pending=0)

        async def dies(*_: object, **__: object) -> int:  # the process dies after the rename, before XACK
            raise ConnectionError("killed")

        monkeypatch.setattr(first.consumer, "ack", dies)
        with pytest.raises(ConnectionError):
            await first.flush()
        await c1.aclose()
        second, c2 = _archiver(redis_url, broker, tmp_path / "a")  # same consumer name: gets them back
        await second.start()
        for _ in range(5):
            await second.step()
        assert second.totals["duplicates"] == 4 and not second.rows
        await second.finish()
        pending = redis.Redis.from_url(redis_url).xpending(second.keys.stream, "archive")["pending"]
        await c2.aclose()
        assert pending == 0
        gids = read_archive(tmp_path / "a").column("group_id").to_pylist()
        assert sorted(gids) == sorted(g.group_id for g in groups for _ in g.samples)

    asyncio.run(go())


def test_an_unwritable_archive_stops_the_archiver_and_its_entries_wait(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = _broker()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")

    async def go() -> None:
        bad, c0 = _archiver(redis_url, broker, blocker / "archive")
        with pytest.raises(ArchiveError, match=r"archive.dir = .*file/archive.* is not writable"):
            await bad.start()
        await c0.aclose()
        full, c1 = _archiver(redis_url, broker, tmp_path / "ok")
        await full.start()
        groups = await _produce(redis_url, broker, 3)
        await _learner_decides(
            redis_url, broker, {i: Outcome("trained", step=1, learner_version=1) for i in range(3)}
        )
        await _archive_until(full, rows=9, pending=0)

        def no_space(*_: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(archive, "write_rows", no_space)
        with pytest.raises(ArchiveError, match="No space left"):
            await full.flush()
        status = await archive.read_status(c1, full.keys)
        assert "No space left" in status["error"]
        await c1.aclose()
        monkeypatch.undo()
        # nothing was acknowledged: the next archiver gets every group again
        back, c2 = _archiver(redis_url, broker, tmp_path / "ok")
        await back.start()
        await _archive_until(back, rows=9, pending=0)
        await back.finish()
        await c2.aclose()
        assert archived_group_ids(tmp_path / "ok") == {g.group_id for g in groups}

    asyncio.run(go())


def test_a_stored_payload_lives_until_both_groups_acknowledged(tmp_path: Path, redis_url: str) -> None:
    broker = _broker(inline_max_bytes=0)  # every payload in a key of its own

    async def go() -> None:
        arch, client = _archiver(redis_url, broker, tmp_path / "a")
        await arch.start()
        await _produce(redis_url, broker, 2)
        raw = redis.Redis.from_url(redis_url)
        payloads = lambda: raw.keys(BrokerKeys.of(SHARED, broker).payload_prefix + "*")  # noqa: E731
        assert len(payloads()) == 2
        await _learner_decides(
            redis_url, broker, {i: Outcome("trained", step=1, learner_version=1) for i in range(2)}
        )
        assert len(payloads()) == 2  # the archive group has not read them yet
        await _archive_until(arch, rows=6, pending=0)
        await arch.flush()
        assert payloads() == [] and read_archive(tmp_path / "a").num_rows == 6
        await client.aclose()

    asyncio.run(go())


def test_a_part_interrupted_mid_write_is_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [rejected_row(Rejected("1-0", "g", "decode", "bad msgpack"), "run", 0.0)]
    write_rows(tmp_path / "part-000000.parquet", rows)

    def dies(table: object, where: str, **_: object) -> None:
        Path(where).write_bytes(b"PAR1 half a file")  # what a crash in the middle of the write leaves
        raise OSError("killed")

    monkeypatch.setattr(archive.pq, "write_table", dies)
    with pytest.raises(OSError):
        write_rows(tmp_path / "part-000001.parquet", rows)
    assert [p.name for p in part_paths(tmp_path)] == ["part-000000.parquet"]
    assert read_archive(tmp_path).column("group_id").to_pylist() == ["g"]


def test_the_archive_is_logged_as_a_wandb_artifact(tmp_path: Path) -> None:
    parts = tmp_path / "archive"
    parts.mkdir()
    write_rows(parts / "part-000000.parquet", [rejected_row(Rejected("1-0", "g", "decode", "x"), "r", 0.0)])
    shared = SharedConfig(run_id="wbtest", run_dir=tmp_path)
    run = open_run(tmp_path, shared.run_id, "offline")  # the run's one wandb run, as the dashboard opens it
    assert archive.log_artifact(run, parts, shared) and not archive.log_artifact(
        run, tmp_path / "none", shared
    )
    run.finish()
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # what `wandb sync` uploads
    deadline = time.monotonic() + 30  # wandb's service process writes the record after finish() returns
    while b"part-000000.parquet" not in log.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    record = log.read_bytes()
    assert b"wbtest-trajectories" in record and b"part-000000.parquet" in record


def test_the_archiver_reads_once_per_poll_however_fast_groups_arrive(tmp_path: Path, redis_url: str) -> None:
    """One round per ``archive.poll_s``: a read that finds entries returns at once, and waking for every group
    would cost the Redis server and the archiver a round of calls per group (counted by Redis itself)."""
    broker, poll_s, n = _broker(), 0.5, 30
    raw = redis.Redis.from_url(redis_url)

    async def go() -> float:
        arch, client = _archiver(redis_url, broker, tmp_path / "a")
        arch.config = arch.config.model_copy(update={"poll_s": poll_s})
        await arch.start()
        raw.config_resetstat()
        stop = asyncio.Event()
        started = time.monotonic()
        rounds = asyncio.create_task(archive.archive_rounds(arch, stop, poll_s))
        for i in range(n):  # a group every 50 ms, as a busy fleet produces them
            await _produce(redis_url, broker, 1, start=i)
            await asyncio.sleep(0.05)
        await asyncio.sleep(poll_s + 0.2)
        stop.set()
        await rounds
        assert len(arch.waiting) == n  # every group read (none decided yet)
        await client.aclose()
        return time.monotonic() - started

    elapsed = asyncio.run(go())
    calls = int(raw.info("commandstats")["cmdstat_xreadgroup"]["calls"])
    assert 2 <= calls <= elapsed / poll_s + 2, (calls, elapsed)
