"""Scheduler and cost oracle configuration: defaults, and failing fast naming the variable."""

from __future__ import annotations

import json

import pytest

from kvrs.model import DEFAULT_MODEL
from kvrs.profile import compute_profile
from services.common import ConfigError
from services.common.decision_inputs import InputsConfig, load_inputs
from services.cost_oracle.config import Config as OracleConfig
from services.scheduler.config import Config


def test_defaults_match_the_documented_ports_and_policies():
    config = Config.from_env({})
    assert config.listen_addr == "0.0.0.0:50053"
    assert (config.placement_policy, config.recovery_policy) == ("netkv", "kvrs")
    assert (config.view_refresh_s, config.view_stale_after_s) == (0.1, 1.0)
    assert config.inputs.model == DEFAULT_MODEL == "tiny"
    assert OracleConfig.from_env({}).listen_addr == "0.0.0.0:50052"


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SCHEDULER_PLACEMENT_POLICY": "fastest"}, "SCHEDULER_PLACEMENT_POLICY"),
        ({"SCHEDULER_RECOVERY_POLICY": "coinflip"}, "SCHEDULER_RECOVERY_POLICY"),
        ({"SCHEDULER_VIEW_REFRESH_S": "0"}, "SCHEDULER_VIEW_REFRESH_S"),
        ({"SCHEDULER_VIEW_STALE_AFTER_S": "soon"}, "SCHEDULER_VIEW_STALE_AFTER_S"),
        ({"SCHEDULER_VIEW_FETCH_TIMEOUT_S": "0"}, "SCHEDULER_VIEW_FETCH_TIMEOUT_S"),
        ({"SCHEDULER_SLOT_TTL_S": "-1"}, "SCHEDULER_SLOT_TTL_S"),
        ({"KVRS_TELEMETRY_STALE_AFTER_S": "0"}, "KVRS_TELEMETRY_STALE_AFTER_S"),
        ({"KVRS_MAX_CONTEXT_TOKENS": "0"}, "KVRS_MAX_CONTEXT_TOKENS"),
    ],
)
def test_bad_values_fail_naming_the_variable(env, variable):
    with pytest.raises(ConfigError, match=variable):
        Config.from_env(env)


def test_oracle_rejects_a_zero_refresh_period():
    with pytest.raises(ConfigError, match="COST_ORACLE_REFRESH_S"):
        OracleConfig.from_env({"COST_ORACLE_REFRESH_S": "0"})


def test_inputs_load_the_model_preset_and_its_profile():
    inputs = load_inputs(InputsConfig.from_env({"KVRS_MODEL": "llama3-8b"}))
    assert inputs.model.kv_bytes_per_token == 131_072
    assert inputs.compute == compute_profile("llama3-8b")
    assert not inputs.topology.instances


def test_inputs_read_a_calibrated_profile_and_a_topology_file(tmp_path):
    profile = compute_profile("tiny")
    profile_file = tmp_path / "profile.json"
    profile.save(profile_file)
    topology_file = tmp_path / "topology.yaml"
    topology_file.write_text(
        "nodes: [{name: n0, rack: r0, pod: p0}]\n"
        "instances: [{id: prefill-0, role: prefill, node: n0}]\n"
    )
    inputs = load_inputs(
        InputsConfig(topology_file=str(topology_file), model="tiny", profile_file=str(profile_file))
    )
    assert inputs.compute == profile
    assert inputs.topology.instance("prefill-0").location.rack == "r0"


@pytest.mark.parametrize(
    ("setup", "variable"),
    [
        (lambda d: InputsConfig(model="gpt-17"), "KVRS_MODEL"),
        (lambda d: InputsConfig(topology_file=str(d / "missing.yaml")), "KVRS_TOPOLOGY_FILE"),
        (
            lambda d: InputsConfig(topology_file=_write(d / "t.yaml", "tiers: {warp: {}}")),
            "KVRS_TOPOLOGY_FILE",
        ),
        (
            lambda d: InputsConfig(
                profile_file=_write(d / "p.json", json.dumps(compute_profile("opt-125m").to_json()))
            ),
            "KVRS_PROFILE_FILE",
        ),
        (lambda d: InputsConfig(max_context_tokens=2**62), "KVRS_MAX_CONTEXT_TOKENS"),
    ],
)
def test_bad_inputs_fail_at_start_naming_the_variable(tmp_path, setup, variable):
    with pytest.raises(ConfigError, match=variable):
        load_inputs(setup(tmp_path))


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)
