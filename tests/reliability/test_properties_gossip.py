"""GossipService under hostile input: every refusal is a clean, named status, and nothing
a caller can write breaks a later read (a registry read is what every decision needs)."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reliability_stack import (
    KNOWN_IDS,
    ControlPlane,
    assert_serving,
    call,
    check_rejection,
    unique_prefix,
)
from reliability_strategies import (
    PROPERTY_SETTINGS,
    doubles,
    enums,
    ids,
    int32s,
    int64s,
    mutated,
    uint64_lists,
)

from kvrs.v1 import common_pb2, gossip_pb2, gossip_pb2_grpc

pytestmark = pytest.mark.filterwarnings(
    # The servers' span ids come from the global `random` while Hypothesis draws.
    "ignore:Do not use the `random` module inside strategies"
)

ROLES = (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE)
IDS = ids(KNOWN_IDS)
WATCH_WAIT_S = 0.2

VALID_REGISTRATION = gossip_pb2.RegisterNodeRequest(
    request_id="r",
    instance_id="prop-0",
    role=common_pb2.ROLE_DECODE,
    address="w0:50060",
    location=common_pb2.Location(node="n0", rack="r0", pod="p0", gpu_index=1),
    model="tiny",
    kv_capacity_blocks=64,
    transfer_address="w0:29500",
    heartbeat_ttl_s=600.0,
)


@pytest.fixture(scope="module")
def stub(gossip_plane):
    channel = gossip_plane.channel("gossip")
    stub = gossip_pb2_grpc.GossipServiceStub(channel)
    for instance_id in KNOWN_IDS:
        registration = gossip_pb2.RegisterNodeRequest()
        registration.CopyFrom(VALID_REGISTRATION)
        registration.instance_id = instance_id
        stub.RegisterNode(registration, timeout=10)
    yield stub
    assert_serving(channel, "kvrs.v1.GossipService")
    channel.close()


def still_reads(stub) -> None:
    """What every scheduler and oracle refresh calls must keep working after any write."""
    stub.ListNodes(gossip_pb2.ListNodesRequest(include_down=True), timeout=10)
    stub.ListLinks(gossip_pb2.ListLinksRequest(), timeout=10)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        VALID_REGISTRATION,
        {
            "instance_id": IDS,
            "role": enums(ROLES),
            "address": IDS,
            "location": st.builds(
                common_pb2.Location, node=IDS, rack=IDS, pod=IDS, gpu_index=int32s()
            ),
            "location.gpu_index": int32s(),
            "model": IDS,
            "kv_capacity_blocks": int64s(),
            "transfer_address": IDS,
            "heartbeat_ttl_s": doubles(),
        },
    )
)
def test_register_node(stub, request):
    call(stub.RegisterNode, request)
    still_reads(stub)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        gossip_pb2.HeartbeatRequest(
            instance_id="decode-0",
            queue_depth=1,
            queued_work_s=0.5,
            running_requests=1,
            free_kv_blocks=10,
            resident_prefix_hashes=[1, 2],
        ),
        {
            "instance_id": IDS,
            "queue_depth": int32s(),
            "queued_work_s": doubles(),
            "running_requests": int32s(),
            "free_kv_blocks": int64s(),
            "resident_prefix_hashes": uint64_lists(),
        },
    )
)
def test_heartbeat(stub, request):
    call(stub.Heartbeat, request)
    still_reads(stub)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        gossip_pb2.DeregisterNodeRequest(instance_id="prop-0", reason="test"),
        {"instance_id": IDS, "reason": IDS},
    )
)
def test_deregister_node(stub, request):
    call(stub.DeregisterNode, request)
    still_reads(stub)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        gossip_pb2.ReportLinkSampleRequest(
            src_instance_id="prefill-0",
            dst_instance_id="decode-0",
            bandwidth_bps=1e9,
            sample_bandwidth_bps=1e9,
            rtt_s=1e-4,
            probe_bytes=1 << 20,
            samples=3,
        ),
        {
            "src_instance_id": IDS,
            "dst_instance_id": IDS,
            "bandwidth_bps": doubles(),
            "sample_bandwidth_bps": doubles(),
            "rtt_s": doubles(),
            "probe_bytes": int64s(),
            "samples": int64s(),
        },
    )
)
def test_report_link_sample(stub, request):
    call(stub.ReportLinkSample, request)
    still_reads(stub)


@PROPERTY_SETTINGS
@given(
    request=st.builds(gossip_pb2.ListNodesRequest, role=enums(ROLES), include_down=st.booleans())
)
def test_list_nodes(stub, request):
    call(stub.ListNodes, request)


event_ids = st.one_of(
    st.sampled_from(
        [
            "",
            "0",
            "0-0",
            "1-1",
            "9999999999999-0",
            "1700000000000-0",
            "-1",
            "1-",
            "18446744073709551615-18446744073709551615",
            "18446744073709551616-0",
            "0-18446744073709551616",
            "1--1",
        ]
    ),
    st.text(max_size=30),
    st.from_regex(r"\A\d{1,30}(-\d{1,30})?\Z"),
)


@PROPERTY_SETTINGS
@given(after_event_id=event_ids)
def test_watch_events(stub, after_event_id):
    request = gossip_pb2.WatchEventsRequest(after_event_id=after_event_id)
    stream = stub.WatchEvents(request, timeout=WATCH_WAIT_S)
    try:
        next(iter(stream))
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # no event yet: still waiting
            check_rejection(exc, request)
    except StopIteration:
        pass
    finally:
        stream.cancel()
    still_reads(stub)


def test_oversized_registrations_cannot_block_registry_reads(redis_url):
    plane = ControlPlane(redis_url, unique_prefix("huge")).start(services=("gossip",))
    channel = grpc.insecure_channel(
        plane.addresses["gossip"], options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    stub = gossip_pb2_grpc.GossipServiceStub(channel)
    try:
        for i in range(2):
            request = gossip_pb2.RegisterNodeRequest()
            request.CopyFrom(VALID_REGISTRATION)
            request.instance_id, request.address = f"huge-{i}", "x" * (9 << 20)
            call(stub.RegisterNode, request)
        still_reads(stub)
    finally:
        channel.close()
        plane.stop()
