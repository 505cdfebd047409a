"""ON/OFF background traffic on aggregation and spine links.

Each chosen link alternates exponentially distributed ON and OFF periods; while ON the
traffic takes `on_share` of the link's capacity. With a mean utilisation U the duty
cycle is U / on_share, and ON and OFF periods average `period_s · duty` and
`period_s · (1 − duty)` (about exp(1 s) each at duty 1/2, an assumption: see
docs/simulator.md). KV flows share what is left, max-min fairly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvrs.errors import InvalidArgument
from kvrs.sim.engine import EventLoop
from kvrs.sim.flownet import FlowNetwork
from kvrs.topology import LinkId

# Link kinds per tier name: the ToR-agg links are "pod" tier, the agg-spine links "spine".
BACKGROUND_LINK_KINDS = {
    "rack": ("node-up", "node-down"),
    "pod": ("rack-up", "rack-down"),
    "spine": ("pod-up", "pod-down"),
}


@dataclass(frozen=True)
class BackgroundSpec:
    """Cross traffic the topology does not know about."""

    utilisation: float = 0.0  # mean share of capacity taken, per link
    tiers: tuple[str, ...] = ("pod", "spine")
    on_share: float = 0.9  # share of capacity taken while ON
    period_s: float = 2.0  # mean ON + OFF cycle

    def __post_init__(self) -> None:
        if not 0.0 <= self.utilisation <= self.on_share <= 1.0:
            raise InvalidArgument("background", "need 0 <= utilisation <= on_share <= 1")
        for tier in self.tiers:
            if tier not in BACKGROUND_LINK_KINDS:
                raise InvalidArgument("background.tiers", f"unknown tier {tier!r}")
        if self.period_s <= 0:
            raise InvalidArgument("background.period_s", "must be > 0")


class BackgroundTraffic:
    """Drives ON/OFF load on a set of links of a flow network."""

    def __init__(
        self,
        spec: BackgroundSpec,
        loop: EventLoop,
        network: FlowNetwork,
        links: Iterable[LinkId],
        seed: int,
    ) -> None:
        self.spec = spec
        self.loop = loop
        self.network = network
        kinds = {kind for tier in spec.tiers for kind in BACKGROUND_LINK_KINDS[tier]}
        self.links = sorted((link for link in links if link[0] in kinds), key=str)
        self._rng = np.random.default_rng(seed)
        self.toggles = 0
        self.stopped = False

    def start(self) -> None:
        """Give every link a random initial phase and schedule its first switch."""
        if self.spec.utilisation <= 0 or not self.links:
            return
        duty = self.spec.utilisation / self.spec.on_share
        for link in self.links:
            on = bool(self._rng.random() < duty)
            self._set(link, on)

    def stop(self) -> None:
        """No more switches (the workload is over; lets the event loop drain)."""
        self.stopped = True

    def _set(self, link: LinkId, on: bool) -> None:
        if self.stopped:
            return
        spec = self.spec
        duty = spec.utilisation / spec.on_share
        capacity_bps = self.network.link(link).capacity_bps
        self.network.set_background(link, capacity_bps * spec.on_share if on else 0.0)
        mean_s = spec.period_s * (duty if on else 1.0 - duty)
        if mean_s <= 0:
            return  # duty 1: always ON
        self.toggles += 1
        self.loop.after(float(self._rng.exponential(mean_s)), self._set, link, not on)
