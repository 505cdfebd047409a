"""`kvrs sim`: experiments run end to end on small inputs and write their outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvrs.cli import main

SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"


def test_netkv_experiment_writes_json_markdown_and_figures(tmp_path):
    config = tmp_path / "netkv.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workload": {"trace": str(SAMPLE), "limit": 60},
                "tuning": {"cache_weight": [0.0, 0.4], "load_weight": [1.0]},
                "load_scales": [1.0],
                "background_levels": [0.0, 0.3],
                "context": {"caps": [8192]},
                "staleness": {"periods_s": [0.0, "inf"]},
                "segregated": {"rate_scales": [1.0], "background_levels": [0.3]},
            }
        )
    )
    out = tmp_path / "out"
    assert main(["sim", "netkv", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    data = json.loads((out / "netkv.json").read_text())
    assert len(data["cache_load_tuning"]) == 2
    assert set(data["policies"]["cache_load"]["params"]) == {"cache_weight", "load_weight"}
    for section in ("load", "context", "staleness", "segregated"):
        for row in data[section]:
            for result in row["results"].values():
                assert result["lost"] == 0 and result["completed"] == 60
    assert "netkv_vs_round_robin_ttft_pct" in data["headline"]
    markdown = (out / "netkv.md").read_text()
    assert "| background | rate_scale |" in markdown
    for figure in ("load", "context", "staleness", "attainment"):
        assert (out / f"netkv_{figure}.png").stat().st_size > 1000


def test_single_run_prints_a_summary(tmp_path, capsys):
    assert (
        main(["sim", "run", "--trace", str(SAMPLE), "--policy", "round_robin", "--no-progress"])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["completed"] == 200 and summary["lost"] == 0


def test_a_bad_config_key_is_named(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"serving": {"no_such_key": 1}}))
    assert (
        main(["sim", "run", "--trace", str(SAMPLE), "--config", str(config), "--no-progress"]) == 2
    )
    assert "no_such_key" in capsys.readouterr().err


WALL_TIME_KEYS = ("wall_s", "plan_wall_s")


def _without_wall_time(value):
    """The value without its wall-clock figures (the only ones that differ run to run)."""
    if isinstance(value, dict):
        return {k: _without_wall_time(v) for k, v in value.items() if k not in WALL_TIME_KEYS}
    if isinstance(value, list):
        return [_without_wall_time(v) for v in value]
    return value


def test_netkv_in_parallel_processes_writes_what_a_serial_run_writes(tmp_path):
    config = tmp_path / "netkv.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workload": {"trace": str(SAMPLE), "limit": 40},
                "tuning": {"cache_weight": [0.0, 0.4], "load_weight": [1.0]},
                "load_scales": [1.0],
                "background_levels": [0.3],
                "context": {"caps": [8192]},
                "staleness": {"periods_s": [1.0]},
                "segregated": {"rate_scales": [1.0], "background_levels": [0.3]},
            }
        )
    )
    outputs = {}
    for jobs in ("1", "3"):
        out = tmp_path / f"j{jobs}"
        argv = ["sim", "netkv", "--config", str(config), "--out", str(out), "--no-progress"]
        assert main([*argv, "-j", jobs]) == 0
        outputs[jobs] = (
            json.loads((out / "netkv.json").read_text()),
            (out / "netkv.md").read_text(),
        )
    (serial, serial_md), (parallel, parallel_md) = outputs["1"], outputs["3"]
    assert parallel_md == serial_md
    assert _without_wall_time(parallel) == _without_wall_time(serial)
    assert serial["load"][0]["results"]["netkv"]["wall_s"] > 0


SMALL_EXPERIMENTS = {
    "rom-goodput": {
        "skews": [0.6, 0.9],
        "requests": 60,
        "tolerance": 1.0,
        "policies": [
            {"name": "static", "policy": "least_loaded", "candidates": "same_node"},
            {"name": "kvrs", "policy": "kvrs", "mode": "recovery", "network_view": "live"},
        ],
    },
    "recovery": {
        "single": {"bandwidth_factors": [0.5, 2.0]},
        "node_failure": {"fail_at_s": 3.0, "workload": {"requests": 200}},
    },
}


@pytest.mark.parametrize("name", sorted(SMALL_EXPERIMENTS))
def test_experiments_in_parallel_processes_write_what_a_serial_run_writes(tmp_path, name):
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(SMALL_EXPERIMENTS[name]))
    outputs = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"j{jobs}"
        argv = ["sim", name, "--config", str(config), "--out", str(out), "--no-progress"]
        assert main([*argv, "-j", jobs]) == 0
        outputs[jobs] = json.loads((out / f"{name}.json").read_text())
    assert _without_wall_time(outputs["2"]) == _without_wall_time(outputs["1"])
