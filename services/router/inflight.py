"""How many executed decisions a worker is carrying out at once, as the router sees them.

The router drives every pull and extend of a placement or a recovery, so it knows which
run side by side on one target. A decision's measured time is stretched by the others it
shared the worker with; its outcome reports the most it shared with (`target_jobs`), so
the learning can tell a slow transfer from a crowded worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Share:
    """One decision under way on a target: the most decisions it has run beside, itself
    included."""

    __slots__ = ("peak",)

    def __init__(self) -> None:
        self.peak = 1


class InFlight:
    """The decisions under way per target (see the module docstring)."""

    def __init__(self) -> None:
        self._live: dict[str, list[Share]] = {}

    @contextlib.contextmanager
    def running(self, target_id: str) -> Iterator[Share]:
        """Counts one decision on `target_id` while the block runs; every decision there
        sees the new count in its `peak`."""
        share = Share()
        live = self._live.setdefault(target_id, [])
        live.append(share)
        count = len(live)
        for other in live:
            if other.peak < count:
                other.peak = count
        try:
            yield share
        finally:
            live.remove(share)
            if not live:
                del self._live[target_id]
