"""How a worker's continuous batching cuts queued work into forward passes.

A worker takes its queued work in arrival order, each request's next tokens at most once
per pass, up to a token budget per pass (`WORKER_MAX_BATCH_TOKENS`); work longer than
what is left of the budget is computed in chunks over the next passes. Both the worker
(what it reports as queued, W(x)) and the recovery planner (when each of a batch's
recoveries has its KV ready on a shared target) need that packing; this is the one
implementation of it. A pass is priced by `ComputeProfile.batch_s`.

A segment is (cached_tokens, new_tokens): `new_tokens` appended to a sequence that
already holds `cached_tokens`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvrs.errors import InvalidArgument

__all__ = ["pack", "pass_ends_s"]

Segment = tuple[int, int]


def pack(work: Sequence[Segment], budget_tokens: int) -> list[list[Segment]]:
    """The passes `work` (in arrival order, all queued now) fills, each as its segments:
    every pass holds `budget_tokens` new tokens except the last, and a request cut at a
    pass's end continues, its cached tokens grown, at the start of the next."""
    _check_budget(budget_tokens)
    passes: list[list[Segment]] = []
    current: list[Segment] = []
    room = budget_tokens
    for cached, left in work:
        while left > 0:
            take = min(left, room)
            current.append((cached, take))
            cached, left, room = cached + take, left - take, room - take
            if not room:
                passes.append(current)
                current, room = [], budget_tokens
    if current:
        passes.append(current)
    return passes


def pass_ends_s(
    work: Sequence[tuple[float, int, int]],
    budget_tokens: int,
    pass_s: Callable[[list[Segment]], float],
    free_s: float = 0.0,
    streams: int = 0,
    after: Sequence[int | None] = (),
    stream_context_tokens: int = 0,
) -> list[float]:
    """When each piece of `work` — (ready_s, cached_tokens, new_tokens), ready when its
    KV has arrived — has its last token computed, in seconds from now.

    The worker's loop as it runs: it is busy until `free_s`; then each pass takes the
    pieces ready by its start, in the order of their ready time (ties in the order their
    KV arrived, then in the given order), one chunk each, while the budget lasts.
    `streams` decoding streams already running there put one token each into every pass,
    on top of the `stream_context_tokens` they hold between them (a step reads every
    stream's cache: 32 streams of 1,500 tokens cost several times 32 of none). `pass_s`
    prices a pass's segments.
    `after[i]`, when given and not None, is the index of a piece that must be computed
    before piece i is ready (a HYBRID's extend follows the recompute of its prefix).

    An idle loop starts a pass the moment work arrives. One with streams running never
    idles: it runs their decode steps back to back, and work that arrives during a step
    waits for it to end, so pieces arriving within one step of each other share a pass
    (a recovery batch's transfers end microseconds apart in the plan, milliseconds apart
    on the machine, and their extends run as one pass, not one after another)."""
    _check_budget(budget_tokens)
    if streams < 0:
        raise InvalidArgument("streams", f"must be >= 0, got {streams}")
    if stream_context_tokens < 0:
        raise InvalidArgument("stream_context_tokens", f"must be >= 0, got {stream_context_tokens}")
    if after and len(after) != len(work):
        raise InvalidArgument("after", f"needs one entry per piece, got {len(after)}")
    ready_at = [ready_s for ready_s, _, _ in work]
    # Pieces ready together are queued in the order their KV arrived: a piece held for
    # another is submitted when its own KV is in, and waits in the queue from then.
    arrival = [(ready_s, i) for i, (ready_s, _, _) in enumerate(work)]
    cached = [c for _, c, _ in work]
    left = [new for _, _, new in work]
    ends = [max(0.0, ready_s) if new <= 0 else 0.0 for ready_s, _, new in work]
    # Pieces waiting for another piece: released, ready no earlier than its end, when it
    # is computed.
    waiting: dict[int, list[int]] = {}
    for i, first in enumerate(after):
        if first is None:
            continue
        if left[first] > 0:
            waiting.setdefault(first, []).append(i)
        else:
            ready_at[i] = max(ready_at[i], ends[first])
    held = {i for dependents in waiting.values() for i in dependents}
    pending = sorted(
        (i for i in range(len(work)) if left[i] > 0 and i not in held),
        key=lambda i: (ready_at[i], arrival[i]),
    )
    # The context split evenly: a pass's price is linear in each sequence's cached tokens.
    share, extra = divmod(stream_context_tokens, streams) if streams else (0, 0)
    running = [(share + 1, 1)] * extra + [(share, 1)] * (streams - extra)
    room_per_pass = max(1, budget_tokens - streams)
    step_s = pass_s(running) if running else 0.0
    now = free_s
    while pending:
        arrives_s = ready_at[pending[0]]
        if arrives_s > now and step_s > 0.0:
            now += math.ceil((arrives_s - now) / step_s) * step_s
        elif arrives_s > now:
            now = arrives_s
        segments = list(running)
        taken: list[int] = []
        room = room_per_pass
        for i in pending:
            if ready_at[i] > now:
                break
            take = min(left[i], room)
            segments.append((cached[i], take))
            cached[i] += take
            left[i] -= take
            room -= take
            taken.append(i)
            if not room:
                break
        now += pass_s(segments)
        released = []
        for i in taken:
            if left[i] == 0:
                ends[i] = now
                for j in waiting.pop(i, ()):
                    ready_at[j] = max(ready_at[j], now)
                    released.append(j)
        pending = [i for i in pending if left[i] > 0]
        if released:
            pending = sorted([*pending, *released], key=lambda i: (ready_at[i], arrival[i]))
    return ends


def _check_budget(budget_tokens: int) -> None:
    if budget_tokens <= 0:
        raise InvalidArgument("budget_tokens", f"must be > 0, got {budget_tokens}")
