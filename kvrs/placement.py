"""Where to decode: score the decode candidates of a prefilled request and pick one.

netkv, the network-aware policy, minimises the predicted time to first token,

    T_x(p, d, S(L − hit_d)) + W(d)

over candidates d with enough free KV memory, breaking ties by lower tier, then fewer
running requests, then instance id. When the KV streams while the prompt prefills
(layer-wise streaming, `PlacementRequest.stream_prefill_s`), only what the prefill
leaves of the transfer counts: T_x becomes `kvrs.costmodel.streamed_tail_s(T_x, T_pf,
layers, rtt)` (the set-up hidden under the prefill, then all but the last layer), so a
slower path costs little until its transfer outlasts the prefill. The
baselines (round_robin, least_loaded and the network-blind cache_load) choose
differently but report the same netkv terms for what they chose, so traces of every
policy are comparable.

Decisions sit on the request path, so scoring is columnar: per candidate list (the
`InstanceList` a `ClusterView` hands out) the waits and free memory are read once, per
(list, prefill instance) the path bandwidths and RTTs once, and a decision is then a
few passes over flat lists — numpy arrays from `NUMPY_MIN_CANDIDATES` candidates on.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from kvrs._columns import Columns as _Columns
from kvrs._columns import Fan as _Fan
from kvrs._frozen import build
from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel, Seconds, prefix_hit_tokens, streamed_tail_s
from kvrs.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvrs.network import TransferEstimate
from kvrs.topology import Tier

__all__ = [
    "NUMPY_MIN_CANDIDATES",
    "PLACEMENT_POLICY_NAMES",
    "CacheLoad",
    "CandidateScore",
    "Kvrs",
    "LeastLoaded",
    "NetKv",
    "JointPlacementPolicy",
    "as_joint",
    "Placement",
    "PlacementPolicy",
    "PlacementRequest",
    "RoundRobin",
    "chooses_prefill",
    "make_placement_policy",
    "prepare_candidates",
    "score_candidates",
]

NUMPY_MIN_CANDIDATES = 32
"""From this many candidates on, scores are computed with numpy instead of list passes."""
HIT_ARRAY_MIN_CANDIDATES = 512
"""From this many candidates on, prefix hits are found with boolean arrays, not sets."""

_INF = math.inf
_UNREPORTED_FREE_KV_TOKENS = 2**61
"""Free KV memory from here up is an instance that does not report it (InstanceState's
default is 2**62): it is never counted as the emptiest or as loaded."""


@dataclass(frozen=True)
class PlacementRequest:
    """A request whose prompt `prefill_id` has prefilled and that now needs a decode instance."""

    request_id: str
    prefill_id: str
    prompt_tokens: int
    prefix_hashes: tuple[int, ...] = ()
    """Hashes of the prompt's prefix blocks, in order (for prefix-cache hits)."""
    stream_prefill_s: float = 0.0
    """The prefill its KV streams under, layer by layer (layer-wise streaming); 0: the KV
    moves once the prefill has ended."""

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise InvalidArgument("prompt_tokens", f"must be >= 0, got {self.prompt_tokens}")
        if not self.stream_prefill_s >= 0.0:
            raise InvalidArgument("stream_prefill_s", f"must be >= 0, got {self.stream_prefill_s}")
        if not self.prefill_id:
            raise InvalidArgument("prefill_id", "must not be empty")


@dataclass(frozen=True)
class CandidateScore:
    """One candidate's netkv terms: score_s = transfer_s + wait_s (the predicted TTFT)."""

    instance_id: str
    score_s: float
    transfer_s: float
    wait_s: float
    prefix_hit_tokens: int
    tier: Tier


@dataclass(frozen=True)
class Placement:
    """The chosen decode instance and the netkv prediction for it."""

    instance_id: str
    predicted_ttft_s: float
    transfer: TransferEstimate
    wait_s: float
    prefix_hit_tokens: int
    kv_bytes: int
    """Bytes that must cross the network: the prompt's KV minus the resident prefix."""
    policy: str
    runner_up: CandidateScore | None
    """The candidate the policy ranked second (None when it ranks nothing, or alone)."""
    candidates_considered: int
    streamed: bool = False
    """The transfer streams under the prefill: predicted_ttft_s counts only its tail."""


class PlacementPolicy(Protocol):
    """Chooses a decode instance among candidates."""

    name: str

    def select(
        self,
        request: PlacementRequest,
        candidates: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
    ) -> Placement: ...


class JointPlacementPolicy(PlacementPolicy, Protocol):
    """A placement policy that also chooses the prefill instance, given each prefill
    option's finish (`Kvrs.choose_prefill`): its caller asks before the prompt prefills.
    The router tells one by its name (`chooses_prefill`), the scheduler and the simulator
    by the object (`as_joint`): both by its `choose_prefill` method."""

    def choose_prefill(
        self,
        request: PlacementRequest,
        prefill_s: Sequence[tuple[str, float]],
        routed: int,
        decodes: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
        prefix_hits: Sequence[int] = (),
    ) -> int: ...


# -- scoring --------------------------------------------------------------------------


def _netkv_scores(
    columns: _Columns,
    fan: _Fan,
    hits: dict[int, int] | np.ndarray | None,
    prompt_tokens: int,
    cost: CostModel,
) -> list[float] | np.ndarray:
    """T_x + W of every candidate; infinity where the KV does not fit.

    `hits` maps index → prefix-hit tokens (a dict, or an array for the largest sets).
    """
    bits_per_token = cost.kv_bits_per_token
    bits = bits_per_token * prompt_tokens
    if len(columns.ids) < NUMPY_MIN_CANDIDATES:
        assert not isinstance(hits, np.ndarray), "hit arrays are built for large sets only"
        hit_map = hits or {}
        if prompt_tokens == 0:
            scores = list(columns.wait)
        else:
            scores = [a + bits * b for a, b in zip(fan.rtt_wait, fan.inv_bps, strict=True)]
        for i, hit in hit_map.items():
            need = prompt_tokens - hit
            scores[i] = columns.wait[i] + (
                fan.rtt[i] + bits_per_token * need * fan.inv_bps[i] if need else 0.0
            )
        if columns.min_free < prompt_tokens:
            for i, free_tokens in enumerate(columns.free):
                if free_tokens < prompt_tokens - hit_map.get(i, 0):
                    scores[i] = _INF
        return scores
    wait, free = columns.arrays()
    rtt, inv_bps, rtt_wait = fan.arrays()
    array: np.ndarray
    if not isinstance(hits, np.ndarray) and not hits:
        array = rtt_wait + bits * inv_bps if prompt_tokens else wait.copy()
        if columns.min_free < prompt_tokens:
            array[free < prompt_tokens] = _INF
        return array
    if isinstance(hits, np.ndarray):
        needs = prompt_tokens - hits
        array = np.where(needs > 0, rtt + (bits_per_token * needs) * inv_bps, 0.0)
        array += wait
        if columns.min_free < prompt_tokens:
            array[free < needs] = _INF
        return array
    array = rtt_wait + bits * inv_bps
    index = np.fromiter(hits, dtype=np.intp, count=len(hits))
    needs = prompt_tokens - np.fromiter(hits.values(), dtype=np.float64, count=len(hits))
    array[index] = wait[index] + np.where(
        needs > 0, rtt[index] + (bits_per_token * needs) * inv_bps[index], 0.0
    )
    if columns.min_free < prompt_tokens:
        need_all = np.full(len(columns.ids), float(prompt_tokens))
        need_all[index] = needs
        array[free < need_all] = _INF
    return array


def _two_best(
    scores: list[float] | np.ndarray,
    tie_key: Callable[[int], Any],
) -> tuple[int, int | None]:
    """Indices of the lowest and second-lowest finite scores, ties broken by `tie_key`.

    `scores` is scratch: it is modified (and restored only when it is a list).
    """
    if isinstance(scores, np.ndarray):
        best = int(scores.argmin())
        low = scores[best]
        if low == _INF:
            return -1, None
        scores[best] = _INF
        second = int(scores.argmin())
        low2 = scores[second]
        if low2 == _INF:
            return best, None
        if low2 == low:
            ordered = sorted([best, *np.flatnonzero(scores == low).tolist()], key=tie_key)
            return ordered[0], ordered[1]
        if np.count_nonzero(scores == low2) > 1:
            second = min(np.flatnonzero(scores == low2).tolist(), key=tie_key)
        return best, second
    low = min(scores)
    if low == _INF:
        return -1, None
    if scores.count(low) > 1:
        ordered = sorted((i for i, s in enumerate(scores) if s == low), key=tie_key)
        return ordered[0], ordered[1]
    best = scores.index(low)
    scores[best] = _INF
    low2 = min(scores)
    if low2 == _INF:
        runner: int | None = None
    elif scores.count(low2) == 1:
        runner = scores.index(low2)
    else:
        runner = min((i for i, s in enumerate(scores) if s == low2), key=tie_key)
    scores[best] = low
    return best, runner


class _Decision:
    """What every policy needs for one request: columns, path terms, prefix hits."""

    __slots__ = ("request", "candidates", "cost", "now_s", "columns", "fan", "hits")

    def __init__(
        self,
        request: PlacementRequest,
        candidates: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
    ) -> None:
        if not candidates:
            raise FailedPrecondition("no decode candidates", field="candidates")
        self.request = request
        self.candidates = candidates
        self.cost = cost
        self.now_s = now_s
        self.columns = _Columns.of(candidates)
        self.fan = self.columns.fan(cost.network, request.prefill_id, now_s)
        block_tokens = cost.model.block_tokens
        self.hits: dict[int, int] | np.ndarray | None
        if len(self.columns.ids) >= HIT_ARRAY_MIN_CANDIDATES:
            self.hits = self.columns.hit_array(
                request.prefix_hashes, request.prompt_tokens, block_tokens
            )
        else:
            self.hits = self.columns.hits(
                request.prefix_hashes, request.prompt_tokens, block_tokens
            )

    def hit(self, i: int) -> int:
        """Prefix-hit tokens of candidate `i`."""
        hits = self.hits
        if hits is None:
            return 0
        if isinstance(hits, dict):
            return hits.get(i, 0)
        return int(hits[i])

    def hit_items(self) -> list[tuple[int, int]]:
        """(index, tokens) of every candidate with a prefix hit."""
        hits = self.hits
        if hits is None:
            return []
        if isinstance(hits, dict):
            return list(hits.items())
        return [(int(i), int(hits[i])) for i in np.flatnonzero(hits)]

    def netkv_scores(self) -> list[float] | np.ndarray:
        scores = _netkv_scores(
            self.columns, self.fan, self.hits, self.request.prompt_tokens, self.cost
        )
        if not self.request.stream_prefill_s:
            return scores
        if isinstance(scores, np.ndarray):
            wait = self.columns.arrays()[0]
            return self.streamed(scores - wait, self.fan.arrays()[0]) + wait
        return [
            s if s == _INF else w + self.streamed(s - w, r)
            for s, w, r in zip(scores, self.columns.wait, self.fan.rtt, strict=True)
        ]

    def streamed(self, transfer_s: Seconds, fixed_s: float | np.ndarray = 0.0) -> Seconds:
        """What transfers of `transfer_s` (of which `fixed_s` is their set-up and latency)
        add once the prefill has ended: all of it, or their tail when they stream under
        the prefill (elementwise on arrays)."""
        prefill_s = self.request.stream_prefill_s
        if not prefill_s:
            return transfer_s
        return streamed_tail_s(transfer_s, prefill_s, self.cost.model.layers, fixed_s)

    def fits(self, i: int) -> bool:
        return self.columns.free[i] >= self.request.prompt_tokens - self.hit(i)

    def tier_key(self, i: int) -> tuple[Tier, int, str]:
        return self.fan.table.tiers[i], self.columns.running[i], self.columns.ids[i]

    def load_key(self, i: int) -> tuple[int, str]:
        return self.columns.running[i], self.columns.ids[i]

    def exhausted(self) -> ResourceExhausted:
        return ResourceExhausted(
            f"no decode candidate has {self.request.prompt_tokens} tokens of free KV memory "
            f"({len(self.candidates)} considered)",
            field="free_kv_tokens",
        )

    def score(self, i: int) -> CandidateScore:
        """The netkv terms of candidate `i`."""
        hit = self.hit(i)
        need = self.request.prompt_tokens - hit
        fan = self.fan
        transfer_s = (
            fan.rtt[i] + self.cost.kv_bits_per_token * need * fan.inv_bps[i] if need else 0.0
        )
        transfer_s = self.streamed(transfer_s, fan.rtt[i])
        wait_s = self.columns.wait[i]
        return build(
            CandidateScore,
            instance_id=self.columns.ids[i],
            score_s=transfer_s + wait_s,
            transfer_s=transfer_s,
            wait_s=wait_s,
            prefix_hit_tokens=hit,
            tier=fan.table.tiers[i],
        )

    def placement(
        self, policy: str, best: int, runner: int | None, transfer_s: float | None = None
    ) -> Placement:
        """The placement on candidate `best`; `transfer_s` replaces netkv's prediction of
        what the transfer adds (T_x, or its tail when it streams)."""
        request, columns = self.request, self.columns
        hit = self.hit(best)
        kv_bytes = (request.prompt_tokens - hit) * self.cost.kv_bytes_per_token
        transfer = self.cost.network.transfer(
            request.prefill_id, columns.ids[best], kv_bytes, self.now_s
        )
        if transfer_s is None:
            transfer_s = self.streamed(transfer.transfer_s, transfer.rtt_s) if kv_bytes else 0.0
        wait_s = columns.wait[best]
        return build(
            Placement,
            instance_id=columns.ids[best],
            predicted_ttft_s=transfer_s + wait_s,
            transfer=transfer,
            wait_s=wait_s,
            prefix_hit_tokens=hit,
            kv_bytes=kv_bytes,
            policy=policy,
            runner_up=None if runner is None else self.score(runner),
            candidates_considered=len(columns.ids),
            streamed=bool(request.stream_prefill_s),
        )


# -- policies -------------------------------------------------------------------------


class NetKv:
    """Minimum predicted TTFT: KV transfer over the real path plus the candidate's queue."""

    name = "netkv"

    def select(
        self,
        request: PlacementRequest,
        candidates: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
    ) -> Placement:
        decision = _Decision(request, candidates, cost, now_s)
        best, runner = _two_best(decision.netkv_scores(), decision.tier_key)
        if best < 0:
            raise decision.exhausted()
        return decision.placement(self.name, best, runner)


class Kvrs:
    """Prefill and decode chosen for the lowest expected TTFT with what the control plane
    knows for sure, without piling KV onto a few decode instances.

    Transfer: `NetworkModel.expected_inverse_bps` when the model has link samples —
    nominal capacities shared with the flows the control plane counts itself, plus what
    each link's trend expects uncounted traffic to add over the transfer, the last sample
    weighted by its age against how fast that link has been changing and the link's mean
    standing in for it otherwise (`kvrs.estimator.LinkTrend`). Without link samples (path
    probes only) it is netkv's T_x.

    Decode load: a decode step takes longer the more KV its batch holds, so the tokens of
    an instance holding much more KV than the others all come slower. The load term is
    bounded: nothing within `kv_band_tokens` (16k) of the candidates' mean KV, then
    `kv_penalty_s_per_token` (10 µs) for each token beyond, steep enough to act as a
    bound. At 3.8e-8 s per token per decode step (the 70B profile), 16k tokens are 0.6 ms
    a step; a hard cap relative to the emptiest candidate, and a gentle penalty from it,
    both lost TTFT where keeping KV local matters (docs/results.md §1b).

    Without any measurement (no link sample, no path estimate) the policy cannot see what
    crossing a higher tier costs, so it trades locality neither for load nor for its own
    flows: the tier capacities alone price the transfer, as netkv_tiers does. Spreading
    load across the spine on that prior lost up to 10 % where the spine carried traffic
    nobody measured (docs/results.md §1b).

    Herding: the KV of the placements this policy made in the last `view_lag_s` (the
    instance state's refresh period) is not in the view yet, so it counts them itself.

    Prefill: `choose_prefill` picks the prefill with the decode side's paths in view (not
    its queues, which will have changed by the time the prefill ends), and for a prompt
    that continues a cached prefix the decode instances' KV too; it leaves the prefill
    router's choice only when that gains more than `joint_margin` of the predicted TTFT.
    """

    name = "kvrs"

    def __init__(
        self,
        kv_penalty_s_per_token: float = 1e-5,
        view_lag_s: float = 0.1,
        joint_margin: float = 0.2,
        kv_band_tokens: int = 16_384,
    ) -> None:
        if kv_penalty_s_per_token < 0:
            raise InvalidArgument(
                "kv_penalty_s_per_token", f"must be >= 0, got {kv_penalty_s_per_token}"
            )
        if view_lag_s < 0:
            raise InvalidArgument("view_lag_s", f"must be >= 0, got {view_lag_s}")
        if kv_band_tokens < 0:
            raise InvalidArgument("kv_band_tokens", f"must be >= 0, got {kv_band_tokens}")
        if not 0.0 <= joint_margin < 1.0:
            raise InvalidArgument("joint_margin", f"must be in [0, 1), got {joint_margin}")
        self.kv_penalty_s_per_token = kv_penalty_s_per_token
        self.kv_band_tokens = kv_band_tokens
        self.view_lag_s = view_lag_s
        self.joint_margin = joint_margin
        self._recent: list[tuple[float, str, int]] = []  # (placed at, instance, KV tokens)

    def _pending(self, now_s: float) -> dict[str, int]:
        """KV tokens placed per instance in the last `view_lag_s`."""
        cutoff = now_s - self.view_lag_s
        self._recent = [entry for entry in self._recent if entry[0] > cutoff]
        pending: dict[str, int] = {}
        for _, instance_id, tokens in self._recent:
            pending[instance_id] = pending.get(instance_id, 0) + tokens
        return pending

    def _scores(
        self,
        request: PlacementRequest,
        candidates: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
    ) -> tuple[_Decision, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(decision, scores, predicted T_x (its tail when streamed), the decode-load
        term, KV tokens to move) per candidate."""
        decision = _Decision(request, candidates, cost, now_s)
        columns, fan, network = decision.columns, decision.fan, cost.network
        n = len(columns.ids)
        need = np.full(n, float(request.prompt_tokens))
        for i, hit in decision.hit_items():
            need[i] -= hit
        bits = cost.kv_bits_per_token * need
        rtt = np.array(fan.rtt)
        measured = network.has_measurements
        if not measured:
            inv_bps = network.expected_inverse_bps(
                request.prefill_id, columns.ids, now_s, count_flows=False
            )
        elif network.has_link_trends:
            base = network.expected_inverse_bps(request.prefill_id, columns.ids, now_s)
            horizon_s = float((rtt + bits * base).min())
            inv_bps = network.expected_inverse_bps(
                request.prefill_id, columns.ids, now_s, horizon_s
            )
        else:
            inv_bps = np.array(fan.inv_bps)
        transfer = decision.streamed(np.where(need > 0, rtt + bits * inv_bps, 0.0), rtt)
        wait, free = columns.arrays()
        pending = self._pending(now_s)
        if pending:
            free = free - np.array([pending.get(i, 0) for i in columns.ids], dtype=np.float64)
        load = np.zeros(n)
        known = free < _UNREPORTED_FREE_KV_TOKENS
        if measured and self.kv_penalty_s_per_token and known.any():
            floor = free[known].mean() - self.kv_band_tokens
            excess = np.where(known, np.maximum(0.0, floor - free), 0.0)
            load = self.kv_penalty_s_per_token * excess
        scores = transfer + wait + load
        scores[free < need] = _INF
        return decision, scores, transfer, load, need

    def select(
        self,
        request: PlacementRequest,
        candidates: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
    ) -> Placement:
        decision, scores, transfer, _, need = self._scores(request, candidates, cost, now_s)
        best, runner = _two_best(scores, decision.tier_key)
        if best < 0:
            raise decision.exhausted()
        self._recent.append((now_s, decision.columns.ids[best], int(need[best])))
        return decision.placement(self.name, best, runner, float(transfer[best]))

    def choose_prefill(
        self,
        request: PlacementRequest,
        prefill_s: Sequence[tuple[str, float]],
        routed: int,
        decodes: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
        prefix_hits: Sequence[int] = (),
    ) -> int:
        """Prefill and decode chosen together: the index in `prefill_s` ((prefill id,
        seconds until its prefill would end) pairs, `kvrs.prefill.prefill_finishes`)
        minimising prefill end + the cheapest transfer from there to a decode candidate
        with room.

        The decode side's paths count, not its queues: the decode instance is
        chosen when the prefill ends, a prefill's duration ahead, and by then the queues
        seen now have moved (weighing them sent prefills after decode instances that
        were busy again when their KV was ready: +9 % mean TTFT at 2× load), while a
        path's tier, its congestion trend and the control plane's own flows on it still
        hold. `routed` is the index the prefill rule alone picks
        (`kvrs.prefill.soonest`); it is kept unless the joint best beats it by
        more than `joint_margin`. `request.prefill_id` is ignored. A prefill node whose
        uplinks carry many of the control plane's own flows, or whose near decode
        instances are full, loses to one a little slower to prefill: what the decode
        choice alone cannot undo later.

        A prompt that continues a prefix the routed instance holds (`prefix_hits`, the
        prompt tokens each option holds) is then weighed with the decode instances' KV
        as well (the decode-load term next to each transfer; KV drains over whole
        decodes, so what is seen now still holds when the prefill ends): it moves next to
        a decode instance with room rather than sending its KV across the network to one
        later. A prompt nothing holds yet does not move for KV: it seeds a family of
        prompts that follow it to its node, and seeding families by decode KV lost 8 %
        of mean TTFT on the full synthetic trace where moving later turns lost nothing
        (docs/results.md §1b).
        """
        if not 0 <= routed < len(prefill_s):
            raise InvalidArgument("routed", f"must index prefill_s, got {routed}")
        if prefix_hits and len(prefix_hits) != len(prefill_s):
            raise InvalidArgument("prefix_hits", "must have one entry per prefill option")
        weigh_kv = bool(prefix_hits) and prefix_hits[routed] > 0
        paths, loaded = [], []
        for prefill_id, seconds in prefill_s:
            at = dataclasses.replace(request, prefill_id=prefill_id)
            _, scores, transfer, load, _ = self._scores(at, decodes, cost, now_s)
            room = scores < _INF
            if not room.any():
                paths.append(_INF)
                loaded.append(_INF)
                continue
            paths.append(seconds + float(transfer[room].min()))
            if weigh_kv:
                loaded.append(seconds + float((transfer + load)[room].min()))
        for totals in (paths, loaded) if weigh_kv else (paths,):
            best = min(range(len(prefill_s)), key=totals.__getitem__)
            if totals[best] < (1.0 - self.joint_margin) * totals[routed]:
                return best
        return routed


class CacheLoad:
    """A tuned cache- and load-aware router that is blind to the network.

    score = cache_weight_s · (1 − prefix hit fraction) + load_weight · W(d): a full cache
    miss is worth `cache_weight_s` seconds of queue. With every path equal and
    `cache_weight_s` set to the prompt's transfer time, this ranks exactly as netkv.
    """

    name = "cache_load"

    def __init__(self, cache_weight: float = 0.1, load_weight: float = 1.0) -> None:
        if cache_weight < 0:
            raise InvalidArgument("cache_weight", f"must be >= 0, got {cache_weight}")
        if load_weight < 0:
            raise InvalidArgument("load_weight", f"must be >= 0, got {load_weight}")
        self.cache_weight = cache_weight
        self.load_weight = load_weight

    def select(
        self,
        request: PlacementRequest,
        candidates: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
    ) -> Placement:
        decision = _Decision(request, candidates, cost, now_s)
        columns = decision.columns
        prompt_tokens = request.prompt_tokens
        cache_w, load_w = self.cache_weight, self.load_weight
        scores = [cache_w + load_w * w for w in columns.wait]
        for i, hit in decision.hit_items():
            scores[i] = cache_w * (1.0 - hit / prompt_tokens) + load_w * columns.wait[i]
        if columns.min_free < prompt_tokens:
            for i in range(len(scores)):
                if not decision.fits(i):
                    scores[i] = _INF
        best, runner = _two_best(scores, decision.load_key)
        if best < 0:
            raise decision.exhausted()
        return decision.placement(self.name, best, runner)


class LeastLoaded:
    """Fewest outstanding requests (queued + running), then least queued work, then id."""

    name = "least_loaded"

    def select(
        self,
        request: PlacementRequest,
        candidates: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
    ) -> Placement:
        decision = _Decision(request, candidates, cost, now_s)
        columns = decision.columns
        order = heapq.nsmallest(
            2,
            (i for i in range(len(columns.ids)) if decision.fits(i)),
            key=lambda i: (columns.load[i], columns.wait[i], columns.ids[i]),
        )
        if not order:
            raise decision.exhausted()
        return decision.placement(self.name, order[0], order[1] if len(order) > 1 else None)


class RoundRobin:
    """Each call takes the next candidate in order, skipping those without memory."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(
        self,
        request: PlacementRequest,
        candidates: Sequence[InstanceState],
        cost: CostModel,
        now_s: float,
    ) -> Placement:
        if not candidates:
            raise FailedPrecondition("no decode candidates", field="candidates")
        n = len(candidates)
        block_tokens = cost.model.block_tokens
        for step in range(n):
            i = (self._next + step) % n
            state = candidates[i]
            hit = prefix_hit_tokens(
                request.prefix_hashes, state.resident_blocks, block_tokens, request.prompt_tokens
            )
            if state.free_kv_tokens >= request.prompt_tokens - hit:
                self._next = i + 1
                decision = _Decision(request, candidates, cost, now_s)
                return decision.placement(self.name, i, None)
        raise ResourceExhausted(
            f"no decode candidate has {request.prompt_tokens} tokens of free KV memory "
            f"({n} considered)",
            field="free_kv_tokens",
        )


PLACEMENT_POLICY_NAMES = ("round_robin", "least_loaded", "cache_load", "netkv", "kvrs")

_POLICIES: dict[str, Callable[..., PlacementPolicy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "cache_load": CacheLoad,
    "netkv": NetKv,
    "kvrs": Kvrs,
}


def prepare_candidates(view: ClusterView, previous: ClusterView | None = None) -> None:
    """Build now what decisions will read from `view`'s decode candidates (their columns,
    arrays and prefix-block index), so that the first decision on a new view does not;
    path terms already computed on `previous`, the view it replaces, are carried over.

    Whoever installs a new view calls it (a refresh, off the decision path); decisions
    are the same with or without it.
    """
    before = None if previous is None else _Columns.of(previous.decode_instances())
    _Columns.of(view.decode_instances()).prepare(before)


def chooses_prefill(name: str) -> bool:
    """Whether the policy called `name` chooses the prefill instance too, given the
    options (a `JointPlacementPolicy`): a caller then asks before the prompt prefills."""
    return _has_choose_prefill(_POLICIES.get(name))


def as_joint(policy: PlacementPolicy | None) -> JointPlacementPolicy | None:
    """`policy` when it chooses the prefill too, else None. The same test as
    `chooses_prefill`, on the object; not isinstance against a runtime-checkable protocol,
    which costs ~12 µs on a decision's path."""
    return cast(JointPlacementPolicy, policy) if _has_choose_prefill(policy) else None


def _has_choose_prefill(policy_or_class: object) -> bool:
    return callable(getattr(policy_or_class, "choose_prefill", None))


def make_placement_policy(name: str, **params: Any) -> PlacementPolicy:
    """A new policy called `name` (see PLACEMENT_POLICY_NAMES) built with `params`."""
    try:
        factory = _POLICIES[name]
    except KeyError:
        raise InvalidArgument(
            "policy",
            f"unknown placement policy {name!r} (known: {', '.join(PLACEMENT_POLICY_NAMES)})",
        ) from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise InvalidArgument("policy", f"{name}: bad parameters {sorted(params)}: {exc}") from None


def score_candidates(
    request: PlacementRequest,
    candidates: Sequence[InstanceState],
    cost: CostModel,
    now_s: float,
    limit: int | None = None,
) -> list[CandidateScore]:
    """The netkv terms of the candidates that fit, best first (for decision traces)."""
    decision = _Decision(request, candidates, cost, now_s)
    scores = decision.netkv_scores()
    finite = [i for i, s in enumerate(scores) if s != _INF]
    finite.sort(key=lambda i: (scores[i], *decision.tier_key(i)))
    return [decision.score(i) for i in finite[:limit]]
