"""Recovery through the router with real processes: kill -9 workers mid-stream.

Every request's tokens are compared with the tiny float64 model run in this process
(greedy, bit-exact), so a recovery that repeated, skipped or changed one token fails.
Requests start on prefill-0 / decode-0 (pinned) so the victim is known; the topology and
profile of `recovery_cluster` (see conftest) make kvrs choose HYBRID when decode-0 dies.
After each test every worker still up holds no KV and no migration slot is leased.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import pytest

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
from services.gossip.client import GossipClient
from tests.tiny_reference import reference

PROMPT_TOKENS = 100
LONG_TOKENS = 800
"""Long enough that the first request placed is still decoding when the last one starts
(`run_and_kill` waits for that moment on the victim), short enough that the reference run
here stays well within the timeout on a loaded machine (transformers generates ~25 ms a
token there)."""

MIGRATE = common_pb2.RECOVERY_ACTION_MIGRATE
RECOMPUTE = common_pb2.RECOVERY_ACTION_RECOMPUTE
HYBRID = common_pb2.RECOVERY_ACTION_HYBRID
ABORT = common_pb2.RECOVERY_ACTION_ABORT

pytestmark = pytest.mark.timeout(180)


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> tuple[int, ...]:
    return tuple((seed * 31 + 7 * i) % 251 for i in range(tokens))


@dataclass
class Stream:
    request: router_pb2.GenerateRequest
    tokens: list[int] = field(default_factory=list)
    summary: router_pb2.GenerateSummary | None = None
    error: grpc.aio.AioRpcError | None = None
    at_kill: str = ""
    """What `run_and_kill` checked when it killed: this stream's tokens, the victims' state."""


def describe(stream: Stream) -> str:
    """Everything a failed assertion about `stream` needs to be understood."""
    summary = stream.summary or router_pb2.GenerateSummary()
    recoveries = [
        (
            r.failed_instance_id,
            r.detected_by,
            r.lost_reason,
            common_pb2.RecoveryAction.Name(r.action),
            r.generated_tokens,
            r.succeeded,
            r.error,
        )
        for r in summary.recoveries
    ]
    error = f"{stream.error.code().name}: {stream.error.details()}" if stream.error else None
    return (
        f"{stream.request.request_id}: {len(stream.tokens)}/{stream.request.max_new_tokens} "
        f"tokens, placed on {summary.decode_instance_id!r}, ended on "
        f"{summary.final_decode_instance_id!r}, recoveries (failed, detected_by, "
        f"lost_reason, action, generated, succeeded, error) {recoveries}, error {error}; "
        f"at the kill: {stream.at_kill}"
    )


async def run_stream(stub, stream: Stream) -> Stream:
    stream.summary, stream.error = await generate_into(stub, stream.request, stream.tokens, 120)
    return stream


def request(
    request_id: str, seed: int, max_new_tokens: int = LONG_TOKENS, **fields
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt(seed)),
        max_new_tokens=max_new_tokens,
        prefill_instance_id="prefill-0",
        decode_instance_id="decode-0",
        **fields,
    )


async def decoding(stubs: dict[str, worker_pb2_grpc.WorkerServiceStub]) -> dict[str, int]:
    """Decode streams open on each worker now."""
    replies = await asyncio.gather(
        *(
            stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5)
            for stub in stubs.values()
        )
    )
    return {name: reply.running_requests for name, reply in zip(stubs, replies, strict=True)}


async def run_and_kill(
    cluster,
    requests: Sequence[router_pb2.GenerateRequest],
    victims: Sequence[str],
) -> list[Stream]:
    """Streams every request; once every one is decoding on its victim, freezes then kills
    `victims`.

    "Decoding" is read on the victims themselves (their open Decode streams), not from the
    tokens this client has seen: those lag the worker's (the router relays them one by
    one, slowly on a loaded machine), and a request placed first can finish on the worker
    before the last one starts; a kill decided from the client's side then misses it.
    Each stream records what was checked at the kill (`Stream.at_kill`)."""
    placed = {
        v: sum(r.decode_instance_id == v for r in requests)
        for v in victims
        if v.startswith("decode")
    }
    channels = {v: grpc.aio.insecure_channel(cluster.address(v)) for v in placed}
    stubs = {v: worker_pb2_grpc.WorkerServiceStub(c) for v, c in channels.items()}
    try:
        async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            streams = [Stream(r) for r in requests]
            tasks = [asyncio.create_task(run_stream(stub, s)) for s in streams]
            deadline = time.monotonic() + 60
            seen: list[dict[str, int]] = []
            while True:
                # A stream that ends first ended on the worker before the last one started
                # there: the kill would miss it.
                assert not any(t.done() for t in tasks), (
                    f"a stream ended before every request was decoding on its victim at once "
                    f"({placed} placed; open decode streams seen, newest last: {seen[-5:]})",
                    [describe(s) for s in streams],
                )
                assert time.monotonic() < deadline, (
                    f"not every request was decoding on its victim at once ({placed} placed; "
                    f"open decode streams seen, newest last: {seen[-5:]})",
                    [describe(s) for s in streams],
                )
                open_streams = await decoding(stubs)
                seen.append(open_streams)
                if all(open_streams[v] >= n for v, n in placed.items()) and all(
                    s.tokens for s in streams
                ):
                    break
                await asyncio.sleep(0.005)
            for victim in victims:
                # Frozen first, so no process gets to answer anything in between.
                cluster.signal(victim, signal.SIGSTOP)
            frozen_s = time.monotonic()
            cluster.kill(*victims)
            for stream in streams:
                stream.at_kill = (
                    f"{len(stream.tokens)} tokens received; decode streams open on "
                    f"{open_streams} just before the freeze; killed "
                    f"{time.monotonic() - frozen_s:.3f} s after it"
                )
            assert all(len(s.tokens) < s.request.max_new_tokens for s in streams), [
                describe(s) for s in streams
            ]
            return list(await asyncio.gather(*tasks))
    finally:
        for channel in channels.values():
            await channel.close()


async def assert_nothing_leaked(cluster, workers: Sequence[str]) -> None:
    for name in workers:
        async with grpc.aio.insecure_channel(cluster.address(name)) as channel:
            stats = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(
                worker_pb2.GetWorkerStatsRequest(), timeout=5
            )
        assert stats.resident_requests == 0, f"{name} still holds KV"
    async with grpc.aio.insecure_channel(cluster.address("slot-broker")) as channel:
        stats = await slots_pb2_grpc.SlotBrokerServiceStub(channel).GetSlotStats(
            slots_pb2.GetSlotStatsRequest(), timeout=5
        )
    assert stats.slots_in_use == 0


def assert_exact(stream: Stream) -> None:
    assert stream.error is None, describe(stream)
    expected = reference(tuple(stream.request.prompt_token_ids), stream.request.max_new_tokens)
    assert stream.tokens == expected, describe(stream)
    assert stream.summary.generated_tokens == len(expected), describe(stream)


@pytest.fixture
def cluster(recovery_cluster):
    recovery_cluster.ensure_running()
    yield recovery_cluster


async def test_fault_free_requests_stream_the_reference_tokens(cluster):
    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        streams = await asyncio.gather(
            *(
                run_stream(
                    stub,
                    Stream(
                        router_pb2.GenerateRequest(
                            request_id=f"clean-{i}",
                            prompt_token_ids=list(prompt(i, 20 + 30 * i)),
                            max_new_tokens=40,
                        )
                    ),
                )
                for i in range(2)
            )
        )
    for stream in streams:
        assert_exact(stream)
        summary = stream.summary
        assert summary.finish_reason == "length"
        assert not summary.recoveries, describe(stream)
        assert summary.prefill_instance_id.startswith("prefill-")
        assert summary.final_decode_instance_id == summary.decode_instance_id
        assert summary.kv_bytes == len(stream.request.prompt_token_ids) * 1024
        assert summary.trace_id == "", "this cluster exports no spans: no trace to name"
    await assert_nothing_leaked(cluster, ("prefill-0", "prefill-1", "decode-0", "decode-1"))


async def test_kill_9_of_a_decode_worker_mid_stream_loses_no_token(cluster):
    requests = [request(f"batch-{i}", seed=10 + i) for i in range(4)]
    streams = await run_and_kill(cluster, requests, ["decode-0"])
    for stream in streams:
        assert_exact(stream)
        assert len(stream.summary.recoveries) == 1, describe(stream)
        (recovery,) = stream.summary.recoveries
        assert recovery.failed_instance_id == "decode-0", describe(stream)
        assert recovery.succeeded, describe(stream)
        assert recovery.target_instance_id == "decode-1", describe(stream)
        assert stream.summary.final_decode_instance_id == "decode-1", describe(stream)
        assert 1 <= recovery.generated_tokens < LONG_TOKENS, describe(stream)
    # They failed together, so they were planned together.
    assert {s.summary.recoveries[0].batch_size for s in streams} == {4}, [
        describe(s) for s in streams
    ]
    await assert_nothing_leaked(cluster, ("prefill-0", "prefill-1", "decode-1"))


async def test_each_action_forced_by_policy_is_token_exact_and_a_missed_deadline_aborts(cluster):
    late = int((time.time() + 0.05) * 1000)
    requests = [
        request("forced-migrate", seed=20, recovery_policy="always_migrate"),
        request("forced-recompute", seed=21, recovery_policy="always_recompute"),
        request("forced-hybrid", seed=22, recovery_policy="kvrs"),
        request("forced-abort", seed=23, recovery_policy="kvrs", deadline_unix_ms=late),
    ]
    migrate, recompute, hybrid, abort = await run_and_kill(cluster, requests, ["decode-0"])
    for stream, action in ((migrate, MIGRATE), (recompute, RECOMPUTE), (hybrid, HYBRID)):
        assert_exact(stream)
        (recovery,) = stream.summary.recoveries
        assert recovery.action == action, stream.request.request_id
        assert recovery.succeeded
        assert recovery.measured_s > 0
        assert recovery.predicted_cost_s > 0
    assert recompute.summary.recoveries[0].source_instance_id == "prefill-1"
    split = hybrid.summary.recoveries[0].split_tokens
    assert 0 < split < PROMPT_TOKENS
    # The aborted request got the summary, then DEADLINE_EXCEEDED naming the reason.
    assert abort.error is not None
    assert abort.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline" in abort.error.details()
    assert abort.summary.finish_reason == "abort"
    assert abort.summary.recoveries[-1].action == ABORT
    expected = reference(tuple(abort.request.prompt_token_ids), LONG_TOKENS)
    assert abort.tokens == expected[: len(abort.tokens)]
    assert abort.summary.generated_tokens == len(abort.tokens)
    await assert_nothing_leaked(cluster, ("prefill-0", "prefill-1", "decode-1"))


async def test_losing_the_prefill_worker_that_holds_the_kv_falls_back_to_recompute(cluster):
    requests = [
        request(f"fallback-{i}", seed=30 + i, recovery_policy="always_migrate") for i in range(2)
    ]
    streams = await run_and_kill(cluster, requests, ["prefill-0", "decode-0"])
    for stream in streams:
        assert_exact(stream)
        attempts = stream.summary.recoveries
        assert [r.action for r in attempts] == [MIGRATE, RECOMPUTE]
        assert not attempts[0].succeeded
        assert attempts[1].detected_by == "transfer"
        assert attempts[1].failed_instance_id == "prefill-0"
        assert attempts[1].source_instance_id == "prefill-1"
        assert attempts[1].succeeded
    await assert_nothing_leaked(cluster, ("prefill-1", "decode-1"))


async def stream_under_way(channel, stream: Stream, tokens: int = 10) -> asyncio.Task:
    """Starts `stream` through the router on `channel`; returns its task once `tokens`
    tokens have arrived (the stream still running)."""
    task = asyncio.create_task(run_stream(router_pb2_grpc.RouterServiceStub(channel), stream))
    while len(stream.tokens) < tokens:
        assert not task.done(), stream.error
        await asyncio.sleep(0.001)
    return task


async def streaming_again(stream: Stream, more_tokens: int, timeout_s: float = 60.0) -> None:
    """Until `more_tokens` more tokens of `stream` have arrived."""
    target = len(stream.tokens) + more_tokens
    deadline = time.monotonic() + timeout_s
    while len(stream.tokens) < target:
        assert stream.error is None and stream.summary is None, describe(stream)
        assert time.monotonic() < deadline, f"no {more_tokens} more tokens in {timeout_s} s"
        await asyncio.sleep(0.005)


async def _wait_state(cluster, instance_id: str, state: str, timeout_s: float = 10.0) -> None:
    async with GossipClient(cluster.address("gossip"), timeout_s=2) as gossip:
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = {
                n.registration.instance_id: n for n in await gossip.list_nodes(include_down=True)
            }
            if instance_id in nodes and nodes[instance_id].state == state:
                return
            assert time.monotonic() < deadline, f"gossip never listed {instance_id} {state}"
            await asyncio.sleep(0.05)


async def test_a_prefill_worker_starved_past_its_ttl_keeps_the_kv_a_migration_reads(cluster):
    """SIGSTOP longer than the heartbeat TTL: gossip declares prefill-0 failed, though it
    lost nothing. After SIGCONT it registers again and must still hold the KV it
    prefilled, so when decode-0 then dies the migration from prefill-0 succeeds."""
    stream = Stream(
        request("starved-prefill", seed=40, max_new_tokens=4000, recovery_policy="always_migrate")
    )
    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        task = await stream_under_way(channel, stream)
        cluster.signal("prefill-0", signal.SIGSTOP)
        try:
            await _wait_state(cluster, "prefill-0", "failed")
        finally:
            cluster.signal("prefill-0", signal.SIGCONT)
        await cluster.wait_alive(["prefill-0"])
        cluster.signal("decode-0", signal.SIGSTOP)
        cluster.kill("decode-0")
        assert len(stream.tokens) < 4000, "the request ended before decode-0 died"
        await task
    assert_exact(stream)
    assert [(r.action, r.succeeded) for r in stream.summary.recoveries] == [(MIGRATE, True)], [
        r.error for r in stream.summary.recoveries
    ]
    (recovery,) = stream.summary.recoveries
    assert recovery.source_instance_id == "prefill-0"
    assert recovery.succeeded
    await assert_nothing_leaked(cluster, ("prefill-0", "prefill-1", "decode-1"))


async def test_a_recovery_with_no_decode_worker_left_waits_for_one_even_one_that_failed_it(
    cluster,
):
    """decode-1 is down when decode-0 dies: the recovery finds nothing to recover to, waits
    (ROUTER_INSTANCE_WAIT_S) while decode-1 restarts, and resumes the stream there. Then
    decode-0 is restarted and decode-1 dies too: the new decode-0 is a new process, so the
    request recovers there, where before it was excluded for what its predecessor did,
    waited for an instance it could use and failed."""
    cluster.kill("decode-1")
    await _wait_state(cluster, "decode-1", "failed")
    stream = Stream(request("waits-for-a-decode-worker", seed=50, max_new_tokens=3000))
    async with grpc.aio.insecure_channel(cluster.address("router")) as channel:
        task = await stream_under_way(channel, stream)
        cluster.signal("decode-0", signal.SIGSTOP)
        cluster.kill("decode-0")
        assert len(stream.tokens) < 3000, "the request ended before decode-0 died"
        await asyncio.to_thread(cluster.restart, "decode-1")
        await streaming_again(stream, more_tokens=10)  # on decode-1, its recovery done
        # Paused on decode-1 until decode-0 is back, so the stream is still running.
        cluster.signal("decode-1", signal.SIGSTOP)
        await asyncio.to_thread(cluster.restart, "decode-0")
        cluster.kill("decode-1")
        assert len(stream.tokens) < 3000, "the request ended before decode-1 died"
        await task
    assert_exact(stream)
    first, second = stream.summary.recoveries
    assert first.failed_instance_id == "decode-0", describe(stream)
    assert first.succeeded and first.target_instance_id == "decode-1", describe(stream)
    # The decision waited for decode-1 to register: far longer than one Recover call.
    assert first.decision_s > 1.0, first.decision_s
    assert second.failed_instance_id == "decode-1", describe(stream)
    assert second.succeeded and second.target_instance_id == "decode-0", describe(stream)
    await assert_nothing_leaked(cluster, ("prefill-0", "prefill-1", "decode-0"))
