"""Prefix-block hashes: the names under which a worker advertises the KV it holds.

A prompt is cut into blocks of `block_tokens` tokens; block i's hash covers every token
of blocks 0..i (each hash chains the previous one), so equal hashes mean equal prefixes
and therefore equal KV (position i's KV depends only on tokens <= i). Only full blocks
are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["prefix_block_hashes"]


def prefix_block_hashes(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Unsigned 64-bit chained hashes of the full `block_tokens`-token blocks of a sequence."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    hashes: list[int] = []
    previous = b""
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        block = token_ids[end - block_tokens:end]
        digest = hashlib.blake2b(previous + struct.pack(f"<{len(block)}q", *block),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        previous = digest
    return hashes
