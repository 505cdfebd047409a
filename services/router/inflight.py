"""How many executed decisions the router is carrying out at once.

The router drives every pull and extend of a placement or a recovery, so it knows which
run side by side. A decision's measured time is stretched by the others it ran beside;
its outcome reports the most it ran beside (`target_jobs`), so the learning can tell a
slow transfer from a crowded cluster. All of the router's decisions count, not only those
on the same target: where workers share a host (the local cluster, compose) they share
its cores, and a burst of placements and recoveries on two decode workers slows both
alike; everywhere they share the router's own calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Share:
    """One decision under way: the most decisions it has run beside, itself included."""

    __slots__ = ("peak",)

    def __init__(self) -> None:
        self.peak = 1


class InFlight:
    """The decisions under way (see the module docstring)."""

    def __init__(self) -> None:
        self._live: list[Share] = []

    @contextlib.contextmanager
    def running(self) -> Iterator[Share]:
        """Counts one decision while the block runs; every decision under way sees the
        new count in its `peak`."""
        share = Share()
        live = self._live
        live.append(share)
        count = len(live)
        for other in live:
            if other.peak < count:
                other.peak = count
        try:
            yield share
        finally:
            live.remove(share)
