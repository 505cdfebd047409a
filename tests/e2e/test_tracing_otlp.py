"""One request's trace, exported over OTLP by real processes, as Jaeger would receive it."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import grpc
import pytest

from kvrs.cli.launcher import SERVICES, ClusterOptions, start_cluster, stop_cluster
from kvrs.tokenizer import encode
from kvrs.v1 import router_pb2, router_pb2_grpc
from tests.e2e.otlp_receiver import OtlpReceiver, ReceivedSpan

TRACED_SERVICES = (
    "gossip",
    "slot-broker",
    "scheduler-1",
    "prefill-0",
    "decode-0",
    "decode-1",
    "router",
)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "telemetry.md"
SELECT_DECODE_ATTRIBUTES = (
    "kvrs.request_id",
    "kvrs.candidates_considered",
    "kvrs.chosen_instance_id",
    "kvrs.predicted_ttft_s",
    "kvrs.wait_s",
    "kvrs.transfer_s",
    "kvrs.transfer.bandwidth_bps",
    "kvrs.transfer.telemetry_age_s",
    "kvrs.runner_up.instance_id",
    "kvrs.runner_up.score_s",
    "kvrs.view_age_s",
    "kvrs.view_stale",
)


@pytest.fixture
def traced_cluster(tmp_path, redis_url, redis_prefix):
    receiver = OtlpReceiver().start()
    options = ClusterOptions(
        run_dir=tmp_path / "cluster",
        otlp_endpoint=receiver.endpoint,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
    )
    services = tuple(spec for spec in SERVICES if spec.name in TRACED_SERVICES)
    state = start_cluster(options, services)
    try:
        yield state, receiver
    finally:
        stop_cluster(Path(state.run_dir))
        receiver.stop()


def _documented_attributes() -> set[str]:
    return set(re.findall(r"^\| `(kvrs\.[^`]+)` \|", DOCS.read_text(), flags=re.MULTILINE))


def _trace_complete(trace_id: str):
    def complete(spans: list[ReceivedSpan]) -> bool:
        services = {s.service_name for s in spans if s.trace_id == trace_id}
        return (
            {"kvrs-router", "kvrs-scheduler-1"} <= services
            and any(name.startswith("kvrs-decode") for name in services)
            and any(name.startswith("kvrs-prefill") for name in services)
        )

    return complete


async def test_one_trace_spans_router_scheduler_and_workers(traced_cluster):
    state, receiver = traced_cluster
    request_id = f"traced-{uuid.uuid4().hex[:8]}"
    async with grpc.aio.insecure_channel(state.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=encode("where does this request decode, and why? " * 4),
            max_new_tokens=4,
        )
        replies = [reply async for reply in stub.Generate(request, timeout=60)]
    summary = replies[-1].summary
    assert summary.request_id == request_id
    assert summary.trace_id, "the router reports the request's trace id"

    spans = await receiver.wait_for(_trace_complete(summary.trace_id), timeout_s=20)
    in_trace = [s for s in spans if s.trace_id == summary.trace_id]
    services = {s.service_name for s in in_trace}
    assert {"kvrs-router", "kvrs-scheduler-1"} <= services, services
    assert any(name.startswith("kvrs-prefill") for name in services), services
    assert any(name.startswith("kvrs-decode") for name in services), services

    decisions = [s for s in in_trace if s.name == "kvrs.select_decode"]
    assert len(decisions) == 1
    decision = decisions[0].attributes
    missing = [a for a in SELECT_DECODE_ATTRIBUTES if a not in decision]
    assert not missing, f"decision span lacks {missing}"
    assert decision["kvrs.request_id"] == request_id
    assert decision["kvrs.chosen_instance_id"] == summary.decode_instance_id
    assert decision["kvrs.candidates_considered"] == 2

    undocumented = {
        key
        for span in in_trace
        if span.name.startswith("kvrs.")
        for key in span.attributes
        if key.startswith("kvrs.")
    } - _documented_attributes()
    assert not undocumented, f"attributes missing from docs/telemetry.md: {sorted(undocumented)}"

    transfers = [s for s in in_trace if s.name.startswith("kvxfer.")]
    assert transfers, "the KV transfer's spans nest under the request's trace"
