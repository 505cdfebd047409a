"""The libkvxfer wire format: versioned preamble, authenticated header, raw chunks, trailer.

One transfer is a sequence of messages on one pair group, all on the transfer's tag:

    preamble   16 bytes, frozen across versions: magic b"KVXF", version u16, flags u16,
               header length u32, reserved u32 (little endian)
    header     HEADER_BYTES: a 32-byte HMAC-SHA256, then the header's JSON (TransferHeader;
               "code\\nmessage" when flags == FLAG_REJECT) of the preamble's header length,
               zero-padded
    per chunk  the key bytes, then the value bytes, of one layer's token sub-range,
               received straight into the receiver's destination views
    trailer    per chunk, xxh3-64 of the key and of the value bytes (u64 each; zero when
               the header says the sender computes none), then a 32-byte HMAC-SHA256

The receiver checks the preamble's magic and version before it decodes anything else,
so a peer on another version fails with ProtocolVersionMismatch, never with a garbled
payload. Both fixed sizes let the receiver post the preamble's and the header's buffers
at once, and every chunk's buffers as soon as the header is verified.

Authentication: every ticket carries a fresh random key (`TransferTicket.auth_key`) that
travels only over the control plane, never through the rendezvous store or the data
sockets. The header's HMAC covers the ticket's identity and the header itself, so the
receiver admits a peer only once it has proven it holds the ticket's key, before any
byte lands in a destination view. The trailer's HMAC covers the header's HMAC and every
chunk checksum, so the payload itself is authenticated too (when checksums are on).
Checksums run while the wire moves the next chunks: the sender posts a chunk first and
hashes it while gloo sends it, the receiver hashes each chunk once it has landed.

Chunks follow layer order; a chunk covers one layer and a token sub-range cut at the
multiples of `chunk_tokens` (counted from token 0, not from the range's start), so with
`chunk_tokens` equal to the block size of paged caches every chunk lies in one block on
both sides and moves in place.

Version history (PROTOCOL_HISTORY keeps it machine-readable):
    1  first version: 16-byte preamble, JSON header, per chunk 1 KiB of JSON metadata
       then key and value bytes, crc32 of key and value bytes per chunk.
    2  xxh3-64 in place of crc32: the same protection against torn or misrouted
       chunks at several times crc32's speed, so checksums stay on by default.
    3  no per-chunk metadata message: the checksums travel in one trailer after the
       data, so neither side hashes on the wire's critical path; a fixed-size header
       (posted together with the preamble); HMAC-SHA256 with the ticket's key over the
       ticket and header, and over every chunk checksum.
    4  chunks cut at absolute multiples of chunk_tokens (3 cut them from the range's
       start), so they line up with the blocks of paged KV on both sides.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import asdict, dataclass

import torch
import xxhash

from libkvxfer._errors import AuthenticationFailed, LayoutMismatch, ProtocolVersionMismatch

__all__ = [
    "AUTH_KEY_BYTES",
    "FLAG_DATA",
    "FLAG_REJECT",
    "HEADER_BYTES",
    "MAC_BYTES",
    "PREAMBLE_BYTES",
    "PROTOCOL_HISTORY",
    "PROTOCOL_VERSION",
    "TransferHeader",
    "checksum",
    "decode_header",
    "decode_preamble",
    "decode_trailer",
    "dtype_from_name",
    "dtype_name",
    "encode_header",
    "encode_preamble",
    "encode_trailer",
    "plan_chunks",
    "tensor_bytes",
    "trailer_bytes",
]

PROTOCOL_VERSION = 4
PROTOCOL_HISTORY: dict[int, str] = {
    1: "16-byte preamble, JSON header, per-chunk JSON metadata + key/value bytes, crc32",
    2: "as 1, with an xxh3-64 checksum of the key and of the value bytes per chunk",
    3: "16-byte preamble, fixed-size HMAC'd header, raw key/value chunks, one trailer "
    "of xxh3-64 checksums under an HMAC-SHA256 with the ticket's key",
    4: "as 3, with chunks cut at absolute multiples of chunk_tokens (aligned with blocks)",
}

MAGIC = b"KVXF"
PREAMBLE_BYTES = 16
_PREAMBLE = struct.Struct("<4sHHII")
HEADER_BYTES = 2048
MAC_BYTES = 32
AUTH_KEY_BYTES = 32
FLAG_DATA = 0
FLAG_REJECT = 1
_HEADER_CONTEXT = b"libkvxfer/4 header\n"
_TRAILER_CONTEXT = b"libkvxfer/4 trailer\n"

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise LayoutMismatch(f"dtype {name!r} is not a KV dtype libkvxfer moves") from None


def encode_preamble(flags: int, header_bytes: int, version: int = PROTOCOL_VERSION) -> bytes:
    return _PREAMBLE.pack(MAGIC, version, flags, header_bytes, 0)


def decode_preamble(data: bytes) -> tuple[int, int]:
    """(flags, header length) of a preamble; ProtocolVersionMismatch before anything else."""
    magic, version, flags, header_bytes, _ = _PREAMBLE.unpack(data)
    if magic != MAGIC:
        raise ProtocolVersionMismatch(PROTOCOL_VERSION, -1, f"bad magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionMismatch(PROTOCOL_VERSION, version)
    if header_bytes > HEADER_BYTES - MAC_BYTES:
        raise LayoutMismatch(f"header length {header_bytes} exceeds {HEADER_BYTES - MAC_BYTES}")
    return flags, header_bytes


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), hashlib.sha256)


def encode_header(key: bytes, ticket_identity: bytes, body: bytes) -> bytes:
    """The header message: HMAC over the ticket's identity and `body`, then `body`, padded."""
    if len(body) > HEADER_BYTES - MAC_BYTES:
        raise LayoutMismatch(
            f"transfer header of {len(body)} bytes exceeds "
            f"{HEADER_BYTES - MAC_BYTES} (ids too long?)"
        )
    mac = _mac(key, _HEADER_CONTEXT, ticket_identity, body)
    return (mac + body).ljust(HEADER_BYTES, b"\0")


def decode_header(key: bytes, ticket_identity: bytes, data: bytes, body_bytes: int) -> bytes:
    """The header's body, once its HMAC proves the sender holds the ticket's key."""
    mac, body = data[:MAC_BYTES], data[MAC_BYTES : MAC_BYTES + body_bytes]
    if not hmac.compare_digest(mac, _mac(key, _HEADER_CONTEXT, ticket_identity, body)):
        raise AuthenticationFailed(
            "transfer header is not signed with the ticket's key: "
            "the peer is not the sender the ticket names"
        )
    return body


def trailer_bytes(chunks: int) -> int:
    return 16 * chunks + MAC_BYTES


def encode_trailer(key: bytes, header_mac: bytes, sums: list[int]) -> bytes:
    """The trailer: every chunk's (key, value) checksums, then their HMAC."""
    packed = struct.pack(f"<{len(sums)}Q", *sums)
    return packed + _mac(key, _TRAILER_CONTEXT, header_mac, packed)


def decode_trailer(key: bytes, header_mac: bytes, data: bytes, chunks: int) -> list[int]:
    """The checksums a trailer carries, once its HMAC matches."""
    packed, mac = data[: 16 * chunks], data[16 * chunks :]
    if not hmac.compare_digest(mac, _mac(key, _TRAILER_CONTEXT, header_mac, packed)):
        raise AuthenticationFailed("transfer trailer is not signed with the ticket's key")
    return list(struct.unpack(f"<{2 * chunks}Q", packed))


@dataclass(frozen=True)
class TransferHeader:
    """What the sender is about to send, so the receiver can allocate and check."""

    request_id: str
    transfer_id: str
    sender_id: str
    token_start: int
    token_end: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int
    checksums: bool
    """Whether the trailer carries xxh3-64 checksums (else zeros, and only the peer is
    authenticated, not the payload)."""
    traceparent: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferHeader:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError) as exc:
            raise LayoutMismatch(f"malformed transfer header: {exc}") from None

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def kv_bytes(self) -> int:
        element = torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()
        return 2 * self.layers * self.tokens * self.kv_heads * self.head_dim * element


def plan_chunks(header: TransferHeader) -> list[tuple[int, int, int]]:
    """(layer, token_start, token_end) of every chunk, in the order they travel: per
    layer, the range cut at the multiples of chunk_tokens (whole when it is 0)."""
    cuts = [header.token_start]
    step = header.chunk_tokens
    if step > 0:
        cuts += range((header.token_start // step + 1) * step, header.token_end, step)
    cuts.append(header.token_end)
    ranges = list(zip(cuts, cuts[1:], strict=False))
    return [(layer, start, end) for layer in range(header.layers) for start, end in ranges]


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy), as gloo moves it."""
    return tensor.reshape(-1).view(torch.uint8)


def checksum(data: torch.Tensor) -> int:
    """xxh3-64 of a flat uint8 tensor, read in place (tens of GB/s per core)."""
    return xxhash.xxh3_64_intdigest(data.numpy().data)
