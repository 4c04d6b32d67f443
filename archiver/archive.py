"""The trajectory archive: every group of the stream, one Parquet row per sample, with the learner's outcome.

The archiver (``streamrl archive``, started by ``streamrl up``) reads the trajectory stream through its own
consumer group (``broker.archive_group``), so the learner is never slowed and the stream keeps each entry until
both groups acknowledged it (``Consumer.trim``; a payload stored by reference is deleted by the last group to
acknowledge its entry). A group's rows are written once its final outcome (broker.outcomes: trained at step N,
dropped with a reason, dead-lettered) is recorded, which the learner does when the checkpoint holding it is
durable; an entry that fails to decode is archived at once as dead-lettered (the learner's group dead-letters
the same entry for the same reason).

Exactly once: rows go to ``part-NNNNNN.parquet`` files, written to a temporary name, fsynced and renamed, so no
partial file is ever readable as complete; the entries are acknowledged in the archive group only after their
part is durable. After a crash the unacknowledged entries come back, and those whose group id is already in a
part (the crash fell between the rename and the acknowledgement) are acknowledged without a second row. When
the archiver stops, the groups still waiting for an outcome (the run ended before the learner decided them)
are written to ``pending.parquet``, rewritten at every stop and removed at every start: they stay pending in
the archive group and get their final row when a resumed run decides them. ``read_archive`` reads the parts;
``include_pending`` adds the pending snapshot.

The archive directory is the contract: :data:`ARCHIVE_SCHEMA`, :data:`PART_GLOB`, :data:`PENDING_FILE`,
defined here only; ``streamrl inspect`` and the tests read it through :func:`read_archive`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import redis.asyncio as aioredis

from archiver.config import ArchiveConfig
from broker.client import BrokerKeys, connect
from broker.config import BrokerConfig
from broker.consumer import Consumer, Delivery, Rejected
from broker.outcomes import Outcome
from broker.record import TrajectoryGroup
from broker.staleness import staleness_stats
from broker.version import PolicyVersion
from common.config import SharedConfig
from common.discovery import RedisNotFound, resolve_redis_url
from common.versioning import Lineage

log = logging.getLogger("streamrl.archive")

PART_GLOB = "part-*.parquet"
PENDING_FILE = "pending.parquet"
CONSUMER_NAME = "archiver"

_NAMED = pa.list_(pa.struct([("name", pa.string()), ("value", pa.float64())]))  # a dict, as datasets reads it
ARCHIVE_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("group_id", pa.string()),
        ("entry_id", pa.string()),
        ("epoch", pa.int32()),
        ("prompt_index", pa.int64()),
        ("attempt", pa.int32()),
        ("prompt_id", pa.string()),
        ("task", pa.string()),
        ("worker_id", pa.string()),
        ("created_at", pa.float64()),  # unix seconds, when the worker made the group
        ("extra", pa.string()),  # the group's free-form strings (e.g. the reference answer), JSON
        ("prompt_ids", pa.list_(pa.int32())),
        ("prompt_text", pa.string()),
        ("sample_index", pa.int32()),
        ("completion_ids", pa.list_(pa.int32())),  # exactly as the engine returned them
        ("completion_text", pa.string()),
        ("num_tokens", pa.int32()),
        ("versions", pa.list_(pa.int32())),  # policy version of each completion token
        ("min_version", pa.int32()),
        ("max_version", pa.int32()),
        ("logprobs", pa.list_(pa.float32())),  # behaviour log-prob of each completion token
        ("loss_mask", pa.list_(pa.uint8())),
        ("finish_reason", pa.string()),
        ("truncated", pa.bool_()),
        ("reward", pa.float64()),
        ("reward_components", _NAMED),
        ("reward_status", pa.string()),
        ("reward_error", pa.string()),
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("top_k", pa.int32()),
        ("engine_id", pa.string()),
        ("timings", _NAMED),
        ("num_resubmits", pa.int32()),
        # multi-turn episodes (record schema v2): [start, end) of each model turn in completion_ids, and the
        # episode's counters (turns, tool_calls, tool_errors, observation_tokens, env_reward); empty when single-turn
        ("turn_bounds", pa.list_(pa.int32())),
        ("num_turns", pa.int32()),
        ("episode", _NAMED),
        # what became of the group: trained | dropped | dead_lettered | pending (pending.parquet only)
        ("outcome", pa.string()),
        ("outcome_reason", pa.string()),
        ("outcome_step", pa.int64()),  # the learner step that trained or dropped it; null otherwise
        ("learner_version", pa.int64()),  # the policy version it was trained against; null otherwise
        # trained: its place among the groups of its step's batch, and the step's learning rate (what
        # `streamrl replay` rebuilds the step from); null otherwise, and in archives written before they existed
        ("outcome_position", pa.int32()),
        ("outcome_lr", pa.float64()),
        # token staleness when trained, in lineage positions as the learner measures it (a magnitude; without
        # resumes learner_version - min_version and learner_version - mean token version)
        ("staleness_max", pa.int32()),
        ("staleness_mean", pa.float32()),
        ("error", pa.string()),  # a rejected entry's decode or validation error
        ("archived_at", pa.float64()),
    ]
)


class TokenText:
    """Token ids to text through the model's ``tokenizer.json`` (decoding, never re-tokenising); empty text
    when the model directory has none."""

    def __init__(self, model_path: Path | None) -> None:
        self.tokenizer: Any = None
        path = Path(model_path) / "tokenizer.json" if model_path is not None else None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(path))
        elif model_path is not None:
            log.warning("no tokenizer.json in %s: the archive keeps token ids without text", model_path)

    def text(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False) if self.tokenizer else ""

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """Each token's own text (the live viewer colours them one by one)."""
        if not self.tokenizer:
            return ["" for _ in ids]
        return self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)


def _named(d: dict[str, float]) -> list[dict[str, Any]]:
    return [{"name": k, "value": float(v)} for k, v in sorted(d.items())]


def _outcome_fields(outcome: Outcome | None, versions: np.ndarray, lineage: Lineage | None) -> dict[str, Any]:
    if outcome is None:
        return {"outcome": "pending", "outcome_reason": "", "outcome_step": None, "learner_version": None,
                "outcome_position": None, "outcome_lr": None, "staleness_max": None,
                "staleness_mean": None}  # fmt: skip
    trained = outcome.outcome == "trained" and outcome.learner_version >= 0
    lv = outcome.learner_version
    stats = staleness_stats(lv, [versions], lineage) if trained else None
    return {
        "outcome": outcome.outcome,
        "outcome_reason": outcome.reason,
        "outcome_step": outcome.step if outcome.step >= 0 else None,
        "learner_version": lv if lv >= 0 else None,
        "outcome_position": outcome.position if trained and outcome.position >= 0 else None,
        "outcome_lr": outcome.lr if trained and outcome.lr >= 0 else None,
        "staleness_max": stats.max if stats is not None else None,
        "staleness_mean": stats.mean if stats is not None else None,
    }


def sample_rows(
    group: TrajectoryGroup,
    entry_id: str,
    outcome: Outcome | None,
    text: TokenText,
    now: float,
    lineage: Lineage | None = None,
) -> list[dict[str, Any]]:
    """One archive row per sample of ``group`` (``outcome`` None: still pending); ``lineage``: the run's
    (common.versioning), for staleness in positions (None: no resume, positions are versions)."""
    common = {
        "run_id": group.run_id, "group_id": group.group_id, "entry_id": entry_id, "epoch": group.epoch,
        "prompt_index": group.prompt_index, "attempt": group.attempt, "prompt_id": group.prompt_id,
        "task": group.task, "worker_id": group.worker_id, "created_at": group.created_at,
        "extra": json.dumps(group.extra, sort_keys=True), "prompt_ids": group.prompt_ids.tolist(),
        "prompt_text": text.text(group.prompt_ids.tolist()), "error": "", "archived_at": now,
    }  # fmt: skip
    rows = []
    for s in group.samples:
        rows.append(
            {
                **common,
                "sample_index": s.sample_index,
                "completion_ids": s.output_ids.tolist(),
                "completion_text": text.text(s.output_ids.tolist()),
                "num_tokens": s.num_tokens(),
                "versions": s.versions.tolist(),
                "min_version": s.min_version(),
                "max_version": s.max_version(),
                "logprobs": s.logprobs.tolist(),
                "loss_mask": s.loss_mask.tolist(),
                "finish_reason": s.finish_reason,
                "truncated": s.truncated,
                "reward": s.reward,
                "reward_components": _named(s.reward_components),
                "reward_status": s.reward_status,
                "reward_error": s.reward_error,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "engine_id": s.engine_id,
                "timings": _named(s.timings),
                "num_resubmits": s.num_resubmits,
                "turn_bounds": s.turn_bounds.tolist(),
                "num_turns": max(len(s.turn_bounds) // 2, 1),
                "episode": _named(s.episode),
                **_outcome_fields(outcome, s.versions, lineage),
            }  # fmt: skip
        )
    return rows


def rejected_row(rejected: Rejected, run_id: str, now: float) -> dict[str, Any]:
    """The one row of an entry that failed to decode or validate: no samples, the learner's dead-letter reason."""
    return {"run_id": run_id, "group_id": rejected.group_id, "entry_id": rejected.entry_id,
            "outcome": "dead_lettered", "outcome_reason": rejected.reason, "error": rejected.error,
            "archived_at": now}  # fmt: skip


def write_rows(path: Path, rows: list[dict[str, Any]]) -> int:
    """Write ``rows`` as one Parquet file at ``path`` atomically (temporary name, fsync, rename, fsync of the
    directory); returns its size in bytes."""
    table = pa.Table.from_pylist(rows, schema=ARCHIVE_SCHEMA)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path.stat().st_size


def part_paths(directory: Path) -> list[Path]:
    """The archive's complete parts, in the order they were written."""
    return sorted(Path(directory).glob(PART_GLOB))


def read_archive(
    directory: Path, include_pending: bool = False, columns: list[str] | None = None
) -> pa.Table:
    """Every archived row (each group once), plus the last stop's pending snapshot with ``include_pending``."""
    paths = part_paths(directory)
    pending = Path(directory) / PENDING_FILE
    if include_pending and pending.is_file():
        paths.append(pending)
    if not paths:
        return ARCHIVE_SCHEMA.empty_table().select(columns) if columns else ARCHIVE_SCHEMA.empty_table()
    return pa.concat_tables(pq.read_table(p, columns=columns, schema=ARCHIVE_SCHEMA) for p in paths)


def archived_group_ids(directory: Path) -> set[str]:
    """Group ids (and, for rejected entries without one, entry ids) already in a part."""
    table = read_archive(directory, columns=["group_id", "entry_id"])
    gids, eids = table.column("group_id").to_pylist(), table.column("entry_id").to_pylist()
    return {g or f"entry:{e}" for g, e in zip(gids, eids, strict=True)}


def _rows_bytes(rows: list[dict[str, Any]]) -> int:
    """A cheap estimate of the rows' size (their token arrays dominate)."""
    return sum(32 * (len(r.get("completion_ids") or ()) + len(r.get("prompt_ids") or ())) + 512 for r in rows)


class ArchiveError(RuntimeError):
    """The archive directory cannot be written (not writable, full): the archiver stops; entries wait."""


class Archiver:
    """Reads the archive consumer group, waits for each group's outcome, writes parts (module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        shared: SharedConfig,
        broker: BrokerConfig,
        config: ArchiveConfig,
    ) -> None:
        self.client, self.shared, self.config = client, shared, config
        self.keys = BrokerKeys.of(shared, broker)
        self.directory = config.directory(shared)
        self.consumer = Consumer(
            client, shared, broker, CONSUMER_NAME, consumer_group=broker.archive_group, dead_letters=False
        )
        self.text = TokenText(shared.model_path)
        self.policy = PolicyVersion(client, shared, broker)  # the lineage, for staleness in positions
        self.waiting: dict[str, Delivery] = {}  # group id -> delivery read, its outcome not yet final
        self.rows: list[dict[str, Any]] = []  # finished rows not yet in a part
        self.row_entries: list[str] = []  # their entry ids, acknowledged once the part is durable
        self.archived: set[str] = set()  # group ids in a part (from disk at start)
        self.first_row_at: float | None = None  # when the oldest unwritten row was finished (monotonic)
        self.next_part = 0
        self.totals = {"groups": 0, "rows": 0, "parts": 0, "bytes": 0, "duplicates": 0, "rejected": 0}

    async def start(self) -> None:
        """Check the directory, load what is archived, and create the consumer group (from the beginning)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".writable"
            probe.write_bytes(b"")
            probe.unlink()
            # the pending snapshot's groups are still pending in the archive group: they are read again
            (self.directory / PENDING_FILE).unlink(missing_ok=True)
            for leftover in self.directory.glob(".*.tmp"):  # a write that a crash interrupted
                leftover.unlink()
        except OSError as exc:
            raise ArchiveError(f"archive.dir = {str(self.directory)!r} is not writable: {exc}") from exc
        self.archived = archived_group_ids(self.directory)
        parts = part_paths(self.directory)
        self.next_part = int(parts[-1].stem.split("-")[1]) + 1 if parts else 0
        self.totals["parts"] = len(parts)
        await self.consumer.ensure_group()
        await self._status(error="")

    async def step(self) -> None:
        """Read what is new, archive what is decided, write a part when one is due."""
        block_ms = int(self.config.poll_s * 1000)
        read = await self.consumer.read(count=self.config.read_count, block_ms=block_ms)
        taken = [d for d in read + await self.consumer.claim_stale() if self._take(d)]
        await self._push_recent([d.group for d in taken])
        now = time.time()
        for rejected in self.consumer.take_rejected():
            self.totals["rejected"] += 1
            key = rejected.group_id or f"entry:{rejected.entry_id}"
            if key in self.archived:
                await self.consumer.ack([rejected.entry_id])
                continue
            self._finish([rejected_row(rejected, self.shared.run_id, now)], rejected.entry_id, key)
        await self._collect_outcomes()
        if self._part_due():
            await self.flush()
        else:
            await self._status(error="")  # the dashboard shows how many groups wait for their outcome

    def _take(self, d: Delivery) -> bool:
        """Hold a new group until its outcome; False for one already archived."""
        gid = d.group.group_id
        if gid in self.archived:  # read again after a crash between a part's rename and its acknowledgement
            self.totals["duplicates"] += 1
            self.row_entries.append(d.entry_id)  # acknowledged with the next part, no row
            return False
        self.waiting[gid] = d
        return True

    async def _collect_outcomes(self) -> None:
        if not self.waiting:
            return
        gids = list(self.waiting)
        docs = await self.client.hmget(self.keys.outcomes, gids)
        if all(doc is None for doc in docs):
            return
        # read after the outcomes: a learner records a resume's lineage before it trains under that version
        lineage = await self.policy.lineage()
        now = time.time()
        for gid, doc in zip(gids, docs, strict=True):
            if doc is None:
                continue
            d = self.waiting.pop(gid)
            rows = sample_rows(d.group, d.entry_id, Outcome.from_json(doc), self.text, now, lineage)
            self._finish(rows, d.entry_id, gid)

    def _finish(self, rows: list[dict[str, Any]], entry_id: str, key: str) -> None:
        self.rows.extend(rows)
        self.row_entries.append(entry_id)
        self.archived.add(key)
        self.totals["groups"] += 1
        if self.first_row_at is None:
            self.first_row_at = time.monotonic()

    def _part_due(self) -> bool:
        if not self.rows:
            return bool(self.row_entries)  # duplicates only: acknowledge them
        waited = time.monotonic() - (self.first_row_at or time.monotonic())
        return _rows_bytes(self.rows) >= self.config.part_bytes or waited >= self.config.flush_s

    async def flush(self) -> None:
        """Write the finished rows as the next part, then acknowledge their entries."""
        if self.rows:
            path = self.directory / f"part-{self.next_part:06d}.parquet"
            try:
                size = write_rows(path, self.rows)
            except OSError as exc:
                await self._status(error=str(exc))
                raise ArchiveError(f"cannot write {path}: {exc}") from exc
            self.next_part += 1
            self.totals["parts"] += 1
            self.totals["rows"] += len(self.rows)
            self.totals["bytes"] += size
            log.info("archived %d rows in %s (%d bytes)", len(self.rows), path.name, size)
        if self.row_entries:
            await self.consumer.ack(self.row_entries)
        self.rows, self.row_entries, self.first_row_at = [], [], None
        await self._status(error="")

    async def finish(self) -> None:
        """At stop: archive what was decided meanwhile, then snapshot the groups still pending."""
        await self._collect_outcomes()
        await self.flush()
        now = time.time()
        pending = [
            r for d in self.waiting.values() for r in sample_rows(d.group, d.entry_id, None, self.text, now)
        ]
        if pending:
            write_rows(self.directory / PENDING_FILE, pending)
        log.info("archiver stopped: %d groups pending an outcome (%s)", len(self.waiting), PENDING_FILE)

    async def _push_recent(self, groups: list[TrajectoryGroup]) -> None:
        """The live viewer's feed: the newest ``archive.recent`` samples of ``groups`` (oldest first), each
        token's text and policy version. Only those are decoded token by token: the rest would be trimmed."""
        newest = (
            [(g, s) for g in groups for s in g.samples][-self.config.recent :] if self.config.recent else []
        )
        if not newest:
            return
        docs = []
        for group, s in newest:
            doc = {"group_id": group.group_id, "prompt": self.text.text(group.prompt_ids.tolist()),
                   "sample_index": s.sample_index, "reward": s.reward, "components": s.reward_components,
                   "reward_status": s.reward_status, "finish_reason": s.finish_reason,
                   "tokens": self.text.pieces(s.output_ids.tolist()), "versions": s.versions.tolist(),
                   "created_at": group.created_at}  # fmt: skip
            docs.append(json.dumps(doc))
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(self.keys.archive_recent, *docs)
        pipe.ltrim(self.keys.archive_recent, 0, self.config.recent - 1)
        await pipe.execute()

    async def _status(self, error: str) -> None:
        fields = {**{k: str(v) for k, v in self.totals.items()}, "waiting": str(len(self.waiting))}
        fields["cpu_s"] = f"{cpu_seconds():.3f}"  # what archiving costs this process, for the overhead figure
        fields.update(error=error, dir=str(self.directory), updated_at=f"{time.time():.3f}")
        await self.client.hset(self.keys.archive_status, mapping=fields)


async def read_recent(client: aioredis.Redis, keys: BrokerKeys, count: int) -> list[dict[str, Any]]:
    """The live viewer's latest samples, newest first."""
    return [json.loads(raw) for raw in await client.lrange(keys.archive_recent, 0, count - 1)]


async def read_status(client: aioredis.Redis, keys: BrokerKeys) -> dict[str, str]:
    """The archiver's counters and last error, as it last wrote them."""
    raw = await client.hgetall(keys.archive_status)
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}  # fmt: skip


# ----- the role: ``streamrl archive`` ----------------------------------------------------------------------


def cpu_seconds() -> float:
    """User plus system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def archive_rounds(archiver: Archiver, stop: asyncio.Event, poll_s: float) -> None:
    """Step the archiver at most once per ``poll_s`` until ``stop``. A round that finds entries returns at
    once, so without the pause the archiver would wake for every group the workers produce: a read, a
    reclaim scan, an outcome lookup and a status write each time, for the Redis server (at normal priority)
    and for this process, taken from the learner's CPU on a small node."""
    while not stop.is_set():
        started = time.monotonic()
        await archiver.step()
        pause = poll_s - (time.monotonic() - started)
        if pause > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)


async def _serve(shared: SharedConfig, broker: BrokerConfig, config: ArchiveConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = connect(await asyncio.to_thread(resolve_redis_url, shared, 60.0), broker)
    archiver = Archiver(client, shared, broker, config)
    try:
        await archiver.start()
        log.info("archiving %s into %s", archiver.keys.stream, archiver.directory)
        await archive_rounds(archiver, stop, config.poll_s)
        await archiver.finish()
        log.info("archiver used %.2f CPU seconds (%s)", cpu_seconds(), archiver.totals)
    except ArchiveError as exc:
        # the run goes on without us; the archive group keeps our entries in the stream until we are back
        log.error("archiver stopped: %s; its entries wait in the stream until it runs again", exc)
        await archiver._status(error=str(exc))
        return 1
    finally:
        await client.aclose()
    return 0  # the parts go to the run's wandb run as an artifact from the dashboard (streamrl.wandb_log)


def log_artifact(run: Any, directory: Path, shared: SharedConfig) -> bool:
    """Add the archive's parts to an open wandb ``run`` as one dataset artifact, ``<run_id>-trajectories``
    (offline mode keeps it locally); False when there are none."""
    parts = part_paths(directory)
    if not parts:
        return False
    try:
        import wandb
    except ImportError:  # not when there is a run to log to; guarded all the same (benchmarks/gpu_bundle.py)
        return False
    artifact = wandb.Artifact(f"{shared.run_id}-trajectories", type="dataset")
    for part in parts:
        artifact.add_file(str(part), name=part.name)
    run.log_artifact(artifact)
    log.info("archive logged to wandb as artifact %s-trajectories (%d parts)", shared.run_id, len(parts))
    return True


def run_archive(shared: SharedConfig, broker: BrokerConfig, config: ArchiveConfig) -> int:
    """Run the archiver until SIGTERM / SIGINT (then archive what is decided and snapshot the pending);
    the exit code (1 when the archive directory cannot be written)."""
    import uvloop

    if config.nice:
        os.nice(config.nice)  # a background role: the learner and the engines come first for the CPU
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(shared, broker, config))
    except RedisNotFound as exc:
        log.error("archiver cannot run: %s", exc)
        return 1
