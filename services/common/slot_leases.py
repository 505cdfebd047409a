"""Migration-slot leases in Redis: a cluster-wide cap, an optional per-link cap, TTLs.

Keys (under one hash-tagged prefix, so each script touches a single slot):

    slots:leases           zset    lease id -> expiry (unix ms, Redis clock)
    slots:lease:<id>       hash    request_id, holder_id, src/dst, link, expires_unix_ms
    slots:request:<rid>    string  request id -> lease id (idempotent retries)
    slots:links            hash    json([src, dst]) -> leases held on that link
    slots:totals           hash    granted / denied / expired / superseded / spares_lapsed
                                   counters
    slots:policy           hash    cluster_cap, link_cap, default_ttl_ms, max_ttl_ms
    slots:attempt:<id>     string  the denial one reserve call got, kept a minute
    slots:spares           set     lease ids reserved ahead for no request yet (spares)

Every operation is one Lua script that first drops expired leases, then acts, all on
the Redis clock: the caps hold whatever the number of broker replicas and callers, and
a crashed holder's slot returns once its TTL passes (on the next call, or the sweeper's).
On Redis Cluster all of these keys are one slot (one hash tag): the cap is one sorted
set on one primary, checked and taken in one atomic step.

A reserve call that the Redis client sends twice (it retries after a timeout, or after
a failover) has the same attempt id both times, and its second run answers what the
first did: a grant comes back as the request's existing lease, a denial as the same
denial, counted once.

A scheduler replica may hold a few spares: leases reserved ahead for no request, which
count against the cluster cap like any other and are claimed for a request later
(`reserve_spare`, `claim`), so that a decision needing a slot takes one without a round
trip. Spares are kept only far from the cap and without a per-link cap; they are not
counted among the slots in use (no migration holds them), only in the cap check.

The caps live in Redis too (`slots:policy`, written by the slot broker when it starts),
and the reserve script reads them there: every caller of this module — the broker's
replicas, and schedulers that reserve without the extra hop to the broker — enforces the
same caps in the same atomic step, so the cap stays exact however many of each there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvrs.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.common.metrics import Metrics
from services.common.redis_store import Keys, RedisClient

log = logging.getLogger(__name__)

# KEYS: leases zset, links hash, totals hash, policy hash, spares set. ARGV[1]: the
# "slots:" key prefix.
_LUA_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Removes a lease and its bookkeeping; false when it was already gone.
local function drop(lease_id)
  if redis.call('ZREM', KEYS[1], lease_id) == 0 then
    return false
  end
  redis.call('SREM', KEYS[5], lease_id)
  local lease = ARGV[1] .. 'lease:' .. lease_id
  local f = redis.call('HMGET', lease, 'link', 'request_id')
  if f[1] and redis.call('HINCRBY', KEYS[2], f[1], -1) <= 0 then
    redis.call('HDEL', KEYS[2], f[1])
  end
  if f[2] then
    local request = ARGV[1] .. 'request:' .. f[2]
    if redis.call('GET', request) == lease_id then
      redis.call('DEL', request)
    end
  end
  redis.call('DEL', lease)
  return true
end
-- Drops every lease past its expiry; returns how many a migration held (its holder never
-- released it). Spares a replica let lapse are counted apart: that is how they end.
local function purge(now)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
  local spares = 0
  for _, lease_id in ipairs(expired) do
    spares = spares + redis.call('SISMEMBER', KEYS[5], lease_id)
    drop(lease_id)
  end
  if #expired > spares then
    redis.call('HINCRBY', KEYS[3], 'expired', #expired - spares)
  end
  if spares > 0 then
    redis.call('HINCRBY', KEYS[3], 'spares_lapsed', spares)
  end
  return #expired - spares
end
-- Makes `lease_id` the lease of migrating `request_id` over `link` until `expires`.
local function grant(lease_id, request_id, holder_id, src, dst, link, expires)
  redis.call('HSET', ARGV[1] .. 'lease:' .. lease_id, 'request_id', request_id,
    'holder_id', holder_id, 'src_instance_id', src, 'dst_instance_id', dst, 'link', link,
    'expires_unix_ms', expires)
  redis.call('ZADD', KEYS[1], expires, lease_id)
  redis.call('HINCRBY', KEYS[2], link, 1)
  redis.call('SET', ARGV[1] .. 'request:' .. request_id, lease_id)
  redis.call('HINCRBY', KEYS[3], 'granted', 1)
end
-- Leases a migration holds: every lease but the spares.
local function migrating()
  return redis.call('ZCARD', KEYS[1]) - redis.call('SCARD', KEYS[5])
end
local function lease_reply(status, lease_id, in_use)
  local f = redis.call('HMGET', ARGV[1] .. 'lease:' .. lease_id, 'request_id', 'holder_id',
    'src_instance_id', 'dst_instance_id', 'expires_unix_ms')
  return {status, lease_id, f[1], f[2], f[3], f[4], f[5], in_use}
end
"""

# ARGV: prefix, request_id, holder_id, src, dst, link, ttl_ms (0: the policy's), lease_id
# (fresh for each call: also the attempt's id)
# Returns {granted|existing, lease fields..., in_use, cluster_cap},
# {denied, cap name, in use, cap}, {badttl, max_ttl_ms} or {nopolicy}.
_RESERVE = (
    _LUA_COMMON
    + """
local request_id, holder_id, src, dst, link = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local policy = redis.call('HMGET', KEYS[4], 'cluster_cap', 'link_cap', 'default_ttl_ms',
  'max_ttl_ms')
if not policy[1] then
  return {'nopolicy'}
end
local cluster_cap, link_cap = tonumber(policy[1]), tonumber(policy[2])
local ttl_ms = tonumber(ARGV[7])
if ttl_ms == 0 then
  ttl_ms = tonumber(policy[3])
end
if ttl_ms > tonumber(policy[4]) then
  return {'badttl', policy[4]}
end
local now = now_ms()
purge(now)
local attempt = ARGV[1] .. 'attempt:' .. ARGV[8]
local denial = redis.call('GET', attempt)
if denial then
  local cap_name, in_use, cap = string.match(denial, '^(%S+) (%d+) (%d+)$')
  return {'denied', cap_name, tonumber(in_use), tonumber(cap)}
end
local function deny(cap_name, in_use, cap)
  redis.call('SET', attempt, cap_name .. ' ' .. in_use .. ' ' .. cap, 'PX', 60000)
  redis.call('HINCRBY', KEYS[3], 'denied', 1)
  return {'denied', cap_name, in_use, cap}
end
local existing = redis.call('GET', ARGV[1] .. 'request:' .. request_id)
if existing then
  -- Same link: a retry, from this holder or from another replica after a lost reply.
  if redis.call('HGET', ARGV[1] .. 'lease:' .. existing, 'link') == link then
    local reply = lease_reply('existing', existing, migrating())
    table.insert(reply, cluster_cap)
    return reply
  end
  -- Another link: the request is recovered again (its last target failed too); the
  -- migration the old lease was for is over, so its slot is returned first.
  drop(existing)
  redis.call('HINCRBY', KEYS[3], 'superseded', 1)
end
local in_use = redis.call('ZCARD', KEYS[1])
if in_use >= cluster_cap then
  return deny('cluster_cap', in_use, cluster_cap)
end
if link_cap > 0 then
  local on_link = tonumber(redis.call('HGET', KEYS[2], link) or '0')
  if on_link >= link_cap then
    return deny('link_cap', on_link, link_cap)
  end
end
local lease_id = ARGV[8]
grant(lease_id, request_id, holder_id, src, dst, link, now + ttl_ms)
local reply = lease_reply('granted', lease_id, migrating())
table.insert(reply, cluster_cap)
return reply
"""
)

# Makes a spare for `holder_id` (ttl_ms 0: the policy's): false with a per-link cap, or
# when half the cluster cap or more would be held.
_LUA_SPARE = """
local function spare(holder_id, ttl_ms, lease_id, now)
  local policy = redis.call('HMGET', KEYS[4], 'cluster_cap', 'link_cap', 'default_ttl_ms')
  if tonumber(policy[2]) > 0 then
    return false
  end
  if 2 * (redis.call('ZCARD', KEYS[1]) + 1) > tonumber(policy[1]) then
    return false
  end
  if ttl_ms == 0 then
    ttl_ms = tonumber(policy[3])
  end
  local expires = now + ttl_ms
  redis.call('HSET', ARGV[1] .. 'lease:' .. lease_id, 'request_id', '', 'holder_id',
    holder_id, 'src_instance_id', '', 'dst_instance_id', '', 'expires_unix_ms', expires)
  redis.call('ZADD', KEYS[1], expires, lease_id)
  redis.call('SADD', KEYS[5], lease_id)
  return true
end
"""

# ARGV: prefix, holder_id, ttl_ms (0: the policy's), lease_id (fresh).
# Returns {spare, lease fields..., in_use}, {none} (see `spare`) or {nopolicy}.
_RESERVE_SPARE = (
    _LUA_COMMON
    + _LUA_SPARE
    + """
if not redis.call('HGET', KEYS[4], 'cluster_cap') then
  return {'nopolicy'}
end
local now = now_ms()
purge(now)
if not spare(ARGV[2], tonumber(ARGV[3]), ARGV[4], now) then
  return {'none'}
end
return lease_reply('spare', ARGV[4], migrating())
"""
)

# ARGV: prefix, ttl_ms (0: the policy's), holder_id, spare_ttl_ms, then six per claim:
# lease_id, request_id, src, dst, link, next_spare_id ('' = none).
# Returns, per claim in order, {claimed, lease fields..., in_use, next spare id or '', its
# expiry or 0} or {missing, next spare id or '', its expiry or 0} (the spare expired, or
# was released before its claim: a migration that ended at once). With a next spare id, a
# spare takes the claimed one's place in the same step (when `spare` allows one), claimed
# or missing: the holder keeps as many spares as it had either way.
_CLAIM = (
    _LUA_COMMON
    + _LUA_SPARE
    + """
local now = now_ms()
purge(now)
local ttl_ms = tonumber(ARGV[2])
if ttl_ms == 0 then
  ttl_ms = tonumber(redis.call('HGET', KEYS[4], 'default_ttl_ms') or '10000')
end
local function replace(reply, next_id)
  if next_id ~= '' and spare(ARGV[3], tonumber(ARGV[4]), next_id, now) then
    table.insert(reply, next_id)
    table.insert(reply, tonumber(redis.call('ZSCORE', KEYS[1], next_id)))
  else
    table.insert(reply, '')
    table.insert(reply, 0)
  end
  return reply
end
local function claim(lease_id, request_id, src, dst, link, next_id)
  if redis.call('SREM', KEYS[5], lease_id) == 0 then
    return replace({'missing'}, next_id)
  end
  local existing = redis.call('GET', ARGV[1] .. 'request:' .. request_id)
  if existing and existing ~= lease_id then
    -- An earlier lease of the request (a retry that was answered twice, or a previous
    -- recovery's): the migration now runs under this one.
    drop(existing)
    redis.call('HINCRBY', KEYS[3], 'superseded', 1)
  end
  local holder_id = redis.call('HGET', ARGV[1] .. 'lease:' .. lease_id, 'holder_id')
  grant(lease_id, request_id, holder_id, src, dst, link, now + ttl_ms)
  return replace(lease_reply('claimed', lease_id, migrating()), next_id)
end
local replies = {}
for i = 5, #ARGV, 6 do
  table.insert(replies, claim(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4],
    ARGV[i + 5]))
end
return replies
"""
)

# ARGV: prefix, lease_id, ttl_ms (0: the policy's). Returns {renewed, lease fields...} or
# {missing}.
_RENEW = (
    _LUA_COMMON
    + """
local lease_id = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
if ttl_ms == 0 then
  ttl_ms = tonumber(redis.call('HGET', KEYS[4], 'default_ttl_ms') or '10000')
end
local now = now_ms()
purge(now)
if not redis.call('ZSCORE', KEYS[1], lease_id) then
  return {'missing'}
end
local expires = now + ttl_ms
redis.call('ZADD', KEYS[1], expires, lease_id)
redis.call('HSET', ARGV[1] .. 'lease:' .. lease_id, 'expires_unix_ms', expires)
return lease_reply('renewed', lease_id, migrating())
"""
)

# ARGV: prefix, lease_id. Returns 1 when this call released it.
_RELEASE = (
    _LUA_COMMON
    + """
purge(now_ms())
return drop(ARGV[2]) and 1 or 0
"""
)

# ARGV: prefix. Returns {in_use, links hash flat, totals hash flat, expired now,
# cluster_cap, link_cap, spares} (caps 0 when no policy is published).
_STATS = (
    _LUA_COMMON
    + """
local purged = purge(now_ms())
local policy = redis.call('HMGET', KEYS[4], 'cluster_cap', 'link_cap')
return {migrating(), redis.call('HGETALL', KEYS[2]),
  redis.call('HGETALL', KEYS[3]), purged, policy[1] or 0, policy[2] or 0,
  redis.call('SCARD', KEYS[5])}
"""
)


class NoSlotPolicy(FailedPrecondition):
    """No slot broker has published the caps yet: nothing to hold a reservation to."""


@dataclass(frozen=True)
class SlotPolicy:
    """The caps and lease lifetimes every reservation is held to (the broker's config)."""

    cluster_cap: int
    """Concurrent migrations allowed cluster-wide."""
    link_cap: int = 0
    """Concurrent migrations allowed per (src, dst) pair; 0 = no cap."""
    default_ttl_s: float = 10.0
    """Lease lifetime when the caller gives none."""
    max_ttl_s: float = 600.0
    """Longest lease a caller may ask for."""


@dataclass(frozen=True)
class Lease:
    """A held migration slot."""

    lease_id: str
    request_id: str
    """The migration it is for; a retry with the same id gets this lease back."""
    holder_id: str
    """Who holds it (the scheduler replica or worker that will run the transfer)."""
    src_instance_id: str
    dst_instance_id: str
    expires_unix_ms: int
    """When the slot returns unless renewed (Redis clock)."""


@dataclass(frozen=True)
class Grant:
    """The outcome of a successful reservation."""

    lease: Lease
    slots_in_use: int
    cluster_cap: int
    retried: bool
    """True when the request id already held this lease (an idempotent retry)."""


@dataclass(frozen=True)
class SpareClaim:
    """A spare handed out for a request: what `SlotStore.claim` makes of it."""

    lease_id: str
    request_id: str
    src_instance_id: str
    dst_instance_id: str


@dataclass(frozen=True)
class Claim:
    """What claiming a spare gave: the request's lease (None: the spare was gone) and the
    spare that took its place (None: none asked for, or none allowed)."""

    lease: Lease | None
    spare: Lease | None


@dataclass(frozen=True)
class LinkUsage:
    src_instance_id: str
    dst_instance_id: str
    in_use: int
    cap: int
    """The per-link cap; 0 = none."""


@dataclass(frozen=True)
class SlotStats:
    slots_in_use: int
    """Leases migrations hold (spares are not among them)."""
    cluster_cap: int
    links: tuple[LinkUsage, ...]
    """Links with at least one lease held."""
    granted_total: int
    denied_total: int
    expired_total: int
    """Leases a migration held until they expired: their holder never released them."""
    spare_slots: int = 0
    """Leases reserved ahead by scheduler replicas, for no request yet (they count
    against the cluster cap)."""
    spares_lapsed_total: int = 0
    """Spares that lapsed unclaimed: how a replica's spares end when it does not need
    them (not a leak)."""


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _pairs(flat: list) -> dict[str, str]:
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


def _lease(reply: list) -> Lease:
    return Lease(
        lease_id=_text(reply[1]),
        request_id=_text(reply[2]),
        holder_id=_text(reply[3]),
        src_instance_id=_text(reply[4]),
        dst_instance_id=_text(reply[5]),
        expires_unix_ms=int(reply[6]),
    )


def _require(field: str, value: str) -> None:
    if not value:
        raise InvalidArgument(field, "must not be empty")


class SlotStore:
    """Lease operations; each raises `kvrs.errors` exceptions the server maps to codes.

    The slot broker owns a `policy` and publishes it (`publish_policy`); any other caller
    (a scheduler reserving directly) passes none and is held to the published one.
    """

    def __init__(
        self,
        client: RedisClient,
        prefix: str,
        policy: SlotPolicy | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        keys = Keys(prefix)
        self._client = client
        self._metrics = metrics
        self.policy = policy
        self._keys = [
            keys("slots", "leases"),
            keys("slots", "links"),
            keys("slots", "totals"),
            keys("slots", "policy"),
            keys("slots", "spares"),
        ]
        self._prefix = keys("slots", "")
        self._reserve = client.register_script(_RESERVE)
        self._reserve_spare = client.register_script(_RESERVE_SPARE)
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._stats = client.register_script(_STATS)

    async def publish_policy(self) -> None:
        """Makes this store's policy the one every reservation is held to."""
        if self.policy is None:
            raise FailedPrecondition("a slot store without a policy has none to publish")
        await self._client.hset(
            self._keys[3],
            mapping={
                "cluster_cap": self.policy.cluster_cap,
                "link_cap": self.policy.link_cap,
                "default_ttl_ms": round(self.policy.default_ttl_s * 1000),
                "max_ttl_ms": round(self.policy.max_ttl_s * 1000),
            },
        )

    def _ttl_ms(self, ttl_s: float) -> int:
        """Milliseconds of `ttl_s`; 0 stays 0: the script applies the published default."""
        if not math.isfinite(ttl_s) or ttl_s < 0:
            raise InvalidArgument("ttl_s", f"must be a finite number >= 0, got {ttl_s}")
        if self.policy is not None and ttl_s > self.policy.max_ttl_s:
            raise InvalidArgument(
                "ttl_s", f"must be at most {self.policy.max_ttl_s} s, got {ttl_s}"
            )
        return max(1, round(ttl_s * 1000)) if ttl_s else 0

    async def reserve(
        self,
        request_id: str,
        holder_id: str,
        src_instance_id: str,
        dst_instance_id: str,
        ttl_s: float = 0.0,
    ) -> Grant:
        """Takes a slot for migrating `request_id` over src -> dst (ttl 0 = the default).

        ResourceExhausted naming `cluster_cap` or `link_cap` when a cap is reached. A
        request id that holds a lease on the same link gets that lease back, whoever asks
        (a retry, possibly on another scheduler replica); on another link, its old lease
        is dropped first (a request migrates over one link at a time).
        """
        _require("request_id", request_id)
        _require("holder_id", holder_id)
        _require("src_instance_id", src_instance_id)
        _require("dst_instance_id", dst_instance_id)
        if src_instance_id == dst_instance_id:
            raise InvalidArgument("dst_instance_id", "must differ from src_instance_id")
        ttl_ms = self._ttl_ms(ttl_s)
        link = json.dumps([src_instance_id, dst_instance_id])
        args: list[str | int] = [
            self._prefix,
            request_id,
            holder_id,
            src_instance_id,
            dst_instance_id,
            link,
            ttl_ms,
            uuid.uuid4().hex,
        ]
        reply = await self._reserve(keys=self._keys, args=args)
        status = _text(reply[0])
        if status == "nopolicy" and self.policy is not None:
            # The caps are gone (Redis restarted empty): the broker that owns them puts
            # them back, and this reservation is held to them like every other.
            await self.publish_policy()
            reply = await self._reserve(keys=self._keys, args=args)
            status = _text(reply[0])
        if status == "nopolicy":
            raise NoSlotPolicy(
                "no slot policy is published yet (the slot broker publishes it when it starts)"
            )
        if status == "badttl":
            raise InvalidArgument("ttl_s", f"must be at most {int(reply[1]) / 1000} s, got {ttl_s}")
        if status == "denied":
            cap_name, in_use, cap = _text(reply[1]), int(reply[2]), int(reply[3])
            self._count("denied", in_use)
            where = "cluster-wide" if cap_name == "cluster_cap" else f"on {link}"
            raise ResourceExhausted(
                f"{in_use} of {cap} migration slots in use {where}", field=cap_name
            )
        self._count("granted", int(reply[7]))
        return Grant(_lease(reply), int(reply[7]), int(reply[8]), status == "existing")

    async def reserve_spare(self, holder_id: str, ttl_s: float = 0.0) -> Lease | None:
        """A lease for no request yet, held by `holder_id` until `claim`ed or released
        (ttl 0 = the default); None when the cluster holds half its cap or more, or has
        a per-link cap (a spare has no link to count against). NoSlotPolicy before a
        broker has published the caps."""
        _require("holder_id", holder_id)
        reply = await self._reserve_spare(
            keys=self._keys,
            args=[self._prefix, holder_id, self._ttl_ms(ttl_s), uuid.uuid4().hex],
        )
        status = _text(reply[0])
        if status == "nopolicy":
            raise NoSlotPolicy("no slot policy is published yet")
        if status != "spare":
            return None
        return _lease(reply)

    async def claim(
        self,
        claims: Sequence[SpareClaim],
        ttl_s: float = 0.0,
        replace_for: str = "",
        spare_ttl_s: float = 0.0,
    ) -> list[Claim]:
        """Makes each spare the lease of migrating its request over its src -> dst (an
        earlier lease of the request is dropped), all in one Redis step; with
        `replace_for`, a new spare of that holder takes each one's place in the same step,
        when `reserve_spare` would give one, whether or not the claimed one was still
        there. A claim's lease is None when its spare is gone (expired, or released before
        the claim). One `Claim` per claim, in order."""
        if not claims:
            return []
        args: list[str | int] = [
            self._prefix,
            self._ttl_ms(ttl_s),
            replace_for,
            self._ttl_ms(spare_ttl_s),
        ]
        for claim in claims:
            _require("lease_id", claim.lease_id)
            _require("request_id", claim.request_id)
            link = json.dumps([claim.src_instance_id, claim.dst_instance_id])
            args += [
                claim.lease_id,
                claim.request_id,
                claim.src_instance_id,
                claim.dst_instance_id,
                link,
                uuid.uuid4().hex if replace_for else "",
            ]
        replies = await self._claim(keys=self._keys, args=args)
        return [self._claimed(reply, replace_for) for reply in replies]

    def _claimed(self, reply: list, replace_for: str) -> Claim:
        spare_id, spare_expires_unix_ms = _text(reply[-2]), int(reply[-1])
        spare = None
        if spare_id:
            spare = Lease(spare_id, "", replace_for, "", "", spare_expires_unix_ms)
        if _text(reply[0]) == "missing":
            return Claim(None, spare)
        self._count("granted", int(reply[7]))
        return Claim(_lease(reply), spare)

    async def renew(self, lease_id: str, ttl_s: float = 0.0) -> Lease:
        """Extends a lease to now + ttl; NotFound once it expired or was released."""
        _require("lease_id", lease_id)
        reply = await self._renew(
            keys=self._keys, args=[self._prefix, lease_id, self._ttl_ms(ttl_s)]
        )
        if _text(reply[0]) == "missing":
            raise NotFound(f"lease {lease_id!r} expired or was released")
        return _lease(reply)

    async def release(self, lease_id: str) -> bool:
        """Returns a slot; False when the lease had already expired or been released."""
        _require("lease_id", lease_id)
        released = bool(int(await self._release(keys=self._keys, args=[self._prefix, lease_id])))
        if self._metrics is not None:
            # The release script answers only whether it dropped the lease; the count of
            # what is left costs one more round trip, paid only when metrics are on.
            self._metrics.slots_in_use.set(await self._client.zcard(self._keys[0]))
        return released

    async def stats(self) -> SlotStats:
        """Leases held now, per link, and the totals, under the published caps."""
        in_use, links, totals, _, cluster_cap, link_cap, spares = await self._stats(
            keys=self._keys, args=[self._prefix]
        )
        totals = _pairs(totals)
        usage = []
        for link, count in sorted(_pairs(links).items()):
            src, dst = json.loads(link)
            usage.append(LinkUsage(src, dst, int(count), int(link_cap)))
        return SlotStats(
            slots_in_use=int(in_use),
            cluster_cap=int(cluster_cap),
            links=tuple(usage),
            granted_total=int(totals.get("granted", 0)),
            denied_total=int(totals.get("denied", 0)),
            expired_total=int(totals.get("expired", 0)),
            spare_slots=int(spares),
            spares_lapsed_total=int(totals.get("spares_lapsed", 0)),
        )

    async def purge(self) -> int:
        """Drops expired leases now; returns how many a migration held (lapsed spares are
        counted apart). Puts this store's caps back if they are gone (Redis restarted
        empty), so that direct reservations resume too."""
        in_use, _, _, purged, cluster_cap, _, _ = await self._stats(
            keys=self._keys, args=[self._prefix]
        )
        if not int(cluster_cap) and self.policy is not None:
            await self.publish_policy()
        self._count("expired", int(in_use), int(purged))
        return int(purged)

    def _count(self, outcome: str, in_use: int, requests: int = 1) -> None:
        """Records `requests` slot requests ending in `outcome` and the slots now in use."""
        if self._metrics is None:
            return
        if requests:
            self._metrics.slot_requests.labels(outcome).inc(requests)
        self._metrics.slots_in_use.set(in_use)


async def purge_forever(store: SlotStore, interval_s: float, stop: asyncio.Event) -> None:
    """Returns crashed holders' slots even when no caller touches the broker.

    Stops on `stop` rather than by cancellation: redis-py can swallow a CancelledError
    that lands inside a command (redis/redis-py#2028), which would leave the loop running.
    """
    while not stop.is_set():
        try:
            purged = await store.purge()
            if purged:
                log.info("%d expired migration slot leases returned", purged)
        except Exception as exc:  # noqa: BLE001 - the purger must outlive any one purge
            # Redis unreachable, or the Redis Cluster client caught mid-way through a
            # topology change (a failover): the next purge tries again.
            log.warning("lease purge skipped: %r", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
