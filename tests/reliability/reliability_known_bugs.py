"""Inputs that reach a known, reported bug; property tests leave them out.

Each predicate has a strict-xfail regression test next to the property it guards: when
the bug is fixed the regression test passes, fails as XPASS, and the predicate and its
`assume(...)` go away with the xfail marker.
"""

from __future__ import annotations

DECODE_IDS = frozenset({"decode-0", "decode-1", "decode-2"})


def recover_source_is_decode(source_id: str) -> bool:
    """A Recover whose source_prefill_instance_id names a decode instance may plan MIGRATE
    from that instance to itself; the slot broker refuses src == dst with INVALID_ARGUMENT
    and the scheduler turns that into INTERNAL (services/scheduler/peers.py reserve)."""
    return source_id in DECODE_IDS
