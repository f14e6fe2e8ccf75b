"""The gateway's security (issue 32): no engine reply reflected to clients, 400 (not 500) on
malformed bodies, header and body deadlines and a connection cap against slow clients, and
HTTPS. A real gateway, router and registry on 127.0.0.1 and fake engines; raw sockets where
the client misbehaves."""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import serve_http
from structlog.testing import capture_logs

from kvbridge.clock import FakeClock
from kvbridge.services.gateway import GatewayConfig, GatewayServer, start_gateway
from kvbridge.services.registry import RegistryServer
from kvbridge.services.router import RouterConfig, RouterServer, create_server
from kvbridge.services.router._policy import InstanceSpec, Role

MODEL = "tiny"
SECRET = "AKIA-internal-secret-7f3a"


@dataclass
class Engine:
    """A fake engine that answers what the test sets: a prefill's JSON with kv_transfer_params,
    a decode's completion, or `reply` (status, content type, body) to play an internal
    service."""

    role: str
    name: str
    reply: tuple[int, str, str] | None = None
    delay_s: float = 0.0
    received: list[dict[str, Any]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner, self.port = await serve_http(app)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.json())
        await asyncio.sleep(self.delay_s)
        if self.reply is not None:
            status, content_type, text = self.reply
            return web.Response(status=status, text=text, content_type=content_type)
        if self.role == "prefill":
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": f"engine-{self.name}",
                "remote_block_ids": [1]}})
        return web.json_response({"choices": [{"index": 0, "text": "ok"}]})


@dataclass
class Stack:
    router: RouterServer
    gateway: GatewayServer
    engines: dict[str, Engine]

    @property
    def port(self) -> int:
        return self.gateway.port

    async def post(self, path: str, raw: bytes) -> tuple[int, dict[str, str], Any]:
        async with aiohttp.ClientSession() as session, session.post(
                f"{self.gateway.url}{path}", data=raw,
                headers={"Content-Type": "application/json"}) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items()}
            return resp.status, headers, await resp.json(content_type=None)


async def make_stack(registry: RegistryServer, *, engines: bool = True,
                     **gateway: Any) -> Stack:
    router = await create_server(RouterConfig(listen="127.0.0.1:0", metrics_listen="",
                                              registry=f"127.0.0.1:{registry.port}"),
                                 clock=FakeClock())
    await router.start()
    server = await start_gateway(GatewayConfig(
        listen="127.0.0.1:0", router=f"127.0.0.1:{router.port}",
        registry=f"127.0.0.1:{registry.port}", retries=0, **gateway))
    stack = Stack(router, server, {})
    if engines:
        for role, name in (("prefill", "p0"), ("decode", "d0")):
            engine = Engine(role, name)
            await engine.start()
            stack.engines[name] = engine
            router.table.register(InstanceSpec(
                name, Role.PREFILL if role == "prefill" else Role.DECODE,
                f"http://127.0.0.1:{engine.port}", f"engine-{name}", MODEL))
    return stack


async def close(stack: Stack) -> None:
    await stack.gateway.stop()
    await stack.router.stop(0)
    for engine in stack.engines.values():
        assert engine.runner is not None
        await engine.runner.cleanup()


@pytest.fixture
async def stack(registry_server: RegistryServer) -> AsyncIterator[Stack]:
    s = await make_stack(registry_server)
    yield s
    await close(s)


COMPLETION = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()


# ==== item 2: no engine reply reflected ==========================================================


@pytest.mark.parametrize(("role", "reply", "stream", "status"), [
    ("prefill", (200, "text/plain", f"root:x:0:0 {SECRET}"), False, 502),
    ("prefill", (200, "application/json", json.dumps([SECRET])), False, 502),
    ("prefill", (500, "application/json",
                 json.dumps({"error": {"message": SECRET}})), False, 500),
    ("prefill", (503, "text/html", f"<h1>{SECRET}</h1>"), False, 503),
    ("prefill", (403, "text/plain", SECRET), False, 403),
    ("prefill", (401, "application/json", json.dumps({"message": SECRET})), False, 401),
    ("prefill", (400, "application/json", json.dumps({"error": {"message": SECRET}})), False,
     400),
    ("decode", (200, "text/plain", SECRET), False, 502),
    ("decode", (200, "text/plain", SECRET), True, 502),
    ("decode", (500, "application/json", json.dumps({"message": SECRET})), False, 500),
    ("decode", (404, "text/html", SECRET), True, 404),
])
async def test_an_engines_reply_never_reaches_the_client(
        stack: Stack, role: str, reply: tuple[int, str, str], stream: bool,
        status: int) -> None:
    """The audit's SSRF: an instance URL pointed at an internal service, and the gateway's 502
    echoed 200 characters of its reply. Now the client gets a generic error naming the request
    id; the reply is in the gateway's log under that id."""
    stack.engines["p0" if role == "prefill" else "d0"].reply = reply
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": stream})
    with capture_logs() as logs:
        got, headers, answer = await stack.post("/v1/completions", body.encode())
    assert got == status, answer
    assert SECRET not in json.dumps(answer) and SECRET not in json.dumps(headers)
    request_id = headers["x-request-id"]
    assert request_id in answer["error"]["message"]
    assert any(SECRET in str(e.get("body", "")) + str(e.get("error", ""))
               and e.get("request_id") == request_id for e in logs), logs


@pytest.mark.parametrize(("role", "stream"), [("prefill", False), ("decode", False),
                                            ("decode", True)])
async def test_an_engines_redirect_is_never_followed(stack: Stack, role: str,
                                                     stream: bool) -> None:
    """From review: aiohttp follows redirects by default, so an engine answering 307 to an
    internal address (cloud metadata, a loopback service) had the gateway fetch it and hand
    its JSON to the client. The gateway now talks only to the address it routed to."""
    internal = Engine("decode", "internal", reply=(200, "application/json",
                                                   json.dumps({"secret": SECRET})))
    await internal.start()
    stack.engines["internal"] = internal  # closed with the stack
    location = f"http://127.0.0.1:{internal.port}/v1/completions"
    engine = stack.engines["p0" if role == "prefill" else "d0"]

    async def redirecting(request: web.Request) -> web.StreamResponse:
        engine.received.append(await request.json())
        raise web.HTTPTemporaryRedirect(location)

    engine.handle = redirecting  # type: ignore[method-assign]
    assert engine.runner is not None
    await engine.runner.cleanup()
    await engine.start()  # the same engine, now redirecting, on a new port
    stack.router.table.register(InstanceSpec(
        engine.name, Role.PREFILL if role == "prefill" else Role.DECODE,
        f"http://127.0.0.1:{engine.port}", f"engine-{engine.name}", MODEL))
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": stream})
    got, headers, answer = await stack.post("/v1/completions", body.encode())
    assert got == 502, answer
    assert SECRET not in json.dumps(answer) and SECRET not in json.dumps(headers)
    assert "location" not in headers
    assert engine.received and internal.received == []  # asked, and never followed


async def test_a_prefill_that_names_another_engines_kv_is_refused(stack: Stack) -> None:
    """From review: the prefill's kv_transfer_params tell decode whose KV to read; a prefill
    (registered by a tenant-scoped token) naming another engine would have decode read that
    engine's KV into this turn. Only the routed prefill's own engine id is passed on."""
    stack.engines["p0"].reply = (200, "application/json", json.dumps({
        "choices": [{"text": "x"}], "kv_transfer_params": {
            "do_remote_prefill": True, "remote_engine_id": "engine-d0",
            "remote_block_ids": [1]}}))
    got, headers, answer = await stack.post("/v1/completions", COMPLETION)
    assert got == 502 and headers["x-request-id"] in answer["error"]["message"]
    assert stack.engines["d0"].received == []


async def test_an_engines_4xx_error_object_keeps_only_its_message(stack: Stack) -> None:
    """vLLM's own validation errors (a prompt too long) are the client's answer: message, type
    and code pass, bounded; nothing else of the reply does."""
    stack.engines["p0"].reply = (400, "application/json", json.dumps({
        "object": "error", "message": "prompt too long " + "x" * 5000, "type": "BadRequest",
        "code": 400, "extra": SECRET}))
    got, headers, answer = await stack.post("/v1/completions", COMPLETION)
    assert got == 400
    assert answer["error"]["message"].startswith("prompt too long")
    assert len(answer["error"]["message"]) == 1000
    assert answer["error"]["type"] == "BadRequest" and answer["error"]["code"] == 400
    assert SECRET not in json.dumps(answer) and headers["x-request-id"].startswith("req-")


async def test_an_unreachable_engine_is_not_described_to_the_client(
        registry_server: RegistryServer, unused_tcp_port: int) -> None:
    """A connection error names the host and port the gateway tried: a port scanner's oracle."""
    s = await make_stack(registry_server, engines=False)
    try:
        s.router.table.register(InstanceSpec("p0", Role.PREFILL,
                                             f"http://127.0.0.1:{unused_tcp_port}", "e-p0", MODEL))
        s.router.table.register(InstanceSpec("d0", Role.DECODE,
                                             f"http://127.0.0.1:{unused_tcp_port}", "e-d0", MODEL))
        got, headers, answer = await s.post("/v1/completions", COMPLETION)
        assert got == 502 and answer["error"]["code"] == "engine_unreachable"
        assert str(unused_tcp_port) not in answer["error"]["message"]
        assert headers["x-request-id"] in answer["error"]["message"]
    finally:
        await close(s)


# ==== item 12: malformed bodies are 400s =========================================================


@pytest.mark.parametrize(("path", "raw", "needle"), [
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + b"[" * 100_000, "not valid JSON"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": ' + b"9" * 5000 + b"}",
     "not valid JSON"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(),
     "messages[0].content[0].text must be a string"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}).encode(),
     "must be a string"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": 5}).encode(),
     "messages must be a list"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": 5}]}).encode(), "content must be a string or a list"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": ["text"]}]}).encode(), "must be an object"),
])
async def test_malformed_bodies_are_400_with_a_message(stack: Stack, path: str, raw: bytes,
                                                       needle: str) -> None:
    got, headers, answer = await stack.post(path, raw)
    assert got == 400, answer
    assert needle in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    assert headers["x-request-id"].startswith("req-")
    assert not stack.engines["p0"].received


# ==== item 13: slow clients ======================================================================


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


async def test_partial_headers_are_closed_after_the_header_timeout(
        registry_server: RegistryServer) -> None:
    s = await make_stack(registry_server, header_timeout_s=0.5)
    s.engines["d0"].delay_s = 1.0  # a turn longer than the header timeout is not cut short
    try:
        sock = await asyncio.to_thread(_connect, s.port)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        data, took = await asyncio.to_thread(_read_until_closed, sock)
        sock.close()
        assert data == b"" and 0.3 < took < 5, (data, took)
        # A connection that sends nothing at all is closed alike.
        sock = await asyncio.to_thread(_connect, s.port)
        data, took = await asyncio.to_thread(_read_until_closed, sock)
        sock.close()
        assert data == b"" and took < 5
        # A kept-alive connection: a whole request is served (longer than the timeout), then
        # the next request's headers trickle and the connection is closed.
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   b"application/json\r\nContent-Length: " + str(len(COMPLETION)).encode()
                   + b"\r\n\r\n" + COMPLETION)

        def keep_alive_then_trickle() -> tuple[bytes, bytes, float]:
            sock = _connect(s.port)
            sock.sendall(request)
            first = b""
            while b'"ok"' not in first:
                chunk = sock.recv(65536)
                assert chunk, first
                first += chunk
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            rest, took = _read_until_closed(sock)
            sock.close()
            return first, rest, took

        first, rest, took = await asyncio.to_thread(keep_alive_then_trickle)
        assert first.startswith(b"HTTP/1.1 200"), first
        assert rest == b"" and took < 5
        assert s.gateway.guard.timed_out >= 3
    finally:
        await close(s)


async def test_a_trickled_body_gets_408_and_is_closed(registry_server: RegistryServer) -> None:
    s = await make_stack(registry_server, body_timeout_s=0.5)
    try:
        def trickle() -> tuple[bytes, float]:
            sock = _connect(s.port)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
            data, took = _read_until_closed(sock)
            sock.close()
            return data, took

        data, took = await asyncio.to_thread(trickle)
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b"request body not received within 0.5 s" in data
        assert took < 5
        assert not s.engines["p0"].received
    finally:
        await close(s)


async def test_connections_past_the_limit_are_refused(registry_server: RegistryServer) -> None:
    s = await make_stack(registry_server, max_connections=3, header_timeout_s=30)
    held: list[socket.socket] = []
    try:
        for _ in range(3):
            held.append(await asyncio.to_thread(_connect, s.port))
        for _ in range(100):
            if s.gateway.guard.open == 3:
                break
            await asyncio.sleep(0.01)
        assert s.gateway.guard.open == 3
        extra = await asyncio.to_thread(_connect, s.port)
        data, _ = await asyncio.to_thread(_read_until_closed, extra)
        extra.close()
        assert data.startswith(b"HTTP/1.1 503"), data
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "busy"
        held.pop().close()
        for _ in range(100):
            if s.gateway.guard.open < 3:
                break
            await asyncio.sleep(0.01)
        got, _, answer = await s.post("/v1/completions", COMPLETION)  # room again
        assert got == 200, answer
    finally:
        for sock in held:
            sock.close()
        await close(s)


def test_limits_are_validated() -> None:
    for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s",
                 "max_connections"):
        with pytest.raises(ValueError, match=name):
            GatewayConfig(**{name: 0})


# ==== item 10: HTTPS =============================================================================


def _self_signed(tmp: Path) -> tuple[str, str]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvbridge gateway test")])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp / "gw.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (tmp / "gw.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(tmp / "gw.pem"), str(tmp / "gw.key")


async def test_the_gateway_serves_https(registry_server: RegistryServer, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    s = await make_stack(registry_server, http_tls_cert=cert, http_tls_key=key)
    try:
        assert s.gateway.url.startswith("https://")
        context = ssl.create_default_context(cafile=cert)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{s.gateway.url}/v1/completions", data=COMPLETION,
                                    ssl=context) as resp:
                assert resp.status == 200, await resp.text()
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port
                async with session.post(f"http://127.0.0.1:{s.port}/v1/completions",
                                        data=COMPLETION) as resp:
                    await resp.read()
    finally:
        await close(s)


def test_https_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        GatewayConfig(http_tls_cert=str(tmp_path / "x.pem"))
    with pytest.raises(ValueError, match="no file"):
        GatewayConfig(http_tls_cert=str(tmp_path / "x.pem"), http_tls_key=str(tmp_path / "k"))


# ==== engine names resolved at call time =========================================================


class _Dns:
    """A resolver answering fixed addresses (what a rebinding DNS would say)."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET
                      ) -> list[dict[str, Any]]:
        return [{"hostname": host, "host": a, "port": port, "family": family, "proto": 0,
                 "flags": 0} for a in self.addresses]

    async def close(self) -> None:
        pass


async def test_engine_names_never_resolve_to_metadata_addresses() -> None:
    """The router checks a name when the engine registers; a DNS answer that changes later
    (rebinding) could still point the gateway at 169.254.169.254. Its resolver refuses."""
    from kvbridge.services.gateway._http import EngineResolver

    rebound = EngineResolver(_Dns("169.254.169.254", "fe80::1"))  # type: ignore[arg-type]
    with pytest.raises(OSError, match="refused"):
        await rebound.resolve("engine.example", 8000)
    mixed = EngineResolver(_Dns("169.254.169.254", "10.0.0.7"))  # type: ignore[arg-type]
    assert [r["host"] for r in await mixed.resolve("engine.example", 8000)] == ["10.0.0.7"]


async def test_engines_named_by_host_name_are_served(registry_server: RegistryServer) -> None:
    s = await make_stack(registry_server, engines=False)
    try:
        for role, name in (("prefill", "p0"), ("decode", "d0")):
            engine = Engine(role, name)
            await engine.start()
            s.engines[name] = engine
            s.router.table.register(InstanceSpec(
                name, Role.PREFILL if role == "prefill" else Role.DECODE,
                f"http://localhost:{engine.port}", f"engine-{name}", MODEL))
        got, _, answer = await s.post("/v1/completions", COMPLETION)
        assert got == 200, answer
    finally:
        await close(s)
