"""CostOracleService under hostile input: clean, named refusals and finite answers."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from reliability_stack import KNOWN_IDS, assert_serving, call
from reliability_strategies import PROPERTY_SETTINGS, id_lists, ids, int64s, mutated

from kvrs.v1 import oracle_pb2, oracle_pb2_grpc

pytestmark = pytest.mark.filterwarnings(
    # The servers' span ids come from the global `random` while Hypothesis draws.
    "ignore:Do not use the `random` module inside strategies"
)

IDS = ids(KNOWN_IDS)


@pytest.fixture(scope="module")
def stub(plane):
    channel = plane.channel("cost-oracle")
    stub = oracle_pb2_grpc.CostOracleServiceStub(channel)
    yield stub
    assert_serving(channel, "kvrs.v1.CostOracleService")
    still_answers(stub)
    channel.close()


def still_answers(stub) -> None:
    reply = stub.EstimateTransfer(
        oracle_pb2.EstimateTransferRequest(
            src_instance_id="prefill-0", dst_instance_id="decode-0", tokens=1024
        ),
        timeout=10,
    )
    assert reply.estimate.transfer_s > 0


@PROPERTY_SETTINGS
@given(
    request=mutated(
        oracle_pb2.EstimateTransferRequest(
            src_instance_id="prefill-0", dst_instance_id="decode-1", tokens=2048
        ),
        {"src_instance_id": IDS, "dst_instance_id": IDS, "kv_bytes": int64s(), "tokens": int64s()},
    )
)
def test_estimate_transfer(stub, request):
    reply = call(stub.EstimateTransfer, request)
    if reply is not None:
        assert reply.estimate.transfer_s >= 0


@PROPERTY_SETTINGS
@given(
    request=mutated(
        oracle_pb2.GetCostMatrixRequest(
            prefill_instance_ids=["prefill-0"],
            decode_instance_ids=["decode-0", "decode-2"],
            tokens=512,
        ),
        {
            "prefill_instance_ids": id_lists(KNOWN_IDS),
            "decode_instance_ids": id_lists(KNOWN_IDS),
            "kv_bytes": int64s(),
            "tokens": int64s(),
        },
    )
)
def test_get_cost_matrix(stub, request):
    reply = call(stub.GetCostMatrix, request)
    if reply is not None:
        assert all(len(row.to_decode) == len(reply.decode_instance_ids) for row in reply.rows)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        oracle_pb2.EstimateComputeRequest(cached_tokens=100, new_tokens=10),
        {"cached_tokens": int64s(), "new_tokens": int64s()},
    )
)
def test_estimate_compute(stub, request):
    reply = call(stub.EstimateCompute, request)
    if reply is not None:
        assert reply.compute_s >= 0 and reply.kv_bytes > 0


@pytest.mark.parametrize(
    "method, request_, field",
    [
        (
            "EstimateTransfer",
            oracle_pb2.EstimateTransferRequest(
                src_instance_id="prefill-0", dst_instance_id="decode-0", tokens=2**62
            ),
            "tokens",
        ),
        ("GetCostMatrix", oracle_pb2.GetCostMatrixRequest(tokens=2**62), "tokens"),
        (
            "EstimateCompute",
            oracle_pb2.EstimateComputeRequest(cached_tokens=2**62, new_tokens=1),
            "cached_tokens",
        ),
        (
            "EstimateCompute",
            oracle_pb2.EstimateComputeRequest(cached_tokens=10_000_000, new_tokens=1),
            "new_tokens",
        ),
    ],
)
def test_huge_token_counts_are_invalid_argument(stub, method, request_, field):
    with pytest.raises(grpc.RpcError) as failure:
        getattr(stub, method)(request_, timeout=10)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
    assert failure.value.details().startswith(f"{field}:"), failure.value.details()
