"""ClusterView.updated: a refreshed view decides exactly as one built from scratch."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvrs._columns import Columns
from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.estimator import LinkEstimate
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.placement import HIT_ARRAY_MIN_CANDIDATES, NetKv, PlacementRequest, prepare_candidates
from kvrs.profile import compute_profile
from kvrs.recovery import Kvrs, RecoveryRequest
from kvrs.topology import Role, Topology

PREFIX = (11, 12, 13, 14)


def cluster(rng: random.Random, nodes: int = 16) -> tuple[CostModel, ClusterView]:
    topology = Topology.fat_tree(nodes=nodes, gpus_per_node=8, nodes_per_rack=4, racks_per_pod=2)
    network = NetworkModel(topology)
    cost = CostModel(model_spec("opt-13b"), compute_profile("opt-13b"), network)
    states = {
        instance_id: InstanceState(
            instance_id,
            spec.role,
            wait_s=rng.uniform(0, 0.2),
            queue_depth=rng.randrange(4),
            running_requests=rng.randrange(8),
            free_kv_tokens=rng.choice([3_000, 200_000]),
            resident_blocks=frozenset(PREFIX[: rng.choice([0, 1, 2, 4])]),
        )
        for instance_id, spec in topology.instances.items()
    }
    decodes = [i for i, s in states.items() if s.role is Role.DECODE]
    network.set_link_estimate(
        "prefill-0", decodes[3], LinkEstimate(80e9, 2e-5, measured_at_s=0.0, samples=5)
    )
    return cost, ClusterView(states, now_s=1.0)


def decisions(view: ClusterView, cost: CostModel) -> list:
    request = PlacementRequest("r", "prefill-0", 2048, PREFIX)
    placed = [
        NetKv().select(request, view.decode_instances(), cost, 1.0).instance_id,
        NetKv().select(replace(request, prefix_hashes=()), view.decode_instances(), cost, 1.0),
    ]
    failed = view.decode_instances()[0].instance_id
    recover = RecoveryRequest(
        "r", 1477, 64, "prefill-1", deadline_s=10.0, exclude_ids=frozenset({failed})
    )
    return [*placed, Kvrs().decide(recover, view, cost, 1.0)]


def warm(view: ClusterView, cost: CostModel) -> None:
    """Decide once so that the lists carry their columns, fans and prefix caches."""
    decisions(view, cost)


def changes(view: ClusterView, rng: random.Random, count: int) -> dict[str, InstanceState]:
    picked = rng.sample(sorted(view.instances), count)
    return {
        instance_id: replace(
            view.instances[instance_id],
            wait_s=rng.uniform(0, 0.5),
            running_requests=rng.randrange(8),
            free_kv_tokens=rng.choice([1_000, 300_000]),
            resident_blocks=frozenset(PREFIX[: rng.choice([0, 3])]),
        )
        for instance_id in picked
    }


@pytest.mark.parametrize("carry_exclusions", [False, True])
def test_an_updated_view_decides_as_a_view_built_from_scratch(carry_exclusions):
    rng = random.Random(7)
    cost, view = cluster(rng)
    for _ in range(5):
        warm(view, cost)
        changed = changes(view, rng, 9)
        updated = view.updated(changed, now_s=1.0, carry_exclusions=carry_exclusions)
        scratch = ClusterView({**view.instances, **changed}, now_s=1.0)
        assert decisions(updated, cost) == decisions(scratch, cost)
        view = updated


def test_unchanged_membership_carries_the_columns_patched():
    rng = random.Random(3)
    cost, view = cluster(rng)
    warm(view, cost)
    old = Columns.of(view.decode_instances())
    target = view.decode_instances()[5]
    changed = {target.instance_id: replace(target, wait_s=9.0, free_kv_tokens=7)}
    updated = view.updated(changed)
    columns = updated.decode_instances().derived[Columns]
    assert columns is not old, "carried over, patched: not rebuilt, not shared"
    assert columns.wait[5] == 9.0 and old.wait[5] == target.wait_s
    assert columns.min_free == 7
    assert columns.ids is old.ids
    fresh = Columns(updated.decode_instances())
    for name in ("wait", "running", "load", "free", "min_free", "has_resident"):
        assert getattr(columns, name) == getattr(fresh, name), name
    fan = columns.fan(cost.network, "prefill-0", 1.0)
    assert fan.table is old.fan(cost.network, "prefill-0", 1.0).table, "path terms kept"
    assert fan.rtt_wait == fresh.fan(cost.network, "prefill-0", 1.0).rtt_wait


def test_a_booking_carries_the_lists_without_a_failed_instance_patched_too():
    # Every recovery of a failed instance decides on the lists that exclude it; work booked
    # on a target between two of them must not make the next rebuild its path terms.
    rng = random.Random(4)
    cost, view = cluster(rng)
    warm(view, cost)
    failed = view.decode_instances()[0]
    excluded = frozenset({failed.instance_id})
    old = Columns.of(view.decode_instances(excluded))
    target = view.decode_instances(excluded)[3]
    refreshed = view.updated({target.instance_id: replace(target, wait_s=9.0)})
    assert Columns not in refreshed.decode_instances(excluded).derived, "a refresh drops them"
    updated = view.updated({target.instance_id: replace(target, wait_s=9.0)}, carry_exclusions=True)
    columns = updated.decode_instances(excluded).derived[Columns]
    assert columns is not old and columns.wait[3] == 9.0 and columns.ids is old.ids
    fan = columns.fan(cost.network, "prefill-1", 1.0)
    assert fan.table is old.fan(cost.network, "prefill-1", 1.0).table, "path terms kept"
    # A change to the excluded instance alone leaves the list as it was.
    again = updated.updated(
        {failed.instance_id: replace(failed, wait_s=5.0)}, carry_exclusions=True
    )
    assert again.decode_instances(excluded) is updated.decode_instances(excluded)
    # One that joins an exclusion list's role rebuilds it.
    joined = again.updated(
        {"decode-new": InstanceState("decode-new", Role.DECODE)}, carry_exclusions=True
    )
    assert "decode-new" in {s.instance_id for s in joined.decode_instances(excluded)}


def test_a_membership_change_rebuilds_the_list():
    rng = random.Random(5)
    cost, view = cluster(rng)
    warm(view, cost)
    gone = view.decode_instances()[2]
    updated = view.updated({gone.instance_id: replace(gone, alive=False)})
    assert gone.instance_id not in {s.instance_id for s in updated.decode_instances()}
    assert Columns not in updated.decode_instances().derived
    assert updated.prefill_instances() is view.prefill_instances(), "no prefill changed"
    joined = InstanceState("decode-new", Role.DECODE, wait_s=0.0)
    grown = updated.updated({"decode-new": joined})
    assert "decode-new" in {s.instance_id for s in grown.decode_instances()}
    shrunk = grown.updated({}, removed=["decode-new"])
    assert "decode-new" not in shrunk.instances
    assert "decode-new" not in {s.instance_id for s in shrunk.decode_instances()}


def test_prepared_views_decide_as_unprepared_ones():
    # 64 decode candidates find prefix hits with sets, 640 with boolean arrays.
    for nodes in (16, 160):
        rng = random.Random(11)
        cost, view = cluster(rng, nodes)
        assert (len(view.decode_instances()) >= HIT_ARRAY_MIN_CANDIDATES) == (nodes == 160)
        prepare_candidates(view)
        warm(view, cost)
        for _ in range(4):
            changed = changes(view, rng, nodes // 2)
            updated = view.updated(changed, now_s=1.0)
            prepare_candidates(updated, view)
            # A full listing of the same instances, replacing the updated view.
            relisted = ClusterView({**view.instances, **changed}, now_s=1.0)
            prepare_candidates(relisted, updated)
            expected = decisions(ClusterView({**view.instances, **changed}, now_s=1.0), cost)
            assert decisions(updated, cost) == expected
            assert decisions(relisted, cost) == expected
            view = updated


def test_a_relisted_view_keeps_what_was_found_from_blocks_only_when_they_are_the_same():
    rng = random.Random(13)
    _, view = cluster(rng)
    old = Columns.of(view.decode_instances())
    old.holder_mask(PREFIX[0])
    same = ClusterView(dict(view.instances), now_s=1.0)
    prepare_candidates(same, view)
    assert Columns.of(same.decode_instances())._masks is old._masks
    changed = changes(view, rng, 40)
    moved = ClusterView({**view.instances, **changed}, now_s=1.0)
    prepare_candidates(moved, view)
    columns = Columns.of(moved.decode_instances())
    assert columns._masks is not old._masks
    fresh = Columns(moved.decode_instances())
    for block_hash in (*PREFIX, 99):
        assert columns.holders(block_hash) == fresh.holders(block_hash)
        assert (columns.holder_mask(block_hash) == fresh.holder_mask(block_hash)).all()


def test_many_exclusion_sets_never_evict_the_full_lists():
    _, view = cluster(random.Random(17))
    full = view.decode_instances()
    ids = [s.instance_id for s in full]
    for instance_id in ids:
        excluded = view.decode_instances(frozenset({instance_id}))
        assert [s.instance_id for s in excluded] == [i for i in ids if i != instance_id]
    assert view.decode_instances() is full
