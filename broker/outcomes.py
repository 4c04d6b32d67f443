"""What became of every prompt group: the durable outcome record, the dropped-group record, and the audit.

Every group that was generated ends in exactly one final outcome, keyed by group id in the hash
``BrokerKeys.outcomes`` (a JSON document per group):

- ``trained``: in the weights of learner step ``step`` (written when the checkpoint that contains it is durable
  and its entries are acknowledged, so it survives any crash and any checkpoint pruning);
- ``dropped``: not trained, with ``reason`` (``stale``, ``reward_error``, ... by the learner, written at the same
  acknowledgement; ``engine_failures``, ``bad_request``, ... by a rollout worker, written when it gives the
  group up, since such a group never reaches the stream);
- ``dead_lettered``: its entry failed to decode or validate, or was delivered too often (written with the
  dead letter).

A second, different outcome for a group that already has one (trained at two steps: a group trained twice) is
kept in ``BrokerKeys.outcome_conflicts``; a repeat of the same outcome (a retried acknowledgement) changes
nothing. :func:`audit` compares the outcomes with what was generated (the producer's group-id index, plus the
groups rollout workers dropped) and with what is still in the stream, and counts what is unaccounted for.

The learner also writes a record to the dropped stream (``BrokerKeys.dropped``) the moment it drops a group, for
dashboards; that one is provisional (a crash before the next checkpoint can undo the decision), the outcome is
final. Both are written by the Lua functions here, which the consumer's scripts and the admission scripts
(``broker.admission``: the dispatch's completion, the learner's drop) include: one definition of each record.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aioredis

from broker.client import BrokerKeys
from broker.config import BrokerConfig
from common.config import SharedConfig

OUTCOMES = ("trained", "dropped", "dead_lettered")

# record_drop: the dropped-stream record, once per group id; returns its stream id (the first one's on a repeat).
# record_outcome: a group's final outcome; 1 written, 0 a repeat of the same outcome, 2 a conflicting second
# outcome (kept apart, the first stays).
RECORDS_LUA = """
local function record_drop(stream, index, counters, gid, reason, fields)
  local existing = redis.call('HGET', index, gid)
  if existing then return existing end
  local t = redis.call('TIME')
  local f = {'gid', gid, 'reason', reason, 'ts', t[1] .. '.' .. string.format('%06d', tonumber(t[2]))}
  for i = 1, #fields do f[#f + 1] = fields[i] end
  local id = redis.call('XADD', stream, '*', unpack(f))
  redis.call('HSET', index, gid, id)
  redis.call('HINCRBY', counters, 'dropped', 1)
  redis.call('HINCRBY', counters, 'dropped:' .. reason, 1)
  return id
end
local function record_outcome(key, conflicts, gid, doc)
  local cur = redis.call('HGET', key, gid)
  if not cur then
    redis.call('HSET', key, gid, doc)
    return 1
  end
  local old, new = cjson.decode(cur), cjson.decode(doc)
  if old['outcome'] == new['outcome'] and old['step'] == new['step'] and old['reason'] == new['reason'] then
    return 0
  end
  redis.call('HSET', conflicts, gid, doc)
  return 2
end
"""


@dataclass(frozen=True)
class Outcome:
    """One group's final outcome (see the module docstring). ``step`` is the learner step that trained or dropped
    it (-1 when no learner step decided: a rollout drop, a dead letter). A trained group also carries what a
    replay of the step needs (``streamrl replay``): ``position``, its place among the groups the learner trained
    at ``step`` (the batch's order, which decides the packing and the float sums; a step retried after a
    non-finite loss continues the count), and ``lr``, the learning rate the step trained with (-1: not
    recorded, an outcome written before these fields existed)."""

    outcome: str
    step: int = -1
    reason: str = ""
    source: str = "learner"  # learner | rollout | consumer
    learner_version: int = -1
    entry_id: str = ""
    position: int = -1
    lr: float = -1.0

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome = {self.outcome!r}: must be one of {OUTCOMES}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Outcome:
        data = json.loads(raw)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def read_outcomes(client: aioredis.Redis, keys: BrokerKeys) -> dict[str, Outcome]:
    """Every group's final outcome, by group id."""
    raw = await client.hgetall(keys.outcomes)
    return {_text(gid): Outcome.from_json(doc) for gid, doc in raw.items()}


async def read_conflicts(client: aioredis.Redis, keys: BrokerKeys) -> dict[str, Outcome]:
    """Second outcomes that differed from a group's first (a group trained twice shows here)."""
    raw = await client.hgetall(keys.outcome_conflicts)
    return {_text(gid): Outcome.from_json(doc) for gid, doc in raw.items()}


@dataclass
class AuditReport:
    """Every group generated in a run, by what became of it. ``lost`` must be 0 and ``trained_twice`` 0."""

    generated: int = 0  # produced into the stream, or dropped by a rollout worker before it
    produced: int = 0  # produced into the stream (what the trajectory archive holds)
    trained: int = 0
    dropped: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    dead_lettered: int = 0  # with a group id; dead letters without one (undecodable) are counted apart
    dead_lettered_without_id: int = 0
    pending: int = 0  # in the stream, not yet trained or dropped (the next step's, or a resume's)
    trained_twice: int = 0
    conflicting: int = 0  # groups with two different final outcomes (trained twice is one kind)
    lost: int = 0  # generated, with no outcome and not in the stream
    lost_ids: list[str] = field(default_factory=list)  # the first few live ones, to look up
    pruned: int = 0  # of ``generated``: pruned from Redis (broker.retention), counted by outcome, not by id
    ok: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _stream_gids(client: aioredis.Redis, keys: BrokerKeys, consumer_group: str) -> set[str]:
    """Group ids of the stream's entries that the learner's consumer group has not acknowledged: pending (handed
    out) or not yet delivered."""
    out: set[str] = set()
    try:
        groups = await client.xinfo_groups(keys.stream)
    except aioredis.ResponseError:
        return out  # no stream yet
    last = "0-0"
    for g in groups:
        if _text(g["name"]) == consumer_group:
            last = _text(g["last-delivered-id"])
    pending: set[str] = set()
    start = "-"
    while True:
        rows = await client.xpending_range(keys.stream, consumer_group, min=start, max="+", count=1000)
        pending.update(_text(r["message_id"]) for r in rows)
        if len(rows) < 1000:
            break
        start = "(" + _text(rows[-1]["message_id"])
    cursor = "-"
    while True:
        entries = await client.xrange(keys.stream, cursor, "+", count=1000)
        for entry_id, fields in entries:
            eid = _text(entry_id)
            if eid in pending or _id_after(eid, last):
                out.add(_text(fields.get(b"gid", b"")))
        if len(entries) < 1000:
            break
        cursor = "(" + _text(entries[-1][0])
    out.discard("")
    return out


def _id_after(a: str, b: str) -> bool:
    am, _, aseq = a.partition("-")
    bm, _, bseq = b.partition("-")
    return (int(am), int(aseq)) > (int(bm), int(bseq))


async def audit(
    client: aioredis.Redis, shared: SharedConfig, config: BrokerConfig, max_ids: int = 20
) -> AuditReport:
    """Account for every group of the run (see :class:`AuditReport`)."""
    keys = BrokerKeys.of(shared, config)
    # one transaction: a prune between the reads would leave a group in neither the counts nor the hashes
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.pruned)
    pipe.hkeys(keys.group_ids)
    pipe.hgetall(keys.outcomes)
    pipe.hgetall(keys.outcome_conflicts)
    raw_pruned, raw_gids, raw_outcomes, raw_conflicts = await pipe.execute()
    pruned = {_text(k): int(v) for k, v in raw_pruned.items()}
    produced = {_text(g) for g in raw_gids}
    outcomes = {_text(g): Outcome.from_json(doc) for g, doc in raw_outcomes.items()}
    conflicts = {_text(g): Outcome.from_json(doc) for g, doc in raw_conflicts.items()}
    in_stream = await _stream_gids(client, keys, config.consumer_group)
    rollout_drops = {g for g, o in outcomes.items() if o.source == "rollout"}
    generated = produced | rollout_drops
    report = AuditReport(generated=len(generated), produced=len(produced))
    reasons: Counter[str] = Counter()
    _add_pruned(report, reasons, pruned)
    for o in outcomes.values():
        if o.outcome == "trained":
            report.trained += 1
        elif o.outcome == "dropped":
            report.dropped += 1
            reasons[o.reason] += 1
        else:
            report.dead_lettered += 1
    report.dropped_by_reason = dict(sorted(reasons.items()))
    report.dead_lettered_without_id = sum(
        1 for _, f in await client.xrange(keys.dead_letter) if not f.get(b"gid")
    )
    report.pending = len(in_stream - set(outcomes))
    report.conflicting = len(conflicts)
    report.trained_twice = sum(
        1 for g, o in conflicts.items() if o.outcome == "trained" and outcomes[g].outcome == "trained"
    )
    lost = sorted(generated - set(outcomes) - in_stream)
    report.lost, report.lost_ids = report.lost + len(lost), lost[:max_ids]
    report.ok = report.lost == 0 and report.conflicting == 0
    return report


def _add_pruned(report: AuditReport, reasons: Counter[str], pruned: dict[str, int]) -> None:
    """Start the report from the counts of the pruned groups (broker.retention): exact totals, no ids."""
    report.pruned = pruned.get("generated", 0)
    report.generated += report.pruned
    report.produced += pruned.get("produced", 0)
    report.trained = pruned.get("trained", 0)
    report.dropped = pruned.get("dropped", 0)
    report.dead_lettered = pruned.get("dead_lettered", 0)
    report.lost = pruned.get("lost", 0)
    for name, count in pruned.items():
        if name.startswith("dropped:"):
            reasons[name.split(":", 1)[1]] += count


def format_audit(report: AuditReport) -> str:
    """The audit as a few aligned lines."""
    reasons = ", ".join(f"{k} {v}" for k, v in report.dropped_by_reason.items()) or "none"
    lines = [
        f"generated      {report.generated}",
        f"trained        {report.trained}",
        f"dropped        {report.dropped} ({reasons})",
        f"dead-lettered  {report.dead_lettered}"
        + (
            f" (+{report.dead_lettered_without_id} without a group id)"
            if report.dead_lettered_without_id
            else ""
        ),
        f"pending        {report.pending} (in the stream, not consumed yet)",
        f"pruned         {report.pruned} (of generated: counted by outcome, no longer by id)",
        f"trained twice  {report.trained_twice}",
        f"lost           {report.lost}" + (f": {', '.join(report.lost_ids)}" if report.lost_ids else ""),
    ]
    if report.conflicting != report.trained_twice:
        lines.append(f"conflicting    {report.conflicting} (two different final outcomes)")
    lines.append("OK: every group is accounted for" if report.ok else "NOT OK: see lost / conflicting above")
    return "\n".join(lines)
