"""T_x(src, dst, bytes): transfer time over the real path, from topology, telemetry and flows.

The effective bandwidth of a transfer is its share of the path's bottleneck. Per link:
capacity / (flows on the link + 1), the minimum over the path's links. A fresh measured
estimate of the (src, dst) path replaces the topology's capacity as the base — it already
contains the background traffic the topology cannot know — and is divided by the flows
this model knows about on the busiest link of the path, plus one for the new transfer.
A measurement older than the staleness bound is ignored (and flagged in the estimate).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass, field

import numpy as np

from kvrs._frozen import build
from kvrs.errors import InvalidArgument
from kvrs.estimator import LinkEstimate, LinkTrend, StalenessPolicy
from kvrs.topology import LinkId, Tier, Topology
from kvrs.units import BITS_PER_BYTE

_INPUT_VERSIONS = itertools.count(1)
"""One counter for every model: a version never names the inputs of two different models,
so caches keyed by `NetworkModel.version` cannot mix up two networks."""

__all__ = ["DEFAULT_STALENESS", "NetworkModel", "PathTable", "PathTerms", "TransferEstimate"]

DEFAULT_STALENESS = StalenessPolicy()


@dataclass(frozen=True)
class TransferEstimate:
    """A predicted transfer and every input that went into it (for traces and tests)."""

    src_id: str
    dst_id: str
    kv_bytes: int
    transfer_s: float
    tier: Tier
    bottleneck_bps: float
    """This transfer's share of the bottleneck link."""
    rtt_s: float
    telemetry_age_s: float
    """Age of the path's bandwidth measurement; -1 when there is none."""
    telemetry_stale: bool
    """A measurement existed but was too old, so topology capacity was used."""
    flows_on_path: int
    """Other flows on the bottleneck link, counted in the share."""


@dataclass(frozen=True)
class PathTable:
    """Bandwidth, RTT and tier from one source to many destinations, for vectorised scoring.

    Reusable while `valid(network, now_s)`: the network's inputs are unchanged and no
    measurement on these paths has changed between fresh and stale.
    """

    src_id: str
    dst_ids: tuple[str, ...]
    bandwidth_bps: tuple[float, ...]
    rtt_s: tuple[float, ...]
    tiers: tuple[Tier, ...]
    version: tuple[int, int]
    lo_s: float
    hi_s: float
    arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)
    """(rtt_s, 1 / bandwidth_bps) as numpy arrays, when the table was priced with numpy:
    the same floats as the tuples, for scoring large candidate lists without converting."""

    def valid(self, network: NetworkModel, now_s: float) -> bool:
        """True while the table still says what `network` would say at `now_s`."""
        return self.version == network.version and self.lo_s < now_s <= self.hi_s


class PathTerms:
    """Everything about one (src, dst) path that does not depend on extra flows (read-only).

    `bps` is the share of the bottleneck with the known flows; `measured_bps` the fresh
    measurement (0 when none is used). Valid while the model's inputs are unchanged and
    `lo_s < now_s <= hi_s` (the interval in which the measurement keeps its status).
    """

    __slots__ = (
        "links",
        "caps",
        "known",
        "tier",
        "rtt_s",
        "measured_bps",
        "estimate",
        "stale",
        "lo_s",
        "hi_s",
        "bps",
        "bottleneck",
        "flows",
    )

    links: tuple[LinkId, ...]
    caps: tuple[float, ...]
    known: tuple[int, ...]
    tier: Tier
    rtt_s: float
    measured_bps: float
    estimate: LinkEstimate | None
    stale: bool
    lo_s: float
    hi_s: float
    bps: float
    bottleneck: LinkId | None
    flows: int


class _FanPaths:
    """The paths from one source to a list of destinations, as far as flows cannot change
    them: link indices hop by hop (index 0 pads the shorter paths), base RTTs and tiers.
    """

    __slots__ = ("dst_ids", "paths_version", "incidence", "rtt_s", "rtt_array", "tiers")

    def __init__(
        self,
        dst_ids: tuple[str, ...],
        paths_version: int,
        incidence: np.ndarray,
        rtt_s: tuple[float, ...],
        tiers: tuple[Tier, ...],
    ) -> None:
        self.dst_ids = dst_ids
        self.paths_version = paths_version
        self.incidence = incidence
        self.rtt_s = rtt_s
        self.rtt_array = np.array(rtt_s)
        self.tiers = tiers


class NetworkModel:
    """Predicts transfer times; holds the telemetry and flow counts a decision sees.

    A fan-out (one source to many destinations) is priced from one vector of per-link
    shares, capacity / (flows + 1), computed once per change of the inputs: flow counts
    change far more often than paths do, and every path crossing a changed link would
    otherwise be rebuilt one by one.
    """

    def __init__(self, topology: Topology, staleness: StalenessPolicy = DEFAULT_STALENESS):
        self.topology = topology
        self.staleness = staleness
        self._estimates: dict[tuple[str, str], LinkEstimate] = {}
        self._flows: dict[LinkId, int] = {}
        self._paths: dict[tuple[str, str], PathTerms] = {}
        self._tables: dict[str, PathTable] = {}
        self._inputs_version = next(_INPUT_VERSIONS)
        self._topology_version = topology.version
        # Fan-outs: per source, its last destination list's paths; links by index (0 is
        # padding, of infinite share); per-link capacities and shares, with their keys.
        self._fan_paths: dict[str, _FanPaths] = {}
        self._estimated: dict[str, set[str]] = {}
        self._link_index: dict[LinkId, int] = {}
        self._link_ids: list[LinkId] = []
        self._caps: tuple[tuple[int, int], np.ndarray] | None = None
        self._shares: tuple[tuple[int, int, int], np.ndarray] | None = None
        self._trends: dict[LinkId, LinkTrend] = {}
        self._unmeasured_rtt_s = 0.0

    def carry_paths(self, previous: NetworkModel) -> None:
        """Take over the fan-out paths `previous` found on the same topology: they depend
        on the topology alone, so a model rebuilt for new measurements or flows need not
        walk them again. Call it on a model that has priced nothing yet."""
        if previous.topology is not self.topology or self._link_ids:
            return
        self._fan_paths = dict(previous._fan_paths)
        self._link_index = dict(previous._link_index)
        self._link_ids = list(previous._link_ids)
        self._caps = previous._caps

    def copy(self) -> NetworkModel:
        """A model with this one's estimates, flows, fixed-cost floor and priced paths,
        to change without changing this one: a view updating the few estimates a refresh
        brought, where setting every estimate again costs in proportion to the network."""
        other = NetworkModel(self.topology, self.staleness)
        other.carry_paths(self)
        other._estimates = dict(self._estimates)
        other._estimated = {src_id: set(dst_ids) for src_id, dst_ids in self._estimated.items()}
        other._flows = dict(self._flows)
        other._paths = dict(self._paths)
        other._topology_version = self._topology_version
        other._trends = {link: deepcopy(trend) for link, trend in self._trends.items()}
        other._unmeasured_rtt_s = self._unmeasured_rtt_s
        return other

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever estimates, flows or the topology change (for derived caches)."""
        return self._inputs_version, self.topology.version

    @property
    def flows(self) -> Mapping[LinkId, int]:
        """The flows now on each link, as last set."""
        return dict(self._flows)

    def link_estimate(self, src_id: str, dst_id: str) -> LinkEstimate | None:
        """The measured estimate of the path, fresh or not; None when never measured."""
        return self._estimates.get((src_id, dst_id))

    def set_link_estimate(self, src_id: str, dst_id: str, estimate: LinkEstimate) -> None:
        """Record the prober's estimate for the (src, dst) path."""
        self.topology.instance(src_id)
        self.topology.instance(dst_id)
        if not estimate.bandwidth_bps > 0.0:
            raise InvalidArgument("bandwidth_bps", f"must be > 0, got {estimate.bandwidth_bps}")
        self._estimates[(src_id, dst_id)] = estimate
        self._estimated.setdefault(src_id, set()).add(dst_id)
        self._paths.pop((src_id, dst_id), None)
        self._inputs_version = next(_INPUT_VERSIONS)

    def set_unmeasured_rtt(self, rtt_s: float) -> None:
        """Price every path without a fresh estimate with at least `rtt_s` of fixed cost:
        what the measured paths show a transfer pays before its first byte (the calls,
        the ticket, the pair), which a pair no one measured yet pays too, or more."""
        if not rtt_s >= 0.0:
            raise InvalidArgument("rtt_s", f"must be >= 0, got {rtt_s}")
        self._unmeasured_rtt_s = rtt_s
        self._paths.clear()
        self._inputs_version = next(_INPUT_VERSIONS)

    def observe_link(self, link: LinkId, free_bps: float, at_s: float) -> None:
        """A link counter's sample: the capacity traffic this model does not count left.

        It feeds the link's `LinkTrend` (prior: the topology's capacity of the link), read
        by `expected_inverse_bps`; `fan_out` and `transfer` are unaffected.
        """
        trend = self._trends.get(link)
        if trend is None:
            trend = self._trends[link] = LinkTrend(self.topology.link_capacity_bps(link))
        trend.observe(free_bps, at_s)

    @property
    def has_link_trends(self) -> bool:
        """True once some link sample was observed."""
        return bool(self._trends)

    @property
    def has_measurements(self) -> bool:
        """True once a link sample or a path estimate was recorded."""
        return bool(self._trends or self._estimates)

    def expected_inverse_bps(
        self,
        src_id: str,
        dst_ids: Sequence[str],
        now_s: float,
        horizon_s: float = 0.0,
        count_flows: bool = True,
    ) -> np.ndarray:
        """Expected seconds per bit from `src_id` to each of `dst_ids`, known flows counted.

        Per link, (flows + 1) / capacity is the share a new transfer gets of its nominal
        capacity, and (flows + 1) · excess what traffic this model does not count adds, as
        the link's trend expects it over the next `horizon_s`. A path costs its
        bottleneck's share plus the excess of all its links: links congest independently,
        and a transfer crossing four of them is slowed by whichever is congested while it
        runs. `count_flows=False` prices every link as if no flow were on it.
        """
        dst_ids = tuple(dst_ids)
        fan = self._fan_paths.get(src_id)
        if (
            fan is None
            or fan.dst_ids != dst_ids
            or fan.paths_version != self.topology.paths_version
        ):
            fan = self._fan_paths[src_id] = self._build_fan(src_id, dst_ids)
        base = np.divide(1.0, self._link_shares() if count_flows else self._link_caps())
        excess = np.zeros(len(base))
        index = self._link_index
        flows = self._flows if count_flows else {}
        for link, trend in self._trends.items():
            i = index.get(link)
            if i is not None:
                excess[i] = (flows.get(link, 0) + 1) * trend.excess_s_per_bit(now_s, horizon_s)
        return base.take(fan.incidence).max(axis=0) + excess.take(fan.incidence).sum(axis=0)

    def set_flows(self, flows: Mapping[LinkId, int]) -> None:
        """Replace the flows known to be on each link (transfers in progress)."""
        for link, count in flows.items():
            if count < 0:
                raise InvalidArgument("flows", f"{link}: count must be >= 0, got {count}")
        self._flows = {link: int(count) for link, count in flows.items() if count}
        self._paths.clear()
        self._inputs_version = next(_INPUT_VERSIONS)

    def rate_and_rtt(
        self,
        src_id: str,
        dst_id: str,
        now_s: float,
        extra_flows: Mapping[LinkId, int] | None = None,
    ) -> tuple[float, float]:
        """(bandwidth_bps, rtt_s) of the path: the hot-path form of `transfer`."""
        path = self._path(src_id, dst_id, now_s)
        if not extra_flows or not path.links:
            return path.bps, path.rtt_s
        return _share(path, extra_flows)[0], path.rtt_s

    def path_terms(self, src_id: str, dst_id: str, now_s: float) -> PathTerms:
        """The cached terms of one path (links, capacities, known flows, RTT, measurement)."""
        return self._path(src_id, dst_id, now_s)

    def fan_out(self, src_id: str, dst_ids: Sequence[str], now_s: float) -> PathTable:
        """The paths from `src_id` to each of `dst_ids` (known flows, no extra ones).

        The last table per source is kept: views are rebuilt on every gossip refresh, but
        the set of instances rarely changes between two of them.
        """
        dst_ids = tuple(dst_ids)
        cached = self._tables.get(src_id)
        if cached is not None and cached.dst_ids == dst_ids and cached.valid(self, now_s):
            return cached
        fan = self._fan_paths.get(src_id)
        if (
            fan is None
            or fan.dst_ids != dst_ids
            or fan.paths_version != self.topology.paths_version
        ):
            fan = self._fan_paths[src_id] = self._build_fan(src_id, dst_ids)
        # Each path's share of its bottleneck, min over its links of capacity / (flows + 1),
        # for every destination at once.
        shares = np.minimum.reduce(self._link_shares().take(fan.incidence), axis=0)
        bandwidth_bps = shares.tolist()
        rtt_s = fan.rtt_s
        # 1 / bandwidth divided elementwise, the same IEEE division as in Python.
        arrays: tuple[np.ndarray, np.ndarray] | None = (fan.rtt_array, 1.0 / shares)
        floor_s = self._unmeasured_rtt_s
        if floor_s > 0.0:
            hops = np.count_nonzero(fan.incidence, axis=0).tolist()
            rtt_s = tuple(max(r, floor_s) if n else r for r, n in zip(rtt_s, hops, strict=True))
            arrays = None
        lo_s, hi_s = -math.inf, math.inf
        estimated = self._estimated.get(src_id)
        if estimated:
            arrays = None
            # Measured paths take their measurement as the base (see `_build_path`).
            rtt = list(rtt_s)
            for i, dst_id in enumerate(dst_ids):
                if dst_id in estimated:
                    path = self._path(src_id, dst_id, now_s)
                    bandwidth_bps[i] = path.bps
                    rtt[i] = path.rtt_s if path.links else 0.0
                    lo_s, hi_s = max(lo_s, path.lo_s), min(hi_s, path.hi_s)
            rtt_s = tuple(rtt)
        table = self._tables[src_id] = PathTable(
            src_id=src_id,
            dst_ids=dst_ids,
            bandwidth_bps=tuple(bandwidth_bps),
            rtt_s=rtt_s,
            tiers=fan.tiers,
            version=self.version,
            lo_s=lo_s,
            hi_s=hi_s,
            arrays=arrays,
        )
        return table

    def _build_fan(self, src_id: str, dst_ids: tuple[str, ...]) -> _FanPaths:
        pairs = [self.topology.pair(src_id, dst_id) for dst_id in dst_ids]
        longest = max((len(links) for _, links, _ in pairs), default=0)
        incidence = np.zeros((max(1, longest), len(dst_ids)), dtype=np.intp)
        index = self._link_index
        for j, (_, links, _) in enumerate(pairs):
            for k, link in enumerate(links):
                i = index.get(link)
                if i is None:
                    self._link_ids.append(link)
                    i = index[link] = len(self._link_ids)
                incidence[k, j] = i
        return _FanPaths(
            dst_ids,
            self.topology.paths_version,
            incidence,
            tuple(rtt if links else 0.0 for _, links, rtt in pairs),
            tuple(tier for tier, _, _ in pairs),
        )

    def _link_shares(self) -> np.ndarray:
        """capacity / (known flows + 1) of every indexed link; infinity at index 0."""
        key = (self._inputs_version, self.topology.version, len(self._link_ids))
        if self._shares is None or self._shares[0] != key:
            caps = self._link_caps()
            flows = np.zeros(len(caps))
            index = self._link_index
            for link, count in self._flows.items():
                i = index.get(link)
                if i is not None:
                    flows[i] = count
            self._shares = (key, caps / (flows + 1.0))
        return self._shares[1]

    def _link_caps(self) -> np.ndarray:
        """Capacity of every indexed link; infinity at index 0."""
        caps_key = (self.topology.version, len(self._link_ids))
        if self._caps is None or self._caps[0] != caps_key:
            capacity = self.topology.link_capacity_bps
            self._caps = (
                caps_key,
                np.array([math.inf, *(capacity(link) for link in self._link_ids)]),
            )
        return self._caps[1]

    def tier(self, src_id: str, dst_id: str) -> Tier:
        """The topology tier of the path."""
        return self.topology.tier(src_id, dst_id)

    def bandwidth_bps(
        self,
        src_id: str,
        dst_id: str,
        now_s: float,
        extra_flows: Mapping[LinkId, int] | None = None,
    ) -> tuple[float, LinkId | None]:
        """B_eff of the path and its bottleneck link (None to itself: infinite bandwidth)."""
        path = self._path(src_id, dst_id, now_s)
        if not extra_flows or not path.links:
            return path.bps, path.bottleneck
        bps, link, _ = _share(path, extra_flows)
        return bps, link

    def transfer(
        self,
        src_id: str,
        dst_id: str,
        kv_bytes: int,
        now_s: float,
        extra_flows: Mapping[LinkId, int] | None = None,
    ) -> TransferEstimate:
        """T_x: seconds to move `kv_bytes` from `src_id` to `dst_id`; 0 for nothing to move."""
        if kv_bytes < 0:
            raise InvalidArgument("kv_bytes", f"must be >= 0, got {kv_bytes}")
        path = self._path(src_id, dst_id, now_s)
        if not extra_flows or not path.links:
            bps, link, flows = path.bps, path.bottleneck, path.flows
        else:
            bps, link, flows = _share(path, extra_flows)
        if kv_bytes == 0 or not path.links:
            seconds = 0.0
        else:
            seconds = path.rtt_s + BITS_PER_BYTE * kv_bytes / bps
        estimate = path.estimate
        return build(
            TransferEstimate,
            src_id=src_id,
            dst_id=dst_id,
            kv_bytes=kv_bytes,
            transfer_s=seconds,
            tier=path.tier,
            bottleneck_bps=bps,
            rtt_s=path.rtt_s if path.links else 0.0,
            telemetry_age_s=-1.0 if estimate is None else estimate.age_s(now_s),
            telemetry_stale=path.stale,
            flows_on_path=flows if link is not None else 0,
        )

    def _path(self, src_id: str, dst_id: str, now_s: float) -> PathTerms:
        if self.topology.version != self._topology_version:
            self._paths.clear()
            self._topology_version = self.topology.version
        key = (src_id, dst_id)
        path = self._paths.get(key)
        if path is None or not path.lo_s < now_s <= path.hi_s:
            path = self._paths[key] = self._build_path(src_id, dst_id, now_s)
        return path

    def _build_path(self, src_id: str, dst_id: str, now_s: float) -> PathTerms:
        topology = self.topology
        path = PathTerms()
        path.tier = topology.tier(src_id, dst_id)
        path.links = topology.path_links(src_id, dst_id)
        path.caps = tuple(topology.link_capacity_bps(link) for link in path.links)
        path.known = tuple(self._flows.get(link, 0) for link in path.links)
        path.estimate = self._estimates.get((src_id, dst_id))
        fresh = self.staleness.is_fresh(path.estimate, now_s)
        path.stale = path.estimate is not None and not fresh
        path.lo_s, path.hi_s = -math.inf, math.inf
        if path.estimate is not None:
            turns_stale_s = path.estimate.measured_at_s + self.staleness.stale_after_s
            if fresh:
                path.hi_s = turns_stale_s
            else:
                path.lo_s = turns_stale_s
        estimate = path.estimate
        if fresh and estimate is not None:
            path.measured_bps, path.rtt_s = estimate.bandwidth_bps, estimate.rtt_s
        else:
            base_rtt_s = topology.base_rtt_s(src_id, dst_id)
            path.measured_bps, path.rtt_s = 0.0, max(base_rtt_s, self._unmeasured_rtt_s)
        if path.links:
            path.bps, path.bottleneck, path.flows = _share(path, None)
        else:
            path.bps, path.bottleneck, path.flows = math.inf, None, 0
        return path


def _share(path: PathTerms, extra_flows: Mapping[LinkId, int] | None) -> tuple[float, LinkId, int]:
    """(bandwidth share, bottleneck link, flows on it) of a path with `extra_flows` added."""
    links = path.links
    if extra_flows:
        get = extra_flows.get
        flows = [known + get(link, 0) for link, known in zip(links, path.known, strict=True)]
    else:
        flows = list(path.known)
    if path.measured_bps:
        busiest = max(range(len(links)), key=flows.__getitem__)
        if flows[busiest] == 0:
            busiest = min(range(len(links)), key=path.caps.__getitem__)
        return path.measured_bps / (flows[busiest] + 1), links[busiest], flows[busiest]
    best = 0
    best_bps = path.caps[0] / (flows[0] + 1)
    for i in range(1, len(links)):
        bps = path.caps[i] / (flows[i] + 1)
        if bps < best_bps:
            best, best_bps = i, bps
    return best_bps, links[best], flows[best]
