"""Translation between SchedulerService protobuf messages and the decision records."""

from __future__ import annotations

from collections.abc import Iterable

from kvrs.errors import InvalidArgument
from kvrs.learning import Corrections
from kvrs.prefill import PrefillOption
from kvrs.recovery import RecoveryRequest
from kvrs.v1 import scheduler_pb2, slots_pb2
from services.common.core_pb import ACTION_TO_PB, option_to_pb, transfer_to_pb
from services.common.outcomes import terms_to_pb
from services.scheduler.leases import Lease
from services.scheduler.records import (
    BatchOutcome,
    RecoveryOutcome,
    SelectDecodeInput,
    Selection,
)


def select_decode_from_pb(request: scheduler_pb2.SelectDecodeRequest) -> SelectDecodeInput:
    return SelectDecodeInput(
        request_id=request.request_id,
        prefill_id=request.prefill_instance_id,
        prompt_tokens=request.prompt_tokens,
        prefix_hashes=tuple(request.prefix_hashes),
        policy=request.policy,
        exclude_ids=frozenset(request.exclude_instance_ids),
        candidate_ids=frozenset(request.candidate_instance_ids),
        streamed=request.streamed,
        prefill_options=tuple(
            PrefillOption(o.instance_id, o.finish_s, o.prefix_hit_tokens)
            for o in request.prefill_options
        ),
    )


def selection_to_pb(selection: Selection) -> scheduler_pb2.SelectDecodeResponse:
    placement = selection.placement
    response = scheduler_pb2.SelectDecodeResponse(
        decode_instance_id=placement.instance_id,
        decode_address=selection.address,
        decode_transfer_address=selection.transfer_address,
        predicted_ttft_s=placement.predicted_ttft_s,
        transfer_s=placement.transfer.transfer_s,
        wait_s=placement.wait_s,
        prefix_hit_tokens=placement.prefix_hit_tokens,
        kv_bytes=placement.kv_bytes,
        transfer=transfer_to_pb(placement.transfer),
        policy=placement.policy,
        view_stale=selection.view_stale,
        view_age_s=selection.view_age_s,
        candidates_considered=placement.candidates_considered,
        predicted_terms=terms_to_pb(selection.predicted),
        planned_jobs=selection.planned_jobs,
        prefill_instance_id=selection.prefill_id,
    )
    if placement.runner_up is not None:
        response.runner_up_instance_id = placement.runner_up.instance_id
        response.runner_up_ttft_s = placement.runner_up.score_s
    return response


def recovery_request_from_pb(
    message: scheduler_pb2.RecoverRequest | scheduler_pb2.RecoverItem,
    failed_id: str,
    exclude_ids: Iterable[str] = (),
    where: str = "",
) -> RecoveryRequest:
    """The core's request for a Recover (or one RecoverBatch item) as the caller sent it:
    the failed instance excluded, a lost source KV unavailable. The fields the core
    request holds are checked here, naming the message's own field (`where` prefixes a
    batch item's); the scheduler checks the rest against its view."""
    if not message.request_id:
        raise InvalidArgument(where + "request_id", "must not be empty")
    if message.prompt_tokens <= 0:
        raise InvalidArgument(where + "prompt_tokens", f"must be > 0, got {message.prompt_tokens}")
    for field, value in (
        ("generated_tokens", message.generated_tokens),
        ("deadline_unix_ms", message.deadline_unix_ms),
    ):
        if value < 0:
            raise InvalidArgument(where + field, f"must be >= 0, got {value}")
    if not message.source_prefill_instance_id:
        raise InvalidArgument(where + "source_prefill_instance_id", "must not be empty")
    return RecoveryRequest(
        request_id=message.request_id,
        prompt_tokens=message.prompt_tokens,
        generated_tokens=message.generated_tokens,
        source_prefill_id=message.source_prefill_instance_id,
        deadline_s=message.deadline_unix_ms / 1000.0 if message.deadline_unix_ms else None,
        source_kv_available=not message.source_kv_lost,
        exclude_ids=frozenset({failed_id, *exclude_ids}),
        prefix_hashes=tuple(message.prefix_hashes),
    )


def recover_items_from_pb(request: scheduler_pb2.RecoverBatchRequest) -> list[RecoveryRequest]:
    return [
        recovery_request_from_pb(item, request.failed_instance_id, where=f"items[{i}].")
        for i, item in enumerate(request.items)
    ]


def _lease_to_pb(lease: Lease) -> slots_pb2.SlotLease:
    return slots_pb2.SlotLease(
        lease_id=lease.lease_id,
        request_id=lease.request_id,
        holder_id=lease.holder_id,
        src_instance_id=lease.src_id,
        dst_instance_id=lease.dst_id,
        expires_unix_ms=lease.expires_unix_ms,
    )


def recovery_to_pb(outcome: RecoveryOutcome) -> scheduler_pb2.RecoverResponse:
    decision = outcome.decision
    response = scheduler_pb2.RecoverResponse(
        request_id=decision.request_id,
        action=ACTION_TO_PB[decision.action],
        target_instance_id=decision.target_id,
        target_address=outcome.target.address,
        target_transfer_address=outcome.target.transfer_address,
        source_instance_id=decision.source_id,
        source_address=outcome.source.address,
        source_transfer_address=outcome.source.transfer_address,
        predicted_cost_s=decision.cost_s,
        options=[option_to_pb(option) for option in decision.options],
        hybrid_split_tokens=decision.split_tokens,
        reason=outcome.reason,
        slo_slack_s=decision.slack_s,
        view_stale=outcome.view_stale,
        view_age_s=outcome.view_age_s,
        predicted_terms=terms_to_pb(outcome.predicted),
        planned_jobs=outcome.planned_jobs,
    )
    if outcome.lease is not None:
        response.slot_lease.CopyFrom(_lease_to_pb(outcome.lease))
    if decision.runner_up is not None:
        runner_up = decision.runner_up
        response.runner_up = f"{runner_up.action.value}:{runner_up.target_id}"
    return response


def batch_to_pb(outcome: BatchOutcome) -> scheduler_pb2.RecoverBatchResponse:
    return scheduler_pb2.RecoverBatchResponse(
        decisions=[recovery_to_pb(item) for item in outcome.outcomes],
        planned_makespan_s=outcome.makespan_s,
    )


def corrections_to_pb(corrections: Corrections) -> scheduler_pb2.GetCorrectionsResponse:
    return scheduler_pb2.GetCorrectionsResponse(
        links=[
            scheduler_pb2.LinkCorrection(
                src_instance_id=src_id,
                dst_instance_id=dst_id,
                fixed_s=link.fixed_s,
                bandwidth_bps=link.bandwidth_bps,
                samples=link.samples,
            )
            for (src_id, dst_id), link in sorted(corrections.links.items())
        ],
        compute_factor=corrections.compute_factor,
        wait_per_decode_s=corrections.wait_per_decode_s,
        errors=[
            scheduler_pb2.TermError(
                kind=kind, term=term, p50=stats.p50, p90=stats.p90, samples=stats.samples
            )
            for (kind, term), stats in sorted(corrections.errors.items())
        ],
        samples=corrections.samples,
        worker_wait_s=dict(corrections.worker_wait_s),
    )
