"""Request traces: Mooncake's JSONL format, arrival scaling, context caps, synthetic workloads.

A Mooncake trace line is `{"timestamp": ms, "input_length": tokens, "output_length":
tokens, "hash_ids": [...]}`, where each hash id names one 512-token prefix block: two
requests that share leading hash ids share that much of their prompt. Any file in this
format loads; unknown keys are ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvrs.errors import InvalidArgument

MOONCAKE_BLOCK_TOKENS = 512


class TraceRequest:
    """One request of a workload; `hash_ids` are its prompt's prefix blocks, in order."""

    __slots__ = ("index", "arrival_s", "input_tokens", "output_tokens", "hash_ids", "deadline_s")

    def __init__(
        self,
        index: int,
        arrival_s: float,
        input_tokens: int,
        output_tokens: int,
        hash_ids: tuple[int, ...] = (),
        deadline_s: float | None = None,
    ) -> None:
        self.index = index
        self.arrival_s = arrival_s
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.hash_ids = hash_ids
        self.deadline_s = deadline_s

    def __repr__(self) -> str:
        return (
            f"TraceRequest({self.index}, arrival_s={self.arrival_s:.3f}, "
            f"input_tokens={self.input_tokens}, output_tokens={self.output_tokens}, "
            f"blocks={len(self.hash_ids)})"
        )

    def to_mooncake(self) -> dict:
        """The request as a Mooncake trace line (timestamp rounded to whole ms)."""
        return {
            "timestamp": int(round(self.arrival_s * 1000)),
            "input_length": self.input_tokens,
            "output_length": self.output_tokens,
            "hash_ids": list(self.hash_ids),
        }


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace; arrivals become seconds from the first line."""
    requests: list[TraceRequest] = []
    origin_ms: float | None = None
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if limit is not None and len(requests) >= limit:
                break
            try:
                row = json.loads(line)
                timestamp_ms = float(row["timestamp"])
                input_tokens = int(row["input_length"])
                output_tokens = int(row["output_length"])
                hash_ids = tuple(int(h) for h in row.get("hash_ids", ()))
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidArgument("trace", f"{path}:{line_no}: {exc}") from exc
            if input_tokens < 1 or output_tokens < 1:
                raise InvalidArgument("trace", f"{path}:{line_no}: lengths must be >= 1")
            if origin_ms is None:
                origin_ms = timestamp_ms
            requests.append(
                TraceRequest(
                    len(requests),
                    (timestamp_ms - origin_ms) / 1000.0,
                    input_tokens,
                    output_tokens,
                    hash_ids,
                )
            )
    return requests


def write_mooncake(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write requests as a Mooncake-format JSONL trace."""
    with open(path, "w", encoding="utf-8") as handle:
        for request in requests:
            handle.write(json.dumps(request.to_mooncake()) + "\n")


def scale_arrivals(requests: Iterable[TraceRequest], rate_scale: float) -> list[TraceRequest]:
    """Replay `rate_scale` times faster (2.0 halves every inter-arrival gap)."""
    if rate_scale <= 0:
        raise InvalidArgument("rate_scale", "must be > 0")
    return [
        TraceRequest(
            r.index,
            r.arrival_s / rate_scale,
            r.input_tokens,
            r.output_tokens,
            r.hash_ids,
            r.deadline_s,
        )
        for r in requests
    ]


def cap_context(
    requests: Iterable[TraceRequest], max_input_tokens: int | None, mode: str = "truncate"
) -> list[TraceRequest]:
    """Limit prompt length: `truncate` cuts long prompts, `filter` drops them.

    Indices are renumbered so a capped trace is a trace in its own right.
    """
    if mode not in ("truncate", "filter"):
        raise InvalidArgument("context_cap_mode", f"unknown mode {mode!r}")
    kept: list[TraceRequest] = []
    for r in requests:
        if max_input_tokens is None or r.input_tokens <= max_input_tokens:
            tokens, blocks = r.input_tokens, r.hash_ids
        elif mode == "filter":
            continue
        else:
            tokens = max_input_tokens
            blocks = r.hash_ids[: math.ceil(max_input_tokens / MOONCAKE_BLOCK_TOKENS)]
        kept.append(
            TraceRequest(len(kept), r.arrival_s, tokens, r.output_tokens, blocks, r.deadline_s)
        )
    return kept


@dataclass(frozen=True)
class TraceStats:
    """Summary of a workload, as reported in the Mooncake paper's Table 2."""

    requests: int
    mean_input_tokens: float
    mean_output_tokens: float
    p50_input_tokens: float
    p99_input_tokens: float
    duration_s: float
    rate_per_s: float
    cache_ratio: float  # share of prefix blocks seen earlier in the trace (infinite cache)

    @classmethod
    def of(cls, requests: list[TraceRequest]) -> TraceStats:
        if not requests:
            raise InvalidArgument("trace", "empty")
        inputs = np.fromiter((r.input_tokens for r in requests), dtype=np.float64)
        outputs = np.fromiter((r.output_tokens for r in requests), dtype=np.float64)
        seen: set[int] = set()
        hits = total = 0
        for r in requests:
            for block in r.hash_ids:
                total += 1
                if block in seen:
                    hits += 1
                else:
                    seen.add(block)
        duration_s = requests[-1].arrival_s - requests[0].arrival_s
        return cls(
            requests=len(requests),
            mean_input_tokens=float(inputs.mean()),
            mean_output_tokens=float(outputs.mean()),
            p50_input_tokens=float(np.percentile(inputs, 50)),
            p99_input_tokens=float(np.percentile(inputs, 99)),
            duration_s=duration_s,
            rate_per_s=(len(requests) - 1) / duration_s if duration_s > 0 else 0.0,
            cache_ratio=hits / total if total else 0.0,
        )


@dataclass(frozen=True)
class SyntheticWorkload:
    """A Mooncake-like generated workload: Poisson arrivals, lognormal lengths, sessions.

    A request either starts a new session (a fresh prompt, optionally behind one of a
    few shared system prompts) or continues a recent session, whose previous prompt and
    answer become the new prompt's prefix, which is what gives real traces their cache
    ratio. Defaults approximate the synthetic Mooncake trace (input p50 ≈ 11.6k tokens,
    output mean ≈ 150, ≈ 3.9 req/s).
    """

    requests: int = 1000
    rate_per_s: float = 3.9
    input_median_tokens: float = 7000.0
    input_sigma: float = 0.9
    max_input_tokens: int = 128_000
    output_median_tokens: float = 70.0
    output_sigma: float = 1.25
    max_output_tokens: int = 2048
    continue_prob: float = 0.62  # share of requests that continue a session
    active_sessions: int = 64  # recent sessions a continuation may pick from
    system_prompts: int = 8  # shared system prompts new sessions may start with
    system_prompt_tokens: int = 2048
    system_prompt_prob: float = 0.3
    seed: int = 0

    def __iter__(self) -> Iterator[TraceRequest]:
        rng = np.random.default_rng(self.seed)
        block = MOONCAKE_BLOCK_TOKENS
        next_block = 0
        system_blocks = []
        for _ in range(self.system_prompts):
            count = max(1, self.system_prompt_tokens // block)
            system_blocks.append(tuple(range(next_block, next_block + count)))
            next_block += count
        sessions: list[tuple[tuple[int, ...], int]] = []  # (full-block prefix, tokens)
        arrival_s = 0.0
        chunk = 4096
        for start in range(0, self.requests, chunk):
            n = min(chunk, self.requests - start)
            gaps = rng.exponential(1.0 / self.rate_per_s, n)
            fresh = rng.lognormal(math.log(self.input_median_tokens), self.input_sigma, n)
            outputs = rng.lognormal(math.log(self.output_median_tokens), self.output_sigma, n)
            kinds = rng.random(n)
            picks = rng.random(n)
            for i in range(n):
                arrival_s += float(gaps[i])
                new_tokens = max(1, int(fresh[i]))
                output_tokens = int(min(self.max_output_tokens, max(1, outputs[i])))
                if sessions and kinds[i] < self.continue_prob:
                    slot = int(picks[i] * len(sessions))
                    prefix, prefix_tokens = sessions[slot]
                    new_tokens = max(1, new_tokens // 4)  # a follow-up turn is shorter
                elif (
                    kinds[i]
                    < self.continue_prob + self.system_prompt_prob * (1 - self.continue_prob)
                    and system_blocks
                ):
                    slot = -1
                    prefix = system_blocks[int(picks[i] * len(system_blocks))]
                    prefix_tokens = len(prefix) * block
                else:
                    slot, prefix, prefix_tokens = -1, (), 0
                input_tokens = min(self.max_input_tokens, prefix_tokens + new_tokens)
                total_blocks = math.ceil(input_tokens / block)
                kept = prefix[:total_blocks]
                extra = total_blocks - len(kept)
                hash_ids = kept + tuple(range(next_block, next_block + extra))
                next_block += extra
                yield TraceRequest(start + i, arrival_s, input_tokens, output_tokens, hash_ids)
                # The answer joins the session; only whole blocks can be shared later.
                session_tokens = input_tokens + output_tokens
                full = min(len(hash_ids), session_tokens // block)
                entry = (hash_ids[:full], full * block)
                if slot >= 0:
                    sessions[slot] = entry
                elif len(sessions) < self.active_sessions:
                    sessions.append(entry)
                else:
                    sessions[int(picks[i] * 7919) % self.active_sessions] = entry

    def generate(self) -> list[TraceRequest]:
        """All requests as a list."""
        return list(self)
