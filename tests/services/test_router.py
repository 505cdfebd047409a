"""Router over an in-process cluster (real gossip, slot broker, scheduler, tiny workers):
token-exact streams, bad input, one trace per request, recovery when a decode instance
goes away (its stream breaks, or gossip says it left), batching, and nothing leaked."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import grpc
import pytest
import redis.asyncio as redis_async

from kvrs.rpc.generate import generate_into
from kvrs.tokenizer import prefix_block_hashes
from kvrs.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.gossip_records import LinkSample
from services.common.redis_store import Keys
from services.scheduler.outcomes import OutcomeLog
from services.worker.paged_kv import FillProgress
from tests.services.router_plane import WORKERS, Plane
from tests.tiny_reference import reference

pytestmark = pytest.mark.timeout(90)

PROMPT = tuple((5 * i + 3) % 250 for i in range(48))


@pytest.fixture
async def plane(redis_url, redis_prefix):
    cluster = Plane(redis_url, redis_prefix)
    await cluster.start()
    yield cluster
    await cluster.stop()


def router(plane: Plane) -> router_pb2_grpc.RouterServiceStub:
    return router_pb2_grpc.RouterServiceStub(plane.channel("router"))


async def collect(stub, request: router_pb2.GenerateRequest, tokens: list[int] | None = None):
    """(tokens, summary, error) of one Generate stream; `tokens`, when given, is the list
    the tokens are appended to as they arrive (a caller watches it)."""
    tokens = [] if tokens is None else tokens
    summary, error = await generate_into(stub, request, tokens, 60)
    return tokens, summary, error


def generate(request_id: str, prompt=PROMPT, max_new_tokens: int = 24, **fields):
    return router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        max_new_tokens=max_new_tokens,
        **fields,
    )


async def test_one_request_streams_the_reference_tokens_under_one_trace(plane):
    tokens, summary, error = await collect(router(plane), generate("r-one"))
    assert error is None
    assert tokens == reference(PROMPT, 24)
    assert summary.generated_tokens == 24
    assert summary.prompt_tokens == len(PROMPT)
    assert summary.finish_reason == "length"
    assert summary.kv_bytes == len(PROMPT) * 1024
    assert summary.final_decode_instance_id == summary.decode_instance_id
    assert summary.decode_instance_id.startswith("decode-")
    assert not summary.recoveries
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert await plane.resident_requests(name) == 0

    spans = plane.exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "router.generate"]
    assert format(root.context.trace_id, "032x") == summary.trace_id
    in_trace = {s.name for s in spans if s.context.trace_id == root.context.trace_id}
    assert {
        "router.prefill",
        "router.select_decode",
        "kvrs.select_decode",
        "router.pull_kv",
        "kvxfer.send",
        "kvxfer.recv",
        "/kvrs.v1.WorkerService/Decode",
    } <= in_trace
    assert root.attributes["kvrs.outcome"] == "completed"


async def slow_paths_from_prefill_0(plane) -> None:
    """Reports prefill-0's paths to both decode instances at 1 Mbit/s, and waits until
    the scheduler's view prices them so."""
    for decode in ("decode-0", "decode-1"):
        await plane.gossip.report_link_sample(
            LinkSample("prefill-0", decode, bandwidth_bps=1e6, rtt_s=1e-4, samples=4)
        )
    view = plane.handles["scheduler"].view
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        current = view.current()
        rates = [
            current.cost.network.rate_and_rtt("prefill-0", d, current.cluster.now_s)[0]
            for d in ("decode-0", "decode-1")
        ]
        if max(rates) <= 2e6:
            return
        assert asyncio.get_running_loop().time() < deadline, f"view still prices {rates}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(("policy", "prefill"), [("kvrs", "prefill-1"), ("netkv", "prefill-0")])
async def test_the_prompt_prefills_where_a_joint_placement_policy_puts_it(plane, policy, prefill):
    """Both prefill instances idle, the prefill rule alone takes prefill-0 (the lower id);
    its paths to both decode instances measure 1 Mbit/s. kvrs chooses prefill and decode
    together, so the router asks before the prefill and the prompt goes to prefill-1;
    netkv places the decode side only, and the prompt stays on prefill-0."""
    await slow_paths_from_prefill_0(plane)
    request = generate(f"r-joint-{policy}", placement_policy=policy)
    tokens, summary, error = await collect(router(plane), request)
    assert error is None
    assert tokens == reference(PROMPT, 24)
    assert summary.prefill_instance_id == prefill
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert await plane.resident_requests(name) == 0


async def test_a_prefill_instance_the_joint_choice_moved_to_that_is_gone_costs_no_request(plane):
    """kvrs moves the prompt to prefill-1 (prefill-0's paths are slow), but prefill-1's
    server is gone while its heartbeats go on (gossip still lists it): the prefill fails,
    and the router prefills on prefill-0 instead, with a placement of its own."""
    await slow_paths_from_prefill_0(plane)
    await plane.handles["prefill-1"].server.stop(0)
    request = generate("r-joint-gone", placement_policy="kvrs")
    tokens, summary, error = await collect(router(plane), request)
    assert error is None
    assert tokens == reference(PROMPT, 24)
    assert summary.prefill_instance_id == "prefill-0"
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert await plane.resident_requests(name) == 0
    (prefill_span,) = [
        s
        for s in plane.exporter.get_finished_spans()
        if s.name == "router.prefill"
        and s.attributes.get("kvrs.request_id") == "r-joint-gone"
        and s.attributes.get("kvrs.instance_id") == "prefill-1"
    ]
    assert not prefill_span.status.is_ok


@pytest.mark.parametrize(
    ("stream_kv", "min_tokens", "streamed"),
    [(True, len(PROMPT), True), (False, 0, False), (True, len(PROMPT) + 1, False)],
    ids=["streamed", "after-the-prefill", "prompt-too-short-to-stream"],
)
async def test_kv_streamed_under_the_prefill_or_pulled_after_it_gives_the_same_tokens(
    redis_url, redis_prefix, stream_kv, min_tokens, streamed
):
    cluster = Plane(redis_url, redis_prefix)
    await cluster.start(stream_kv=stream_kv, stream_kv_min_tokens=min_tokens)
    try:
        tokens, summary, error = await collect(router(cluster), generate("r-stream"))
        assert error is None
        assert tokens == reference(PROMPT, 24)
        assert summary.kv_bytes == len(PROMPT) * 1024
        (pull,) = [s for s in cluster.exporter.get_finished_spans() if s.name == "router.pull_kv"]
        assert pull.attributes["kvrs.transfer.streamed"] is streamed
        client = redis_async.Redis.from_url(cluster.redis_url)
        try:
            log = OutcomeLog(client, Keys(cluster.redis_prefix), capacity=64)
            stored: list = []
            for _ in range(100):
                stored = [o for o in await log.read() if o.request_id == "r-stream"]
                if stored:
                    break
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        (outcome,) = stored
        # A streamed transfer's time is what the prefill left of it: no link is fitted on it.
        assert outcome.kind == "placement" and outcome.streamed is streamed
        if streamed:
            assert outcome.measured.setup_s == 0.0 and outcome.predicted.setup_s == 0.0
        for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
            assert await cluster.resident_requests(name) == 0
    finally:
        await cluster.stop()


async def test_a_decode_worker_lost_while_the_kv_streams_under_the_prefill_is_recovered(
    redis_url, redis_prefix, monkeypatch
):
    """decode-0 goes away after the prefill has written its first layer and while decode-0
    receives the KV layer by layer; the request still streams the reference tokens, from a
    recovery, and no worker keeps its KV."""
    first_layer_written = threading.Event()
    resume = threading.Event()
    advance = FillProgress.advance

    def advance_then_hold(self: FillProgress, layer: int, end: int) -> None:
        advance(self, layer, end)
        if layer == 0 and not resume.is_set():
            # The prefill's compute thread stops between its first and second layer.
            first_layer_written.set()
            resume.wait(30.0)

    monkeypatch.setattr(FillProgress, "advance", advance_then_hold)
    cluster = Plane(redis_url, redis_prefix)
    await cluster.start(stream_kv=True, stream_kv_min_tokens=len(PROMPT))
    try:
        request = generate("r-lost-streaming", decode_instance_id="decode-0")
        task = asyncio.create_task(collect(router(cluster), request))
        try:
            assert await asyncio.to_thread(first_layer_written.wait, 30.0)
            # decode-0 holds the request's entry from the moment its pull begins.
            deadline = asyncio.get_running_loop().time() + 10.0
            while await cluster.resident_requests("decode-0") == 0:
                assert asyncio.get_running_loop().time() < deadline, "decode-0 never pulled"
                await asyncio.sleep(0.01)
            await cluster.handles.pop("decode-0").stop(0)
        finally:
            resume.set()
        tokens, summary, error = await task
        assert error is None
        assert tokens == reference(PROMPT, 24)
        (recovery,) = summary.recoveries
        assert recovery.failed_instance_id == "decode-0"
        assert recovery.succeeded
        assert recovery.generated_tokens == 1
        assert recovery.target_instance_id == "decode-1"
        pulls = [s for s in cluster.exporter.get_finished_spans() if s.name == "router.pull_kv"]
        assert any(s.attributes["kvrs.transfer.streamed"] for s in pulls)
        for name in ("prefill-0", "prefill-1", "decode-1"):
            assert await cluster.resident_requests(name) == 0
    finally:
        await cluster.stop()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1, 100000]}, "prompt_token_ids[1]"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"ttft_slo_s": -1.0}, "ttft_slo_s"),
        ({"ttft_slo_s": math.nan}, "ttft_slo_s"),
        ({"deadline_unix_ms": -5}, "deadline_unix_ms"),
        ({"placement_policy": "fastest"}, "placement_policy"),
        ({"recovery_policy": "pray"}, "recovery_policy"),
        ({"sampling": {"temperature": -1.0}}, "sampling.temperature"),
        ({"sampling": {"temperature": 0.7, "top_p": 1.5}}, "sampling.top_p"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(plane, fields, field):
    request = generate("r-bad")
    for name, value in fields.items():
        if name == "prompt_token_ids":
            del request.prompt_token_ids[:]
            request.prompt_token_ids.extend(value)
        elif name == "sampling":
            request.sampling.CopyFrom(common_pb2.SamplingParams(**value))
        else:
            setattr(request, name, value)
    _, _, error = await collect(router(plane), request)
    assert error is not None
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}:"), error.details()
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert await plane.resident_requests(name) == 0


async def test_an_unknown_prefill_instance_is_not_found(plane):
    _, _, error = await collect(router(plane), generate("r-nf", prefill_instance_id="nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "prefill_instance_id" in error.details()


async def start_streams(plane, requests, min_tokens: int):
    stub = router(plane)
    progress = [[] for _ in requests]
    tasks = [
        asyncio.create_task(collect(stub, r, p)) for r, p in zip(requests, progress, strict=True)
    ]
    while min(len(p) for p in progress) < min_tokens:
        assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
        await asyncio.sleep(0.001)
    return tasks


async def test_requests_of_a_stopped_decode_worker_are_recovered_together(plane):
    requests = [
        generate(
            f"r-stop-{i}",
            prompt=PROMPT[: 30 + 6 * i],
            max_new_tokens=800,
            decode_instance_id="decode-0",
        )
        for i in range(3)
    ]
    tasks = await start_streams(plane, requests, min_tokens=5)
    await plane.handles.pop("decode-0").stop(0)
    results = await asyncio.gather(*tasks)
    for request, (tokens, summary, error) in zip(requests, results, strict=True):
        assert error is None
        assert tokens == reference(tuple(request.prompt_token_ids), 800)
        (recovery,) = summary.recoveries
        assert recovery.succeeded
        assert recovery.failed_instance_id == "decode-0"
        assert recovery.target_instance_id == "decode-1"
        assert recovery.batch_size == 3
        assert recovery.action != common_pb2.RECOVERY_ACTION_ABORT
        assert summary.final_decode_instance_id == "decode-1"
    assert plane.handles["router"].router.batcher.calls == 1
    recovered = plane.metrics.recovery_actual_s
    assert (
        sum(s.value for m in recovered.collect() for s in m.samples if s.name.endswith("_count"))
        == 3
    )
    assert await plane.slots_in_use() == 0
    for name in ("prefill-0", "prefill-1", "decode-1"):
        assert await plane.resident_requests(name) == 0


async def test_a_gossip_left_event_moves_a_healthy_stream_and_releases_its_kv(plane):
    request = generate(
        "r-left",
        max_new_tokens=1500,
        decode_instance_id="decode-0",
        recovery_policy="always_migrate",
    )
    (task,) = await start_streams(plane, [request], min_tokens=5)
    await plane.gossip.deregister("decode-0", "operator drained it")
    tokens, summary, error = await task
    assert error is None
    assert tokens == reference(PROMPT, 1500)
    (recovery,) = summary.recoveries
    assert recovery.detected_by == "gossip"
    assert recovery.action == common_pb2.RECOVERY_ACTION_MIGRATE
    assert recovery.succeeded
    # decode-0 still answers: the router released the KV it had there.
    assert await plane.resident_requests("decode-0") == 0
    # The recovery nests in the request's trace: decision at the scheduler, then the steps.
    spans = plane.exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    in_trace = [s for s in spans if format(s.context.trace_id, "032x") == summary.trace_id]

    def ancestors(span) -> list[str]:
        names = []
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
            names.append(span.name)
        return names

    (decide,) = [s for s in in_trace if s.name == "kvrs.recover"]
    assert ancestors(decide)[0] == "/kvrs.v1.SchedulerService/Recover"
    assert {"router.recover.decide", "router.recover", "router.generate"} <= set(ancestors(decide))
    (recover,) = [s for s in in_trace if s.name == "router.recover"]
    assert recover.attributes["kvrs.action"] == "migrate"
    assert recover.attributes["kvrs.detected_by"] == "gossip"
    recv = [
        s for s in in_trace if s.name == "kvxfer.recv" and "router.recover.execute" in ancestors(s)
    ]
    assert recv, "the migration's transfer is not in the request's trace"


async def test_no_decode_instance_left_ends_the_stream_unavailable_after_the_summary(plane):
    request = generate("r-none", max_new_tokens=1500, decode_instance_id="decode-0")
    (task,) = await start_streams(plane, [request], min_tokens=5)
    await plane.handles.pop("decode-1").stop(0)
    await plane.handles.pop("decode-0").stop(0)
    tokens, summary, error = await task
    assert error is not None
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode" in error.details()
    assert summary.finish_reason == "abort"
    assert summary.generated_tokens == len(tokens)
    assert tokens == reference(PROMPT, 1500)[: len(tokens)]
    assert await plane.resident_requests("prefill-0") == 0
    assert await plane.resident_requests("prefill-1") == 0


async def test_a_workers_measured_pace_reaches_gossip(plane):
    """After a request, the decode worker that ran it has timed its passes against its
    profile (GetWorkerStats.compute_factor) and heartbeats the factor to gossip."""
    _, summary, error = await collect(router(plane), generate("r-pace"))
    assert error is None
    name = summary.decode_instance_id
    stub = worker_pb2_grpc.WorkerServiceStub(plane.channel(name))
    stats = await stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5)
    assert stats.compute_factor > 0.0
    deadline = asyncio.get_running_loop().time() + 5.0
    while True:
        nodes = {n.registration.instance_id: n for n in await plane.gossip.list_nodes()}
        if nodes[name].load.compute_factor > 0.0:
            break
        assert asyncio.get_running_loop().time() < deadline, "no compute_factor in gossip"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("missing", "span_name", "event"),
    [
        ("decode", "router.select_decode", "kvrs.placement.waiting"),
        ("prefill", "router.generate", "kvrs.prefill.waiting"),
    ],
)
async def test_a_request_with_no_instance_to_use_waits_for_one_to_register(
    redis_url, redis_prefix, missing, span_name, event
):
    """No decode (or no prefill) worker is up when the request arrives: it waits
    (ROUTER_INSTANCE_WAIT_S) while one starts, then streams the reference tokens."""
    plane = Plane(redis_url, redis_prefix)
    await plane.start(workers=[w for w in WORKERS if w[1] != missing], instance_wait_s=30.0)
    try:
        task = asyncio.create_task(collect(router(plane), generate("r-waits")))
        await asyncio.sleep(1.0)
        assert not task.done(), task.result()
        await plane.add_worker(f"{missing}-0", missing)
        tokens, summary, error = await task
        assert error is None, error.details()
        assert tokens == reference(PROMPT, 24)
        assert getattr(summary, f"{missing}_instance_id") == f"{missing}-0"
        (span,) = [s for s in plane.exporter.get_finished_spans() if s.name == span_name]
        assert event in [e.name for e in span.events]
    finally:
        await plane.stop()


async def test_the_calls_grpc_deadline_bounds_the_wait_for_an_instance(redis_url, redis_prefix):
    """No prefill worker and a 60 s instance wait, but the call has 3 s: the router gives
    up before the call's deadline, DEADLINE_EXCEEDED saying why, instead of the call
    timing out with no word from it."""
    plane = Plane(redis_url, redis_prefix)
    await plane.start(workers=[w for w in WORKERS if w[1] == "decode"], instance_wait_s=60.0)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in router(plane).Generate(generate("r-deadline"), timeout=3.0):
                pass
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, raised.value.details()
        assert "deadline comes before an instance" in raised.value.details()
        assert "no alive prefill instance" in raised.value.details()
        waited_s = asyncio.get_running_loop().time() - started
        assert 2.0 < waited_s < 3.0, f"gave up after {waited_s:.2f} s"
    finally:
        await plane.stop()


async def test_a_recovery_waiting_for_an_instance_past_its_deadline_ends_deadline_exceeded(
    redis_url, redis_prefix
):
    """Both decode workers gone mid-stream, a 60 s instance wait, and the request due in
    4 s: the recovery waits for an instance until the request's deadline, then the stream
    ends DEADLINE_EXCEEDED saying so (not UNAVAILABLE, which a wait that outlived its
    configured limit ends with), its KV released."""
    plane = Plane(redis_url, redis_prefix)
    await plane.start(instance_wait_s=60.0)
    try:
        due_ms = int((time.time() + 4.0) * 1000)
        request = generate(
            "r-due", max_new_tokens=1500, decode_instance_id="decode-0", deadline_unix_ms=due_ms
        )
        (task,) = await start_streams(plane, [request], min_tokens=5)
        await plane.handles.pop("decode-1").stop(0)
        await plane.handles.pop("decode-0").stop(0)
        tokens, summary, error = await task
        assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "cannot continue after losing decode-0" in error.details(), error.details()
        assert "deadline comes before an instance" in error.details(), error.details()
        assert time.time() * 1000 >= due_ms - 500, "gave up long before the deadline"
        assert summary.finish_reason == "abort"
        assert tokens == reference(PROMPT, 1500)[: len(tokens)]
        assert await plane.resident_requests("prefill-0") == 0
        assert await plane.resident_requests("prefill-1") == 0
    finally:
        await plane.stop()


async def test_a_request_beyond_the_admission_limit_is_shed_at_once(redis_url, redis_prefix):
    """One request per alive decode instance: with two streams running, a third is
    refused RESOURCE_EXHAUSTED naming the limit, and admitted again once one ended."""
    plane = Plane(redis_url, redis_prefix)
    await plane.start(max_requests_per_decode=1)
    try:
        running = [generate(f"held-{i}", max_new_tokens=1500) for i in range(2)]
        tasks = await start_streams(plane, running, min_tokens=2)
        tokens, summary, error = await collect(router(plane), generate("shed"))
        assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_requests_per_decode" in error.details(), error.details()
        assert "2 alive decode instances" in error.details(), error.details()
        assert tokens == [] and summary is None
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        tokens, summary, error = await collect(router(plane), generate("admitted"))
        assert error is None and tokens == reference(PROMPT, 24)
        await tasks[1]
    finally:
        await plane.stop()


async def test_deadline_admission_refuses_only_a_request_its_share_would_finish_late(
    redis_url, redis_prefix
):
    """Two streams running set the delivery rate: a 1,000-token request due in 0.2 s,
    sharing it three ways, would be late at any rate below 15,000 tokens/s (this machine
    delivers far fewer), so it is refused at once, naming its deadline; a 24-token request
    with a minute to go is admitted."""
    plane = Plane(redis_url, redis_prefix)
    await plane.start(deadline_admission=True)
    try:
        running = [generate(f"paced-{i}", max_new_tokens=1500) for i in range(2)]
        tasks = await start_streams(plane, running, min_tokens=20)
        due_soon = generate(
            "due-soon", max_new_tokens=1000, deadline_unix_ms=int(time.time() * 1000) + 200
        )
        tokens, summary, error = await collect(router(plane), due_soon)
        assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details().startswith("deadline_unix_ms: "), error.details()
        assert "2 requests in flight" in error.details(), error.details()
        assert tokens == [] and summary is None
        in_time = generate("in-time", deadline_unix_ms=int(time.time() * 1000) + 60_000)
        tokens, summary, error = await collect(router(plane), in_time)
        assert error is None and tokens == reference(PROMPT, 24)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await plane.stop()


async def wait_until_released(plane: Plane, timeout_s: float = 10.0) -> None:
    """Until no worker holds KV (the router releases it as the stream ends)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        resident = {
            name: await plane.resident_requests(name)
            for name in ("prefill-0", "prefill-1", "decode-0", "decode-1")
        }
        if not any(resident.values()):
            return
        assert asyncio.get_running_loop().time() < deadline, f"KV left behind: {resident}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("hang_up_after", ["3 tokens", "the summary"])
async def test_a_client_that_hangs_up_leaves_no_kv_behind(plane, hang_up_after):
    """The OpenAI adapter cancels its call once it has the summary; a user may close a
    stream at any token. Either way the request's KV on prefill and decode is released."""
    max_new_tokens = 400 if hang_up_after == "3 tokens" else 8
    call = router(plane).Generate(
        generate(f"r-hangup-{len(hang_up_after)}", max_new_tokens=max_new_tokens), timeout=60
    )
    received = 0
    async for message in call:
        received += 1
        if message.HasField("summary") or (hang_up_after == "3 tokens" and received == 3):
            break
    call.cancel()
    await wait_until_released(plane)


def _count(histogram, **labels) -> float:
    """The observation count of one labelled series of a Prometheus histogram."""
    return sum(
        sample.value
        for metric in histogram.collect()
        for sample in metric.samples
        if sample.name.endswith("_count")
        and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def test_a_recoverys_measured_terms_reach_the_span_the_metrics_and_the_store(plane):
    request = generate(
        "r-measured",
        max_new_tokens=1500,
        decode_instance_id="decode-0",
        recovery_policy="always_migrate",
    )
    (task,) = await start_streams(plane, [request], min_tokens=5)
    await plane.gossip.deregister("decode-0", "operator drained it")
    tokens, summary, error = await task
    assert error is None and tokens == reference(PROMPT, 1500)
    (recovery,) = summary.recoveries
    assert recovery.action == common_pb2.RECOVERY_ACTION_MIGRATE and recovery.succeeded
    predicted, measured = recovery.predicted_terms, recovery.measured_terms
    assert predicted.total_s == pytest.approx(recovery.predicted_cost_s)
    assert measured.total_s == pytest.approx(recovery.measured_s)
    assert measured.stream_s > 0.0 and measured.extend_s > 0.0
    assert measured.first_token_s >= measured.total_s
    assert summary.placement_measured_s > 0.0 and summary.placement_predicted_s > 0.0
    # The span: the recovery's terms on router.recover, the outcome as an event.
    spans = plane.exporter.get_finished_spans()
    in_trace = [s for s in spans if format(s.context.trace_id, "032x") == summary.trace_id]
    (recover,) = [s for s in in_trace if s.name == "router.recover"]
    assert recover.attributes["kvrs.measured.total_s"] == pytest.approx(recovery.measured_s)
    assert recover.attributes["kvrs.predicted.total_s"] == pytest.approx(predicted.total_s)
    (generate_span,) = [s for s in in_trace if s.name == "router.generate"]
    events = [e for e in generate_span.events if e.name == "kvrs.outcome"]
    assert [e.attributes["kvrs.outcome.kind"] for e in events] == ["placement", "migrate"]
    assert events[1].attributes["kvrs.measured.first_token_s"] == pytest.approx(
        measured.first_token_s
    )
    # The metrics: one observation per term either side has.
    metrics = plane.metrics
    assert _count(metrics.prediction_error, kind="migrate", term="total_s") == 1
    assert _count(metrics.prediction_ratio, kind="migrate", term="extend_s") == 1
    assert _count(metrics.prediction_error, kind="placement", term="total_s") == 1
    # The store every scheduler replica reads, as another replica would read it, and the
    # corrections the scheduler fitted from it.
    client = redis_async.Redis.from_url(plane.redis_url)
    try:
        log = OutcomeLog(client, Keys(plane.redis_prefix), capacity=64)
        deadline = asyncio.get_running_loop().time() + 5.0
        while True:
            stored = [o for o in await log.read() if o.request_id == "r-measured"]
            if len(stored) >= 2 or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()
    by_kind = {o.kind: o for o in stored}
    assert set(by_kind) == {"placement", "migrate"}
    assert by_kind["migrate"].measured.total_s == pytest.approx(recovery.measured_s)
    assert by_kind["migrate"].kv_bytes == summary.kv_bytes
    stub = scheduler_pb2_grpc.SchedulerServiceStub(plane.channel("scheduler"))
    for _ in range(50):
        corrections = await stub.GetCorrections(scheduler_pb2.GetCorrectionsRequest(), timeout=5)
        fitted = {(e.kind, e.term) for e in corrections.errors}
        if ("migrate", "total_s") in fitted:
            break
        await asyncio.sleep(0.05)
    assert ("migrate", "total_s") in fitted


async def test_a_request_sharing_a_1024_token_prefix_moves_only_its_suffix(plane):
    """The first request leaves the prefix's blocks on its prefill and decode workers; the
    second, sharing 1,024 tokens, prefills only its suffix there and moves at most its
    suffix plus one block, and streams exactly what a cold run does."""
    shared = [(11 * i + 5) % 256 for i in range(1024)]
    first, second = [*shared, *range(40, 70)], [*shared, *range(90, 130)]
    block_hashes = set(prefix_block_hashes(shared, 512))
    _, one, error = await collect(
        router(plane), generate("r-prefix-a", first, 8, decode_instance_id="decode-0")
    )
    assert error is None and one.prefix_hit_tokens == 0
    assert one.kv_bytes == len(first) * 1024
    deadline = asyncio.get_running_loop().time() + 10
    while True:  # until decode-0 and the prefill worker heartbeat the blocks they keep
        nodes = {n.registration.instance_id: n for n in await plane.gossip.list_nodes()}
        holders = {
            name for name, n in nodes.items() if block_hashes <= set(n.load.resident_prefix_hashes)
        }
        if "decode-0" in holders and one.prefill_instance_id in holders:
            break
        assert asyncio.get_running_loop().time() < deadline, holders
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.15)  # the router's view refreshes every 50 ms
    tokens, two, error = await collect(
        router(plane), generate("r-prefix-b", second, 16, decode_instance_id="decode-0")
    )
    assert error is None
    assert tokens == reference(tuple(second), 16)
    assert two.prefill_instance_id == one.prefill_instance_id
    assert two.prefix_hit_tokens == 1024
    assert two.kv_bytes <= (len(second) - 1024 + 512) * 1024


async def test_a_migration_moves_only_the_blocks_its_target_lacks(plane):
    """decode-1 holds a 1,024-token prefix from an earlier request; when decode-0 stops
    under a request sharing it, MIGRATE to decode-1 pulls only the rest of the prompt and
    the stream goes on exactly."""
    shared = [(13 * i + 1) % 256 for i in range(1024)]
    warm, prompt = [*shared, *range(10, 20)], [*shared, *range(60, 100)]
    _, _, error = await collect(
        router(plane), generate("r-warm-1", warm, 4, decode_instance_id="decode-1")
    )
    assert error is None
    block_hashes = set(prefix_block_hashes(shared, 512))
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        nodes = {n.registration.instance_id: n for n in await plane.gossip.list_nodes()}
        if block_hashes <= set(nodes["decode-1"].load.resident_prefix_hashes):
            break
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.15)
    request = generate(
        "r-migrate-held",
        prompt,
        600,
        decode_instance_id="decode-0",
        recovery_policy="always_migrate",
    )
    (task,) = await start_streams(plane, [request], min_tokens=5)
    await plane.handles.pop("decode-0").stop(0)
    tokens, summary, error = await task
    assert error is None
    assert tokens == reference(tuple(prompt), 600)
    (recovery,) = summary.recoveries
    assert recovery.action == common_pb2.RECOVERY_ACTION_MIGRATE
    assert recovery.target_instance_id == "decode-1"
    spans = plane.exporter.get_finished_spans()
    pulls = [
        s
        for s in spans
        if s.name == "router.pull_kv"
        and format(s.context.trace_id, "032x") == summary.trace_id
        and s.attributes["kvrs.transfer.dst_instance_id"] == "decode-1"
    ]
    (pull,) = pulls
    assert pull.attributes["kvrs.token_start"] == 1024
    assert pull.attributes["kvrs.transfer.kv_bytes"] == (len(prompt) - 1024) * 1024
