"""Decode placement: netkv against brute force, the baselines, memory and tie rules."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrs._columns import Columns
from kvrs.cluster import ClusterView, InstanceList, InstanceState
from kvrs.costmodel import CostModel, prefix_hit_tokens, streamed_tail_s
from kvrs.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.placement import (
    NUMPY_MIN_CANDIDATES,
    PLACEMENT_POLICY_NAMES,
    CacheLoad,
    NetKv,
    PlacementRequest,
    RoundRobin,
    make_placement_policy,
    score_candidates,
)
from kvrs.profile import compute_profile
from kvrs.topology import InstanceSpec, Location, Role, Tier, TierSpec, Topology

MODEL = model_spec("opt-13b")


def cost_model(topology: Topology) -> CostModel:
    return CostModel(MODEL, compute_profile("opt-13b"), NetworkModel(topology))


def uniform_tiers(gbps: float) -> dict[Tier, TierSpec]:
    return {tier: TierSpec(capacity_bps=gbps * 1e9, hop_latency_s=0.0) for tier in Tier}


def near_far_topology() -> Topology:
    """p on n0; 'near' on n1 in the same rack; 'far' on n2 in another pod; all links 100G."""
    topology = Topology(uniform_tiers(100.0), setup_latency_s=0.0)
    topology.add_instance(InstanceSpec("p", Role.PREFILL, Location("n0", "r0", "p0")))
    topology.add_instance(InstanceSpec("near", Role.DECODE, Location("n1", "r0", "p0")))
    topology.add_instance(InstanceSpec("far", Role.DECODE, Location("n2", "r5", "p5")))
    return topology


def brute_force_netkv(request, candidates, cost, now_s):
    best = None
    for state in candidates:
        hit = prefix_hit_tokens(
            request.prefix_hashes, state.resident_blocks, MODEL.block_tokens, request.prompt_tokens
        )
        need = request.prompt_tokens - hit
        if state.free_kv_tokens < need:
            continue
        transfer = cost.transfer(request.prefill_id, state.instance_id, need, now_s)
        key = (
            transfer.transfer_s + state.wait_s,
            transfer.tier,
            state.running_requests,
            state.instance_id,
        )
        if best is None or key < best:
            best = key
    return best


def test_netkv_prefers_near_instance_when_far_path_is_congested() -> None:
    cost = cost_model(near_far_topology())
    candidates = InstanceList(
        [
            InstanceState("near", Role.DECODE, wait_s=0.010),
            InstanceState("far", Role.DECODE, wait_s=0.005),
        ]
    )
    request = PlacementRequest("r1", "p", prompt_tokens=4096)
    # Idle network: equal bandwidth everywhere, so the shorter queue wins.
    assert NetKv().select(request, candidates, cost, 0.0).instance_id == "far"
    # Three transfers already climb out of rack r0: the far path gets a quarter of 100G.
    cost.network.set_flows({("rack-up", "r0"): 3})
    placement = NetKv().select(request, candidates, cost, 0.0)
    assert placement.instance_id == "near"
    assert placement.runner_up is not None and placement.runner_up.instance_id == "far"
    assert placement.runner_up.score_s > placement.predicted_ttft_s
    # The network-blind router does not notice.
    assert CacheLoad().select(request, candidates, cost, 0.0).instance_id == "far"


def test_placement_reports_netkv_terms() -> None:
    cost = cost_model(near_far_topology())
    candidates = [InstanceState("near", Role.DECODE, wait_s=0.25)]
    request = PlacementRequest("r1", "p", prompt_tokens=1477)
    for name in PLACEMENT_POLICY_NAMES:
        placement = make_placement_policy(name).select(request, candidates, cost, 0.0)
        assert placement.policy == name
        assert placement.kv_bytes == MODEL.kv_bytes(1477)
        assert placement.transfer.transfer_s == pytest.approx(8 * MODEL.kv_bytes(1477) / 100e9)
        assert placement.predicted_ttft_s == pytest.approx(placement.transfer.transfer_s + 0.25)
        assert placement.candidates_considered == 1


@pytest.mark.parametrize("policy", ["netkv", "kvrs"])
@pytest.mark.parametrize("candidates_count", [2, NUMPY_MIN_CANDIDATES + 2])
def test_a_transfer_streamed_under_the_prefill_counts_only_its_tail(
    policy: str, candidates_count: int
) -> None:
    """The far path is four times slower: after the prefill its transfer costs more than
    the near instance's longer queue, but streamed under a long prefill it is mostly
    hidden, and the idle far instance wins."""
    tiers = uniform_tiers(100.0)
    for tier in (Tier.POD, Tier.SPINE):
        tiers[tier] = TierSpec(capacity_bps=25e9, hop_latency_s=0.0)
    topology = Topology(tiers, setup_latency_s=0.0)
    topology.add_instance(InstanceSpec("p", Role.PREFILL, Location("n0", "r0", "p0")))
    topology.add_instance(InstanceSpec("near", Role.DECODE, Location("n1", "r0", "p0")))
    topology.add_instance(InstanceSpec("far", Role.DECODE, Location("n2", "r5", "p5")))
    fillers = [
        InstanceState(f"full-{i}", Role.DECODE, free_kv_tokens=0)
        for i in range(candidates_count - 2)
    ]
    for state in fillers:
        topology.add_instance(
            InstanceSpec(state.instance_id, Role.DECODE, Location("n1", "r0", "p0"))
        )
    cost = cost_model(topology)
    candidates = InstanceList(
        [
            InstanceState("near", Role.DECODE, wait_s=0.050),
            InstanceState("far", Role.DECODE, wait_s=0.005),
            *fillers,
        ]
    )
    after = PlacementRequest("r1", "p", prompt_tokens=4096)
    streamed = PlacementRequest("r1", "p", prompt_tokens=4096, stream_prefill_s=2.0)
    chosen = make_placement_policy(policy).select(after, candidates, cost, 0.0)
    assert chosen.instance_id == "near" and not chosen.streamed
    chosen = make_placement_policy(policy).select(streamed, candidates, cost, 0.0)
    assert chosen.instance_id == "far" and chosen.streamed
    tail_s = streamed_tail_s(chosen.transfer.transfer_s, 2.0, MODEL.layers)
    assert tail_s == pytest.approx(chosen.transfer.transfer_s / MODEL.layers)
    assert chosen.predicted_ttft_s == pytest.approx(tail_s + 0.005)
    best = score_candidates(streamed, candidates, cost, 0.0)[0]
    assert (best.instance_id, best.transfer_s) == ("far", pytest.approx(tail_s))


@settings(max_examples=60, deadline=None)
@given(
    waits=st.lists(st.integers(0, 50), min_size=2, max_size=12),
    hit_blocks=st.lists(st.integers(0, 4), min_size=12, max_size=12),
    prompt_blocks=st.integers(1, 8),
    gbps=st.sampled_from([1.0, 25.0, 400.0]),
)
def test_netkv_picks_the_same_as_cache_load_when_all_paths_are_equal(
    waits: list[int],
    hit_blocks: list[int],
    prompt_blocks: int,
    gbps: float,
) -> None:
    topology = Topology(uniform_tiers(gbps), setup_latency_s=0.0)
    topology.add_instance(InstanceSpec("p", Role.PREFILL, Location("np", "rp", "pp")))
    hashes = tuple(range(100, 100 + prompt_blocks))
    candidates = []
    for i, wait in enumerate(waits):
        topology.add_instance(InstanceSpec(f"d{i}", Role.DECODE, Location(f"n{i}", f"r{i}")))
        resident = frozenset(hashes[: hit_blocks[i]])
        candidates.append(
            InstanceState(f"d{i}", Role.DECODE, wait_s=wait * 0.01, resident_blocks=resident)
        )
    cost = cost_model(topology)
    prompt_tokens = prompt_blocks * MODEL.block_tokens
    request = PlacementRequest("r", "p", prompt_tokens, hashes)
    netkv = NetKv().select(request, candidates, cost, 0.0)
    # Network-blind, without prefixes: the queue decides for both.
    blind = CacheLoad().select(PlacementRequest("r", "p", prompt_tokens), candidates, cost, 0.0)
    assert (
        blind.instance_id
        == NetKv()
        .select(PlacementRequest("r", "p", prompt_tokens), candidates, cost, 0.0)
        .instance_id
    )
    # Tuned to the (uniform) network, cache_load ranks exactly as netkv.
    tuned = CacheLoad(cache_weight=8 * MODEL.kv_bytes(prompt_tokens) / (gbps * 1e9))
    assert tuned.select(request, candidates, cost, 0.0).instance_id == netkv.instance_id


@pytest.mark.parametrize("n", [NUMPY_MIN_CANDIDATES - 12, NUMPY_MIN_CANDIDATES + 300])
def test_netkv_matches_brute_force(n: int) -> None:
    rng = random.Random(n)
    topology = Topology.fat_tree(
        nodes=n // 2 + 1, gpus_per_node=4, nodes_per_rack=4, racks_per_pod=4
    )
    cost = cost_model(topology)
    cost.network.set_flows({("rack-up", "r0"): 2, ("node-down", "n5"): 7, ("pod-down", "p1"): 1})
    decode_ids = sorted(i for i, s in topology.instances.items() if s.role is Role.DECODE)[:n]
    hashes = tuple(rng.getrandbits(60) for _ in range(6))
    states = {
        d: InstanceState(
            d,
            Role.DECODE,
            wait_s=rng.choice([0.0, 0.01, 0.02, 0.5]),
            running_requests=rng.randrange(4),
            free_kv_tokens=rng.choice([10**6, 10**6, 1000]),
            resident_blocks=frozenset(hashes[: rng.choice([0, 0, 1, 3, 6])]),
        )
        for d in decode_ids
    }
    view = ClusterView(states, now_s=0.0)
    for prompt_tokens in (0, 700, 3000):
        for prefill in ("prefill-0", "prefill-9"):
            request = PlacementRequest("r", prefill, prompt_tokens, hashes)
            placement = NetKv().select(request, view.decode_instances(), cost, 0.0)
            expected = brute_force_netkv(request, view.decode_instances(), cost, 0.0)
            assert placement.instance_id == expected[3]
            assert placement.predicted_ttft_s == pytest.approx(expected[0])
            # The cached columns answer the same as a fresh plain list.
            again = NetKv().select(request, list(view.decode_instances()), cost, 0.0)
            assert again.instance_id == placement.instance_id


def test_ties_go_to_lower_tier_then_fewer_running_then_id() -> None:
    topology = Topology(uniform_tiers(100.0), setup_latency_s=0.0)
    topology.add_instance(InstanceSpec("p", Role.PREFILL, Location("n0", "r0", "p0")))
    topology.add_instance(InstanceSpec("b-rack", Role.DECODE, Location("n1", "r0", "p0")))
    topology.add_instance(InstanceSpec("a-pod", Role.DECODE, Location("n2", "r1", "p0")))
    topology.add_instance(InstanceSpec("c-rack", Role.DECODE, Location("n3", "r0", "p0")))
    cost = cost_model(topology)
    request = PlacementRequest("r", "p", 1000)
    candidates = [
        InstanceState("a-pod", Role.DECODE),
        InstanceState("b-rack", Role.DECODE, running_requests=2),
        InstanceState("c-rack", Role.DECODE, running_requests=1),
    ]
    placement = NetKv().select(request, candidates, cost, 0.0)
    assert placement.instance_id == "c-rack"
    assert placement.runner_up is not None and placement.runner_up.instance_id == "b-rack"
    even = [InstanceState("c-rack", Role.DECODE), InstanceState("b-rack", Role.DECODE)]
    assert NetKv().select(request, even, cost, 0.0).instance_id == "b-rack"


def test_prefix_hits_shrink_the_transfer() -> None:
    cost = cost_model(near_far_topology())
    hashes = (11, 22, 33)
    candidates = [
        InstanceState("near", Role.DECODE, wait_s=0.001),
        InstanceState("far", Role.DECODE, resident_blocks=frozenset({11, 22})),
    ]
    request = PlacementRequest("r", "p", 3 * 512, hashes)
    placement = NetKv().select(request, candidates, cost, 0.0)
    assert placement.instance_id == "far"
    assert placement.prefix_hit_tokens == 1024
    assert placement.kv_bytes == MODEL.kv_bytes(512)
    full = [InstanceState("near", Role.DECODE, wait_s=0.001, resident_blocks=frozenset(hashes))]
    assert NetKv().select(request, full, cost, 0.0).predicted_ttft_s == pytest.approx(0.001)


def test_memory_skips_and_exhaustion() -> None:
    cost = cost_model(near_far_topology())
    request = PlacementRequest("r", "p", 2000)
    candidates = [
        InstanceState("near", Role.DECODE, free_kv_tokens=1999),
        InstanceState("far", Role.DECODE, wait_s=9.0, free_kv_tokens=2000),
    ]
    for name in PLACEMENT_POLICY_NAMES:
        policy = make_placement_policy(name)
        assert policy.select(request, candidates, cost, 0.0).instance_id == "far"
        with pytest.raises(ResourceExhausted):
            policy.select(request, candidates[:1], cost, 0.0)
        with pytest.raises(FailedPrecondition):
            policy.select(request, [], cost, 0.0)


def test_round_robin_cycles_and_least_loaded_counts_requests() -> None:
    cost = cost_model(near_far_topology())
    request = PlacementRequest("r", "p", 10)
    candidates = [
        InstanceState("near", Role.DECODE, queue_depth=3),
        InstanceState("far", Role.DECODE, running_requests=1, wait_s=5.0),
    ]
    policy = RoundRobin()
    assert [policy.select(request, candidates, cost, 0.0).instance_id for _ in range(3)] == [
        "near",
        "far",
        "near",
    ]
    least = make_placement_policy("least_loaded").select(request, candidates, cost, 0.0)
    assert least.instance_id == "far"


def test_score_candidates_lists_feasible_best_first() -> None:
    cost = cost_model(near_far_topology())
    candidates = [InstanceState("near", Role.DECODE, wait_s=0.5), InstanceState("far", Role.DECODE)]
    scores = score_candidates(PlacementRequest("r", "p", 100), candidates, cost, 0.0)
    assert [s.instance_id for s in scores] == ["far", "near"]
    assert scores[1].score_s == pytest.approx(scores[1].transfer_s + 0.5)


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(InvalidArgument) as info:
        PlacementRequest("r", "p", -1)
    assert info.value.field == "prompt_tokens"
    with pytest.raises(InvalidArgument) as info:
        make_placement_policy("random")
    assert info.value.field == "policy"
    with pytest.raises(InvalidArgument) as info:
        make_placement_policy("netkv", bogus=1)
    assert info.value.field == "policy"
    cost = cost_model(near_far_topology())
    with pytest.raises(NotFound) as info:
        NetKv().select(
            PlacementRequest("r", "ghost", 10), [InstanceState("near", Role.DECODE)], cost, 0.0
        )
    assert info.value.field == "instance_id"
    with pytest.raises(NotFound):
        NetKv().select(
            PlacementRequest("r", "p", 10), [InstanceState("ghost", Role.DECODE)], cost, 0.0
        )


def test_columns_follow_network_changes() -> None:
    cost = cost_model(near_far_topology())
    view = ClusterView(
        {
            "near": InstanceState("near", Role.DECODE, wait_s=0.010),
            "far": InstanceState("far", Role.DECODE, wait_s=0.005),
        },
        now_s=0.0,
    )
    request = PlacementRequest("r", "p", 4096)
    assert NetKv().select(request, view.decode_instances(), cost, 0.0).instance_id == "far"
    cost.network.set_flows({("rack-up", "r0"): 3})
    assert NetKv().select(request, view.decode_instances(), cost, 0.0).instance_id == "near"
    cost.network.set_flows({})
    assert NetKv().select(request, view.decode_instances(), cost, 0.0).instance_id == "far"


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(st.frozensets(st.integers(0, 7), max_size=8), min_size=1, max_size=6),
    prefix=st.lists(st.integers(0, 7), min_size=1, max_size=10),
    prompt_tokens=st.integers(1, 10 * 512),
)
def test_prefix_hits_of_columns_match_prefix_hit_tokens(blocks, prefix, prompt_tokens) -> None:
    """Narrowing level by level, and reading on through the last holder's own blocks,
    finds each instance's leading hit as a scan of its blocks does."""
    states = InstanceList(
        InstanceState(f"d{i}", Role.DECODE, resident_blocks=held) for i, held in enumerate(blocks)
    )
    expected = {
        i: hit
        for i, state in enumerate(states)
        if (hit := prefix_hit_tokens(tuple(prefix), state.resident_blocks, 512, prompt_tokens))
    }
    columns = Columns.of(states)
    assert columns.hits(tuple(prefix), prompt_tokens, 512) == expected
    assert columns.hits(tuple(prefix), prompt_tokens, 512) == expected  # from the caches
