"""Flow-level network: KV transfers share links max-min fairly (progressive filling).

Each transfer is a flow over the directional links of its topology path. Rates are the
max-min fair allocation of every link's capacity left over by background traffic.
A flow starting or ending only changes rates inside its connected component (flows
linked through shared links), so only that component is re-filled; the rest keep their
rates and their already scheduled completion events.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from typing import Any

from kvrs.sim.engine import EventLoop
from kvrs.topology import LinkId
from kvrs.units import BITS_PER_BYTE

# Bits left below which a flow counts as finished (float round-off of rate x time).
_DONE_BITS = 1e-3


class Link:
    """One directional link: capacity, background load, the flows crossing it."""

    __slots__ = ("link_id", "capacity_bps", "background_bps", "flows")

    def __init__(self, link_id: LinkId, capacity_bps: float) -> None:
        self.link_id = link_id
        self.capacity_bps = capacity_bps
        self.background_bps = 0.0
        self.flows: set[Flow] = set()

    @property
    def free_bps(self) -> float:
        """Capacity left after background traffic."""
        return max(0.0, self.capacity_bps - self.background_bps)

    @property
    def kv_rate_bps(self) -> float:
        return sum(flow.rate_bps for flow in self.flows)


class Flow:
    """A KV transfer in flight; `remaining_bits` is exact as of `updated_s`."""

    __slots__ = (
        "flow_id",
        "links",
        "total_bits",
        "remaining_bits",
        "rate_bps",
        "updated_s",
        "on_done",
        "handle",
        "tag",
        "joined_s",
        "active",
    )

    def __init__(
        self,
        flow_id: int,
        links: tuple[Link, ...],
        bits: float,
        on_done: Callable[[Flow], Any] | None,
        tag: Any,
    ) -> None:
        self.flow_id = flow_id
        self.links = links
        self.total_bits = bits
        self.remaining_bits = bits
        self.rate_bps = 0.0
        self.updated_s = 0.0
        self.on_done = on_done
        self.handle = 0
        self.tag = tag
        self.joined_s = math.nan
        """When it joined its links, its set-up done (nan until then)."""
        self.active = False

    def __hash__(self) -> int:
        return self.flow_id

    def __lt__(self, other: Flow) -> bool:
        return self.flow_id < other.flow_id


class FlowNetwork:
    """Links and the flows on them, with max-min fair rates kept current on the loop."""

    def __init__(self, loop: EventLoop, capacity_of: Callable[[LinkId], float]) -> None:
        self.loop = loop
        self._capacity_of = capacity_of
        self.links: dict[LinkId, Link] = {}
        self._next_id = 0
        self.flows_started = 0
        self.flows_finished = 0
        self.refills = 0
        self.refilled_flows = 0
        # Flows launched and not yet finished, per link, setup phase included: what the
        # control plane that started them knows. `counts_version` changes with them.
        self.launched: dict[LinkId, int] = {}
        self.counts_version = 0

    def link(self, link_id: LinkId) -> Link:
        """The link named `link_id`, created on first use with the topology's capacity."""
        found = self.links.get(link_id)
        if found is None:
            found = self.links[link_id] = Link(link_id, float(self._capacity_of(link_id)))
        return found

    def start(
        self,
        link_ids: Iterable[LinkId],
        kv_bytes: float,
        on_done: Callable[[Flow], Any] | None = None,
        setup_s: float = 0.0,
        tag: Any = None,
    ) -> Flow:
        """Send `kv_bytes` over the path; `on_done(flow)` runs when the last bit arrives.

        The flow joins the links after `setup_s` (connection setup and hop latency), so
        an unloaded path takes `setup_s + 8 * kv_bytes / bottleneck` seconds.
        """
        links = tuple(dict.fromkeys(self.link(link_id) for link_id in link_ids))
        self._next_id += 1
        flow = Flow(self._next_id, links, float(kv_bytes) * BITS_PER_BYTE, on_done, tag)
        self.flows_started += 1
        self._count(flow, 1)
        if setup_s > 0:
            flow.handle = self.loop.after(setup_s, self._activate, flow)
        else:
            self._activate(flow)
        return flow

    def abort(self, flow: Flow) -> None:
        """Drop a flow (its endpoint failed); `on_done` never runs."""
        if flow.on_done is None and not flow.active and not flow.handle:
            return  # already finished or aborted
        self.loop.cancel(flow.handle)
        flow.handle = 0
        if flow.active:
            self._detach(flow)
        flow.on_done = None
        self._count(flow, -1)

    def set_background(self, link_id: LinkId, background_bps: float) -> None:
        """Set the background (non-KV) load on a link; KV flows on it are re-shared."""
        link = self.link(link_id)
        link.background_bps = min(max(0.0, background_bps), link.capacity_bps)
        if link.flows:
            self._refill((link,))

    def flow_counts(self) -> dict[LinkId, int]:
        """KV flows now on each link (links with none are left out)."""
        return {link.link_id: len(link.flows) for link in self.links.values() if link.flows}

    def utilisation(self, link_id: LinkId) -> float:
        """(background + KV) load over capacity, now."""
        link = self.link(link_id)
        if link.capacity_bps <= 0:
            return 1.0
        return min(1.0, (link.background_bps + link.kv_rate_bps) / link.capacity_bps)

    @property
    def active_flows(self) -> int:
        return sum(1 for _ in self._all_flows())

    def _all_flows(self) -> set[Flow]:
        found: set[Flow] = set()
        for link in self.links.values():
            found.update(link.flows)
        return found

    def _activate(self, flow: Flow) -> None:
        flow.handle = 0
        flow.active = True
        flow.updated_s = flow.joined_s = self.loop.now_s
        if flow.remaining_bits <= _DONE_BITS:
            self._finish(flow)
            return
        for link in flow.links:
            link.flows.add(flow)
        self._refill(flow.links)

    def _detach(self, flow: Flow) -> None:
        flow.active = False
        self._advance(flow, self.loop.now_s)
        for link in flow.links:
            link.flows.discard(flow)
        self._refill(flow.links)

    def _complete(self, flow: Flow) -> None:
        flow.handle = 0
        self._detach(flow)
        self._finish(flow)

    def _count(self, flow: Flow, delta: int) -> None:
        launched = self.launched
        for link in flow.links:
            count = launched.get(link.link_id, 0) + delta
            if count:
                launched[link.link_id] = count
            else:
                del launched[link.link_id]
        self.counts_version += 1

    def _finish(self, flow: Flow) -> None:
        flow.remaining_bits = 0.0
        flow.rate_bps = 0.0
        self.flows_finished += 1
        self._count(flow, -1)
        done, flow.on_done = flow.on_done, None
        if done is not None:
            done(flow)

    @staticmethod
    def _advance(flow: Flow, now_s: float) -> None:
        if flow.rate_bps > 0 and now_s > flow.updated_s:
            sent_bits = flow.rate_bps * (now_s - flow.updated_s)
            flow.remaining_bits = max(0.0, flow.remaining_bits - sent_bits)
        flow.updated_s = now_s

    def _component(self, seeds: Iterable[Link]) -> tuple[list[Link], list[Flow]]:
        """The links and flows connected to `seeds`, links in the order they were reached.

        That order breaks ties between equal shares in `_refill`, so it must not depend
        on where links sit in memory (a set of links iterates by address).
        """
        links_seen: dict[Link, None] = {}
        flows_seen: set[Flow] = set()
        stack = [link for link in seeds if link.flows]
        while stack:
            link = stack.pop()
            if link in links_seen:
                continue
            links_seen[link] = None
            for flow in link.flows:
                if flow not in flows_seen:
                    flows_seen.add(flow)
                    stack.extend(flow.links)
        return list(links_seen), sorted(flows_seen)

    def _refill(self, seeds: Iterable[Link]) -> None:
        """Max-min fair rates for the component around `seeds`, by progressive filling."""
        links, flows = self._component(seeds)
        if not flows:
            return
        now_s = self.loop.now_s
        self.refills += 1
        self.refilled_flows += len(flows)
        for flow in flows:
            self._advance(flow, now_s)
        residual = {link: link.free_bps for link in links}
        unfrozen = {link: len(link.flows) for link in links}
        heap = [
            (residual[link] / unfrozen[link], id_order, link) for id_order, link in enumerate(links)
        ]
        order = {link: i for i, link in enumerate(links)}
        heapq.heapify(heap)
        new_rate: dict[Flow, float] = {}
        while heap and len(new_rate) < len(flows):
            share, _, link = heapq.heappop(heap)
            count = unfrozen[link]
            if count == 0 or abs(share - residual[link] / count) > 1e-9 * max(1.0, share):
                continue
            share = max(0.0, share)
            for flow in link.flows:
                if flow in new_rate:
                    continue
                new_rate[flow] = share
                for other in flow.links:
                    residual[other] = max(0.0, residual[other] - share)
                    unfrozen[other] -= 1
                    if other is not link and unfrozen[other] > 0:
                        heapq.heappush(
                            heap, (residual[other] / unfrozen[other], order[other], other)
                        )
            unfrozen[link] = 0
        for flow in flows:
            rate = new_rate.get(flow, 0.0)
            if rate == flow.rate_bps and flow.handle:
                continue
            flow.rate_bps = rate
            self.loop.cancel(flow.handle)
            flow.handle = 0
            if flow.remaining_bits <= _DONE_BITS:
                flow.handle = self.loop.at(now_s, self._complete, flow)
            elif rate > 0:
                flow.handle = self.loop.at(now_s + flow.remaining_bits / rate, self._complete, flow)
