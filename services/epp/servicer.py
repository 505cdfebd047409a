"""Envoy's ext_proc `ExternalProcessor.Process` stream, per the endpoint-picker protocol.

One stream is one HTTP request. The picker needs the prompt, so the pick happens once
the body is complete; how the answer travels depends on the filter's request body mode,
which Envoy announces in the first message's `protocol_config`:

* BUFFERED / BUFFERED_PARTIAL: the request headers are answered at once (continue), the
  whole body arrives in one message, and its answer carries the header mutation.
* FULL_DUPLEX_STREAMED: nothing is answered until the body (and trailers, if any) is
  complete; then the headers answer carries the header mutation and the body is
  streamed back unchanged, in chunks of at most 64 KiB.
* NONE / STREAMED (or a request without a body): picked from the headers alone.

The destination is `x-gateway-destination-endpoint: ip:port` (followed by the fallback
endpoints, `ip:port,ip:port,...` in order, when EPP_FALLBACK_ENDPOINTS asks for them) in
the request headers and the same value under dynamic metadata `envoy.lb` /
`x-gateway-destination-endpoint` (the filter must list `envoy.lb` in
`metadata_options.receiving_namespaces`); a client's own header of that name is
overwritten. The subset hint is read from `envoy.lb.subset_hint` /
`x-gateway-destination-endpoint-subset` in the request's metadata context (listed in
`forwarding_namespaces`). On the response, the endpoint that served it is read from
`envoy.lb` / `x-gateway-destination-endpoint-served` in the metadata context, when the
gateway sends it, and recorded (primary, fallback or unlisted). A request that cannot be
placed gets an immediate response in OpenAI's error shape: 503 when no eligible endpoint
exists or kvrs cannot answer, 429 without capacity (shedding), 400 for a body that is
not a valid OpenAI request, 500 on a misconfiguration. Response messages pass through
untouched. The protocol is the Gateway API Inference Extension's endpoint picker
protocol v1.0.0 (PROTOCOL_VERSION).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from opentelemetry.context import Context
from opentelemetry.propagate import extract

from kvrs.errors import InvalidArgument, KvrsError
from services.common.openai_protocol import error_body, http_error, json_bytes
from services.common.tokenizer import TextCodec
from services.epp.picker import Pick, Picker, PickRequest, new_request_id, prompt_info

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "1.0.0"
"""The endpoint picker protocol version followed (gateway-api-inference-extension,
docs/proposals/004-endpoint-picker-protocol): v0.2.0 destination header and metadata,
v0.3.0 subset hint, v0.4.0 fallback endpoint list, v1.0.0 served-endpoint metadata."""
DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
STREAMED_CHUNK_BYTES = 64 * 1024
"""Largest body chunk streamed back in FULL_DUPLEX_STREAMED mode (Envoy's advice)."""

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
_PICK_ON_HEADERS = (BodyMode.NONE, BodyMode.STREAMED)


def subset_hint(metadata: base_pb2.Metadata) -> tuple[str, ...] | None:
    """The endpoints of the gateway's subset hint; None when it sent none.

    The protocol's value is a list of "ip:port"; a single comma-separated string is
    accepted too.
    """
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [
            item.string_value
            for item in value.list_value.values
            if item.WhichOneof("kind") == "string_value"
        ]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return tuple(item.strip() for item in items if item.strip())


def _header_value(header: base_pb2.HeaderValue) -> str:
    return header.raw_value.decode("utf-8", errors="replace") if header.raw_value else header.value


def served_endpoint(metadata: base_pb2.Metadata) -> str:
    """The endpoint the gateway reports served the request; "" when it sent none."""
    namespace = metadata.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is None or SERVED_KEY not in namespace.fields:
        return ""
    return namespace.fields[SERVED_KEY].string_value.strip()


def destination(
    endpoints: Sequence[str], headers: Sequence[tuple[str, str]] = ()
) -> tuple[ext_proc_pb2.CommonResponse, struct_pb2.Struct]:
    """The header mutation and dynamic metadata that send the request to `endpoints`
    (the first, then the rest in order); the same value in both, as the protocol asks.
    `headers` are set on the request too (a client's own values are overwritten)."""
    endpoint = ",".join(endpoints)
    mutation = ext_proc_pb2.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for key, value in ((DESTINATION_HEADER, endpoint), *headers)
        ]
    )
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return ext_proc_pb2.CommonResponse(header_mutation=mutation), metadata


def immediate(status: int, body: dict, details: str) -> ext_proc_pb2.ProcessingResponse:
    """A local reply in OpenAI's error shape instead of forwarding the request."""
    return ext_proc_pb2.ProcessingResponse(
        immediate_response=ext_proc_pb2.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc_pb2.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(
                            key="content-type", raw_value=b"application/json"
                        ),
                        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                    )
                ]
            ),
            body=json_bytes(body),
            details=details,
        )
    )


def streamed_body(chunk: bytes, end_of_stream: bool) -> ext_proc_pb2.BodyResponse:
    """A FULL_DUPLEX_STREAMED body answer: `chunk` goes on unchanged."""
    streamed = ext_proc_pb2.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
    mutation = ext_proc_pb2.BodyMutation(streamed_response=streamed)
    return ext_proc_pb2.BodyResponse(response=ext_proc_pb2.CommonResponse(body_mutation=mutation))


class _Exchange:
    """The state of one HTTP request's stream."""

    def __init__(self, picker: Picker, block_tokens: int, codec: TextCodec | None = None) -> None:
        self.picker = picker
        self.block_tokens = block_tokens
        self.codec = codec
        self.request_body_mode = BodyMode.BUFFERED
        self.response_body_mode = BodyMode.NONE
        self.headers: dict[str, str] = {}
        self.subset: tuple[str, ...] | None = None
        self.body = bytearray()
        self.trailers_seen = False
        self.decided = False
        self.pick: Pick | None = None
        self.served_recorded = False

    @property
    def full_duplex(self) -> bool:
        return self.request_body_mode == BodyMode.FULL_DUPLEX_STREAMED

    async def handle(
        self, message: ext_proc_pb2.ProcessingRequest
    ) -> list[ext_proc_pb2.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.request_body_mode = message.protocol_config.request_body_mode
            self.response_body_mode = message.protocol_config.response_body_mode
        kind = message.WhichOneof("request")
        if message.HasField("metadata_context"):
            hint = subset_hint(message.metadata_context)
            if hint is not None:
                self.subset = hint
            if kind and kind.startswith("response_"):
                self._record_served(message.metadata_context)
        if kind == "request_headers":
            return await self._request_headers(message.request_headers)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            return [
                ext_proc_pb2.ProcessingResponse(response_headers=ext_proc_pb2.HeadersResponse())
            ]
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            return [
                ext_proc_pb2.ProcessingResponse(response_trailers=ext_proc_pb2.TrailersResponse())
            ]
        return []

    async def _request_headers(
        self, headers: ext_proc_pb2.HttpHeaders
    ) -> list[ext_proc_pb2.ProcessingResponse]:
        self.headers = {h.key.lower(): _header_value(h) for h in headers.headers.headers}
        if headers.end_of_stream or self.request_body_mode in _PICK_ON_HEADERS:
            return await self._decide(in_body=False)
        if self.full_duplex:
            return []
        return [ext_proc_pb2.ProcessingResponse(request_headers=ext_proc_pb2.HeadersResponse())]

    async def _request_body(
        self, body: ext_proc_pb2.HttpBody
    ) -> list[ext_proc_pb2.ProcessingResponse]:
        if self.decided:
            # Bodies that follow a pick made from the headers pass through.
            if self.full_duplex:
                return self._streamed(bytes(body.body), body.end_of_stream)
            return [ext_proc_pb2.ProcessingResponse(request_body=ext_proc_pb2.BodyResponse())]
        self.body += body.body
        if self.full_duplex:
            return await self._decide(in_body=False) if body.end_of_stream else []
        # BUFFERED sends the whole body at once; BUFFERED_PARTIAL as much as it kept.
        return await self._decide(in_body=True)

    async def _request_trailers(self) -> list[ext_proc_pb2.ProcessingResponse]:
        self.trailers_seen = True
        responses = []
        if not self.decided:
            responses = await self._decide(in_body=False)
            if responses and responses[0].HasField("immediate_response"):
                return responses
        responses.append(
            ext_proc_pb2.ProcessingResponse(request_trailers=ext_proc_pb2.TrailersResponse())
        )
        return responses

    def _record_served(self, metadata: base_pb2.Metadata) -> None:
        served = served_endpoint(metadata)
        if self.pick is None or self.served_recorded or not served:
            return
        self.served_recorded = True
        rank = self.picker.served(self.pick, served, context=self._trace_context())
        if rank != "primary":
            log.info(
                "request %s picked for %s was served by %s (%s)",
                self.headers.get("x-request-id", ""),
                self.pick.endpoint,
                served,
                rank,
            )

    def _response_body(self, body: ext_proc_pb2.HttpBody) -> list[ext_proc_pb2.ProcessingResponse]:
        if self.response_body_mode == BodyMode.FULL_DUPLEX_STREAMED:
            return [
                ext_proc_pb2.ProcessingResponse(
                    response_body=streamed_body(body.body, body.end_of_stream)
                )
            ]
        return [ext_proc_pb2.ProcessingResponse(response_body=ext_proc_pb2.BodyResponse())]

    def _streamed(self, data: bytes, end_of_stream: bool) -> list[ext_proc_pb2.ProcessingResponse]:
        chunks = [
            data[i : i + STREAMED_CHUNK_BYTES] for i in range(0, len(data), STREAMED_CHUNK_BYTES)
        ] or [b""]
        last = len(chunks) - 1
        return [
            ext_proc_pb2.ProcessingResponse(
                request_body=streamed_body(chunk, end_of_stream and index == last)
            )
            for index, chunk in enumerate(chunks)
        ]

    async def _decide(self, in_body: bool) -> list[ext_proc_pb2.ProcessingResponse]:
        """Picks the endpoint and answers the message that completed the request.

        `in_body`: the answer is the body message's (BUFFERED); otherwise the held-back
        headers are answered, followed in full-duplex mode by the buffered body.
        """
        self.decided = True
        request_id = self.headers.get("x-request-id") or new_request_id()
        try:
            prompt = prompt_info(bytes(self.body), self.block_tokens, self.codec)
            pick = await self.picker.pick(
                PickRequest(request_id=request_id, prompt=prompt, subset=self.subset),
                context=self._trace_context(),
            )
        except KvrsError as exc:
            status, body = http_error(exc)
            if not isinstance(exc, InvalidArgument):
                log.info("request %s not placed (%d): %s", request_id, status, exc)
            return [immediate(status, body, f"kvrs_epp_{exc.code.lower()}")]
        self.pick = pick
        prefiller = self.picker.prefiller_header
        common, metadata = destination(
            pick.endpoints, [(prefiller, pick.prefill_endpoint)] if pick.prefill_endpoint else []
        )
        if in_body:
            return [
                ext_proc_pb2.ProcessingResponse(
                    request_body=ext_proc_pb2.BodyResponse(response=common),
                    dynamic_metadata=metadata,
                )
            ]
        responses = [
            ext_proc_pb2.ProcessingResponse(
                request_headers=ext_proc_pb2.HeadersResponse(response=common),
                dynamic_metadata=metadata,
            )
        ]
        if self.full_duplex and self.body:
            responses += self._streamed(bytes(self.body), end_of_stream=not self.trailers_seen)
        return responses

    def _trace_context(self) -> Context:
        return extract({k: v for k, v in self.headers.items() if not k.startswith(":")})


class ExternalProcessorServicer(ext_proc_pb2_grpc.ExternalProcessorServicer):
    """Answers every ext_proc stream with the picker's choice (see module doc)."""

    def __init__(self, picker: Picker, block_tokens: int, codec: TextCodec | None = None) -> None:
        self.picker = picker
        self.block_tokens = block_tokens
        self.codec = codec

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc_pb2.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc_pb2.ProcessingResponse]:
        exchange = _Exchange(self.picker, self.block_tokens, self.codec)
        async for message in request_iterator:
            try:
                responses: Sequence[ext_proc_pb2.ProcessingResponse] = await exchange.handle(
                    message
                )
            except Exception:  # noqa: BLE001 - the gateway gets a 500, the log the traceback
                log.exception("ext_proc stream failed")
                responses = [
                    immediate(
                        500,
                        error_body(
                            "internal error in the endpoint picker; see its log",
                            "server_error",
                            None,
                            "internal",
                        ),
                        "kvrs_epp_internal",
                    )
                ]
            for response in responses:
                yield response
