"""The server interceptor every kvrs server shares: exceptions become status codes.

    request bytes that do not parse    -> INVALID_ARGUMENT ("request: cannot be parsed as ...")
    KvrsError, a peer's AioRpcError    -> `kvrs.rpc.status_for_error` (the one mapping)
    redis ConnectionError/TimeoutError -> UNAVAILABLE   ("redis unreachable")
    a Redis Cluster mid-failover       -> UNAVAILABLE   ("redis cluster unavailable")
    anything else                      -> INTERNAL with a generic message; traceback logged

Servicers raise domain errors; they never build status codes themselves.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import redis.exceptions

from kvrs.rpc import status_for_error

log = logging.getLogger(__name__)


_FAILING_OVER = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,
)
"""What a Redis Cluster answers while a primary fails over (slots unserved, a key's slot
migrating, a write reaching a primary just demoted): transient, so a caller retries."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status and message an exception maps to; None when it is unexpected."""
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, f"redis unreachable: {exc}"
    if isinstance(exc, _FAILING_OVER):
        return grpc.StatusCode.UNAVAILABLE, f"redis cluster unavailable: {exc}"
    return status_for_error(exc)


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    mapped = status_for(exc)
    if mapped is None:
        log.exception("unexpected error in %s", method)
        mapped = (grpc.StatusCode.INTERNAL, f"internal error in {method}; see server log")
    else:
        log.debug("%s -> %s: %s", method, mapped[0].name, mapped[1])
    code, message = mapped
    await context.abort(code, message)


class _Unparsable:
    """What a request that failed to parse becomes, so the handler can refuse it: grpc
    itself would answer a deserialiser's exception with UNKNOWN and the exception's class."""

    def __init__(self, message_name: str, error: Exception) -> None:
        self.details = f"request: cannot be parsed as {message_name}: {error}"


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The handler's deserialiser, returning an `_Unparsable` instead of raising."""
    if deserializer is None:
        return None
    message_type = getattr(deserializer, "__self__", None)
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    message_name = descriptor.full_name if descriptor is not None else "the request message"

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bytes
            return _Unparsable(message_name, exc)

    return deserialize


async def _refuse_unparsable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Unparsable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str):
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_unparsable(request, context)
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped or logged with traceback
            await _abort_for(exc, context, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str):
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _refuse_unparsable(request, context)
        try:
            result = behavior(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:
                await result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped or logged with traceback
            await _abort_for(exc, context, method)

    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a servicer into precise status codes (see module doc)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
