"""Worker configuration: required variables named, topology file as location source, the
cluster's block size."""

from __future__ import annotations

import pytest

from kvrs.errors import InvalidArgument
from kvrs.model import block_tokens_setting, model_spec
from services.common import ConfigError
from services.worker.config import Config

TOPOLOGY = """
nodes:
  - {name: node-a, rack: rack-0, pod: pod-0}
instances:
  - {id: prefill-0, role: prefill, node: node-a, gpu_index: 1}
"""


def test_required_variables_are_named():
    with pytest.raises(ConfigError, match="WORKER_INSTANCE_ID"):
        Config.from_env({"WORKER_ROLE": "prefill"})
    with pytest.raises(ConfigError, match="WORKER_ROLE"):
        Config.from_env({"WORKER_INSTANCE_ID": "w"})
    with pytest.raises(ConfigError, match="WORKER_ROLE"):
        Config.from_env({"WORKER_INSTANCE_ID": "w"}, role="router")
    with pytest.raises(ConfigError, match="WORKER_TRANSFER_TIMEOUT_S"):
        Config.from_env(
            {"WORKER_INSTANCE_ID": "w", "WORKER_TRANSFER_TIMEOUT_S": "0"}, role="decode"
        )


def test_location_comes_from_the_topology_file_unless_overridden(tmp_path):
    path = tmp_path / "topology.yaml"
    path.write_text(TOPOLOGY)
    env = {
        "WORKER_INSTANCE_ID": "prefill-0",
        "KVRS_TOPOLOGY_FILE": str(path),
        "KVRS_MODEL": "opt-125m",
    }
    config = Config.from_env(env, role="prefill")
    assert (
        config.location.node,
        config.location.rack,
        config.location.pod,
        config.location.gpu_index,
    ) == ("node-a", "rack-0", "pod-0", 1)
    assert config.model == "opt-125m"
    overridden = Config.from_env(
        {**env, "WORKER_RACK": "rack-9", "WORKER_MODEL": "tiny"}, role="prefill"
    )
    assert (overridden.location.rack, overridden.model) == ("rack-9", "tiny")
    unlisted = Config.from_env({**env, "WORKER_INSTANCE_ID": "decode-7"}, role="decode")
    assert unlisted.location.node == "decode-7"


@pytest.mark.parametrize("value", ["0", "-512", "many"])
def test_a_block_size_that_is_not_a_positive_integer_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="KVRS_BLOCK_TOKENS"):
        Config.from_env({"WORKER_INSTANCE_ID": "w", "KVRS_BLOCK_TOKENS": value}, role="decode")
    with pytest.raises(InvalidArgument) as info:
        block_tokens_setting({"KVRS_BLOCK_TOKENS": value})
    assert info.value.field == "KVRS_BLOCK_TOKENS"


def test_the_block_size_is_one_cluster_setting(monkeypatch):
    """Workers, and whatever hashes prompts through `model_spec` (router, scheduler,
    gateway), read the same variable."""
    env = {"WORKER_INSTANCE_ID": "w", "KVRS_BLOCK_TOKENS": "64"}
    assert Config.from_env(env, role="decode").block_tokens == 64
    assert Config.from_env({"WORKER_INSTANCE_ID": "w"}, role="decode").block_tokens == 512
    monkeypatch.setenv("KVRS_BLOCK_TOKENS", "64")
    assert model_spec("tiny").block_tokens == 64
    assert model_spec("opt-13b").block_tokens == 64
    monkeypatch.delenv("KVRS_BLOCK_TOKENS")
    assert model_spec("tiny").block_tokens == 512
