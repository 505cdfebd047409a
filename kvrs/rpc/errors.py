"""The one mapping between `kvrs.errors` and gRPC status codes, in both directions.

Server side, an exception raised by a handler becomes a status (`status_for_error`)::

    KvrsError (kvrs.errors)            -> its own `code` (INVALID_ARGUMENT, NOT_FOUND, ...)
    grpc.aio.AioRpcError from a peer   -> the peer's code when it means the same to our
                                          caller (UNAVAILABLE, DEADLINE_EXCEEDED, ...)
    anything else                      -> None: the caller answers INTERNAL

Client side, a failed call becomes the `KvrsError` its status stands for (`error_from_rpc`)::

    INVALID_ARGUMENT "field: message"  -> InvalidArgument(field, message)
    NOT_FOUND, FAILED_PRECONDITION,
    RESOURCE_EXHAUSTED, UNAVAILABLE,
    DEADLINE_EXCEEDED                  -> the subclass carrying that code
    CANCELLED                          -> Unavailable (the peer went away mid-call)
    anything else                      -> KvrsError("CODE: details")

A service that relays a peer's failure to its own caller passes it through `relayed`:
the peer's refusal (bad input, unknown name) is a state the caller cannot fix by
changing its own request, so it reaches them as FailedPrecondition.
"""

from __future__ import annotations

import grpc

from kvrs import errors

__all__ = ["error_for_code", "error_from_rpc", "relayed", "status_code", "status_for_error"]

_ERRORS_BY_CODE: dict[grpc.StatusCode, type[errors.KvrsError]] = {
    grpc.StatusCode[cls.code]: cls
    for cls in (
        errors.NotFound,
        errors.FailedPrecondition,
        errors.ResourceExhausted,
        errors.Unavailable,
        errors.DeadlineExceeded,
    )
}
_ERRORS_BY_CODE[grpc.StatusCode.CANCELLED] = errors.Unavailable

_PEER_CODES_PASSED_THROUGH = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def status_code(error: errors.KvrsError) -> grpc.StatusCode:
    """The status a domain error is answered with."""
    return grpc.StatusCode[error.code]


def status_for_error(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status and message an exception maps to; None when it is unexpected."""
    if isinstance(exc, errors.KvrsError):
        return status_code(exc), str(exc)
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _PEER_CODES_PASSED_THROUGH:
        return exc.code(), f"peer: {exc.details()}"
    return None


def error_for_code(code: grpc.StatusCode, details: str, origin: str = "") -> errors.KvrsError:
    """The `kvrs.errors` exception a status stands for; `origin` (the server) ends the message."""
    details = details or code.name
    suffix = f" (from {origin})" if origin else ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, message = details.partition(": ")
        if sep and field and " " not in field:
            return errors.InvalidArgument(field, f"{message}{suffix}")
        return errors.InvalidArgument("request", f"{details}{suffix}")
    cls = _ERRORS_BY_CODE.get(code)
    if cls is None:
        return errors.KvrsError(f"{code.name}: {details}{suffix}")
    return cls(f"{details}{suffix}")


def error_from_rpc(exc: grpc.aio.AioRpcError, origin: str = "") -> errors.KvrsError:
    """The `kvrs.errors` exception a failed RPC stands for (see the module doc)."""
    return error_for_code(exc.code(), exc.details() or "", origin)


def relayed(error: errors.KvrsError) -> errors.KvrsError:
    """`error` as this service's caller sees it: a peer's refusal is FailedPrecondition,
    never the peer's own INVALID_ARGUMENT (the field it names is not the caller's)."""
    if isinstance(error, errors.InvalidArgument | errors.NotFound):
        return errors.FailedPrecondition(str(error))
    return error
