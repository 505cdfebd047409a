"""Decision outcomes between protobuf and the core's `kvrs.learning` records.

The router builds outcomes and the scheduler stores and fits them; both speak
`DecisionTerms` / `DecisionOutcome` on the wire and `Terms` / `Outcome` inside.
"""

from __future__ import annotations

from kvrs.errors import InvalidArgument
from kvrs.learning import TERMS, Outcome, Terms
from kvrs.v1 import common_pb2, scheduler_pb2

__all__ = ["outcome_from_pb", "outcome_to_pb", "terms_from_pb", "terms_to_pb"]


def terms_to_pb(terms: Terms) -> common_pb2.DecisionTerms:
    return common_pb2.DecisionTerms(**terms.as_dict())


def terms_from_pb(message: common_pb2.DecisionTerms) -> Terms:
    return Terms(**{name: getattr(message, name) for name in TERMS})


def outcome_to_pb(outcome: Outcome) -> scheduler_pb2.DecisionOutcome:
    return scheduler_pb2.DecisionOutcome(
        kind=outcome.kind,
        request_id=outcome.request_id,
        source_instance_id=outcome.source_id,
        target_instance_id=outcome.target_id,
        decided_unix_ms=round(outcome.at_s * 1000.0),
        predicted=terms_to_pb(outcome.predicted),
        measured=terms_to_pb(outcome.measured),
        kv_bytes=outcome.kv_bytes,
        prefill_tokens=outcome.prefill_tokens,
        cached_tokens=outcome.cached_tokens,
        extend_tokens=outcome.extend_tokens,
        target_running_requests=outcome.target_running,
        target_jobs=outcome.target_jobs,
        streamed=outcome.streamed,
    )


def outcome_from_pb(message: scheduler_pb2.DecisionOutcome) -> Outcome:
    """The core record; InvalidArgument names the first bad field (`outcome.<field>`)."""
    try:
        return _outcome(message)
    except InvalidArgument as exc:
        raise InvalidArgument(f"outcome.{exc.field}", exc.message) from None


def _outcome(message: scheduler_pb2.DecisionOutcome) -> Outcome:
    return Outcome(
        kind=message.kind,
        request_id=message.request_id,
        source_id=message.source_instance_id,
        target_id=message.target_instance_id,
        at_s=message.decided_unix_ms / 1000.0,
        predicted=terms_from_pb(message.predicted),
        measured=terms_from_pb(message.measured),
        kv_bytes=message.kv_bytes,
        prefill_tokens=message.prefill_tokens,
        cached_tokens=message.cached_tokens,
        extend_tokens=message.extend_tokens,
        target_running=message.target_running_requests,
        # 0: a reporter that predates the field, whose predictions counted one job.
        target_jobs=message.target_jobs or 1,
        streamed=message.streamed,
    )
