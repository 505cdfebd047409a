"""The KV hand-off in the simulator: the decode instance chosen as the prefill starts, the
KV streamed layer by layer under it (landing what `streamed_tail_s` says is left), and
failures of either side while it streams."""

from __future__ import annotations

import math

import pytest

from kvrs.costmodel import streamed_tail_s
from kvrs.sim.config import PolicySpec, SimConfig
from kvrs.sim.metrics import COMPLETED
from kvrs.sim.simulator import run_policy
from kvrs.sim.trace import TraceRequest
from tests.unit.sim.workloads import busy_chat

NETKV = PolicySpec("netkv", "netkv")
STREAMED = {"serving": {"layerwise_streaming": True}}
LONG_PROMPTS = busy_chat(200, 20.0, input_tokens=8000.0, seed=3)


def _one_request(input_tokens: int) -> list[TraceRequest]:
    return [TraceRequest(0, 0.0, input_tokens, 4, ())]


def _slow_network(gbps: float, setup_ms: float = 0.0) -> dict:
    """One request on an idle cluster whose every link carries `gbps`, each transfer
    paying `setup_ms` of set-up first."""
    return {
        "cluster": {
            "nvlink_gbps": gbps,
            "rack_gbps": gbps,
            "pod_gbps": gbps,
            "spine_gbps": gbps,
            "hop_latency_us": 0,
            "setup_latency_ms": setup_ms,
        },
        "telemetry": {"state_period_s": 0.0},
    }


@pytest.mark.parametrize(
    ("gbps", "setup_ms"),
    [(2.0, 0.0), (20.0, 0.0), (20.0, 30.0), (20.0, 900.0)],
    ids=["transfer-longer", "prefill-longer", "set-up-hidden", "set-up-longer"],
)
def test_a_streamed_kv_lands_what_the_prefill_leaves_of_its_transfer(gbps, setup_ms):
    network = _slow_network(gbps, setup_ms)
    after = run_policy(SimConfig.from_dict(network), _one_request(8192), NETKV).records[0]
    streamed = run_policy(
        SimConfig.from_dict({**network, **STREAMED}), _one_request(8192), NETKV
    ).records[0]
    assert after.status == streamed.status == COMPLETED
    prefill_s = after.prefill_end_s - after.prefill_start_s
    transfer_s = after.transfer_end_s - after.prefill_end_s
    assert streamed.prefill_end_s == pytest.approx(after.prefill_end_s)
    config = SimConfig.from_dict(network)
    layers = config.serving.model_spec().layers
    tail_s = streamed_tail_s(transfer_s, prefill_s, layers, fixed_s=setup_ms / 1e3)
    assert streamed.transfer_end_s - streamed.prefill_end_s == pytest.approx(tail_s, rel=1e-6)
    assert streamed.first_token_s < after.first_token_s


def test_a_decode_instance_lost_under_a_streaming_prefill_costs_only_its_placement():
    failures = {"failures": [{"at_s": 2.0, "instance": "decode-3"}]}
    result = run_policy(
        SimConfig.from_dict({**STREAMED, **failures}),
        busy_chat(200, 20.0, input_tokens=8000.0, seed=3),
        NETKV,
    )
    summary = result.summary
    assert summary.lost == 0 and summary.completed == summary.requests
    # Those placed there while still prefilling were placed again once their prefill
    # ended (no recovery); only those decoding there were recovered.
    assert result.stats["streams_unplaced"] > 0
    recovered = [r for r in result.records if r.recoveries]
    assert all(r.recoveries[0].started_s >= 2.0 for r in recovered)
    assert not any(r.decode_id == "decode-3" and r.first_token_s > 2.0 for r in result.records)


def test_a_prefill_lost_under_its_stream_starts_the_prompt_over():
    failures = {"failures": [{"at_s": 2.0, "instance": "prefill-1"}]}
    result = run_policy(
        SimConfig.from_dict({**STREAMED, **failures}),
        busy_chat(200, 20.0, input_tokens=8000.0, seed=3),
        NETKV,
    )
    assert result.summary.lost == 0
    assert result.summary.completed == result.summary.requests
    assert result.stats["prefill_rerouted"] > 0
    assert all(r.prefill_id != "prefill-1" or r.prefill_end_s <= 2.0 for r in result.records)


def test_early_placement_alone_sends_the_kv_after_the_prefill():
    network = _slow_network(2.0)
    early = {"serving": {"early_placement": True}}
    after = run_policy(SimConfig.from_dict(network), _one_request(8192), NETKV).records[0]
    placed = run_policy(
        SimConfig.from_dict({**network, **early}), _one_request(8192), NETKV
    ).records[0]
    assert placed.decode_id == after.decode_id
    assert placed.transfer_end_s == pytest.approx(after.transfer_end_s)
    assert not math.isnan(placed.first_token_s)
