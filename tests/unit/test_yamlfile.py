"""Configuration files: numbers as JSON and YAML 1.2 write them."""

from __future__ import annotations

import json

from kvrs.sim.config import SimConfig
from kvrs.yamlfile import load_yaml


def test_exponent_only_floats_are_numbers_and_quoted_ones_stay_text(tmp_path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text('penalty: 1e-05\nrate_bps: 400e9\nneg: -2E+3\nname: "1e5"\nn: 10\nx: 1.5\n')
    assert load_yaml(path) == {
        "penalty": 1e-05,
        "rate_bps": 400e9,
        "neg": -2000.0,
        "name": "1e5",
        "n": 10,
        "x": 1.5,
    }


def test_a_json_config_written_by_python_loads_its_floats_as_floats(tmp_path) -> None:
    """`json.dumps(0.00001)` is `1e-05`: a simulator configuration written by a script
    must hold the number, not the string YAML 1.1 would read."""
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"placement_retry_s": 0.00001}))
    assert "1e-05" in path.read_text()
    assert SimConfig.load(path).placement_retry_s == 1e-05
