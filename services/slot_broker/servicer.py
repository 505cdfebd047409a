"""SlotBrokerService: protobuf in, `SlotStore` call, protobuf out."""

from __future__ import annotations

import grpc

from kvrs.v1 import slots_pb2, slots_pb2_grpc
from services.common.slot_leases import Lease, SlotStore


def _lease_to_pb(lease: Lease) -> slots_pb2.SlotLease:
    return slots_pb2.SlotLease(
        lease_id=lease.lease_id,
        request_id=lease.request_id,
        holder_id=lease.holder_id,
        src_instance_id=lease.src_instance_id,
        dst_instance_id=lease.dst_instance_id,
        expires_unix_ms=lease.expires_unix_ms,
    )


class SlotBrokerServicer(slots_pb2_grpc.SlotBrokerServiceServicer):
    def __init__(self, store: SlotStore) -> None:
        self._store = store

    async def ReserveSlot(self, request, context: grpc.aio.ServicerContext):
        grant = await self._store.reserve(
            request.request_id,
            request.holder_id,
            request.src_instance_id,
            request.dst_instance_id,
            request.ttl_s,
        )
        return slots_pb2.ReserveSlotResponse(
            lease=_lease_to_pb(grant.lease),
            slots_in_use=grant.slots_in_use,
            cluster_cap=grant.cluster_cap,
        )

    async def RenewSlot(self, request, context: grpc.aio.ServicerContext):
        lease = await self._store.renew(request.lease_id, request.ttl_s)
        return slots_pb2.RenewSlotResponse(lease=_lease_to_pb(lease))

    async def ReleaseSlot(self, request, context: grpc.aio.ServicerContext):
        released = await self._store.release(request.lease_id)
        return slots_pb2.ReleaseSlotResponse(released=released)

    async def GetSlotStats(self, request, context: grpc.aio.ServicerContext):
        stats = await self._store.stats()
        return slots_pb2.GetSlotStatsResponse(
            slots_in_use=stats.slots_in_use,
            cluster_cap=stats.cluster_cap,
            links=[
                slots_pb2.LinkSlotStats(
                    src_instance_id=link.src_instance_id,
                    dst_instance_id=link.dst_instance_id,
                    in_use=link.in_use,
                    cap=link.cap,
                )
                for link in stats.links
            ],
            granted_total=stats.granted_total,
            denied_total=stats.denied_total,
            expired_total=stats.expired_total,
            spare_slots=stats.spare_slots,
            spares_lapsed_total=stats.spares_lapsed_total,
        )
