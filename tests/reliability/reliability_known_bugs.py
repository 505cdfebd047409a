"""Inputs that reach a known, reported bug; property tests leave them out.

Each predicate has a strict-xfail regression test next to the property it guards: when
the bug is fixed the regression test passes, fails as XPASS, and the predicate and its
`assume(...)` go away with the xfail marker.
"""

from __future__ import annotations

from reliability_stack import MODEL

from kvrs.model import model_spec

INT64_MAX = 2**63 - 1
KV_BYTES_PER_TOKEN = model_spec(MODEL).kv_bytes_per_token
DECODE_IDS = frozenset({"decode-0", "decode-1", "decode-2"})


def kv_bytes_overflow(tokens: int) -> bool:
    """Token counts whose KV size does not fit the int64 `kv_bytes` reply field: the reply
    cannot be serialised and the call fails INTERNAL (no upper bound on token counts in
    services/cost_oracle/estimates.py and services/scheduler/decisions.py)."""
    return tokens > 0 and tokens * KV_BYTES_PER_TOKEN > INT64_MAX


def recover_source_is_decode(source_id: str) -> bool:
    """A Recover whose source_prefill_instance_id names a decode instance may plan MIGRATE
    from that instance to itself; the slot broker refuses src == dst with INVALID_ARGUMENT
    and the scheduler turns that into INTERNAL (services/scheduler/peers.py reserve)."""
    return source_id in DECODE_IDS
