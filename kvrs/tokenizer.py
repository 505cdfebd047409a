"""Byte-level tokenizer: UTF-8 bytes are token ids 0-255, special tokens follow.

The workers' models take one token per byte, so any text is a prompt without a
vocabulary file, and the front doors (the OpenAI-compatible HTTP adapter, the endpoint
picker) count tokens and hash prefix blocks exactly as the workers do.

    ids = encode("héllo")                  # [104, 195, 169, 108, 108, 111]
    decode(ids) == "héllo"
    stream = StreamDecoder()               # token by token, never splitting a character
    "".join(stream.push(t) for t in ids) + stream.flush() == "héllo"

Special ids (>= 256) carry no text: `decode` drops them.
"""

from __future__ import annotations

import codecs
import hashlib
import struct
from collections.abc import Iterable, Sequence

from kvrs.errors import InvalidArgument

__all__ = [
    "BOS_ID",
    "BYTE_TOKENS",
    "EOS_ID",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "StreamDecoder",
    "decode",
    "encode",
    "prefix_block_hashes",
    "validate_token_ids",
]

BYTE_TOKENS = 256
"""Ids 0-255: one per byte value."""
BOS_ID = 256
"""Beginning of sequence."""
EOS_ID = 257
"""End of sequence: a model that emits it has finished."""
SPECIAL_TOKENS: dict[str, int] = {"<bos>": BOS_ID, "<eos>": EOS_ID}
VOCAB_SIZE = BYTE_TOKENS + len(SPECIAL_TOKENS)


def encode(text: str, *, add_bos: bool = False) -> list[int]:
    """The token ids of `text`: its UTF-8 bytes, after `BOS_ID` when `add_bos`."""
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids] if add_bos else ids


def decode(token_ids: Iterable[int]) -> str:
    """The text of `token_ids`; special ids are dropped, broken UTF-8 shows as U+FFFD."""
    return bytes(t for t in token_ids if 0 <= t < BYTE_TOKENS).decode("utf-8", errors="replace")


def validate_token_ids(token_ids: Sequence[int], field: str, vocab_size: int = VOCAB_SIZE) -> None:
    """InvalidArgument naming `field` unless every id is an int in [0, vocab_size)."""
    for index, token in enumerate(token_ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidArgument(f"{field}[{index}]", f"must be an integer, got {token!r}")
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                f"{field}[{index}]", f"token {token} is outside the vocabulary [0, {vocab_size})"
            )


class StreamDecoder:
    """Text of a token stream, one token at a time.

    A multi-byte character is emitted once its last byte arrives, so the pieces
    concatenate to exactly `decode(all_tokens)` and no piece ever holds half a character.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by `token_id` (often "", inside a multi-byte character)."""
        if not 0 <= token_id < BYTE_TOKENS:
            return ""
        return self._decoder.decode(bytes((token_id,)))

    def flush(self) -> str:
        """Whatever an unfinished character at the end of the stream decodes to (U+FFFD)."""
        return self._decoder.decode(b"", final=True)


def prefix_block_hashes(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Unsigned 64-bit chained hashes of the full `block_tokens`-token blocks of a prompt.

    Block i's hash covers blocks 0..i (each hash chains the previous digest), so equal
    hashes mean equal prefixes; a partial last block is not hashed. These are the names
    under which workers advertise resident KV and the scheduler counts prefix hits, so
    the computation is byte-for-byte the workers' (blake2b-64 over little-endian int64).
    """
    if block_tokens <= 0:
        raise InvalidArgument("block_tokens", f"must be > 0, got {block_tokens}")
    hashes: list[int] = []
    previous = b""
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        block = token_ids[end - block_tokens : end]
        digest = hashlib.blake2b(
            previous + struct.pack(f"<{len(block)}q", *block), digest_size=8
        ).digest()
        hashes.append(int.from_bytes(digest, "little"))
        previous = digest
    return hashes
