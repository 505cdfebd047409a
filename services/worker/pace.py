"""How fast this worker really computes, against the profile that prices its work.

The profile (`kvrs calibrate`, or the model's preset) was measured on a quiet machine.
Under load the same pass takes longer: decode streams beside it, other processes on the
cores, a slower host than the one calibrated. The scheduler prices a recovery's extend
or a placement's first step with the profile, so every forward pass this worker runs is
timed against the profile's estimate of it, and the median ratio of the recent passes
is reported with each heartbeat (`compute_factor`). The worker's own queued work, W(x),
is reported in the same measured seconds.

A median over a window of passes, clipped to a band: one pass stalled by a page fault or
a garbage collection cannot move it, and it follows the load within a few hundred
passes (a second of decoding), the time scale of a burst of recoveries.
"""

from __future__ import annotations

import statistics
from collections import deque

from kvrs.errors import InvalidArgument

WINDOW_PASSES = 64
"""Recent passes the factor is the median of."""
MIN_PASSES = 8
"""Fewer timed passes than this: the factor is 1 (the profile as it is)."""
MAX_FACTOR = 16.0
"""The factor stays within [1 / MAX_FACTOR, MAX_FACTOR] (as the scheduler's corrections do)."""


class PassPace:
    """Measured / estimated seconds of the recent forward passes."""

    def __init__(self, window: int = WINDOW_PASSES, min_passes: int = MIN_PASSES) -> None:
        if window < 1 or not 1 <= min_passes <= window:
            raise InvalidArgument(
                "window", f"need 1 <= min_passes <= window, got {min_passes} and {window}"
            )
        self._ratios: deque[float] = deque(maxlen=window)
        self._min_passes = min_passes
        self._factor = 1.0

    def observe(self, measured_s: float, estimated_s: float) -> None:
        """One pass: what it took, and what the profile said it would."""
        if estimated_s <= 0.0 or measured_s <= 0.0:
            return
        self._ratios.append(measured_s / estimated_s)
        if len(self._ratios) >= self._min_passes:
            median = statistics.median(self._ratios)
            self._factor = min(MAX_FACTOR, max(1.0 / MAX_FACTOR, median))

    @property
    def factor(self) -> float:
        """Measured seconds per profile second (1 until `min_passes` passes were timed)."""
        return self._factor

    @property
    def passes(self) -> int:
        """Passes in the window."""
        return len(self._ratios)

    @property
    def measured(self) -> bool:
        """Whether enough passes were timed for `factor` to say anything."""
        return len(self._ratios) >= self._min_passes
