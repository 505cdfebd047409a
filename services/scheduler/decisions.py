"""The scheduler's decisions: placement, recovery and batch recovery over the cached view.

This module holds everything the scheduler decides, with no gRPC in it: the servicer
turns protobuf into the `*Input` records below and the outcomes back into protobuf.
Costs are computed in-process with the same kvrs core the cost oracle serves; the only
await on a decision's path is the migration slot reservation at the slot broker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry.trace import Tracer
from opentelemetry.util.types import AttributeValue

from kvrs.batch import plan_batch
from kvrs.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvrs.network import TransferEstimate
from kvrs.placement import Placement, PlacementPolicy, PlacementRequest, make_placement_policy
from kvrs.recovery import (
    Action,
    OptionCost,
    RecoveryDecision,
    RecoveryPolicy,
    RecoveryRequest,
    make_recovery_policy,
)
from services.scheduler.leases import Lease, SlotBroker
from services.scheduler.view import DecisionView, ViewCache

log = logging.getLogger(__name__)

NEEDS_SLOT = (Action.MIGRATE, Action.HYBRID)


class SlotOutcome:
    """What happened at the slot broker for one decision (the `kvrs.slot.outcome` values)."""

    GRANTED = "granted"
    EXHAUSTED = "exhausted"
    UNREACHABLE = "broker_unreachable"
    SKIPPED = "skipped"
    NOT_NEEDED = "not_needed"


@dataclass(frozen=True)
class SelectDecodeInput:
    request_id: str
    prefill_id: str
    prompt_tokens: int
    prefix_hashes: tuple[int, ...] = ()
    policy: str = ""
    exclude_ids: frozenset[str] = frozenset()
    candidate_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Selection:
    placement: Placement
    address: str
    transfer_address: str
    view_age_s: float
    view_stale: bool


@dataclass(frozen=True)
class RecoverInput:
    request_id: str
    failed_id: str
    source_prefill_id: str
    prompt_tokens: int
    generated_tokens: int
    deadline_unix_ms: int = 0
    policy: str = ""
    source_kv_lost: bool = False
    exclude_ids: frozenset[str] = frozenset()
    skip_slot: bool = False


@dataclass(frozen=True)
class Endpoint:
    instance_id: str = ""
    address: str = ""
    transfer_address: str = ""


@dataclass(frozen=True)
class RecoveryOutcome:
    decision: RecoveryDecision
    reason: str
    lease: Lease | None
    slot_outcome: str
    target: Endpoint
    source: Endpoint
    view_age_s: float
    view_stale: bool
    replayed: bool = False
    transfer: TransferEstimate | None = None
    """The chosen option's KV transfer as priced now (for the decision span)."""


@dataclass(frozen=True)
class BatchOutcome:
    outcomes: tuple[RecoveryOutcome, ...]
    makespan_s: float
    slots_free: int


class RecentRecoveries:
    """Recover decisions of the last `ttl_s`, by request id, so a retry reuses its lease.

    Holds futures rather than results, so a retry arriving while the first call is still
    reserving its slot waits for that call instead of reserving a second slot.
    """

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[RecoverInput, float, asyncio.Future]] = (
            OrderedDict()
        )

    def get(self, request: RecoverInput) -> asyncio.Future | None:
        self._expire()
        entry = self._entries.get(request.request_id)
        if entry is None or entry[0] != request:
            return None
        return entry[2]

    def put(self, request: RecoverInput, future: asyncio.Future) -> None:
        self._entries.pop(request.request_id, None)
        self._entries[request.request_id] = (request, self._clock(), future)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, request_id: str, future: asyncio.Future) -> None:
        entry = self._entries.get(request_id)
        if entry is not None and entry[2] is future:
            del self._entries[request_id]

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        while self._entries:
            _, (_, created_s, _) = next(iter(self._entries.items()))
            if created_s >= horizon:
                break
            self._entries.popitem(last=False)


class Scheduler:
    """Makes every decision the SchedulerService serves (see the module docstring)."""

    def __init__(
        self,
        view: ViewCache,
        slots: SlotBroker,
        tracer: Tracer,
        placement_policy: str,
        recovery_policy: str,
        recent: RecentRecoveries,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.view = view
        self.slots = slots
        self.tracer = tracer
        self.default_placement = placement_policy
        self.default_recovery = recovery_policy
        self.recent = recent
        self._clock = clock
        self._placement: dict[str, PlacementPolicy] = {}
        self._recovery: dict[str, RecoveryPolicy] = {}
        self.placement_policy(placement_policy)
        self.recovery_policy(recovery_policy)

    def placement_policy(self, name: str) -> PlacementPolicy:
        """The named policy, kept across calls (round_robin has a cursor)."""
        name = name or self.default_placement
        policy = self._placement.get(name)
        if policy is None:
            policy = self._placement[name] = make_placement_policy(name)
        return policy

    def recovery_policy(self, name: str) -> RecoveryPolicy:
        name = name or self.default_recovery
        policy = self._recovery.get(name)
        if policy is None:
            policy = self._recovery[name] = make_recovery_policy(name)
        return policy

    # -- SelectDecode ---------------------------------------------------------------------

    def select_decode(self, request: SelectDecodeInput) -> Selection:
        with self.tracer.start_as_current_span("kvrs.select_decode") as span:
            # Collected and set once: each set_attributes call costs microseconds.
            attributes: dict[str, AttributeValue] = {
                "kvrs.request_id": request.request_id,
                "kvrs.prefill_instance_id": request.prefill_id,
                "kvrs.prompt_tokens": request.prompt_tokens,
                "kvrs.prefix_blocks": len(request.prefix_hashes),
            }
            try:
                return self._select_decode(request, attributes)
            finally:
                span.set_attributes(attributes)

    def _select_decode(
        self, request: SelectDecodeInput, attributes: dict[str, AttributeValue]
    ) -> Selection:
        _require_id("request_id", request.request_id)
        _require_non_negative("prompt_tokens", request.prompt_tokens)
        policy = self.placement_policy(request.policy)
        attributes["kvrs.policy"] = policy.name
        self._require_known("prefill_instance_id", request.prefill_id)
        for instance_id in request.candidate_ids:
            self._require_known("candidate_instance_ids", instance_id)
        view = self.view.current()
        attributes.update(_view_attributes(view))
        candidates = view.cluster.decode_instances()
        if request.exclude_ids or request.candidate_ids:
            # A filtered copy; the unfiltered list is shared so its derived columns stay
            # cached between decisions.
            candidates = [
                state
                for state in candidates
                if state.instance_id not in request.exclude_ids
                and (not request.candidate_ids or state.instance_id in request.candidate_ids)
            ]
        attributes["kvrs.candidates_considered"] = len(candidates)
        placement = policy.select(
            PlacementRequest(
                request_id=request.request_id,
                prefill_id=request.prefill_id,
                prompt_tokens=request.prompt_tokens,
                prefix_hashes=request.prefix_hashes,
            ),
            candidates,
            view.cost,
            view.cluster.now_s,
        )
        attributes.update(_placement_attributes(placement))
        chosen = view.cluster.instances[placement.instance_id]
        return Selection(
            placement=placement,
            address=chosen.address,
            transfer_address=chosen.transfer_address,
            view_age_s=view.age_s,
            view_stale=view.stale,
        )

    # -- Recover --------------------------------------------------------------------------

    async def recover(self, request: RecoverInput) -> RecoveryOutcome:
        with self.tracer.start_as_current_span("kvrs.recover") as span:
            attributes = _recover_input_attributes(request)
            try:
                self._validate_recover(request, "")
                policy = self.recovery_policy(request.policy)
                attributes["kvrs.policy"] = policy.name
                pending = self.recent.get(request)
                if pending is not None:
                    outcome = dataclasses.replace(await asyncio.shield(pending), replayed=True)
                else:
                    outcome = await self._recover_once(request, policy)
                attributes.update(_recovery_attributes(outcome))
                return outcome
            finally:
                span.set_attributes(attributes)

    async def _recover_once(self, request: RecoverInput, policy: RecoveryPolicy) -> RecoveryOutcome:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.recent.put(request, future)
        try:
            view = self.view.current()
            core_request = self._core_request(request, view)
            decision = policy.decide(core_request, view.cluster, view.cost, view.cluster.now_s)
            outcome = await self._hold_slot(
                core_request, decision, policy, view, request.skip_slot, priced=True
            )
        except BaseException as exc:
            self.recent.forget(request.request_id, future)
            if isinstance(exc, asyncio.CancelledError):
                # The caller gave up; a retry waiting on this attempt should try again.
                future.set_exception(Unavailable("the first attempt was cancelled; retry"))
            else:
                future.set_exception(exc)
            future.exception()  # retrieved here: only a concurrent retry may also see it
            raise
        future.set_result(outcome)
        return outcome

    async def _hold_slot(
        self,
        core_request: RecoveryRequest,
        decision: RecoveryDecision,
        policy: RecoveryPolicy,
        view: DecisionView,
        skip_slot: bool,
        priced: bool = False,
    ) -> RecoveryOutcome:
        """Reserves the slot a MIGRATE/HYBRID needs; without one, decides again without it.

        `priced`: also price the chosen option's transfer on its own (for the span).
        """
        if decision.action not in NEEDS_SLOT:
            slot_outcome = SlotOutcome.NOT_NEEDED
            return self._outcome(core_request, decision, decision.reason, None, slot_outcome,
                                 view, priced)
        if skip_slot:
            return self._outcome(core_request, decision, decision.reason, None,
                                 SlotOutcome.SKIPPED, view, priced)
        try:
            lease = await self.slots.reserve(
                core_request.request_id, decision.source_id, decision.target_id
            )
        except ResourceExhausted as exc:
            slot_outcome, why = SlotOutcome.EXHAUSTED, f"no migration slot free ({exc})"
        except (Unavailable, DeadlineExceeded) as exc:
            slot_outcome, why = SlotOutcome.UNREACHABLE, f"slot broker unreachable ({exc})"
        else:
            return self._outcome(core_request, decision, decision.reason, lease,
                                 SlotOutcome.GRANTED, view, priced)
        view = self.view.current()  # the reservation awaited: decide again on the view of now
        fallback = policy.decide(
            core_request, view.cluster, view.cost, view.cluster.now_s, migration_slot_free=False
        )
        return self._outcome(core_request, fallback, f"{why}; {fallback.reason}", None,
                             slot_outcome, view, priced)

    def _outcome(
        self,
        core_request: RecoveryRequest,
        decision: RecoveryDecision,
        reason: str,
        lease: Lease | None,
        slot_outcome: str,
        view: DecisionView,
        priced: bool = False,
    ) -> RecoveryOutcome:
        return RecoveryOutcome(
            decision=decision,
            reason=reason,
            lease=lease,
            slot_outcome=slot_outcome,
            target=_endpoint(view, decision.target_id),
            source=_endpoint(view, decision.source_id),
            view_age_s=view.age_s,
            view_stale=view.stale,
            transfer=_chosen_transfer(core_request, decision, view) if priced else None,
        )

    def _core_request(self, request: RecoverInput, view: DecisionView) -> RecoveryRequest:
        source = view.cluster.instances.get(request.source_prefill_id)
        source_alive = source is None or source.alive
        deadline_s = request.deadline_unix_ms / 1000.0 if request.deadline_unix_ms else None
        return RecoveryRequest(
            request_id=request.request_id,
            prompt_tokens=request.prompt_tokens,
            generated_tokens=request.generated_tokens,
            source_prefill_id=request.source_prefill_id,
            deadline_s=deadline_s,
            source_kv_available=source_alive and not request.source_kv_lost,
            exclude_ids=frozenset({request.failed_id, *request.exclude_ids}),
        )

    def _validate_recover(self, request: RecoverInput, where: str) -> None:
        _require_id(where + "request_id", request.request_id)
        _require_positive(where + "prompt_tokens", request.prompt_tokens)
        _require_non_negative(where + "generated_tokens", request.generated_tokens)
        _require_non_negative(where + "deadline_unix_ms", request.deadline_unix_ms)
        self._require_known(where + "source_prefill_instance_id", request.source_prefill_id)
        self._require_known("failed_instance_id", request.failed_id)

    # -- RecoverBatch ---------------------------------------------------------------------

    async def recover_batch(
        self, batch_id: str, failed_id: str, items: Sequence[RecoverInput], policy_name: str,
        skip_slot: bool,
    ) -> BatchOutcome:
        with self.tracer.start_as_current_span("kvrs.recover_batch") as span:
            attributes: dict[str, AttributeValue] = {
                "kvrs.batch_id": batch_id,
                "kvrs.failed_instance_id": failed_id,
                "kvrs.batch.requests": len(items),
                "kvrs.skip_slot": skip_slot,
            }
            try:
                return await self._recover_batch(failed_id, items, policy_name, skip_slot,
                                                 attributes)
            finally:
                span.set_attributes(attributes)

    async def _recover_batch(
        self, failed_id: str, items: Sequence[RecoverInput], policy_name: str,
        skip_slot: bool, attributes: dict[str, AttributeValue],
    ) -> BatchOutcome:
        _require_id("failed_instance_id", failed_id)
        seen: set[str] = set()
        for i, item in enumerate(items):
            self._validate_recover(item, f"items[{i}].")
            if item.request_id in seen:
                raise InvalidArgument(
                    f"items[{i}].request_id", f"duplicate request id {item.request_id!r}"
                )
            seen.add(item.request_id)
        policy = self.recovery_policy(policy_name)
        attributes["kvrs.policy"] = policy.name
        broker_note = ""
        if skip_slot:
            slots_free = len(items)
        else:
            try:
                slots_free = await self.slots.free_slots()
            except (Unavailable, DeadlineExceeded) as exc:
                slots_free = 0
                broker_note = f"slot broker unreachable ({exc}); "
        attributes["kvrs.slots_free"] = slots_free
        view = self.view.current()
        attributes.update(_view_attributes(view))
        core_requests = [self._core_request(item, view) for item in items]
        plan = plan_batch(
            core_requests, view.cluster, view.cost, view.cluster.now_s, policy, slots_free
        )
        by_id = {r.request_id: r for r in core_requests}
        outcomes = await asyncio.gather(*(
            self._batch_outcome(by_id[d.request_id], d, policy, view, skip_slot, broker_note)
            for d in plan.decisions
        ))
        attributes.update(_batch_attributes(outcomes, plan.makespan_s))
        return BatchOutcome(
            outcomes=tuple(outcomes), makespan_s=plan.makespan_s, slots_free=slots_free
        )

    async def _batch_outcome(
        self,
        core_request: RecoveryRequest,
        decision: RecoveryDecision,
        policy: RecoveryPolicy,
        view: DecisionView,
        skip_slot: bool,
        broker_note: str,
    ) -> RecoveryOutcome:
        if broker_note and decision.action not in NEEDS_SLOT:
            return self._outcome(core_request, decision, broker_note + decision.reason, None,
                                 SlotOutcome.UNREACHABLE, view)
        return await self._hold_slot(core_request, decision, policy, view, skip_slot)

    # -- shared checks --------------------------------------------------------------------

    def _require_known(self, field: str, instance_id: str) -> None:
        _require_id(field, instance_id)
        if not self.view.is_known(instance_id):
            raise NotFound(f"unknown instance {instance_id!r}", field=field)


def _chosen_transfer(
    request: RecoveryRequest, decision: RecoveryDecision, view: DecisionView
) -> TransferEstimate | None:
    """The transfer the chosen option makes: S(L) migrated, S(L-k) hybrid, S(L+g) recomputed."""
    if decision.action is Action.ABORT or not decision.target_id or not decision.source_id:
        return None
    if decision.action is Action.MIGRATE:
        tokens = request.prompt_tokens
    elif decision.action is Action.HYBRID:
        tokens = request.prompt_tokens - decision.split_tokens
    else:
        tokens = request.prompt_tokens + request.generated_tokens
    return view.cost.transfer(decision.source_id, decision.target_id, tokens, view.cluster.now_s)


def _endpoint(view: DecisionView, instance_id: str) -> Endpoint:
    state = view.cluster.instances.get(instance_id)
    if state is None:
        return Endpoint(instance_id=instance_id)
    return Endpoint(instance_id, state.address, state.transfer_address)


def _require_id(field: str, value: str) -> None:
    if not value:
        raise InvalidArgument(field, "must not be empty")


def _require_non_negative(field: str, value: int) -> None:
    if value < 0:
        raise InvalidArgument(field, f"must be >= 0, got {value}")


def _require_positive(field: str, value: int) -> None:
    if value <= 0:
        raise InvalidArgument(field, f"must be > 0, got {value}")


# -- span attributes (every name is listed in docs/telemetry.md) ----------------------------


def _view_attributes(view: DecisionView) -> dict[str, AttributeValue]:
    return {
        "kvrs.view_age_s": view.age_s,
        "kvrs.view_stale": view.stale,
        "kvrs.view_links": view.state.links_used,
    }


def _placement_attributes(placement: Placement) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "kvrs.candidates_considered": placement.candidates_considered,
        "kvrs.chosen_instance_id": placement.instance_id,
        "kvrs.predicted_ttft_s": placement.predicted_ttft_s,
        "kvrs.wait_s": placement.wait_s,
        "kvrs.prefix_hit_tokens": placement.prefix_hit_tokens,
        "kvrs.kv_bytes": placement.kv_bytes,
        **_transfer_attributes(placement.transfer),
    }
    runner_up = placement.runner_up
    if runner_up is not None:
        attributes["kvrs.runner_up.instance_id"] = runner_up.instance_id
        attributes["kvrs.runner_up.score_s"] = runner_up.score_s
        attributes["kvrs.runner_up.tier"] = int(runner_up.tier)
    return attributes


def _transfer_attributes(transfer: TransferEstimate) -> dict[str, AttributeValue]:
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


def _recover_input_attributes(request: RecoverInput) -> dict[str, AttributeValue]:
    return {
        "kvrs.request_id": request.request_id,
        "kvrs.failed_instance_id": request.failed_id,
        "kvrs.source_prefill_instance_id": request.source_prefill_id,
        "kvrs.prompt_tokens": request.prompt_tokens,
        "kvrs.generated_tokens": request.generated_tokens,
        "kvrs.deadline_unix_ms": request.deadline_unix_ms,
        "kvrs.source_kv_lost": request.source_kv_lost,
        "kvrs.skip_slot": request.skip_slot,
    }


def _recovery_attributes(outcome: RecoveryOutcome) -> dict[str, AttributeValue]:
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
        attributes.update(_transfer_attributes(outcome.transfer))
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


def _batch_attributes(
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
