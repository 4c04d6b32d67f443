"""The consumer: consumer groups, explicit acknowledgement, reclaiming, dead letters, duplicates, trimming.

Delivery rules (docs/broker.md has the full story):

* :meth:`Consumer.read` hands out decoded, validated groups, in stream order. A payload stored beside its entry
  (``ref``, see broker/producer.py) is fetched in the round trip after XREADGROUP, together with the duplicate
  check and the counters. An entry that fails to decode or validate, or that was delivered more than
  ``max_deliveries`` times, goes to the dead-letter stream with its reason and raw fields, is acknowledged and
  leaves the backlog, all in one Lua script; the consumer moves on.
* The caller acknowledges explicitly with :meth:`Consumer.ack` - the learner does so only once the checkpoint
  containing the entries' effect is durable. XACK, the backlog decrement (by the number actually acknowledged),
  the record of acknowledged group ids and the deletion of a stored payload (by the last consumer group that
  still needed its entry: the learner's, or the archive's) happen in one Lua script, so a retried ack is
  harmless.
* A group id that this consumer group already acknowledged, or that is already handed out under another entry
  id, is a duplicate: it is acknowledged at once and counted, never handed out twice.
* :meth:`Consumer.claim_stale` takes over entries a dead consumer left pending (XAUTOCLAIM after
  ``claim_idle_ms``). After a reconnect (and on the first read) the consumer re-fetches its own pending entries
  that it never handed out: a retried XREADGROUP may have lost a reply the server had already recorded.
* :meth:`Consumer.trim` drops, with XTRIM MINID, only entries older than the oldest pending or undelivered
  entry of every consumer group; nothing unacknowledged is ever trimmed.
* :meth:`Consumer.drop` records a group the learner will not train on (stale, invalid, ...) in the durable
  dropped stream, once per group id; the original entry is acknowledged with the next checkpoint as usual.

The backlog counter counts the learner's consumer group (``BrokerConfig.consumer_group``); consumers of other
groups (e.g. a monitor) acknowledge without touching it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from broker.admission import DropRecorder, RedisCounters, give_back
from broker.client import BrokerKeys, connection_stats
from broker.codec import decode
from broker.config import BrokerConfig
from broker.outcomes import RECORDS_LUA, Outcome
from broker.protocols import Delivery, DropRecord, check_drop_reason
from broker.record import KNOWN_SCHEMA_VERSIONS, RecordError, TrajectoryGroup
from broker.retention import Pruner
from broker.staleness import StalenessCounters
from common.config import SharedConfig

# Stream ids compared as (milliseconds, sequence): parse and less, for the scripts below.
STREAM_ID_LUA = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
"""

# needed(stream, id): whether any consumer group still has the entry pending or not yet delivered. A payload
# stored by reference is deleted by the last group to acknowledge its entry (the learner's, or the archive's).
NEEDED_LUA = (
    STREAM_ID_LUA
    + """
local function needed(stream, id)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local name, last
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] end
      if g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
    if less(last, id) then return true end
    if #redis.call('XPENDING', stream, name, id, id, 1) > 0 then return true end
  end
  return false
end
"""
)

_ACK = (
    RECORDS_LUA
    + NEEDED_LUA
    + """
-- KEYS: 1 stream, 2 backlog counter, 3 group-id hash, 4 acked set, 5 counters hash, 6 outcomes, 7 conflicts
-- ARGV: 1 consumer group, 2 mode ('ack' | 'dup'), 3 primary group ('1' | '0'), 4 n,
--       n ids, n group ids ('' when unknown), n payload keys ('' inline, '?' unknown: read from the entry),
--       n outcome documents ('' for none; recorded for the group whether or not its entry was still pending)
local n = tonumber(ARGV[4])
local done, counted = 0, 0
for i = 1, n do
  local id, gid, ref, doc = ARGV[4 + i], ARGV[4 + n + i], ARGV[4 + 2 * n + i], ARGV[4 + 3 * n + i]
  if gid == '' or ref == '?' then
    local e = redis.call('XRANGE', KEYS[1], id, id)
    local entry_ref = ''
    if #e == 1 then
      local f = e[1][2]
      for j = 1, #f, 2 do
        if f[j] == 'gid' and gid == '' then gid = f[j + 1] end
        if f[j] == 'ref' then entry_ref = f[j + 1] end
      end
    end
    ref = entry_ref
  end
  -- XACK first: it needs no memory, and a script that has written is never refused later, so a server at its
  -- maxmemory still takes acknowledgements (which is how its memory comes back); HSET first would be refused
  local acked = redis.call('XACK', KEYS[1], ARGV[1], id) == 1
  if doc ~= '' and gid ~= '' then record_outcome(KEYS[6], KEYS[7], gid, doc) end
  if acked then
    done = done + 1
    if gid ~= '' then
      if ARGV[2] == 'ack' then redis.call('SADD', KEYS[4], gid) end
      -- only the entry the producer script added counts in the backlog and owns its payload key
      if redis.call('HGET', KEYS[3], gid) == id then
        if ARGV[3] == '1' then counted = counted + 1 end
        if ref ~= '' and not needed(KEYS[1], id) then redis.call('UNLINK', ref) end
      end
    end
  end
end
if counted > 0 then redis.call('DECRBY', KEYS[2], counted) end
if done > 0 then
  redis.call('HINCRBY', KEYS[5], ARGV[2] == 'ack' and 'acknowledged' or 'duplicates', done)
end
return done
"""
)

_DEAD_LETTER = (
    RECORDS_LUA
    + NEEDED_LUA
    + """
-- KEYS: 1 stream, 2 dead-letter stream, 3 backlog counter, 4 group-id hash, 5 counters hash, 6 outcomes,
--       7 conflicts
-- ARGV: 1 consumer group, 2 entry id, 3 group id or '', 4 reason, 5 error, 6 consumer, 7 deliveries,
--       8 primary group ('1' | '0'), 9 payload key or '', 10 outcome document, 11.. raw field name/value pairs
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
local t = redis.call('TIME')
local fields = {'reason', ARGV[4], 'error', ARGV[5], 'entry_id', ARGV[2], 'gid', ARGV[3],
  'consumer_group', ARGV[1], 'consumer', ARGV[6], 'deliveries', ARGV[7],
  'ts', t[1] .. '.' .. string.format('%06d', tonumber(t[2]))}
for i = 11, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
if ARGV[8] == '1' and ARGV[3] ~= '' then record_outcome(KEYS[6], KEYS[7], ARGV[3], ARGV[10]) end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[4], ARGV[3]) == ARGV[2] then
  if ARGV[8] == '1' then redis.call('DECR', KEYS[3]) end
  if ARGV[9] ~= '' and not needed(KEYS[1], ARGV[2]) then redis.call('UNLINK', ARGV[9]) end
end
redis.call('HINCRBY', KEYS[5], 'dead_lettered', 1)
redis.call('HINCRBY', KEYS[5], 'dead_lettered:' .. ARGV[4], 1)
return 1
"""
)

_TRIM = (
    STREAM_ID_LUA
    + """
-- KEYS: 1 stream, 2 retired groups (broker.retention). ARGV: 1 most entries per call.
-- Trim below the oldest entry that any consumer group has pending or not yet delivered (at most ARGV[1] entries
-- a call), putting each trimmed entry's group on the retired list: nothing but the audit reads it any more.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return 0 end
local minid = nil
for _, g in ipairs(groups) do
  local name, last
  for j = 1, #g, 2 do
    if g[j] == 'name' then name = g[j + 1] end
    if g[j] == 'last-delivered-id' then last = g[j + 1] end
  end
  local ms, seq = parse(last)
  local keep = string.format('%d-%d', ms, seq + 1)
  local p = redis.call('XPENDING', KEYS[1], name)
  if p[1] > 0 and less(p[2], keep) then keep = p[2] end
  if minid == nil or less(keep, minid) then minid = keep end
end
local rows = redis.call('XRANGE', KEYS[1], '-', '(' .. minid, 'COUNT', tonumber(ARGV[1]))
if #rows == 0 then return 0 end
if #rows == tonumber(ARGV[1]) then
  local ms, seq = parse(rows[#rows][1])
  minid = string.format('%d-%d', ms, seq + 1)
end
local retired = {}
for _, row in ipairs(rows) do
  local gid, pos = '', ''
  local f = row[2]
  for j = 1, #f, 2 do
    if f[j] == 'gid' then gid = f[j + 1] end
    if f[j] == 'pos' then pos = f[j + 1] end
  end
  if gid ~= '' then retired[#retired + 1] = gid .. '|' .. pos .. '|' .. row[1] end
end
-- XTRIM first: it frees memory, and a script that has written is never refused later, so a server at its
-- maxmemory still trims; an RPUSH first would be refused
local trimmed = redis.call('XTRIM', KEYS[1], 'MINID', minid)
for _, item in ipairs(retired) do redis.call('RPUSH', KEYS[2], item) end
return trimmed
"""
)


@dataclass
class Rejected:
    """An entry that failed to decode or validate, handed to a consumer that keeps no dead letters (a secondary
    group such as the archive's: the learner's group dead-letters the same entry). Acknowledge it by
    ``entry_id`` once it is accounted for."""

    entry_id: str
    group_id: str  # the entry's gid field, '' when it has none
    reason: str  # the dead-letter reason code the learner's group records for it
    error: str


@dataclass
class _Bad:
    reason: str  # short code: decode, missing_field, schema_version, invalid, max_deliveries
    error: str


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _int(raw: Any) -> int:
    """An entry's integer field, 0 when absent or malformed (counters must not crash the consumer)."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def classify(exc: RecordError) -> str:
    """The dead-letter reason code of a record error (the full message goes with it)."""
    if exc.field == "schema_version":
        return "schema_version"
    if exc.field == "<payload>":
        return "decode"
    if exc.reason.startswith("missing"):
        return "missing_field"
    return "invalid"


@dataclass
class _Entry:
    """One raw stream entry with its payload (inline, or fetched from its key; None if that key is gone)."""

    entry_id: str
    fields: dict[bytes, bytes]
    gid: str
    ref: str  # payload key, '' for inline payloads
    payload: bytes | None
    deliveries: int


def _check_entry(e: _Entry, decoder: Callable[[bytes], TrajectoryGroup] = decode) -> TrajectoryGroup | _Bad:
    """Decode and validate one raw entry: the group, or why it is bad."""
    fields = e.fields
    missing = [k for k in ("v", "gid") if k.encode() not in fields]
    if b"d" not in fields and b"ref" not in fields:
        missing.append("d")
    if missing:
        return _Bad("missing_field", f"entry field(s) {missing} missing; has {sorted(map(_text, fields))}")
    try:
        version = int(fields[b"v"])
    except ValueError:
        return _Bad("schema_version", f"entry field v = {fields[b'v']!r}: not an int")
    if version not in KNOWN_SCHEMA_VERSIONS:
        return _Bad("schema_version", f"entry field v = {version}: unknown schema version")
    if e.payload is None:
        return _Bad("missing_payload", f"payload key {e.ref!r} does not exist")
    try:
        group = decoder(e.payload)
    except RecordError as exc:
        return _Bad(classify(exc), str(exc))
    if group.group_id != e.gid:
        return _Bad("invalid", f"entry field gid = {e.gid!r} differs from the payload's {group.group_id!r}")
    if group.schema_version != version:
        return _Bad(
            "schema_version", f"entry field v = {version} differs from the payload's {group.schema_version}"
        )
    return group


class Consumer:
    """Reads one consumer group of the trajectory stream under a stable consumer ``name`` (a learner that
    restarts under the same name gets its unacknowledged entries back on its first read). ``decoder`` is
    the payload codec (the msgpack one; the benchmark passes its JSON baseline through the same path).
    With ``dead_letters=False`` (a secondary group) bad entries are not dead-lettered again but kept for
    :meth:`take_rejected`, and no entry is given up for its delivery count."""

    def __init__(
        self,
        client: aioredis.Redis,
        shared: SharedConfig,
        config: BrokerConfig,
        name: str,
        consumer_group: str | None = None,
        decoder: Callable[[bytes], TrajectoryGroup] = decode,
        dead_letters: bool = True,
    ) -> None:
        if not name:
            raise ValueError(f"consumer name = {name!r}: must not be empty")
        self.client = client
        self.config = config
        self.name = name
        self.group_name = consumer_group or config.consumer_group
        self.counts_backlog = self.group_name == config.consumer_group
        self.keys = BrokerKeys.of(shared, config)
        self.decoder = decoder
        self._ack = client.register_script(_ACK)
        self._dead_letter = client.register_script(_DEAD_LETTER)
        self._drops = DropRecorder(client, self.keys)
        self._trim = client.register_script(_TRIM)
        self._pruner = Pruner(client, shared, config)
        self._handed: dict[str, tuple[str, str]] = {}  # entry id -> (group id, payload key): not yet acked
        self._handed_gids: dict[str, str] = {}  # group id -> entry id
        self._seen_connects = -1  # connection count at the last recovery; -1: never recovered
        self._claim_cursor = "0-0"
        self._group_ready = False
        self.dead_letters = dead_letters
        self._rejected: list[Rejected] = []  # bad entries not yet taken (dead_letters=False)

    # ----- setup and recovery -------------------------------------------------------------------------

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) reading from the beginning; an existing group is fine."""
        try:
            await self.client.xgroup_create(self.keys.stream, self.group_name, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def _maybe_recover(self) -> list[Delivery]:
        connects = connection_stats(self.client).connects
        if connects == self._seen_connects:
            return []
        self._seen_connects = connects
        return await self.recover_own()

    async def recover_own(self) -> list[Delivery]:
        """Re-fetch this consumer's pending entries that were never handed out (a lost XREADGROUP reply, or a
        previous process with the same name); the delivery count goes up by one."""
        lost: dict[str, int] = {}
        start = "-"
        while True:
            rows = await self.client.xpending_range(
                self.keys.stream, self.group_name, min=start, max="+", count=1000, consumername=self.name
            )
            for row in rows:
                entry_id = _text(row["message_id"])
                if entry_id not in self._handed:
                    lost[entry_id] = int(row["times_delivered"]) + 1
            if len(rows) < 1000:
                break
            start = "(" + _text(rows[-1]["message_id"])
        if not lost:
            return []
        entries = await self.client.xclaim(
            self.keys.stream, self.group_name, self.name, min_idle_time=0, message_ids=list(lost)
        )
        await self.client.hincrby(self.keys.counters, "recovered", len(entries))
        return await self._process(entries, {_text(i): lost[_text(i)] for i, _ in entries})

    # ----- reading --------------------------------------------------------------------------------------

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` new valid groups, waiting up to ``block_ms`` (0: no wait) for the first. Bad entries
        are dead-lettered on the way and duplicates acknowledged, so fewer than were read may come back."""
        if not self._group_ready:
            await self.ensure_group()
        recovered = await self._maybe_recover()
        if recovered:
            return recovered
        count = count or self.config.read_count
        block = self.config.block_ms if block_ms is None else block_ms
        res = await self.client.xreadgroup(
            self.group_name, self.name, {self.keys.stream: ">"}, count=count, block=block or None
        )
        out = await self._process(res[0][1], {}) if res else []
        # A reconnect inside that call may have cost an earlier attempt's reply: fetch what it delivered.
        out += await self._maybe_recover()
        return sorted(out, key=lambda d: _id_key(d.entry_id))

    async def claim_stale(self, count: int | None = None) -> list[Delivery]:
        """Take over entries another consumer left pending for more than ``claim_idle_ms`` (XAUTOCLAIM).
        Call it periodically; each call continues the scan of the pending list where the last one stopped."""
        if not self._group_ready:
            await self.ensure_group()
        count = count or self.config.read_count
        cursor, entries, *_deleted = await self.client.xautoclaim(
            self.keys.stream,
            self.group_name,
            self.name,
            min_idle_time=self.config.claim_idle_ms,
            start_id=self._claim_cursor,
            count=count,
        )
        self._claim_cursor = _text(cursor)
        # Our own handed-out entries may be idle that long too (a slow checkpoint): they stay ours, not new.
        entries = [(i, f) for i, f in entries if _text(i) not in self._handed]
        if not entries:
            return []
        pipe = self.client.pipeline(transaction=False)
        for entry_id, _ in entries:
            pipe.xpending_range(self.keys.stream, self.group_name, min=entry_id, max=entry_id, count=1)
        pipe.hincrby(self.keys.counters, "reclaimed", len(entries))
        *pending, _ = await pipe.execute()
        counts = {_text(p[0]["message_id"]): int(p[0]["times_delivered"]) for p in pending if p}
        return await self._process(entries, counts)

    async def _process(self, entries: list[tuple[Any, dict]], counts: dict[str, int]) -> list[Delivery]:
        """Fetch payloads, acknowledge duplicates, dead-letter the bad, hand out the rest - in stream order."""
        batch = await self._fetch(entries, counts)
        out: list[Delivery] = []
        dups: list[_Entry] = []
        given: set[str] = set()
        for e, was_acked in batch:
            held = self._handed_gids.get(e.gid)
            if e.gid and (was_acked or (held is not None and held != e.entry_id) or e.gid in given):
                dups.append(e)
                continue
            checked = _check_entry(e, self.decoder)
            over = self.dead_letters and e.deliveries > self.config.max_deliveries
            if not isinstance(checked, _Bad) and over:
                checked = _Bad("max_deliveries", f"delivered {e.deliveries} times > max_deliveries")
            if isinstance(checked, _Bad) and not self.dead_letters:
                self._rejected.append(Rejected(e.entry_id, e.gid, checked.reason, checked.error))
                self._handed[e.entry_id] = (e.gid, e.ref)  # acknowledged by the caller, not fetched again
                continue
            if isinstance(checked, _Bad):
                await self._to_dead_letter(e, checked)
                continue
            given.add(e.gid)
            out.append(Delivery(e.entry_id, checked, e.deliveries, len(e.payload or b"")))
            self._handed[e.entry_id] = (e.gid, e.ref)
            self._handed_gids[e.gid] = e.entry_id
        if dups:
            await self._run_ack(
                [e.entry_id for e in dups], [e.gid for e in dups], [""] * len(dups), mode="dup"
            )
        return out

    async def _fetch(
        self, entries: list[tuple[Any, dict]], counts: dict[str, int]
    ) -> list[tuple[_Entry, bool]]:
        """One round trip: payloads stored by reference, which group ids were already acknowledged, counters."""
        batch = []
        for raw_id, fields in entries:
            entry_id = _text(raw_id)
            gid = _text(fields.get(b"gid", b""))
            ref = _text(fields.get(b"ref", b"")) if b"d" not in fields else ""
            batch.append(_Entry(entry_id, fields, gid, ref, fields.get(b"d"), counts.get(entry_id, 1)))
        nbytes = sum(len(e.payload) if e.payload is not None else _int(e.fields.get(b"n")) for e in batch)
        pipe = self.client.pipeline(transaction=False)
        refs = [e for e in batch if e.ref]
        for e in refs:
            pipe.get(e.ref)
        gids = [e.gid for e in batch]
        if gids:
            pipe.smismember(self.keys.acked(self.group_name), gids)
        pipe.hincrby(self.keys.counters, "consumed", len(batch))
        pipe.hincrby(self.keys.counters, "consumed_bytes", nbytes)
        res = await pipe.execute()
        for e, payload in zip(refs, res, strict=False):
            e.payload = payload
        acked = res[len(refs)] if gids else []
        return list(zip(batch, [bool(a) for a in acked], strict=True))

    async def _to_dead_letter(self, e: _Entry, bad: _Bad) -> None:
        raw: list[Any] = []
        for k, v in e.fields.items():
            raw += [b"raw:" + (k if isinstance(k, bytes) else k.encode()), v]
        if e.ref and e.payload is not None:
            raw += [b"payload", e.payload]
        outcome = Outcome("dead_lettered", reason=bad.reason, source="consumer", entry_id=e.entry_id)
        args = [self.group_name, e.entry_id, e.gid, bad.reason, bad.error, self.name, e.deliveries]
        args += ["1" if self.counts_backlog else "0", e.ref, outcome.to_json(), *raw]
        keys = [self.keys.stream, self.keys.dead_letter, self.keys.backlog, self.keys.group_ids]
        keys += [self.keys.counters, self.keys.outcomes, self.keys.outcome_conflicts]
        await self._dead_letter(keys=keys, args=args)

    # ----- acknowledging --------------------------------------------------------------------------------

    async def ack(
        self,
        entries: list[str] | list[Delivery],
        outcomes: list[tuple[str, Outcome] | None] | None = None,
    ) -> int:
        """Acknowledge entries (ids or deliveries) and take them off the backlog; returns how many were pending
        (a repeated ack returns 0 and changes nothing). Call only once their effect is durable.

        ``outcomes``, one per entry (None: none), are ``(group id, final outcome)`` pairs recorded in the same
        atomic step (broker.outcomes), so an acknowledged group always has its outcome; a repeat records
        nothing new."""
        ids = [e.entry_id if isinstance(e, Delivery) else e for e in entries]
        if not ids:
            return 0
        outcomes = outcomes if outcomes is not None else [None] * len(ids)
        if len(outcomes) != len(ids):
            raise ValueError(f"{len(outcomes)} outcomes for {len(ids)} entries")
        gids, refs, docs = [], [], []
        for entry_id, outcome in zip(ids, outcomes, strict=True):
            gid, ref = self._handed.get(entry_id, ("", "?"))  # not handed out here: the entry says
            gids.append(gid or (outcome[0] if outcome else ""))
            refs.append(ref)
            docs.append(outcome[1].to_json() if outcome else "")
        done = await self._run_ack(ids, gids, refs, mode="ack", docs=docs)
        for entry_id in ids:
            gid, _ = self._handed.pop(entry_id, ("", ""))
            if gid and self._handed_gids.get(gid) == entry_id:
                del self._handed_gids[gid]
        return done

    async def _run_ack(
        self, ids: list[str], gids: list[str], refs: list[str], mode: str, docs: list[str] | None = None
    ) -> int:
        keys = [
            self.keys.stream,
            self.keys.backlog,
            self.keys.group_ids,
            self.keys.acked(self.group_name),
            self.keys.counters,
            self.keys.outcomes,
            self.keys.outcome_conflicts,
        ]
        docs = docs if docs is not None else [""] * len(ids)
        primary = "1" if self.counts_backlog else "0"
        args = [self.group_name, mode, primary, len(ids), *ids, *gids, *refs, *docs]
        return int(await self._ack(keys=keys, args=args))

    async def is_duplicate(self, group_id: str) -> bool:
        """Whether ``group_id`` was already acknowledged by this consumer group or is handed out right now."""
        if group_id in self._handed_gids:
            return True
        return bool(await self.client.sismember(self.keys.acked(self.group_name), group_id))

    def take_rejected(self) -> list[Rejected]:
        """The bad entries read since the last call (``dead_letters=False`` only); they stay pending until
        acknowledged."""
        out, self._rejected = self._rejected, []
        return out

    @property
    def outstanding(self) -> int:
        """Entries handed out by this consumer and not yet acknowledged."""
        return len(self._handed)

    # ----- drops and trimming ---------------------------------------------------------------------------

    async def drop(
        self,
        item: Delivery | TrajectoryGroup,
        reason: str,
        detail: str = "",
        admission: StalenessCounters | str | None = None,
    ) -> DropRecord:
        """Record in the durable dropped stream that a group is not trained on, and why (a short code such as
        ``stale``, ``zero_signal``, ``reward_error``). Once per group id: a repeated drop returns the first
        record's id and changes nothing. With ``admission`` (the admission counters, or the key of their Redis
        hash) the first drop also gives the group's admission capacity back (accepted -> dropped): in the same
        script for counters in Redis (broker.admission.RedisCounters), right after it for others. The original
        entry still has to be acknowledged with the next checkpoint."""
        check_drop_reason(reason)
        group = item.group if isinstance(item, Delivery) else item
        entry_id = item.entry_id if isinstance(item, Delivery) else ""
        fields = {
            "run_id": group.run_id,
            "prompt_id": group.prompt_id,
            "entry_id": entry_id,
            "num_samples": len(group.samples),
            "num_tokens": group.num_tokens(),
            "min_version": group.min_version(),
            "max_version": group.max_version(),
            "consumer": self.name,
            "detail": detail,
        }
        # Counters in Redis give the capacity back inside the record's script (a crash cannot separate them);
        # counters elsewhere (one process's memory) right after it.
        scripted = admission if isinstance(admission, (str, RedisCounters)) else None
        record = await self._drops.record(group.group_id, reason, fields, scripted)
        if admission is None or scripted is not None or not record.first:
            return record
        return DropRecord(record.record_id, record.first, gave_back=await give_back(admission))

    async def recorded_drop(self, group_id: str) -> str | None:
        """The reason of the group's drop record, or None when it was never dropped: a learner that meets a
        group again after a restart keeps the decision it recorded before the crash."""
        record_id = await self.client.hget(self.keys.dropped_index, group_id)
        if record_id is None:
            return None
        rows = await self.client.xrange(self.keys.dropped, min=record_id, max=record_id)
        if not rows:  # the record was trimmed away: the index alone says it was dropped
            return "dropped"
        return _text(rows[0][1].get(b"reason", b"dropped"))

    async def trim(self) -> int:
        """XTRIM MINID below the oldest entry any consumer group has pending or not yet delivered (at most
        ``prune_batch`` entries a call), then prune the state of groups retired long enough
        (broker.retention); returns how many entries were removed. Never removes an unacknowledged entry."""
        keys = [self.keys.stream, self.keys.retired]
        trimmed = int(await self._trim(keys=keys, args=[self.config.prune_batch]))
        await self._pruner.prune()
        return trimmed


async def dead_letters(client: aioredis.Redis, shared: SharedConfig, config: BrokerConfig) -> list[dict]:
    """All dead-letter records (oldest first) as dicts of str -> bytes, with the stream id under ``id``."""
    rows = await client.xrange(BrokerKeys.of(shared, config).dead_letter)
    return [{"id": _text(i), **{_text(k): v for k, v in f.items()}} for i, f in rows]


async def dropped(client: aioredis.Redis, shared: SharedConfig, config: BrokerConfig) -> list[dict]:
    """All dropped-group records (oldest first) as dicts of str -> str."""
    rows = await client.xrange(BrokerKeys.of(shared, config).dropped)
    return [{"id": _text(i), **{_text(k): _text(v) for k, v in f.items()}} for i, f in rows]
