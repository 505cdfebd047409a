"""New placements avoid a killed decode worker before gossip even suspects it.

A local cluster of real processes (`kvrs up`'s launcher): gossip, slot broker, one
scheduler, the router, one prefill and two decode tiny float64 workers heartbeating with
a 20 s TTL, so gossip goes on listing a killed worker as alive for seconds after the
kill. The router hears the kill at once through the broken Decode stream; requests
placed right after it must go to the other decode worker, not to the dead one (whose
pull would fail and be recovered).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest
from reliability_cluster import Stream, launched, run

from kvrs.v1 import gossip_pb2, gossip_pb2_grpc, router_pb2, router_pb2_grpc

TTL_S = 20.0
PROMPT_TOKENS = 32
LONG_TOKENS = 256
VICTIM_TOKENS = 1024
"""Long enough that the victim is still decoding when the kill lands on a loaded machine
(at 256 tokens it once finished first, and nothing broke for the router to hear)."""
SHORT_TOKENS = 8
WORKERS = ("prefill-0", "decode-0", "decode-1")
CLUSTER_SERVICES = ("gossip", "slot-broker", "scheduler-1", *WORKERS, "router")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url, module_redis_prefix):
    workers = {name: {"WORKER_HEARTBEAT_TTL_S": str(TTL_S)} for name in WORKERS}
    run_dir = tmp_path_factory.mktemp("kill") / "cluster"
    with launched(run_dir, redis_url, module_redis_prefix, CLUSTER_SERVICES, workers) as state:
        yield state


def new_request(seed: int, new_tokens: int, decode_instance_id: str = "") -> Stream:
    return Stream(
        router_pb2.GenerateRequest(
            request_id=f"kill-{seed}-{uuid.uuid4().hex[:6]}",
            prompt_token_ids=[(seed * 31 + 7 * i) % 251 for i in range(PROMPT_TOKENS)],
            max_new_tokens=new_tokens,
            decode_instance_id=decode_instance_id,
        )
    )


async def node_state(cluster, instance_id: str) -> int:
    async with grpc.aio.insecure_channel(cluster.address("gossip")) as channel:
        reply = await gossip_pb2_grpc.GossipServiceStub(channel).ListNodes(
            gossip_pb2.ListNodesRequest(include_down=True), timeout=5
        )
    return next(n.state for n in reply.nodes if n.instance_id == instance_id)


async def until_decoding(streams: list[Stream]) -> None:
    """Until every stream has a decoded token (token 0 comes from the prefill worker)."""
    deadline_s = time.monotonic() + 60
    while any(len(s.tokens) < 2 for s in streams):
        assert not any(s.error for s in streams), [s.describe() for s in streams]
        assert time.monotonic() < deadline_s, [s.describe() for s in streams]
        await asyncio.sleep(0.005)


async def test_requests_placed_right_after_a_kill_9_avoid_the_dead_decode_worker(cluster):
    """decode-1 busy with four streams, decode-0 with one: left to the load alone, new
    requests would go to decode-0. It is killed; the requests placed right after go to
    decode-1 with no recovery, while gossip still lists decode-0 alive."""
    busy = [new_request(i, LONG_TOKENS, "decode-1") for i in range(4)]
    victim = new_request(9, VICTIM_TOKENS, "decode-0")
    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        tasks = [asyncio.create_task(run(stub, s)) for s in busy]
        await until_decoding(busy)
        tasks.append(asyncio.create_task(run(stub, victim)))
        await until_decoding([victim])
        decode_0 = next(r.pid for r in cluster.processes if r.name == "decode-0")
        os.killpg(decode_0, signal.SIGKILL)
        killed_s = time.monotonic()
        await tasks[-1]  # the victim's stream broke, was recovered and ended elsewhere
        placed = await asyncio.gather(
            *(run(stub, new_request(20 + i, SHORT_TOKENS)) for i in range(4))
        )
        placed_s = time.monotonic() - killed_s
        state_after = await node_state(cluster, "decode-0")
        await asyncio.gather(*tasks)
    print(
        f"\nplaced {placed_s:.2f} s after the kill, decode-0 then "
        f"{gossip_pb2.NodeState.Name(state_after)}: {[s.describe() for s in placed]}; "
        f"victim: {victim.describe()}"
    )
    assert state_after == gossip_pb2.NODE_STATE_ALIVE, "gossip suspected decode-0 already"
    for stream in placed:
        assert stream.exact and not stream.error, stream.describe()
        assert stream.summary is not None and not stream.summary.recoveries, stream.describe()
        assert stream.summary.decode_instance_id == "decode-1", stream.describe()
    for stream in (*busy, victim):
        assert stream.exact and not stream.error, stream.describe()
    assert victim.summary is not None and victim.summary.recoveries, victim.describe()
    first = victim.summary.recoveries[0]
    assert (first.failed_instance_id, first.detected_by) == ("decode-0", "decode_stream")
