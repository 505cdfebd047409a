"""Spare migration slots in the real Redis: reserved ahead for no request, counted against
the cap and not among the slots in use, kept only far from the cap, claimed for a request
(then its lease like any other), gone once they lapse or are released."""

from __future__ import annotations

import asyncio

import pytest

from kvrs.errors import ResourceExhausted
from services.common import connect_redis
from services.common.slot_leases import SlotPolicy, SlotStore


@pytest.fixture
async def store(redis_url, redis_prefix):
    client = connect_redis(redis_url)
    store = SlotStore(client, redis_prefix, SlotPolicy(cluster_cap=4, default_ttl_s=5.0))
    await store.publish_policy()
    yield store
    await client.aclose()


async def test_a_spare_counts_against_the_cap_but_not_among_the_slots_in_use(store):
    spare = await store.reserve_spare("replica-0")
    assert spare is not None and spare.holder_id == "replica-0" and not spare.request_id
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (0, 1)
    for i in range(3):
        await store.reserve(f"m{i}", "replica-1", "p0", f"d{i}")
    with pytest.raises(ResourceExhausted, match="4 of 4 migration slots"):
        await store.reserve("m3", "replica-1", "p0", "d3")
    assert (await store.stats()).slots_in_use == 3


async def test_spares_are_kept_only_under_half_the_cap_and_without_link_caps(
    store, redis_url, redis_prefix
):
    assert await store.reserve_spare("replica-0") is not None
    await store.reserve("m0", "replica-1", "p0", "d0")
    # Two of four held: a third would reach more than half the cap.
    assert await store.reserve_spare("replica-0") is None
    client = connect_redis(redis_url)
    try:
        linked = SlotStore(
            client, redis_prefix, SlotPolicy(cluster_cap=64, link_cap=2, default_ttl_s=5.0)
        )
        await linked.publish_policy()
        assert await linked.reserve_spare("replica-0") is None, "a spare has no link to count"
    finally:
        await client.aclose()


async def test_a_claimed_spare_is_the_requests_lease(store):
    spare = await store.reserve_spare("replica-0")
    assert spare is not None
    claim = await store.claim(spare.lease_id, "m-claimed", "p0", "d1", ttl_s=5.0)
    lease = claim.lease
    assert lease is not None and claim.spare is None
    assert (lease.lease_id, lease.request_id) == (spare.lease_id, "m-claimed")
    assert (lease.src_instance_id, lease.dst_instance_id) == ("p0", "d1")
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (1, 0)
    assert [(link.src_instance_id, link.dst_instance_id, link.in_use) for link in stats.links] == [
        ("p0", "d1", 1)
    ]
    # From here on it is the request's lease: a retry gets it back, renew and release act.
    again = await store.reserve("m-claimed", "replica-1", "p0", "d1")
    assert again.retried and again.lease.lease_id == spare.lease_id
    assert (await store.renew(spare.lease_id, ttl_s=5.0)).request_id == "m-claimed"
    assert await store.release(spare.lease_id)
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots, stats.links) == (0, 0, ())


async def test_a_spare_that_lapsed_or_was_released_cannot_be_claimed(store):
    released = await store.reserve_spare("replica-0")
    assert released is not None and await store.release(released.lease_id)
    assert (await store.claim(released.lease_id, "m0", "p0", "d0")).lease is None
    lapsing = await store.reserve_spare("replica-0", ttl_s=0.2)
    assert lapsing is not None
    await asyncio.sleep(0.4)
    assert (await store.claim(lapsing.lease_id, "m1", "p0", "d0")).lease is None
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (0, 0)
    assert (stats.expired_total, stats.spares_lapsed_total) == (0, 1), "a spare lapses, no leak"


async def test_a_claim_whose_spare_was_released_first_still_leaves_a_replacement(store):
    # The migration ended (its lease released) before the scheduler's claim landed: the
    # claim holds nothing, and the holder keeps as many spares as it had.
    spare = await store.reserve_spare("replica-0")
    assert spare is not None and await store.release(spare.lease_id)
    claim = await store.claim(spare.lease_id, "m0", "p0", "d0", replace_for="replica-0")
    assert claim.lease is None
    assert claim.spare is not None and claim.spare.holder_id == "replica-0"
    assert claim.spare.lease_id != spare.lease_id
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots, stats.links) == (0, 1, ())


async def test_a_claim_reserves_the_spare_that_replaces_it_in_the_same_step(store):
    spare = await store.reserve_spare("replica-0")
    assert spare is not None
    claim = await store.claim(spare.lease_id, "m0", "p0", "d0", replace_for="replica-0")
    assert claim.lease is not None and claim.spare is not None
    assert claim.spare.holder_id == "replica-0" and claim.spare.lease_id != spare.lease_id
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (1, 1)
    # Two of four held: a replacement would pass half the cap, so none is made.
    again = await store.claim(claim.spare.lease_id, "m1", "p0", "d1", replace_for="replica-0")
    assert again.lease is not None and again.spare is None
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (2, 0)
