"""The OpenAI-compatible gateway: one conversation turn = route, prefill, then decode.

Per turn the gateway asks the router for a prefill and a decode instance, sends the prefill
request (`max_tokens` 1, the conversation key in `kv_transfer_params`), then sends the decode
request with prefill's `kv_transfer_params` and streams its response back unchanged. The
tenant comes from the API key, never from the request, so one tenant cannot name another's
conversation. What happened (instances, reuse, timings) is in the `X-Kvbridge-*` response
headers and in one log line per request.

Every response carries `X-Request-Id`, also in the request's log lines. An engine's own reply
reaches the client only when it is the answer (decode's completion, a JSON object or an event
stream) or an OpenAI-style 4xx error object (its message, type and code, nothing else); any
other reply (a 5xx, a body that is not JSON, a connection error) is logged with the request id
and the client gets a generic error naming that id, so that the gateway never shows a client
what some other server said.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvbridge import history
from kvbridge.clients._registry import AsyncRegistryClient, seconds
from kvbridge.clients._router import AsyncRouterClient
from kvbridge.clock import monotonic
from kvbridge.connector._routed import LEASE_WHOLE, PIN_LEFT, READ_KEY, routed_read
from kvbridge.connector._settings import CONVERSATION_KEY
from kvbridge.errors import InvalidArgument, KvbridgeError, NoInstance
from kvbridge.registry.v1 import registry_pb2 as reg_pb
from kvbridge.router.v1 import router_pb2 as router_pb
from kvbridge.services.gateway._config import GatewayConfig
from kvbridge.services.gateway._http import EngineResolver

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kvbridge._otel import Tracing

log = structlog.get_logger("kvbridge.gateway")
_T = TypeVar("_T")

_ID = re.compile(r"[\x21-\x7e]{1,256}")
CONVERSATION_HEADER = "X-Conversation-Id"
SESSION_HEADER = "X-Session-ID"  # what vLLM's multi-turn benchmark sends
# A request's own choice: "off" serves a turn that names no conversation without reuse (and
# without retaining its KV), whatever the gateway's --conversation-lookup.
LOOKUP_HEADER = "X-Kvbridge-Conversation-Lookup"
# A conversation found by content is named kvb-<hex>; one that began as another answer to a
# whole lease's history (a sibling), kvb-s<hex>: any gateway can tell from the id alone.
_SIBLING = "kvb-s"
_RECENT_CONVERSATIONS = 100_000
# How long after a turn ends a follow-up is matched against it locally (`_recent_turn`):
# decode's grant over that turn lands well within it, and from then on the registry answers.
_RECENT_TURN_S = 3.0
# Most history keys a lookup sends (the registry's default max_lookup_keys): a longer history
# sends its latest boundaries, where the leases it may continue have their keys.
_LOOKUP_KEYS = 4096
REQUEST_ID_HEADER = "X-Request-Id"
_ENGINE_MESSAGE_CHARS = 1000  # of an engine's 4xx error message passed to the client
_LOGGED_BODY_CHARS = 2000  # of an engine's bad reply kept in the log
# Most of an engine's (non-streamed) reply the gateway reads: past it, the engine is at fault.
_MAX_ENGINE_REPLY = 64 * 2**20


class _TooLarge(Exception):
    pass


async def _read_reply(resp: aiohttp.ClientResponse) -> bytes:
    """An engine's whole reply, up to `_MAX_ENGINE_REPLY` (`_TooLarge` past it)."""
    data = bytearray()
    async for chunk in resp.content.iter_chunked(2**16):
        data += chunk
        if len(data) > _MAX_ENGINE_REPLY:
            raise _TooLarge(f"reply longer than {_MAX_ENGINE_REPLY} bytes")
    return bytes(data)
_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvbridge_request_id",
                                                                  default="")
# Most distinct model names the gateway's metrics carry as `model` labels; past it, "other".
MODEL_LABELS = 100
# The model a request named, for its `requests` count (`Gateway._endpoint`).
_MODEL: contextvars.ContextVar[str] = contextvars.ContextVar("kvbridge_model", default="")
_OUTCOME_FIELDS = ("kvbridge_decision", "kvbridge_reused_tokens", "kvbridge_recomputed_tokens",
                   "kvbridge_lookup_ms", "kvbridge_transfer_ms", "kvbridge_mismatch_block",
                   "kvbridge_read_source", "kvbridge_load", "kvbridge_local_tokens")


class HttpError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, *, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.close = close  # close the connection after answering

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.kind,
                                            "param": None, "code": self.code}},
                                 status=self.status)


class Tenants:
    """API key -> tenant. With a keys file only its keys are accepted; without one (open mode)
    a key names its own tenant (a hash of it, so keys never reach logs), no key is
    'anonymous'."""

    def __init__(self, keys_file: str = "") -> None:
        self.keys_file = keys_file
        self.keys: dict[str, str] | None = self._read(keys_file) if keys_file else None

    def reload(self) -> None:
        """Read the keys file again and swap the keys in at once (SIGHUP: a key is rotated
        without a restart); ValueError or OSError, the old keys kept, when it cannot."""
        if self.keys_file:
            self.keys = self._read(self.keys_file)

    @staticmethod
    def _read(keys_file: str) -> dict[str, str]:
        keys = {}
        for n, line in enumerate(Path(keys_file).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or not _ID.fullmatch(parts[1]):
                raise ValueError(f"{keys_file}:{n}: expected 'API_KEY TENANT'")
            keys[parts[0]] = parts[1]
        if not keys:
            raise ValueError(f"{keys_file}: no API keys")
        return keys

    @property
    def open_mode(self) -> bool:
        return self.keys is None

    def tenant_of(self, authorization: str | None) -> str:
        key = ""
        if authorization:
            scheme, _, key = authorization.partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                raise HttpError(401, "Authorization must be 'Bearer API_KEY'",
                                "authentication_error", "invalid_api_key")
            key = key.strip()
        if self.keys is None:
            if not key:
                return "anonymous"
            return "key-" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        tenant = self.keys.get(key) if key else None
        if tenant is None:
            raise HttpError(401, "invalid or missing API key", "authentication_error",
                            "invalid_api_key")
        return tenant


def check_turn_body(body: dict[str, Any], chat: bool) -> None:
    """HttpError 400 for the shapes the gateway itself reads and cannot take (the engine judges
    the rest): chat `messages` a list of objects whose `content` is a string, null or a list of
    objects with string `text`."""
    if not chat:
        return
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise HttpError(400, "messages must be a list of message objects", code="bad_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise HttpError(400, f"messages[{i}] must be an object", code="bad_messages")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise HttpError(400, f"messages[{i}].content must be a string or a list of parts",
                            code="bad_messages")
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise HttpError(400, f"messages[{i}].content[{j}] must be an object",
                                code="bad_messages")
            if "text" in part and not isinstance(part["text"], str | None):
                raise HttpError(400, f"messages[{i}].content[{j}].text must be a string",
                                code="bad_messages")


def estimate_prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    """A cheap estimate for routing (token ids are counted; text is ~4 characters a token)."""
    if chat:
        chars = 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return chars // 4 + 1
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt) // 4 + 1
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return 1


@dataclass
class Metrics:
    """The gateway's Prometheus metrics. Each has a `model` label: the turn's model when an
    engine serves it (`served`), `other` for any other name, empty for a request that names
    no model (not a turn, or refused before its body was read): a client cannot add series by
    inventing model names."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry())

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("kvbridge_gateway_requests",
                                "Requests, by endpoint, status and model",
                                ["endpoint", "status", "model"], registry=r)
        self.ttft = Histogram("kvbridge_gateway_ttft_seconds", "Time to first token",
                              ["model"],
                              buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
                              registry=r)
        self.prefill = Histogram("kvbridge_gateway_prefill_seconds", "Prefill request time",
                                 ["model"],
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60),
                                 registry=r)
        self.reused = Counter("kvbridge_gateway_reused_tokens",
                              "Prompt tokens prefill read back from decode", ["model"],
                              registry=r)
        self.recomputed = Counter("kvbridge_gateway_recomputed_tokens",
                                  "Prompt tokens prefill computed", ["model"], registry=r)
        self.found = Counter("kvbridge_gateway_conversation_sources",
                             "Turns by how their conversation was named or found (body, "
                             "header, session; by content: continued, branched, recent, new; "
                             "unrecognised, none)", ["source", "model"], registry=r)
        self.retries = Counter("kvbridge_gateway_retries",
                               "Turns sent again to another instance after a failed engine",
                               ["role", "model"], registry=r)
        # Models an engine was found to serve (a turn routed, or GET /v1/models), at most
        # `MODEL_LABELS` of them: the `model` label's values besides "other" and "".
        self.served: set[str] = set()

    def serves(self, model: str) -> None:
        """An engine serves `model`: its turns are counted under its name from now on."""
        if model not in self.served and len(self.served) < MODEL_LABELS:
            self.served.add(model)

    def model(self, name: str) -> str:
        """The `model` label of a request that named model `name` ("" for none)."""
        return name if not name or name in self.served else "other"


@dataclass
class _Turn:
    """What one request did, for the log line and the response headers."""

    tenant: str
    conversation: str
    model: str
    request_id: str = ""
    started: float = field(default_factory=time.perf_counter)
    prefill: str = ""
    decode: str = ""
    decode_reason: str = ""
    lease_wait_ms: float = 0.0  # waiting for decode's lease over the turn before
    route_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_headers_ms: float = 0.0  # from sending the decode request to its response headers
    ttft_ms: float = 0.0
    outcome: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    # How the conversation was named or found: body, header, session (X-Session-ID), or by
    # content: continued (a lease's whole history and more), branched (part of a lease's
    # history), recent (a turn this gateway just served, its lease maybe not granted yet),
    # new (nothing found); none when neither an id nor a lookup applied.
    source: str = "none"
    keys: list[bytes] | None = None  # the request's history keys (lookup by content)
    keys_matched: int = 0
    claimed: bool = False  # continuing `conversation` (see Gateway._claim)
    answered: bool = False  # decode's whole answer reached the client

    def span_attributes(self) -> dict[str, str | int | bool]:
        """What the turn's span says of it (tracing on)."""
        out: dict[str, str | int | bool] = {
            "kvbridge.request_id": self.request_id, "kvbridge.tenant": self.tenant,
            "kvbridge.model": self.model,
            # whether the request named its conversation (source: how it was named or found)
            "kvbridge.conversation.present": self.source in ("body", "header", "session"),
            "kvbridge.conversation.source": self.source, "kvbridge.attempts": self.attempts}
        for name, value in (("kvbridge.prefill.instance", self.prefill),
                            ("kvbridge.decode.instance", self.decode),
                            ("kvbridge.decode.reason", self.decode_reason)):
            if value:
                out[name] = value
        for name in ("kvbridge_decision", "kvbridge_reused_tokens", "kvbridge_recomputed_tokens",
                     "kvbridge_read_source", "kvbridge_local_tokens"):
            said = self.outcome.get(name)
            if isinstance(said, str | int) and not isinstance(said, bool):
                out[name.replace("kvbridge_", "kvbridge.", 1)] = said
        return out

    def headers(self) -> dict[str, str]:
        out = {REQUEST_ID_HEADER: self.request_id,
               "X-Kvbridge-Conversation-Source": self.source,
               "X-Kvbridge-Prefill-Instance": self.prefill,
               "X-Kvbridge-Decode-Instance": self.decode,
               "X-Kvbridge-Decode-Reason": self.decode_reason,
               "X-Kvbridge-Route-Ms": f"{self.route_ms:.1f}",
               "X-Kvbridge-Prefill-Ms": f"{self.prefill_ms:.1f}"}
        if self.conversation:
            out["X-Kvbridge-Conversation-Id"] = self.conversation
        if self.keys is not None:
            out["X-Kvbridge-History-Matched"] = f"{self.keys_matched}/{len(self.keys)}"
        if self.outcome:
            out["X-Kvbridge-Decision"] = str(self.outcome.get("kvbridge_decision", ""))
            out["X-Kvbridge-Reused-Tokens"] = str(self.outcome.get("kvbridge_reused_tokens", 0))
            out["X-Kvbridge-Recomputed-Tokens"] = str(
                self.outcome.get("kvbridge_recomputed_tokens", 0))
            for name in _OUTCOME_FIELDS[3:]:
                if name in self.outcome:
                    header = "X-Kvbridge-" + name.removeprefix("kvbridge_").replace(
                        "_", "-").title()
                    out[header] = str(self.outcome[name])
        return out


class _EngineDown(Exception):
    """An engine failed a turn before anything was sent to the client: unreachable, gone
    mid-request (connection lost), or a prefill that answered 5xx (`status`). `str()` is for
    the log only: it may hold what the engine said."""

    def __init__(self, role: str, instance_id: str, error: str, status: int | None = None,
                 *, never_sent: bool = False) -> None:
        what = "failed" if status is not None else "unreachable"
        super().__init__(f"{role} instance {instance_id} {what}: {error}")
        self.role, self.instance_id, self.status = role, instance_id, status
        self.never_sent = never_sent  # no connection: the engine cannot have the request

    def client_error(self, request_id: str) -> HttpError:
        """What the client is told: no more than which instance failed, and how."""
        if self.status is not None:
            status = self.status if self.status >= 500 else 502  # (a redirect: never passed on)
            return HttpError(status, f"{self.role} instance {self.instance_id} failed "
                             f"(HTTP {self.status}); request id {request_id}", "engine_error",
                             "engine_error")
        return HttpError(502, f"{self.role} instance {self.instance_id} unreachable; request "
                         f"id {request_id}", "engine_error", "engine_unreachable")


def engine_error(status: int, text: str, role: str, instance: str, request_id: str
                 ) -> web.Response:
    """The client's answer for an engine's error reply (status >= 400): a 4xx OpenAI-style
    error object (`{"error": {"message", "type", ...}}`, or vLLM's `{"object": "error",
    "message", "type", ...}`) keeps its message (bounded), type and code; anything else is
    logged and replaced by a generic error naming the request id."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(data, dict) and data.get("object") == "error":
        error = data  # vLLM's {"object": "error", "message": ..., "type": ..., "code": ...}
    if (400 <= status < 500 and isinstance(error, dict)
            and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)):
        kind, code = error.get("type"), error.get("code")
        return web.json_response({"error": {
            "message": error["message"][:_ENGINE_MESSAGE_CHARS],
            "type": str(kind)[:64],
            "param": None,
            "code": code if isinstance(code, int) or (isinstance(code, str) and len(code) <= 64)
            else None}}, status=status)
    log.warning("engine_bad_reply", request_id=request_id, role=role, instance=instance,
                status=status, body=text[:_LOGGED_BODY_CHARS])
    return HttpError(status if 400 <= status < 600 else 502,
                     f"{role} instance {instance} failed (HTTP {status}); request id "
                     f"{request_id}", "engine_error", "engine_error").response()


def _new_conversation(*, sibling: bool = False) -> str:
    return _SIBLING + uuid.uuid4().hex[:23] if sibling else "kvb-" + uuid.uuid4().hex[:24]


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


class Gateway:
    def __init__(self, config: GatewayConfig, router: AsyncRouterClient,
                 registry: AsyncRegistryClient | None, tenants: Tenants,
                 tracing: Tracing | None = None) -> None:
        self.config = config
        self.router = router
        self.registry = registry
        self.tenants = tenants
        self.tracing = tracing  # None: off (`kvbridge.tracing`)
        self.metrics = Metrics()
        self.session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # When each recent conversation's last turn ended (monotonic), most recent last.
        self._ended: OrderedDict[tuple[str, str], float] = OrderedDict()
        # (tenant, last history key of a turn served here) -> its conversation: a follow-up
        # that arrives before decode's grant over that turn lands still continues it.
        self._recent_keys: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._latest_key: dict[tuple[str, str], bytes] = {}
        # (tenant, conversation) a turn of this gateway is continuing now (`_claim`).
        self._continuing: set[tuple[str, str]] = set()

    # ---- the application --------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._endpoint("completions", self.completions))
        app.router.add_post("/v1/chat/completions",
                            self._endpoint("chat_completions", self.chat_completions))
        app.router.add_get("/v1/models", self._endpoint("models", self.models))
        app.router.add_post("/v1/conversations/{conversation_id}/keepalive",
                            self._endpoint("keepalive", self.keepalive))
        app.router.add_get("/v1/conversations/{conversation_id}",
                           self._endpoint("conversation", self.conversation))
        app.router.add_delete("/v1/conversations/{conversation_id}",
                              self._endpoint("release", self.release))
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        # Idle connections are dropped before the engines would close them: a request written
        # to a connection the engine is closing at that moment fails ("Can not write request
        # body"), and the turn then goes to another instance, or fails where there is none.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(resolver=EngineResolver(),
                                           keepalive_timeout=self.config.engine_keepalive_s),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s,
                                          connect=self.config.connect_timeout_s))

    async def _stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        await self.router.close()
        if self.registry is not None:
            await self.registry.close()

    def _endpoint(self, name: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            request_id = "req-" + uuid.uuid4().hex[:20]
            _REQUEST_ID.set(request_id)  # each request runs in its own task (context)
            _MODEL.set("")
            try:
                response = await handler(request)
            except HttpError as err:
                log.info("request_refused", endpoint=name, status=err.status, error=err.message,
                         request_id=request_id)
                response = err.response()
                if err.close:  # answer, then read no more of what the client sends
                    response.headers[REQUEST_ID_HEADER] = request_id
                    response.force_close()
                    await response.prepare(request)
                    await response.write_eof()
                    if request.transport is not None:
                        request.transport.close()
            except RecursionError:  # a body nested deeper than Python's recursion limit
                response = HttpError(400, "request body is nested too deeply").response()
            except web.HTTPException as err:  # aiohttp's own (e.g. body too large)
                response = HttpError(err.status, err.reason or "bad request").response()
            if not response.prepared:
                response.headers[REQUEST_ID_HEADER] = request_id
            self.metrics.requests.labels(name, str(response.status),
                                         self.metrics.model(_MODEL.get())).inc()
            return response

        return wrapped

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge as err:
            raise HttpError(413, f"request body larger than {self.config.max_body_bytes} "
                                 "bytes") from err
        except TimeoutError:
            raise HttpError(408, f"request body not received within "
                                 f"{self.config.body_timeout_s:g} s", close=True) from None
        try:
            body = json.loads(raw)
        except RecursionError:
            raise HttpError(400, "request body is not valid JSON: nested too deeply") from None
        except ValueError as err:  # bad JSON or UTF-8, an integer of too many digits
            raise HttpError(400, f"request body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "request body must be a JSON object")
        return body

    def _conversation(self, request: web.Request, body: dict[str, Any]) -> tuple[str, str]:
        """The conversation the request names, and where: (id, "body" | "header" |
        "session"), or ("", "none")."""
        value, source = body.pop("conversation_id", None), "body"
        if value is None or value == "":
            value, source = request.headers.get(CONVERSATION_HEADER), "header"
        if value is None or value == "":
            value, source = request.headers.get(SESSION_HEADER), "session"
        if value is None or value == "":
            return "", "none"
        if source == "session" and not _ID.fullmatch(value):
            # Another system's session header (spaces, a long token): named by its hash, not
            # refused.
            return "session-" + hashlib.blake2b(value.encode("utf-8", "surrogateescape"),
                                                digest_size=12).hexdigest(), source
        if not isinstance(value, str) or not _ID.fullmatch(value):
            raise HttpError(400, "conversation_id must be 1-256 printable ASCII characters "
                                 "without spaces", code="invalid_conversation_id")
        return value, source

    # ---- turns ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "/v1/chat/completions", chat=True)

    async def _turn(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        if self.tracing is None:
            return await self._serve_turn(request, path, chat, None)
        # The turn's span: the router's and the registry's spans, and the engines', join its
        # trace (or the client's, when the request carries a traceparent header).
        with self.tracing.server_span(f"POST {path}", request.headers, {
                "http.request.method": "POST", "url.path": path}) as span:
            try:
                response = await self._serve_turn(request, path, chat, span)
            except HttpError as err:
                self.tracing.http_status(span, err.status)
                raise
            except BaseException as exc:
                self.tracing.failed(span, type(exc).__name__)
                raise
            self.tracing.http_status(span, response.status)
            return response

    async def _serve_turn(self, request: web.Request, path: str, chat: bool,
                          span: Span | None) -> web.StreamResponse:
        tenant = self.tenants.tenant_of(request.headers.get("Authorization"))
        body = await self._json_body(request)
        conversation, source = self._conversation(request, body)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise HttpError(400, "model is required", code="missing_model")
        _MODEL.set(model)
        if "kv_transfer_params" in body:
            raise HttpError(400, "kv_transfer_params is set by the gateway, not by clients")
        check_turn_body(body, chat)
        turn = _Turn(tenant, conversation, model, _REQUEST_ID.get(), source=source)
        asked = request.headers.get(LOOKUP_HEADER, "").strip().lower()
        if asked not in ("", "off", "content"):
            raise HttpError(400, f"{LOOKUP_HEADER} must be 'off' or 'content'",
                            code="bad_conversation_lookup")
        if (not conversation and self.registry is not None and asked != "off"
                and self.config.conversation_lookup == "content"):
            turn.keys = history.request_keys(tenant, body, chat)
            if turn.keys is None:
                turn.source = "unrecognised"
            elif turn.keys:
                conversation = turn.conversation = self._recent_turn(turn)
        excluded: list[str] = []
        try:
            while True:
                turn.attempts += 1
                try:
                    response = await self._attempt(request, path, chat, body, turn, excluded)
                    # Only a whole answer leaves a lease that a follow-up can continue (a
                    # client too slow to read had decode's request aborted).
                    if turn.conversation and response.status == 200 and turn.answered:
                        self._turn_ended(tenant, turn.conversation)
                        if turn.keys:
                            self._remember_keys(tenant, turn.keys[-1], turn.conversation)
                    return response
                except _EngineDown as down:
                    if turn.attempts > self.config.retries:
                        log.warning("engine_failed", role=down.role, instance=down.instance_id,
                                    error=str(down), request_id=turn.request_id)
                        raise down.client_error(turn.request_id) from None
                    self.metrics.retries.labels(down.role, self.metrics.model(turn.model)).inc()
                    log.warning("engine_failed_retrying", role=down.role,
                                instance=down.instance_id, error=str(down), tenant=tenant,
                                conversation=conversation or None, request_id=turn.request_id)
                    excluded.append(down.instance_id)
        finally:
            self._release_claim(turn)
            self._log_turn(turn, path)
            if span is not None:
                span.set_attributes(turn.span_attributes())

    async def _attempt(self, request: web.Request, path: str, chat: bool, body: dict[str, Any],
                       turn: _Turn, excluded: list[str]) -> web.StreamResponse:
        routing = time.perf_counter()
        # Find the conversation by content: on the first attempt, and again on a retry of a
        # turn that found no conversation to continue (its own new id has no lease yet).
        lookup = bool(turn.keys) and (not turn.conversation
                                      or turn.source in ("branched", "new"))
        wait = (self._lease_wait(turn.tenant, turn.conversation)
                if turn.conversation and not lookup and turn.attempts == 1 else 0.0)
        try:
            route = await self.router.route(
                turn.tenant, "" if lookup else turn.conversation,
                estimate_prompt_tokens(body, chat), turn.model,
                excluded, pin_read=bool(turn.conversation) and self.config.pin_at_route,
                pin_ttl=self.config.pin_ttl_s,
                history_keys=(history.join(turn.keys[-_LOOKUP_KEYS:]) if lookup and turn.keys
                              else b""),
                lease_wait=wait, timeout=self.config.route_timeout_s + wait)
        except NoInstance as err:
            if not excluded and not await self._model_known(turn.model):
                raise HttpError(404, f"the model {turn.model!r} does not exist: no engine "
                                     "serves it (GET /v1/models lists those that do)",
                                "invalid_request_error", "model_not_found") from None
            raise HttpError(503, f"no engine available: {err.message}", "service_unavailable",
                            "no_instance") from None
        except InvalidArgument as err:
            raise HttpError(400, err.message) from None
        except KvbridgeError as err:
            raise HttpError(503, f"router unavailable: {err.message}", "service_unavailable",
                            "router_unavailable") from None
        routed, received = time.perf_counter(), monotonic()
        self.metrics.serves(turn.model)  # the router found an engine serving it
        turn.lease_wait_ms += seconds(route.lease_waited) * 1000
        turn.route_ms += (routed - routing) * 1000 - seconds(route.lease_waited) * 1000
        turn.prefill, turn.decode = route.prefill.instance_id, route.decode.instance_id
        turn.decode_reason = (router_pb.DecodeReason.Name(route.decode_reason)
                              .removeprefix("DECODE_REASON_").lower())
        if lookup:
            self._found(turn, route, retry=bool(turn.conversation))
        if (turn.conversation and self.registry is not None and turn.attempts == 1
                and not (route.HasField("read") and route.read.read.pin.pin_id)):
            # Keep the conversation's lease for this turn's answer. A pinned read has renewed
            # it already (a read is activity): no call then.
            self._in_background(self._renew(turn.tenant, turn.conversation))
        key: dict[str, dict[str, Any]] = (
            {CONVERSATION_KEY: {"tenant": turn.tenant, "conversation_id": turn.conversation}}
            if turn.conversation else {})

        # Prefill: compute (or read back) the prompt's KV, one token, no streaming.
        prefill_body = {k: v for k, v in body.items()
                        if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
        prefill_key = key
        if turn.conversation and route.HasField("read"):
            prefill_key = {CONVERSATION_KEY: {
                **key[CONVERSATION_KEY],
                READ_KEY: routed_read(route.read, received,
                                      gateway_releases=self.registry is not None)}}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, **prefill_key})
        start = time.perf_counter()
        url = route.prefill.http_url + path
        pin_id = route.read.read.pin.pin_id if route.HasField("read") else ""
        try:
            prefill = await self._to_engine(
                "prefill", turn.prefill, url,
                lambda headers: self._post_json(url, prefill_body, "prefill", turn, headers))
        except HttpError:
            # Prefill answered, but not with a JSON object: its request is over, and no read
            # runs under the pin any more.
            if pin_id and self.registry is not None:
                self._in_background(self._release_pin(pin_id))
            raise
        except _EngineDown as down:
            # An engine that never got the request (no connection) reads nothing under its
            # pin: give it back now rather than hold decode's blocks until it runs out. One
            # that may have it (connection lost mid-request, a timeout, a 5xx) may still have
            # a read in flight under the pin: the engine releases it once that read is over
            # (or the pin runs out), never the gateway, lest decode free blocks being read.
            if down.never_sent and pin_id and self.registry is not None:
                self._in_background(self._release_pin(pin_id))
            raise
        turn.prefill_ms = (time.perf_counter() - start) * 1000
        self.metrics.prefill.labels(self.metrics.model(turn.model)).observe(
            turn.prefill_ms / 1000)
        params = prefill.get("kv_transfer_params") if isinstance(prefill, dict) else None
        if pin_id and self.registry is not None and (
                isinstance(prefill, web.Response) or not isinstance(params, dict)
                or params.pop(PIN_LEFT, None) is True):
            # No read runs under the pin any more: prefill rejected the request (a 4xx, before
            # scheduling it), or finished it (a read lands before the compute that needs it)
            # and either left the pin to us, having decided before any read not to read, or
            # sent no kv_transfer_params to say so (vLLM omits them when the first token
            # ends the answer). Released twice is harmless.
            self._in_background(self._release_pin(pin_id))
        if isinstance(prefill, web.Response):  # its error, as the client may see it
            prefill.headers.update(turn.headers())
            return prefill
        if not isinstance(params, dict):
            raise HttpError(502, f"prefill instance {turn.prefill} returned no "
                                 "kv_transfer_params: is it a kvbridge/NIXL kv_producer?",
                            "engine_error", "bad_prefill_response")
        # Decode reads this turn's KV from the engine the params name: only the routed
        # prefill's own (an engine's word must not send decode to another engine's KV).
        engine = route.prefill.engine_id
        if engine and params.get("remote_engine_id") != engine:
            log.warning("engine_bad_reply", request_id=turn.request_id, role="prefill",
                        instance=turn.prefill, expected_engine=engine,
                        named_engine=str(params.get("remote_engine_id"))[:_LOGGED_BODY_CHARS])
            raise HttpError(502, f"prefill instance {turn.prefill} named another engine's KV; "
                                 f"request id {turn.request_id}", "engine_error",
                            "bad_prefill_response")
        turn.outcome = {k: params.pop(k) for k in _OUTCOME_FIELDS if k in params}
        read_epoch = route.read.read.lease.epoch if route.HasField("read") else 0
        if (params.pop(LEASE_WHOLE, None) is False and turn.source in ("continued", "recent")
                and turn.conversation.startswith(_SIBLING) and read_epoch == 1):
            # The prompt holds only part of a sibling's first lease (verified by hash): the
            # other answer to this history (a regenerated one), which this turn does not
            # continue. It branches and leaves the lease to its own conversation. (A lease of
            # a conversation's own held only in part, as when the client strips the reasoning
            # from an answer, is continued and superseded: it is never read whole again.)
            self._release_claim(turn)
            turn.source, turn.conversation = "branched", _new_conversation()
            key = {CONVERSATION_KEY: {"tenant": turn.tenant,
                                      "conversation_id": turn.conversation}}

        # Decode: read prefill's KV and generate, streamed back as it comes; its lease over
        # this turn is granted with the history keys that later turns find it by.
        if turn.keys and key:
            key = {CONVERSATION_KEY: {**key[CONVERSATION_KEY], "history_keys": base64.b64encode(
                history.grant_keys(turn.keys)).decode("ascii")}}
        decode_body = dict(body, kv_transfer_params={**params, **key})
        url = route.decode.http_url + path
        return await self._to_engine(
            "decode", turn.decode, url,
            lambda headers: self._decode(request, url, body, decode_body, turn, headers))

    async def _decode(self, request: web.Request, url: str, body: dict[str, Any],
                      decode_body: dict[str, Any], turn: _Turn, headers: dict[str, str] | None
                      ) -> web.StreamResponse:
        """Send the decode request and pass its answer on (streamed as it comes)."""
        assert self.session is not None
        sent = time.perf_counter()
        try:
            # Never to another address than the one routed to: an engine's redirect is an error.
            upstream = await self.session.post(url, json=decode_body, headers=headers,
                                               allow_redirects=False)
        except (TimeoutError, aiohttp.ClientConnectionError) as err:
            raise _EngineDown("decode", turn.decode, str(err) or type(err).__name__) from None
        turn.decode_headers_ms = (time.perf_counter() - sent) * 1000
        async with upstream:
            content_type = upstream.headers.get("Content-Type", "")
            headers = {"Content-Type": content_type or "application/json", **turn.headers()}
            streamed = bool(body.get("stream")) and upstream.status < 300
            if not streamed:
                status = upstream.status
                try:
                    data = await _read_reply(upstream)
                except _TooLarge as err:  # an engine at fault: the generic answer below
                    data, status = str(err).encode(), 502
                turn.ttft_ms = (time.perf_counter() - turn.started) * 1000
                text = data.decode("utf-8", "replace")
                if status >= 300 or not _json_object(text):
                    error = engine_error(status if status >= 400 else 502, text, "decode",
                                         turn.decode, turn.request_id)
                    error.headers.update(turn.headers())
                    return error
                turn.answered = True
                return web.Response(body=data, status=status, headers=headers)
            if not content_type.startswith("text/event-stream"):
                text = (await upstream.content.read(_LOGGED_BODY_CHARS)).decode("utf-8",
                                                                                "replace")
                log.warning("engine_bad_reply", request_id=turn.request_id, role="decode",
                            instance=turn.decode, status=upstream.status,
                            content_type=content_type[:100], body=text[:_LOGGED_BODY_CHARS])
                error = HttpError(502, f"decode instance {turn.decode} answered a stream "
                                  f"request without an event stream; request id "
                                  f"{turn.request_id}", "engine_error",
                                  "bad_engine_response").response()
                error.headers.update(turn.headers())
                return error
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            first = True
            async for chunk in upstream.content.iter_any():
                if first:
                    turn.ttft_ms = (time.perf_counter() - turn.started) * 1000
                    first = False
                try:  # a client that stops reading must not hold a slot and decode for ever
                    async with asyncio.timeout(self.config.body_timeout_s):
                        await response.write(chunk)
                except TimeoutError:
                    log.warning("client_too_slow", request_id=turn.request_id,
                                waited_s=self.config.body_timeout_s)
                    if request.transport is not None:
                        request.transport.close()
                    return response
            await response.write_eof()
            turn.answered = True
            return response

    async def _to_engine(self, role: str, instance: str, url: str,
                         send: Callable[[dict[str, str] | None], Awaitable[_T]]) -> _T:
        """`send(headers)`: a request to an engine. With tracing on, in a client span of its
        own whose context `headers` carries (`traceparent`: vLLM's spans join the turn's
        trace); off, `headers` is None."""
        if self.tracing is None:
            return await send(None)
        span, headers = self.tracing.client_span(role, {
            "http.request.method": "POST", "url.full": url, "kvbridge.role": role,
            "kvbridge.instance": instance})
        try:
            result = await send(headers)
            if isinstance(result, web.StreamResponse):
                self.tracing.http_status(span, result.status)
            return result
        except _EngineDown as down:
            self.tracing.failed(span, str(down))
            raise
        except BaseException as exc:
            self.tracing.failed(span, type(exc).__name__)
            raise
        finally:
            span.end()

    async def _post_json(self, url: str, body: dict[str, Any], role: str, turn: _Turn,
                         headers: dict[str, str] | None = None
                         ) -> dict[str, Any] | web.Response:
        """POST a prefill request: its JSON object, or for a 4xx the client's answer
        (`engine_error`). A request the engine cannot take or finish (connection refused or
        lost, as when the engine dies mid-request; a timeout; a 5xx answer) raises
        `_EngineDown`: nothing has reached the client yet, so another instance may serve it."""
        assert self.session is not None
        instance = turn.prefill
        try:
            async with self.session.post(url, json=body, headers=headers,
                                         allow_redirects=False) as resp:
                text = (await _read_reply(resp)).decode("utf-8", "replace")
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                _TooLarge) as err:
            raise _EngineDown(role, instance, str(err) or type(err).__name__,
                              never_sent=isinstance(err, aiohttp.ClientConnectorError)
                              ) from None
        if 300 <= resp.status < 400:  # never followed: it could point anywhere
            raise _EngineDown(role, instance, f"HTTP {resp.status} redirect to "
                              f"{resp.headers.get('Location', '')[:200]!r}", resp.status)
        if resp.status >= 500:
            raise _EngineDown(role, instance, f"HTTP {resp.status}: "
                              f"{text[:_LOGGED_BODY_CHARS]!r}", resp.status)
        if resp.status >= 400:
            return engine_error(resp.status, text, role, instance, turn.request_id)
        data = _json_object(text)
        if data is None:
            log.warning("engine_bad_reply", request_id=turn.request_id, role=role,
                        instance=instance, status=resp.status, body=text[:_LOGGED_BODY_CHARS])
            raise HttpError(502, f"{role} instance {instance} answered HTTP {resp.status} "
                                 f"without a JSON object; request id {turn.request_id}",
                            "engine_error", "bad_engine_response")
        return data

    def _log_turn(self, turn: _Turn, path: str) -> None:
        total_ms = (time.perf_counter() - turn.started) * 1000
        reused = int(turn.outcome.get("kvbridge_reused_tokens", 0))
        recomputed = int(turn.outcome.get("kvbridge_recomputed_tokens", 0))
        model = self.metrics.model(turn.model)
        self.metrics.found.labels(turn.source, model).inc()
        if turn.ttft_ms:
            self.metrics.ttft.labels(model).observe(turn.ttft_ms / 1000)
            self.metrics.reused.labels(model).inc(reused)
            self.metrics.recomputed.labels(model).inc(recomputed)
        log.info("turn", path=path, request_id=turn.request_id, tenant=turn.tenant,
                 conversation=turn.conversation or None, conversation_source=turn.source,
                 history_matched=(f"{turn.keys_matched}/{len(turn.keys)}"
                                  if turn.keys is not None else None),
                 model=turn.model, prefill=turn.prefill or None, decode=turn.decode or None,
                 decode_reason=turn.decode_reason or None,
                 decision=turn.outcome.get("kvbridge_decision"),
                 lease_wait_ms=round(turn.lease_wait_ms, 1), route_ms=round(turn.route_ms, 1),
                 prefill_ms=round(turn.prefill_ms, 1),
                 decode_headers_ms=round(turn.decode_headers_ms, 1),
                 ttft_ms=round(turn.ttft_ms, 1),
                 total_ms=round(total_ms, 1), reused_tokens=reused,
                 recomputed_tokens=recomputed,
                 lookup_ms=turn.outcome.get("kvbridge_lookup_ms"),
                 read_source=turn.outcome.get("kvbridge_read_source"),
                 transfer_ms=turn.outcome.get("kvbridge_transfer_ms"),
                 attempts=turn.attempts)

    # ---- conversations ----------------------------------------------------------------------

    def _recent_turn(self, turn: _Turn) -> str:
        """The conversation whose latest turn this gateway served in the last
        `_RECENT_TURN_S` and that this request continues (it has that turn's whole history,
        and more), else "". Only for a follow-up that may beat decode's grant over that turn:
        later, the registry's answer (which every gateway shares) decides."""
        keys = turn.keys or []
        now = time.monotonic()
        for i in range(len(keys) - 2, -1, -1):  # the request's own last key cannot continue
            conversation = self._recent_keys.get((turn.tenant, keys[i]))
            if conversation is None:
                continue
            ended = self._ended.get((turn.tenant, conversation))
            if (ended is not None and now - ended <= _RECENT_TURN_S
                    and self._claim(turn, conversation)):
                turn.source, turn.keys_matched = "recent", i + 1
                return conversation
            return ""
        return ""

    def _claim(self, turn: _Turn, conversation: str) -> bool:
        """Take `conversation` for this turn's continuation, unless another turn of this
        gateway is continuing it right now: then this one branches (concurrent continuations,
        as an agent's parallel calls, would otherwise supersede each other's leases)."""
        key = (turn.tenant, conversation)
        if key in self._continuing:
            return False
        self._continuing.add(key)
        turn.claimed = True
        return True

    def _release_claim(self, turn: _Turn) -> None:
        if turn.claimed:
            self._continuing.discard((turn.tenant, turn.conversation))
            turn.claimed = False

    def _remember_keys(self, tenant: str, key: bytes, conversation: str) -> None:
        """`key` is now the last key of the conversation's latest turn (its previous one no
        longer continues it: a request with that history branches)."""
        previous = self._latest_key.pop((tenant, conversation), None)
        if previous is not None and self._recent_keys.get((tenant, previous)) == conversation:
            del self._recent_keys[(tenant, previous)]
        replaced = self._recent_keys.get((tenant, key))
        if replaced is not None and replaced != conversation:  # another ended on this history
            self._latest_key.pop((tenant, replaced), None)
        self._latest_key[(tenant, conversation)] = key
        self._recent_keys[(tenant, key)] = conversation
        self._recent_keys.move_to_end((tenant, key))
        while len(self._recent_keys) > _RECENT_CONVERSATIONS:
            (old_tenant, _), old = self._recent_keys.popitem(last=False)
            self._latest_key.pop((old_tenant, old), None)

    def _found(self, turn: _Turn, route: router_pb.RouteResponse, retry: bool = False) -> None:
        """Name the turn's conversation from what the lookup by content found: a request that
        has a lease's whole history and more continues it (its grant supersedes that lease,
        as the next turn of a named conversation does) unless another turn of this gateway is
        continuing it now; one that shares only part of it branches (a new conversation,
        reading the shared part, leaving the lease to the others); nothing found: a new
        conversation. A retry keeps the id its first attempt chose."""
        read = route.read.read if route.HasField("read") else None
        match = route.read.match if route.HasField("read") else None
        found = read.lease.conversation_id if read is not None else ""
        source = "new"
        if found and match is not None and match.keys_matched:
            sent = min(len(turn.keys or ()), _LOOKUP_KEYS)
            turn.keys_matched = len(turn.keys or ()) - sent + match.keys_matched
            source = "branched"
            # This gateway's own latest turn of the conversation, if the request lacks it,
            # is a newer one than the lease found (its grant not landed yet): a sibling.
            latest = self._latest_key.get((turn.tenant, found))
            if (not retry and match.whole and turn.keys_matched < len(turn.keys or ())
                    and (latest is None or latest in (turn.keys or ()))
                    and self._claim(turn, found)):
                turn.source, turn.conversation = "continued", found
                return
        turn.source = source
        if not retry:
            # Another answer to a lease's whole history (regenerate, parallel samples): a
            # sibling, whose lease a later turn of the other answer's must not supersede.
            sibling = (source == "branched" and match is not None and match.whole
                       and turn.keys_matched >= len(turn.keys or ()))
            turn.conversation = _new_conversation(sibling=sibling)

    def _turn_ended(self, tenant: str, conversation: str) -> None:
        key = (tenant, conversation)
        self._ended[key] = time.monotonic()
        self._ended.move_to_end(key)
        while len(self._ended) > _RECENT_CONVERSATIONS:
            self._ended.popitem(last=False)

    def _lease_wait(self, tenant: str, conversation: str) -> float:
        """How long the router may wait for the conversation's lease: a follow-up right after
        a turn (a tool result, say) may arrive before decode's background grant over that turn
        lands, and without a lease it would reuse nothing. Only then, and only while the
        conversation has no lease at all (an older lease still covers a prefix and is read at
        once): the router pins first and waits only on a miss for want of a lease."""
        wait = self.config.lease_wait_s
        ended = self._ended.get((tenant, conversation))
        if not wait or ended is None:
            return 0.0
        return max(0.0, ended + wait - time.monotonic())

    def _in_background(self, coro: Awaitable[Any]) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_pin(self, pin_id: str) -> None:
        assert self.registry is not None
        try:
            await self.registry.release_read(pin_id, timeout=2.0)
        except KvbridgeError as err:  # the pin runs out on its own
            log.debug("release_read_failed", pin_id=pin_id, error=str(err))

    async def _renew(self, tenant: str, conversation: str) -> int:
        assert self.registry is not None
        try:
            resp = await self.registry.renew_leases(conversations=[(tenant, conversation)],
                                                    timeout=1.0)
        except KvbridgeError as err:
            log.debug("renew_failed", tenant=tenant, conversation=conversation, error=str(err))
            return 0
        return int(resp.renewed_count)

    def _conversation_path(self, request: web.Request) -> tuple[str, str]:
        tenant = self.tenants.tenant_of(request.headers.get("Authorization"))
        conversation = request.match_info["conversation_id"]
        if not _ID.fullmatch(conversation):
            raise HttpError(400, "conversation id must be 1-256 printable ASCII characters "
                                 "without spaces", code="invalid_conversation_id")
        if self.registry is None:
            raise HttpError(501, "this gateway has no registry (--registry is empty)",
                            "not_implemented")
        return tenant, conversation

    async def keepalive(self, request: web.Request) -> web.StreamResponse:
        """Keep a paused conversation's KV (e.g. during a long tool call): renews its lease."""
        tenant, conversation = self._conversation_path(request)
        try:
            resp = await self.registry.renew_leases(  # type: ignore[union-attr]
                conversations=[(tenant, conversation)], timeout=2.0)
        except KvbridgeError as err:
            raise HttpError(503, f"registry unavailable: {err.message}", "service_unavailable",
                            "registry_unavailable") from None
        if not resp.renewed_count:
            raise HttpError(404, f"conversation {conversation!r} holds no KV (no live lease)",
                            "not_found_error", "no_lease")
        left = [r.expires_in.seconds + r.expires_in.nanos / 1e9
                for r in resp.results if r.renewed]
        return web.json_response({"conversation_id": conversation,
                                  "renewed": int(resp.renewed_count),
                                  "expires_in_s": round(max(left), 3) if left else None})

    async def conversation(self, request: web.Request) -> web.StreamResponse:
        """The conversation's KV: its lease (state, holder, tokens, time left), if any."""
        tenant, conversation = self._conversation_path(request)
        assert self.registry is not None
        try:
            page = await self.registry.list_leases(tenant=tenant, conversation_id=conversation,
                                                   include_inactive=True, timeout=2.0)
        except KvbridgeError as err:
            raise HttpError(503, f"registry unavailable: {err.message}", "service_unavailable",
                            "registry_unavailable") from None
        leases = sorted(page.leases, key=lambda lease: lease.epoch)
        if not leases:
            raise HttpError(404, f"conversation {conversation!r} holds no KV (no lease)",
                            "not_found_error", "no_lease")
        lease = leases[-1]
        return web.json_response({
            "conversation_id": conversation,
            "state": reg_pb.LeaseState.Name(lease.state).removeprefix("LEASE_STATE_").lower(),
            "holder": lease.holder_id, "epoch": lease.epoch, "tokens": lease.token_count,
            "pins": lease.pin_count,
            "expires_in_s": round(lease.expires_in.seconds + lease.expires_in.nanos / 1e9, 3)})

    async def release(self, request: web.Request) -> web.StreamResponse:
        """The conversation ended: revoke its lease so decode frees the KV now."""
        tenant, conversation = self._conversation_path(request)
        assert self.registry is not None
        released = 0
        try:
            page = await self.registry.list_leases(tenant=tenant, conversation_id=conversation,
                                                   timeout=2.0)
            for lease in page.leases:
                if lease.state == reg_pb.LEASE_STATE_ACTIVE:
                    await self.registry.revoke_lease(lease.lease_id, "conversation_ended",
                                                     timeout=2.0)
                    released += 1
        except KvbridgeError as err:
            raise HttpError(503, f"registry unavailable: {err.message}", "service_unavailable",
                            "registry_unavailable") from None
        log.info("conversation_released", tenant=tenant, conversation=conversation,
                 leases=released)
        return web.json_response({"conversation_id": conversation, "released": released})

    # ---- the rest ---------------------------------------------------------------------------

    async def _model_known(self, model: str) -> bool:
        """Whether any instance (live or not yet expired, any role) serves `model`; True when
        the router cannot say, so that an outage is not reported as a missing model."""
        try:
            return bool(await self.router.list_instances(
                model=model, timeout=self.config.route_timeout_s))
        except KvbridgeError:
            return True

    async def models(self, request: web.Request) -> web.StreamResponse:
        self.tenants.tenant_of(request.headers.get("Authorization"))
        try:
            instances = await self.router.list_instances(timeout=self.config.route_timeout_s)
        except KvbridgeError as err:
            raise HttpError(503, f"router unavailable: {err.message}", "service_unavailable",
                            "router_unavailable") from None
        names = sorted({i.model for i in instances})
        for name in names:
            self.metrics.serves(name)
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvbridge"}
            for name in names]})

    async def health(self, request: web.Request) -> web.StreamResponse:
        try:
            instances = await self.router.list_instances(timeout=self.config.route_timeout_s)
        except KvbridgeError as err:
            return web.json_response({"status": "unavailable",
                                      "error": f"router: {err.message}"}, status=503)
        roles = {"prefill": 0, "decode": 0}
        for i in instances:
            roles["prefill" if i.role == router_pb.ROLE_PREFILL else "decode"] += 1
        ok = roles["prefill"] > 0 and roles["decode"] > 0
        return web.json_response({"status": "ok" if ok else "no_engines", **roles},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
