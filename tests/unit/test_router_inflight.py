"""The router's count of the decisions it carries out side by side."""

from __future__ import annotations

import pytest

from services.router.inflight import InFlight


def test_each_decision_keeps_the_most_it_ran_beside() -> None:
    inflight = InFlight()
    with inflight.running() as first:
        assert first.peak == 1
        with inflight.running() as second:
            with inflight.running() as third:
                assert (first.peak, second.peak, third.peak) == (3, 3, 3)
        # Those that ended no longer count; the peak stays.
        with inflight.running() as late:
            assert late.peak == 2
        assert first.peak == 3


def test_a_failed_decision_stops_counting() -> None:
    inflight = InFlight()
    with pytest.raises(RuntimeError), inflight.running():
        raise RuntimeError("pull failed")
    with inflight.running() as after:
        assert after.peak == 1
