"""Workers built in the test process: gossip registration and heartbeats (real gossip
service, real Redis), one trace across PullKv → SendKv → transfer, the KV store's leases,
when a Decode stream releases its KV."""

from __future__ import annotations

import asyncio

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.errors import NotFound, ResourceExhausted
from kvrs.tokenizer import prefix_block_hashes
from kvrs.v1 import worker_pb2 as pb
from kvrs.v1 import worker_pb2_grpc
from services.common import GrpcSettings, open_channel, setup_tracing
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.worker.config import Config
from services.worker.kvstore import KvStore
from services.worker.paged_kv import KvPool
from services.worker.server import build_server


def worker_config(instance_id: str, role: str, **overrides) -> Config:
    defaults = {
        "listen_addr": "127.0.0.1:0",
        "transfer_host": "127.0.0.1",
        "transfer_timeout_s": 10.0,
        "canary_interval_s": 30.0,
    }
    return Config(instance_id=instance_id, role=role, **{**defaults, **overrides})


async def test_worker_registers_and_heartbeats_its_load(redis_url, redis_prefix):
    provider = setup_tracing("test", exporter=InMemorySpanExporter())
    gossip = await build_gossip(
        GossipConfig(
            listen_addr="127.0.0.1:0",
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            heartbeat_ttl_s=2.0,
            sweep_interval_s=0.05,
        ),
        provider,
    )
    gossip_addr = f"127.0.0.1:{gossip.port}"
    worker = await build_server(
        worker_config("decode-g", "decode", gossip_addr=gossip_addr, heartbeat_interval_s=0.05),
        provider,
    )
    client = GossipClient(gossip_addr, timeout_s=5)
    channel = open_channel(f"127.0.0.1:{worker.port}", GrpcSettings())
    try:
        (node,) = await client.list_nodes("decode")
        registration = node.registration
        assert registration.instance_id == "decode-g"
        assert registration.address == f"127.0.0.1:{worker.port}"
        assert registration.transfer_address == worker.engine.agent.address
        assert registration.kv_capacity_blocks == worker.engine.store.capacity_blocks
        prompt = [7] * 600
        await worker_pb2_grpc.WorkerServiceStub(channel).Prefill(
            pb.PrefillRequest(request_id="r-gossip", prompt_token_ids=prompt)
        )
        expected_hash = prefix_block_hashes(prompt, 512)[0]
        expected_free = registration.kv_capacity_blocks - 2
        # A change of free KV under the heartbeat's threshold rides along with the next
        # full beat (every tenth), so it may arrive a few beats after the prefix hash.
        for _ in range(100):
            (node,) = await client.list_nodes("decode")
            load = node.load
            if (
                expected_hash in load.resident_prefix_hashes
                and load.free_kv_blocks == expected_free
            ):
                break
            await asyncio.sleep(0.05)
        assert expected_hash in node.load.resident_prefix_hashes
        # 600 tokens hold two 512-token blocks of the budget.
        assert node.load.free_kv_blocks == registration.kv_capacity_blocks - 2
        assert node.load.queued_work_s >= 0.0
    finally:
        await channel.close()
        await worker.stop(0)
        nodes = await client.list_nodes("decode", include_down=True)
        await client.close()
        await gossip.stop(0)
    assert [(n.registration.instance_id, n.state) for n in nodes] == [("decode-g", "left")]


async def test_one_trace_runs_from_the_caller_through_pull_send_and_transfer():
    exporter = InMemorySpanExporter()
    provider = setup_tracing("test", exporter=exporter)
    source = await build_server(worker_config("prefill-t", "prefill"), provider)
    target = await build_server(worker_config("decode-t", "decode"), provider)
    channels = [
        open_channel(f"127.0.0.1:{w.port}", GrpcSettings(), provider) for w in (source, target)
    ]
    try:
        prefill, decode = (worker_pb2_grpc.WorkerServiceStub(c) for c in channels)
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("router.generate") as root:
            await prefill.Prefill(
                pb.PrefillRequest(request_id="r-trace", prompt_token_ids=[1, 2, 3, 4])
            )
            await decode.PullKv(
                pb.PullKvRequest(
                    request_id="r-trace",
                    source_instance_id="prefill-t",
                    source_address=f"127.0.0.1:{source.port}",
                    token_start=0,
                    token_end=4,
                )
            )
    finally:
        for channel in channels:
            await channel.close()
        await target.stop(0)
        await source.stop(0)
    spans = exporter.get_finished_spans()
    trace_id = root.get_span_context().trace_id
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    by_id = {span.context.span_id: span for span in spans}

    def ancestors(span) -> list[str]:
        names = []
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
            names.append(span.name)
        return names

    for name in ("kvxfer.send", "kvxfer.recv"):
        (span,) = by_name[name]
        assert span.context.trace_id == trace_id
        assert "/kvrs.v1.WorkerService/PullKv" in ancestors(span)
        assert ancestors(span)[-1] == "router.generate"
        assert span.attributes["kvrs.kv_bytes"] == 4 * 1024
    assert "/kvrs.v1.WorkerService/SendKv" in ancestors(by_name["kvxfer.send"][0])


async def test_a_worker_allocates_budgets_and_hashes_kv_in_its_configured_blocks():
    provider = setup_tracing("test", exporter=InMemorySpanExporter())
    worker = await build_server(worker_config("decode-b", "decode", block_tokens=16), provider)
    channel = open_channel(f"127.0.0.1:{worker.port}", GrpcSettings())
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    prompt = list(range(1, 41))
    try:
        before = await stub.GetWorkerStats(pb.GetWorkerStatsRequest())
        await stub.Prefill(pb.PrefillRequest(request_id="r-a", prompt_token_ids=prompt))
        stats = await stub.GetWorkerStats(pb.GetWorkerStatsRequest())
        cache = worker.engine.store.get("r-a").cache
        again = await stub.Prefill(
            pb.PrefillRequest(request_id="r-b", prompt_token_ids=[*prompt[:32], 99, 98])
        )
        sharing = await stub.GetWorkerStats(pb.GetWorkerStatsRequest())
        shared_cache = worker.engine.store.get("r-b").cache
    finally:
        await channel.close()
        await worker.stop(0)
    assert stats.block_tokens == 16
    # 40 tokens: three 16-token blocks charged, and three allocated.
    assert stats.free_kv_blocks == before.free_kv_blocks - 3
    assert cache.capacity_tokens == 48
    assert set(prefix_block_hashes(prompt, 16)) <= set(stats.resident_prefix_hashes)
    assert again.prefix_hit_tokens == 32
    # The second prompt shares the first's two leading blocks, and only its third is new.
    assert shared_cache.blocks[:2] == cache.blocks[:2]
    assert sharing.free_kv_blocks == stats.free_kv_blocks - 1


async def test_a_stream_that_releases_its_kv_does_so_before_its_last_token():
    """A reader may close the Decode stream on its last token (the router does): the
    request's KV must be gone by then, not once the stream is read to its end."""
    provider = setup_tracing("test", exporter=InMemorySpanExporter())
    worker = await build_server(worker_config("decode-r", "decode"), provider)
    channel = open_channel(f"127.0.0.1:{worker.port}", GrpcSettings())
    try:
        await worker_pb2_grpc.WorkerServiceStub(channel).Prefill(
            pb.PrefillRequest(request_id="r-last", prompt_token_ids=list(range(1, 41)))
        )
        resident_at = []
        async for token in worker.engine.decode("r-last", [], 3, release_when_done=True):
            resident_at.append(worker.engine.store.find("r-last") is not None)
            assert token.last == (len(resident_at) == 3)
    finally:
        await channel.close()
        await worker.stop(0)
    assert resident_at == [True, True, False]


def test_kv_store_evicts_expired_first_then_least_recently_used():
    now = [0.0]
    pool = KvPool(2, 2, 16, torch.float64, block_tokens=16, num_blocks=4)
    store = KvStore(pool, clock=lambda: now[0])
    assert store.capacity_blocks == 4 and store.bytes_per_token == 1024

    def add(request_id: str, tokens: int, lease_s: float):
        entry = store.add(request_id, tokens, lease_s)
        store.unpin(entry)
        return entry

    add("short-lease", 16, lease_s=1.0)
    now[0] = 1.0
    add("old", 16, lease_s=100.0)
    now[0] = 2.0
    busy = add("busy", 16, lease_s=100.0)
    store.pin(busy)
    now[0] = 3.0
    add("recent", 16, lease_s=100.0)
    assert store.free_blocks == 0
    now[0] = 4.0
    add("new-1", 16, lease_s=100.0)
    assert store.find("short-lease") is None and store.find("old") is not None
    assert (store.expired, store.evicted) == (1, 0)
    add("new-2", 16, lease_s=100.0)
    assert store.find("old") is None
    assert store.find("busy") is not None
    assert store.evicted == 1
    with pytest.raises(ResourceExhausted, match="needs 5 KV blocks"):
        store.add("huge", 80, 10.0)
    store.release("busy")
    assert store.find("busy") is not None, "a pinned entry is released when its user is done"
    store.unpin(busy)
    assert store.find("busy") is None
    with pytest.raises(NotFound) as info:
        store.get("busy")
    assert info.value.field == "request_id"
