"""ProberService: protobuf in, `probing.LinkProber`, protobuf out."""

from __future__ import annotations

import time

import grpc

from kvrs.errors import InvalidArgument, NotFound
from kvrs.v1 import prober_pb2, prober_pb2_grpc
from services.common.membership import Membership
from services.prober.probing import LinkProber, LinkState
from services.worker.client import Endpoint


def link_to_pb(state: LinkState, now_s: float, now_unix_ms: int) -> prober_pb2.LinkEstimate:
    estimate = state.estimate
    message = prober_pb2.LinkEstimate(
        src_instance_id=state.src.instance_id,
        dst_instance_id=state.dst.instance_id,
        sample_bandwidth_bps=state.sample_bps,
        probe_bytes=state.probe_bytes,
        probe_s=state.probe_s,
        measured_unix_ms=state.measured_unix_ms,
        probe_time_fraction=state.probe_time_fraction(now_s),
        last_error=state.last_error,
    )
    if estimate is not None:
        message.bandwidth_bps = estimate.bandwidth_bps
        message.rtt_s = estimate.rtt_s
        message.samples = estimate.samples
        message.age_s = max(0.0, (now_unix_ms - state.measured_unix_ms) / 1000.0)
    return message


class ProberServicer(prober_pb2_grpc.ProberServiceServicer):
    def __init__(self, prober: LinkProber, membership: Membership) -> None:
        self._prober = prober
        self._membership = membership

    def _endpoint(self, field: str, instance_id: str) -> Endpoint:
        if not instance_id:
            raise InvalidArgument(field, "must not be empty")
        known = self._membership.instance(instance_id)
        if known is None or not known.alive:
            raise NotFound(f"no alive instance {instance_id!r} in gossip", field=field)
        return Endpoint(known.instance_id, known.address)

    async def ProbeLink(
        self, request: prober_pb2.ProbeLinkRequest, context: grpc.aio.ServicerContext
    ) -> prober_pb2.ProbeLinkResponse:
        if request.probe_bytes < 0:
            raise InvalidArgument("probe_bytes", f"must be >= 0, got {request.probe_bytes}")
        src = self._endpoint("src_instance_id", request.src_instance_id)
        dst = self._endpoint("dst_instance_id", request.dst_instance_id)
        state = await self._prober.probe(src, dst, request.probe_bytes)
        return prober_pb2.ProbeLinkResponse(
            link=link_to_pb(state, time.monotonic(), int(time.time() * 1000))
        )

    async def ListLinkEstimates(
        self, request: prober_pb2.ListLinkEstimatesRequest, context: grpc.aio.ServicerContext
    ) -> prober_pb2.ListLinkEstimatesResponse:
        prober = self._prober
        now_s, now_unix_ms = time.monotonic(), int(time.time() * 1000)
        stats = prober.stats
        elapsed_s = max(now_s - stats.started_s, 1e-9)
        return prober_pb2.ListLinkEstimatesResponse(
            links=[link_to_pb(state, now_s, now_unix_ms) for state in prober.links.values()],
            probe_time_fraction=stats.busy_s / elapsed_s,
            probe_budget_fraction=prober.settings.budget_fraction,
            probes_total=stats.probes_total,
            probe_failures_total=stats.probe_failures_total,
        )
