"""The router's prefill choice: its view of the prefill instances, given to the core rule.

`kvrs.prefill.rank_prefills` decides; this module only says what the router knows of
each instance: W(p) is the queued work p last reported to gossip plus the prefill work
this router sent p since (gossip lags by a heartbeat, so without it a burst would all
land on the instance that looked idle), and hit(p) the prompt tokens whose KV p already
holds (its resident prefix blocks). Candidates are taken in id order, so ties go to the
lower queue depth, then the lower id.

With `options` it also hands back every candidate as a `PrefillOption` (its predicted
finish and hit), for a placement policy that chooses prefill and decode together.

What the router adds to its in-flight work for the chosen instance is the prompt's
compute there, not its predicted finish: the finish includes W(p), in-flight work
already counted, and adding it again would double what a burst sent with each request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvrs import prefill
from kvrs.errors import FailedPrecondition
from kvrs.prefill import PrefillOption
from kvrs.profile import ComputeProfile
from services.common.membership import Instance


@dataclass(frozen=True)
class PrefillChoice:
    instance: Instance
    work_s: float
    """The prompt's compute on `instance`, on top of the prefix it holds (seconds)."""
    options: tuple[PrefillOption, ...] = ()
    """Every candidate, in id order, when asked for."""


def choose_prefill(
    candidates: Sequence[Instance],
    prompt_tokens: int,
    prefix_hashes: Sequence[int],
    block_tokens: int,
    profile: ComputeProfile,
    inflight_s: Mapping[str, float],
    options: bool = False,
) -> PrefillChoice:
    """The chosen instance, the prompt's compute there and, with `options`, every
    candidate as a prefill option."""
    if not candidates:
        raise FailedPrecondition("no alive prefill instance", field="prefill_instances")
    ordered = sorted(candidates, key=lambda instance: instance.instance_id)
    ranking = prefill.rank_prefills(
        [i.queued_work_s + inflight_s.get(i.instance_id, 0.0) for i in ordered],
        [i.queue_depth for i in ordered],
        [i.resident_prefix_hashes for i in ordered],
        prompt_tokens,
        prefix_hashes,
        block_tokens,
        profile,
    )
    best = ranking.best
    work_s = prefill.prefill_finish_s(profile, prompt_tokens, 0.0, ranking.hit_tokens[best])
    return PrefillChoice(
        ordered[best],
        work_s,
        ranking.options([i.instance_id for i in ordered]) if options else (),
    )
