"""The decision services' cached copy of gossip: instances, link estimates, and its age.

A decision reads `ViewCache.current()` and never awaits gossip or Redis: a background
task refreshes the copy every `refresh_s` (and at once on a failure event), and when
gossip is unreachable the last copy keeps serving, flagged stale once it is older than
`stale_after_s`. The copy is one immutable `DecisionState`, swapped whole, so a decision
never sees half of a refresh.

Each build applies what executed decisions taught (`kvrs.learning.Corrections`): a link a
decision has measured is priced with its fitted fixed cost and rate, the compute profile
is scaled by the measured compute factor, and a decode instance's W(x) grows by its
measured interference per decoding request plus the work this scheduler assigned to it
after its last heartbeat (`AssignedWork`).

Gossip keeps failed and departed instances listed for minutes, so an alive instance that
vanishes from a listing without a trace was lost by the registry (a Redis restart
without persistence), not by the cluster: it stays in the view, flagged stale, for one
heartbeat TTL, the time it has to register again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import DeadlineExceeded, NotFound, Unavailable
from kvrs.estimator import LinkEstimate
from kvrs.learning import AssignedWork, Corrections, LinkFit
from kvrs.network import NetworkModel
from kvrs.placement import prepare_candidates
from kvrs.topology import InstanceSpec, LinkId, Location, Role
from services.common.decision_inputs import DecisionInputs
from services.common.gossip_records import ALIVE, LinkRecord, NodeRecord, Registration

log = logging.getLogger(__name__)

UNKNOWN_FREE_KV_TOKENS = 2**62
"""Free KV memory of an instance that registered no KV capacity: never the limit."""
DOWN_LINK_BPS = 1.0
"""A probe rate at or below this marks a link down (the prober's DOWN_BANDWIDTH_BPS)."""


@dataclass(frozen=True)
class GossipSnapshot:
    """Everything one refresh fetched, stamped with the local clock."""

    nodes: tuple[NodeRecord, ...]
    """Every instance gossip remembers, alive or not."""
    links: Mapping[tuple[str, str], LinkRecord]
    """The newest sample of every measured link, by (src, dst), as of this fetch (read
    during the refresh that fetched it: the source updates it at its next fetch)."""
    fetched_at_s: float
    flows: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """Migrations in flight per (src, dst) instance pair, as the slot broker counts them."""
    changed: tuple[NodeRecord, ...] | None = None
    """The records of `nodes` this fetch updated; None: any may have changed (a full
    listing), so the view is rebuilt from `nodes` alone."""
    changed_links: tuple[LinkRecord, ...] | None = None
    """The records of `links` this fetch brought new; None: any may have changed (a full
    listing), so the network model is rebuilt from `links` alone."""


class SnapshotSource(Protocol):
    async def fetch(self) -> GossipSnapshot:
        """Raises kvrs.errors.Unavailable / DeadlineExceeded when gossip cannot answer."""
        ...


@dataclass(frozen=True)
class DecisionState:
    """One consistent snapshot decisions read: the priced network and the instances."""

    cost: CostModel
    cluster: ClusterView
    """Every instance gossip remembers; `alive` says which may take work. One view per
    snapshot, so the candidate lists the core caches on it survive between decisions."""
    refreshed_at_s: float
    links_used: int
    telemetry_key: tuple
    """What the network model was built from besides the links (the flows in flight,
    the corrections); with no link changed either, the next refresh reuses the model."""
    carried_ids: frozenset[str] = frozenset()
    """Alive instances the registry lost, kept from an earlier listing (see module doc)."""

    def age_s(self, now_s: float) -> float:
        return max(0.0, now_s - self.refreshed_at_s)


@dataclass(frozen=True)
class DecisionView:
    """What one decision is made against, and how old it is."""

    state: DecisionState
    age_s: float
    stale: bool

    @property
    def cost(self) -> CostModel:
        return self.state.cost

    @property
    def cluster(self) -> ClusterView:
        return self.state.cluster


class ViewCache:
    """Keeps the latest `DecisionState`; see the module docstring."""

    def __init__(
        self,
        inputs: DecisionInputs,
        source: SnapshotSource,
        refresh_s: float,
        stale_after_s: float,
        clock: Callable[[], float] = time.time,
        corrections: Callable[[], Corrections] = Corrections,
        assigned: AssignedWork | None = None,
    ) -> None:
        self.inputs = inputs
        self.corrections = corrections
        self.assigned = assigned
        self.refresh_s = refresh_s
        self.stale_after_s = stale_after_s
        self._source = source
        self.clock = clock
        self._state: DecisionState | None = None
        self._wake = asyncio.Event()
        self._refreshing = asyncio.Lock()
        """One fetch at a time: two overlapping refreshes (the background loop and a caller
        that wants the latest) could install the older snapshot last, and the change feed's
        cursor must advance in order."""
        self.refresh_failures = 0
        self._failing_since_s: float | None = None
        self._alive: dict[str, NodeRecord] = {}
        """The alive instances of the last view, listed or carried."""
        self._vanished_at_s: dict[str, float] = {}
        self._records: dict[str, tuple[NodeRecord, float]] = {}
        """Each instance's last record and when it was reported (local clock)."""
        self._pending_ids: set[str] = set()
        """Instances whose W(x) counted assigned work at the last build."""
        self._unbooked: list[tuple[str, float]] = []
        """Work `assign`ed and not yet in the view's W(x) (see `book_assigned`)."""
        self._reported_down: set[str] = set()
        """Instances failure events reported and the view still counts alive (see
        `mark_down`)."""
        self._unplaced: dict[tuple[str, str], LinkRecord] = {}
        """Link samples of an instance the topology does not know yet (the prober saw it
        register before this view did); placed by the refresh that first knows both ends."""
        self._unplaced_at_version = -1
        """The topology's version when `_unplaced` was last looked at."""

    @property
    def state(self) -> DecisionState | None:
        self._apply_pending()
        return self._state

    def current(self, now_s: float | None = None) -> DecisionView:
        """The view to decide against now; Unavailable only before the first refresh."""
        self._apply_pending()
        state = self._state
        if state is None:
            raise Unavailable("no view of the cluster yet: gossip has not answered since start")
        now_s = self.clock() if now_s is None else now_s
        age_s = state.age_s(now_s)
        stale = age_s > self.stale_after_s or bool(state.carried_ids)
        # The shared view's clock moves with each decision; decisions run between awaits on
        # one event loop, so none sees another's `now_s` change under it.
        cluster = state.cluster
        cluster.now_s, cluster.view_age_s, cluster.stale = now_s, age_s, stale
        return DecisionView(state=state, age_s=age_s, stale=stale)

    def is_known(self, instance_id: str) -> bool:
        """Known to the topology file or to gossip (alive or not)."""
        state = self._state
        if state is not None and instance_id in state.cluster.instances:
            return True
        return self._in_topology(instance_id)

    def role(self, instance_id: str) -> Role | None:
        """The instance's role as gossip or the topology file knows it; None if unknown."""
        state = self._state
        if state is not None:
            known = state.cluster.instances.get(instance_id)
            if known is not None:
                return known.role
        try:
            return self.inputs.topology.instance(instance_id).role
        except NotFound:
            return None

    async def refresh(self) -> bool:
        """Fetches gossip once; False (and the old view kept) when gossip cannot answer.

        A refresh asked for while another is in flight waits for it, then fetches anew, so
        what it installs was fetched after it was asked for.
        """
        async with self._refreshing:
            reported_down = set(self._reported_down)
            try:
                snapshot = await self._source.fetch()
            except (Unavailable, DeadlineExceeded) as exc:
                self.refresh_failures += 1
                self._expire_assigned()
                # Once per outage, not ten times a second.
                if self._failing_since_s is None:
                    self._failing_since_s = self.clock()
                    log.warning("gossip unreachable, deciding from the cached view: %s", exc)
                return False
            self._unbooked = []  # the build reads the assigned work, this included
            self._state = self._build(snapshot)
            # The listing says what became of the failures reported before it was asked
            # for (an instance may have registered again since); only those reported
            # while it was under way are still to drop.
            self._reported_down -= reported_down
            if self._failing_since_s is not None:
                log.warning(
                    "gossip reachable again after %.1f s", self.clock() - self._failing_since_s
                )
                self._failing_since_s = None
            return True

    def mark_down(self, instance_id: str) -> None:
        """A failure event: the instance stops being a candidate now, not at the next
        refresh. The next read of the view (`current`, `state`) drops it, together with
        every other instance reported down before that read: a rack's failure events
        rebuild the candidate lists once, not once per instance. A refresh asked for
        after the report supersedes it."""
        if self._state is not None:
            self._reported_down.add(instance_id)
            self.request_refresh()

    def _apply_pending(self) -> None:
        """Failures reported and work assigned since the view was last read."""
        if self._reported_down:
            self._drop_reported_down()
        if self._unbooked:
            self.book_assigned()

    def _drop_reported_down(self) -> None:
        reported, self._reported_down = self._reported_down, set()
        state = self._state
        if state is None:
            return
        instances = state.cluster.instances
        down = {
            instance_id: dataclasses.replace(instances[instance_id], alive=False)
            for instance_id in reported
            if instance_id in instances and instances[instance_id].alive
        }
        if down:
            cluster = ClusterView(instances={**instances, **down}, now_s=state.cluster.now_s)
            prepare_candidates(cluster, state.cluster)
            self._state = dataclasses.replace(state, cluster=cluster)

    def _expire_assigned(self) -> None:
        """Without a snapshot, W(x) of the instances holding assigned work is still read
        again: work predicted done by now stops counting, as it would in a refresh."""
        state = self._state
        if state is None or self.assigned is None:
            return
        now_s = self.clock()
        corrections = self.corrections()
        changed = {}
        for instance_id in set(self.assigned.instances()) | self._pending_ids:
            record = self._records.get(instance_id)
            known = state.cluster.instances.get(instance_id)
            if record is not None and known is not None:
                node, reported_at_s = record
                reread = self._instance_state(node, corrections, now_s, reported_at_s)
                # An instance marked down since the last snapshot stays down.
                changed[instance_id] = dataclasses.replace(reread, alive=known.alive)
        if changed:
            self._unbooked = []  # re-read from the assigned work, this included
            cluster = state.cluster.updated(changed, now_s=state.cluster.now_s)
            self._state = dataclasses.replace(state, cluster=cluster)

    def assign(self, instance_id: str, work_s: float) -> None:
        """Work just sent to `instance_id`: its W(x) rises before the next decision reads
        the view (a burst's next placement, milliseconds later). The view itself is
        patched by `book_assigned`, which a scheduler calls once its reply is sent, or by
        the next `current()` if that comes first; either way no decision misses it. The
        next periodic refresh reads it again from the assigned work, until a heartbeat
        reports it, so no fetch from gossip is asked for per decision."""
        if work_s > 0.0:
            self._unbooked.append((instance_id, work_s))

    def book_assigned(self) -> None:
        """Raises W(x) in the current view by the work `assign`ed since the last call (all
        of it in one patch of the view)."""
        unbooked, self._unbooked = self._unbooked, []
        state = self._state
        if state is None or not unbooked:
            return
        instances = state.cluster.instances
        changed: dict[str, InstanceState] = {}
        for instance_id, work_s in unbooked:
            known = changed.get(instance_id) or instances.get(instance_id)
            if known is not None:
                changed[instance_id] = dataclasses.replace(known, wait_s=known.wait_s + work_s)
        if changed:
            cluster = state.cluster.updated(
                changed, now_s=state.cluster.now_s, carry_exclusions=True
            )
            self._state = dataclasses.replace(state, cluster=cluster)

    def request_refresh(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Refreshes forever: `refresh_s` after the previous refresh began (so the view's
        age stays within one period plus one fetch), or sooner when asked."""
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            started_s = loop.time()
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - one bad snapshot must not end the refreshes
                self.refresh_failures += 1
                log.exception("view refresh failed unexpectedly; keeping the cached view")
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancellation
            # that stops this loop when the wake-up lands at the same moment.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(max(started_s + self.refresh_s, loop.time())):
                    await self._wake.wait()

    def _carry_vanished(self, snapshot: GossipSnapshot) -> tuple[NodeRecord, ...]:
        """The alive instances of the last view that this listing lost without a trace,
        each kept until one heartbeat TTL has passed since it vanished."""
        listed = {node.registration.instance_id for node in snapshot.nodes}
        now_s = snapshot.fetched_at_s
        vanished_at_s: dict[str, float] = {}
        carried = []
        for instance_id, record in self._alive.items():
            if instance_id in listed:
                continue
            vanished_at_s[instance_id] = self._vanished_at_s.get(instance_id, now_s)
            if now_s - vanished_at_s[instance_id] <= record.heartbeat_ttl_s:
                carried.append(record)
        newly = vanished_at_s.keys() - self._vanished_at_s.keys()
        if newly:
            log.warning(
                "%d alive instances vanished from gossip without a failure (the "
                "registry lost them?); kept, stale, for one heartbeat TTL: %s",
                len(newly),
                ", ".join(sorted(newly)),
            )
        self._vanished_at_s = vanished_at_s
        self._alive = {
            node.registration.instance_id: node
            for node in (*snapshot.nodes, *carried)
            if node.state == ALIVE
        }
        return tuple(carried)

    def _apply_changes(
        self, previous: DecisionState, snapshot: GossipSnapshot, corrections: Corrections
    ) -> tuple[ClusterView, tuple[str, ...]]:
        """The previous view with the changed instances rebuilt (work in proportion to
        the change), and the instances still carried after the registry lost them."""
        assert snapshot.changed is not None
        now_s = snapshot.fetched_at_s
        changed: dict[str, InstanceState] = {}
        for node in snapshot.changed:
            instance_id = node.registration.instance_id
            if not self.is_known(instance_id):
                self.inputs.topology.add_instance(_instance_spec(node.registration))
            self._records[instance_id] = (node, now_s - node.age_s)
            self._vanished_at_s.pop(instance_id, None)
            if node.state == ALIVE:
                self._alive[instance_id] = node
            else:
                self._alive.pop(instance_id, None)
        # Work this scheduler assigned moves W(x) without any change in gossip: those
        # instances (and those whose assignments just ran out) are re-read as well.
        assigned = set(self.assigned.instances()) if self.assigned is not None else set()
        for instance_id in {node.registration.instance_id for node in snapshot.changed} | (
            (assigned | self._pending_ids) & self._records.keys()
        ):
            node, reported_at_s = self._records[instance_id]
            changed[instance_id] = self._instance_state(node, corrections, now_s, reported_at_s)
        carried, dropped = [], []
        for instance_id in previous.carried_ids - changed.keys():
            record = self._alive.get(instance_id)
            vanished_at_s = self._vanished_at_s.get(instance_id, now_s)
            if record is not None and now_s - vanished_at_s <= record.heartbeat_ttl_s:
                carried.append(instance_id)
                continue
            dropped.append(instance_id)
            self._alive.pop(instance_id, None)
            self._vanished_at_s.pop(instance_id, None)
        cluster = previous.cluster.updated(changed, removed=dropped, now_s=now_s)
        return cluster, tuple(carried)

    def _build(self, snapshot: GossipSnapshot) -> DecisionState:
        corrections = self.corrections()
        previous = self._state
        if (
            snapshot.changed is not None
            and previous is not None
            and previous.telemetry_key[-1] == corrections.key()
        ):
            cluster, carried_ids = self._apply_changes(previous, snapshot, corrections)
        else:  # a full listing, or new corrections: every instance's W(x) is read again
            self._pending_ids = set()
            if snapshot.changed is None:
                self._records = {}
            else:
                for node in snapshot.changed:
                    self._records[node.registration.instance_id] = (
                        node,
                        snapshot.fetched_at_s - node.age_s,
                    )
            instances: dict[str, InstanceState] = {}
            carried = self._carry_vanished(snapshot)
            for node in (*snapshot.nodes, *carried):
                registration = node.registration
                if not self.is_known(registration.instance_id):
                    self.inputs.topology.add_instance(_instance_spec(registration))
                if registration.instance_id not in self._records:
                    reported_at_s = snapshot.fetched_at_s - node.age_s
                    self._records[registration.instance_id] = (node, reported_at_s)
                node, reported_at_s = self._records[registration.instance_id]
                instances[registration.instance_id] = self._instance_state(
                    node, corrections, snapshot.fetched_at_s, reported_at_s
                )
            cluster = ClusterView(instances=instances, now_s=snapshot.fetched_at_s)
            carried_ids = tuple(record.registration.instance_id for record in carried)
        key = (tuple(sorted(snapshot.flows.items())), corrections.key())
        network = self._network(previous, snapshot, key, corrections)
        if network is None:
            assert previous is not None
            cost = previous.cost
        else:
            cost = CostModel(
                self.inputs.model,
                corrections.compute_profile(self.inputs.compute),
                network,
                margins=corrections.margins(),
            )
        prepare_candidates(cluster, None if previous is None else previous.cluster)
        return DecisionState(
            cost=cost,
            cluster=cluster,
            refreshed_at_s=snapshot.fetched_at_s,
            links_used=len(snapshot.links) - len(self._unplaced),
            telemetry_key=key,
            carried_ids=frozenset(carried_ids),
        )

    def _network(
        self,
        previous: DecisionState | None,
        snapshot: GossipSnapshot,
        key: tuple,
        corrections: Corrections,
    ) -> NetworkModel | None:
        """The network model priced from the links' measurements and the flows in flight;
        None when the previous one still holds (no link, flow or correction changed).

        After a full link listing, or with new corrections, every link is priced again;
        otherwise a copy of the previous model takes the links this fetch changed, so a
        refresh costs in proportion to what was measured since the last one, not to the
        network. The paths decisions have measured are priced again either way: their
        fit is as recent as this refresh (see `_price`).
        """
        fitted = corrections.links
        # The model this refresh updates: the previous one, unless every link was listed
        # again or the corrections changed (then every link is priced anew).
        base = (
            previous
            if previous is not None
            and snapshot.changed_links is not None
            and previous.telemetry_key[-1] == key[-1]
            else None
        )
        if base is not None:
            assert snapshot.changed_links is not None
            records = self._placeable_since(snapshot.changed_links)
            if not records and base.telemetry_key == key:
                return None
            network = base.cost.network.copy()
        else:
            network = NetworkModel(self.inputs.topology, self.inputs.staleness)
            if previous is not None:
                network.carry_paths(previous.cost.network)
            records = self._placeable_all(snapshot.links)
        now_s = snapshot.fetched_at_s
        for record in records:
            pair = (record.sample.src_instance_id, record.sample.dst_instance_id)
            if pair not in fitted:
                network.set_link_estimate(*pair, _price(record, None, corrections, now_s))
        for pair, learned in fitted.items():
            if self._in_topology_pair(pair):
                probe = snapshot.links.get(pair)
                network.set_link_estimate(*pair, _price(probe, learned, corrections, now_s))
        if base is None:
            network.set_unmeasured_rtt(corrections.new_link_fixed_s)
        if base is None or base.telemetry_key[0] != key[0]:
            network.set_flows(self._link_flows(snapshot.flows))
        return network

    def _placeable_since(self, changed: tuple[LinkRecord, ...]) -> list[LinkRecord]:
        """The `changed` samples, and those held back whose instances have joined since,
        that have both ends in the topology; the others are held back. Held-back samples
        are looked at again only when the topology changed."""
        version = self.inputs.topology.version
        candidates = dict.fromkeys(self._unplaced if self._unplaced_at_version != version else ())
        self._unplaced_at_version = version
        for record in changed:
            pair = (record.sample.src_instance_id, record.sample.dst_instance_id)
            self._unplaced[pair] = record
            candidates[pair] = None
        return [self._unplaced.pop(pair) for pair in candidates if self._in_topology_pair(pair)]

    def _placeable_all(self, links: Mapping[tuple[str, str], LinkRecord]) -> list[LinkRecord]:
        """Every sample of a full listing that has both ends in the topology; the others
        are held back (see `_placeable_since`)."""
        self._unplaced = {}
        self._unplaced_at_version = self.inputs.topology.version
        placeable = []
        for pair, record in links.items():
            if self._in_topology_pair(pair):
                placeable.append(record)
            else:
                self._unplaced[pair] = record
        return placeable

    def _instance_state(
        self, node: NodeRecord, corrections: Corrections, now_s: float, reported_at_s: float
    ) -> InstanceState:
        """`reported_at_s`: when gossip received this record's report (local clock)."""
        registration, load = node.registration, node.load
        wait_s = load.queued_work_s + corrections.worker_wait_s.get(registration.instance_id, 0.0)
        if registration.role == Role.DECODE.value:
            wait_s += corrections.wait_per_decode_s * load.running_requests
        if self.assigned is not None:
            pending_s = self.assigned.pending_s(registration.instance_id, now_s, reported_at_s)
            if pending_s > 0.0:
                self._pending_ids.add(registration.instance_id)
            else:
                self._pending_ids.discard(registration.instance_id)
            wait_s += pending_s
        if registration.kv_capacity_blocks > 0:
            free_kv_tokens = load.free_kv_blocks * self.inputs.model.block_tokens
        else:
            free_kv_tokens = UNKNOWN_FREE_KV_TOKENS
        return InstanceState(
            instance_id=registration.instance_id,
            role=Role(registration.role),
            wait_s=wait_s,
            queue_depth=load.queue_depth,
            running_requests=load.running_requests,
            running_context_tokens=load.running_context_tokens,
            free_kv_tokens=free_kv_tokens,
            resident_blocks=frozenset(load.resident_prefix_hashes),
            age_s=node.age_s,
            address=registration.address,
            transfer_address=registration.transfer_address,
            alive=node.state == ALIVE,
            max_batch_tokens=registration.max_batch_tokens,
            # The worker times its passes against the base profile; decisions price with
            # it corrected by the outcomes (`corrections.compute_factor`).
            compute_factor=(
                load.compute_factor / corrections.compute_factor if load.compute_factor else 1.0
            ),
        )

    def _in_topology_pair(self, pair: tuple[str, str]) -> bool:
        return self._in_topology(pair[0]) and self._in_topology(pair[1])

    def _in_topology(self, instance_id: str) -> bool:
        try:
            self.inputs.topology.instance(instance_id)
        except NotFound:
            return False
        return True

    def _link_flows(self, pair_flows: Mapping[tuple[str, str], int]) -> dict[LinkId, int]:
        """Migrations in flight per instance pair, spread onto the links their paths cross."""
        flows: dict[LinkId, int] = {}
        topology = self.inputs.topology
        for (src_id, dst_id), count in pair_flows.items():
            if count <= 0 or not (self._in_topology(src_id) and self._in_topology(dst_id)):
                continue
            for link in topology.path_links(src_id, dst_id):
                flows[link] = flows.get(link, 0) + count
        return flows


def _price(
    record: LinkRecord | None, learned: LinkFit | None, corrections: Corrections, now_s: float
) -> LinkEstimate:
    """One path's estimate, from its probe `record` and what decisions measured on it.

    A measurement's time is the gossip store's clock (`measured_unix_ms`), the same clock
    for every replica, so an unchanged measurement keeps its age across refreshes. A path
    decisions have measured takes their fixed cost and rate instead of the probe's
    (probes move one size class; decisions move KV of every size, under the load the
    cluster really carries), as recent as the outcomes behind it (which age out on their
    own), however long ago the prober last got round to the pair — unless its probe
    says it is down. A path no decision has used yet is priced with at least the fixed
    cost the used ones show: its first transfer pays at least their set-up.
    """
    if learned is not None and (record is None or record.sample.bandwidth_bps > DOWN_LINK_BPS):
        return LinkEstimate(
            bandwidth_bps=learned.bandwidth_bps,
            rtt_s=learned.fixed_s,
            measured_at_s=now_s,
            samples=learned.samples if record is None else record.sample.samples,
        )
    assert record is not None
    sample = record.sample
    return LinkEstimate(
        bandwidth_bps=sample.bandwidth_bps,
        rtt_s=corrections.unmeasured_rtt_s(sample.rtt_s),
        measured_at_s=record.measured_unix_ms / 1000.0,
        samples=sample.samples,
    )


def _instance_spec(registration: Registration) -> InstanceSpec:
    """An instance the topology file does not list, placed where it says it runs."""
    return InstanceSpec(
        instance_id=registration.instance_id,
        role=Role(registration.role),
        location=Location(
            node=registration.node or registration.instance_id,
            rack=registration.rack,
            pod=registration.pod,
            gpu_index=registration.gpu_index,
        ),
    )
