"""Slot broker under contention from several OS processes, and a holder killed by SIGKILL."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.errors import ResourceExhausted
from kvrs.v1 import slots_pb2, slots_pb2_grpc
from services.common import GrpcSettings, connect_redis, open_channel, setup_tracing
from services.common.slot_leases import SlotStore
from services.slot_broker.config import Config
from services.slot_broker.server import build_server

CAP = 32
PROCESSES = 8
RESERVATIONS_PER_PROCESS = 500
TASKS_PER_PROCESS = 8  # 64 concurrent claimants for 32 slots: the cap is really contended

# Spawned children start clean: no gRPC or event-loop state inherited from pytest.
SPAWN = multiprocessing.get_context("spawn")


async def _start(redis_url: str, redis_prefix: str, cap: int):
    config = Config(
        listen_addr="127.0.0.1:0",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        cluster_cap=cap,
        lease_ttl_s=30.0,
        purge_interval_s=0.1,
    )
    return await build_server(config, setup_tracing("test", exporter=InMemorySpanExporter()))


async def _contend(address, index, held, held_lock, peak, totals, cap, direct=None) -> None:
    """`direct`: (redis_url, prefix) to reserve in Redis as a scheduler does, not via RPC."""
    channel = open_channel(address, GrpcSettings())
    stub = slots_pb2_grpc.SlotBrokerServiceStub(channel)
    client = store = None
    if direct is not None:
        client = connect_redis(direct[0])
        store = SlotStore(client, direct[1])
    attempts = iter(range(RESERVATIONS_PER_PROCESS))
    rng = random.Random(index)
    granted = denied = reported = 0

    async def claimant() -> None:
        nonlocal granted, denied, reported
        for attempt in attempts:
            request = slots_pb2.ReserveSlotRequest(
                request_id=f"proc{index}-{attempt}",
                holder_id=f"proc{index}",
                src_instance_id=f"p{attempt % 4}",
                dst_instance_id=f"d{attempt % 5}",
            )
            asked_s = time.monotonic()
            try:
                if store is None:
                    reply = await stub.ReserveSlot(request, timeout=30)
                    lease_id, in_use = reply.lease.lease_id, reply.slots_in_use
                else:
                    grant = await store.reserve(
                        request.request_id,
                        request.holder_id,
                        request.src_instance_id,
                        request.dst_instance_id,
                    )
                    lease_id, in_use = grant.lease.lease_id, grant.slots_in_use
            except (grpc.aio.AioRpcError, ResourceExhausted) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and (
                    exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
                ):
                    raise
                denied += 1
                await asyncio.sleep(rng.uniform(0, 0.005))
                continue
            # Counted only between a confirmed grant and the release request: every
            # counted lease is held at the broker at that instant.
            with held_lock:
                held.value += 1
                peak.value = max(peak.value, held.value)
            granted += 1
            reported = max(reported, in_use)
            # Held for at least three times what the grant took: with 64 claimants each
            # holding longer than its two calls, more than 32 are holding or asking at any
            # time, however slowly the broker answers, so the cap is really reached.
            await asyncio.sleep(max(rng.uniform(0.02, 0.04), 3 * (time.monotonic() - asked_s)))
            with held_lock:
                held.value -= 1
            await stub.ReleaseSlot(slots_pb2.ReleaseSlotRequest(lease_id=lease_id), timeout=30)

    try:
        await asyncio.gather(*(claimant() for _ in range(TASKS_PER_PROCESS)))
        totals[index] = (granted, denied, reported)
    finally:
        await channel.close()
        if client is not None:
            await client.aclose()


def contend(address, index, held, held_lock, peak, totals, cap, direct=None) -> None:
    """Child process: RESERVATIONS_PER_PROCESS reservations from TASKS_PER_PROCESS tasks."""
    asyncio.run(_contend(address, index, held, held_lock, peak, totals, cap, direct))


async def test_cap_holds_under_contention_from_many_processes(redis_url, redis_prefix):
    await _contend_and_check(redis_url, redis_prefix, direct_processes=0)


@pytest.mark.slow
async def test_cap_holds_with_half_the_processes_reserving_in_redis_directly(
    redis_url, redis_prefix
):
    """Half the claimants reserve as a scheduler does (the broker's script, straight in
    Redis, under the caps the broker published), half through the broker: one cap."""
    await _contend_and_check(redis_url, redis_prefix, direct_processes=PROCESSES // 2)


async def _contend_and_check(redis_url, redis_prefix, direct_processes: int) -> None:
    handle = await _start(redis_url, redis_prefix, CAP)
    address = f"127.0.0.1:{handle.port}"
    manager = SPAWN.Manager()
    held, held_lock, peak = SPAWN.Value("i", 0), SPAWN.Lock(), SPAWN.Value("i", 0)
    totals = manager.dict()
    channel = open_channel(address, GrpcSettings())
    stub = slots_pb2_grpc.SlotBrokerServiceStub(channel)
    broker_peak = 0
    processes = [
        SPAWN.Process(
            target=contend,
            args=(
                address,
                i,
                held,
                held_lock,
                peak,
                totals,
                CAP,
                (redis_url, redis_prefix) if i < direct_processes else None,
            ),
        )
        for i in range(PROCESSES)
    ]
    try:
        started_s = time.monotonic()
        for process in processes:
            process.start()
        while any(process.is_alive() for process in processes):
            stats = await stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=5)
            broker_peak = max(broker_peak, stats.slots_in_use)
            await asyncio.sleep(0.005)
        elapsed_s = time.monotonic() - started_s
        assert [process.exitcode for process in processes] == [0] * PROCESSES
        stats = await stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=5)
        totals = dict(totals)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        await channel.close()
        await handle.stop(0)
        manager.shutdown()

    assert sorted(totals) == list(range(PROCESSES))
    granted = sum(g for g, _, _ in totals.values())
    denied = sum(d for _, d, _ in totals.values())
    reported = max(r for _, _, r in totals.values())
    print(
        f"{PROCESSES}x{RESERVATIONS_PER_PROCESS} reservations in {elapsed_s:.1f} s: "
        f"{granted} granted, {denied} denied; peak held {peak.value} (clients), "
        f"{broker_peak} (broker stats), {reported} (grant replies); cap {CAP}"
    )
    assert granted + denied == PROCESSES * RESERVATIONS_PER_PROCESS
    assert peak.value <= CAP and broker_peak <= CAP and reported <= CAP
    assert denied > 0, "the cap was never reached: the test did not contend"
    assert (stats.granted_total, stats.denied_total) == (granted, denied)
    assert stats.slots_in_use == 0 and held.value == 0 and stats.expired_total == 0


def hold(address: str, ttl_s: float, leases) -> None:
    """Child process: takes the only slot, reports its lease, renews until killed."""

    async def run() -> None:
        channel = open_channel(address, GrpcSettings())
        stub = slots_pb2_grpc.SlotBrokerServiceStub(channel)
        reply = await stub.ReserveSlot(
            slots_pb2.ReserveSlotRequest(
                request_id="doomed",
                holder_id=f"pid-{os.getpid()}",
                src_instance_id="p0",
                dst_instance_id="d0",
                ttl_s=ttl_s,
            ),
            timeout=5,
        )
        leases.put(reply.lease.lease_id)
        while True:
            await asyncio.sleep(ttl_s / 3)
            await stub.RenewSlot(
                slots_pb2.RenewSlotRequest(lease_id=reply.lease.lease_id, ttl_s=ttl_s),
                timeout=5,
            )

    asyncio.run(run())


async def test_a_killed_holder_gets_its_slot_back_within_the_ttl(redis_url, redis_prefix):
    ttl_s = 0.6
    handle = await _start(redis_url, redis_prefix, cap=1)
    address = f"127.0.0.1:{handle.port}"
    leases = SPAWN.Queue()
    holder = SPAWN.Process(target=hold, args=(address, ttl_s, leases))
    channel = open_channel(address, GrpcSettings())
    stub = slots_pb2_grpc.SlotBrokerServiceStub(channel)
    contender = slots_pb2.ReserveSlotRequest(
        request_id="waiting", holder_id="survivor", src_instance_id="p1", dst_instance_id="d1"
    )
    try:
        holder.start()
        lease_id = await asyncio.to_thread(leases.get, True, 30)
        await asyncio.sleep(2 * ttl_s)
        try:
            await stub.ReserveSlot(contender, timeout=5)
            raise AssertionError("a renewed lease must keep its slot past its TTL")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        os.kill(holder.pid, signal.SIGKILL)
        killed_s = time.monotonic()
        await asyncio.to_thread(holder.join, 10)
        while True:
            try:
                await stub.ReserveSlot(contender, timeout=5)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() - killed_s < ttl_s + 1.5, "slot never came back"
                await asyncio.sleep(0.02)
        returned_s = time.monotonic() - killed_s
        print(f"slot returned {returned_s * 1000:.0f} ms after SIGKILL (lease TTL {ttl_s} s)")
        assert returned_s <= ttl_s + 0.5
        stats = await stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=5)
        assert (stats.slots_in_use, stats.expired_total) == (1, 1)
        renew = slots_pb2.RenewSlotRequest(lease_id=lease_id)
        try:
            await stub.RenewSlot(renew, timeout=5)
            raise AssertionError("the dead holder's lease must be gone")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
    finally:
        if holder.is_alive():
            holder.kill()
        await channel.close()
        await handle.stop(0)
