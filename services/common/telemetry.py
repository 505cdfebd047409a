"""Tracing setup: an OTLP-exporting tracer provider per process, passed explicitly.

Nothing here sets module-level tracers: each service builds one provider at start
(`setup_tracing`) and hands it to its server, clients and domain code. The gRPC
interceptors propagate W3C trace context across every hop, and `traceparent()` /
`context_from_traceparent()` carry it where gRPC metadata cannot (libkvxfer transfers).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from kvrs.rpc.channels import Untraced, client_interceptors, not_health_check

__all__ = [
    "client_interceptors",
    "context_from_traceparent",
    "server_interceptors",
    "setup_tracing",
    "traceparent",
]


class _StreamClosedElsewhere(logging.Filter):
    """Drops OpenTelemetry's "Failed to detach context" error when a span's context token
    belongs to another context: the gRPC server interceptor keeps a streaming RPC's span
    current across the handler's yields, and when a client hangs up the stream's
    generator is closed from another task. The span still ends and is exported; only the
    reset of a context that is already gone fails, and it would print a traceback at
    ERROR for every stream a client cancels."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            record.getMessage() == "Failed to detach context"
            and isinstance(exc, ValueError)
            and "was created in a different Context" in str(exc)
        )


_CONTEXT_LOG = logging.getLogger("opentelemetry.context")
_CONTEXT_FILTER = _StreamClosedElsewhere()


def setup_tracing(
    service_name: str,
    exporter: SpanExporter | None = None,
    env: Mapping[str, str] | None = None,
) -> TracerProvider:
    """A provider for `service_name` (OTEL_SERVICE_NAME wins when set).

    With `exporter` given (tests: an in-memory exporter) spans go there synchronously;
    otherwise they are batched to OTEL_EXPORTER_OTLP_ENDPOINT when it is set. When it is
    not, no span would go anywhere: the process does no tracing at all (`Untraced`).
    """
    _CONTEXT_LOG.addFilter(_CONTEXT_FILTER)  # once: adding the same filter again is a no-op
    source = os.environ if env is None else env
    name = source.get("OTEL_SERVICE_NAME") or service_name
    if exporter is None and not source.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return Untraced(resource=Resource.create({SERVICE_NAME: name}))
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = source["OTEL_EXPORTER_OTLP_ENDPOINT"]
        insecure = source.get("OTEL_EXPORTER_OTLP_INSECURE", "true").lower() != "false"
        provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=endpoint, insecure=insecure),
                schedule_delay_millis=500,
            )
        )
    return provider


def server_interceptors(provider: TracerProvider) -> list:
    """The tracing interceptor for a grpc.aio server, health checks left out (none for
    an `Untraced` provider)."""
    if isinstance(provider, Untraced):
        return []
    return [aio_server_interceptor(tracer_provider=provider, filter_=not_health_check)]


def traceparent() -> str:
    """The current span's W3C `traceparent`, or "" outside any span."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent", "")


def context_from_traceparent(value: str) -> otel_context.Context:
    """A context whose parent is the span named by `value` (empty: the current context)."""
    if not value:
        return otel_context.get_current()
    return extract({"traceparent": value})
