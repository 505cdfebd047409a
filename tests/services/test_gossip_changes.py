"""Heartbeat streams, load deltas and the change feed, on the real Redis and gRPC servers."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from kvrs import errors
from kvrs.v1 import gossip_pb2, gossip_pb2_grpc
from services.common import GrpcSettings, open_channel
from services.common.gossip_records import NodeLoad
from services.gossip import client as gossip_client
from services.gossip.client import GossipClient, HeartbeatLoop
from services.gossip.store import GossipStore
from tests.services.test_gossip import SERVERS, TTL_S, decode, start_registry

LOAD = NodeLoad(
    queue_depth=3,
    queued_work_s=0.25,
    running_requests=2,
    free_kv_blocks=40,
    resident_prefix_hashes=(7, 2**64 - 1),
    running_context_tokens=900,
)


@pytest.fixture(params=SERVERS)
async def server(request, redis_url, redis_prefix):
    """The registry in one hash tag, and sharded on a Redis Cluster (most shards empty at
    first: a change id then carries an empty shard's "0-0")."""
    handle = await start_registry(request, redis_url, redis_prefix)
    yield handle
    await handle.stop(0)


@pytest.fixture
async def client(server):
    gossip = GossipClient(f"127.0.0.1:{server.port}", timeout_s=5)
    yield gossip
    await gossip.close()


async def stored(client: GossipClient, instance_id: str):
    return {n.registration.instance_id: n for n in await client.list_nodes()}[instance_id]


async def test_stream_heartbeats_answer_each_beat_and_keep_the_stream_after_a_refusal(client):
    await client.register(decode("decode-0", ttl_s=5.0))
    stream = client.heartbeat_stream()
    expires_ms = await stream.heartbeat("decode-0", LOAD)
    node = await stored(client, "decode-0")
    assert node.load == LOAD
    assert expires_ms == node.last_seen_unix_ms + 5000
    with pytest.raises(errors.NotFound, match="ghost"):
        await stream.heartbeat("ghost")
    with pytest.raises(errors.InvalidArgument) as bad:
        await stream.heartbeat("decode-0", NodeLoad(queue_depth=-1))
    assert bad.value.field == "queue_depth"
    await client.deregister("decode-0")
    with pytest.raises(errors.FailedPrecondition, match="left"):
        await stream.heartbeat("decode-0")
    await client.register(decode("decode-0", ttl_s=5.0))
    assert await stream.heartbeat("decode-0", LOAD) > expires_ms, "same stream, beating again"
    await stream.close()
    await stream.close()


async def test_unchanged_load_and_prefixes_keep_what_was_stored(client):
    await client.register(decode("decode-0", ttl_s=5.0))
    await client.heartbeat("decode-0", LOAD)
    before = await stored(client, "decode-0")
    await asyncio.sleep(0.01)
    await client.heartbeat(
        "decode-0", NodeLoad(), load_unchanged=True, prefix_hashes_unchanged=True
    )
    after = await stored(client, "decode-0")
    assert after.load == LOAD
    assert after.last_seen_unix_ms > before.last_seen_unix_ms, "liveness is still recorded"
    await client.heartbeat("decode-0", NodeLoad(queue_depth=9), prefix_hashes_unchanged=True)
    node = await stored(client, "decode-0")
    assert node.load.queue_depth == 9
    assert node.load.resident_prefix_hashes == LOAD.resident_prefix_hashes
    await client.heartbeat("decode-0", NodeLoad(resident_prefix_hashes=(5,)), load_unchanged=True)
    node = await stored(client, "decode-0")
    assert (node.load.queue_depth, node.load.resident_prefix_hashes) == (9, (5,))


async def test_list_changes_lists_only_what_changed(client):
    for i in range(3):
        await client.register(decode(f"decode-{i}", ttl_s=5.0))
    full = await client.list_changes()
    assert full.full
    assert sorted(n.registration.instance_id for n in full.nodes) == [
        "decode-0",
        "decode-1",
        "decode-2",
    ]
    quiet = await client.list_changes(full.change_id)
    assert (quiet.full, quiet.nodes, quiet.change_id) == (False, (), full.change_id)

    await client.heartbeat("decode-1", LOAD)
    await client.heartbeat("decode-1", LOAD)  # the same values again: no change
    await client.heartbeat("decode-2", load_unchanged=True, prefix_hashes_unchanged=True)
    await client.deregister("decode-0")
    delta = await client.list_changes(full.change_id)
    assert not delta.full
    by_id = {n.registration.instance_id: n for n in delta.nodes}
    assert set(by_id) == {"decode-0", "decode-1"}
    assert by_id["decode-1"].load == LOAD
    assert by_id["decode-0"].state == "left", "a departed instance is listed as it is now"
    assert (await client.list_changes(delta.change_id)).nodes == ()


async def test_a_failure_found_by_the_sweep_is_a_change(client):
    await client.register(decode("decode-0"))
    start = await client.list_changes()
    await asyncio.sleep(TTL_S + 0.3)
    delta = await client.list_changes(start.change_id)
    assert [(n.registration.instance_id, n.state) for n in delta.nodes] == [("decode-0", "failed")]


async def test_a_gap_in_the_change_history_gives_a_full_listing(redis_url, redis_prefix):
    import redis.asyncio as redis_async

    redis = redis_async.from_url(redis_url)
    store = GossipStore(redis, redis_prefix, default_ttl_s=5.0, changes_maxlen=10)
    try:
        for i in range(3):
            await store.register(decode(f"decode-{i}"))
        start = await store.list_changes("")
        for beat in range(300):  # far past the trimmed history
            await store.heartbeat("decode-1", NodeLoad(queue_depth=beat))
        after_gap = await store.list_changes(start.change_id)
        assert after_gap.full
        assert len(after_gap.nodes) == 3
        assert not (await store.list_changes(after_gap.change_id)).full
        from_elsewhere = await store.list_changes("99999999999999-0")
        assert from_elsewhere.full, "an id past this stream's end comes from another registry"
    finally:
        await redis.aclose()


async def test_bad_change_id_is_invalid_argument(server):
    channel = open_channel(f"127.0.0.1:{server.port}", GrpcSettings())
    try:
        stub = gossip_pb2_grpc.GossipServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListChanges(gossip_pb2.ListChangesRequest(after_change_id="yesterday"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("after_change_id:")
    finally:
        await channel.close()


async def test_heartbeat_loop_sends_the_load_only_when_it_changed(client, monkeypatch):
    sent: list[tuple[bool, bool]] = []
    original = gossip_client.HeartbeatStream.heartbeat

    async def recording(self, instance_id, load=None, **flags):
        sent.append((flags["load_unchanged"], flags["prefix_hashes_unchanged"]))
        return await original(self, instance_id, load, **flags)

    monkeypatch.setattr(gossip_client.HeartbeatStream, "heartbeat", recording)
    current = {"load": LOAD}
    loop = HeartbeatLoop(
        client, decode("decode-0", ttl_s=5.0), load=lambda: current["load"], interval_s=0.02
    )
    await loop.start()
    try:
        while len(sent) < 3:
            await asyncio.sleep(0.01)
        current["load"] = replace(
            LOAD,
            queued_work_s=LOAD.queued_work_s + 0.0001,  # below the threshold
            resident_prefix_hashes=(1, 2, 3),
        )
        mark = len(sent)
        while len(sent) < mark + 2:
            await asyncio.sleep(0.01)
        current["load"] = NodeLoad(queue_depth=7, resident_prefix_hashes=(1, 2, 3))
        mark = len(sent)
        while len(sent) < mark + gossip_client.FULL_LOAD_EVERY + 1:
            await asyncio.sleep(0.01)
        node = await stored(client, "decode-0")
    finally:
        await loop.stop()
    assert sent[0] == (False, False), "the first beat after registering sends everything"
    assert sent[1] == (True, True)
    assert (True, False) in sent, "a new prefix set alone is sent without the load"
    assert (False, True) in sent, "a changed queue is sent without the prefix set"
    assert sent.count((False, False)) >= 2, "everything again every FULL_LOAD_EVERY beats"
    assert node.load.queue_depth == 7
    assert node.load.resident_prefix_hashes == (1, 2, 3)


async def test_concurrent_heartbeats_share_pipelines_not_connections(redis_url, redis_prefix):
    """Thousands of instances beating over streams arrive concurrently: they must not need
    a Redis connection each (redis-py's pool refuses past its size)."""
    import redis.asyncio as redis_async

    redis = redis_async.from_url(redis_url, max_connections=3)
    store = GossipStore(redis, redis_prefix, default_ttl_s=5.0)
    try:
        for i in range(40):
            await store.register(decode(f"decode-{i}"))
        expiries = await asyncio.gather(
            *(store.heartbeat(f"decode-{i}", LOAD) for i in range(40)),
            *(store.heartbeat(f"decode-{i}", LOAD, load_unchanged=True) for i in range(40)),
        )
        assert all(expiry > 0 for expiry in expiries)
        with pytest.raises(errors.NotFound):
            await asyncio.gather(store.heartbeat("decode-0", LOAD), store.heartbeat("ghost", LOAD))
    finally:
        await redis.aclose()


def test_a_streams_context_is_sent_once_it_grew_by_its_threshold():
    """Every decode step adds a token per stream: not worth a beat's load each time."""
    grown = int(LOAD.running_context_tokens * (1 + gossip_client.CONTEXT_THRESHOLD))
    assert not gossip_client.load_changed(LOAD, replace(LOAD, running_context_tokens=grown), 64)
    assert gossip_client.load_changed(LOAD, replace(LOAD, running_context_tokens=grown + 1), 64)
