"""Late is not dead: a stopped or CPU-starved worker keeps its streams; a killed one does not.

A local cluster of real processes (`kvrs up`'s launcher): gossip (default confirmation
window: 2 TTLs after the suspicion), slot broker, one scheduler, the router, one prefill
and two decode tiny float64 workers heartbeating with a 1 s TTL. Streams are compared
token by token with the same model run in this process; what gossip decided is read
from its event stream in Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest
import redis
from reliability_cluster import Stream, launched, run

from kvrs.v1 import (
    gossip_pb2,
    gossip_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.tiny_reference import reference

TTL_S = 1.0
PROMPT_TOKENS = 32
MAX_NEW_TOKENS = 256
WORKERS = ("prefill-0", "decode-0", "decode-1")
CLUSTER_SERVICES = ("gossip", "slot-broker", "scheduler-1", *WORKERS, "router")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url, module_redis_prefix):
    workers = {name: {"WORKER_HEARTBEAT_TTL_S": str(TTL_S)} for name in WORKERS}
    run_dir = tmp_path_factory.mktemp("late") / "cluster"
    with launched(run_dir, redis_url, module_redis_prefix, CLUSTER_SERVICES, workers) as state:
        yield state


def new_request(seed: int, decode_instance_id: str = "") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=f"late-{seed}-{uuid.uuid4().hex[:6]}",
        prompt_token_ids=[(seed * 31 + 7 * i) % 251 for i in range(PROMPT_TOKENS)],
        max_new_tokens=MAX_NEW_TOKENS,
        decode_instance_id=decode_instance_id,
    )


def events_since(cluster, redis_url: str, since_ms: int, instance_id: str) -> list[tuple]:
    """(type, reason) of every gossip event about `instance_id` since `since_ms`."""
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(f"{cluster.redis_prefix}gossip:events", min=f"{since_ms}-0")
    finally:
        client.close()
    found = []
    for _, raw in entries:
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        if fields["instance_id"] == instance_id:
            found.append((fields["type"], fields["reason"]))
    return found


async def node_state(cluster, instance_id: str) -> int:
    async with grpc.aio.insecure_channel(cluster.address("gossip")) as channel:
        reply = await gossip_pb2_grpc.GossipServiceStub(channel).ListNodes(
            gossip_pb2.ListNodesRequest(include_down=True), timeout=5
        )
    return next(n.state for n in reply.nodes if n.instance_id == instance_id)


def pid_of(cluster, name: str) -> int:
    return next(r.pid for r in cluster.processes if r.name == name)


async def wait_decoding(streams: list[Stream], tasks: list[asyncio.Task]) -> list[Stream]:
    """Until at least two streams are decoding (token 0 comes from the prefill worker);
    returns those decoding then."""
    deadline_s = time.monotonic() + 60

    def decoding() -> list[Stream]:
        return [s for s in streams if 2 <= len(s.tokens) < MAX_NEW_TOKENS]

    while len(decoding()) < 2:
        failed = [s.describe() for s, t in zip(streams, tasks, strict=True) if t.done() and s.error]
        assert not failed, f"streams failed before the fault: {failed}"
        assert time.monotonic() < deadline_s, [s.describe() for s in streams]
        await asyncio.sleep(0.002)
    return decoding()


async def test_a_decode_worker_stopped_for_less_than_two_ttls_keeps_its_streams(cluster, redis_url):
    """SIGSTOP for 1.8 TTLs: gossip suspects decode-0 (new work goes to decode-1 meanwhile)
    and takes the suspicion back when it beats again; no stream is moved."""
    since_ms = int(time.time() * 1000)
    streams = [Stream(new_request(i, "decode-0")) for i in range(6)]
    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        tasks = [asyncio.create_task(run(stub, s)) for s in streams]
        hit = await wait_decoding(streams, tasks)
        victim = pid_of(cluster, "decode-0")
        os.kill(victim, signal.SIGSTOP)
        stopped_s = time.monotonic()
        try:
            while await node_state(cluster, "decode-0") != gossip_pb2.NODE_STATE_SUSPECT:
                assert time.monotonic() - stopped_s < 1.6 * TTL_S, "decode-0 never suspected"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # the scheduler hears the event
            placed = await run(stub, Stream(new_request(99)))
            await asyncio.sleep(max(0.0, 1.8 * TTL_S - (time.monotonic() - stopped_s)))
        finally:
            os.kill(victim, signal.SIGCONT)
        await asyncio.gather(*tasks)
    events = events_since(cluster, redis_url, since_ms, "decode-0")
    print(
        f"\n{len(hit)} streams decoding at the stop; gossip about decode-0: {events}; "
        f"new request while suspect: {placed.describe()}"
    )
    for stream in streams:
        assert stream.exact and not stream.error, stream.describe()
        assert stream.summary is not None and not stream.summary.recoveries, stream.describe()
    assert [kind for kind, _ in events] == ["suspect", "refuted"], events
    assert placed.summary is not None and placed.summary.decode_instance_id == "decode-1", (
        placed.describe()
    )


def wipe_registry(cluster, redis_url: str) -> int:
    """Deletes what gossip knows of the instances (their records, the id set and the
    deadlines), as a Redis restart without persistence does; only this cluster's keys,
    and its event stream stays, to read what gossip decided afterwards."""
    client = redis.Redis.from_url(redis_url)
    try:
        prefix = f"{cluster.redis_prefix}gossip:"
        keys = [*client.scan_iter(match=f"{prefix}node:*"), f"{prefix}nodes", f"{prefix}live"]
        return int(client.delete(*keys))
    finally:
        client.close()


def registered(cluster, redis_url: str, instance_id: str) -> bool:
    client = redis.Redis.from_url(redis_url)
    try:
        return bool(client.exists(f"{cluster.redis_prefix}gossip:node:{instance_id}"))
    finally:
        client.close()


async def park_kv_on_decode_0(cluster, request_id: str, prompt: list[int]) -> int:
    """A prompt prefilled on prefill-0 and its KV pulled to decode-0, with no stream
    decoding it yet (the moment between a request's pull and its Decode call); token 0."""
    source = cluster.address("prefill-0")
    async with (
        grpc.aio.insecure_channel(source) as src,
        grpc.aio.insecure_channel(cluster.address("decode-0")) as dst,
    ):
        reply = await worker_pb2_grpc.WorkerServiceStub(src).Prefill(
            worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, lease_s=60),
            timeout=30,
        )
        await worker_pb2_grpc.WorkerServiceStub(dst).PullKv(
            worker_pb2.PullKvRequest(
                request_id=request_id,
                source_instance_id="prefill-0",
                source_address=source,
                token_start=0,
                token_end=len(prompt),
                prompt_tokens=len(prompt),
                lease_s=60,
            ),
            timeout=30,
        )
        await worker_pb2_grpc.WorkerServiceStub(src).ReleaseKv(
            worker_pb2.ReleaseKvRequest(request_id=request_id), timeout=10
        )
    return reply.first_token_id


async def decode_parked(cluster, request_id: str, first_token: int, new_tokens: int) -> list[int]:
    """Decodes the parked request on decode-0 from the KV it holds; every token."""
    tokens = [first_token]
    async with grpc.aio.insecure_channel(cluster.address("decode-0")) as channel:
        async for token in worker_pb2_grpc.WorkerServiceStub(channel).Decode(
            worker_pb2.DecodeRequest(
                request_id=request_id,
                generated_token_ids=tokens,
                max_new_tokens=new_tokens - 1,
                release_when_done=True,
            ),
            timeout=60,
        ):
            tokens.append(token.token_id)
    return tokens


async def test_a_decode_worker_a_lost_registry_forgot_keeps_its_streams_and_kv(cluster, redis_url):
    """The registry wiped under live streams: decode-0's next beat is answered NotFound
    (forgotten, not declared failed), it registers again and goes on decoding every
    stream from the KV it holds (no stream moves, none differs by a token), and KV it
    holds for a request not decoding yet is still there to decode from."""
    since_ms = int(time.time() * 1000)
    parked_id, parked_prompt = f"parked-{uuid.uuid4().hex[:6]}", list(range(3, 3 + PROMPT_TOKENS))
    parked_first = await park_kv_on_decode_0(cluster, parked_id, parked_prompt)
    streams = [Stream(new_request(20 + i, "decode-0")) for i in range(6)]
    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        tasks = [asyncio.create_task(run(stub, s)) for s in streams]
        hit = await wait_decoding(streams, tasks)
        wiped = wipe_registry(cluster, redis_url)
        wiped_s = time.monotonic()
        while not registered(cluster, redis_url, "decode-0"):
            assert time.monotonic() - wiped_s < 3 * TTL_S, "decode-0 never registered again"
            await asyncio.sleep(0.01)
        rejoined_s = time.monotonic() - wiped_s
        decoding = [s for s, t in zip(streams, tasks, strict=True) if not t.done()]
        await asyncio.sleep(TTL_S / 2)  # the worker has acted on its re-registration
        parked = await decode_parked(cluster, parked_id, parked_first, 16)
        await asyncio.gather(*tasks)
    events = events_since(cluster, redis_url, since_ms, "decode-0")
    print(
        f"\n{len(hit)} streams decoding at the wipe ({wiped} keys); decode-0 registered "
        f"again {rejoined_s:.2f} s later with {len(decoding)} streams still decoding; "
        f"gossip about decode-0: {events}"
    )
    assert decoding, "every stream ended before decode-0 registered again: nothing shown"
    for stream in streams:
        assert stream.exact and not stream.error, stream.describe()
        assert stream.summary is not None and not stream.summary.recoveries, stream.describe()
        assert stream.summary.final_decode_instance_id == "decode-0", stream.describe()
    assert parked == reference(tuple(parked_prompt), 16)
    # Registered again once, never declared failed. On a loaded machine one beat can come
    # late (a suspicion its next beat refutes): that moves no stream, as asserted above.
    kinds = [kind for kind, _ in events]
    assert kinds.count("joined") == 1 and not {"failed", "left"} & set(kinds), events
    assert kinds.count("suspect") == kinds.count("refuted"), events


@pytest.mark.slow
async def test_four_busy_loops_on_the_cores_cost_no_stream(cluster, redis_url):
    """20 s of four `while 1: pass` processes competing with the whole cluster."""
    since_ms = int(time.time() * 1000)
    finished: list[Stream] = []
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)

        async def client(offset: int) -> None:
            turn = 0
            while not stop.is_set():
                finished.append(await run(stub, Stream(new_request(offset + 4 * turn))))
                turn += 1

        clients = [asyncio.create_task(client(i)) for i in range(4)]
        loops = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(4)]
        try:
            await asyncio.sleep(20)
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        stop.set()
        await asyncio.gather(*clients)
    events = {
        name: events_since(cluster, redis_url, since_ms, name)
        for name in ("prefill-0", "decode-0", "decode-1")
    }
    print(f"\n{len(finished)} streams under four busy loops; gossip events: {events}")
    assert finished
    for stream in finished:
        assert stream.exact and not stream.error, stream.describe()
        assert stream.summary is not None and not stream.summary.recoveries, stream.describe()
    assert all(kind != "failed" for found in events.values() for kind, _ in found), events


async def test_a_kill_9_mid_stream_is_recovered_from_the_broken_stream(cluster, redis_url):
    """The router hears a real death through the stream at once, not a TTL later; gossip
    confirms it with a direct probe, not by waiting out the confirmation window."""
    since_ms = int(time.time() * 1000)
    streams = [Stream(new_request(40 + i, "decode-0")) for i in range(6)]
    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        tasks = [asyncio.create_task(run(stub, s)) for s in streams]
        hit = await wait_decoding(streams, tasks)
        os.killpg(pid_of(cluster, "decode-0"), signal.SIGKILL)
        await asyncio.gather(*tasks)
    deadline_s = time.monotonic() + 3 * TTL_S
    while not any(k == "failed" for k, _ in events_since(cluster, redis_url, since_ms, "decode-0")):
        assert time.monotonic() < deadline_s, "gossip never declared decode-0 failed"
        await asyncio.sleep(0.05)
    events = events_since(cluster, redis_url, since_ms, "decode-0")
    print(f"\n{len(hit)} streams decoding at the kill; gossip about decode-0: {events}")
    for stream in streams:
        assert stream.exact and not stream.error, stream.describe()
    for stream in hit:
        assert stream.summary is not None and stream.summary.recoveries, stream.describe()
        first = stream.summary.recoveries[0]
        assert (first.failed_instance_id, first.detected_by) == ("decode-0", "decode_stream"), (
            stream.describe()
        )
        assert stream.summary.final_decode_instance_id == "decode-1", stream.describe()
    assert [kind for kind, _ in events] == ["suspect", "failed"], events
    assert "nothing listens at" in events[1][1], events
