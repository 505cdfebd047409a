"""Simulation parameters: one frozen dataclass per concern, loadable from YAML or JSON.

Every number here is a parameter; docs/simulator.md lists the defaults and says which
are published [P], derived [D] or assumed [A], with their sources. `SimConfig.from_dict`
takes the nested form written by `to_dict`, so a run's parameters can be saved with
its results and replayed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrs.errors import InvalidArgument
from kvrs.model import ModelSpec, model_spec
from kvrs.profile import ComputeProfile, DecodeProfile, compute_profile, decode_profile
from kvrs.sim.background import BackgroundSpec
from kvrs.sim.metrics import SloSpec
from kvrs.sim.telemetry import NETWORK_VIEWS, TelemetrySpec
from kvrs.topology import InstanceSpec, Location, Role, Tier, TierSpec, Topology
from kvrs.units import gbps_to_bps
from kvrs.yamlfile import load_yaml

LAYOUTS = ("interleaved", "segregated")
PREFILL_ROUTERS = ("cache_aware", "least_loaded", "round_robin", "weighted")
RECOVERY_PLANNERS = ("batch", "per_request")


@dataclass(frozen=True)
class ClusterSpec:
    """A fat-tree of nodes with GPUs grouped into tensor-parallel instances.

    Defaults (docs/simulator.md, all assumed): 8 nodes × 8 GPUs, 2 nodes per rack, 2 racks per pod,
    TP4 instances, per node one prefill and one decode (interleaved); NVLink 450 GB/s,
    400 Gbps node uplinks, ToR→agg 2:1 and agg→spine 4:1 oversubscribed, 2 µs per hop
    and 1 ms transfer setup. `topology` (the docs/topology.md format) replaces all of it.
    """

    nodes: int = 8
    gpus_per_node: int = 8
    nodes_per_rack: int = 2
    racks_per_pod: int = 2
    gpus_per_instance: int = 4
    layout: str = "interleaved"
    prefill_per_node: int = 1  # interleaved: the first instances of a node prefill
    nvlink_gbps: float = 3600.0
    rack_gbps: float = 400.0  # node uplink to its ToR
    pod_gbps: float = 200.0  # ToR uplink to aggregation
    spine_gbps: float = 100.0  # aggregation uplink to spine
    hop_latency_us: float = 2.0
    setup_latency_ms: float = 1.0
    topology: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidArgument("cluster.layout", f"one of {LAYOUTS}")
        if self.topology is None and self.gpus_per_node % self.gpus_per_instance:
            raise InvalidArgument("cluster.gpus_per_instance", "must divide gpus_per_node")

    @property
    def instances_per_node(self) -> int:
        return self.gpus_per_node // self.gpus_per_instance

    def build(self) -> Topology:
        """The topology with every instance registered."""
        if self.topology is not None:
            return Topology.from_dict(self.topology)
        hop_s = self.hop_latency_us * 1e-6
        tiers = {
            Tier.NODE: TierSpec(gbps_to_bps(self.nvlink_gbps), 0.0),
            Tier.RACK: TierSpec(gbps_to_bps(self.rack_gbps), hop_s),
            Tier.POD: TierSpec(gbps_to_bps(self.pod_gbps), hop_s),
            Tier.SPINE: TierSpec(gbps_to_bps(self.spine_gbps), hop_s),
        }
        nodes = {}
        for n in range(self.nodes):
            rack = n // self.nodes_per_rack
            nodes[f"n{n}"] = Location(f"n{n}", f"r{rack}", f"p{rack // self.racks_per_pod}")
        topology = Topology(tiers, self.setup_latency_ms * 1e-3, nodes)
        counters = {Role.PREFILL: 0, Role.DECODE: 0}
        for n, name in enumerate(nodes):
            rack = n // self.nodes_per_rack
            for slot in range(self.instances_per_node):
                if self.layout == "interleaved":
                    role = Role.PREFILL if slot < self.prefill_per_node else Role.DECODE
                else:  # segregated: whole racks of prefill alternate with racks of decode
                    role = Role.PREFILL if rack % 2 == 0 else Role.DECODE
                instance_id = f"{role.value}-{counters[role]}"
                counters[role] += 1
                topology.add_instance(
                    InstanceSpec(
                        instance_id, role, Location(name, gpu_index=slot * self.gpus_per_instance)
                    )
                )
        return topology


@dataclass(frozen=True)
class ServingSpec:
    """The model, its latency profiles, and the executors' limits.

    Defaults: LLaMA3-70B-shaped model on TP4 (docs/simulator.md, assumed): prefill a = 20 ms,
    b = 0.0708 ms/token, c = 6.63e-7 ms/token²; decode step 17 ms + 3.8e-5 ms/context
    token + 0.05 ms/request; 500k tokens of KV per decode instance; a 3M-token prefix
    pool per node.
    """

    model: str = "llama3-70b"
    prefill_profile: str | Mapping[str, Any] = "llama3-70b"
    decode_profile: str | Mapping[str, float] = field(
        default_factory=lambda: {
            "a_s": 17e-3,
            "b_s_per_context_token": 3.8e-8,
            "c_s_per_request": 5e-5,
        }
    )
    prefill_budget_tokens: int = 16_384
    prefix_pool_tokens: int = 3_000_000
    prefix_pool_scope: str = "node"  # "node": one LRU per node; "global": one for all
    decode_kv_tokens: int = 500_000
    decode_max_batch: int = 256
    decode_cache_tokens: int = 500_000  # prefix blocks a decode instance keeps
    transfer_overlap: float = 0.0  # share of the KV already sent when prefill ends
    layerwise_streaming: bool = False  # decode chosen as the prefill starts, KV streamed
    early_placement: bool = False  # decode chosen as the prefill starts, KV sent after it
    prefill_router: str = "cache_aware"
    prefill_weights: Mapping[str, float] | None = None  # "weighted": share per prefill

    def __post_init__(self) -> None:
        if self.prefill_router == "weighted" and not self.prefill_weights:
            raise InvalidArgument("serving.prefill_weights", "needed by the weighted router")
        if self.prefix_pool_scope not in ("node", "global"):
            raise InvalidArgument("serving.prefix_pool_scope", "node or global")
        if not 0.0 <= self.transfer_overlap < 1.0:
            raise InvalidArgument("serving.transfer_overlap", "must be in [0, 1)")
        if self.prefill_router not in PREFILL_ROUTERS:
            raise InvalidArgument("serving.prefill_router", f"one of {PREFILL_ROUTERS}")

    def model_spec(self) -> ModelSpec:
        return model_spec(self.model)

    def compute(self) -> ComputeProfile:
        if isinstance(self.prefill_profile, str):
            return compute_profile(self.prefill_profile)
        return ComputeProfile.from_json({"model": self.model, **self.prefill_profile})

    def decode(self) -> DecodeProfile:
        if isinstance(self.decode_profile, str):
            return decode_profile(self.decode_profile)
        return DecodeProfile(**self.decode_profile)


@dataclass(frozen=True)
class PolicySpec:
    """How a prefilled request finds its decode instance, and what the chooser knows.

    mode `placement`: `policy` names a kvrs placement policy (`params` go to it).
    mode `recovery`: `policy` names a kvrs recovery policy, asked as if the request had
    to move off its prefill node (MIGRATE the KV to a decode instance, RECOMPUTE it on
    another prefill instance, HYBRID) — RoM's per-request load balancing.
    `candidates: same_node` keeps the choice on the prefill's node (static intra-node).
    """

    name: str
    policy: str
    mode: str = "placement"
    params: Mapping[str, Any] = field(default_factory=dict)
    network_view: str = "telemetry"
    candidates: str = "all"
    prefill: str = "router"
    """`router`: serving.prefill_router picks the prefill alone; `joint`: the placement
    policy's `choose_prefill` picks it with the decode side in view (cache_aware estimates
    of each prefill's end as input)."""

    def __post_init__(self) -> None:
        if self.prefill not in ("router", "joint"):
            raise InvalidArgument("policy.prefill", "router or joint")
        if self.network_view not in NETWORK_VIEWS:
            raise InvalidArgument("policy.network_view", f"one of {NETWORK_VIEWS}")
        if self.mode not in ("placement", "recovery"):
            raise InvalidArgument("policy.mode", "placement or recovery")
        if self.candidates not in ("all", "same_node"):
            raise InvalidArgument("policy.candidates", "all or same_node")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PolicySpec:
        return _build(cls, d, "policy")


@dataclass(frozen=True)
class FailureSpec:
    """Kill one instance, or every instance of one node, at `at_s`."""

    at_s: float
    instance: str = ""
    node: str = ""

    def __post_init__(self) -> None:
        if bool(self.instance) == bool(self.node):
            raise InvalidArgument("failure", "name exactly one of instance or node")


@dataclass(frozen=True)
class RecoverySpec:
    """How requests on failed instances continue."""

    policy: str = "kvrs"
    planner: str = "batch"  # "batch": plan_batch; "per_request": one by one
    migration_slots: int = 32  # concurrent MIGRATE/HYBRID transfers (RoM README)
    deadline_s: float | None = None  # resume within this long after the failure
    detection_s: float = 0.0  # failure to recovery decision
    network_view: str = "live"
    margins: Mapping[str, float] = field(default_factory=dict)
    """Measured relative error per recovery action (`kvrs.learning.Corrections.margins`,
    e.g. fitted from an earlier run's outcomes): decisions keep MIGRATE unless another
    option beats it by more than its error, and check deadlines against the upper end."""

    def __post_init__(self) -> None:
        for action, margin in self.margins.items():
            if not (isinstance(margin, (int, float)) and 0.0 <= margin < math.inf):
                raise InvalidArgument(f"recovery.margins.{action}", "must be a number >= 0")
        if self.planner not in RECOVERY_PLANNERS:
            raise InvalidArgument("recovery.planner", f"one of {RECOVERY_PLANNERS}")
        if self.network_view not in NETWORK_VIEWS:
            raise InvalidArgument("recovery.network_view", f"one of {NETWORK_VIEWS}")


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated run needs except the requests and the policy."""

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    serving: ServingSpec = field(default_factory=ServingSpec)
    telemetry: TelemetrySpec = field(default_factory=TelemetrySpec)
    background: BackgroundSpec = field(default_factory=BackgroundSpec)
    slo: SloSpec = field(default_factory=SloSpec)
    recovery: RecoverySpec = field(default_factory=RecoverySpec)
    failures: tuple[FailureSpec, ...] = ()
    placement_retry_s: float = 0.05  # wait before retrying when no decode has memory
    seed: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SimConfig:
        return _build(cls, d, "config")

    @classmethod
    def load(cls, path: str | Path) -> SimConfig:
        return cls.from_dict(load_yaml(path) or {})

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def replace(self, **sections: Any) -> SimConfig:
        """A copy with some sections (or fields of sections, as dicts) replaced."""
        changes = {}
        for name, value in sections.items():
            current = getattr(self, name)
            if (
                isinstance(value, Mapping)
                and dataclasses.is_dataclass(current)
                and not isinstance(current, type)
            ):
                value = dataclasses.replace(current, **value)
            changes[name] = value
        return dataclasses.replace(self, **changes)


_NESTED = {
    "cluster": ClusterSpec,
    "serving": ServingSpec,
    "telemetry": TelemetrySpec,
    "background": BackgroundSpec,
    "slo": SloSpec,
    "recovery": RecoverySpec,
}


def _build(cls: type, d: Mapping[str, Any], where: str) -> Any:
    if not isinstance(d, Mapping):
        raise InvalidArgument(where, "must be a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise InvalidArgument(where, f"unknown key(s): {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if cls is SimConfig and key in _NESTED:
            value = _build(_NESTED[key], value, key)
        elif cls is SimConfig and key == "failures":
            value = tuple(
                _build(FailureSpec, item, f"failures[{i}]") for i, item in enumerate(value or ())
            )
        elif isinstance(value, list) and key == "tiers":
            value = tuple(value)
        elif isinstance(value, str) and value in ("inf", "infinity"):
            value = math.inf
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise InvalidArgument(where, str(exc)) from None


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value
