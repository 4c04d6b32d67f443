"""Read an offline wandb run's transaction log (``run-<id>.wandb``, what ``wandb sync`` uploads) with wandb's own
record schema (``wandb.proto.wandb_internal_pb2.Record``). The file is a LevelDB log (32 KiB blocks of
checksummed chunks) after a 7-byte W&B header; wandb 0.31 ships no Python reader of it, so the framing is read
here and every record is parsed by wandb's protobuf."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:HEADER]
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's trailer
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:  # zero padding: the rest of the block
            pos += room
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: Path) -> list[dict[str, Any]]:
    """Every ``run.log`` row of the file, its values decoded from JSON."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def run_record(path: Path) -> Any:
    """The file's run record (id, project, config)."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def config(path: Path) -> dict[str, Any]:
    """The run's config as the file holds it: the run record's, updated by every later config record."""
    out: dict[str, Any] = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = r.run.config.update if kind == "run" else r.config.update
            out.update({i.key: json.loads(i.value_json) for i in updates})
    return out
