"""What the control plane knows: instance state and link load, sampled every T seconds.

Policies never read the simulator's live state. They get a `ClusterView` built from the
last instance sample and a `NetworkModel` fed from the last link sample, so a period of
T seconds makes every decision see state up to T seconds old; 0 means a fresh sample at
every decision, infinity means none after the start (links: topology capacity only).

Instance samples are exact but lazy: rather than copying every instance at every tick,
an instance records its state just before its first change after each tick (so the
record is its state at that tick), and a view is assembled only when a decision asks
for one. Between its changes an instance's state at a tick is its current state, with
the queued-work term evaluated at the tick's time.

A link sample is what a switch counter gives: each link's capacity left by background
traffic, which becomes that link's capacity in the control plane's own copy of the
topology (so `NetworkModel` computes each link's share with its measured capacity), and
the KV flows on each link. Three network views, chosen per policy:
- `topology`: tier capacities only (what a static topology-aware router knows);
- `telemetry`: measured link capacities and KV flow counts, both as of the last sample;
- `live`: the same measured capacities, but the KV flows the control plane itself
  started, counted as they start and end (it launched them, so it needs no sample);
- `trend`: the tier capacities and the live KV flows, with every link sample folded into
  that link's `LinkTrend` (`NetworkModel.observe_link`): what `kvrs` placement reads to
  weigh a sample by its age against how fast the link changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from kvrs.cluster import ClusterView, InstanceState
from kvrs.errors import InvalidArgument
from kvrs.estimator import StalenessPolicy
from kvrs.network import NetworkModel
from kvrs.sim.engine import EventLoop
from kvrs.sim.flownet import FlowNetwork
from kvrs.sim.instances import DecodeInstance, PrefillInstance
from kvrs.topology import Role, Topology

NETWORK_VIEWS = ("topology", "telemetry", "live", "trend")


@dataclass(frozen=True)
class TelemetrySpec:
    """How often the control plane's picture of the cluster is refreshed."""

    # Instance load, memory, prefix blocks (gossip): what the real control plane delivers
    # at a thousand GPUs and more. Workers heartbeat every TTL / 4 = 0.5 s (gossip's
    # default TTL is 2 s); views follow the change feed within one 0.1 s refresh (view
    # age p50 ~0.1 s, bench.scale, docs/benchmarks.md), so a load report is up to ~0.5 s
    # old when a decision reads it, not 0.1 s.
    state_period_s: float = 0.5
    link_period_s: float = 1.0  # link capacity left by background, KV flow counts
    stale_after_s: float = 60.0  # staleness bound handed to the network model

    def __post_init__(self) -> None:
        if self.state_period_s < 0 or self.link_period_s < 0:
            raise InvalidArgument("telemetry", "periods must be >= 0 (inf: never)")


class Telemetry:
    """Samples instance and link state on the simulator's clock."""

    def __init__(
        self,
        spec: TelemetrySpec,
        loop: EventLoop,
        topology: Topology,
        build_topology: Callable[[], Topology],
        flows: FlowNetwork,
        prefills: Mapping[str, PrefillInstance],
        decodes: Mapping[str, DecodeInstance],
    ) -> None:
        self.spec = spec
        self.loop = loop
        self.topology = topology
        self.flows = flows
        self.prefills = prefills
        self.decodes = decodes
        self.dead: set[str] = set()
        self.samples = 0
        self.link_samples = 0
        self.stopped = False
        self._view: ClusterView | None = None
        self._view_tick = -1
        self._views: dict[str, ClusterView] = {}
        # instance id -> (tick, state at that tick), recorded before its first change
        self._captured: dict[str, tuple[int, InstanceState]] = {}
        # Instances changed since the last view; the others keep their InstanceState when
        # it does not depend on time (no job running, no prefill batch in progress).
        self._changed: set[str] = set(prefills) | set(decodes)
        # Instances whose state the last view computed rather than reused: only these, the
        # changed and the dead can differ from the last view, because an unchanged instance
        # that was idle at one sample is idle at every later one (its work only ends).
        self._recheck: set[str] = set()
        self._position = {
            instance_id: position for position, instance_id in enumerate((*prefills, *decodes))
        }
        for prefill in prefills.values():
            prefill.on_change = self.before_change
        for decode in decodes.values():
            decode.on_change = self.before_change
        # The control plane's copy of the topology, whose link capacities are measured.
        self._measured = build_topology()
        self._measured_bps: dict = {}
        self._models: dict[str, NetworkModel] = {}
        self._flow_sample: dict = {}
        self._link_sampled_s = -math.inf
        self._flows_version: dict[str, int] = {}  # per live-flow view, counts it has

    # -- sampling ------------------------------------------------------------------------

    def start(self, views: Iterable[str] = ()) -> None:
        """Take the first link sample and schedule the periodic ones.

        The network models of `views` exist from the start, so a `trend` view sees every
        sample (it is fed only while it exists).
        """
        for kind in views:
            self._model(kind)
        if self.spec.link_period_s < math.inf:
            self._sample_links()
            if self.spec.link_period_s > 0:
                self.loop.after(self.spec.link_period_s, self._periodic_links)

    def stop(self) -> None:
        self.stopped = True

    def _periodic_links(self) -> None:
        if not self.stopped:
            self._sample_links()
            self.loop.after(self.spec.link_period_s, self._periodic_links)

    def mark_dead(self, instance_id: str) -> None:
        """Failure events reach the control plane at once (they are not sampled)."""
        self.dead.add(instance_id)
        self._view_tick = -1

    def _tick(self, now_s: float) -> int:
        """Index of the last instance sample at or before `now_s` (0 for a period of inf)."""
        period = self.spec.state_period_s
        return 0 if period == math.inf else int(now_s / period + 1e-9)

    def before_change(self, instance_id: str) -> None:
        """An instance is about to change: keep its state at the last tick if not yet kept."""
        self._changed.add(instance_id)
        if self.spec.state_period_s == 0:
            return
        tick = self._tick(self.loop.now_s)
        captured = self._captured.get(instance_id)
        if captured is None or captured[0] < tick:
            self._captured[instance_id] = (tick, self._state_at_tick(instance_id, tick))

    def _state_at_tick(self, instance_id: str, tick: int) -> InstanceState:
        """The instance's state at `tick`, called before its first change since then.

        Decisions build the tick's view early in the tick, so most instances change after
        it: where that view computed the instance's state itself (rather than carrying it
        from an older view), its state is the one `_state` would compute again now.
        """
        if tick == self._view_tick and instance_id in self._recheck:
            assert self._view is not None
            return self._view.instances[instance_id]
        return self._state(instance_id, self._tick_s(tick))

    def _tick_s(self, tick: int) -> float:
        period = self.spec.state_period_s
        return 0.0 if period == math.inf else tick * period

    def _state(self, instance_id: str, at_s: float) -> InstanceState:
        """The instance's state at `at_s`, which must not precede its last change."""
        p = self.prefills.get(instance_id)
        if p is not None:
            return InstanceState(
                instance_id=instance_id,
                role=Role.PREFILL,
                wait_s=p.wait_s(at_s),
                queue_depth=len(p.queue),
                running_requests=len(p.batch),
                resident_blocks=p.pool.as_of(at_s),  # type: ignore[arg-type]
                alive=p.alive,
            )
        d = self.decodes[instance_id]
        return InstanceState(
            instance_id=instance_id,
            role=Role.DECODE,
            wait_s=d.wait_s(at_s),
            queue_depth=len(d.waiting) + len(d.memory_queue),
            running_requests=len(d.batch),
            free_kv_tokens=max(0, d.free_kv_tokens),
            # A decode cache changes only with its instance, so its contents now are its
            # contents at `at_s`; a frozenset keeps placement's per-block scans in C.
            resident_blocks=d.cache.snapshot(),
            alive=d.alive,
        )

    def _busy(self, instance_id: str, at_s: float) -> bool:
        """Its W(x) shrinks as time passes (work in progress), so old states are stale."""
        prefill = self.prefills.get(instance_id)
        if prefill is not None:
            return prefill.busy_until_s > at_s or prefill.pool_shared
        return self.decodes[instance_id].job_running(at_s)

    def _build_view(self) -> None:
        now_s = self.loop.now_s
        period = self.spec.state_period_s
        tick = -2 if period == 0 else self._tick(now_s)
        if tick == self._view_tick and tick != -2 and self._view is not None:
            return
        at_s = now_s if period == 0 else self._tick_s(tick)
        self.samples += 1
        previous = self._view.instances if self._view is not None else {}
        # Copying the last view keeps every instance in topology order; the ones that may
        # differ are then replaced, in that order too.
        states: dict[str, InstanceState] = dict(previous)
        changed = self._changed
        # A captured state is the tick's, not the live one: it cannot be reused later.
        stale_next: set[str] = set()
        recheck: set[str] = set()
        maybe_different = changed | self._recheck | (self.dead & self._position.keys())
        for instance_id in sorted(maybe_different, key=self._position.__getitem__):
            captured = self._captured.get(instance_id)
            if captured is not None and captured[0] == tick:
                state = captured[1]
                stale_next.add(instance_id)
                recheck.add(instance_id)
            elif (
                instance_id not in changed
                and instance_id in previous
                and not self._busy(instance_id, at_s)
            ):
                state = previous[instance_id]
            else:
                state = self._state(instance_id, at_s)
                recheck.add(instance_id)
            if instance_id in self.dead and state.alive:
                state = replace(state, alive=False)
            states[instance_id] = state
        self._view = ClusterView(instances=states, now_s=at_s)
        self._view_tick = tick
        self._changed = stale_next
        self._recheck = recheck
        self._views = {}

    def _sample_links(self) -> None:
        """Read every link's capacity left by background traffic, and the KV flows."""
        self._link_sampled_s = self.loop.now_s
        self.link_samples += 1
        for link_id, link in self.flows.links.items():
            free_bps = max(1.0, link.free_bps)
            if self._measured_bps.get(link_id) != free_bps:
                self._measured_bps[link_id] = free_bps
                self._measured.set_link_capacity(link_id, free_bps)
        trend_model = self._models.get("trend")
        if trend_model is not None:
            for link_id, link in self.flows.links.items():
                trend_model.observe_link(link_id, link.free_bps, self.loop.now_s)
        self._flow_sample = dict(self.flows.launched)
        telemetry_model = self._models.get("telemetry")
        if telemetry_model is not None:
            telemetry_model.set_flows(self._flow_sample)

    def next_state_sample_s(self) -> float:
        """When the instance view will next change (now, for a period of 0 or inf)."""
        period = self.spec.state_period_s
        if not 0 < period < math.inf:
            return self.loop.now_s
        return self._tick_s(self._tick(self.loop.now_s) + 1)

    # -- what decisions see --------------------------------------------------------------

    def view(self, network_view: str = "") -> ClusterView:
        """The cluster as of the last instance sample (fresh when the period is 0).

        Decisions cache path terms on a view's instance lists, keyed by the network
        model's version number only; two network models can share a version number, so
        each network view gets a view object of its own.
        """
        self._build_view()
        assert self._view is not None
        view = self._views.get(network_view)
        if view is None:
            view = self._views[network_view] = ClusterView(
                instances=self._view.instances, now_s=self._view.now_s
            )
        return view

    def _model(self, kind: str) -> NetworkModel:
        model = self._models.get(kind)
        if model is None:
            topology = self.topology if kind in ("topology", "trend") else self._measured
            model = self._models[kind] = NetworkModel(
                topology, StalenessPolicy(self.spec.stale_after_s)
            )
            if kind == "telemetry":
                model.set_flows(self._flow_sample)
        return model

    def network(self, kind: str) -> NetworkModel:
        """The network model of `kind` as of now (see the module docstring)."""
        if kind not in NETWORK_VIEWS:
            raise InvalidArgument("network_view", f"one of {NETWORK_VIEWS}, not {kind!r}")
        model = self._model(kind)
        if (
            kind != "topology"
            and self.spec.link_period_s == 0
            and self._link_sampled_s < self.loop.now_s
        ):
            self._sample_links()
        if kind in ("live", "trend") and self._flows_version.get(kind) != self.flows.counts_version:
            self._flows_version[kind] = self.flows.counts_version
            model.set_flows(self.flows.launched)
        return model
