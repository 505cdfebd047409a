"""The control plane at thousands of instances: heartbeat capacity and view freshness.

`python -m bench.scale --instances 4096 [--json FILE]` starts a private Redis, two gossip
replicas of one registry (instances beat to `gossip-beats`, views read `gossip-views`, so
each one's CPU says what its half of the work costs) and a slot broker, then:

1. **heartbeat capacity**: driver processes heartbeat N registered instances as fast as
   gossip answers, as unary calls with the full load (what instances sent before), over
   `StreamHeartbeats` with the full load, and over streams with only liveness; reported
   as heartbeats/s and heartbeats per CPU-second of gossip + Redis (/proc CPU time).
2. **a cluster heartbeating as deployed**: `HeartbeatLoop`s for all N instances (one
   stream each) from several processes, every `--interval-s`, the load changing at every
   beat; the time until all are registered.
3. **views**: two schedulers reading the whole registry at every refresh (full-read,
   `KVRS_VIEW_RESYNC_S=0`, what views did before the change feed), then two following
   the change feed, side by side in the same run: view age p50/p99 at each (from
   SelectDecode replies at 20/s), SelectDecode latency, the schedulers' CPU (refreshes +
   decisions) and what serving them costs `gossip-views`.

`--gossip-addr ADDR --scheduler-addr ADDR [--scheduler-addr ...]` runs phase 2 against a
running cluster instead (`kvrs up` without `--tls`: its gossip and schedulers are in its
client environment), then probes those schedulers' view age; the instances (a TTL of four
intervals, listening at one port per driver process, which accepts and hangs up) leave at
the end.

Not a test: figures depend on the machine (shared here: the load average is printed);
nothing asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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

import grpc
import redis

from kvrs.errors import KvrsError
from kvrs.rpc import SERVING, check_health
from kvrs.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import GrpcSettings, open_channel
from services.common.gossip_records import NodeLoad, Registration
from services.gossip.client import GossipClient, HeartbeatLoop

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


def start_gossip(
    procs: Processes, redis_url: str, prefix: str, name: str
) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{_free_port()}"
    env = {
        "GOSSIP_LISTEN_ADDR": address,
        "REDIS_URL": redis_url,
        "KVRS_REDIS_PREFIX": prefix,
        "GOSSIP_HEARTBEAT_TTL_S": "3600",
        "OTEL_TRACES_EXPORTER": "none",
    }
    proc = procs.start(name, [sys.executable, "-m", "services.gossip"], env)
    return proc, address


async def wait_serving(address: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await check_health(address, GrpcSettings.from_env(), timeout_s=0.5) != SERVING:
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
    """A decode instance's load at its `beat`-th heartbeat: a few running requests (which
    change every beat) and a few dozen resident prefix blocks (every 4th beat)."""
    return NodeLoad(
        queue_depth=(index + beat) % 4,
        queued_work_s=0.01 * ((index + beat) % 7),
        running_requests=(index + beat) % 9,
        free_kv_blocks=4096 - 16 * ((index + beat) % 50),
        resident_prefix_hashes=tuple(range(index * 64, index * 64 + 32 + (beat // 4) % 4)),
    )


async def _register_all(address: str, instances: int) -> float:
    await wait_serving(address)
    started = time.perf_counter()
    async with GossipClient(address, GrpcSettings.from_env(), timeout_s=30) as gossip:
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
        async with GossipClient(address, GrpcSettings.from_env(), timeout_s=30) as gossip:
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


# -- a cluster heartbeating as deployed -------------------------------------------------------


def _run_instances(
    address: str,
    indices: list[int],
    interval_s: float,
    out,
    stop,
    ready_at: float,
    deregister: bool,
) -> None:
    """One driver process: a `HeartbeatLoop` per instance (each with its own stream), the
    starts spread over one interval; reports when all are registered, then beats."""

    async def hang_up(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def main() -> None:
        # The instances listen, as live ones do: gossip's direct probe of one whose beat
        # is late finds it there and leaves it suspect until its next beat refutes it
        # (at an address nobody listens at, the probe would declare it failed at once).
        listener = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        listening_at = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
        async with listener, GossipClient(address, GrpcSettings.from_env(), timeout_s=30) as gossip:
            beats = [0] * len(indices)

            def source(slot: int):
                def current() -> NodeLoad:
                    beats[slot] += 1
                    return load(indices[slot], beats[slot])

                return current

            loops = [
                HeartbeatLoop(
                    gossip,
                    # A TTL of four intervals, as workers beat (every TTL / 4).
                    dataclasses.replace(
                        registration(index),
                        address=listening_at,
                        heartbeat_ttl_s=4 * interval_s,
                    ),
                    load=source(slot),
                    interval_s=interval_s,
                )
                for slot, index in enumerate(indices)
            ]
            limit = asyncio.Semaphore(16)

            async def start(loop: HeartbeatLoop, delay_s: float) -> None:
                await asyncio.sleep(delay_s)
                async with limit:
                    for attempt in range(3):  # a registry short of CPU answers late
                        try:
                            await loop.start()
                            return
                        except KvrsError:
                            if attempt == 2:
                                raise

            await asyncio.gather(
                *(start(loop, interval_s * i / len(loops) / 4) for i, loop in enumerate(loops))
            )
            out.put(("registered", time.time() - ready_at))
            while not stop.is_set():
                await asyncio.sleep(0.1)

            # Side by side, as they started: one by one, a thousand deregistrations
            # through a loaded registry take minutes.
            async def leave(loop: HeartbeatLoop) -> None:
                async with limit:
                    await loop.stop(deregister=deregister)

            await asyncio.gather(*(leave(loop) for loop in loops))
            out.put(("beats", sum(beats)))

    try:
        asyncio.run(main())
    except KvrsError as exc:
        out.put(("failed", str(exc)))


class Cluster:
    """N instances registered and heartbeating from `drivers` processes."""

    def __init__(
        self,
        address: str,
        instances: int,
        drivers: int,
        interval_s: float,
        deregister: bool = False,
    ) -> None:
        """`deregister`: the instances leave when stopped (in someone else's cluster)."""
        ctx = multiprocessing.get_context("spawn")
        self.out = ctx.Queue()
        self.stop_event = ctx.Event()
        ready_at = time.time()
        self.workers = [
            ctx.Process(
                target=_run_instances,
                args=(
                    address,
                    list(range(d, instances, drivers)),
                    interval_s,
                    self.out,
                    self.stop_event,
                    ready_at,
                    deregister,
                ),
            )
            for d in range(drivers)
        ]
        for worker in self.workers:
            worker.start()
        reports = [self.out.get(timeout=300) for _ in self.workers]
        failed = [detail for kind, detail in reports if kind == "failed"]
        if failed:
            self.stop_event.set()
            raise RuntimeError(f"instances could not register: {failed[0]}")
        self.register_s = max(seconds for _, seconds in reports)

    def stop(self) -> int:
        self.stop_event.set()
        beats = sum(self.out.get(timeout=300)[1] for _ in self.workers)
        for worker in self.workers:
            worker.join()
        return beats


def start_broker(procs: Processes, redis_url: str, prefix: str) -> str:
    address = f"127.0.0.1:{_free_port()}"
    env = {
        "SLOT_BROKER_LISTEN_ADDR": address,
        "REDIS_URL": redis_url,
        "KVRS_REDIS_PREFIX": prefix,
        "OTEL_TRACES_EXPORTER": "none",
    }
    procs.start("slot-broker", [sys.executable, "-m", "services.slot_broker"], env)
    return address


def start_scheduler(
    procs: Processes, name: str, gossip: str, broker: str, resync_s: float, refresh_s: float
) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{_free_port()}"
    env = {
        "SCHEDULER_LISTEN_ADDR": address,
        "GOSSIP_ADDR": gossip,
        "SLOT_BROKER_ADDR": broker,
        "SCHEDULER_HOLDER_ID": name,
        "SCHEDULER_VIEW_REFRESH_S": str(refresh_s),
        "KVRS_VIEW_RESYNC_S": str(resync_s),
        "OTEL_TRACES_EXPORTER": "none",
    }
    proc = procs.start(name, [sys.executable, "-m", "services.scheduler"], env)
    return proc, address


def _select_request() -> scheduler_pb2.SelectDecodeRequest:
    return scheduler_pb2.SelectDecodeRequest(
        request_id=uuid.uuid4().hex,
        prefill_instance_id=registration(0).instance_id,
        prompt_tokens=2048,
        prefix_hashes=[1, 2, 3],
    )


async def _wait_view(address: str, decode: int, timeout_s: float = 120.0) -> None:
    await wait_serving(address, timeout_s)
    channel = open_channel(address, GrpcSettings.from_env())
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                reply = await stub.SelectDecode(_select_request(), timeout=10)
                if reply.candidates_considered >= decode:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"scheduler {address} has no view of {decode} decode instances")
            await asyncio.sleep(0.2)
    finally:
        await channel.close()


async def _probe(address: str, duration_s: float, rate_hz: float) -> dict[str, list[float]]:
    """SelectDecode at `rate_hz` for `duration_s`: view ages and client latencies."""
    channel = open_channel(address, GrpcSettings.from_env())
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    ages, latencies = [], []
    try:
        stop_at = time.monotonic() + duration_s
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            reply = await stub.SelectDecode(_select_request(), timeout=10)
            latencies.append(time.perf_counter() - started)
            ages.append(reply.view_age_s)
            await asyncio.sleep(max(0.0, 1 / rate_hz - (time.perf_counter() - started)))
    finally:
        await channel.close()
    return {"view_age_s": ages, "latency_s": latencies}


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _cpu_window(pids: dict[str, int], seconds: float, work=None) -> tuple[dict[str, float], object]:
    """CPU share of a core each process used over `seconds` (running `work` meanwhile)."""
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    result = asyncio.run(work) if work is not None else time.sleep(seconds)
    wall_s = time.perf_counter() - started
    return {name: (cpu_s(pid) - before[name]) / wall_s for name, pid in pids.items()}, result


def views(
    procs: Processes,
    pids: dict[str, int],
    gossip: str,
    broker: str,
    decode: int,
    resync_s: float,
    refresh_s: float,
    window_s: float,
) -> dict:
    """Two schedulers with one view mode; their view ages and what serving them costs."""
    names = [f"scheduler-{'full' if resync_s == 0 else 'follow'}-{i}" for i in range(2)]
    started = [start_scheduler(procs, name, gossip, broker, resync_s, refresh_s) for name in names]

    async def ready() -> None:
        await asyncio.gather(*(_wait_view(address, decode) for _, address in started))

    asyncio.run(ready())
    time.sleep(1.0)  # past the first full listing

    async def probe_all() -> list[dict[str, list[float]]]:
        return await asyncio.gather(*(_probe(address, window_s, 20.0) for _, address in started))

    watched = {**pids, **{name: proc.pid for name, (proc, _) in zip(names, started, strict=True)}}
    cpu, probes = _cpu_window(watched, window_s, probe_all())
    for proc, _ in started:
        proc.terminate()
        proc.wait(10)
    figures: dict = {"cpu_core_share": cpu, "schedulers": {}}
    for name, probe in zip(names, probes, strict=True):
        figures["schedulers"][name] = {
            "view_age_p50_s": _quantile(probe["view_age_s"], 0.5),
            "view_age_p99_s": _quantile(probe["view_age_s"], 0.99),
            "select_decode_p50_ms": 1e3 * _quantile(probe["latency_s"], 0.5),
            "select_decode_p99_ms": 1e3 * _quantile(probe["latency_s"], 0.99),
            "decisions": len(probe["latency_s"]),
        }
    return figures


def against_cluster(args: argparse.Namespace, decode: int) -> dict:
    """Registers the instances in a running cluster (`kvrs up`) and probes its schedulers.

    The instances are placement candidates there (at addresses that accept a connection
    and hang up) until they leave at the end: use a cluster that serves nothing else
    meanwhile.
    """
    cluster = Cluster(args.gossip_addr, args.instances, args.drivers, args.interval_s, True)
    print(
        f"registered {args.instances} instances in {args.gossip_addr}, each then beating "
        f"every {args.interval_s} s, in {cluster.register_s:.1f} s (goal <= 10 s)"
    )
    results: dict = {"register_s": cluster.register_s, "schedulers": {}}
    try:

        async def probe_all() -> list[dict[str, list[float]]]:
            addresses = args.scheduler_addr
            await asyncio.gather(*(_wait_view(address, decode) for address in addresses))
            return await asyncio.gather(
                *(_probe(address, args.window_s, 20.0) for address in addresses)
            )

        for address, probe in zip(args.scheduler_addr, asyncio.run(probe_all()), strict=True):
            figures = {
                "view_age_p50_s": _quantile(probe["view_age_s"], 0.5),
                "view_age_p99_s": _quantile(probe["view_age_s"], 0.99),
                "select_decode_p50_ms": 1e3 * _quantile(probe["latency_s"], 0.5),
                "select_decode_p99_ms": 1e3 * _quantile(probe["latency_s"], 0.99),
            }
            results["schedulers"][address] = figures
            print(
                f"  scheduler {address}: view age p50 {figures['view_age_p50_s'] * 1e3:.0f} ms,"
                f" p99 {figures['view_age_p99_s'] * 1e3:.0f} ms; SelectDecode p50 "
                f"{figures['select_decode_p50_ms']:.1f} ms, p99 "
                f"{figures['select_decode_p99_ms']:.1f} ms"
            )
    finally:
        results["steady_beats"] = cluster.stop()
    return results


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=4096)
    parser.add_argument("--drivers", type=int, default=3, help="heartbeat driver processes")
    parser.add_argument("--interval-s", type=float, default=2.0, help="heartbeat period")
    parser.add_argument("--refresh-s", type=float, default=0.1, help="scheduler view refresh")
    parser.add_argument("--window-s", type=float, default=8.0, help="each measured window")
    parser.add_argument("--duration-s", type=float, default=4.0, help="each capacity window")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument(
        "--gossip-addr",
        help="a running cluster's gossip (e.g. kvrs up's): register the instances there "
        "and probe --scheduler-addr instead of starting processes",
    )
    parser.add_argument("--scheduler-addr", action="append", default=[])
    args = parser.parse_args(argv)
    if args.gossip_addr and not args.scheduler_addr:
        parser.error("--gossip-addr needs at least one --scheduler-addr")

    decode = sum(1 for i in range(args.instances) if registration(i).role == "decode")
    load_avg = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"bench.scale: {args.instances} instances ({decode} decode), heartbeats every "
        f"{args.interval_s} s, scheduler refresh {args.refresh_s} s; {os.cpu_count()} CPUs, "
        f"load average {load_avg}"
    )
    results: dict = {
        "instances": args.instances,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    if args.gossip_addr:
        results["cluster"] = against_cluster(args, decode)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return results
    with tempfile.TemporaryDirectory(prefix="kvrs-bench-scale-") as tmp:
        procs = Processes(Path(tmp))
        try:
            redis_proc, redis_url = start_redis(procs)
            prefix = f"{{bench-{uuid.uuid4().hex[:8]}}}:"
            # Two replicas of one registry: instances beat to one, views read the other,
            # so each one's CPU says what its half of the work costs.
            beats_proc, beats_addr = start_gossip(procs, redis_url, prefix, "gossip-beats")
            views_proc, views_addr = start_gossip(procs, redis_url, prefix, "gossip-views")
            broker = start_broker(procs, redis_url, prefix)
            for address in (beats_addr, views_addr, broker):
                asyncio.run(wait_serving(address))

            asyncio.run(_register_all(beats_addr, args.instances))
            for mode in HEARTBEAT_MODES:
                figures = heartbeat_capacity(
                    beats_addr,
                    [beats_proc.pid, redis_proc.pid],
                    args.instances,
                    args.drivers,
                    args.duration_s,
                    mode,
                )
                results[f"heartbeat_{mode}"] = figures
                print(
                    f"capacity, {HEARTBEAT_MODES[mode]:44s}: "
                    f"{figures['heartbeats_per_s']:6.0f}/s, "
                    f"{figures['heartbeats_per_cpu_s']:6.0f} per CPU-s of gossip + Redis"
                )
            before = results["heartbeat_unary"]["heartbeats_per_cpu_s"]
            after = results["heartbeat_stream"]["heartbeats_per_cpu_s"]
            ratio = after / before
            results["heartbeat_ratio"] = ratio
            print(f"heartbeats per CPU-s, streamed vs unary: ratio {ratio:.2f}x (goal >= 2x)")

            pids = {"gossip-beats": beats_proc.pid, "gossip-views": views_proc.pid}
            pids["redis"] = redis_proc.pid
            cluster = Cluster(beats_addr, args.instances, args.drivers, args.interval_s)
            results["register_s"] = cluster.register_s
            print(
                f"(re-)registered {args.instances} instances, each then beating every "
                f"{args.interval_s} s, in {cluster.register_s:.1f} s (goal <= 10 s)"
            )
            baseline, _ = _cpu_window(pids, args.window_s)
            results["heartbeats_only_cpu"] = baseline
            print(
                f"heartbeats alone: gossip-beats {100 * baseline['gossip-beats']:.0f} % of a "
                f"core, gossip-views {100 * baseline['gossip-views']:.0f} % (its failure sweep),"
                f" redis {100 * baseline['redis']:.0f} %"
            )
            for label, resync_s in (("full-read views (before)", 0.0), ("change feed", 30.0)):
                figures = views(
                    procs,
                    pids,
                    views_addr,
                    broker,
                    decode,
                    resync_s,
                    args.refresh_s,
                    args.window_s,
                )
                results["full_read" if resync_s == 0 else "follow"] = figures
                cpu = figures["cpu_core_share"]
                print(f"two schedulers, {label}:")
                print(
                    f"  gossip-views {100 * cpu['gossip-views']:.0f} % of a core serving views "
                    f"(goal <= 10 %), gossip-beats {100 * cpu['gossip-beats']:.0f} %, "
                    f"redis {100 * cpu['redis']:.0f} %"
                )
                for name, sched in figures["schedulers"].items():
                    print(
                        f"  {name}: view age p50 {sched['view_age_p50_s'] * 1e3:.0f} ms, "
                        f"p99 {sched['view_age_p99_s'] * 1e3:.0f} ms "
                        f"(goal <= {2 * args.refresh_s * 1e3:.0f} ms); SelectDecode p50 "
                        f"{sched['select_decode_p50_ms']:.1f} ms, p99 "
                        f"{sched['select_decode_p99_ms']:.1f} ms; process "
                        f"{100 * cpu[name]:.0f} % of a core (refreshes + decisions)"
                    )
            results["steady_beats"] = cluster.stop()
        finally:
            procs.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
