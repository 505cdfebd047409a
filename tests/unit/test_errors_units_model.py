"""Errors carry status code names; units never mix bits and bytes; KV sizes of the presets."""

from __future__ import annotations

import pytest

from kvrs import errors
from kvrs.model import MODEL_PRESETS, ModelSpec, model_spec
from kvrs.units import bps_to_gbps, gbps_to_bps, ms_to_s, s_to_ms, transfer_s


def test_every_error_names_a_grpc_status_code() -> None:
    expected = {
        errors.KvrsError: "INTERNAL",
        errors.InvalidArgument: "INVALID_ARGUMENT",
        errors.NotFound: "NOT_FOUND",
        errors.FailedPrecondition: "FAILED_PRECONDITION",
        errors.ResourceExhausted: "RESOURCE_EXHAUSTED",
        errors.Unavailable: "UNAVAILABLE",
        errors.DeadlineExceeded: "DEADLINE_EXCEEDED",
    }
    for cls, code in expected.items():
        assert cls.code == code
        assert issubclass(cls, errors.KvrsError)


def test_invalid_argument_names_the_field() -> None:
    err = errors.InvalidArgument("prompt_tokens", "must be >= 0")
    assert err.field == "prompt_tokens"
    assert str(err) == "prompt_tokens: must be >= 0"


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidArgument("policy", "bad parameters"),
        errors.Unavailable("redis is down", field="redis_url"),
        errors.KvrsError("plain"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_error_crosses_a_process_boundary_as_itself(error) -> None:
    """A simulator run in a child process (-j) that fails hands its parent the error,
    which pickling must rebuild whatever the subclass's constructor takes."""
    import pickle

    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert (again.field, again.message, str(again)) == (error.field, error.message, str(error))


def test_unit_conversions_round_trip() -> None:
    assert gbps_to_bps(25) == 25e9
    assert bps_to_gbps(25e9) == 25
    assert ms_to_s(1.5) == 0.0015
    assert s_to_ms(0.25) == 250


def test_transfer_counts_bits_not_bytes() -> None:
    # 1 GB over 8 Gbit/s is one second, not one eighth of a second.
    assert transfer_s(1e9, 8e9) == pytest.approx(1.0)
    assert transfer_s(1e9, 8e9, rtt_s=0.01) == pytest.approx(1.01)
    assert transfer_s(1, 0.0) == float("inf")
    assert transfer_s(0, 0.0, rtt_s=0.002) == 0.002


def test_opt13b_kv_bytes_per_token() -> None:
    assert model_spec("opt-13b").kv_bytes_per_token == 819_200


def test_opt13b_1477_tokens_is_1_21_gb() -> None:
    assert model_spec("opt-13b").kv_bytes(1477) == pytest.approx(1.21e9, rel=1e-3)


def test_llama70b_one_token() -> None:
    assert model_spec("llama3-70b").kv_bytes(1) == 327_680


def test_other_presets() -> None:
    assert MODEL_PRESETS["llama3-8b"].kv_bytes_per_token == 131_072
    assert MODEL_PRESETS["opt-125m"].kv_bytes_per_token == 36_864
    assert MODEL_PRESETS["tiny"].kv_bytes_per_token == 2 * 2 * 2 * 16 * 8


def test_unknown_model_names_the_field() -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        model_spec("gpt-17")
    assert info.value.field == "model"
    assert "gpt-17" in str(info.value)


def test_negative_tokens_rejected() -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        model_spec("opt-13b").kv_bytes(-1)
    assert info.value.field == "tokens"


def test_model_spec_rejects_bad_shape() -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        ModelSpec("bad", layers=0, kv_heads=1, head_dim=1, dtype_bytes=2)
    assert info.value.field == "layers"
