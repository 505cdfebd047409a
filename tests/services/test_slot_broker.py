"""Slot broker against the real Redis and a real gRPC server: caps, leases, expiry, input."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
import redis.asyncio as redis_async
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.errors import ResourceExhausted
from kvrs.v1 import slots_pb2, slots_pb2_grpc
from services.common import (
    ConfigError,
    GrpcSettings,
    ServerHandle,
    connect_redis,
    open_channel,
    setup_tracing,
    slot_leases,
)
from services.common.slot_leases import SlotStore
from services.slot_broker.config import Config
from services.slot_broker.server import build_server


async def start_broker(redis_url: str, redis_prefix: str, **overrides) -> ServerHandle:
    fields = dict(
        listen_addr="127.0.0.1:0",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        cluster_cap=3,
        lease_ttl_s=5.0,
        purge_interval_s=0.1,
    )
    fields.update(overrides)
    provider = setup_tracing("test-slot-broker", exporter=InMemorySpanExporter())
    return await build_server(Config(**fields), provider)


class Broker:
    """A started broker and a stub on it."""

    def __init__(self, handle: ServerHandle, redis_url: str = "") -> None:
        self.handle = handle
        self.redis_url = redis_url
        self.channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
        self.stub = slots_pb2_grpc.SlotBrokerServiceStub(self.channel)

    async def reserve(
        self,
        request_id: str,
        src: str = "p0",
        dst: str = "d0",
        holder: str = "sched-0",
        ttl_s: float = 0.0,
    ):
        return await self.stub.ReserveSlot(
            slots_pb2.ReserveSlotRequest(
                request_id=request_id,
                holder_id=holder,
                src_instance_id=src,
                dst_instance_id=dst,
                ttl_s=ttl_s,
            ),
            timeout=5,
        )

    async def stats(self) -> slots_pb2.GetSlotStatsResponse:
        return await self.stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=5)

    async def close(self) -> None:
        await self.channel.close()
        await self.handle.stop(0)


@pytest.fixture
async def broker(any_redis_url, redis_prefix):
    """On one Redis and on a three-primary Redis Cluster."""
    started = Broker(await start_broker(any_redis_url, redis_prefix), any_redis_url)
    yield started
    await started.close()


async def expect_code(awaitable, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await awaitable
    assert failure.value.code() == code, failure.value.details()
    return failure.value.details()


def reserve_request(**overrides) -> slots_pb2.ReserveSlotRequest:
    fields = dict(
        request_id="m1", holder_id="sched-0", src_instance_id="p0", dst_instance_id="d0", ttl_s=1.0
    )
    fields.update(overrides)
    return slots_pb2.ReserveSlotRequest(**fields)


BAD_INPUTS = [
    ("ReserveSlot", reserve_request(request_id=""), "request_id"),
    ("ReserveSlot", reserve_request(holder_id=""), "holder_id"),
    ("ReserveSlot", reserve_request(src_instance_id=""), "src_instance_id"),
    ("ReserveSlot", reserve_request(dst_instance_id=""), "dst_instance_id"),
    ("ReserveSlot", reserve_request(dst_instance_id="p0"), "dst_instance_id"),
    ("ReserveSlot", reserve_request(ttl_s=-1.0), "ttl_s"),
    ("ReserveSlot", reserve_request(ttl_s=float("nan")), "ttl_s"),
    ("ReserveSlot", reserve_request(ttl_s=float("inf")), "ttl_s"),
    ("ReserveSlot", reserve_request(ttl_s=10_000.0), "ttl_s"),
    ("RenewSlot", slots_pb2.RenewSlotRequest(lease_id=""), "lease_id"),
    ("RenewSlot", slots_pb2.RenewSlotRequest(lease_id="x", ttl_s=float("nan")), "ttl_s"),
    ("ReleaseSlot", slots_pb2.ReleaseSlotRequest(lease_id=""), "lease_id"),
]


@pytest.mark.parametrize(("method", "request_message", "field"), BAD_INPUTS)
async def test_bad_input_is_invalid_argument_naming_the_field(
    broker, method, request_message, field
):
    details = await expect_code(
        getattr(broker.stub, method)(request_message, timeout=5),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert details.startswith(f"{field}:"), details
    assert (await broker.stats()).slots_in_use == 0


async def test_unknown_lease_is_not_found_and_release_is_idempotent(broker):
    await expect_code(
        broker.stub.RenewSlot(slots_pb2.RenewSlotRequest(lease_id="nope"), timeout=5),
        grpc.StatusCode.NOT_FOUND,
    )
    reply = await broker.reserve("m1")
    release = slots_pb2.ReleaseSlotRequest(lease_id=reply.lease.lease_id)
    assert (await broker.stub.ReleaseSlot(release, timeout=5)).released
    assert not (await broker.stub.ReleaseSlot(release, timeout=5)).released
    unknown = slots_pb2.ReleaseSlotRequest(lease_id="nope")
    assert not (await broker.stub.ReleaseSlot(unknown, timeout=5)).released
    await expect_code(
        broker.stub.RenewSlot(slots_pb2.RenewSlotRequest(lease_id=reply.lease.lease_id), timeout=5),
        grpc.StatusCode.NOT_FOUND,
    )


async def test_retries_with_one_request_id_get_the_same_lease(broker):
    first = await broker.reserve("m1", ttl_s=2.0)
    again = await broker.reserve("m1", ttl_s=2.0)
    assert again.lease == first.lease
    assert first.lease.request_id == "m1" and first.lease.holder_id == "sched-0"
    assert (first.lease.src_instance_id, first.lease.dst_instance_id) == ("p0", "d0")
    assert again.slots_in_use == 1 and again.cluster_cap == 3
    stats = await broker.stats()
    assert (stats.slots_in_use, stats.granted_total) == (1, 1)
    # Another scheduler replica retrying after a lost reply gets the lease too.
    elsewhere = await broker.reserve("m1", holder="sched-1")
    assert elsewhere.lease == first.lease
    release = slots_pb2.ReleaseSlotRequest(lease_id=first.lease.lease_id)
    await broker.stub.ReleaseSlot(release, timeout=5)
    fresh = await broker.reserve("m1")
    assert fresh.lease.lease_id != first.lease.lease_id


async def test_a_request_recovered_again_over_another_link_moves_its_lease(broker):
    first = await broker.reserve("m1", dst="d0")
    await broker.reserve("m2", dst="d2")
    moved = await broker.reserve("m1", dst="d1", holder="sched-1")
    assert moved.lease.lease_id != first.lease.lease_id
    assert (moved.lease.dst_instance_id, moved.lease.holder_id) == ("d1", "sched-1")
    assert moved.slots_in_use == 2
    stats = await broker.stats()
    assert {(link.dst_instance_id, link.in_use) for link in stats.links} == {("d1", 1), ("d2", 1)}
    renew = slots_pb2.RenewSlotRequest(lease_id=first.lease.lease_id)
    await expect_code(broker.stub.RenewSlot(renew, timeout=5), grpc.StatusCode.NOT_FOUND)
    # The cap still holds: a third request finds the one free slot, a fourth none.
    await broker.reserve("m3", dst="d3")
    await expect_code(broker.reserve("m4", dst="d4"), grpc.StatusCode.RESOURCE_EXHAUSTED)


async def test_cluster_cap_is_resource_exhausted_naming_the_cap(broker):
    leases = [(await broker.reserve(f"m{i}", dst=f"d{i}")).lease for i in range(3)]
    details = await expect_code(broker.reserve("m3", dst="d3"), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert details.startswith("cluster_cap:"), details
    await broker.stub.ReleaseSlot(
        slots_pb2.ReleaseSlotRequest(lease_id=leases[0].lease_id), timeout=5
    )
    assert (await broker.reserve("m3", dst="d3")).slots_in_use == 3
    stats = await broker.stats()
    assert (stats.slots_in_use, stats.cluster_cap) == (3, 3)
    assert (stats.granted_total, stats.denied_total) == (4, 1)


async def test_per_link_cap(redis_url, redis_prefix):
    broker = Broker(await start_broker(redis_url, redis_prefix, cluster_cap=10, link_cap=2))
    try:
        await broker.reserve("m0", src="a", dst="b")
        await broker.reserve("m1", src="a", dst="b")
        details = await expect_code(
            broker.reserve("m2", src="a", dst="b"), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert details.startswith("link_cap:"), details
        await broker.reserve("m3", src="b", dst="a")
        await broker.reserve("m4", src="a", dst="c")
        stats = await broker.stats()
        links = {
            (link.src_instance_id, link.dst_instance_id): (link.in_use, link.cap)
            for link in stats.links
        }
        assert links == {("a", "b"): (2, 2), ("b", "a"): (1, 2), ("a", "c"): (1, 2)}
        assert (stats.slots_in_use, stats.denied_total) == (4, 1)
    finally:
        await broker.close()


async def test_expired_lease_frees_its_slot(redis_url, redis_prefix):
    broker = Broker(
        await start_broker(redis_url, redis_prefix, cluster_cap=1, purge_interval_s=30.0)
    )
    try:
        held = await broker.reserve("m0", ttl_s=0.3)
        await expect_code(broker.reserve("m1", dst="d1"), grpc.StatusCode.RESOURCE_EXHAUSTED)
        await asyncio.sleep(0.45)
        taken = await broker.reserve("m1", dst="d1")
        assert taken.slots_in_use == 1
        stats = await broker.stats()
        assert (stats.expired_total, stats.granted_total) == (1, 2)
        await expect_code(
            broker.stub.RenewSlot(
                slots_pb2.RenewSlotRequest(lease_id=held.lease.lease_id), timeout=5
            ),
            grpc.StatusCode.NOT_FOUND,
        )
        release = slots_pb2.ReleaseSlotRequest(lease_id=held.lease.lease_id)
        assert not (await broker.stub.ReleaseSlot(release, timeout=5)).released
    finally:
        await broker.close()


async def test_renewal_keeps_a_lease_past_its_ttl(broker):
    # Renewed every third of its TTL (room for a loaded machine's stalls), for 1.5 TTLs.
    lease = (await broker.reserve("m0", ttl_s=1.0)).lease
    expires_ms = lease.expires_unix_ms
    for _ in range(5):
        await asyncio.sleep(0.3)
        renewed = await broker.stub.RenewSlot(
            slots_pb2.RenewSlotRequest(lease_id=lease.lease_id, ttl_s=1.0), timeout=5
        )
        assert renewed.lease.expires_unix_ms > expires_ms
        expires_ms = renewed.lease.expires_unix_ms
    stats = await broker.stats()
    assert (stats.slots_in_use, stats.expired_total) == (1, 0)


async def test_sweeper_returns_slots_without_any_call(redis_url, redis_prefix):
    broker = Broker(await start_broker(redis_url, redis_prefix, purge_interval_s=0.05))
    client = redis_async.Redis.from_url(redis_url)
    try:
        await broker.reserve("m0", ttl_s=0.2)
        await broker.reserve("m1", dst="d1", ttl_s=0.2)
        leases_key = f"{redis_prefix}slots:leases"
        assert await client.zcard(leases_key) == 2
        await asyncio.sleep(0.5)
        assert await client.zcard(leases_key) == 0
        assert await client.hgetall(f"{redis_prefix}slots:links") == {}
        assert int(await client.hget(f"{redis_prefix}slots:totals", "expired")) == 2
    finally:
        await client.aclose()
        await broker.close()


async def test_the_broker_puts_its_caps_back_when_redis_lost_them(redis_url, redis_prefix):
    broker = Broker(
        await start_broker(redis_url, redis_prefix, cluster_cap=5, purge_interval_s=0.05)
    )
    client = redis_async.Redis.from_url(redis_url)
    policy_key = f"{redis_prefix}slots:policy"
    try:
        assert int(await client.hget(policy_key, "cluster_cap")) == 5
        await client.delete(policy_key)
        await asyncio.sleep(0.3)
        assert int(await client.hget(policy_key, "cluster_cap")) == 5, "the sweeper restores it"
        await client.delete(policy_key)
        assert (await broker.reserve("m0")).cluster_cap == 5, "a reservation restores it too"
    finally:
        await client.aclose()
        await broker.close()


async def test_two_brokers_share_one_cap(redis_url, redis_prefix):
    first = Broker(await start_broker(redis_url, redis_prefix, cluster_cap=2))
    second = Broker(await start_broker(redis_url, redis_prefix, cluster_cap=2))
    try:
        await first.reserve("m0")
        await second.reserve("m1", dst="d1")
        await expect_code(first.reserve("m2", dst="d2"), grpc.StatusCode.RESOURCE_EXHAUSTED)
        await expect_code(second.reserve("m2", dst="d2"), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert (await second.reserve("m0")).slots_in_use == 2, "a retry via another replica"
    finally:
        await first.close()
        await second.close()


def test_config_from_env_names_the_bad_variable():
    config = Config.from_env({"SLOT_BROKER_CLUSTER_CAP": "8", "SLOT_BROKER_LINK_CAP": "2"})
    assert (config.cluster_cap, config.link_cap, config.lease_ttl_s) == (8, 2, 10.0)
    assert config.listen_addr == "0.0.0.0:50054"
    with pytest.raises(ConfigError, match="SLOT_BROKER_CLUSTER_CAP"):
        Config.from_env({"SLOT_BROKER_CLUSTER_CAP": "0"})
    with pytest.raises(ConfigError, match="SLOT_BROKER_LINK_CAP"):
        Config.from_env({"SLOT_BROKER_LINK_CAP": "-1"})
    with pytest.raises(ConfigError, match="SLOT_BROKER_LEASE_TTL_S"):
        Config.from_env({"SLOT_BROKER_LEASE_TTL_S": "ten"})


async def test_a_reserve_call_run_twice_is_one_denial(broker, redis_prefix, monkeypatch):
    """The Redis client re-sends a script after a timeout (or a failover) with the same
    arguments, the attempt id among them: the second run answers what the first did and
    the denial is counted once; a new call is a new attempt."""
    for i in range(3):
        await broker.reserve(f"m{i}", dst=f"d{i}")
    client = connect_redis(broker.redis_url)
    store = SlotStore(client, redis_prefix)
    attempt = SimpleNamespace(hex="attempt-1")
    monkeypatch.setattr(slot_leases, "uuid", SimpleNamespace(uuid4=lambda: attempt))
    try:
        for _ in range(2):
            with pytest.raises(ResourceExhausted, match="3 of 3"):
                await store.reserve("late", "sched-0", "p0", "d9")
        assert (await broker.stats()).denied_total == 1
        attempt = SimpleNamespace(hex="attempt-2")
        with pytest.raises(ResourceExhausted):
            await store.reserve("late", "sched-0", "p0", "d9")
        assert (await broker.stats()).denied_total == 2
    finally:
        await client.aclose()
