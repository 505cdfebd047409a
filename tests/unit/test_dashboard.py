"""The Grafana dashboard and the Prometheus scrape configurations agree with the code: every
query names a metric some kvrs process exports, every kvrs service is scraped where it
serves its metrics, and compose and `kvrs up` label their jobs alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvrs.cli.launcher import ClusterState, ProcessRecord, job_name, scrape_config
from services.common.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvrs.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
# Series names prometheus_client writes for each kind of family.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}
# What an operator asked the dashboard to show, by the metric each panel rests on.
REQUIRED_METRICS = {
    "kvrs_decisions_total",
    "kvrs_recovery_actual_seconds_count",
    "kvrs_recovery_predicted_seconds_sum",
    "kvrs_prediction_error_bucket",
    "kvrs_telemetry_age_seconds",
    "kvrs_transfer_bytes_total",
    "kvrs_transfer_rate_bps_bucket",
    "kvrs_ttft_seconds_bucket",
    "kvrs_tbt_seconds_bucket",
    "kvrs_slots_in_use",
}


def exported_series() -> set[str]:
    names = set()
    for family in Metrics().registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\bkvrs_[a-z0-9_]+\b", expr))


def test_every_dashboard_query_names_metrics_the_code_exports():
    exported = exported_series()
    queries = dashboard_queries()
    assert queries
    for expr in queries:
        named = metrics_in(expr)
        assert named, f"a query on no kvrs metric: {expr}"
        assert named <= exported, f"{sorted(named - exported)} not exported (query: {expr})"


def test_the_dashboard_shows_decisions_errors_age_recoveries_transfers_latency_and_slots():
    used = set().union(*(metrics_in(expr) for expr in dashboard_queries()))
    assert REQUIRED_METRICS <= used, sorted(REQUIRED_METRICS - used)


def test_every_panel_reads_the_provisioned_datasource():
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvrs"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert all(target["datasource"]["uid"] == uid for target in panel["targets"])


def compose_kvrs_services() -> dict[str, str]:
    """compose service -> the module it runs, the Envoy override's picker included."""
    services = {}
    for path in (DEPLOY / "docker-compose.yml", DEPLOY / "envoy" / "compose.envoy.yml"):
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            command = service.get("command", [])
            if command[:2] == ["python", "-m"]:
                services[name] = command[2]
    return services


def dot_env() -> dict[str, str]:
    lines = (DEPLOY / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_compose_prometheus_scrapes_every_kvrs_service_on_its_metrics_port():
    metrics_port = dot_env()["KVRS_METRICS_ADDR"].rpartition(":")[2]
    scraped = {}
    for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, _, port = target.rpartition(":")
                assert port == metrics_port, target
                assert group["labels"]["instance"] == host
                scraped[host] = job["job_name"]
    services = compose_kvrs_services()
    assert set(scraped) == set(services)
    for name, module in services.items():
        assert scraped[name] == job_name(module), name


@pytest.mark.parametrize("name", ["prometheus", "grafana"])
def test_compose_runs_prometheus_and_grafana_with_the_files_in_deploy(name):
    service = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"][name]
    for volume in service["volumes"]:
        source = volume.split(":")[0]
        assert (DEPLOY / source).exists(), volume


def test_kvrs_up_writes_the_same_jobs_and_instance_labels(tmp_path):
    records = [
        ProcessRecord("redis", "redis", "redis", "127.0.0.1:1", 1, "", 0, -1),
        ProcessRecord(
            "scheduler-2",
            "control",
            "services.scheduler",
            "127.0.0.1:2",
            2,
            "",
            0,
            -1,
            metrics_addr="127.0.0.1:9002",
        ),
        ProcessRecord(
            "decode-0",
            "decode",
            "services.worker",
            "127.0.0.1:3",
            3,
            "",
            0,
            -1,
            metrics_addr="127.0.0.1:9003",
        ),
    ]
    state = ClusterState(str(tmp_path), 0, "redis://127.0.0.1:1/0", "{kvrs}:", "", records)
    jobs = {
        job["job_name"]: job["static_configs"] for job in scrape_config(state)["scrape_configs"]
    }
    assert jobs == {
        "scheduler": [{"targets": ["127.0.0.1:9002"], "labels": {"instance": "scheduler-2"}}],
        "worker": [{"targets": ["127.0.0.1:9003"], "labels": {"instance": "decode-0"}}],
    }
