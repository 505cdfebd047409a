"""Scheduler server assembly: the cached gossip view, migration slots, the servicer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, fields

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.learning import AssignedWork, Corrections
from kvrs.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import ServerHandle, connect_redis, run_until_signal, start_server
from services.common.decision_inputs import load_inputs
from services.common.gossip_source import GossipSource
from services.common.gossip_view import ViewCache
from services.common.metrics import Metrics, serve_metrics
from services.common.redis_store import Keys
from services.common.slot_leases import SlotStore
from services.gossip.client import GossipClient
from services.scheduler.config import Config
from services.scheduler.decisions import Scheduler
from services.scheduler.outcomes import Learning, OutcomeLog, close_quietly
from services.scheduler.peers import PeerChannel, SlotBrokerClient
from services.scheduler.replay import RecentRecoveries
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.slots import RedisSlots

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


@dataclass
class SchedulerServerHandle(ServerHandle):
    """A started scheduler and the parts tests and benchmarks look into."""

    scheduler: Scheduler | None = None
    view: ViewCache | None = None
    learning: Learning | None = None


async def build_server(
    config: Config, provider: TracerProvider, metrics: Metrics | None = None
) -> SchedulerServerHandle:
    """Starts a scheduler on `config.listen_addr` after one attempt to load the view.

    Serves even when gossip does not answer yet: decisions then fail UNAVAILABLE until
    the first refresh succeeds, and health tells the orchestrator nothing more than that
    the process is up.
    """
    inputs = load_inputs(config.inputs)
    # Background refreshes are not traced (ten spans a second of noise); slot calls are,
    # so a recovery's trace shows its reservation.
    broker = PeerChannel(config.slot_broker_addr, config.grpc, provider)
    broker_slots = SlotBrokerClient(
        broker, config.holder_id, config.slot_ttl_s, config.peer_timeout_s
    )
    slots: SlotBrokerClient | RedisSlots = broker_slots
    # One Redis connection: the shared outcome log, and the slots when reserved there.
    redis_client = connect_redis(config.redis_url, config.redis_tls)
    if config.slot_reservations == "redis":
        slots = RedisSlots(
            SlotStore(redis_client, config.redis_prefix),
            config.holder_id,
            config.slot_ttl_s,
            broker_slots,
            config.spare_slots,
        )
    source = GossipSource(
        lambda: GossipClient(
            config.gossip_addr, config.grpc, timeout_s=config.view_fetch_timeout_s
        ),
        slots,
        resync_s=config.inputs.view_resync_s,
    )
    learning = Learning(
        OutcomeLog(redis_client, Keys(config.redis_prefix), config.outcome_capacity),
        inputs.compute,
    )
    assigned = AssignedWork()
    view = ViewCache(
        inputs,
        source,
        config.view_refresh_s,
        config.view_stale_after_s,
        corrections=(lambda: learning.corrections) if config.learning else Corrections,
        assigned=assigned if config.learning else None,
    )
    await learning.refresh()
    if not await view.refresh():
        log.warning("gossip at %s did not answer; serving once it does", config.gossip_addr)
    scheduler = Scheduler(
        view=view,
        slots=slots,
        tracer=provider.get_tracer("kvrs.scheduler"),
        placement_policy=config.placement_policy,
        recovery_policy=config.recovery_policy,
        recent=RecentRecoveries(
            config.recover_replay_s, config.recover_replay_entries, clock=view.clock
        ),
        metrics=metrics,
        learning=learning,
        assigned=assigned if config.learning else None,
    )

    def register(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(
            SchedulerServicer(scheduler), server
        )

    base = await start_server(register, [SERVICE_NAME], config.listen_addr, config.grpc, provider)
    handle = SchedulerServerHandle(
        **{item.name: getattr(base, item.name) for item in fields(base)},
        scheduler=scheduler,
        view=view,
        learning=learning,
    )
    tasks = [
        asyncio.create_task(view.run(), name="scheduler-view-refresh"),
        asyncio.create_task(learning.run(config.learning_refresh_s), name="scheduler-learning"),
        asyncio.create_task(source.watch(view), name="scheduler-gossip-events"),
    ]
    if isinstance(slots, RedisSlots) and slots.spares:
        tasks.append(asyncio.create_task(slots.keep_spares(), name="scheduler-spare-slots"))

    async def stop_background() -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await source.close()
        await broker.close()
        await close_quietly(redis_client)

    handle.cleanups.append(stop_background)
    return handle


async def serve(config: Config, provider: TracerProvider) -> None:
    """Runs the scheduler until SIGTERM/SIGINT, then drains and shuts down."""
    metrics = Metrics()
    serve_metrics(metrics, config.metrics_addr)
    handle = await build_server(config, provider, metrics)
    await run_until_signal(handle, config.grpc, provider)
