"""Admission by deadline: refuse at once a request the cluster would finish too late.

The rule needs no limit picked by hand. The cluster's delivery rate is measured, in
tokens streamed per second over the last few seconds. The requests in flight share it;
admitted now, a request of `n` new tokens gets about an equal share:

    expected_s = n * (in_flight + 1) / tokens_per_s

When that is longer than the time its deadline leaves, the request would end late
anyway. Admitting it would also slow every stream already running. Refused at once, it
costs the cluster nothing, and its client can retry later or elsewhere.

The rate follows faults: a killed instance's streams stall and the rate falls, while
requests keep arriving and the in-flight count grows, so `expected_s` rises as the backlog
builds. Recovered capacity brings it down again. When nothing was delivered in the
whole window (an idle cluster, or one whose every stream has stalled that long) there is
no rate to judge by, and every request is admitted.

An equal share is an estimate. A decode batch's step time grows with the batch, so each
stream gets somewhat less than this; the prefill and the first token's wait are not
counted. Both make the rule lenient: it refuses only requests that are already late by
this lower bound.
"""

from __future__ import annotations

from collections import deque

DELIVERY_WINDOW_S = 10.0
"""How far back the delivery rate looks: long enough to ride over one stalled stream,
short enough to follow a lost instance within seconds."""
BUCKET_S = 0.25
"""Tokens are counted in buckets this wide, so the meter's memory stays bounded."""
MIN_SPAN_S = 1.0
"""A rate measured over less than this is taken over this much time instead, so the
first tokens of a run do not read as a burst."""


class DeliveryRate:
    """Tokens delivered per second over the last `window_s` (monotonic clock)."""

    def __init__(self, window_s: float = DELIVERY_WINDOW_S) -> None:
        if window_s < MIN_SPAN_S:
            raise ValueError(f"window_s must be >= {MIN_SPAN_S}, got {window_s}")
        self.window_s = window_s
        self._buckets: deque[list[float]] = deque()  # [bucket start s, tokens]
        self._first_s: float | None = None

    def add(self, now_s: float, tokens: int = 1) -> None:
        self._trim(now_s)
        if not self._buckets:
            # The first tokens after a silence start a new measurement: averaged over the
            # whole window, a busy second after an idle minute would read as a trickle.
            self._first_s = now_s
        start_s = now_s - now_s % BUCKET_S
        if self._buckets and self._buckets[-1][0] == start_s:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([start_s, float(tokens)])

    def per_s(self, now_s: float) -> float:
        """0.0 when nothing was delivered in the window: no rate to judge by."""
        self._trim(now_s)
        if not self._buckets or self._first_s is None:
            return 0.0
        span_s = max(MIN_SPAN_S, min(self.window_s, now_s - self._first_s))
        return sum(tokens for _, tokens in self._buckets) / span_s

    def _trim(self, now_s: float) -> None:
        while self._buckets and self._buckets[0][0] + BUCKET_S <= now_s - self.window_s:
            self._buckets.popleft()


def expected_duration_s(new_tokens: int, in_flight: int, tokens_per_s: float) -> float:
    """How long `new_tokens` take with an equal share of `tokens_per_s` among the
    `in_flight` requests and this one; inf without a rate."""
    if tokens_per_s <= 0.0:
        return float("inf")
    return new_tokens * (in_flight + 1) / tokens_per_s


def admits(new_tokens: int, in_flight: int, tokens_per_s: float, time_left_s: float) -> bool:
    """Whether a request with `time_left_s` to its deadline is worth starting (see the
    module doc): always, with nothing else in flight or no rate measured yet."""
    if in_flight == 0 or tokens_per_s <= 0.0:
        return True
    return expected_duration_s(new_tokens, in_flight, tokens_per_s) <= time_left_s
