"""The faults `bench.soak --chaos` injects, one at a time, each chosen at random (fixed seed).

- `decode_kill`: kill -9 of a decode worker, started again `restart_after_s` later;
- `prefill_kill`: kill -9 of a prefill worker (the KV source of migrations), restarted;
- `scheduler_kill`: kill -9 of one scheduler replica (clients fail over), restarted;
- `redis_restart`: the private Redis SIGKILLed and started again on its port, empty (it
  persists nothing): registry, leases and events are gone until the workers re-register;
- `link_flap`: a decode worker's listeners (gRPC and KV rendezvous) unreachable for
  `flap_s`: every packet to them on the loopback dropped (iptables), then let through;
- `cpu_starve`: a worker stopped 60 % of the time (SIGSTOP 0.3 s / SIGCONT 0.2 s) for
  `starve_s`.

The link flap drops packets on the host's loopback rather than shaping a veth between
network namespaces: the soak's cluster runs every process on the host. It needs root and
`iptables`; without them the fault is recorded as skipped, with the reason.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from kvrs.cli.launcher import ClusterState, is_running, start_private_redis
from kvrs.v1 import worker_pb2, worker_pb2_grpc

FAULTS = (
    "decode_kill",
    "prefill_kill",
    "scheduler_kill",
    "redis_restart",
    "link_flap",
    "cpu_starve",
)
DECODE_WORKERS = ("decode-0", "decode-1")
PREFILL_WORKERS = ("prefill-0", "prefill-1")
SCHEDULERS = ("scheduler-1", "scheduler-2")


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


class Chaos:
    """Injects one fault at a time into the cluster `supervisor` runs (see the module doc)."""

    def __init__(
        self,
        supervisor,
        rng: random.Random,
        restart_after_s: float,
        flap_s: float = 3.0,
        starve_s: float = 6.0,
    ) -> None:
        self.supervisor = supervisor
        self.rng = rng
        self.restart_after_s = restart_after_s
        self.flap_s = flap_s
        self.starve_s = starve_s

    @property
    def state(self) -> ClusterState:
        return self.supervisor.state

    async def inject_one(self) -> dict:
        """Picks a fault and a victim, runs it to the end; what happened, for the report."""
        kind = self.rng.choice(FAULTS)
        run: dict[str, Callable[[], Awaitable[dict]]] = {
            "decode_kill": lambda: self._kill_and_restart(self.rng.choice(DECODE_WORKERS)),
            "prefill_kill": lambda: self._kill_and_restart(self.rng.choice(PREFILL_WORKERS)),
            "scheduler_kill": lambda: self._kill_and_restart(self.rng.choice(SCHEDULERS)),
            "redis_restart": self._restart_redis,
            "link_flap": lambda: self._flap(self.rng.choice(DECODE_WORKERS)),
            "cpu_starve": lambda: self._starve(
                self.rng.choice((*PREFILL_WORKERS, *DECODE_WORKERS))
            ),
        }
        started_s = time.monotonic()
        record = await run[kind]()
        return {"fault": kind, **record, "lasted_s": round(time.monotonic() - started_s, 1)}

    async def _kill_and_restart(self, victim: str) -> dict:
        await asyncio.to_thread(self.supervisor.kill, victim)
        await asyncio.sleep(self.restart_after_s)
        serving_after_s = await self.supervisor.restart(victim)
        return {
            "victim": victim,
            "serving_again_after_s": round(self.restart_after_s + serving_after_s, 1),
        }

    async def _restart_redis(self) -> dict:
        old = self.supervisor.record("redis")
        os.killpg(old.pid, signal.SIGKILL)
        while is_running(old):
            await asyncio.sleep(0.01)
        await asyncio.sleep(2.0)
        record = await asyncio.to_thread(
            start_private_redis, Path(self.state.run_dir), _port(old.address)
        )
        self.state.processes[self.state.processes.index(old)] = record
        self.state.save()
        self.supervisor.restarted.add("redis")
        return {"victim": "redis", "down_s": 2.0}

    async def _flap(self, victim: str) -> dict:
        if os.geteuid() != 0 or shutil.which("iptables") is None:
            return {"victim": victim, "skipped": "needs root and iptables"}
        address = self.supervisor.record(victim).address
        async with grpc.aio.insecure_channel(address) as channel:
            stats = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(
                worker_pb2.GetWorkerStatsRequest(), timeout=5
            )
        ports = (_port(address), _port(stats.transfer_address))
        rules = [
            ("INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), "-j", "DROP") for port in ports
        ]
        for rule in rules:
            subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
        try:
            await asyncio.sleep(self.flap_s)
        finally:
            for rule in rules:
                subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)
        return {"victim": victim, "ports": list(ports), "down_s": self.flap_s}

    async def _starve(self, victim: str) -> dict:
        pid = self.supervisor.record(victim).pid
        end_s = time.monotonic() + self.starve_s
        try:
            while time.monotonic() < end_s:
                os.killpg(pid, signal.SIGSTOP)
                await asyncio.sleep(0.3)
                os.killpg(pid, signal.SIGCONT)
                await asyncio.sleep(0.2)
        finally:
            os.killpg(pid, signal.SIGCONT)
        return {"victim": victim, "stopped_share": 0.6}
