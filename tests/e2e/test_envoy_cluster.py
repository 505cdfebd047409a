"""`kvrs up --envoy`: a completion through Envoy reaches the adapter of the decode instance
the endpoint picker chose, and is decoded there."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from kvrs.cli.launcher import ENVOY_SERVICES, SERVICES, ClusterOptions, start_cluster, stop_cluster

CORE = {"gossip", "slot-broker", "scheduler-1", "prefill-0", "decode-0", "decode-1", "router"}


@pytest.fixture
def envoy_cluster(tmp_path, redis_url, redis_prefix):
    options = ClusterOptions(
        run_dir=tmp_path / "cluster", redis_url=redis_url, redis_prefix=redis_prefix
    )
    services = tuple(spec for spec in SERVICES if spec.name in CORE) + ENVOY_SERVICES
    state = start_cluster(options, services)
    try:
        yield state
    finally:
        stop_cluster(Path(state.run_dir))


def test_a_completion_through_envoy_is_decoded_where_the_picker_sent_it(envoy_cluster):
    body = json.dumps(
        {"model": "tiny", "prompt": "the network decides", "max_tokens": 4, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"http://{envoy_cluster.address('envoy')}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        status = reply.status
        served_by = reply.headers.get("x-kvrs-decode-instance")
        completion = json.loads(reply.read())
    assert status == 200
    assert completion["choices"][0]["text"]
    assert completion["usage"]["completion_tokens"] == 4
    # The adapter Envoy reached is pinned to one decode instance; the router decoded there.
    assert served_by in {"decode-0", "decode-1"}
