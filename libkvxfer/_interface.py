"""The transfer interface, split by role: the side that holds KV and the side that wants it.

A transfer is pulled: the receiver (a decode worker) asks for a token range of a
request's KV, the sender (the prefill worker that holds it) pushes it. The sequence is

    receiver: ticket = prepare(...)            non-blocking, on the receiver
    caller:   hand `ticket` to the sender       any control channel (gRPC SendKv)
    sender:   send(ticket, kv)  |  reject(...)  blocking, on the sender
    receiver: recv(ticket)                      blocking, concurrently with send
    receiver: abandon(ticket)                   only when the sender will never see it

The blocking methods are plain calls meant for a worker thread; the `*_async` variants
run them on the implementation's own thread pool so an asyncio event loop never blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvrs.errors import KvrsError
from libkvxfer._types import (
    ChunkReady,
    KvLayers,
    KvLayout,
    KvPages,
    ReceivedKv,
    TransferStats,
    TransferTicket,
)

__all__ = ["KvReceiver", "KvSender"]


class KvSender(ABC):
    """The side that holds a request's KV (a prefill worker, or any worker after extend)."""

    @abstractmethod
    def send(
        self,
        ticket: TransferTicket,
        kv: KvLayers | KvPages,
        pacing_bps: float | None = None,
        ready: ChunkReady | None = None,
    ) -> TransferStats:
        """Push `kv` — exactly the ticket's token range, one (key, value) per layer, or
        the pages (blocks) that hold it.

        Called on the sender once the receiver's ticket arrives. Blocks until every
        chunk has been handed to the peer, layer by layer; joins the pair group first
        if this is the pair's first transfer. `pacing_bps` caps the rate (emulates a
        slower link). With `ready`, KV still being computed streams: each chunk goes
        once `ready(layer, token_end)` returns (a prefill computing layer by layer).
        Raises ProtocolVersionMismatch for a ticket of another version (before sending
        anything), PeerLost / TransferTimeout when the receiver goes away, and whatever
        `ready` raises (the receiver then sees the pair close).
        """

    @abstractmethod
    def reject(self, ticket: TransferTicket, error: KvrsError) -> None:
        """Tell the waiting receiver that this transfer will not happen, and why.

        Called instead of `send` when the sender cannot serve the ticket (unknown
        request, range beyond its KV). Blocks only to deliver the rejection; the
        receiver's `recv` raises TransferRejected carrying `error.code`.
        """

    @abstractmethod
    async def send_async(
        self,
        ticket: TransferTicket,
        kv: KvLayers | KvPages,
        pacing_bps: float | None = None,
        ready: ChunkReady | None = None,
    ) -> TransferStats:
        """`send` on a worker thread; awaiting it never blocks the event loop."""

    @abstractmethod
    async def reject_async(self, ticket: TransferTicket, error: KvrsError) -> None:
        """`reject` on a worker thread."""


class KvReceiver(ABC):
    """The side that wants a request's KV (a decode worker, a recovery target)."""

    @abstractmethod
    def prepare(
        self,
        sender_id: str,
        request_id: str,
        token_start: int,
        token_end: int,
        traceparent: str = "",
    ) -> TransferTicket:
        """A ticket for tokens [token_start, token_end) of `request_id` from `sender_id`.

        Called on the receiver before the sender is contacted. Never blocks: it picks the
        pair group generation and a tag; the group itself is built by `recv`.
        """

    @abstractmethod
    def recv(
        self, ticket: TransferTicket, layout: KvLayout, out: KvLayers | KvPages | None = None
    ) -> ReceivedKv:
        """Receive the ticket's KV, verifying the version first and every chunk's checksum.

        Called on the receiver right after the ticket was handed on (before or while the
        sender sends). Blocks until the last chunk is verified. `layout` is the KV shape
        this receiver's model uses; a sender describing another raises LayoutMismatch.
        `out`, when given, holds contiguous per-layer views of [tokens, kv_heads,
        head_dim], or the pages (blocks) of the range, that are filled in place (no
        copy where a chunk lies in one page); otherwise tensors are allocated.
        """

    @abstractmethod
    def abandon(self, ticket: TransferTicket, reason: str) -> None:
        """Give up on a ticket whose sender will never answer (it was unreachable).

        Called on the receiver, from any thread, when handing the ticket on failed.
        Does not block. The pending `recv` raises PeerLost; the pair with that sender is
        closed (it is presumed gone) and the next ticket opens a new one.
        """

    @abstractmethod
    async def recv_async(
        self, ticket: TransferTicket, layout: KvLayout, out: KvLayers | KvPages | None = None
    ) -> ReceivedKv:
        """`recv` on a worker thread; awaiting it never blocks the event loop."""
