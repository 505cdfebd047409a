"""Sampling parameters and the per-position draws that make a sampled stream replayable."""

from __future__ import annotations

import pytest

from kvrs.errors import InvalidArgument
from kvrs.sampling import Sampling, seed_for, uniform


def test_a_draw_is_a_pure_function_of_seed_and_position():
    draws = [uniform(7, i) for i in range(1000)]
    assert draws == [uniform(7, i) for i in range(1000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == 1000
    assert draws != [uniform(8, i) for i in range(1000)]
    # Roughly uniform: each tenth of [0, 1) gets its share.
    counts = [sum(1 for u in draws if k / 10 <= u < (k + 1) / 10) for k in range(10)]
    assert min(counts) > 60 and max(counts) < 140


def test_a_request_without_a_seed_gets_one_from_its_id():
    assert seed_for("req-1") == seed_for("req-1") != seed_for("req-2")
    assert 0 < seed_for("") < 1 << 64


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"seed": -1}, "sampling.seed"),
        ({"seed": 1 << 64}, "sampling.seed"),
    ],
)
def test_bad_parameters_name_their_field(kwargs, field):
    with pytest.raises(InvalidArgument) as info:
        Sampling(**kwargs)
    assert info.value.field == field


def test_greedy_is_temperature_zero_or_top_k_one():
    assert Sampling().greedy
    assert Sampling(temperature=0.8, top_k=1).greedy
    assert not Sampling(temperature=0.8).greedy
    assert Sampling.of(0.8, 0.0, 0, 3) == Sampling(0.8, 1.0, 0, 3)
