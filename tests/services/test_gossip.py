"""Gossip service against the real Redis and real gRPC servers (registry, links, events)."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import replace

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs import errors
from kvrs.v1 import common_pb2, gossip_pb2, gossip_pb2_grpc
from services.common import ConfigError, GrpcSettings, open_channel, setup_tracing
from services.common.gossip_follow import LINK_CLOCK_MARGIN_MS, LinkCopy
from services.common.gossip_records import LinkSample, NodeLoad, Registration
from services.gossip.client import GossipClient, HeartbeatLoop
from services.gossip.config import CLUSTER_SHARDS, Config
from services.gossip.server import build_server

TTL_S = 0.4


def gossip_config(
    redis_url: str,
    redis_prefix: str,
    listen_addr: str = "127.0.0.1:0",
    confirm_ttls: float = 0.0,
    shards: int = 1,
) -> Config:
    """Most tests here check the deadline itself: no confirmation window, a missed
    deadline fails the instance (the suspect tests below give it one)."""
    return Config(
        listen_addr=listen_addr,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        heartbeat_ttl_s=TTL_S,
        sweep_interval_s=0.05,
        confirm_ttls=confirm_ttls,
        registry_shards=shards,
    )


async def start_gossip(
    redis_url: str,
    redis_prefix: str,
    listen_addr: str = "127.0.0.1:0",
    confirm_ttls: float = 0.0,
    shards: int = 1,
):
    provider = setup_tracing("test-gossip", exporter=InMemorySpanExporter())
    return await build_server(
        gossip_config(redis_url, redis_prefix, listen_addr, confirm_ttls, shards), provider
    )


REGISTRIES = {"one-shard": 1, "four-shards": 4, "redis-cluster": CLUSTER_SHARDS}
"""Where a registry fixture puts the registry: one Redis with one hash tag or four, or
a three-primary Redis Cluster with the shards a cluster gets."""


def registry_url(request, redis_url: str) -> str:
    """The Redis the registry `request.param` (one of REGISTRIES) lives in."""
    if request.param == "redis-cluster":
        return request.getfixturevalue("shared_redis_cluster").url
    return redis_url


async def start_registry(request, redis_url: str, redis_prefix: str):
    """A gossip server over the registry `request.param` names."""
    url = registry_url(request, redis_url)
    return await start_gossip(url, redis_prefix, shards=REGISTRIES[request.param])


SERVERS = ("one-shard", "redis-cluster")
"""The registries the service's tests run on: one Redis, and a Redis Cluster (sixteen
shards, some of them empty: what a registry spread over four on one Redis would add)."""


@pytest.fixture(params=SERVERS)
async def server(request, redis_url, redis_prefix):
    """The registry in one hash tag on one Redis, and sharded on a Redis Cluster: every
    test that uses it holds for both."""
    handle = await start_registry(request, redis_url, redis_prefix)
    yield handle
    await handle.stop(0)


@pytest.fixture
async def client(server):
    gossip = GossipClient(f"127.0.0.1:{server.port}", timeout_s=5)
    yield gossip
    await gossip.close()


@pytest.fixture
async def stub(server):
    channel = open_channel(f"127.0.0.1:{server.port}", GrpcSettings())
    yield gossip_pb2_grpc.GossipServiceStub(channel)
    await channel.close()


def decode(instance_id: str, ttl_s: float = 0.0) -> Registration:
    return Registration(
        instance_id=instance_id,
        role="decode",
        address=f"{instance_id}:50060",
        node="n0",
        rack="r0",
        pod="p0",
        gpu_index=1,
        model="tiny",
        kv_capacity_blocks=64,
        transfer_address=f"{instance_id}:29500",
        heartbeat_ttl_s=ttl_s,
        max_batch_tokens=2048,
    )


async def collect(client: GossipClient, after: str, count: int, timeout_s: float = 3.0):
    events = []

    async def take() -> None:
        async for event in client.watch_events(after):
            events.append(event)
            if len(events) == count:
                return

    await asyncio.wait_for(take(), timeout_s)
    return events


async def test_register_heartbeat_and_list(client):
    prefill = Registration("prefill-0", "prefill", "p0:50060", heartbeat_ttl_s=5.0)
    record = await client.register(prefill)
    assert record.state == "alive"
    assert record.heartbeat_ttl_s == 5.0
    stored = await client.register(decode("decode-0"))
    assert stored.heartbeat_ttl_s == TTL_S
    assert stored.registration.transfer_address == "decode-0:29500"

    load = NodeLoad(
        queue_depth=3,
        queued_work_s=0.25,
        running_requests=2,
        free_kv_blocks=40,
        resident_prefix_hashes=(7, 2**64 - 1),
        compute_factor=1.5,
        running_context_tokens=900,
    )
    expires_ms = await client.heartbeat("decode-0", load)
    nodes = {node.registration.instance_id: node for node in await client.list_nodes()}
    assert set(nodes) == {"prefill-0", "decode-0"}
    assert nodes["decode-0"].load == load
    assert nodes["decode-0"].registration.rack == "r0"
    assert nodes["decode-0"].registration.max_batch_tokens == 2048
    assert expires_ms == nodes["decode-0"].last_seen_unix_ms + int(TTL_S * 1000)
    assert 0 <= nodes["decode-0"].age_s < TTL_S
    decodes = await client.list_nodes(role="decode")
    assert [node.registration.instance_id for node in decodes] == ["decode-0"]

    await asyncio.sleep(0.15)
    aged = {n.registration.instance_id: n for n in await client.list_nodes(role="prefill")}
    assert aged["prefill-0"].age_s >= 0.15


async def test_a_new_instance_reports_all_its_kv_free_before_its_first_heartbeat(client):
    """Placement filters on free KV; a worker that joined must be usable at once."""
    joined = await client.register(replace(decode("decode-0"), kv_capacity_blocks=64))
    assert joined.load.free_kv_blocks == 64
    await client.heartbeat("decode-0", NodeLoad(free_kv_blocks=10))
    refreshed = await client.register(replace(decode("decode-0"), kv_capacity_blocks=64))
    assert refreshed.load.free_kv_blocks == 10, "a live re-registration keeps its reported load"


async def test_registration_is_idempotent_and_joined_once(client):
    await client.register(decode("decode-0", ttl_s=5.0))
    await client.heartbeat("decode-0", NodeLoad(queue_depth=4))
    again = await client.register(decode("decode-0", ttl_s=5.0))
    assert again.load.queue_depth == 4, "refreshing a live registration keeps its load"
    await client.deregister("decode-0")
    events = await collect(client, "0", 2)
    assert [(e.type, e.instance_id) for e in events] == [
        ("joined", "decode-0"),
        ("left", "decode-0"),
    ]


async def test_unknown_instance_is_not_found(client, stub):
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.Heartbeat(gossip_pb2.HeartbeatRequest(instance_id="ghost"), timeout=5)
    assert raw.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(errors.NotFound):
        await client.heartbeat("ghost")
    with pytest.raises(errors.NotFound):
        await client.deregister("ghost")


async def test_stopped_heartbeats_are_reported_failed(client):
    ttl_s = 1.5  # beats every 0.1 s keep it alive even on a heavily loaded machine
    loop = asyncio.get_running_loop()

    async def watch() -> tuple[list, float]:
        events = await collect(client, "", 2, timeout_s=ttl_s + 5)
        return events, loop.time()

    watchers = [asyncio.create_task(watch()) for _ in range(3)]
    await asyncio.sleep(0.2)
    await client.register(decode("decode-0", ttl_s=ttl_s))
    for _ in range(4):
        await asyncio.sleep(0.1)
        expires_ms = await client.heartbeat("decode-0")
    last_beat_s = loop.time()
    seen = await asyncio.gather(*watchers)
    assert all(events == seen[0][0] for events, _ in seen), "every watcher sees the same"
    joined, failed = seen[0][0]
    received_s = max(at for _, at in seen) - last_beat_s
    stamped_s = (failed.unix_ms - (expires_ms - ttl_s * 1000)) / 1000
    print(
        f"failure stamped {stamped_s * 1000:.0f} ms and received by all 3 watchers "
        f"{received_s * 1000:.0f} ms after the last heartbeat (TTL {ttl_s * 1000:.0f} ms)"
    )
    assert (joined.type, failed.type) == ("joined", "failed")
    assert failed.instance_id == "decode-0" and failed.role == "decode"
    assert failed.address == "decode-0:50060"
    # Bounded, not timed: the sweep runs every 0.05 s, and the margin leaves room for a
    # machine stalled by the Redis Cluster tests beside this one.
    assert ttl_s <= stamped_s < ttl_s + 3.0
    assert received_s < ttl_s + 3.0
    with pytest.raises(errors.FailedPrecondition):
        await client.heartbeat("decode-0")
    assert await client.list_nodes() == []
    [down] = await client.list_nodes(include_down=True)
    assert down.state == "failed"


async def test_late_heartbeat_before_the_sweep_still_fails(redis_url, redis_prefix):
    provider = setup_tracing("test-gossip", exporter=InMemorySpanExporter())
    config = Config(
        listen_addr="127.0.0.1:0",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        heartbeat_ttl_s=0.2,
        sweep_interval_s=30.0,
        confirm_ttls=0.0,
    )
    handle = await build_server(config, provider)
    try:
        async with GossipClient(f"127.0.0.1:{handle.port}") as client:
            await asyncio.sleep(0.1)
            await client.register(decode("decode-0"))
            await asyncio.sleep(0.3)
            with pytest.raises(errors.FailedPrecondition):
                await client.heartbeat("decode-0")
            events = await collect(client, "0", 2)
            assert [e.type for e in events] == ["joined", "failed"]
    finally:
        await handle.stop(0)


async def test_a_gossip_restart_after_the_ttl_gives_instances_one_ttl(redis_url, redis_prefix):
    """Gossip was down longer than the TTL: its successor lets the instances that beat
    again within one TTL live, and still fails the one that stays silent."""
    first = await start_gossip(redis_url, redis_prefix)
    async with GossipClient(f"127.0.0.1:{first.port}") as client:
        for name in ("decode-0", "decode-1"):
            await client.register(decode(name))
    await first.stop(0)
    await asyncio.sleep(TTL_S * 2)
    second = await start_gossip(redis_url, redis_prefix)
    try:
        async with GossipClient(f"127.0.0.1:{second.port}") as client:
            for _ in range(4):
                await asyncio.sleep(TTL_S / 4)
                await client.heartbeat("decode-0")
            events = await collect(client, "0", 3)
            assert [(e.type, e.instance_id) for e in events] == [
                ("joined", "decode-0"),
                ("joined", "decode-1"),
                ("failed", "decode-1"),
            ]
            assert [n.registration.instance_id for n in await client.list_nodes()] == ["decode-0"]
    finally:
        await second.stop(0)


async def test_two_gossip_replicas_report_one_failure(redis_url, redis_prefix):
    first = await start_gossip(redis_url, redis_prefix)
    second = await start_gossip(redis_url, redis_prefix)
    clients = [GossipClient(f"127.0.0.1:{h.port}") for h in (first, second)]
    try:
        watchers = [asyncio.create_task(collect(c, "", 2, TTL_S + 3)) for c in clients]
        await asyncio.sleep(0.2)
        for index in range(5):
            await clients[index % 2].register(decode(f"decode-{index}"))
        seen = await asyncio.gather(*watchers)
        for events in seen:
            assert [e.type for e in events] == ["joined", "joined"]
        await asyncio.sleep(TTL_S + 0.5)
        history = await collect(clients[1], "0", 10)
        failed = sorted(e.instance_id for e in history if e.type == "failed")
        assert failed == [f"decode-{i}" for i in range(5)], "each failure reported exactly once"
        with pytest.raises(TimeoutError):
            await collect(clients[0], "0", 11, timeout_s=0.5)
    finally:
        for client in clients:
            await client.close()
        await first.stop(0)
        await second.stop(0)


def register_request(**overrides) -> gossip_pb2.RegisterNodeRequest:
    fields = dict(
        request_id="r1",
        instance_id="decode-0",
        role=common_pb2.ROLE_DECODE,
        address="d0:50060",
        heartbeat_ttl_s=1.0,
    )
    fields.update(overrides)
    return gossip_pb2.RegisterNodeRequest(**fields)


def link_request(**overrides) -> gossip_pb2.ReportLinkSampleRequest:
    fields = dict(src_instance_id="p0", dst_instance_id="d0", bandwidth_bps=1e9, rtt_s=1e-4)
    fields.update(overrides)
    return gossip_pb2.ReportLinkSampleRequest(**fields)


BAD_INPUTS = [
    ("RegisterNode", register_request(instance_id=""), "instance_id"),
    ("RegisterNode", register_request(role=common_pb2.ROLE_UNSPECIFIED), "role"),
    ("RegisterNode", register_request(address=""), "address"),
    ("RegisterNode", register_request(heartbeat_ttl_s=-1.0), "heartbeat_ttl_s"),
    ("RegisterNode", register_request(heartbeat_ttl_s=float("nan")), "heartbeat_ttl_s"),
    ("RegisterNode", register_request(kv_capacity_blocks=-5), "kv_capacity_blocks"),
    ("RegisterNode", register_request(max_batch_tokens=-1), "max_batch_tokens"),
    (
        "RegisterNode",
        register_request(location=common_pb2.Location(gpu_index=-1)),
        "location.gpu_index",
    ),
    ("Heartbeat", gossip_pb2.HeartbeatRequest(instance_id=""), "instance_id"),
    ("Heartbeat", gossip_pb2.HeartbeatRequest(instance_id="d0", queue_depth=-1), "queue_depth"),
    (
        "Heartbeat",
        gossip_pb2.HeartbeatRequest(instance_id="d0", queued_work_s=float("inf")),
        "queued_work_s",
    ),
    (
        "Heartbeat",
        gossip_pb2.HeartbeatRequest(instance_id="d0", free_kv_blocks=-1),
        "free_kv_blocks",
    ),
    ("DeregisterNode", gossip_pb2.DeregisterNodeRequest(instance_id=""), "instance_id"),
    ("ReportLinkSample", link_request(src_instance_id=""), "src_instance_id"),
    ("ReportLinkSample", link_request(dst_instance_id="p0"), "dst_instance_id"),
    ("ReportLinkSample", link_request(bandwidth_bps=float("nan")), "bandwidth_bps"),
    ("ReportLinkSample", link_request(bandwidth_bps=float("inf")), "bandwidth_bps"),
    ("ReportLinkSample", link_request(bandwidth_bps=-1.0), "bandwidth_bps"),
    ("ReportLinkSample", link_request(rtt_s=-0.1), "rtt_s"),
    ("ReportLinkSample", link_request(sample_bandwidth_bps=float("nan")), "sample_bandwidth_bps"),
    # Sizes: every registry read carries every instance in one message.
    ("RegisterNode", register_request(instance_id="i" * 257), "instance_id"),
    ("RegisterNode", register_request(address="a" * 513), "address"),
    ("RegisterNode", register_request(transfer_address="a" * 513), "transfer_address"),
    ("RegisterNode", register_request(model="m" * 129), "model"),
    (
        "RegisterNode",
        register_request(location=common_pb2.Location(rack="é" * 129)),
        "location.rack",
    ),
    (
        "Heartbeat",
        gossip_pb2.HeartbeatRequest(instance_id="d0", resident_prefix_hashes=range(65_537)),
        "resident_prefix_hashes",
    ),
    (
        "DeregisterNode",
        gossip_pb2.DeregisterNodeRequest(instance_id="d0", reason="r" * 1025),
        "reason",
    ),
    ("ReportLinkSample", link_request(dst_instance_id="d" * 257), "dst_instance_id"),
    ("ListLinks", gossip_pb2.ListLinksRequest(measured_after_unix_ms=-1), "measured_after_unix_ms"),
]


@pytest.mark.parametrize(("method", "request_message", "field"), BAD_INPUTS)
async def test_bad_input_is_invalid_argument_naming_the_field(stub, method, request_message, field):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await getattr(stub, method)(request_message, timeout=5)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.value.details().startswith(f"{field}:"), failure.value.details()


async def test_bad_event_id_is_invalid_argument(client):
    with pytest.raises(errors.InvalidArgument) as failure:
        await collect(client, "yesterday", 1)
    assert failure.value.field == "after_event_id"


async def test_events_replay_after_an_id(client):
    for name in ("a", "b"):
        await client.register(decode(name, ttl_s=5.0))
    await client.deregister("a", reason="drained")
    history = await collect(client, "0", 3)
    # With the registry sharded, events of different instances are merged by stream
    # time, which two shards can share: only each instance's own order is certain.
    assert sorted((e.type, e.instance_id) for e in history) == [
        ("joined", "a"),
        ("joined", "b"),
        ("left", "a"),
    ]
    of_a = [e for e in history if e.instance_id == "a"]
    assert [e.type for e in of_a] == ["joined", "left"]
    assert of_a[1].reason == "drained"
    assert of_a[0].unix_ms <= of_a[1].unix_ms
    replayed = await collect(client, history[0].event_id, 2)
    assert replayed == history[1:]
    live = asyncio.create_task(collect(client, history[2].event_id, 1))
    await client.deregister("b")
    [left] = await live
    assert (left.type, left.instance_id) == ("left", "b")


async def test_reregistration_after_failure_joins_again(client):
    await client.register(decode("decode-0"))
    await asyncio.sleep(TTL_S + 0.3)
    record = await client.register(decode("decode-0"))
    assert record.state == "alive"
    events = await collect(client, "0", 3)
    assert [e.type for e in events] == ["joined", "failed", "joined"]
    assert events[2].reason == "re-registered after failed"


async def test_link_samples_with_age(client):
    sample = LinkSample(
        "p0",
        "d0",
        bandwidth_bps=8e9,
        sample_bandwidth_bps=7.5e9,
        rtt_s=2e-4,
        probe_bytes=1 << 20,
        samples=3,
    )
    await client.report_link_sample(sample)
    await client.report_link_sample(LinkSample("d0", "p0", bandwidth_bps=1e9))
    await asyncio.sleep(0.2)
    links = {
        (link.sample.src_instance_id, link.sample.dst_instance_id): link
        for link in await client.list_links()
    }
    assert set(links) == {("p0", "d0"), ("d0", "p0")}
    forward = links[("p0", "d0")]
    assert forward.sample.bandwidth_bps == 8e9
    assert forward.sample.sample_bandwidth_bps == 7.5e9
    assert forward.sample.rtt_s == 2e-4 and forward.sample.samples == 3
    assert 0.2 <= forward.age_s < 5
    await client.report_link_sample(LinkSample("p0", "d0", bandwidth_bps=4e9))
    [fresh] = [link for link in await client.list_links() if link.sample.src_instance_id == "p0"]
    assert fresh.sample.bandwidth_bps == 4e9 and fresh.age_s < forward.age_s


async def test_links_measured_after_a_time_are_listed_alone(client):
    await client.report_link_sample(LinkSample("p0", "d0", bandwidth_bps=8e9))
    [listed] = await client.list_links()
    first = listed.measured_unix_ms
    await asyncio.sleep(0.01)
    await client.report_link_sample(LinkSample("p1", "d1", bandwidth_bps=4e9))
    later = await client.list_links(measured_after_unix_ms=first)
    assert [(link.sample.src_instance_id, link.sample.bandwidth_bps) for link in later] == [
        ("p1", 4e9)
    ]
    assert len(await client.list_links()) == 2
    await client.report_link_sample(LinkSample("p0", "d0", bandwidth_bps=2e9))
    again = await client.list_links(measured_after_unix_ms=first)
    assert {link.sample.src_instance_id: link.sample.bandwidth_bps for link in again} == {
        "p0": 2e9,
        "p1": 4e9,
    }


async def test_thousands_of_links_measured_since_a_time_are_all_listed(client):
    """More links than one Lua unpack takes (its stack holds ~8,000 values) come back
    whole from a listing since a time."""
    for start in range(0, 9000, 500):
        await asyncio.gather(
            *(
                client.report_link_sample(LinkSample(f"p{i}", f"d{i}", bandwidth_bps=1e9 + i))
                for i in range(start, start + 500)
            )
        )
    since = await client.list_links(measured_after_unix_ms=1)
    assert {link.sample.bandwidth_bps for link in since} == {1e9 + i for i in range(9000)}


async def test_a_link_copy_asks_for_what_was_measured_since_and_resyncs(client):
    """Between full listings a copy asks only for the links measured since its newest
    (less the clock margin): what it holds stays every link, each at its newest sample."""
    asked: list[int] = []

    class Recording:
        async def list_links(self, measured_after_unix_ms: int = 0):
            asked.append(measured_after_unix_ms)
            return await client.list_links(measured_after_unix_ms)

    now_s = [0.0]
    copy = LinkCopy(resync_s=30.0, clock=lambda: now_s[0])
    await client.report_link_sample(LinkSample("p0", "d0", bandwidth_bps=8e9))
    assert await copy.poll(Recording()) is None, "the first poll is a full listing"
    [first] = copy.links.values()
    assert first.sample.bandwidth_bps == 8e9
    await client.report_link_sample(LinkSample("p1", "d1", bandwidth_bps=4e9))
    await client.report_link_sample(LinkSample("p0", "d0", bandwidth_bps=2e9))
    now_s[0] = 1.0
    changed = await copy.poll(Recording())
    assert sorted(link.sample.src_instance_id for link in changed) == ["p0", "p1"]
    held = {pair[0]: link.sample.bandwidth_bps for pair, link in copy.links.items()}
    assert held == {"p0": 2e9, "p1": 4e9}
    now_s[0] = 2.0
    assert await copy.poll(Recording()) == (), "listed again within the margin, unchanged"
    now_s[0] = 31.0
    assert await copy.poll(Recording()) is None
    newest_ms = max(link.measured_unix_ms for link in copy.links.values())
    assert asked[:2] == [0, first.measured_unix_ms - LINK_CLOCK_MARGIN_MS]
    assert asked[2:] == [newest_ms - LINK_CLOCK_MARGIN_MS, 0]


async def test_watch_stream_ends_cleanly_on_shutdown(redis_url, redis_prefix):
    handle = await start_gossip(redis_url, redis_prefix)
    channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
    try:
        call = gossip_pb2_grpc.GossipServiceStub(channel).WatchEvents(
            gossip_pb2.WatchEventsRequest(after_event_id=""), timeout=30
        )
        await asyncio.sleep(0.2)
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        stopping = asyncio.create_task(handle.stop(10))
        received = [event async for event in call]
        assert received == []
        assert await call.code() == grpc.StatusCode.OK
        await stopping
        assert loop.time() - started_s < 2, "watchers must not hold shutdown for the grace"
    finally:
        await channel.close()


async def test_client_watch_resumes_across_a_server_restart(redis_url, redis_prefix):
    handle = await start_gossip(redis_url, redis_prefix)
    port = handle.port
    other = await start_gossip(redis_url, redis_prefix)
    writer = GossipClient(f"127.0.0.1:{other.port}")
    watcher_client = GossipClient(f"127.0.0.1:{port}")
    try:
        received = []

        async def watch() -> None:
            async for event in watcher_client.watch_events(""):
                received.append(event)
                if len(received) == 3:
                    return

        watching = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        await writer.register(decode("a", ttl_s=5.0))
        await asyncio.sleep(0.3)
        await handle.stop(1)
        await writer.register(decode("b", ttl_s=5.0))
        await writer.register(decode("c", ttl_s=5.0))
        handle = await start_gossip(redis_url, redis_prefix, f"127.0.0.1:{port}")
        await asyncio.wait_for(watching, 10)
        assert [e.instance_id for e in received] == ["a", "b", "c"]
    finally:
        await writer.close()
        await watcher_client.close()
        await handle.stop(0)
        await other.stop(0)


def test_config_from_env_names_the_bad_variable():
    config = Config.from_env({"GOSSIP_HEARTBEAT_TTL_S": "0.5", "KVRS_REDIS_PREFIX": "{t}:"})
    assert config.heartbeat_ttl_s == 0.5 and config.listen_addr == "0.0.0.0:50051"
    with pytest.raises(ConfigError, match="GOSSIP_SWEEP_INTERVAL_S"):
        Config.from_env({"GOSSIP_SWEEP_INTERVAL_S": "0"})
    with pytest.raises(ConfigError, match="GOSSIP_HEARTBEAT_TTL_S"):
        Config.from_env({"GOSSIP_HEARTBEAT_TTL_S": "soon"})
    with pytest.raises(ConfigError, match="KVRS_REDIS_PREFIX"):
        Config.from_env({"KVRS_REDIS_PREFIX": "kvrs:"})


async def test_cancelled_watchers_do_not_linger(server, stub):
    calls = [
        stub.WatchEvents(gossip_pb2.WatchEventsRequest(after_event_id=""), timeout=30)
        for _ in range(3)
    ]
    readers = [asyncio.create_task(call.read()) for call in calls]
    for _ in range(100):
        if server.servicer.active_watchers == 3:
            break
        await asyncio.sleep(0.05)
    assert server.servicer.active_watchers == 3
    for call in calls:
        call.cancel()
    for delay_s in [0.0, 0.001, 0.003, 0.01, 0.02, 0.05] * 5:
        call = stub.WatchEvents(gossip_pb2.WatchEventsRequest(after_event_id="0"), timeout=30)
        readers.append(asyncio.create_task(call.read()))
        await asyncio.sleep(delay_s)
        call.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    for _ in range(40):
        if server.servicer.active_watchers == 0:
            break
        await asyncio.sleep(0.05)
    assert server.servicer.active_watchers == 0


async def test_heartbeat_loop_keeps_an_instance_alive_and_rejoins_after_failure(client):
    ttl_s = 0.8  # beats every 0.1 s keep it alive even on a loaded machine
    stall = asyncio.Event()
    beats = 0
    reregistered = []

    async def load() -> NodeLoad:
        nonlocal beats
        beats += 1
        if stall.is_set():
            stall.clear()
            await asyncio.sleep(ttl_s + 0.3)
        if beats == 3:
            raise RuntimeError("metric source broken")
        return NodeLoad(queue_depth=beats)

    loop = HeartbeatLoop(
        client,
        decode("decode-0", ttl_s=ttl_s),
        load=load,
        interval_s=0.1,
        on_reregistered=lambda: reregistered.append(True),
    )
    record = await loop.start()
    assert record.state == "alive" and loop.running
    await asyncio.sleep(1.2)
    [node] = await client.list_nodes()
    assert node.load.queue_depth >= 4, "a failing load callback must not stop the beats"
    assert loop.registrations == 1

    stall.set()
    for _ in range(60):
        if reregistered:
            break
        await asyncio.sleep(0.05)
    assert reregistered and loop.registrations == 2
    assert loop.declared_failed, "a rejoin after a failure declaration must say so"
    [node] = await client.list_nodes()
    assert node.state == "alive"

    await loop.stop(reason="drained")
    await loop.stop()
    assert not loop.running
    events = await collect(client, "0", 4)
    assert [e.type for e in events] == ["joined", "failed", "joined", "left"]
    assert events[3].reason == "drained"


async def test_a_rejoin_drops_the_given_up_work_even_when_the_beat_after_it_fails(client):
    """The instance left the registry; it registers again, and the beat right after
    that fails. The callback must run anyway: the next beat is accepted, and nothing
    would call it then."""
    rejoined: list[int] = []
    loop = HeartbeatLoop(
        client,
        decode("decode-0"),
        interval_s=0.1,
        on_reregistered=lambda: rejoined.append(loop.registrations),
    )
    await loop.start()
    send = loop._stream.heartbeat
    failed_after_rejoin: list[bool] = []

    async def breaks_once_after_the_rejoin(*args, **kwargs):
        if loop.registrations == 2 and not failed_after_rejoin:
            failed_after_rejoin.append(True)
            raise errors.Unavailable("the stream broke")
        return await send(*args, **kwargs)

    loop._stream.heartbeat = breaks_once_after_the_rejoin
    await client.deregister("decode-0")
    for _ in range(60):
        if rejoined:
            break
        await asyncio.sleep(0.05)
    await loop.stop(deregister=False)
    assert failed_after_rejoin, "the beat after the re-registration did not fail"
    assert rejoined == [2]


# -- suspect, then confirm ---------------------------------------------------------------


@pytest.fixture
async def confirming(redis_url, redis_prefix):
    """A gossip server with the default confirmation window: 2 TTLs after the suspicion."""
    handle = await start_gossip(redis_url, redis_prefix, confirm_ttls=2.0)
    client = GossipClient(f"127.0.0.1:{handle.port}", timeout_s=5)
    yield handle, client
    await client.close()
    await handle.stop(0)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_late_heartbeat_makes_an_instance_suspect_and_the_next_one_refutes_it(
    confirming, caplog
):
    caplog.set_level(logging.INFO, logger="services.gossip.store")
    handle, client = confirming
    # Its address is a live listener (the gossip server's own): the probe proves nothing.
    await client.register(replace(decode("decode-0"), address=f"127.0.0.1:{handle.port}"))
    await asyncio.sleep(TTL_S + 0.3)
    [node] = await client.list_nodes()
    assert node.state == "suspect", "a late instance is listed, as suspect"
    await client.heartbeat("decode-0")
    [node] = await client.list_nodes()
    assert node.state == "alive"
    events = await collect(client, "0", 3)
    assert [e.type for e in events] == ["joined", "suspect", "refuted"]
    assert events[1].reason.startswith("no heartbeat for ")
    refuted = [r.getMessage() for r in caplog.records if "refuted" in r.getMessage()]
    assert len(refuted) == 1 and refuted[0].startswith("instance decode-0 refuted: heartbeat ")


async def test_a_suspect_that_stays_silent_is_failed_after_its_confirmation_window(confirming):
    handle, client = confirming
    await client.register(replace(decode("decode-0"), address=f"127.0.0.1:{handle.port}"))
    events = await collect(client, "0", 3, timeout_s=3 * TTL_S + 3)
    assert [e.type for e in events] == ["joined", "suspect", "failed"]
    suspected_after_s = (events[1].unix_ms - events[0].unix_ms) / 1000
    failed_after_s = (events[2].unix_ms - events[1].unix_ms) / 1000
    assert TTL_S <= suspected_after_s < TTL_S + 1.0
    assert 2 * TTL_S <= failed_after_s < 2 * TTL_S + 1.0, "failed 2 TTLs after the suspicion"
    with pytest.raises(errors.FailedPrecondition):
        await client.heartbeat("decode-0")


async def test_a_suspect_whose_address_refuses_connections_is_failed_at_once(confirming):
    _, client = confirming
    await client.register(replace(decode("decode-0"), address=f"127.0.0.1:{closed_port()}"))
    events = await collect(client, "0", 3, timeout_s=TTL_S + 2)
    assert [e.type for e in events] == ["joined", "suspect", "failed"]
    assert "nothing listens at" in events[2].reason
    assert (events[2].unix_ms - events[1].unix_ms) / 1000 < TTL_S, "before the window ends"


def test_confirm_ttls_is_validated():
    assert Config.from_env({}).confirm_ttls == 2.0
    assert Config.from_env({"GOSSIP_CONFIRM_TTLS": "0"}).confirm_ttls == 0.0
    for bad in ("-1", "nan", "1000"):
        with pytest.raises(ConfigError, match="GOSSIP_CONFIRM_TTLS"):
            Config.from_env({"GOSSIP_CONFIRM_TTLS": bad})
