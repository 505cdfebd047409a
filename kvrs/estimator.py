"""Link bandwidth estimates from probe samples: an EWMA per path, and when it is too old."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvrs.errors import InvalidArgument

__all__ = ["EwmaEstimator", "LinkEstimate", "LinkTrend", "StalenessPolicy"]


@dataclass(frozen=True)
class LinkEstimate:
    """Smoothed bandwidth and RTT of one (src, dst) path, and when they were last measured."""

    bandwidth_bps: float
    rtt_s: float
    measured_at_s: float
    samples: int

    def age_s(self, now_s: float) -> float:
        """Seconds since the last sample; never negative (clocks of two hosts may disagree)."""
        return max(0.0, now_s - self.measured_at_s)


class EwmaEstimator:
    """Exponentially weighted moving average of probe samples for one path.

    alpha = 0.2 as in the RecomputeOrMigrate code: a new sample moves the estimate a
    fifth of the way, enough to follow a congestion change within a handful of probes
    without jumping on one noisy sample. The first sample is taken as is (no bias to 0).
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise InvalidArgument("alpha", f"must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._estimate: LinkEstimate | None = None

    def update(self, sample_bps: float, rtt_s: float, now_s: float) -> LinkEstimate:
        """Fold one probe sample in and return the new estimate."""
        if not sample_bps > 0.0:
            raise InvalidArgument("sample_bps", f"must be > 0, got {sample_bps}")
        if not rtt_s >= 0.0:
            raise InvalidArgument("rtt_s", f"must be >= 0, got {rtt_s}")
        previous = self._estimate
        if previous is None:
            bandwidth_bps, smoothed_rtt_s, samples = sample_bps, rtt_s, 1
        else:
            a = self.alpha
            bandwidth_bps = a * sample_bps + (1.0 - a) * previous.bandwidth_bps
            smoothed_rtt_s = a * rtt_s + (1.0 - a) * previous.rtt_s
            samples = previous.samples + 1
        self._estimate = LinkEstimate(bandwidth_bps, smoothed_rtt_s, now_s, samples)
        return self._estimate

    @property
    def estimate(self) -> LinkEstimate | None:
        """The current estimate, None before the first sample."""
        return self._estimate


@dataclass(frozen=True)
class StalenessPolicy:
    """How old a measurement may be before the topology's capacity is trusted instead."""

    stale_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.stale_after_s >= 0.0:
            raise InvalidArgument("stale_after_s", f"must be >= 0, got {self.stale_after_s}")

    def is_fresh(self, estimate: LinkEstimate | None, now_s: float) -> bool:
        """True when there is an estimate no older than `stale_after_s`."""
        return estimate is not None and estimate.age_s(now_s) <= self.stale_after_s


class LinkTrend:
    """One link's capacity samples (what a switch counter gives) and what they predict.

    What a transfer pays is time per bit, so the samples are kept as inverse capacities
    x = 1 / free: the last one, their mean E[x] and variance, and the mean squared change
    between consecutive samples, which give the correlation of samples Δt apart,
    ρ = 1 − E[(x_k − x_{k−1})²] / (2·Var x). A sample of age a is worth w = ρ^(a/Δt):
    a link that never changed keeps w = 1, one whose background switches about as often as
    it is sampled has ρ ≈ 0 and falls back to its mean. The mean starts at the nominal
    capacity (the tier prior) and follows the samples with weight `alpha`.

    `excess_s_per_bit(now_s)` is what the link adds to a bit's time beyond its nominal
    capacity: w·x_last + (1 − w)·E[x] − 1 / nominal, never negative. The mean of inverses
    (not the inverse of the mean) is what makes a link that is congested a third of the
    time cost what it costs: 90 % background for a third of the time slows a transfer by
    4×, not by the 1.4× the mean capacity suggests.
    """

    __slots__ = (
        "nominal_bps",
        "alpha",
        "mean_inv",
        "var_inv",
        "change_var",
        "gap_s",
        "last_inv",
        "last_at_s",
        "samples",
    )

    def __init__(self, nominal_bps: float, alpha: float = 0.1) -> None:
        if not nominal_bps > 0.0:
            raise InvalidArgument("nominal_bps", f"must be > 0, got {nominal_bps}")
        if not 0.0 < alpha <= 1.0:
            raise InvalidArgument("alpha", f"must be in (0, 1], got {alpha}")
        self.nominal_bps = nominal_bps
        self.alpha = alpha
        self.mean_inv = 1.0 / nominal_bps
        self.var_inv = 0.0
        self.change_var = 0.0
        self.gap_s = 0.0
        self.last_inv = self.mean_inv
        self.last_at_s = -math.inf
        self.samples = 0

    def observe(self, free_bps: float, at_s: float) -> None:
        """Fold in one sample taken at `at_s` (in time order); free is floored at 1 %."""
        x = 1.0 / max(free_bps, 0.01 * self.nominal_bps)
        a = self.alpha
        if self.samples:
            change = x - self.last_inv
            gap_s = max(0.0, at_s - self.last_at_s)
            if self.samples == 1:
                self.change_var, self.gap_s = change * change, gap_s
            else:
                self.change_var += a * (change * change - self.change_var)
                self.gap_s += a * (gap_s - self.gap_s)
        self.mean_inv += a * (x - self.mean_inv)
        deviation = x - self.mean_inv
        self.var_inv += a * (deviation * deviation - self.var_inv)
        self.last_inv, self.last_at_s = x, at_s
        self.samples += 1

    def weight(self, now_s: float, horizon_s: float = 0.0) -> float:
        """What the last sample is still worth at `now_s` (1: all of it, 0: nothing),
        averaged over the next `horizon_s` (a transfer's duration) when that is > 0."""
        if self.samples < 2 or self.change_var == 0.0:
            return 1.0
        rho = 1.0 - self.change_var / (2.0 * self.var_inv) if self.var_inv > 0.0 else 0.0
        if rho <= 0.0 or self.gap_s <= 0.0:
            return 0.0
        if rho >= 1.0:
            return 1.0
        rate = -math.log(rho) / self.gap_s  # per second
        w = math.exp(-rate * max(0.0, now_s - self.last_at_s))
        span = rate * horizon_s
        return w * (1.0 - math.exp(-span)) / span if span > 1e-9 else w

    def excess_s_per_bit(self, now_s: float, horizon_s: float = 0.0) -> float:
        """Seconds per bit this link adds beyond its nominal capacity, expected over
        [now_s, now_s + horizon_s]."""
        w = self.weight(now_s, horizon_s)
        expected = w * self.last_inv + (1.0 - w) * self.mean_inv
        return max(0.0, expected - 1.0 / self.nominal_bps)
