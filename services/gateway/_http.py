"""The gateway's HTTP listener: optional TLS, and limits against slow or piled-up clients.

aiohttp waits for a request's headers as long as the client likes and accepts every connection;
a few thousand clients that send half a header each (slowloris) then hold the gateway's sockets
and memory. Here every connection is wrapped (`ConnectionGuard`): past `max_connections` a new
one gets a 503 and is closed; a connection must deliver a request's headers within
`header_timeout_s` of connecting (or of its first byte after the previous request), else it is
closed. A request's body has its own deadline, applied where the body is read (`_app`). Idle
kept-alive connections close after aiohttp's `keepalive_timeout`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver

from kvbridge.services.router._urls import always_refused

if TYPE_CHECKING:
    from aiohttp.abc import ResolveResult

log = structlog.get_logger("kvbridge.gateway")

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: 108\r\n\r\n"
         b'{"error": {"message": "too many connections", "type": "service_unavailable", '
         b'"param": null, "code": "busy"}}')


class ConnectionGuard:
    """Counts open client connections and closes those that are too slow to send headers."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0
        self.timed_out = 0
        self._connections: dict[object, _GuardedConnection] = {}  # aiohttp's handler -> ours

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for `loop.create_server` wrapping aiohttp's (`runner.server`)."""
        return lambda: _GuardedConnection(self, inner)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """Marks a connection busy while a request runs: its headers are in."""
        connection = self._connections.get(request.protocol)
        if connection is not None:
            connection.request_started()
        try:
            response: web.StreamResponse = await handler(request)
            return response
        finally:
            if connection is not None:
                connection.request_finished()


class _GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the guard's admission and header clock."""

    def __init__(self, guard: ConnectionGuard, factory: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._factory = factory
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        guard = self._guard
        if guard.open >= guard.max_connections:
            guard.refused += 1
            if guard.refused == 1 or guard.refused % 1000 == 0:  # one line, not one per client
                log.warning("connections_refused", open=guard.open, refused=guard.refused,
                            max_connections=guard.max_connections)
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(_BUSY)
            transport.close()
            return
        guard.open += 1
        self._inner = self._factory()
        guard._connections[self._inner] = self
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if not self._busy and self._timer is None:  # the first byte of the next request
            self._arm()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        inner, self._inner = self._inner, None
        if inner is not None:
            self._guard.open -= 1
            self._guard._connections.pop(inner, None)
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def request_started(self) -> None:
        self._busy = True
        self._cancel()

    def request_finished(self) -> None:
        self._busy = False

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.header_timeout_s, self._headers_late)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        self._guard.timed_out += 1
        if self._guard.timed_out == 1 or self._guard.timed_out % 1000 == 0:
            log.warning("slow_clients_closed", what="request headers", count=self._guard.timed_out,
                        header_timeout_s=self._guard.header_timeout_s)
        if self._transport is not None:
            self._transport.close()


class EngineResolver(AbstractResolver):
    """Name resolution for the gateway's calls to engines: never an address that the router's
    engine URL policy always refuses (link-local/cloud metadata, unspecified, multicast), even
    when a name resolved elsewhere as the engine registered (DNS rebinding). IP-literal URLs
    are not resolved: the router has checked them for good."""

    def __init__(self, inner: AbstractResolver | None = None) -> None:
        self._inner = inner or DefaultResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        kept = [r for r in results if not always_refused(ipaddress.ip_address(r["host"]))]
        if not kept:
            log.warning("engine_address_refused", host=host[:64],
                        addresses=[r["host"] for r in results][:8])
            raise OSError(f"{host[:64]} resolves only to refused (link-local, metadata, "
                          "unspecified or multicast) addresses")
        return kept

    async def close(self) -> None:
        await self._inner.close()


def server_tls(cert: str, key: str) -> ssl.SSLContext | None:
    """The TLS context of the gateway's HTTP side, None without a certificate."""
    if not cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context
