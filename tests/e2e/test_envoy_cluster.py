"""`kvrs up --envoy`: a completion through Envoy reaches the adapter of the decode instance
the endpoint picker chose, and is decoded there.

The picker's choice is read from its own `kvrs.epp.pick` span (exported over OTLP, as to
Jaeger) under the request id Envoy handed both the picker and the adapter. Which adapter
Envoy reached is the service that exported the request's `openai_http.completions` span
(each adapter is pinned to one decode instance and named after it); where it was decoded
is the adapter's `x-kvrs-decode-instance` header (the router's summary) and the router's
own `kvrs.select_decode` decision in the same trace.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from kvrs.cli.launcher import ENVOY_SERVICES, SERVICES, ClusterOptions, start_cluster, stop_cluster
from tests.e2e.otlp_receiver import OtlpReceiver

CORE = {"gossip", "slot-broker", "scheduler-1", "prefill-0", "decode-0", "decode-1", "router"}
COMPLETIONS = 4


@pytest.fixture
def envoy_cluster(tmp_path, redis_url, redis_prefix):
    receiver = OtlpReceiver().start()
    options = ClusterOptions(
        run_dir=tmp_path / "cluster",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        otlp_endpoint=receiver.endpoint,
    )
    services = tuple(spec for spec in SERVICES if spec.name in CORE) + ENVOY_SERVICES
    state = start_cluster(options, services)
    try:
        yield state, receiver
    finally:
        stop_cluster(Path(state.run_dir))
        receiver.stop()


def complete(address: str, prompt: str) -> tuple[int, str, dict]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        data=body.encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.status, reply.headers.get("x-kvrs-decode-instance"), json.loads(reply.read())


async def test_a_completion_through_envoy_is_decoded_where_the_picker_sent_it(envoy_cluster):
    state, receiver = envoy_cluster
    served: dict[str, str] = {}
    # Sent together, so placements see each other's work and may spread.
    replies = await asyncio.gather(
        *(
            asyncio.to_thread(
                complete, state.address("envoy"), f"the network decides, take {i} " * (i + 1)
            )
            for i in range(COMPLETIONS)
        )
    )
    for status, served_by, completion in replies:
        assert status == 200
        assert completion["choices"][0]["text"]
        assert completion["usage"]["completion_tokens"] == 4
        # The completion id carries the request id the adapter was given (Envoy's).
        served[completion["id"].removeprefix("cmpl-")] = served_by

    def picked(spans) -> dict[str, dict]:
        return {
            s.attributes["kvrs.request_id"]: s.attributes
            for s in spans
            if s.name == "kvrs.epp.pick" and s.attributes.get("kvrs.request_id") in served
        }

    def generated(spans) -> dict[str, str]:
        return {
            s.attributes["kvrs.request_id"]: s.trace_id
            for s in spans
            if s.name == "router.generate" and s.attributes.get("kvrs.request_id") in served
        }

    def adapters(spans) -> dict[str, str]:
        return {
            s.attributes["kvrs.request_id"]: s.service_name
            for s in spans
            if s.name.startswith("openai_http.") and s.attributes.get("kvrs.request_id") in served
        }

    def decided(spans) -> set[str]:
        """The traces holding a scheduler's placement (exported by another process, so it
        may arrive after the router's span)."""
        return {s.trace_id for s in spans if s.name == "kvrs.select_decode"}

    spans = await receiver.wait_for(
        lambda spans: (
            len(picked(spans)) == len(generated(spans)) == len(adapters(spans)) == COMPLETIONS
            and set(generated(spans).values()) <= decided(spans)
        ),
        timeout_s=20,
    )
    picks, traces, reached = picked(spans), generated(spans), adapters(spans)
    print(
        "\npicked -> served: "
        + ", ".join(f"{picks[r]['kvrs.chosen_instance_id']} -> {s}" for r, s in served.items())
    )
    assert set(picks) == set(served), "every completion went through the picker"
    assert set(traces) == set(served), "every completion reached the router"
    assert set(reached) == set(served), "every completion reached an adapter"
    for request_id, served_by in served.items():
        pick = picks[request_id]
        assert pick["kvrs.epp.outcome"] == "picked", pick
        chosen = pick["kvrs.chosen_instance_id"]
        assert reached[request_id] == f"kvrs-openai-http-{chosen}", (request_id, pick, reached)
        assert served_by == pick["kvrs.chosen_instance_id"], (request_id, pick, served_by)
        # The router placed it where the adapter Envoy reached is pinned: its own decision
        # in the request's trace names the same instance.
        decisions = [
            s.attributes
            for s in spans
            if s.trace_id == traces[request_id] and s.name == "kvrs.select_decode"
        ]
        assert [d["kvrs.chosen_instance_id"] for d in decisions] == [served_by], decisions
