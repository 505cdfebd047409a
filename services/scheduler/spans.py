"""Decision span attributes; every name is listed in docs/telemetry.md.

Each builder returns a dict, so a decision writes its span's attributes once: every
`set_attributes` call costs microseconds on the request path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from opentelemetry.util.types import AttributeValue

from kvrs.network import TransferEstimate
from kvrs.placement import Placement
from kvrs.recovery import Action, OptionCost, RecoveryRequest
from services.common.gossip_view import DecisionView
from services.scheduler.records import RecoveryOutcome, SlotOutcome


def view_attributes(view: DecisionView) -> dict[str, AttributeValue]:
    return {
        "kvrs.view_age_s": view.age_s,
        "kvrs.view_stale": view.stale,
        "kvrs.view_links": view.state.links_used,
    }


def placement_attributes(placement: Placement) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "kvrs.candidates_considered": placement.candidates_considered,
        "kvrs.chosen_instance_id": placement.instance_id,
        "kvrs.predicted_ttft_s": placement.predicted_ttft_s,
        "kvrs.wait_s": placement.wait_s,
        "kvrs.prefix_hit_tokens": placement.prefix_hit_tokens,
        "kvrs.kv_bytes": placement.kv_bytes,
        **transfer_attributes(placement.transfer),
    }
    runner_up = placement.runner_up
    if runner_up is not None:
        attributes["kvrs.runner_up.instance_id"] = runner_up.instance_id
        attributes["kvrs.runner_up.score_s"] = runner_up.score_s
        attributes["kvrs.runner_up.tier"] = int(runner_up.tier)
    return attributes


def transfer_attributes(transfer: TransferEstimate) -> dict[str, AttributeValue]:
    return {
        "kvrs.transfer.src_instance_id": transfer.src_id,
        "kvrs.transfer.dst_instance_id": transfer.dst_id,
        "kvrs.transfer_s": transfer.transfer_s,
        "kvrs.transfer.kv_bytes": transfer.kv_bytes,
        "kvrs.transfer.tier": int(transfer.tier),
        "kvrs.transfer.bandwidth_bps": transfer.bottleneck_bps,
        "kvrs.transfer.rtt_s": transfer.rtt_s,
        "kvrs.transfer.telemetry_age_s": transfer.telemetry_age_s,
        "kvrs.transfer.telemetry_stale": transfer.telemetry_stale,
        "kvrs.transfer.flows_on_path": transfer.flows_on_path,
    }


def recover_input_attributes(
    request: RecoveryRequest, failed_id: str, skip_slot: bool
) -> dict[str, AttributeValue]:
    """The Recover call as the caller sent it."""
    deadline_s = request.deadline_s
    return {
        "kvrs.request_id": request.request_id,
        "kvrs.failed_instance_id": failed_id,
        "kvrs.source_prefill_instance_id": request.source_prefill_id,
        "kvrs.prompt_tokens": request.prompt_tokens,
        "kvrs.generated_tokens": request.generated_tokens,
        "kvrs.deadline_unix_ms": round(deadline_s * 1000) if deadline_s is not None else 0,
        "kvrs.source_kv_lost": not request.source_kv_available,
        "kvrs.skip_slot": skip_slot,
    }


def recovery_attributes(outcome: RecoveryOutcome) -> dict[str, AttributeValue]:
    decision = outcome.decision
    attributes: dict[str, AttributeValue] = {
        "kvrs.action": decision.action.value,
        "kvrs.target_instance_id": decision.target_id,
        "kvrs.source_instance_id": decision.source_id,
        "kvrs.cost_s": decision.cost_s,
        "kvrs.split_tokens": decision.split_tokens,
        "kvrs.reason": outcome.reason,
        "kvrs.slot.outcome": outcome.slot_outcome,
        "kvrs.replayed": outcome.replayed,
        "kvrs.view_age_s": outcome.view_age_s,
        "kvrs.view_stale": outcome.view_stale,
        "kvrs.options_evaluated": len(decision.options),
    }
    if math.isfinite(decision.slack_s):
        attributes["kvrs.slo_slack_s"] = decision.slack_s
    if outcome.lease is not None:
        attributes["kvrs.slot.lease_id"] = outcome.lease.lease_id
    if outcome.transfer is not None:
        attributes.update(transfer_attributes(outcome.transfer))
    runner_up = decision.runner_up
    if runner_up is not None:
        attributes["kvrs.runner_up.action"] = runner_up.action.value
        attributes["kvrs.runner_up.instance_id"] = runner_up.target_id
        attributes["kvrs.runner_up.cost_s"] = runner_up.cost_s
    best: dict[Action, OptionCost] = {}
    for option in decision.options:
        current = best.get(option.action)
        if current is None or _better(option, current):
            best[option.action] = option
    for action, option in best.items():
        prefix = f"kvrs.option.{action.value}."
        attributes[prefix + "cost_s"] = option.cost_s
        attributes[prefix + "target_instance_id"] = option.target_id
        attributes[prefix + "wait_s"] = option.wait_s
        attributes[prefix + "transfer_s"] = option.transfer_s
        attributes[prefix + "compute_s"] = option.compute_s
        attributes[prefix + "feasible"] = option.feasible
        if action is Action.HYBRID:
            attributes[prefix + "split_tokens"] = option.split_tokens
        if not option.feasible:
            attributes[prefix + "infeasible_reason"] = option.infeasible_reason
    return attributes


def _better(option: OptionCost, current: OptionCost) -> bool:
    """Feasible options first, then the cheaper."""
    return (not option.feasible, option.cost_s) < (not current.feasible, current.cost_s)


def batch_attributes(
    outcomes: Sequence[RecoveryOutcome], makespan_s: float
) -> dict[str, AttributeValue]:
    counts = {action: 0 for action in Action}
    slot_counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.decision.action] += 1
        slot_counts[outcome.slot_outcome] = slot_counts.get(outcome.slot_outcome, 0) + 1
    attributes: dict[str, AttributeValue] = {
        f"kvrs.batch.{action.value}": count for action, count in counts.items()
    }
    attributes["kvrs.batch.makespan_s"] = makespan_s
    attributes["kvrs.slot.granted"] = slot_counts.get(SlotOutcome.GRANTED, 0)
    attributes["kvrs.slot.exhausted"] = slot_counts.get(SlotOutcome.EXHAUSTED, 0)
    attributes["kvrs.slot.unreachable"] = slot_counts.get(SlotOutcome.UNREACHABLE, 0)
    return attributes
