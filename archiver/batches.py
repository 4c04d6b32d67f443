"""The learner's batches rebuilt from a run's archive: every trained group, in the order and composition its step
trained it (``streamrl replay`` trains on these).

A trained row carries its outcome's step, policy version, learning rate and position among the groups of that
step (broker.outcomes.Outcome); the samples come back exactly as the learner decoded them from the stream (the
archive keeps token ids, behaviour log-probs, versions, masks, rewards and temperatures at their record dtypes).
An archive written before positions were recorded, or one missing a trained group (the archiver had not caught
up), cannot be replayed: :class:`NotReplayable` names the step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from archiver.archive import read_archive
from broker.record import Sample, TrajectoryGroup


class NotReplayable(ValueError):
    """The archive cannot give back what a step trained on."""


@dataclass
class TrainedStep:
    """The groups one learner step trained, in its batch's order (a step retried after a non-finite loss holds
    every batch it was tried with, one after the other)."""

    step: int
    learner_version: int
    lr: float
    groups: list[TrajectoryGroup]


def _named(items: list[dict[str, Any]] | None) -> dict[str, float]:
    return {item["name"]: item["value"] for item in items or []}


def _sample(row: dict[str, Any]) -> Sample:
    return Sample(
        sample_index=row["sample_index"],
        output_ids=np.asarray(row["completion_ids"], dtype=np.int32),
        logprobs=np.asarray(row["logprobs"], dtype=np.float32),
        versions=np.asarray(row["versions"], dtype=np.int32),
        loss_mask=np.asarray(row["loss_mask"], dtype=np.uint8),
        finish_reason=row["finish_reason"],
        truncated=row["truncated"],
        reward=row["reward"],
        reward_components=_named(row["reward_components"]),
        reward_status=row["reward_status"],
        reward_error=row["reward_error"],
        temperature=row["temperature"],
        top_p=row["top_p"],
        top_k=row["top_k"],
        engine_id=row["engine_id"],
        timings=_named(row["timings"]),
        num_resubmits=row["num_resubmits"],
        turn_bounds=np.asarray(row["turn_bounds"] or [], dtype=np.int32),
        episode=_named(row["episode"]),
    )


def _group(rows: list[dict[str, Any]]) -> TrajectoryGroup:
    """A group from its rows (one per sample, in the group's sample order: the archiver writes them so)."""
    first = rows[0]
    return TrajectoryGroup(
        run_id=first["run_id"], epoch=first["epoch"], prompt_index=first["prompt_index"],
        attempt=first["attempt"], prompt_id=first["prompt_id"], task=first["task"],
        prompt_ids=np.asarray(first["prompt_ids"], dtype=np.int32), samples=[_sample(r) for r in rows],
        worker_id=first["worker_id"], created_at=first["created_at"], extra=json.loads(first["extra"] or "{}"),
        group_id=first["group_id"],
    )  # fmt: skip


def check_replayable(directory: Path) -> int:
    """The archive's last trained step; :class:`NotReplayable` unless it has trained groups, each with its
    position. Cheap (three columns): a check before anything is started."""
    table = read_archive(directory, columns=["outcome", "outcome_position", "outcome_step"])
    table = table.filter(pc.equal(table.column("outcome"), "trained"))
    if not table.num_rows:
        raise NotReplayable(f"archive {directory}: no trained group in it")
    _refuse_unpositioned(table, directory)
    return int(pc.max(table.column("outcome_step")).as_py())


def _refuse_unpositioned(table: pa.Table, directory: Path) -> None:
    if table.column("outcome_position").null_count:
        raise NotReplayable(
            f"archive {directory}: trained rows without outcome_position (an archive written before the learner "
            "recorded each group's place in its step's batch): this run cannot be replayed"
        )


def trained_steps(directory: Path, until: int | None = None) -> list[TrainedStep]:
    """Every step up to ``until`` (all: None) with the groups it trained, oldest step first."""
    table = read_archive(directory)
    trained = pc.equal(table.column("outcome"), "trained")
    if until is not None:
        trained = pc.and_(trained, pc.less_equal(table.column("outcome_step"), until))
    table = table.filter(trained)
    _refuse_unpositioned(table, directory)
    by_group: dict[str, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        by_group.setdefault(row["group_id"], []).append(row)
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for gid, rows in by_group.items():
        positions = by_step.setdefault(rows[0]["outcome_step"], {})
        if rows[0]["outcome_position"] in positions:
            raise NotReplayable(
                f"step {rows[0]['outcome_step']}: groups {positions[rows[0]['outcome_position']][0]['group_id']!r} "
                f"and {gid!r} both at position {rows[0]['outcome_position']}"
            )
        positions[rows[0]["outcome_position"]] = rows
    return [_step(step, by_step[step]) for step in sorted(by_step)]


def _step(step: int, positions: dict[int, list[dict[str, Any]]]) -> TrainedStep:
    missing = sorted(set(range(max(positions) + 1)) - set(positions))
    if missing:
        raise NotReplayable(
            f"step {step}: the archive lacks the groups at positions {missing} of its batch (not archived yet?)"
        )
    ordered = [positions[p] for p in sorted(positions)]
    versions = {rows[0]["learner_version"] for rows in ordered}
    rates = {rows[0]["outcome_lr"] for rows in ordered}
    if len(versions) != 1 or len(rates) != 1:
        raise NotReplayable(
            f"step {step}: its groups disagree on the policy version {versions} or lr {rates}"
        )
    return TrainedStep(step, versions.pop(), rates.pop(), [_group(rows) for rows in ordered])
