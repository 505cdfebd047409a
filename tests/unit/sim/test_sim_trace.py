"""Trace loading, scaling, caps and the synthetic generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrs.errors import InvalidArgument
from kvrs.sim.experiments.common import load_workload
from kvrs.sim.trace import (
    SyntheticWorkload,
    TraceStats,
    cap_context,
    load_mooncake,
    scale_arrivals,
    write_mooncake,
)

SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"


def test_loader_reproduces_the_means_computed_from_the_raw_lines():
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    mean_in = sum(r["input_length"] for r in rows) / len(rows)
    mean_out = sum(r["output_length"] for r in rows) / len(rows)
    stats = TraceStats.of(load_mooncake(SAMPLE))
    assert stats.requests == len(rows) == 200
    assert stats.mean_input_tokens == pytest.approx(mean_in)
    assert stats.mean_output_tokens == pytest.approx(mean_out)
    # The first 200 lines of the synthetic Mooncake trace, as the sample was cut.
    assert round(stats.mean_input_tokens) == 13_317
    assert round(stats.mean_output_tokens) == 192


def test_arrivals_are_seconds_from_the_first_line_and_scale_with_rate():
    requests = load_mooncake(SAMPLE)
    assert requests[0].arrival_s == 0.0
    faster = scale_arrivals(requests, 2.0)
    assert faster[-1].arrival_s == pytest.approx(requests[-1].arrival_s / 2)
    with pytest.raises(InvalidArgument):
        scale_arrivals(requests, 0)


def test_context_caps_truncate_or_filter():
    requests = load_mooncake(SAMPLE)
    cap = 8192
    truncated = cap_context(requests, cap, "truncate")
    assert len(truncated) == len(requests)
    assert max(r.input_tokens for r in truncated) == cap
    assert all(len(r.hash_ids) <= cap // 512 for r in truncated)
    filtered = cap_context(requests, cap, "filter")
    assert len(filtered) == sum(1 for r in requests if r.input_tokens <= cap)
    assert [r.index for r in filtered] == list(range(len(filtered)))


def test_bad_lines_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"oops": 1}\n')
    with pytest.raises(InvalidArgument, match="bad.jsonl:2"):
        load_mooncake(path)


def test_synthetic_workload_is_deterministic_and_round_trips(tmp_path):
    workload = SyntheticWorkload(requests=500, seed=7)
    first, second = workload.generate(), workload.generate()
    assert [(r.arrival_s, r.input_tokens, r.hash_ids) for r in first] == [
        (r.arrival_s, r.input_tokens, r.hash_ids) for r in second
    ]
    stats = TraceStats.of(first)
    assert 0.2 < stats.cache_ratio < 0.9  # sessions share prefixes
    assert 2.5 < stats.rate_per_s < 5.5
    path = tmp_path / "gen.jsonl"
    write_mooncake(path, first)
    loaded = load_mooncake(path)
    assert [r.input_tokens for r in loaded] == [r.input_tokens for r in first]
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in loaded)


def test_the_default_trace_is_in_the_repository_with_mooncakes_published_means():
    workload = load_workload({"trace": "default"})
    assert workload.source == "data/traces/synthetic_trace.jsonl"
    assert workload.stats.requests == 3_993
    assert round(workload.stats.mean_input_tokens) == 15_325
    assert round(workload.stats.mean_output_tokens) == 149
