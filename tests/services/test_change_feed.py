"""The gossip replica's shared reading of the change streams, on the real Redis and gRPC."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as redis_async

from services.common import connect_redis
from services.common.gossip_records import NodeLoad
from services.gossip.change_feed import ChangeFeed, position
from services.gossip.client import GossipClient
from services.gossip.store import GossipStore
from tests.services.test_gossip import REGISTRIES, decode, registry_url, start_gossip


@pytest.fixture(params=list(REGISTRIES))
def registry(request, redis_url) -> tuple[str, int]:
    """Where the registry lives (one Redis in one hash tag or four, or a Redis Cluster)
    and its shard count."""
    return registry_url(request, redis_url), REGISTRIES[request.param]


@pytest.fixture
async def store(registry, redis_prefix):
    url, shards = registry
    client = connect_redis(url)
    yield GossipStore(client, redis_prefix, default_ttl_s=5.0, shards=shards)
    await client.aclose()


class CountingStore:
    """The real store, counting the change reads the feed makes through it."""

    def __init__(self, store: GossipStore) -> None:
        self._store = store
        self.shards = store.shards
        self.reads = 0

    async def list_changes(self, after_change_id: str):
        self.reads += 1
        return await self._store.list_changes(after_change_id)


def ids(reply) -> set[str]:
    return {info.instance_id for info in reply.nodes}


async def test_views_at_different_cursors_get_what_the_store_answers(registry, redis_prefix, store):
    url, shards = registry
    server = await start_gossip(url, redis_prefix, shards=shards)
    views = [GossipClient(f"127.0.0.1:{server.port}", timeout_s=5) for _ in range(2)]
    try:
        for i in range(4):
            await store.register(decode(f"decode-{i}"))
        first, second = [await view.list_changes() for view in views]
        first = await views[0].list_changes(first.change_id)  # a cursor the feed issued
        await store.heartbeat("decode-1", NodeLoad(queue_depth=1))
        first_delta = await views[0].list_changes(first.change_id)
        await store.heartbeat("decode-2", NodeLoad(queue_depth=2))
        await store.deregister("decode-3", "scaled in")
        # The second view asks from before all three changes, the first from between.
        second_delta = await views[1].list_changes(second.change_id)
        first_next = await views[0].list_changes(first_delta.change_id)

        assert [n.registration.instance_id for n in first_delta.nodes] == ["decode-1"]
        assert {n.registration.instance_id for n in first_next.nodes} == {"decode-2", "decode-3"}
        assert {n.registration.instance_id for n in second_delta.nodes} == {
            "decode-1",
            "decode-2",
            "decode-3",
        }
        assert first_next.change_id == second_delta.change_id
        by_store = await store.list_changes(second.change_id)
        by_feed = {n.registration.instance_id: n for n in second_delta.nodes}
        for record in by_store.nodes:
            served = by_feed[record.registration.instance_id]
            assert (served.registration, served.state, served.load) == (
                record.registration,
                record.state,
                record.load,
            )
        assert by_feed["decode-3"].state == "left"
        assert by_feed["decode-2"].load.queue_depth == 2
    finally:
        for view in views:
            await view.close()
        await server.stop(0)


async def test_views_asking_together_share_one_read_of_the_changes(store):
    counting = CountingStore(store)
    feed = ChangeFeed(counting)
    for i in range(3):
        await store.register(decode(f"decode-{i}"))
    start = await store.list_changes("")
    assert (await feed.answer(start.change_id)).nodes == []
    reads = counting.reads
    await store.heartbeat("decode-0", NodeLoad(queue_depth=5))

    replies = await asyncio.gather(*(feed.answer(start.change_id) for _ in range(5)))

    assert counting.reads == reads + 1, "one read answered all five"
    assert all(ids(reply) == {"decode-0"} for reply in replies)
    assert all(reply.nodes[0].queue_depth == 5 for reply in replies)


async def test_a_reply_ages_each_instance_to_its_own_time(store):
    feed = ChangeFeed(store)
    await store.register(decode("decode-0"))
    start = await store.list_changes("")
    await feed.answer(start.change_id)
    await store.heartbeat("decode-0", NodeLoad(queue_depth=1))
    await feed.answer(start.change_id)
    await asyncio.sleep(0.2)
    await store.register(decode("decode-1"))  # a change elsewhere moves the feed on

    reply = await feed.answer(start.change_id)

    ages = {info.instance_id: info.age_s for info in reply.nodes}
    stored = {r.registration.instance_id: r for r in (await store.list_nodes())[0]}
    for instance_id, age_s in ages.items():
        expected_s = (reply.server_unix_ms - stored[instance_id].last_seen_unix_ms) / 1000
        assert age_s == pytest.approx(expected_s)
    assert ages["decode-0"] >= 0.2, "aged to this reply's time, not the poll that read it"


async def test_cursors_the_feed_cannot_place_are_left_to_the_store(store):
    feed = ChangeFeed(store, retain_s=0.0)
    await store.register(decode("decode-0"))
    old = await store.list_changes("")
    await store.heartbeat("decode-0", NodeLoad(queue_depth=1))
    newer = await store.list_changes(old.change_id)
    await feed.answer(newer.change_id)  # the feed starts after `old`
    await store.heartbeat("decode-0", NodeLoad(queue_depth=2))
    await feed.answer(newer.change_id)  # and, retaining nothing, forgets `newer` too

    assert await feed.answer("") is None, "a full listing"
    assert await feed.answer("yesterday") is None, "malformed: the store refuses it"
    assert await feed.answer(old.change_id) is None, "before the feed started"
    assert await feed.answer("99999999999999-0") is None, "from a replica further ahead"
    latest = await store.list_changes(newer.change_id)
    assert ids(await feed.answer(latest.change_id)) == set(), "its newest position still is"


async def test_a_gap_in_the_history_restarts_the_feed(redis_url, redis_prefix):
    client = redis_async.from_url(redis_url)
    store = GossipStore(client, redis_prefix, default_ttl_s=5.0, changes_maxlen=10)
    feed = ChangeFeed(store)
    try:
        for i in range(3):
            await store.register(decode(f"decode-{i}"))
        start = await store.list_changes("")
        await feed.answer(start.change_id)
        for beat in range(300):  # far past the trimmed history
            await store.heartbeat("decode-1", NodeLoad(queue_depth=beat))
        assert await feed.answer(start.change_id) is None, "the store lists it all again"
        after_gap = await store.list_changes(start.change_id)
        assert after_gap.full
        await store.heartbeat("decode-2", NodeLoad(queue_depth=1))
        assert ids(await feed.answer(after_gap.change_id)) == {"decode-2"}
    finally:
        await client.aclose()


def test_a_change_id_reads_as_one_position_per_shard():
    assert position("", 2) is None
    assert position("5-1", 2) == ((5, 1), (5, 1)), "one id stands for every shard"
    assert position("5-1,7", 2) == ((5, 1), (7, 0))
    assert position("5-1,7", 3) is None, "issued under another shard count"
    assert position("5-x", 1) is None
    assert position("1" * 20, 1) is None, "more digits than the store accepts"
