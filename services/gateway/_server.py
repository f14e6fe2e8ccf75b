"""Running the gateway: an aiohttp server until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog
from aiohttp import web

from kvbridge import aio, grpc_env, logs
from kvbridge.clients._registry import AsyncRegistryClient
from kvbridge.clients._router import AsyncRouterClient
from kvbridge.services.gateway._app import Gateway, Tenants
from kvbridge.services.gateway._config import GatewayConfig
from kvbridge.services.registry._server import split_hostport

log = structlog.get_logger("kvbridge.gateway")


@dataclass
class GatewayServer:
    config: GatewayConfig
    gateway: Gateway
    runner: web.AppRunner
    port: int

    @property
    def url(self) -> str:
        host, _ = split_hostport(self.config.listen)
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        log.info("gateway_stopped")


async def start_gateway(config: GatewayConfig) -> GatewayServer:
    """Build and start a gateway on `config.listen` (port 0 picks a free port)."""
    tenants = Tenants(config.api_keys_file)
    token, tls = config.token or None, config.client_tls()
    router = AsyncRouterClient(config.router, timeout=config.route_timeout_s, token=token,
                               tls=tls)
    registry = (AsyncRegistryClient(config.registry, timeout=2.0, token=token, tls=tls)
                if config.registry else None)
    gateway = Gateway(config, router, registry, tenants)
    runner = web.AppRunner(gateway.app(), access_log=None, handle_signals=False)
    await runner.setup()
    host, port = split_hostport(config.listen)
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    result = GatewayServer(config, gateway, runner, int(bound))
    log.info("gateway_started", url=result.url, router=config.router,
             registry=config.registry or None,
             **grpc_env.describe(log),
             auth="open (any bearer token names its own tenant)" if tenants.open_mode
             else f"{len(tenants.keys or {})} API key(s)")
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
    if ready is not None:
        ready.set()
    await aio.wait_for_stop_signal()
    log.info("gateway_shutting_down")
    await server.stop()
