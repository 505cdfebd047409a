"""WorkerService: translates between worker.proto messages and the engine's domain calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvrs.errors import InvalidArgument
from kvrs.sampling import Sampling
from kvrs.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from libkvxfer import PROTOCOL_VERSION, TransferTicket
from services.common import traceparent
from services.common.core_pb import sampling_from_pb
from services.common.metrics import Metrics
from services.worker.engine import SendResult, WorkerEngine

ROLE_TO_PB = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}


def ticket_to_pb(ticket: TransferTicket) -> worker_pb2.KvTransferTicket:
    return worker_pb2.KvTransferTicket(
        protocol_version=ticket.protocol_version,
        transfer_id=ticket.transfer_id,
        tag=ticket.tag,
        receiver_instance_id=ticket.receiver_id,
        receiver_incarnation=ticket.receiver_incarnation,
        rendezvous_address=ticket.rendezvous_address,
        group_generation=ticket.group_generation,
        sender_instance_id=ticket.sender_id,
        request_id=ticket.request_id,
        token_start=ticket.token_start,
        token_end=ticket.token_end,
        traceparent=ticket.traceparent,
        auth_key=ticket.auth_key,
    )


def ticket_from_pb(message: worker_pb2.KvTransferTicket) -> TransferTicket:
    if not message.transfer_id or not message.rendezvous_address:
        raise InvalidArgument(
            "ticket", "is missing (transfer_id and rendezvous_address are required)"
        )
    return TransferTicket(
        protocol_version=message.protocol_version,
        transfer_id=message.transfer_id,
        tag=message.tag,
        receiver_id=message.receiver_instance_id,
        receiver_incarnation=message.receiver_incarnation,
        rendezvous_address=message.rendezvous_address,
        group_generation=message.group_generation,
        sender_id=message.sender_instance_id,
        request_id=message.request_id,
        token_start=message.token_start,
        token_end=message.token_end,
        traceparent=message.traceparent,
        auth_key=message.auth_key,
    )


def send_result_from_pb(message: worker_pb2.SendKvResponse) -> SendResult:
    return SendResult(
        kv_bytes=message.kv_bytes, transfer_s=message.transfer_s, token_ids=list(message.token_ids)
    )


def _sampling(request) -> Sampling | None:
    """The request's sampling parameters; None when it has none (keep what the KV has)."""
    return sampling_from_pb(request.sampling) if request.HasField("sampling") else None


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """One worker's RPCs; every domain error maps through the shared interceptor."""

    def __init__(
        self,
        engine: WorkerEngine,
        role: str,
        dtype: str,
        location: common_pb2.Location,
        metrics: Metrics | None = None,
    ) -> None:
        self._engine = engine
        self._metrics = metrics or Metrics()
        self._role = role
        self._dtype = dtype
        self._location = location

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        result = await self._engine.prefill(
            request.request_id,
            request.prompt_token_ids,
            request.lease_s,
            _sampling(request),
            request.prompt_tokens,
        )
        return worker_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=result.first_token_id,
            prompt_tokens=result.prompt_tokens,
            kv_bytes=result.kv_bytes,
            prefill_s=result.prefill_s,
            queued_s=result.queued_s,
            lease_expires_unix_ms=result.lease_expires_unix_ms,
            instance_id=self._engine.instance_id,
            prefix_hit_tokens=result.prefix_hit_tokens,
        )

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        stop = request.stop_token_id if request.HasField("stop_token_id") else None
        outcome = "failed"
        try:
            async for token in self._engine.decode(
                request.request_id,
                request.generated_token_ids,
                request.max_new_tokens,
                stop,
                request.release_when_done,
                _sampling(request),
            ):
                yield worker_pb2.DecodeResponse(
                    request_id=request.request_id,
                    token_id=token.token_id,
                    index=token.index,
                    step_s=token.step_s,
                    last=token.last,
                )
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self._metrics.requests.labels(outcome=outcome).inc()

    async def Extend(
        self, request: worker_pb2.ExtendRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ExtendResponse:
        result = await self._engine.extend(
            request.request_id, request.token_ids, _sampling(request)
        )
        return worker_pb2.ExtendResponse(
            request_id=request.request_id,
            next_token_id=result.next_token_id,
            resident_tokens=result.resident_tokens,
            extend_s=result.extend_s,
            kv_bytes=result.kv_bytes,
        )

    async def PullKv(
        self, request: worker_pb2.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PullKvResponse:
        result = await self._engine.pull_kv(
            request.request_id,
            request.source_instance_id,
            request.source_address,
            request.token_start,
            request.token_end,
            request.prompt_tokens,
            request.prefix_token_ids,
            request.lease_s,
            request.pacing_bps,
            traceparent=traceparent(),
            deadline_s=context.time_remaining(),
            while_prefilling=request.while_prefilling,
        )
        self._record_transfer("received", result.transferred_kv_bytes, result.transfer_s)
        return worker_pb2.PullKvResponse(
            request_id=request.request_id,
            resident_tokens=result.resident_tokens,
            transferred_kv_bytes=result.transferred_kv_bytes,
            transfer_s=result.transfer_s,
            transfer_bps=result.transfer_bps,
            recomputed_tokens=result.recomputed_tokens,
            recompute_s=result.recompute_s,
            total_s=result.total_s,
            transfer_id=result.transfer_id,
        )

    async def SendKv(
        self, request: worker_pb2.SendKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.SendKvResponse:
        ticket = ticket_from_pb(request.ticket)
        if ticket.request_id != request.request_id:
            raise InvalidArgument(
                "ticket.request_id",
                f"{ticket.request_id!r} differs from request_id {request.request_id!r}",
            )
        result = await self._engine.send_kv(ticket, request.pacing_bps, request.while_prefilling)
        self._record_transfer("sent", result.kv_bytes, result.transfer_s)
        return worker_pb2.SendKvResponse(
            request_id=request.request_id,
            kv_bytes=result.kv_bytes,
            transfer_s=result.transfer_s,
            token_ids=result.token_ids,
        )

    def _record_transfer(self, direction: str, kv_bytes: int, transfer_s: float) -> None:
        """Counts the bytes of one completed transfer; its rate only when any moved."""
        if kv_bytes <= 0:
            return
        self._metrics.transfer_bytes.labels(direction).inc(kv_bytes)
        if transfer_s > 0:
            self._metrics.transfer_rate_bps.observe(kv_bytes * 8 / transfer_s)

    async def ReleaseKv(
        self, request: worker_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKvResponse:
        released, freed = self._engine.release(request.request_id)
        return worker_pb2.ReleaseKvResponse(released=released, freed_kv_bytes=freed)

    async def GetWorkerStats(
        self, request: worker_pb2.GetWorkerStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetWorkerStatsResponse:
        engine = self._engine
        stats = engine.stats()
        return worker_pb2.GetWorkerStatsResponse(
            instance_id=engine.instance_id,
            role=ROLE_TO_PB[self._role],
            model=engine.model_name,
            dtype=self._dtype,
            location=self._location,
            transfer_address=engine.agent.address,
            protocol_version=PROTOCOL_VERSION,
            resident_requests=stats.resident_requests,
            block_tokens=stats.block_tokens,
            kv_capacity_blocks=stats.kv_capacity_blocks,
            free_kv_blocks=stats.free_kv_blocks,
            used_kv_bytes=stats.used_kv_bytes,
            kv_capacity_bytes=stats.kv_capacity_bytes,
            queued_work_s=stats.queued_work_s,
            compute_factor=stats.compute_factor,
            queue_depth=stats.queue_depth,
            running_requests=stats.running_requests,
            evicted_requests=stats.evicted_requests,
            expired_requests=stats.expired_requests,
            resident_prefix_hashes=stats.resident_prefix_hashes,
        )
