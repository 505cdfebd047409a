"""The one status <-> error mapping of `kvrs.rpc`, both directions."""

from __future__ import annotations

import grpc
import pytest

from kvrs import errors
from kvrs.rpc import error_for_code, relayed, status_code, status_for_error

DOMAIN_ERRORS = [
    errors.NotFound("x"),
    errors.FailedPrecondition("x"),
    errors.ResourceExhausted("x"),
    errors.Unavailable("x"),
    errors.DeadlineExceeded("x"),
    errors.InvalidArgument("prompt_tokens", "must be > 0"),
]


@pytest.mark.parametrize("error", DOMAIN_ERRORS, ids=lambda e: type(e).__name__)
def test_a_domain_error_survives_the_round_trip_through_its_status(error):
    code, message = status_for_error(error)
    assert code == status_code(error)
    back = error_for_code(code, message, "server-0")
    assert type(back) is type(error)
    assert back.field == error.field
    assert "server-0" in str(back)


def test_invalid_argument_without_a_field_names_the_request():
    error = error_for_code(grpc.StatusCode.INVALID_ARGUMENT, "cannot be parsed")
    assert isinstance(error, errors.InvalidArgument) and error.field == "request"


def test_cancelled_is_unavailable_and_unknown_codes_keep_their_name():
    assert isinstance(error_for_code(grpc.StatusCode.CANCELLED, ""), errors.Unavailable)
    unknown = error_for_code(grpc.StatusCode.DATA_LOSS, "lost")
    assert type(unknown) is errors.KvrsError and str(unknown).startswith("DATA_LOSS: lost")


def test_an_unexpected_exception_maps_to_nothing():
    assert status_for_error(RuntimeError("bug")) is None


def test_a_relayed_refusal_is_a_failed_precondition_and_the_rest_is_kept():
    refusal = relayed(errors.InvalidArgument("ttl_s", "must be > 0"))
    assert isinstance(refusal, errors.FailedPrecondition) and "ttl_s" in str(refusal)
    assert isinstance(relayed(errors.NotFound("gone")), errors.FailedPrecondition)
    busy = errors.ResourceExhausted("no slot")
    assert relayed(busy) is busy
