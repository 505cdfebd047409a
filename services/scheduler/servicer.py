"""SchedulerService: protobuf in, `decisions.Scheduler` call, protobuf out."""

from __future__ import annotations

import grpc

from kvrs.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.outcomes import outcome_from_pb
from services.scheduler.after_reply import deferring
from services.scheduler.convert import (
    batch_to_pb,
    corrections_to_pb,
    recover_items_from_pb,
    recovery_request_from_pb,
    recovery_to_pb,
    select_decode_from_pb,
    selection_to_pb,
)
from services.scheduler.decisions import Scheduler


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def SelectDecode(
        self, request: scheduler_pb2.SelectDecodeRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SelectDecodeResponse:
        with deferring(context):
            selection = self.scheduler.select_decode(select_decode_from_pb(request))
        return selection_to_pb(selection)

    async def Recover(
        self, request: scheduler_pb2.RecoverRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RecoverResponse:
        core_request = recovery_request_from_pb(
            request, request.failed_instance_id, request.exclude_instance_ids
        )
        with deferring(context):
            outcome = await self.scheduler.recover(
                core_request,
                failed_id=request.failed_instance_id,
                policy_name=request.policy,
                skip_slot=request.skip_slot,
            )
        return recovery_to_pb(outcome)

    async def RecoverBatch(
        self, request: scheduler_pb2.RecoverBatchRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RecoverBatchResponse:
        with deferring(context):
            outcome = await self.scheduler.recover_batch(
                batch_id=request.batch_id,
                failed_id=request.failed_instance_id,
                items=recover_items_from_pb(request),
                policy_name=request.policy,
                skip_slot=request.skip_slot,
            )
        return batch_to_pb(outcome)

    async def ReportOutcome(
        self, request: scheduler_pb2.ReportOutcomeRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReportOutcomeResponse:
        held = await self.scheduler.report_outcome(outcome_from_pb(request.outcome))
        return scheduler_pb2.ReportOutcomeResponse(stored_outcomes=held)

    async def GetCorrections(
        self, request: scheduler_pb2.GetCorrectionsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetCorrectionsResponse:
        return corrections_to_pb(self.scheduler.corrections())
