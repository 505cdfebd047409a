"""The router's count of decisions carried out side by side on one target."""

from __future__ import annotations

from services.router.inflight import InFlight


def test_each_decision_keeps_the_most_it_ran_beside_on_its_target() -> None:
    inflight = InFlight()
    with inflight.running("d0") as first:
        assert first.peak == 1
        with inflight.running("d0") as second, inflight.running("d1") as elsewhere:
            with inflight.running("d0") as third:
                assert (first.peak, second.peak, third.peak) == (3, 3, 3)
            assert elsewhere.peak == 1
        # Those that ended no longer count; the peak stays.
        with inflight.running("d0") as late:
            assert late.peak == 2
        assert first.peak == 3


def test_a_failed_decision_stops_counting() -> None:
    inflight = InFlight()
    try:
        with inflight.running("d0"):
            raise RuntimeError("pull failed")
    except RuntimeError:
        pass
    with inflight.running("d0") as after:
        assert after.peak == 1
