"""The router's gRPC server: RouterService, health, reflection, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kvbridge import aio, auth, grpc_env, logs, tracing
from kvbridge._grpc_handlers import (
    SERVER_KEEPALIVE_OPTIONS,
    add_health_and_reflection,
    add_servicer,
)
from kvbridge.clients._registry import AsyncRegistryClient
from kvbridge.clock import Clock, SystemClock
from kvbridge.router.v1 import router_pb2 as pb
from kvbridge.services.registry._server import split_hostport
from kvbridge.services.router._access import RULES
from kvbridge.services.router._config import RouterConfig
from kvbridge.services.router._policy import InstanceTable
from kvbridge.services.router._servicer import RouterMetrics, RouterServicer

if TYPE_CHECKING:
    from kvbridge._otel import Tracing

log = structlog.get_logger("kvbridge.router")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RouterService"].full_name
_EXPIRY_INTERVAL = 0.5


@dataclass
class RouterServer:
    config: RouterConfig
    table: InstanceTable
    metrics: RouterMetrics
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    registry: AsyncRegistryClient | None
    servicer: RouterServicer
    metrics_port: int | None = None
    tracing: Tracing | None = None  # None: off
    _expiry: asyncio.Task[None] | None = None
    _http: object | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        host, _ = split_hostport(self.config.listen)
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def start(self) -> None:
        if self.config.metrics_listen:
            host, port = split_hostport(self.config.metrics_listen)
            httpd, _thread = start_http_server(port, host, registry=self.metrics.registry)
            self._http = httpd
            self.metrics_port = httpd.server_port
        await self.server.start()
        self._expiry = asyncio.create_task(self._run_expiry(), name="router-expiry")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("router_started", listen=self.address, registry=self.config.registry or None,
                 metrics_port=self.metrics_port,
                 **grpc_env.describe(log),
                 traces=tracing.endpoint(self.config.otlp_traces_endpoint)
                 if self.tracing is not None else "off",
                 engine_urls=self.servicer.urls.describe(),
                 **auth.describe(self.config.token_table(), self.config.tls_files()))
        host, _ = split_hostport(self.config.listen)
        auth.warn_if_exposed(log, "router", self.config.listen, host,
                             self.config.token_table(), self.config.tls_files())

    async def _run_expiry(self) -> None:
        while True:  # instances are also expired lazily on every call; this logs losses soon
            self.table.expire()
            await asyncio.sleep(_EXPIRY_INTERVAL)

    async def stop(self, grace: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.shutdown_grace_s if grace is None else grace)
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        if self.registry is not None:
            await self.registry.close()
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]
            self._http.server_close()  # type: ignore[attr-defined]
        if self.tracing is not None:
            await self.tracing.close()  # exports what is left
        log.info("router_stopped")


async def create_server(config: RouterConfig, *, clock: Clock | None = None) -> RouterServer:
    """Build a router bound to `config.listen` (not started). Port 0 picks a free port."""
    table = InstanceTable(config, clock or SystemClock())
    metrics = RouterMetrics(table)
    traces = tracing.start(config.otlp_traces_endpoint, "kvbridge-router")  # None: off
    registry = (AsyncRegistryClient(config.registry, timeout=config.read_timeout_s, retries=1,
                                    token=config.token or None, tls=config.client_tls(),
                                    interceptors=tracing.client_interceptors(traces))
                if config.registry else None)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *SERVER_KEEPALIVE_OPTIONS],
                             interceptors=tracing.server_interceptors(traces))
    servicer = RouterServicer(table, metrics, registry, config.url_policy())
    add_servicer(server, servicer, pb, "RouterService",
                 authenticator=auth.Authenticator(config.token_table()), rules=RULES)
    health_servicer = health.aio.HealthServicer()
    add_health_and_reflection(
        server, health_servicer,
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME))
    host, port = split_hostport(config.listen)
    try:
        bound = auth.bind(server, f"{host}:{port}" if ":" not in host else f"[{host}]:{port}",
                          config.tls_files())
    except RuntimeError as exc:
        raise OSError(f"cannot bind the router to {config.listen}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind the router to {config.listen}")
    return RouterServer(config, table, metrics, server, bound, health_servicer, registry,
                        servicer, tracing=traces)


async def serve(config: RouterConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run a router until SIGTERM or SIGINT. ValueError when it would run unauthenticated
    outside insecure local mode."""
    auth.require_secured(config.token_table(), config.insecure, "router")
    logs.configure(config.log_level, config.log_format)
    router = await create_server(config)
    await router.start()
    auth.reload_tokens_on_sighup(log)  # a token is rotated without a restart
    if ready is not None:
        ready.set()
    await aio.wait_for_stop_signal()
    log.info("router_shutting_down", grace_s=config.shutdown_grace_s)
    await router.stop()
