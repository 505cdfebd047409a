"""The real Prometheus server scrapes a `kvrs up` cluster with the scrape configuration
`kvrs up` wrote, and every query of the Grafana dashboard answers, with data, after
requests went through the router."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvrs.cli.launcher import SCRAPE_CONFIG_FILE, ClusterError, ClusterState, free_ports
from kvrs.cli.launcher import stop_processes as stop_cluster_processes

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvrs.json"
# Queries that need an event this test does not cause (a slot reservation, i.e. a
# migration) may answer with no series; every other query must answer with data.
MAY_BE_EMPTY = {"kvrs_slot_requests_total"}


def kvrs(*args: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvrs", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def query(base_url: str, expr: str) -> dict:
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def wait_for_targets(base_url: str, count: int, deadline_s: float) -> list[dict]:
    """Until Prometheus has scraped `count` targets successfully at least once."""
    deadline = time.monotonic() + deadline_s
    targets: list[dict] = []
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/api/v1/targets", timeout=2) as response:
                targets = json.load(response)["data"]["activeTargets"]
        except OSError:
            targets = []
        if len(targets) == count and all(t["health"] == "up" for t in targets):
            return targets
        time.sleep(0.3)
    raise AssertionError(f"targets not all up after {deadline_s} s: {targets}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_prometheus_scrapes_kvrs_up_and_answers_every_dashboard_query(
    tmp_path, redis_url, redis_prefix
):
    binary = shutil.which("prometheus")
    assert binary, "the prometheus server is required (apt-get install prometheus)"
    run_dir = tmp_path / "cluster"
    env = {"REDIS_URL": redis_url, "KVRS_REDIS_PREFIX": redis_prefix}
    prometheus = None
    try:
        up = kvrs("up", "--dir", str(run_dir), env=env)
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}"
        state = ClusterState.load(run_dir)
        metered = [record for record in state.processes if record.metrics_addr]
        assert {r.name for r in metered} == {r.name for r in state.processes if r.name != "redis"}
        for record in metered:
            assert f"http://{record.metrics_addr}/metrics" in up.stdout
        assert f"OpenAI API: http://{state.address('openai-http')}/v1" in up.stdout
        assert f"export OPENAI_BASE_URL=http://{state.address('openai-http')}/v1" in up.stdout
        assert f"prometheus --config.file {run_dir / SCRAPE_CONFIG_FILE}" in up.stdout

        config = yaml.safe_load((run_dir / SCRAPE_CONFIG_FILE).read_text())
        config["global"]["scrape_interval"] = "1s"
        config_file = tmp_path / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        port = free_ports(1)[0]
        base_url = f"http://127.0.0.1:{port}"
        prometheus = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("w"),
            start_new_session=True,
        )
        targets = wait_for_targets(base_url, len(metered), deadline_s=60)
        assert {t["labels"]["instance"] for t in targets} == {r.name for r in metered}

        # Traffic after the first scrape, so each rate() sees it arrive.
        for i in range(2):
            request = {
                "request_id": f"prom-{i}",
                "prompt_token_ids": [72, 105],
                "max_new_tokens": 16,
            }
            result = kvrs(
                "rpc", "--dir", str(run_dir), "RouterService/Generate", json.dumps(request), env={}
            )
            assert result.returncode == 0, result.stderr
        time.sleep(3.5)

        dashboard = json.loads(DASHBOARD.read_text())
        answers = {}
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "1m")
                answer = query(base_url, expr)
                assert answer["status"] == "success", (panel["title"], expr, answer)
                answers[expr] = answer["data"]["result"]
                if not any(name in expr for name in MAY_BE_EMPTY):
                    assert answers[expr], f"{panel['title']}: no data for {expr}"

        def values(expr: str) -> list[float]:
            return [float(sample["value"][1]) for sample in query(base_url, expr)["data"]["result"]]

        assert sum(values("sum(kvrs_ttft_seconds_count)")) == 2
        assert sum(values("sum(kvrs_tbt_seconds_count)")) == 2 * 15
        assert sum(values('sum(kvrs_requests_total{job="router", outcome="completed"})')) == 2
        assert sum(values('sum(kvrs_decisions_total{decision="select_decode"})')) >= 2
        assert sum(values('sum(kvrs_transfer_bytes_total{job="worker"})')) > 0
        assert values('kvrs_slots_in_use{job="slot-broker"}') == [0.0]
        recoveries = values('kvrs_recovery_actual_seconds_count{job="router"}')
        assert recoveries == [0.0] * 4  # every action's series, at zero: no failure here
        ttft_p50 = values(
            "histogram_quantile(0.5, sum by (le) (rate(kvrs_ttft_seconds_bucket[1m])))"
        )
        assert len(ttft_p50) == 1 and math.isfinite(ttft_p50[0]) and ttft_p50[0] > 0
    finally:
        if prometheus is not None:
            os.killpg(prometheus.pid, signal.SIGTERM)
            prometheus.wait(timeout=30)
        try:
            stop_cluster_processes(ClusterState.load(run_dir).processes, grace_s=5.0)
        except ClusterError:
            pass
