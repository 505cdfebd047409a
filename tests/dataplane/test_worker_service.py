"""WorkerService over real gRPC between worker processes: hand-off, migration, HYBRID,
RECOMPUTE, errors, health, draining."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from worker_procs import WorkerProcess, stub

from kvrs.cli.launcher import free_ports
from kvrs.tokenizer import encode, prefix_block_hashes
from kvrs.v1 import worker_pb2 as pb
from kvrs.v1.common_pb2 import SamplingParams
from tests import tiny_reference

PROMPT = encode("Network-aware placement of the decode phase, and recovery of its KV.")
L = len(PROMPT)


@pytest.fixture(scope="module")
def metrics_addrs() -> dict[str, str]:
    """The Prometheus endpoint of each worker."""
    names = ("prefill-a", "decode-b", "decode-c")
    return {name: f"127.0.0.1:{port}" for name, port in zip(names, free_ports(3), strict=True)}


@pytest.fixture(scope="module")
def workers(metrics_addrs):
    """prefill-a, decode-b, decode-c: started together (each start imports torch)."""
    started = [
        WorkerProcess.start(
            name, "prefill" if name.startswith("prefill") else "decode", KVRS_METRICS_ADDR=address
        )
        for name, address in metrics_addrs.items()
    ]
    try:
        yield {w.instance_id: w.ready() for w in started}
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture
async def stubs(workers):
    channels = {}
    stubs = {}
    for name, worker in workers.items():
        channels[name], stubs[name] = stub(worker.address)
    yield stubs
    for channel in channels.values():
        await channel.close()


@pytest.fixture(scope="module")
def reference():
    """What one uninterrupted transformers generate makes of PROMPT: 25 greedy tokens."""
    return None, tiny_reference.reference(tuple(PROMPT), 25)


async def decode(worker_stub, request_id, generated, max_new_tokens, **kwargs):
    request = pb.DecodeRequest(
        request_id=request_id,
        generated_token_ids=generated,
        max_new_tokens=max_new_tokens,
        **kwargs,
    )
    return [m async for m in worker_stub.Decode(request, timeout=60)]


async def pull(worker_stub, source, request_id, start, end, **kwargs):
    return await worker_stub.PullKv(
        pb.PullKvRequest(
            request_id=request_id,
            source_instance_id=source.instance_id,
            source_address=source.address,
            token_start=start,
            token_end=end,
            **kwargs,
        ),
        timeout=60,
    )


async def test_handoff_decodes_exactly_what_one_process_would(workers, stubs, reference):
    _, expected = reference
    a, b = stubs["prefill-a"], stubs["decode-b"]
    prefill = await a.Prefill(pb.PrefillRequest(request_id="r-handoff", prompt_token_ids=PROMPT))
    assert prefill.first_token_id == expected[0]
    assert prefill.kv_bytes == L * 1024
    pulled = await pull(b, workers["prefill-a"], "r-handoff", 0, L)
    assert (pulled.resident_tokens, pulled.transferred_kv_bytes) == (L, L * 1024)
    tokens = await decode(b, "r-handoff", [prefill.first_token_id], 12)
    assert [t.token_id for t in tokens] == expected[1:13]
    assert [t.index for t in tokens] == list(range(1, 13))
    assert tokens[-1].last and not tokens[0].last
    # The prefill side still holds the prompt's KV (for a migration) until released.
    stats = await a.GetWorkerStats(pb.GetWorkerStatsRequest())
    assert stats.resident_requests >= 1
    released = await a.ReleaseKv(pb.ReleaseKvRequest(request_id="r-handoff"))
    assert released.released and released.freed_kv_bytes == L * 1024
    again = await a.ReleaseKv(pb.ReleaseKvRequest(request_id="r-handoff"))
    assert not again.released


async def test_a_pull_sent_with_the_prefill_streams_the_kv_as_it_is_computed(
    workers, stubs, reference
):
    """Layer-wise streaming: the decode worker's pull leaves before the prefill has even
    reached the prefill worker; each layer streams once computed, and the KV decodes
    exactly as after a hand-off."""
    _, expected = reference
    a, b = stubs["prefill-a"], stubs["decode-b"]
    pulling = asyncio.ensure_future(
        pull(b, workers["prefill-a"], "r-streamed", 0, L, while_prefilling=True)
    )
    await asyncio.sleep(0.2)  # the SendKv waits on the prefill worker for the request
    assert not pulling.done()
    prefill = await a.Prefill(pb.PrefillRequest(request_id="r-streamed", prompt_token_ids=PROMPT))
    pulled = await pulling
    assert (pulled.resident_tokens, pulled.transferred_kv_bytes) == (L, L * 1024)
    tokens = await decode(b, "r-streamed", [prefill.first_token_id], 12)
    assert [prefill.first_token_id, *(t.token_id for t in tokens)] == expected[:13]


async def test_a_streamed_pull_whose_prefill_never_comes_fails_and_keeps_nothing(workers, stubs):
    a, b = stubs["prefill-a"], stubs["decode-b"]
    before = await b.GetWorkerStats(pb.GetWorkerStatsRequest())
    bad = pb.PullKvRequest(
        request_id="r-never",
        source_instance_id="prefill-a",
        source_address=workers["prefill-a"].address,
        token_start=0,
        token_end=L,
        while_prefilling=True,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        # Shorter than the source's wait for the request: the caller gives up first.
        await b.PullKv(bad, timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(50):
        after = await b.GetWorkerStats(pb.GetWorkerStatsRequest())
        if after.resident_requests == before.resident_requests:
            break
        await asyncio.sleep(0.1)
    assert after.resident_requests == before.resident_requests
    assert after.free_kv_blocks == before.free_kv_blocks
    # The pair between the two workers still works.
    await a.Prefill(pb.PrefillRequest(request_id="r-after-never", prompt_token_ids=PROMPT))
    pulled = await pull(b, workers["prefill-a"], "r-after-never", 0, L, while_prefilling=True)
    assert pulled.resident_tokens == L


def scrape(address: str) -> dict[str, float]:
    """Every sample of a Prometheus endpoint, by its line's name and labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line and not line.startswith("#")
    }


async def test_metrics_count_transfer_bytes_rates_and_decode_outcomes(
    workers, stubs, metrics_addrs
):
    sent, received = (
        'kvrs_transfer_bytes_total{direction="sent"}',
        'kvrs_transfer_bytes_total{direction="received"}',
    )
    rates, completed = "kvrs_transfer_rate_bps_count", 'kvrs_requests_total{outcome="completed"}'
    before = {name: scrape(address) for name, address in metrics_addrs.items()}
    a, b = stubs["prefill-a"], stubs["decode-b"]
    prefill = await a.Prefill(pb.PrefillRequest(request_id="r-metrics", prompt_token_ids=PROMPT))
    await pull(b, workers["prefill-a"], "r-metrics", 0, L)
    tokens = await decode(b, "r-metrics", [prefill.first_token_id], 3, release_when_done=True)
    assert len(tokens) == 3
    await a.ReleaseKv(pb.ReleaseKvRequest(request_id="r-metrics"))
    after = {name: scrape(address) for name, address in metrics_addrs.items()}

    def grew(name: str, sample: str) -> float:
        return after[name].get(sample, 0.0) - before[name].get(sample, 0.0)

    assert grew("prefill-a", sent) == L * 1024
    assert grew("decode-b", received) == L * 1024
    assert grew("prefill-a", rates) == grew("decode-b", rates) == 1
    assert after["decode-b"]["kvrs_transfer_rate_bps_sum"] > 0
    assert grew("decode-b", completed) == 1
    assert grew("decode-c", received) == 0


async def test_decode_right_after_prefill_on_the_same_worker(stubs, reference):
    _, expected = reference
    a = stubs["prefill-a"]
    await a.Prefill(pb.PrefillRequest(request_id="r-local", prompt_token_ids=PROMPT))
    tokens = await decode(a, "r-local", [], 5, release_when_done=True)
    assert [t.token_id for t in tokens] == expected[:5]
    assert [t.index for t in tokens] == list(range(5))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await decode(a, "r-local", expected[:5], 1)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_migration_after_a_decode_worker_dies_continues_exactly(workers, stubs, reference):
    """MIGRATE: the prompt KV still on the prefill worker goes to a new decode worker,
    which rebuilds the generated tokens' KV (extend) and continues."""
    _, expected = reference
    a, c = stubs["prefill-a"], stubs["decode-c"]
    victim = WorkerProcess.start("decode-victim", "decode").ready()
    channel, v = stub(victim.address)
    try:
        first = (
            await a.Prefill(pb.PrefillRequest(request_id="r-migrate", prompt_token_ids=PROMPT))
        ).first_token_id
        await pull(v, workers["prefill-a"], "r-migrate", 0, L)
        received = [first]
        stream = v.Decode(
            pb.DecodeRequest(
                request_id="r-migrate", generated_token_ids=[first], max_new_tokens=100
            ),
            timeout=60,
        )
        async for message in stream:
            received.append(message.token_id)
            if len(received) == 7:
                break
        stream.cancel()
        victim.kill()
    finally:
        await channel.close()
        victim.stop()
    assert received == expected[:7]
    await pull(c, workers["prefill-a"], "r-migrate", 0, L)
    tokens = await decode(c, "r-migrate", received, 6)
    assert [t.token_id for t in tokens] == expected[7:13]
    assert tokens[0].index == 7


async def test_extend_rebuilds_generated_tokens_after_a_pull(workers, stubs, reference):
    _, expected = reference
    a, b = stubs["prefill-a"], stubs["decode-b"]
    await a.Prefill(pb.PrefillRequest(request_id="r-extend", prompt_token_ids=PROMPT))
    await pull(b, workers["prefill-a"], "r-extend", 0, L)
    extended = await b.Extend(pb.ExtendRequest(request_id="r-extend", token_ids=expected[:4]))
    assert extended.next_token_id == expected[4]
    assert extended.resident_tokens == L + 4
    tokens = await decode(b, "r-extend", expected[:5], 3)
    assert [t.token_id for t in tokens] == expected[5:8]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await decode(b, "r-extend", [expected[0], (expected[1] + 1) % 256, *expected[2:8]], 1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "generated_token_ids" in info.value.details()


async def test_hybrid_recomputes_a_prefix_while_the_rest_streams(workers, stubs, reference):
    _, expected = reference
    a, c = stubs["prefill-a"], stubs["decode-c"]
    first = (
        await a.Prefill(pb.PrefillRequest(request_id="r-hybrid", prompt_token_ids=PROMPT))
    ).first_token_id
    k = 29
    pulled = await pull(c, workers["prefill-a"], "r-hybrid", k, L, prefix_token_ids=PROMPT[:k])
    assert pulled.recomputed_tokens == k
    assert pulled.transferred_kv_bytes == (L - k) * 1024
    assert pulled.resident_tokens == L
    tokens = await decode(c, "r-hybrid", [first], 10)
    assert [t.token_id for t in tokens] == expected[1:11]


async def test_recompute_on_a_prefill_worker_then_pull(workers, stubs, reference):
    """RECOMPUTE: prefill prompt + generated tokens anew, pull that, continue."""
    _, expected = reference
    a, b = stubs["prefill-a"], stubs["decode-b"]
    g = 5
    sequence = PROMPT + expected[:g]
    recomputed = await a.Prefill(
        pb.PrefillRequest(request_id="r-recompute", prompt_token_ids=sequence)
    )
    assert recomputed.first_token_id == expected[g]
    await pull(b, workers["prefill-a"], "r-recompute", 0, L + g, prompt_tokens=L)
    tokens = await decode(b, "r-recompute", expected[: g + 1], 4)
    assert [t.token_id for t in tokens] == expected[g + 1 : g + 5]


async def test_bad_input_is_invalid_argument_naming_the_field(workers, stubs):
    a, b = stubs["prefill-a"], stubs["decode-b"]
    cases = [
        (a.Prefill(pb.PrefillRequest(request_id="r-bad", prompt_token_ids=[])), "prompt_token_ids"),
        (
            a.Prefill(pb.PrefillRequest(request_id="r-bad", prompt_token_ids=[1, 2, 100000])),
            "prompt_token_ids[2]",
        ),
        (a.Prefill(pb.PrefillRequest(request_id="", prompt_token_ids=[1])), "request_id"),
        (
            a.Prefill(pb.PrefillRequest(request_id="r-bad", prompt_token_ids=[1], lease_s=-1)),
            "lease_s",
        ),
        (pull(b, workers["prefill-a"], "r-bad", 5, 5), "token_end"),
        (pull(b, workers["prefill-a"], "r-bad", 2, 5, prefix_token_ids=[1]), "prefix_token_ids"),
        (
            b.PullKv(
                pb.PullKvRequest(request_id="r-bad", source_instance_id="prefill-a", token_end=4)
            ),
            "source_address",
        ),
        (
            b.PullKv(
                pb.PullKvRequest(
                    request_id="r-bad",
                    source_instance_id="prefill-a",
                    source_address="\x00",
                    token_end=4,
                )
            ),
            "source_address",
        ),
        # The pair's rendezvous keys carry the source's id: the store refuses huge keys
        # and drops the connection every later transfer needs.
        (
            b.PullKv(
                pb.PullKvRequest(
                    request_id="r-bad",
                    source_instance_id="p" * 9000,
                    source_address="127.0.0.1:1",
                    token_end=4,
                )
            ),
            "source_instance_id",
        ),
        (
            a.Prefill(
                pb.PrefillRequest(request_id="r-bad", prompt_token_ids=[1], lease_s=float("nan"))
            ),
            "lease_s",
        ),
        (pull(b, workers["prefill-a"], "r-bad", 0, 4, pacing_bps=1e-3), "pacing_bps"),
    ]
    for call, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert info.value.details().startswith(f"{field}:"), info.value.details()
    await a.Prefill(pb.PrefillRequest(request_id="r-bad-decode", prompt_token_ids=[1, 2]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await decode(a, "r-bad-decode", [], 0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("max_new_tokens:")


async def test_unknown_request_is_not_found(workers, stubs):
    a, b = stubs["prefill-a"], stubs["decode-b"]
    for call in (
        decode(b, "r-nobody", [1], 3),
        b.Extend(pb.ExtendRequest(request_id="r-nobody", token_ids=[1])),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "r-nobody" in info.value.details()
    # The source does not hold it: the pull fails with the source's NOT_FOUND, and the
    # pair between the two workers keeps working afterwards.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await pull(b, workers["prefill-a"], "r-nobody", 0, 8)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    await a.Prefill(pb.PrefillRequest(request_id="r-after-missing", prompt_token_ids=PROMPT))
    pulled = await pull(b, workers["prefill-a"], "r-after-missing", 0, L)
    assert pulled.resident_tokens == L


async def test_pull_of_a_range_beyond_the_source_is_rejected(workers, stubs):
    a, b = stubs["prefill-a"], stubs["decode-b"]
    await a.Prefill(pb.PrefillRequest(request_id="r-short", prompt_token_ids=PROMPT[:10]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await pull(b, workers["prefill-a"], "r-short", 0, 20)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_end" in info.value.details()


async def test_health_is_serving_and_stats_describe_the_worker(workers, stubs):
    worker = workers["decode-c"]
    async with grpc.aio.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="kvrs.v1.WorkerService"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stats = await stubs["decode-c"].GetWorkerStats(pb.GetWorkerStatsRequest())
    assert (stats.instance_id, stats.model, stats.dtype) == ("decode-c", "tiny", "float64")
    assert stats.transfer_address == worker.transfer_address
    assert stats.kv_capacity_blocks == (1 << 30) // (512 * 1024)
    assert stats.free_kv_blocks == stats.kv_capacity_blocks - stats.resident_requests


async def test_sigterm_drains_a_running_decode_stream():
    """SIGTERM: health turns NOT_SERVING and new calls are refused, while the decode
    stream already running is served to its end; then the process exits 0."""
    env = dict(
        os.environ,
        WORKER_INSTANCE_ID="drain-me",
        WORKER_LISTEN_ADDR="127.0.0.1:0",
        KVRS_SHUTDOWN_GRACE_S="90",
        KVRS_LOG_LEVEL="INFO",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "services.worker", "--role", "decode"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = await asyncio.wait_for(asyncio.to_thread(_serving_address, process), 90)
        channel, worker = stub(address)
        async with channel:
            await worker.Prefill(pb.PrefillRequest(request_id="r-drain", prompt_token_ids=PROMPT))
            stream = worker.Decode(
                pb.DecodeRequest(request_id="r-drain", max_new_tokens=500), timeout=120
            )
            tokens = [await stream.read()]
            process.send_signal(signal.SIGTERM)
            health = health_pb2_grpc.HealthStub(channel)
            while await _serving(health):
                await asyncio.sleep(0.01)
            assert await _refused(worker) in REFUSED
            while (message := await stream.read()) is not grpc.aio.EOF:
                tokens.append(message)
            assert len(tokens) == 500 and tokens[-1].last
        assert await asyncio.to_thread(process.wait, 60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


REFUSED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
"""How a stopping server turns a new call away: UNAVAILABLE, or CANCELLED for a call
that arrived as the shutdown began."""


async def _serving(health: health_pb2_grpc.HealthStub) -> bool:
    """Health says SERVING (a server already refusing calls is not serving)."""
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.aio.AioRpcError as exc:
        if exc.code() not in REFUSED:
            raise
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _refused(worker) -> grpc.StatusCode:
    """The code a new call ends with once the worker stops taking calls (health turns
    NOT_SERVING just before the server refuses them)."""
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline:
        try:
            await worker.GetWorkerStats(pb.GetWorkerStatsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        await asyncio.sleep(0.01)
    raise AssertionError("the draining worker still answers new calls")


def _serving_address(process: subprocess.Popen) -> str:
    """The address from the worker's "serving on" log line; its log is drained afterwards."""
    for line in process.stderr:
        found = re.search(r"serving on (\S+), transfers on", line)
        if found:
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return found.group(1)
    raise RuntimeError("worker exited before serving")


def sampled_reference(sampling: SamplingParams, tokens: int) -> list[int]:
    """What one process draws for PROMPT, uninterrupted: token i from uniform(seed, i)."""
    from kvrs.sampling import Sampling
    from services.worker.model import Transformer
    from services.worker.sampling import choose

    model = Transformer.load("tiny")
    params = Sampling.of(sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed)
    cache, logits = model.prefill(PROMPT)
    out = [choose(logits, params, 0)]
    while len(out) < tokens:
        out.append(choose(model.decode_step(cache, out[-1]), params, len(out)))
    return out


async def test_a_sampled_request_draws_the_same_tokens_through_handoff_migration_and_recompute(
    workers, stubs
):
    """Every worker draws token i from (seed, i): a request sampled at temperature 0.8
    that moves prefill → decode-b → (MIGRATE) decode-c → (RECOMPUTE) decode-b streams
    what one uninterrupted process draws."""
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=2026)
    expected = sampled_reference(sampling, 24)
    assert expected != tiny_reference.reference(tuple(PROMPT), 24)
    a, b, c = stubs["prefill-a"], stubs["decode-b"], stubs["decode-c"]
    prefill = await a.Prefill(
        pb.PrefillRequest(request_id="r-sampled", prompt_token_ids=PROMPT, sampling=sampling)
    )
    got = [prefill.first_token_id]
    await pull(b, workers["prefill-a"], "r-sampled", 0, L)
    got += [t.token_id for t in await decode(b, "r-sampled", got, 7, sampling=sampling)]
    # MIGRATE to decode-c: the prompt's KV from the prefill worker, generated tokens rebuilt.
    await pull(c, workers["prefill-a"], "r-sampled", 0, L)
    got += [t.token_id for t in await decode(c, "r-sampled", got, 8, sampling=sampling)]
    # RECOMPUTE prompt + generated[:-1] on the prefill worker, pull it, extend the last one.
    context = PROMPT + got[:-1]
    recomputed = await a.Prefill(
        pb.PrefillRequest(
            request_id="r-sampled~r1",
            prompt_token_ids=context,
            sampling=sampling,
            prompt_tokens=L,
        )
    )
    assert recomputed.first_token_id == got[-1]
    await pull(b, workers["prefill-a"], "r-sampled~r1", 0, len(context), prompt_tokens=L)
    extended = await b.Extend(
        pb.ExtendRequest(request_id="r-sampled~r1", token_ids=got[-1:], sampling=sampling)
    )
    got.append(extended.next_token_id)
    got += [t.token_id for t in await decode(b, "r-sampled~r1", got, 7, sampling=sampling)]
    assert got == expected
    for worker, request_id in ((a, "r-sampled"), (a, "r-sampled~r1"), (b, "r-sampled~r1")):
        await worker.ReleaseKv(pb.ReleaseKvRequest(request_id=request_id))


async def test_a_shared_1024_token_prefix_is_reused_not_recomputed_nor_moved(workers, stubs):
    """The second request sharing a 1,024-token prefix: the prefill worker computes only
    its suffix, the decode worker, already holding the prefix blocks, receives only the
    suffix; the tokens are those of a cold run."""
    a, b = stubs["prefill-a"], stubs["decode-b"]
    shared = [(7 * i + 3) % 256 for i in range(1024)]
    first, second = shared + encode("first question?"), shared + encode("and another one")
    cold = tiny_reference.reference(tuple(second), 12)
    one = await a.Prefill(pb.PrefillRequest(request_id="r-prefix-1", prompt_token_ids=first))
    assert one.prefix_hit_tokens == 0
    await pull(b, workers["prefill-a"], "r-prefix-1", 0, len(first))
    two = await a.Prefill(pb.PrefillRequest(request_id="r-prefix-2", prompt_token_ids=second))
    assert two.prefix_hit_tokens == 1024
    assert two.first_token_id == cold[0]
    # The target holds the prefix blocks: only [1024, L) crosses the network.
    pulled = await pull(
        b, workers["prefill-a"], "r-prefix-2", 1024, len(second), prefix_token_ids=shared
    )
    assert pulled.recomputed_tokens == 0
    assert pulled.transferred_kv_bytes == (len(second) - 1024) * 1024
    tokens = await decode(b, "r-prefix-2", [two.first_token_id], 11, release_when_done=True)
    assert [two.first_token_id, *(t.token_id for t in tokens)] == cold
    stats = await b.GetWorkerStats(pb.GetWorkerStatsRequest())
    assert set(prefix_block_hashes(shared, 512)) <= set(stats.resident_prefix_hashes)
    for request_id in ("r-prefix-1", "r-prefix-2"):
        await a.ReleaseKv(pb.ReleaseKvRequest(request_id=request_id))
    await b.ReleaseKv(pb.ReleaseKvRequest(request_id="r-prefix-1"))
