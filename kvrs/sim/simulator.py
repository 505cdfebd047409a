"""The simulated cluster: requests flow prefill → placement → KV transfer → decode.

Every decision is made by the kvrs core, exactly as the scheduler service makes it:
decode placement by `kvrs.placement`, recovery by `kvrs.recovery` (one request at a
time) or `kvrs.batch.plan_batch` (a failed instance's requests together). Decisions see
only what telemetry sampled (`kvrs.sim.telemetry`); the simulator then executes them on
the live state, so a stale view costs what it would cost in a real cluster.

Conservation: a request ends COMPLETED or ABORTED; `RunResult.summary.lost` counts the
ones that did neither when the event queue drained (always 0 unless there is a bug).
"""

from __future__ import annotations

import gc
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import numpy as np

from kvrs.batch import plan_batch
from kvrs.cluster import InstanceList, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvrs.placement import (
    JointPlacementPolicy,
    PlacementPolicy,
    PlacementRequest,
    as_joint,
    make_placement_policy,
)
from kvrs.prefill import prefill_finishes, soonest
from kvrs.recovery import (
    NEEDS_SLOT,
    Action,
    RecoveryDecision,
    RecoveryPolicy,
    RecoveryRequest,
    decide_without_slot,
    kv_tokens_moved,
    make_recovery_policy,
)
from kvrs.sim.background import BackgroundTraffic
from kvrs.sim.cache import BlockIndex, PrefixCache, ResidentView
from kvrs.sim.config import PolicySpec, SimConfig
from kvrs.sim.engine import EventLoop
from kvrs.sim.flownet import Flow, FlowNetwork
from kvrs.sim.instances import (
    ComputeJob,
    DecodeInstance,
    DecodeMember,
    PrefillInstance,
    PrefillJob,
)
from kvrs.sim.metrics import (
    ABORTED,
    COMPLETED,
    RecoveryRecord,
    RequestRecord,
    RunSummary,
    summarize,
)
from kvrs.sim.telemetry import Telemetry
from kvrs.sim.trace import TraceRequest
from kvrs.topology import Role

_MIGRATING = (Action.MIGRATE, Action.HYBRID)


@contextmanager
def _cycle_collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a run replays its events.

    A run frees what it drops by reference counting alone: it makes no reference cycles
    (tests/unit/sim/test_sim_simulator.py checks), while the collector would rescan the
    records it keeps, a million of them in a long run: 10-40 % of the run time, growing
    with the run. Collection resumes as it was when the run ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Flight:
    """A request's life in the cluster: where its KV is and what it waits for.

    `epoch` grows whenever the request is pulled back for recovery, so callbacks of
    work started before (a transfer, a prefill, a compute job) recognise themselves as
    outdated and do nothing.
    """

    __slots__ = (
        "request",
        "record",
        "stage",
        "prefill_id",
        "source_kv",
        "decode_id",
        "flow",
        "job",
        "memory_tokens",
        "memory_state",
        "slot",
        "epoch",
        "recovery",
        "pending_parts",
        "streamed",
        "prefill_ends_s",
        "first_layer_s",
        "tail_s",
    )

    def __init__(self, request: TraceRequest, record: RequestRecord) -> None:
        self.request = request
        self.record = record
        self.stage = "prefill"
        self.prefill_id = ""  # the prefill instance holding the prompt's KV
        self.source_kv = False
        self.decode_id = ""
        self.flow: Flow | None = None
        self.job: PrefillJob | None = None  # the prefill work it waits for, if any
        self.memory_tokens = 0
        self.memory_state = ""  # "", "queued" or "granted" on decode_id
        self.slot = False  # holds a migration slot
        self.epoch = 0
        self.recovery: RecoveryRecord | None = None
        self.pending_parts = 0  # HYBRID: transfer and recompute both must finish
        # Layer-wise streaming: placed as its prefill starts, the KV leaves layer by
        # layer (the first at `first_layer_s`) and lands the tail after `prefill_ends_s`.
        self.streamed = False
        self.prefill_ends_s = math.nan
        self.first_layer_s = math.nan
        self.tail_s = math.nan  # what is left after the prefill, once the KV has crossed


class _PrefillRouting:
    """What prefill routing reads from one list of prefill states, read once per list."""

    __slots__ = ("wait_s", "queue_depth", "by_pool", "pooled")

    def __init__(self, candidates: InstanceList, prefills: dict[str, PrefillInstance]) -> None:
        self.wait_s = np.array([state.wait_s for state in candidates])
        self.queue_depth = np.array([state.queue_depth for state in candidates])
        # Telemetry reports a prefill's pool as it was at the sample (`PrefixCache.as_of`).
        self.pooled: list[ResidentView] = [
            cast(ResidentView, state.resident_blocks) for state in candidates
        ]
        self.by_pool: dict[PrefixCache, list[int]] = defaultdict(list)
        for i, state in enumerate(candidates):
            self.by_pool[prefills[state.instance_id].pool].append(i)

    @classmethod
    def of(cls, candidates: InstanceList, prefills: dict[str, PrefillInstance]) -> _PrefillRouting:
        """The routing columns of `candidates`, cached on the list."""
        routing = candidates.derived.get(cls)
        if routing is None:
            routing = candidates.derived[cls] = cls(candidates, prefills)
        return routing


@dataclass
class RunResult:
    """A finished run: the per-request records, their summary and run statistics."""

    policy: str
    records: list[RequestRecord]
    summary: RunSummary
    stats: dict[str, Any] = field(default_factory=dict)
    recovery_batches: list[dict[str, Any]] = field(default_factory=list)


class Simulator:
    """One run of one policy over one workload."""

    def __init__(
        self,
        config: SimConfig,
        requests: Iterable[TraceRequest],
        policy: PolicySpec,
        on_request_done: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.policy_spec = policy
        self.loop = EventLoop()
        self.topology = config.cluster.build()
        serving = config.serving
        self.model = serving.model_spec()
        self.compute = serving.compute()
        self.block_tokens = self.model.block_tokens
        self._rng = np.random.default_rng(config.seed)
        self._on_request_done = on_request_done

        decode_profile = serving.decode()
        pool_blocks = serving.prefix_pool_tokens // self.block_tokens
        self._pooled_blocks = BlockIndex()
        shared_pool = (
            PrefixCache(pool_blocks, index=self._pooled_blocks)
            if serving.prefix_pool_scope == "global"
            else None
        )
        node_pools: dict[str, PrefixCache] = {}
        self.prefills: dict[str, PrefillInstance] = {}
        self.decodes: dict[str, DecodeInstance] = {}
        self.node_of: dict[str, str] = {}
        for spec in sorted(self.topology.instances.values(), key=lambda s: s.instance_id):
            node = spec.location.node
            self.node_of[spec.instance_id] = node
            if spec.role is Role.PREFILL:
                # `is None`, not `or`: an empty cache has length 0 and is falsy.
                pool = (
                    shared_pool
                    if shared_pool is not None
                    else node_pools.setdefault(
                        node, PrefixCache(pool_blocks, index=self._pooled_blocks)
                    )
                )
                self.prefills[spec.instance_id] = PrefillInstance(
                    spec.instance_id,
                    node,
                    self.loop,
                    self.compute,
                    pool,
                    self.block_tokens,
                    serving.prefill_budget_tokens,
                )
            else:
                self.decodes[spec.instance_id] = DecodeInstance(
                    spec.instance_id,
                    node,
                    self.loop,
                    decode_profile,
                    serving.decode_kv_tokens,
                    serving.decode_max_batch,
                    # Read as of now only (telemetry reports its snapshot): no history.
                    PrefixCache(serving.decode_cache_tokens // self.block_tokens, history_s=0.0),
                    self._decode_finished,
                )
        pool_users: dict[int, int] = defaultdict(int)
        for prefill in self.prefills.values():
            pool_users[id(prefill.pool)] += 1
        for prefill in self.prefills.values():
            prefill.pool_shared = pool_users[id(prefill.pool)] > 1
        if not self.prefills or not self.decodes:
            raise InvalidArgument("cluster", "needs at least one prefill and one decode instance")

        self.network = FlowNetwork(self.loop, self.topology.link_capacity_bps)
        for p in self.prefills:
            for d in self.decodes:
                for link_id in self.topology.path_links(p, d):
                    self.network.link(link_id)
        self.background = BackgroundTraffic(
            config.background,
            self.loop,
            self.network,
            list(self.network.links),
            seed=config.seed + 1,
        )
        # The control plane's copy reuses the paths just computed for the flow network.
        self.telemetry = Telemetry(
            config.telemetry,
            self.loop,
            self.topology,
            self.topology.copy,
            self.network,
            self.prefills,
            self.decodes,
        )
        self._costs: dict[str, CostModel] = {}
        self.placement: PlacementPolicy | None
        self.placement_recovery: RecoveryPolicy | None
        if policy.mode == "placement":
            self.placement = make_placement_policy(policy.policy, **dict(policy.params))
            self.placement_recovery = None
        else:
            self.placement = None
            self.placement_recovery = make_recovery_policy(policy.policy)
        self.joint_placement: JointPlacementPolicy | None = None
        """The placement policy, when it chooses the prefill too (`policy.prefill: joint`)."""
        if policy.prefill == "joint":
            self.joint_placement = as_joint(self.placement)
            if self.joint_placement is None:
                raise InvalidArgument(
                    "policy.prefill",
                    f"joint needs a placement policy that chooses the prefill too (kvrs), "
                    f"not {policy.mode} {policy.policy!r}",
                )
        self.recovery_policy = make_recovery_policy(config.recovery.policy)

        self.records: list[RequestRecord] = []
        # Open requests only: a closed one leaves, so a long run holds its records but
        # not every request's flows and prefill jobs.
        self.flights: dict[int, Flight] = {}
        self._on_decode: dict[str, set[Flight]] = defaultdict(set)
        self._held_at: dict[str, set[Flight]] = defaultdict(set)
        self._requests: Iterator[TraceRequest] = iter(requests)
        self._arrivals_done = False
        self._open = 0
        self._round_robin = 0
        self._dead: set[str] = set()
        self.slots_in_use = 0
        self.stats: dict[str, Any] = defaultdict(int)
        self.recovery_batches: list[dict[str, Any]] = []

    # -- running -------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Replay the workload to the end; every request ends completed or aborted."""
        started = time.perf_counter()
        self.background.start()
        self.telemetry.start((self.policy_spec.network_view, self.config.recovery.network_view))
        for failure in self.config.failures:
            self.loop.at(failure.at_s, self._fail, failure.instance, failure.node)
        self._next_arrival()
        with _cycle_collector_paused():
            self.loop.run()
        wall_s = time.perf_counter() - started
        summary = summarize(
            self.policy_spec.name,
            self.records,
            self.config.slo,
            sim_time_s=self.loop.now_s,
            wall_s=wall_s,
            events=self.loop.events_run,
        )
        stats = dict(self.stats)
        stats.update(
            flows=self.network.flows_started,
            refills=self.network.refills,
            refilled_flows=self.network.refilled_flows,
            decode_steps=sum(d.steps for d in self.decodes.values()),
            telemetry_samples=self.telemetry.samples,
            link_samples=self.telemetry.link_samples,
            background_toggles=self.background.toggles,
        )
        return RunResult(self.policy_spec.name, self.records, summary, stats, self.recovery_batches)

    def _next_arrival(self) -> None:
        request = next(self._requests, None)
        if request is None:
            self._arrivals_done = True
            self._maybe_stop()
            return
        self.loop.at(request.arrival_s, self._arrive, request)

    def _maybe_stop(self) -> None:
        if self._arrivals_done and self._open == 0:
            self.background.stop()
            self.telemetry.stop()

    def _cost(self, network_view: str) -> CostModel:
        network = self.telemetry.network(network_view)
        cost = self._costs.get(network_view)
        if cost is None:
            cost = self._costs[network_view] = CostModel(
                self.model, self.compute, network, margins=self.config.recovery.margins
            )
        return cost

    # -- arrival and prefill -------------------------------------------------------------

    def _arrive(self, request: TraceRequest) -> None:
        record = RequestRecord(
            request.index, request.arrival_s, request.input_tokens, request.output_tokens
        )
        self.records.append(record)
        flight = Flight(request, record)
        self.flights[request.index] = flight
        self._open += 1
        self._submit_prefill(flight)
        self._next_arrival()

    def _submit_prefill(self, flight: Flight) -> None:
        prefill = self._route_prefill(flight.request)
        if prefill is None:
            self._abort(flight, "no_prefill_alive")
            return
        flight.stage = "prefill"
        request = flight.request
        flight.job = PrefillJob(
            flight.record,
            request.input_tokens,
            request.hash_ids,
            partial(self._prefilled, flight.epoch),
            tag=flight,
            on_start=self._prefill_started if self._streaming else None,
        )
        prefill.submit(flight.job)

    def _route_prefill(self, request: TraceRequest) -> PrefillInstance | None:
        """The prefill instance for a new request (the same rule for every policy)."""
        view = self.telemetry.view()
        candidates = view.prefill_instances()
        if not candidates:
            return None
        router = self.config.serving.prefill_router
        if router == "round_robin":
            self._round_robin += 1
            return self.prefills[candidates[self._round_robin % len(candidates)].instance_id]
        if router == "weighted":
            weights = self.config.serving.prefill_weights or {}
            ids = [s.instance_id for s in candidates]
            share = np.array([float(weights.get(i, 0.0)) for i in ids])
            if share.sum() <= 0:
                share = np.ones(len(ids))
            pick = int(
                np.searchsorted(np.cumsum(share / share.sum()), self._rng.random(), side="right")
            )
            return self.prefills[ids[min(pick, len(ids) - 1)]]
        age_s = max(0.0, self.loop.now_s - view.now_s)
        routing = _PrefillRouting.of(candidates, self.prefills)
        if router != "cache_aware":
            scores = np.maximum(routing.wait_s - age_s, 0.0)
            return self.prefills[candidates[int(scores.argmin())].instance_id]
        # The core's rule (kvrs.prefill), with W aged by the view's age. Only pools listed
        # under the first block can hit; the others stay cold.
        tokens = request.input_tokens
        hash_ids = request.hash_ids
        holders = self._pooled_blocks.caches(hash_ids[0]) if hash_ids else ()
        hits: dict[int, int] = {}
        for pool in holders:
            for i in routing.by_pool.get(pool, ()):
                blocks = routing.pooled[i].leading(hash_ids)
                if blocks:
                    # kvrs.costmodel.prefix_hit_tokens, over the pool as telemetry saw it.
                    hits[i] = min(blocks * self.block_tokens, tokens)
        finishes = prefill_finishes(routing.wait_s - age_s, tokens, self.compute, hits)
        index = soonest(finishes, routing.queue_depth)
        if self.joint_placement is not None:
            index = self.joint_placement.choose_prefill(
                PlacementRequest(
                    str(request.index), candidates[index].instance_id, tokens, request.hash_ids
                ),
                [(state.instance_id, float(finishes[i])) for i, state in enumerate(candidates)],
                index,
                self.telemetry.view(self.policy_spec.network_view).decode_instances(),
                self._cost(self.policy_spec.network_view),
                self.loop.now_s,
                [hits.get(i, 0) for i in range(len(candidates))],
            )
        return self.prefills[candidates[index].instance_id]

    def _prefill_started(self, job: PrefillJob, end_s: float) -> None:
        """The decode instance is chosen as the prefill starts (what the service's router
        does); with layer-wise streaming the KV leaves layer by layer while the prefill
        computes it, else once it has ended."""
        flight: Flight = job.tag
        if flight.job is not job or flight.stage != "prefill":
            return
        now_s = self.loop.now_s
        flight.streamed = True
        flight.prefill_id = job.prefill_id
        flight.prefill_ends_s = end_s
        flight.first_layer_s = end_s
        if self.config.serving.layerwise_streaming:
            flight.first_layer_s = now_s + (end_s - now_s) / self.model.layers
        flight.tail_s = math.nan
        self._place(flight)

    def _prefilled(self, epoch: int, job: PrefillJob) -> None:
        flight: Flight = job.tag
        if flight.epoch != epoch or flight.stage == "done":
            return
        record = flight.record
        prefill_id = job.prefill_id
        if math.isnan(record.prefill_end_s):
            record.prefill_start_s = job.started_s
            record.prefill_end_s = self.loop.now_s
            record.prefill_id = prefill_id
            record.prefix_hit_tokens = job.hit_tokens
        self._hold_kv(flight, prefill_id)
        if not flight.streamed:
            self._place(flight)
        elif flight.stage == "placing":
            # No decode instance had room yet: it is placed, as any, when one has.
            flight.streamed = False
        elif flight.stage == "streamed":
            # The KV crossed while it prefilled: only the last layer's part is left.
            self.loop.after(flight.tail_s, self._streamed_in, flight, flight.epoch)

    @property
    def _streaming(self) -> bool:
        """Whether a decode instance is chosen as the prefill starts (see `_prefill_started`)."""
        serving = self.config.serving
        early = serving.layerwise_streaming or serving.early_placement
        return early and self.policy_spec.mode == "placement"

    def _hold_kv(self, flight: Flight, prefill_id: str) -> None:
        if flight.prefill_id:
            self._held_at[flight.prefill_id].discard(flight)
        flight.prefill_id = prefill_id
        flight.source_kv = True
        self._held_at[prefill_id].add(flight)

    # -- placement -----------------------------------------------------------------------

    def _place(self, flight: Flight, epoch: int | None = None) -> None:
        if flight.stage == "done" or (epoch is not None and epoch != flight.epoch):
            return
        flight.stage = "placing"
        request = flight.request
        if request.input_tokens + request.output_tokens > self.config.serving.decode_kv_tokens:
            self._abort(flight, "exceeds_decode_kv")
            return
        if self.policy_spec.mode == "recovery":
            self._place_by_recovery(flight)
            return
        now_s = self.loop.now_s
        view = self.telemetry.view(self.policy_spec.network_view)
        candidates: Sequence[InstanceState] = view.decode_instances()
        if self.policy_spec.candidates == "same_node":
            node = self.node_of[flight.prefill_id]
            candidates = [s for s in candidates if self.node_of[s.instance_id] == node]
        cost = self._cost(self.policy_spec.network_view)
        stream_prefill_s = 0.0
        if flight.streamed and self.config.serving.layerwise_streaming:
            stream_prefill_s = max(0.0, flight.prefill_ends_s - now_s)
        try:
            placement = self.placement.select(  # type: ignore[union-attr]
                PlacementRequest(
                    str(request.index),
                    flight.prefill_id,
                    request.input_tokens,
                    request.hash_ids,
                    stream_prefill_s,
                ),
                candidates,
                cost,
                now_s,
            )
        except (ResourceExhausted, FailedPrecondition):
            self._retry_placement(flight)
            return
        flight.record.predicted_ttft_s = placement.predicted_ttft_s
        self._to_decode(
            flight, placement.instance_id, flight.prefill_id, request.input_tokens, use_hits=True
        )

    def _retry_placement(self, flight: Flight) -> None:
        """No decode instance has room in the view: look again once the view has changed."""
        self.stats["placement_retries"] += 1
        delay_s = max(
            self.config.placement_retry_s, self.telemetry.next_state_sample_s() - self.loop.now_s
        )
        self.loop.after(delay_s, self._place, flight, flight.epoch)

    def _place_by_recovery(self, flight: Flight) -> None:
        """RoM-style placement: MIGRATE / RECOMPUTE / HYBRID decided per request.

        The prefill that just ran is excluded as a recompute site: recomputing where the
        KV already is would only repeat the same work.
        """
        now_s = self.loop.now_s
        request = flight.request
        recovery_request = RecoveryRequest(
            request_id=str(request.index),
            prompt_tokens=request.input_tokens,
            generated_tokens=0,
            source_prefill_id=flight.prefill_id,
            exclude_ids=frozenset((flight.prefill_id,)),
        )
        view = self.telemetry.view(self.policy_spec.network_view)
        cost = self._cost(self.policy_spec.network_view)
        try:
            decision = self.placement_recovery.decide(  # type: ignore[union-attr]
                recovery_request, view, cost, now_s
            )
        except FailedPrecondition:
            decision = None
        if decision is None or decision.action is Action.ABORT:
            self._retry_placement(flight)
            return
        flight.record.predicted_ttft_s = decision.cost_s
        self.stats[f"placed_{decision.action.value}"] += 1
        self._execute(flight, decision, now_s, record=False)

    def _to_decode(
        self,
        flight: Flight,
        decode_id: str,
        source_id: str,
        kv_tokens: int,
        use_hits: bool,
        then: Callable[[Flight], Any] | None = None,
        migration: bool = False,
    ) -> None:
        """Reserve KV memory on `decode_id`, then pull `kv_tokens` of KV from `source_id`."""
        decode = self.decodes[decode_id]
        if not decode.alive:
            # Chosen before it died (a recompute outlived its target): plan again.
            self._withdraw(flight)
            self._recover([flight], self.loop.now_s)
            return
        record = flight.record
        record.decode_id = decode_id
        record.tier = int(self.topology.tier(source_id, decode_id))
        flight.decode_id = decode_id
        self._on_decode[decode_id].add(flight)
        flight.stage = "memory"
        flight.memory_tokens = flight.request.input_tokens + flight.request.output_tokens
        flight.memory_state = "queued"
        granted = partial(
            self._memory_granted,
            flight,
            flight.epoch,
            source_id,
            kv_tokens,
            use_hits,
            then,
            migration,
        )
        decode.request_memory(flight.memory_tokens, granted, tag=flight)

    def _memory_granted(
        self,
        flight: Flight,
        epoch: int,
        source_id: str,
        kv_tokens: int,
        use_hits: bool,
        then: Callable[[Flight], Any] | None,
        migration: bool,
    ) -> None:
        flight.memory_state = "granted"
        if flight.epoch != epoch:
            return
        setup_s = self.topology.base_rtt_s(source_id, flight.decode_id)
        sends_s = flight.first_layer_s
        if self.config.serving.layerwise_streaming:
            # The set-up runs while the prefill computes the first layer.
            sends_s -= setup_s
        if flight.streamed and self.loop.now_s < sends_s:
            # Nothing to send before the prefill has computed the first layer (streamed:
            # the set-up starts that much earlier).
            self.loop.at(
                sends_s,
                self._memory_granted,
                flight,
                epoch,
                source_id,
                kv_tokens,
                use_hits,
                then,
                migration,
            )
            return
        decode = self.decodes[flight.decode_id]
        record = flight.record
        hit = 0
        if use_hits:
            hit = min(
                kv_tokens, decode.cache.leading_hits(flight.request.hash_ids) * self.block_tokens
            )
            record.decode_hit_tokens = hit
        kv_bytes = self.model.kv_bytes(kv_tokens - hit)
        if use_hits:
            kv_bytes = int(kv_bytes * (1.0 - self.config.serving.transfer_overlap))
        record.kv_bytes = kv_bytes
        flight.stage = "transfer"
        if math.isnan(record.transfer_start_s):
            record.transfer_start_s = self.loop.now_s
        done = partial(self._kv_arrived, flight, flight.epoch, then or self._admit, migration)
        flight.flow = self.network.start(
            self.topology.path_links(source_id, flight.decode_id),
            kv_bytes,
            done,
            setup_s=setup_s,
            tag=flight,
        )

    def _kv_arrived(
        self, flight: Flight, epoch: int, then: Callable[[Flight], Any], migration: bool, flow: Flow
    ) -> None:
        if flight.epoch != epoch:
            return
        flight.flow = None
        if migration:
            self._release_slot(flight)
        if flight.streamed:
            # Its last layer could not leave before the prefill computed it: the KV is in
            # once the prefill has ended and that layer crossed (at the flow's mean rate,
            # from when its set-up was done).
            tail_s = (self.loop.now_s - flow.joined_s) / self.model.layers
            if not flight.source_kv:
                flight.tail_s, flight.stage = tail_s, "streamed"
                return
            left_s = flight.record.prefill_end_s + tail_s - self.loop.now_s
            if left_s > 0:
                self.loop.after(left_s, self._streamed_in, flight, epoch)
                return
        if math.isnan(flight.record.transfer_end_s):
            flight.record.transfer_end_s = self.loop.now_s
        then(flight)

    def _streamed_in(self, flight: Flight, epoch: int) -> None:
        """A streamed KV is in: its tail has crossed after the prefill."""
        if flight.epoch != epoch:
            return
        if math.isnan(flight.record.transfer_end_s):
            flight.record.transfer_end_s = self.loop.now_s
        self._admit(flight)

    def _admit(self, flight: Flight) -> None:
        request, record = flight.request, flight.record
        flight.stage = "decode"
        generated = record.generated_tokens
        if flight.recovery is not None and math.isnan(flight.recovery.restored_s):
            flight.recovery.restored_s = self.loop.now_s
        member = DecodeMember(
            record,
            request.input_tokens + generated,
            request.output_tokens - generated,
            flight.memory_tokens,
            request.hash_ids,
            self._resumed if flight.recovery else None,
        )
        flight.memory_state = ""
        self.decodes[flight.decode_id].admit(member)

    def _resumed(self, member: DecodeMember, resumed_s: float) -> None:
        flight = self.flights[member.record.index]
        if flight.recovery is not None and math.isnan(flight.recovery.resumed_s):
            flight.recovery.resumed_s = resumed_s

    def _decode_finished(self, member: DecodeMember) -> None:
        flight = self.flights[member.record.index]
        record = flight.record
        record.finish_s = self.loop.now_s
        record.status = COMPLETED
        record.close_gaps()
        self._close(flight)

    def _close(self, flight: Flight) -> None:
        flight.stage = "done"
        # A job and a flow point back at their flight (`tag`): unlinking them lets
        # reference counting free the request's objects instead of the cycle collector.
        flight.job = None
        flight.flow = None
        del self.flights[flight.record.index]
        self._on_decode[flight.decode_id].discard(flight)
        if flight.prefill_id:
            self._held_at[flight.prefill_id].discard(flight)
        self._release_slot(flight)
        self._open -= 1
        if self._on_request_done is not None:
            self._on_request_done()
        self._maybe_stop()

    def _abort(self, flight: Flight, reason: str) -> None:
        flight.record.status = ABORTED
        flight.record.abort_reason = reason
        flight.record.segments = []
        self._close(flight)

    def _release_slot(self, flight: Flight) -> None:
        if flight.slot:
            flight.slot = False
            self.slots_in_use -= 1

    # -- failures ------------------------------------------------------------------------

    def _fail(self, instance_id: str, node: str) -> None:
        """Kill an instance (or every instance of a node) and recover what it held."""
        ids = (
            [instance_id]
            if instance_id
            else sorted(i for i, n in self.node_of.items() if n == node)
        )
        if not ids or any(i not in self.node_of for i in ids):
            raise InvalidArgument("failure", f"unknown instance or node: {instance_id or node}")
        failed_at_s = self.loop.now_s
        affected: dict[int, Flight] = {}
        reroute: list[Flight] = []
        for dead in ids:
            self._dead.add(dead)
            self.telemetry.mark_dead(dead)
            self.stats["failed_instances"] += 1
        for dead in ids:
            if dead in self.prefills:
                for job in self.prefills[dead].fail():
                    flight = job.tag
                    if flight.job is not job or flight.stage == "done":
                        continue  # work it no longer waits for
                    if flight.stage == "prefill":
                        reroute.append(flight)
                    elif flight.streamed and not flight.source_kv:
                        # Placed as it prefilled, on KV now lost: the prompt starts over.
                        self._withdraw(flight)
                        reroute.append(flight)
                    else:
                        affected[flight.record.index] = flight
                for flight in list(self._held_at.pop(dead, ())):
                    flight.source_kv = False
                    if flight.stage in ("placing", "memory", "transfer"):
                        # The KV it was about to send is gone with the prefill.
                        affected[flight.record.index] = flight
            if dead in self.decodes:
                self.decodes[dead].fail()
                for flight in list(self._on_decode.pop(dead, ())):
                    if flight.streamed and not flight.source_kv and flight.stage != "done":
                        self._unplace(flight)
                    else:
                        affected[flight.record.index] = flight
        for flight in reroute:
            flight.epoch += 1
            flight.streamed = False
            self.stats["prefill_rerouted"] += 1
            self._submit_prefill(flight)
        flights = [f for _, f in sorted(affected.items()) if f.stage != "done"]
        for flight in flights:
            self._withdraw(flight)
        if flights:
            self.loop.after(self.config.recovery.detection_s, self._recover, flights, failed_at_s)

    def _unplace(self, flight: Flight) -> None:
        """Its decode instance died while its prompt still prefilled: nothing is lost but
        the placement, so it is placed again, as any, once the prefill ends."""
        self._withdraw(flight)
        flight.stage = "prefill"
        flight.streamed = False
        assert flight.job is not None, "a flight streaming under a prefill has its job"
        flight.job.on_done = partial(self._prefilled, flight.epoch)
        self.stats["streams_unplaced"] += 1

    def _withdraw(self, flight: Flight) -> None:
        """Cancel whatever the flight was waiting for; it is about to be re-planned."""
        flight.epoch += 1
        flight.stage = "recovering"
        if flight.flow is not None:
            self.network.abort(flight.flow)
            flight.flow = None
        self._release_slot(flight)
        decode = self.decodes.get(flight.decode_id)
        if decode is not None and decode.alive:
            if flight.memory_state == "queued":
                decode.cancel_memory_request(flight)
            elif flight.memory_state == "granted":
                decode.release_memory(flight.memory_tokens)
        flight.memory_state = ""
        self._on_decode[flight.decode_id].discard(flight)

    # -- recovery ------------------------------------------------------------------------

    def _recover(self, flights: list[Flight], failed_at_s: float) -> None:
        now_s = self.loop.now_s
        flights = [f for f in flights if f.stage == "recovering"]
        if not flights:
            return
        spec = self.config.recovery
        deadline_s = None if spec.deadline_s is None else failed_at_s + spec.deadline_s
        exclude = frozenset(self._dead)
        requests = []
        for flight in flights:
            source_ok = flight.source_kv and flight.prefill_id not in self._dead
            requests.append(
                RecoveryRequest(
                    request_id=str(flight.record.index),
                    prompt_tokens=flight.request.input_tokens,
                    generated_tokens=flight.record.generated_tokens,
                    source_prefill_id=flight.prefill_id or next(iter(self.prefills)),
                    deadline_s=deadline_s,
                    source_kv_available=source_ok,
                    exclude_ids=exclude,
                )
            )
        view = self.telemetry.view(spec.network_view)
        cost = self._cost(spec.network_view)
        started = time.perf_counter()
        by_id = {str(f.record.index): f for f in flights}
        if spec.planner == "batch":
            plan = plan_batch(
                requests,
                view,
                cost,
                now_s,
                self.recovery_policy,
                max(0, spec.migration_slots - self.slots_in_use),
            )
            plan_s = time.perf_counter() - started
            for decision in plan.decisions:
                self._execute(by_id[decision.request_id], decision, failed_at_s)
            makespan_s = plan.makespan_s
        else:
            for request in requests:
                # As the scheduler does: decide, then take a slot; none left, decide again.
                decision = self.recovery_policy.decide(request, view, cost, now_s)
                if decision.action in NEEDS_SLOT and self.slots_in_use >= spec.migration_slots:
                    decision = decide_without_slot(
                        self.recovery_policy, request, view, cost, now_s, "no migration slot free"
                    )
                self._execute(by_id[request.request_id], decision, failed_at_s)
            plan_s = time.perf_counter() - started
            makespan_s = math.nan
        self.recovery_batches.append(
            {
                "at_s": now_s,
                "failed_at_s": failed_at_s,
                "requests": len(requests),
                "planner": spec.planner,
                "policy": spec.policy,
                "plan_wall_s": plan_s,
                "predicted_makespan_s": makespan_s,
            }
        )

    def _execute(
        self, flight: Flight, decision: RecoveryDecision, started_s: float, record: bool = True
    ) -> None:
        """Carry out one recovery decision on the live cluster."""
        action = decision.action
        if record:
            rec = RecoveryRecord(
                action=action.value,
                started_s=started_s,
                target_id=decision.target_id,
                predicted_s=decision.cost_s,
                planner=self.config.recovery.planner,
                generated_tokens=flight.record.generated_tokens,
            )
            flight.record.recoveries.append(rec)
            flight.recovery = rec
            self.stats[f"recovery_{action.value}"] += 1
        if action is Action.ABORT:
            self._abort(flight, f"recovery: {decision.reason}")
            return
        request = flight.request
        generated = flight.record.generated_tokens
        if action is Action.RECOMPUTE:
            prefill = self.prefills[decision.source_id]
            flight.stage = "recomputing"
            flight.job = PrefillJob(
                flight.record,
                request.input_tokens + generated,
                request.hash_ids,
                partial(self._recomputed, flight.epoch, decision),
                tag=flight,
            )
            prefill.submit(flight.job)
            return
        # Placement-time moves (RoM load balancing) are not failure migrations: no slot.
        flight.slot = record
        self.slots_in_use += int(record)
        if action is Action.MIGRATE:
            self._to_decode(
                flight,
                decision.target_id,
                decision.source_id,
                request.input_tokens,
                use_hits=not record,
                then=self._extend_then_admit,
                migration=record,
            )
            return
        moved = kv_tokens_moved(action, request.input_tokens, generated, decision.split_tokens)
        split = request.input_tokens - moved
        flight.pending_parts = 2
        self._to_decode(
            flight,
            decision.target_id,
            decision.source_id,
            moved,
            use_hits=False,
            then=self._hybrid_part_done,
            migration=record,
        )
        decode = self.decodes[decision.target_id]
        decode.add_job(
            ComputeJob(
                self.compute.prefill_s(split),
                partial(self._hybrid_compute_done, flight, flight.epoch),
            )
        )

    def _recomputed(self, epoch: int, decision: RecoveryDecision, job: PrefillJob) -> None:
        flight: Flight = job.tag
        if flight.epoch != epoch or flight.stage == "done":
            return
        self._hold_kv(flight, job.prefill_id)
        tokens = flight.request.input_tokens + flight.record.generated_tokens
        self._to_decode(flight, decision.target_id, flight.prefill_id, tokens, use_hits=False)

    def _hybrid_compute_done(self, flight: Flight, epoch: int, job: ComputeJob) -> None:
        if flight.epoch == epoch:
            self._hybrid_part_done(flight)

    def _hybrid_part_done(self, flight: Flight) -> None:
        flight.pending_parts -= 1
        if flight.pending_parts == 0:
            self._extend_then_admit(flight)

    def _extend_then_admit(self, flight: Flight) -> None:
        """The prompt's KV is on the target; recompute the generated tokens' KV, then go."""
        generated = flight.record.generated_tokens
        if generated == 0:
            self._admit(flight)
            return
        extend_s = self.compute.extend_s(flight.request.input_tokens, generated)
        self.decodes[flight.decode_id].add_job(
            ComputeJob(extend_s, partial(self._extended, flight, flight.epoch))
        )

    def _extended(self, flight: Flight, epoch: int, job: ComputeJob) -> None:
        if flight.epoch == epoch:
            self._admit(flight)


def run_policy(
    config: SimConfig,
    requests: Iterable[TraceRequest],
    policy: PolicySpec,
    on_request_done: Callable[[], Any] | None = None,
) -> RunResult:
    """Simulate `requests` under `policy`; the convenience entry point."""
    return Simulator(config, requests, policy, on_request_done).run()
