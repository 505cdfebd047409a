"""Learning from outcomes: each executed decision's measured terms next to its predicted
ones, and the corrections fitted from them.

A decision predicts a time as a sum of terms (queue wait, transfer set-up and streaming,
prefill, extend); the router measures the same terms while it carries the decision out
and reports an `Outcome`. `fit` turns a window of outcomes into `Corrections`:

    per link      fixed cost and rate, T = fixed + 8·bytes / rate. The rate is Theil–Sen
                  over the measured streams (a median of pairwise slopes, so one stalled
                  transfer moves nothing; probes alone cannot separate the two, decisions
                  move KV of many sizes). The fixed cost is what each transfer as
                  measured says it was, less its stream: under load the calls, ticket
                  and pair, not the wire, are what a transfer costs. Of a transfer run
                  beside others on its target (`target_jobs`, n in all), its share: the
                  target serves them about in turn, each taking about n times its own.
    new pairs     a pair no decision has used yet takes the median fixed cost of those
                  that have (its first transfer pays the same set-up, and more)
    compute       measured / predicted seconds of the forward passes (prefill and extend;
                  median ratio) of decisions carried out alone (`target_jobs` 1), which
                  scales the compute profile (its batched-pass cost too)
    worker wait   a worker's queue wait (and call overhead) beyond the W(x) it reported
    interference  extra queue wait per request decoding on the target (median)
                  (both against the wait predicted without them: `Corrections.applied_to`)
    error         the relative error of each decision kind, which decisions must beat

Every correction is a median over recent outcomes, clipped to a band around the base
model (`LearningConfig.max_factor`), and forgets outcomes older than `max_age_s`: one
absurd measurement cannot move a decision, and an old regime fades out. `fit` is a pure
function of the outcomes, so every scheduler replica reading the same shared log gets
the same corrections, and the simulator replays a saved log to the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument
from kvrs.placement import Placement
from kvrs.profile import ComputeProfile
from kvrs.recovery import Action, RecoveryDecision, RecoveryRequest, chosen_option
from kvrs.units import BITS_PER_BYTE

__all__ = [
    "KINDS",
    "TERMS",
    "AssignedWork",
    "Corrections",
    "ErrorStats",
    "LearningConfig",
    "LinkFit",
    "Outcome",
    "Terms",
    "error_stats",
    "fit",
    "placement_terms",
    "recovery_terms",
    "relative_error",
]

KINDS = ("placement", "migrate", "recompute", "hybrid")
"""Decision kinds an outcome reports: a placement, or the recovery action carried out."""


@dataclass(frozen=True)
class Terms:
    """Seconds of each part of a decision's time, predicted or measured (0: no such part)."""

    source_wait_s: float = 0.0
    """Queue wait at the worker computing from scratch (RECOMPUTE's prefill instance)."""
    target_wait_s: float = 0.0
    """Queue wait at the target before its compute (the extend) starts."""
    setup_s: float = 0.0
    """Transfer set-up: the calls, the ticket, the pair; predicted as the path's fixed cost."""
    stream_s: float = 0.0
    """Transfer streaming: the KV on the wire; predicted as 8·bytes / rate."""
    prefill_s: float = 0.0
    """Compute from scratch: RECOMPUTE's prefill, HYBRID's recomputed prefix, a prompt."""
    extend_s: float = 0.0
    """Compute on the target on top of the moved KV (the generated tokens)."""
    total_s: float = 0.0
    """Decision to KV ready on the target (placement: to the first decoded token)."""
    first_token_s: float = 0.0
    """Decision to the first token the new decode instance streams."""

    @property
    def transfer_s(self) -> float:
        return self.setup_s + self.stream_s

    def as_dict(self) -> dict[str, float]:
        # Not dataclasses.asdict: its deep copy costs a decision's reply microseconds.
        return dict(self.__dict__)


TERMS = tuple(f.name for f in fields(Terms))
"""Every term's name, as the metrics, spans and `kvrs status` label it."""


def recovery_terms(
    decision: RecoveryDecision, request: RecoveryRequest, cost: CostModel, now_s: float
) -> Terms:
    """The chosen option's predicted cost split into its terms (all 0 for ABORT).

    MIGRATE  W(d) + [rtt + 8·S(L)/B] + T_ext(L, g)
    HYBRID   W(d) + max(T_pf(k), rtt + 8·S(L − k)/B) + T_ext(L, g)
    RECOMPUTE W(p') + T_pf(L + g) + [rtt + 8·S(L + g)/B] + W(d)

    The first token after it is predicted at KV ready: the extend already computed it.
    """
    option = chosen_option(decision)
    if option is None:
        return Terms()
    setup_s = 0.0
    if option.transfer_s > 0.0:
        _, rtt_s = cost.network.rate_and_rtt(option.source_id, option.target_id, now_s)
        setup_s = min(rtt_s, option.transfer_s)
    stream_s = max(0.0, option.transfer_s - setup_s)
    if option.action is Action.RECOMPUTE:
        return Terms(
            source_wait_s=option.wait_s,
            target_wait_s=option.target_wait_s,
            setup_s=setup_s,
            stream_s=stream_s,
            prefill_s=option.compute_s,
            total_s=option.cost_s,
            first_token_s=option.cost_s,
        )
    # HYBRID's compute is the recomputed part (not the blocks the target already held)
    # and the extend.
    ext_s = cost.extend_s(request.prompt_tokens, request.generated_tokens)
    prefill_s = max(0.0, option.compute_s - ext_s) if option.action is Action.HYBRID else 0.0
    return Terms(
        target_wait_s=option.wait_s,
        setup_s=setup_s,
        stream_s=stream_s,
        prefill_s=prefill_s,
        extend_s=max(0.0, option.compute_s - prefill_s),
        total_s=option.cost_s,
        first_token_s=option.cost_s,
    )


def placement_terms(placement: Placement, prompt_tokens: int, cost: CostModel) -> Terms:
    """A placement's prediction of the time to its first decoded token, term by term:
    W(d) + T_x + T_ext(L, 1) (the decode instance feeds the first token as an extend).
    A transfer streamed under the prefill counts from the prefill's end: its set-up and
    most of its stream are hidden, what is left is its tail, all of it stream."""
    transfer = placement.transfer
    if placement.streamed:
        setup_s, stream_s = 0.0, placement.predicted_ttft_s - placement.wait_s
    else:
        setup_s = min(transfer.rtt_s, transfer.transfer_s)
        stream_s = transfer.transfer_s - setup_s
    extend_s = cost.extend_s(prompt_tokens, 1) if prompt_tokens else 0.0
    return Terms(
        target_wait_s=placement.wait_s,
        setup_s=setup_s,
        stream_s=stream_s,
        extend_s=extend_s,
        total_s=placement.predicted_ttft_s + extend_s,
        first_token_s=placement.predicted_ttft_s + extend_s,
    )


@dataclass(frozen=True)
class Outcome:
    """One executed decision: what it predicted, what was measured, and its inputs."""

    kind: str
    """One of KINDS."""
    request_id: str
    source_id: str
    """Where the KV came from (RECOMPUTE: the prefill instance that recomputed it)."""
    target_id: str
    at_s: float
    """When the decision was made (unix seconds)."""
    predicted: Terms
    measured: Terms
    kv_bytes: int = 0
    """Bytes the transfer moved."""
    prefill_tokens: int = 0
    """Tokens computed from scratch (what `measured.prefill_s` is the time of)."""
    cached_tokens: int = 0
    extend_tokens: int = 0
    """The extend: `extend_tokens` on top of `cached_tokens` already resident."""
    target_running: int = 0
    """Requests decoding on the target when the decision was made."""
    target_jobs: int = 1
    """The most decisions it was carried out beside, itself included (what stretched its
    measured time)."""
    streamed: bool = False
    """Its transfer ran while the source prefilled (layer-wise streaming): the measured
    transfer is only the part the prefill did not hide, so no link is fitted from it."""
    learned_source_wait_s: float = 0.0
    """What corrections added to `predicted.source_wait_s` (the prefill instance's worker
    wait; `Corrections.applied_to`). A wait's excess is fitted against the prediction
    without them: against the corrected one, each fit would learn only what the one
    before it left over, and settle at half the excess."""
    learned_target_wait_s: float = 0.0
    """What corrections added to `predicted.target_wait_s` (the target's worker wait and
    interference)."""

    def __post_init__(self) -> None:
        if self.target_jobs < 1:
            raise InvalidArgument("target_jobs", f"must be >= 1, got {self.target_jobs}")
        if self.kind not in KINDS:
            raise InvalidArgument("kind", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("kv_bytes", "prefill_tokens", "cached_tokens", "extend_tokens"):
            if getattr(self, name) < 0:
                raise InvalidArgument(name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("learned_source_wait_s", "learned_target_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise InvalidArgument(name, f"must be a finite number >= 0, got {value}")
        for which in ("predicted", "measured"):
            terms = getattr(self, which)
            for name in TERMS:
                value = getattr(terms, name)
                if not (math.isfinite(value) and value >= 0.0):
                    raise InvalidArgument(
                        f"{which}.{name}", f"must be a finite number >= 0, got {value}"
                    )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Outcome:
        values = dict(data)
        values["predicted"] = Terms(**values.get("predicted", {}))
        values["measured"] = Terms(**values.get("measured", {}))
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclass(frozen=True)
class LearningConfig:
    """How much the corrections trust recent outcomes."""

    window: int = 512
    """At most this many of the newest outcomes are fitted (older ones are dropped)."""
    max_age_s: float = 900.0
    """Outcomes older than this no longer count."""
    min_samples: int = 3
    """A correction needs this many outcomes behind it; fewer leave the base model."""
    max_factor: float = 16.0
    """A correction stays within [1 / max_factor, max_factor] of the base model."""
    max_fixed_s: float = 1.0
    """A link's fitted fixed cost stays below this."""
    max_rate_factor: float = 1000.0
    """A link's fitted rate stays within [1 / this, this] of the rate decisions predicted
    (probes on an idle link can overstate by orders of magnitude what a loaded one moves)."""
    error_window: int = 64
    """Error statistics (and decision margins) cover this many newest outcomes per kind."""

    def __post_init__(self) -> None:
        for name in ("window", "min_samples", "error_window"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")
        if not self.max_factor >= 1.0:
            raise InvalidArgument("max_factor", f"must be >= 1, got {self.max_factor}")
        if not self.max_rate_factor >= 1.0:
            raise InvalidArgument("max_rate_factor", f"must be >= 1, got {self.max_rate_factor}")
        for name in ("max_age_s", "max_fixed_s"):
            if not getattr(self, name) > 0.0:
                raise InvalidArgument(name, f"must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class LinkFit:
    """A (src, dst) path as decisions measured it: T = fixed_s + 8·bytes / bandwidth_bps."""

    fixed_s: float
    bandwidth_bps: float
    samples: int


@dataclass(frozen=True)
class ErrorStats:
    """|measured − predicted| / measured of one term over recent outcomes of one kind."""

    p50: float
    p90: float
    samples: int


@dataclass(frozen=True)
class Corrections:
    """What the outcomes say the base model gets wrong (neutral when there are none)."""

    links: Mapping[tuple[str, str], LinkFit] = field(default_factory=dict)
    new_link_fixed_s: float = 0.0
    """The fixed cost a pair no decision has measured yet is priced with (at least)."""
    compute_factor: float = 1.0
    """Measured / predicted seconds of a forward pass (prefill or extend)."""
    wait_per_decode_s: float = 0.0
    """Queue wait a target adds per request it is decoding (interference)."""
    worker_wait_s: Mapping[str, float] = field(default_factory=dict)
    """instance id -> queue wait (and call overhead) it adds beyond its reported W(x)."""
    errors: Mapping[tuple[str, str], ErrorStats] = field(default_factory=dict)
    """(kind, term) -> error statistics of the predictions as they were made."""
    samples: int = 0
    """Outcomes the corrections were fitted from."""

    def link(self, src_id: str, dst_id: str) -> LinkFit | None:
        return self.links.get((src_id, dst_id))

    def unmeasured_rtt_s(self, probed_rtt_s: float) -> float:
        """The fixed cost of a pair with no fit of its own: its probe's, or what the
        measured pairs' set-ups say a transfer costs, whichever is more."""
        return max(probed_rtt_s, self.new_link_fixed_s)

    def applied_to(self, outcome: Outcome) -> Outcome:
        """`outcome` with the waits these corrections add to a prediction of it noted
        (`Outcome.learned_source_wait_s` / `learned_target_wait_s`), as a view adds them
        to the W(x) of the instances it priced. Noted when the outcome is reported: every
        replica fits the same shared log, so the corrections in force then are those the
        decision was priced with, a refit or two later at most."""
        source_s = (
            self.worker_wait_s.get(outcome.source_id, 0.0) if outcome.kind == "recompute" else 0.0
        )
        target_s = (
            self.worker_wait_s.get(outcome.target_id, 0.0)
            + self.wait_per_decode_s * outcome.target_running
        )
        return replace(outcome, learned_source_wait_s=source_s, learned_target_wait_s=target_s)

    def compute_profile(self, base: ComputeProfile) -> ComputeProfile:
        """`base` scaled by `compute_factor` (prefill and extend alike)."""
        return base.scaled(self.compute_factor)

    def margins(self, min_samples: int = 3, cap: float = 1.0) -> dict[str, float]:
        """The relative error each recovery action's decisions must win by (the p90 error
        of its total over recent outcomes, capped at `cap`), for `CostModel.margins`;
        an action with fewer than `min_samples` outcomes has none."""
        margins = {}
        for kind in KINDS[1:]:
            stats = self.errors.get((kind, "total_s"))
            if stats is not None and stats.samples >= min_samples:
                margins[kind] = min(cap, stats.p90)
        return margins

    def key(self) -> tuple:
        """Changes whenever the corrections do (for caches of what is priced with them)."""
        return (
            tuple(sorted((k, v.fixed_s, v.bandwidth_bps) for k, v in self.links.items())),
            self.new_link_fixed_s,
            self.compute_factor,
            self.wait_per_decode_s,
            tuple(sorted(self.worker_wait_s.items())),
            tuple(sorted((k, v.p90) for k, v in self.errors.items() if k[1] == "total_s")),
        )


def relative_error(predicted_s: float, measured_s: float) -> float:
    """|measured − predicted| / measured; 0 when both are 0, 1 when only the prediction is."""
    if measured_s <= 0.0:
        return 0.0 if predicted_s <= 0.0 else 1.0
    return abs(measured_s - predicted_s) / measured_s


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def _clip(value: float, lo: float, hi: float) -> float:
    return lo if value < lo else hi if value > hi else value


def _recent(outcomes: Iterable[Outcome], now_s: float, config: LearningConfig) -> list[Outcome]:
    """The newest `window` outcomes no older than `max_age_s`, oldest first."""
    kept = [o for o in outcomes if now_s - o.at_s <= config.max_age_s]
    kept.sort(key=lambda o: o.at_s)
    return kept[-config.window :]


def _fit_link(samples: list[Outcome], config: LearningConfig) -> LinkFit | None:
    """Fixed cost and rate of one path from its transfers (see the module docstring).

    The fixed cost is each transfer as measured (from the pull's call to its KV in on
    the target: the calls, the ticket, the pair and the wire) less its stream at the
    fitted rate, or of one carried out beside `target_jobs` − 1 others on its target, its
    share: a target serves pulls started together about in turn (`bench.concurrent_pulls`:
    n of them take 0.6–0.8 × n times one alone), each taking about n times its own, as the
    recovery planner prices them. The rest of a decision's total (the queue at the target,
    the call that feeds its first token) is the worker wait's and the interference's to
    fit: counted here too, it would be priced twice, and n times over in a batch. The
    rate's slope reads the transfers whole: their shares, divided by counts that vary from
    one to tens in a burst, scatter more than the sizes separate them."""
    points = []
    priors = []
    for o in samples:
        bits = BITS_PER_BYTE * o.kv_bytes
        points.append((bits, o.measured.transfer_s))
        if o.predicted.stream_s > 0.0:
            priors.append(bits / o.predicted.stream_s)
    if len(points) < config.min_samples or not priors:
        return None
    prior_bps = _median(priors)
    lo_bps, hi_bps = prior_bps / config.max_rate_factor, prior_bps * config.max_rate_factor
    xs = [x for x, _ in points]
    slopes: list[float] = []
    spread = 0.25 * (max(xs) - min(xs))
    if spread > 0.0 and max(xs) >= 1.5 * min(xs):
        for i, (x0, y0) in enumerate(points):
            for x1, y1 in points[i + 1 :]:
                if abs(x1 - x0) >= spread:
                    slopes.append((y1 - y0) / (x1 - x0))
    if len(slopes) >= config.min_samples:
        # Seconds per bit; a non-positive slope (noise on sizes too close) keeps the band.
        slope = _median(slopes)
        bps = _clip(1.0 / slope, lo_bps, hi_bps) if slope > 0.0 else hi_bps
    else:
        # Sizes too alike to separate the two: keep the predicted rate, fit the fixed cost.
        bps = prior_bps
    shares = [
        o.measured.transfer_s / o.target_jobs - x / bps
        for o, (x, _) in zip(samples, points, strict=True)
    ]
    fixed_s = _clip(_median(shares), 0.0, config.max_fixed_s)
    return LinkFit(fixed_s=fixed_s, bandwidth_bps=bps, samples=len(points))


def _base_source_wait_s(o: Outcome) -> float:
    """The predicted wait at the prefill instance without what corrections added."""
    return max(0.0, o.predicted.source_wait_s - o.learned_source_wait_s)


def _base_target_wait_s(o: Outcome) -> float:
    """The predicted wait at the target without what corrections added."""
    return max(0.0, o.predicted.target_wait_s - o.learned_target_wait_s)


def _ratio(pairs: list[tuple[float, float]], config: LearningConfig) -> float:
    """Median of measured / base over (measured, base) pairs, clipped to the band; 1 with
    too few."""
    ratios = [m / b for m, b in pairs if b > 0.0 and m > 0.0]
    if len(ratios) < config.min_samples:
        return 1.0
    return _clip(_median(ratios), 1.0 / config.max_factor, config.max_factor)


def fit(
    outcomes: Iterable[Outcome],
    base: ComputeProfile,
    now_s: float,
    config: LearningConfig | None = None,
) -> Corrections:
    """The corrections the outcomes support (see the module docstring)."""
    config = config or LearningConfig()
    recent = _recent(outcomes, now_s, config)
    if not recent:
        return Corrections()
    by_link: dict[tuple[str, str], list[Outcome]] = {}
    for o in recent:
        on_a_link = o.source_id and o.target_id and not o.streamed
        if o.kv_bytes > 0 and o.measured.transfer_s > 0.0 and on_a_link:
            by_link.setdefault((o.source_id, o.target_id), []).append(o)
    links = {}
    for key, samples in by_link.items():
        fitted = _fit_link(samples, config)
        if fitted is not None:
            links[key] = fitted
    new_link_fixed_s = _median([f.fixed_s for f in links.values()]) if links else 0.0
    # Compute: every forward pass measured, prefills and extends alike, against the base;
    # only of decisions carried out alone (a worker batching several
    # reports the whole batch's pass to each of them).
    solo = [o for o in recent if o.target_jobs == 1]
    passes = [
        (o.measured.prefill_s, base.prefill_s(o.prefill_tokens)) for o in solo if o.prefill_tokens
    ]
    passes += [
        (o.measured.extend_s, base.extend_s(o.cached_tokens, o.extend_tokens))
        for o in solo
        if o.extend_tokens
    ]
    compute_factor = _ratio(passes, config)
    # A worker's own excess wait: where it computed with no decode stream beside it.
    excess_by_worker: dict[str, list[float]] = {}
    for o in recent:
        if o.kind == "recompute" and o.source_id:
            excess_by_worker.setdefault(o.source_id, []).append(
                o.measured.source_wait_s - _base_source_wait_s(o)
            )
        if o.target_running == 0 and o.target_jobs == 1 and o.target_id and o.extend_tokens:
            excess_by_worker.setdefault(o.target_id, []).append(
                o.measured.target_wait_s - _base_target_wait_s(o)
            )
    worker_wait_s = {
        worker: _clip(_median(values), 0.0, config.max_fixed_s)
        for worker, values in excess_by_worker.items()
        if len(values) >= config.min_samples
    }
    # Interference: a placement's wait for its first decode step beyond W(d) and the
    # worker's own excess, per request decoding there. Only where its prediction counted
    # no other work sent there: recoveries and a burst of placements also queue behind
    # each other, which is not interference (their queue is priced, set-ups and all).
    per_decode = [
        max(
            0.0,
            o.measured.target_wait_s - _base_target_wait_s(o) - worker_wait_s.get(o.target_id, 0.0),
        )
        / o.target_running
        for o in recent
        if o.target_running > 0 and o.kind == "placement" and o.target_jobs == 1
    ]
    wait_per_decode_s = (
        _clip(_median(per_decode), 0.0, config.max_fixed_s)
        if len(per_decode) >= config.min_samples
        else 0.0
    )
    return Corrections(
        links=links,
        new_link_fixed_s=new_link_fixed_s,
        compute_factor=compute_factor,
        wait_per_decode_s=wait_per_decode_s,
        worker_wait_s=worker_wait_s,
        errors=error_stats(recent, config.error_window),
        samples=len(recent),
    )


def error_stats(outcomes: Sequence[Outcome], last_n: int) -> dict[tuple[str, str], ErrorStats]:
    """p50 / p90 relative error per (kind, term) over the newest `last_n` outcomes of each
    kind; a term neither predicted nor measured in an outcome does not count."""
    by_kind: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, []).append(o)
    stats: dict[tuple[str, str], ErrorStats] = {}
    for kind, items in by_kind.items():
        items = items[-last_n:]
        for term in TERMS:
            errors = [
                relative_error(getattr(o.predicted, term), getattr(o.measured, term))
                for o in items
                if getattr(o.predicted, term) > 0.0 or getattr(o.measured, term) > 0.0
            ]
            if errors:
                stats[(kind, term)] = ErrorStats(
                    _quantile(errors, 0.5), _quantile(errors, 0.9), len(errors)
                )
    return stats


class AssignedWork:
    """Work the scheduler itself has sent to workers, until their heartbeats include it.

    W(x) comes from a worker's last heartbeat, which cannot know of a request placed
    after it; a burst of placements would all see the same idle worker. Each assignment
    counts in W(x) from the moment it is made until it is predicted done or a heartbeat
    newer than the assignment has reported the worker's queue.
    """

    def __init__(self) -> None:
        self._items: dict[str, list[tuple[float, float]]] = {}
        self._total_s: dict[str, float] = {}
        """The sum of each instance's items' work (read per decision: not summed each time)."""

    def add(self, instance_id: str, at_s: float, work_s: float) -> None:
        """`work_s` seconds sent to `instance_id` at `at_s`."""
        if work_s > 0.0:
            self._items.setdefault(instance_id, []).append((at_s, work_s))
            self._total_s[instance_id] = self._total_s.get(instance_id, 0.0) + work_s

    def instances(self) -> list[str]:
        """The instances with assignments still counted (a view refreshing only what
        changed in gossip re-reads these too)."""
        return [instance_id for instance_id, items in self._items.items() if items]

    def pending_jobs(self, instance_id: str, now_s: float) -> int:
        """Assignments to `instance_id` still counted in its W(x) (as of the last
        `pending_s`) and not predicted done by `now_s`: the set-ups its queue holds."""
        items = self._items.get(instance_id)
        if not items:
            return 0
        done_s = items[0][0] + self._total_s[instance_id]
        return len(items) if done_s > now_s else 0

    def pending_s(self, instance_id: str, now_s: float, reported_at_s: float) -> float:
        """Seconds assigned after `reported_at_s` (the heartbeat's time) and not yet done."""
        items = self._items.get(instance_id)
        if not items:
            return 0.0
        # Done by now, or already in a heartbeat: never counted again.
        items[:] = [(at, work) for at, work in items if at > reported_at_s and at + work > now_s]
        total_s = self._total_s[instance_id] = sum(work for _, work in items)
        # The assignments run one after another: what is left of their sum.
        if not items:
            return 0.0
        # A snapshot fetched before an assignment was made reads it whole, never more.
        return min(total_s, max(0.0, items[0][0] + total_s - now_s))
