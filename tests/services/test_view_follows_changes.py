"""Decision views follow gossip's change feed: deltas in between, full listings when due."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import redis

from kvrs.errors import DeadlineExceeded, Unavailable
from kvrs.learning import AssignedWork
from services.common.decision_inputs import InputsConfig, load_inputs
from services.common.gossip_follow import RegistryCopy
from services.common.gossip_records import LinkSample, NodeLoad
from services.common.gossip_source import GossipSource
from services.common.gossip_view import ViewCache
from services.common.membership import Membership
from services.gossip.client import GossipClient
from tests.services.test_gossip import decode, start_gossip


@pytest.fixture
async def gossip(redis_url, redis_prefix):
    handle = await start_gossip(redis_url, redis_prefix)
    client = GossipClient(f"127.0.0.1:{handle.port}", timeout_s=5)
    yield client
    await client.close()
    await handle.stop(0)


def view_over(gossip: GossipClient, resync_s: float) -> tuple[ViewCache, GossipSource]:
    source = GossipSource(lambda: gossip, resync_s=resync_s)
    view = ViewCache(load_inputs(InputsConfig()), source, refresh_s=0.1, stale_after_s=5.0)
    return view, source


async def test_a_view_refresh_reads_only_what_changed(gossip):
    for i in range(4):
        await gossip.register(decode(f"decode-{i}", ttl_s=30.0))
    view, source = view_over(gossip, resync_s=3600.0)
    assert await view.refresh()
    assert source.registry.full_listings == 1
    first = view.state
    assert sorted(first.cluster.instances) == [f"decode-{i}" for i in range(4)]
    columns_before = first.cluster.decode_instances()

    await gossip.heartbeat("decode-2", NodeLoad(queued_work_s=0.75, free_kv_blocks=8))
    await gossip.deregister("decode-3")
    assert await view.refresh()
    cluster = view.state.cluster
    assert cluster.instances["decode-2"].wait_s == 0.75
    assert not cluster.instances["decode-3"].alive
    assert cluster.instances["decode-0"] is first.cluster.instances["decode-0"], "unchanged"
    assert [s.instance_id for s in cluster.decode_instances()] == [
        "decode-0",
        "decode-1",
        "decode-2",
    ]
    assert columns_before is not cluster.decode_instances()
    assert source.registry.full_listings == 1, "no full listing between resyncs"

    await gossip.register(decode("decode-9", ttl_s=30.0))
    assert await view.refresh()
    assert "decode-9" in {s.instance_id for s in view.state.cluster.decode_instances()}
    assert source.registry.full_listings == 1

    await gossip.heartbeat("decode-1", NodeLoad(queue_depth=1))
    snapshot = await source.fetch()
    assert [n.registration.instance_id for n in snapshot.changed] == ["decode-1"]
    assert len(snapshot.nodes) == 5, "the snapshot still carries every instance"


async def test_a_view_refresh_reprices_only_the_links_measured_since(gossip):
    await gossip.register(dataclasses.replace(decode("prefill-0"), role="prefill", gpu_index=0))
    for i in range(2):
        await gossip.register(decode(f"decode-{i}", ttl_s=30.0))
    for i, bandwidth_bps in enumerate((8e9, 4e9, 2e9)):
        await gossip.report_link_sample(LinkSample("prefill-0", f"decode-{i}", bandwidth_bps))
    view, source = view_over(gossip, resync_s=3600.0)
    assert await view.refresh()
    first = view.state
    assert first.links_used == 2, "decode-2 is not registered yet"
    unchanged = first.cost.network.link_estimate("prefill-0", "decode-1")
    assert first.cost.network.link_estimate("prefill-0", "decode-0").bandwidth_bps == 8e9

    await gossip.report_link_sample(LinkSample("prefill-0", "decode-0", 1e9))
    await gossip.register(decode("decode-2", ttl_s=30.0))
    assert await view.refresh()
    network = view.state.cost.network
    assert network.link_estimate("prefill-0", "decode-0").bandwidth_bps == 1e9
    assert network.link_estimate("prefill-0", "decode-1") is unchanged
    assert network.link_estimate("prefill-0", "decode-2").bandwidth_bps == 2e9, (
        "a sample held until its instance registered"
    )
    assert view.state.links_used == 3
    assert first.cost.network.link_estimate("prefill-0", "decode-0").bandwidth_bps == 8e9, (
        "the previous view is left as it was"
    )
    assert source.registry.full_listings == 1

    settled = view.state
    assert await view.refresh()
    assert view.state.cost is settled.cost, "nothing measured since: the model is reused"


async def test_failures_reported_together_leave_the_view_in_one_rebuild(gossip, monkeypatch):
    from services.common import gossip_view

    for i in range(4):
        await gossip.register(decode(f"decode-{i}", ttl_s=30.0))
    view, _ = view_over(gossip, resync_s=3600.0)
    assert await view.refresh()
    rebuilds = []
    real = gossip_view.prepare_candidates
    monkeypatch.setattr(
        gossip_view, "prepare_candidates", lambda *args: rebuilds.append(args) or real(*args)
    )
    for instance_id in ("decode-1", "decode-3", "decode-1", "ghost"):
        view.mark_down(instance_id)
    alive = [s.instance_id for s in view.current().cluster.decode_instances()]
    assert alive == ["decode-0", "decode-2"]
    assert len(rebuilds) == 1, "one rebuild for every failure reported before the read"
    view.mark_down("decode-3")
    assert view.current().cluster.decode_instances()[1].instance_id == "decode-2"
    assert len(rebuilds) == 1, "an instance already down changes nothing"


async def test_an_instance_reported_down_then_registered_again_is_a_candidate(gossip):
    """A failure the view has not applied yet does not outlive a refresh that lists the
    instance registered again."""
    for i in range(2):
        await gossip.register(decode(f"decode-{i}", ttl_s=30.0))
    view, _ = view_over(gossip, resync_s=3600.0)
    assert await view.refresh()
    await gossip.deregister("decode-1")
    view.mark_down("decode-1")
    await gossip.register(decode("decode-1", ttl_s=30.0))
    assert await view.refresh()
    alive = [s.instance_id for s in view.current().cluster.decode_instances()]
    assert alive == ["decode-0", "decode-1"]


async def test_resync_zero_lists_everything_every_refresh(gossip):
    await gossip.register(decode("decode-0", ttl_s=30.0))
    view, source = view_over(gossip, resync_s=0.0)
    for _ in range(3):
        assert await view.refresh()
    assert source.registry.full_listings == 3
    assert (await source.fetch()).changed is None


async def test_a_full_resync_drops_what_the_registry_forgot(gossip, redis_url, redis_prefix):
    import redis.asyncio as redis_async

    for i in range(2):
        await gossip.register(decode(f"decode-{i}", ttl_s=30.0))
    await gossip.deregister("decode-1")
    view, source = view_over(gossip, resync_s=3600.0)
    assert await view.refresh()
    assert "decode-1" in view.state.cluster.instances
    redis = redis_async.from_url(redis_url)
    try:  # what the down retention does when it expires the hash
        await redis.delete(f"{redis_prefix}gossip:node:decode-1")
    finally:
        await redis.aclose()
    assert await view.refresh()
    assert "decode-1" in view.state.cluster.instances, "no delta reports a forgotten instance"
    source.registry.resync_s = 0.0
    assert await view.refresh()
    assert "decode-1" not in view.state.cluster.instances


class GatedListings:
    """The real gossip client, whose full listings read Redis at once but answer only
    when the test opens the gate (a registry of thousands takes gossip seconds)."""

    def __init__(self, gossip: GossipClient) -> None:
        self.gossip = gossip
        self.gate = asyncio.Event()
        self.gate.set()
        self.listing_read = asyncio.Event()

    async def list_changes(self, after_change_id: str):
        changes = await self.gossip.list_changes(after_change_id)
        if not after_change_id:
            self.listing_read.set()
            await self.gate.wait()
        return changes


async def test_a_resync_runs_beside_the_polls_and_keeps_what_they_brought(
    gossip, redis_url, redis_prefix
):
    """A due resync does not hold up the poll that starts it; once in, it drops what the
    registry forgot and keeps what the polls brought while it was read."""
    import redis.asyncio as redis_async

    for i in range(3):
        await gossip.register(decode(f"decode-{i}", ttl_s=30.0))
    now_s = [0.0]
    copy = RegistryCopy(resync_s=10.0, clock=lambda: now_s[0])
    reader = GatedListings(gossip)
    assert await copy.poll(reader) is None, "the first poll is a full listing"
    redis = redis_async.from_url(redis_url)
    try:  # what the down retention does when it expires the hash
        await redis.delete(f"{redis_prefix}gossip:node:decode-2")
    finally:
        await redis.aclose()
    reader.gate.clear()
    reader.listing_read.clear()
    now_s[0] = 20.0
    assert await asyncio.wait_for(copy.poll(reader), timeout=5) == ()
    await asyncio.wait_for(reader.listing_read.wait(), timeout=5)
    await gossip.heartbeat("decode-0", NodeLoad(queue_depth=7))
    (changed,) = await asyncio.wait_for(copy.poll(reader), timeout=5)
    assert changed.registration.instance_id == "decode-0"
    assert "decode-2" in copy.nodes, "no delta reports a forgotten instance"
    reader.gate.set()
    await asyncio.sleep(0.05)
    assert await copy.poll(reader) is None, "the resync's listing is in"
    assert sorted(copy.nodes) == ["decode-0", "decode-1"]
    assert copy.nodes["decode-0"].load.queue_depth == 7, "newer than the listing's"
    assert copy.full_listings == 2


async def test_router_membership_follows_changes(gossip):
    await gossip.register(decode("decode-0", ttl_s=30.0))
    membership = Membership(gossip, refresh_s=0.1)
    assert await membership.refresh()
    await gossip.heartbeat("decode-0", NodeLoad(queue_depth=5))
    await gossip.register(decode("decode-1", ttl_s=30.0))
    assert await membership.refresh()
    assert membership.instance("decode-0").queue_depth == 5
    assert [i.instance_id for i in membership.alive("decode")] == ["decode-0", "decode-1"]
    await gossip.deregister("decode-0")
    assert await membership.refresh()
    assert not membership.is_alive("decode-0")


async def test_router_membership_knows_an_instance_registered_again_after_it_left(gossip):
    """A request excludes an instance that failed it only until that instance registers
    again: the membership says whether a `joined` event came after a given moment."""
    await gossip.register(decode("decode-0", ttl_s=30.0))
    membership = Membership(gossip, refresh_s=0.1)
    await membership.start()
    try:
        await gossip.deregister("decode-0")
        lost_s = time.monotonic()
        deadline_s = lost_s + 5.0
        while not membership.is_down("decode-0"):
            assert time.monotonic() < deadline_s, "the left event never arrived"
            await asyncio.sleep(0.02)
        assert not membership.joined_since("decode-0", lost_s)
        await gossip.register(decode("decode-0", ttl_s=30.0))
        while not membership.joined_since("decode-0", lost_s):
            assert time.monotonic() < deadline_s, "the joined event never arrived"
            await asyncio.sleep(0.02)
        assert membership.is_alive("decode-0")
        assert not membership.joined_since("decode-0", time.monotonic())
        assert not membership.joined_since("decode-1", lost_s)
    finally:
        await membership.close()


async def test_router_membership_shares_one_refresh_among_a_burst_of_joined_events(gossip):
    """Instances registering in a burst each send a `joined` event: the membership asks
    for a refresh on each, and those that arrive while one runs share the next, so it
    lists far fewer times than it saw events, and ends with every instance alive."""
    listings = 0

    class Counting:
        def __getattr__(self, name):
            return getattr(gossip, name)

        async def list_changes(self, after_change_id: str = ""):
            nonlocal listings
            listings += 1
            return await gossip.list_changes(after_change_id)

    membership = Membership(Counting(), refresh_s=30.0)
    await membership.start()
    try:
        started = listings
        await asyncio.gather(
            *(gossip.register(decode(f"decode-{i}", ttl_s=30.0)) for i in range(60))
        )
        deadline_s = time.monotonic() + 10.0
        while len(membership.alive("decode")) < 60:
            assert time.monotonic() < deadline_s, len(membership.alive("decode"))
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
    finally:
        await membership.close()
    assert 1 <= listings - started < 30, listings - started


async def test_a_view_carries_each_instances_pace_and_the_context_of_its_streams(gossip):
    """What the batch planner prices an instance's passes with: how much slower than the
    profile they run there, and the context its running streams read at every step."""
    await gossip.register(decode("decode-0", ttl_s=30.0))
    await gossip.register(decode("decode-1", ttl_s=30.0))
    await gossip.heartbeat(
        "decode-0", NodeLoad(running_requests=2, compute_factor=2.5, running_context_tokens=3000)
    )
    view, _ = view_over(gossip, resync_s=3600.0)
    assert await view.refresh()
    busy, quiet = (view.state.cluster.instances[f"decode-{i}"] for i in (0, 1))
    assert (busy.compute_factor, busy.running_context_tokens) == (2.5, 3000)
    assert (quiet.compute_factor, quiet.running_context_tokens) == (1.0, 0), "not measured"


async def test_work_assigned_since_the_last_heartbeat_moves_w_on_a_delta_refresh(gossip):
    await gossip.register(decode("decode-0", ttl_s=30.0))
    await gossip.register(decode("decode-1", ttl_s=30.0))
    await gossip.heartbeat("decode-0", NodeLoad(queued_work_s=0.5))
    assigned = AssignedWork()
    source = GossipSource(lambda: gossip, resync_s=3600.0)
    view = ViewCache(
        load_inputs(InputsConfig()), source, refresh_s=0.1, stale_after_s=5.0, assigned=assigned
    )
    assert await view.refresh()
    assert view.state.cluster.instances["decode-0"].wait_s == 0.5
    assigned.add("decode-0", time.time(), 0.4)
    assert await view.refresh()  # nothing changed in gossip
    assert source.registry.full_listings == 1
    assert 0.8 < view.state.cluster.instances["decode-0"].wait_s <= 0.9
    assert view.state.cluster.instances["decode-1"].wait_s == 0.0
    await asyncio.sleep(0.45)  # the assigned work is predicted done
    assert await view.refresh()
    assert view.state.cluster.instances["decode-0"].wait_s == 0.5


async def test_work_assigned_counts_for_the_next_decision_before_it_is_booked(gossip):
    """A scheduler books a decision's work into the view after its reply; a decision
    that reads the view first sees the work all the same, and a refresh that reads it
    from the assigned work does not count it twice."""
    for i in range(2):
        await gossip.register(decode(f"decode-{i}", ttl_s=30.0))
    assigned = AssignedWork()
    source = GossipSource(lambda: gossip, resync_s=3600.0)
    view = ViewCache(
        load_inputs(InputsConfig()), source, refresh_s=0.1, stale_after_s=5.0, assigned=assigned
    )
    assert await view.refresh()

    def waits() -> list[float]:
        instances = view.current().cluster.instances
        return [instances[f"decode-{i}"].wait_s for i in range(2)]

    for instance_id, work_s in (("decode-0", 0.25), ("decode-0", 0.5), ("decode-1", 1.0)):
        assigned.add(instance_id, time.time(), work_s)
        view.assign(instance_id, work_s)
    assert waits() == [0.75, 1.0], "read before the booking: counted all the same"
    view.book_assigned()  # the reply's bookkeeping, after the next decision: nothing left
    assert waits() == [0.75, 1.0]
    assigned.add("decode-1", time.time(), 2.0)
    view.assign("decode-1", 2.0)
    assert await view.refresh()  # reads every assignment, the unbooked one included
    view.book_assigned()
    assert waits() == pytest.approx([0.75, 3.0], abs=0.05)


async def test_router_membership_keeps_what_a_registry_loss_dropped_for_one_ttl(
    gossip, redis_url, redis_prefix
):
    """Redis restarted empty: the full listing lacks every instance until they register
    again; the router keeps placing on them meanwhile, and forgets them a TTL later."""
    await gossip.register(decode("decode-0", ttl_s=1.0))
    membership = Membership(gossip, refresh_s=0.1)
    assert await membership.refresh()
    client = redis.Redis.from_url(redis_url)
    try:
        client.delete(*client.keys(f"{redis_prefix}*"))
    finally:
        client.close()
    membership._registry.resync_s = 0.0  # every refresh a full listing
    assert await membership.refresh()
    assert [i.instance_id for i in membership.alive("decode")] == ["decode-0"]
    await asyncio.sleep(1.2)
    assert await membership.refresh()
    assert membership.alive("decode") == []


async def test_a_fetch_past_its_deadline_keeps_the_channel_and_an_unreachable_gossip_replaces_it(
    redis_url, redis_prefix, unused_tcp_port
):
    """A busy gossip (a deadline) gets no new connection on top of its work; a gossip
    that cannot be reached gets a fresh channel, which connects at once when it is back."""
    clients: list[GossipClient] = []

    def connect(address: str, timeout_s: float):
        def open_client() -> GossipClient:
            clients.append(GossipClient(address, timeout_s=timeout_s))
            return clients[-1]

        return open_client

    handle = await start_gossip(redis_url, redis_prefix)
    try:
        busy = GossipSource(connect(f"127.0.0.1:{handle.port}", 1e-6))
        with pytest.raises(DeadlineExceeded):
            await busy.fetch()
        assert busy.client is clients[0] and len(clients) == 1

        gone = GossipSource(connect(f"127.0.0.1:{unused_tcp_port}", 1.0))
        with pytest.raises(Unavailable):
            await gone.fetch()
        assert len(clients) == 3 and gone.client is clients[2]
    finally:
        await asyncio.sleep(0)  # the replaced client closes in a task of its own
        for client in clients:
            await client.close()
        await handle.stop(0)
