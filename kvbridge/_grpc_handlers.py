"""Registering a grpc.aio servicer so that a request that does not parse is a clear
INVALID_ARGUMENT (with an ErrorInfo), not gRPC's UNKNOWN and a traceback in the server's log.

`add_servicer(server, servicer, pb_module, "RegistryService")` replaces the generated
`add_RegistryServiceServicer_to_server`: the same methods, with the request bytes parsed inside
the handler instead of by gRPC. `add_health_and_reflection` adds the standard gRPC health and
reflection services.

Every handler goes to the server as a generic handler only, never as a "registered method":
grpc.aio's server keeps one pending request per registered method and, for every call it
accepts, waits on all of them (`asyncio.wait`), so each registered method adds to the CPU of
every RPC (with the registry's 14 methods, health and reflection that wait cost about as much
as the AcquireRead handler itself). A generic handler is one dict lookup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import ModuleType
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvbridge import auth
from kvbridge._grpc_status import to_status
from kvbridge.errors import InvalidArgument, KvbridgeError

log = structlog.get_logger("kvbridge.auth")

# `rpc_denied` lines a second, per reason, that a service writes at most (`_DenialLog`).
DENIED_LOG_PER_SECOND = 10
_MAX_LOGGED = 512  # most characters of an error message a log line repeats
_now = time.monotonic  # the denial log's clock (a test's to replace)

Ctx = grpc.aio.ServicerContext[Any, Any]

# What kvbridge's servers allow of a client's keepalive pings (`kvbridge.clients._base`
# pings every 30 s while a call, such as a watch stream, is open): gRPC's default refuses
# pings more often than every 5 minutes on a connection that sends no data, and closes it.
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def _identity(raw: bytes) -> bytes:
    return raw


async def _parse(raw: bytes, cls: Any, context: Ctx) -> Any:
    try:
        return cls.FromString(raw)
    except DecodeError as err:
        await _refuse(cls, err, context)
        raise  # unreachable: _refuse raises


async def _refuse(cls: Any, err: DecodeError, context: Ctx) -> None:
    error = InvalidArgument("request", f"not a valid {cls.DESCRIPTOR.full_name}: {err}")
    await context.abort_with_status(to_status(error))


def _unary(fn: Callable[[Any, Ctx], Awaitable[Any]], cls: Any
           ) -> Callable[[bytes, Ctx], Awaitable[Any]]:
    parse = cls.FromString

    async def handle(raw: bytes, context: Ctx) -> Any:
        # Parsed here rather than in `_parse`: one coroutine less on every unary call.
        try:
            request = parse(raw)
        except DecodeError as err:
            await _refuse(cls, err, context)
            raise  # unreachable: _refuse raises
        return await fn(request, context)

    return handle


def _streaming(fn: Callable[[Any, Ctx], AsyncIterator[Any]], cls: Any
               ) -> Callable[[bytes, Ctx], AsyncIterator[Any]]:
    async def handle(raw: bytes, context: Ctx) -> AsyncIterator[Any]:
        async for item in fn(await _parse(raw, cls, context), context):
            yield item

    return handle


class _DenialLog:
    """The `rpc_denied` log line, at most `per_second` lines a second for each reason: an
    unauthenticated flood must not flood the log. The next line of a reason after some were
    held back says how many (`suppressed`)."""

    def __init__(self, per_second: int = DENIED_LOG_PER_SECOND) -> None:
        self.per_second = per_second
        self._windows: dict[str, _Window] = {}  # by reason: a handful of them

    def write(self, method: str, err: KvbridgeError, caller: str, peer: str) -> None:
        now = _now()
        window = self._windows.get(err.reason)
        if window is None:
            window = self._windows[err.reason] = _Window(now)
        elif now - window.start >= 1.0:
            window.start, window.lines = now, 0
        if window.lines >= self.per_second:
            window.held += 1
            return
        window.lines += 1
        held, window.held = window.held, 0
        log.info("rpc_denied", method=method, reason=err.reason, error=_bounded(err.message),
                 caller=caller or None, peer=peer, **({"suppressed": held} if held else {}))


@dataclasses.dataclass
class _Window:
    start: float  # this second's start
    lines: int = 0  # written in it
    held: int = 0  # held back since the last line written


def _bounded(message: str) -> str:
    # Messages are bounded where they are made (`auth.shown`); this is the last line of defence.
    return message if len(message) <= _MAX_LOGGED else message[:_MAX_LOGGED] + "..."


class _Guard:
    """Authentication and the method's rule, run before the servicer sees the request; the
    caller is then `kvbridge.auth.current()` for checks that need stored state."""

    def __init__(self, authenticator: auth.Authenticator, rule: auth.Rule, method: str,
                 denials: _DenialLog, max_id_length: int) -> None:
        self.authenticator, self.rule, self.method = authenticator, rule, method
        self.denials, self.max_id_length = denials, max_id_length

    async def authenticate(self, context: Ctx) -> auth.Principal:
        """First, before the request is even parsed: who is calling."""
        try:
            return self.authenticator.authenticate(context.invocation_metadata())
        except KvbridgeError as err:
            await self._deny(err, context)
            raise  # unreachable: abort_with_status raises

    async def authorize(self, principal: auth.Principal, request: Any, context: Ctx) -> None:
        try:
            self.rule.apply(self.method, principal, request, self.max_id_length)
        except KvbridgeError as err:
            await self._deny(err, context, principal.name)

    async def _deny(self, err: KvbridgeError, context: Ctx, caller: str = "") -> None:
        self.denials.write(self.method, err, caller, context.peer())
        await context.abort_with_status(to_status(err))


def _guarded_unary(fn: Callable[[Any, Ctx], Awaitable[Any]], cls: Any, guard: _Guard
                   ) -> Callable[[bytes, Ctx], Awaitable[Any]]:
    async def handle(raw: bytes, context: Ctx) -> Any:
        principal = await guard.authenticate(context)
        request = await _parse(raw, cls, context)
        await guard.authorize(principal, request, context)
        token = auth.set_current(principal)
        try:
            return await fn(request, context)
        finally:
            with contextlib.suppress(ValueError):  # another context (should not happen)
                auth.reset_current(token)

    return handle


def _guarded_streaming(fn: Callable[[Any, Ctx], AsyncIterator[Any]], cls: Any, guard: _Guard
                       ) -> Callable[[bytes, Ctx], AsyncIterator[Any]]:
    async def handle(raw: bytes, context: Ctx) -> AsyncIterator[Any]:
        principal = await guard.authenticate(context)
        request = await _parse(raw, cls, context)
        await guard.authorize(principal, request, context)
        auth.set_current(principal)  # this stream's own context
        async for item in fn(request, context):
            yield item

    return handle


def add_servicer(server: grpc.aio.Server, servicer: Any, messages: ModuleType,
                 service_name: str, *, authenticator: auth.Authenticator | None = None,
                 rules: Mapping[str, auth.Rule] | None = None,
                 max_id_length: int = auth.MAX_ID_LENGTH) -> None:
    """Register every method of `service_name` (from the `_pb2` module `messages`) on
    `server`, served by the same-named methods of `servicer`.

    With an enabled `authenticator`, every call is authenticated and checked against its
    method's entry in `rules` (which must name every method) before the servicer runs; a
    tenant or holder id a rule checks must be an id of at most `max_id_length` characters
    (else INVALID_ARGUMENT, before any access decision)."""
    guarded = authenticator is not None and authenticator.enabled
    denials = _DenialLog()
    service = messages.DESCRIPTOR.services_by_name[service_name]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client streaming is not supported here")
        request_cls = _message_class(messages, method.input_type)
        response_cls = _message_class(messages, method.output_type)
        fn = getattr(servicer, method.name)
        if guarded:
            assert authenticator is not None
            if rules is None or method.name not in rules:
                raise ValueError(f"{method.full_name}: no access rule")
            guard = _Guard(authenticator, rules[method.name], method.name, denials,
                           max_id_length)
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    _guarded_streaming(fn, request_cls, guard), _identity,
                    response_cls.SerializeToString)
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    _guarded_unary(fn, request_cls, guard), _identity,
                    response_cls.SerializeToString)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(fn, request_cls), _identity, response_cls.SerializeToString)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(fn, request_cls), _identity, response_cls.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))


class _GenericOnly:
    """A server as the generated `add_*Servicer_to_server` functions see it: they register
    their handlers both ways; this keeps the generic ones only (see the module docstring)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, name: str, handlers: Any) -> None:
        pass


def add_health_and_reflection(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                              service_names: tuple[str, ...]) -> None:
    """Serve gRPC health (`health_servicer`) and server reflection listing `service_names`."""
    generic = _GenericOnly(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, generic)  # type: ignore[arg-type]
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(  # type: ignore[no-untyped-call]
        reflection.aio.ReflectionServicer(service_names), generic)


def _message_class(messages: ModuleType, descriptor: Any) -> Any:
    if descriptor.file is messages.DESCRIPTOR:
        return getattr(messages, descriptor.name)
    # A message of another file (e.g. the router serving the registry's AcquireRead).
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)
