"""SlotBrokerService under hostile input: clean, named refusals; the cap never moves."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from reliability_stack import KNOWN_IDS, assert_serving, call
from reliability_strategies import PROPERTY_SETTINGS, doubles, ids

from kvrs.v1 import slots_pb2, slots_pb2_grpc

IDS = ids(KNOWN_IDS)


@pytest.fixture(scope="module")
def stub(plane):
    channel = plane.channel("slot-broker")
    yield slots_pb2_grpc.SlotBrokerServiceStub(channel)
    assert_serving(channel, "kvrs.v1.SlotBrokerService")
    channel.close()


def cap_holds(stub) -> slots_pb2.GetSlotStatsResponse:
    stats = stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=10)
    assert 0 <= stats.slots_in_use <= stats.cluster_cap, stats
    return stats


reservations = st.builds(
    slots_pb2.ReserveSlotRequest,
    request_id=IDS,
    holder_id=IDS,
    src_instance_id=IDS,
    dst_instance_id=IDS,
    ttl_s=doubles(),
)


@PROPERTY_SETTINGS
@given(request=reservations)
def test_reserve_slot(stub, request):
    reply = call(stub.ReserveSlot, request)
    cap_holds(stub)
    if reply is not None:
        assert reply.lease.request_id == request.request_id
        assert reply.slots_in_use <= reply.cluster_cap
        released = stub.ReleaseSlot(
            slots_pb2.ReleaseSlotRequest(lease_id=reply.lease.lease_id), timeout=10
        )
        # A lease of a few ms (TTLs down to 1 ms are granted) may expire before the release.
        assert released.released or 0 < request.ttl_s < 1


@PROPERTY_SETTINGS
@given(lease_id=IDS, ttl_s=doubles())
def test_renew_unknown_or_bad_lease(stub, lease_id, ttl_s):
    call(stub.RenewSlot, slots_pb2.RenewSlotRequest(lease_id=lease_id, ttl_s=ttl_s))
    cap_holds(stub)


@PROPERTY_SETTINGS
@given(ttl_s=doubles(), renew_ttl_s=doubles(), release_twice=st.booleans())
def test_lease_lifecycle(stub, ttl_s, renew_ttl_s, release_twice):
    """A real lease renewed and released with any TTLs: never a stuck slot."""
    before = cap_holds(stub).slots_in_use
    reply = call(
        stub.ReserveSlot,
        slots_pb2.ReserveSlotRequest(
            request_id="lifecycle",
            holder_id="property",
            src_instance_id="prefill-0",
            dst_instance_id="decode-0",
            ttl_s=ttl_s,
        ),
    )
    if reply is None:
        return
    lease_id = reply.lease.lease_id
    call(stub.RenewSlot, slots_pb2.RenewSlotRequest(lease_id=lease_id, ttl_s=renew_ttl_s))
    release = slots_pb2.ReleaseSlotRequest(lease_id=lease_id)
    first = stub.ReleaseSlot(release, timeout=10).released
    if release_twice:
        assert not stub.ReleaseSlot(release, timeout=10).released
    # A 1 ms TTL may expire before the release: either way the slot is back.
    assert first or ttl_s < 0.01 or renew_ttl_s < 0.01
    assert cap_holds(stub).slots_in_use <= before


@PROPERTY_SETTINGS
@given(lease_id=IDS)
def test_release_slot(stub, lease_id):
    call(stub.ReleaseSlot, slots_pb2.ReleaseSlotRequest(lease_id=lease_id))
    cap_holds(stub)
