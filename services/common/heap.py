"""The garbage collector's settings for a long-running service: fewer, shorter pauses.

A decision service keeps a large heap that lives for as long as it runs (its view of
thousands of instances, the link estimates, the priced paths) and replaces a slice of it
at every refresh. Under CPython's default thresholds (700, 10, 10) the replaced slices
trigger a full collection every few seconds, and each one walks every object: at 4,096
instances a scheduler paused for 125-433 ms (gen2) and 30-94 ms (gen1) several times a
minute, which is what its view age and SelectDecode latency showed at p99.

`settle_heap`, called once a service serves, collects once and freezes what survived
(modules, the first view: never garbage, and no longer walked by any collection), then
raises the thresholds: a young collection every `YOUNG_ALLOCATIONS` allocations, full
ones rarely. The short-lived cycles asyncio and gRPC leave still die young.
"""

from __future__ import annotations

import gc

YOUNG_ALLOCATIONS = 50_000
"""Allocations (less deallocations) between two young collections (CPython: 700)."""
THRESHOLDS = (YOUNG_ALLOCATIONS, 20, 100)
"""gc.set_threshold: young collections per middle one, middle ones per full one (the
full one also waits for the long-lived objects to grow by a quarter)."""


def settle_heap() -> None:
    """Freeze what startup built and raise the collection thresholds (see module doc)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
