"""The libkvxfer wire format: versioned preamble, transfer header, per-chunk metadata.

One transfer is a sequence of messages on one pair group, all on the transfer's tag:

    preamble   16 bytes, frozen across versions: magic b"KVXF", version u16, flags u16,
               header length u32, reserved u32 (little endian)
    header     JSON (TransferHeader), or a rejection (code, message) when flags == REJECT
    per chunk  CHUNK_META_BYTES of space-padded JSON (ChunkMeta), then the key bytes,
               then the value bytes of that layer's token sub-range

The receiver checks the preamble's magic and version before it decodes anything else,
so a peer on another version fails with ProtocolVersionMismatch, never with a garbled
payload. Chunks follow layer order; a chunk covers one layer and a token sub-range of at
most `chunk_tokens` tokens.

Version history (PROTOCOL_HISTORY keeps it machine-readable):
    1  first version: the layout above, crc32 of key and value bytes per chunk.
    2  xxh3-64 in place of crc32: the same protection against torn or misrouted
       chunks at several times crc32's speed, so checksums stay on by default.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

import torch
import xxhash

from libkvxfer._errors import LayoutMismatch, ProtocolVersionMismatch

__all__ = [
    "CHUNK_META_BYTES",
    "NO_CHECKSUM",
    "PREAMBLE_BYTES",
    "PROTOCOL_HISTORY",
    "PROTOCOL_VERSION",
    "ChunkMeta",
    "TransferHeader",
    "checksum",
    "decode_preamble",
    "dtype_from_name",
    "dtype_name",
    "encode_preamble",
    "plan_chunks",
    "tensor_bytes",
]

PROTOCOL_VERSION = 2
PROTOCOL_HISTORY: dict[int, str] = {
    1: "16-byte preamble, JSON header, per-chunk JSON metadata + key/value bytes, crc32",
    2: "as 1, with an xxh3-64 checksum of the key and of the value bytes per chunk",
}
NO_CHECKSUM = -1
"""ChunkMeta's checksum when the sender computes none."""

MAGIC = b"KVXF"
PREAMBLE_BYTES = 16
_PREAMBLE = struct.Struct("<4sHHII")
CHUNK_META_BYTES = 1024
FLAG_DATA = 0
FLAG_REJECT = 1

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
    return flags, header_bytes


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


@dataclass(frozen=True)
class ChunkMeta:
    """One chunk: a layer's key and value over token sub-range [token_start, token_end)."""

    request_id: str
    transfer_id: str
    index: int
    layer: int
    token_start: int
    token_end: int
    dtype: str
    shape: tuple[int, ...]
    key_checksum: int
    """xxh3-64 of the key bytes; NO_CHECKSUM when the sender computes none."""
    value_checksum: int

    def to_bytes(self) -> bytes:
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        if len(data) > CHUNK_META_BYTES:
            raise LayoutMismatch(
                f"chunk metadata of {len(data)} bytes exceeds "
                f"{CHUNK_META_BYTES} (request id too long?)"
            )
        return data.ljust(CHUNK_META_BYTES, b" ")

    @classmethod
    def from_bytes(cls, data: bytes) -> ChunkMeta:
        try:
            fields = json.loads(data)
            fields["shape"] = tuple(fields["shape"])
            return cls(**fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise LayoutMismatch(f"malformed chunk metadata: {exc}") from None


def plan_chunks(header: TransferHeader) -> list[tuple[int, int, int]]:
    """(layer, token_start, token_end) of every chunk, in the order they travel."""
    step = max(1, header.chunk_tokens or header.tokens)
    chunks = []
    for layer in range(header.layers):
        for start in range(header.token_start, header.token_end, step):
            chunks.append((layer, start, min(start + step, header.token_end)))
    return chunks


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy), as gloo moves it."""
    return tensor.reshape(-1).view(torch.uint8)


def checksum(data: torch.Tensor) -> int:
    """xxh3-64 of a flat uint8 tensor, read in place (tens of GB/s per core)."""
    return xxhash.xxh3_64_intdigest(data.numpy())
