"""Spare migration slots in the real Redis: reserved ahead for no request, counted against
the cap and not among the slots in use, kept only far from the cap, claimed for a request
(then its lease like any other), gone once they lapse or are released."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvrs.errors import ResourceExhausted
from services.common import connect_redis
from services.common.slot_leases import Claim, SlotPolicy, SlotStore, SpareClaim
from services.scheduler.slots import RedisSlots


async def claim_one(
    store: SlotStore, lease_id: str, request_id: str, src: str, dst: str, **kwargs
) -> Claim:
    (claim,) = await store.claim([SpareClaim(lease_id, request_id, src, dst)], **kwargs)
    return claim


@contextlib.asynccontextmanager
async def published_store(redis_url: str, redis_prefix: str, cluster_cap: int):
    """A store whose policy (this cap, 5 s leases) is published, over its own client."""
    client = connect_redis(redis_url)
    try:
        store = SlotStore(client, redis_prefix, SlotPolicy(cluster_cap, default_ttl_s=5.0))
        await store.publish_policy()
        yield store
    finally:
        await client.aclose()


@pytest.fixture
async def store(redis_url, redis_prefix):
    async with published_store(redis_url, redis_prefix, cluster_cap=4) as store:
        yield store


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
    claim = await claim_one(store, spare.lease_id, "m-claimed", "p0", "d1", ttl_s=5.0)
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
    assert (await claim_one(store, released.lease_id, "m0", "p0", "d0")).lease is None
    lapsing = await store.reserve_spare("replica-0", ttl_s=0.2)
    assert lapsing is not None
    await asyncio.sleep(0.4)
    assert (await claim_one(store, lapsing.lease_id, "m1", "p0", "d0")).lease is None
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (0, 0)
    assert (stats.expired_total, stats.spares_lapsed_total) == (0, 1), "a spare lapses, no leak"


async def test_a_claim_whose_spare_was_released_first_still_leaves_a_replacement(store):
    # The migration ended (its lease released) before the scheduler's claim landed: the
    # claim holds nothing, and the holder keeps as many spares as it had.
    spare = await store.reserve_spare("replica-0")
    assert spare is not None and await store.release(spare.lease_id)
    claim = await claim_one(store, spare.lease_id, "m0", "p0", "d0", replace_for="replica-0")
    assert claim.lease is None
    assert claim.spare is not None and claim.spare.holder_id == "replica-0"
    assert claim.spare.lease_id != spare.lease_id
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots, stats.links) == (0, 1, ())


async def test_a_claim_reserves_the_spare_that_replaces_it_in_the_same_step(store):
    spare = await store.reserve_spare("replica-0")
    assert spare is not None
    claim = await claim_one(store, spare.lease_id, "m0", "p0", "d0", replace_for="replica-0")
    assert claim.lease is not None and claim.spare is not None
    assert claim.spare.holder_id == "replica-0" and claim.spare.lease_id != spare.lease_id
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (1, 1)
    # Two of four held: a replacement would pass half the cap, so none is made.
    again = await claim_one(store, claim.spare.lease_id, "m1", "p0", "d1", replace_for="replica-0")
    assert again.lease is not None and again.spare is None
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (2, 0)


@pytest.fixture
async def roomy_store(redis_url, redis_prefix):
    """A store whose cap leaves room for several spares and the leases claimed from them."""
    async with published_store(redis_url, redis_prefix, cluster_cap=16) as store:
        yield store


async def test_claims_in_one_step_each_get_their_lease_and_a_replacement(roomy_store):
    store = roomy_store
    first, gone, second = [await store.reserve_spare("replica-0") for _ in range(3)]
    assert first and gone and second
    assert await store.release(gone.lease_id)  # its migration ended before the claim
    claims = await store.claim(
        [
            SpareClaim(first.lease_id, "m0", "p0", "d0"),
            SpareClaim(gone.lease_id, "m1", "p0", "d1"),
            SpareClaim(second.lease_id, "m2", "p1", "d1"),
        ],
        ttl_s=5.0,
        replace_for="replica-0",
    )
    assert [c.lease.request_id if c.lease else None for c in claims] == ["m0", None, "m2"]
    assert claims[2].lease is not None and claims[2].lease.src_instance_id == "p1"
    replacements = {c.spare.lease_id for c in claims if c.spare is not None}
    assert len(replacements) == 3, "every claim, held or gone, gets its replacement"
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (2, 3)


async def test_no_claims_is_no_redis_step(store):
    assert await store.claim([]) == []


async def test_spares_handed_out_together_are_claimed_in_one_redis_step(roomy_store):
    """A failure's burst of decisions takes several spares at once: their claims share one
    script run, and each request ends up holding its own lease."""
    store = roomy_store
    # The broker is never asked: the caps are published.
    slots = RedisSlots(store, "replica-0", ttl_s=30.0, broker=None, spares=3)
    keeper = asyncio.create_task(slots.keep_spares())
    await until(lambda stats: stats.spare_slots == 3, store)
    steps = []
    claim = store.claim

    async def counted(claims, *args, **kwargs):
        steps.append([c.request_id for c in claims])
        return await claim(claims, *args, **kwargs)

    store.claim = counted  # the real claim, counted
    leases = [await slots.reserve(f"m{i}", "p0", f"d{i}") for i in range(3)]
    assert not steps, "no Redis step on a decision's path"
    await until(lambda stats: stats.slots_in_use == 3, store)
    assert steps == [["m0", "m1", "m2"]]
    for i, lease in enumerate(leases):
        held = await store.renew(lease.lease_id, ttl_s=5.0)
        assert (held.request_id, held.dst_instance_id) == (f"m{i}", f"d{i}")
    assert (await store.stats()).spare_slots == 3, "each claim reserved its replacement"
    keeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await keeper
    stats = await store.stats()
    assert (stats.slots_in_use, stats.spare_slots) == (3, 0), "spares given back on stop"


async def until(condition, store: SlotStore, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition(await store.stats()):
        assert asyncio.get_running_loop().time() < deadline, "the slots never got there"
        await asyncio.sleep(0.01)
