"""The one prefill choice (`kvrs.prefill`): queued work plus the prefill of what is not cached."""

from __future__ import annotations

import pytest

from kvrs.errors import FailedPrecondition, InvalidArgument
from kvrs.prefill import (
    computed_hit_tokens,
    prefill_finish_s,
    prefill_finishes,
    rank_prefills,
    soonest,
)
from kvrs.profile import compute_profile

PROFILE = compute_profile("opt-13b")


def choose(wait_s, prompt_tokens, hit_tokens=None, queue_depth=None) -> tuple[int, float]:
    """The rule as the simulator applies it: every finish, then the soonest."""
    finish = prefill_finishes(wait_s, prompt_tokens, PROFILE, hit_tokens)
    best = soonest(finish, queue_depth)
    return best, float(finish[best])


def test_finish_is_wait_plus_the_extend_of_the_uncached_tokens():
    # Attention still reads the cached tokens: T_ext(hit, L - hit), more than T_pf(L - hit).
    finish_s = prefill_finish_s(PROFILE, 2048, wait_s=0.5, hit_tokens=1024)
    assert finish_s == pytest.approx(0.5 + PROFILE.extend_s(1024, 1024))
    assert finish_s > 0.5 + PROFILE.prefill_s(1024)
    assert prefill_finish_s(PROFILE, 2048, wait_s=-3.0) == PROFILE.prefill_s(2048)


def test_at_least_one_token_is_computed():
    assert computed_hit_tokens(4096, 2048) == 2047
    assert computed_hit_tokens(-1, 2048) == 0
    assert prefill_finish_s(PROFILE, 2048, 0.0, 2048) == PROFILE.extend_s(2047, 1)


def test_a_cached_prefix_outweighs_a_little_queued_work():
    index, finish_s = choose([0.0, 0.05], 4096, hit_tokens={1: 3584})
    assert index == 1
    assert finish_s == pytest.approx(0.05 + PROFILE.extend_s(3584, 512))
    # Enough queued work and the idle instance wins again.
    assert choose([0.0, 5.0], 4096, hit_tokens={1: 3584})[0] == 0


def test_ties_go_to_the_lower_queue_depth_then_the_earlier_candidate():
    assert choose([0.0, 0.0, 0.0], 512)[0] == 0
    assert choose([0.0, 0.0, 0.0], 512, queue_depth=[2, 0, 0])[0] == 1


def test_no_candidate_or_no_prompt_is_refused():
    with pytest.raises(FailedPrecondition):
        choose([], 512)
    with pytest.raises(InvalidArgument, match="prompt_tokens"):
        choose([0.0], 0)


def test_a_ranking_reads_each_candidates_held_blocks_and_lists_every_option():
    """What the router and the endpoint picker both call: hits from the blocks each
    candidate holds, the rule's choice, and every candidate as an option in order."""
    from kvrs.tokenizer import prefix_block_hashes

    prompt = list(range(4096))
    hashes = prefix_block_hashes(prompt, 512)
    held = frozenset(hashes[:7])  # 3,584 tokens
    ranking = rank_prefills([0.0, 0.05], [0, 0], [frozenset(), held], 4096, hashes, 512, PROFILE)
    assert ranking.best == choose([0.0, 0.05], 4096, {1: 3584})[0] == 1
    assert ranking.hit_tokens == (0, 3584)
    options = ranking.options(["p0", "p1"])
    assert [(o.instance_id, o.prefix_hit_tokens) for o in options] == [("p0", 0), ("p1", 3584)]
    assert options[1].finish_s == pytest.approx(prefill_finish_s(PROFILE, 4096, 0.05, 3584))
