"""The HTTP handlers: OpenAI's completions, chat completions and models over a `Generator`.

Both completion endpoints take the same path; a `Dialect` says how each parses its
request and shapes its bodies. A streamed completion answers with server-sent events in
OpenAI's chunk format, one chunk per piece of text (a multi-byte character is sent once
complete), the choice's last chunk carrying its `finish_reason`, then `data: [DONE]`.
The 200 and the event stream start only once the first token is there, so a request
that fails before any output (bad input, no capacity, nothing alive) gets a real HTTP
status; a failure after that arrives as a last `data: {"error": ...}` event, without
`[DONE]`, which OpenAI's clients raise as an error.

With API keys configured, every /v1/ route wants `Authorization: Bearer <key>` (401
otherwise, as vLLM's `--api-key` does); `/health` (liveness: the process answers) and
`/ready` (readiness: its router reports SERVING) stay open to probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.propagate import extract
from opentelemetry.trace import Span, SpanKind, Tracer

from kvrs.errors import InvalidArgument, KvrsError
from services.common import openai_chat as chat
from services.common import openai_protocol as protocol
from services.common.metrics import Metrics
from services.common.tokenizer import TextCodec, load_codec
from services.openai_http.config import Config
from services.openai_http.generation import Finished, GenerateCall, Generator

Readiness = Callable[[], Awaitable[str]]
"""The router's health status name (SERVING when the adapter can serve completions)."""

DECODE_INSTANCE_HEADER = "x-kvrs-decode-instance"
"""Response header of a non-streamed completion: the decode instance(s) that finished it."""

log = logging.getLogger(__name__)

Event = tuple[int, "Piece | Finished"]
"""(prompt index, what happened)."""


@dataclass(frozen=True)
class Dialect:
    """What differs between `/v1/completions` and `/v1/chat/completions`."""

    name: str
    """Span suffix: openai_http.<name>."""
    id_prefix: str
    parse: Callable[..., protocol.CompletionRequest]
    """(body, served model, max tokens limit, codec=, aliases=) -> the request."""
    completion_body: Callable[..., dict[str, Any]]
    chunk_body: Callable[..., dict[str, Any]]
    """(id, model, index, text, finish_reason, created, first) -> one streamed chunk."""
    usage_chunk_body: Callable[..., dict[str, Any]]


def _text_chunk(
    request_id: str,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    created_unix_s: int,
    first: bool,
) -> dict[str, Any]:
    # Text chunks look the same from the first to the last.
    return protocol.chunk_body(request_id, model, index, text, finish_reason, created_unix_s)


COMPLETIONS = Dialect(
    "completions",
    "cmpl-",
    protocol.parse_completion_request,
    protocol.completion_body,
    _text_chunk,
    protocol.usage_chunk_body,
)
CHAT = Dialect(
    "chat_completions",
    "chatcmpl-",
    chat.parse_chat_request,
    chat.completion_body,
    chat.chunk_body,
    functools.partial(protocol.usage_chunk_body, object_name="chat.completion.chunk"),
)


@dataclass(frozen=True)
class Piece:
    """Text a choice gained (possibly none) and the tokens that made it."""

    text: str
    tokens: int


class StopText:
    """A choice's text up to its first stop sequence. A tail that may be the start of a
    stop sequence is held back until the next piece shows whether it is."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        text = self._held + piece
        hits = [at for at in (text.find(stop) for stop in self._stops) if at >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        held = max(
            (n for stop in self._stops for n in range(1, len(stop)) if text.endswith(stop[:n])),
            default=0,
        )
        self._held = text[len(text) - held :]
        return text[: len(text) - held]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


async def _choice(
    generator: Generator,
    call: GenerateCall,
    codec: TextCodec,
    stop_token_ids: frozenset[int],
    stops: Sequence[str],
) -> AsyncGenerator[Piece | Finished, None]:
    """One choice as text, as its tokens arrive, up to the model's end-of-sequence token
    or a stop sequence (then finishing with reason "stop", the rest of the generation
    cancelled); a multi-byte character comes out once complete."""
    decoder, stopper = codec.stream(), StopText(stops)
    prompt_tokens = len(call.prompt_token_ids)
    async with contextlib.aclosing(generator.generate(call)) as events:
        async for event in events:
            if isinstance(event, Finished):
                text = stopper.push(decoder.flush())
                if stopper.stopped:
                    event = Finished("stop", prompt_tokens, event.generated_tokens)
                yield Piece(text + stopper.flush(), 0)
                yield event
                return
            if event.token_id in stop_token_ids:
                yield Piece(stopper.push(decoder.flush()) + stopper.flush(), 1)
                yield Finished("stop", prompt_tokens, event.index + 1)
                return
            text = stopper.push(decoder.push(event.token_id))
            yield Piece(text, 1)
            if stopper.stopped:
                yield Finished("stop", prompt_tokens, event.index + 1)
                return


async def _merged(
    choices: Sequence[Callable[[], AsyncGenerator[Piece | Finished, None]]],
) -> AsyncGenerator[Event, None]:
    """The events of every choice, each tagged with its prompt's index, as they come."""
    if len(choices) == 1:
        # Closed here, so a client that goes away cancels its router call at once.
        async with contextlib.aclosing(choices[0]()) as events:
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Piece | Finished | Exception | None]] = asyncio.Queue()

    async def pump(
        index: int, choice: Callable[[], AsyncGenerator[Piece | Finished, None]]
    ) -> None:
        try:
            async with contextlib.aclosing(choice()) as events:
                async for event in events:
                    await queue.put((index, event))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer below
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, choice)) for i, choice in enumerate(choices)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class CompletionsApi:
    """`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
    `GET /ready`."""

    def __init__(
        self,
        config: Config,
        generator: Generator,
        tracer: Tracer,
        metrics: Metrics | None = None,
        codec: TextCodec | None = None,
        readiness: Readiness | None = None,
    ) -> None:
        self.config = config
        self.codec = codec or load_codec(config.checkpoint)
        self._stop_token_ids = frozenset(self.codec.eos_token_ids)
        self.generator = generator
        self.tracer = tracer
        self.metrics = metrics
        self.readiness = readiness
        self.created_unix_s = int(time.time())
        self._keys = [key.encode() for key in config.api_keys]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authenticate] if self._keys else [])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        offered = presented.strip().encode()
        # Every key is compared, in constant time: neither which key nor how much of one
        # matched shows in the answer's timing.
        matched = [hmac.compare_digest(offered, key) for key in self._keys]
        if scheme.lower() == "bearer" and any(matched):
            return await handler(request)
        self._count("unauthorized")
        return web.json_response(
            protocol.error_body(
                "missing or wrong API key: send Authorization: Bearer <key>",
                "invalid_request_error",
                None,
                "invalid_api_key",
            ),
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: the process and its event loop answer; nothing else is asked."""
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: 200 only while the router answers its health check SERVING."""
        status = "SERVING" if self.readiness is None else await self.readiness()
        if status == "SERVING":
            return web.json_response({"status": "ready", "router": status})
        return web.json_response({"status": "not ready", "router": status}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(protocol.models_body(self.config.model, self.created_unix_s))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT)

    async def _serve(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        base_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        context = extract(dict(request.headers))
        with self.tracer.start_as_current_span(
            f"openai_http.{dialect.name}", context=context, kind=SpanKind.SERVER
        ) as span:
            span.set_attribute("kvrs.request_id", base_id)
            try:
                parsed = dialect.parse(
                    await self._json(request),
                    self.config.model,
                    self.config.max_tokens_limit,
                    codec=self.codec,
                    aliases=(self.config.checkpoint,),
                )
            except KvrsError as exc:
                return self._error(exc, span)
            span.set_attributes(
                {
                    "kvrs.prompt_tokens": sum(len(p) for p in parsed.prompts),
                    "kvrs.openai.prompts": len(parsed.prompts),
                    "kvrs.openai.stream": parsed.stream,
                    "kvrs.openai.max_tokens": parsed.max_tokens,
                }
            )
            calls = [
                GenerateCall(
                    request_id=base_id if len(parsed.prompts) == 1 else f"{base_id}-{index}",
                    prompt_token_ids=prompt,
                    max_new_tokens=parsed.max_tokens,
                    timeout_s=self.config.request_timeout_s,
                    ttft_slo_s=self.config.ttft_slo_s,
                    decode_instance_id=self.config.decode_instance_id,
                    sampling=parsed.sampling,
                )
                for index, prompt in enumerate(parsed.prompts)
            ]
            completion_id = f"{dialect.id_prefix}{base_id}"
            if parsed.stream:
                return await self._stream(request, dialect, parsed, calls, completion_id, span)
            return await self._complete(dialect, parsed, calls, completion_id, span)

    @staticmethod
    async def _json(request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument("body", f"is not JSON: {exc}") from None

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=outcome).inc()

    def _error(self, exc: KvrsError, span: Span) -> web.Response:
        status, body = protocol.http_error(exc)
        span.set_attributes(
            {"kvrs.openai.status": status, "kvrs.openai.error_code": body["error"]["code"]}
        )
        if status >= 500:
            log.warning("completion failed (%d): %s", status, exc)
        self._count("client_error" if status < 500 else "server_error")
        return web.json_response(body, status=status)

    def _choices(
        self, parsed: protocol.CompletionRequest, calls: Sequence[GenerateCall]
    ) -> list[Callable[[], AsyncGenerator[Piece | Finished, None]]]:
        return [
            functools.partial(
                _choice, self.generator, call, self.codec, self._stop_token_ids, parsed.stop
            )
            for call in calls
        ]

    async def _complete(
        self,
        dialect: Dialect,
        parsed: protocol.CompletionRequest,
        calls: Sequence[GenerateCall],
        completion_id: str,
        span: Span,
    ) -> web.Response:
        texts = [""] * len(calls)
        generated = 0
        reasons = ["length"] * len(calls)
        served_by: set[str] = set()
        try:
            async with contextlib.aclosing(_merged(self._choices(parsed, calls))) as events:
                async for index, event in events:
                    if isinstance(event, Piece):
                        texts[index] += event.text
                        generated += event.tokens
                    else:
                        reasons[index] = event.finish_reason
                        served_by.add(event.decode_instance_id)
        except KvrsError as exc:
            return self._error(exc, span)
        served_by.discard("")
        usage = protocol.Usage(sum(len(p) for p in parsed.prompts), generated)
        span.set_attributes(
            {"kvrs.generated_tokens": usage.completion_tokens, "kvrs.openai.status": 200}
        )
        self._count("ok")
        return web.json_response(
            dialect.completion_body(
                completion_id,
                parsed.model,
                texts,
                reasons,
                usage,
            ),
            headers={DECODE_INSTANCE_HEADER: ",".join(sorted(served_by))} if served_by else None,
        )

    async def _stream(
        self,
        request: web.Request,
        dialect: Dialect,
        parsed: protocol.CompletionRequest,
        calls: Sequence[GenerateCall],
        completion_id: str,
        span: Span,
    ) -> web.StreamResponse:
        created_unix_s = int(time.time())
        generated = 0
        async with contextlib.aclosing(_merged(self._choices(parsed, calls))) as events:
            try:
                event: Event | None = await anext(events)
            except KvrsError as exc:
                return self._error(exc, span)
            response = web.StreamResponse(
                headers={
                    "content-type": "text/event-stream; charset=utf-8",
                    "cache-control": "no-cache",
                }
            )
            await response.prepare(request)
            span.set_attribute("kvrs.openai.status", 200)

            async def send(body: dict[str, Any]) -> None:
                await response.write(b"data: " + protocol.json_bytes(body) + b"\n\n")

            opened = [False] * len(calls)

            async def send_chunk(index: int, text: str, finish_reason: str | None) -> None:
                first, opened[index] = not opened[index], True
                await send(
                    dialect.chunk_body(
                        completion_id,
                        parsed.model,
                        index,
                        text,
                        finish_reason,
                        created_unix_s,
                        first,
                    )
                )

            try:
                while event is not None:
                    index, item = event
                    if isinstance(item, Piece):
                        generated += item.tokens
                        if item.text:
                            await send_chunk(index, item.text, None)
                    else:
                        await send_chunk(index, "", item.finish_reason)
                    event = await anext(events, None)
                if parsed.include_usage:
                    usage = protocol.Usage(sum(len(p) for p in parsed.prompts), generated)
                    await send(
                        dialect.usage_chunk_body(completion_id, parsed.model, usage, created_unix_s)
                    )
                await response.write(b"data: [DONE]\n\n")
                self._count("ok")
            except KvrsError as exc:
                status, body = protocol.http_error(exc)
                log.warning("completion %s failed mid-stream (%d): %s", completion_id, status, exc)
                span.set_attribute("kvrs.openai.error_code", body["error"]["code"])
                await send(body)
                self._count("server_error" if status >= 500 else "client_error")
            except ConnectionResetError:
                self._count("cancelled")
                span.set_attribute("kvrs.openai.error_code", "client_disconnected")
                return response
            finally:
                span.set_attribute("kvrs.generated_tokens", generated)
        await response.write_eof()
        return response
