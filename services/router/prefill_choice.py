"""The router's prefill choice: its view of the prefill instances, given to the core rule.

`kvrs.prefill.choose_prefill` decides; this module only says what the router knows of
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
from kvrs.costmodel import prefix_hit_tokens
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
    hits = {
        index: prefix_hit_tokens(
            prefix_hashes, instance.resident_prefix_hashes, block_tokens, prompt_tokens
        )
        for index, instance in enumerate(ordered)
        if instance.resident_prefix_hashes
    }
    waits = [i.queued_work_s + inflight_s.get(i.instance_id, 0.0) for i in ordered]
    finishes = prefill.prefill_finishes(waits, prompt_tokens, profile, hits)
    index = prefill.soonest(finishes, [i.queue_depth for i in ordered])
    work_s = prefill.prefill_finish_s(profile, prompt_tokens, 0.0, hits.get(index, 0))
    if not options:
        return PrefillChoice(ordered[index], work_s)
    return PrefillChoice(
        ordered[index],
        work_s,
        tuple(
            PrefillOption(instance.instance_id, finish_s, hits.get(k, 0))
            for k, (instance, finish_s) in enumerate(zip(ordered, finishes.tolist(), strict=True))
        ),
    )
