"""Domain errors of kvrs, each carrying the gRPC status code name services map it to.

Exception tree::

    KvrsError                      INTERNAL
    ├── InvalidArgument            INVALID_ARGUMENT     bad input; names the field
    ├── NotFound                   NOT_FOUND            unknown model, instance, link, policy
    ├── FailedPrecondition         FAILED_PRECONDITION  the cluster is not in a state to answer
    ├── ResourceExhausted          RESOURCE_EXHAUSTED   no slot, no KV memory left
    ├── Unavailable                UNAVAILABLE          a backing store or peer is down
    └── DeadlineExceeded           DEADLINE_EXCEEDED    the answer came too late to matter

The core never imports grpc: `code` is the *name* of a `grpc.StatusCode` member, so one
shared interceptor can map any `KvrsError` with `getattr(grpc.StatusCode, err.code)`.
"""

from __future__ import annotations

__all__ = [
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "KvrsError",
    "NotFound",
    "ResourceExhausted",
    "Unavailable",
]


class KvrsError(Exception):
    """Base of every kvrs domain error.

    `field` optionally names the input the error is about (the request field, the YAML
    key, the CLI flag), so a client can tell which of its values was rejected; when set,
    the message reads ``"{field}: {message}"``.
    """

    code: str = "INTERNAL"

    def __init__(self, message: str = "", *, field: str = "") -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    def __reduce__(self) -> tuple:
        # Pickled as its class and the two values every subclass carries, whatever order
        # its constructor takes them in (`InvalidArgument(field, message)`): an error
        # raised in a child process (a simulator run under -j) reaches the parent as
        # itself, not as a broken process pool.
        return _rebuild, (type(self), self.message, self.field)


def _rebuild(cls: type[KvrsError], message: str, field: str) -> KvrsError:
    error = cls.__new__(cls)
    KvrsError.__init__(error, message, field=field)
    return error


class InvalidArgument(KvrsError):
    """An input is malformed or out of range; `field` says which one."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message, field=field)


class NotFound(KvrsError):
    """A name (model, instance, link, policy) does not exist."""

    code = "NOT_FOUND"


class FailedPrecondition(KvrsError):
    """The request is valid but the cluster state cannot serve it (e.g. no candidates)."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(KvrsError):
    """A bounded resource (migration slots, KV memory) is used up."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(KvrsError):
    """A dependency (Redis, a peer service, a worker) cannot be reached; retry may help."""

    code = "UNAVAILABLE"


class DeadlineExceeded(KvrsError):
    """The operation did not finish before its deadline."""

    code = "DEADLINE_EXCEEDED"
