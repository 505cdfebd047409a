"""Errors of a KV transfer, each a `kvrs.errors` class so services map them to status codes.

Exception tree::

    KvrsError (kvrs.errors)
    └── KvXferError                                       INTERNAL
        ├── ProtocolVersionMismatch  (FailedPrecondition) the peer speaks another version
        ├── LayoutMismatch           (FailedPrecondition) shapes/dtype differ from expected
        ├── PeerLost                 (Unavailable)        the peer died, closed or restarted
        ├── TransferTimeout          (DeadlineExceeded)   no progress within the timeout
        ├── ChecksumMismatch                              DATA_LOSS: payload corrupted
        ├── AuthenticationFailed                          UNAUTHENTICATED: the peer does
        │                                                 not hold the ticket's key
        └── TransferRejected                              the sender refused; `code` is its
                                                          own error's (e.g. NOT_FOUND)

`from_torch_error` maps the RuntimeErrors torch.distributed raises to the most specific
of these.
"""

from __future__ import annotations

from kvrs.errors import DeadlineExceeded, FailedPrecondition, KvrsError, Unavailable

__all__ = [
    "AuthenticationFailed",
    "ChecksumMismatch",
    "KvXferError",
    "LayoutMismatch",
    "PeerLost",
    "ProtocolVersionMismatch",
    "TransferRejected",
    "TransferTimeout",
    "from_torch_error",
]


class KvXferError(KvrsError):
    """Base of every transfer error; the transfer it names did not complete."""


class ProtocolVersionMismatch(KvXferError, FailedPrecondition):
    """The peer's wire format has another version; nothing after the preamble was decoded."""

    def __init__(self, local_version: int, peer_version: int, detail: str = "") -> None:
        self.local_version = local_version
        self.peer_version = peer_version
        text = f"peer speaks libkvxfer protocol {peer_version}, this process speaks {local_version}"
        super().__init__(f"{text} ({detail})" if detail else text)


class LayoutMismatch(KvXferError, FailedPrecondition):
    """The KV the sender describes is not the KV the receiver expects (model, dtype, range)."""


class PeerLost(KvXferError, Unavailable):
    """The peer process died, closed the pair, or restarted and lost the pair's state."""


class TransferTimeout(KvXferError, DeadlineExceeded):
    """An operation made no progress within the configured timeout; the pair was closed."""


class ChecksumMismatch(KvXferError):
    """A chunk's bytes do not match the checksum its sender computed."""

    code = "DATA_LOSS"


class AuthenticationFailed(KvXferError):
    """A message is not signed with the ticket's key: the peer that joined the pair is not
    the sender the ticket names (or the bytes were altered). Nothing it sent was admitted."""

    code = "UNAUTHENTICATED"


class TransferRejected(KvXferError):
    """The sender refused the transfer before any payload (unknown request, bad range...).

    `code` is the status code name of the sender's own error, so a receiver can report
    the cause faithfully (NOT_FOUND stays NOT_FOUND).
    """

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"sender rejected the transfer: {message}")


_PEER_GONE_MARKERS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "pair closure",
    "socket closed",
    "connection refused",
    "pair is closed",
)


def from_torch_error(exc: BaseException, during: str) -> KvXferError:
    """The transfer error a torch.distributed failure stands for.

    Gloo reports everything as RuntimeError; its messages are the only signal, so they
    are matched by substring (timeouts first: a timeout also closes the pair).
    """
    if isinstance(exc, KvXferError):
        return exc
    text = str(exc)
    lowered = text.lower()
    first_line = text.splitlines()[0] if text else type(exc).__name__
    if "timed out" in lowered or ("timeout" in lowered and "pair closure" not in lowered):
        return TransferTimeout(f"{during}: {first_line}")
    if any(marker in lowered for marker in _PEER_GONE_MARKERS):
        return PeerLost(f"{during}: {first_line}")
    # Any other transport failure leaves the pair unusable, which is what PeerLost means.
    return PeerLost(f"{during}: {type(exc).__name__}: {first_line}")
