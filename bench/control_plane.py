"""Control-plane latency: scheduler RPCs next to a bare echo RPC, on loopback.

`python -m bench.control_plane` starts a real gossip store, slot broker and scheduler as
separate processes (as deployed), registers a cluster of prefill and decode instances,
and times SelectDecode, Recover and RecoverBatch from a client process. An echo service
built with the same bootstrap (tracing and error interceptors, health, reflection) runs
in a process of its own, so `ratio` = what deciding costs on top of a gRPC round trip
(goal ≤ 1.3×). In-process decision times come from bench.core_decisions when present.
Not a test: figures depend on the machine; nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import redis

from bench.report import add_json_argument, write_json
from kvrs.cli.launcher import free_ports, spawn, stop_processes
from kvrs.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, slots_pb2, slots_pb2_grpc
from services.common import GrpcSettings, open_channel, setup_tracing, start_server
from services.common.gossip_records import LinkSample, NodeLoad, Registration
from services.common.healthcheck import SERVING, check_health
from services.gossip.client import GossipClient

ECHO_SERVICE = "kvrs.bench.Echo"
ECHO_METHOD = f"/{ECHO_SERVICE}/Echo"
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/9")
NODES_PER_RACK = 2
RACKS_PER_POD = 2


# -- the echo server (run in its own process) -----------------------------------------------


def _echo_register(server: grpc.aio.Server) -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(ECHO_SERVICE, {"Echo": handler}),)
    )


async def _serve_echo(listen_addr: str) -> None:
    provider = setup_tracing("kvrs-bench-echo")
    handle = await start_server(
        _echo_register, [ECHO_SERVICE], listen_addr, GrpcSettings(), provider
    )
    try:
        await asyncio.Event().wait()
    finally:
        await handle.stop(0)


# -- the cluster ----------------------------------------------------------------------------


def _registrations(prefill: int, decode: int) -> list[Registration]:
    """One instance per node; prefill and decode nodes interleaved across racks and pods."""
    registrations = []
    for role, count in (("prefill", prefill), ("decode", decode)):
        for i in range(count):
            node = 2 * i + (role == "decode")
            rack = node // NODES_PER_RACK
            registrations.append(
                Registration(
                    instance_id=f"{role}-{i}",
                    role=role,
                    address=f"127.0.0.1:{60000 + node}",
                    node=f"n{node}",
                    rack=f"r{rack}",
                    pod=f"p{rack // RACKS_PER_POD}",
                    kv_capacity_blocks=4096,
                    transfer_address=f"127.0.0.1:{61000 + node}",
                    heartbeat_ttl_s=3600.0,
                )
            )
    return registrations


async def _register_cluster(gossip: GossipClient, prefill: int, decode: int) -> None:
    for registration in _registrations(prefill, decode):
        await gossip.register(registration)
        index = int(registration.instance_id.rsplit("-", 1)[1])
        await gossip.heartbeat(
            registration.instance_id,
            NodeLoad(
                queue_depth=index % 3,
                queued_work_s=0.01 * (index % 4),
                running_requests=index % 5,
                free_kv_blocks=4096 - 64 * index,
                resident_prefix_hashes=tuple(range(index % 3)),
            ),
        )
    for p in range(prefill):
        for d in range(decode):
            await gossip.report_link_sample(
                LinkSample(
                    src_instance_id=f"prefill-{p}",
                    dst_instance_id=f"decode-{d}",
                    bandwidth_bps=(10 + (p + d) % 7) * 1e9,
                    rtt_s=50e-6,
                    samples=5,
                )
            )


async def _wait_serving(address: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await check_health(address, GrpcSettings(), timeout_s=0.5) != SERVING:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{address} is not SERVING after {timeout_s} s")
        await asyncio.sleep(0.1)


async def _wait_view(stub: scheduler_pb2_grpc.SchedulerServiceStub, decode: int) -> None:
    deadline = time.monotonic() + 30.0
    while True:
        try:
            reply = await stub.SelectDecode(_select_request("warm"), timeout=5)
            if reply.candidates_considered == decode:
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler never saw the registered cluster")
        await asyncio.sleep(0.1)


# -- requests -------------------------------------------------------------------------------


def _select_request(request_id: str) -> scheduler_pb2.SelectDecodeRequest:
    return scheduler_pb2.SelectDecodeRequest(
        request_id=request_id,
        prefill_instance_id="prefill-0",
        prompt_tokens=2048,
        prefix_hashes=[0, 1, 2, 3],
    )


def _recover_request(request_id: str, skip_slot: bool) -> scheduler_pb2.RecoverRequest:
    return scheduler_pb2.RecoverRequest(
        request_id=request_id,
        failed_instance_id="decode-0",
        source_prefill_instance_id="prefill-1",
        prompt_tokens=2048,
        generated_tokens=100,
        skip_slot=skip_slot,
    )


def _batch_request(size: int, skip_slot: bool) -> scheduler_pb2.RecoverBatchRequest:
    batch_id = uuid.uuid4().hex[:8]
    return scheduler_pb2.RecoverBatchRequest(
        batch_id=batch_id,
        failed_instance_id="decode-0",
        skip_slot=skip_slot,
        items=[
            scheduler_pb2.RecoverItem(
                request_id=f"{batch_id}-{i}",
                source_prefill_instance_id=f"prefill-{i % 8}",
                prompt_tokens=256 + 64 * (i % 50),
                generated_tokens=i % 200,
            )
            for i in range(size)
        ],
    )


# -- timing ---------------------------------------------------------------------------------


Call = Callable[[int], Awaitable[object]]
Cleanup = Callable[[object], Awaitable[None]]


async def _time_interleaved(
    calls: dict[str, tuple[Call, Cleanup | None]], count: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per call of each entry, one of each per round (so load drift hits them
    alike) in an order shuffled every round (seeded): what a call leaves running after its
    reply (a span's export, a lease's release, the slot broker's Redis step) slows
    whatever comes next, and a fixed order would charge it to the same entry every time.
    Each entry's cleanup runs untimed after its call."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    shuffle = random.Random(0).shuffle
    for i in range(-warmup, count):
        shuffle(order)
        for name in order:
            call, after = calls[name]
            started = time.perf_counter()
            result = await call(i)
            elapsed = time.perf_counter() - started
            if i >= 0:
                samples[name].append(elapsed)
            if after is not None:
                await after(result)
    return samples


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _figures(samples: list[float], echo: list[float] | None) -> dict[str, float]:
    p50, p99 = _percentile(samples, 0.5), _percentile(samples, 0.99)
    figures = {"p50_s": p50, "p99_s": p99}
    if echo is not None:
        figures["p50_ratio"] = p50 / _percentile(echo, 0.5)
        figures["p99_ratio"] = p99 / _percentile(echo, 0.99)
    return figures


def _row(name: str, samples: list[float], echo: list[float] | None) -> str:
    p50, p99 = _percentile(samples, 0.5), _percentile(samples, 0.99)
    text = f"{name:<44} {p50 * 1e6:>9.0f} {p99 * 1e6:>9.0f}"
    if echo is not None:
        text += f" {p50 / _percentile(echo, 0.5):>8.2f}x {p99 / _percentile(echo, 0.99):>8.2f}x"
    return text


async def _measure(args: argparse.Namespace, addresses: dict[str, str], figures: dict) -> list[str]:
    """The printed lines; `figures` gets every figure in them."""
    settings = GrpcSettings()
    lines = []
    async with (
        open_channel(addresses["scheduler"], settings) as scheduler_channel,
        open_channel(addresses["echo"], settings) as echo_channel,
        open_channel(addresses["slot-broker"], settings) as broker_channel,
        GossipClient(addresses["gossip"], settings, timeout_s=5) as gossip,
    ):
        await _register_cluster(gossip, args.prefill, args.decode)
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(scheduler_channel)
        broker = slots_pb2_grpc.SlotBrokerServiceStub(broker_channel)
        echo = echo_channel.unary_unary(ECHO_METHOD)
        await _wait_view(scheduler, args.decode)
        run = uuid.uuid4().hex[:8]
        payload = _recover_request("echo", skip_slot=False).SerializeToString()

        async def echo_call(i: int) -> None:
            await echo(payload, timeout=5)

        async def select_call(i: int) -> None:
            await scheduler.SelectDecode(_select_request(f"{run}-s{i}"), timeout=5)

        async def recover_call(i: int) -> None:
            await scheduler.Recover(_recover_request(f"{run}-r{i}", True), timeout=5)

        async def recover_slot_call(i: int) -> scheduler_pb2.RecoverResponse:
            return await scheduler.Recover(_recover_request(f"{run}-m{i}", False), timeout=5)

        async def reserve_call(i: int) -> slots_pb2.ReserveSlotResponse:
            return await broker.ReserveSlot(
                slots_pb2.ReserveSlotRequest(
                    request_id=f"{run}-b{i}",
                    holder_id="bench",
                    src_instance_id="prefill-1",
                    dst_instance_id="decode-1",
                ),
                timeout=5,
            )

        async def release(reply: scheduler_pb2.RecoverResponse) -> None:
            lease_id = (
                reply.slot_lease.lease_id
                if isinstance(reply, scheduler_pb2.RecoverResponse)
                else reply.lease.lease_id
            )
            if lease_id:
                await broker.ReleaseSlot(slots_pb2.ReleaseSlotRequest(lease_id=lease_id), timeout=5)

        probe = await scheduler.Recover(_recover_request(f"{run}-probe", False), timeout=5)
        await release(probe)
        samples = await _time_interleaved(
            {
                "echo RPC (same bootstrap)": (echo_call, None),
                "SelectDecode": (select_call, None),
                "Recover, skip_slot (decision only)": (recover_call, None),
                "ReserveSlot at the broker (bare)": (reserve_call, release),
                "Recover with a slot reserved": (recover_slot_call, release),
            },
            args.calls,
            args.warmup,
        )
        echo_samples = samples["echo RPC (same bootstrap)"]
        lines.append(
            f"cluster: {args.prefill} prefill + {args.decode} decode instances; "
            f"Recover chooses {common_pb2.RecoveryAction.Name(probe.action)} "
            f"({probe.reason[:60]})"
        )
        lines.append(
            f"{'RPC (sequential, loopback)':<44} {'p50 µs':>9} {'p99 µs':>9} "
            f"{'p50/echo':>9} {'p99/echo':>9}"
        )
        lines.extend(
            _row(name, values, None if values is echo_samples else echo_samples)
            for name, values in samples.items()
        )
        figures["recover_action"] = common_pb2.RecoveryAction.Name(probe.action)
        figures["rpcs"] = {
            name: _figures(values, None if values is echo_samples else echo_samples)
            for name, values in samples.items()
        }
        for skip_slot in (True, False):
            batch = []
            for _ in range(args.batch_repeats):
                request = _batch_request(args.batch, skip_slot)
                started = time.perf_counter()
                reply = await scheduler.RecoverBatch(request, timeout=30)
                batch.append(time.perf_counter() - started)
                leases = [d.slot_lease.lease_id for d in reply.decisions if d.slot_lease.lease_id]
                await asyncio.gather(
                    *(
                        broker.ReleaseSlot(slots_pb2.ReleaseSlotRequest(lease_id=lease), timeout=5)
                        for lease in leases
                    )
                )
            label = "skip_slot" if skip_slot else f"{len(leases)} slots reserved"
            figures[f"recover_batch_{args.batch}_{label.replace(' ', '_')}_median_s"] = (
                statistics.median(batch)
            )
            lines.append(
                f"RecoverBatch({args.batch}), {label}: median "
                f"{statistics.median(batch) * 1e3:.1f} ms over {len(batch)} runs"
            )
    return lines


def _core_decisions(figures: dict) -> list[str]:
    """The in-process figures of bench.core_decisions (its quick run), when it exists."""
    if importlib.util.find_spec("bench.core_decisions") is None:
        return ["in-process decisions: bench.core_decisions is not present"]
    core = importlib.import_module("bench.core_decisions")
    results = core.run_all(quick=True)
    figures["core_decisions"] = core.as_figures(results)
    return ["", "in-process decisions (bench.core_decisions --quick):", core.table(results)]


# -- orchestration --------------------------------------------------------------------------


def _start_processes(run_dir: Path, prefix: str, args: argparse.Namespace):
    ports = free_ports(4)
    addresses = {
        name: f"127.0.0.1:{port}"
        for name, port in zip(("gossip", "slot-broker", "scheduler", "echo"), ports, strict=True)
    }
    common = {
        "REDIS_URL": REDIS_URL,
        "KVRS_REDIS_PREFIX": prefix,
        "GOSSIP_ADDR": addresses["gossip"],
        "SLOT_BROKER_ADDR": addresses["slot-broker"],
        "KVRS_MODEL": args.model,
        "KVRS_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
    python = sys.executable
    specs = [
        ("gossip", "services.gossip", {"GOSSIP_LISTEN_ADDR": addresses["gossip"]}),
        (
            "slot-broker",
            "services.slot_broker",
            {
                "SLOT_BROKER_LISTEN_ADDR": addresses["slot-broker"],
                "SLOT_BROKER_CLUSTER_CAP": str(args.slot_cap),
            },
        ),
        (
            "scheduler",
            "services.scheduler",
            {
                "SCHEDULER_LISTEN_ADDR": addresses["scheduler"],
            },
        ),
    ]
    records = [
        spawn(
            name,
            "control",
            [python, "-m", module],
            module,
            addresses[name],
            {**common, **env},
            run_dir,
        )
        for name, module, env in specs
    ]
    records.append(
        spawn(
            "echo",
            "control",
            [python, "-m", "bench.control_plane", "--serve-echo", addresses["echo"]],
            "bench.control_plane",
            addresses["echo"],
            common,
            run_dir,
        )
    )
    return records, addresses


async def _run(args: argparse.Namespace, figures: dict) -> list[str]:
    prefix = f"{{kvrs-bench-{uuid.uuid4().hex[:8]}}}:"
    with tempfile.TemporaryDirectory(prefix="kvrs-bench-") as run_dir:
        records, addresses = _start_processes(Path(run_dir), prefix, args)
        try:
            for address in addresses.values():
                await _wait_serving(address)
            return await _measure(args, addresses, figures)
        finally:
            stop_processes(records, grace_s=5.0)
            client = redis.Redis.from_url(REDIS_URL)
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                client.delete(*keys)
            client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per RPC")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--batch", type=int, default=512, help="RecoverBatch size")
    parser.add_argument("--batch-repeats", type=int, default=5)
    parser.add_argument("--slot-cap", type=int, default=32, help="the broker's cluster cap")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--serve-echo", metavar="ADDR", help=argparse.SUPPRESS)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.serve_echo:
        asyncio.run(_serve_echo(args.serve_echo))
        return 0
    figures: dict = {"calls": args.calls, "slot_cap": args.slot_cap}
    lines = asyncio.run(_run(args, figures))
    lines.extend(_core_decisions(figures))
    print("\n".join(lines))
    write_json(args.json, "control_plane", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
