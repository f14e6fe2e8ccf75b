"""OpenTelemetry traces of a turn: gateway -> router -> registry, and on to the engines.

Off unless an OTLP endpoint is configured: `--otlp-traces-endpoint URL` on `kvbridge gateway
serve`, `router serve` and `registry serve` (or `KVBRIDGE_OTLP_TRACES_ENDPOINT`, or
OpenTelemetry's own `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`). Off, this module imports nothing of
OpenTelemetry, installs no gRPC interceptor and sends no header: a service runs exactly as it
did. On, it needs the `tracing` extra (`pip install 'kvbridge[tracing]'`, the packages vLLM
itself traces with); a service asked to trace without them refuses to start and says so.

On, each service exports its own spans (`service.name` kvbridge-gateway, kvbridge-router,
kvbridge-registry) over OTLP, gRPC by default (`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
http/protobuf` for HTTP, whose URL ends in /v1/traces), batched off the request path. The
context travels as W3C trace context: the `traceparent` gRPC metadata entry from the gateway to
the router and from the router to the registry, and the `traceparent` HTTP header from the
gateway to the prefill and decode engines (vLLM joins the trace when it runs with its own
`--otlp-traces-endpoint`). A gRPC call that arrives without a trace context (heartbeats,
holders' grants) makes no span. The implementation is `kvbridge._otel`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvbridge.config import setting

if TYPE_CHECKING:
    import grpc

    from kvbridge._otel import Tracing

ENDPOINT_ENV = "KVBRIDGE_OTLP_TRACES_ENDPOINT"
OTEL_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("grpc", "http/protobuf")
INSTALL_HINT = "pip install 'kvbridge[tracing]'"


def endpoint_setting() -> Any:
    """The `otlp_traces_endpoint` field every service's config has."""
    return setting(
        "", "OTLP collector URL to export OpenTelemetry traces to, e.g. http://127.0.0.1:4317 "
        f"(gRPC; with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, "
        "http://HOST:4318/v1/traces). Empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT if set, else "
        f"no tracing (nothing installed). Needs the tracing extra ({INSTALL_HINT})",
        env=ENDPOINT_ENV)


def endpoint(configured: str, environ: Mapping[str, str] | None = None) -> str:
    """The endpoint a service exports to: `configured`, else OpenTelemetry's standard variable;
    "" (off) when neither is set or `OTEL_SDK_DISABLED` is true."""
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    return configured.strip() or environ.get(OTEL_ENDPOINT_ENV, "").strip()


def protocol(environ: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol: OpenTelemetry's variables, else gRPC (as vLLM's default)."""
    environ = os.environ if environ is None else environ
    for name in PROTOCOL_ENVS:
        value = environ.get(name, "").strip()
        if value:
            return value
    return "grpc"


def check_endpoint(url: str, environ: Mapping[str, str] | None = None) -> None:
    """ValueError unless `url` is empty (off) or an http(s) URL with a host, the protocol is
    one kvbridge exports with, and the OpenTelemetry packages are installed."""
    if not url:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL with a host, "
                         f"got {url!r}")
    chosen = protocol(environ)
    if chosen not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {chosen!r} (from {' or '.join(PROTOCOL_ENVS)}) is "
                         f"not supported: use {' or '.join(PROTOCOLS)}")
    exporter = "grpc" if chosen == "grpc" else "http"
    try:
        for module in ("opentelemetry.sdk.trace",
                       f"opentelemetry.exporter.otlp.proto.{exporter}.trace_exporter"):
            importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"tracing (otlp_traces_endpoint {url}) needs the OpenTelemetry "
                         f"packages, which are not installed: {INSTALL_HINT} ({exc})") from None


def start(configured: str, service: str) -> Tracing | None:
    """A service's tracing, exporting to `endpoint(configured)`; None (off) when there is
    none. ValueError as `check_endpoint`."""
    url = endpoint(configured)
    if not url:
        return None
    check_endpoint(url)
    from kvbridge import _otel

    return _otel.Tracing(service, _otel.span_processor(url, protocol()))


def server_interceptors(tracing: Tracing | None) -> list[grpc.aio.ServerInterceptor] | None:
    """What a gRPC server is built with: a server span for each traced call when on; None
    (no interceptor at all) when off."""
    return None if tracing is None else [tracing.server_interceptor()]


def client_interceptors(tracing: Tracing | None) -> list[grpc.aio.ClientInterceptor] | None:
    """What a gRPC client's channels are built with: the trace context sent along when on;
    None when off."""
    return None if tracing is None else [tracing.client_interceptor()]
