"""Migration slot leases as the scheduler sees them, and the broker interface it needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Lease:
    """A migration slot held at the slot broker for one request."""

    lease_id: str
    request_id: str
    holder_id: str
    src_id: str
    dst_id: str
    expires_unix_ms: int


class SlotBroker(Protocol):
    async def reserve(self, request_id: str, src_id: str, dst_id: str) -> Lease:
        """Raises ResourceExhausted when a cap is reached, Unavailable when unreachable."""
        ...

    async def free_slots(self) -> int:
        """Cluster-wide slots not leased now; raises Unavailable when unreachable."""
        ...
