"""Per-request records and per-run summaries: TTFT, TPOT, TBT, SLO attainment, recovery.

Definitions (docs/simulator.md, "Metrics"): TTFT ends at the first token, which is the first decode
step after the KV arrived (`ttft_mode="first_token"`, the NetKV definition) or the end
of prefill (`"prefill_end"`, DistServe's simulator). TPOT is the mean gap after the
first token; TBT is the mean of a request's longest 10 % of gaps (Mooncake).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from kvrs.errors import InvalidArgument
from kvrs.learning import KINDS, Outcome, Terms

TTFT_MODES = ("first_token", "prefill_end")
SLO_MODES = ("ttft", "ttft+tbt", "ttft+tpot")

PENDING, COMPLETED, ABORTED = "pending", "completed", "aborted"


class RequestRecord:
    """What happened to one request; filled in by the simulator as it goes."""

    __slots__ = (
        "index",
        "arrival_s",
        "input_tokens",
        "output_tokens",
        "prefill_id",
        "decode_id",
        "prefill_start_s",
        "prefill_end_s",
        "prefix_hit_tokens",
        "decode_hit_tokens",
        "kv_bytes",
        "tier",
        "transfer_start_s",
        "transfer_end_s",
        "first_token_s",
        "finish_s",
        "status",
        "tpot_s",
        "tbt_s",
        "segments",
        "recoveries",
        "abort_reason",
        "predicted_ttft_s",
        "generated_tokens",
        "last_token_s",
    )

    def __init__(self, index: int, arrival_s: float, input_tokens: int, output_tokens: int) -> None:
        self.index = index
        self.arrival_s = arrival_s
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.prefill_id = ""
        self.decode_id = ""
        self.prefill_start_s = math.nan
        self.prefill_end_s = math.nan
        self.prefix_hit_tokens = 0
        self.decode_hit_tokens = 0
        self.kv_bytes = 0
        self.tier = -1
        self.transfer_start_s = math.nan
        self.transfer_end_s = math.nan
        self.first_token_s = math.nan
        self.finish_s = math.nan
        self.status = PENDING
        self.tpot_s = math.nan
        self.tbt_s = math.nan
        # Token gaps as runs of an arithmetic series: (extra before the first, first gap,
        # increment per gap, count). Decode steps lengthen by a fixed amount per step while
        # a batch is unchanged, so a run stores hundreds of gaps in one tuple.
        self.segments: list[tuple[float, float, float, int]] = []
        self.recoveries: list[RecoveryRecord] = []
        self.abort_reason = ""
        self.predicted_ttft_s = math.nan
        self.generated_tokens = 0
        self.last_token_s = math.nan

    def ttft_s(self, mode: str = "first_token") -> float:
        if mode == "prefill_end":
            return self.prefill_end_s - self.arrival_s
        return self.first_token_s - self.arrival_s

    def close_gaps(self) -> None:
        """Turn the recorded gap runs into TPOT and TBT, then drop them (memory)."""
        segments, self.segments = self.segments, []
        count = sum(s[3] for s in segments)
        if count <= 0:
            return
        if len(segments) == 1 and segments[0][0] == 0.0:
            _, first, inc, n = segments[0]
            total = n * first + inc * n * (n - 1) / 2
            top = max(1, math.ceil(0.1 * n))
            # Gaps grow along a run, so the longest are its last `top`.
            start = first + inc * (n - top)
            top_total = top * start + inc * top * (top - 1) / 2
        else:
            gaps = np.concatenate(
                [first + inc * np.arange(n, dtype=np.float64) for _, first, inc, n in segments]
            )
            offset = 0
            for extra, _, _, n in segments:
                gaps[offset] += extra
                offset += n
            total = float(gaps.sum())
            top = max(1, math.ceil(0.1 * count))
            top_total = float(np.partition(gaps, count - top)[count - top :].sum())
        self.tpot_s = total / count
        self.tbt_s = top_total / top


@dataclass
class RecoveryRecord:
    """One recovery of one request: the action taken and how long it took."""

    action: str
    started_s: float
    restored_s: float = math.nan  # the KV (prompt and generated tokens) is whole again
    resumed_s: float = math.nan  # the first token after recovery
    target_id: str = ""
    predicted_s: float = math.nan
    planner: str = ""
    generated_tokens: int = 0  # tokens the request had produced when it failed

    @property
    def latency_s(self) -> float:
        """Failure to the first token after it."""
        return self.resumed_s - self.started_s

    @property
    def restore_s(self) -> float:
        """Failure to the KV being whole on the new instance."""
        return self.restored_s - self.started_s


@dataclass(frozen=True)
class SloSpec:
    """Service-level objectives a request must meet to count as attained."""

    ttft_s: float = 30.0
    tbt_s: float = 0.1
    tpot_s: float = 0.1
    mode: str = "ttft+tbt"
    ttft_mode: str = "first_token"

    def __post_init__(self) -> None:
        if self.mode not in SLO_MODES:
            raise InvalidArgument("slo.mode", f"one of {SLO_MODES}")
        if self.ttft_mode not in TTFT_MODES:
            raise InvalidArgument("slo.ttft_mode", f"one of {TTFT_MODES}")

    def met(self, record: RequestRecord) -> bool:
        if record.status != COMPLETED:
            return False
        if not record.ttft_s(self.ttft_mode) <= self.ttft_s:
            return False
        if self.mode == "ttft+tbt":
            return math.isnan(record.tbt_s) or record.tbt_s <= self.tbt_s
        if self.mode == "ttft+tpot":
            return math.isnan(record.tpot_s) or record.tpot_s <= self.tpot_s
        return True


def _stats(values: Iterable[float], scale: float = 1.0) -> dict[str, float]:
    array = np.fromiter((v for v in values if not math.isnan(v)), dtype=np.float64) * scale
    if array.size == 0:
        return {
            "count": 0,
            "mean": math.nan,
            "p50": math.nan,
            "p90": math.nan,
            "p99": math.nan,
            "max": math.nan,
        }
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {
        "count": int(array.size),
        "mean": float(array.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(array.max()),
    }


@dataclass
class RunSummary:
    """Aggregates of one simulated run (times in seconds unless named `_ms`)."""

    policy: str
    requests: int
    completed: int
    aborted: int
    lost: int
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    tbt_s: dict[str, float]
    transfer_s: dict[str, float]
    slo_attainment: float
    ttft_attainment: float
    tier_share: dict[str, float]
    prefill_hit_ratio: float
    decode_hit_ratio: float
    mean_kv_bytes: float
    recovery: dict[str, dict[str, float]] = field(default_factory=dict)
    recovery_restore: dict[str, dict[str, float]] = field(default_factory=dict)
    aborted_by_reason: dict[str, int] = field(default_factory=dict)
    sim_time_s: float = 0.0
    wall_s: float = 0.0
    events: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def summarize(
    policy: str,
    records: list[RequestRecord],
    slo: SloSpec,
    sim_time_s: float = 0.0,
    wall_s: float = 0.0,
    events: int = 0,
) -> RunSummary:
    """Summarise the records of one run."""
    done = [r for r in records if r.status == COMPLETED]
    aborted = [r for r in records if r.status == ABORTED]
    tiers = Counter(r.tier for r in done if r.tier >= 0)
    tier_total = sum(tiers.values()) or 1
    recovery: dict[str, list[float]] = defaultdict(list)
    restore: dict[str, list[float]] = defaultdict(list)
    for r in records:
        for rec in r.recoveries:
            recovery[rec.action].append(rec.latency_s)
            restore[rec.action].append(rec.restore_s)
    ttft_only = SloSpec(ttft_s=slo.ttft_s, mode="ttft", ttft_mode=slo.ttft_mode)
    input_total = sum(r.input_tokens for r in done) or 1
    n = len(records) or 1
    return RunSummary(
        policy=policy,
        requests=len(records),
        completed=len(done),
        aborted=len(aborted),
        lost=len(records) - len(done) - len(aborted),
        ttft_s=_stats(r.ttft_s(slo.ttft_mode) for r in done),
        tpot_s=_stats(r.tpot_s for r in done),
        tbt_s=_stats(r.tbt_s for r in done),
        transfer_s=_stats(r.transfer_end_s - r.transfer_start_s for r in done),
        slo_attainment=sum(1 for r in records if slo.met(r)) / n,
        ttft_attainment=sum(1 for r in records if ttft_only.met(r)) / n,
        tier_share={str(t): c / tier_total for t, c in sorted(tiers.items())},
        prefill_hit_ratio=sum(r.prefix_hit_tokens for r in done) / input_total,
        decode_hit_ratio=sum(r.decode_hit_tokens for r in done) / input_total,
        mean_kv_bytes=float(np.mean([r.kv_bytes for r in done])) if done else 0.0,
        recovery={action: _stats(values) for action, values in sorted(recovery.items())},
        recovery_restore={action: _stats(v) for action, v in sorted(restore.items())},
        aborted_by_reason=dict(Counter(r.abort_reason for r in aborted)),
        sim_time_s=sim_time_s,
        wall_s=wall_s,
        events=events,
    )


def goodput_by_bisection(
    attainment_at: Callable[[float], float],
    low_rate: float,
    high_rate: float,
    target: float = 0.9,
    tolerance: float = 0.1,
) -> tuple[float, list[tuple[float, float]]]:
    """Highest rate whose attainment is ≥ `target`, by bisection to `tolerance` req/s.

    Assumes attainment falls with rate (DistServe's method). Returns the rate and every
    (rate, attainment) probed. The bracket widens as needed: `high_rate` doubles while it
    passes, `low_rate` halves while it fails (0.0 once it drops below `tolerance`).
    """
    probes: list[tuple[float, float]] = []

    def probe(rate: float) -> bool:
        value = attainment_at(rate)
        probes.append((rate, value))
        return value >= target

    while not probe(low_rate):
        high_rate, low_rate = low_rate, low_rate / 2
        if low_rate < tolerance:
            return 0.0, probes
    while probe(high_rate):
        low_rate, high_rate = high_rate, high_rate * 2
    while high_rate - low_rate > tolerance:
        middle = (low_rate + high_rate) / 2
        if probe(middle):
            low_rate = middle
        else:
            high_rate = middle
    return low_rate, probes


def recovery_outcomes(records: Iterable[RequestRecord]) -> list[Outcome]:
    """Every completed recovery of a run as a `kvrs.learning.Outcome`: the decision's
    predicted time against the simulated failure → KV restored (detection included, as
    a router measures from the failure it noticed), so a run's outcomes can be fitted
    (`kvrs.learning.fit`) and replayed into the next run's decisions."""
    outcomes = []
    for record in records:
        for i, recovery in enumerate(record.recoveries):
            if math.isnan(recovery.restored_s) or math.isnan(recovery.predicted_s):
                continue
            if recovery.action not in KINDS:
                continue
            outcomes.append(
                Outcome(
                    kind=recovery.action,
                    request_id=f"{record.index}.{i}",
                    source_id=record.prefill_id,
                    target_id=recovery.target_id,
                    at_s=recovery.started_s,
                    predicted=Terms(total_s=max(0.0, recovery.predicted_s)),
                    measured=Terms(total_s=max(0.0, recovery.restore_s)),
                )
            )
    return outcomes
