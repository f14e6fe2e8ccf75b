"""The gateway over HTTP on 127.0.0.1, with a real router and registry behind it and small fake
engines (aiohttp servers that speak vLLM's prefill/decode protocol and record what they got).
The real engines are in tests/e2e/test_gateway_e2e.py."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from conftest import serve_http

from kvbridge.clients import AsyncRegistryClient
from kvbridge.clients._registry import seconds
from kvbridge.clock import FakeClock, boot_id, monotonic
from kvbridge.registry.v1 import registry_pb2 as reg_pb
from kvbridge.services.gateway import GatewayConfig, GatewayServer, start_gateway
from kvbridge.services.gateway._app import MODEL_LABELS, Metrics
from kvbridge.services.registry import RegistryServer
from kvbridge.services.router import RouterConfig, RouterServer, create_server
from kvbridge.services.router._policy import InstanceSpec, Role

MODEL = "tiny"


@dataclass
class FakeEngine:
    """A prefill or decode engine as the gateway sees it."""

    role: str
    name: str
    reused: int = 0
    local: int = 0  # prompt tokens from prefill's own prefix cache (reported when > 0)
    received: list[dict[str, Any]] = field(default_factory=list)
    peers: list[Any] = field(default_factory=list)  # each request's client address (connection)
    # Failures to play, one per request, first first: "disconnect" (the engine dies with the
    # request: connection lost, no answer), or an HTTP status to answer with. Engines may
    # share one list: then the first request to reach any of them fails.
    faults: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0
    delay: float = 0.0  # before a decode answers (turns in flight at once)
    # A prefill that decides before any read not to read leaves a routed pin the gateway
    # releases itself (as kvbridge's connector does) and says so in its answer.
    pin_left: bool = False
    no_params: bool = False  # a prefill answer without kv_transfer_params (vLLM's, at EOS)
    # Whether the prompt held all of the read lease's tokens (kvbridge's connector says so
    # when it verified a read): None, not said.
    lease_whole: bool | None = None
    not_json: bool = False  # a prefill that answers 200 with something other than JSON
    padding: int = 0  # bytes a decode streams before its answer (more than sockets buffer)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        self.runner, self.port = await serve_http(app)

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername"))
        if self.faults:
            fault = self.faults.pop(0)
            if fault == "disconnect":
                assert request.transport is not None
                request.transport.abort()
                return web.Response()  # never sent: the connection is gone
            return web.json_response({"error": {"message": f"fake {fault}", "type": "x",
                                                "param": None, "code": int(fault)}},
                                     status=int(fault))
        chat = request.path.endswith("chat/completions")
        params = body.get("kv_transfer_params") or {}
        if self.role == "prefill" and self.not_json:
            return web.Response(text="<html>proxy page</html>", content_type="text/html")
        if self.role == "prefill" and self.no_params:
            return web.json_response({
                "id": "cmpl-p", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
        if self.role == "prefill":
            return web.json_response({
                "id": "cmpl-p", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": f"engine-{self.name}", "remote_block_ids": [1, 2],
                    "remote_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": 1,
                    "kvbridge_decision": "hit" if self.reused else "miss_no_lease",
                    "kvbridge_reused_tokens": self.reused,
                    "kvbridge_recomputed_tokens": 7,
                    **({"kvbridge_pin_left": True} if self.pin_left and params.get(
                        "kvbridge", {}).get("read", {}).get("released_by") == "gateway"
                       else {}),
                    **({"kvbridge_local_tokens": self.local} if self.local else {}),
                    **({"kvbridge_lease_whole": self.lease_whole}
                       if self.lease_whole is not None else {})}})
        if not params.get("do_remote_prefill"):
            return web.json_response({"error": {"message": "no prefill params"}}, status=400)
        await asyncio.sleep(self.delay)
        words = ["Hello", " from", f" {self.name}"]
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(self.padding >> 20):
                await response.write(b": " + b"x" * (1 << 20) + b"\n\n")
            for i, word in enumerate(words):
                delta = ({"choices": [{"index": 0, "delta": {"content": word},
                                       "finish_reason": None}]}
                         if chat else {"choices": [{"index": 0, "text": word}]})
                chunk = {"id": "c1", "object": "chat.completion.chunk" if chat
                         else "text_completion", "created": 0, "model": body["model"], **delta}
                if i == 0 and chat:
                    chunk["choices"][0]["delta"]["role"] = "assistant"
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        text = "".join(words)
        if chat:
            return web.json_response({
                "id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
        return web.json_response({
            "id": "c1", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})


@dataclass
class Stack:
    registry: RegistryServer
    router: RouterServer
    gateway: GatewayServer
    engines: dict[str, FakeEngine]
    registry_client: AsyncRegistryClient

    @property
    def url(self) -> str:
        return self.gateway.url

    def register(self, engine: FakeEngine) -> None:
        self.router.table.register(InstanceSpec(
            engine.name, Role.PREFILL if engine.role == "prefill" else Role.DECODE, engine.url,
            f"engine-{engine.name}", MODEL, "127.0.0.1", 5600))


async def make_stack(registry_server: RegistryServer, tmp_path: Path, *,
                     engines: tuple[tuple[str, str], ...] = (("prefill", "p0"),
                                                             ("decode", "d0")),
                     **gateway: Any) -> Stack:
    # These tests check what the router's lease lookup found: a first call on a cold channel
    # of a loaded CI machine can outlast the 0.25 s default and route by load instead.
    router = await create_server(RouterConfig(
        listen="127.0.0.1:0", metrics_listen="",
        registry=f"127.0.0.1:{registry_server.port}", registry_timeout_s=5.0),
        clock=FakeClock())
    await router.start()
    server = await start_gateway(GatewayConfig(
        listen="127.0.0.1:0", router=f"127.0.0.1:{router.port}",
        registry=f"127.0.0.1:{registry_server.port}", log_level="debug", **gateway))
    stack = Stack(registry_server, router, server, {},
                  AsyncRegistryClient(f"127.0.0.1:{registry_server.port}"))
    for role, name in engines:
        engine = FakeEngine(role, name)
        await engine.start()
        stack.engines[name] = engine
        stack.register(engine)
    return stack


@pytest.fixture
async def stack(registry_server: RegistryServer, tmp_path: Path) -> AsyncIterator[Stack]:
    s = await make_stack(registry_server, tmp_path)
    yield s
    await close(s)


async def close(s: Stack) -> None:
    await s.gateway.stop()
    await s.router.stop(0)
    await s.registry_client.close()
    for engine in s.engines.values():
        await engine.stop()


def client(stack: Stack, key: str = "sk-alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


async def post(stack: Stack, path: str, body: Any, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{stack.url}{path}", headers=headers or {},
            data=raw if raw is not None else json.dumps(body)) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


# ==== turns ======================================================================================


async def test_completion_turn_runs_prefill_then_decode(stack: Stack) -> None:
    stack.engines["p0"].reused = 96
    stack.engines["p0"].local = 64
    raw = await client(stack).completions.with_raw_response.create(
        model=MODEL, prompt=[5] * 40, max_tokens=8, extra_body={"conversation_id": "conv-1"})
    completion = raw.parse()
    assert completion.choices[0].text == "Hello from d0"
    prefill = stack.engines["p0"].received[0]
    decode = stack.engines["d0"].received[0]
    tenant = prefill["kv_transfer_params"]["kvbridge"]["tenant"]
    assert tenant.startswith("key-") and "sk-alice" not in json.dumps(prefill)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    # The router pinned no read (the conversation has no lease yet) and said so: prefill
    # decides without a lookup of its own.
    assert prefill["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False,
        "kvbridge": {"tenant": tenant, "conversation_id": "conv-1",
                     "read": {"miss": "no_lease"}}}
    assert "conversation_id" not in prefill and "conversation_id" not in decode
    assert decode["max_tokens"] == 8
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
    assert decode["kv_transfer_params"]["kvbridge"] == {"tenant": tenant,
                                                        "conversation_id": "conv-1"}
    assert not any(k.startswith("kvbridge_") for k in decode["kv_transfer_params"])
    headers = raw.headers
    assert headers["x-kvbridge-reused-tokens"] == "96"
    assert headers["x-kvbridge-recomputed-tokens"] == "7"
    assert headers["x-kvbridge-local-tokens"] == "64"  # from prefill's own prefix cache
    assert headers["x-kvbridge-decision"] == "hit"
    assert headers["x-kvbridge-prefill-instance"] == "p0"
    assert headers["x-kvbridge-decode-instance"] == "d0"
    assert headers["x-kvbridge-decode-reason"] == "no_lease"


async def test_streamed_chat_turn_passes_chunks_through(stack: Stack) -> None:
    stream = await client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers={"X-Conversation-Id": "conv-2"})
    pieces = [chunk.choices[0].delta.content async for chunk in stream]
    assert "".join(p for p in pieces if p) == "Hello from d0"
    prefill = stack.engines["p0"].received[0]
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert prefill["kv_transfer_params"]["kvbridge"]["conversation_id"] == "conv-2"
    assert stack.engines["d0"].received[0]["stream"] is True


async def test_request_without_conversation_carries_no_key_with_lookup_off(
        registry_server: RegistryServer, tmp_path: Path) -> None:
    s = await make_stack(registry_server, tmp_path, conversation_lookup="off")
    try:
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "none"
        assert "kvbridge" not in s.engines["p0"].received[0]["kv_transfer_params"]
        assert "kvbridge" not in s.engines["d0"].received[0]["kv_transfer_params"]
    finally:
        await close(s)


async def test_tenants_come_from_api_keys(stack: Stack) -> None:
    for key in ("sk-alice", "sk-bob"):
        await client(stack, key).completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"conversation_id": "same"})
    a, b = (r["kv_transfer_params"]["kvbridge"]["tenant"]
            for r in stack.engines["p0"].received)
    assert a != b


async def test_keys_file_maps_keys_and_refuses_others(registry_server: RegistryServer,
                                                      tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nsk-1 acme\nsk-2 globex\n")
    s = await make_stack(registry_server, tmp_path, api_keys_file=str(keys))
    try:
        await client(s, "sk-2").completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                   extra_body={"conversation_id": "c"})
        assert s.engines["p0"].received[0]["kv_transfer_params"]["kvbridge"]["tenant"] == "globex"
        with pytest.raises(openai.AuthenticationError):
            await client(s, "sk-unknown").completions.create(model=MODEL, prompt="hi")
        status, _, body = await post(s, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert len(s.engines["p0"].received) == 1
    finally:
        await close(s)


async def test_route_follows_the_conversations_lease(registry_server: RegistryServer,
                                                     tmp_path: Path, kv: Any) -> None:
    s = await make_stack(registry_server, tmp_path, engines=(
        ("prefill", "p0"), ("decode", "d0"), ("decode", "d1")))
    try:
        # Learn alice's tenant, then give her conversation a lease held by d1.
        await client(s).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        tenant = "key-" + __import__("hashlib").blake2b(b"sk-alice", digest_size=8).hexdigest()
        reg = s.registry_client
        await reg.register_holder("engine-d1", "127.0.0.1", 5600, kv.block_size,
                                  kv.fingerprint, ttl=60)
        tokens = kv.tokens(8)
        await reg.grant_lease("engine-d1", tenant, "conv-l", "req-1", [1, 2], 8,
                              kv.lease_hashes(tokens))
        for turn in range(2):
            raw = await client(s).completions.with_raw_response.create(
                model=MODEL, prompt="hi", max_tokens=1, extra_body={"conversation_id": "conv-l"})
            assert raw.headers["x-kvbridge-decode-instance"] == "d1"
            assert raw.headers["x-kvbridge-decode-reason"] == "holds_lease"
            # The router pinned the lease while routing: prefill gets the read with the
            # request (block ids and the lease's hashes, to check against its prompt).
            read = s.engines["p0"].received[-1]["kv_transfer_params"]["kvbridge"]["read"]
            assert read["pin_id"].startswith("p-") and read["block_ids"] == [1, 2]
            assert base64.b64decode(read["block_hashes"]) == kv.prompt_hashes(tokens)
            assert read["holder"]["id"] == "engine-d1" and read["token_count"] == 8
            assert 0 < read["expires_in_s"] <= 10.0
            # When and where it was sent: a prefill engine on this host counts from then.
            assert read["sent"]["boot"] == boot_id()
            assert 0 <= monotonic() - read["sent"]["clock"] < 5.0
            assert registry_server.table.counts()["pins"] == turn + 1
    finally:
        await close(s)


async def test_pin_at_route_off_leaves_the_lookup_to_prefill(registry_server: RegistryServer,
                                                             tmp_path: Path) -> None:
    s = await make_stack(registry_server, tmp_path, pin_at_route=False)
    try:
        await client(s).completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                           extra_body={"conversation_id": "conv-x"})
        params = s.engines["p0"].received[-1]["kv_transfer_params"]
        assert set(params["kvbridge"]) == {"tenant", "conversation_id"}
        assert registry_server.table.counts()["pins"] == 0
    finally:
        await close(s)


async def test_read_pinned_for_an_unreachable_prefill_is_released(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    s = await make_stack(registry_server, tmp_path, engines=(("decode", "d0"),))
    try:
        with socket.socket() as sock:  # a port nothing listens on
            sock.bind(("127.0.0.1", 0))
            dead = sock.getsockname()[1]
        s.router.table.register(InstanceSpec("px", Role.PREFILL, f"http://127.0.0.1:{dead}",
                                             "engine-px", MODEL))
        tenant = "key-" + __import__("hashlib").blake2b(b"sk-alice", digest_size=8).hexdigest()
        reg = s.registry_client
        await reg.register_holder("engine-d0", "127.0.0.1", 5600, kv.block_size,
                                  kv.fingerprint, ttl=60)
        await reg.grant_lease("engine-d0", tenant, "conv-p", "req-1", [1, 2], 8,
                              kv.lease_hashes(kv.tokens(8)))
        status, _, body = await post(s, "/v1/completions", {
            "model": MODEL, "prompt": "hi", "max_tokens": 1, "conversation_id": "conv-p"},
            headers={"Authorization": "Bearer sk-alice"})
        assert status in (502, 503), body
        for _ in range(200):  # released in the background
            if registry_server.table.counts()["pins"] == 0:
                break
            await asyncio.sleep(0.01)
        assert registry_server.table.counts()["pins"] == 0
    finally:
        await close(s)


@pytest.mark.parametrize("prefill_answers", ["pin_left", "used", "400", "no_params",
                                             "not_json"])
async def test_gateway_releases_the_routed_pin_prefill_left_or_never_saw(
        registry_server: RegistryServer, tmp_path: Path, kv: Any, prefill_answers: str) -> None:
    """The gateway marks the read it pinned at route as its own to release. Prefill that
    decided before any read not to read leaves the pin (and says so): the gateway releases it
    once prefill answers. One that rejected the request (4xx) never scheduled it, and one that
    finished it without kv_transfer_params cannot say, nor one whose answer is no JSON object
    (a proxy's page, say): released too. One that took the read
    releases it itself when the read lands: the gateway leaves it."""
    s = await make_stack(registry_server, tmp_path, lease_wait_s=0)
    try:
        tenant = "key-" + __import__("hashlib").blake2b(b"sk-alice", digest_size=8).hexdigest()
        reg = s.registry_client
        await reg.register_holder("engine-d0", "127.0.0.1", 5600, kv.block_size,
                                  kv.fingerprint, ttl=60)
        await reg.grant_lease("engine-d0", tenant, "conv-r", "req-1", [1, 2], 8,
                              kv.lease_hashes(kv.tokens(8)))
        s.engines["p0"].pin_left = prefill_answers == "pin_left"
        s.engines["p0"].no_params = prefill_answers == "no_params"
        s.engines["p0"].not_json = prefill_answers == "not_json"
        if prefill_answers == "400":
            s.engines["p0"].faults.append("400")
        status, _, body = await post(s, "/v1/completions", {
            "model": MODEL, "prompt": "hi", "max_tokens": 1, "conversation_id": "conv-r"},
            headers={"Authorization": "Bearer sk-alice"})
        assert status == {"400": 400, "no_params": 502, "not_json": 502}.get(
            prefill_answers, 200), body
        read = s.engines["p0"].received[-1]["kv_transfer_params"]["kvbridge"]["read"]
        assert read["pin_id"] and read["released_by"] == "gateway"
        want = 1 if prefill_answers == "used" else 0
        if want:
            await asyncio.sleep(0.2)  # a release would have landed by now
        assert await _pins(registry_server, want) == want
        if status == 200:  # the engine's note is the gateway's, not decode's
            assert "kvbridge_pin_left" not in s.engines["d0"].received[-1]["kv_transfer_params"]
    finally:
        await close(s)


async def test_unreachable_engine_is_retried_on_another(registry_server: RegistryServer,
                                                        tmp_path: Path) -> None:
    s = await make_stack(registry_server, tmp_path, engines=(("prefill", "p0"),
                                                            ("decode", "d1")))
    try:
        with socket.socket() as sock:  # a port nothing listens on
            sock.bind(("127.0.0.1", 0))
            dead = sock.getsockname()[1]
        s.router.table.register(InstanceSpec("d0", Role.DECODE, f"http://127.0.0.1:{dead}",
                                             "engine-d0", MODEL))
        raw = await client(s).completions.with_raw_response.create(
            model=MODEL, prompt="hi", max_tokens=2)
        assert raw.parse().choices[0].text == "Hello from d1"
        assert raw.headers["x-kvbridge-decode-instance"] == "d1"
        async with aiohttp.ClientSession() as session, session.get(f"{s.url}/metrics") as resp:
            text = await resp.text()
        assert f'kvbridge_gateway_retries_total{{model="{MODEL}",role="decode"}} 1.0' in text
    finally:
        await close(s)


@pytest.mark.parametrize("keepalive", [0.2, 30.0])
async def test_idle_engine_connections_are_not_reused_past_engine_keepalive(
        registry_server: RegistryServer, tmp_path: Path, keepalive: float) -> None:
    # vLLM closes a connection idle for 5 s: one reused as it does fails the turn. The gateway
    # opens a new one when its own, shorter, keep-alive has passed, and reuses it before.
    s = await make_stack(registry_server, tmp_path, engine_keepalive_s=keepalive)
    try:
        for turn in range(2):
            if turn:
                await asyncio.sleep(0.5)  # aiohttp times its pool by the real monotonic clock
            raw = await client(s).completions.with_raw_response.create(
                model=MODEL, prompt="hi", max_tokens=2)
            assert raw.parse().choices[0].text == "Hello from d0"
        for engine in ("p0", "d0"):
            peers = s.engines[engine].peers
            assert len(peers) == 2
            assert (peers[0] != peers[1]) == (keepalive < 0.5), (engine, peers)
    finally:
        await close(s)


def test_engine_keepalive_must_be_positive() -> None:
    with pytest.raises(ValueError, match="engine_keepalive_s must be positive"):
        GatewayConfig(engine_keepalive_s=0)


async def _metric(s: Stack, needle: str) -> bool:
    async with aiohttp.ClientSession() as session, session.get(f"{s.url}/metrics") as resp:
        return needle in await resp.text()


async def _pins(registry_server: RegistryServer, want: int) -> int:
    for _ in range(200):  # released in the background
        if registry_server.table.counts()["pins"] == want:
            break
        await asyncio.sleep(0.01)
    return int(registry_server.table.counts()["pins"])


@pytest.mark.parametrize("fault", ["disconnect", "500", "503"])
async def test_prefill_that_fails_mid_turn_is_retried_on_the_other(
        registry_server: RegistryServer, tmp_path: Path, kv: Any, fault: str) -> None:
    """A prefill engine dies with the request (the connection drops, no answer) or answers
    5xx: nothing has reached the client, so the gateway sends the turn to the other prefill,
    which gets a pin of its own. The failed attempt's pin is not the gateway's to release: that
    engine may still have a read in flight under it (it releases the pin when the read is
    over, or the pin runs out)."""
    s = await make_stack(registry_server, tmp_path, engines=(
        ("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")))
    try:
        faults = [fault]  # shared: whichever prefill the router picks first fails
        s.engines["p0"].faults = s.engines["p1"].faults = faults
        tenant = "key-" + __import__("hashlib").blake2b(b"sk-alice", digest_size=8).hexdigest()
        reg = s.registry_client
        await reg.register_holder("engine-d0", "127.0.0.1", 5600, kv.block_size,
                                  kv.fingerprint, ttl=60)
        await reg.grant_lease("engine-d0", tenant, "conv-r", "req-1", [1, 2], 8,
                              kv.lease_hashes(kv.tokens(8)))
        raw = await client(s).completions.with_raw_response.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"conversation_id": "conv-r"})
        assert raw.parse().choices[0].text == "Hello from d0"
        served = raw.headers["x-kvbridge-prefill-instance"]
        failed = "p1" if served == "p0" else "p0"
        assert not faults
        assert len(s.engines[failed].received) == 1 and len(s.engines[served].received) == 1
        pins = [s.engines[name].received[0]["kv_transfer_params"]["kvbridge"]["read"]["pin_id"]
                for name in (failed, served)]
        assert pins[0] != pins[1]
        # Both pins stand: each is its (fake) engine's to release.
        await asyncio.sleep(0.2)  # a release would have landed by now
        assert await _pins(registry_server, 2) == 2
        assert pins[0] in registry_server.table._pins
        assert await _metric(
            s, f'kvbridge_gateway_retries_total{{model="{MODEL}",role="prefill"}} 1.0')
    finally:
        await close(s)


async def test_prefill_failing_on_every_instance_returns_its_error(
        registry_server: RegistryServer, tmp_path: Path) -> None:
    """Retries run out (one, by default): the client gets the last engine's status, with a
    message of the gateway's own (never what the engine said) naming the request id."""
    s = await make_stack(registry_server, tmp_path, engines=(
        ("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")))
    try:
        faults = ["500", "500"]
        s.engines["p0"].faults = s.engines["p1"].faults = faults
        status, headers, body = await post(s, "/v1/completions",
                                           {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert status == 500 and "fake" not in body["error"]["message"], body
        request_id = {k.lower(): v for k, v in headers.items()}["x-request-id"]
        assert request_id.startswith("req-") and request_id in body["error"]["message"]
        assert not faults and not s.engines["d0"].received
        assert await _metric(
            s, f'kvbridge_gateway_retries_total{{model="{MODEL}",role="prefill"}} 1.0')
        # Both gone mid-request: a 502 that says so.
        faults += ["disconnect", "disconnect"]
        status, _, body = await post(s, "/v1/completions",
                                     {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert status == 502 and body["error"]["code"] == "engine_unreachable", body
    finally:
        await close(s)


async def test_prefill_4xx_is_the_clients_answer_not_retried(
        registry_server: RegistryServer, tmp_path: Path) -> None:
    s = await make_stack(registry_server, tmp_path, engines=(
        ("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")))
    try:
        faults = ["400"]
        s.engines["p0"].faults = s.engines["p1"].faults = faults
        status, _, body = await post(s, "/v1/completions",
                                     {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert status == 400 and body["error"]["message"] == "fake 400", body
        assert len(s.engines["p0"].received) + len(s.engines["p1"].received) == 1
        assert not await _metric(
            s, f'kvbridge_gateway_retries_total{{model="{MODEL}",role="prefill"}}')
    finally:
        await close(s)


# ==== bad input ==================================================================================


@pytest.mark.parametrize(("raw", "status", "needle"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"prompt": "x"}', 400, "model is required"),
    (b'{"model": "tiny", "prompt": "x", "conversation_id": "has space"}', 400,
     "conversation_id"),
    (b'{"model": "tiny", "prompt": "x", "conversation_id": 12}', 400, "conversation_id"),
    (b'{"model": "tiny", "prompt": "x", "kv_transfer_params": {}}', 400, "kv_transfer_params"),
    (b"\xff\xfe", 400, "not valid JSON"),
])
async def test_bad_requests_get_openai_style_errors(stack: Stack, raw: bytes, status: int,
                                                    needle: str) -> None:
    got, _, body = await post(stack, "/v1/completions", None, raw=raw)
    assert got == status
    assert needle in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert not stack.engines["p0"].received  # nothing reached an engine


async def test_huge_body_is_refused(registry_server: RegistryServer, tmp_path: Path) -> None:
    s = await make_stack(registry_server, tmp_path, max_body_bytes=1024)
    try:
        status, _, body = await post(s, "/v1/completions",
                                     {"model": MODEL, "prompt": "x" * 5000})
        assert status == 413 and "larger than 1024 bytes" in body["error"]["message"]
        assert not s.engines["p0"].received
    finally:
        await close(s)


async def test_unknown_model_is_404_and_a_model_without_prefill_503(
        registry_server: RegistryServer, tmp_path: Path) -> None:
    s = await make_stack(registry_server, tmp_path, engines=(("decode", "d0"),))
    try:
        with pytest.raises(openai.NotFoundError) as raised:
            await client(s).completions.create(model="unknown-model", prompt="hi")
        assert raised.value.status_code == 404
        assert "'unknown-model' does not exist" in str(raised.value)
        assert raised.value.body["code"] == "model_not_found"  # type: ignore[index]
        # The model exists (d0 serves it) but no prefill instance is up: a 503, retryable.
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client(s).completions.create(model=MODEL, prompt="hi")
        assert unavailable.value.status_code == 503
        assert "no live prefill instance" in str(unavailable.value)
    finally:
        await close(s)


# ==== conversations, models, health ==============================================================


async def test_keepalive_and_delete(stack: Stack, kv: Any) -> None:
    await client(stack).completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                           extra_body={"conversation_id": "c9"})
    tenant = stack.engines["p0"].received[0]["kv_transfer_params"]["kvbridge"]["tenant"]
    reg = stack.registry_client
    await reg.register_holder("engine-d0", "127.0.0.1", 5600, kv.block_size, kv.fingerprint,
                              ttl=60)
    lease = (await reg.grant_lease("engine-d0", tenant, "c9", "req-9", [1, 2], 8,
                                   kv.lease_hashes(kv.tokens(8)), idle_ttl=5)).lease
    auth = {"Authorization": "Bearer sk-alice"}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{stack.url}/v1/conversations/c9", headers=auth) as resp:
            assert resp.status == 200
            info = await resp.json()
        assert {k: info[k] for k in ("state", "holder", "epoch", "tokens", "pins")} == {
            "state": "active", "holder": "engine-d0", "epoch": 1, "tokens": 8, "pins": 0}
        async with session.get(f"{stack.url}/v1/conversations/c9",
                               headers={"Authorization": "Bearer sk-bob"}) as resp:
            assert resp.status == 404
    status, _, body = await post(stack, "/v1/conversations/c9/keepalive", {}, auth)
    assert status == 200 and body["renewed"] == 1 and 0 < body["expires_in_s"] <= 5
    # Another tenant cannot keep it alive, nor release it.
    status, _, body = await post(stack, "/v1/conversations/c9/keepalive", {},
                                 {"Authorization": "Bearer sk-bob"})
    assert status == 404 and body["error"]["code"] == "no_lease"
    async with aiohttp.ClientSession() as session:
        async with session.delete(f"{stack.url}/v1/conversations/c9",
                                  headers={"Authorization": "Bearer sk-bob"}) as resp:
            assert (await resp.json())["released"] == 0
        assert (await reg.get_lease(lease.lease_id)).state == reg_pb.LEASE_STATE_ACTIVE
        async with session.delete(f"{stack.url}/v1/conversations/c9", headers=auth) as resp:
            assert resp.status == 200 and (await resp.json())["released"] == 1
    assert (await reg.get_lease(lease.lease_id)).state == reg_pb.LEASE_STATE_REVOKED
    status, _, body = await post(stack, "/v1/conversations/bad%20id/keepalive", {}, auth)
    assert status == 400


async def test_models_health_and_metrics(stack: Stack) -> None:
    models = await client(stack).models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{stack.url}/health") as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "ok", "prefill": 1, "decode": 1}
        stack.router.table.deregister("d0")
        async with session.get(f"{stack.url}/health") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "no_engines"
        async with session.get(f"{stack.url}/metrics") as resp:
            text = await resp.text()
    assert 'kvbridge_gateway_requests_total{endpoint="models",model="",status="200"} 1.0' in text


async def test_metrics_carry_the_model_only_for_served_models(stack: Stack) -> None:
    """Every gateway metric has a `model` label: the served model's name, "other" for names no
    engine serves (a client cannot add series by inventing names), "" for no model."""
    await client(stack).completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                           extra_body={"conversation_id": "conv-m"})
    for invented in ("made-up-1", "made-up-2"):
        with pytest.raises(openai.NotFoundError):
            await client(stack).completions.create(model=invented, prompt="hi")
    status, _, _ = await post(stack, "/v1/completions", {"prompt": "no model"})
    assert status == 400
    text = await _metrics_text(stack)
    lines = [line for line in text.splitlines() if line.startswith("kvbridge_gateway_")]
    for needle in (
            f'kvbridge_gateway_requests_total{{endpoint="completions",model="{MODEL}",'
            f'status="200"}} 1.0',
            'kvbridge_gateway_requests_total{endpoint="completions",model="other",'
            'status="404"} 2.0',
            'kvbridge_gateway_requests_total{endpoint="completions",model="",status="400"} 1.0',
            f'kvbridge_gateway_ttft_seconds_count{{model="{MODEL}"}} 1.0',
            f'kvbridge_gateway_prefill_seconds_count{{model="{MODEL}"}} 1.0',
            f'kvbridge_gateway_recomputed_tokens_total{{model="{MODEL}"}} 7.0',
            f'kvbridge_gateway_conversation_sources_total{{model="{MODEL}",source="body"}} 1.0'):
        assert needle in lines, needle
    assert not any("made-up" in line for line in lines)


def test_model_labels_are_bounded() -> None:
    metrics = Metrics()
    for n in range(MODEL_LABELS + 5):
        metrics.serves(f"model-{n}")
    assert len(metrics.served) == MODEL_LABELS
    assert metrics.model("model-0") == "model-0"
    assert metrics.model(f"model-{MODEL_LABELS}") == "other"
    assert metrics.model("") == ""


async def _metrics_text(s: Stack) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{s.url}/metrics") as resp:
        return await resp.text()


async def test_health_without_router(unused_tcp_port: int) -> None:
    server = await start_gateway(GatewayConfig(listen="127.0.0.1:0",
                                               router=f"127.0.0.1:{unused_tcp_port}",
                                               registry="", route_timeout_s=0.3))
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.url}/health") as resp:
                assert resp.status == 503
                assert "router" in (await resp.json())["error"]
            async with session.post(f"{server.url}/v1/completions",
                                    json={"model": MODEL, "prompt": "x"}) as resp:
                body = await resp.json()
                assert resp.status == 503 and body["error"]["code"] == "router_unavailable"
            async with session.post(f"{server.url}/v1/conversations/c/keepalive") as resp:
                assert resp.status == 501
    finally:
        await server.stop()


@pytest.mark.parametrize("pin_at_route", [True, False])
async def test_a_turn_keeps_its_conversations_lease(
        registry_server: RegistryServer, registry_clock: FakeClock, tmp_path: Path, kv: Any,
        pin_at_route: bool) -> None:
    """A turn is conversation activity: its lease's idle TTL starts again. The read pinned at
    route renews it in the same call (the gateway makes no call of its own); with pins at
    route off, the gateway renews it."""
    s = await make_stack(registry_server, tmp_path, pin_at_route=pin_at_route, lease_wait_s=0)

    def renewals() -> float:
        value = registry_server.metrics.registry.get_sample_value(
            "kvbridge_registry_rpc_duration_seconds_count", {"method": "RenewLeases"})
        return value or 0.0

    try:
        await client(s).completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                           extra_body={"conversation_id": "c-keep"})
        tenant = s.engines["p0"].received[0]["kv_transfer_params"]["kvbridge"]["tenant"]
        reg = s.registry_client
        await reg.register_holder("engine-d0", "127.0.0.1", 5600, kv.block_size,
                                  kv.fingerprint, ttl=60)
        await reg.grant_lease("engine-d0", tenant, "c-keep", "req-k", [1, 2], 8,
                              kv.lease_hashes(kv.tokens(8)), idle_ttl=10)
        registry_clock.advance(8)
        before = renewals()
        await client(s).completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                           extra_body={"conversation_id": "c-keep"})
        left = 0.0
        for _ in range(200):  # the gateway's renewal runs in the background
            page = await reg.list_leases(tenant=tenant, conversation_id="c-keep")
            left = seconds(page.leases[0].expires_in)
            if left > 5:
                break
            await asyncio.sleep(0.01)
        assert 9 < left <= 10
        assert renewals() == before + (0 if pin_at_route else 1)
    finally:
        await close(s)


@pytest.mark.parametrize(("wait", "reason"), [(0.3, "holds_lease"), (0.0, "no_lease")])
async def test_fast_follow_up_waits_for_the_previous_turns_lease(
        registry_server: RegistryServer, tmp_path: Path, kv: Any, wait: float,
        reason: str) -> None:
    """A tool result sent right after a turn can beat decode's background grant over that
    turn; the gateway waits (briefly, only then) for the lease, so the turn goes back to the
    decode instance holding it."""
    import asyncio

    s = await make_stack(registry_server, tmp_path, lease_wait_s=wait)
    try:
        await client(s).completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                           extra_body={"conversation_id": "c-fast"})
        tenant = s.engines["p0"].received[0]["kv_transfer_params"]["kvbridge"]["tenant"]
        reg = s.registry_client
        await reg.register_holder("engine-d0", "127.0.0.1", 5600, kv.block_size,
                                  kv.fingerprint, ttl=60)

        async def grant_soon() -> None:  # as decode's grant thread would, 100 ms later
            await asyncio.sleep(0.1)
            await reg.grant_lease("engine-d0", tenant, "c-fast", "req-f", [1, 2], 8,
                                  kv.lease_hashes(kv.tokens(8)))

        granting = asyncio.create_task(grant_soon())
        raw = await client(s).completions.with_raw_response.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body={"conversation_id": "c-fast"})
        await granting
        assert raw.headers["x-kvbridge-decode-reason"] == reason
    finally:
        await close(s)


# ==== conversations found by content (no id) ==================================================


async def _grant_as_decode(s: Stack, kv: Any, received: dict[str, Any], tokens: int = 8,
                           holder: str = "engine-d0") -> str:
    """Grant the lease decode's connector would over the turn it `received`, with the history
    keys the gateway sent it; returns the lease id."""
    section = received["kv_transfer_params"]["kvbridge"]
    reg = s.registry_client
    await reg.register_holder(holder, "127.0.0.1", 5600, kv.block_size, kv.fingerprint, ttl=60)
    resp = await reg.grant_lease(holder, section["tenant"], section["conversation_id"],
                                 f"req-{len(s.engines['d0'].received)}", [1, 2], tokens,
                                 kv.lease_hashes(kv.tokens(tokens)),
                                 history_keys=base64.b64decode(section["history_keys"]))
    return str(resp.lease.lease_id)


async def test_turn_without_id_continues_the_lease_its_history_has(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    s = await make_stack(registry_server, tmp_path)
    other = await start_gateway(GatewayConfig(
        listen="127.0.0.1:0", router=f"127.0.0.1:{s.router.port}",
        registry=f"127.0.0.1:{registry_server.port}"))
    try:
        first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=first, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "new"
        assert raw.headers["x-kvbridge-history-matched"] == "0/2"
        conversation = raw.headers["x-kvbridge-conversation-id"]
        assert conversation.startswith("kvb-")
        sent = s.engines["d0"].received[-1]
        assert sent["kv_transfer_params"]["kvbridge"]["conversation_id"] == conversation
        # Nothing to read for a new conversation: prefill is told so, it looks nothing up.
        assert s.engines["p0"].received[-1]["kv_transfer_params"]["kvbridge"]["read"] == {
            "miss": "no_lease"}
        lease_id = await _grant_as_decode(s, kv, sent)

        second = [*first, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "more"}]
        # Another gateway (no memory of the first turn) finds it in the registry.
        async with aiohttp.ClientSession() as http, http.post(
                f"{other.url}/v1/chat/completions", json={"model": MODEL, "messages": second,
                                                          "max_tokens": 2},
                headers={"Authorization": "Bearer sk-alice"}) as resp:
            assert resp.status == 200
            headers = resp.headers
        assert headers["X-Kvbridge-Conversation-Source"] == "continued"
        assert headers["X-Kvbridge-Conversation-Id"] == conversation
        assert headers["X-Kvbridge-History-Matched"] == "2/4"
        assert headers["X-Kvbridge-Decode-Reason"] == "holds_lease"
        read = s.engines["p0"].received[-1]["kv_transfer_params"]["kvbridge"]["read"]
        assert read["lease_id"] == lease_id and read["pin_id"].startswith("p-")
        # Decode's lease over this turn will be found under this turn's keys.
        assert s.engines["d0"].received[-1]["kv_transfer_params"]["kvbridge"][
            "conversation_id"] == conversation

        # The same gateway remembers its own turns: a follow-up continues at once.
        third = [*second, {"role": "assistant", "content": "Hello"},
                 {"role": "user", "content": "and more"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=third, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] in ("recent", "continued")
        assert raw.headers["x-kvbridge-conversation-id"] == conversation
        assert await _metric(s, 'kvbridge_gateway_conversation_sources_total{'
                                f'model="{MODEL}",source="new"}} 1.0')
    finally:
        await other.stop()
        await close(s)


async def test_branch_reads_the_shared_part_and_keeps_its_own_id(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    s = await make_stack(registry_server, tmp_path)
    try:
        first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=first, max_tokens=2)
        conversation = raw.headers["x-kvbridge-conversation-id"]
        lease_id = await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        # The user's message edited: only the system prompt is shared.
        edited = [first[0], {"role": "user", "content": "hello there"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=edited, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "branched"
        assert raw.headers["x-kvbridge-history-matched"] == "1/2"
        assert raw.headers["x-kvbridge-conversation-id"] not in ("", conversation)
        read = s.engines["p0"].received[-1]["kv_transfer_params"]["kvbridge"]["read"]
        assert read["lease_id"] == lease_id  # the shared part is read (prefill verifies it)
        # Regenerating the same turn is a branch too: the lease stays for the others.
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=first, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "branched"
        lease = await s.registry_client.get_lease(lease_id)
        assert lease.state == reg_pb.LEASE_STATE_ACTIVE
    finally:
        await close(s)


async def test_a_turn_holding_only_part_of_a_siblings_lease_branches(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    """A regenerated answer's lease has the same history keys as the first answer's: a turn
    that continues the first answer finds the sibling's lease, and prefill finds that it holds
    only part of it (its answer differs). The turn branches: the sibling's lease stays."""
    s = await make_stack(registry_server, tmp_path, lease_wait_s=0)
    try:
        first = [{"role": "user", "content": "write a poem"}]
        await client(s).chat.completions.create(model=MODEL, messages=first, max_tokens=2)
        await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        s.gateway.gateway._ended.clear()  # long after: found in the registry, not as recent
        raw = await client(s).chat.completions.with_raw_response.create(  # regenerate
            model=MODEL, messages=first, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "branched"
        sibling = raw.headers["x-kvbridge-conversation-id"]
        assert sibling.startswith("kvb-s") and len(sibling) == 28, sibling
        lease_id = await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        s.gateway.gateway._ended.clear()
        follow = [*first, {"role": "assistant", "content": "the first answer"},
                  {"role": "user", "content": "shorter"}]
        s.engines["p0"].reused, s.engines["p0"].lease_whole = 4, False
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=follow, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "branched"
        assert raw.headers["x-kvbridge-conversation-id"] not in ("", sibling)
        read = s.engines["p0"].received[-1]["kv_transfer_params"]["kvbridge"]["read"]
        assert read["lease_id"] == lease_id  # what it shares is read all the same
        sent = s.engines["d0"].received[-1]["kv_transfer_params"]
        assert sent["kvbridge"]["conversation_id"] == raw.headers["x-kvbridge-conversation-id"]
        assert "kvbridge_lease_whole" not in sent  # prefill's word stays with the gateway
        assert not s.gateway.gateway._continuing  # the claim on the sibling is given back
        # With the whole lease held, the same request continues it.
        s.gateway.gateway._ended.clear()
        s.engines["p0"].lease_whole = True
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=follow, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "continued"
        assert raw.headers["x-kvbridge-conversation-id"] == sibling
        # Past its first lease, a sibling is a conversation as any other: a turn holding
        # only part of its lease continues it.
        await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        s.gateway.gateway._ended.clear()
        s.engines["p0"].lease_whole = False
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=2, messages=[
                *follow, {"role": "assistant", "content": "stripped"},
                {"role": "user", "content": "go on"}])
        assert raw.headers["x-kvbridge-conversation-source"] == "continued"
        assert raw.headers["x-kvbridge-conversation-id"] == sibling
    finally:
        await close(s)


async def test_a_turn_holding_only_part_of_its_own_conversations_lease_continues(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    """A client that re-sends the answer changed (its reasoning stripped) holds only part of
    the conversation's lease: the turn still continues the conversation (the lease, never to
    be read whole again, is superseded rather than left to its TTL)."""
    s = await make_stack(registry_server, tmp_path, lease_wait_s=0)
    try:
        first = [{"role": "user", "content": "think, then answer"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=first, max_tokens=2)
        conversation = raw.headers["x-kvbridge-conversation-id"]
        await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        s.gateway.gateway._ended.clear()
        s.engines["p0"].reused, s.engines["p0"].lease_whole = 4, False
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=2, messages=[
                *first, {"role": "assistant", "content": "the answer, no reasoning"},
                {"role": "user", "content": "next"}])
        assert raw.headers["x-kvbridge-conversation-source"] == "continued"
        assert raw.headers["x-kvbridge-conversation-id"] == conversation
    finally:
        await close(s)


async def test_a_sibling_of_a_turn_whose_grant_has_not_landed_branches(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    """Two follow-ups to one turn, the second sent after the first ended but before decode's
    grant over the first landed: the registry still has the older lease, which the second
    extends whole. It must branch (it lacks the first follow-up's turn), or its grant would
    supersede the first follow-up's."""
    s = await make_stack(registry_server, tmp_path, lease_wait_s=0)
    try:
        first = [{"role": "user", "content": "plan"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=first, max_tokens=2)
        conversation = raw.headers["x-kvbridge-conversation-id"]
        await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        s.gateway.gateway._ended.clear()
        a = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "a"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=a, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "continued"
        assert raw.headers["x-kvbridge-conversation-id"] == conversation
        s.gateway.gateway._ended.clear()  # not as recent: the registry answers
        b = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "b"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=b, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "branched"
        assert raw.headers["x-kvbridge-conversation-id"] != conversation
        # The first follow-up's own next turn still continues the conversation.
        s.gateway.gateway._ended.clear()
        c = [*a, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "c"}]
        raw = await client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=c, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "continued"
        assert raw.headers["x-kvbridge-conversation-id"] == conversation
    finally:
        await close(s)


async def test_a_client_too_slow_to_read_leaves_no_turn_to_continue(
        registry_server: RegistryServer, tmp_path: Path) -> None:
    """A client that stops reading has the stream cut (decode's request aborted, so no lease
    over the turn): its history is not a turn a follow-up continues or waits for."""
    s = await make_stack(registry_server, tmp_path, body_timeout_s=0.5)
    try:
        s.engines["d0"].padding = 64 << 20
        body = json.dumps({"model": MODEL, "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()

        def send_and_read_nothing() -> None:
            with socket.create_connection(("127.0.0.1", s.gateway.port)) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Authorization: Bearer sk-alice\r\nContent-Type: "
                             b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                             + body)
                # Read nothing while the gateway's writes fill the buffers and time out.
                threading.Event().wait(3.0)

        await asyncio.to_thread(send_and_read_nothing)
        for _ in range(500):
            if await _metric(s, 'kvbridge_gateway_conversation_sources_total{'
                                f'model="{MODEL}",source="new"}} 1.0'):
                break
            await asyncio.sleep(0.02)
        gw = s.gateway.gateway
        assert await _metric(s, 'kvbridge_gateway_conversation_sources_total{'
                                f'model="{MODEL}",source="new"}} 1.0')
        assert not gw._ended and not gw._recent_keys
    finally:
        await close(s)


async def test_lookup_never_crosses_tenants(registry_server: RegistryServer, tmp_path: Path,
                                            kv: Any) -> None:
    s = await make_stack(registry_server, tmp_path)
    try:
        first = [{"role": "user", "content": "the same words"}]
        await client(s).chat.completions.create(model=MODEL, messages=first, max_tokens=2)
        await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        second = [*first, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "again"}]
        raw = await client(s, "sk-bob").chat.completions.with_raw_response.create(
            model=MODEL, messages=second, max_tokens=2)
        assert raw.headers["x-kvbridge-conversation-source"] == "new"
        assert s.engines["p0"].received[-1]["kv_transfer_params"]["kvbridge"]["read"] == {
            "miss": "no_lease"}
    finally:
        await close(s)


async def test_session_header_names_the_conversation(stack: Stack) -> None:
    raw = await client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Session-ID": "sess-1"})
    assert raw.headers["x-kvbridge-conversation-source"] == "session"
    assert raw.headers["x-kvbridge-conversation-id"] == "sess-1"
    assert stack.engines["d0"].received[-1]["kv_transfer_params"]["kvbridge"][
        "conversation_id"] == "sess-1"
    # An explicit id wins over the session header, and over the lookup.
    raw = await client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Session-ID": "sess-1", "X-Conversation-Id": "conv-2"})
    assert raw.headers["x-kvbridge-conversation-source"] == "header"
    assert raw.headers["x-kvbridge-conversation-id"] == "conv-2"
    # Another system's session header that is no valid id names the conversation by its hash.
    ids = set()
    for _ in range(2):
        status, headers, _ = await post(stack, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            {"X-Session-ID": "has spaces " + "x" * 300})
        assert status == 200 and headers["X-Kvbridge-Conversation-Source"] == "session"
        ids.add(headers["X-Kvbridge-Conversation-Id"])
    assert len(ids) == 1 and ids.pop().startswith("session-")
    status, _, body = await post(stack, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        {"X-Conversation-Id": "has spaces"})
    assert status == 400 and body["error"]["code"] == "invalid_conversation_id"


async def test_request_may_turn_the_lookup_off(stack: Stack) -> None:
    raw = await client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Kvbridge-Conversation-Lookup": "off"})
    assert raw.headers["x-kvbridge-conversation-source"] == "none"
    assert "kvbridge" not in stack.engines["d0"].received[-1]["kv_transfer_params"]
    status, _, body = await post(stack, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        {"X-Kvbridge-Conversation-Lookup": "maybe"})
    assert status == 400 and body["error"]["code"] == "bad_conversation_lookup"


async def test_unrecognised_history_is_served_without_reuse(stack: Stack) -> None:
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    raw = await client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert raw.http_response.status_code == 200
    assert raw.headers["x-kvbridge-conversation-source"] == "unrecognised"
    assert "kvbridge" not in stack.engines["d0"].received[-1]["kv_transfer_params"]


async def test_a_history_longer_than_a_lookup_sends_its_latest_keys(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    s = await make_stack(registry_server, tmp_path, lease_wait_s=0)
    other = await start_gateway(GatewayConfig(
        listen="127.0.0.1:0", router=f"127.0.0.1:{s.router.port}",
        registry=f"127.0.0.1:{registry_server.port}"))
    try:
        first = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                 for i in range(4101)]
        await client(s).chat.completions.create(model=MODEL, messages=first,  # type: ignore[arg-type]
                                                max_tokens=2)
        await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        second = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
        async with aiohttp.ClientSession() as http, http.post(
                f"{other.url}/v1/chat/completions", json={"model": MODEL, "messages": second},
                headers={"Authorization": "Bearer sk-alice"}) as resp:
            assert resp.status == 200
            assert resp.headers["X-Kvbridge-Conversation-Source"] == "continued"
            assert resp.headers["X-Kvbridge-History-Matched"] == "4101/4103"
    finally:
        await other.stop()
        await close(s)


async def test_concurrent_continuations_of_one_lease_branch_but_one(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    """An agent's parallel calls that each extend a lease's whole history: one continues the
    conversation, the others branch (else each grant would supersede its sibling's)."""
    s = await make_stack(registry_server, tmp_path, lease_wait_s=0)
    try:
        first = [{"role": "user", "content": "plan"}]
        await client(s).chat.completions.create(model=MODEL, messages=first, max_tokens=2)
        await _grant_as_decode(s, kv, s.engines["d0"].received[-1])
        s.engines["d0"].delay = 0.5

        async def call(task: str) -> str:
            raw = await client(s).chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=2, messages=[
                    *first, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": task}])
            return str(raw.headers["x-kvbridge-conversation-source"])

        sources = await asyncio.gather(call("a"), call("b"), call("c"))
        assert sources.count("branched") == 2, sources  # the other: recent (or continued)
        assert len({*sources} & {"recent", "continued"}) == 1, sources
    finally:
        await close(s)


def test_recent_turns_keep_one_entry_per_conversation_and_history(stack: Stack) -> None:
    """Repeated identical one-shot prompts (a new conversation each) must not grow the
    gateway's memory of recent turns, and a conversation moving on must not drop the entry
    another conversation now holds."""
    gw = stack.gateway.gateway
    key, other = b"k" * 16, b"o" * 16
    for i in range(50):
        gw._remember_keys("t", key, f"kvb-{i}")
    assert gw._recent_keys == {("t", key): "kvb-49"} and gw._latest_key == {("t", "kvb-49"): key}
    gw._remember_keys("t", key, "kvb-x")  # another conversation ends on the same history
    gw._remember_keys("t", other, "kvb-49")  # the first moves on
    assert gw._recent_keys == {("t", key): "kvb-x", ("t", other): "kvb-49"}
    assert gw._latest_key == {("t", "kvb-x"): key, ("t", "kvb-49"): other}
