"""A Prometheus scrape configuration for a local cluster's metrics endpoints.

`kvrs up` writes it beside the state file, so `prometheus --config.file
runs/local/prometheus.yml` scrapes every process of the cluster; the jobs and labels are
the same as in `deploy/prometheus/prometheus.yml` (job = the service, `instance` = the
process' name), so the Grafana dashboard in `deploy/grafana/` reads either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvrs.cli.launcher.state import ClusterState

SCRAPE_CONFIG_FILE = "prometheus.yml"
SCRAPE_INTERVAL_S = 5


def job_name(module: str) -> str:
    """The scrape job of a service module: services.slot_broker -> slot-broker."""
    return module.removeprefix("services.").replace("_", "-")


def scrape_config(state: ClusterState, interval_s: float = SCRAPE_INTERVAL_S) -> dict[str, Any]:
    jobs: dict[str, list[dict[str, Any]]] = {}
    for record in state.processes:
        if record.metrics_addr:
            jobs.setdefault(job_name(record.module), []).append(
                {"targets": [record.metrics_addr], "labels": {"instance": record.name}}
            )
    return {
        "global": {
            "scrape_interval": f"{interval_s:g}s",
            "evaluation_interval": f"{interval_s:g}s",
        },
        "scrape_configs": [
            {"job_name": job, "static_configs": targets} for job, targets in jobs.items()
        ],
    }


def write_scrape_config(state: ClusterState, path: Path) -> Path:
    header = f"# kvrs up's cluster in {state.run_dir}: prometheus --config.file {path}\n"
    path.write_text(header + yaml.safe_dump(scrape_config(state), sort_keys=False))
    return path
