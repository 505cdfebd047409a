"""Endpoint picker over a real gossip store and scheduler: the ext_proc protocol, then a real
Envoy routing to the upstream kvrs picked.

The cluster: prefill-0 on node n0; decode-a and decode-b on nodes n1 and n2 of the same
rack, registered at the addresses of two HTTP upstreams. decode-b carries a little queued
work and holds the prefix blocks of PROMPT_HELD; decode-a is idle and holds nothing. So
the scheduler (netkv) sends PROMPT_HELD to decode-b (its KV need not cross the rack) and
any other prompt to decode-a (no wait): which upstream serves a request tells whether the
picker read the body, hashed its prefix and followed kvrs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_pb2_grpc
from google.protobuf import struct_pb2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs import tokenizer
from kvrs.cli.launcher import free_ports
from services.common import GrpcSettings, Metrics, open_channel, setup_tracing
from services.common.decision_inputs import InputsConfig
from services.common.gossip_records import NodeLoad, Registration
from services.epp.config import Config
from services.epp.envoy_config import find_envoy, render
from services.epp.server import build_server
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.scheduler.config import Config as SchedulerConfig
from services.scheduler.server import build_server as build_scheduler

BLOCK_TOKENS = 512
PROMPT_HELD = "the cached system prompt; " * 100  # 2600 bytes: 5 full blocks
PROMPT_OTHER = "a fresh, uncached prompt! " * 100
BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
PREFILLER_HEADER = "x-prefiller-host-port"
"""Where llm-d's P/D sidecar reads the prefill instance from."""


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


class Upstream:
    """A model-server stand-in that records what reached it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": body})
        return web.json_response({"served_by": self.name})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.address = f"127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def completion(prompt: str) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()


@pytest.fixture
async def cluster(redis_url, redis_prefix):
    """Gossip, a scheduler, two upstreams registered as decode instances, an EPP."""
    exporter = InMemorySpanExporter()
    provider = setup_tracing("test-epp", exporter=exporter)
    upstreams = {"decode-a": Upstream("decode-a"), "decode-b": Upstream("decode-b")}
    for upstream in upstreams.values():
        await upstream.start()
    gossip = await build_gossip(
        GossipConfig(listen_addr="127.0.0.1:0", redis_url=redis_url, redis_prefix=redis_prefix),
        provider,
    )
    gossip_addr = f"127.0.0.1:{gossip.port}"
    members = GossipClient(gossip_addr, timeout_s=5)
    await members.register(
        Registration(
            "prefill-0",
            "prefill",
            "127.0.0.1:1",
            node="n0",
            rack="r0",
            pod="p0",
            heartbeat_ttl_s=600.0,
        )
    )
    for node, (instance_id, upstream) in zip(("n1", "n2"), upstreams.items(), strict=True):
        await members.register(
            Registration(
                instance_id,
                "decode",
                upstream.address,
                node=node,
                rack="r0",
                pod="p0",
                heartbeat_ttl_s=600.0,
            )
        )
    held = tuple(tokenizer.prefix_block_hashes(tokenizer.encode(PROMPT_HELD), BLOCK_TOKENS))
    await members.heartbeat(
        "decode-b", NodeLoad(queued_work_s=1e-5, free_kv_blocks=1000, resident_prefix_hashes=held)
    )
    await members.heartbeat("decode-a", NodeLoad(free_kv_blocks=1000))
    scheduler = await build_scheduler(
        SchedulerConfig(
            listen_addr="127.0.0.1:0",
            gossip_addr=gossip_addr,
            slot_broker_addr="127.0.0.1:9",
            view_refresh_s=0.05,
            inputs=InputsConfig(model="tiny"),
            redis_url=redis_url,
            redis_prefix=redis_prefix,
        ),
        provider,
    )
    # `state`, not `current()`: on a loaded machine the scheduler's first refresh may time
    # out, and `current()` raises until one succeeds.
    await until(
        lambda: (
            scheduler.view.state is not None
            and any(
                state.instance_id == "decode-b" and state.resident_blocks
                for state in scheduler.view.state.cluster.decode_instances()
            )
        )
    )
    metrics = Metrics()
    epp = await build_server(
        Config(
            listen_addr="127.0.0.1:0",
            scheduler_addrs=(f"127.0.0.1:{scheduler.port}",),
            gossip_addr=gossip_addr,
            model="tiny",
            endpoints_refresh_s=0.05,
            scheduler_timeout_s=2.0,
            prefiller_header=PREFILLER_HEADER,
        ),
        provider,
        metrics,
    )
    channel = open_channel(f"127.0.0.1:{epp.port}", GrpcSettings())
    yield {
        "stub": ext_proc_pb2_grpc.ExternalProcessorStub(channel),
        "epp_addr": f"127.0.0.1:{epp.port}",
        "gossip_addr": gossip_addr,
        "scheduler_addr": f"127.0.0.1:{scheduler.port}",
        "members": members,
        "upstreams": upstreams,
        "exporter": exporter,
        "metrics": metrics,
    }
    await channel.close()
    await epp.stop(0)
    await scheduler.stop(0)
    await members.close()
    await gossip.stop(0)
    for upstream in upstreams.values():
        await upstream.stop()


def picks(exporter: InMemorySpanExporter) -> list:
    return [span for span in exporter.get_finished_spans() if span.name == "kvrs.epp.pick"]


def headers_message(
    path: str = "/v1/completions",
    end_of_stream: bool = False,
    subset: list[str] | None = None,
    body_mode: int = BodyMode.BUFFERED,
) -> ext_proc_pb2.ProcessingRequest:
    headers = [
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
        base_pb2.HeaderValue(key="x-request-id", raw_value=b"req-epp-1"),
    ]
    message = ext_proc_pb2.ProcessingRequest(
        request_headers=ext_proc_pb2.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=headers), end_of_stream=end_of_stream
        ),
        protocol_config=ext_proc_pb2.ProtocolConfiguration(request_body_mode=body_mode),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body_message(body: bytes, end_of_stream: bool = True) -> ext_proc_pb2.ProcessingRequest:
    return ext_proc_pb2.ProcessingRequest(
        request_body=ext_proc_pb2.HttpBody(body=body, end_of_stream=end_of_stream)
    )


def set_headers(response: ext_proc_pb2.ProcessingResponse, phase: str) -> dict[str, str]:
    """The request headers the answer to `phase` sets."""
    mutation = getattr(response, phase).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def destination_of(response: ext_proc_pb2.ProcessingResponse, phase: str) -> str:
    """The endpoint set by the answer to `phase`, checked equal in header and metadata."""
    endpoint = set_headers(response, phase)["x-gateway-destination-endpoint"]
    metadata = response.dynamic_metadata.fields["envoy.lb"].struct_value
    assert metadata.fields["x-gateway-destination-endpoint"].string_value == endpoint
    return endpoint


async def buffered_exchange(stub, body: bytes, subset: list[str] | None = None):
    """Headers then a buffered body; returns the body answer."""
    call = stub.Process(timeout=10)
    await call.write(headers_message(subset=subset))
    first = await call.read()
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    await call.write(body_message(body))
    answer = await call.read()
    await call.done_writing()
    return answer


async def test_the_prompt_in_the_body_decides_the_endpoint(cluster):
    stub, upstreams = cluster["stub"], cluster["upstreams"]
    held = await buffered_exchange(stub, completion(PROMPT_HELD))
    other = await buffered_exchange(stub, completion(PROMPT_OTHER))
    assert destination_of(held, "request_body") == upstreams["decode-b"].address
    assert destination_of(other, "request_body") == upstreams["decode-a"].address

    spans = picks(cluster["exporter"])
    assert len(spans) == 2
    attributes = spans[0].attributes
    assert attributes["kvrs.request_id"] == "req-epp-1"
    assert attributes["kvrs.epp.outcome"] == "picked"
    assert attributes["kvrs.chosen_instance_id"] == "decode-b"
    assert attributes["kvrs.epp.endpoint"] == upstreams["decode-b"].address
    assert attributes["kvrs.prompt_tokens"] == len(PROMPT_HELD)
    assert attributes["kvrs.prefix_blocks"] == len(PROMPT_HELD) // BLOCK_TOKENS
    assert attributes["kvrs.prefix_hit_tokens"] == 5 * BLOCK_TOKENS
    assert attributes["kvrs.prefill_instance_id"] == "prefill-0"
    assert attributes["kvrs.epp.prefill_source"] == "least_loaded"
    assert attributes["kvrs.epp.endpoints_eligible"] == 2
    assert attributes["kvrs.epp.subset_size"] == -1
    assert spans[1].attributes["kvrs.chosen_instance_id"] == "decode-a"
    # The scheduler's decision span is a child of the pick: one trace per request.
    select = [s for s in cluster["exporter"].get_finished_spans() if s.name == "kvrs.select_decode"]
    assert select[0].context.trace_id == spans[0].context.trace_id
    sample = cluster["metrics"].registry.get_sample_value(
        "kvrs_decisions_total", {"decision": "epp_pick", "action": "picked"}
    )
    assert sample == 2


async def test_the_prefiller_header_names_the_prefill_instance_chosen(cluster, redis_url):
    """With two prefill instances the picker offers both to the scheduler and names the
    one the prompt prefills on, at the address a P/D sidecar reaches it: its
    EPP_ENDPOINTS entry, else its registered host at EPP_PREFILL_TARGET_PORT."""
    members, upstreams = cluster["members"], cluster["upstreams"]
    await members.register(
        Registration("prefill-1", "prefill", "127.0.0.1:2", node="n3", rack="r0", pod="p0")
    )
    exporter = InMemorySpanExporter()
    epp = await build_server(
        Config(
            listen_addr="127.0.0.1:0",
            scheduler_addrs=(cluster["scheduler_addr"],),
            gossip_addr=cluster["gossip_addr"],
            model="tiny",
            endpoints_refresh_s=0.05,
            scheduler_timeout_s=2.0,
            prefiller_header=PREFILLER_HEADER,
            prefill_target_port=8200,
            endpoints={
                **{name: upstream.address for name, upstream in upstreams.items()},
                "prefill-1": "localhost:8301",
            },
        ),
        setup_tracing("test-epp-prefiller", exporter=exporter),
    )
    channel = open_channel(f"127.0.0.1:{epp.port}", GrpcSettings())
    stub = ext_proc_pb2_grpc.ExternalProcessorStub(channel)
    prefilled_on = {}
    try:
        for busy, idle in (("prefill-0", "prefill-1"), ("prefill-1", "prefill-0")):
            await members.heartbeat(busy, NodeLoad(queued_work_s=5.0, queue_depth=3))
            await members.heartbeat(idle, NodeLoad())
            await asyncio.sleep(0.1)  # past the endpoint map's refresh
            answer = await buffered_exchange(stub, completion(PROMPT_OTHER))
            prefilled_on[idle] = set_headers(answer, "request_body")[PREFILLER_HEADER]
    finally:
        await channel.close()
        await epp.stop(0)
    assert prefilled_on == {"prefill-1": "127.0.0.1:8301", "prefill-0": "127.0.0.1:8200"}
    spans = picks(exporter)
    assert [s.attributes["kvrs.prefill_instance_id"] for s in spans] == ["prefill-1", "prefill-0"]
    assert spans[0].attributes["kvrs.epp.prefill_endpoint"] == "127.0.0.1:8301"


async def test_the_subset_hint_restricts_the_candidates(cluster):
    upstreams = cluster["upstreams"]
    answer = await buffered_exchange(
        cluster["stub"], completion(PROMPT_HELD), subset=[upstreams["decode-a"].address]
    )
    assert destination_of(answer, "request_body") == upstreams["decode-a"].address
    (span,) = picks(cluster["exporter"])
    assert span.attributes["kvrs.epp.subset_size"] == 1
    assert span.attributes["kvrs.epp.endpoints_eligible"] == 1


@pytest.mark.parametrize("subset", [[], ["10.255.255.1:8000"]], ids=["empty", "unknown"])
async def test_no_eligible_endpoint_is_an_immediate_503(cluster, subset):
    answer = await buffered_exchange(cluster["stub"], completion(PROMPT_HELD), subset=subset)
    immediate = answer.immediate_response
    assert immediate.status.code == 503
    error = json.loads(immediate.body)["error"]
    assert error["type"] == "service_unavailable_error"
    assert "subset" in error["message"]
    (span,) = picks(cluster["exporter"])
    assert span.attributes["kvrs.epp.outcome"] == "no_endpoint"


async def test_a_body_that_is_not_an_openai_request_is_a_400(cluster):
    answer = await buffered_exchange(cluster["stub"], b"{not json")
    assert answer.immediate_response.status.code == 400
    assert json.loads(answer.immediate_response.body)["error"]["param"] == "body"
    bad_prompt = await buffered_exchange(
        cluster["stub"], json.dumps({"model": "tiny", "prompt": [1, 999]}).encode()
    )
    assert bad_prompt.immediate_response.status.code == 400
    assert json.loads(bad_prompt.immediate_response.body)["error"]["param"] == "prompt[1]"


async def test_a_request_without_body_is_placed_from_its_headers(cluster):
    call = cluster["stub"].Process(timeout=10)
    await call.write(headers_message(path="/v1/models", end_of_stream=True))
    answer = await call.read()
    await call.done_writing()
    assert destination_of(answer, "request_headers") == cluster["upstreams"]["decode-a"].address


async def test_full_duplex_holds_the_headers_until_the_body_is_complete(cluster):
    body = completion(PROMPT_HELD)
    call = cluster["stub"].Process(timeout=10)
    await call.write(headers_message(body_mode=BodyMode.FULL_DUPLEX_STREAMED))
    await call.write(body_message(body[:100], end_of_stream=False))
    await call.write(body_message(body[100:], end_of_stream=True))
    first = await call.read()
    assert destination_of(first, "request_headers") == cluster["upstreams"]["decode-b"].address
    echoed = b""
    while True:
        chunk = (await call.read()).request_body.response.body_mutation.streamed_response
        echoed += chunk.body
        if chunk.end_of_stream:
            break
    await call.done_writing()
    assert echoed == body


async def test_without_a_scheduler_the_gateway_gets_a_503(cluster, redis_url):
    provider = setup_tracing("test-epp-down", exporter=InMemorySpanExporter())
    (dead_port,) = free_ports(1)
    epp = await build_server(
        Config(
            listen_addr="127.0.0.1:0",
            scheduler_addrs=(f"127.0.0.1:{dead_port}",),
            gossip_addr=f"127.0.0.1:{dead_port}",
            model="tiny",
            scheduler_timeout_s=0.5,
        ),
        provider,
    )
    channel = open_channel(f"127.0.0.1:{epp.port}", GrpcSettings())
    try:
        answer = await buffered_exchange(
            ext_proc_pb2_grpc.ExternalProcessorStub(channel), completion(PROMPT_OTHER)
        )
    finally:
        await channel.close()
        await epp.stop(0)
    assert answer.immediate_response.status.code == 503


async def test_health_answers_the_protocols_service_names(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = open_channel(cluster["epp_addr"], GrpcSettings())
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    finally:
        await channel.close()


async def start_epp(cluster, **overrides):
    """Another picker over the cluster's gossip and scheduler; (handle, stub, channel, metrics,
    exporter)."""
    exporter = InMemorySpanExporter()
    metrics = Metrics()
    settings = {
        "listen_addr": "127.0.0.1:0",
        "scheduler_addrs": (cluster["scheduler_addr"],),
        "gossip_addr": cluster["gossip_addr"],
        "model": "tiny",
        "endpoints_refresh_s": 0.05,
        "scheduler_timeout_s": 2.0,
        **overrides,
    }
    epp = await build_server(
        Config(**settings), setup_tracing("test-epp-extra", exporter=exporter), metrics
    )
    channel = open_channel(f"127.0.0.1:{epp.port}", GrpcSettings())
    return epp, ext_proc_pb2_grpc.ExternalProcessorStub(channel), channel, metrics, exporter


async def test_a_clients_own_destination_header_cannot_steer_the_request(cluster):
    """kvrs sends PROMPT_OTHER to decode-a; a client naming decode-b is overruled."""
    upstreams = cluster["upstreams"]
    call = cluster["stub"].Process(timeout=10)
    message = headers_message()
    message.request_headers.headers.headers.append(
        base_pb2.HeaderValue(
            key="x-gateway-destination-endpoint", raw_value=upstreams["decode-b"].address.encode()
        )
    )
    await call.write(message)
    await call.read()
    await call.write(body_message(completion(PROMPT_OTHER)))
    answer = await call.read()
    await call.done_writing()
    assert destination_of(answer, "request_body") == upstreams["decode-a"].address
    # Every header the picker sets (the prefiller's too) replaces the client's own.
    options = answer.request_body.response.header_mutation.set_headers
    assert {o.append_action for o in options} == {
        base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    }


async def test_no_kv_memory_left_anywhere_is_an_immediate_429(cluster):
    """Shedding: every decode instance has a KV capacity and reports none of it free."""
    for node, (instance_id, upstream) in zip(
        ("n1", "n2"), cluster["upstreams"].items(), strict=True
    ):
        await cluster["members"].register(
            Registration(
                instance_id,
                "decode",
                upstream.address,
                node=node,
                rack="r0",
                pod="p0",
                kv_capacity_blocks=1000,
                heartbeat_ttl_s=600.0,
            )
        )
        await cluster["members"].heartbeat(instance_id, NodeLoad(free_kv_blocks=0))
    deadline = time.monotonic() + 10
    while True:
        answer = await buffered_exchange(cluster["stub"], completion(PROMPT_OTHER))
        if answer.WhichOneof("response") == "immediate_response" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)  # the scheduler's view refreshes every 0.05 s
    immediate = answer.immediate_response
    assert immediate.status.code == 429, answer
    error = json.loads(immediate.body)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "resource_exhausted", error
    assert "free KV memory" in error["message"]
    assert not any(upstream.seen for upstream in cluster["upstreams"].values())
    assert picks(cluster["exporter"])[-1].attributes["kvrs.epp.outcome"] == "no_capacity"


async def test_an_unknown_policy_is_an_immediate_500_naming_the_setting(cluster):
    epp, stub, channel, metrics, _ = await start_epp(cluster, policy="no-such-policy")
    try:
        answer = await buffered_exchange(stub, completion(PROMPT_OTHER))
    finally:
        await channel.close()
        await epp.stop(0)
    immediate = answer.immediate_response
    assert immediate.status.code == 500
    assert "EPP_POLICY" in json.loads(immediate.body)["error"]["message"]
    sample = metrics.registry.get_sample_value(
        "kvrs_decisions_total", {"decision": "epp_pick", "action": "error"}
    )
    assert sample == 1


async def test_fallback_endpoints_follow_the_pick_in_order(cluster):
    """Protocol v0.4.0: `ip:port,ip:port`, the pick first, then the runner-up."""
    upstreams = cluster["upstreams"]
    epp, stub, channel, _, exporter = await start_epp(cluster, fallback_endpoints=3)
    try:
        held = await buffered_exchange(stub, completion(PROMPT_HELD))
        other = await buffered_exchange(stub, completion(PROMPT_OTHER))
    finally:
        await channel.close()
        await epp.stop(0)
    a, b = upstreams["decode-a"].address, upstreams["decode-b"].address
    assert destination_of(held, "request_body") == f"{b},{a}"
    assert destination_of(other, "request_body") == f"{a},{b}"
    assert [span.attributes["kvrs.epp.fallbacks"] for span in picks(exporter)] == [a, b]


@pytest.mark.parametrize("served, rank", [("decode-b", "primary"), ("decode-a", "fallback")])
async def test_the_served_endpoint_is_read_back_from_the_response_metadata(cluster, served, rank):
    """Protocol v1.0.0: the gateway reports which endpoint of the list served the request."""
    upstreams = cluster["upstreams"]
    epp, stub, channel, metrics, exporter = await start_epp(cluster, fallback_endpoints=1)
    try:
        call = stub.Process(timeout=10)
        await call.write(headers_message())
        await call.read()
        await call.write(body_message(completion(PROMPT_HELD)))
        answer = await call.read()
        response = ext_proc_pb2.ProcessingRequest(response_headers=ext_proc_pb2.HttpHeaders())
        reported = struct_pb2.Struct()
        reported.update({"x-gateway-destination-endpoint-served": upstreams[served].address})
        response.metadata_context.filter_metadata["envoy.lb"].CopyFrom(reported)
        await call.write(response)
        passed = await call.read()
        await call.done_writing()
    finally:
        await channel.close()
        await epp.stop(0)
    assert destination_of(answer, "request_body").split(",")[0] == upstreams["decode-b"].address
    assert passed.WhichOneof("response") == "response_headers"
    assert metrics.registry.get_sample_value("kvrs_epp_served_total", {"rank": rank}) == 1
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "kvrs.epp.served"]
    assert span.attributes["kvrs.epp.served_endpoint"] == upstreams[served].address
    assert span.attributes["kvrs.epp.served_rank"] == rank


async def test_readiness_waits_for_the_endpoint_map_and_liveness_does_not(redis_url, redis_prefix):
    """Liveness SERVING at once; readiness, "" and ext_proc only once gossip first answered."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    (gossip_port,) = free_ports(1)
    provider = setup_tracing("test-epp-ready", exporter=InMemorySpanExporter())
    epp = await build_server(
        Config(
            listen_addr="127.0.0.1:0",
            scheduler_addrs=("127.0.0.1:9",),
            gossip_addr=f"127.0.0.1:{gossip_port}",
            model="tiny",
            endpoints_refresh_s=0.05,
            scheduler_timeout_s=0.3,
        ),
        provider,
    )
    channel = open_channel(f"127.0.0.1:{epp.port}", GrpcSettings())
    stub = health_pb2_grpc.HealthStub(channel)
    services = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")

    async def status(service: str) -> int:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status

    gossip = None
    try:
        assert await status("liveness") == health_pb2.HealthCheckResponse.SERVING
        for service in services:
            assert await status(service) == health_pb2.HealthCheckResponse.NOT_SERVING, service
        gossip = await build_gossip(
            GossipConfig(
                listen_addr=f"127.0.0.1:{gossip_port}",
                redis_url=redis_url,
                redis_prefix=redis_prefix,
            ),
            provider,
        )
        deadline = time.monotonic() + 10
        while await status("readiness") != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "readiness never turned SERVING"
            await asyncio.sleep(0.05)
        for service in (*services, "liveness"):
            assert await status(service) == health_pb2.HealthCheckResponse.SERVING, service
    finally:
        await channel.close()
        await epp.stop(0)
        if gossip is not None:
            await gossip.stop(0)


# Through a real Envoy


@pytest.fixture(params=["BUFFERED", "FULL_DUPLEX_STREAMED"])
async def gateway(cluster, tmp_path, request):
    """Envoy (deploy/envoy/envoy.yaml) with ext_proc pointed at the EPP; yields its URL."""
    listen_port, admin_port = free_ports(2)
    config_file = tmp_path / "envoy.yaml"
    config_file.write_text(render(cluster["epp_addr"], listen_port, admin_port, request.param))
    log_file = tmp_path / "envoy.log"
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            [
                find_envoy(),
                "-c",
                str(config_file),
                "--disable-hot-restart",
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 20
            while True:
                assert process.poll() is None, f"envoy exited:\n{log_file.read_text()}"
                assert time.monotonic() < deadline, f"envoy not ready:\n{log_file.read_text()}"
                try:
                    async with session.get(f"http://127.0.0.1:{admin_port}/ready") as reply:
                        if reply.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            yield session, f"http://127.0.0.1:{listen_port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def post(session, url: str, body: bytes, subset: str | None = None):
    headers = {"content-type": "application/json"}
    if subset is not None:
        headers["x-kvrs-endpoint-subset"] = subset
    async with session.post(f"{url}/v1/completions", data=body, headers=headers) as reply:
        return reply.status, await reply.json(content_type=None)


async def test_envoy_sends_each_request_to_the_endpoint_kvrs_picked(cluster, gateway):
    session, url = gateway
    upstreams = cluster["upstreams"]
    status, reply = await post(session, url, completion(PROMPT_HELD))
    assert (status, reply) == (200, {"served_by": "decode-b"})
    status, reply = await post(session, url, completion(PROMPT_OTHER))
    assert (status, reply) == (200, {"served_by": "decode-a"})
    (seen,) = upstreams["decode-b"].seen
    assert seen["headers"]["x-gateway-destination-endpoint"] == upstreams["decode-b"].address
    assert seen["headers"][PREFILLER_HEADER] == "127.0.0.1:1", "prefill-0 as registered"
    assert seen["body"] == completion(PROMPT_HELD)
    assert [span.attributes["kvrs.epp.endpoint"] for span in picks(cluster["exporter"])] == [
        upstreams["decode-b"].address,
        upstreams["decode-a"].address,
    ]


async def test_envoy_honours_the_subset_hint(cluster, gateway):
    session, url = gateway
    upstreams = cluster["upstreams"]
    status, reply = await post(
        session, url, completion(PROMPT_HELD), subset=upstreams["decode-a"].address
    )
    assert (status, reply) == (200, {"served_by": "decode-a"})
    assert not upstreams["decode-b"].seen
    (span,) = picks(cluster["exporter"])
    assert span.attributes["kvrs.epp.subset_size"] == 1


@pytest.mark.parametrize("subset", ["", "10.255.255.1:8000"], ids=["empty", "unknown"])
async def test_envoy_answers_503_when_no_endpoint_is_eligible(cluster, gateway, subset):
    session, url = gateway
    status, reply = await post(session, url, completion(PROMPT_HELD), subset=subset)
    assert status == 503
    assert reply["error"]["type"] == "service_unavailable_error"
    assert not any(upstream.seen for upstream in cluster["upstreams"].values())


async def test_envoy_ignores_a_clients_destination_header(cluster, gateway):
    session, url = gateway
    upstreams = cluster["upstreams"]
    headers = {
        "content-type": "application/json",
        "x-gateway-destination-endpoint": upstreams["decode-b"].address,
    }
    body = completion(PROMPT_OTHER)
    async with session.post(f"{url}/v1/completions", data=body, headers=headers) as reply:
        assert (reply.status, await reply.json()) == (200, {"served_by": "decode-a"})
    assert not upstreams["decode-b"].seen
    (seen,) = upstreams["decode-a"].seen
    assert seen["headers"]["x-gateway-destination-endpoint"] == upstreams["decode-a"].address


# Configuration


def test_config_reads_the_environment_and_names_bad_values():
    from services.common import ConfigError

    config = Config.from_env(
        {"SCHEDULER_ADDRS": "a:1, b:2", "EPP_TARGET_PORT": "8000", "KVRS_MODEL": "tiny"}
    )
    assert config.scheduler_addrs == ("a:1", "b:2")
    assert (config.listen_addr, config.target_port, config.block_tokens) == (
        "0.0.0.0:9002",
        8000,
        512,
    )
    pd = Config.from_env(
        {"EPP_PREFILLER_HEADER": " X-Prefiller-Host-Port", "EPP_PREFILL_TARGET_PORT": "8200"}
    )
    assert (pd.prefiller_header, pd.prefill_target_port) == ("x-prefiller-host-port", 8200)
    assert Config.from_env({}).prefiller_header == "", "off unless asked for"
    for env, name in (
        ({"EPP_TARGET_PORT": "70000"}, "EPP_TARGET_PORT"),
        ({"EPP_PREFILL_TARGET_PORT": "-1"}, "EPP_PREFILL_TARGET_PORT"),
        ({"EPP_PREFILLER_HEADER": "x prefiller"}, "EPP_PREFILLER_HEADER"),
        ({"EPP_ENDPOINTS_REFRESH_S": "0"}, "EPP_ENDPOINTS_REFRESH_S"),
        ({"KVRS_MODEL": "gpt-9"}, "KVRS_MODEL"),
        ({"SCHEDULER_ADDRS": "nohost"}, "SCHEDULER_ADDRS"),
    ):
        with pytest.raises(ConfigError, match=name):
            Config.from_env(env)


def test_the_envoy_template_is_filled_completely():
    text = render("epp.default.svc:9002", 8081, 9901, "FULL_DUPLEX_STREAMED")
    assert "${" not in text
    assert "address: epp.default.svc, port_value: 9002" in text
    assert "request_trailer_mode: SEND" in text
    with pytest.raises(ValueError, match="body_mode"):
        render("epp:9002", 8081, body_mode="STREAMED")
