"""`kvrs.network.TransferEstimate` as protobuf, one translation for both decision services."""

from __future__ import annotations

from kvrs.network import TransferEstimate
from kvrs.v1 import common_pb2


def transfer_to_pb(estimate: TransferEstimate) -> common_pb2.TransferEstimate:
    return common_pb2.TransferEstimate(
        src_instance_id=estimate.src_id,
        dst_instance_id=estimate.dst_id,
        kv_bytes=estimate.kv_bytes,
        transfer_s=estimate.transfer_s,
        tier=int(estimate.tier),
        bottleneck_bandwidth_bps=estimate.bottleneck_bps,
        rtt_s=estimate.rtt_s,
        telemetry_age_s=estimate.telemetry_age_s,
        telemetry_stale=estimate.telemetry_stale,
        flows_on_path=estimate.flows_on_path,
    )
