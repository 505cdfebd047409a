"""`kvrs up` names every URL a user needs: the OpenAI API (and each pinned adapter), Envoy
when it runs, the Prometheus scrape configuration, Jaeger when spans are exported."""

from __future__ import annotations

from kvrs.cli.cluster import urls
from kvrs.cli.launcher import ClusterState, ProcessRecord


def record(name: str, kind: str, address: str) -> ProcessRecord:
    return ProcessRecord(name, kind, "services.x", address, 1, "", 0, -1)


def state(*records: ProcessRecord) -> ClusterState:
    return ClusterState("/tmp/run", 0, "redis://127.0.0.1:1/0", "{kvrs}:", "", list(records))


def test_a_plain_cluster_names_its_openai_endpoint_and_the_scrape_config():
    lines = urls(
        state(
            record("router", "control", "127.0.0.1:5"),
            record("openai-http", "control", "127.0.0.1:7"),
        )
    )
    assert lines[0].startswith("OpenAI API: http://127.0.0.1:7/v1 ")
    assert "OPENAI_BASE_URL=http://127.0.0.1:7/v1" in lines[0]
    assert lines[-1].endswith(
        "prometheus --config.file /tmp/run/prometheus.yml (then http://localhost:9090)"
    )
    assert not any("Jaeger" in line or "Envoy" in line for line in lines)


def test_envoy_the_pinned_adapters_and_jaeger_are_named_when_present():
    lines = urls(
        state(
            record("openai-http", "control", "127.0.0.1:7"),
            record("openai-http-decode-0", "control", "127.0.0.1:8"),
            record("envoy", "gateway", "127.0.0.1:9"),
        ),
        otlp_endpoint="http://collector.local:4317",
    )
    assert "OpenAI API pinned to decode-0: http://127.0.0.1:8/v1" in lines
    assert "Envoy (OpenAI API through the endpoint picker): http://127.0.0.1:9/v1" in lines
    assert lines[-1] == (
        "Jaeger UI (spans exported to http://collector.local:4317): "
        "http://collector.local:16686/search?service=kvrs-router"
    )
