"""Work deferred until a real gRPC reply is sent (`services.scheduler.after_reply`)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.scheduler.after_reply import after_reply, deferring

SERVICE = "kvrs.test.Deferred"


@pytest.fixture
async def server_and_started():
    started: list[str] = []
    seen_in_handler: list[list[str]] = []

    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        with deferring(context):
            after_reply(lambda: started.append(request.decode()))
            seen_in_handler.append(list(started))
            if request == b"fail":
                await context.abort(grpc.StatusCode.INTERNAL, "failed after promising")
        return request

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(handle)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Call": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel.unary_unary(f"/{SERVICE}/Call"), started, seen_in_handler
    finally:
        await channel.close()
        await server.stop(0)


async def _settle(started: list[str], count: int) -> None:
    for _ in range(100):
        if len(started) >= count:
            return
        await asyncio.sleep(0.01)


async def test_work_given_inside_an_rpc_starts_after_the_handler_not_during_it(server_and_started):
    call, started, seen_in_handler = server_and_started
    assert await call(b"a", timeout=5) == b"a"
    await _settle(started, 1)
    assert seen_in_handler == [[]], "started while the handler was still running"
    assert started == ["a"]


async def test_work_promised_by_a_failed_rpc_still_starts(server_and_started):
    call, started, _ = server_and_started
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call(b"fail", timeout=5)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    await _settle(started, 1)
    assert started == ["fail"]


def test_work_given_outside_an_rpc_starts_at_once():
    started: list[int] = []
    after_reply(lambda: started.append(1))
    assert started == [1]
