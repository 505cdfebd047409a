"""Admission by deadline (`kvrs.admission`): the delivery rate and the rule built on it."""

from __future__ import annotations

import math

import pytest

from kvrs.admission import DeliveryRate, admits, expected_duration_s


def test_the_rate_is_the_tokens_of_the_window_over_its_length():
    rate = DeliveryRate(window_s=10.0)
    for i in range(200):  # 20 tokens/s for 10 s
        rate.add(i * 0.05)
    assert rate.per_s(10.0) == pytest.approx(20.0, rel=0.05)


def test_tokens_older_than_the_window_no_longer_count():
    rate = DeliveryRate(window_s=10.0)
    rate.add(0.0, tokens=1000)
    rate.add(5.0, tokens=10)
    assert rate.per_s(12.0) == pytest.approx(1.0)
    assert rate.per_s(30.0) == 0.0


def test_a_young_meter_measures_over_its_own_age_not_the_whole_window():
    rate = DeliveryRate(window_s=10.0)
    rate.add(100.0, tokens=30)
    rate.add(102.0, tokens=30)
    assert rate.per_s(103.0) == pytest.approx(20.0)  # 60 tokens in 3 s, not in 10


def test_the_first_tokens_of_a_run_do_not_read_as_a_burst():
    rate = DeliveryRate(window_s=10.0)
    rate.add(5.0, tokens=4)
    assert rate.per_s(5.01) == pytest.approx(4.0)  # over the minimum span of 1 s


def test_a_window_shorter_than_the_minimum_span_is_refused():
    with pytest.raises(ValueError, match="window_s"):
        DeliveryRate(window_s=0.5)


def test_each_request_in_flight_and_the_new_one_get_an_equal_share():
    assert expected_duration_s(48, in_flight=7, tokens_per_s=384.0) == pytest.approx(1.0)
    assert math.isinf(expected_duration_s(48, in_flight=7, tokens_per_s=0.0))


@pytest.mark.parametrize(
    ("new_tokens", "in_flight", "tokens_per_s", "time_left_s", "admitted"),
    [
        (48, 7, 384.0, 1.5, True),  # done in 1 s
        (48, 7, 384.0, 0.5, False),  # 1 s needed, 0.5 s left
        (4800, 0, 384.0, 0.5, True),  # nothing in flight: it runs alone, never refused
        (48, 7, 0.0, 0.5, True),  # no rate measured yet
        (48, 7, 384.0, -1.0, False),  # already past its deadline
    ],
)
def test_a_request_is_admitted_only_when_its_share_finishes_it_in_time(
    new_tokens, in_flight, tokens_per_s, time_left_s, admitted
):
    assert admits(new_tokens, in_flight, tokens_per_s, time_left_s) is admitted


def test_tokens_after_a_silence_are_measured_from_the_silences_end():
    rate = DeliveryRate(window_s=10.0)
    rate.add(0.0, tokens=100)
    rate.add(60.0, tokens=40)  # a minute idle, then a busy second
    assert rate.per_s(61.0) == pytest.approx(40.0)
