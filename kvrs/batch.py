"""A failed decode instance strands n requests at once: plan their recoveries together.

Per-request decisions made in isolation all see an idle network and idle instances, and
so all pick the same fastest link and the same least-loaded target, then share both. The
planner decides the requests one by one, least slack first, each seeing what the plan
has already committed: flows on links (a second migration on a link gets half of it),
work queued on instances (W raised by the extend or prefill already assigned), and the
migration slots left. The work a recovery puts on its target is all of its time there:
the pull (the target drives it) and the compute, not the compute alone.

When every request is placed, each transfer is re-costed with the final flow counts, so
no two transfers are promised the same link at full speed, and each recovery is priced
with the queue the plan builds on its instances. The router starts them together, so a target
serves their transfers side by side (processor sharing): of transfers taking x_j each
alone, started at once, transfer i ends after Σ_j min(x_j, x_i). A transfer's x is all of
its time on the target alone, its fixed cost (the calls, the ticket, posting the buffers)
and its stream: the target drives every pull's calls and receive itself, so pulls
started together mostly queue there, set-ups included (`bench.concurrent_pulls`: n of
them took 0.6–0.8 × n times one alone). The streams in x are the streaming times alone
on the path: the re-costed times already share the links, and summing those would count
the sharing twice. A transfer ends after the longer of the two, its share of the target
and its share of the links. Their
extends then join the target's batched forward passes (`ComputeProfile.batch_s`), and
RECOMPUTE's prefills their prefill instance's, before that. An instance that reports its
token budget per pass runs them as its loop will (`kvrs.passes`): in the order their KV
arrives, in passes of at most that many tokens beside its running streams (each
holding its share of the context they report), so the recoveries end one pass after
another; there a HYBRID's recomputed prefix is work of its own in those passes (the
worker queues it as the pull starts), and its extend follows both the prefix and the
transfer. One that reports none is priced as running them all in one pass, each
HYBRID's prefix beside its transfer. Every instance's passes are priced at the pace it
reports, its recent passes timed against the profile (a loaded host runs them slower
than the quiet one the profile was measured on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvrs._columns import WaitPlan
from kvrs._pathmatrix import FlowPlan
from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument
from kvrs.passes import pass_ends_s
from kvrs.recovery import (
    Action,
    OptionCost,
    RecoveryDecision,
    RecoveryPolicy,
    RecoveryRequest,
    assigned_work,
    chosen_option,
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
        if action is not Action.RECOMPUTE:
            slots_left -= 1
        for instance_id, work_s in assigned_work(decision):
            extra_wait.add(instance_id, work_s)
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
    final = _shared(final, requests, view, cost, now_s)
    makespan = max((d.cost_s for d in final if d.action is not Action.ABORT), default=0.0)
    return BatchPlan(final, makespan)


def _shared(
    decisions: tuple[RecoveryDecision, ...],
    requests: Sequence[RecoveryRequest],
    view: ClusterView,
    cost: CostModel,
    now_s: float,
) -> tuple[RecoveryDecision, ...]:
    """Every decision priced with its instances shared by the plan's other recoveries
    (see the module docstring): W(x) as reported plus its share of the plan's work."""
    # Per decision: its transfer's time on the target (HYBRID: the longer of the transfer
    # and the recomputed prefix), and the forward-pass segment (cached, new) it adds to
    # its target's and, for RECOMPUTE, its prefill instance's work.
    moved: dict[int, float] = {}
    fixed: dict[int, float] = {}
    alone: dict[int, float] = {}
    streamed: dict[int, float] = {}
    """The transfer's own streaming seconds alone (HYBRID's without its prefix)."""
    own_ext: dict[int, float] = {}
    segment: dict[int, tuple[int, int]] = {}
    on_target: dict[str, list[int]] = {}
    on_source: dict[str, list[int]] = {}
    for i, decision in enumerate(decisions):
        if decision.action not in _MOVES_KV:
            continue
        chosen = _chosen_option(decision)
        request = requests[i]
        on_target.setdefault(decision.target_id, []).append(i)
        moved_s = chosen.transfer_s
        fixed_s, alone_s = (
            _alone_transfer_s(decision, request, cost, now_s) if moved_s > 0.0 else (0.0, 0.0)
        )
        streamed[i] = alone_s
        if decision.action is Action.RECOMPUTE:
            context = request.prompt_tokens + request.generated_tokens
            on_source.setdefault(decision.source_id, []).append(i)
            segment[i] = (max(0, context - 1), 1)
        else:
            segment[i] = (request.prompt_tokens, request.generated_tokens)
            if decision.action is Action.HYBRID:
                prefix_s = cost.prefill_s(decision.split_tokens)
                moved_s = max(prefix_s, moved_s)
                alone_s = max(prefix_s - fixed_s, alone_s)
        moved[i] = moved_s
        fixed[i] = fixed_s
        alone[i] = alone_s
        own_ext[i] = cost.extend_s(*segment[i]) if decision.action is not Action.RECOMPUTE else 0.0

    # RECOMPUTE: when each prefill ends on its prefill instance, from now.
    prefilled: dict[int, float] = {}
    for source_id, jobs in on_source.items():
        source = view.get(source_id)
        computes = [_chosen_option(decisions[i]).compute_s for i in jobs]
        work = [(0.0, 0, sum(segment[i])) for i in jobs]
        ends = _ends_s(source, work, computes, cost)
        # Never sooner than the prefill alone, after what the instance has queued.
        wait_s, pace = (0.0, 1.0) if source is None else (source.wait_s, source.compute_factor)
        for i, end_s, compute_s in zip(jobs, ends, computes, strict=True):
            prefilled[i] = max(end_s, wait_s + pace * compute_s)

    priced = list(decisions)
    for target_id, jobs in on_target.items():
        target = view.get(target_id)
        splits = [
            decisions[i].split_tokens if decisions[i].action is Action.HYBRID else 0 for i in jobs
        ]
        # On a target that reports its pass budget, a HYBRID's prefix is recomputed in its
        # passes; elsewhere it is priced beside its transfer, as part of it.
        in_passes = any(splits) and target is not None and target.max_batch_tokens > 0
        own = streamed if in_passes else alone
        own_transfer = (
            {i: _chosen_option(decisions[i]).transfer_s for i in jobs} if in_passes else moved
        )
        # The target serves the transfers side by side, set-ups and streams; the
        # extends join its passes.
        whole = {i: fixed[i] + own[i] for i in jobs}
        transfers = {
            i: max(own_transfer[i], sum(min(whole[j], whole[i]) for j in jobs)) for i in jobs
        }
        work = [(prefilled.get(i, 0.0) + transfers[i], *segment[i]) for i in jobs]
        if in_passes:
            assert target is not None
            done_s = _ends_after_prefixes_s(target, work, splits, cost)
        else:
            done_s = _ends_s(target, work, [own_ext[i] for i in jobs], cost)
        for i, total in zip(jobs, done_s, strict=True):
            decision = decisions[i]
            chosen = _chosen_option(decision)
            if decision.action is Action.RECOMPUTE:
                source_wait = max(0.0, prefilled[i] - chosen.compute_s)
                queue_s = max(0.0, total - prefilled[i] - moved[i])
                fields = {"wait_s": source_wait, "target_wait_s": queue_s}
            else:
                queue_s = max(0.0, total - moved[i] - own_ext[i])
                fields = {"wait_s": queue_s, "target_wait_s": queue_s}
            updated = _new(OptionCost)
            updated.__dict__.update(chosen.__dict__, cost_s=total, **fields)
            # The options not taken, on the same target, would have met the same queue:
            # shown with the same change, so a trace compares like with like.
            delta_s = total - chosen.cost_s
            options = tuple(
                [
                    updated
                    if o is chosen
                    else _shifted(o, delta_s)
                    if o.feasible and o.target_id == chosen.target_id
                    else o
                    for o in decision.options
                ]
            )
            deadline = requests[i].deadline_s
            slack = math.inf if deadline is None else deadline - now_s - total
            repriced = _new(RecoveryDecision)
            repriced.__dict__.update(
                decision.__dict__,
                cost_s=total,
                options=options,
                slack_s=slack,
                planned_jobs=len(jobs),
            )
            priced[i] = repriced
    return tuple(priced)


def _ends_s(
    instance: InstanceState | None,
    work: list[tuple[float, int, int]],
    alone_s: Sequence[float],
    cost: CostModel,
) -> list[float]:
    """When each piece of `work` (ready_s, cached, new) is computed on `instance`, from now.

    An instance that reports its pass budget runs the pieces as its loop will
    (`kvrs.passes.pass_ends_s`: passes of at most that many tokens, after the work it
    reports queued, beside its running streams). Otherwise every piece is priced as
    joining one pass over all of them, after the queued work and its own arrival; a piece
    alone in the plan costs what it costs alone (`alone_s`, one per piece)."""
    if instance is not None and instance.max_batch_tokens > 0:
        return _pass_ends_s(instance, work, cost)
    wait_s = instance.wait_s if instance is not None else 0.0
    pace = instance.compute_factor if instance is not None else 1.0
    segments = [(cached, new) for _, cached, new in work if new > 0]
    shared_s = cost.compute.batch_s(segments) if len(segments) > 1 else None
    return [
        wait_s + ready_s + pace * (shared_s if shared_s is not None else alone)
        for (ready_s, _, _), alone in zip(work, alone_s, strict=True)
    ]


def _ends_after_prefixes_s(
    target: InstanceState,
    work: list[tuple[float, int, int]],
    splits: list[int],
    cost: CostModel,
) -> list[float]:
    """`_ends_s` on a target that reports its pass budget, where HYBRIDs (`splits[i]` > 0
    tokens recomputed) also recompute their prefix there: the worker queues each prefix
    as a forward job as soon as its pull starts, so the prefixes join its passes with the
    rest of its work, and a HYBRID's extend is ready once both its prefix and its
    transfer are done."""
    prefix_at = [k for k, split in enumerate(splits) if split > 0]
    prefixes = [(0.0, 0, splits[k]) for k in prefix_at]
    after: list[int | None] = [None] * (len(prefixes) + len(work))
    for n, k in enumerate(prefix_at):
        after[len(prefixes) + k] = n
    ends = _pass_ends_s(target, [*prefixes, *work], cost, after)
    return ends[len(prefixes) :]


def _pass_ends_s(
    instance: InstanceState,
    work: list[tuple[float, int, int]],
    cost: CostModel,
    after: Sequence[int | None] = (),
) -> list[float]:
    """`kvrs.passes.pass_ends_s` on an instance that reports its pass budget, each pass
    at the pace its recent passes ran."""
    return pass_ends_s(
        work,
        instance.max_batch_tokens,
        cost.compute.scaled(instance.compute_factor).pass_s,
        instance.wait_s,
        instance.running_requests,
        after,
        instance.running_context_tokens,
    )


def _alone_transfer_s(
    decision: RecoveryDecision, request: RecoveryRequest, cost: CostModel, now_s: float
) -> tuple[float, float]:
    """The decision's transfer with none of the plan's other flows on its path: its fixed
    cost (the path's latency and set-up) and its streaming seconds."""
    bps, rtt_s = cost.network.rate_and_rtt(decision.source_id, decision.target_id, now_s)
    tokens = kv_tokens_moved(
        decision.action, request.prompt_tokens, request.generated_tokens, decision.split_tokens
    )
    return rtt_s, cost.kv_bits_per_token * tokens / bps


def _shifted(option: OptionCost, delta_s: float) -> OptionCost:
    """`option` with its cost and its wait changed by `delta_s` (never below zero)."""
    shifted = _new(OptionCost)
    shifted.__dict__.update(
        option.__dict__,
        cost_s=max(0.0, option.cost_s + delta_s),
        wait_s=max(0.0, option.wait_s + delta_s),
    )
    return shifted


def _slack_bound(request: RecoveryRequest, cost: CostModel, now_s: float) -> tuple[float, str]:
    """An upper bound on the request's slack: every option at least extends the g tokens."""
    if request.deadline_s is None:
        return math.inf, request.request_id
    ext_s = cost.extend_s(request.prompt_tokens, request.generated_tokens)
    return request.deadline_s - now_s - ext_s, request.request_id


def _chosen_option(decision: RecoveryDecision) -> OptionCost:
    option = chosen_option(decision)
    if option is None:
        raise AssertionError(f"decision {decision.request_id} lists no option for its action")
    return option


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
