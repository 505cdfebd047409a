"""Compute profiles: the presets, monotone interpolation, quadratic extrapolation, and the
cost of a batched pass."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrs.errors import InvalidArgument
from kvrs.profile import (
    DECODE_PRESETS,
    BatchCost,
    ComputeProfile,
    compute_profile,
    decode_profile,
)

OPT13B = compute_profile("opt-13b")
# A noisy measured table: the 1024-token point is *below* the 512-token one.
NOISY_TABLE = (
    (16, 0.018),
    (128, 0.029),
    (512, 0.066),
    (1024, 0.060),
    (2048, 0.240),
    (4096, 0.520),
    (8192, 1.250),
)


def test_distserve_prefill_512() -> None:
    assert OPT13B.prefill_s(512) == pytest.approx(65.6e-3, abs=0.1e-3)


def test_distserve_decode_step_1_512() -> None:
    assert DECODE_PRESETS["opt-13b"].step_s(1, 512) == pytest.approx(20.3e-3, abs=0.1e-3)
    assert decode_profile("opt-13b") is DECODE_PRESETS["opt-13b"]


def test_opt125m_cpu_preset() -> None:
    assert compute_profile("opt-125m").prefill_s(512) == pytest.approx(0.116, rel=0.02)


def test_zero_tokens_cost_nothing() -> None:
    assert OPT13B.prefill_s(0) == 0.0
    assert OPT13B.extend_s(100, 0) == 0.0


def test_fit_recovers_coefficients() -> None:
    table = [(n, OPT13B.fit_s(n)) for n in (16, 64, 256, 512, 1024, 2048, 4096, 8192)]
    fitted = ComputeProfile.fit("opt-13b", table)
    assert fitted.a_s == pytest.approx(OPT13B.a_s, rel=1e-6)
    assert fitted.b_s_per_token == pytest.approx(OPT13B.b_s_per_token, rel=1e-6)
    assert fitted.c_s_per_token2 == pytest.approx(OPT13B.c_s_per_token2, rel=1e-6)


def test_fit_keeps_coefficients_non_negative() -> None:
    # Concave data would want c < 0; the constrained fit sets it to 0 instead.
    fitted = ComputeProfile.fit("x", [(100, 1.0), (1000, 5.0), (10000, 12.0)])
    assert min(fitted.a_s, fitted.b_s_per_token, fitted.c_s_per_token2) >= 0.0


@given(st.integers(1, 20_000), st.integers(1, 20_000))
def test_interpolation_is_monotone(x: int, y: int) -> None:
    profile = ComputeProfile.fit("noisy", NOISY_TABLE)
    lo, hi = min(x, y), max(x, y)
    assert profile.prefill_s(lo) <= profile.prefill_s(hi)


def test_interpolation_goes_through_measured_points() -> None:
    profile = ComputeProfile.fit("noisy", NOISY_TABLE)
    assert profile.prefill_s(512) == pytest.approx(0.066)
    assert profile.prefill_s(4096) == pytest.approx(0.520)
    # between 2048 and 4096: linear
    assert profile.prefill_s(3072) == pytest.approx((0.240 + 0.520) / 2)


def test_extrapolation_is_quadratic_not_flat_at_100k() -> None:
    profile = ComputeProfile.fit("noisy", NOISY_TABLE)
    last = profile.prefill_s(8192)
    at_50k, at_100k = profile.prefill_s(50_000), profile.prefill_s(100_000)
    assert at_100k > 10 * last
    # A quadratic more than doubles when L doubles (a linear model would exactly double).
    assert at_100k - last > 2.0 * (at_50k - last)
    fit_only = ComputeProfile(
        "noisy",
        a_s=profile.a_s,
        b_s_per_token=profile.b_s_per_token,
        c_s_per_token2=profile.c_s_per_token2,
    )
    assert at_100k == pytest.approx(last + fit_only.fit_s(100_000) - fit_only.fit_s(8192))


def test_extend_matches_prefill_from_zero_and_grows() -> None:
    profile = ComputeProfile.fit("noisy", NOISY_TABLE)
    for p in (OPT13B, profile):
        assert p.extend_s(0, 1477) == pytest.approx(p.prefill_s(1477))
        assert p.extend_s(1477, 10) < p.prefill_s(1487)
        assert p.extend_s(1477, 20) > p.extend_s(1477, 10) > 0.0


def test_extend_fit_formula() -> None:
    l0, g = 1000, 50
    expected = (
        OPT13B.a_s + OPT13B.b_s_per_token * g + OPT13B.c_s_per_token2 * ((l0 + g) ** 2 - l0**2)
    )
    assert OPT13B.extend_s(l0, g) == pytest.approx(expected)


def test_json_round_trip(tmp_path) -> None:
    profile = ComputeProfile.fit("noisy", NOISY_TABLE)
    assert ComputeProfile.from_json(profile.to_json()) == profile
    path = tmp_path / "profile.json"
    profile.save(path)
    assert ComputeProfile.load(path) == profile


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(InvalidArgument) as info:
        OPT13B.prefill_s(-5)
    assert info.value.field == "tokens"
    with pytest.raises(InvalidArgument) as info:
        compute_profile("nope")
    assert info.value.field == "model"
    with pytest.raises(InvalidArgument) as info:
        ComputeProfile("x", table=((10, 0.1), (5, 0.2)))
    assert info.value.field == "table[1]"
    with pytest.raises(InvalidArgument) as info:
        ComputeProfile.from_json({"model": "x", "a_s": "fast"})
    assert info.value.field == "a_s"


BATCH = BatchCost(a_s=2e-3, b_s_per_token=5e-5, c_s_per_token2=1e-8, d_s_per_sequence=3e-4)


def test_a_batch_is_priced_by_its_tokens_pairs_and_sequences() -> None:
    eight = [(0, 256)] * 8
    expected = 2e-3 + 5e-5 * 2048 + 1e-8 * 8 * 256 * 256 + 3e-4 * 8
    assert BATCH.batch_s(eight) == pytest.approx(expected)
    # One pass for eight prompts costs less than eight passes: the fixed cost is paid once.
    assert BATCH.batch_s(eight) < 8 * BATCH.batch_s([(0, 256)])
    # A decode step attends over its cached context.
    assert BATCH.batch_s([(1000, 1)]) > BATCH.batch_s([(10, 1)])
    assert BATCH.batch_s([]) == 0.0
    with pytest.raises(InvalidArgument) as info:
        BATCH.batch_s([(0, 0)])
    assert info.value.field == "new_tokens"


def test_the_batch_fit_recovers_the_terms_it_was_measured_with() -> None:
    shapes = [[(0, n)] * k for n in (16, 64, 256, 1024) for k in (1, 2, 8)]
    shapes += [[(c, 1)] * k for c in (64, 1024, 4096) for k in (1, 4, 16)]
    fitted = BatchCost.fit([(shape, BATCH.batch_s(shape)) for shape in shapes])
    for shape in shapes:
        assert fitted.batch_s(shape) == pytest.approx(BATCH.batch_s(shape), rel=1e-6)


def test_a_decode_step_pays_for_reading_every_sequences_cached_kv() -> None:
    """A step of long-context streams reads all their resident KV: priced per cached
    token, a term the dense attention of prefills (per pair) cannot stand in for, and
    which a calibration's decode passes alone pin down."""
    reading = BatchCost(
        a_s=5e-4, b_s_per_token=1e-5, c_s_per_token2=3e-8, e_s_per_cached_token=2e-7
    )
    steps = [(1500, 1)] * 32
    without = BatchCost(a_s=5e-4, b_s_per_token=1e-5, c_s_per_token2=3e-8)
    assert reading.batch_s(steps) == pytest.approx(without.batch_s(steps) + 2e-7 * 32 * 1500)
    # A prefill from scratch reads nothing cached: the same price with or without it.
    assert reading.batch_s([(0, 512)] * 2) == pytest.approx(without.batch_s([(0, 512)] * 2))
    shapes = [[(0, n)] * k for n in (16, 64, 256) for k in (1, 2, 8)]
    shapes += [[(c, 1)] * k for c in (16, 128, 1024) for k in (1, 4, 16, 32)]
    fitted = BatchCost.fit([(shape, reading.batch_s(shape)) for shape in shapes])
    assert fitted.e_s_per_cached_token == pytest.approx(2e-7, rel=1e-6)
    assert fitted.batch_s(steps) == pytest.approx(reading.batch_s(steps), rel=1e-6)
    # Profiles written before the term load without it.
    assert BatchCost.from_json({"a_s": 1e-3}).e_s_per_cached_token == 0.0
    assert BatchCost.from_json(reading.to_json()) == reading


def test_a_profile_without_batch_terms_prices_a_batch_with_its_single_pass_fit() -> None:
    old = ComputeProfile.from_json({"model": "opt-13b", "a_s": 1e-2, "b_s_per_token": 1e-4})
    assert old.batch is None
    assert old.batch_s([(0, 100)]) == pytest.approx(old.fit_s(100))
    measured = ComputeProfile("m", a_s=1e-2, batch=BATCH)
    assert ComputeProfile.from_json(measured.to_json()) == measured
    assert measured.batch_s([(0, 64)] * 2) == BATCH.batch_s([(0, 64)] * 2)
    with pytest.raises(InvalidArgument) as info:
        ComputeProfile.from_json({"model": "m", "batch": {"a_s": -1}})
    assert info.value.field == "batch.a_s"


def test_a_pass_costs_at_least_its_longest_piece_alone() -> None:
    """The batch fit prices many small pieces; one long piece is priced by the measured
    table when the fit would make it cheaper than that piece alone."""
    profile = ComputeProfile(
        "m", table=((256, 0.01), (1024, 0.2)), a_s=1e-3, c_s_per_token2=1e-7, batch=BATCH
    )
    small = [(0, 16)] * 8
    assert profile.pass_s(small) == BATCH.batch_s(small)
    long = [(64, 1000), (0, 1), (0, 1)]
    assert BATCH.batch_s(long) < profile.extend_s(64, 1000)
    assert profile.pass_s(long) == profile.extend_s(64, 1000)
    assert profile.pass_s([]) == 0.0
