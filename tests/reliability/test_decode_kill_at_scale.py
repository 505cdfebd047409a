"""kill -9 of a decode worker with 64 requests in flight: all complete, token-exact.

A local cluster of real processes (`kvrs up`'s launcher): gossip, slot broker, one
scheduler, the router and four tiny float64 workers, whose greedy decoding is bit-exact,
so every stream is compared with the same model run undisturbed in this process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest
from reliability_cluster import launched

from kvrs.cli.launcher import (
    is_running,
)
from kvrs.rpc.generate import generate_into
from kvrs.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    slots_pb2,
    slots_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.tiny_reference import reference

IN_FLIGHT = 64
SENT = 80
PROMPT_TOKENS = 48
PROMPTS = 16
"""Distinct prompts among the requests: each one's reference is computed once. A 48-token
prompt fills no prefix block, so requests sharing a prompt share no KV."""
MAX_NEW_TOKENS = 256
"""Long enough that 64 streams overlap."""
CLUSTER_SERVICES = (
    "gossip",
    "slot-broker",
    "scheduler-1",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
    "router",
)
EXTRA_ENV = {
    "prefill-0": {"WORKER_HEARTBEAT_TTL_S": "2.0"},
    "prefill-1": {"WORKER_HEARTBEAT_TTL_S": "2.0"},
    "decode-0": {"WORKER_HEARTBEAT_TTL_S": "2.0"},
    "decode-1": {"WORKER_HEARTBEAT_TTL_S": "2.0"},
    "router": {"ROUTER_BATCH_WINDOW_S": "0.2"},
}

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url, module_redis_prefix):
    run_dir = tmp_path_factory.mktemp("scale") / "cluster"
    with launched(run_dir, redis_url, module_redis_prefix, CLUSTER_SERVICES, EXTRA_ENV) as state:
        yield state


def prompt(seed: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 251 for i in range(PROMPT_TOKENS)]


async def generate(stub, request, tokens: list[int], summary: list) -> grpc.aio.AioRpcError | None:
    ended, error = await generate_into(stub, request, tokens, 180)
    if ended is not None:
        summary.append(ended)
    return error


async def leaked(state, workers) -> dict[str, int]:
    found = {}
    for name in workers:
        async with grpc.aio.insecure_channel(state.address(name)) as channel:
            stats = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(
                worker_pb2.GetWorkerStatsRequest(), timeout=5
            )
        found[name] = stats.resident_requests
    async with grpc.aio.insecure_channel(state.address("slot-broker")) as channel:
        stats = await slots_pb2_grpc.SlotBrokerServiceStub(channel).GetSlotStats(
            slots_pb2.GetSlotStatsRequest(), timeout=5
        )
    found["slots"] = stats.slots_in_use
    return found


async def test_kill_9_of_a_decode_worker_with_64_requests_in_flight(cluster):
    """The kill comes once at least 64 streams are decoding on decode-0, between their
    first decoded token and their last (more requests than that are sent, so a slow
    machine still gets 64 at once)."""
    victim = next(r for r in cluster.processes if r.name == "decode-0")
    requests = [
        router_pb2.GenerateRequest(
            request_id=f"scale-{i}-{uuid.uuid4().hex[:6]}",
            prompt_token_ids=prompt(i % PROMPTS),
            max_new_tokens=MAX_NEW_TOKENS,
            decode_instance_id="decode-0",
        )
        for i in range(SENT)
    ]
    tokens: list[list[int]] = [[] for _ in requests]
    summaries: list[list] = [[] for _ in requests]

    def streaming() -> list[int]:
        # Token 0 comes from the prefill worker; from token 1 on, decode-0 is decoding.
        return [i for i, t in enumerate(tokens) if 2 <= len(t) < MAX_NEW_TOKENS]

    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        started_s = time.monotonic()
        tasks = [
            asyncio.create_task(generate(stub, r, t, s))
            for r, t, s in zip(requests, tokens, summaries, strict=True)
        ]
        while len(streaming()) < IN_FLIGHT:
            failed = [task.result() for task in tasks if task.done() and task.result()]
            assert not failed, f"streams failed before the kill: {failed[:3]}"
            assert time.monotonic() - started_s < 90, "the requests did not start streaming"
            await asyncio.sleep(0.005)
        os.killpg(victim.pid, signal.SIGSTOP)  # frozen: it answers nothing more
        in_flight = streaming()
        os.killpg(victim.pid, signal.SIGKILL)
        killed_s = time.monotonic()
        errors = await asyncio.gather(*tasks)
        done_s = time.monotonic()
    while is_running(victim):
        await asyncio.sleep(0.01)

    assert [e for e in errors if e is not None] == []
    hit = [summaries[i][0] for i in in_flight]
    actions: dict[str, int] = {}
    for summary in hit:
        action = common_pb2.RecoveryAction.Name(summary.recoveries[-1].action)
        actions[action] = actions.get(action, 0) + 1
    print(
        f"\n{len(in_flight)} of {SENT} requests streaming at the kill, "
        f"{killed_s - started_s:.1f} s after the first call; "
        f"{sum(e is None for e in errors)} of {SENT} completed; final recovery actions of "
        f"those in flight {actions}; last stream ended {done_s - killed_s:.1f} s after "
        "the kill"
    )
    assert len(in_flight) >= IN_FLIGHT
    for request, streamed, summary in zip(requests, tokens, summaries, strict=True):
        assert streamed == reference(tuple(request.prompt_token_ids), MAX_NEW_TOKENS), (
            request.request_id
        )
        assert summary[0].generated_tokens == MAX_NEW_TOKENS
    for summary in hit:
        assert summary.recoveries and summary.recoveries[-1].succeeded
        assert summary.final_decode_instance_id != "decode-0"
    assert await leaked(cluster, ("prefill-0", "prefill-1", "decode-1")) == {
        "prefill-0": 0,
        "prefill-1": 0,
        "decode-1": 0,
        "slots": 0,
    }
