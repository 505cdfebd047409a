"""Recent Recover decisions by request id, so a retried Recover reuses its decision and lease."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable


class RecentRecoveries:
    """Recover decisions of the last `ttl_s`, by request id, so a retry reuses its lease.

    Holds futures rather than results, so a retry arriving while the first call is still
    reserving its slot waits for that call instead of reserving a second slot.
    """

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[Hashable, float, asyncio.Future]] = OrderedDict()

    def get(self, request_id: str, call: Hashable) -> asyncio.Future | None:
        """The pending or finished decision of `request_id`, if it was asked with an equal
        `call` (the request and every argument of the Recover)."""
        self._expire()
        entry = self._entries.get(request_id)
        if entry is None or entry[0] != call:
            return None
        return entry[2]

    def put(self, request_id: str, call: Hashable, future: asyncio.Future) -> None:
        self._entries.pop(request_id, None)
        self._entries[request_id] = (call, self._clock(), future)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, request_id: str, future: asyncio.Future) -> None:
        entry = self._entries.get(request_id)
        if entry is not None and entry[2] is future:
            del self._entries[request_id]

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        while self._entries:
            _, (_, created_s, _) = next(iter(self._entries.items()))
            if created_s >= horizon:
                break
            self._entries.popitem(last=False)
