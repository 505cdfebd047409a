"""The control plane at thousands of instances: heartbeat capacity and view freshness.

`python -m bench.scale --instances 4096` starts a private Redis and a gossip process,
registers N instances, and then:

1. **heartbeat capacity**: several driver processes heartbeat as fast as the gossip
   process answers; reported as heartbeats/s and heartbeats per CPU-second of gossip +
   Redis (their /proc CPU time over the window), for full-load heartbeats and for the
   beats `HeartbeatLoop` sends when the load did not change.

Not a test: figures depend on the machine (shared here); nothing asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import redis

from services.common import GrpcSettings
from services.common.gossip_records import NodeLoad, Registration
from services.common.healthcheck import SERVING, check_health
from services.gossip.client import GossipClient

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HEARTBEAT_MODES = {
    "unary": "unary Heartbeat, load changed (before)",
    "stream": "StreamHeartbeats, load changed",
    "stream_unchanged": "StreamHeartbeats, load unchanged (liveness)",
}
PODS = 16
"""Instances spread over this many pods (and 8 GPUs per node)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class Processes:
    """The private Redis and the control-plane processes of one run; stopped on exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, command: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            list(command), env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_redis(procs: Processes) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = procs.start(
        "redis",
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        + ["no", "--dir", str(procs.run_dir)],
        {},
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"


def start_gossip(procs: Processes, redis_url: str, prefix: str) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{_free_port()}"
    env = {
        "GOSSIP_LISTEN_ADDR": address,
        "REDIS_URL": redis_url,
        "KVRS_REDIS_PREFIX": prefix,
        "GOSSIP_HEARTBEAT_TTL_S": "3600",
        "OTEL_TRACES_EXPORTER": "none",
    }
    proc = procs.start("gossip", [sys.executable, "-m", "services.gossip"], env)
    return proc, address


async def wait_serving(address: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await check_health(address, GrpcSettings(), timeout_s=0.5) != SERVING:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{address} is not SERVING after {timeout_s} s")
        await asyncio.sleep(0.1)


def registration(index: int) -> Registration:
    role = "prefill" if index % 4 == 0 else "decode"
    node = index // 8
    return Registration(
        instance_id=f"{role}-{index:05d}",
        role=role,
        address=f"10.{node // 250}.{node % 250}.1:{50060 + index % 8}",
        node=f"n{node}",
        rack=f"r{node // 4}",
        pod=f"p{node % PODS}",
        gpu_index=index % 8,
        kv_capacity_blocks=4096,
        transfer_address=f"10.{node // 250}.{node % 250}.1:{51060 + index % 8}",
    )


def load(index: int, beat: int) -> NodeLoad:
    """A decode instance's load at its `beat`-th heartbeat: a few running requests and a
    few dozen resident prefix blocks, changing every beat."""
    return NodeLoad(
        queue_depth=(index + beat) % 4,
        queued_work_s=0.01 * ((index + beat) % 7),
        running_requests=(index + beat) % 9,
        free_kv_blocks=4096 - 16 * ((index + beat) % 50),
        resident_prefix_hashes=tuple(range(index * 64, index * 64 + 32 + beat % 4)),
    )


async def _register_all(address: str, instances: int) -> float:
    await wait_serving(address)
    started = time.perf_counter()
    async with GossipClient(address, timeout_s=30) as gossip:
        limit = asyncio.Semaphore(64)

        async def one(index: int) -> None:
            async with limit:
                await gossip.register(registration(index))

        await asyncio.gather(*(one(i) for i in range(instances)))
    return time.perf_counter() - started


# -- heartbeat capacity ----------------------------------------------------------------------


def _drive_heartbeats(
    address: str, indices: list[int], duration_s: float, concurrency: int, mode: str, out
) -> None:
    """One driver process: `concurrency` loops heartbeating its instances round-robin."""

    async def main() -> int:
        done = 0
        async with GossipClient(address, timeout_s=30) as gossip:
            stop_at = time.monotonic() + duration_s

            async def worker(offset: int) -> None:
                nonlocal done
                beat = 0
                stream = gossip.heartbeat_stream() if mode != "unary" else None
                while time.monotonic() < stop_at:
                    for index in indices[offset::concurrency]:
                        instance_id = registration(index).instance_id
                        if stream is None:
                            await gossip.heartbeat(instance_id, load(index, beat))
                        elif mode == "stream":
                            await stream.heartbeat(instance_id, load(index, beat))
                        else:
                            await stream.heartbeat(
                                instance_id,
                                load(index, 0),
                                load_unchanged=True,
                                prefix_hashes_unchanged=True,
                            )
                        done += 1
                        if time.monotonic() >= stop_at:
                            return
                    beat += 1

            await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return done

    out.put(asyncio.run(main()))


def heartbeat_capacity(
    address: str, pids: Sequence[int], instances: int, drivers: int, duration_s: float, mode: str
) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    workers = [
        ctx.Process(
            target=_drive_heartbeats,
            args=(address, list(range(d, instances, drivers)), duration_s, 32, mode, out),
        )
        for d in range(drivers)
    ]
    for worker in workers:
        worker.start()
    time.sleep(0.5)  # processes import and connect; the window starts once they beat
    cpu_before = [cpu_s(pid) for pid in pids]
    wall_before = time.perf_counter()
    beats = sum(out.get() for _ in workers)
    wall_s = time.perf_counter() - wall_before
    cpu = [cpu_s(pid) - before for pid, before in zip(pids, cpu_before, strict=True)]
    for worker in workers:
        worker.join()
    return {
        "heartbeats": beats,
        "heartbeats_per_s": beats / duration_s,
        "gossip_cpu_s": cpu[0],
        "redis_cpu_s": cpu[1],
        "heartbeats_per_cpu_s": beats / max(1e-9, sum(cpu)),
        "wall_s": wall_s,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=4096)
    parser.add_argument("--drivers", type=int, default=3, help="heartbeat driver processes")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args(argv)

    results: dict = {"instances": args.instances, "date_utc": time.strftime("%Y-%m-%d %H:%M")}
    with tempfile.TemporaryDirectory(prefix="kvrs-bench-scale-") as tmp:
        procs = Processes(Path(tmp))
        try:
            redis_proc, redis_url = start_redis(procs)
            prefix = f"{{bench-{uuid.uuid4().hex[:8]}}}:"
            gossip_proc, address = start_gossip(procs, redis_url, prefix)
            register_s = asyncio.run(_register_all(address, args.instances))
            results["register_s"] = register_s
            print(f"registered {args.instances} instances in {register_s:.2f} s")
            for mode in HEARTBEAT_MODES:
                figures = heartbeat_capacity(
                    address,
                    [gossip_proc.pid, redis_proc.pid],
                    args.instances,
                    args.drivers,
                    args.duration_s,
                    mode,
                )
                results[f"heartbeat_{mode}"] = figures
                print(
                    f"heartbeats {HEARTBEAT_MODES[mode]:44s}: "
                    f"{figures['heartbeats_per_s']:6.0f}/s, "
                    f"{figures['heartbeats_per_cpu_s']:7.0f} per CPU-s of gossip + Redis "
                    f"(gossip {figures['gossip_cpu_s']:.2f} s, redis {figures['redis_cpu_s']:.2f}"
                    f" s CPU over {args.duration_s:.0f} s)"
                )
        finally:
            procs.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
