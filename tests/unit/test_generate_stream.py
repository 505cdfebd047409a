"""kvrs.rpc.generate: the order check of the shared Generate loop (pure logic; the loop
against a real router runs in tests/services/test_router.py)."""

from __future__ import annotations

import pytest

from kvrs.rpc.generate import generate_into
from kvrs.v1 import router_pb2


class Replayed:
    """A RouterService stand-in whose Generate streams the given messages."""

    def __init__(self, messages: list[router_pb2.GenerateResponse]) -> None:
        self.messages = messages

    def Generate(self, request, timeout):  # noqa: N802 - the stub's method name
        async def stream():
            for message in self.messages:
                yield message

        return stream()


def token(index: int, token_id: int) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(index=index, token_id=token_id)


async def test_tokens_land_in_the_callers_list_and_the_summary_is_returned():
    summary = router_pb2.GenerateResponse(
        index=-1, summary=router_pb2.GenerateSummary(generated_tokens=2)
    )
    tokens: list[int] = []
    got, error = await generate_into(
        Replayed([token(0, 7), token(1, 9), summary]),
        router_pb2.GenerateRequest(request_id="r"),
        tokens,
        5.0,
    )
    assert tokens == [7, 9] and error is None and got.generated_tokens == 2


async def test_a_token_out_of_order_is_a_broken_stream():
    tokens: list[int] = []
    with pytest.raises(ValueError, match="token index 2 after 1 tokens"):
        await generate_into(
            Replayed([token(0, 7), token(2, 9)]),
            router_pb2.GenerateRequest(request_id="r"),
            tokens,
            5.0,
        )
    assert tokens == [7]
