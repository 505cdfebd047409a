"""Workload generators with the structure of real serving traces, for policies to be
tested on workloads they were not tuned on.

One generator, `GeneratedWorkload`, draws three things independently:
- arrivals: a Poisson stream, or bursts (a burst every `burst_gap_s` on average, its
  requests `rate_per_s · burst_gap_s` on average, spread over `burst_spread_s`);
- lengths: lognormal prompt and output lengths, capped;
- prefixes: every request starts with the `shared_blocks` blocks every request shares (a
  system prompt); then it continues one of the active sessions with probability
  `continue_prob` (the session's prompt and answer so far become its prefix, and a new
  message a quarter of a fresh prompt's length follows), or starts a new one, behind one
  of `prefixes` popular prefixes with probability `prefix_prob` (popularity
  Zipf-distributed with exponent `prefix_zipf`, uniform at 0).

`GENERATORS` names the presets; `conversation` has the published shape of Mooncake's
conversation trace (FAST'25): ~3.4 req/s in bursts every 3 s, mean input ~12.7k tokens
(~7 % over 32k), mean output ~340, every request sharing its first 512-token block, ~40 %
sharing at least two, cache ratio ~0.42 (4,000 requests, seed 0; see the tests).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrs.errors import InvalidArgument
from kvrs.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["GENERATORS", "GeneratedWorkload", "make_generator"]


@dataclass(frozen=True)
class GeneratedWorkload:
    """A generated trace (see the module docstring for what each group of fields draws)."""

    requests: int = 1000
    rate_per_s: float = 3.4
    burst_gap_s: float = 0.0
    """Mean gap between bursts; 0 for a Poisson stream of single requests."""
    burst_spread_s: float = 0.5
    """A burst's requests arrive uniformly over this long."""
    input_median_tokens: float = 6000.0
    input_sigma: float = 1.1
    max_input_tokens: int = 128_000
    output_median_tokens: float = 229.0
    output_sigma: float = 0.9
    max_output_tokens: int = 4096
    shared_blocks: int = 1
    """Leading blocks every request shares (a system prompt); 0 for none."""
    continue_prob: float = 0.42
    active_sessions: int = 256
    prefixes: int = 0
    """Popular prefixes a new session may start behind (after the shared blocks)."""
    prefix_blocks: int = 4
    prefix_prob: float = 0.0
    prefix_zipf: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise InvalidArgument("generator.requests", f"must be >= 1, got {self.requests}")
        if not self.rate_per_s > 0:
            raise InvalidArgument("generator.rate_per_s", f"must be > 0, got {self.rate_per_s}")
        if self.burst_gap_s < 0 or self.burst_spread_s < 0:
            raise InvalidArgument("generator.burst_gap_s", "burst gap and spread must be >= 0")
        for name in ("continue_prob", "prefix_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise InvalidArgument(f"generator.{name}", "must be in [0, 1]")
        if self.shared_blocks < 0 or self.prefixes < 0 or self.prefix_blocks < 1:
            raise InvalidArgument("generator.prefixes", "block counts must be >= 0 (blocks >= 1)")

    def _arrivals(self, rng: np.random.Generator) -> np.ndarray:
        n = self.requests
        if self.burst_gap_s == 0:
            return np.cumsum(rng.exponential(1.0 / self.rate_per_s, n))
        times: list[float] = []
        start_s = 0.0
        mean_size = self.rate_per_s * self.burst_gap_s
        while len(times) < n:
            start_s += float(rng.exponential(self.burst_gap_s))
            size = 1 + int(rng.poisson(max(0.0, mean_size - 1.0)))
            times.extend((start_s + rng.uniform(0.0, self.burst_spread_s, size)).tolist())
        return np.sort(np.array(times[:n]))

    def __iter__(self) -> Iterator[TraceRequest]:
        rng = np.random.default_rng(self.seed)
        block = MOONCAKE_BLOCK_TOKENS
        n = self.requests
        arrivals = self._arrivals(rng)
        inputs = rng.lognormal(math.log(self.input_median_tokens), self.input_sigma, n)
        outputs = rng.lognormal(math.log(self.output_median_tokens), self.output_sigma, n)
        kinds = rng.random(n)
        starts = rng.random(n)
        picks = rng.integers(0, 2**31, n)
        shared = tuple(range(self.shared_blocks))
        next_block = self.shared_blocks
        popular: list[tuple[int, ...]] = []
        for _ in range(self.prefixes):
            popular.append(tuple(range(next_block, next_block + self.prefix_blocks)))
            next_block += self.prefix_blocks
        weights = np.arange(1, self.prefixes + 1, dtype=np.float64) ** -self.prefix_zipf
        popularity = np.cumsum(weights / weights.sum()) if self.prefixes else np.array([])
        sessions: list[tuple[int, ...]] = []  # full-block prefix of each active session
        for i in range(n):
            drawn = max(1.0, inputs[i])
            output_tokens = int(min(self.max_output_tokens, max(1.0, outputs[i])))
            slot = -1
            prefix: tuple[int, ...] = shared
            if sessions and kinds[i] < self.continue_prob:
                slot = int(picks[i] % len(sessions))
                prefix = max(sessions[slot], shared, key=len)
                # A next turn: the history, then a new message a quarter of a fresh prompt.
                drawn = len(prefix) * block + drawn / 4
            input_tokens = int(min(self.max_input_tokens, drawn))
            blocks = math.ceil(input_tokens / block)
            if slot < 0 and popular and starts[i] < self.prefix_prob:
                choice = int(np.searchsorted(popularity, starts[i] / self.prefix_prob))
                prefix = shared + popular[min(choice, len(popular) - 1)]
            kept = prefix[:blocks]
            extra = blocks - len(kept)
            hash_ids = kept + tuple(range(next_block, next_block + extra))
            next_block += extra
            yield TraceRequest(i, float(arrivals[i]), input_tokens, output_tokens, hash_ids)
            # The answer joins the session; only whole blocks can be shared later.
            full = min(len(hash_ids), (input_tokens + output_tokens) // block)
            entry = hash_ids[:full]
            if slot >= 0:
                sessions[slot] = entry
            elif len(sessions) < self.active_sessions:
                sessions.append(entry)
            else:
                sessions[int(picks[i] // 7) % self.active_sessions] = entry

    def generate(self) -> list[TraceRequest]:
        """All requests as a list."""
        return list(self)


GENERATORS: dict[str, dict[str, Any]] = {
    # Mooncake's conversation trace, by its published statistics (module docstring).
    "conversation": {"rate_per_s": 3.3, "burst_gap_s": 3.0},
    # Synthetic-trace lengths, but arrivals in bursts of ~20 every 5 s.
    "bursty": {
        "rate_per_s": 3.9,
        "burst_gap_s": 5.0,
        "burst_spread_s": 0.3,
        "input_median_tokens": 7000.0,
        "input_sigma": 0.9,
        "output_median_tokens": 70.0,
        "output_sigma": 1.25,
        "shared_blocks": 0,
        "continue_prob": 0.3,
    },
    # Long answers: decode-bound, so the decode-load term and TBT matter most.
    "long_output": {
        "rate_per_s": 2.5,
        "input_median_tokens": 4000.0,
        "input_sigma": 0.8,
        "output_median_tokens": 900.0,
        "output_sigma": 0.6,
    },
    # Short prompts at a higher rate: transfers are small, queues dominate.
    "short_prompt": {
        "rate_per_s": 12.0,
        "input_median_tokens": 1200.0,
        "input_sigma": 0.7,
        "output_median_tokens": 150.0,
        "output_sigma": 0.8,
        "continue_prob": 0.3,
    },
    # A few long prefixes that most new sessions start behind, Zipf-popular.
    "skewed_prefix": {
        "rate_per_s": 3.6,
        "input_median_tokens": 10000.0,
        "input_sigma": 0.7,
        "output_median_tokens": 150.0,
        "shared_blocks": 0,
        "continue_prob": 0.2,
        "prefixes": 16,
        "prefix_blocks": 16,
        "prefix_prob": 0.8,
        "prefix_zipf": 1.2,
    },
}


def make_generator(spec: Mapping[str, Any]) -> GeneratedWorkload:
    """The generator `spec["kind"]` (a GENERATORS preset) with the other keys overriding it."""
    params = dict(spec)
    kind = params.pop("kind", None)
    if kind not in GENERATORS:
        raise InvalidArgument(
            "workload.generator.kind", f"one of {', '.join(GENERATORS)}, got {kind!r}"
        )
    fields = {f.name for f in dataclasses.fields(GeneratedWorkload)}
    unknown = set(params) - fields
    if unknown:
        raise InvalidArgument("workload.generator", f"unknown key(s): {', '.join(sorted(unknown))}")
    return GeneratedWorkload(**{**GENERATORS[kind], **params})
