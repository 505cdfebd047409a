"""`kvrs up` → `kvrs status` → `kvrs down` as a user runs them: real processes, real ports."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrs.cli.launcher import (
    SERVICES,
    ClusterError,
    ClusterState,
    find_redis_server,
    is_running,
    start_private_redis,
    stop_processes,
)

ROOT = Path(__file__).resolve().parents[2]
INSTANCES = {"prefill-0", "prefill-1", "decode-0", "decode-1"}


def kvrs(*args: str, env: dict[str, str] | None = None, timeout_s: float = 90):
    return subprocess.run(
        [sys.executable, "-m", "kvrs", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def force_down(run_dir: Path) -> None:
    """Whatever the test did, no process of the cluster outlives it."""
    try:
        state = ClusterState.load(run_dir)
    except ClusterError:
        return
    stop_processes(state.processes, grace_s=2.0)


def registered_instances(run_dir: Path, deadline_s: float) -> dict:
    """`kvrs status --json` once every worker shows up in gossip (workers register as
    they finish their canary, so the first look may miss the last one)."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = kvrs("status", "--dir", str(run_dir), "--json", timeout_s=30)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        alive = {n["instance_id"] for n in report.get("instances", []) if n["state"] == "alive"}
        if alive >= INSTANCES or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


@pytest.mark.timeout(150)
def test_up_status_down(tmp_path, redis_url, redis_prefix):
    run_dir = tmp_path / "cluster"
    env = {"REDIS_URL": redis_url, "KVRS_REDIS_PREFIX": redis_prefix}
    try:
        up = kvrs("up", "--dir", str(run_dir), "--workers-model", "tiny", "--calibrate", env=env)
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}"
        state = ClusterState.load(run_dir)
        # Calibrated here, and every decision is priced with it.
        profile = (run_dir / "profile.json").resolve()
        assert "calibrating tiny" in up.stdout and profile.is_file()
        scheduler = next(r for r in state.processes if r.name == "scheduler-1")
        environ = Path(f"/proc/{scheduler.pid}/environ").read_bytes().split(b"\0")
        assert f"KVRS_PROFILE_FILE={profile}".encode() in environ
        assert {r.name for r in state.processes} == {spec.name for spec in SERVICES}
        assert all(is_running(r) for r in state.processes)
        assert state.redis_prefix == redis_prefix
        for record in state.processes:
            assert record.address in up.stdout
            assert Path(record.log_file).is_file()

        report = registered_instances(run_dir, deadline_s=10)
        instances = {n["instance_id"]: n for n in report["instances"]}
        assert INSTANCES <= set(instances)
        for name in INSTANCES:
            assert instances[name]["role"] == name.split("-")[0]
            assert instances[name]["address"] == state.address(name)
            assert instances[name]["age_s"] < 5
            assert instances[name]["running_context_tokens"] == 0, "nothing decoding yet"
        assert report["slots"]["slots_in_use"] == 0
        assert report["slots"]["cluster_cap"] > 0
        assert all(p["running"] for p in report["processes"])

        tables = kvrs("status", "--dir", str(run_dir), timeout_s=30)
        assert tables.returncode == 0, tables.stderr
        for heading in ("instances", "links", "slots", "PACE", "CONTEXT"):
            assert heading in tables.stdout
        assert "decode-1" in tables.stdout

        again = kvrs("up", "--dir", str(run_dir), env=env, timeout_s=30)
        assert again.returncode == 1
        assert "already running" in again.stderr

        down = kvrs("down", "--dir", str(run_dir), timeout_s=60)
        assert down.returncode == 0, down.stderr
        assert not any(is_running(r) for r in state.processes)
        assert not (run_dir / "cluster.json").exists()
    finally:
        force_down(run_dir)


def test_a_service_that_dies_at_startup_is_named_with_its_log(tmp_path, redis_url, redis_prefix):
    run_dir = tmp_path / "broken"
    env = {
        "REDIS_URL": redis_url,
        "KVRS_REDIS_PREFIX": redis_prefix,
        "GOSSIP_HEARTBEAT_TTL_S": "-1",
    }
    try:
        up = kvrs("up", "--dir", str(run_dir), env=env, timeout_s=60)
        assert up.returncode == 1
        # Both gossip replicas read the variable; whichever exits first is named.
        assert re.search(r"gossip(-views)? exited during startup", up.stderr), up.stderr
        assert "GOSSIP_HEARTBEAT_TTL_S" in up.stderr
        assert not (run_dir / "cluster.json").exists()
    finally:
        force_down(run_dir)


def test_private_redis_starts_answers_and_stops(tmp_path):
    import redis

    assert Path(find_redis_server()).is_file()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    record = start_private_redis(tmp_path, port)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        assert client.ping()
        client.close()
    finally:
        killed = stop_processes([record], grace_s=5.0)
    assert killed == [], "redis-server stops on SIGTERM, without SIGKILL"
    assert not is_running(record)


def test_without_any_redis_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr("kvrs.cli.launcher.redis_server.shutil.which", lambda name: None)
    monkeypatch.setattr(
        "kvrs.cli.launcher.redis_server.importlib.util.find_spec", lambda name: None
    )
    with pytest.raises(ClusterError) as caught:
        find_redis_server()
    message = str(caught.value)
    assert "REDIS_URL" in message and "redis-server" in message and "kvrs[redis]" in message
