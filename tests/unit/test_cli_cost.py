"""`kvrs cost` prints the Kvrs policy's options as JSON and rejects bad flags by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvrs.cli import main
from kvrs.cli.cost import DECODE_ID, PREFILL_ID, two_instance_topology
from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.profile import ComputeProfile, compute_profile
from kvrs.recovery import Kvrs, RecoveryRequest
from kvrs.topology import Role

ROOT = Path(__file__).resolve().parents[2]


def kvrs_cost(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrs", "cost", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_opt13b_1477_tokens_at_25_gbps() -> None:
    result = kvrs_cost("--model", "opt-13b", "--prompt-tokens", "1477", "--bandwidth-gbps", "25")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["kv_bytes_per_token"] == 819_200
    assert report["kv_bytes"] == pytest.approx(1.21e9, rel=1e-3)
    assert report["migrate_s"] == pytest.approx(0.387, abs=1e-3)
    assert report["recompute_s"] > report["migrate_s"]
    assert report["hybrid_s"] <= min(report["migrate_s"], report["recompute_s"])
    assert 0 < report["hybrid_split_tokens"] < 1477
    assert report["decision"] == "hybrid"
    assert report["slack_s"] is None


def test_matches_the_kvrs_policy_in_process() -> None:
    result = kvrs_cost(
        "--model",
        "llama3-70b",
        "--prompt-tokens",
        "3000",
        "--generated-tokens",
        "40",
        "--bandwidth-gbps",
        "10",
        "--rtt-ms",
        "2",
        "--decode-wait-s",
        "0.05",
        "--prefill-wait-s",
        "0.2",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    cost = CostModel(
        model_spec("llama3-70b"),
        compute_profile("llama3-70b"),
        NetworkModel(two_instance_topology(10e9, 2e-3)),
    )
    view = ClusterView(
        {
            PREFILL_ID: InstanceState(PREFILL_ID, Role.PREFILL, wait_s=0.2),
            DECODE_ID: InstanceState(DECODE_ID, Role.DECODE, wait_s=0.05),
        },
        0.0,
    )
    decision = Kvrs().decide(RecoveryRequest("x", 3000, 40, PREFILL_ID), view, cost, 0.0)
    by_action = {o.action.value: o.cost_s for o in decision.options}
    assert report["migrate_s"] == pytest.approx(by_action["migrate"])
    assert report["recompute_s"] == pytest.approx(by_action["recompute"])
    assert report["hybrid_s"] == pytest.approx(by_action["hybrid"])
    assert report["decision"] == decision.action.value
    assert report["rtt_s"] == pytest.approx(2e-3)
    # migrate = W(d) + rtt + 8·S(L)/B + T_ext(L, g)
    assert report["migrate_s"] == pytest.approx(
        0.05 + 2e-3 + 8 * 327_680 * 3000 / 10e9 + compute_profile("llama3-70b").extend_s(3000, 40)
    )


def test_deadline_and_infeasible_migration() -> None:
    late = kvrs_cost(
        "--model",
        "opt-13b",
        "--prompt-tokens",
        "1477",
        "--bandwidth-gbps",
        "25",
        "--deadline-s",
        "0.01",
    )
    assert json.loads(late.stdout)["decision"] == "abort"
    lost = kvrs_cost(
        "--model",
        "opt-13b",
        "--prompt-tokens",
        "1477",
        "--bandwidth-gbps",
        "25",
        "--source-kv-lost",
    )
    report = json.loads(lost.stdout)
    assert report["decision"] == "recompute"
    assert report["migrate_s"] is None


def test_fast_link_ties_to_migrate(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["cost", "--model", "opt-13b", "--prompt-tokens", "512", "--bandwidth-gbps", "3600"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["hybrid_split_tokens"] == 0
    assert report["decision"] == "migrate"


def test_calibrated_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = ComputeProfile.fit("opt-13b", [(128, 0.03), (1024, 0.2), (4096, 1.0)])
    path = tmp_path / "profile.json"
    profile.save(path)
    assert (
        main(
            [
                "cost",
                "--model",
                "opt-13b",
                "--prompt-tokens",
                "1024",
                "--bandwidth-gbps",
                "1",
                "--profile",
                str(path),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["prefill_s"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model", "gpt-9", "--prompt-tokens", "10", "--bandwidth-gbps", "1"], "--model"),
        (
            ["--model", "opt-13b", "--prompt-tokens", "-3", "--bandwidth-gbps", "1"],
            "--prompt-tokens",
        ),
        (
            ["--model", "opt-13b", "--prompt-tokens", "3", "--bandwidth-gbps", "0"],
            "--bandwidth-gbps",
        ),
        (
            [
                "--model",
                "opt-13b",
                "--prompt-tokens",
                "3",
                "--bandwidth-gbps",
                "1",
                "--generated-tokens",
                "-1",
            ],
            "--generated-tokens",
        ),
    ],
)
def test_bad_flags_are_named(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cost", *flags]) == 2
    captured = capsys.readouterr()
    assert named in captured.err
    assert captured.out == ""


def test_bad_flag_exit_status_through_the_command() -> None:
    result = kvrs_cost("--model", "gpt-9", "--prompt-tokens", "10", "--bandwidth-gbps", "1")
    assert result.returncode == 2
    assert "--model" in result.stderr
