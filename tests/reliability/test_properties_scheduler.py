"""SchedulerService under hostile input: clean, named refusals, and it keeps deciding."""

from __future__ import annotations

import uuid

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reliability_stack import (
    CLUSTER,
    KNOWN_IDS,
    ControlPlane,
    assert_serving,
    call,
    unique_prefix,
)
from reliability_strategies import (
    PROPERTY_SETTINGS,
    doubles,
    id_lists,
    ids,
    int32s,
    int64s,
    mutated,
    uint64_lists,
)

from kvrs.v1 import (
    common_pb2,
    gossip_pb2,
    gossip_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    slots_pb2,
    slots_pb2_grpc,
)

pytestmark = pytest.mark.filterwarnings(
    # The servers' span ids come from the global `random` while Hypothesis draws.
    "ignore:Do not use the `random` module inside strategies"
)

IDS = ids(KNOWN_IDS)
PLACEMENT = st.one_of(
    st.sampled_from(["", "round_robin", "least_loaded", "cache_load", "netkv"]),
    st.text(max_size=12),
)
RECOVERY = st.one_of(
    st.sampled_from(["", "always_migrate", "always_recompute", "rom", "kvrs"]), st.text(max_size=12)
)
NO_FINITE_COST = frozenset(
    {
        "slo_slack_s",
        "predicted_cost_s",
        "cost_s",
        "wait_s",
        "transfer_s",
        "compute_s",
    }
)
"""Fields that are +-inf when no option fits (documented for slo_slack_s; an infeasible
option's cost)."""
SLOT_ACTIONS = (common_pb2.RECOVERY_ACTION_MIGRATE, common_pb2.RECOVERY_ACTION_HYBRID)
DECODE_IDS = tuple(row[0] for row in CLUSTER if row[1] == "decode")


@pytest.fixture(scope="module")
def stub(plane):
    channel = plane.channel("scheduler")
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    yield stub
    assert_serving(channel, "kvrs.v1.SchedulerService")
    still_decides(stub)
    channel.close()


def still_decides(stub) -> None:
    reply = stub.SelectDecode(
        scheduler_pb2.SelectDecodeRequest(
            request_id="valid", prefill_instance_id="prefill-0", prompt_tokens=1024
        ),
        timeout=10,
    )
    assert reply.decode_instance_id.startswith("decode-")
    assert not reply.view_stale


@PROPERTY_SETTINGS
@given(
    request=mutated(
        scheduler_pb2.SelectDecodeRequest(
            request_id="s",
            prefill_instance_id="prefill-0",
            prompt_tokens=4096,
            prefix_hashes=[7, 8],
        ),
        {
            "request_id": IDS,
            "prefill_instance_id": IDS,
            "prompt_tokens": int64s(),
            "prefix_hashes": uint64_lists(),
            "policy": PLACEMENT,
            "exclude_instance_ids": id_lists(KNOWN_IDS),
            "candidate_instance_ids": id_lists(KNOWN_IDS),
        },
    )
)
def test_select_decode(stub, request):
    reply = call(stub.SelectDecode, request)
    if reply is not None:
        assert reply.decode_instance_id not in request.exclude_instance_ids
        assert reply.decode_instance_id.startswith("decode-")


@PROPERTY_SETTINGS
@given(
    request=mutated(
        scheduler_pb2.RecoverRequest(
            request_id="r",
            failed_instance_id="decode-0",
            source_prefill_instance_id="prefill-0",
            prompt_tokens=2000,
            generated_tokens=10,
        ),
        {
            "request_id": IDS,
            "failed_instance_id": IDS,
            "source_prefill_instance_id": IDS,
            "prompt_tokens": int64s(),
            "generated_tokens": int64s(),
            "deadline_unix_ms": int64s(),
            "policy": RECOVERY,
            "source_kv_lost": st.booleans(),
            "exclude_instance_ids": id_lists(KNOWN_IDS),
            "skip_slot": st.booleans(),
        },
    )
)
def test_recover(stub, request):
    reply = call(stub.Recover, request, allow_inf=NO_FINITE_COST)
    if reply is not None and reply.slot_lease.lease_id:
        assert reply.action in SLOT_ACTIONS


VALID_ITEM = scheduler_pb2.RecoverItem(
    request_id="i", source_prefill_instance_id="prefill-1", prompt_tokens=3000, generated_tokens=5
)
items = mutated(
    VALID_ITEM,
    {
        "request_id": IDS,
        "source_prefill_instance_id": IDS,
        "prompt_tokens": int64s(),
        "generated_tokens": int64s(),
        "deadline_unix_ms": int64s(),
        "source_kv_lost": st.booleans(),
    },
    max_fields=2,
)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        scheduler_pb2.RecoverBatchRequest(
            batch_id="b", failed_instance_id="decode-1", items=[VALID_ITEM], skip_slot=True
        ),
        {
            "batch_id": IDS,
            "failed_instance_id": IDS,
            "items": st.lists(items, max_size=6),
            "policy": RECOVERY,
            "skip_slot": st.booleans(),
        },
    )
)
def test_recover_batch(stub, request):
    reply = call(stub.RecoverBatch, request, allow_inf=NO_FINITE_COST | {"planned_makespan_s"})
    if reply is not None:
        assert len(reply.decisions) == len(request.items)


# -- regressions of bugs the properties found ---------------------------------------------


def expect_code(method, request, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as failure:
        method(request, timeout=10)
    assert failure.value.code() == code, failure.value.details()
    return failure.value.details()


def test_a_huge_prompt_is_invalid_argument(stub):
    details = expect_code(
        stub.SelectDecode,
        scheduler_pb2.SelectDecodeRequest(
            request_id="huge", prefill_instance_id="prefill-0", prompt_tokens=2**62
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert details.startswith("prompt_tokens:")
    details = expect_code(
        stub.Recover,
        scheduler_pb2.RecoverRequest(
            request_id="huge",
            failed_instance_id="decode-0",
            source_prefill_instance_id="prefill-0",
            prompt_tokens=2**62,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert details.startswith("prompt_tokens:")
    details = expect_code(
        stub.Recover,
        scheduler_pb2.RecoverRequest(
            request_id="huge",
            failed_instance_id="decode-0",
            source_prefill_instance_id="prefill-0",
            prompt_tokens=10_000_000,
            generated_tokens=1,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert details.startswith("generated_tokens:")


def test_select_decode_from_a_decode_instance_is_invalid_argument(stub):
    details = expect_code(
        stub.SelectDecode,
        scheduler_pb2.SelectDecodeRequest(
            request_id="role", prefill_instance_id="decode-0", prompt_tokens=100
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert details.startswith("prefill_instance_id:")


def test_recover_from_a_decode_source_is_invalid_argument(stub):
    for target in sorted(DECODE_IDS):
        details = expect_code(
            stub.Recover,
            scheduler_pb2.RecoverRequest(
                request_id=f"role-{target}",
                failed_instance_id="prefill-0",
                source_prefill_instance_id=target,
                prompt_tokens=100,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert details.startswith("source_prefill_instance_id:")


def test_a_second_recovery_of_one_request_gets_a_decision(redis_url):
    """A request recovered onto decode-1 whose new instance fails too, before its first
    slot lease expired: the second recovery must still be decided, and its migration
    holds the request's one slot (a plane of its own: the properties use up the slots)."""
    plane = ControlPlane(redis_url, unique_prefix("twice")).start()
    channel = plane.channel("scheduler")
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    try:
        first = stub.Recover(
            scheduler_pb2.RecoverRequest(
                request_id="twice",
                failed_instance_id="decode-0",
                policy="always_migrate",
                source_prefill_instance_id="prefill-0",
                prompt_tokens=100,
            ),
            timeout=10,
        )
        assert first.action == common_pb2.RECOVERY_ACTION_MIGRATE and first.slot_lease.lease_id
        second = stub.Recover(
            scheduler_pb2.RecoverRequest(
                request_id="twice",
                failed_instance_id=first.target_instance_id,
                exclude_instance_ids=["decode-0"],
                policy="always_migrate",
                source_prefill_instance_id="prefill-0",
                prompt_tokens=100,
                generated_tokens=3,
            ),
            timeout=10,
        )
        assert second.target_instance_id not in ("decode-0", first.target_instance_id)
        assert second.action == common_pb2.RECOVERY_ACTION_MIGRATE, second.reason
        assert second.slot_lease.lease_id not in ("", first.slot_lease.lease_id)
        with plane.channel("slot-broker") as broker:
            stats = slots_pb2_grpc.SlotBrokerServiceStub(broker).GetSlotStats(
                slots_pb2.GetSlotStatsRequest(), timeout=10
            )
        assert stats.slots_in_use == 1
    finally:
        channel.close()
        plane.stop()


# -- whatever gossip accepts, the scheduler can decide on ----------------------------------


@pytest.fixture(scope="module")
def gossip(plane):
    channel = plane.channel("gossip")
    yield gossip_pb2_grpc.GossipServiceStub(channel)
    channel.close()


@PROPERTY_SETTINGS
@given(
    registration=mutated(
        gossip_pb2.RegisterNodeRequest(
            instance_id="decode-2",
            role=common_pb2.ROLE_DECODE,
            address="decode-2:50060",
            heartbeat_ttl_s=3600.0,
            location=common_pb2.Location(node="n9", rack="r9", pod="p9"),
        ),
        {
            "kv_capacity_blocks": int64s(),
            "location.gpu_index": int32s(),
            "model": IDS,
            "transfer_address": IDS,
            "address": IDS,
        },
    ),
    load=mutated(
        gossip_pb2.HeartbeatRequest(instance_id="decode-2"),
        {
            "queue_depth": int32s(),
            "queued_work_s": doubles(),
            "running_requests": int32s(),
            "free_kv_blocks": int64s(),
            "resident_prefix_hashes": uint64_lists(),
        },
    ),
    link=mutated(
        gossip_pb2.ReportLinkSampleRequest(
            src_instance_id="prefill-0", dst_instance_id="decode-2", bandwidth_bps=1e9
        ),
        {
            "bandwidth_bps": doubles(),
            "rtt_s": doubles(),
            "samples": int64s(),
            "sample_bandwidth_bps": doubles(),
            "probe_bytes": int64s(),
        },
    ),
)
def test_whatever_gossip_accepts_the_scheduler_decides_on(
    plane, stub, gossip, registration, load, link
):
    """A worker or prober reporting extreme (accepted) values must not poison the view
    every decision reads: the refresh succeeds and decisions still come back clean."""
    for method, request in (
        (gossip.RegisterNode, registration),
        (gossip.Heartbeat, load),
        (gossip.ReportLinkSample, link),
    ):
        call(method, request)
    view = plane.handles["scheduler"].view
    assert plane.loop.run(view.refresh()), "the scheduler could not refresh its view"
    call(
        stub.SelectDecode,
        scheduler_pb2.SelectDecodeRequest(
            request_id="after-write",
            prefill_instance_id="prefill-0",
            prompt_tokens=2048,
            prefix_hashes=[1, 2, 3],
        ),
    )
    call(
        stub.Recover,
        scheduler_pb2.RecoverRequest(
            request_id=f"after-write-{uuid.uuid4().hex[:8]}",
            failed_instance_id="decode-0",
            source_prefill_instance_id="prefill-0",
            prompt_tokens=2048,
            skip_slot=True,
        ),
        allow_inf=NO_FINITE_COST,
    )
    still_decides(stub)
