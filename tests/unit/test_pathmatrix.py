"""Pricing every pair at once agrees with pricing each pair alone, under planned flows."""

from __future__ import annotations

import random

import pytest

from kvrs._pathmatrix import FlowPlan, PathMatrix
from kvrs.estimator import LinkEstimate
from kvrs.network import NetworkModel
from kvrs.topology import Role, Topology


def test_matrix_matches_per_pair_rates() -> None:
    rng = random.Random(3)
    topology = Topology.fat_tree(nodes=8, gpus_per_node=4, nodes_per_rack=2, racks_per_pod=2)
    network = NetworkModel(topology)
    prefills = sorted(i for i, s in topology.instances.items() if s.role is Role.PREFILL)
    decodes = sorted(i for i, s in topology.instances.items() if s.role is Role.DECODE)
    network.set_link_estimate(prefills[0], decodes[5], LinkEstimate(30e9, 1e-4, 0.0, 3))
    network.set_flows({("rack-up", "r0"): 2, ("nvlink", "n3"): 1})
    matrix = PathMatrix(network, prefills, decodes, now_s=1.0)
    plan = FlowPlan()
    for _ in range(12):
        plan.add_path(topology.path_links(rng.choice(prefills), rng.choice(decodes)))
        bps = matrix.bandwidth_bps(plan)
        from_dict = matrix.bandwidth_bps(dict(plan))
        for i, src in enumerate(prefills):
            for j, dst in enumerate(decodes):
                expected, rtt_s = network.rate_and_rtt(src, dst, 1.0, plan)
                assert bps[i, j] == pytest.approx(expected)
                assert from_dict[i, j] == pytest.approx(expected)
                assert matrix.rtt_s[i, j] == rtt_s
    assert matrix.valid(network, 1.0)
    network.set_flows({})
    assert not matrix.valid(network, 1.0)


def test_flow_plan_grows_only_through_add_path() -> None:
    plan = FlowPlan()
    plan.add_path([("node-up", "n0"), ("node-down", "n1")])
    plan.add_path([("node-up", "n0")])
    assert plan == {("node-up", "n0"): 2, ("node-down", "n1"): 1}
    with pytest.raises(TypeError):
        plan[("node-up", "n0")] = 0
    with pytest.raises(TypeError):
        plan.update({})
