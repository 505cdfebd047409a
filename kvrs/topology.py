"""Datacenter topology: where instances sit, which links a KV transfer crosses, their capacity.

The model is a tiered tree (node → rack → pod → spine). Every link is directional and
named `(kind, name)`::

    ("nvlink", node)                     GPU to GPU inside a node (one shared fabric)
    ("node-up", node) / ("node-down", node)   node NIC to / from its top-of-rack switch
    ("rack-up", rack) / ("rack-down", rack)   ToR to / from its pod aggregation switch
    ("pod-up", pod)   / ("pod-down", pod)     aggregation to / from the spine

A transfer between two instances climbs to their lowest common tier and back down; the
capacity of an up/down link is the capacity of the tier it leads into (`rack` for node
uplinks, `pod` for ToR uplinks, `spine` for aggregation uplinks). The YAML format is
documented in docs/topology.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum, IntEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvrs.errors import InvalidArgument, NotFound
from kvrs.units import gbps_to_bps

__all__ = [
    "DEFAULT_TIERS",
    "InstanceSpec",
    "LinkId",
    "Location",
    "Role",
    "Tier",
    "TierSpec",
    "Topology",
]


class Tier(IntEnum):
    """The lowest level of the tree two instances share; higher is farther."""

    NODE = 0
    RACK = 1
    POD = 2
    SPINE = 3


class Role(Enum):
    """What an instance does in a disaggregated deployment."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Location:
    """Where an instance runs; an empty rack/pod means a rack/pod of its own."""

    node: str
    rack: str = ""
    pod: str = ""
    gpu_index: int = 0


@dataclass(frozen=True)
class TierSpec:
    """Capacity of one link at a tier, per direction, and the latency one hop adds."""

    capacity_bps: float
    hop_latency_s: float


@dataclass(frozen=True)
class InstanceSpec:
    """A prefill or decode instance and its place in the tree."""

    instance_id: str
    role: Role
    location: Location


LinkId = tuple[str, str]

# Which tier's capacity and hop latency a link kind has.
_LINK_TIER: dict[str, Tier] = {
    "nvlink": Tier.NODE,
    "node-up": Tier.RACK,
    "node-down": Tier.RACK,
    "rack-up": Tier.POD,
    "rack-down": Tier.POD,
    "pod-up": Tier.SPINE,
    "pod-down": Tier.SPINE,
}

DEFAULT_TIERS: Mapping[Tier, TierSpec] = MappingProxyType(
    {
        Tier.NODE: TierSpec(capacity_bps=gbps_to_bps(3600), hop_latency_s=0.0),
        Tier.RACK: TierSpec(capacity_bps=gbps_to_bps(400), hop_latency_s=2e-6),
        Tier.POD: TierSpec(capacity_bps=gbps_to_bps(400), hop_latency_s=2e-6),
        Tier.SPINE: TierSpec(capacity_bps=gbps_to_bps(200), hop_latency_s=2e-6),
    }
)


class Topology:
    """The tree, its instances, and cached per-pair paths (instances may join at run time)."""

    def __init__(
        self,
        tiers: Mapping[Tier, TierSpec] = DEFAULT_TIERS,
        setup_latency_s: float = 1e-3,
        nodes: Mapping[str, Location] | None = None,
        link_capacity_overrides_bps: Mapping[LinkId, float] | None = None,
    ) -> None:
        missing = [tier.name.lower() for tier in Tier if tier not in tiers]
        if missing:
            raise InvalidArgument("tiers", f"missing tier(s): {', '.join(missing)}")
        for tier, spec in tiers.items():
            if not spec.capacity_bps > 0 or spec.hop_latency_s < 0:
                raise InvalidArgument(
                    f"tiers.{Tier(tier).name.lower()}", "needs capacity > 0 and hop latency >= 0"
                )
        if setup_latency_s < 0:
            raise InvalidArgument("setup_latency_s", f"must be >= 0, got {setup_latency_s}")
        self.tiers: dict[Tier, TierSpec] = {Tier(t): s for t, s in tiers.items()}
        self.setup_latency_s = float(setup_latency_s)
        self._nodes: dict[str, Location] = dict(nodes or {})
        self._overrides: dict[LinkId, float] = dict(link_capacity_overrides_bps or {})
        self._instances: dict[str, InstanceSpec] = {}
        self._pair_cache: dict[tuple[str, str], tuple[Tier, tuple[LinkId, ...], float]] = {}
        self.version = 0
        """Bumped on every change, so callers may cache anything derived from paths."""
        self.paths_version = 0
        """Bumped when instances join or move: which links a path crosses, its tier and base
        RTT may change then, but not when only a link's capacity changes."""

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path) -> Topology:
        """Load the YAML format of docs/topology.md."""
        import yaml  # only files need it; `kvrs cost` builds its topology in code

        from kvrs.yamlfile import load_yaml

        try:
            data = load_yaml(path)
        except yaml.YAMLError as exc:
            raise InvalidArgument("topology", f"{path}: not YAML ({exc})") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        """Build from the parsed YAML; every error names the offending key."""
        if not isinstance(d, Mapping):
            raise InvalidArgument("topology", "must be a mapping")
        tiers = dict(DEFAULT_TIERS)
        for name, spec in (d.get("tiers") or {}).items():
            try:
                tier = Tier[str(name).upper()]
            except KeyError:
                raise InvalidArgument(
                    f"tiers.{name}", "unknown tier (node, rack, pod, spine)"
                ) from None
            tiers[tier] = TierSpec(
                capacity_bps=gbps_to_bps(_number(spec, "capacity_gbps", f"tiers.{name}")),
                hop_latency_s=_number(spec, "hop_latency_us", f"tiers.{name}", 0.0) * 1e-6,
            )
        setup_latency_s = _number(d, "setup_latency_ms", "", 1.0) * 1e-3
        nodes: dict[str, Location] = {}
        for i, node in enumerate(d.get("nodes") or []):
            name = _string(node, "name", f"nodes[{i}]")
            if name in nodes:
                raise InvalidArgument(f"nodes[{i}].name", f"duplicate node {name!r}")
            nodes[name] = Location(
                node=name, rack=str(node.get("rack", "")), pod=str(node.get("pod", ""))
            )
        overrides: dict[LinkId, float] = {}
        for i, link in enumerate(d.get("links") or []):
            kind = _string(link, "kind", f"links[{i}]")
            if kind not in _LINK_TIER:
                raise InvalidArgument(f"links[{i}].kind", f"unknown link kind {kind!r}")
            overrides[(kind, _string(link, "name", f"links[{i}]"))] = gbps_to_bps(
                _number(link, "capacity_gbps", f"links[{i}]")
            )
        topology = cls(tiers, setup_latency_s, nodes, overrides)
        for i, inst in enumerate(d.get("instances") or []):
            where = f"instances[{i}]"
            role_name = _string(inst, "role", where)
            try:
                role = Role(role_name)
            except ValueError:
                raise InvalidArgument(
                    f"{where}.role", f"must be prefill or decode, not {role_name!r}"
                ) from None
            node = _string(inst, "node", where)
            if nodes and node not in nodes:
                raise InvalidArgument(f"{where}.node", f"unknown node {node!r}")
            instance_id = _string(inst, "id", where)
            if instance_id in topology._instances:
                raise InvalidArgument(f"{where}.id", f"duplicate instance {instance_id!r}")
            gpu_index = int(_number(inst, "gpu_index", where, 0))
            topology.add_instance(
                InstanceSpec(instance_id, role, Location(node=node, gpu_index=gpu_index))
            )
        return topology

    @classmethod
    def fat_tree(
        cls,
        nodes: int,
        gpus_per_node: int,
        nodes_per_rack: int,
        racks_per_pod: int,
        *,
        prefill_gpus_per_node: int | None = None,
        tiers: Mapping[Tier, TierSpec] = DEFAULT_TIERS,
        setup_latency_s: float = 1e-3,
    ) -> Topology:
        """A regular tree: nodes `n0…`, racks `r0…`, pods `p0…`, one instance per GPU.

        On each node the first `prefill_gpus_per_node` GPUs (half by default) host
        prefill instances `prefill-<i>`, the rest decode instances `decode-<i>`, numbered
        across the whole cluster.
        """
        for name, value in (
            ("nodes", nodes),
            ("gpus_per_node", gpus_per_node),
            ("nodes_per_rack", nodes_per_rack),
            ("racks_per_pod", racks_per_pod),
        ):
            if value <= 0:
                raise InvalidArgument(name, f"must be > 0, got {value}")
        n_prefill = gpus_per_node // 2 if prefill_gpus_per_node is None else prefill_gpus_per_node
        if not 0 <= n_prefill <= gpus_per_node:
            raise InvalidArgument("prefill_gpus_per_node", f"must be in [0, {gpus_per_node}]")
        node_locations = {}
        for n in range(nodes):
            rack = n // nodes_per_rack
            node_locations[f"n{n}"] = Location(f"n{n}", f"r{rack}", f"p{rack // racks_per_pod}")
        topology = cls(tiers, setup_latency_s, node_locations)
        counters = {Role.PREFILL: 0, Role.DECODE: 0}
        for name in node_locations:
            for gpu in range(gpus_per_node):
                role = Role.PREFILL if gpu < n_prefill else Role.DECODE
                instance_id = f"{role.value}-{counters[role]}"
                counters[role] += 1
                location = Location(name, gpu_index=gpu)
                topology.add_instance(InstanceSpec(instance_id, role, location))
        return topology

    def add_instance(self, spec: InstanceSpec) -> None:
        """Register (or move) an instance; an empty rack/pod is filled from its node's entry."""
        if not spec.instance_id:
            raise InvalidArgument("instance_id", "must not be empty")
        if not spec.location.node:
            raise InvalidArgument("location.node", f"{spec.instance_id}: node must not be empty")
        known = self._nodes.get(spec.location.node)
        if known is not None:
            spec = replace(
                spec,
                location=replace(
                    spec.location,
                    rack=spec.location.rack or known.rack,
                    pod=spec.location.pod or known.pod,
                ),
            )
        self._instances[spec.instance_id] = spec
        self._pair_cache.clear()
        self.version += 1
        self.paths_version += 1

    def copy(self) -> Topology:
        """An independent copy, paths already computed included.

        A second view of the same cluster (one whose link capacities will be set from
        measurements) then does not recompute every pair's path: at 1,024 GPUs the
        simulator's 16,384 prefill-to-decode paths took ~70 ms per copy.
        """
        twin = Topology(self.tiers, self.setup_latency_s, self._nodes, self._overrides)
        twin._instances = dict(self._instances)
        twin._pair_cache = dict(self._pair_cache)
        twin.version = self.version
        twin.paths_version = self.paths_version
        return twin

    def set_link_capacity(self, link: LinkId, capacity_bps: float) -> None:
        """Override one link's capacity (a degraded NIC, an oversubscribed uplink)."""
        if link[0] not in _LINK_TIER:
            raise NotFound(f"unknown link kind {link[0]!r}", field="link")
        if not capacity_bps > 0:
            raise InvalidArgument("capacity_bps", f"must be > 0, got {capacity_bps}")
        self._overrides[link] = float(capacity_bps)
        self.version += 1

    # -- queries ------------------------------------------------------------------------

    @property
    def instances(self) -> Mapping[str, InstanceSpec]:
        """Every registered instance by id (read-only)."""
        return MappingProxyType(self._instances)

    def instance(self, instance_id: str) -> InstanceSpec:
        """The registered instance `instance_id`; NotFound names the field otherwise."""
        try:
            return self._instances[instance_id]
        except KeyError:
            raise NotFound(f"unknown instance {instance_id!r}", field="instance_id") from None

    def tier(self, src_id: str, dst_id: str) -> Tier:
        """The lowest tier the two instances share."""
        return self._pair(src_id, dst_id)[0]

    def path_links(self, src_id: str, dst_id: str) -> tuple[LinkId, ...]:
        """The directional links a transfer from `src_id` to `dst_id` crosses, in order."""
        return self._pair(src_id, dst_id)[1]

    def base_rtt_s(self, src_id: str, dst_id: str) -> float:
        """Setup latency plus the round trip over every hop of the path; 0 to itself."""
        return self._pair(src_id, dst_id)[2]

    def pair(self, src_id: str, dst_id: str) -> tuple[Tier, tuple[LinkId, ...], float]:
        """(tier, path links, base RTT) of the path in one lookup: what the three above give."""
        return self._pair(src_id, dst_id)

    def link_capacity_bps(self, link: LinkId) -> float:
        """Capacity of one directional link (its tier's, unless overridden)."""
        override = self._overrides.get(link)
        if override is not None:
            return override
        try:
            return self.tiers[_LINK_TIER[link[0]]].capacity_bps
        except KeyError:
            raise NotFound(f"unknown link kind {link[0]!r}", field="link") from None

    def _pair(self, src_id: str, dst_id: str) -> tuple[Tier, tuple[LinkId, ...], float]:
        key = (src_id, dst_id)
        cached = self._pair_cache.get(key)
        if cached is None:
            cached = self._pair_cache[key] = self._compute_pair(src_id, dst_id)
        return cached

    def _compute_pair(self, src_id: str, dst_id: str) -> tuple[Tier, tuple[LinkId, ...], float]:
        src, dst = self.instance(src_id).location, self.instance(dst_id).location
        if src_id == dst_id:
            return Tier.NODE, (), 0.0
        if src.node == dst.node:
            links: tuple[LinkId, ...] = (("nvlink", src.node),)
            tier = Tier.NODE
        else:
            src_rack, dst_rack = _rack(src), _rack(dst)
            src_pod, dst_pod = _pod(src), _pod(dst)
            up: list[LinkId] = [("node-up", src.node)]
            down: list[LinkId] = [("node-down", dst.node)]
            tier = Tier.RACK
            if src_rack != dst_rack:
                up.append(("rack-up", src_rack))
                down.append(("rack-down", dst_rack))
                tier = Tier.POD
                if src_pod != dst_pod:
                    up.append(("pod-up", src_pod))
                    down.append(("pod-down", dst_pod))
                    tier = Tier.SPINE
            links = (*up, *reversed(down))
        one_way_s = sum(self.tiers[_LINK_TIER[kind]].hop_latency_s for kind, _ in links)
        return tier, links, self.setup_latency_s + 2.0 * one_way_s


def _rack(location: Location) -> str:
    # An unnamed rack is the node's own; the prefix keeps it apart from named racks.
    return location.rack or f"node:{location.node}"


def _pod(location: Location) -> str:
    return location.pod or f"rack:{_rack(location)}"


def _number(d: Any, key: str, where: str, default: float | None = None) -> float:
    field = f"{where}.{key}" if where else key
    if not isinstance(d, Mapping):
        raise InvalidArgument(where or "topology", "must be a mapping")
    if key not in d:
        if default is None:
            raise InvalidArgument(field, "missing")
        return default
    try:
        value = float(d[key])
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"must be a number, got {d[key]!r}") from None
    if value < 0:
        raise InvalidArgument(field, f"must be >= 0, got {value}")
    return value


def _string(d: Any, key: str, where: str) -> str:
    if not isinstance(d, Mapping):
        raise InvalidArgument(where, "must be a mapping")
    value = d.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{where}.{key}", "missing or not a string")
    return value
