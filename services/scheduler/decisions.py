"""The scheduler's decisions: placement, recovery and batch recovery over the cached view.

This module holds everything the scheduler decides, with no gRPC in it: the servicer
turns protobuf into the records of `records.py` and the outcomes back into protobuf.
Costs are computed in-process with the same kvrs core the cost oracle serves; the only
await on a decision's path is the migration slot reservation at the slot broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

from opentelemetry.trace import INVALID_SPAN, NoOpTracer, Span, Tracer
from opentelemetry.util.types import AttributeValue

from kvrs.batch import plan_batch
from kvrs.cluster import InstanceState
from kvrs.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvrs.learning import (
    AssignedWork,
    Corrections,
    Outcome,
    placement_terms,
    recovery_terms,
)
from kvrs.network import TransferEstimate
from kvrs.placement import PlacementPolicy, PlacementRequest, as_joint, make_placement_policy
from kvrs.recovery import (
    NEEDS_SLOT,
    Action,
    RecoveryDecision,
    RecoveryPolicy,
    RecoveryRequest,
    assigned_work,
    decide_without_slot,
    kv_tokens_moved,
    make_recovery_policy,
)
from kvrs.topology import Role
from services.common.gossip_view import DecisionView, ViewCache
from services.common.metrics import Metrics
from services.scheduler import spans
from services.scheduler.after_reply import after_reply
from services.scheduler.leases import Lease, SlotBroker
from services.scheduler.outcomes import Learning
from services.scheduler.records import (
    BatchOutcome,
    Endpoint,
    RecoveryOutcome,
    SelectDecodeInput,
    Selection,
    SlotOutcome,
)
from services.scheduler.replay import RecentRecoveries

log = logging.getLogger(__name__)


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
        metrics: Metrics | None = None,
        learning: Learning | None = None,
        assigned: AssignedWork | None = None,
    ) -> None:
        self.view = view
        self.learning = learning
        self.assigned = assigned
        self.metrics = metrics
        self.slots = slots
        self.tracer = tracer
        self._traced = not isinstance(tracer, NoOpTracer)
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
        with self._span("kvrs.select_decode") as span:
            # Collected and set once: each set_attributes call costs microseconds.
            attributes: dict[str, AttributeValue] = {
                "kvrs.request_id": request.request_id,
                "kvrs.prefill_instance_id": request.prefill_id,
                "kvrs.prefill.routed_instance_id": request.prefill_id,
                "kvrs.prompt_tokens": request.prompt_tokens,
                "kvrs.prefix_blocks": len(request.prefix_hashes),
            }
            started = time.perf_counter()
            try:
                selection = self._select_decode(request, attributes, span.is_recording())
            finally:
                span.set_attributes(attributes)
            if self.metrics is not None:
                elapsed_s = time.perf_counter() - started
                after_reply(lambda: self._count_placement(elapsed_s, selection.view_age_s))
            return selection

    def _select_decode(
        self, request: SelectDecodeInput, attributes: dict[str, AttributeValue], traced: bool
    ) -> Selection:
        """`traced`: the span is recorded, so what only it reads is built too."""
        _require_id("request_id", request.request_id)
        _require_non_negative("prompt_tokens", request.prompt_tokens)
        self.view.inputs.require_context_tokens("prompt_tokens", request.prompt_tokens)
        policy = self.placement_policy(request.policy)
        attributes["kvrs.policy"] = policy.name
        self._require_role("prefill_instance_id", request.prefill_id, Role.PREFILL)
        for instance_id in request.candidate_ids:
            self._require_known("candidate_instance_ids", instance_id)
        view = self.view.current()
        if traced:
            attributes.update(spans.view_attributes(view))
        # The view caches a list per exclusion set, and its columns with it: a request
        # that excludes instances (a retry) decides on prepared columns too.
        candidates: Sequence[InstanceState] = view.cluster.decode_instances(request.exclude_ids)
        if request.candidate_ids:
            # A filtered copy (a caller pinning a few instances; their columns are small).
            candidates = [
                state for state in candidates if state.instance_id in request.candidate_ids
            ]
        attributes["kvrs.candidates_considered"] = len(candidates)
        prefill_id = self._prefill_id(request, policy, candidates, view, attributes)
        placement = policy.select(
            PlacementRequest(
                request_id=request.request_id,
                prefill_id=prefill_id,
                prompt_tokens=request.prompt_tokens,
                prefix_hashes=request.prefix_hashes,
                stream_prefill_s=(
                    view.cost.prefill_s(request.prompt_tokens) if request.streamed else 0.0
                ),
            ),
            candidates,
            view.cost,
            view.cluster.now_s,
        )
        if traced:
            attributes.update(spans.placement_attributes(placement))
        chosen = view.cluster.instances[placement.instance_id]
        predicted = placement_terms(placement, request.prompt_tokens, view.cost)
        jobs = 1 + self._pending_jobs(placement.instance_id)
        # The pull and the first step occupy the instance: the next burst's placements
        # (and recoveries) see them in its W(d) before any heartbeat can.
        self._assign(
            placement.instance_id, predicted.setup_s + predicted.stream_s + predicted.extend_s
        )
        self._book_after_reply()
        return Selection(
            placement=placement,
            address=chosen.address,
            transfer_address=chosen.transfer_address,
            view_age_s=view.age_s,
            view_stale=view.stale,
            predicted=predicted,
            planned_jobs=jobs,
            prefill_id=prefill_id,
        )

    def _prefill_id(
        self,
        request: SelectDecodeInput,
        policy: PlacementPolicy,
        candidates: Sequence[InstanceState],
        view: DecisionView,
        attributes: dict[str, AttributeValue],
    ) -> str:
        """Where the prompt prefills: `request.prefill_id` (the prefill rule's choice), or
        the option a policy choosing prefill and decode together prefers on this view
        (`Kvrs.choose_prefill`, as the simulator calls it)."""
        if not request.prefill_options:
            return request.prefill_id
        ids = [option.instance_id for option in request.prefill_options]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("prefill_options", "names an instance more than once")
        if request.prefill_id not in ids:
            raise InvalidArgument(
                "prefill_options", f"must include prefill_instance_id {request.prefill_id!r}"
            )
        for option in request.prefill_options:
            _require_id("prefill_options.instance_id", option.instance_id)
            if not (math.isfinite(option.finish_s) and option.finish_s >= 0.0):
                raise InvalidArgument(
                    "prefill_options.finish_s", f"must be finite and >= 0, got {option.finish_s}"
                )
            if not 0 <= option.prefix_hit_tokens <= request.prompt_tokens:
                raise InvalidArgument(
                    "prefill_options.prefix_hit_tokens",
                    f"must be in [0, prompt_tokens], got {option.prefix_hit_tokens}",
                )
        # One the view does not know yet (registered since its last refresh) cannot be
        # priced: it is left out rather than failing the request.
        options = [o for o in request.prefill_options if self.view.is_known(o.instance_id)]
        for option in options:
            self._require_role("prefill_options.instance_id", option.instance_id, Role.PREFILL)
        joint = as_joint(policy)
        if joint is None or len(options) < 2:
            return request.prefill_id
        ids = [option.instance_id for option in options]
        routed = ids.index(request.prefill_id)
        chosen = joint.choose_prefill(
            PlacementRequest(
                request.request_id, request.prefill_id, request.prompt_tokens, request.prefix_hashes
            ),
            [(option.instance_id, option.finish_s) for option in options],
            routed,
            candidates,
            view.cost,
            view.cluster.now_s,
            [option.prefix_hit_tokens for option in options],
        )
        attributes["kvrs.prefill_instance_id"] = ids[chosen]
        return ids[chosen]

    # -- Recover --------------------------------------------------------------------------

    async def recover(
        self,
        request: RecoveryRequest,
        failed_id: str,
        policy_name: str = "",
        skip_slot: bool = False,
    ) -> RecoveryOutcome:
        """Decides one request's recovery (`request` as its caller sent it: the failed
        instance excluded, `source_kv_available` false when it said the KV is lost); an
        equal call within the replay window gets the same decision and lease."""
        with self._span("kvrs.recover") as span:
            # What only the span reads is built only when the span is recorded.
            traced = span.is_recording()
            attributes = (
                spans.recover_input_attributes(request, failed_id, skip_slot) if traced else {}
            )
            started = time.perf_counter()
            try:
                self._validate_recover(request, failed_id, "")
                policy = self.recovery_policy(policy_name)
                attributes["kvrs.policy"] = policy.name
                call = (request, failed_id, policy_name, skip_slot)
                pending = self.recent.get(request.request_id, call)
                if pending is not None:
                    outcome = dataclasses.replace(await asyncio.shield(pending), replayed=True)
                else:
                    outcome = await self._recover_once(request, call, policy, skip_slot, traced)
                    self._record("recover", [outcome], started)
                if traced:
                    attributes.update(spans.recovery_attributes(outcome))
                return outcome
            finally:
                span.set_attributes(attributes)

    async def _recover_once(
        self,
        request: RecoveryRequest,
        call: tuple[RecoveryRequest, str, str, bool],
        policy: RecoveryPolicy,
        skip_slot: bool,
        priced: bool,
    ) -> RecoveryOutcome:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.recent.put(request.request_id, call, future)
        try:
            view = self.view.current()
            core_request = _in_view(request, view)
            decision = policy.decide(core_request, view.cluster, view.cost, view.cluster.now_s)
            outcome = await self._hold_slot(
                core_request, decision, policy, view, skip_slot, priced=priced
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
            return self._outcome(
                core_request, decision, decision.reason, None, slot_outcome, view, priced
            )
        if skip_slot:
            return self._outcome(
                core_request, decision, decision.reason, None, SlotOutcome.SKIPPED, view, priced
            )
        try:
            lease = await self.slots.reserve(
                core_request.request_id, decision.source_id, decision.target_id
            )
        except ResourceExhausted as exc:
            slot_outcome, why = SlotOutcome.EXHAUSTED, f"no migration slot free ({exc})"
        except (Unavailable, DeadlineExceeded) as exc:
            slot_outcome, why = SlotOutcome.UNREACHABLE, f"slot broker unreachable ({exc})"
        except FailedPrecondition as exc:
            log.warning(
                "slot broker refused %s -> %s for %s: %s",
                decision.source_id,
                decision.target_id,
                core_request.request_id,
                exc,
            )
            slot_outcome, why = SlotOutcome.REFUSED, f"slot broker refused the slot ({exc})"
        else:
            return self._outcome(
                core_request, decision, decision.reason, lease, SlotOutcome.GRANTED, view, priced
            )
        view = self.view.current()  # the reservation awaited: decide again on the view of now
        fallback = decide_without_slot(
            policy, core_request, view.cluster, view.cost, view.cluster.now_s, why
        )
        return self._outcome(
            core_request, fallback, fallback.reason, None, slot_outcome, view, priced
        )

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
        # The plan's jobs on the target, and those this scheduler sent there before it.
        jobs = decision.planned_jobs + self._pending_jobs(decision.target_id)
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
            predicted=recovery_terms(decision, core_request, view.cost, view.cluster.now_s),
            planned_jobs=jobs,
        )

    def _validate_recover(self, request: RecoveryRequest, failed_id: str, where: str) -> None:
        """What the request's own fields cannot say (convert.py checked those): whether
        its sizes fit this scheduler and its instances are the ones it names."""
        # A recompute re-creates the KV of the prompt and every generated token.
        inputs = self.view.inputs
        inputs.require_context_tokens(where + "prompt_tokens", request.prompt_tokens)
        inputs.require_context_tokens(
            where + "generated_tokens", request.prompt_tokens + request.generated_tokens
        )
        self._require_role(
            where + "source_prefill_instance_id", request.source_prefill_id, Role.PREFILL
        )
        self._require_known("failed_instance_id", failed_id)

    # -- RecoverBatch ---------------------------------------------------------------------

    async def recover_batch(
        self,
        batch_id: str,
        failed_id: str,
        items: Sequence[RecoveryRequest],
        policy_name: str,
        skip_slot: bool,
    ) -> BatchOutcome:
        with self._span("kvrs.recover_batch") as span:
            attributes: dict[str, AttributeValue] = {
                "kvrs.batch_id": batch_id,
                "kvrs.failed_instance_id": failed_id,
                "kvrs.batch.requests": len(items),
                "kvrs.skip_slot": skip_slot,
            }
            try:
                return await self._recover_batch(
                    failed_id, items, policy_name, skip_slot, attributes
                )
            finally:
                span.set_attributes(attributes)

    async def _recover_batch(
        self,
        failed_id: str,
        items: Sequence[RecoveryRequest],
        policy_name: str,
        skip_slot: bool,
        attributes: dict[str, AttributeValue],
    ) -> BatchOutcome:
        started = time.perf_counter()
        _require_id("failed_instance_id", failed_id)
        seen: set[str] = set()
        for i, item in enumerate(items):
            self._validate_recover(item, failed_id, f"items[{i}].")
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
        attributes.update(spans.view_attributes(view))
        core_requests = [_in_view(item, view) for item in items]
        plan = plan_batch(
            core_requests, view.cluster, view.cost, view.cluster.now_s, policy, slots_free
        )
        by_id = {r.request_id: r for r in core_requests}
        outcomes = await asyncio.gather(
            *(
                self._batch_outcome(by_id[d.request_id], d, policy, view, skip_slot, broker_note)
                for d in plan.decisions
            )
        )
        attributes.update(spans.batch_attributes(outcomes, plan.makespan_s))
        self._record("recover_batch", outcomes, started)
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
            return self._outcome(
                core_request,
                decision,
                broker_note + decision.reason,
                None,
                SlotOutcome.UNREACHABLE,
                view,
            )
        return await self._hold_slot(core_request, decision, policy, view, skip_slot)

    # -- outcomes ---------------------------------------------------------------------------

    async def report_outcome(self, outcome: Outcome) -> int:
        """Stores an executed decision's outcome and refits; the outcomes held now."""
        if self.learning is None:
            raise FailedPrecondition("this scheduler keeps no outcomes")
        return await self.learning.record(self.learning.corrections.applied_to(outcome))

    def corrections(self) -> Corrections:
        """The corrections in force (neutral ones when this scheduler does not learn)."""
        return Corrections() if self.learning is None else self.learning.corrections

    def _pending_jobs(self, instance_id: str) -> int:
        """Work this scheduler sent to `instance_id` that its W(x) still counts."""
        if self.assigned is None or not instance_id:
            return 0
        return self.assigned.pending_jobs(instance_id, self._clock())

    def _assign(self, instance_id: str, work_s: float) -> None:
        """Counts `work_s` just sent to `instance_id` in its W(x) until a heartbeat does."""
        if self.assigned is None or work_s <= 0.0:
            return
        self.assigned.add(instance_id, self._clock(), work_s)
        self.view.assign(instance_id, work_s)

    def _book_after_reply(self) -> None:
        """Patching the view's columns with the work just assigned is a decision's largest
        piece of bookkeeping: done once the reply is sent, or by the next decision that
        reads the view first (`ViewCache.book_assigned`)."""
        after_reply(self.view.book_assigned)

    def _record(self, kind: str, outcomes: Sequence[RecoveryOutcome], started: float) -> None:
        """Counts each decision's work in W(x) of the instances that run it (RECOMPUTE's
        prefill on its prefill instance, and on the target everything the target does: the
        pull it drives and the compute) and, once the reply is sent, its metrics
        (`_count`)."""
        for outcome in outcomes:
            for instance_id, work_s in assigned_work(outcome.decision):
                self._assign(instance_id, work_s)
        self._book_after_reply()
        if self.metrics is not None:
            elapsed_s = time.perf_counter() - started
            after_reply(lambda: self._count(kind, outcomes, elapsed_s))

    def _count(self, kind: str, outcomes: Sequence[RecoveryOutcome], elapsed_s: float) -> None:
        """The decisions' metrics (after the reply: nothing on the decision's path)."""
        metrics = self.metrics
        assert metrics is not None
        metrics.decision_latency_s.labels(kind).observe(elapsed_s)
        for outcome in outcomes:
            action = outcome.decision.action.value
            metrics.decisions.labels(kind, action).inc()
            if outcome.decision.action is not Action.ABORT:
                metrics.recovery_predicted_s.labels(action).observe(outcome.decision.cost_s)
            if outcome.slot_outcome != SlotOutcome.NOT_NEEDED:
                metrics.slot_requests.labels(outcome.slot_outcome).inc()
            metrics.telemetry_age_s.set(outcome.view_age_s)

    def _span(self, name: str) -> contextlib.AbstractContextManager[Span]:
        """The decision's span, current while it runs; where nothing records spans, none
        (even a no-op span is a context switch on every decision)."""
        if self._traced:
            return self.tracer.start_as_current_span(name)
        return contextlib.nullcontext(INVALID_SPAN)

    def _count_placement(self, elapsed_s: float, view_age_s: float) -> None:
        metrics = self.metrics
        assert metrics is not None
        metrics.decisions.labels("select_decode", "placed").inc()
        metrics.decision_latency_s.labels("select_decode").observe(elapsed_s)
        metrics.telemetry_age_s.set(view_age_s)

    # -- shared checks --------------------------------------------------------------------

    def _require_known(self, field: str, instance_id: str) -> None:
        _require_id(field, instance_id)
        if not self.view.is_known(instance_id):
            raise NotFound(f"unknown instance {instance_id!r}", field=field)

    def _require_role(self, field: str, instance_id: str, role: Role) -> None:
        """A known instance of `role`: a decode instance named as a prefill source would be
        placed onto, or migrated to, itself."""
        self._require_known(field, instance_id)
        if self.view.role(instance_id) is not role:
            raise InvalidArgument(field, f"{instance_id!r} is not a {role.value} instance")


def _chosen_transfer(
    request: RecoveryRequest, decision: RecoveryDecision, view: DecisionView
) -> TransferEstimate | None:
    """The transfer the chosen option makes: S(L) migrated, S(L-k) hybrid, S(L+g) recomputed."""
    if decision.action is Action.ABORT or not decision.target_id or not decision.source_id:
        return None
    tokens = kv_tokens_moved(
        decision.action, request.prompt_tokens, request.generated_tokens, decision.split_tokens
    )
    return view.cost.transfer(decision.source_id, decision.target_id, tokens, view.cluster.now_s)


def _endpoint(view: DecisionView, instance_id: str) -> Endpoint:
    state = view.cluster.instances.get(instance_id)
    if state is None:
        return Endpoint(instance_id=instance_id)
    return Endpoint(instance_id, state.address, state.transfer_address)


def _in_view(request: RecoveryRequest, view: DecisionView) -> RecoveryRequest:
    """`request` on this view: a source the view knows to be dead holds no KV."""
    source = view.cluster.instances.get(request.source_prefill_id)
    if source is None or source.alive or not request.source_kv_available:
        return request
    return dataclasses.replace(request, source_kv_available=False)


def _require_id(field: str, value: str) -> None:
    if not value:
        raise InvalidArgument(field, "must not be empty")


def _require_non_negative(field: str, value: int) -> None:
    if value < 0:
        raise InvalidArgument(field, f"must be >= 0, got {value}")
