"""Bounded per-group state: groups that nothing but the audit reads any more are pruned into counts.

Every group leaves an entry in several structures (the group-id index, the acknowledged sets of both consumer
groups, its outcome, its drop record and index entry, its dispatch position). Once a group is *retired* - its
stream entry trimmed (both consumer groups acknowledged it: the learner's outcome is recorded, the archive has
its rows) or, for a group a rollout worker dropped, its position done - its id goes on the list
``BrokerKeys.retired`` (``"gid|position|entry id"``, oldest first): by the trim script (broker.consumer) and by
the dispatch's completion script (broker.admission). :data:`PRUNE` takes retired groups off the head of that list
once more than ``broker.keep_groups`` wait there, at most ``broker.prune_batch`` per call, and for each:

- removes its id from every consumer group's acknowledged set (the entry is gone from the stream, and no second
  entry of the group can be added: below);
- if it has a dispatch position that is done (below the done watermark, or in its epoch's done set until the
  watermark passes it: either way the producer script refuses a late send of the group without the index), and
  no conflicting second outcome (kept whole for inspection): folds its outcome into the counts ``BrokerKeys.pruned`` (generated, produced, trained, dropped,
  dropped:<reason>, dead_lettered, lost for a group retired without an outcome) and deletes its index entry,
  outcome, drop record and drop-index entry, in the same atomic step.

The head of the list waits while its position is not done (a holder that produced and died before completing:
the position is taken over after a lease TTL and completed by the new holder, whose send meets the index); a group without a
position (a producer outside the dispatch: tests, benchmarks) keeps its index entry and outcome forever. The
audit (broker.outcomes) adds the counts to what it finds live. docs/broker.md, "Bounded state", has the why.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from broker.admission import DONE_LUA, DispatchKeys
from broker.client import BrokerKeys
from broker.config import BrokerConfig
from common.config import SharedConfig

PRUNE = (
    DONE_LUA
    + """
-- KEYS: 1 retired list, 2 group-id hash, 3 outcomes, 4 outcome conflicts, 5 dropped stream, 6 dropped index,
--       7 pruned counts, 8 done watermark, 9 trajectory stream, 10 dispatch meta
-- ARGV: 1 groups to keep, 2 most groups per call, 3 acknowledged-set key prefix (+ consumer group),
--       4 done-set key prefix (+ epoch)
local function prune_group(gid, id)
  local orig = redis.call('HGET', KEYS[2], gid)
  if id ~= '' and orig and orig ~= id then return end  -- a copy: the original's own turn prunes the group
  local doc = redis.call('HGET', KEYS[3], gid)
  if not orig and not doc then return end  -- pruned already (a copy retired after its original)
  redis.call('HINCRBY', KEYS[7], 'generated', 1)
  if orig then
    redis.call('HINCRBY', KEYS[7], 'produced', 1)
    redis.call('HDEL', KEYS[2], gid)
  end
  if doc then
    local o = cjson.decode(doc)
    redis.call('HINCRBY', KEYS[7], o['outcome'], 1)
    if o['outcome'] == 'dropped' then redis.call('HINCRBY', KEYS[7], 'dropped:' .. o['reason'], 1) end
    redis.call('HDEL', KEYS[3], gid)
  else
    redis.call('HINCRBY', KEYS[7], 'lost', 1)
  end
  local record = redis.call('HGET', KEYS[6], gid)
  if record then
    redis.call('XDEL', KEYS[5], record)
    redis.call('HDEL', KEYS[6], gid)
  end
end
local acked = {}
if redis.call('EXISTS', KEYS[9]) == 1 then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[9])) do
    for j = 1, #g, 2 do if g[j] == 'name' then acked[#acked + 1] = ARGV[3] .. g[j + 1] end end
  end
end
local keep, most = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = 0
while n < most and redis.call('LLEN', KEYS[1]) > keep do
  local gid, pos, id = string.match(redis.call('LINDEX', KEYS[1], 0), '^(.*)|([^|]*)|([^|]*)$')
  -- a position not done yet (its holder produced, then died before completing) is leased again, and the new
  -- holder's send must still meet the index: wait
  if pos ~= '' and not is_done_at(KEYS[8], KEYS[10], ARGV[4], pos) then break end
  redis.call('LPOP', KEYS[1])
  n = n + 1
  for _, set in ipairs(acked) do redis.call('SREM', set, gid) end
  if pos ~= '' and redis.call('HEXISTS', KEYS[4], gid) == 0 then prune_group(gid, id) end
end
return n
"""
)


class Pruner:
    """Prunes retired groups (see the module docstring); :meth:`prune` is called beside every trim."""

    def __init__(self, client: aioredis.Redis, shared: SharedConfig, config: BrokerConfig) -> None:
        self.config = config
        self.keys = BrokerKeys.of(shared, config)
        self.dispatch = DispatchKeys.of(shared)
        self._prune = client.register_script(PRUNE)

    async def prune(self) -> int:
        """Prune up to ``broker.prune_batch`` retired groups beyond the newest ``broker.keep_groups``; returns
        how many left the retired list."""
        k = self.keys
        keys = [k.retired, k.group_ids, k.outcomes, k.outcome_conflicts, k.dropped, k.dropped_index]
        keys += [k.pruned, self.dispatch.done_below, k.stream, self.dispatch.meta]
        args = [self.config.keep_groups, self.config.prune_batch, k.acked_prefix, self.dispatch.done_prefix]
        return int(await self._prune(keys=keys, args=args))
