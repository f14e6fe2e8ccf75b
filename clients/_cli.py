"""`kvbridge leases ...` and `kvbridge holders ...`: operator commands over the registry API.

Human tables by default; `--json` prints one JSON object per line (per lease, holder or event)
for scripts. Failures print `error: REASON: message` and exit 1 (2 for bad arguments).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import click
from google.protobuf import json_format

from kvbridge.auth import TOKEN_ENV, TlsFiles
from kvbridge.clients._base import parse_hostport, parse_targets
from kvbridge.clients._registry import RegistryClient, seconds
from kvbridge.errors import DeadlineExceeded, InvalidArgument, KvbridgeError, Unavailable
from kvbridge.registry.v1 import registry_pb2 as pb

F = TypeVar("F", bound=Callable[..., Any])

def check_address(value: str, *, listen: bool = False) -> None:
    """ValueError("expected HOST:PORT ...") unless `value` is an address to bind (`listen`)
    or a client's address (replicas: comma-separated)."""
    if listen:
        parse_hostport(value, listen=True)
    else:
        parse_targets(value)


def address_callback(*, listen: bool = False, optional: bool = False) -> Callable[
        [click.Context, click.Parameter, str | None], str | None]:
    """A click option callback that rejects a malformed HOST:PORT with a usage error (exit 2)
    before the command does anything; with `optional`, '' (none) passes."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None or (optional and value == ""):
            return value
        try:
            check_address(value, listen=listen)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
        return value

    return check


def check_address_options(options: Mapping[str, Any], *, listen: Sequence[str] = (),
                          targets: Sequence[str] = (), optional: Sequence[str] = ()) -> None:
    """The same check for a service's options (from flags or environment variables; None:
    not set, the valid default): `listen` names addresses to bind, `targets` addresses to call,
    `optional` those that may be '' (none); a usage error naming the flag otherwise."""
    for name in (*listen, *targets):
        value = options.get(name)
        if value is None or (name in optional and value == ""):
            continue
        try:
            check_address(value, listen=name in listen)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--" + name.replace("_", "-")) from None


registry_option = click.option(
    "--registry", envvar="KVBRIDGE_REGISTRY", default="127.0.0.1:50051", show_default=True,
    callback=address_callback(),
    help="registry address HOST:PORT (or dns:///HOST:PORT, unix:PATH), or replicas' "
         "addresses comma-separated [env KVBRIDGE_REGISTRY]")
json_option = click.option("--json", "as_json", is_flag=True,
                           help="print JSON (one object per line) instead of a table")
timeout_option = click.option("--timeout", default=5.0, show_default=True,
                              type=click.FloatRange(min=0, min_open=True),
                              help="seconds to wait for each RPC (more than 0)")


_SECURITY_KEY = "kvbridge.client_security"


def security_options(fn: F) -> F:
    """--token and the TLS flags of a client command; the command builds its client with
    `client_security()`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, token: str, tls_ca: str, tls_cert: str, tls_key: str,
                **kwargs: Any) -> Any:
        tls = TlsFiles(tls_cert, tls_key, tls_ca)
        try:
            tls.validate(server=False)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        click.get_current_context().meta[_SECURITY_KEY] = {
            "token": token or None, "tls": tls if tls.enabled else None}
        return fn(*args, **kwargs)

    options = [
        click.option("--token", envvar=TOKEN_ENV, default="", show_default=False,
                     help=f"bearer token for a server with authentication (prefer the "
                          f"environment variable) [env {TOKEN_ENV}]"),
        click.option("--tls-ca", envvar="KVBRIDGE_TLS_CA", default="",
                     help="PEM CA to trust: connect with TLS [env KVBRIDGE_TLS_CA]"),
        click.option("--tls-cert", envvar="KVBRIDGE_TLS_CERT", default="",
                     help="PEM client certificate, for mutual TLS [env KVBRIDGE_TLS_CERT]"),
        click.option("--tls-key", envvar="KVBRIDGE_TLS_KEY", default="",
                     help="PEM key of --tls-cert [env KVBRIDGE_TLS_KEY]"),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper  # type: ignore[return-value]


def client_security() -> dict[str, Any]:
    """`token=` and `tls=` for a client, from the current command's --token and TLS flags."""
    ctx = click.get_current_context(silent=True)
    return dict(ctx.meta.get(_SECURITY_KEY, {})) if ctx is not None else {}


def _fail_cleanly(fn: F) -> F:
    """Turn domain errors into one readable line and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        registry = kwargs.get("registry", "")
        try:
            return fn(*args, **kwargs)
        except (Unavailable, DeadlineExceeded) as err:
            click.echo(f"error: {err.reason}: cannot reach the registry at {registry} "
                       f"({err.message}); is `kvbridge registry serve` running there?", err=True)
            sys.exit(1)
        except InvalidArgument as err:
            click.echo(f"error: {err.reason}: {err.message}", err=True)
            sys.exit(2)
        except KvbridgeError as err:
            click.echo(f"error: {err.reason}: {err.message}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def _fmt_duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f}h"
    if s >= 60:
        return f"{s / 60:.1f}m"
    return f"{s:.1f}s"


def _state(enum: Any, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix).lower()


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in cells)


def _json(message: Any) -> str:
    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True),
                      sort_keys=True)


def _lease_row(lease: pb.Lease) -> list[object]:
    return [lease.lease_id, lease.tenant, lease.conversation_id, lease.holder_id, lease.epoch,
            _state(pb.LeaseState, lease.state, "LEASE_STATE_"), lease.token_count,
            len(lease.block_ids) or "-", lease.pin_count, _fmt_duration(seconds(lease.expires_in))]


_LEASE_HEADERS = ["LEASE", "TENANT", "CONVERSATION", "HOLDER", "EPOCH", "STATE", "TOKENS",
                  "BLOCKS", "PINS", "EXPIRES_IN"]


@click.group("leases")
def leases_group() -> None:
    """Inspect and manage conversation leases."""


@leases_group.command("list")
@registry_option
@security_options
@click.option("--tenant", default="", help="only this tenant's leases")
@click.option("--conversation", default="", help="only this conversation (needs --tenant)")
@click.option("--holder", default="", help="only this holder's leases")
@click.option("--all", "include_inactive", is_flag=True,
              help="include leases no longer active but not yet reclaimed")
@click.option("--limit", default=0, type=click.IntRange(min=0),
              help="stop after this many leases (0: all)")
@json_option
@timeout_option
@_fail_cleanly
def leases_list(registry: str, tenant: str, conversation: str, holder: str,
                include_inactive: bool, limit: int, as_json: bool, timeout: float) -> None:
    """List leases (paginated under the hood)."""
    with RegistryClient(registry, timeout=timeout, **client_security()) as client:
        leases = []
        for lease in client.iter_leases(tenant=tenant, conversation_id=conversation,
                                        holder_id=holder, include_inactive=include_inactive):
            leases.append(lease)
            if limit and len(leases) >= limit:
                break
    if as_json:
        for lease in leases:
            click.echo(_json(lease))
        return
    click.echo(_table(_LEASE_HEADERS, (_lease_row(x) for x in leases)))
    click.echo(f"{len(leases)} lease(s)")


@leases_group.command("show")
@registry_option
@security_options
@click.argument("lease_id")
@json_option
@timeout_option
@_fail_cleanly
def leases_show(registry: str, lease_id: str, as_json: bool, timeout: float) -> None:
    """Show one lease in full."""
    with RegistryClient(registry, timeout=timeout, **client_security()) as client:
        lease = client.get_lease(lease_id)
    if as_json:
        click.echo(_json(lease))
        return
    fields = [
        ("lease", lease.lease_id), ("tenant", lease.tenant),
        ("conversation", lease.conversation_id), ("holder", lease.holder_id),
        ("remote request", lease.remote_request_id), ("epoch", lease.epoch),
        ("state", _state(pb.LeaseState, lease.state, "LEASE_STATE_")),
        ("tokens", lease.token_count), ("blocks", len(lease.block_ids)),
        ("pins", lease.pin_count), ("idle ttl", _fmt_duration(seconds(lease.idle_ttl))),
        ("max lifetime", _fmt_duration(seconds(lease.max_lifetime))),
        ("expires in", _fmt_duration(seconds(lease.expires_in))),
        ("expire time", lease.expire_time.ToJsonString()),
        ("created", lease.create_time.ToJsonString()),
    ]
    for name, value in fields:
        click.echo(f"{name + ':':<16}{value}")


@leases_group.command("renew")
@registry_option
@security_options
@click.argument("lease_ids", nargs=-1)
@click.option("--conversation", "conversations", multiple=True, metavar="TENANT/CONVERSATION",
              help="renew a conversation's current lease (repeatable)")
@json_option
@timeout_option
@_fail_cleanly
def leases_renew(registry: str, lease_ids: tuple[str, ...], conversations: tuple[str, ...],
                 as_json: bool, timeout: float) -> None:
    """Renew leases by id and/or conversation (one batched call). Exits 1 if any was not
    renewed."""
    refs = []
    for ref in conversations:
        tenant, sep, conv = ref.partition("/")
        if not sep or not tenant or not conv:
            raise click.BadParameter(f"expected TENANT/CONVERSATION, got {ref!r}",
                                     param_hint="--conversation")
        refs.append((tenant, conv))
    if not lease_ids and not refs:
        raise click.UsageError("name at least one lease id or --conversation")
    with RegistryClient(registry, timeout=timeout, **client_security()) as client:
        resp = client.renew_leases(lease_ids, refs)
    names = list(lease_ids) + list(conversations)
    for name, r in zip(names, resp.results, strict=True):
        if as_json:
            click.echo(_json(r))
        elif r.renewed:
            click.echo(f"{name}: renewed {r.lease_id}, expires in "
                       f"{_fmt_duration(seconds(r.expires_in))}")
        else:
            state = _state(pb.LeaseState, r.state, "LEASE_STATE_") if r.state else "no lease"
            click.echo(f"{name}: not renewed ({state})")
    if resp.renewed_count != len(names):
        sys.exit(1)


@leases_group.command("revoke")
@registry_option
@security_options
@click.argument("lease_id")
@click.option("--reason", default="operator", show_default=True, help="recorded in the log")
@json_option
@timeout_option
@_fail_cleanly
def leases_revoke(registry: str, lease_id: str, reason: str, as_json: bool,
                  timeout: float) -> None:
    """Revoke a lease: it is never read again; the holder frees it once no pin is live."""
    with RegistryClient(registry, timeout=timeout, **client_security()) as client:
        resp = client.revoke_lease(lease_id, reason)
    if as_json:
        click.echo(_json(resp))
        return
    if resp.reclaimable:
        when = "now"
    elif resp.lease.pin_count:
        when = f"after {resp.lease.pin_count} pin(s) end"
    else:  # no pin it knows of, but it lost its state: pins from before may be live
        when = "once the registry's recovery grace is over"
    click.echo(f"revoked {lease_id} (state "
               f"{_state(pb.LeaseState, resp.lease.state, 'LEASE_STATE_')}); "
               f"holder {resp.lease.holder_id} may free it {when}")


@leases_group.command("watch")
@registry_option
@security_options
@click.option("--holder", default="", help="only this holder's leases")
@click.option("--tenant", default="", help="only this tenant's leases")
@click.option("--renewals", is_flag=True, help="also show renewals (high volume)")
@click.option("--count", default=0, type=click.IntRange(min=0),
              help="exit after this many events (0: run until interrupted)")
@click.option("--reconnect-for", "reconnect_for", default=30.0, show_default=True,
              type=click.FloatRange(min=0),
              help="when the registry (replica) goes away, keep trying it and the other "
                   "--registry addresses for this many seconds; 0: exit at once")
@json_option
@_fail_cleanly
def leases_watch(registry: str, holder: str, tenant: str, renewals: bool, count: int,
                 reconnect_for: float, as_json: bool) -> None:
    """Stream lease events as they happen.

    When the replica streaming them stops, restarts or stops serving, the watch moves to the
    next address in --registry (or waits for the same one to come back), saying so on stderr.
    Events in between are not replayed: `kvbridge leases list` shows where things stand.
    """
    seen = 0
    lost_at = [0.0]

    def lost(target: str, err: KvbridgeError) -> None:
        lost_at[0] = time.monotonic()
        click.echo(f"watch: the stream from {target} ended ({err.reason}: {err.message}); "
                   f"reconnecting for up to {reconnect_for:g}s", err=True)

    def resumed(target: str) -> None:
        click.echo(f"watch: now watching {target}, after "
                   f"{time.monotonic() - lost_at[0]:.1f}s; events in between are not shown "
                   "(`kvbridge leases list` has the leases as they are now)", err=True)

    with RegistryClient(registry, **client_security()) as client:
        try:
            for event in client.watch_leases(holder, tenant, renewals,
                                             reconnect_for=reconnect_for, on_lost=lost,
                                             on_resumed=resumed):
                if as_json:
                    click.echo(_json(event))
                else:
                    kind = _state(pb.LeaseEventType, event.type, "LEASE_EVENT_TYPE_")
                    stamp = time.strftime("%H:%M:%S", time.localtime(event.event_time.seconds))
                    click.echo(f"{stamp} {kind:<12} {event.lease_id} tenant={event.tenant} "
                               f"conversation={event.conversation_id} holder={event.holder_id} "
                               f"epoch={event.epoch}")
                sys.stdout.flush()
                seen += 1
                if count and seen >= count:
                    return
        except KeyboardInterrupt:
            return
        except KvbridgeError as err:
            if not getattr(err, "stream_ended", False):
                raise  # none could be opened: "cannot reach the registry ..."
            click.echo(f"error: {err.reason}: the watch stream ended ({err.message})"
                       + (f"; no registry answered within --reconnect-for {reconnect_for:g}s"
                          if reconnect_for else ""), err=True)
            sys.exit(1)


@click.group("holders")
def holders_group() -> None:
    """Inspect registered decode engines (holders)."""


@holders_group.command("list")
@registry_option
@security_options
@json_option
@timeout_option
@_fail_cleanly
def holders_list(registry: str, as_json: bool, timeout: float) -> None:
    """List registered holders."""
    with RegistryClient(registry, timeout=timeout, **client_security()) as client:
        holders = list(client.iter_holders())
    if as_json:
        for h in holders:
            click.echo(_json(h))
        return
    rows = [[h.holder_id, _state(pb.HolderState, h.state, "HOLDER_STATE_"),
             f"{h.nixl_host}:{h.nixl_port}", h.block_size, h.tp_size, h.lease_count,
             h.retained_blocks, _fmt_duration(seconds(h.expires_in))] for h in holders]
    click.echo(_table(["HOLDER", "STATE", "NIXL", "BLOCK_SIZE", "TP", "LEASES", "BLOCKS",
                       "EXPIRES_IN"], rows))
    click.echo(f"{len(holders)} holder(s)")
