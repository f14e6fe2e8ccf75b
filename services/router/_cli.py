"""`kvbridge router serve` and `kvbridge instances list`."""

from __future__ import annotations

import sys
from typing import Any

import click

from kvbridge import aio
from kvbridge.clients._cli import (
    _fmt_duration,
    _json,
    _table,
    address_callback,
    check_address_options,
    client_security,
    json_option,
    security_options,
    timeout_option,
)
from kvbridge.clients._registry import seconds
from kvbridge.clients._router import ROLES, RouterClient
from kvbridge.config import build_config, config_options
from kvbridge.errors import DeadlineExceeded, KvbridgeError, Unavailable
from kvbridge.router.v1 import router_pb2 as pb
from kvbridge.services.router._config import RouterConfig
from kvbridge.services.router._server import serve


@click.group("router")
def router_group() -> None:
    """The routing service: where each conversation turn runs."""


@router_group.command("serve")
@config_options(RouterConfig)
def serve_command(**options: Any) -> None:
    """Run a router until SIGTERM/SIGINT (graceful shutdown).

    Engines (prefill and decode instances) register and heartbeat their load; the gateway
    asks Route for each turn; prefill connectors may ask AcquireRead here instead of the
    registry, so that KV on an engine the router knows is dead is never read. Serves
    kvbridge.router.v1.RouterService plus health and reflection on --listen, Prometheus
    metrics on --metrics-listen. Every flag can also be set with the environment variable
    named in its help (KVBRIDGE_ROUTER_*, or for shared ones KVBRIDGE_INSECURE,
    KVBRIDGE_AUTH_TOKENS_FILE, KVBRIDGE_TLS_*, KVBRIDGE_TOKEN).

    Traces (off by default): --otlp-traces-endpoint URL exports a span for each call that
    arrives in a trace (traceparent metadata) and carries it on to the registry.

    gRPC core: unless GRPC_EXPERIMENTS is set, runs with -event_engine_listener,
    -event_engine_client (gRPC's classic TCP endpoints: less CPU per call); set
    GRPC_EXPERIMENTS yourself, even empty, to choose otherwise.
    """
    check_address_options(options, listen=("listen", "metrics_listen"), targets=("registry",),
                          optional=("metrics_listen", "registry"))
    config = build_config(RouterConfig, options)
    try:
        aio.run(serve(config))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot start the router: {exc}") from exc


@click.group("instances")
def instances_group() -> None:
    """Inspect the engine instances a router knows."""


router_option = click.option(
    "--router", envvar="KVBRIDGE_ROUTER", default="127.0.0.1:50061", show_default=True,
    callback=address_callback(),
    help="router address HOST:PORT [env KVBRIDGE_ROUTER]")


@instances_group.command("list")
@router_option
@security_options
@click.option("--role", type=click.Choice(sorted(ROLES)), default=None,
              help="only this role")
@click.option("--model", default="", help="only instances serving this model")
@json_option
@timeout_option
def instances_list(router: str, role: str | None, model: str, as_json: bool,
                   timeout: float) -> None:
    """List live instances with their load."""
    try:
        with RouterClient(router, timeout=timeout, **client_security()) as client:
            instances = client.list_instances(role or "", model)
    except (Unavailable, DeadlineExceeded) as err:
        click.echo(f"error: {err.reason}: cannot reach the router at {router} ({err.message}); "
                   "is `kvbridge router serve` running there?", err=True)
        sys.exit(1)
    except KvbridgeError as err:
        click.echo(f"error: {err.reason}: {err.message}", err=True)
        sys.exit(1)
    if as_json:
        for i in instances:
            click.echo(_json(i))
        return
    rows = [[i.instance_id, pb.Role.Name(i.role).removeprefix("ROLE_").lower(), i.model,
             i.http_url, i.engine_id, i.load.running_requests, i.load.waiting_requests,
             f"{i.load.kv_usage:.0%}", i.routed_since_heartbeat,
             _fmt_duration(seconds(i.expires_in))] for i in instances]
    click.echo(_table(["INSTANCE", "ROLE", "MODEL", "URL", "ENGINE", "RUNNING", "WAITING", "KV",
                       "ROUTED", "EXPIRES_IN"], rows))
    click.echo(f"{len(instances)} instance(s)")
