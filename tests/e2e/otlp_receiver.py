"""A real OTLP/gRPC trace receiver for tests: what the services export, as they export it."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service_name: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: list[ReceivedSpan], lock: threading.Lock) -> None:
        self._sink = sink
        self._lock = lock

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service_name=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self._lock:
            self._sink.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port) and keeps every span it is sent."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _TraceService(self._spans, self._lock), self._server
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    async def wait_for(self, predicate, timeout_s: float) -> list[ReceivedSpan]:
        """Polls until `predicate(spans)` holds; returns the spans either way."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            if predicate(self.spans()):
                break
            await asyncio.sleep(0.2)
        return self.spans()
