"""The gossip registry in Redis: node hashes, a liveness sorted set, links, an event stream.

Keys of one shard (all under one hash tag, so every script touches a single slot):

    gossip:node:<id>   hash    registration, load, state, last_seen_unix_ms, ttl_ms
    gossip:nodes       set     every remembered instance id of the shard
    gossip:live        zset    alive or suspect instance id -> its next deadline (unix ms,
                               Redis clock): suspicion for an alive one, failure for a suspect
    gossip:links       hash    json([src, dst]) -> "<measured_unix_ms> <json sample>", for
                               links whose source is in the shard
    gossip:link_times  zset    json([src, dst]) -> its measured_unix_ms, so a view asks
                               for the links measured since its last listing alone
    gossip:events      stream  joined / suspect / refuted / failed / left, trimmed to about
                               `events_maxlen`
    gossip:changes     stream  `id` of every instance whose registration, state or load
                               changed, trimmed to about `changes_maxlen`

Shards (`GOSSIP_REGISTRY_SHARDS`, default 1; 16 on a Redis Cluster). With one shard the
keys sit under the prefix itself (`{kvrs}:gossip:...`). With N, instance `id` belongs
to shard `crc32(id) % N`, whose keys sit under the prefix's tag with `.<shard>` appended
(`{kvrs.3}:gossip:...`, `services.common.redis_store.Keys.shard`): each shard is one
Redis Cluster slot, so the shards spread over the primaries while every script — a
registration, a batch of heartbeats, a sweep — stays within one shard and stays atomic.
The shard follows from the id alone, so a heartbeat needs no lookup. Listings read every
shard at once; change and event ids then hold one stream id per shard, comma-separated
(opaque to callers, who pass back what they were given).

The change stream is what lets views follow the registry instead of re-reading it
(`list_changes`): a heartbeat appends to it only when a value it writes differs from the
stored one, so a cluster whose load is steady costs its views almost nothing.

Every state change runs as one Lua script reading the Redis clock (`TIME`), so several
gossip replicas share one clock (a shard's: that of the node holding it) and one truth:
the script that removes an instance from the live set is the only one that reports it
failed, and it does so exactly once.

Failure is declared in two steps (see `gossip_records`): an instance silent for its TTL
turns *suspect* ("suspect" event; its live-set score becomes its confirmation deadline,
`confirm_ms` later); a heartbeat before that deadline refutes it ("refuted"), the
deadline passing or `confirm_failure` (a direct probe found nothing listening) declares
it failed. With `confirm_ms` 0 the first deadline fails it at once.

Expiries are only trusted while heartbeats could reach the registry. After Redis was
unreachable from this process (and when the process starts), the first operation gives
every live instance one full TTL from now before anything else runs: instances that
kept beating through an outage longer than their TTL are not all declared failed at
once, and one that really died is still reported, a TTL later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import zlib
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import redis.exceptions

from kvrs.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.gossip_records import (
    LIVE_STATES,
    MAX_REASON_BYTES,
    LinkRecord,
    LinkSample,
    NodeChanges,
    NodeEvent,
    NodeLoad,
    NodeRecord,
    Registration,
    require_at_most_bytes,
    require_id,
    validate_link_sample,
    validate_load,
    validate_registration,
)
from services.common.metrics import Metrics
from services.common.redis_store import Keys, RedisClient

log = logging.getLogger(__name__)

T = TypeVar("T")

_EVENT_ID = re.compile(r"^[0-9]{1,19}(-[0-9]{1,19})?$")  # ASCII, within the uint64 Redis takes

YIELD_EVERY = 256
"""Records a listing decodes (or encodes) between two turns of the event loop: at 4,096
instances a full listing is ~0.1 s of Python, and one chunk of it would hold up every
other view's poll and every heartbeat this replica answers."""

# Shared by the scripts below. ARGV[1] is the node-key prefix, ARGV[2] the event stream's
# MAXLEN, ARGV[3] how long a down node stays listed, ARGV[4] the change stream's MAXLEN;
# KEYS[1] is the live set, KEYS[2] the event stream, KEYS[3] the change stream.
_LUA_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function emit(kind, id, node, now, reason)
  local f = redis.call('HMGET', node, 'role', 'address')
  return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'type', kind,
    'instance_id', id, 'role', f[1] or '', 'address', f[2] or '',
    'unix_ms', now, 'reason', reason)
end
local function changed(id)
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'id', id)
end
local function go_down(id, node, state, now)
  redis.call('HSET', node, 'state', state, 'down_unix_ms', now)
  redis.call('PEXPIRE', node, ARGV[3])
  changed(id)
end
local function silence(node, now)
  local last = tonumber(redis.call('HGET', node, 'last_seen_unix_ms')) or now
  return 'no heartbeat for ' .. ((now - last) / 1000) .. ' s'
end
-- Declares `id` failed if it is still live; false when another caller already did.
local function fail(id, now, reason)
  if redis.call('ZREM', KEYS[1], id) == 0 then
    return false
  end
  local node = ARGV[1] .. id
  local why = reason or silence(node, now)
  go_down(id, node, 'failed', now)
  emit('failed', id, node, now, why)
  return true
end
local function confirm_ms(node)
  return tonumber(redis.call('HGET', node, 'confirm_ms')) or 0
end
-- An alive instance past its deadline: suspect until `confirm_ms` from now.
local function suspect(id, node, now)
  redis.call('HSET', node, 'state', 'suspect', 'suspect_unix_ms', now)
  redis.call('ZADD', KEYS[1], now + confirm_ms(node), id)
  changed(id)
  emit('suspect', id, node, now, silence(node, now))
end
local function expired(id, now)
  local expiry = redis.call('ZSCORE', KEYS[1], id)
  return (not expiry) or tonumber(expiry) <= now
end
"""

# KEYS: live, events, changes, nodes. ARGV: common, id, ttl_ms, field/value pairs...
_REGISTER = (
    _LUA_COMMON
    + """
local id, ttl_ms = ARGV[5], tonumber(ARGV[6])
local node = ARGV[1] .. id
local now = now_ms()
local state = redis.call('HGET', node, 'state')
if (state == 'alive' and expired(id, now) and confirm_ms(node) <= 0)
    or (state == 'suspect' and expired(id, now)) then
  fail(id, now)
  state = 'failed'
end
local live = state == 'alive' or state == 'suspect'
local fields = {}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', node, unpack(fields))
if not live then
  -- A (re)joining instance holds no requests: all of its KV memory is free.
  local capacity = redis.call('HGET', node, 'kv_capacity_blocks') or 0
  redis.call('HSET', node, 'queue_depth', 0, 'queued_work_s', 0, 'running_requests', 0,
    'free_kv_blocks', capacity, 'resident_prefix_hashes', '[]', 'compute_factor', 0,
    'running_context_tokens', 0)
end
redis.call('HSET', node, 'state', 'alive', 'last_seen_unix_ms', now, 'ttl_ms', ttl_ms)
redis.call('HDEL', node, 'down_unix_ms', 'suspect_unix_ms')
redis.call('PERSIST', node)
redis.call('ZADD', KEYS[1], now + ttl_ms, id)
redis.call('SADD', KEYS[4], id)
changed(id)
if state == 'suspect' then
  emit('refuted', id, node, now, 'registered again while suspect')
elseif not live then
  emit('joined', id, node, now, state and ('re-registered after ' .. state) or '')
end
return redis.call('HGETALL', node)
"""
)

# KEYS: live, events, changes. ARGV: common, then per heartbeat: id, n, and n strings of
# load field/value pairs (n may be 0). Returns one reply per heartbeat: {expiry}, {-1}
# (unknown) or {-2, state} (not alive: re-register). A whole batch is one script, so it
# costs one round trip and touches one slot. Appends to the change stream only when a
# written value differs from the stored one.
_HEARTBEAT = (
    _LUA_COMMON
    + """
local now = now_ms()
local function beat(id, first, last)
  local node = ARGV[1] .. id
  local state = redis.call('HGET', node, 'state')
  if not state then
    return {-1}
  end
  if state ~= 'alive' and state ~= 'suspect' then
    return {-2, state}
  end
  -- Late but before the sweep saw it: an alive instance is only late (unless it has no
  -- confirmation window); a suspect one past its confirmation deadline is dead.
  if expired(id, now) and (state == 'suspect' or confirm_ms(node) <= 0) then
    fail(id, now)
    return {-2, 'failed'}
  end
  local refuted_after_ms = nil
  if state == 'suspect' then
    local suspected = tonumber(redis.call('HGET', node, 'suspect_unix_ms')) or now
    redis.call('HSET', node, 'state', 'alive')
    redis.call('HDEL', node, 'suspect_unix_ms')
    changed(id)
    refuted_after_ms = now - suspected
    emit('refuted', id, node, now,
      'heartbeat ' .. (refuted_after_ms / 1000) .. ' s after the suspicion')
  end
  if last >= first then
    local names, values, fields = {}, {}, {}
    for i = first, last, 2 do
      names[#names + 1] = ARGV[i]
      values[#values + 1] = ARGV[i + 1]
      fields[#fields + 1] = ARGV[i]
      fields[#fields + 1] = ARGV[i + 1]
    end
    local stored = redis.call('HMGET', node, unpack(names))
    for i = 1, #names do
      if stored[i] ~= values[i] then
        changed(id)
        break
      end
    end
    redis.call('HSET', node, unpack(fields))
  end
  redis.call('HSET', node, 'last_seen_unix_ms', now)
  local expiry = now + tonumber(redis.call('HGET', node, 'ttl_ms'))
  redis.call('ZADD', KEYS[1], expiry, id)
  if refuted_after_ms then
    return {expiry, refuted_after_ms}
  end
  return {expiry}
end
local replies, i = {}, 5
while i <= #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  replies[#replies + 1] = beat(id, i + 2, i + 1 + n)
  i = i + 2 + n
end
return replies
"""
)

# KEYS: live, events, changes. ARGV: common, id, reason. Returns 0 for an unknown instance.
_DEREGISTER = (
    _LUA_COMMON
    + """
local id = ARGV[5]
local node = ARGV[1] .. id
local now = now_ms()
local state = redis.call('HGET', node, 'state')
if not state then
  return 0
end
redis.call('ZREM', KEYS[1], id)
if state == 'alive' or state == 'suspect' then
  emit('left', id, node, now, ARGV[6])
end
go_down(id, node, 'left', now)
return 1
"""
)

# KEYS: live, events, changes. ARGV: common, limit. Returns {failed ids, suspected ids,
# examined}: those this call declared failed or suspect, and how many deadlines it saw.
_SWEEP = (
    _LUA_COMMON
    + """
local now = now_ms()
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[5]))
local failed, suspected = {}, {}
for _, id in ipairs(ids) do
  local node = ARGV[1] .. id
  local state = redis.call('HGET', node, 'state')
  if state == 'alive' and confirm_ms(node) > 0 then
    suspect(id, node, now)
    suspected[#suspected + 1] = id
  elseif state == 'alive' or state == 'suspect' then
    if fail(id, now) then failed[#failed + 1] = id end
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return {failed, suspected, #ids}
"""
)

# KEYS: live, events, changes. ARGV: common, id, reason. Declares a suspect instance
# failed now; 0 when it is not suspect (it heartbeat meanwhile, or is already down).
_CONFIRM = (
    _LUA_COMMON
    + """
local id = ARGV[5]
if redis.call('HGET', ARGV[1] .. id, 'state') ~= 'suspect' then
  return 0
end
return fail(id, now_ms(), ARGV[6]) and 1 or 0
"""
)

# KEYS: links, link_times. ARGV: field, sample json.
_REPORT_LINK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
return now
"""

# KEYS: live. ARGV: node-key prefix. Moves every live instance's expiry to at least now +
# its TTL; returns how many were already past their expiry.
_RESUME = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local overdue = 0
for i = 1, #live, 2 do
  local id, expiry = live[i], tonumber(live[i + 1])
  local ttl_ms = tonumber(redis.call('HGET', ARGV[1] .. id, 'ttl_ms')) or 0
  if expiry <= now then
    overdue = overdue + 1
  end
  if expiry < now + ttl_ms then
    redis.call('ZADD', KEYS[1], now + ttl_ms, id)
  end
end
return overdue
"""

# KEYS: changes. ARGV: node-key prefix, after id ("" = full), most entries to read.
# Returns {now_ms, last_id, 1} when the reader needs a full listing (asked for, the
# stream is empty or was trimmed past `after`, or `after` is not from this stream), else
# {now_ms, last_id, 0, hash...}: the flat hash of every instance changed after `after`
# that is still stored, once each, in one round trip.
_CHANGES_SINCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-?(%d*)$')
  return tonumber(ms), tonumber(seq ~= '' and seq or '0')
end
local function after_than(a, b)  -- stream id a > stream id b
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am > bm or (am == bm and as > bs)
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local after = ARGV[2]
if #last == 0 then
  -- Nothing changed yet: a reader that saw it empty ('0-0') is up to date.
  return {now, '0-0', after == '0-0' and 0 or 1}
end
local last_id = last[1][1]
if after == '' or after_than(after, last_id) then
  return {now, last_id, 1}
end
-- Whether the stream ever dropped an entry (trimmed it); Redis before 7 cannot say.
local function trimmed()
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'entries-added' then
      return tonumber(info[i + 1]) > redis.call('XLEN', KEYS[1])
    end
  end
  return true
end
-- `after` is the last id of an earlier reply: while it is retained, nothing after it
-- was trimmed; once the oldest entry is younger, some may have been (a gap). A reader
-- that saw the stream empty ('0-0') missed nothing unless the stream was trimmed since.
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
if after_than(first[1][1], after) and (after ~= '0-0' or trimmed()) then
  return {now, last_id, 1}
end
local limit = tonumber(ARGV[3])
local entries = redis.call('XRANGE', KEYS[1], '(' .. after, last_id, 'COUNT', limit + 1)
if #entries > limit then
  return {now, last_id, 1}
end
local reply, seen = {now, last_id, 0}, {}
for _, entry in ipairs(entries) do
  local id = entry[2][2]
  if not seen[id] then
    seen[id] = true
    local fields = redis.call('HGETALL', ARGV[1] .. id)
    if #fields > 0 then
      reply[#reply + 1] = fields
    end
  end
end
return reply
"""

# KEYS: nodes. Returns {now_ms, member...}: the Redis time and the shard's instance ids,
# read together in one round trip (a pipelined TIME has no key, so Redis Cluster could
# not route it).
_MEMBERS = """
local t = redis.call('TIME')
local reply = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  reply[#reply + 1] = id
end
return reply
"""

# KEYS: links, link_times. ARGV: measured after (unix ms; 0 = every link). Returns
# {now_ms, flat hash of the shard's links measured after it}. HMGET in slices: Lua's
# unpack has a stack limit.
_LINKS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] == '0' then
  return {now, redis.call('HGETALL', KEYS[1])}
end
local fields = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf')
local flat = {}
for first = 1, #fields, 1000 do
  local last = math.min(first + 999, #fields)
  local values = redis.call('HMGET', KEYS[1], unpack(fields, first, last))
  for i = first, last do
    local value = values[i - first + 1]
    if value then
      flat[#flat + 1] = fields[i]
      flat[#flat + 1] = value
    end
  end
end
return {now, flat}
"""

_LOAD_FIELDS = (
    "queue_depth",
    "queued_work_s",
    "running_requests",
    "free_kv_blocks",
    "compute_factor",
    "running_context_tokens",
)
SWEEP_BATCH = 500
PROBE_TIMEOUT_S = 0.5
"""How long the direct probe of a suspect instance waits for its listener to accept."""
HEARTBEAT_BATCH_MAX = 256
"""Most heartbeats one script call records: Redis runs nothing else meanwhile."""
CHANGES_READ_MAX = 20_000
"""More change entries than this since a reader's id: a full listing costs less."""


@dataclass
class Swept:
    """What one sweep changed."""

    failed: list[str] = field(default_factory=list)
    suspected: list[str] = field(default_factory=list)


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _decode_hash(raw: dict[bytes, bytes]) -> dict[str, str]:
    # Inline decode, not `_text`: a full listing decodes ~90,000 fields at 4,096 instances.
    return {field.decode(): value.decode() for field, value in raw.items()}


def _decode_flat(flat: list[bytes]) -> dict[str, str]:
    """A hash as a script returns it (field, value, field, value, ...), decoded; inline,
    since a listing decodes thousands of fields."""
    fields = iter(flat)
    return {field.decode(): value.decode() for field, value in zip(fields, fields, strict=True)}


def _node_record(fields: dict[str, str], now_ms: int) -> NodeRecord:
    registration = Registration(
        instance_id=fields["instance_id"],
        role=fields["role"],
        address=fields["address"],
        node=fields.get("node", ""),
        rack=fields.get("rack", ""),
        pod=fields.get("pod", ""),
        gpu_index=int(fields.get("gpu_index", 0)),
        model=fields.get("model", ""),
        kv_capacity_blocks=int(fields.get("kv_capacity_blocks", 0)),
        transfer_address=fields.get("transfer_address", ""),
        heartbeat_ttl_s=int(fields["ttl_ms"]) / 1000,
        max_batch_tokens=int(fields.get("max_batch_tokens", 0)),
    )
    load = NodeLoad(
        queue_depth=int(fields.get("queue_depth", 0)),
        queued_work_s=float(fields.get("queued_work_s", 0)),
        running_requests=int(fields.get("running_requests", 0)),
        free_kv_blocks=int(fields.get("free_kv_blocks", 0)),
        resident_prefix_hashes=tuple(json.loads(fields.get("resident_prefix_hashes", "[]"))),
        compute_factor=float(fields.get("compute_factor", 0)),
        running_context_tokens=int(fields.get("running_context_tokens", 0)),
    )
    last_seen_ms = int(fields["last_seen_unix_ms"])
    return NodeRecord(
        registration=registration,
        state=fields["state"],
        load=load,
        last_seen_unix_ms=last_seen_ms,
        age_s=max(0.0, (now_ms - last_seen_ms) / 1000),
        heartbeat_ttl_s=registration.heartbeat_ttl_s,
    )


def _event(event_id: bytes | str, raw: dict) -> NodeEvent:
    fields = _decode_hash(raw)
    return NodeEvent(
        event_id=_text(event_id),
        type=fields["type"],
        instance_id=fields["instance_id"],
        role=fields.get("role", ""),
        address=fields.get("address", ""),
        unix_ms=int(fields["unix_ms"]),
        reason=fields.get("reason", ""),
    )


def _retrieve_exception(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("abandoned Redis read failed: %s", task.exception())


async def _shielded(command: Awaitable[T]) -> T:
    """Runs a Redis read so that cancelling the caller always raises CancelledError.

    redis-py can swallow a CancelledError that lands inside a command
    (redis/redis-py#2028); a watch loop whose client went away would then poll forever.
    Here the cancel hits only the wait; the read itself finishes (within its block time)
    and its result is dropped.
    """
    read = asyncio.ensure_future(command)
    read.add_done_callback(_retrieve_exception)
    return await asyncio.shield(read)


@dataclass(frozen=True)
class _Shard:
    """The keys of one registry shard (one hash tag: one Redis Cluster slot)."""

    node_prefix: str
    nodes: str
    live: str
    links: str
    link_times: str
    events: str
    changes: str
    common: list[str]
    """ARGV[1..4] of every state-changing script (see `_LUA_COMMON`)."""

    @property
    def script_keys(self) -> list[str]:
        return [self.live, self.events, self.changes]


def shard_of(instance_id: str, shards: int) -> int:
    """The registry shard holding `instance_id`'s keys: CRC-32 of the id modulo the shard
    count, so every operation finds an instance's shard from its id alone."""
    return zlib.crc32(instance_id.encode()) % shards if shards > 1 else 0


def _stream_order(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def _started(commands: Iterable[Awaitable[T]]) -> list[asyncio.Future[T]]:
    """Redis reads started now, each of whose errors is retrieved even if abandoned."""
    reads: list[asyncio.Future[T]] = [asyncio.ensure_future(command) for command in commands]
    for read in reads:
        read.add_done_callback(_retrieve_exception)
    return reads


async def _shielded_all(commands: Iterable[Awaitable[T]]) -> list[T]:
    """`_shielded` for several reads at once, all started before the first wait."""
    together = asyncio.gather(*_started(commands))
    together.add_done_callback(_retrieve_exception)
    return await asyncio.shield(together)


class GossipStore:
    """Registry operations; each raises `kvrs.errors` exceptions the servers map to codes."""

    def __init__(
        self,
        client: RedisClient,
        prefix: str,
        default_ttl_s: float,
        events_maxlen: int = 10_000,
        down_retention_s: float = 600.0,
        changes_maxlen: int = 100_000,
        confirm_ttls: float = 0.0,
        shards: int = 1,
    ) -> None:
        """`confirm_ttls`: how many of its TTLs a suspect instance has to heartbeat again
        before it is declared failed; 0 = failed at the first missed deadline. `shards`:
        how many hash tags the registry is spread over (see the module docstring); every
        process sharing a registry must use the same number."""
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        keys = Keys(prefix)
        self._redis = client
        self._default_ttl_s = default_ttl_s
        self._confirm_ttls = confirm_ttls
        self._down_retention_s = down_retention_s
        self._shards: list[_Shard] = []
        for index in range(shards):
            shard = keys.shard(index, shards)
            node_prefix = shard("gossip", "node", "")
            self._shards.append(
                _Shard(
                    node_prefix=node_prefix,
                    nodes=shard("gossip", "nodes"),
                    live=shard("gossip", "live"),
                    links=shard("gossip", "links"),
                    link_times=shard("gossip", "link_times"),
                    events=shard("gossip", "events"),
                    changes=shard("gossip", "changes"),
                    common=[
                        node_prefix,
                        str(events_maxlen),
                        str(int(down_retention_s * 1000)),
                        str(changes_maxlen),
                    ],
                )
            )
        self._register = client.register_script(_REGISTER)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._deregister = client.register_script(_DEREGISTER)
        self._sweep = client.register_script(_SWEEP)
        self._confirm = client.register_script(_CONFIRM)
        self._report_link = client.register_script(_REPORT_LINK)
        self._resume = client.register_script(_RESUME)
        self._changes_since = client.register_script(_CHANGES_SINCE)
        self._members = client.register_script(_MEMBERS)
        self._links = client.register_script(_LINKS)
        self._resume_pending = True
        """Whether expiries need a fresh TTL before they are trusted (see module doc)."""
        self._resuming = asyncio.Lock()
        self._beats: list[list[tuple[list, asyncio.Future]]] = [[] for _ in self._shards]
        """Per shard, heartbeats waiting for the next script call (see `_flush_beats`)."""
        self._flushing: list[asyncio.Task | None] = [None for _ in self._shards]

    @property
    def shards(self) -> int:
        return len(self._shards)

    def _shard(self, instance_id: str) -> _Shard:
        return self._shards[shard_of(instance_id, len(self._shards))]

    @contextlib.asynccontextmanager
    async def _redis_call(self, trusts_expiries: bool) -> AsyncIterator[None]:
        """Wraps every Redis round trip: notes when Redis was unreachable, and resumes
        expiries before an operation that may declare a failure."""
        try:
            if trusts_expiries and self._resume_pending:
                await self._resume_expiries()
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self._resume_pending = True
            raise

    async def _resume_expiries(self) -> None:
        """Gives every live instance of every shard at least one TTL from now, once: the
        operations waiting meanwhile (a shard's heartbeats, a sweep of every shard) wait
        for that one resume instead of each running its own."""
        async with self._resuming:
            if not self._resume_pending:
                return
            overdue = sum(
                int(count)
                for count in await asyncio.gather(
                    *(
                        self._resume(keys=[shard.live], args=[shard.node_prefix])
                        for shard in self._shards
                    )
                )
            )
            self._resume_pending = False
        if overdue:
            log.warning(
                "registry reachable again: %d instances past their TTL get "
                "one TTL to heartbeat before they are declared failed",
                overdue,
            )

    async def register(self, registration: Registration) -> NodeRecord:
        """Adds or refreshes an instance; "joined" only when it was not alive before."""
        validate_registration(registration)
        ttl_ms = max(1, round((registration.heartbeat_ttl_s or self._default_ttl_s) * 1000))
        fields = asdict(registration)
        del fields["heartbeat_ttl_s"]
        fields["confirm_ms"] = round(ttl_ms * self._confirm_ttls)
        pairs = [str(part) for item in fields.items() for part in item]
        shard = self._shard(registration.instance_id)
        async with self._redis_call(trusts_expiries=True):
            flat = await self._register(
                keys=[*shard.script_keys, shard.nodes],
                args=[*shard.common, registration.instance_id, ttl_ms, *pairs],
            )
        stored = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
        return _node_record(stored, int(stored["last_seen_unix_ms"]))

    async def heartbeat(
        self,
        instance_id: str,
        load: NodeLoad,
        *,
        load_unchanged: bool = False,
        prefix_hashes_unchanged: bool = False,
    ) -> int:
        """Records liveness and load; returns the new expiry (unix ms).

        `load_unchanged` keeps the stored load fields and `prefix_hashes_unchanged` the
        stored prefix set (the caller sent them before): a liveness-only heartbeat
        writes two values. NotFound for an unknown instance and FailedPrecondition for
        one already declared failed (or gone): either way the caller registers again.
        """
        require_id("instance_id", instance_id)
        validate_load(load)
        pairs: list[str] = []
        if not load_unchanged:
            for name in _LOAD_FIELDS:
                pairs += [name, str(getattr(load, name))]
        if not prefix_hashes_unchanged:
            pairs += ["resident_prefix_hashes", json.dumps(list(load.resident_prefix_hashes))]
        beat: asyncio.Future = asyncio.get_running_loop().create_future()
        index = shard_of(instance_id, len(self._shards))
        self._beats[index].append(([instance_id, str(len(pairs)), *pairs], beat))
        if self._flushing[index] is None:
            self._flushing[index] = asyncio.create_task(self._flush_beats(index))
        reply = await beat
        code = int(reply[0])
        if code == -1:
            raise NotFound(f"instance {instance_id!r} is not registered")
        if code == -2:
            raise FailedPrecondition(
                f"instance {instance_id!r} is {_text(reply[1])}; register it again"
            )
        if len(reply) > 1:
            log.info(
                "instance %s refuted: heartbeat %.2f s after the suspicion",
                instance_id,
                int(reply[1]) / 1000.0,
            )
        return code

    async def _flush_beats(self, index: int) -> None:
        """Sends every heartbeat waiting for shard `index`, as one script call, until none
        is left.

        Heartbeats that arrive while a call is in flight wait for the next one: under
        load many beats share one round trip (and one connection), and an idle registry
        answers a lone beat at once. Shards flush independently, each to its own node.
        """
        shard = self._shards[index]
        try:
            while self._beats[index]:
                batch = self._beats[index][:HEARTBEAT_BATCH_MAX]
                self._beats[index] = self._beats[index][HEARTBEAT_BATCH_MAX:]
                try:
                    async with self._redis_call(trusts_expiries=True):
                        replies = await self._heartbeat(
                            keys=shard.script_keys,
                            args=[*shard.common, *(arg for args, _ in batch for arg in args)],
                        )
                except Exception as exc:  # noqa: BLE001 - every waiting beat gets the error
                    for _, beat in batch:
                        if not beat.done():
                            beat.set_exception(exc)
                    continue
                for (_, beat), reply in zip(batch, replies, strict=True):
                    if not beat.done():
                        beat.set_result(reply)
        finally:
            self._flushing[index] = None

    async def deregister(self, instance_id: str, reason: str) -> None:
        """Marks an instance as left; repeating it is harmless, an unknown id is NotFound."""
        require_id("instance_id", instance_id)
        require_at_most_bytes("reason", reason, MAX_REASON_BYTES)
        shard = self._shard(instance_id)
        async with self._redis_call(trusts_expiries=False):
            found = await self._deregister(
                keys=shard.script_keys,
                args=[*shard.common, instance_id, reason or "deregistered"],
            )
        if not int(found):
            raise NotFound(f"instance {instance_id!r} is not registered")

    async def sweep(self) -> Swept:
        """Acts on every deadline that passed: an alive instance turns suspect (failed when
        there is no confirmation window), a suspect one failed. Returns what this call did."""
        swept = Swept()
        for done in await asyncio.gather(*(self._sweep_shard(shard) for shard in self._shards)):
            swept.failed += done.failed
            swept.suspected += done.suspected
        return swept

    async def _sweep_shard(self, shard: _Shard) -> Swept:
        swept = Swept()
        while True:
            async with self._redis_call(trusts_expiries=True):
                failed, suspected, examined = await self._sweep(
                    keys=shard.script_keys, args=[*shard.common, SWEEP_BATCH]
                )
            swept.failed += [_text(item) for item in failed]
            swept.suspected += [_text(item) for item in suspected]
            if int(examined) < SWEEP_BATCH:
                return swept

    async def confirm_failure(self, instance_id: str, reason: str) -> bool:
        """Declares a suspect instance failed now (its death was confirmed); False when it
        is no longer suspect."""
        shard = self._shard(instance_id)
        async with self._redis_call(trusts_expiries=False):
            confirmed = await self._confirm(
                keys=shard.script_keys, args=[*shard.common, instance_id, reason]
            )
        return bool(int(confirmed))

    async def address_of(self, instance_id: str) -> str:
        """The registered address of an instance ("" when unknown)."""
        shard = self._shard(instance_id)
        async with self._redis_call(trusts_expiries=False):
            return _text(await self._redis.hget(shard.node_prefix + instance_id, "address"))

    async def list_nodes(
        self, role: str | None = None, include_down: bool = False
    ) -> tuple[list[NodeRecord], int]:
        """Instances (alive or suspect only unless `include_down`) and the Redis time of
        the listing."""
        async with self._redis_call(trusts_expiries=False):
            records, now_ms = await self._read_all()
        return [
            record
            for record in records
            if (not role or record.registration.role == role)
            and (record.state in LIVE_STATES or include_down)
        ], now_ms

    async def _read_all(self) -> tuple[list[NodeRecord], int]:
        """Every stored instance of every shard, and the latest Redis time read."""
        listings = await asyncio.gather(*(self._read_shard(shard) for shard in self._shards))
        records = [record for shard_records, _ in listings for record in shard_records]
        records.sort(key=lambda record: record.registration.instance_id)
        return records, max(now_ms for _, now_ms in listings)

    async def _read_shard(self, shard: _Shard) -> tuple[list[NodeRecord], int]:
        now_ms, *members = await self._members(keys=[shard.nodes])
        ids = sorted(_text(m) for m in members)
        return await self._read_nodes(shard, ids, int(now_ms)), int(now_ms)

    async def list_changes(self, after_change_id: str) -> NodeChanges:
        """The instances that changed after `after_change_id`, or all of them (`full`)
        when it is "" or the change stream no longer reaches back to it.

        The change id is read before the hashes, so a change that lands during the
        listing is listed again next time rather than lost; re-applying it is harmless,
        since every reply carries instances as they are now. With several shards the
        change id holds one stream id per shard, and a gap in any shard makes the reply
        a full listing.
        """
        afters = self._cursor("after_change_id", after_change_id, "an id from an earlier reply")
        if afters is None:
            afters = [""] * len(self._shards)
        async with self._redis_call(trusts_expiries=False):
            replies = await asyncio.gather(
                *(
                    self._changes_since(
                        keys=[shard.changes], args=[shard.node_prefix, after, CHANGES_READ_MAX]
                    )
                    for shard, after in zip(self._shards, afters, strict=True)
                )
            )
            now_ms = max(int(reply[0]) for reply in replies)
            change_id = ",".join(_text(reply[1]) for reply in replies)
            if not any(int(reply[2]) for reply in replies):
                records = [
                    _node_record(_decode_flat(flat), now_ms)
                    for reply in replies
                    for flat in reply[3:]
                ]
                return NodeChanges(tuple(records), change_id, full=False, now_ms=now_ms)
            all_records, _ = await self._read_all()
        return NodeChanges(tuple(all_records), change_id, full=True, now_ms=now_ms)

    def _cursor(self, name: str, cursor: str, what: str) -> list[str] | None:
        """The per-shard stream ids of a change or event id ("" -> None).

        A single stream id stands for that position in every shard (stream ids are
        Redis-clock times, so `<unix_ms>-0` means "after that time" in each). An id with
        another number of parts was issued under another shard count: None (start
        afresh) rather than an error.
        """
        if not cursor:
            return None
        parts = cursor.split(",")
        if not all(_EVENT_ID.match(part) for part in parts):
            raise InvalidArgument(name, f"must be '' or {what}, got {cursor!r}")
        if len(parts) == 1:
            return parts * len(self._shards)
        return parts if len(parts) == len(self._shards) else None

    async def _read_nodes(self, shard: _Shard, ids: list[str], now_ms: int) -> list[NodeRecord]:
        """The stored instances among `ids` (all of `shard`); ids whose hash expired are
        dropped from its member set."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for instance_id in ids:
                pipe.hgetall(shard.node_prefix + instance_id)
            hashes = await pipe.execute()
        records: list[NodeRecord] = []
        forgotten: list[str] = []
        for index, (instance_id, raw) in enumerate(zip(ids, hashes, strict=True)):
            if raw:
                records.append(_node_record(_decode_hash(raw), now_ms))
            else:
                forgotten.append(instance_id)
            if index % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
        if forgotten:
            await self._redis.srem(shard.nodes, *forgotten)
        return records

    async def report_link(self, sample: LinkSample) -> int:
        """Stores the newest sample of a link (in its source's shard); returns its time
        (unix ms, Redis clock)."""
        validate_link_sample(sample)
        link = json.dumps([sample.src_instance_id, sample.dst_instance_id])
        shard = self._shard(sample.src_instance_id)
        async with self._redis_call(trusts_expiries=False):
            return int(
                await self._report_link(
                    keys=[shard.links, shard.link_times], args=[link, json.dumps(asdict(sample))]
                )
            )

    async def list_links(self, measured_after_unix_ms: int = 0) -> tuple[list[LinkRecord], int]:
        """Every link sample younger than the down retention, with its age; or, with
        `measured_after_unix_ms`, only those measured after then (a view's next listing:
        its cost follows what the prober measured since, not how many links there are)."""
        async with self._redis_call(trusts_expiries=False):
            replies = await asyncio.gather(
                *(
                    self._links(keys=[shard.links, shard.link_times], args=[measured_after_unix_ms])
                    for shard in self._shards
                )
            )
        now_ms = max(int(reply[0]) for reply in replies)
        records: list[LinkRecord] = []
        for shard, reply in zip(self._shards, replies, strict=True):
            outdated: list[str] = []
            for link, value in _decode_flat(reply[1]).items():
                measured, _, body = value.partition(" ")
                age_s = max(0.0, (now_ms - int(measured)) / 1000)
                if age_s > self._down_retention_s:
                    outdated.append(link)
                    continue
                records.append(LinkRecord(LinkSample(**json.loads(body)), int(measured), age_s))
            if outdated:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.hdel(shard.links, *outdated)
                    pipe.zrem(shard.link_times, *outdated)
                    await pipe.execute()
        records.sort(key=lambda r: (r.sample.src_instance_id, r.sample.dst_instance_id))
        return records, now_ms

    async def resolve_after(self, after_event_id: str) -> str:
        """The concrete stream id to read after: "" = the newest event now, "0" = the start.

        With several shards the id holds one stream id per shard."""
        if after_event_id == "":
            newest = await _shielded_all(
                self._redis.xrevrange(shard.events, count=1) for shard in self._shards
            )
            return ",".join(_text(last[0][0]) if last else "0-0" for last in newest)
        parts = self._cursor(
            "after_event_id", after_event_id, "'0' or a stream id like '1700000000000-0'"
        )
        if parts is None:
            raise InvalidArgument(
                "after_event_id",
                f"names {after_event_id.count(',') + 1} registry shards, not "
                f"{len(self._shards)}; watch from '' or '0'",
            )
        return ",".join(parts)

    def event_reader(self, after_event_id: str) -> EventReader:
        """Reads events after `after_event_id` (from `resolve_after`), call after call."""
        return EventReader(self._redis, [shard.events for shard in self._shards], after_event_id)


EVENT_POLL_S = 0.05
"""How often a watcher of a sharded registry looks for new events (its event latency)."""


class EventReader:
    """One watcher's reads of the event streams, one stream per shard.

    With one shard, a read blocks on the stream until an event comes (or `block_s`).
    With several, each read looks at every shard's stream at once, without blocking,
    every `EVENT_POLL_S` until one has news or `block_s` passed: a blocking read per
    shard would hold a connection per shard per watcher, which a few watchers of a
    sixteen-shard registry would take from everything else. Events found together are
    merged by stream time (those of one instance keep their order: they are all in one
    shard). Each event's id is the position just past it: one stream id per shard,
    comma-separated.
    """

    def __init__(self, client: RedisClient, streams: list[str], after_event_id: str) -> None:
        self._redis = client
        self._streams = streams
        self._afters = after_event_id.split(",")
        self._pending: asyncio.Future | None = None

    async def read(self, block_s: float, count: int = 100) -> list[NodeEvent]:
        """The events after the last one returned, waiting up to `block_s` for one."""
        if len(self._streams) == 1:
            return await self._read_blocking(block_s, count)
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + block_s
        while True:
            replies = await _shielded_all(
                self._redis.xread({stream: after}, count=count)
                for stream, after in zip(self._streams, self._afters, strict=True)
            )
            events = self._take(dict(enumerate(replies)))
            left_s = deadline_s - loop.time()
            if events or left_s <= 0:
                return events
            await asyncio.sleep(min(EVENT_POLL_S, left_s))

    async def _read_blocking(self, block_s: float, count: int) -> list[NodeEvent]:
        if self._pending is None:
            (self._pending,) = _started(
                [
                    self._redis.xread(
                        {self._streams[0]: self._afters[0]},
                        count=count,
                        block=max(1, int(block_s * 1000)),
                    )
                ]
            )
        # A cancelled watcher leaves its read to finish within the block time (a Redis
        # command cannot be cancelled safely, see `_shielded`); the next call takes it.
        reply = await asyncio.shield(self._pending)
        self._pending = None
        return self._take({0: reply})

    def _take(self, replies: dict[int, Any]) -> list[NodeEvent]:
        tagged = [
            (_stream_order(_text(event_id)), index, _text(event_id), raw)
            for index, reply in replies.items()
            for event_id, raw in (reply[0][1] if reply else ())
        ]
        events = []
        for _, index, event_id, raw in sorted(tagged, key=lambda item: item[:2]):
            self._afters[index] = event_id
            events.append(_event(",".join(self._afters), raw))
        return events


async def nothing_listens_at(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True only when `address` refuses a TCP connection: no process listens there.

    The direct probe of a suspect instance. A refusal is proof (the process that held the
    port is gone); a timeout proves nothing (a stopped or starved process still has its
    listener, whose backlog accepts without it), nor does a name that does not resolve.
    """
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), timeout_s
        )
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


async def _probe_suspect(store: GossipStore, instance_id: str, metrics: Metrics) -> None:
    try:
        address = await store.address_of(instance_id)
        if not address or not await nothing_listens_at(address):
            return
        reason = f"no heartbeat, and nothing listens at {address} (direct probe)"
        if await store.confirm_failure(instance_id, reason):
            log.info("instance %s failed: %s", instance_id, reason)
            metrics.membership_events.labels(type="failed").inc()
    except redis.exceptions.RedisError as exc:
        log.warning("probe of suspect %s not acted on: %s", instance_id, exc)


async def sweep_forever(
    store: GossipStore, interval_s: float, stop: asyncio.Event, metrics: Metrics
) -> None:
    """Runs `store.sweep()` every `interval_s` until `stop` is set; Redis outages are logged.

    Each instance the sweep makes suspect gets a direct probe (`nothing_listens_at`) at
    once: a killed process is confirmed failed within the sweep interval, a starved or
    stopped one waits out its confirmation window. Every gossip replica runs one: the
    sweep script is atomic, so they never double-report, and any surviving replica keeps
    detecting failures. It stops on an event rather than by cancellation because
    redis-py can swallow a CancelledError that lands inside a command
    (redis/redis-py#2028), which would leave the loop running.
    """
    probes: set[asyncio.Task] = set()
    while not stop.is_set():
        try:
            swept = await store.sweep()
            for instance_id in swept.failed:
                log.info("instance %s failed: heartbeats stopped", instance_id)
                metrics.membership_events.labels(type="failed").inc()
            for instance_id in swept.suspected:
                log.info("instance %s suspect: heartbeat late", instance_id)
                metrics.membership_events.labels(type="suspect").inc()
                probe = asyncio.create_task(_probe_suspect(store, instance_id, metrics))
                probes.add(probe)
                probe.add_done_callback(probes.discard)
        except Exception as exc:  # noqa: BLE001 - the sweeper must outlive any one sweep
            # Redis unreachable, or the Redis Cluster client caught mid-way through a
            # topology change (a failover can surface as an AttributeError from inside
            # redis-py): the next sweep tries again.
            log.warning("failure sweep skipped: %r", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    for probe in list(probes):
        await probe
