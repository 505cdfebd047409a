"""Who may call the HTTP adapter, where it listens, and what its probes say.

API keys (`Authorization: Bearer`, as vLLM's `--api-key`), the loopback default, and
liveness (`/health`) apart from readiness (`/ready`: its router answers SERVING), against
a real gRPC server standing in for the router's address and health service.
"""

from __future__ import annotations

import aiohttp
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.v1 import router_pb2, router_pb2_grpc
from services.common import ConfigError, GrpcSettings, setup_tracing
from services.common.server import start_server
from services.openai_http.config import Config
from services.openai_http.generation import RouterGenerator
from services.openai_http.server import build_server


class OneTokenRouter(router_pb2_grpc.RouterServiceServicer):
    """A RouterService that answers every Generate with one token and its summary."""

    async def Generate(self, request, context):
        summary = router_pb2.GenerateSummary(
            request_id=request.request_id,
            prompt_tokens=len(request.prompt_token_ids),
            generated_tokens=1,
            finish_reason="length",
        )
        yield router_pb2.GenerateResponse(index=0, token_id=72, summary=summary)


@pytest.fixture
async def router():
    provider = setup_tracing("test-openai-router", exporter=InMemorySpanExporter())
    handle = await start_server(
        lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(OneTokenRouter(), s),
        ["kvrs.v1.RouterService"],
        "127.0.0.1:0",
        GrpcSettings(),
        provider,
    )
    yield handle
    await handle.stop(0)


@pytest.fixture
async def adapter(router):
    handles = []

    async def start(**overrides):
        config = Config(
            listen_addr="127.0.0.1:0",
            router_addr=f"127.0.0.1:{router.port}",
            model="tiny",
            max_tokens_limit=8,
            **overrides,
        )
        generator = RouterGenerator(config.router_addr, GrpcSettings())
        provider = setup_tracing("test-openai-access", exporter=InMemorySpanExporter())
        handle = await build_server(config, generator, provider)
        handle.cleanups.append(generator.close)
        handles.append(handle)
        return f"http://127.0.0.1:{handle.port}"

    yield start
    for handle in handles:
        await handle.stop()


COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 1}


async def test_with_api_keys_every_v1_route_wants_one_of_them(adapter):
    url = await adapter(api_keys=("key-one", "key-two"))
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"}):
            for method, path, body in (
                ("GET", "/v1/models", None),
                ("POST", "/v1/completions", COMPLETION),
            ):
                async with session.request(
                    method, f"{url}{path}", json=body, headers=headers
                ) as reply:
                    assert reply.status == 401, (path, headers)
                    assert reply.headers["WWW-Authenticate"] == "Bearer"
                    error = (await reply.json())["error"]
                    assert error["code"] == "invalid_api_key", error
        for key in ("key-one", "key-two"):
            headers = {"Authorization": f"Bearer {key}"}
            async with session.get(f"{url}/v1/models", headers=headers) as reply:
                assert reply.status == 200
            async with session.post(f"{url}/v1/completions", json=COMPLETION, headers=headers) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 1
        for probe in ("/health", "/ready"):
            async with session.get(f"{url}{probe}") as reply:
                assert reply.status == 200, probe


async def test_without_keys_the_api_is_open(adapter):
    url = await adapter()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=COMPLETION) as reply:
            assert reply.status == 200


async def test_ready_follows_the_router_while_health_only_says_the_process_answers(adapter, router):
    url = await adapter()
    async with aiohttp.ClientSession() as session:

        async def probe(path: str) -> tuple[int, dict]:
            async with session.get(f"{url}{path}") as reply:
                return reply.status, await reply.json()

        assert await probe("/ready") == (200, {"status": "ready", "router": "SERVING"})
        await router.set_serving(False)
        assert await probe("/ready") == (503, {"status": "not ready", "router": "NOT_SERVING"})
        assert (await probe("/health"))[0] == 200
        await router.set_serving(True)
        assert (await probe("/ready"))[0] == 200
        await router.stop(0)
        status, body = await probe("/ready")
        assert status == 503 and body["router"] == "UNAVAILABLE", body
        assert await probe("/health") == (200, {"status": "ok"})


def test_the_adapter_listens_on_loopback_unless_told_otherwise_and_reads_its_keys():
    assert Config().listen_addr == Config.from_env({}).listen_addr == "127.0.0.1:8000"
    assert Config.from_env({}).api_keys == ()
    assert Config.from_env({"OPENAI_HTTP_API_KEY": "a, b,"}).api_keys == ("a", "b")
    with pytest.raises(ConfigError, match="OPENAI_HTTP_READINESS_TIMEOUT_S"):
        Config.from_env({"OPENAI_HTTP_READINESS_TIMEOUT_S": "0"})
