"""Unit conversions, and the one place where bits (links) and bytes (KV caches) meet."""

from __future__ import annotations

import math

__all__ = [
    "BITS_PER_BYTE",
    "bps_to_gbps",
    "gbps_to_bps",
    "ms_to_s",
    "s_to_ms",
    "transfer_s",
]

BITS_PER_BYTE = 8
_BPS_PER_GBPS = 1e9
_MS_PER_S = 1e3


def gbps_to_bps(gbps: float) -> float:
    """Gigabits per second (decimal, as link speeds are quoted) to bits per second."""
    return gbps * _BPS_PER_GBPS


def bps_to_gbps(bps: float) -> float:
    """Bits per second to gigabits per second."""
    return bps / _BPS_PER_GBPS


def ms_to_s(ms: float) -> float:
    """Milliseconds to seconds."""
    return ms / _MS_PER_S


def s_to_ms(s: float) -> float:
    """Seconds to milliseconds."""
    return s * _MS_PER_S


def transfer_s(kv_bytes: float, bandwidth_bps: float, rtt_s: float = 0.0) -> float:
    """Seconds to move `kv_bytes` over a link of `bandwidth_bps`: rtt + 8·bytes / bps.

    Link speeds are quoted in bits, KV sizes in bytes; every conversion between the two
    goes through `BITS_PER_BYTE` (never a literal 8), so a bits/bytes mix-up, the 8× error
    of the published formula, has one place to hide and a test on it. A non-positive
    bandwidth means the bytes never arrive: infinity.
    """
    if bandwidth_bps <= 0.0:
        return math.inf if kv_bytes > 0 else rtt_s
    return rtt_s + BITS_PER_BYTE * kv_bytes / bandwidth_bps
