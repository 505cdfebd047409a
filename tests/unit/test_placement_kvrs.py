"""The kvrs placement policy and the link trends it reads: sample age against each link's
rate of change, the control plane's own flows and decisions, the decode-load term, and
prefill chosen with the decode side in view."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvrs.cluster import InstanceList, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument
from kvrs.estimator import LinkTrend
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.placement import (
    Kvrs,
    NetKv,
    PlacementRequest,
    as_joint,
    chooses_prefill,
    make_placement_policy,
)
from kvrs.profile import compute_profile
from kvrs.topology import InstanceSpec, Location, Role, Tier, TierSpec, Topology

MODEL = model_spec("opt-13b")
GBPS = 1e9


def fat_tree() -> Topology:
    """p on n0 (rack r0, pod p0); 'near' on n1 in pod p0 (rack r1); 'far' on n2 in pod p1."""
    tiers = {
        Tier.NODE: TierSpec(3600 * GBPS, 0.0),
        Tier.RACK: TierSpec(400 * GBPS, 0.0),
        Tier.POD: TierSpec(200 * GBPS, 0.0),
        Tier.SPINE: TierSpec(100 * GBPS, 0.0),
    }
    topology = Topology(tiers, setup_latency_s=0.0)
    topology.add_instance(InstanceSpec("p", Role.PREFILL, Location("n0", "r0", "p0")))
    topology.add_instance(InstanceSpec("q", Role.PREFILL, Location("n3", "r3", "p1")))
    topology.add_instance(InstanceSpec("near", Role.DECODE, Location("n1", "r1", "p0")))
    topology.add_instance(InstanceSpec("far", Role.DECODE, Location("n2", "r2", "p1")))
    return topology


def decodes(**fields: dict) -> InstanceList:
    return InstanceList(
        [
            InstanceState("near", Role.DECODE, **fields.get("near", {})),
            InstanceState("far", Role.DECODE, **fields.get("far", {})),
        ]
    )


def measured_cost(topology: Topology | None = None) -> CostModel:
    """A cost model whose network has one measurement: a quiet link at its capacity, which
    changes no transfer's price but tells the policy the network is measured at all."""
    topology = topology or fat_tree()
    network = NetworkModel(topology)
    link = topology.path_links("p", "near")[0]
    network.observe_link(link, topology.link_capacity_bps(link), 0.0)
    return CostModel(MODEL, compute_profile("opt-13b"), network)


def link_of(topology: Topology, dst: str, kind: str):
    """The first link of `kind` on the path p -> dst."""
    return next(link for link in topology.path_links("p", dst) if link[0] == kind)


# -- LinkTrend -------------------------------------------------------------------------


def test_a_link_that_never_changes_keeps_its_sample():
    trend = LinkTrend(100 * GBPS)
    for t in range(10):
        trend.observe(40 * GBPS, float(t))
    assert trend.weight(100.0) == 1.0
    assert trend.excess_s_per_bit(100.0) == pytest.approx(1 / (40 * GBPS) - 1 / (100 * GBPS))


def test_a_link_switching_as_often_as_it_is_sampled_falls_back_to_its_mean():
    trend = LinkTrend(100 * GBPS, alpha=0.05)
    rng = np.random.default_rng(0)
    for t in range(400):  # independent ON/OFF at every sample: no correlation at all
        trend.observe((10 if rng.random() < 1 / 3 else 100) * GBPS, float(t))
    assert trend.weight(399.0) < 0.2
    # The mean of inverse capacities: a third of the time at 10 % of capacity costs 4x.
    mean_inv = (1 / 3) / (10 * GBPS) + (2 / 3) / (100 * GBPS)
    assert trend.mean_inv == pytest.approx(mean_inv, rel=0.25)


def test_a_slowly_changing_link_trusts_a_young_sample_more_than_an_old_one():
    trend = LinkTrend(100 * GBPS)
    for t in range(60):  # a square wave with a 20-sample period: consecutive samples agree
        trend.observe((20 if (t // 10) % 2 else 100) * GBPS, float(t))
    young, old = trend.weight(59.2), trend.weight(62.0)
    assert 0.5 < young < 1.0 and old < young
    # Averaged over a long transfer, the sample is worth less than at its start.
    assert trend.weight(59.2, horizon_s=5.0) < young
    with pytest.raises(InvalidArgument, match="nominal_bps"):
        LinkTrend(0.0)


# -- expected transfer cost ------------------------------------------------------------


def test_expected_inverse_adds_each_links_excess_and_counts_known_flows():
    topology = fat_tree()
    network = NetworkModel(topology)
    plain = network.expected_inverse_bps("p", ["near", "far"], 0.0)
    assert plain == pytest.approx([1 / (200 * GBPS), 1 / (100 * GBPS)])
    spine = link_of(topology, "far", "pod-up")
    network.observe_link(spine, 25 * GBPS, 0.0)
    assert network.has_link_trends
    excess = 1 / (25 * GBPS) - 1 / (100 * GBPS)
    assert network.expected_inverse_bps("p", ["far"], 0.5)[0] == pytest.approx(
        1 / (100 * GBPS) + excess
    )
    network.set_flows({spine: 3})
    assert network.expected_inverse_bps("p", ["far"], 0.5)[0] == pytest.approx(
        4 / (100 * GBPS) + 4 * excess
    )


# -- the policy --------------------------------------------------------------------------


def flapping_spine_cost() -> tuple[CostModel, Topology]:
    """The spine links' samples alternate free / 90 % busy, samples unrelated to the next."""
    topology = fat_tree()
    network = NetworkModel(topology)
    cost = CostModel(MODEL, compute_profile("opt-13b"), network)
    rng = np.random.default_rng(1)
    for link in topology.path_links("p", "far"):
        if link[0] in ("pod-up", "pod-down"):
            for t in range(200):
                network.observe_link(link, (10 if rng.random() < 0.5 else 100) * GBPS, t / 10)
            network.observe_link(link, 100 * GBPS, 20.0)  # the last sample looked free
    return cost, topology


def test_kvrs_does_not_chase_a_spine_that_looked_free_in_an_unreliable_sample():
    cost, _ = flapping_spine_cost()
    request = PlacementRequest("r", "p", prompt_tokens=8192)
    # The near decode queues 30 ms more: worth more than the near path's speed-up unless
    # the spine is as slow as its history says, whatever its last sample showed.
    candidates = decodes(near={"wait_s": 0.03})
    placement = Kvrs().select(request, candidates, cost, 20.5)
    assert placement.instance_id == "near"
    assert placement.runner_up is not None and placement.runner_up.instance_id == "far"
    # On an unchanging network the same far decode wins: the queue is all that differs.
    quiet = CostModel(MODEL, compute_profile("opt-13b"), NetworkModel(fat_tree()))
    far = PlacementRequest("r", "p", prompt_tokens=64)
    assert Kvrs().select(far, candidates, quiet, 20.5).instance_id == "far"


def test_kvrs_spreads_kv_beyond_its_band_when_transfers_cost_little_and_not_when_much():
    cost = measured_cost()
    # near holds 300k tokens more than far: 150k beyond the mean, far past the 16k band.
    loaded = decodes(near={"free_kv_tokens": 100_000}, far={"free_kv_tokens": 400_000})
    small = PlacementRequest("r", "p", prompt_tokens=16)
    assert Kvrs().select(small, loaded, cost, 0.0).instance_id == "far"
    assert NetKv().select(small, loaded, cost, 0.0).instance_id == "near"
    big = PlacementRequest("r", "p", prompt_tokens=60_000)  # 2.4 s more across the spine
    assert Kvrs().select(big, loaded, cost, 0.0).instance_id == "near"
    assert Kvrs(kv_penalty_s_per_token=0.0).select(small, loaded, cost, 0.0).instance_id == "near"
    # Within the band the load term is zero: the near, faster path wins.
    close = decodes(near={"free_kv_tokens": 380_000}, far={"free_kv_tokens": 400_000})
    assert Kvrs().select(small, close, cost, 0.0).instance_id == "near"
    assert Kvrs(kv_band_tokens=0).select(small, close, cost, 0.0).instance_id == "far"


def test_without_any_measurement_kvrs_decides_on_the_tier_prior_as_netkv_tiers():
    topology = fat_tree()
    blind = CostModel(MODEL, compute_profile("opt-13b"), NetworkModel(topology))
    loaded = decodes(near={"free_kv_tokens": 100_000}, far={"free_kv_tokens": 400_000})
    small = PlacementRequest("r", "p", prompt_tokens=16)
    assert Kvrs().select(small, loaded, blind, 0.0).instance_id == "near"
    # Its own flows on the near path do not push it across the spine either.
    blind.network.set_flows({link_of(topology, "near", "rack-down"): 5})
    request = PlacementRequest("r", "p", prompt_tokens=8192)
    assert Kvrs().select(request, decodes(), blind, 0.0).instance_id == "near"
    assert measured_cost().network.has_measurements and not blind.network.has_measurements


def test_kvrs_counts_its_own_placements_until_the_view_can_show_them():
    cost = measured_cost()
    even = decodes(near={"free_kv_tokens": 200_000}, far={"free_kv_tokens": 200_000})
    request = PlacementRequest("r", "p", prompt_tokens=5_000)
    policy = Kvrs(kv_penalty_s_per_token=1e-4, kv_band_tokens=0)
    assert policy.select(request, even, cost, 0.0).instance_id == "near"
    # Same view, a moment later: the first placement's 5k tokens are not in it yet.
    assert policy.select(request, even, cost, 0.05).instance_id == "far"
    # Once the view is younger than the decisions, they are its business again.
    assert policy.select(request, even, cost, 1.0).instance_id == "near"


def test_kvrs_chooses_the_prefill_with_the_decode_side_in_view():
    cost = CostModel(MODEL, compute_profile("opt-13b"), NetworkModel(fat_tree()))
    request = PlacementRequest("r", "p", prompt_tokens=8192)
    full_near = decodes(near={"free_kv_tokens": 0})
    policy = Kvrs(joint_margin=0.2)
    # p prefills 10 ms sooner but its only decode with room is across the spine (0.54 s
    # of transfer); q's decode ('far') is in q's own pod (0.27 s). Behind 2 s of prefill
    # that is a 10 % gain, under the margin; behind 50 ms it is 44 %.
    options = [("p", 2.0), ("q", 2.01)]
    assert policy.choose_prefill(request, options, 0, full_near, cost, 0.0) == 0
    assert Kvrs(joint_margin=0.0).choose_prefill(request, options, 0, full_near, cost, 0.0) == 1
    slow_near = [("p", 0.05), ("q", 0.06)]
    assert Kvrs(joint_margin=0.0).choose_prefill(request, slow_near, 0, full_near, cost, 0.0) == 1
    assert policy.choose_prefill(request, slow_near, 0, full_near, cost, 0.0) == 1
    with pytest.raises(InvalidArgument, match="routed"):
        policy.choose_prefill(request, options, 2, full_near, cost, 0.0)


def test_kvrs_chooses_the_prefill_by_the_decode_sides_paths_not_its_queues():
    """A decode queue seen now says nothing of the queue when the prefill ends: near's
    3 s queue does not send the prefill to q, whose path to an idle 'far' looks better
    only by that queue; a full 'near' (no room) does."""
    cost = CostModel(MODEL, compute_profile("opt-13b"), NetworkModel(fat_tree()))
    request = PlacementRequest("r", "p", prompt_tokens=8192)
    policy = Kvrs(joint_margin=0.0)
    options = [("p", 0.05), ("q", 0.06)]
    busy_near = decodes(near={"wait_s": 3.0})
    assert policy.choose_prefill(request, options, 0, busy_near, cost, 0.0) == 0
    full_near = decodes(near={"free_kv_tokens": 0})
    assert policy.choose_prefill(request, options, 0, full_near, cost, 0.0) == 1


def test_kvrs_moves_a_prompt_continuing_a_cached_prefix_next_to_a_decode_instance_with_room():
    """'near' (p's pod) holds 150k tokens of KV beyond the candidates' mean, far past the
    band; 'far' (q's pod) has room. Both prefills end as soon. A prompt whose prefix p holds
    goes to q, whose KV then stays in its pod, rather than loading 'near' further or
    crossing the spine to 'far'. A prompt nothing holds yet stays with the router's p: it
    would seed its family where the decode side has room, and the family follows it."""
    cost = measured_cost()
    request = PlacementRequest("r", "p", prompt_tokens=8192)
    loaded = decodes(near={"free_kv_tokens": 100_000}, far={"free_kv_tokens": 400_000})
    options = [("p", 0.1), ("q", 0.1)]
    held = [4096, 4096]
    assert Kvrs().choose_prefill(request, options, 0, loaded, cost, 0.0, held) == 1
    assert Kvrs().choose_prefill(request, options, 0, loaded, cost, 0.0, [0, 4096]) == 0
    assert Kvrs().choose_prefill(request, options, 0, loaded, cost, 0.0) == 0
    no_load_term = Kvrs(kv_penalty_s_per_token=0.0)
    assert no_load_term.choose_prefill(request, options, 0, loaded, cost, 0.0, held) == 0
    even = decodes(near={"free_kv_tokens": 400_000}, far={"free_kv_tokens": 400_000})
    assert Kvrs().choose_prefill(request, options, 0, even, cost, 0.0, held) == 0
    with pytest.raises(InvalidArgument, match="prefix_hits"):
        Kvrs().choose_prefill(request, options, 0, loaded, cost, 0.0, [4096])


def test_kvrs_parameters_are_checked_and_named():
    assert make_placement_policy("kvrs").name == "kvrs"
    for name, value in (
        ("kv_penalty_s_per_token", -1.0),
        ("view_lag_s", -1.0),
        ("kv_band_tokens", -1),
    ):
        with pytest.raises(InvalidArgument, match=name):
            Kvrs(**{name: value})
    with pytest.raises(InvalidArgument, match="joint_margin"):
        Kvrs(joint_margin=1.0)
    assert math.isfinite(Kvrs().kv_penalty_s_per_token)


def test_the_policy_names_and_objects_that_choose_the_prefill_agree():
    # The router asks by name, the scheduler and the simulator by the policy object.
    for name in ("round_robin", "least_loaded", "cache_load", "netkv", "kvrs"):
        joint = as_joint(make_placement_policy(name)) is not None
        assert chooses_prefill(name) is joint, name
    assert chooses_prefill("kvrs") and not chooses_prefill("netkv")
    assert not chooses_prefill("no-such-policy")
