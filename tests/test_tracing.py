"""OpenTelemetry traces (`kvbridge.tracing`): a real registry, router and gateway on 127.0.0.1
with fake engines, each service exporting its spans to one in-memory exporter instead of an
OTLP collector; and, with tracing off, nothing installed and nothing sent."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from click.testing import CliRunner
from conftest import start_registry
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from test_gateway import MODEL, FakeEngine

from kvbridge import _otel, tracing
from kvbridge.cli import main
from kvbridge.clients import AsyncRegistryClient
from kvbridge.clock import FakeClock
from kvbridge.registry.v1 import registry_pb2 as reg_pb
from kvbridge.registry.v1 import registry_pb2_grpc as reg_grpc
from kvbridge.services.gateway import GatewayConfig, GatewayServer, start_gateway
from kvbridge.services.registry import RegistryConfig, RegistryServer
from kvbridge.services.router import InstanceSpec, Role, RouterConfig, RouterServer, create_server

# Never contacted: the exporter behind it is replaced by an in-memory one.
ENDPOINT = "http://127.0.0.1:4317"
ROUTE = "kvbridge.router.v1.RouterService/Route"
PIN = "kvbridge.registry.v1.RegistryService/PinLease"
TURN = "POST /v1/chat/completions"


@dataclass
class HeaderEngine(FakeEngine):
    """A fake engine that also keeps each request's headers."""

    headers: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        return await super().handle(request)


@dataclass
class Stack:
    registry: RegistryServer
    router: RouterServer
    gateway: GatewayServer
    engines: dict[str, HeaderEngine]

    async def close(self) -> None:
        await self.gateway.stop()
        await self.router.stop(0)
        await self.registry.stop(0)
        for engine in self.engines.values():
            await engine.stop()

    async def chat(self, headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        async with aiohttp.ClientSession() as session, session.post(
                f"{self.gateway.url}/v1/chat/completions",
                headers={"Authorization": "Bearer sk-alice", **(headers or {})},
                data=json.dumps({"model": MODEL, "max_tokens": 2, "conversation_id": "conv-t",
                                 "messages": [{"role": "user", "content": "hi"}]})) as resp:
            await resp.read()
            return resp


async def start_stack(endpoint: str) -> Stack:
    registry = await start_registry(FakeClock(), otlp_traces_endpoint=endpoint)
    router = await create_server(RouterConfig(
        listen="127.0.0.1:0", metrics_listen="", registry=f"127.0.0.1:{registry.port}",
        otlp_traces_endpoint=endpoint), clock=FakeClock())
    await router.start()
    gateway = await start_gateway(GatewayConfig(
        listen="127.0.0.1:0", router=f"127.0.0.1:{router.port}",
        registry=f"127.0.0.1:{registry.port}", otlp_traces_endpoint=endpoint))
    stack = Stack(registry, router, gateway, {})
    for role, name in (("prefill", "p0"), ("decode", "d0")):
        engine = HeaderEngine(role, name)
        await engine.start()
        stack.engines[name] = engine
        router.table.register(InstanceSpec(
            name, Role.PREFILL if role == "prefill" else Role.DECODE, engine.url,
            f"engine-{name}", MODEL, "127.0.0.1", 5600))
    return stack


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Every service's spans, exported at once to memory rather than batched to OTLP."""
    memory = InMemorySpanExporter()
    made: list[tuple[str, str]] = []

    def processor(url: str, protocol: str) -> SpanProcessor:
        made.append((url, protocol))
        return SimpleSpanProcessor(memory)

    monkeypatch.delenv(tracing.OTEL_ENDPOINT_ENV, raising=False)
    monkeypatch.setattr(_otel, "span_processor", processor)
    yield memory
    assert made and all(m == (ENDPOINT, "grpc") for m in made)


@pytest.fixture
async def traced(exporter: InMemorySpanExporter) -> AsyncIterator[Stack]:
    stack = await start_stack(ENDPOINT)
    yield stack
    await stack.close()


def _service(span: ReadableSpan) -> str:
    return str(span.resource.attributes["service.name"])


def _traceparent(headers: dict[str, str]) -> tuple[int, int]:
    """(trace id, parent span id) of a W3C traceparent header."""
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    return int(trace_id, 16), int(span_id, 16)


async def _spans(exporter: InMemorySpanExporter, want: int) -> list[ReadableSpan]:
    """The finished spans, once there are at least `want` (the lease renewal runs in the
    background)."""
    for _ in range(200):
        spans = list(exporter.get_finished_spans())
        if len(spans) >= want:
            return spans
        await asyncio.sleep(0.01)
    return list(exporter.get_finished_spans())


async def test_one_turn_is_one_trace_across_gateway_router_registry_and_engines(
        traced: Stack, exporter: InMemorySpanExporter) -> None:
    resp = await traced.chat()
    assert resp.status == 200
    # gateway: turn, Route (client), prefill, decode, RenewLeases (client); router: Route,
    # PinLease (client); registry: PinLease, RenewLeases.
    spans = await _spans(exporter, 9)
    turns = [s for s in spans if s.name == TURN]
    assert len(turns) == 1
    turn = turns[0]
    trace_id = turn.context.trace_id
    assert turn.parent is None and _service(turn) == "kvbridge-gateway"
    assert {s.context.trace_id for s in spans} == {trace_id}, [(s.name, _service(s))
                                                               for s in spans]
    by_id = {s.context.span_id: s for s in spans}

    def parent(span: ReadableSpan) -> ReadableSpan:
        assert span.parent is not None, span.name
        return by_id[span.parent.span_id]

    # gateway -> router, through gRPC metadata.
    route = [s for s in spans if s.name == ROUTE and s.kind == SpanKind.SERVER]
    assert len(route) == 1 and _service(route[0]) == "kvbridge-router"
    route_client = parent(route[0])
    assert route_client.kind == SpanKind.CLIENT and _service(route_client) == "kvbridge-gateway"
    assert parent(route_client) is turn
    # router -> registry: the pin taken while routing, under the router's Route span.
    pin = [s for s in spans if s.name == PIN and s.kind == SpanKind.SERVER]
    assert len(pin) == 1 and _service(pin[0]) == "kvbridge-registry"
    pin_client = parent(pin[0])
    assert _service(pin_client) == "kvbridge-router" and parent(pin_client) is route[0]
    assert pin[0].attributes is not None and pin[0].attributes["rpc.grpc.status_code"] == 0
    assert {_service(s) for s in spans} == {"kvbridge-gateway", "kvbridge-router",
                                            "kvbridge-registry"}

    # gateway -> engines: each request carries its own client span's context, in the trace.
    for name, role in (("p0", "prefill"), ("d0", "decode")):
        headers = traced.engines[name].headers
        assert len(headers) == 1
        sent_trace, sent_parent = _traceparent(headers[0])
        assert sent_trace == trace_id
        engine_span = by_id[sent_parent]
        assert engine_span.name == role and engine_span.kind == SpanKind.CLIENT
        assert parent(engine_span) is turn
        assert engine_span.attributes is not None
        assert engine_span.attributes["kvbridge.instance"] == name
        assert engine_span.status.is_unset
    decode = by_id[_traceparent(traced.engines["d0"].headers[0])[1]]
    assert decode.attributes == {
        "http.request.method": "POST", "url.full": f"{traced.engines['d0'].url}{TURN[5:]}",
        "kvbridge.role": "decode", "kvbridge.instance": "d0", "http.response.status_code": 200}

    attributes = dict(turn.attributes or {})
    assert attributes["kvbridge.prefill.instance"] == "p0"
    assert attributes["kvbridge.decode.instance"] == "d0"
    assert attributes["kvbridge.conversation.present"] is True
    assert attributes["kvbridge.conversation.source"] == "body"
    assert attributes["kvbridge.decision"] == "miss_no_lease"
    assert attributes["kvbridge.recomputed_tokens"] == 7
    assert attributes["kvbridge.model"] == MODEL
    assert str(attributes["kvbridge.tenant"]).startswith("key-")
    assert attributes["http.response.status_code"] == 200

    # A call made outside any trace (a heartbeat, a holder's grant) makes no span.
    before = len(exporter.get_finished_spans())
    async with AsyncRegistryClient(f"127.0.0.1:{traced.registry.port}") as client:
        await client.list_leases(tenant="t", conversation_id="c")
    await asyncio.sleep(0.05)
    assert len(exporter.get_finished_spans()) == before


async def test_a_clients_traceparent_is_the_turns_parent(
        traced: Stack, exporter: InMemorySpanExporter) -> None:
    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    resp = await traced.chat(
        {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"})
    assert resp.status == 200
    spans = await _spans(exporter, 9)
    turn = next(s for s in spans if s.name == TURN)
    assert turn.context.trace_id == trace_id
    assert turn.parent is not None and turn.parent.span_id == span_id
    assert _traceparent(traced.engines["d0"].headers[0])[0] == trace_id


async def test_registry_traces_only_calls_that_carry_a_valid_context(
        traced: Stack, exporter: InMemorySpanExporter) -> None:
    trace_id = 0x1234567890ABCDEF1234567890ABCDEF
    async with grpc.aio.insecure_channel(f"127.0.0.1:{traced.registry.port}") as channel:
        stub = reg_grpc.RegistryServiceStub(channel)
        for value in ("garbage", f"00-{0:032x}-{1:016x}-01",  # malformed, invalid trace id
                      f"00-{trace_id:032x}-{7:016x}-01"):
            await stub.GetServerInfo(reg_pb.GetServerInfoRequest(),
                                     metadata=(("traceparent", value),))
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # a failed call: its status
            await stub.GetLease(reg_pb.GetLeaseRequest(lease_id=""),
                                metadata=(("traceparent", f"00-{trace_id:032x}-{8:016x}-01"),))
    spans = await _spans(exporter, 2)
    assert [(s.name.rsplit("/", 1)[1], s.context.trace_id, s.parent and s.parent.span_id)
            for s in spans] == [("GetServerInfo", trace_id, 7), ("GetLease", trace_id, 8)]
    failed = spans[1]
    assert failed.attributes is not None
    assert failed.attributes["rpc.grpc.status_code"] == refused.value.code().value[0]
    assert not failed.status.is_ok


async def test_tracing_off_installs_nothing_and_sends_no_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.OTEL_ENDPOINT_ENV, raising=False)
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)

    def no_provider(url: str, protocol: str) -> SpanProcessor:
        raise AssertionError("tracing is off: no span processor is made")

    monkeypatch.setattr(_otel, "span_processor", no_provider)
    interceptors: list[Any] = []
    for module, name in ((grpc.aio, "server"), (grpc.aio, "insecure_channel")):
        real = getattr(module, name)

        def recording(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            interceptors.append((_name, kwargs.get("interceptors")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    stack = await start_stack("")
    try:
        resp = await stack.chat()
        assert resp.status == 200
        assert stack.gateway.gateway.tracing is None and stack.router.tracing is None
        # The registry's server, the router's (and its registry client), the gateway's two
        # clients: built, all without interceptors.
        names = [name for name, _ in interceptors]
        assert names.count("server") == 2 and names.count("insecure_channel") >= 3
        assert all(value is None for _, value in interceptors), interceptors
        for engine in stack.engines.values():
            assert engine.headers and all("traceparent" not in h for h in engine.headers)
    finally:
        await stack.close()


def test_endpoint_comes_from_the_setting_then_opentelemetrys_variable() -> None:
    env = {tracing.OTEL_ENDPOINT_ENV: "http://collector:4317"}
    assert tracing.endpoint("", {}) == ""
    assert tracing.endpoint("", env) == "http://collector:4317"
    assert tracing.endpoint("http://mine:4317", env) == "http://mine:4317"
    assert tracing.endpoint("http://mine:4317", {**env, "OTEL_SDK_DISABLED": "true"}) == ""
    assert tracing.protocol({}) == "grpc"
    assert tracing.protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"


@pytest.mark.parametrize(("url", "environ", "needle"), [
    ("collector:4317", {}, "http:// or https:// URL"),
    ("ftp://collector:4317", {}, "http:// or https:// URL"),
    ("http://", {}, "with a host"),
    ("http://collector:4317", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
     "'http/json'"),
])
def test_bad_endpoints_are_refused(url: str, environ: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError) as refused:
        tracing.check_endpoint(url, environ)
    assert needle in str(refused.value)


def test_configs_check_the_endpoint() -> None:
    for config in (GatewayConfig, RouterConfig, RegistryConfig):
        with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
            config(otlp_traces_endpoint="collector:4317")
        assert config(otlp_traces_endpoint=ENDPOINT).otlp_traces_endpoint == ENDPOINT


@pytest.mark.parametrize("command", ["gateway", "router", "registry"])
def test_tracing_without_the_packages_is_a_clear_startup_error(
        command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                        None)
    result = CliRunner().invoke(main, [command, "serve", "--insecure",
                                       "--otlp-traces-endpoint", ENDPOINT])
    assert result.exit_code == 2, result.output
    assert "kvbridge[tracing]" in result.output and "not installed" in result.output
    # Nor from the environment variable, and the flag is in --help.
    result = CliRunner().invoke(main, [command, "serve", "--insecure"],
                                env={tracing.ENDPOINT_ENV: ENDPOINT})
    assert result.exit_code == 2 and "kvbridge[tracing]" in result.output
    help_text = CliRunner().invoke(main, [command, "serve", "--help"]).output
    assert "--otlp-traces-endpoint" in help_text and tracing.ENDPOINT_ENV in help_text


async def test_a_stopping_service_waits_for_its_exporter_a_bounded_time() -> None:
    """A collector that is down must not hold a shutdown: the last export gets `timeout`."""
    released = threading.Event()

    class Stuck(SpanProcessor):
        def shutdown(self) -> None:
            released.wait(10)

    traces = _otel.Tracing("kvbridge-test", Stuck())
    started = time.monotonic()
    await traces.close(timeout=0.2)
    assert time.monotonic() - started < 2
    released.set()


async def test_a_stopping_registry_exports_its_last_spans(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """As the gateway and the router do: the registry's stop shuts its span processor down
    (which exports what is left), rather than leaving it to the process's exit."""
    shut: list[str] = []

    class Recording(SimpleSpanProcessor):
        def shutdown(self) -> None:
            shut.append("registry")
            super().shutdown()

    monkeypatch.delenv(tracing.OTEL_ENDPOINT_ENV, raising=False)
    monkeypatch.setattr(_otel, "span_processor",
                        lambda url, protocol: Recording(InMemorySpanExporter()))
    registry = await start_registry(FakeClock(), otlp_traces_endpoint=ENDPOINT)
    assert shut == []
    await registry.stop(0)
    assert shut == ["registry"]
