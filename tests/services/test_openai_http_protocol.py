"""Translation in the HTTP adapter: OpenAI requests and responses, Generate streams.

Only the translation is checked here (parameters, error shapes, the event stream, the
reading of a Generate stream), over scripted generators and a scripted RouterService; the
completions themselves are tested against a real router in tests/e2e/test_openai_client.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs import tokenizer
from kvrs.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvrsError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvrs.v1 import router_pb2, router_pb2_grpc
from services.common import GrpcSettings, Metrics, setup_tracing
from services.common import openai_chat as chat
from services.common import openai_protocol as protocol
from services.openai_http.config import Config
from services.openai_http.generation import Finished, GenerateCall, Token
from services.openai_http.server import build_server

REPLY = "héllo, wörld €"


def parse(**body):
    return protocol.parse_completion_request(
        {"model": "tiny", "prompt": "hi", **body}, "tiny", max_tokens_limit=64
    )


def test_prompts_in_every_openai_form_become_token_ids():
    assert parse().prompts == ((104, 105),)
    assert parse(prompt=["a", "bc"]).prompts == ((97,), (98, 99))
    assert parse(prompt=[1, 2, 3]).prompts == ((1, 2, 3),)
    assert parse(prompt=[[1], [2, 3]]).prompts == ((1,), (2, 3))
    request = parse(
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        max_tokens=5,
        seed=7,
        user="u",
        top_p=1,
        n=1,
    )
    assert (request.stream, request.include_usage, request.max_tokens) == (True, True, 5)
    assert parse().max_tokens == protocol.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 300]}, "prompt[1]"),
        ({"prompt": ["ok", 5]}, "prompt[1]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 65}, "max_tokens"),
        ({"max_tokens": "3"}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"n": 2}, "n"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"echo": True}, "echo"),
        ({"logprobs": 2}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"model": ""}, "model"),
    ],
)
def test_bad_or_unsupported_parameters_are_named(body, param):
    with pytest.raises(InvalidArgument) as info:
        parse(**body)
    assert info.value.field == param


def test_an_unknown_model_is_not_found_naming_the_model():
    with pytest.raises(NotFound) as info:
        parse(model="gpt-4")
    assert info.value.field == "model"


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (InvalidArgument("prompt", "bad"), 400, "invalid_argument"),
        (NotFound("no such model", field="model"), 404, "not_found"),
        (ResourceExhausted("no KV memory"), 429, "resource_exhausted"),
        (FailedPrecondition("no decode instance"), 503, "failed_precondition"),
        (Unavailable("router down"), 503, "unavailable"),
        (protocol.RequestAborted("gave up"), 503, "request_aborted"),
        (DeadlineExceeded("late"), 504, "deadline_exceeded"),
        (KvrsError("boom"), 500, "internal"),
    ],
)
def test_errors_map_to_http_status_and_openai_shape(error, status, code):
    got_status, body = protocol.http_error(error)
    assert got_status == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert body["error"]["param"] == (error.field or None)


class ScriptedGenerator:
    """Answers every prompt with REPLY's tokens, or fails as told."""

    def __init__(
        self,
        fail_before: KvrsError | None = None,
        fail_after_tokens: tuple[int, KvrsError] | None = None,
    ) -> None:
        self.fail_before = fail_before
        self.fail_after_tokens = fail_after_tokens
        self.calls: list[GenerateCall] = []

    async def generate(self, call: GenerateCall) -> AsyncIterator[Token | Finished]:
        self.calls.append(call)
        if self.fail_before is not None:
            raise self.fail_before
        tokens = tokenizer.encode(REPLY)[: call.max_new_tokens]
        for index, token in enumerate(tokens):
            if self.fail_after_tokens and index == self.fail_after_tokens[0]:
                raise self.fail_after_tokens[1]
            yield Token(index, token)
        yield Finished("length", len(call.prompt_token_ids), len(tokens))


@pytest.fixture
async def serve():
    handles = []

    async def start(generator):
        exporter = InMemorySpanExporter()
        metrics = Metrics()
        handle = await build_server(
            Config(listen_addr="127.0.0.1:0", model="tiny", max_tokens_limit=64),
            generator,
            setup_tracing("test-openai-http", exporter=exporter),
            metrics,
        )
        handles.append(handle)
        return f"http://127.0.0.1:{handle.port}", exporter, metrics

    yield start
    for handle in handles:
        await handle.stop()


def events_of(raw: str) -> list[str]:
    return [line.removeprefix("data: ") for line in raw.split("\n\n") if line]


async def test_streamed_chunks_add_up_to_the_non_streamed_text(serve):
    url, exporter, metrics = await serve(ScriptedGenerator())
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 64}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            assert reply.status == 200
            whole = await reply.json()
        async with session.post(
            f"{url}/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as reply:
            assert reply.status == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            raw = await reply.text()
    assert whole["object"] == "text_completion"
    assert whole["choices"] == [
        {"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "length"}
    ]
    n_tokens = len(tokenizer.encode(REPLY))
    assert whole["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": n_tokens,
        "total_tokens": 2 + n_tokens,
    }
    events = events_of(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    *text_chunks, usage_chunk = chunks
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == REPLY
    # A piece never holds half a character: every chunk is valid text on its own.
    assert all(c["choices"][0]["text"] or c["choices"][0]["finish_reason"] for c in text_chunks)
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert metrics.registry.get_sample_value("kvrs_requests_total", {"outcome": "ok"}) == 2


async def test_a_batch_of_prompts_gets_one_choice_each(serve):
    generator = ScriptedGenerator()
    url, _, _ = await serve(generator)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{url}/v1/completions",
            headers={"x-request-id": "batch-1"},
            json={"model": "tiny", "prompt": ["a", "bb"], "max_tokens": 3},
        ) as reply:
            whole = await reply.json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert [c["text"] for c in whole["choices"]] == ["hé", "hé"]
    assert whole["id"] == "cmpl-batch-1"
    assert sorted(call.request_id for call in generator.calls) == ["batch-1-0", "batch-1-1"]


async def test_an_error_before_any_token_is_an_http_status(serve):
    url, exporter, _ = await serve(ScriptedGenerator(fail_before=ResourceExhausted("no KV")))
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            async with session.post(
                f"{url}/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": "hi",
                    "stream": stream,
                },
            ) as reply:
                assert reply.status == 429
                assert (await reply.json())["error"]["code"] == "resource_exhausted"
        async with session.post(f"{url}/v1/completions", data=b"{oops") as reply:
            assert reply.status == 400
            assert (await reply.json())["error"]["param"] == "body"
    (span, *_) = [s for s in exporter.get_finished_spans() if s.name == "openai_http.completions"]
    assert span.attributes["kvrs.openai.status"] == 429


async def test_an_error_mid_stream_is_a_last_error_event_without_done(serve):
    url, _, _ = await serve(
        ScriptedGenerator(fail_after_tokens=(3, protocol.RequestAborted("recovery gave up")))
    )
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{url}/v1/completions",
            json={
                "model": "tiny",
                "prompt": "hi",
                "stream": True,
                "max_tokens": 10,
            },
        ) as reply:
            assert reply.status == 200
            events = events_of(await reply.text())
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "request_aborted"


async def test_models_lists_the_served_model(serve):
    url, _, _ = await serve(ScriptedGenerator())
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as reply:
            models = await reply.json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_config_reads_the_environment_and_names_bad_values():
    from services.common import ConfigError

    assert Config.from_env({"KVRS_MODEL": "tiny"}).model == "tiny"
    assert (
        Config.from_env({"KVRS_MODEL": "tiny", "OPENAI_HTTP_MODEL": "kvrs-tiny"}).model
        == "kvrs-tiny"
    )
    assert Config.from_env({}).listen_addr == "127.0.0.1:8000"
    for env, name in (
        ({"OPENAI_HTTP_MAX_TOKENS": "0"}, "OPENAI_HTTP_MAX_TOKENS"),
        ({"OPENAI_HTTP_REQUEST_TIMEOUT_S": "-1"}, "OPENAI_HTTP_REQUEST_TIMEOUT_S"),
        ({"OPENAI_HTTP_LISTEN_ADDR": "8000"}, "OPENAI_HTTP_LISTEN_ADDR"),
    ):
        with pytest.raises(ConfigError, match=name):
            Config.from_env(env)


class ScriptedRouter(router_pb2_grpc.RouterServiceServicer):
    """RouterService answering from a script: (tokens, summary finish reason, final status)."""

    def __init__(self, tokens: int, finish_reason: str, status: grpc.StatusCode | None) -> None:
        self.script = (tokens, finish_reason, status)

    async def Generate(self, request, context):
        tokens, finish_reason, status = self.script
        summary = router_pb2.GenerateSummary(
            request_id=request.request_id,
            prompt_tokens=len(request.prompt_token_ids),
            generated_tokens=tokens,
            finish_reason=finish_reason,
        )
        for index in range(tokens):
            last = index == tokens - 1 and finish_reason != "abort"
            yield router_pb2.GenerateResponse(
                index=index, token_id=65 + index, summary=summary if last else None
            )
        if finish_reason == "abort":
            yield router_pb2.GenerateResponse(summary=summary)
        if status is not None:
            await context.abort(status, "scripted failure")


@pytest.mark.parametrize(
    ("script", "tokens", "error"),
    [
        ((3, "length", None), 3, None),
        ((2, "abort", grpc.StatusCode.DEADLINE_EXCEEDED), 2, protocol.RequestAborted),
        ((0, "", grpc.StatusCode.UNAVAILABLE), 0, Unavailable),
        ((0, "", grpc.StatusCode.INVALID_ARGUMENT), 0, InvalidArgument),
    ],
)
async def test_the_router_generator_reads_generate_streams(script, tokens, error):
    from services.common.server import start_server
    from services.openai_http.generation import RouterGenerator

    provider = setup_tracing("test-router-generator", exporter=InMemorySpanExporter())
    server = await start_server(
        lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(ScriptedRouter(*script), s),
        ["kvrs.v1.RouterService"],
        "127.0.0.1:0",
        GrpcSettings(),
        provider,
    )
    generator = RouterGenerator(f"127.0.0.1:{server.port}", GrpcSettings())
    events = []
    call = GenerateCall("req-1", (1, 2), max_new_tokens=3, timeout_s=5)
    try:
        if error is None:
            events = [event async for event in generator.generate(call)]
        else:
            with pytest.raises(error):
                async for event in generator.generate(call):
                    events.append(event)
    finally:
        await generator.close()
        await server.stop(0)
    assert [e.token_id for e in events if isinstance(e, Token)] == [65 + i for i in range(tokens)]
    if error is None:
        assert events[-1] == Finished("length", prompt_tokens=2, generated_tokens=3)


# Chat completions: the same path, a conversation rendered into one prompt.

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
]


def test_a_conversation_renders_into_one_prompt():
    assert chat.render(CONVERSATION) == "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"
    request = chat.parse_chat_request(
        {"model": "tiny", "messages": CONVERSATION, "max_completion_tokens": 5, "stream": True},
        "tiny",
        64,
    )
    assert request.prompts == (tuple(tokenizer.encode(chat.render(CONVERSATION))),)
    assert (request.max_tokens, request.stream) == (5, True)
    older = chat.parse_chat_request(
        {"model": "tiny", "messages": CONVERSATION, "max_tokens": 7}, "tiny", 64
    )
    assert older.max_tokens == 7
    unbounded = chat.parse_chat_request({"model": "tiny", "messages": CONVERSATION}, "tiny", 64)
    assert unbounded.max_tokens == 64, "without a limit, the server's own"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": CONVERSATION, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": CONVERSATION, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": CONVERSATION, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": CONVERSATION, "temperature": -0.1}, "temperature"),
        ({"messages": CONVERSATION, "prompt": "x"}, "prompt"),
    ],
)
def test_bad_or_unsupported_chat_parameters_are_named(body, param):
    with pytest.raises(InvalidArgument) as info:
        chat.parse_chat_request({"model": "tiny", **body}, "tiny", 64)
    assert info.value.field == param


async def test_chat_stream_deltas_add_up_to_the_message(serve):
    url, exporter, _ = await serve(ScriptedGenerator())
    body = {"model": "tiny", "messages": CONVERSATION, "max_completion_tokens": 64}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers={"x-request-id": "c-1"}
        ) as reply:
            assert reply.status == 200
            whole = await reply.json()
        async with session.post(
            f"{url}/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as reply:
            raw = await reply.text()
    assert whole["id"] == "chatcmpl-c-1" and whole["object"] == "chat.completion"
    assert whole["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": REPLY},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    prompt_tokens = len(tokenizer.encode(chat.render(CONVERSATION)))
    assert whole["usage"]["prompt_tokens"] == prompt_tokens
    events = events_of(raw)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = [json.loads(event) for event in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert not any("role" in delta for delta in deltas[1:])
    assert "".join(delta.get("content", "") for delta in deltas) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["usage"] == whole["usage"]
    spans = [s.name for s in exporter.get_finished_spans()]
    assert spans.count("openai_http.chat_completions") == 2


def test_sampling_parameters_and_stop_sequences_are_parsed_as_openai_defines_them():
    from kvrs.sampling import Sampling

    request = parse(temperature=0.8, top_p=0.9, top_k=40, seed=7, stop="\n")
    assert request.sampling == Sampling(0.8, 0.9, 40, 7)
    assert request.stop == ("\n",)
    assert parse().sampling == Sampling()  # no temperature: greedy, reproducible
    assert parse(top_k=-1, seed=-1).sampling == Sampling(top_k=0, seed=(1 << 64) - 1)
    assert parse(stop=["wö", "€"]).stop == ("wö", "€")
    chat_request = chat.parse_chat_request(
        {"model": "tiny", "messages": CONVERSATION, "temperature": 1.5, "stop": ["x"]}, "tiny", 64
    )
    assert chat_request.sampling.temperature == 1.5 and chat_request.stop == ("x",)


def test_stop_text_holds_back_what_may_start_a_stop_sequence():
    from services.openai_http.app import StopText

    stopper = StopText(["wörld", "lo!"])
    assert stopper.push("hél") == "hé"  # "l" may start "lo!"
    assert stopper.push("lo, w") == "llo, "
    assert stopper.push("ö") == ""
    assert stopper.push("rld €") == ""
    assert stopper.stopped
    free = StopText([])
    assert free.push("abc") == "abc" and free.flush() == ""


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_sequence_ends_the_choice_before_it(serve, stream):
    url, _, _ = await serve(ScriptedGenerator())
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 64, "stop": ["wör"], "stream": stream}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            assert reply.status == 200
            if stream:
                chunks = [json.loads(e) for e in events_of(await reply.text())[:-1]]
                text = "".join(c["choices"][0]["text"] for c in chunks)
                reason = chunks[-1]["choices"][0]["finish_reason"]
            else:
                (choice,) = (await reply.json())["choices"]
                text, reason = choice["text"], choice["finish_reason"]
    assert (text, reason) == ("héllo, ", "stop")


async def test_sampling_reaches_the_generator(serve):
    generator = ScriptedGenerator()
    url, _, _ = await serve(generator)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0.5, "seed": 9}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            assert reply.status == 200
    (call,) = generator.calls
    assert (call.sampling.temperature, call.sampling.seed) == (0.5, 9)
