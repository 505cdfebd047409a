"""Executors against a step-by-step reference, prefix caches, and gap statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvrs.profile import ComputeProfile, DecodeProfile
from kvrs.sim.cache import PrefixCache
from kvrs.sim.engine import EventLoop
from kvrs.sim.instances import (
    ComputeJob,
    DecodeInstance,
    DecodeMember,
    PrefillInstance,
    PrefillJob,
)
from kvrs.sim.metrics import RequestRecord, goodput_by_bisection

PROFILE = DecodeProfile(a_s=0.01, b_s_per_context_token=1e-6, c_s_per_request=1e-3)


def _reference(arrivals, profile, pauses=()):
    """Token times of a naive one-event-per-step continuous-batching loop."""
    pending = sorted(arrivals)
    pauses = sorted(pauses)
    t, batch, ctx, left = 0.0, [], {}, {}
    times = {i: [] for _, i, _, _ in arrivals}
    while pending or batch:
        while pending and pending[0][0] <= t:
            _, i, context, out = pending.pop(0)
            batch.append(i)
            ctx[i], left[i] = context, out
        while pauses and pauses[0][0] <= t:
            t += pauses.pop(0)[1]
        if not batch:
            t = pending[0][0]
            continue
        t += profile.step_s(len(batch), sum(ctx[i] for i in batch))
        for i in list(batch):
            times[i].append(t)
            ctx[i] += 1
            left[i] -= 1
            if left[i] == 0:
                batch.remove(i)
    return times


def _gap_stats(times):
    gaps = np.diff(times)
    top = max(1, math.ceil(0.1 * len(gaps)))
    return gaps.mean(), np.sort(gaps)[-top:].mean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_runs_match_a_step_by_step_reference(seed):
    rng = np.random.default_rng(seed)
    arrivals = []
    t = 0.0
    for i in range(12):
        t += float(rng.exponential(0.03))
        arrivals.append((t, i, int(rng.integers(10, 5000)), int(rng.integers(2, 60))))
    loop = EventLoop()
    finished = []
    decode = DecodeInstance(
        "d",
        "n",
        loop,
        PROFILE,
        10**9,
        64,
        PrefixCache(0),
        lambda m: finished.append(m.record.index),
    )
    records = {}
    for at, i, context, out in arrivals:
        records[i] = RequestRecord(i, at, context, out)
        member = DecodeMember(records[i], context, out, context + out)
        loop.at(at, decode.admit, member)
    loop.run()
    expected = _reference(arrivals, PROFILE)
    assert sorted(finished) == sorted(records)
    for i, record in records.items():
        record.close_gaps()
        assert record.generated_tokens == len(expected[i])
        assert record.first_token_s == pytest.approx(expected[i][0], abs=1e-9)
        assert record.last_token_s == pytest.approx(expected[i][-1], abs=1e-9)
        tpot, tbt = _gap_stats(expected[i])
        assert record.tpot_s == pytest.approx(tpot, rel=1e-9)
        assert record.tbt_s == pytest.approx(tbt, rel=1e-9)


def test_a_compute_job_pauses_the_batch_and_shows_in_tbt():
    loop = EventLoop()
    decode = DecodeInstance("d", "n", loop, PROFILE, 10**9, 64, PrefixCache(0), lambda m: None)
    record = RequestRecord(0, 0.0, 1000, 40)
    decode.admit(DecodeMember(record, 1000, 40, 1040))
    ran = []
    loop.at(0.1, decode.add_job, ComputeJob(0.5, lambda job: ran.append(loop.now_s)))
    loop.run()
    record.close_gaps()
    assert len(ran) == 1 and ran[0] > 0.6
    # 39 gaps: the longest 4 are the 0.5 s pause and three ordinary steps.
    assert record.tbt_s > 0.5 / 4 + 3 * 0.011 / 4
    assert record.tpot_s > 0.5 / 39


def test_memory_is_reserved_before_transfer_and_queued_when_full():
    loop = EventLoop()
    decode = DecodeInstance("d", "n", loop, PROFILE, 1000, 64, PrefixCache(0), lambda m: None)
    granted = []
    assert decode.request_memory(600, lambda: granted.append("a"))
    assert not decode.request_memory(600, lambda: granted.append("b"))
    assert granted == ["a"] and decode.free_kv_tokens == 400
    decode.release_memory(600)
    assert granted == ["a", "b"] and decode.free_kv_tokens == 400


def test_prefill_batches_by_token_budget_and_skips_cached_blocks():
    profile = ComputeProfile("m", a_s=0.02, b_s_per_token=1e-4, c_s_per_token2=1e-9)
    loop = EventLoop()
    pool = PrefixCache(100)
    prefill = PrefillInstance("p", "n", loop, profile, pool, block_tokens=512, budget_tokens=2048)
    ends = {}

    def submit(i, tokens, blocks):
        record = RequestRecord(i, loop.now_s, tokens, 1)
        prefill.submit(
            PrefillJob(
                record, tokens, blocks, lambda job: ends.setdefault(job.record.index, loop.now_s)
            )
        )

    submit(0, 1024, (1, 2))  # runs alone, at once
    submit(1, 1024, (1, 2, 3))  # queued
    submit(2, 1024, (7, 8))  # fits the budget with #1
    loop.run()
    first = profile.prefill_s(1024)
    assert ends[0] == pytest.approx(first)
    # Batch 2: #1 hits its first two blocks (cached by #0) and computes 0 new... capped at
    # one token less than the prompt; #2 computes all 1024.
    hit = 1023
    second = (
        profile.a_s
        + (profile.extend_s(hit, 1) - profile.a_s)
        + (profile.prefill_s(1024) - profile.a_s)
    )
    assert ends[1] == ends[2] == pytest.approx(first + second)


def test_prefix_cache_is_lru_and_remembers_the_past():
    cache = PrefixCache(3)
    cache.insert([1, 2, 3], now_s=1.0)
    cache.insert([1, 4], now_s=2.0)  # evicts 2 (least recent)
    assert list(cache) == [3, 1, 4]
    assert cache.leading_hits([1, 2, 3]) == 1
    past = cache.as_of(1.5)
    assert 2 in past and 4 not in past
    assert 4 in cache.as_of(2.0) and 2 not in cache.as_of(2.0)


def test_leading_blocks_of_a_past_view_match_membership_at_that_time():
    rng = np.random.default_rng(7)
    cache = PrefixCache(6)
    views = []
    for step in range(40):
        now_s = step * 0.5
        cache.insert([int(b) for b in rng.integers(0, 12, size=4)], now_s)
        views.append(cache.as_of(now_s - 0.25 * int(rng.integers(0, 3))))
        for view in views[-4:]:
            blocks = [int(b) for b in rng.integers(0, 12, size=5)]
            by_membership = next(
                (i for i, block in enumerate(blocks) if block not in view), len(blocks)
            )
            assert view.leading(blocks) == by_membership


def test_goodput_bisection_finds_the_threshold():
    rate, probes = goodput_by_bisection(
        lambda r: 1.0 if r <= 7.3 else 0.5, 1.0, 4.0, tolerance=0.05
    )
    assert 7.25 <= rate <= 7.3
    assert all(value in (1.0, 0.5) for _, value in probes)
