"""Every path between two instance lists as arrays, to price many pairs under planned flows.

A batch plan adds flows after every decision, so the cached per-path shares go stale at
once and pricing every (prefill, decode) pair one by one costs a microsecond each. The
matrix keeps, per pair, the indices of the links it crosses; the share of every link
under the plan's flows is one vector, and the bottleneck of every pair one gather-min.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvrs._columns import refuse_edits
from kvrs.network import NetworkModel
from kvrs.topology import LinkId

_NO_LINK = 0  # index of a padding link of infinite capacity


class FlowPlan(dict[LinkId, int]):
    """Flows a plan has committed per link: a mapping, plus a log that matrices replay.

    Grow it only with `add_path`; the other mutators raise, because matrices follow the
    log, not the dictionary.
    """

    def __init__(self) -> None:
        super().__init__()
        self._log: list[LinkId] = []
        self._vectors: dict[int, tuple[PathMatrix, np.ndarray, int]] = {}

    def add_path(self, links: Iterable[LinkId]) -> None:
        """One more flow on every link of a path."""
        for link in links:
            dict.__setitem__(self, link, self.get(link, 0) + 1)
            self._log.append(link)

    def vector_for(self, matrix: PathMatrix) -> np.ndarray:
        """Flows on the matrix's links, in its link order (kept up to date incrementally)."""
        entry = self._vectors.get(id(matrix))
        if entry is None or entry[0] is not matrix:
            entry = (matrix, np.zeros(len(matrix.capacity_bps)), 0)
        _, vector, seen = entry
        index = matrix.link_index
        for link in self._log[seen:]:
            i = index.get(link)
            if i is not None:
                vector[i] += 1
        self._vectors[id(matrix)] = (matrix, vector, len(self._log))
        return vector


refuse_edits(FlowPlan, "add_path")


class PathMatrix:
    """Paths from every source to every destination, as link-index arrays.

    `measured_at` holds the flat (source-major) indices of the pairs with a fresh
    measurement; `measured_incidence` and `measured_bps` follow the same order.
    """

    __slots__ = (
        "network",
        "src_ids",
        "dst_ids",
        "link_index",
        "capacity_bps",
        "known_flows",
        "incidence",
        "rtt_s",
        "measured_at",
        "measured_incidence",
        "measured_bps",
        "version",
        "lo_s",
        "hi_s",
    )

    def __init__(
        self, network: NetworkModel, src_ids: Sequence[str], dst_ids: Sequence[str], now_s: float
    ) -> None:
        self.network = network
        self.src_ids = tuple(src_ids)
        self.dst_ids = tuple(dst_ids)
        self.version = network.version
        self.link_index: dict[LinkId, int] = {}
        capacity: list[float] = [math.inf]
        known: list[float] = [0.0]
        terms = [[network.path_terms(s, d, now_s) for d in dst_ids] for s in src_ids]
        longest = max((len(t.links) for row in terms for t in row), default=0)
        # Hop-major (hop, source, destination): reducing over the first axis is a few
        # element-wise minima of whole planes, far faster than over a short last axis.
        incidence = np.full((max(1, longest), len(src_ids), len(dst_ids)), _NO_LINK, dtype=np.intp)
        for i, row in enumerate(terms):
            for j, path in enumerate(row):
                for k, (link, cap, flows) in enumerate(
                    zip(path.links, path.caps, path.known, strict=True)
                ):
                    index = self.link_index.get(link)
                    if index is None:
                        index = self.link_index[link] = len(capacity)
                        capacity.append(cap)
                        known.append(flows)
                    incidence[k, i, j] = index
        self.incidence = incidence
        self.capacity_bps = np.array(capacity)
        self.known_flows = np.array(known)
        self.rtt_s = np.array([[t.rtt_s for t in row] for row in terms]).reshape(
            len(src_ids), len(dst_ids)
        )
        # The few pairs with a fresh measurement, kept apart: their base is the measurement.
        measured = np.array([[t.measured_bps for t in row] for row in terms]).reshape(
            len(src_ids), len(dst_ids)
        )
        measured_at = np.nonzero(measured)
        self.measured_at = np.ravel_multi_index(measured_at, measured.shape)
        self.measured_incidence = incidence[:, measured_at[0], measured_at[1]]
        self.measured_bps = measured[measured_at]
        self.lo_s = max((t.lo_s for row in terms for t in row), default=-math.inf)
        self.hi_s = min((t.hi_s for row in terms for t in row), default=math.inf)

    def valid(self, network: NetworkModel, now_s: float) -> bool:
        """True while the matrix still says what `network` would say at `now_s`."""
        return (
            network is self.network
            and self.version == network.version
            and self.lo_s < now_s <= self.hi_s
        )

    def bandwidth_bps(self, extra_flows: Mapping[LinkId, int] | None) -> np.ndarray:
        """B_eff of every (source, destination) pair with `extra_flows` added."""
        flows = self.known_flows
        if isinstance(extra_flows, FlowPlan):
            flows = flows + extra_flows.vector_for(self)
        elif extra_flows:
            flows = flows.copy()
            for link, count in extra_flows.items():
                i = self.link_index.get(link)
                if i is not None:
                    flows[i] += count
        # take, ufunc.reduce and put: the same values as fancy indexing, min and a masked
        # store, at a fraction of the call overhead that dominates arrays this small.
        flows_plus_one = flows + 1.0
        bps = np.minimum.reduce((self.capacity_bps / flows_plus_one).take(self.incidence), axis=0)
        if len(self.measured_bps):
            # max(flows) + 1 == max(flows + 1): rounding is monotone.
            busiest = np.maximum.reduce(flows_plus_one.take(self.measured_incidence), axis=0)
            bps.put(self.measured_at, self.measured_bps / busiest)
        return bps
