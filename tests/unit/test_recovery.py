"""Recovery decisions: the option formulas, ties, deadlines, infeasible options, baselines."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import FailedPrecondition, InvalidArgument, NotFound
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.profile import ComputeProfile, compute_profile
from kvrs.recovery import (
    NEEDS_SLOT,
    RECOVERY_POLICY_NAMES,
    Action,
    AlwaysMigrate,
    AlwaysRecompute,
    Kvrs,
    RecoveryRequest,
    Rom,
    decide_without_slot,
    hybrid_split,
    kv_tokens_moved,
    make_recovery_policy,
)
from kvrs.topology import InstanceSpec, Location, Role, Tier, TierSpec, Topology

MODEL = model_spec("opt-13b")
PROFILE = compute_profile("opt-13b")
TABLE_PROFILE = ComputeProfile.fit(
    "opt-13b", [(n, PROFILE.fit_s(n) * 1.05) for n in (64, 256, 1024, 4096, 16384)]
)


def two_node_cluster(
    gbps: float, profile: ComputeProfile = PROFILE, rtt_s: float = 0.0
) -> CostModel:
    """p0 and d0 on node n0; p1 and d1 on node n1, same rack; rack links at `gbps`."""
    tiers = {tier: TierSpec(capacity_bps=gbps * 1e9, hop_latency_s=0.0) for tier in Tier}
    tiers[Tier.NODE] = TierSpec(capacity_bps=3600e9, hop_latency_s=0.0)
    topology = Topology(tiers, setup_latency_s=rtt_s)
    for node in (0, 1):
        topology.add_instance(InstanceSpec(f"p{node}", Role.PREFILL, Location(f"n{node}", "r0")))
        topology.add_instance(
            InstanceSpec(f"d{node}", Role.DECODE, Location(f"n{node}", "r0", gpu_index=1))
        )
    return CostModel(MODEL, profile, NetworkModel(topology))


def view_of(**waits: float) -> ClusterView:
    states = {}
    for name in ("p0", "p1", "d0", "d1"):
        role = Role.PREFILL if name.startswith("p") else Role.DECODE
        states[name] = InstanceState(name, role, wait_s=waits.get(name, 0.0))
    return ClusterView(states, now_s=0.0)


def option(decision, action):
    return next(o for o in decision.options if o.action is action)


def test_option_formulas() -> None:
    cost = two_node_cluster(25.0, rtt_s=1e-3)
    view = view_of(d0=0.3, d1=0.2, p0=0.05, p1=0.01)
    request = RecoveryRequest("r", 1477, 30, "p0", exclude_ids=frozenset({"d0"}))
    decision = Kvrs().decide(request, view, cost, 0.0)
    migrate = option(decision, Action.MIGRATE)
    assert migrate.target_id == "d1" and migrate.source_id == "p0"
    transfer = cost.transfer("p0", "d1", 1477, 0.0).transfer_s
    assert transfer == pytest.approx(1e-3 + 0.387, abs=1e-3)
    assert migrate.cost_s == pytest.approx(0.2 + transfer + PROFILE.extend_s(1477, 30))
    recompute = option(decision, Action.RECOMPUTE)
    # p1 sits next to d1 (NVLink) and waits less: the cheapest recompute.
    assert (recompute.source_id, recompute.target_id) == ("p1", "d1")
    # RECOMPUTE's final extend waits behind the target's queue, W(d1) = 0.2.
    assert recompute.cost_s == pytest.approx(
        0.01 + PROFILE.prefill_s(1507) + cost.transfer("p1", "d1", 1507, 0.0).transfer_s + 0.2
    )
    assert recompute.target_wait_s == 0.2
    hybrid = option(decision, Action.HYBRID)
    k = hybrid.split_tokens
    assert 0 < k < 1477
    assert hybrid.cost_s == pytest.approx(
        0.2
        + max(PROFILE.prefill_s(k), cost.transfer("p0", "d1", 1477 - k, 0.0).transfer_s)
        + PROFILE.extend_s(1477, 30)
    )
    assert decision.cost_s == min(o.cost_s for o in decision.options)
    assert decision.slack_s == float("inf")
    assert decision.runner_up is not None and decision.runner_up.action is not decision.action


def test_tie_goes_to_migrate() -> None:
    cost = two_node_cluster(100.0)
    # p0 -> d0 over NVLink: moving 2000 tokens is faster than any prefill, so the best
    # HYBRID split is k = 0, a tie with MIGRATE.
    request = RecoveryRequest("r", 2000, 0, "p0", exclude_ids=frozenset({"d1"}))
    migrate_transfer = cost.transfer("p0", "d0", 2000, 0.0).transfer_s
    # Recompute on p0 costs W(p0) + T_pf(L) + the same transfer + W(d0): never a tie.
    view = view_of(d0=1.0, p1=5.0)
    decision = Kvrs().decide(request, view, cost, 0.0)
    assert option(decision, Action.RECOMPUTE).cost_s == pytest.approx(
        option(decision, Action.MIGRATE).cost_s + PROFILE.prefill_s(2000), abs=1e-12
    )
    assert option(decision, Action.HYBRID).cost_s == option(decision, Action.MIGRATE).cost_s
    assert decision.action is Action.MIGRATE
    assert decision.cost_s == pytest.approx(1.0 + migrate_transfer)


def test_abort_when_cheapest_misses_deadline() -> None:
    cost = two_node_cluster(25.0)
    view = view_of()
    loose = RecoveryRequest("r", 1477, 10, "p0", deadline_s=100.0)
    decision = Kvrs().decide(loose, view, cost, 0.0)
    assert decision.action is not Action.ABORT
    assert decision.slack_s == pytest.approx(100.0 - decision.cost_s)
    tight = RecoveryRequest("r", 1477, 10, "p0", deadline_s=10.0 + decision.cost_s / 2)
    aborted = Kvrs().decide(tight, view, cost, 10.0)
    assert aborted.action is Action.ABORT
    assert aborted.slack_s == pytest.approx(-decision.cost_s / 2)
    assert aborted.runner_up is not None and aborted.runner_up.cost_s == decision.cost_s
    assert aborted.target_id == ""
    # The baselines never abort.
    assert Rom().decide(tight, view, cost, 10.0).action is not Action.ABORT


@settings(max_examples=150, deadline=None)
@given(
    prompt_tokens=st.integers(1, 100_000),
    gbps=st.floats(0.1, 800.0),
    rtt_ms=st.floats(0.0, 5.0),
    generated=st.integers(0, 500),
    tabled=st.booleans(),
)
def test_hybrid_never_worse_than_migrate_or_recompute(
    prompt_tokens: int,
    gbps: float,
    rtt_ms: float,
    generated: int,
    tabled: bool,
) -> None:
    profile = TABLE_PROFILE if tabled else PROFILE
    cost = two_node_cluster(gbps, profile, rtt_s=rtt_ms * 1e-3)
    k, term = hybrid_split(cost, "p0", "d1", prompt_tokens, 0.0)
    migrate_all = cost.transfer("p0", "d1", prompt_tokens, 0.0).transfer_s
    # Even k = L pulls one token (PullKv moves at least one): its set-up is paid.
    one_token = cost.transfer("p0", "d1", 1, 0.0).transfer_s
    recompute_all = max(profile.prefill_s(prompt_tokens), one_token)
    assert 0 <= k <= prompt_tokens
    assert term <= min(migrate_all, recompute_all) + 1e-12
    moved = cost.transfer("p0", "d1", max(1, prompt_tokens - k), 0.0).transfer_s
    assert term == pytest.approx(max(profile.prefill_s(k), moved))
    # The decision: HYBRID to a target never costs more than MIGRATE to it, and the
    # chosen option is the cheapest of all.
    request = RecoveryRequest("r", prompt_tokens, generated, "p0", exclude_ids=frozenset({"d0"}))
    decision = Kvrs().decide(request, view_of(), cost, 0.0)
    hybrid, migrate = option(decision, Action.HYBRID), option(decision, Action.MIGRATE)
    recompute = option(decision, Action.RECOMPUTE)
    assert hybrid.cost_s <= migrate.cost_s
    assert decision.cost_s <= min(migrate.cost_s, recompute.cost_s) + 1e-9
    if decision.action is Action.HYBRID:
        assert hybrid.cost_s < min(migrate.cost_s, recompute.cost_s)


@pytest.mark.parametrize("profile", [PROFILE, TABLE_PROFILE], ids=["fit", "table"])
def test_split_is_optimal_by_brute_force(profile: ComputeProfile) -> None:
    for gbps in (1.0, 10.0, 50.0):
        cost = two_node_cluster(gbps, profile, rtt_s=1e-3)
        for prompt_tokens in (1, 7, 300, 1477):
            k, term = hybrid_split(cost, "p0", "d1", prompt_tokens, 0.0)
            best = min(
                max(
                    profile.prefill_s(j),
                    cost.transfer("p0", "d1", prompt_tokens - j, 0.0).transfer_s,
                )
                for j in range(prompt_tokens + 1)
            )
            assert term == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("profile", [PROFILE, TABLE_PROFILE], ids=["fit", "table"])
def test_a_path_too_slow_for_one_token_prices_hybrid_as_a_full_recompute(
    profile: ComputeProfile,
) -> None:
    cost = two_node_cluster(1e-309, profile)
    k, term = hybrid_split(cost, "p0", "d1", 1477, 0.0)
    assert (k, term) == (1477, profile.prefill_s(1477))
    request = RecoveryRequest("r", 1477, 3, "p0", exclude_ids=frozenset({"d0"}))
    decision = Kvrs().decide(request, view_of(), cost, 0.0)
    assert decision.action is not Action.MIGRATE
    assert all(o.cost_s == o.cost_s for o in decision.options), "no NaN cost"


def test_slow_network_makes_hybrid_win() -> None:
    cost = two_node_cluster(5.0)
    request = RecoveryRequest("r", 8000, 0, "p0", exclude_ids=frozenset({"d0"}))
    decision = Kvrs().decide(request, view_of(p0=10.0, p1=10.0), cost, 0.0)
    assert decision.action is Action.HYBRID
    assert 0 < decision.split_tokens < 8000
    assert decision.source_id == "p0" and decision.target_id == "d1"


@pytest.mark.parametrize("blocker", ["kv_lost", "no_slot", "source_dead"])
def test_migration_impossible_falls_back_to_recompute(blocker: str) -> None:
    cost = two_node_cluster(400.0)
    view = view_of()
    # p0 -> d0 runs over NVLink: MIGRATE wins outright while it is possible.
    request = RecoveryRequest("r", 1477, 10, "p0", exclude_ids=frozenset({"d1"}))
    assert Kvrs().decide(request, view, cost, 0.0).action is Action.MIGRATE
    if blocker == "kv_lost":
        request = replace(request, source_kv_available=False)
    if blocker == "source_dead":
        view = ClusterView(
            {**view.instances, "p0": InstanceState("p0", Role.PREFILL, alive=False)}, 0.0
        )
    for policy in (Kvrs(), Rom(), AlwaysMigrate()):
        decision = policy.decide(request, view, cost, 0.0, migration_slot_free=blocker != "no_slot")
        assert decision.action is Action.RECOMPUTE, policy.name
        if blocker == "source_dead":
            assert decision.source_id == "p1"
        migrate = option(decision, Action.MIGRATE)
        assert not migrate.feasible
        assert migrate.infeasible_reason in ("source KV lost", "no migration slot")


def test_no_feasible_option_aborts() -> None:
    cost = two_node_cluster(25.0)
    view = ClusterView(
        {
            "p0": InstanceState("p0", Role.PREFILL, alive=False),
            "d1": InstanceState("d1", Role.DECODE),
        },
        0.0,
    )
    request = RecoveryRequest("r", 100, 0, "p0", source_kv_available=False)
    for name in RECOVERY_POLICY_NAMES:
        decision = make_recovery_policy(name).decide(request, view, cost, 0.0)
        assert decision.action is Action.ABORT, name
        assert "no feasible option" in decision.reason


def test_targets_need_free_memory_for_prompt_and_generated() -> None:
    cost = two_node_cluster(25.0)
    states = dict(view_of().instances)
    states["d0"] = InstanceState("d0", Role.DECODE, free_kv_tokens=1009)
    states["d1"] = InstanceState("d1", Role.DECODE, wait_s=3.0, free_kv_tokens=1010)
    request = RecoveryRequest("r", 1000, 10, "p0")
    decision = Kvrs().decide(request, ClusterView(states, 0.0), cost, 0.0)
    assert decision.target_id == "d1"
    states["d1"] = InstanceState("d1", Role.DECODE, free_kv_tokens=5)
    decision = Kvrs().decide(request, ClusterView(states, 0.0), cost, 0.0)
    assert decision.action is Action.ABORT
    assert "free KV memory" in decision.reason


def test_rom_rule_and_target() -> None:
    view = view_of(d0=0.5, d1=0.1)
    request = RecoveryRequest("r", 1477, 10, "p0")
    fast = Rom().decide(request, view, two_node_cluster(400.0), 0.0)
    assert fast.action is Action.MIGRATE and fast.target_id == "d1"
    # 8·S(L)/B at 0.1 Gbit/s is ~97 s, far above T_pf(1477).
    slow = Rom().decide(request, view, two_node_cluster(0.1), 0.0)
    assert slow.action is Action.RECOMPUTE and slow.target_id == "d1"
    assert {o.action for o in slow.options} == {Action.MIGRATE, Action.RECOMPUTE}


def test_forced_modes() -> None:
    cost = two_node_cluster(0.1)
    request = RecoveryRequest("r", 1477, 10, "p0")
    assert AlwaysMigrate().decide(request, view_of(), cost, 0.0).action is Action.MIGRATE
    fast = two_node_cluster(400.0)
    assert AlwaysRecompute().decide(request, view_of(), fast, 0.0).action is Action.RECOMPUTE
    no_prefill = ClusterView({"d1": InstanceState("d1", Role.DECODE)}, 0.0)
    decision = AlwaysRecompute().decide(request, no_prefill, fast, 0.0)
    assert decision.action is Action.MIGRATE


def test_extra_wait_and_flows_shift_the_choice() -> None:
    cost = two_node_cluster(25.0)
    request = RecoveryRequest("r", 1477, 0, "p0")
    alone = Kvrs().decide(request, view_of(d1=0.001), cost, 0.0)
    assert alone.target_id == "d0"
    busy = Kvrs().decide(request, view_of(d1=0.001), cost, 0.0, extra_wait_s={"d0": 5.0})
    assert busy.target_id == "d1"
    flows = {("node-up", "n0"): 3}
    shared = Kvrs().decide(
        request, view_of(), cost, 0.0, extra_flows=flows, extra_wait_s={"d0": 5.0}
    )
    assert option(shared, Action.MIGRATE).transfer_s == pytest.approx(
        4 * option(busy, Action.MIGRATE).transfer_s
    )


def test_bad_inputs_name_the_field() -> None:
    for kwargs, field in (
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"generated_tokens": -2}, "generated_tokens"),
        ({"source_prefill_id": ""}, "source_prefill_id"),
    ):
        args = {
            "request_id": "r",
            "prompt_tokens": 10,
            "generated_tokens": 0,
            "source_prefill_id": "p0",
            **kwargs,
        }
        with pytest.raises(InvalidArgument) as info:
            RecoveryRequest(**args)
        assert info.value.field == field
    with pytest.raises(InvalidArgument) as info:
        make_recovery_policy("coinflip")
    assert info.value.field == "policy"
    cost = two_node_cluster(25.0)
    with pytest.raises(NotFound) as not_found:
        Kvrs().decide(RecoveryRequest("r", 10, 0, "ghost"), view_of(), cost, 0.0)
    assert not_found.value.field == "instance_id"
    with pytest.raises(FailedPrecondition):
        Kvrs().decide(
            RecoveryRequest("r", 10, 0, "p0", exclude_ids=frozenset({"d0", "d1"})),
            view_of(),
            cost,
            0.0,
        )
    with pytest.raises(InvalidArgument):
        hybrid_split(cost, "p0", "d1", -1, 0.0)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    model=st.sampled_from(["opt-13b", "tiny"]),
    prompt_tokens=st.integers(1, 20_000),
    planned=st.booleans(),
)
def test_pruned_search_finds_the_exhaustive_optimum(
    seed: int,
    model: str,
    prompt_tokens: int,
    planned: bool,
) -> None:
    rng = random.Random(seed)
    topology = Topology.fat_tree(
        nodes=4,
        gpus_per_node=4,
        nodes_per_rack=2,
        racks_per_pod=1,
        setup_latency_s=rng.choice([0.0, 5e-3]),
    )
    cost = CostModel(model_spec(model), compute_profile(model), NetworkModel(topology))
    cost.network.set_flows({("node-up", "n0"): rng.randrange(4), ("rack-up", "r1"): 2})
    states = {
        i: InstanceState(i, spec.role, wait_s=rng.uniform(0.0, 0.3))
        for i, spec in topology.instances.items()
    }
    view = ClusterView(states, 0.0)
    flows = {("node-down", "n1"): rng.randrange(1, 5)} if planned else None
    waits = {"decode-1": 0.1, "prefill-2": 0.2} if planned else None
    request = RecoveryRequest("r", prompt_tokens, rng.randrange(0, 64), "prefill-0")
    decision = Kvrs().decide(request, view, cost, 0.0, extra_flows=flows, extra_wait_s=waits)

    def wait(instance_id: str) -> float:
        return states[instance_id].wait_s + (waits or {}).get(instance_id, 0.0)

    ext_s = cost.extend_s(prompt_tokens, request.generated_tokens)
    decodes = [i for i, s in topology.instances.items() if s.role is Role.DECODE]
    prefills = [i for i, s in topology.instances.items() if s.role is Role.PREFILL]
    migrate = min(
        wait(d) + cost.transfer("prefill-0", d, prompt_tokens, 0.0, flows).transfer_s + ext_s
        for d in decodes
    )
    hybrid = min(
        wait(d) + hybrid_split(cost, "prefill-0", d, prompt_tokens, 0.0, flows)[1] + ext_s
        for d in decodes
    )
    tokens = prompt_tokens + request.generated_tokens
    recompute = min(
        wait(p)
        + cost.prefill_s(tokens)
        + cost.transfer(p, d, tokens, 0.0, flows).transfer_s
        + wait(d)
        for p in prefills
        for d in decodes
    )
    assert option(decision, Action.MIGRATE).cost_s == pytest.approx(migrate, rel=1e-9)
    assert option(decision, Action.HYBRID).cost_s == pytest.approx(hybrid, rel=1e-9)
    assert option(decision, Action.RECOMPUTE).cost_s == pytest.approx(recompute, rel=1e-9)


def test_without_a_slot_the_policy_decides_again_and_says_why() -> None:
    cost = two_node_cluster(400.0)
    request = RecoveryRequest("r", 1477, 10, "p0", exclude_ids=frozenset({"d1"}))
    assert Kvrs().decide(request, view_of(), cost, 0.0).action in NEEDS_SLOT
    fallback = decide_without_slot(Kvrs(), request, view_of(), cost, 0.0, "no migration slot free")
    assert fallback.action is Action.RECOMPUTE
    assert fallback.reason.startswith("no migration slot free; ")
    assert not option(fallback, Action.MIGRATE).feasible


@pytest.mark.parametrize(
    ("action", "split", "moved"),
    [
        (Action.MIGRATE, 0, 1000),
        (Action.HYBRID, 300, 700),
        (Action.HYBRID, -5, 1000),
        (Action.HYBRID, 1200, 0),
        (Action.RECOMPUTE, 0, 1017),
        (Action.ABORT, 0, 0),
    ],
)
def test_kv_tokens_moved_by_each_action(action: Action, split: int, moved: int) -> None:
    assert kv_tokens_moved(action, 1000, 17, split) == moved


def test_migrate_and_hybrid_send_only_what_the_target_does_not_hold() -> None:
    """A target already holding the prompt's leading blocks is sent only the rest:
    MIGRATE moves S(L − h), HYBRID splits what is left, and the holder wins."""
    cost = two_node_cluster(25.0, rtt_s=1e-3)
    block = MODEL.block_tokens
    prompt_tokens = 4 * block + 100
    hashes = (11, 12, 13, 14, 15)
    states = {
        name: InstanceState(name, Role.PREFILL if name.startswith("p") else Role.DECODE)
        for name in ("p0", "p1", "d0", "d1")
    }
    # d0 sits on p0's node (NVLink): without resident blocks it is the cheapest target.
    # d1 holds the first three blocks.
    states["d1"] = InstanceState("d1", Role.DECODE, resident_blocks=frozenset({11, 12, 13, 99}))
    view = ClusterView(states, now_s=0.0)
    request = RecoveryRequest("r", prompt_tokens, 8, "p1", prefix_hashes=hashes)
    decision = AlwaysMigrate().decide(request, view, cost, 0.0)
    held = 3 * block
    assert (decision.target_id, decision.split_tokens) == ("d1", held)
    moved = kv_tokens_moved(Action.MIGRATE, prompt_tokens, 8, decision.split_tokens)
    assert moved == prompt_tokens - held
    transfer = cost.transfer("p1", "d1", moved, 0.0).transfer_s
    assert option(decision, Action.MIGRATE).transfer_s == pytest.approx(transfer)
    # Without the hashes the same target is priced for the whole prompt.
    blind = AlwaysMigrate().decide(replace(request, prefix_hashes=()), view, cost, 0.0)
    assert blind.split_tokens == 0
    assert blind.cost_s > decision.cost_s
    # HYBRID splits only the rest: k ≥ h, and never recomputes a held block.
    on_d1 = replace(request, exclude_ids=frozenset({"d0"}))
    hybrid = option(Kvrs().decide(on_d1, view, cost, 0.0), Action.HYBRID)
    assert hybrid.target_id == "d1" and hybrid.split_tokens >= held
    k = hybrid.split_tokens - held
    assert hybrid.compute_s == pytest.approx(
        PROFILE.prefill_s(k) + PROFILE.extend_s(prompt_tokens, 8)
    )
    blind_hybrid = option(
        Kvrs().decide(replace(on_d1, prefix_hashes=()), view, cost, 0.0), Action.HYBRID
    )
    assert hybrid.cost_s < blind_hybrid.cost_s
    # A holder never shortens a pull to nothing: at least one token moves.
    whole = RecoveryRequest("w", 3 * block, 8, "p1", prefix_hashes=hashes[:3])
    assert AlwaysMigrate().decide(whole, view, cost, 0.0).split_tokens == 2 * block
