"""A decode worker's link blackholed while a KV transfer to it is in flight (netns + tc).

prefill-0, decode-0 (same node), decode-1 and prefill-1 (across the spine) run as real
worker processes, each in its own network namespace on one bridge; gossip, the slot
broker and the scheduler run on the bridge's host address, the router as a process on
the host. A request is placed on decode-0, whose link is shaped to 4 Mbit/s, so its
512-token prompt's KV takes about a second to cross it. Once part of the KV has crossed,
the link's qdisc is replaced with a zero-length queue: every packet into decode-0's
namespace is dropped, mid-connection (open TCP connections see no reset, only silence),
for 3 s: longer than the transfer's 2 s step timeout, shorter than gossip's confirmation
window (suspect after one 2 s TTL, failed two TTLs later; TCP's retransmission backoff
delays the first beat after the heal by a second or more). The request must end
token-exact: the pull times out and the recovery policy moves it.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
import redis
from reliability_stack import ControlPlane, ServiceProcess, free_port, unique_prefix

from bench import netns as netns_lab
from kvrs.rpc.generate import generate_into
from kvrs.v1 import router_pb2, router_pb2_grpc
from tests.tiny_reference import reference

WORKERS = {
    # name: (role, node, rack, pod)
    "prefill-0": ("prefill", "n0", "r0", "p0"),
    "prefill-1": ("prefill", "n6", "r6", "p6"),
    "decode-0": ("decode", "n0", "r0", "p0"),
    "decode-1": ("decode", "n5", "r5", "p5"),
}
WORKER_PORT = 50060
LINK_RATE = "4mbit"
PROMPT_TOKENS = 512
NEW_TOKENS = 16
IN_FLIGHT_BYTES = 128 * 1024
"""Bytes through decode-0's link after which its transfer counts as under way (of ~512 KiB)."""
FLAP_S = 3.0
TRANSFER_TIMEOUT_S = 2.0

WHY_NOT = netns_lab.available()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(180),
    pytest.mark.skipif(bool(WHY_NOT), reason=f"network namespaces: {WHY_NOT}"),
]


@pytest.fixture(scope="module")
def lab(redis_url, tmp_path_factory):
    netns = netns_lab.NetnsLab(tuple(WORKERS)).start()
    plane = None
    processes: list[tuple[str, ServiceProcess]] = []
    try:
        plane = ControlPlane(redis_url, unique_prefix("flap"), host=netns.host_ip, model="tiny")
        plane.start(services=("gossip", "slot-broker", "scheduler"), cluster=())
        log_dir = tmp_path_factory.mktemp("flap-logs")
        for name, (role, node, rack, pod) in WORKERS.items():
            address = f"{netns.ips[name]}:{WORKER_PORT}"
            env = {
                "WORKER_INSTANCE_ID": name,
                "WORKER_LISTEN_ADDR": f"0.0.0.0:{WORKER_PORT}",
                "WORKER_ADVERTISE_ADDR": address,
                "WORKER_TRANSFER_HOST": netns.ips[name],
                "WORKER_NODE": node,
                "WORKER_RACK": rack,
                "WORKER_POD": pod,
                "GOSSIP_ADDR": plane.addresses["gossip"],
                "KVRS_MODEL": "tiny",
                "WORKER_HEARTBEAT_TTL_S": "2.0",
                "WORKER_TRANSFER_TIMEOUT_S": str(TRANSFER_TIMEOUT_S),
                "KVRS_LOG_LEVEL": "WARNING",
            }
            worker = ServiceProcess(
                name, "services.worker", env, log_dir, ("--role", role), netns.exec_prefix(name)
            )
            processes.append((address, worker.start()))
        router_address = f"{netns.host_ip}:{free_port()}"
        router_env = {
            "ROUTER_LISTEN_ADDR": router_address,
            "GOSSIP_ADDR": plane.addresses["gossip"],
            "SCHEDULER_ADDRS": plane.addresses["scheduler"],
            "SLOT_BROKER_ADDR": plane.addresses["slot-broker"],
            "KVRS_MODEL": "tiny",
        }
        processes.append(
            (
                router_address,
                ServiceProcess("router", "services.router", router_env, log_dir).start(),
            )
        )
        for address, process in processes:
            process.wait_serving(address, timeout_s=90)
        yield netns, plane, router_address
    finally:
        for _, process in processes:
            process.kill()
        if plane is not None:
            plane.stop()
        netns.stop()


def new_request(seed: int, prompt_tokens: int, decode_instance_id: str = ""):
    return router_pb2.GenerateRequest(
        request_id=f"flap-{seed}-{uuid.uuid4().hex[:6]}",
        prompt_token_ids=[(seed * 31 + 7 * i) % 251 for i in range(prompt_tokens)],
        max_new_tokens=NEW_TOKENS,
        decode_instance_id=decode_instance_id,
    )


async def generate(stub, request) -> tuple[list[int], router_pb2.GenerateSummary | None, str]:
    tokens: list[int] = []
    summary, error = await generate_into(stub, request, tokens, 120)
    return tokens, summary, f"{error.code().name}: {error.details()}" if error else ""


async def until_every_decode_worker_serves(stub) -> None:
    """One short request decoded on each decode worker (they register after their canary)."""
    deadline_s = time.monotonic() + 60
    for target in ("decode-0", "decode-1"):
        while True:
            request = new_request(1, 16, target)
            tokens, summary, error = await generate(stub, request)
            if not error and summary is not None and not summary.recoveries:
                assert tokens == reference(tuple(request.prompt_token_ids), NEW_TOKENS)
                break
            assert time.monotonic() < deadline_s, f"{target} never served: {error}"
            await asyncio.sleep(0.5)


def gossip_events(redis_url: str, prefix: str, instance_id: str) -> list[tuple[str, str]]:
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(f"{prefix}gossip:events")
    finally:
        client.close()
    return [
        (raw[b"type"].decode(), raw[b"reason"].decode())
        for _, raw in entries
        if raw[b"instance_id"].decode() == instance_id
    ]


async def test_a_link_blackholed_mid_transfer_is_recovered_token_exact(lab, redis_url):
    netns, plane, router_address = lab
    async with grpc.aio.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        await until_every_decode_worker_serves(stub)
        netns.shape("decode-0", LINK_RATE)
        request = new_request(7, PROMPT_TOKENS, "decode-0")
        started_s = time.monotonic()
        call = asyncio.create_task(generate(stub, request))
        while netns.sent_bytes("decode-0") < IN_FLIGHT_BYTES:
            assert not call.done(), f"ended before its transfer got under way: {call.result()}"
            assert time.monotonic() - started_s < 30, "the transfer never got under way"
            await asyncio.sleep(0.005)
        in_flight_bytes = netns.sent_bytes("decode-0")
        netns.blackhole("decode-0")
        cut_s = time.monotonic() - started_s
        try:
            await asyncio.sleep(FLAP_S)
        finally:
            netns.shape("decode-0", LINK_RATE)
        tokens, summary, error = await call
        ended_s = time.monotonic() - started_s
    events = gossip_events(redis_url, plane.prefix, "decode-0")
    recoveries = [
        (r.failed_instance_id, r.detected_by, r.action, r.target_instance_id)
        for r in (summary or router_pb2.GenerateSummary()).recoveries
    ]
    print(
        f"\nlink blackholed {cut_s:.2f} s after the request, {in_flight_bytes} bytes into "
        f"decode-0 by then, healed {FLAP_S} s later; request ended at {ended_s:.2f} s, "
        f"placed on {summary.decode_instance_id if summary else None}, recoveries "
        f"{recoveries}, error {error!r}; gossip about decode-0: {events}"
    )
    assert not error, error
    assert tokens == reference(tuple(request.prompt_token_ids), NEW_TOKENS)
    assert summary is not None and summary.decode_instance_id == "decode-0"
    assert summary.recoveries, "the transfer over the dead link completed?"
    # The receiver's transfer timed out. Whether decode-0 answers the liveness check that
    # follows (the link healed by then) or not, the link is to blame, not prefill-0's KV.
    assert summary.recoveries[0].failed_instance_id == "decode-0", recoveries
