"""`kvbridge auth ...`: make tokens and check token tables."""

from __future__ import annotations

import secrets
import sys

import click

from kvbridge.auth import ROLES, TokenTable, hash_token


@click.group("auth")
def auth_group() -> None:
    """Tokens for kvbridge's gRPC services (registry, router).

    \b
    A server authenticates callers with a token table (--auth-tokens-file FILE, or
    KVBRIDGE_AUTH_TOKENS_FILE=FILE; or the lines themselves in KVBRIDGE_AUTH_TOKENS,
    separated by ';'), one token per line:
        TOKEN  ROLE  [holder=ID[,ID..]]  [tenants=T[,T..]]  [name=LABEL]
    TOKEN may be written sha256:<hex> (see `kvbridge auth token --hashed`) so the file holds
    no secret. Patterns may use '*'. Roles:
    \b
      holder   a decode engine: registers the holders holder= names, grants, renews and
               revokes their leases only (holder= required)
      reader   a prefill engine: pins and releases reads only
      gateway  the gateway: routes, pins, renews/lists/revokes leases by conversation
      router   the router's calls to the registry (as gateway)
      tenant   one customer's operator: sees and touches its tenants' leases only
               (tenants= required)
      admin    everything
    tenants= limits any role but admin to those tenants. Clients send the token as
    'authorization: Bearer TOKEN' (CLI: --token or KVBRIDGE_TOKEN; connector:
    kvbridge.token_env / token_file). Without a token table a server starts only with
    --insecure (KVBRIDGE_INSECURE=1), a trusted-local-machine mode where every caller is admin.

    To rotate a token, edit the token file and send the registry SIGHUP: it reads the file again
    and uses it from the next call on (state is kept; a file that does not parse is logged and
    the old table kept). Check the file first with `kvbridge auth check FILE`.
    """


@auth_group.command("token")
@click.option("--role", type=click.Choice(ROLES), required=True, help="the token's role")
@click.option("--holder", default="", help="holder ids (role holder), comma-separated")
@click.option("--tenants", default="", help="tenants the token is limited to, comma-separated")
@click.option("--name", default="", help="a label for logs")
@click.option("--hashed", is_flag=True,
              help="print the table line with the token's sha256 (the token itself on stderr)")
def token_command(role: str, holder: str, tenants: str, name: str, hashed: bool) -> None:
    """Make a random token and print its token-table line."""
    token = "kvb_" + secrets.token_urlsafe(32)
    fields = [hash_token(token) if hashed else token, role]
    fields += [f"{k}={v}" for k, v in (("holder", holder), ("tenants", tenants), ("name", name))
               if v]
    line = " ".join(fields)
    try:
        TokenTable.parse(line, "the new entry")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if hashed:
        click.echo(f"token (give it to the client; it is not stored): {token}", err=True)
    click.echo(line)


@auth_group.command("check")
@click.argument("path", type=click.Path(dir_okay=False))
def check_command(path: str) -> None:
    """Check a token table file; print how many tokens each role has."""
    try:
        table = TokenTable.load(path)
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    assert table is not None
    roles = ", ".join(f"{role} {n}" for role, n in sorted(table.roles().items()))
    click.echo(f"{path}: {len(table)} token(s): {roles}")
