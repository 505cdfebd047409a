"""Sampling parameters and the per-position random draws that make sampling replayable.

A request's token i is drawn with the uniform number `uniform(seed, i)`: a pure function
of the seed and the position, not of a generator's state. Whichever worker computes
token i — the first decode worker, a migration target, a recompute — draws the same
number from the same logits and so picks the same token; a recovered stream equals a
fault-free one, sampled or not.

The seed is the request's own (OpenAI's `seed`) or, without one, derived from its id
(`seed_for`), so that retries and recoveries of one request agree while two requests
differ.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from kvrs.errors import InvalidArgument

__all__ = ["MAX_TOP_K", "Sampling", "seed_for", "uniform"]

MAX_TOP_K = 1 << 20
"""Largest top_k accepted (beyond any vocabulary)."""
_SEED_MASK = (1 << 64) - 1


def seed_for(request_id: str) -> int:
    """The seed of a request that gave none: a stable 64-bit hash of its id (never 0)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] or 1


def uniform(seed: int, index: int) -> float:
    """The draw for generated token `index` of the request seeded `seed`, in [0, 1)."""
    if index < 0:
        raise InvalidArgument("index", f"must be >= 0, got {index}")
    digest = hashlib.blake2b(
        struct.pack("<QQ", seed & _SEED_MASK, index), digest_size=8, person=b"kvrs-sample"
    ).digest()
    # 53 random bits: every double in [0, 1) on the 2**-53 grid, never 1.0.
    return (struct.unpack("<Q", digest)[0] >> 11) * 2.0**-53


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn from a model's next-token distribution (OpenAI's meaning)."""

    temperature: float = 0.0
    """Softmax temperature; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probabilities first reach top_p (1 = all)."""
    top_k: int = 0
    """Keep the top_k most likely tokens (0 = all)."""
    seed: int = 0
    """Seed of the per-position draws (`uniform`)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise InvalidArgument(
                "sampling.temperature", f"must be in [0, 100], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:  # NaN fails too
            raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidArgument(
                "sampling.top_k", f"must be in [0, {MAX_TOP_K}], got {self.top_k}"
            )
        if not 0 <= self.seed <= _SEED_MASK:
            raise InvalidArgument(
                "sampling.seed", f"must be a 64-bit unsigned integer, got {self.seed}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def of(cls, temperature: float, top_p: float, top_k: int, seed: int) -> Sampling:
        """From wire values, where 0 means "unset" for top_p (all tokens)."""
        return cls(temperature=temperature, top_p=top_p or 1.0, top_k=top_k, seed=seed)
