"""Running the gateway: an aiohttp server until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog
from aiohttp import web
from prometheus_client import Gauge

from kvbridge import aio, auth, grpc_env, logs, tracing
from kvbridge.auth import is_loopback_host
from kvbridge.clients._registry import AsyncRegistryClient
from kvbridge.clients._router import AsyncRouterClient
from kvbridge.services.gateway._app import Gateway, Tenants
from kvbridge.services.gateway._config import GatewayConfig
from kvbridge.services.gateway._http import ConnectionGuard, server_tls
from kvbridge.services.registry._server import split_hostport

log = structlog.get_logger("kvbridge.gateway")


@dataclass
class GatewayServer:
    config: GatewayConfig
    gateway: Gateway
    runner: web.AppRunner
    port: int
    listener: asyncio.Server
    guard: ConnectionGuard

    @property
    def url(self) -> str:
        host, _ = split_hostport(self.config.listen)
        scheme = "https" if self.config.http_tls_cert else "http"
        return f"{scheme}://{host}:{self.port}"

    async def stop(self) -> None:
        self.listener.close()
        await self.runner.cleanup()
        if self.gateway.tracing is not None:
            await self.gateway.tracing.close()  # exports what is left
        log.info("gateway_stopped")


async def start_gateway(config: GatewayConfig) -> GatewayServer:
    """Build and start a gateway on `config.listen` (port 0 picks a free port)."""
    tenants = Tenants(config.api_keys_file)
    token, tls = config.token or None, config.client_tls()
    traces = tracing.start(config.otlp_traces_endpoint, "kvbridge-gateway")  # None: off
    interceptors = tracing.client_interceptors(traces)
    router = AsyncRouterClient(config.router, timeout=config.route_timeout_s, token=token,
                               tls=tls, interceptors=interceptors)
    registry = (AsyncRegistryClient(config.registry, timeout=2.0, token=token, tls=tls,
                                    interceptors=interceptors)
                if config.registry else None)
    gateway = Gateway(config, router, registry, tenants, traces)
    guard = ConnectionGuard(config.max_connections, config.header_timeout_s)
    app = gateway.app()
    app.middlewares.append(guard.middleware)
    Gauge("kvbridge_gateway_connections", "Open client connections",
          registry=gateway.metrics.registry).set_function(lambda: guard.open)
    runner = web.AppRunner(app, access_log=None, handle_signals=False,
                           keepalive_timeout=config.keepalive_timeout_s)
    await runner.setup()
    assert runner.server is not None
    host, port = split_hostport(config.listen)
    https = server_tls(config.http_tls_cert, config.http_tls_key)
    try:
        listener = await asyncio.get_running_loop().create_server(
            guard.factory(runner.server), host, port, ssl=https,
            ssl_handshake_timeout=config.header_timeout_s if https else None)
    except OSError:
        await runner.cleanup()
        raise
    bound = listener.sockets[0].getsockname()[1]
    result = GatewayServer(config, gateway, runner, int(bound), listener, guard)
    log.info("gateway_started", url=result.url, router=config.router,
             registry=config.registry or None, https="on" if https else "off",
             max_connections=config.max_connections,
             header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s,
             **grpc_env.describe(log),
             traces=tracing.endpoint(config.otlp_traces_endpoint) if traces else "off",
             auth="open (any bearer token names its own tenant)" if tenants.open_mode
             else f"{len(tenants.keys or {})} API key(s)")
    if not https and not is_loopback_host(host) and not tenants.open_mode:
        log.warning("api_keys_without_tls", listen=config.listen,
                    risk="API keys cross the network in the clear on a non-loopback address",
                    fix="add --http-tls-cert/--http-tls-key, or terminate TLS in front of the "
                        "gateway")
    return result


async def serve(config: GatewayConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run a gateway until SIGTERM or SIGINT. ValueError when it would run in open mode (no
    API keys) outside insecure local mode."""
    if not config.api_keys_file and not config.insecure:
        raise ValueError(
            "the gateway has no API keys configured: give it --api-keys-file FILE "
            "('API_KEY TENANT' lines) or, on a trusted local machine only, run it with "
            "--insecure (KVBRIDGE_INSECURE=1): any bearer token then names its own tenant")
    logs.configure(config.log_level, config.log_format)
    server = await start_gateway(config)
    # Tokens towards the router and registry are the gateway's own; its API keys are reread.
    auth.reload_tokens_on_sighup(log, ("api_keys", server.gateway.tenants.reload))
    if ready is not None:
        ready.set()
    await aio.wait_for_stop_signal()
    log.info("gateway_shutting_down")
    await server.stop()
