"""`kvbridge registry serve`."""

from __future__ import annotations

from typing import Any

import click

from kvbridge import aio
from kvbridge.clients._cli import check_address_options
from kvbridge.config import build_config, config_options
from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._server import serve


@click.group("registry")
def registry_group() -> None:
    """The lease registry service."""


@registry_group.command("serve")
@config_options(RegistryConfig)
def serve_command(**options: Any) -> None:
    """Run a lease registry until SIGTERM/SIGINT (graceful shutdown).

    Serves the gRPC API (kvbridge.registry.v1.RegistryService, plus health and reflection) on
    --listen and Prometheus metrics on --metrics-listen. Every flag can also be set with the
    KVBRIDGE_* environment variable named in its help.

    --backend memory (the default) keeps leases in this process; --backend redis --redis-url
    URL keeps them in Redis, shared by every replica started with the same URL and namespace
    (each replica serves any RPC; start fails with exit status 1 if Redis is unreachable).

    Security: with a token table, SIGHUP reads --auth-tokens-file again (rotate a token by
    editing the file and sending SIGHUP; nothing else changes, and a file that does not parse
    is logged as tokens_reload_failed and the old table kept). A registry with tokens caps
    each tenant (--tenant-max-leases/--tenant-max-blocks, -1 by default: 100,000 leases and
    10,000,000 blocks; 0: no limit). It starts on a non-loopback --listen all the same, but
    warns loudly: insecure_mode_on_network with --insecure (every caller is an admin),
    tokens_without_tls with tokens and no --tls-cert (tokens cross the network in clear).

    gRPC core: unless GRPC_EXPERIMENTS is set, runs with -event_engine_listener,
    -event_engine_client (gRPC's classic TCP endpoints: less CPU per call); set
    GRPC_EXPERIMENTS yourself, even empty, to choose otherwise.
    """
    check_address_options(options, listen=("listen", "metrics_listen"),
                          optional=("metrics_listen",))
    config = build_config(RegistryConfig, options)
    try:
        aio.run(serve(config))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot start the registry: {exc}") from exc


def _register_demo() -> None:
    from kvbridge.clients._demo import demo_command

    registry_group.add_command(demo_command)


_register_demo()
