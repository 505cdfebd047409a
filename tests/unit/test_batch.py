"""Batch recovery planning: shared links, shared queues, slots, least slack first."""

from __future__ import annotations

import pytest

from kvrs.batch import plan_batch
from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.profile import compute_profile
from kvrs.recovery import Action, Kvrs, RecoveryRequest, make_recovery_policy
from kvrs.topology import Topology

MODEL = model_spec("opt-13b")


def cluster(nodes: int = 4) -> tuple[CostModel, ClusterView]:
    """`nodes` nodes in two racks; each node one prefill and one decode instance."""
    topology = Topology.fat_tree(
        nodes=nodes, gpus_per_node=2, nodes_per_rack=nodes // 2, racks_per_pod=1
    )
    cost = CostModel(MODEL, compute_profile("opt-13b"), NetworkModel(topology))
    states = {i: InstanceState(i, spec.role) for i, spec in topology.instances.items()}
    return cost, ClusterView(states, now_s=0.0)


def requests(n: int, prompt_tokens: int = 8000, **kwargs) -> list[RecoveryRequest]:
    return [
        RecoveryRequest(
            f"r{i}", prompt_tokens, 16, "prefill-0", exclude_ids=frozenset({"decode-0"}), **kwargs
        )
        for i in range(n)
    ]


def chosen(decision):
    return next(
        o
        for o in decision.options
        if o.action is decision.action and o.target_id == decision.target_id
    )


def test_plan_never_promises_a_shared_link_at_full_speed() -> None:
    cost, view = cluster()
    plan = plan_batch(requests(6), view, cost, 0.0, Kvrs(), migration_slots_free=32)
    topology = cost.network.topology
    users: dict = {}
    for decision in plan.decisions:
        if decision.action in (Action.MIGRATE, Action.HYBRID, Action.RECOMPUTE):
            for link in topology.path_links(decision.source_id, decision.target_id):
                users[link] = users.get(link, 0) + 1
    shared = {link: n for link, n in users.items() if n > 1}
    assert shared, "six transfers out of one prefill node must share its uplink"
    for decision in plan.decisions:
        option = chosen(decision)
        path = topology.path_links(decision.source_id, decision.target_id)
        if option.transfer_s == 0.0 or not path:
            continue
        tokens = 8000 - decision.split_tokens if decision.action is not Action.RECOMPUTE else 8016
        rtt_s = cost.network.rate_and_rtt(decision.source_id, decision.target_id, 0.0)[1]
        implied_bps = 8 * MODEL.kv_bytes(tokens) / (option.transfer_s - rtt_s)
        for link in path:
            assert implied_bps <= topology.link_capacity_bps(link) / users[link] * (1 + 1e-9)


def test_isolated_decisions_would_overpromise() -> None:
    cost, view = cluster()
    alone = [Kvrs().decide(r, view, cost, 0.0) for r in requests(6)]
    plan = plan_batch(requests(6), view, cost, 0.0, Kvrs(), migration_slots_free=32)
    # Deciding alone, every request expects the idle network; the plan knows better.
    assert plan.makespan_s > max(d.cost_s for d in alone)


def test_slots_bound_migrations() -> None:
    cost, view = cluster()
    plan = plan_batch(requests(8), view, cost, 0.0, Kvrs(), migration_slots_free=2)
    moving = [d for d in plan.decisions if d.action in (Action.MIGRATE, Action.HYBRID)]
    assert len(moving) <= 2
    assert sum(d.action is Action.RECOMPUTE for d in plan.decisions) >= 6
    none = plan_batch(requests(3), view, cost, 0.0, Kvrs(), migration_slots_free=0)
    assert all(d.action is Action.RECOMPUTE for d in none.decisions)


def test_work_is_spread_over_instances() -> None:
    cost, view = cluster(8)
    plan = plan_batch(requests(12), view, cost, 0.0, Kvrs(), migration_slots_free=32)
    targets = {d.target_id for d in plan.decisions}
    assert len(targets) > 1
    # Later decisions see the work already queued: their waits are not all zero.
    assert any(chosen(d).wait_s > 0.0 for d in plan.decisions)


def test_least_slack_first_gets_the_best_option() -> None:
    cost, view = cluster()
    relaxed = requests(3, deadline_s=1000.0)
    urgent = RecoveryRequest(
        "urgent", 8000, 16, "prefill-0", exclude_ids=frozenset({"decode-0"}), deadline_s=5.0
    )
    plan = plan_batch([*relaxed, urgent], view, cost, 0.0, Kvrs(), migration_slots_free=1)
    by_id = {d.request_id: d for d in plan.decisions}
    assert [d.request_id for d in plan.decisions] == ["r0", "r1", "r2", "urgent"]
    assert by_id["urgent"].action in (Action.MIGRATE, Action.HYBRID)
    assert by_id["urgent"].cost_s <= min(d.cost_s for d in plan.decisions)


def test_every_policy_plans_and_reports_a_makespan() -> None:
    cost, view = cluster()
    for name in ("always_migrate", "always_recompute", "rom", "kvrs"):
        plan = plan_batch(requests(5, 2000), view, cost, 0.0, make_recovery_policy(name), 32)
        assert len(plan.decisions) == 5
        assert plan.makespan_s == pytest.approx(max(d.cost_s for d in plan.decisions))


def test_rom_is_blind_to_the_batch() -> None:
    cost, view = cluster(8)
    plan = plan_batch(requests(6, 2000), view, cost, 0.0, make_recovery_policy("rom"), 32)
    # Every request goes to the same least-waiting decode instance.
    assert len({d.target_id for d in plan.decisions}) == 1


def test_bad_slot_count() -> None:
    cost, view = cluster()
    with pytest.raises(InvalidArgument) as info:
        plan_batch(requests(1), view, cost, 0.0, Kvrs(), migration_slots_free=-1)
    assert info.value.field == "migration_slots_free"


def test_empty_batch() -> None:
    cost, view = cluster()
    plan = plan_batch([], view, cost, 0.0, Kvrs(), migration_slots_free=4)
    assert plan.decisions == () and plan.makespan_s == 0.0


def test_two_migrations_on_one_link_each_get_half_of_it() -> None:
    cost, view = cluster()
    uplink = ("node-up", "n0")
    plan = plan_batch(
        requests(2),
        view,
        cost,
        0.0,
        make_recovery_policy("always_migrate"),
        migration_slots_free=32,
    )
    assert [d.action for d in plan.decisions] == [Action.MIGRATE, Action.MIGRATE]
    topology = cost.network.topology
    for decision in plan.decisions:
        assert uplink in topology.path_links(decision.source_id, decision.target_id)
        rtt_s = topology.base_rtt_s(decision.source_id, decision.target_id)
        implied_bps = 8 * MODEL.kv_bytes(8000) / (chosen(decision).transfer_s - rtt_s)
        assert implied_bps <= topology.link_capacity_bps(uplink) / 2 * (1 + 1e-9)
    # Alone, the same request is promised the whole uplink (its path's bottleneck).
    alone = make_recovery_policy("always_migrate").decide(requests(1)[0], view, cost, 0.0)
    rtt_s = topology.base_rtt_s(alone.source_id, alone.target_id)
    assert 8 * MODEL.kv_bytes(8000) / (chosen(alone).transfer_s - rtt_s) == pytest.approx(
        topology.link_capacity_bps(uplink)
    )


def test_recoveries_sharing_a_target_are_priced_with_the_queue_they_build() -> None:
    """Started together, n recoveries on one target share it: each transfer ends after
    Σ_j min(x_j, x_i) of their times alone (fixed cost and stream, side by side), or its
    share of the links, whichever is longer, and the extends join one batched pass; none
    is priced as if it ran alone, and the sharing is not counted twice."""
    cost, view = cluster(nodes=2)
    # One target left: every recovery lands on decode-1.
    items = [
        RecoveryRequest(
            f"r{i}", 4000 + 500 * i, 16, "prefill-0", exclude_ids=frozenset({"decode-0"})
        )
        for i in range(5)
    ]
    policy = make_recovery_policy("always_migrate")
    alone = plan_batch(items[:1], view, cost, 0.0, policy, 32)
    plan = plan_batch(items, view, cost, 0.0, policy, 32)
    assert {d.target_id for d in plan.decisions} == {"decode-1"}
    moved = [chosen(d).transfer_s for d in plan.decisions]
    solo = [chosen(plan_batch([r], view, cost, 0.0, policy, 32).decisions[0]) for r in items]
    _, fixed_s = cost.network.rate_and_rtt("prefill-0", "decode-1", 0.0)
    # Alone on the path: the set-up and the stream with no other flow.
    alone_s = [option.transfer_s for option in solo]
    assert all(x > fixed_s for x in alone_s)
    extends_s = cost.compute.batch_s([(r.prompt_tokens, r.generated_tokens) for r in items])
    for i, decision in enumerate(plan.decisions):
        side_by_side_s = sum(min(x, alone_s[i]) for x in alone_s)
        transfers_s = max(moved[i], side_by_side_s)
        # The links' share alone already stretches every transfer; summing the stretched
        # times on top would price the same sharing twice.
        assert transfers_s < sum(min(x, moved[i]) for x in moved)
        assert decision.planned_jobs == 5
        assert decision.cost_s == pytest.approx(transfers_s + extends_s)
        own_s = moved[i] + cost.extend_s(items[i].prompt_tokens, 16)
        assert chosen(decision).wait_s == pytest.approx(decision.cost_s - own_s)
        assert decision.cost_s > 4 * alone.decisions[0].cost_s
    # Alone, the same request is priced exactly as the policy priced it.
    single = policy.decide(items[0], view, cost, 0.0)
    assert alone.decisions[0].planned_jobs == 1
    assert alone.decisions[0].cost_s == pytest.approx(single.cost_s)
    assert plan.makespan_s == pytest.approx(max(d.cost_s for d in plan.decisions))


def test_recoveries_on_a_target_with_a_pass_budget_end_pass_by_pass() -> None:
    """A target that reports its token budget per pass runs the plan's extends in
    passes of at most that many tokens, beside its running streams: the recoveries are
    priced to end one pass after another, not all at the end of one pass over all."""
    cost, view = cluster(nodes=2)
    topology = cost.network.topology
    states = {
        i: InstanceState(i, spec.role, wait_s=0.05, running_requests=3, max_batch_tokens=2048)
        for i, spec in topology.instances.items()
    }
    items = [
        RecoveryRequest(f"r{i}", 64, 1100, "prefill-0", exclude_ids=frozenset({"decode-0"}))
        for i in range(4)
    ]
    policy = make_recovery_policy("always_migrate")
    plan = plan_batch(items, ClusterView(states, now_s=0.0), cost, 0.0, policy, 32)
    assert {d.target_id for d in plan.decisions} == {"decode-1"}
    # The four KVs land together; decode-1's loop then takes 2,045 new tokens a pass
    # (three of its 2,048 go to its running streams): 1,100 + 945, then 155 + 1,100 +
    # 790, then 310.
    streams = [(0, 1)] * 3
    passes_s = [
        cost.compute.pass_s(streams + p)
        for p in (
            [(64, 1100), (64, 945)],
            [(1009, 155), (64, 1100), (64, 790)],
            [(854, 310)],
        )
    ]
    first, second, third, fourth = sorted(d.cost_s for d in plan.decisions)
    assert first >= 0.05 + passes_s[0]
    assert second == pytest.approx(first + passes_s[1])
    assert third == second
    assert fourth == pytest.approx(second + passes_s[2])
    assert plan.makespan_s == fourth
    # Without a reported budget the same recoveries are priced as one pass over all four.
    flat = plan_batch(items, view, cost, 0.0, policy, 32)
    assert len({d.cost_s for d in flat.decisions}) == 1


def test_a_target_whose_passes_run_slower_than_its_profile_is_priced_at_its_pace() -> None:
    """A worker reports how many times longer than the profile its recent passes ran
    (a loaded host, other processes on its cores): the plan prices that target's passes
    at that pace, not at the quiet machine's."""
    cost, _ = cluster(nodes=2)
    topology = cost.network.topology
    items = [
        RecoveryRequest(f"r{i}", 64, 1100, "prefill-0", exclude_ids=frozenset({"decode-0"}))
        for i in range(2)
    ]
    policy = make_recovery_policy("always_migrate")
    ends = {}
    for pace in (1.0, 3.0):
        states = {
            i: InstanceState(i, spec.role, max_batch_tokens=4096, compute_factor=pace)
            for i, spec in topology.instances.items()
        }
        plan = plan_batch(items, ClusterView(states, now_s=0.0), cost, 0.0, policy, 32)
        ends[pace] = max(d.cost_s for d in plan.decisions)
    # Both extends land together and share one pass.
    pass_s = cost.compute.pass_s([(64, 1100), (64, 1100)])
    assert ends[3.0] - ends[1.0] == pytest.approx(2 * pass_s)


def test_set_ups_of_recoveries_started_together_share_their_target() -> None:
    """Eight small recoveries onto one target whose path has a large fixed cost: the
    target drives each pull's calls and receive itself, so their set-ups share it like
    their streams (n pulls started together take about n times one alone), instead of
    each paying one set-up as if it had the target to itself."""
    cost, view = cluster(nodes=2)
    fixed_s = 0.05
    cost.network.set_unmeasured_rtt(fixed_s)
    items = [
        RecoveryRequest(f"r{i}", 64, 0, "prefill-0", exclude_ids=frozenset({"decode-0"}))
        for i in range(8)
    ]
    policy = make_recovery_policy("always_migrate")
    plan = plan_batch(items, view, cost, 0.0, policy, 32)
    alone = plan_batch(items[:1], view, cost, 0.0, policy, 32).decisions[0]
    transfer_s = chosen(alone).transfer_s
    assert transfer_s >= fixed_s
    for decision in plan.decisions:
        assert decision.target_id == "decode-1"
        assert decision.cost_s >= alone.cost_s + 7 * transfer_s - 1e-9


def test_hybrid_prefixes_are_recomputed_in_their_targets_passes() -> None:
    """A worker recomputes a HYBRID's prefix as a forward job on its own queue, queued as
    the pull starts: on a target that reports its pass budget the prefixes of a batch
    share its passes behind the work queued there, and each extend follows both its
    prefix and its transfer."""
    cost, _ = cluster(nodes=2)
    topology = cost.network.topology
    states = {
        i: InstanceState(i, spec.role, wait_s=0.3, max_batch_tokens=8192)
        for i, spec in topology.instances.items()
    }
    view = ClusterView(states, now_s=0.0)
    items = [
        RecoveryRequest(f"r{i}", 4000, 16, "prefill-0", exclude_ids=frozenset({"decode-0"}))
        for i in range(2)
    ]
    plan = plan_batch(items, view, cost, 0.0, Kvrs(), 32)
    assert [d.action for d in plan.decisions] == [Action.HYBRID, Action.HYBRID]
    splits = [d.split_tokens for d in plan.decisions]
    # Both prefixes in one pass (the budget holds them), after the 0.3 s queued there.
    prefixes_end_s = 0.3 + cost.compute.pass_s([(0, k) for k in splits])
    transfers_s = [chosen(d).transfer_s for d in plan.decisions]
    ready_s = [max(prefixes_end_s, t) for t in transfers_s]
    for decision, ready in zip(plan.decisions, ready_s, strict=True):
        assert decision.cost_s >= ready + cost.compute.pass_s([(4000, 16)]) - 1e-12
    # Both extends ready at the prefixes' end (longer than either transfer here): one pass.
    assert max(transfers_s) < prefixes_end_s
    both_s = prefixes_end_s + cost.compute.pass_s([(4000, 16), (4000, 16)])
    assert [d.cost_s for d in plan.decisions] == [pytest.approx(both_s)] * 2
