"""Transfer estimates: bottleneck share, EWMA telemetry, staleness and flows on the path."""

from __future__ import annotations

import pytest

from kvrs.errors import InvalidArgument, NotFound
from kvrs.estimator import EwmaEstimator, LinkEstimate, StalenessPolicy
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.topology import DEFAULT_TIERS, InstanceSpec, Location, Role, Tier, TierSpec, Topology

RTT_S = 1e-3


def rack_topology(rack_gbps: float = 25.0) -> Topology:
    tiers = dict(DEFAULT_TIERS)
    tiers[Tier.RACK] = TierSpec(capacity_bps=rack_gbps * 1e9, hop_latency_s=0.0)
    topology = Topology(tiers, setup_latency_s=RTT_S)
    topology.add_instance(InstanceSpec("p", Role.PREFILL, Location("n0", "r0", "p0")))
    topology.add_instance(InstanceSpec("d", Role.DECODE, Location("n1", "r0", "p0")))
    topology.add_instance(InstanceSpec("d2", Role.DECODE, Location("n0", "r0", "p0", 1)))
    return topology


def test_opt13b_1477_tokens_over_25_gbps() -> None:
    network = NetworkModel(rack_topology(25.0))
    kv_bytes = model_spec("opt-13b").kv_bytes(1477)
    estimate = network.transfer("p", "d", kv_bytes, now_s=0.0)
    assert estimate.rtt_s == pytest.approx(RTT_S)
    assert estimate.transfer_s - estimate.rtt_s == pytest.approx(0.387, abs=1e-3)
    assert estimate.tier is Tier.RACK
    assert estimate.bottleneck_bps == 25e9
    assert estimate.telemetry_age_s == -1.0
    assert not estimate.telemetry_stale


def test_same_instance_and_zero_bytes_cost_nothing() -> None:
    network = NetworkModel(rack_topology())
    assert network.transfer("p", "p", 10**9, 0.0).transfer_s == 0.0
    assert network.transfer("p", "d", 0, 0.0).transfer_s == 0.0


def test_nvlink_is_faster_than_the_rack() -> None:
    network = NetworkModel(rack_topology())
    near = network.transfer("p", "d2", 10**9, 0.0)
    far = network.transfer("p", "d", 10**9, 0.0)
    assert near.tier is Tier.NODE and near.transfer_s < far.transfer_s


def test_ewma_first_sample_as_is_then_smooths() -> None:
    ewma = EwmaEstimator(alpha=0.2)
    assert ewma.estimate is None
    first = ewma.update(10e9, 1e-3, now_s=1.0)
    assert first.bandwidth_bps == 10e9 and first.samples == 1
    second = ewma.update(20e9, 3e-3, now_s=2.0)
    assert second.bandwidth_bps == pytest.approx(0.2 * 20e9 + 0.8 * 10e9)
    assert second.rtt_s == pytest.approx(0.2 * 3e-3 + 0.8 * 1e-3)
    assert second.samples == 2 and second.measured_at_s == 2.0
    assert ewma.estimate == second
    with pytest.raises(InvalidArgument) as info:
        ewma.update(-1.0, 0.0, 3.0)
    assert info.value.field == "sample_bps"


def test_staleness_policy() -> None:
    policy = StalenessPolicy(stale_after_s=5.0)
    estimate = LinkEstimate(1e9, 1e-3, measured_at_s=100.0, samples=3)
    assert policy.is_fresh(estimate, 105.0)
    assert not policy.is_fresh(estimate, 105.1)
    assert not policy.is_fresh(None, 0.0)
    assert estimate.age_s(99.0) == 0.0


def test_fresh_measurement_replaces_capacity_until_stale() -> None:
    network = NetworkModel(rack_topology(100.0), StalenessPolicy(stale_after_s=10.0))
    network.set_link_estimate("p", "d", LinkEstimate(5e9, 2e-3, measured_at_s=0.0, samples=4))
    fresh = network.transfer("p", "d", 10**9, now_s=4.0)
    assert fresh.bottleneck_bps == 5e9
    assert fresh.rtt_s == 2e-3
    assert fresh.telemetry_age_s == pytest.approx(4.0)
    assert not fresh.telemetry_stale
    stale = network.transfer("p", "d", 10**9, now_s=11.0)
    assert stale.bottleneck_bps == 100e9
    assert stale.telemetry_stale
    assert stale.telemetry_age_s == pytest.approx(11.0)
    # A measurement of one direction says nothing about the other.
    assert network.transfer("d", "p", 10**9, now_s=4.0).bottleneck_bps == 100e9


def test_flows_on_path_halve_bandwidth() -> None:
    network = NetworkModel(rack_topology(25.0))
    alone = network.transfer("p", "d", 10**9, 0.0)
    network.set_flows({("node-up", "n0"): 1})
    shared = network.transfer("p", "d", 10**9, 0.0)
    assert shared.bottleneck_bps == pytest.approx(alone.bottleneck_bps / 2)
    assert shared.flows_on_path == 1
    assert shared.transfer_s - RTT_S == pytest.approx(2 * (alone.transfer_s - RTT_S))
    # Extra (planned) flows add to the known ones: 1 known + 1 planned -> a third.
    planned = network.transfer("p", "d", 10**9, 0.0, extra_flows={("node-down", "n1"): 2})
    assert planned.bottleneck_bps == pytest.approx(25e9 / 3)
    assert planned.flows_on_path == 2
    # A flow elsewhere does not slow this path.
    network.set_flows({("node-up", "n9"): 5})
    assert network.transfer("p", "d", 10**9, 0.0).bottleneck_bps == 25e9


def test_flows_divide_a_fresh_measurement_too() -> None:
    network = NetworkModel(rack_topology(100.0))
    network.set_link_estimate("p", "d", LinkEstimate(8e9, 1e-3, 0.0, 1))
    network.set_flows({("node-down", "n1"): 1})
    bps, link = network.bandwidth_bps("p", "d", 1.0)
    assert bps == pytest.approx(4e9)
    assert link == ("node-down", "n1")


def test_rate_and_rtt_agrees_with_transfer() -> None:
    network = NetworkModel(rack_topology(25.0))
    network.set_flows({("node-up", "n0"): 3})
    bps, rtt_s = network.rate_and_rtt("p", "d", 0.0, {("node-up", "n0"): 1})
    estimate = network.transfer("p", "d", 10**6, 0.0, {("node-up", "n0"): 1})
    assert bps == estimate.bottleneck_bps == pytest.approx(25e9 / 5)
    assert rtt_s == estimate.rtt_s


def test_unknown_instances_and_bad_bytes() -> None:
    network = NetworkModel(rack_topology())
    with pytest.raises(NotFound) as info:
        network.transfer("p", "ghost", 1, 0.0)
    assert info.value.field == "instance_id"
    with pytest.raises(InvalidArgument) as info:
        network.transfer("p", "d", -1, 0.0)
    assert info.value.field == "kv_bytes"


def test_two_models_never_share_a_version_so_cached_paths_never_mix():
    from kvrs.cluster import ClusterView, InstanceState
    from kvrs.costmodel import CostModel
    from kvrs.estimator import LinkEstimate
    from kvrs.model import model_spec
    from kvrs.network import NetworkModel
    from kvrs.placement import NetKv, PlacementRequest
    from kvrs.profile import compute_profile
    from kvrs.topology import Role

    topology = Topology.fat_tree(nodes=2, gpus_per_node=2, nodes_per_rack=1, racks_per_pod=1)
    prefill, *_ = [i.instance_id for i in topology.instances.values() if i.role is Role.PREFILL]
    decodes = [i.instance_id for i in topology.instances.values() if i.role is Role.DECODE]
    slow, fast = NetworkModel(topology), NetworkModel(topology)
    for decode in decodes:
        slow.set_link_estimate(prefill, decode, LinkEstimate(1e9, 1e-3, 0.0, 1))
        fast.set_link_estimate(prefill, decode, LinkEstimate(1e11, 1e-3, 0.0, 1))
    assert slow.version != fast.version
    view = ClusterView(
        {d: InstanceState(instance_id=d, role=Role.DECODE) for d in decodes}, now_s=0.0
    )
    request = PlacementRequest("r", prefill, prompt_tokens=4096)
    spec = model_spec("llama3-8b")
    picks = [
        NetKv().select(
            request,
            view.decode_instances(),
            CostModel(spec, compute_profile("llama3-8b"), network),
            0.0,
        )
        for network in (slow, fast)
    ]
    assert picks[0].transfer.transfer_s > 50 * picks[1].transfer.transfer_s


def test_a_model_that_carries_paths_prices_fan_outs_as_a_fresh_one() -> None:
    topology = Topology.fat_tree(nodes=4, gpus_per_node=8, nodes_per_rack=2, racks_per_pod=2)
    sources = [i for i, s in topology.instances.items() if s.role is Role.PREFILL]
    sinks = tuple(i for i, s in topology.instances.items() if s.role is Role.DECODE)
    before = NetworkModel(topology)
    for src in sources:
        before.fan_out(src, sinks, 1.0)
    links = {link for dst in sinks for link in topology.path_links(sources[0], dst)}

    def priced(network: NetworkModel) -> list:
        network.set_link_estimate(
            sources[0], sinks[-1], LinkEstimate(5e9, 1e-4, measured_at_s=0.0, samples=3)
        )
        network.set_flows({link: 2 for link in sorted(links)[:3]})
        tables = [network.fan_out(src, sinks, 1.0) for src in sources]
        return [(t.bandwidth_bps, t.rtt_s, t.tiers) for t in tables]

    carrying = NetworkModel(topology)
    carrying.carry_paths(before)
    assert carrying._fan_paths.keys() == before._fan_paths.keys()
    assert priced(carrying) == priced(NetworkModel(topology))


def test_an_unmeasured_path_pays_at_least_the_fixed_cost_measured_ones_show() -> None:
    network = NetworkModel(rack_topology(), StalenessPolicy(stale_after_s=5.0))
    network.set_link_estimate("p", "d2", LinkEstimate(50e9, 2e-4, measured_at_s=0.0, samples=1))
    network.set_unmeasured_rtt(0.02)
    # Never measured: the floor, in the single path and in the fan-out alike.
    assert network.transfer("p", "d", 10**6, now_s=1.0).rtt_s == pytest.approx(0.02)
    table = network.fan_out("p", ("d", "d2", "p"), now_s=1.0)
    assert table.rtt_s[0] == pytest.approx(0.02)
    # Freshly measured: its own fixed cost; once stale, the floor again.
    assert network.transfer("p", "d2", 10**6, now_s=1.0).rtt_s == pytest.approx(2e-4)
    assert table.rtt_s[1] == pytest.approx(2e-4)
    assert network.transfer("p", "d2", 10**6, now_s=10.0).rtt_s == pytest.approx(0.02)
    # Nothing to move to itself.
    assert network.transfer("p", "p", 10**6, now_s=1.0).transfer_s == 0.0
    assert table.rtt_s[2] == 0.0
    with pytest.raises(InvalidArgument, match="rtt_s"):
        network.set_unmeasured_rtt(-1.0)


def test_a_copy_prices_as_its_original_and_changes_without_changing_it() -> None:
    original = NetworkModel(rack_topology(), StalenessPolicy(stale_after_s=5.0))
    original.set_link_estimate("p", "d", LinkEstimate(5e9, 2e-4, measured_at_s=0.0, samples=2))
    original.set_unmeasured_rtt(0.01)
    original.set_flows({link: 1 for link in rack_topology().path_links("p", "d2")})
    before = original.fan_out("p", ("d", "d2"), now_s=1.0)

    copied = original.copy()
    assert copied.version != original.version
    again = copied.fan_out("p", ("d", "d2"), now_s=1.0)
    assert (again.bandwidth_bps, again.rtt_s) == (before.bandwidth_bps, before.rtt_s)

    copied.set_link_estimate("p", "d", LinkEstimate(1e9, 3e-4, measured_at_s=0.5, samples=2))
    copied.set_link_estimate("p", "d2", LinkEstimate(2e9, 3e-4, measured_at_s=0.5, samples=2))
    copied.set_flows({})
    assert copied.transfer("p", "d", 10**6, now_s=1.0).bottleneck_bps == 1e9
    assert original.link_estimate("p", "d").bandwidth_bps == 5e9
    assert original.link_estimate("p", "d2") is None
    assert original.flows and not copied.flows
    after = original.fan_out("p", ("d", "d2"), now_s=1.0)
    assert (after.bandwidth_bps, after.rtt_s) == (before.bandwidth_bps, before.rtt_s)
