"""A whole kvrs cluster of real processes, started with `kvrs up`'s own launcher.

`recovery_cluster` runs gossip, the slot broker, one scheduler, the router and four torch
workers (prefill-0/1, decode-0/1, the tiny model in float64: greedy decoding is bit-exact,
so a recovered stream must equal an undisturbed one) on free ports against the test Redis,
under a fresh key prefix. Tests kill workers with real signals and `restart` them.

The topology and compute profile make the three recovery actions distinct when decode-0
dies and decode-1 takes over: prefill-1 sits on decode-1's node (NVLink) while prefill-0
reaches it across a slow rack link whose transfer of a prompt costs about as much as its
prefill (1 ms per token each). Recomputing via prefill-1 then costs L + g ms, migrating
from prefill-0 L + g ms, and HYBRID, which recomputes half the prompt while the other half
crosses the rack, about L/2 + g ms: `kvrs` picks HYBRID, `always_migrate` and
`always_recompute` force the other two.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvrs.cli.launcher import (
    SERVICES,
    ClusterOptions,
    ClusterState,
    ServiceSpec,
    Wiring,
    common_env,
    is_running,
    log_tail,
    spawn,
    start_cluster,
    stop_cluster,
    stop_processes,
)
from kvrs.model import model_spec
from kvrs.profile import ComputeProfile
from services.common import GrpcSettings
from services.common.healthcheck import SERVING, check_health
from services.gossip.client import GossipClient

RECOVERY_SERVICES = (
    "gossip",
    "slot-broker",
    "scheduler-1",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
    "router",
)
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
MS_PER_TOKEN = 1e-3
"""Prefill cost of one token in the test profile, and the rack link's transfer cost of one."""
HEARTBEAT_TTL_S = 1.0
EVENT_LINE = re.compile(r" (WARNING|ERROR) |recovering |suspect|failed|refuted|registered")
"""The log lines a failed test's report shows: what the cluster noticed while it ran."""
LOGGED_AT = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
"""How a logged line starts (its time), unlike a traceback's continuation lines."""


def recovery_topology() -> dict:
    bits_per_token = 8 * model_spec("tiny").kv_bytes_per_token
    rack_gbps = bits_per_token / MS_PER_TOKEN / 1e9
    return {
        "setup_latency_ms": 0.1,
        "tiers": {
            "node": {"capacity_gbps": 3600, "hop_latency_us": 0},
            "rack": {"capacity_gbps": rack_gbps, "hop_latency_us": 2},
            "pod": {"capacity_gbps": rack_gbps, "hop_latency_us": 2},
            "spine": {"capacity_gbps": rack_gbps, "hop_latency_us": 2},
        },
        "nodes": [
            {"name": "node-a", "rack": "rack-0", "pod": "pod-0"},
            {"name": "node-b", "rack": "rack-0", "pod": "pod-0"},
        ],
        "instances": [
            {"id": "prefill-0", "role": "prefill", "node": "node-a", "gpu_index": 0},
            {"id": "decode-0", "role": "decode", "node": "node-a", "gpu_index": 1},
            {"id": "prefill-1", "role": "prefill", "node": "node-b", "gpu_index": 0},
            {"id": "decode-1", "role": "decode", "node": "node-b", "gpu_index": 1},
        ],
    }


def _with_env(spec: ServiceSpec, extra: dict[str, str]) -> ServiceSpec:
    base = spec.env
    return dataclasses.replace(spec, env=lambda wiring: {**base(wiring), **extra})


def recovery_services(profile_file: Path) -> tuple[ServiceSpec, ...]:
    by_name = {spec.name: spec for spec in SERVICES}
    extra = {
        # The base model alone prices these recoveries: the topology and profile are built
        # so that each policy yields a known action, and corrections learned from the
        # module's earlier recoveries would move that choice (learning has its own tests).
        "scheduler-1": {"KVRS_PROFILE_FILE": str(profile_file), "SCHEDULER_LEARNING": "0"},
        # A restarted worker takes seconds to register: a recovery waits up to a minute.
        "router": {
            "KVRS_PROFILE_FILE": str(profile_file),
            "ROUTER_BATCH_WINDOW_S": "0.2",
            "ROUTER_INSTANCE_WAIT_S": "60",
        },
    }
    for worker in WORKERS:
        extra[worker] = {"WORKER_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S)}
    return tuple(_with_env(by_name[name], extra.get(name, {})) for name in RECOVERY_SERVICES)


@dataclass
class LocalCluster:
    """A running cluster and the means to kill and restart its processes."""

    state: ClusterState
    options: ClusterOptions
    specs: dict[str, ServiceSpec]

    @property
    def run_dir(self) -> Path:
        return Path(self.state.run_dir)

    def address(self, name: str) -> str:
        return self.state.address(name)

    def record(self, name: str):
        return next(r for r in self.state.processes if r.name == name)

    def signal(self, name: str, sig: signal.Signals) -> None:
        record = self.record(name)
        os.killpg(record.pid, sig)

    def kill(self, *names: str) -> None:
        """kill -9, then wait until each process is gone."""
        for name in names:
            self.signal(name, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(is_running(self.record(n)) for n in names) and time.monotonic() < deadline:
            time.sleep(0.01)

    def restart(self, *names: str) -> None:
        """Starts each named process again, with its original environment and port; returns
        once it reports SERVING and gossip lists it alive again."""
        wiring = Wiring(
            addresses={r.name: r.address for r in self.state.processes}, options=self.options
        )
        shared = common_env(wiring, None, self.state.redis_url, self.state.redis_prefix)
        for name in names:
            old = self.record(name)
            if is_running(old):
                stop_processes([old], grace_s=2.0)
            spec = self.specs[name]
            env = {
                **shared,
                spec.listen_env: old.address,
                "OTEL_SERVICE_NAME": f"kvrs-{name}",
                **spec.env(wiring),
            }
            record = spawn(
                name,
                spec.kind,
                [sys.executable, "-m", spec.module, *spec.args],
                spec.module,
                old.address,
                env,
                self.run_dir,
            )
            index = self.state.processes.index(old)
            self.state.processes[index] = record
        self.state.save()
        asyncio.run(self._wait_back(names))

    def events_since(self, since_unix_s: float, most: int = 60) -> str:
        """Every process's notable log lines (EVENT_LINE) from `since_unix_s` on, in time
        order: heartbeats late, instances failed, recoveries started, errors."""
        since = datetime.datetime.fromtimestamp(since_unix_s).strftime("%Y-%m-%d %H:%M:%S")
        lines = []
        for log_file in sorted((self.run_dir / "logs").glob("*.log")):
            for line in log_file.read_text(errors="replace").splitlines():
                if LOGGED_AT.match(line) and line[:19] >= since and EVENT_LINE.search(line):
                    lines.append(f"{line[:23]} {log_file.stem}: {line[24:300]}")
        return "\n".join(sorted(lines)[-most:])

    def ensure_running(self) -> None:
        """Restarts whatever a test left dead."""
        dead = [r.name for r in self.state.processes if r.name != "redis" and not is_running(r)]
        if dead:
            self.restart(*dead)

    async def _wait_back(self, names: tuple[str, ...], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            while await check_health(self.address(name), GrpcSettings(), timeout_s=0.5) != SERVING:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{name} did not come back:\n{log_tail(self.record(name).log_file)}"
                    )
                await asyncio.sleep(0.1)
        await self.wait_alive(names, deadline - time.monotonic())

    async def wait_alive(self, names, timeout_s: float = 30.0) -> None:
        """Until gossip lists every named worker alive (and the router's view caught up)."""
        client = GossipClient(self.address("gossip"), timeout_s=2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                alive = {n.registration.instance_id for n in await client.list_nodes()}
                if set(names) & set(WORKERS) <= alive:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"gossip lists {sorted(alive)} alive, not {names}")
                await asyncio.sleep(0.1)
        finally:
            await client.close()
        # The router and the scheduler refresh their views from gossip every 0.2 / 0.1 s.
        await asyncio.sleep(0.5)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test of the recovery cluster reports what the cluster logged meanwhile."""
    report = (yield).get_result()
    cluster = item.funcargs.get("recovery_cluster") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and isinstance(cluster, LocalCluster):
        report.sections.append(("cluster events", cluster.events_since(call.start - 1)))


@pytest.fixture(scope="session")
def recovery_cluster(tmp_path_factory, redis_url, session_redis_prefix) -> Iterator[LocalCluster]:
    """The cluster described in the module docstring, torn down after the session."""
    root = tmp_path_factory.mktemp("recovery")
    topology = root / "topology.yaml"
    topology.write_text(yaml.safe_dump(recovery_topology()))
    profile = root / "profile.json"
    ComputeProfile("tiny", a_s=0.0, b_s_per_token=MS_PER_TOKEN, c_s_per_token2=0.0).save(profile)
    options = ClusterOptions(
        run_dir=root / "cluster",
        workers_model="tiny",
        redis_url=redis_url,
        redis_prefix=session_redis_prefix,
        topology_file=topology,
        startup_timeout_s=120,
    )
    services = recovery_services(profile)
    state = start_cluster(options, services)
    cluster = LocalCluster(
        state=state, options=options, specs={spec.name: spec for spec in services}
    )
    try:
        asyncio.run(cluster.wait_alive(WORKERS))
        yield cluster
    finally:
        stop_cluster(cluster.run_dir, grace_s=5.0)
