"""Link bandwidth estimates from probe samples: an EWMA per path, and when it is too old."""

from __future__ import annotations

from dataclasses import dataclass

from kvrs.errors import InvalidArgument

__all__ = ["EwmaEstimator", "LinkEstimate", "StalenessPolicy"]


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
