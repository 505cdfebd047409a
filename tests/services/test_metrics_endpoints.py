"""Scheduler, slot broker and gossip record decisions, leases and membership on a scraped
Prometheus endpoint."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, slots_pb2, slots_pb2_grpc
from services.common import GrpcSettings, open_channel, setup_tracing
from services.common.decision_inputs import InputsConfig
from services.common.gossip_records import Registration
from services.common.metrics import Metrics, serve_metrics
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.scheduler.config import Config as SchedulerConfig
from services.scheduler.server import build_server as build_scheduler
from services.slot_broker.config import Config as BrokerConfig
from services.slot_broker.server import build_server as build_broker

# (instance id, role, node, rack)
CLUSTER = (
    ("prefill-0", "prefill", "n0", "r0"),
    ("decode-near", "decode", "n0", "r0"),
    ("decode-rack", "decode", "n1", "r0"),
)


async def scrape(metrics: Metrics) -> str:
    port = serve_metrics(metrics, "127.0.0.1:0")
    url = f"http://127.0.0.1:{port}/metrics"

    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()

    return await asyncio.to_thread(get)


def sample(text: str, line_start: str) -> float:
    """The value of the one sample whose line starts with `line_start`."""
    values = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(line_start)]
    assert len(values) == 1, (line_start, values)
    return float(values[0])


@pytest.fixture
def provider():
    return setup_tracing("test-metrics", exporter=InMemorySpanExporter())


async def test_slot_broker_exports_slots_in_use_and_request_outcomes(
    redis_url, redis_prefix, provider
):
    metrics = Metrics()
    handle = await build_broker(
        BrokerConfig(
            listen_addr="127.0.0.1:0", redis_url=redis_url, redis_prefix=redis_prefix, cluster_cap=1
        ),
        provider,
        metrics=metrics,
    )
    channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
    stub = slots_pb2_grpc.SlotBrokerServiceStub(channel)
    try:

        def reserve(request_id: str) -> slots_pb2.ReserveSlotRequest:
            return slots_pb2.ReserveSlotRequest(
                request_id=request_id, holder_id="s0", src_instance_id="p0", dst_instance_id="d0"
            )

        granted = await stub.ReserveSlot(reserve("m1"), timeout=5)
        text = await scrape(metrics)
        assert sample(text, "kvrs_slots_in_use ") == 1.0
        assert sample(text, 'kvrs_slot_requests_total{outcome="granted"}') == 1.0

        with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
            await stub.ReserveSlot(reserve("m2"), timeout=5)
        await stub.ReleaseSlot(
            slots_pb2.ReleaseSlotRequest(lease_id=granted.lease.lease_id), timeout=5
        )
        text = await scrape(metrics)
        assert sample(text, 'kvrs_slot_requests_total{outcome="denied"}') == 1.0
        assert sample(text, "kvrs_slots_in_use ") == 0.0
    finally:
        await channel.close()
        await handle.stop(0)


async def test_scheduler_exports_decisions_predicted_costs_and_slot_outcomes(
    redis_url, redis_prefix, provider
):
    gossip_handle = await build_gossip(
        GossipConfig(listen_addr="127.0.0.1:0", redis_url=redis_url, redis_prefix=redis_prefix),
        provider,
    )
    broker_handle = await build_broker(
        BrokerConfig(listen_addr="127.0.0.1:0", redis_url=redis_url, redis_prefix=redis_prefix),
        provider,
    )
    gossip = GossipClient(f"127.0.0.1:{gossip_handle.port}", timeout_s=5)
    closers = [lambda: gossip_handle.stop(0), lambda: broker_handle.stop(0), gossip.close]
    try:
        for instance_id, role, node, rack in CLUSTER:
            await gossip.register(
                Registration(
                    instance_id=instance_id,
                    role=role,
                    address=f"{instance_id}:50060",
                    node=node,
                    rack=rack,
                    pod="p0",
                    transfer_address=f"{instance_id}:29500",
                    heartbeat_ttl_s=600.0,
                )
            )
        metrics = Metrics()
        handle = await build_scheduler(
            SchedulerConfig(
                listen_addr="127.0.0.1:0",
                gossip_addr=f"127.0.0.1:{gossip_handle.port}",
                slot_broker_addr=f"127.0.0.1:{broker_handle.port}",
                holder_id="test-scheduler",
                inputs=InputsConfig(model="opt-125m"),
                redis_url=redis_url,
                redis_prefix=redis_prefix,
            ),
            provider,
            metrics,
        )
        closers.append(lambda: handle.stop(0))
        channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
        closers.append(channel.close)
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

        reply = await stub.Recover(
            scheduler_pb2.RecoverRequest(
                request_id="req-1",
                failed_instance_id="decode-near",
                source_prefill_instance_id="prefill-0",
                prompt_tokens=1000,
                generated_tokens=20,
            ),
            timeout=5,
        )
        assert reply.action == common_pb2.RECOVERY_ACTION_MIGRATE, reply.reason
        await stub.SelectDecode(
            scheduler_pb2.SelectDecodeRequest(
                request_id="req-2",
                prefill_instance_id="prefill-0",
                prompt_tokens=512,
            ),
            timeout=5,
        )

        text = await scrape(metrics)
        assert sample(text, 'kvrs_decisions_total{action="migrate",decision="recover"}') == 1.0
        assert sample(text, 'kvrs_decisions_total{action="placed",decision="select_decode"}') == 1.0
        assert sample(text, 'kvrs_slot_requests_total{outcome="granted"}') == 1.0
        assert sample(text, 'kvrs_recovery_predicted_seconds_count{action="migrate"}') == 1.0
        assert sample(text, 'kvrs_recovery_predicted_seconds_sum{action="migrate"}') == (
            pytest.approx(reply.predicted_cost_s)
        )
        assert sample(text, 'kvrs_decision_latency_seconds_count{decision="recover"}') == 1.0
        assert sample(text, "kvrs_telemetry_age_seconds ") >= 0.0
    finally:
        while closers:
            await closers.pop()()


async def test_gossip_exports_alive_instances_failures_departures_and_heartbeats(
    redis_url, redis_prefix, provider
):
    metrics = Metrics()
    handle = await build_gossip(
        GossipConfig(
            listen_addr="127.0.0.1:0",
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            heartbeat_ttl_s=0.3,
            sweep_interval_s=0.05,
        ),
        provider,
        metrics=metrics,
    )
    client = GossipClient(f"127.0.0.1:{handle.port}", timeout_s=5)
    try:
        for instance_id, role, _, _ in CLUSTER:
            await client.register(Registration(instance_id, role, f"{instance_id}:1"))
        await client.heartbeat("decode-near")
        await client.deregister("decode-rack", "drained")
        await client.list_nodes()
        text = await scrape(metrics)
        assert sample(text, 'kvrs_instances_alive{role="decode"}') == 1.0
        assert sample(text, 'kvrs_instances_alive{role="prefill"}') == 1.0
        assert sample(text, 'kvrs_membership_events_total{type="left"}') == 1.0
        assert sample(text, 'kvrs_heartbeats_total{outcome="ok"}') == 1.0

        # One TTL of silence makes both suspect; two more (GOSSIP_CONFIRM_TTLS) confirm them
        # failed, and the sweep declares it.
        await asyncio.sleep(1.2)
        with pytest.raises(Exception, match="register"):
            await client.heartbeat("decode-near")
        await client.list_nodes()
        text = await scrape(metrics)
        assert sample(text, 'kvrs_membership_events_total{type="failed"}') == 2.0
        assert sample(text, 'kvrs_heartbeats_total{outcome="not_alive"}') == 1.0
        assert sample(text, 'kvrs_instances_alive{role="decode"}') == 0.0
    finally:
        await client.close()
        await handle.stop(0)
