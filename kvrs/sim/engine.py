"""A deterministic discrete-event loop: a heap of (time, sequence) ordered callbacks."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    """Runs callbacks in time order; equal times run in scheduling order.

    The sequence number breaks ties, so two runs that schedule the same events in the
    same order replay identically (no dependence on callback identity or hashing).
    Cancellation is lazy: a cancelled handle stays in the heap and is skipped when popped,
    which keeps `cancel` O(1) for the many rescheduled flow completions.
    """

    __slots__ = ("now_s", "_heap", "_seq", "_cancelled", "events_run")

    def __init__(self) -> None:
        self.now_s = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self._cancelled: set[int] = set()
        self.events_run = 0

    def at(self, time_s: float, callback: Callable[..., Any], *args: Any) -> int:
        """Schedule `callback(*args)` at absolute `time_s` (never before now); returns a handle."""
        self._seq += 1
        heapq.heappush(self._heap, (max(time_s, self.now_s), self._seq, callback, args))
        return self._seq

    def after(self, delay_s: float, callback: Callable[..., Any], *args: Any) -> int:
        """Schedule `callback(*args)` `delay_s` seconds from now; returns a handle."""
        return self.at(self.now_s + delay_s, callback, *args)

    def cancel(self, handle: int) -> None:
        """Forget a scheduled callback; cancelling one that already ran is harmless."""
        if handle:
            self._cancelled.add(handle)

    def run(self, until_s: float = float("inf")) -> None:
        """Run events up to and including `until_s` (all of them by default)."""
        heap = self._heap
        cancelled = self._cancelled
        pop = heapq.heappop
        while heap and heap[0][0] <= until_s:
            time_s, seq, callback, args = pop(heap)
            if cancelled and seq in cancelled:
                cancelled.discard(seq)
                continue
            self.now_s = time_s
            self.events_run += 1
            callback(*args)
        if until_s != float("inf") and until_s > self.now_s:
            self.now_s = until_s

    @property
    def pending(self) -> int:
        """Events still queued (cancelled ones included until popped)."""
        return len(self._heap)
