"""The faults `bench.soak --chaos` injects, one at a time, each chosen at random (fixed seed).

- `decode_kill`: kill -9 of a decode worker, started again `restart_after_s` later;
- `prefill_kill`: kill -9 of a prefill worker (the KV source of migrations), restarted;
- `scheduler_kill`: kill -9 of one scheduler replica (clients fail over), restarted;
- `redis_restart`: the private Redis SIGKILLed and started again on its port, empty (it
  persists nothing): registry, leases and events are gone until the workers re-register;
- `link_flap`: a decode worker's link blackholed for `flap_s` (every packet into its
  network namespace dropped, mid-connection: tc swaps its veth's queue for one of length
  0), then given back;
- `cpu_starve`: a worker stopped 60 % of the time (SIGSTOP 0.3 s / SIGCONT 0.2 s) for
  `starve_s`.

The link flap needs the workers in network namespaces (`bench.netns`: root, `ip`,
`iptables`, `tc`); where the soak could not put them there, the fault is recorded as
skipped, with the reason.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.netns import NetnsLab
from kvrs.cli.launcher import ClusterState, is_running, start_private_redis

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
        lab: NetnsLab | None,
        why_no_lab: str = "",
        flap_s: float = 3.0,
        starve_s: float = 6.0,
    ) -> None:
        self.supervisor = supervisor
        self.lab = lab
        self.why_no_lab = why_no_lab
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
        if self.lab is None:
            return {"victim": victim, "skipped": f"no network namespaces: {self.why_no_lab}"}
        await asyncio.to_thread(self.lab.blackhole, victim)
        try:
            await asyncio.sleep(self.flap_s)
        finally:
            await asyncio.to_thread(self.lab.restore, victim)
        return {"victim": victim, "down_s": self.flap_s}

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
