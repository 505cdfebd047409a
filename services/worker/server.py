"""Worker server assembly: model, KV store, transfer agent, gRPC server, canary, gossip.

Lifecycle: build the model (in a thread) → start the server NOT_SERVING → one-token
canary → register with gossip → SERVING. The canary repeats; a failure turns health
NOT_SERVING until it passes again. On SIGTERM: deregister (the scheduler stops placing
here) → NOT_SERVING → in-flight RPCs (decode streams) get the grace period → close
channels, transfer agent and compute thread. `stop` is safe twice and after a partial
start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, fields

import grpc
import torch
from opentelemetry.sdk.trace import TracerProvider

from kvrs.errors import KvrsError
from kvrs.model import model_spec
from kvrs.rpc import error_from_rpc
from kvrs.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from libkvxfer import AgentConfig, TransferAgent, TransferTicket
from services.common import (
    ConfigError,
    GrpcSettings,
    ServerHandle,
    open_channel,
    run_until_signal,
    start_server,
)
from services.common.gossip_records import NodeLoad, Registration
from services.common.metrics import Metrics, serve_metrics
from services.worker.compute import ComputeQueue, load_profile
from services.worker.config import Config
from services.worker.engine import SendResult, WorkerEngine
from services.worker.heartbeat import HeartbeatThread
from services.worker.kvstore import KvStore
from services.worker.model import Transformer, resolve_dtype
from services.worker.servicer import WorkerServicer, send_result_from_pb, ticket_to_pb

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
_LEASE_SWEEP_S = 1.0


class WorkerPeers:
    """Channels to other workers, opened on first use, for the SendKv a pull needs."""

    def __init__(self, settings: GrpcSettings, provider: TracerProvider) -> None:
        self._settings = settings
        self._provider = provider
        self._stubs: dict[str, worker_pb2_grpc.WorkerServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, self._settings, self._provider)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.WorkerServiceStub(channel)
        return stub

    async def send_kv(
        self,
        address: str,
        ticket: TransferTicket,
        pacing_bps: float,
        deadline_s: float,
        while_prefilling: bool,
    ) -> SendResult:
        request = worker_pb2.SendKvRequest(
            request_id=ticket.request_id,
            ticket=ticket_to_pb(ticket),
            pacing_bps=pacing_bps,
            while_prefilling=while_prefilling,
        )
        try:
            reply = await self._stub(address).SendKv(request, timeout=deadline_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, address) from exc
        return send_result_from_pb(reply)

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], {}
        for channel in channels:
            await channel.close()


@dataclass
class WorkerServerHandle(ServerHandle):
    """A started worker; `stop` deregisters from gossip before draining."""

    engine: WorkerEngine | None = None
    heartbeat: HeartbeatThread | None = None
    advertise_addr: str = ""

    async def stop(self, grace_s: float) -> None:
        if self.heartbeat is not None:
            heartbeat, self.heartbeat = self.heartbeat, None
            await heartbeat.stop(deregister=True, reason="draining")
        await super().stop(grace_s)


def _advertise(config: Config, port: int) -> str:
    if config.advertise_addr:
        return config.advertise_addr
    host = config.listen_addr.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


async def _canary_forever(engine: WorkerEngine, handle: ServerHandle, interval_s: float) -> None:
    """Health is the canary's last verdict: SERVING only while a forward pass works."""
    serving = True
    while True:
        await asyncio.sleep(interval_s)
        try:
            await engine.canary()
            healthy = True
        except Exception:  # noqa: BLE001 - any failure of the model means "not serving"
            log.exception("canary forward pass failed")
            healthy = False
        if healthy != serving:
            serving = healthy
            await handle.set_serving(serving)


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def build_server(
    config: Config, provider: TracerProvider, metrics: Metrics | None = None
) -> WorkerServerHandle:
    """Start a worker on `config.listen_addr`; SERVING once the canary passed."""
    torch.set_num_threads(config.torch_threads)
    dtype = resolve_dtype(config.dtype) if config.dtype else None
    try:
        model = await asyncio.to_thread(Transformer.load, config.model, dtype)
        model_spec(config.model)  # what the cost model prices must read the same files
    except KvrsError as exc:
        # Refused at start-up, naming the file, tensor or setting it cannot run.
        raise ConfigError(f"WORKER_MODEL {config.model}: {exc}") from None
    dtype_name = str(model.dtype).removeprefix("torch.")
    try:
        profile = load_profile(config.model, config.profile_path)
    except KvrsError as exc:
        raise ConfigError(f"WORKER_PROFILE_PATH {config.profile_path}: {exc}") from None
    compute = ComputeQueue(model, profile, config.max_batch_tokens, metrics)
    blocks = config.kv_capacity_bytes // (config.block_tokens * model.kv_bytes_per_token)
    store = KvStore(model.new_pool(blocks, config.block_tokens))
    host = config.transfer_host or _advertise(config, 0).rpartition(":")[0]
    agent = TransferAgent(
        AgentConfig(
            instance_id=config.instance_id,
            host=host,
            port=config.transfer_port,
            timeout_s=config.transfer_timeout_s,
            pacing_bps=config.transfer_pacing_bps or None,
            chunk_tokens=config.transfer_chunk_tokens or config.block_tokens,
            checksums=config.transfer_checksums,
        ),
        provider,
    )
    peers = WorkerPeers(config.grpc, provider)
    engine = WorkerEngine(
        config.instance_id,
        config.model,
        model,
        store,
        compute,
        agent,
        peers.send_kv,
        config.kv_lease_s,
        config.send_kv_deadline_s,
        config.transfer_pacing_bps,
    )
    location = common_pb2.Location(
        node=config.location.node,
        rack=config.location.rack,
        pod=config.location.pod,
        gpu_index=config.location.gpu_index,
    )
    servicer = WorkerServicer(engine, config.role, dtype_name, location, metrics)

    def register(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)

    try:
        base = await start_server(
            register, [SERVICE_NAME], config.listen_addr, config.grpc, provider, serving=False
        )
    except BaseException:
        agent.close()
        compute.close()
        raise
    handle = WorkerServerHandle(
        **{f.name: getattr(base, f.name) for f in fields(base)},
        engine=engine,
        advertise_addr=_advertise(config, base.port),
    )

    async def close_resources() -> None:
        await peers.close()
        agent.close()
        compute.close()

    handle.cleanups.append(close_resources)
    try:
        await engine.canary()
        # Registered before SERVING: whoever waits for health (a launcher, a readiness
        # probe) then finds the worker in the cluster, with its free KV memory.
        if config.gossip_addr:
            handle.heartbeat = await _join_gossip(config, engine, handle.advertise_addr, provider)
        await handle.set_serving(True)
        for task in (
            asyncio.create_task(_canary_forever(engine, handle, config.canary_interval_s)),
            asyncio.create_task(engine.expire_forever(_LEASE_SWEEP_S)),
        ):
            handle.cleanups.append(functools.partial(_cancel, task))
    except BaseException:
        await handle.stop(0)
        raise
    log.info(
        "worker %s (%s, %s %s) serving on %s, transfers on %s",
        config.instance_id,
        config.role,
        config.model,
        dtype_name,
        handle.advertise_addr,
        agent.address,
    )
    return handle


async def _join_gossip(
    config: Config, engine: WorkerEngine, advertise_addr: str, provider: TracerProvider
) -> HeartbeatThread:
    location = config.location
    registration = Registration(
        instance_id=config.instance_id,
        role=config.role,
        address=advertise_addr,
        node=location.node,
        rack=location.rack,
        pod=location.pod,
        gpu_index=location.gpu_index,
        model=config.model,
        kv_capacity_blocks=engine.store.capacity_blocks,
        transfer_address=engine.agent.address,
        heartbeat_ttl_s=config.heartbeat_ttl_s,
        max_batch_tokens=config.max_batch_tokens,
    )

    def load() -> NodeLoad:
        stats = engine.stats()
        return NodeLoad(
            queue_depth=stats.queue_depth,
            queued_work_s=stats.queued_work_s,
            running_requests=stats.running_requests,
            free_kv_blocks=stats.free_kv_blocks,
            resident_prefix_hashes=tuple(stats.resident_prefix_hashes),
            compute_factor=stats.compute_factor,
            running_context_tokens=stats.running_context_tokens,
        )

    def forget_requests(declared_failed: bool) -> None:
        # Only a failure declaration moved this worker's decode streams elsewhere (perhaps
        # only because its heartbeats were late): then a decode worker drops their KV. A
        # registry that lost its data (a Redis restart) declared nothing: every stream is
        # still decoding here. A prefill worker keeps its KV under the leases it has either
        # way: a migration still reads it, and the router releases it when its request ends.
        if not declared_failed:
            log.warning("re-registered with a registry that had forgotten it; requests kept")
            return
        if config.role == "prefill":
            log.warning("re-registered after being declared failed; KV kept under its leases")
            return
        request_ids = engine.store.request_ids()
        for request_id in request_ids:
            engine.store.release(request_id)
        log.warning(
            "re-registered after being declared failed; released %d requests", len(request_ids)
        )

    heartbeat = HeartbeatThread(
        config.gossip_addr,
        config.grpc,
        provider,
        registration,
        load=load,
        on_reregistered=forget_requests,
        interval_s=config.heartbeat_interval_s or None,
    )
    await heartbeat.start()
    return heartbeat


async def serve(config: Config, provider: TracerProvider) -> None:
    """Run a worker until SIGTERM/SIGINT, then drain and shut down."""
    metrics = Metrics()
    serve_metrics(metrics, config.metrics_addr)
    handle = await build_server(config, provider, metrics)
    await run_until_signal(handle, config.grpc, provider)
