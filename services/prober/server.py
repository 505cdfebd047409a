"""Prober server assembly: gossip membership, the worker transport, the probe loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, fields

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.v1 import prober_pb2, prober_pb2_grpc
from services.common import Metrics, ServerHandle, run_until_signal, serve_metrics, start_server
from services.common.membership import Membership
from services.gossip.client import GossipClient
from services.prober.config import Config
from services.prober.probing import LinkProber, ProbePairs, ProbeSettings
from services.prober.servicer import ProberServicer
from services.prober.transport import WorkerTransport
from services.worker.client import Endpoint, WorkerPool

log = logging.getLogger(__name__)

SERVICE_NAME = prober_pb2.DESCRIPTOR.services_by_name["ProberService"].full_name


@dataclass
class ProberServerHandle(ServerHandle):
    """A started prober and the parts tests look into."""

    prober: LinkProber | None = None
    membership: Membership | None = None


def probe_pairs(membership: Membership, mode: str) -> ProbePairs:
    """The links to measure: prefill -> decode pairs, or every ordered pair ("all")."""
    prefill = [Endpoint(i.instance_id, i.address) for i in membership.alive("prefill")]
    decode = [Endpoint(i.instance_id, i.address) for i in membership.alive("decode")]
    if mode == "prefill-decode":
        return ProbePairs(prefill, decode)
    return ProbePairs(prefill + decode, prefill + decode)


def probe_settings(config: Config) -> ProbeSettings:
    return ProbeSettings(
        budget_fraction=config.budget_fraction,
        target_probe_s=config.target_probe_s,
        interval_s=config.interval_s,
        payload_tokens=config.payload_tokens,
        max_pulls=config.max_pulls,
        payload_lease_s=config.payload_lease_s,
        ewma_alpha=config.ewma_alpha,
        pacing_bps=config.pacing_bps,
        max_probes_per_s=config.max_probes_per_s,
    )


async def build_server(
    config: Config, provider: TracerProvider, probe_forever: bool = True
) -> ProberServerHandle:
    """Starts a prober on `config.listen_addr`; `probe_forever=False` (tests) probes only
    when ProbeLink asks."""
    gossip = GossipClient(config.gossip_addr, config.grpc, timeout_s=config.worker_timeout_s)
    workers = WorkerPool(config.grpc, None, config.worker_timeout_s)
    membership = Membership(gossip, config.refresh_s)
    await membership.start()
    prober = LinkProber(WorkerTransport(workers), gossip, probe_settings(config))
    membership.add_failure_listener(lambda instance_id, _: prober.forget_source(instance_id))

    def register(server: grpc.aio.Server) -> None:
        prober_pb2_grpc.add_ProberServiceServicer_to_server(
            ProberServicer(prober, membership), server
        )

    base = await start_server(register, [SERVICE_NAME], config.listen_addr, config.grpc, provider)
    handle = ProberServerHandle(
        **{item.name: getattr(base, item.name) for item in fields(base)},
        prober=prober,
        membership=membership,
    )
    tasks = []
    if probe_forever:
        tasks.append(
            asyncio.create_task(
                prober.run(lambda: probe_pairs(membership, config.pairs)), name="prober-loop"
            )
        )

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await membership.close()
        await gossip.close()
        await workers.close()

    handle.cleanups.append(stop)
    return handle


async def serve(config: Config, provider: TracerProvider) -> None:
    """Runs the prober until SIGTERM/SIGINT, then drains and shuts down."""
    serve_metrics(Metrics(), config.metrics_addr)
    handle = await build_server(config, provider)
    await run_until_signal(handle, config.grpc, provider)
