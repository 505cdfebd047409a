"""Redis killed and restarted under load: decisions continue from the cached view.

A private redis-server (never the shared one) backs gossip, the slot broker and the
scheduler. A client keeps calling SelectDecode and Recover while Redis is SIGKILLed and,
two seconds later, restarted on the same port with its append-only file.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import grpc
import pytest
import redis
from reliability_stack import CLUSTER, ControlPlane, PrivateRedis

from kvrs.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.gossip_records import Registration
from services.gossip.client import GossipClient, HeartbeatLoop

STALE_AFTER_S = 1.0
"""The scheduler's default bound: a tighter one flags views stale on a starved machine."""
OUTAGE_S = 2.5
FRESH_WITHIN_S = 2.0


@dataclass
class Calls:
    """Every call's outcome, by phase."""

    ok: dict[str, int] = field(default_factory=dict)
    stale: dict[str, int] = field(default_factory=dict)
    errors: list[tuple[str, str, str]] = field(default_factory=list)
    """(phase, status code, details) of every failed call."""
    stale_after_kill_s: float | None = None
    fresh_after_restart_s: float | None = None

    def record(self, phase: str, reply) -> None:
        self.ok[phase] = self.ok.get(phase, 0) + 1
        if reply.view_stale:
            self.stale[phase] = self.stale.get(phase, 0) + 1


def one_round(stub, calls: Calls, phase: str) -> list:
    """SelectDecode, Recover(skip_slot) and Recover (holding a slot if it can)."""
    rid = uuid.uuid4().hex[:12]
    requests = (
        (
            stub.SelectDecode,
            scheduler_pb2.SelectDecodeRequest(
                request_id=rid, prefill_instance_id="prefill-0", prompt_tokens=4096
            ),
        ),
        (
            stub.Recover,
            scheduler_pb2.RecoverRequest(
                request_id=f"{rid}-skip",
                failed_instance_id="decode-0",
                skip_slot=True,
                source_prefill_instance_id="prefill-0",
                prompt_tokens=4096,
                generated_tokens=8,
            ),
        ),
        (
            stub.Recover,
            scheduler_pb2.RecoverRequest(
                request_id=f"{rid}-slot",
                failed_instance_id="decode-1",
                source_prefill_instance_id="prefill-1",
                prompt_tokens=4096,
                generated_tokens=8,
            ),
        ),
    )
    replies = []
    for method, request in requests:
        try:
            reply = method(request, timeout=5)
        except grpc.RpcError as exc:
            calls.errors.append((phase, exc.code().name, exc.details()))
            continue
        calls.record(phase, reply)
        replies.append(reply)
    return replies


@pytest.mark.timeout(90)
def test_decisions_continue_through_a_redis_restart(tmp_path):
    redis_server = PrivateRedis(tmp_path / "redis")
    redis_server.start()
    plane = ControlPlane(redis_server.url, "{kvrs}:").start(view_stale_after_s=STALE_AFTER_S)
    channel = plane.channel("scheduler")
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    calls = Calls()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            one_round(stub, calls, "before")

        redis_server.kill()
        killed_s = time.monotonic()
        while time.monotonic() - killed_s < OUTAGE_S:
            replies = one_round(stub, calls, "outage")
            if calls.stale_after_kill_s is None and any(r.view_stale for r in replies):
                calls.stale_after_kill_s = time.monotonic() - killed_s

        redis_server.start()
        restarted_s = time.monotonic()
        while time.monotonic() - restarted_s < FRESH_WITHIN_S + 3.0:
            replies = one_round(stub, calls, "after")
            if replies and not any(r.view_stale for r in replies):
                calls.fresh_after_restart_s = time.monotonic() - restarted_s
                break
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            one_round(stub, calls, "fresh")
    finally:
        channel.close()
        plane.stop()
        redis_server.kill()

    print(
        f"\ncalls ok {calls.ok}; stale answers {calls.stale}; errors {len(calls.errors)}; "
        f"view stale {calls.stale_after_kill_s}s after the kill "
        f"(bound {STALE_AFTER_S}s); fresh {calls.fresh_after_restart_s}s after the restart"
    )
    internal = [e for e in calls.errors if e[1] in ("INTERNAL", "UNKNOWN")]
    assert not internal, internal
    assert not calls.errors, f"a decision was refused: {calls.errors[:5]}"
    assert calls.ok["before"] > calls.stale.get("before", 0), "no fresh answer before"
    assert calls.ok["outage"] >= 10 and calls.ok["fresh"] > 0
    assert calls.stale_after_kill_s is not None, "no answer ever said view_stale"
    assert calls.stale_after_kill_s < STALE_AFTER_S + 1.0
    assert calls.fresh_after_restart_s is not None
    assert calls.fresh_after_restart_s < FRESH_WITHIN_S
    assert not calls.stale.get("fresh")


def start_heartbeats(plane: ControlPlane, ttl_s: float, interval_s: float) -> list:
    """Every instance of the cluster kept alive by its own HeartbeatLoop, as workers do."""

    async def start() -> list:
        # Patient enough for a first registration on a loaded machine (a fresh gossip
        # loads its scripts into Redis); a beat to a gossip whose Redis is gone fails fast.
        client = GossipClient(plane.addresses["gossip"], timeout_s=2.0)
        loops = []
        for instance_id, role, node, rack, pod in CLUSTER:
            loop = HeartbeatLoop(
                client,
                Registration(
                    instance_id=instance_id,
                    role=role,
                    address=f"{instance_id}:50060",
                    node=node,
                    rack=rack,
                    pod=pod,
                    heartbeat_ttl_s=ttl_s,
                ),
                interval_s=interval_s,
            )
            await loop.start()
            loops.append(loop)
        return loops

    return plane.loop.run(start())


def stop_heartbeats(plane: ControlPlane, loops: list) -> None:
    async def stop() -> None:
        for loop in loops:
            await loop.stop(deregister=False)

    plane.loop.run(stop())


def failure_events(redis_url: str, prefix: str) -> list[str]:
    client = redis.Redis.from_url(redis_url)
    try:
        events = client.xrange(f"{prefix}gossip:events")
    finally:
        client.close()
    return [fields[b"instance_id"].decode() for _, fields in events if fields[b"type"] == b"failed"]


@pytest.mark.timeout(60)
def test_a_redis_outage_longer_than_the_ttl_fails_no_healthy_instance(tmp_path):
    """Workers heartbeat all along; only Redis was away. A failure event makes routers
    recover every request on the instance, and the instance drop them (a storm). The one
    worker that really died during the outage is still reported, one TTL after Redis is
    back (the registry's own deadline, without the confirmation window that would add two
    more TTLs)."""
    redis_server = PrivateRedis(tmp_path / "redis")
    redis_server.start()
    plane = ControlPlane(redis_server.url, "{kvrs}:", gossip_confirm_ttls=0.0).start(
        services=("gossip",), cluster=()
    )
    alive: list = []
    try:
        loops = start_heartbeats(plane, ttl_s=1.0, interval_s=0.2)
        dead, alive = loops[-1:], loops[:-1]
        time.sleep(0.5)
        redis_server.kill()
        stop_heartbeats(plane, dead)
        time.sleep(OUTAGE_S)
        redis_server.start()
        time.sleep(0.5)
        failed_within_a_ttl = failure_events(redis_server.url, "{kvrs}:")
        time.sleep(1.5)
        failed = failure_events(redis_server.url, "{kvrs}:")
    finally:
        stop_heartbeats(plane, alive)
        plane.stop()
        redis_server.kill()
    print(f"\nfailure events after a {OUTAGE_S} s Redis outage (TTL 1 s): {failed}")
    assert failed_within_a_ttl == []
    assert failed == [CLUSTER[-1][0]]


@pytest.mark.timeout(60)
def test_a_redis_restart_that_lost_the_registry_refuses_no_placement(tmp_path):
    """Redis without persistence comes back empty; workers re-register within one heartbeat
    (NotFound -> register). In between, the scheduler must not turn requests away."""
    redis_server = PrivateRedis(tmp_path / "redis", appendonly=False)
    redis_server.start()
    plane = ControlPlane(redis_server.url, "{kvrs}:").start(cluster=(), view_stale_after_s=0.3)
    channel = plane.channel("scheduler")
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    request = scheduler_pb2.SelectDecodeRequest(
        request_id="after-reset", prefill_instance_id="prefill-0", prompt_tokens=4096
    )
    try:
        loops = start_heartbeats(plane, ttl_s=2.0, interval_s=0.5)
        assert plane.loop.run(plane.handles["scheduler"].view.refresh())
        stub.SelectDecode(request, timeout=5)
        # The moment between Redis answering again and the first re-registration, held
        # open: heartbeats paused, one refresh of the scheduler's view.
        stop_heartbeats(plane, loops)
        redis_server.kill()
        redis_server.start()
        plane.loop.run(plane.handles["scheduler"].view.refresh())
        try:
            reply = stub.SelectDecode(request, timeout=5)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), (
                exc.details()
            )
            pytest.fail(f"placement refused after the reset: {exc.code().name}: {exc.details()}")
        assert reply.decode_instance_id.startswith("decode-")
        assert reply.view_stale, "a view the registry could not confirm must say so"
    finally:
        channel.close()
        plane.stop()
        redis_server.kill()
