"""Reads a router `Generate` stream to its end: the one loop every caller of it shares.

The tokens are appended to a list the caller owns while they arrive, so a caller can
watch a stream's progress (kill a worker once it decodes, print it) while it runs.
"""

from __future__ import annotations

from typing import Any

import grpc

from kvrs.v1 import router_pb2


async def generate_into(
    router: Any, request: router_pb2.GenerateRequest, tokens: list[int], timeout_s: float
) -> tuple[router_pb2.GenerateSummary | None, grpc.aio.AioRpcError | None]:
    """Streams `request` through `router` (a RouterService stub), appending each token to
    `tokens`; returns the summary (None when the stream ended before it) and the error that
    ended the stream (None when it ended well). A token out of order is a broken stream,
    not a recoverable answer: ValueError."""
    summary = None
    try:
        async for message in router.Generate(request, timeout=timeout_s):
            if message.index >= 0:
                if message.index != len(tokens):
                    raise ValueError(
                        f"{request.request_id}: token index {message.index} after "
                        f"{len(tokens)} tokens"
                    )
                tokens.append(message.token_id)
            if message.HasField("summary"):
                summary = message.summary
    except grpc.aio.AioRpcError as exc:
        return summary, exc
    return summary, None
