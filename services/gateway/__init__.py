"""The OpenAI-compatible gateway: route, prefill, decode, per conversation turn."""

from kvbridge.services.gateway._app import Gateway, HttpError, Tenants, estimate_prompt_tokens
from kvbridge.services.gateway._config import GatewayConfig
from kvbridge.services.gateway._server import GatewayServer, serve, start_gateway

__all__ = ["Gateway", "GatewayConfig", "GatewayServer", "HttpError", "Tenants",
           "estimate_prompt_tokens", "serve", "start_gateway"]
