"""The gloo transfer agent: one per process, both sender and receiver of KV.

It hosts the process's rendezvous `TCPStore` (the address peers put in their tickets,
listening on the configured host only), keeps the pair groups, and moves KV chunk by
chunk with a deep window of operations in flight: gloo moves a message only once the
receiver has posted its buffer, so the receiver posts many chunks ahead, straight into
the destination views. Neither side hashes on the wire's critical path: the sender posts
a chunk, then hashes it while gloo sends it; the receiver hashes a chunk once it has
landed, while the next ones arrive; the checksums travel last, in the signed trailer.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import secrets
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.propagate import extract
from torch.distributed import TCPStore

from kvrs.errors import InvalidArgument, KvrsError
from libkvxfer import _protocol
from libkvxfer._errors import (
    AuthenticationFailed,
    ChecksumMismatch,
    LayoutMismatch,
    PeerLost,
    ProtocolVersionMismatch,
    TransferRejected,
)
from libkvxfer._interface import KvReceiver, KvSender
from libkvxfer._pairs import InboundPairs, OutboundPairs, PairGroup
from libkvxfer._protocol import (
    AUTH_KEY_BYTES,
    FLAG_DATA,
    FLAG_REJECT,
    HEADER_BYTES,
    MAC_BYTES,
    PREAMBLE_BYTES,
    TransferHeader,
    checksum,
    decode_header,
    decode_trailer,
    dtype_from_name,
    dtype_name,
    encode_header,
    encode_trailer,
    plan_chunks,
    tensor_bytes,
    trailer_bytes,
)
from libkvxfer._types import (
    ChunkReady,
    KvLayers,
    KvLayout,
    KvPage,
    KvPages,
    ReceivedKv,
    TransferStats,
    TransferTicket,
    as_pages,
    page_rows,
)

__all__ = ["AgentConfig", "TransferAgent"]

log = logging.getLogger(__name__)

_MAX_TAG = 2**31 - 1
_MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class AgentConfig:
    """How one process's transfer agent listens and moves KV."""

    instance_id: str
    """Stable name of this process among its peers (the worker's instance id)."""
    host: str = "127.0.0.1"
    """Address peers reach this process on: the store and the gloo sockets bind to it,
    and to no other interface."""
    port: int = 0
    """TCPStore port; 0 picks a free one (see `TransferAgent.address`)."""
    timeout_s: float = 30.0
    """Longest wait for any single step (join, one message); then the pair is closed."""
    connect_timeout_s: float = 5.0
    """Longest wait to reach a receiver's store before joining its pair. A refused
    connection (nothing listens: the receiver is gone) fails at once, so tickets of dead
    receivers never hold the transfer threads that live ones need."""
    pacing_bps: float | None = None
    """Default cap on the send rate, bits/s (emulates a slower link); None: no cap."""
    chunk_tokens: int = 0
    """Tokens per chunk within a layer; 0: one chunk per layer."""
    window_chunks: int = 64
    """Chunks posted ahead per transfer (receive buffers, sends): deep enough that the
    wire never waits for a checksum or a Python wake-up; bounded for huge transfers."""
    checksums: bool = True
    """Send an xxh3-64 of every chunk (receivers verify every checksum they get), signed
    with the ticket's key. Costs a pass over the bytes on each side at tens of GB/s, off
    the wire's critical path. When off, TCP's own checksums remain and the header's
    signature still proves the peer, but the payload itself is not authenticated."""
    max_concurrent_transfers: int = 16
    """Threads for the async API: transfers running at once in this process."""


class _Pacer:
    """Holds a sender back so that `bytes` leave no faster than `rate_bps`."""

    def __init__(self, rate_bps: float | None) -> None:
        if rate_bps is not None and rate_bps <= 0:
            raise InvalidArgument("pacing_bps", f"must be > 0, got {rate_bps}")
        self._rate_bps = rate_bps
        self._start = time.monotonic()
        self._sent_bytes = 0

    def account(self, nbytes: int) -> None:
        """Sleep until a link of the paced rate would have delivered `nbytes` more.

        Called before handing a chunk to gloo, so the receiver never sees a chunk before
        the emulated link could have carried it.
        """
        if self._rate_bps is None:
            return
        self._sent_bytes += nbytes
        due = self._start + 8.0 * self._sent_bytes / self._rate_bps
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class TransferAgent(KvSender, KvReceiver):
    """Sends and receives KV over pairwise gloo groups (see `libkvxfer` for the protocol)."""

    def __init__(
        self, config: AgentConfig, tracer_provider: trace.TracerProvider | None = None
    ) -> None:
        if not config.instance_id:
            raise InvalidArgument("instance_id", "must not be empty")
        self.config = config
        self.incarnation = uuid.uuid4().hex
        self._tracer = trace.get_tracer("libkvxfer", tracer_provider=tracer_provider)
        self._store = _bound_store(config.host, config.port)
        self._inbound = InboundPairs(self._store, config.host, config.timeout_s)
        self._outbound = OutboundPairs(
            self.incarnation, config.host, config.timeout_s, config.connect_timeout_s
        )
        self._tags = itertools.count(1)
        self._tag_lock = threading.Lock()
        self._abandoned: set[str] = set()
        self._issued: dict[str, _Issued] = {}
        """transfer id -> its ticket's issue time and key (receiver side), until received."""
        self._executor = ThreadPoolExecutor(
            config.max_concurrent_transfers, thread_name_prefix="kvxfer"
        )
        self._closed = False

    @property
    def address(self) -> str:
        """host:port of this agent's rendezvous store (what peers need to send to it)."""
        return f"{self.config.host}:{self._store.port}"

    def close(self) -> None:
        """Close every pair and stop the thread pool; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._inbound.close()
        self._outbound.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- receiver ---------------------------------------------------------------------

    def prepare(
        self,
        sender_id: str,
        request_id: str,
        token_start: int,
        token_end: int,
        traceparent: str = "",
    ) -> TransferTicket:
        if not sender_id:
            raise InvalidArgument("sender_id", "must not be empty")
        _check_request_id(request_id)
        if not 0 <= token_start < token_end:
            raise InvalidArgument(
                "token_range",
                f"need 0 <= token_start < token_end, got [{token_start}, {token_end})",
            )
        with self._tag_lock:
            tag = (next(self._tags) - 1) % _MAX_TAG + 1
        transfer_id = uuid.uuid4().hex
        auth_key = secrets.token_bytes(AUTH_KEY_BYTES)
        self._issued[transfer_id] = _Issued(time.monotonic(), auth_key)
        return TransferTicket(
            protocol_version=_protocol.PROTOCOL_VERSION,
            transfer_id=transfer_id,
            tag=tag,
            receiver_id=self.config.instance_id,
            receiver_incarnation=self.incarnation,
            rendezvous_address=self.address,
            group_generation=self._inbound.generation_for(sender_id),
            sender_id=sender_id,
            request_id=request_id,
            token_start=token_start,
            token_end=token_end,
            traceparent=traceparent,
            auth_key=auth_key,
        )

    def abandon(self, ticket: TransferTicket, reason: str) -> None:
        log.info(
            "abandoning transfer %s of %s from %s: %s",
            ticket.transfer_id,
            ticket.request_id,
            ticket.sender_id,
            reason,
        )
        self._abandoned.add(ticket.transfer_id)
        self._issued.pop(ticket.transfer_id, None)
        self._inbound.close_pair(ticket.sender_id, ticket.group_generation)

    def recv(
        self, ticket: TransferTicket, layout: KvLayout, out: KvLayers | KvPages | None = None
    ) -> ReceivedKv:
        if ticket.receiver_incarnation != self.incarnation:
            raise InvalidArgument("ticket", "was not issued by this agent")
        pages = None
        if out is not None:
            pages = as_pages(out, ticket.token_start, ticket.token_end)
            _check_out(pages, layout)
        with self._span("kvxfer.recv", ticket) as span:
            try:
                received = self._recv(ticket, layout, pages)
            finally:
                self._abandoned.discard(ticket.transfer_id)
            _record(span, received.stats)
            return received

    def _recv(
        self, ticket: TransferTicket, layout: KvLayout, out: list[KvPage] | None
    ) -> ReceivedKv:
        def cancelled() -> bool:
            return ticket.transfer_id in self._abandoned

        issued = self._issued.pop(ticket.transfer_id, None)
        if cancelled():
            raise PeerLost(f"transfer {ticket.transfer_id} abandoned before it started")
        if issued is None:
            raise InvalidArgument(
                "ticket", f"transfer {ticket.transfer_id} is not pending on this agent"
            )

        group = self._inbound.group(ticket.sender_id, ticket.group_generation, cancelled)
        try:
            header, header_mac = self._recv_header(group, ticket, issued.key)
            _check_header(header, ticket, layout)
            if out is None:
                shape = (ticket.tokens, layout.kv_heads, layout.head_dim)
                layers = [
                    (torch.empty(shape, dtype=layout.dtype), torch.empty(shape, dtype=layout.dtype))
                    for _ in range(layout.layers)
                ]
                out = [KvPage(ticket.token_start, ticket.token_end, layers)]
            chunks = plan_chunks(header)
            self._recv_chunks(group, ticket, header, header_mac, chunks, out, issued.key)
        except TransferRejected:
            raise
        except BaseException as exc:
            # Messages of this transfer may still be in flight: drop the pair so the
            # sender fails now, and nothing stale can reach a later transfer.
            group.close()
            if cancelled() and not isinstance(exc, AuthenticationFailed):
                raise PeerLost(f"transfer {ticket.transfer_id} abandoned") from exc
            raise
        stats = TransferStats(
            ticket.request_id,
            ticket.transfer_id,
            ticket.token_start,
            ticket.token_end,
            header.kv_bytes,
            len(chunks),
            time.monotonic() - issued.at_s,
        )
        return ReceivedKv(pages=out, stats=stats, sender_id=header.sender_id)

    def _recv_header(
        self, group: PairGroup, ticket: TransferTicket, key: bytes
    ) -> tuple[TransferHeader, bytes]:
        """The verified header and its HMAC; TransferRejected for a signed rejection."""
        preamble = torch.empty(PREAMBLE_BYTES, dtype=torch.uint8)
        raw = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        preamble_work = group.recv(preamble, ticket.tag)
        header_work = group.recv(raw, ticket.tag)
        group.wait(preamble_work, "preamble")
        # Checked before anything else is decoded; on a mismatch the caller drops the
        # pair rather than guess where the next transfer's messages start.
        flags, body_bytes = _protocol.decode_preamble(preamble.numpy().tobytes())
        group.wait(header_work, "header")
        data = raw.numpy().tobytes()
        body = decode_header(key, ticket.identity(), data, body_bytes)
        if flags == FLAG_REJECT:
            code, _, message = body.decode(errors="replace").partition("\n")
            raise TransferRejected(code, message)
        return TransferHeader.from_bytes(body), data[:MAC_BYTES]

    def _recv_chunks(
        self,
        group: PairGroup,
        ticket: TransferTicket,
        header: TransferHeader,
        header_mac: bytes,
        chunks: list[tuple[int, int, int]],
        out: list[KvPage],
        key: bytes,
    ) -> None:
        """Receive every chunk into `out`, hash each once it lands, check the trailer.

        A chunk that lies in one page lands there in place; one that crosses pages lands
        in a buffer of its own and is copied out once it has arrived."""
        posted: deque = deque()
        trailer = torch.empty(trailer_bytes(len(chunks)), dtype=torch.uint8)
        trailer_work: list[Any] = []
        next_index = 0

        def post_next() -> None:
            """Post the next chunk's buffers, or the trailer's once every chunk's are."""
            nonlocal next_index
            if next_index == len(chunks):
                if not trailer_work:
                    trailer_work.append(group.recv(trailer, ticket.tag))
                return
            layer, start, end = chunks[next_index]
            rows = page_rows(out, layer, start, end)
            if len(rows) == 1:
                (key_rows, value_rows), spread = rows[0], None
            else:
                like = rows[0][0]
                key_rows = like.new_empty((end - start, *like.shape[1:]))
                value_rows, spread = torch.empty_like(key_rows), rows
            key_bytes, value_bytes = tensor_bytes(key_rows), tensor_bytes(value_rows)
            posted.append(
                (
                    next_index,
                    key_bytes,
                    value_bytes,
                    group.recv(key_bytes, ticket.tag),
                    group.recv(value_bytes, ticket.tag),
                    (key_rows, value_rows, spread),
                )
            )
            next_index += 1

        for _ in range(min(max(1, self.config.window_chunks), len(chunks)) + 1):
            post_next()
        sums: list[int] = []
        while posted:
            index, key_bytes, value_bytes, key_work, value_work, landed = posted.popleft()
            post_next()
            group.wait(key_work, f"chunk {index} key")
            if header.checksums:
                sums.append(checksum(key_bytes))
            group.wait(value_work, f"chunk {index} value")
            if header.checksums:
                sums.append(checksum(value_bytes))
            _spread(*landed)
        post_next()
        group.wait(trailer_work[0], "trailer")
        sent = decode_trailer(key, header_mac, trailer.numpy().tobytes(), len(chunks))
        if header.checksums and sent != sums:
            first = next(i for i, (a, b) in enumerate(zip(sent, sums, strict=True)) if a != b)
            layer, start, end = chunks[first // 2]
            raise ChecksumMismatch(
                f"request {ticket.request_id} layer {layer} tokens "
                f"[{start}, {end}): {('key', 'value')[first % 2]} checksum mismatch"
            )

    async def recv_async(
        self, ticket: TransferTicket, layout: KvLayout, out: KvLayers | KvPages | None = None
    ) -> ReceivedKv:
        return await self._in_thread(self.recv, ticket, layout, out)

    # -- sender -----------------------------------------------------------------------

    def send(
        self,
        ticket: TransferTicket,
        kv: KvLayers | KvPages,
        pacing_bps: float | None = None,
        ready: ChunkReady | None = None,
    ) -> TransferStats:
        if ticket.protocol_version != _protocol.PROTOCOL_VERSION:
            raise ProtocolVersionMismatch(
                _protocol.PROTOCOL_VERSION, ticket.protocol_version, "ticket"
            )
        pages = as_pages(kv, ticket.token_start, ticket.token_end)
        layout = KvLayout.of(pages[0].layers)
        for page in pages:
            _check_page(page, layout, "kv", contiguous=False)
        pacing = self.config.pacing_bps if pacing_bps is None else pacing_bps
        with self._span("kvxfer.send", ticket) as span:
            stats = self._send(ticket, pages, layout, pacing or None, ready)
            _record(span, stats)
            return stats

    def _send(
        self,
        ticket: TransferTicket,
        kv: list[KvPage],
        layout: KvLayout,
        pacing_bps: float | None,
        ready: ChunkReady | None,
    ) -> TransferStats:
        started = time.monotonic()
        group = self._group_for(ticket)
        header = TransferHeader(
            request_id=ticket.request_id,
            transfer_id=ticket.transfer_id,
            sender_id=self.config.instance_id,
            token_start=ticket.token_start,
            token_end=ticket.token_end,
            layers=layout.layers,
            kv_heads=layout.kv_heads,
            head_dim=layout.head_dim,
            dtype=dtype_name(layout.dtype),
            chunk_tokens=self.config.chunk_tokens,
            checksums=self.config.checksums,
            traceparent=ticket.traceparent,
        )
        try:
            pacer = _Pacer(pacing_bps)
            return self._send_chunks(group, ticket, kv, header, pacer, ready, started)
        except BaseException:
            group.close()
            raise

    def _send_chunks(
        self,
        group: PairGroup,
        ticket: TransferTicket,
        kv: list[KvPage],
        header: TransferHeader,
        pacer: _Pacer,
        ready: ChunkReady | None,
        started: float,
    ) -> TransferStats:
        body = header.to_bytes()
        signed = encode_header(ticket.auth_key, ticket.identity(), body)
        in_flight: deque = deque()
        self._post(
            group, ticket, in_flight, _protocol.encode_preamble(FLAG_DATA, len(body)), signed
        )
        chunks = plan_chunks(header)
        limit = 2 * max(1, self.config.window_chunks) + 2
        sums: list[int] = []
        for index, (layer, start, end) in enumerate(chunks):
            if ready is not None:
                ready(layer, end)
            rows = page_rows(kv, layer, start, end)
            key = tensor_bytes(torch.cat([k for k, _ in rows]) if len(rows) > 1 else rows[0][0])
            value = tensor_bytes(torch.cat([v for _, v in rows]) if len(rows) > 1 else rows[0][1])
            pacer.account(key.numel() + value.numel())
            self._post(group, ticket, in_flight, key, value)
            # Hashed while gloo sends them (both only read the bytes).
            sums += (checksum(key), checksum(value)) if header.checksums else (0, 0)
            while len(in_flight) > limit:
                group.wait(in_flight.popleft()[0], f"chunk {index} send")
        self._post(
            group, ticket, in_flight, encode_trailer(ticket.auth_key, signed[:MAC_BYTES], sums)
        )
        while in_flight:
            group.wait(in_flight.popleft()[0], "send")
        return TransferStats(
            ticket.request_id,
            ticket.transfer_id,
            ticket.token_start,
            ticket.token_end,
            header.kv_bytes,
            len(chunks),
            time.monotonic() - started,
        )

    @staticmethod
    def _post(
        group: PairGroup, ticket: TransferTicket, in_flight: deque, *messages: bytes | torch.Tensor
    ) -> None:
        for message in messages:
            if isinstance(message, bytes):
                message = torch.frombuffer(bytearray(message), dtype=torch.uint8)
            # The tensor rides along: gloo reads it until the operation completes.
            in_flight.append((group.send(message, ticket.tag), message))

    def _group_for(self, ticket: TransferTicket) -> PairGroup:
        return self._outbound.group(
            ticket.receiver_id,
            ticket.receiver_incarnation,
            ticket.group_generation,
            ticket.rendezvous_address,
            self.config.instance_id,
        )

    def reject(self, ticket: TransferTicket, error: KvrsError) -> None:
        with self._span("kvxfer.reject", ticket) as span:
            span.set_attribute("kvrs.error_code", error.code)
            group = self._group_for(ticket)
            body = f"{error.code}\n{error}".encode()[: HEADER_BYTES - MAC_BYTES]
            signed = encode_header(ticket.auth_key, ticket.identity(), body)
            in_flight: deque = deque()
            self._post(
                group, ticket, in_flight, _protocol.encode_preamble(FLAG_REJECT, len(body)), signed
            )
            while in_flight:
                group.wait(in_flight.popleft()[0], "reject")

    async def send_async(
        self,
        ticket: TransferTicket,
        kv: KvLayers | KvPages,
        pacing_bps: float | None = None,
        ready: ChunkReady | None = None,
    ) -> TransferStats:
        return await self._in_thread(self.send, ticket, kv, pacing_bps, ready)

    async def reject_async(self, ticket: TransferTicket, error: KvrsError) -> None:
        await self._in_thread(self.reject, ticket, error)

    # -- shared -----------------------------------------------------------------------

    async def _in_thread(self, fn: Callable, *args):
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(self._executor, functools.partial(context.run, fn, *args))

    @contextlib.contextmanager
    def _span(self, name: str, ticket: TransferTicket) -> Iterator[trace.Span]:
        """A transfer span with the error code when it fails.

        Its parent is the caller's current span when there is one (the RPC that carries
        the ticket), else the ticket's traceparent: either way it joins the request's trace.
        """
        parent = None
        if ticket.traceparent and not trace.get_current_span().get_span_context().is_valid:
            parent = extract({"traceparent": ticket.traceparent})
        kind = trace.SpanKind.CONSUMER if name == "kvxfer.recv" else trace.SpanKind.PRODUCER
        with self._tracer.start_as_current_span(name, context=parent, kind=kind) as span:
            span.set_attributes(
                {
                    "kvrs.request_id": ticket.request_id,
                    "kvxfer.transfer_id": ticket.transfer_id,
                    "kvxfer.sender_id": ticket.sender_id,
                    "kvxfer.receiver_id": ticket.receiver_id,
                    "kvxfer.token_start": ticket.token_start,
                    "kvxfer.token_end": ticket.token_end,
                    "kvxfer.group_generation": ticket.group_generation,
                    "kvxfer.protocol_version": _protocol.PROTOCOL_VERSION,
                }
            )
            try:
                yield span
            except KvrsError as exc:
                span.set_attribute("kvrs.error_code", exc.code)
                raise


@dataclass(frozen=True)
class _Issued:
    """What the receiver keeps of a ticket it issued until the transfer is received."""

    at_s: float
    """Monotonic time of issue: a transfer's time runs from here."""
    key: bytes
    """The ticket's key: only a peer that holds it is admitted."""


def _bound_store(host: str, port: int) -> TCPStore:
    """The rendezvous store, listening on `host` alone.

    TCPStore binds every interface when it opens its own socket; handed a socket already
    bound to `host`, it listens there and nowhere else (and owns the descriptor).
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, port), family=family, backlog=128)
    try:
        store = TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            use_libuv=True,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()
    return store


def _record(span: trace.Span, stats: TransferStats) -> None:
    span.set_attributes(
        {
            "kvrs.kv_bytes": stats.kv_bytes,
            "kvxfer.chunks": stats.chunks,
            "kvxfer.seconds": stats.seconds,
            "kvxfer.throughput_bps": stats.throughput_bps,
        }
    )


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidArgument("request_id", "must not be empty")
    if len(request_id) > _MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"longer than {_MAX_REQUEST_ID_CHARS} characters")


def _check_header(header: TransferHeader, ticket: TransferTicket, layout: KvLayout) -> None:
    if (header.request_id, header.transfer_id, header.token_start, header.token_end) != (
        ticket.request_id,
        ticket.transfer_id,
        ticket.token_start,
        ticket.token_end,
    ):
        raise LayoutMismatch(
            f"header names {header.request_id} [{header.token_start}, "
            f"{header.token_end}) transfer {header.transfer_id}, ticket "
            f"{ticket.request_id} [{ticket.token_start}, {ticket.token_end}) "
            f"transfer {ticket.transfer_id}"
        )
    sent = (header.layers, header.kv_heads, header.head_dim, dtype_from_name(header.dtype))
    wanted = (layout.layers, layout.kv_heads, layout.head_dim, layout.dtype)
    if sent != wanted:
        raise LayoutMismatch(
            f"sender's KV is (layers, kv_heads, head_dim, dtype) = {sent}, "
            f"this receiver's model needs {wanted}"
        )


def _check_out(pages: list[KvPage], layout: KvLayout) -> None:
    for page in pages:
        _check_page(page, layout, "out", contiguous=True)


def _check_page(page: KvPage, layout: KvLayout, name: str, contiguous: bool) -> None:
    """Each of the page's tensors must hold its rows in the layout's shape and dtype, on
    the CPU (and, to receive into, contiguously)."""
    if len(page.layers) != layout.layers:
        raise InvalidArgument(name, f"needs {layout.layers} layers, got {len(page.layers)}")
    shape = (page.end - page.start, layout.kv_heads, layout.head_dim)
    for layer, pair in enumerate(page.layers):
        for part, tensor in zip(("key", "value"), pair, strict=True):
            if (
                tuple(tensor.shape) != shape
                or tensor.dtype != layout.dtype
                or (contiguous and not tensor.is_contiguous())
                or tensor.device.type != "cpu"
            ):
                raise InvalidArgument(
                    f"{name}[{layer}].{part}",
                    f"must be a {'contiguous ' if contiguous else ''}CPU tensor of {shape} "
                    f"{dtype_name(layout.dtype)}, got {tuple(tensor.shape)} {tensor.dtype} "
                    f"on {tensor.device}",
                )


def _spread(key_rows: torch.Tensor, value_rows: torch.Tensor, spread: list | None) -> None:
    """Copy a chunk received into a buffer of its own out to the pages it spans."""
    if spread is None:
        return
    offset = 0
    for key, value in spread:
        rows = slice(offset, offset + key.shape[0])
        key.copy_(key_rows[rows])
        value.copy_(value_rows[rows])
        offset = rows.stop
