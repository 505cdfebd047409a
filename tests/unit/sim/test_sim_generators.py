"""Workload generators: the shapes they promise, determinism, and config selection."""

from __future__ import annotations

import numpy as np
import pytest

from kvrs.errors import InvalidArgument
from kvrs.sim.experiments.common import load_workload
from kvrs.sim.generators import GENERATORS, GeneratedWorkload, make_generator
from kvrs.sim.trace import TraceStats


def _share_two_blocks(requests) -> float:
    """Share of requests whose first two blocks an earlier request already had."""
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for r in requests:
        if len(r.hash_ids) >= 2 and r.hash_ids[:2] in seen:
            hits += 1
        seen.update((r.hash_ids[:1], r.hash_ids[:2]))
    return hits / len(requests)


def test_conversation_has_the_published_shape_of_the_conversation_trace():
    requests = make_generator({"kind": "conversation", "requests": 4000}).generate()
    stats = TraceStats.of(requests)
    assert 3.0 <= stats.rate_per_s <= 3.8
    assert 11_000 <= stats.mean_input_tokens <= 14_000
    assert 300 <= stats.mean_output_tokens <= 390
    assert 0.35 <= stats.cache_ratio <= 0.5
    assert all(r.hash_ids[0] == 0 for r in requests)
    assert 0.35 <= _share_two_blocks(requests) <= 0.45
    assert 0.05 <= np.mean([r.input_tokens > 32_768 for r in requests]) <= 0.09


def test_bursty_arrivals_come_in_bursts_not_a_poisson_stream():
    bursty = make_generator({"kind": "bursty", "requests": 2000}).generate()
    gaps = np.diff([r.arrival_s for r in bursty])
    poisson = GeneratedWorkload(requests=2000, rate_per_s=3.9).generate()
    poisson_gaps = np.diff([r.arrival_s for r in poisson])
    # A Poisson stream's gaps have a coefficient of variation of 1; bursts, far more.
    assert gaps.std() / gaps.mean() > 2.0
    assert 0.8 < poisson_gaps.std() / poisson_gaps.mean() < 1.2


def test_presets_differ_where_they_say_they_do():
    stats = {
        kind: TraceStats.of(make_generator({"kind": kind, "requests": 1500}).generate())
        for kind in GENERATORS
    }
    assert stats["long_output"].mean_output_tokens > 3 * stats["conversation"].mean_output_tokens
    assert stats["short_prompt"].mean_input_tokens < stats["conversation"].mean_input_tokens / 4
    assert stats["skewed_prefix"].cache_ratio > stats["bursty"].cache_ratio


def test_a_generator_is_deterministic_in_its_seed():
    a = [r.to_mooncake() for r in make_generator({"kind": "skewed_prefix", "requests": 300})]
    b = [r.to_mooncake() for r in make_generator({"kind": "skewed_prefix", "requests": 300})]
    c = [r.to_mooncake() for r in make_generator({"kind": "skewed_prefix", "seed": 1})][:300]
    assert a == b
    assert a != c


def test_an_experiment_workload_selects_a_generator_and_bad_keys_are_named():
    workload = load_workload({"trace": "default", "generator": {"kind": "bursty"}, "limit": 50})
    assert len(workload.requests) == 50
    assert "bursty" in workload.source
    with pytest.raises(InvalidArgument, match="generator.kind"):
        make_generator({"kind": "nope"})
    with pytest.raises(InvalidArgument, match="no_such"):
        make_generator({"kind": "bursty", "no_such": 1})
