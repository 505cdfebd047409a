"""Router server assembly: gossip membership, scheduler and worker clients, the servicer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.client import KvrsClient
from kvrs.errors import KvrsError
from kvrs.model import model_spec
from kvrs.profile import ComputeProfile, compute_profile
from kvrs.v1 import router_pb2, router_pb2_grpc
from services.common import (
    ConfigError,
    Metrics,
    ServerHandle,
    run_until_signal,
    serve_metrics,
    start_server,
)
from services.common.membership import Membership
from services.gossip.client import GossipClient
from services.router.config import Config
from services.router.flow import Router, RouterSettings
from services.router.peers import ControlPlane
from services.router.servicer import RouterServicer
from services.worker.client import WorkerPool

log = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


@dataclass
class RouterServerHandle(ServerHandle):
    """A started router and the parts tests look into."""

    router: Router | None = None
    membership: Membership | None = None
    metrics: Metrics | None = None


def load_profile(config: Config) -> ComputeProfile:
    """The compute profile that prices prefill (KVRS_PROFILE_FILE, else the preset)."""
    try:
        if config.profile_file:
            return ComputeProfile.load(config.profile_file)
        return compute_profile(config.model)
    except (KvrsError, OSError, ValueError, KeyError) as exc:
        name = "KVRS_PROFILE_FILE" if config.profile_file else "KVRS_MODEL"
        raise ConfigError(f"{name}: {exc}") from None


async def build_server(
    config: Config, provider: TracerProvider, metrics: Metrics | None = None
) -> RouterServerHandle:
    """Starts a router on `config.listen_addr` after one attempt to read gossip.

    Serves even when gossip does not answer yet: requests then fail UNAVAILABLE ("no
    alive prefill instance") until the first listing arrives.
    """
    try:
        spec = model_spec(config.model)
    except KvrsError as exc:
        raise ConfigError(f"KVRS_MODEL: {exc}") from None
    profile = load_profile(config)
    metrics = metrics or Metrics()
    gossip = GossipClient(config.gossip_addr, config.grpc, timeout_s=config.control_timeout_s)
    control = KvrsClient(
        config.scheduler_addrs,
        slot_broker_addr=config.slot_broker_addr,
        settings=config.grpc,
        provider=provider,
        timeout_s=config.control_timeout_s,
    )
    workers = WorkerPool(config.grpc, provider, config.worker_timeout_s)
    membership = Membership(gossip, config.view_refresh_s)
    await membership.start()
    router = Router(
        workers=workers,
        control=ControlPlane(control),
        membership=membership,
        profile=profile,
        tracer=provider.get_tracer("kvrs.router"),
        metrics=metrics,
        settings=RouterSettings(
            default_placement_policy=config.placement_policy,
            default_recovery_policy=config.recovery_policy,
            block_tokens=spec.block_tokens,
            decode_idle_timeout_s=config.decode_idle_timeout_s,
            batch_window_s=config.batch_window_s,
            instance_wait_s=config.instance_wait_s,
            max_requests_per_decode=config.max_requests_per_decode,
            deadline_admission=config.deadline_admission,
            stream_kv=config.stream_kv,
            stream_kv_min_tokens=config.stream_kv_min_tokens,
            vocab_size=spec.vocab_size,
            max_positions=spec.max_positions,
        ),
    )

    def register(server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(router), server)

    base = await start_server(register, [SERVICE_NAME], config.listen_addr, config.grpc, provider)
    handle = RouterServerHandle(
        **{item.name: getattr(base, item.name) for item in fields(base)},
        router=router,
        membership=membership,
        metrics=metrics,
    )

    async def close_clients() -> None:
        await membership.close()
        await gossip.close()
        await control.close()
        await workers.close()

    handle.cleanups.append(close_clients)
    return handle


async def serve(config: Config, provider: TracerProvider) -> None:
    """Runs the router until SIGTERM/SIGINT, then drains and shuts down."""
    metrics = Metrics()
    serve_metrics(metrics, config.metrics_addr)
    handle = await build_server(config, provider, metrics)
    await run_until_signal(handle, config.grpc, provider)
