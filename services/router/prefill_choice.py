"""Where to prefill: the instance that would finish the prompt soonest.

Finish time of prefill instance p for a prompt of L tokens:
    W(p) + inflight(p) + T_pf(L - hit(p))
where W(p) is the queued work p last reported to gossip, inflight(p) the prefill work
this router sent p since (gossip lags by a heartbeat, so without it a burst would all
land on the instance that looked idle), and hit(p) the prompt tokens whose KV p already
holds (its resident prefix blocks). Ties go to the lower queue depth, then the id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvrs.costmodel import prefix_hit_tokens
from kvrs.errors import FailedPrecondition
from kvrs.profile import ComputeProfile
from services.common.membership import Instance


def choose_prefill(
    candidates: Sequence[Instance],
    prompt_tokens: int,
    prefix_hashes: Sequence[int],
    block_tokens: int,
    profile: ComputeProfile,
    inflight_s: Mapping[str, float],
) -> tuple[Instance, float]:
    """The chosen instance and its predicted finish time (seconds from now)."""
    if not candidates:
        raise FailedPrecondition("no alive prefill instance", field="prefill_instances")
    best: tuple[tuple[float, int, str], Instance, float] | None = None
    for instance in candidates:
        hit = prefix_hit_tokens(
            prefix_hashes, instance.resident_prefix_hashes, block_tokens, prompt_tokens
        )
        finish_s = (
            instance.queued_work_s
            + inflight_s.get(instance.instance_id, 0.0)
            + profile.prefill_s(prompt_tokens - hit)
        )
        key = (finish_s, instance.queue_depth, instance.instance_id)
        if best is None or key < best[0]:
            best = (key, instance, finish_s)
    assert best is not None
    return best[1], best[2]
