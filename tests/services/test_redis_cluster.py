"""Gossip and the slot broker on a real Redis Cluster: three primaries with a replica
each, started by the test on loopback, and a primary failing over under load."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.errors import KvrsError, ResourceExhausted, Unavailable
from kvrs.v1 import slots_pb2, slots_pb2_grpc
from services.common import (
    ConfigError,
    GrpcSettings,
    Keys,
    connect_redis,
    open_channel,
    setup_tracing,
)
from services.common.gossip_records import LinkSample, NodeEvent, NodeLoad, Registration
from services.common.redis_store import cluster_nodes
from services.common.slot_leases import SlotStore
from services.gossip.client import GossipClient
from services.gossip.config import CLUSTER_SHARDS
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.slot_broker.config import Config as BrokerConfig
from services.slot_broker.server import build_server as build_broker
from tests.redis_cluster import LocalRedisCluster
from tests.services.test_scheduler import CLUSTER as SCHEDULER_CLUSTER
from tests.services.test_scheduler import MIGRATE, RECOMPUTE, Plane, recover

T = TypeVar("T")
INSTANCES = 48
CAP = 4


@pytest.fixture
def redis_cluster(tmp_path):
    """Six `redis-server`s in the test's temporary directory, all stopped after it (each
    test fails primaries over, so each gets a cluster of its own)."""
    cluster = LocalRedisCluster(tmp_path / "redis-cluster").start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def tag() -> str:
    return f"kvrs-test-{uuid.uuid4().hex[:12]}"


def _keys_per_primary(cluster: LocalRedisCluster, tag: str) -> dict[int, int]:
    counts = {}
    for port in cluster.primaries():
        with contextlib.closing(cluster.node(port)) as node:
            counts[port] = sum(1 for _ in node.scan_iter(match=f"{{{tag}*", count=1000))
    return counts


async def _retried(call: Callable[[], Awaitable[T]], attempts: int = 20) -> T:
    """`call()`, again after UNAVAILABLE: what a caller does when the cluster client lost a
    connection (on a loaded machine it can, between the test's calls)."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except Unavailable:
            await asyncio.sleep(0.1)
    return await call()


def _decode(index: int) -> Registration:
    instance_id = f"decode-{index}"
    return Registration(
        instance_id=instance_id,
        role="decode",
        address=f"127.0.0.1:{1 + index}",
        pod=f"pod-{index % 4}",
        model="tiny",
        kv_capacity_blocks=64,
    )


async def _gossip(cluster: LocalRedisCluster, tag: str):
    config = GossipConfig.from_env(
        {
            "REDIS_URL": cluster.url,
            "KVRS_REDIS_PREFIX": f"{{{tag}}}:",
            "GOSSIP_LISTEN_ADDR": "127.0.0.1:0",
            "GOSSIP_HEARTBEAT_TTL_S": "5",
            "GOSSIP_CONFIRM_TTLS": "1",
            "GOSSIP_SWEEP_INTERVAL_S": "0.1",
        }
    )
    assert config.registry_shards == CLUSTER_SHARDS
    return await build_gossip(config, setup_tracing("test-gossip", exporter=InMemorySpanExporter()))


async def test_gossip_spreads_over_the_primaries_and_loses_nothing_when_one_is_killed(
    redis_cluster, tag
):
    """Two gossip replicas on the cluster: instances beat to one, views read the other.
    The primary holding the most registry keys is killed; its replica takes over, the
    beats resume, and no instance is declared failed or forgotten."""
    writer, reader = await _gossip(redis_cluster, tag), await _gossip(redis_cluster, tag)
    # Generous deadlines: six redis-servers and two gossip replicas share a loaded machine.
    beats = GossipClient(f"127.0.0.1:{writer.port}", timeout_s=30)
    views = GossipClient(f"127.0.0.1:{reader.port}", timeout_s=30)
    events: list[NodeEvent] = []
    outcomes = {"ok": 0, "error": 0}
    stop = asyncio.Event()

    async def watch() -> None:
        async for event in views.watch_events("0"):
            events.append(event)

    async def beat_all(round_: int) -> None:
        async def one(index: int) -> None:
            try:
                await beats.heartbeat(f"decode-{index}", NodeLoad(queue_depth=round_ % 3))
                outcomes["ok"] += 1
            except KvrsError:
                outcomes["error"] += 1

        await asyncio.gather(*(one(index) for index in range(INSTANCES)))

    async def keep_beating() -> None:
        round_ = 0
        while not stop.is_set():
            await beat_all(round_)
            round_ += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.3)

    watcher = asyncio.create_task(watch())
    beater: asyncio.Task | None = None
    try:
        for index in range(INSTANCES):
            await _retried(lambda index=index: beats.register(_decode(index)))
        await _retried(lambda: beats.report_link_sample(LinkSample("decode-0", "decode-1", 1e9)))
        await _retried(lambda: beats.report_link_sample(LinkSample("decode-7", "decode-2", 2e9)))
        await beat_all(0)

        listed = await _retried(views.list_nodes)
        assert sorted(n.registration.instance_id for n in listed) == sorted(
            f"decode-{i}" for i in range(INSTANCES)
        )
        assert {n.state for n in listed} == {"alive"}
        links = await _retried(views.list_links)
        assert [(r.sample.src_instance_id, r.sample.dst_instance_id) for r in links] == [
            ("decode-0", "decode-1"),
            ("decode-7", "decode-2"),
        ]
        full = await _retried(lambda: views.list_changes(""))
        assert full.full and len(full.nodes) == INSTANCES
        await _retried(lambda: beats.heartbeat("decode-5", NodeLoad(queue_depth=9)))
        delta = await _retried(lambda: views.list_changes(full.change_id))
        assert not delta.full
        assert [n.registration.instance_id for n in delta.nodes] == ["decode-5"]
        assert delta.nodes[0].load.queue_depth == 9

        per_primary = _keys_per_primary(redis_cluster, tag)
        print(f"registry keys per primary: {per_primary}")
        assert sum(1 for count in per_primary.values() if count) >= 2, per_primary

        beater = asyncio.create_task(keep_beating())
        await asyncio.sleep(0.5)
        victim = max(per_primary, key=lambda port: per_primary[port])
        killed_s = time.monotonic()
        await asyncio.to_thread(redis_cluster.kill, victim)
        promoted_s = time.monotonic() - killed_s
        ok_at_failover = outcomes["ok"]
        # Every instance beats at least twice more: beats of the dead primary's shards
        # wait out the client's retries, then go to the promoted replica.
        while outcomes["ok"] < ok_at_failover + 2 * INSTANCES:
            assert time.monotonic() - killed_s < 60, f"heartbeats did not resume: {outcomes}"
            await asyncio.sleep(0.1)
        print(
            f"killed primary {victim}: replica promoted after {promoted_s:.1f} s, beats "
            f"flowing again after {time.monotonic() - killed_s:.1f} s; {outcomes['error']} "
            f"heartbeats failed, {outcomes['ok']} succeeded in all"
        )

        listed = await _retried(views.list_nodes)
        assert len(listed) == INSTANCES and {n.state for n in listed} == {"alive"}
        await _retried(lambda: beats.register(_decode(INSTANCES)))
        assert len(await _retried(views.list_nodes)) == INSTANCES + 1
        await asyncio.sleep(0.5)
        joined = {e.instance_id for e in events if e.type == "joined"}
        assert joined == {f"decode-{i}" for i in range(INSTANCES + 1)}
        assert [e for e in events if e.type == "failed"] == []
    finally:
        stop.set()
        if beater is not None:
            await beater
        await views.close()
        await beats.close()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await writer.stop(0)
        await reader.stop(0)


async def test_slot_cap_stays_exact_across_a_primary_failover(redis_cluster, tag):
    """Claimants through the broker and straight in Redis (as a scheduler reserves)
    contend for CAP slots while the primary holding the slots fails over; then CAP
    leases held through a second failover are all still there, and still the cap."""
    prefix = f"{{{tag}}}:"
    handle = await build_broker(
        BrokerConfig(
            listen_addr="127.0.0.1:0",
            redis_url=redis_cluster.url,
            redis_prefix=prefix,
            cluster_cap=CAP,
            lease_ttl_s=30.0,
            purge_interval_s=0.1,
        ),
        setup_tracing("test-broker", exporter=InMemorySpanExporter()),
    )
    channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
    stub = slots_pb2_grpc.SlotBrokerServiceStub(channel)
    direct_client = connect_redis(redis_cluster.url)
    direct = SlotStore(direct_client, prefix)
    held = peak = granted = denied = 0
    failures: list[str] = []

    async def reserve(request_id: str, via_broker: bool) -> str | None:
        """The lease id, or None when a cap said no; a call that failed (the failover)
        is retried with the same request id, which gets its lease back if it had one."""
        for _ in range(50):
            try:
                if via_broker:
                    reply = await stub.ReserveSlot(
                        slots_pb2.ReserveSlotRequest(
                            request_id=request_id,
                            holder_id="broker-client",
                            src_instance_id="p0",
                            dst_instance_id="d0",
                        ),
                        timeout=10,
                    )
                    return reply.lease.lease_id
                grant = await direct.reserve(request_id, "scheduler", "p0", "d0")
                return grant.lease.lease_id
            except ResourceExhausted:
                return None
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    return None
                failures.append(exc.code().name)
            except Exception as exc:  # noqa: BLE001 - Redis errors while the primary moves
                failures.append(type(exc).__name__)
            await asyncio.sleep(0.05)
        raise AssertionError(f"reservation {request_id} never got an answer: {failures}")

    async def release(lease_id: str) -> None:
        for _ in range(50):
            try:
                await stub.ReleaseSlot(slots_pb2.ReleaseSlotRequest(lease_id=lease_id), timeout=10)
                return
            except grpc.aio.AioRpcError as exc:
                failures.append(exc.code().name)
                await asyncio.sleep(0.05)

    async def claimant(index: int, attempts: int) -> None:
        nonlocal held, peak, granted, denied
        for attempt in range(attempts):
            lease_id = await reserve(f"c{index}-{attempt}", via_broker=index % 2 == 0)
            if lease_id is None:
                denied += 1
                await asyncio.sleep(0.002)
                continue
            granted += 1
            held += 1
            peak = max(peak, held)
            await asyncio.sleep(0.01)
            held -= 1
            await release(lease_id)

    slots_key = f"{prefix}slots:leases"
    try:
        contention = asyncio.gather(*(claimant(index, 40) for index in range(12)))
        await asyncio.sleep(0.3)
        primary = direct_client.get_node_from_key(slots_key).port
        promoted = await asyncio.to_thread(redis_cluster.fail_over, primary)
        await contention
        stats = await stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=10)
        print(
            f"slots moved {primary} -> {promoted}: {granted} granted, {denied} denied, "
            f"peak {peak} of {CAP}; {len(failures)} calls retried ({set(failures)})"
        )
        assert peak <= CAP
        assert denied > 0, "the cap was never reached: the test did not contend"
        assert stats.slots_in_use == 0
        assert stats.granted_total == granted
        assert denied <= stats.denied_total <= denied + len(failures)

        leases = [await reserve(f"hold-{i}", via_broker=i % 2 == 0) for i in range(CAP)]
        assert None not in leases
        assert await reserve("one-too-many", via_broker=True) is None
        primary = direct_client.get_node_from_key(slots_key).port
        await asyncio.to_thread(redis_cluster.fail_over, primary)
        stats = await stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=10)
        assert stats.slots_in_use == CAP, "a lease was lost in the failover"
        assert await reserve("still-too-many", via_broker=False) is None
        assert await reserve("still-too-many-rpc", via_broker=True) is None
        for lease_id in leases:
            assert lease_id is not None
            await stub.RenewSlot(slots_pb2.RenewSlotRequest(lease_id=lease_id), timeout=10)
        await release(str(leases[0]))
        assert await reserve("after-release", via_broker=False) is not None
    finally:
        await channel.close()
        await direct_client.aclose()
        await handle.stop(0)


def test_a_redis_cluster_url_names_its_nodes_and_picks_the_registry_shards():
    env = {"REDIS_URL": "redis+cluster://u:p%40ss@10.0.0.1:7000,[::1]:7001"}
    assert cluster_nodes(env["REDIS_URL"]) == ([("10.0.0.1", 7000), ("::1", 7001)], "u", "p@ss")
    assert GossipConfig.from_env(env).registry_shards == CLUSTER_SHARDS
    assert GossipConfig.from_env({**env, "GOSSIP_REGISTRY_SHARDS": "4"}).registry_shards == 4
    assert GossipConfig.from_env({"REDIS_URL": "redis://redis:6379/0"}).registry_shards == 1
    assert BrokerConfig.from_env(env).redis_url == env["REDIS_URL"]
    with pytest.raises(ConfigError, match="REDIS_URL: a Redis Cluster node must be host:port"):
        GossipConfig.from_env({"REDIS_URL": "redis+cluster://10.0.0.1"})
    with pytest.raises(ConfigError, match="GOSSIP_REGISTRY_SHARDS must be > 0"):
        GossipConfig.from_env({**env, "GOSSIP_REGISTRY_SHARDS": "0"})


def test_shards_of_a_prefix_have_hash_tags_of_their_own():
    keys = Keys("{kvrs}:")
    assert keys.shard(0, 1) is keys
    assert keys.shard(3, 16)("gossip", "live") == "{kvrs.3}:gossip:live"
    assert Keys("app:{t}:").shard(0, 2)("x") == "app:{t.0}:x"
    with pytest.raises(ValueError, match="shard 4 of 4"):
        keys.shard(4, 4)


class ClusterPlane(Plane):
    """The scheduler tests' plane (gossip, slot broker, schedulers) on a Redis Cluster,
    with the registry spread over four shards."""

    async def start_gossip(self, port: int = 0) -> None:
        self.gossip_handle = await build_gossip(
            GossipConfig(
                listen_addr=f"127.0.0.1:{port}",
                redis_url=self.redis_url,
                redis_prefix=self.redis_prefix,
                registry_shards=4,
            ),
            self.provider,
        )
        self.gossip_port = self.gossip_handle.port


async def test_schedulers_reserving_on_the_cluster_keep_the_cap_through_a_failover(
    redis_cluster, tag
):
    """Two scheduler replicas reserve migration slots straight in the cluster (one hop):
    of 12 concurrent Recovers against a cap of 3 exactly 3 migrate; the primary holding
    the slots fails over; the 3 leases are still held, the cap still refuses a fourth,
    and a released slot is granted again."""
    plane = ClusterPlane(redis_cluster.url, f"{{{tag}}}:")
    await plane.start(slot_cap=3)
    try:
        await plane.register(SCHEDULER_CLUSTER)
        direct = {"slot_reservations": "redis", "slot_ttl_s": 30.0}
        replicas = [await plane.scheduler(holder_id=f"replica-{i}", **direct) for i in range(2)]
        replies = await asyncio.gather(
            *(replicas[i % 2].Recover(recover(f"req-{i}"), timeout=10) for i in range(12))
        )
        granted = [reply for reply in replies if reply.slot_lease.lease_id]
        assert len(granted) == 3 and all(reply.action == MIGRATE for reply in granted)
        assert all(r.action == RECOMPUTE for r in replies if not r.slot_lease.lease_id)
        # A replica may have answered from a spare, claimed for its request just after.
        assert await plane.slots_in_use_settles_at(3)

        client = connect_redis(redis_cluster.url)
        try:
            await client.initialize()
            primary = client.get_node_from_key(f"{{{tag}}}:slots:leases").port
        finally:
            await client.aclose()
        await asyncio.to_thread(redis_cluster.fail_over, primary)
        assert await plane.slots_in_use() == 3, "a lease was lost in the failover"
        late = await replicas[1].Recover(recover("req-late"), timeout=10)
        assert late.action == RECOMPUTE and not late.slot_lease.lease_id, late.reason
        await plane.broker.ReleaseSlot(
            slots_pb2.ReleaseSlotRequest(lease_id=granted[0].slot_lease.lease_id), timeout=10
        )
        again = await replicas[0].Recover(recover("req-after-release"), timeout=10)
        assert again.action == MIGRATE and again.slot_lease.lease_id
        assert await plane.slots_in_use_settles_at(3)
    finally:
        await plane.close()


async def test_commands_started_together_on_a_new_cluster_client_all_run(shared_redis_cluster):
    """A gossip replica's first operation runs a script per registry shard at once; on a
    client that has not read the topology yet none of them may lose its connection."""
    for attempt in range(8):
        client = connect_redis(shared_redis_cluster.url)
        try:
            replies = await asyncio.gather(
                *(client.xread({f"{{new-client.{shard}}}:s": "0-0"}) for shard in range(16)),
                return_exceptions=True,
            )
        finally:
            await client.aclose()
        failed = [reply for reply in replies if isinstance(reply, Exception)]
        assert not failed, f"client {attempt}: {failed[0]!r}"
