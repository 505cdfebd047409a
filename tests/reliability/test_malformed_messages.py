"""Bytes that are not a valid protobuf message: a clean refusal, and the server stays up."""

from __future__ import annotations

import grpc
import pytest
from reliability_stack import assert_serving

NOT_UTF8 = b"\x0a\x02\xff\xfe"
"""Field 1 (a string in each request below) holding invalid UTF-8: parsing fails."""

METHODS = (
    ("gossip", "/kvrs.v1.GossipService/RegisterNode"),
    ("slot-broker", "/kvrs.v1.SlotBrokerService/ReserveSlot"),
    ("cost-oracle", "/kvrs.v1.CostOracleService/EstimateTransfer"),
    ("scheduler", "/kvrs.v1.SchedulerService/SelectDecode"),
    ("scheduler", "/kvrs.v1.SchedulerService/Recover"),
)


@pytest.mark.parametrize("service, method", METHODS)
def test_unparsable_request_is_invalid_argument(plane, service, method):
    channel = plane.channel(service)
    raw = channel.unary_unary(method)  # no serialiser: the bytes go out as they are
    try:
        with pytest.raises(grpc.RpcError) as failure:
            raw(NOT_UTF8, timeout=10)
        assert_serving(channel)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            f"{failure.value.code().name}: {failure.value.details()}"
        )
        assert failure.value.details().startswith("request:"), failure.value.details()
        assert failure.value.details().startswith("request: cannot be parsed as kvrs.v1.")
    finally:
        channel.close()


@pytest.mark.parametrize("service, method", METHODS)
def test_unparsable_request_leaves_the_server_serving(plane, service, method):
    channel = plane.channel(service)
    raw = channel.unary_unary(method)
    try:
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as failure:
                raw(NOT_UTF8, timeout=10)
            assert failure.value.code() != grpc.StatusCode.OK
        assert_serving(channel)
    finally:
        channel.close()
