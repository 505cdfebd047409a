"""A scheduler replica SIGKILLed under load: KvrsClient fails over, no decision is lost.

Two `python -m services.scheduler` processes share one gossip store and slot broker;
eight client tasks keep calling through one KvrsClient that knows both addresses, and
the replica the client prefers is killed mid-run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest
from reliability_stack import MODEL, ControlPlane, ServiceProcess, free_port, unique_prefix

from kvrs import errors
from kvrs.client import KvrsClient
from kvrs.v1 import scheduler_pb2, scheduler_pb2_grpc

CLIENT_TASKS = 8
RUN_AFTER_KILL_S = 1.5
ATTEMPT_TIMEOUT_S = 1.0


@pytest.fixture
def replicas(redis_url, tmp_path):
    """Gossip and slot broker in-process; two scheduler replicas as real processes."""
    plane = ControlPlane(redis_url, unique_prefix("failover")).start(
        services=("gossip", "slot-broker")
    )
    processes = []
    try:
        for name in ("scheduler-a", "scheduler-b"):
            address = f"127.0.0.1:{free_port()}"
            process = ServiceProcess(
                name,
                "services.scheduler",
                {
                    "SCHEDULER_LISTEN_ADDR": address,
                    "GOSSIP_ADDR": plane.addresses["gossip"],
                    "SLOT_BROKER_ADDR": plane.addresses["slot-broker"],
                    "SCHEDULER_HOLDER_ID": name,
                    "KVRS_MODEL": MODEL,
                    "KVRS_LOG_LEVEL": "WARNING",
                },
                tmp_path,
            ).start()
            processes.append((address, process))
        for address, process in processes:
            process.wait_serving(address)
        yield plane, processes
    finally:
        for _, process in processes:
            process.kill()
        plane.stop()


async def client_task(client: KvrsClient, index: int, stop: asyncio.Event, outcomes: list):
    turn = 0
    while not stop.is_set():
        rid = f"c{index}-{turn}-{uuid.uuid4().hex[:6]}"
        turn += 1
        started_s = time.monotonic()
        try:
            if turn % 2:
                reply = await client.select_decode("prefill-0", 4096, request_id=rid)
                answered = reply.decode_instance_id
            else:
                reply = await client.recover(
                    rid,
                    failed_instance_id="decode-0",
                    source_prefill_instance_id="prefill-1",
                    prompt_tokens=4096,
                    generated_tokens=turn,
                    skip_slot=True,
                )
                answered = reply.target_instance_id
            outcomes.append((rid, answered, time.monotonic() - started_s, None))
        except errors.KvrsError as exc:
            outcomes.append((rid, "", time.monotonic() - started_s, repr(exc)))


async def run_load(addresses: list[str], kill) -> tuple[list, str, float]:
    outcomes: list = []
    stop = asyncio.Event()
    async with KvrsClient(addresses, timeout_s=ATTEMPT_TIMEOUT_S, max_attempts=4) as client:
        tasks = [
            asyncio.create_task(client_task(client, i, stop, outcomes)) for i in range(CLIENT_TASKS)
        ]
        await asyncio.sleep(1.0)
        victim = client.preferred_scheduler
        kill(victim)
        killed_at = len(outcomes)
        await asyncio.sleep(RUN_AFTER_KILL_S)
        stop.set()
        await asyncio.gather(*tasks)
    return outcomes, victim, killed_at


@pytest.mark.timeout(120)
def test_killing_a_scheduler_replica_loses_no_decision(replicas):
    _, processes = replicas
    by_address = dict(processes)

    def kill(address: str) -> None:
        by_address[address].kill()

    outcomes, victim, killed_at = asyncio.run(run_load([a for a, _ in processes], kill))
    failed = [o for o in outcomes if o[3] is not None]
    after = outcomes[killed_at:]
    slowest_s = max(o[2] for o in after)
    print(
        f"\n{len(outcomes)} decisions ({len(after)} after SIGKILL of {victim}); "
        f"{len(failed)} failed; slowest call after the kill {slowest_s * 1000:.0f} ms "
        f"(attempt deadline {ATTEMPT_TIMEOUT_S * 1000:.0f} ms)"
    )
    assert not failed, failed[:5]
    assert len(after) >= 20, "the load did not continue after the kill"
    assert all(o[1].startswith("decode-") for o in outcomes)
    assert len({o[0] for o in outcomes}) == len(outcomes)
    assert slowest_s < 2 * ATTEMPT_TIMEOUT_S + 1.0


@pytest.mark.timeout(60)
def test_a_recover_retried_on_the_other_replica_gets_the_same_decision(replicas):
    """The reply of replica A was lost (A died after deciding and taking the slot): the
    client's retry on replica B must get a decision, not an error."""
    _, processes = replicas
    request = scheduler_pb2.RecoverRequest(
        request_id=f"lost-reply-{uuid.uuid4().hex[:6]}",
        failed_instance_id="decode-0",
        source_prefill_instance_id="prefill-0",
        prompt_tokens=4096,
        generated_tokens=4,
        policy="always_migrate",
    )
    (address_a, process_a), (address_b, _) = processes
    with grpc.insecure_channel(address_a) as channel:
        first = scheduler_pb2_grpc.SchedulerServiceStub(channel).Recover(request, timeout=5)
    assert first.slot_lease.lease_id
    os.killpg(process_a.process.pid, signal.SIGKILL)
    with grpc.insecure_channel(address_b) as channel:
        retried = scheduler_pb2_grpc.SchedulerServiceStub(channel).Recover(request, timeout=5)
    assert retried.target_instance_id == first.target_instance_id
    assert retried.slot_lease == first.slot_lease
