"""Instances this router just found unreachable, left out of its next placements.

A killed decode worker's streams break at once, but gossip suspects it only once its
TTL runs out, up to one TTL later; until then the scheduler still counts it among the
candidates, and a request placed there fails its pull and is recovered. The router that
saw the break leaves the instance out of its own SelectDecode calls for one of the
instance's TTLs: by then gossip has suspected a dead instance (and keeps everyone's new
work off it) or a live one has gone on beating. Nothing is declared: gossip's
confirmation stays the only judge of a failure, and a live instance is avoided by this
router alone, for one TTL at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_HOLD_S = 2.0
"""How long an instance whose TTL the router does not know is avoided (gossip's default TTL)."""


class Unreachable:
    """Instance ids, each until its hold runs out."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until_s: dict[str, float] = {}

    def note(self, instance_id: str, hold_s: float) -> None:
        """Avoid `instance_id` for `hold_s` from now (a later note extends it)."""
        until_s = self._clock() + hold_s
        self._until_s[instance_id] = max(until_s, self._until_s.get(instance_id, until_s))

    def current(self) -> frozenset[str]:
        """The ids still held."""
        now_s = self._clock()
        for instance_id in [i for i, until_s in self._until_s.items() if until_s <= now_s]:
            del self._until_s[instance_id]
        return frozenset(self._until_s)
