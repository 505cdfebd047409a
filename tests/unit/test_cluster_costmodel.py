"""Cluster views and the cost model's glue: prefix hits, alive lists, S(L) through T_x."""

from __future__ import annotations

import numpy as np
import pytest

from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel, prefix_hit_tokens, streamed_tail_s
from kvrs.errors import InvalidArgument
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.profile import compute_profile
from kvrs.topology import Role, Topology


def test_prefix_hits_stop_at_first_miss_and_cap_at_prompt() -> None:
    resident = frozenset({1, 2, 4})
    assert prefix_hit_tokens((1, 2, 3, 4), resident, 512, 2000) == 1024
    assert prefix_hit_tokens((3, 1), resident, 512, 2000) == 0
    assert prefix_hit_tokens((1, 2), resident, 512, 700) == 700
    assert prefix_hit_tokens((), resident, 512, 700) == 0
    with pytest.raises(InvalidArgument):
        prefix_hit_tokens((), resident, 512, -1)


def test_view_lists_alive_instances_by_role_sorted() -> None:
    view = ClusterView(
        instances={
            "d1": InstanceState("d1", Role.DECODE),
            "d0": InstanceState("d0", Role.DECODE),
            "dx": InstanceState("dx", Role.DECODE, alive=False),
            "p0": InstanceState("p0", Role.PREFILL),
        },
        now_s=0.0,
    )
    assert [s.instance_id for s in view.decode_instances()] == ["d0", "d1"]
    assert [s.instance_id for s in view.prefill_instances()] == ["p0"]
    assert [s.instance_id for s in view.decode_instances(exclude={"d0"})] == ["d1"]
    assert view.decode_instances() is view.decode_instances()


def test_view_snapshot_cannot_be_edited_in_place() -> None:
    states = {"d0": InstanceState("d0", Role.DECODE)}
    view = ClusterView(instances=states, now_s=0.0)
    states["d1"] = InstanceState("d1", Role.DECODE)
    assert len(view.decode_instances()) == 1
    with pytest.raises(TypeError):
        view.instances["d2"] = InstanceState("d2", Role.DECODE)  # type: ignore[index]
    with pytest.raises(TypeError):
        view.decode_instances().append(InstanceState("d3", Role.DECODE))
    # Assigning a new mapping is the way to change a view; cached lists follow it.
    view.instances = states
    assert len(view.decode_instances()) == 2


def test_cost_model_glues_model_profile_and_network() -> None:
    topology = Topology.fat_tree(nodes=2, gpus_per_node=2, nodes_per_rack=2, racks_per_pod=1)
    cost = CostModel(model_spec("opt-13b"), compute_profile("opt-13b"), NetworkModel(topology))
    assert cost.kv_bytes(10) == 8_192_000
    assert cost.kv_bits_per_token == 8 * 819_200
    estimate = cost.transfer("prefill-0", "decode-1", 1477, 0.0)
    assert estimate.kv_bytes == cost.kv_bytes(1477)
    assert estimate.transfer_s == pytest.approx(estimate.rtt_s + 8 * cost.kv_bytes(1477) / 400e9)
    assert cost.prefill_s(512) == compute_profile("opt-13b").prefill_s(512)
    assert cost.extend_s(512, 8) == compute_profile("opt-13b").extend_s(512, 8)


def _layer_pipeline_tail_s(
    transfer_s: float, prefill_s: float, layers: int, fixed_s: float = 0.0
) -> float:
    """The same tail, step by step: the set-up first, then layer i leaves once computed
    and once the link has carried layer i - 1."""
    link_free_s = fixed_s
    for layer in range(layers):
        computed_s = (layer + 1) * prefill_s / layers
        link_free_s = max(link_free_s, computed_s) + (transfer_s - fixed_s) / layers
    return link_free_s - prefill_s


@pytest.mark.parametrize(
    ("transfer_s", "prefill_s", "layers", "fixed_s"),
    [
        (0.6, 1.9, 12, 0.0),
        (6.4, 1.9, 12, 0.0),
        (1.0, 1.0, 2, 0.0),
        (0.0, 2.0, 32, 0.0),
        (3.0, 0.0, 4, 0.0),
        (0.5, 4.0, 1, 0.0),
        (0.6, 1.9, 12, 0.3),
        (6.4, 1.9, 12, 2.5),
        (1.0, 0.5, 2, 0.9),
        (0.05, 0.1, 2, 0.04),
    ],
)
def test_a_streamed_transfer_leaves_what_the_layer_pipeline_leaves(
    transfer_s: float, prefill_s: float, layers: int, fixed_s: float
) -> None:
    tail_s = streamed_tail_s(transfer_s, prefill_s, layers, fixed_s)
    assert tail_s == pytest.approx(_layer_pipeline_tail_s(transfer_s, prefill_s, layers, fixed_s))
    assert tail_s <= transfer_s + 1e-12
    arrays = streamed_tail_s(np.array([transfer_s]), prefill_s, layers, np.array([fixed_s]))
    assert arrays[0] == pytest.approx(tail_s)


def test_a_set_up_shorter_than_the_prefill_is_hidden_under_it() -> None:
    # 40 ms of set-up, 0.1 ms of stream, under a 100 ms prefill of a 2-layer model: what
    # is left is the last layer's half of the stream, not a share of the set-up.
    assert streamed_tail_s(0.0401, 0.1, 2, fixed_s=0.04) == pytest.approx(0.00005)
    # A fixed cost that is the whole transfer (nothing to move) leaves nothing.
    assert streamed_tail_s(0.0, 0.1, 2, fixed_s=0.04) == 0.0


def test_a_streamed_transfer_needs_a_layer() -> None:
    with pytest.raises(InvalidArgument, match="layers"):
        streamed_tail_s(1.0, 1.0, 0)
