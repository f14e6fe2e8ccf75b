"""The OpenTelemetry side of `kvbridge.tracing`, imported only when tracing is on.

A `Tracing` is one service's tracer provider (its own `service.name`, so that the services of
`kvbridge up` or a test, sharing a process, still report as themselves; the process-wide
provider is never set). It makes the gateway's spans, and the gRPC interceptors that carry the
W3C trace context as `traceparent` metadata: `_ServerInterceptor` opens a server span for a
call that arrives with one (a call without is left alone, untraced), `_ClientInterceptor`
opens a client span and sends the context along for a call made inside a trace.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import kvbridge

_CONTEXT_KEYS = ("traceparent", "tracestate")
_CLOSE_TIMEOUT_S = 5.0  # most a stopping service waits for its last spans to be exported


def _exporter(url: str, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=url, insecure=url.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=url)


def span_processor(url: str, protocol: str) -> SpanProcessor:
    """Spans batched and exported over OTLP `protocol` to `url`, off the request path (a test
    replaces this to keep them in memory)."""
    return BatchSpanProcessor(_exporter(url, protocol))


def _carrier(metadata: Any) -> dict[str, str] | None:
    """The trace context entries of gRPC `metadata`, or None when it has no traceparent."""
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if key in _CONTEXT_KEYS and isinstance(value, str):
            found[key] = value
    return found if "traceparent" in found else None


class Tracing:
    """One service's traces (see the module docstring)."""

    def __init__(self, service: str, processor: SpanProcessor) -> None:
        self.service = service
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvbridge", kvbridge.__version__)
        self.propagator = TraceContextTextMapPropagator()

    async def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Export what is left and stop (a stopping service), in a thread so that the event
        loop goes on serving meanwhile, waiting for it `timeout` seconds at most (a collector
        that is down must not hold a shutdown)."""
        done = asyncio.ensure_future(asyncio.to_thread(self.provider.shutdown))
        await asyncio.wait([done], timeout=timeout)

    # ---- HTTP (the gateway) -----------------------------------------------------------------

    def server_span(self, name: str, headers: Mapping[str, str], attributes: dict[str, Any]
                    ) -> AbstractContextManager[Span]:
        """A server span, current while the context manager is open: a child of the request's
        own `traceparent` header when it has one, else a new trace. Exceptions are the
        caller's to record."""
        return self.tracer.start_as_current_span(
            name, context=self.propagator.extract(headers), kind=SpanKind.SERVER,
            attributes=attributes, record_exception=False, set_status_on_exception=False)

    def client_span(self, name: str, attributes: dict[str, Any]) -> tuple[Span, dict[str, str]]:
        """A client span under the current one (not made current; the caller ends it), and the
        headers that carry its context to the server called."""
        span = self.tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        headers: dict[str, str] = {}
        self.propagator.inject(headers, context=trace.set_span_in_context(span))
        return span, headers

    @staticmethod
    def http_status(span: Span, status: int) -> None:
        """An HTTP answer's status on `span`; 5xx marks it failed."""
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            failed(span, f"HTTP {status}")

    @staticmethod
    def failed(span: Span, description: str) -> None:
        failed(span, description)

    # ---- gRPC -------------------------------------------------------------------------------

    def server_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _ServerInterceptor(self)

    def client_interceptor(self) -> grpc.aio.ClientInterceptor:
        return _ClientInterceptor(self)

    def rpc_span(self, method: str, kind: SpanKind, context: Context | None
                 ) -> AbstractContextManager[Span]:
        service, _, name = method.lstrip("/").partition("/")
        return self.tracer.start_as_current_span(
            method.lstrip("/"), context=context, kind=kind,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
            record_exception=False, set_status_on_exception=False)


def failed(span: Span, description: str) -> None:
    span.set_status(Status(StatusCode.ERROR, description[:200]))


def _server_outcome(span: Span, context: grpc.aio.ServicerContext[Any, Any],
                    exc: BaseException | None) -> None:
    code = None
    with contextlib.suppress(Exception):  # a context without the call's status yet
        code = context.code()
    if not isinstance(code, grpc.StatusCode):  # none set: OK, unless the handler raised
        code = grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        failed(span, code.name)


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        carrier = _carrier(details.invocation_metadata)
        if handler is None or carrier is None:
            return handler
        parent = self.tracing.propagator.extract(carrier)
        if not trace.get_current_span(parent).get_span_context().is_valid:
            return handler  # a malformed traceparent: untraced
        method, tracing = details.method, self.tracing
        functions: Any = handler  # (the stubs type its functions as the sync server's)
        if functions.unary_unary is not None:
            unary = functions.unary_unary

            async def traced_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]
                                   ) -> Any:
                with tracing.rpc_span(method, SpanKind.SERVER, parent) as span:
                    try:
                        response = await unary(request, context)
                    except BaseException as exc:
                        _server_outcome(span, context, exc)
                        raise
                    _server_outcome(span, context, None)
                    return response

            return functions._replace(unary_unary=traced_unary)  # type: ignore[no-any-return]
        if functions.unary_stream is not None:
            stream = functions.unary_stream

            async def traced_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]
                                    ) -> AsyncIterator[Any]:
                with tracing.rpc_span(method, SpanKind.SERVER, parent) as span:
                    try:
                        async for item in stream(request, context):
                            yield item
                    except BaseException as exc:
                        _server_outcome(span, context, exc)
                        raise
                    _server_outcome(span, context, None)

            return functions._replace(unary_stream=traced_stream)  # type: ignore[no-any-return]
        return handler


class _ClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    async def intercept_unary_unary(
            self, continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
            details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        if not trace.get_current_span().get_span_context().is_valid:
            return await continuation(details, request)  # not inside a trace
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        with self.tracing.rpc_span(method, SpanKind.CLIENT, None) as span:
            carrier: dict[str, str] = {}
            self.tracing.propagator.inject(carrier)
            metadata = grpc.aio.Metadata(*_pairs(details.metadata), *carrier.items())
            call = await continuation(grpc.aio.ClientCallDetails(
                details.method, details.timeout, metadata, details.credentials,
                details.wait_for_ready), request)
            try:
                await call
            except grpc.RpcError as err:
                code = err.code()
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                failed(span, code.name)
            except BaseException as exc:  # cancelled with the turn
                failed(span, type(exc).__name__)
                raise
            else:
                span.set_attribute("rpc.grpc.status_code", 0)
            return call  # done: awaiting it again gives its response or raises its error


def _pairs(metadata: Any) -> Iterator[tuple[str, Any]]:
    yield from (metadata or ())
