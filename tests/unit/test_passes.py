"""`kvrs.passes`: work cut into a worker's forward passes as its loop takes it."""

from __future__ import annotations

import pytest

from kvrs.errors import InvalidArgument
from kvrs.passes import pack, pass_ends_s


def tokens(segments: list[tuple[int, int]]) -> float:
    """A pass priced at one second per new token: ends read as token counts."""
    return float(sum(new for _, new in segments))


def test_pack_cuts_work_at_the_budget_and_continues_it_in_the_next_pass() -> None:
    assert pack([(100, 1100), (0, 1100), (64, 10)], 2048) == [
        [(100, 1100), (0, 948)],
        [(948, 152), (64, 10)],
    ]
    assert pack([(0, 5000)], 2048) == [[(0, 2048)], [(2048, 2048)], [(4096, 904)]]
    assert pack([(7, 0)], 16) == []


def test_work_ready_together_ends_pass_by_pass_in_arrival_order() -> None:
    work = [(0.0, 0, 1100)] * 4
    # Passes of 2,048 tokens: [1100, 948], [152, 1100, 796], [304].
    assert pass_ends_s(work, 2048, tokens) == [2048.0, 4096.0, 4096.0, 4400.0]
    # The loop is busy first, and two running streams add a token each to every pass.
    assert pass_ends_s(work, 2048, tokens, free_s=10.0, streams=2) == [
        2058.0,
        4106.0,
        4106.0,
        4416.0,
    ]


def test_work_joins_the_first_pass_that_starts_after_it_arrives() -> None:
    # The second piece arrives during the first pass: it waits for the next one.
    assert pass_ends_s([(0.0, 0, 100), (50.0, 0, 100)], 2048, tokens) == [100.0, 200.0]
    # The loop idles until work arrives; the earlier arrival goes first, whatever the order.
    assert pass_ends_s([(30.0, 0, 10), (20.0, 0, 10)], 2048, tokens) == [40.0, 30.0]
    # Nothing to compute: done when it arrives.
    assert pass_ends_s([(5.0, 64, 0)], 2048, tokens) == [5.0]


def test_a_pass_is_priced_with_each_pieces_cached_tokens() -> None:
    seen: list[list[tuple[int, int]]] = []

    def price(segments: list[tuple[int, int]]) -> float:
        seen.append(list(segments))
        return 1.0

    pass_ends_s([(0.0, 500, 3000)], 2048, price, streams=1)
    # The running stream's own decode step first (the loop's rhythm), then the passes.
    assert seen == [[(0, 1)], [(0, 1), (500, 2047)], [(0, 1), (2547, 953)]]


def test_running_streams_are_priced_with_the_context_they_hold() -> None:
    """Each decode step reads every running stream's cache: the streams' context, split
    evenly (a pass's price is linear in it), is in every pass they are part of."""
    seen: list[list[tuple[int, int]]] = []

    def price(segments: list[tuple[int, int]]) -> float:
        seen.append(list(segments))
        return 1.0

    pass_ends_s([(0.0, 0, 10)], 2048, price, streams=3, stream_context_tokens=3001)
    streams = [(1001, 1), (1000, 1), (1000, 1)]
    assert seen == [streams, [*streams, (0, 10)]]
    with pytest.raises(InvalidArgument, match="stream_context_tokens"):
        pass_ends_s([(0.0, 0, 10)], 2048, price, streams=1, stream_context_tokens=-1)


def test_pieces_released_together_queue_in_the_order_their_kv_arrived() -> None:
    """Two extends wait for one recomputed prefix; the short one's KV came in first, so
    the worker queued it first: it shares the first pass after the prefix with the long
    one's first chunk instead of waiting behind the whole of it."""
    work = [(0.0, 0, 100), (0.5, 0, 2000), (0.2, 0, 10)]
    ends = pass_ends_s(work, 1024, tokens, after=[None, 0, 0])
    # Passes: the prefix (100); the short one and 1,014 of the long; its other 986.
    assert ends == [100.0, 2110.0, 1124.0]


@pytest.mark.parametrize("budget", [0, -1])
def test_a_budget_must_be_positive(budget: int) -> None:
    with pytest.raises(InvalidArgument, match="budget_tokens"):
        pack([(0, 1)], budget)
    with pytest.raises(InvalidArgument, match="budget_tokens"):
        pass_ends_s([(0.0, 0, 1)], budget, tokens)


def test_work_arriving_during_a_decode_step_joins_the_pass_after_it() -> None:
    # Two running streams: the loop steps them back to back, 2 s a step from t = 0.
    # Work ready at 1.0 and 1.5 waits for the step ending at 2 and joins one pass.
    assert pass_ends_s([(1.0, 0, 10), (1.5, 0, 10)], 2048, tokens, streams=2) == [24.0, 24.0]
    # Ready at 3: the step running then ends at 4. An idle loop starts at once.
    assert pass_ends_s([(3.0, 0, 10)], 2048, tokens, streams=2) == [16.0]
    assert pass_ends_s([(3.0, 0, 10)], 2048, tokens) == [13.0]


def test_a_piece_that_follows_another_waits_for_its_last_pass() -> None:
    # Together they would share one pass; the second follows the first, so it waits.
    assert pass_ends_s([(0.0, 0, 10), (0.0, 0, 10)], 2048, tokens) == [20.0, 20.0]
    assert pass_ends_s([(0.0, 0, 10), (0.0, 0, 10)], 2048, tokens, after=[None, 0]) == [
        10.0,
        20.0,
    ]
    # Ready later than its predecessor ends: its own arrival counts.
    ends = pass_ends_s([(0.0, 0, 10), (30.0, 0, 5)], 2048, tokens, after=[None, 0])
    assert ends == [10.0, 35.0]
    with pytest.raises(InvalidArgument, match="after"):
        pass_ends_s([(0.0, 0, 1)], 2048, tokens, after=[None, None])
