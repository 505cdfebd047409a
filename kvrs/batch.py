"""A failed decode instance strands n requests at once: plan their recoveries together.

Per-request decisions made in isolation all see an idle network and idle instances, and
so all pick the same fastest link and the same least-loaded target, then share both. The
planner decides the requests one by one, least slack first, each seeing what the plan
has already committed: flows on links (a second migration on a link gets half of it),
work queued on instances (W raised by the extend or prefill already assigned), and the
migration slots left. When every request is placed, each transfer is re-costed with the
final flow counts, so no two transfers are promised the same link at full speed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvrs._columns import WaitPlan
from kvrs._pathmatrix import FlowPlan
from kvrs.cluster import ClusterView
from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument
from kvrs.recovery import (
    Action,
    OptionCost,
    RecoveryDecision,
    RecoveryPolicy,
    RecoveryRequest,
    kv_tokens_moved,
)
from kvrs.topology import LinkId

__all__ = ["BatchPlan", "plan_batch"]

_MOVES_KV = (Action.MIGRATE, Action.HYBRID, Action.RECOMPUTE)
_new = object.__new__


@dataclass(frozen=True)
class BatchPlan:
    """One decision per request, in the order the requests were given."""

    decisions: tuple[RecoveryDecision, ...]
    makespan_s: float
    """Predicted time until the last planned recovery finishes (0 when none runs)."""


def plan_batch(
    requests: Sequence[RecoveryRequest],
    view: ClusterView,
    cost: CostModel,
    now_s: float,
    policy: RecoveryPolicy,
    migration_slots_free: int,
) -> BatchPlan:
    """Decide every request, sharing links, instance queues and migration slots."""
    if migration_slots_free < 0:
        raise InvalidArgument("migration_slots_free", f"must be >= 0, got {migration_slots_free}")
    topology = cost.network.topology
    flows = FlowPlan()
    extra_wait = WaitPlan()
    slots_left = migration_slots_free
    decisions: dict[int, RecoveryDecision] = {}
    transfers: dict[int, tuple[OptionCost, tuple[LinkId, ...]]] = {}
    for index in sorted(range(len(requests)), key=lambda i: _slack_bound(requests[i], cost, now_s)):
        request = requests[index]
        decision = policy.decide(
            request,
            view,
            cost,
            now_s,
            migration_slot_free=slots_left > 0,
            extra_flows=flows,
            extra_wait_s=extra_wait,
        )
        decisions[index] = decision
        action = decision.action
        if action not in _MOVES_KV:
            continue
        chosen = _chosen_option(decision)
        if action is Action.RECOMPUTE:
            worker = decision.source_id
        else:
            slots_left -= 1
            worker = decision.target_id
        extra_wait.add(worker, chosen.compute_s)
        if chosen.transfer_s > 0.0:
            path = topology.path_links(decision.source_id, decision.target_id)
            transfers[index] = (chosen, path)
            flows.add_path(path)
    final = tuple(
        [
            decisions[i]
            if i not in transfers
            else _recost(decisions[i], *transfers[i], requests[i], cost, now_s, flows)
            for i in range(len(requests))
        ]
    )
    makespan = max((d.cost_s for d in final if d.action is not Action.ABORT), default=0.0)
    return BatchPlan(final, makespan)


def _slack_bound(request: RecoveryRequest, cost: CostModel, now_s: float) -> tuple[float, str]:
    """An upper bound on the request's slack: every option at least extends the g tokens."""
    if request.deadline_s is None:
        return math.inf, request.request_id
    ext_s = cost.extend_s(request.prompt_tokens, request.generated_tokens)
    return request.deadline_s - now_s - ext_s, request.request_id


def _chosen_option(decision: RecoveryDecision) -> OptionCost:
    for option in decision.options:
        if (
            option.action is decision.action
            and option.target_id == decision.target_id
            and option.source_id == decision.source_id
            and option.feasible
        ):
            return option
    raise AssertionError(f"decision {decision.request_id} lists no option for its action")


def _recost(
    decision: RecoveryDecision,
    chosen: OptionCost,
    path: tuple[LinkId, ...],
    request: RecoveryRequest,
    cost: CostModel,
    now_s: float,
    flows: Mapping[LinkId, int],
) -> RecoveryDecision:
    """The decision with its transfer (`chosen`, over `path`) re-costed under every flow of
    the final plan."""
    if not path:
        return decision
    # The rate reads the flows of the path's own links only: those of the final plan,
    # less this transfer's.
    others: dict[LinkId, int] = {}
    for link in path:
        others[link] = others.get(link, flows[link]) - 1
    bps, rtt_s = cost.network.rate_and_rtt(decision.source_id, decision.target_id, now_s, others)
    bits_per_token = cost.kv_bits_per_token
    tokens = kv_tokens_moved(
        decision.action, request.prompt_tokens, request.generated_tokens, decision.split_tokens
    )
    transfer_s = rtt_s + bits_per_token * tokens / bps
    if decision.action is Action.MIGRATE:
        total = chosen.wait_s + transfer_s + chosen.compute_s
    elif decision.action is Action.RECOMPUTE:
        total = chosen.wait_s + chosen.compute_s + transfer_s
    else:
        ext_s = cost.extend_s(request.prompt_tokens, request.generated_tokens)
        total = chosen.wait_s + max(cost.prefill_s(decision.split_tokens), transfer_s) + ext_s
    if transfer_s == chosen.transfer_s:
        return decision
    # Copies filled in place, as `kvrs._frozen.build` does, without its keyword packing.
    updated = _new(OptionCost)
    updated.__dict__.update(chosen.__dict__, cost_s=total, transfer_s=transfer_s)
    options = tuple([updated if option is chosen else option for option in decision.options])
    slack = math.inf if request.deadline_s is None else request.deadline_s - now_s - total
    recosted = _new(RecoveryDecision)
    recosted.__dict__.update(decision.__dict__, cost_s=total, options=options, slack_s=slack)
    return recosted
