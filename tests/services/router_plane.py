"""An in-process kvrs cluster for router and prober tests: real gossip, slot broker and
scheduler on the test Redis, four real tiny-model workers (float64, bit-exact), one
tracer provider with an in-memory exporter shared by every server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.v1 import (
    slots_pb2,
    slots_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common import GrpcSettings, Metrics, open_channel, setup_tracing
from services.common.decision_inputs import InputsConfig
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.router.config import Config as RouterConfig
from services.router.server import build_server as build_router
from services.scheduler.config import Config as SchedulerConfig
from services.scheduler.server import build_server as build_scheduler
from services.slot_broker.config import Config as BrokerConfig
from services.slot_broker.server import build_server as build_broker
from services.worker.config import Config as WorkerConfig
from services.worker.server import build_server as build_worker

WORKERS = (
    ("prefill-0", "prefill"),
    ("prefill-1", "prefill"),
    ("decode-0", "decode"),
    ("decode-1", "decode"),
)


@dataclass
class Plane:
    redis_url: str
    redis_prefix: str
    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    handles: dict = field(default_factory=dict)
    closers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.provider = setup_tracing("test-router", exporter=self.exporter)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.handles[name].port}"

    async def start(
        self, router: bool = True, workers=WORKERS, worker_overrides=None, **router_overrides
    ) -> None:
        self.handles["gossip"] = await build_gossip(
            GossipConfig(
                listen_addr="127.0.0.1:0",
                redis_url=self.redis_url,
                redis_prefix=self.redis_prefix,
                heartbeat_ttl_s=2.0,
                sweep_interval_s=0.05,
            ),
            self.provider,
        )
        self.handles["slot-broker"] = await build_broker(
            BrokerConfig(
                listen_addr="127.0.0.1:0", redis_url=self.redis_url, redis_prefix=self.redis_prefix
            ),
            self.provider,
        )
        self.handles["scheduler"] = await build_scheduler(
            SchedulerConfig(
                listen_addr="127.0.0.1:0",
                gossip_addr=self.address("gossip"),
                slot_broker_addr=self.address("slot-broker"),
                inputs=InputsConfig(model="tiny"),
                view_refresh_s=0.05,
                redis_url=self.redis_url,
                redis_prefix=self.redis_prefix,
            ),
            self.provider,
        )
        self.gossip = GossipClient(self.address("gossip"), timeout_s=5)
        self.closers.append(self.gossip.close)
        for name, role in workers:
            await self.add_worker(name, role, wait=False, **(worker_overrides or {}))
        await self.wait_for_heartbeats([name for name, _ in workers])
        if router:
            self.metrics = Metrics()
            config = RouterConfig(
                listen_addr="127.0.0.1:0",
                gossip_addr=self.address("gossip"),
                scheduler_addrs=(self.address("scheduler"),),
                slot_broker_addr=self.address("slot-broker"),
                model="tiny",
                view_refresh_s=0.05,
                **router_overrides,
            )
            self.handles["router"] = await build_router(config, self.provider, self.metrics)

    async def add_worker(self, name: str, role: str, wait: bool = True, **overrides) -> None:
        """Starts a tiny worker; with `wait`, until the scheduler can place work on it."""
        self.handles[name] = await build_worker(
            WorkerConfig(
                instance_id=name,
                role=role,
                listen_addr="127.0.0.1:0",
                transfer_host="127.0.0.1",
                transfer_timeout_s=10.0,
                canary_interval_s=30.0,
                gossip_addr=self.address("gossip"),
                heartbeat_interval_s=0.1,
                **overrides,
            ),
            self.provider,
        )
        if wait:
            await self.wait_for_heartbeats([name])

    async def wait_for_heartbeats(self, names, timeout_s: float = 10.0) -> None:
        """Until gossip lists every named worker with free KV memory to place work on."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            nodes = {n.registration.instance_id: n for n in await self.gossip.list_nodes()}
            if all(name in nodes and nodes[name].load.free_kv_blocks > 0 for name in names):
                break
            assert asyncio.get_running_loop().time() < deadline, "workers sent no heartbeat"
            await asyncio.sleep(0.05)
        # The scheduler re-reads gossip every 50 ms.
        await asyncio.sleep(0.15)

    async def stop(self) -> None:
        for close in reversed(self.closers):
            await close()
        # The scheduler stops before the workers: their "left" events would otherwise
        # arrive while it cancels its view refresh.
        services = ("router", "scheduler", "slot-broker", "gossip")
        workers = [name for name in self.handles if name not in services]
        for name in ("router", "scheduler", *workers, "slot-broker", "gossip"):
            handle = self.handles.pop(name, None)
            if handle is not None:
                await handle.stop(0)

    def channel(self, name: str):
        channel = open_channel(self.address(name), GrpcSettings(), self.provider)
        self.closers.append(channel.close)
        return channel

    async def resident_requests(self, name: str) -> int:
        stub = worker_pb2_grpc.WorkerServiceStub(self.channel(name))
        stats = await stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5)
        return stats.resident_requests

    async def slots_in_use(self) -> int:
        stub = slots_pb2_grpc.SlotBrokerServiceStub(self.channel("slot-broker"))
        stats = await stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=5)
        return stats.slots_in_use
