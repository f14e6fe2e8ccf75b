"""`kvbridge gateway serve`."""

from __future__ import annotations

from typing import Any

import click

from kvbridge import aio
from kvbridge.clients._cli import check_address_options
from kvbridge.config import build_config, config_options
from kvbridge.services.gateway._config import GatewayConfig
from kvbridge.services.gateway._server import serve


@click.group("gateway")
def gateway_group() -> None:
    """The OpenAI-compatible HTTP gateway in front of prefill and decode engines."""


@gateway_group.command("serve")
@config_options(GatewayConfig)
def serve_command(**options: Any) -> None:
    """Serve /v1/chat/completions, /v1/completions (streaming or not), /v1/models, /health and
    /metrics until SIGTERM/SIGINT.

    \b
    Each turn: the router picks a prefill and a decode instance and pins the conversation's
    KV on decode; prefill runs with the conversation key and that read, verifies it against
    its prompt and reads back what matches; decode reads prefill's KV and streams the answer.
    Conversation id: body field "conversation_id" or header X-Conversation-Id.
    Tenant: from "Authorization: Bearer API_KEY" (see --api-keys-file).
    Conversations: POST /v1/conversations/ID/keepalive keeps a paused conversation's KV;
    DELETE /v1/conversations/ID frees it.
    HTTPS with --http-tls-cert/--http-tls-key. Slow clients: headers within
    --header-timeout-s, bodies within --body-timeout-s, at most --max-connections open.
    Engine failures reach clients as generic errors naming the X-Request-Id (details in the
    log).
    Traces (off by default): --otlp-traces-endpoint URL exports a span per turn over OTLP,
    joined by the router's and registry's, and sends its traceparent header to the engines
    (needs pip install 'kvbridge[tracing]'; docs/tracing.md).

    gRPC core: unless GRPC_EXPERIMENTS is set, runs with -event_engine_listener,
    -event_engine_client (gRPC's classic TCP endpoints: less CPU per call); set
    GRPC_EXPERIMENTS yourself, even empty, to choose otherwise.
    """
    check_address_options(options, listen=("listen",), targets=("router", "registry"),
                          optional=("registry",))
    config = build_config(GatewayConfig, options)
    try:
        aio.run(serve(config))
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot start the gateway: {exc}") from exc
