"""Continuous batching on a real worker (gRPC server in this process): concurrent Decode
streams, some joining mid-way and one behind a prompt chunked over several passes, get
exactly the tokens each gets alone, and the passes really held several of them."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.tokenizer import encode
from kvrs.v1 import worker_pb2 as pb
from kvrs.v1 import worker_pb2_grpc
from services.common import GrpcSettings, Metrics, open_channel, setup_tracing
from services.worker.config import Config
from services.worker.model import Transformer
from services.worker.server import build_server

NEW_TOKENS = 24
PROMPTS = [encode(f"stream {i}: batching joins requests between steps.") for i in range(6)]
LONG_PROMPT = encode("a prompt longer than one pass's token budget " * 5)


@pytest.fixture(scope="module")
def alone() -> dict[int, list[int]]:
    """Each prompt's tokens when it is the only request (the model run directly)."""
    model = Transformer.load("tiny")
    prompts = [*PROMPTS, LONG_PROMPT]
    return {i: model.complete(prompt, NEW_TOKENS) for i, prompt in enumerate(prompts)}


async def decode_worker(instance_id: str):
    """A decode worker serving in this process, a channel to it and its stub."""
    worker = await build_server(
        Config(
            instance_id=instance_id,
            role="decode",
            listen_addr="127.0.0.1:0",
            transfer_host="127.0.0.1",
            canary_interval_s=30.0,
        ),
        setup_tracing("test", exporter=InMemorySpanExporter()),
    )
    channel = open_channel(f"127.0.0.1:{worker.port}", GrpcSettings())
    return worker, channel, worker_pb2_grpc.WorkerServiceStub(channel)


async def test_concurrent_streams_get_their_single_request_tokens(alone):
    metrics = Metrics()
    worker = await build_server(
        Config(
            instance_id="decode-batch",
            role="decode",
            listen_addr="127.0.0.1:0",
            transfer_host="127.0.0.1",
            canary_interval_s=30.0,
            max_batch_tokens=64,
        ),
        setup_tracing("test", exporter=InMemorySpanExporter()),
        metrics,
    )
    channel = open_channel(f"127.0.0.1:{worker.port}", GrpcSettings())
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    got: dict[int, list[int]] = {}
    progress = {i: asyncio.Event() for i in range(len(PROMPTS) + 1)}

    async def generate(i: int, prompt: list[int]) -> None:
        request_id = f"r-{i}"
        await stub.Prefill(pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt))
        tokens = got.setdefault(i, [])
        stream = stub.Decode(pb.DecodeRequest(request_id=request_id, max_new_tokens=NEW_TOKENS))
        async for reply in stream:
            tokens.append(reply.token_id)
            if len(tokens) == NEW_TOKENS // 3:
                progress[i].set()

    try:
        first = [asyncio.create_task(generate(i, PROMPTS[i])) for i in range(3)]
        # The others join while the first streams are mid-way; the long prompt's
        # prefill (chunked: budget 64 tokens a pass) runs alongside their steps.
        await asyncio.wait_for(progress[0].wait(), 60)
        later = [asyncio.create_task(generate(i, PROMPTS[i])) for i in range(3, len(PROMPTS))]
        later.append(asyncio.create_task(generate(len(PROMPTS), LONG_PROMPT)))
        await asyncio.wait_for(asyncio.gather(*first, *later), 120)
        counts = worker.engine.compute.counts
    finally:
        await channel.close()
        await worker.stop(0)
    assert len(LONG_PROMPT) > 64
    assert got == alone
    assert counts.max_sequences > 1
    passes = metrics.registry.get_sample_value("kvrs_worker_batch_sequences_count")
    single = metrics.registry.get_sample_value("kvrs_worker_batch_sequences_bucket", {"le": "1.0"})
    assert passes == counts.passes
    assert single < passes, "some passes computed several sequences"


async def test_a_stream_left_mid_way_resumes_exactly_where_its_reader_stopped(alone):
    """Each stream queues its next step before handing out a token, so its KV may run
    ahead of what its reader got: a new Decode with fewer generated tokens than are
    resident (here 3 of the 5 read, at least 4 fed) continues exactly from them."""
    worker, channel, stub = await decode_worker("decode-resume")
    try:
        await stub.Prefill(pb.PrefillRequest(request_id="r-resume", prompt_token_ids=PROMPTS[0]))
        stream = stub.Decode(pb.DecodeRequest(request_id="r-resume", max_new_tokens=NEW_TOKENS))
        received = []
        async for reply in stream:
            received.append(reply.token_id)
            if len(received) == 5:
                break
        stream.cancel()
        rest = [
            reply.token_id
            async for reply in stub.Decode(
                pb.DecodeRequest(
                    request_id="r-resume",
                    generated_token_ids=received[:3],
                    max_new_tokens=NEW_TOKENS - 3,
                )
            )
        ]
    finally:
        await channel.close()
        await worker.stop(0)
    assert received[:3] + rest == alone[0]


async def test_a_worker_reports_the_context_its_open_streams_hold():
    """Each decode step reads every open stream's cache: the worker reports their tokens
    summed (gossip carries it to the batch planner), and none once the streams close."""
    worker, channel, stub = await decode_worker("decode-context")
    streams = []
    try:
        for i in (0, 1):
            request_id = f"r-context-{i}"
            await stub.Prefill(
                pb.PrefillRequest(request_id=request_id, prompt_token_ids=PROMPTS[i])
            )
            stream = stub.Decode(pb.DecodeRequest(request_id=request_id, max_new_tokens=NEW_TOKENS))
            for _ in range(3):
                await stream.read()
            streams.append(stream)
        open_stats = worker.engine.stats()
        resident = sum(worker.engine.store.get(f"r-context-{i}").resident_tokens for i in (0, 1))
        for stream in streams:
            stream.cancel()
        for _ in range(100):
            if worker.engine.stats().running_requests == 0:
                break
            await asyncio.sleep(0.02)
        closed_stats = worker.engine.stats()
    finally:
        await channel.close()
        await worker.stop(0)
    assert open_stats.running_requests == 2
    assert open_stats.running_context_tokens >= len(PROMPTS[0]) + len(PROMPTS[1]) + 2 * 3
    assert open_stats.running_context_tokens <= resident
    assert closed_stats.running_context_tokens == 0
