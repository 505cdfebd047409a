"""RouterService: protobuf in, `flow.Router.generate`, protobuf out."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import grpc

from kvrs.sampling import seed_for
from kvrs.v1 import router_pb2, router_pb2_grpc
from services.common.core_pb import ACTION_TO_PB, option_to_pb, sampling_from_pb
from services.common.outcomes import terms_to_pb
from services.router.flow import Router
from services.router.records import GenerateInput, RecoveryRecord, Summary, Token


def generate_from_pb(
    request: router_pb2.GenerateRequest, call_remaining_s: float | None = None
) -> GenerateInput:
    """The request as the flow takes it. A call with a gRPC deadline (`call_remaining_s`
    seconds left) is done by then whatever `deadline_unix_ms` says, so the earlier of the
    two is the request's deadline: recovery ABORTs against it, and waits end by it."""
    sampling = sampling_from_pb(request.sampling)
    if not sampling.seed:
        # Every worker the request reaches draws with this seed: recoveries agree.
        sampling = dataclasses.replace(sampling, seed=seed_for(request.request_id))
    return GenerateInput(
        request_id=request.request_id,
        prompt=tuple(request.prompt_token_ids),
        max_new_tokens=request.max_new_tokens,
        ttft_slo_s=request.ttft_slo_s,
        deadline_unix_ms=_deadline_unix_ms(request.deadline_unix_ms, call_remaining_s),
        placement_policy=request.placement_policy,
        recovery_policy=request.recovery_policy,
        prefill_instance_id=request.prefill_instance_id,
        decode_instance_id=request.decode_instance_id,
        sampling=sampling,
    )


def _deadline_unix_ms(requested_unix_ms: int, call_remaining_s: float | None) -> int:
    if call_remaining_s is None:
        return requested_unix_ms
    call_unix_ms = math.floor((time.time() + max(0.0, call_remaining_s)) * 1000)
    return call_unix_ms if requested_unix_ms == 0 else min(requested_unix_ms, call_unix_ms)


def recovery_to_pb(record: RecoveryRecord) -> router_pb2.RecoveryReport:
    report = router_pb2.RecoveryReport(
        failed_instance_id=record.failed_instance_id,
        detected_by=record.detected_by,
        lost_reason=record.lost_reason,
        generated_tokens=record.generated_tokens,
        policy=record.policy,
        measured_s=record.measured_s,
        decision_s=record.decision_s,
        succeeded=record.succeeded,
        error=record.error,
        slo_slack_s=math.inf,
        measured_terms=terms_to_pb(record.measured),
    )
    decision = record.decision
    if decision is not None:
        report.action = ACTION_TO_PB[decision.action]
        report.target_instance_id = decision.target.instance_id
        report.source_instance_id = decision.source.instance_id
        report.split_tokens = decision.split_tokens
        report.predicted_cost_s = decision.predicted_cost_s
        report.options.extend(option_to_pb(option) for option in decision.options)
        report.slo_slack_s = decision.slo_slack_s
        report.reason = decision.reason
        report.batch_size = decision.batch_size
        report.predicted_terms.CopyFrom(terms_to_pb(decision.predicted))
    return report


def summary_to_pb(summary: Summary) -> router_pb2.GenerateSummary:
    return router_pb2.GenerateSummary(
        request_id=summary.request_id,
        prefill_instance_id=summary.prefill_instance_id,
        decode_instance_id=summary.decode_instance_id,
        final_decode_instance_id=summary.final_decode_instance_id,
        prompt_tokens=summary.prompt_tokens,
        generated_tokens=summary.generated_tokens,
        finish_reason=summary.finish_reason,
        ttft_s=summary.ttft_s,
        ttft_slo_met=summary.ttft_slo_met,
        total_s=summary.total_s,
        predicted_ttft_s=summary.predicted_ttft_s,
        prefill_s=summary.prefill_s,
        kv_transfer_s=summary.kv_transfer_s,
        kv_bytes=summary.kv_bytes,
        prefix_hit_tokens=summary.prefix_hit_tokens,
        recoveries=[recovery_to_pb(record) for record in summary.recoveries],
        trace_id=summary.trace_id,
        placement_measured_s=summary.placement_measured_s,
        placement_predicted_s=summary.placement_predicted_s,
    )


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Generate: one message per token; the summary rides on the last token's message."""

    def __init__(self, router: Router) -> None:
        self._router = router

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Written with context.write from a coroutine, not yielded from a generator: when
        # the client hangs up (the HTTP adapter does right after the summary) the
        # cancellation lands here, and closing the flow's generator releases the request's
        # KV at once. A suspended generator would wait for the garbage collector.
        domain = generate_from_pb(request, context.time_remaining())
        last_index = domain.max_new_tokens - 1
        held: Token | None = None
        async with contextlib.aclosing(self._router.generate(domain)) as items:
            async for item in items:
                if isinstance(item, Token):
                    if item.index == last_index:
                        held = item
                    else:
                        await context.write(
                            router_pb2.GenerateResponse(index=item.index, token_id=item.token_id)
                        )
                    continue
                summary = summary_to_pb(item)
                if held is not None:
                    await context.write(
                        router_pb2.GenerateResponse(
                            index=held.index, token_id=held.token_id, summary=summary
                        )
                    )
                else:
                    await context.write(router_pb2.GenerateResponse(index=-1, summary=summary))
