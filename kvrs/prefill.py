"""Where to prefill: the instance that would finish the prompt soonest.

The router, the endpoint picker and the simulator all choose with this one rule. The
predicted finish of prefill instance p for a prompt of L tokens is

    W(p) + T_ext(hit(p), L − hit(p))

where W(p) is the work queued on p (as the caller knows it: the last report, minus what
drained since it was taken, plus what the caller itself sent since), hit(p) the leading
prompt tokens whose KV p already holds, and T_ext the profile's cost of computing the
rest on top of them (`ComputeProfile.extend_s`: attention still reads the cached
tokens, so this is not T_pf(L − hit)). At least one token is always computed (the
first token comes out of it), so hit(p) is at most L − 1. Ties go to the lower queue
depth, then to the earlier candidate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvrs.costmodel import prefix_hit_tokens
from kvrs.errors import FailedPrecondition, InvalidArgument
from kvrs.profile import ComputeProfile

__all__ = [
    "PrefillOption",
    "PrefillRanking",
    "computed_hit_tokens",
    "prefill_finish_s",
    "prefill_finishes",
    "rank_prefills",
    "soonest",
]


@dataclass(frozen=True)
class PrefillOption:
    """A prefill instance a prompt could go to, as the caller predicts it there: what a
    policy choosing prefill and decode together (`kvrs.placement.Kvrs.choose_prefill`)
    weighs against the decode side."""

    instance_id: str
    finish_s: float
    """Seconds from now until it would have prefilled the prompt (`prefill_finishes`)."""
    prefix_hit_tokens: int = 0
    """Leading prompt tokens whose KV it already holds."""


def computed_hit_tokens(hit_tokens: int, prompt_tokens: int) -> int:
    """The cached tokens a prefill can reuse: `hit_tokens`, leaving at least one to compute."""
    return max(0, min(hit_tokens, prompt_tokens - 1))


def prefill_finish_s(
    profile: ComputeProfile, prompt_tokens: int, wait_s: float, hit_tokens: int = 0
) -> float:
    """Seconds from now until an instance with `wait_s` queued work and `hit_tokens`
    cached prompt tokens would finish prefilling `prompt_tokens` (see the module doc)."""
    hit = computed_hit_tokens(hit_tokens, prompt_tokens)
    return max(0.0, wait_s) + profile.extend_s(hit, prompt_tokens - hit)


def prefill_finishes(
    wait_s: Sequence[float] | np.ndarray,
    prompt_tokens: int,
    profile: ComputeProfile,
    hit_tokens: Mapping[int, int] | None = None,
) -> np.ndarray:
    """Every candidate's predicted finish (seconds from now), the rule's ranking (`soonest`
    picks from it; kvrs placement's joint choice weighs it against the decode side)."""
    if prompt_tokens < 1:
        raise InvalidArgument("prompt_tokens", f"must be >= 1, got {prompt_tokens}")
    waits = np.maximum(np.asarray(wait_s, dtype=float), 0.0)
    if waits.size == 0:
        raise FailedPrecondition("no alive prefill instance", field="prefill_instances")
    finish = waits + profile.prefill_s(prompt_tokens)
    if hit_tokens:
        # `prefill_finish_s` for each candidate with a hit, in Python floats rather than
        # numpy scalars (the same float operations), each distinct hit priced once.
        wait_list = waits.tolist()
        compute_s: dict[int, float] = {}
        for index, hit in hit_tokens.items():
            if hit > 0:
                seconds = compute_s.get(hit)
                if seconds is None:
                    cached = computed_hit_tokens(hit, prompt_tokens)
                    seconds = compute_s[hit] = profile.extend_s(cached, prompt_tokens - cached)
                finish[index] = max(0.0, wait_list[index]) + seconds
    return finish


def soonest(finish: np.ndarray, queue_depth: Sequence[int] | np.ndarray | None = None) -> int:
    """The index of the earliest of `finish` (`prefill_finishes`); ties go to the lower
    `queue_depth` when given, then to the earlier candidate."""
    best = int(finish.argmin())
    if queue_depth is not None:
        tied = np.flatnonzero(finish == finish[best])
        if tied.size > 1:
            depths = np.asarray(queue_depth)
            best = int(tied[depths[tied].argmin()])
    return best


@dataclass(frozen=True)
class PrefillRanking:
    """The rule applied to a caller's candidates: the one chosen, and each one's
    predicted finish and prefix hit (in the candidates' order)."""

    best: int
    finish_s: tuple[float, ...]
    hit_tokens: tuple[int, ...]

    def options(self, instance_ids: Sequence[str]) -> tuple[PrefillOption, ...]:
        """Every candidate as a `PrefillOption`, `instance_ids` naming them in order."""
        return tuple(
            PrefillOption(instance_id, finish_s, hit)
            for instance_id, finish_s, hit in zip(
                instance_ids, self.finish_s, self.hit_tokens, strict=True
            )
        )


def rank_prefills(
    wait_s: Sequence[float],
    queue_depth: Sequence[int],
    resident_blocks: Sequence[frozenset[int]],
    prompt_tokens: int,
    prefix_hashes: Sequence[int],
    block_tokens: int,
    profile: ComputeProfile,
) -> PrefillRanking:
    """The rule over candidates as a caller knows them: W (`wait_s`), queue depth and the
    prefix blocks each holds (`resident_blocks`), for a prompt of `prompt_tokens` whose
    blocks hash to `prefix_hashes`. The router and the endpoint picker both choose here."""
    hits = {
        index: prefix_hit_tokens(prefix_hashes, blocks, block_tokens, prompt_tokens)
        for index, blocks in enumerate(resident_blocks)
        if blocks
    }
    finish = prefill_finishes(wait_s, prompt_tokens, profile, hits)
    return PrefillRanking(
        best=soonest(finish, queue_depth),
        finish_s=tuple(finish.tolist()),
        hit_tokens=tuple(hits.get(index, 0) for index in range(len(resident_blocks))),
    )
