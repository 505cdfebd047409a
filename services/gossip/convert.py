"""Translation between gossip protobuf messages and the domain records, both directions.

The servicer turns requests into records and records into responses; the client does the
reverse, so callers of `GossipClient` only ever see `services.common.gossip_records` types.
"""

from __future__ import annotations

from kvrs.v1 import common_pb2, gossip_pb2
from services.common.gossip_records import (
    ALIVE,
    FAILED,
    JOINED,
    LEFT,
    REFUTED,
    SUSPECT,
    LinkRecord,
    LinkSample,
    NodeChanges,
    NodeEvent,
    NodeLoad,
    NodeRecord,
    Registration,
)

ROLE_TO_PB = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}
ROLE_FROM_PB: dict[int, str] = {value: name for name, value in ROLE_TO_PB.items()}
STATE_TO_PB = {
    ALIVE: gossip_pb2.NODE_STATE_ALIVE,
    FAILED: gossip_pb2.NODE_STATE_FAILED,
    LEFT: gossip_pb2.NODE_STATE_LEFT,
    SUSPECT: gossip_pb2.NODE_STATE_SUSPECT,
}
STATE_FROM_PB = {value: name for name, value in STATE_TO_PB.items()}
EVENT_TO_PB = {
    JOINED: gossip_pb2.NODE_EVENT_TYPE_JOINED,
    FAILED: gossip_pb2.NODE_EVENT_TYPE_FAILED,
    LEFT: gossip_pb2.NODE_EVENT_TYPE_LEFT,
    SUSPECT: gossip_pb2.NODE_EVENT_TYPE_SUSPECT,
    REFUTED: gossip_pb2.NODE_EVENT_TYPE_REFUTED,
}
EVENT_FROM_PB = {value: name for name, value in EVENT_TO_PB.items()}


def role_from_pb(role: int) -> str:
    """ "" for ROLE_UNSPECIFIED, which validation rejects where a role is required."""
    return ROLE_FROM_PB.get(role, "")


def registration_to_pb(
    registration: Registration, request_id: str
) -> gossip_pb2.RegisterNodeRequest:
    return gossip_pb2.RegisterNodeRequest(
        request_id=request_id,
        instance_id=registration.instance_id,
        role=ROLE_TO_PB.get(registration.role, common_pb2.ROLE_UNSPECIFIED),
        address=registration.address,
        location=common_pb2.Location(
            node=registration.node,
            rack=registration.rack,
            pod=registration.pod,
            gpu_index=registration.gpu_index,
        ),
        model=registration.model,
        kv_capacity_blocks=registration.kv_capacity_blocks,
        transfer_address=registration.transfer_address,
        heartbeat_ttl_s=registration.heartbeat_ttl_s,
        max_batch_tokens=registration.max_batch_tokens,
    )


def registration_from_pb(request: gossip_pb2.RegisterNodeRequest) -> Registration:
    return Registration(
        instance_id=request.instance_id,
        role=role_from_pb(request.role),
        address=request.address,
        node=request.location.node,
        rack=request.location.rack,
        pod=request.location.pod,
        gpu_index=request.location.gpu_index,
        model=request.model,
        kv_capacity_blocks=request.kv_capacity_blocks,
        transfer_address=request.transfer_address,
        heartbeat_ttl_s=request.heartbeat_ttl_s,
        max_batch_tokens=request.max_batch_tokens,
    )


def heartbeat_to_pb(
    instance_id: str,
    load: NodeLoad,
    request_id: str,
    load_unchanged: bool = False,
    prefix_hashes_unchanged: bool = False,
) -> gossip_pb2.HeartbeatRequest:
    """What is unchanged is left out of the message, not just flagged."""
    request = gossip_pb2.HeartbeatRequest(
        request_id=request_id,
        instance_id=instance_id,
        load_unchanged=load_unchanged,
        prefix_hashes_unchanged=prefix_hashes_unchanged,
    )
    if not load_unchanged:
        request.queue_depth = load.queue_depth
        request.queued_work_s = load.queued_work_s
        request.running_requests = load.running_requests
        request.free_kv_blocks = load.free_kv_blocks
        request.compute_factor = load.compute_factor
        request.running_context_tokens = load.running_context_tokens
    if not prefix_hashes_unchanged:
        request.resident_prefix_hashes.extend(load.resident_prefix_hashes)
    return request


def load_from_pb(message: gossip_pb2.HeartbeatRequest | gossip_pb2.NodeInfo) -> NodeLoad:
    return NodeLoad(
        queue_depth=message.queue_depth,
        queued_work_s=message.queued_work_s,
        running_requests=message.running_requests,
        free_kv_blocks=message.free_kv_blocks,
        resident_prefix_hashes=tuple(message.resident_prefix_hashes),
        compute_factor=message.compute_factor,
        running_context_tokens=message.running_context_tokens,
    )


def node_to_pb(record: NodeRecord) -> gossip_pb2.NodeInfo:
    registration, load = record.registration, record.load
    return gossip_pb2.NodeInfo(
        instance_id=registration.instance_id,
        role=ROLE_TO_PB.get(registration.role, common_pb2.ROLE_UNSPECIFIED),
        address=registration.address,
        location=common_pb2.Location(
            node=registration.node,
            rack=registration.rack,
            pod=registration.pod,
            gpu_index=registration.gpu_index,
        ),
        model=registration.model,
        kv_capacity_blocks=registration.kv_capacity_blocks,
        transfer_address=registration.transfer_address,
        state=STATE_TO_PB.get(record.state, gossip_pb2.NODE_STATE_UNSPECIFIED),
        queue_depth=load.queue_depth,
        queued_work_s=load.queued_work_s,
        running_requests=load.running_requests,
        free_kv_blocks=load.free_kv_blocks,
        resident_prefix_hashes=load.resident_prefix_hashes,
        compute_factor=load.compute_factor,
        running_context_tokens=load.running_context_tokens,
        age_s=record.age_s,
        last_seen_unix_ms=record.last_seen_unix_ms,
        heartbeat_ttl_s=record.heartbeat_ttl_s,
        max_batch_tokens=registration.max_batch_tokens,
    )


def node_from_pb(info: gossip_pb2.NodeInfo) -> NodeRecord:
    registration = Registration(
        instance_id=info.instance_id,
        role=role_from_pb(info.role),
        address=info.address,
        node=info.location.node,
        rack=info.location.rack,
        pod=info.location.pod,
        gpu_index=info.location.gpu_index,
        model=info.model,
        kv_capacity_blocks=info.kv_capacity_blocks,
        transfer_address=info.transfer_address,
        heartbeat_ttl_s=info.heartbeat_ttl_s,
        max_batch_tokens=info.max_batch_tokens,
    )
    return NodeRecord(
        registration=registration,
        state=STATE_FROM_PB.get(info.state, ""),
        load=load_from_pb(info),
        last_seen_unix_ms=info.last_seen_unix_ms,
        age_s=info.age_s,
        heartbeat_ttl_s=info.heartbeat_ttl_s,
    )


def changes_from_pb(reply: gossip_pb2.ListChangesResponse) -> NodeChanges:
    return NodeChanges(
        nodes=tuple(node_from_pb(info) for info in reply.nodes),
        change_id=reply.change_id,
        full=reply.full,
        now_ms=reply.server_unix_ms,
    )


def link_sample_to_pb(sample: LinkSample, request_id: str) -> gossip_pb2.ReportLinkSampleRequest:
    return gossip_pb2.ReportLinkSampleRequest(
        request_id=request_id,
        src_instance_id=sample.src_instance_id,
        dst_instance_id=sample.dst_instance_id,
        bandwidth_bps=sample.bandwidth_bps,
        sample_bandwidth_bps=sample.sample_bandwidth_bps,
        rtt_s=sample.rtt_s,
        probe_bytes=sample.probe_bytes,
        samples=sample.samples,
    )


def link_sample_from_pb(request: gossip_pb2.ReportLinkSampleRequest) -> LinkSample:
    return LinkSample(
        src_instance_id=request.src_instance_id,
        dst_instance_id=request.dst_instance_id,
        bandwidth_bps=request.bandwidth_bps,
        sample_bandwidth_bps=request.sample_bandwidth_bps,
        rtt_s=request.rtt_s,
        probe_bytes=request.probe_bytes,
        samples=request.samples,
    )


def link_to_pb(record: LinkRecord) -> gossip_pb2.LinkInfo:
    sample = record.sample
    return gossip_pb2.LinkInfo(
        src_instance_id=sample.src_instance_id,
        dst_instance_id=sample.dst_instance_id,
        bandwidth_bps=sample.bandwidth_bps,
        sample_bandwidth_bps=sample.sample_bandwidth_bps,
        rtt_s=sample.rtt_s,
        samples=sample.samples,
        age_s=record.age_s,
        measured_unix_ms=record.measured_unix_ms,
    )


def link_from_pb(info: gossip_pb2.LinkInfo) -> LinkRecord:
    sample = LinkSample(
        src_instance_id=info.src_instance_id,
        dst_instance_id=info.dst_instance_id,
        bandwidth_bps=info.bandwidth_bps,
        sample_bandwidth_bps=info.sample_bandwidth_bps,
        rtt_s=info.rtt_s,
        samples=info.samples,
    )
    return LinkRecord(sample=sample, measured_unix_ms=info.measured_unix_ms, age_s=info.age_s)


def event_to_pb(event: NodeEvent) -> gossip_pb2.NodeEvent:
    return gossip_pb2.NodeEvent(
        event_id=event.event_id,
        type=EVENT_TO_PB.get(event.type, gossip_pb2.NODE_EVENT_TYPE_UNSPECIFIED),
        instance_id=event.instance_id,
        role=ROLE_TO_PB.get(event.role, common_pb2.ROLE_UNSPECIFIED),
        address=event.address,
        unix_ms=event.unix_ms,
        reason=event.reason,
    )


def event_from_pb(message: gossip_pb2.NodeEvent) -> NodeEvent:
    return NodeEvent(
        event_id=message.event_id,
        type=EVENT_FROM_PB.get(message.type, ""),
        instance_id=message.instance_id,
        role=role_from_pb(message.role),
        address=message.address,
        unix_ms=message.unix_ms,
        reason=message.reason,
    )
