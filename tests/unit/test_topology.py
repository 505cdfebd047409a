"""Topology: tiers and directional paths from YAML and from the fat-tree generator."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvrs.errors import InvalidArgument, NotFound
from kvrs.topology import InstanceSpec, Location, Role, Tier, Topology

YAML = textwrap.dedent("""
    setup_latency_ms: 1.0
    tiers:
      node:  {capacity_gbps: 3600, hop_latency_us: 0}
      rack:  {capacity_gbps: 400,  hop_latency_us: 2}
      pod:   {capacity_gbps: 400,  hop_latency_us: 2}
      spine: {capacity_gbps: 200,  hop_latency_us: 2}
    nodes:
      - {name: n0, rack: r0, pod: p0}
      - {name: n1, rack: r0, pod: p0}
      - {name: n2, rack: r1, pod: p0}
      - {name: n3, rack: r2, pod: p1}
    links:
      - {kind: node-up, name: n1, capacity_gbps: 100}
    instances:
      - {id: prefill-0, role: prefill, node: n0, gpu_index: 0}
      - {id: decode-0,  role: decode,  node: n0, gpu_index: 1}
      - {id: decode-1,  role: decode,  node: n1}
      - {id: decode-2,  role: decode,  node: n2}
      - {id: decode-3,  role: decode,  node: n3}
""")


@pytest.fixture
def topology(tmp_path: Path) -> Topology:
    path = tmp_path / "topology.yaml"
    path.write_text(YAML)
    return Topology.from_yaml(path)


def test_tiers_from_yaml(topology: Topology) -> None:
    assert topology.tier("prefill-0", "decode-0") is Tier.NODE
    assert topology.tier("prefill-0", "decode-1") is Tier.RACK
    assert topology.tier("prefill-0", "decode-2") is Tier.POD
    assert topology.tier("prefill-0", "decode-3") is Tier.SPINE
    assert topology.tiers[Tier.SPINE].capacity_bps == 200e9
    assert topology.setup_latency_s == pytest.approx(1e-3)


def test_paths_from_yaml(topology: Topology) -> None:
    assert topology.path_links("prefill-0", "decode-0") == (("nvlink", "n0"),)
    assert topology.path_links("prefill-0", "decode-1") == (("node-up", "n0"), ("node-down", "n1"))
    assert topology.path_links("prefill-0", "decode-2") == (
        ("node-up", "n0"),
        ("rack-up", "r0"),
        ("rack-down", "r1"),
        ("node-down", "n2"),
    )
    assert topology.path_links("prefill-0", "decode-3") == (
        ("node-up", "n0"),
        ("rack-up", "r0"),
        ("pod-up", "p0"),
        ("pod-down", "p1"),
        ("rack-down", "r2"),
        ("node-down", "n3"),
    )
    assert topology.path_links("decode-1", "prefill-0") == (("node-up", "n1"), ("node-down", "n0"))


def test_capacities_and_overrides(topology: Topology) -> None:
    assert topology.link_capacity_bps(("nvlink", "n0")) == 3600e9
    assert topology.link_capacity_bps(("node-up", "n0")) == 400e9
    assert topology.link_capacity_bps(("node-up", "n1")) == 100e9
    assert topology.link_capacity_bps(("pod-down", "p1")) == 200e9
    with pytest.raises(NotFound):
        topology.link_capacity_bps(("warp", "x"))


def test_rtt_grows_with_tier(topology: Topology) -> None:
    node = topology.base_rtt_s("prefill-0", "decode-0")
    rack = topology.base_rtt_s("prefill-0", "decode-1")
    spine = topology.base_rtt_s("prefill-0", "decode-3")
    assert node == pytest.approx(1e-3)
    assert rack == pytest.approx(1e-3 + 2 * 2 * 2e-6)
    assert spine == pytest.approx(1e-3 + 2 * 6 * 2e-6)
    assert topology.base_rtt_s("decode-0", "decode-0") == 0.0


def test_runtime_instance_takes_rack_from_its_node(topology: Topology) -> None:
    topology.add_instance(InstanceSpec("decode-9", Role.DECODE, Location("n2")))
    assert topology.instance("decode-9").location.rack == "r1"
    assert topology.tier("decode-2", "decode-9") is Tier.NODE
    assert topology.tier("prefill-0", "decode-9") is Tier.POD


def test_copy_keeps_paths_and_diverges_independently(topology: Topology) -> None:
    paths = {
        (s, d): topology.path_links(s, d) for s in topology.instances for d in topology.instances
    }
    twin = topology.copy()
    assert {pair: twin.path_links(*pair) for pair in paths} == paths
    assert (twin.version, twin.paths_version) == (topology.version, topology.paths_version)
    twin.set_link_capacity(("node-up", "n0"), 1e9)
    twin.add_instance(InstanceSpec("decode-9", Role.DECODE, Location("n2")))
    assert topology.link_capacity_bps(("node-up", "n0")) == 400e9
    assert "decode-9" not in topology.instances
    assert twin.tier("prefill-0", "decode-9") is Tier.POD


def test_empty_rack_is_its_own() -> None:
    topology = Topology()
    topology.add_instance(InstanceSpec("a", Role.PREFILL, Location("x")))
    topology.add_instance(InstanceSpec("b", Role.DECODE, Location("y")))
    topology.add_instance(InstanceSpec("c", Role.DECODE, Location("x")))
    assert topology.tier("a", "b") is Tier.SPINE
    assert topology.tier("a", "c") is Tier.NODE


def test_fat_tree_generator() -> None:
    topology = Topology.fat_tree(nodes=16, gpus_per_node=4, nodes_per_rack=4, racks_per_pod=2)
    assert len(topology.instances) == 64
    roles = [spec.role for spec in topology.instances.values()]
    assert roles.count(Role.PREFILL) == roles.count(Role.DECODE) == 32
    assert topology.tier("prefill-0", "decode-0") is Tier.NODE
    assert topology.tier("prefill-0", "decode-2") is Tier.RACK
    assert topology.tier("prefill-0", "decode-8") is Tier.POD
    assert topology.tier("prefill-0", "decode-16") is Tier.SPINE


def test_unknown_instance_is_not_found(topology: Topology) -> None:
    with pytest.raises(NotFound) as info:
        topology.tier("prefill-0", "ghost")
    assert info.value.field == "instance_id"
    assert "ghost" in str(info.value)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"tiers": {"rack": {"capacity_gbps": "fast"}}}, "tiers.rack.capacity_gbps"),
        ({"tiers": {"moon": {"capacity_gbps": 1}}}, "tiers.moon"),
        ({"instances": [{"id": "x", "role": "router", "node": "n0"}]}, "instances[0].role"),
        ({"instances": [{"id": "x", "role": "decode"}]}, "instances[0].node"),
        (
            {"nodes": [{"name": "n0"}], "instances": [{"id": "x", "role": "decode", "node": "n9"}]},
            "instances[0].node",
        ),
    ],
)
def test_bad_yaml_names_the_field(patch: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        Topology.from_dict(patch)
    assert info.value.field == field


def test_demo_topology_file_loads() -> None:
    path = Path(__file__).resolve().parents[2] / "deploy" / "topology.yaml"
    topology = Topology.from_yaml(path)
    assert set(topology.instances) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert topology.tier("prefill-0", "decode-0") is Tier.NODE
    assert topology.tier("prefill-0", "decode-1") is Tier.RACK
