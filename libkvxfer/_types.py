"""Values that describe a transfer: the ticket a receiver hands out, layouts, results."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from kvrs.errors import InvalidArgument

__all__ = [
    "ChunkReady",
    "KvLayers",
    "KvLayout",
    "KvPage",
    "KvPages",
    "ReceivedKv",
    "TransferStats",
    "TransferTicket",
    "as_pages",
    "page_rows",
]

KvLayers = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (key, value) tensors of shape [tokens, kv_heads, head_dim]."""


@dataclass(frozen=True)
class KvPage:
    """KV of positions [start, end) kept contiguously: one block of a paged cache.

    A transfer's range given as pages is sent from, or received into, the pages
    themselves; a chunk that crosses from one page into the next goes through a copy."""

    start: int
    end: int
    layers: KvLayers
    """Per layer, (key, value) of shape [end - start, kv_heads, head_dim]."""


KvPages = Sequence[KvPage]
"""The pages that make up a range, in position order, each starting where the last ended."""

ChunkReady = Callable[[int, int], None]
"""(layer, token_end) -> returns once that layer's rows up to token_end hold their final
values: a sender streaming KV that is still being computed waits on it before each chunk
(and raises to abandon the transfer)."""


def as_pages(kv: KvLayers | KvPages, start: int, end: int) -> list[KvPage]:
    """`kv` as pages of [start, end): per-layer tensors of the whole range are one page;
    InvalidArgument when the pages do not tile the range exactly."""
    if kv and isinstance(kv[0], KvPage):
        pages = [page for page in kv if isinstance(page, KvPage)]
    else:
        pages = [KvPage(start, end, kv)]  # type: ignore[arg-type]
    position = start
    for index, page in enumerate(pages):
        if page.start != position or page.end <= page.start:
            raise InvalidArgument(
                f"kv[{index}]", f"covers [{page.start}, {page.end}), expected one from {position}"
            )
        position = page.end
    if position != end:
        raise InvalidArgument("kv", f"pages end at {position}, the range at {end}")
    return pages


def page_rows(
    pages: Sequence[KvPage], layer: int, start: int, end: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (key, value) row slices of `layer` that hold positions [start, end), in order:
    one when the range lies in one page."""
    rows = []
    for page in pages:
        if page.end <= start or page.start >= end:
            continue
        cut = slice(max(start, page.start) - page.start, min(end, page.end) - page.start)
        key, value = page.layers[layer]
        rows.append((key[cut], value[cut]))
    return rows


@dataclass(frozen=True)
class KvLayout:
    """The shape of one model's KV: what a receiver expects and a sender describes."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * element

    @classmethod
    def of(cls, kv: KvLayers) -> KvLayout:
        """The layout of a list of per-layer (key, value) tensors."""
        if not kv:
            raise InvalidArgument("kv", "needs at least one layer")
        key = kv[0][0]
        if key.dim() != 3:
            raise InvalidArgument(
                "kv",
                f"key tensors must be [tokens, kv_heads, head_dim], got shape {tuple(key.shape)}",
            )
        return cls(layers=len(kv), kv_heads=key.shape[1], head_dim=key.shape[2], dtype=key.dtype)


@dataclass(frozen=True)
class TransferTicket:
    """Everything a sender needs to push one token range of one request to a receiver.

    The receiver creates it (`KvReceiver.prepare`) and the caller hands it to the sender
    over any control channel (WorkerService.SendKv carries its fields).
    """

    protocol_version: int
    """The receiver's PROTOCOL_VERSION; a sender on another version refuses the ticket."""
    transfer_id: str
    tag: int
    """Gloo tag of every message of this transfer: concurrent transfers never mix."""
    receiver_id: str
    receiver_incarnation: str
    """Changes when the receiver process restarts, so stale pair groups are never reused."""
    rendezvous_address: str
    """host:port of the receiver's TCPStore, where pair groups meet."""
    group_generation: int
    """Which pair group (receiver, sender) to use; a new one after any failure."""
    sender_id: str
    request_id: str
    token_start: int
    token_end: int
    traceparent: str = ""
    """W3C trace context of the caller, so transfer spans nest under the request's trace."""
    auth_key: bytes = field(default=b"", repr=False)
    """A fresh random key of this ticket alone, known to the receiver that issued it and to
    whoever it hands the ticket to (the sender, over the control plane). The sender signs
    the transfer with it; a peer without it is refused before any KV lands. Never logged."""

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start

    def identity(self) -> bytes:
        """The fields that name this transfer, canonically encoded (what the header's HMAC
        binds the transfer to)."""
        return json.dumps(
            [
                self.protocol_version,
                self.transfer_id,
                self.tag,
                self.receiver_id,
                self.receiver_incarnation,
                self.group_generation,
                self.sender_id,
                self.request_id,
                self.token_start,
                self.token_end,
            ],
            separators=(",", ":"),
        ).encode()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferTicket:
        names = {f.name for f in fields(cls)}
        missing = [n for n in names if n not in data and n not in ("traceparent", "auth_key")]
        if missing:
            raise InvalidArgument(f"ticket.{sorted(missing)[0]}", "missing")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class TransferStats:
    """What one completed transfer moved and how fast."""

    request_id: str
    transfer_id: str
    token_start: int
    token_end: int
    kv_bytes: int
    chunks: int
    seconds: float
    """Receiver: from the ticket's issue to the last chunk checked, so a receive thread that
    starts late never shortens it below the sender's (paced) time. Sender: the send."""

    @property
    def throughput_bps(self) -> float:
        return 8.0 * self.kv_bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class ReceivedKv:
    """KV of [token_start, token_end) as received (or written into the caller's pages)."""

    pages: list[KvPage]
    stats: TransferStats
    sender_id: str

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (key, value) of the whole range (copied together when it came in
        several pages)."""
        if len(self.pages) == 1:
            return list(self.pages[0].layers)
        return [
            (
                torch.cat([page.layers[layer][0] for page in self.pages]),
                torch.cat([page.layers[layer][1] for page in self.pages]),
            )
            for layer in range(len(self.pages[0].layers))
        ]

    @property
    def layout(self) -> KvLayout:
        return KvLayout.of(self.pages[0].layers)
