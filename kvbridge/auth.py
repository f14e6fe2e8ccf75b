"""Who may call what: bearer tokens with roles, the check every gRPC method runs, and TLS.

A server with authentication holds a **token table**: one token per line,

    # TOKEN                  ROLE     SCOPE...
    s3cret-decode-0          holder   holder=decode-0
    sha256:9f86d08...        reader   tenants=acme,globex   name=prefill-eu
    s3cret-gateway           gateway
    s3cret-ops               admin

read from a file (`--auth-tokens-file`, `KVBRIDGE_AUTH_TOKENS_FILE`) or from the environment
(`KVBRIDGE_AUTH_TOKENS`, the same lines separated by newlines or `;`). A token may be written as
`sha256:<hex>` so that the file holds no secret; the server only ever keeps the hash.

Roles:
- `holder`: a decode engine. Registers, heartbeats and drains the holders its `holder=` scope
  names (comma-separated; `*` matches any run of characters), grants leases for them, and
  renews, revokes, reads and watches only those holders' leases.
- `reader`: a prefill engine. Pins reads (AcquireRead, PinLease, ReleaseRead) and nothing else.
- `gateway`: the OpenAI-compatible gateway (and the router, which pins for it): routes, pins,
  and renews, lists and revokes leases by conversation, on behalf of the tenants it serves.
- `router`: the router's own calls to the registry; the same rights there as `gateway`.
- `tenant`: one customer's operator token: lists, shows, renews, revokes and watches only its
  own tenants' leases (`tenants=` is required).
- `admin`: everything, including holders and instances.

`tenants=` on any role but admin limits every request that names a tenant to those tenants
(`*` patterns allowed). Clients send `authorization: Bearer <token>` metadata.

With no token table a server runs only when told it is in **insecure local mode**
(`--insecure`, `KVBRIDGE_INSECURE=1`): every caller is then an admin, and the server says so in
its start line. TLS (and mutual TLS) is configured apart from tokens: see `TlsFiles`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import fnmatch
import hashlib
import ipaddress
import os
import re
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from kvbridge.errors import PermissionDenied, Unauthenticated
from kvbridge.ids import check_identifier

ROLES = ("admin", "holder", "reader", "gateway", "router", "tenant")
SCOPED_ROLES = {"holder": "holder", "tenant": "tenants"}  # role -> the scope it requires
TOKEN_ENV = "KVBRIDGE_TOKEN"
TOKENS_ENV = "KVBRIDGE_AUTH_TOKENS"
TOKENS_FILE_ENV = "KVBRIDGE_AUTH_TOKENS_FILE"
INSECURE_ENV = "KVBRIDGE_INSECURE"
_MIN_TOKEN_LENGTH = 16
_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
# The longest id (tenant, holder) a rule checks, unless its server says otherwise: the default of
# the services' own max_id_length.
MAX_ID_LENGTH = 256
_SHOWN_LENGTH = 64  # most characters of a caller's value an error or a log line repeats


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def hash_token(token: str) -> str:
    """`sha256:<hex>`: how a token can be written in a token table without the secret."""
    return "sha256:" + _digest(token).hex()


@dataclasses.dataclass(frozen=True)
class Principal:
    """An authenticated caller: a role and what it is limited to."""

    name: str
    role: str
    holders: tuple[str, ...] = ()  # holder id patterns (role holder)
    tenants: tuple[str, ...] | None = None  # tenant patterns; None: any tenant

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def may_hold(self, holder_id: str) -> bool:
        return self.is_admin or any(fnmatch.fnmatchcase(holder_id, p) for p in self.holders)

    def may_tenant(self, tenant: str) -> bool:
        return self.tenants is None or any(fnmatch.fnmatchcase(tenant, p) for p in self.tenants)

    @property
    def single_holder(self) -> str:
        """The one holder id this principal names exactly, else ''."""
        if len(self.holders) == 1 and not any(c in self.holders[0] for c in "*?["):
            return self.holders[0]
        return ""

    @property
    def single_tenant(self) -> str:
        if self.tenants is not None and len(self.tenants) == 1 and not any(
                c in self.tenants[0] for c in "*?["):
            return self.tenants[0]
        return ""


# Insecure local mode: every caller.
LOCAL_ADMIN = Principal("insecure-local", "admin")


class TokenTable:
    """Token hashes -> principals."""

    def __init__(self, entries: Mapping[bytes, Principal]) -> None:
        if not entries:
            raise ValueError("the token table is empty")
        self._entries = dict(entries)
        # (file, inline lines) it was loaded from (`load`): what `Authenticator.reload` reads.
        self.origin: tuple[str, str] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> Principal | None:
        # A lookup by SHA-256 digest: timing reveals nothing usable about the tokens held.
        return self._entries.get(_digest(token))

    def roles(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self._entries.values():
            out[p.role] = out.get(p.role, 0) + 1
        return out

    @classmethod
    def parse(cls, text: str, source: str = "tokens") -> TokenTable:
        """Parse token-table lines (newline- or `;`-separated); ValueError names the line."""
        entries: dict[bytes, Principal] = {}
        lines = [line for chunk in text.splitlines() for line in chunk.split(";")]
        for number, raw in enumerate(lines, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"{source}: entry {number}"
            fields = line.split()
            if len(fields) < 2:
                raise ValueError(f"{where}: expected TOKEN ROLE [holder=..] [tenants=..] "
                                 f"[name=..]")
            token, role, options = fields[0], fields[1], fields[2:]
            if role not in ROLES:
                raise ValueError(f"{where}: unknown role {role!r} (one of {', '.join(ROLES)})")
            scope: dict[str, str] = {}
            for opt in options:
                key, sep, value = opt.partition("=")
                if not sep or key not in ("holder", "tenants", "name") or not value:
                    raise ValueError(f"{where}: expected holder=IDS, tenants=IDS or name=LABEL, "
                                     f"got {opt!r}")
                scope[key] = value
            need = SCOPED_ROLES.get(role)
            if need and need not in scope:
                raise ValueError(f"{where}: role {role} needs {need}=...")
            if "holder" in scope and role != "holder":
                raise ValueError(f"{where}: holder= applies to role holder only")
            if role == "admin" and "tenants" in scope:
                raise ValueError(f"{where}: an admin is not limited to tenants")
            match = _HASHED.fullmatch(token)
            if match:
                digest = bytes.fromhex(match.group(1))
            elif len(token) < _MIN_TOKEN_LENGTH:
                raise ValueError(f"{where}: a token must be at least {_MIN_TOKEN_LENGTH} "
                                 f"characters (or sha256:<hex>)")
            else:
                digest = _digest(token)
            if digest in entries:
                raise ValueError(f"{where}: the same token appears twice")
            tenants = tuple(t for t in scope["tenants"].split(",") if t) if (
                "tenants" in scope) else None
            holders = tuple(h for h in scope.get("holder", "").split(",") if h)
            entries[digest] = Principal(scope.get("name", f"{role}-{len(entries) + 1}"), role,
                                        holders, tenants)
        if not entries:
            raise ValueError(f"{source}: no tokens")
        return cls(entries)

    @classmethod
    def load(cls, path: str = "", inline: str = "") -> TokenTable | None:
        """The table from a file and/or inline text; None when neither is given."""
        text, sources = "", []
        if path:
            try:
                text += Path(path).read_text() + "\n"
            except OSError as exc:
                raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from exc
            sources.append(path)
        if inline:
            text += inline
            sources.append(TOKENS_ENV)
        if not sources:
            return None
        table = cls.parse(text, " + ".join(sources))
        table.origin = (path, inline)
        return table


def bearer(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The bearer token in gRPC metadata (or HTTP-like headers), if any."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
            return token.strip()
    return None


class Authenticator:
    """Turns a call's metadata into a `Principal`: from the token table, or, in insecure local
    mode (no table), everyone is `LOCAL_ADMIN`. A table from `TokenTable.load` can be read again
    (`reload`, or every such authenticator on SIGHUP: `reload_tokens_on_sighup`)."""

    def __init__(self, table: TokenTable | None) -> None:
        self.table = table
        if table is not None and table.origin is not None:
            _RELOADABLE.add(self)

    def reload(self) -> TokenTable:
        """Read the token table again from where it was loaded and use it for every call from
        now on (one assignment: a call sees the old table or the new, never a mix; nothing
        else changes). ValueError, with the current table kept, when the new one is not valid
        or there is none to reload (insecure local mode, a table not loaded from a source)."""
        table = self.table
        if table is None or table.origin is None:
            raise ValueError("no token table loaded from a file to reload")
        fresh = TokenTable.load(*table.origin)
        assert fresh is not None  # the origin names a source
        self.table = fresh
        return fresh

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def authenticate(self, metadata: Iterable[tuple[str, Any]] | None) -> Principal:
        if self.table is None:
            return LOCAL_ADMIN
        token = bearer(metadata)
        if token is None:
            raise Unauthenticated("no credentials: send 'authorization: Bearer <token>'")
        principal = self.table.lookup(token)
        if principal is None:
            raise Unauthenticated("unknown token")
        return principal


# Every authenticator over a loaded table, for `reload_tokens` (weak: a server that is gone drops
# out by itself).
_RELOADABLE: weakref.WeakSet[Authenticator] = weakref.WeakSet()


def reload_tokens() -> list[tuple[str, TokenTable | ValueError]]:
    """Reload every live authenticator's token table (`Authenticator.reload`); for each, its
    source and the new table, or the ValueError for which it kept its old one."""
    out: list[tuple[str, TokenTable | ValueError]] = []
    for authenticator in list(_RELOADABLE):
        path, inline = (authenticator.table and authenticator.table.origin) or ("", "")
        source = " + ".join(x for x in (path, TOKENS_ENV if inline else "") if x)
        try:
            out.append((source, authenticator.reload()))
        except ValueError as exc:
            out.append((source, exc))
    return out


def reload_tokens_on_sighup(logger: Any, *others: tuple[str, Callable[[], object]]) -> None:
    """From now on, SIGHUP reloads this process's token tables (`reload_tokens`), and calls
    each of `others` (a name and a function that reads some other credentials again, such as
    the gateway's API keys, raising ValueError or OSError, with the old ones kept, when it
    cannot): a token is rotated by editing its file and sending SIGHUP, without a restart and
    without losing any state. Each reload is logged on `logger`: `tokens_reloaded`, or
    `tokens_reload_failed` (the old table stays). Call it from a server's `serve`, on its
    event loop, once its server is built."""
    import asyncio
    import signal

    def on_sighup() -> None:
        for source, result in reload_tokens():
            if isinstance(result, ValueError):
                logger.error("tokens_reload_failed", source=source, error=str(result),
                             kept="the previous token table")
            else:
                logger.info("tokens_reloaded", source=source, token_roles=result.roles())
        for name, reload in others:
            try:
                reload()
            except (ValueError, OSError) as exc:
                logger.error("tokens_reload_failed", source=name, error=str(exc),
                             kept=f"the previous {name}")
            else:
                logger.info("tokens_reloaded", source=name)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)


# The caller of the RPC being served (set by the handler wrapper; LOCAL_ADMIN when auth is off).
_CURRENT: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "kvbridge_principal", default=LOCAL_ADMIN)


def current() -> Principal:
    return _CURRENT.get()


def set_current(principal: Principal) -> contextvars.Token[Principal]:
    return _CURRENT.set(principal)


def reset_current(token: contextvars.Token[Principal]) -> None:
    _CURRENT.reset(token)


# ---- per-method rules ---------------------------------------------------------------------------

Check = Callable[[Principal, Any], None]


@dataclasses.dataclass(frozen=True)
class Rule:
    """Which roles may call a method, and a check of the request's fields against the caller:
    `check`, or with `tenant_field`, that the caller may touch the tenant that field names."""

    roles: frozenset[str]
    check: Check | None = None
    tenant_field: str | None = None

    def apply(self, method: str, principal: Principal, request: Any,
              max_id_length: int = MAX_ID_LENGTH) -> None:
        """Raise PermissionDenied unless `principal` may make this call; InvalidArgument when a
        tenant or holder id it checks is not an id (`check_identifier`, at `max_id_length`)."""
        if not principal.is_admin and principal.role not in self.roles:
            raise PermissionDenied(f"role {principal.role} may not call {method}",
                                   method=method, role=principal.role)
        if principal.is_admin:
            return
        limit = _ID_LIMIT.set(max_id_length)
        try:
            if self.tenant_field is not None:
                deny_tenant(principal, getattr(request, self.tenant_field), self.tenant_field)
            if self.check is not None:
                self.check(principal, request)
        finally:
            _ID_LIMIT.reset(limit)


def rule(*roles: str, check: Check | None = None, tenant_field: str | None = None) -> Rule:
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown roles {unknown}")
    return Rule(frozenset(roles), check, tenant_field)


# The id length limit of the rule being applied (`Rule.apply`).
_ID_LIMIT: contextvars.ContextVar[int] = contextvars.ContextVar(
    "kvbridge_id_limit", default=MAX_ID_LENGTH)


def shown(value: str) -> str:
    """`value` as an error message or a log line may repeat it: quoted, and cut to a bounded
    length (a caller's value is never echoed whole)."""
    if len(value) <= _SHOWN_LENGTH:
        return repr(value)
    return f"{value[:_SHOWN_LENGTH]!r}... ({len(value)} characters)"


def _cut(value: str) -> str:
    """`value` for an error's metadata (trailers): at most a bounded length of it."""
    return value if len(value) <= _SHOWN_LENGTH else value[:_SHOWN_LENGTH] + "..."


def deny_tenant(principal: Principal, tenant: str, field: str = "tenant") -> None:
    """PermissionDenied unless `principal` may touch `tenant`; first, InvalidArgument when a
    tenant is named that is not an id (so that nothing unbounded reaches the refusal)."""
    if tenant:
        check_identifier(field, tenant, _ID_LIMIT.get())
    if not principal.may_tenant(tenant):
        raise PermissionDenied(f"{principal.name} may not touch tenant {shown(tenant)}",
                               field=field, tenant=_cut(tenant))


def deny_holder(principal: Principal, holder_id: str, field: str = "holder_id") -> None:
    """PermissionDenied unless `principal` (a holder) may act as `holder_id`; InvalidArgument
    first when a holder id is named that is not an id."""
    if principal.role == "holder":
        if holder_id:
            check_identifier(field, holder_id, _ID_LIMIT.get())
        if not principal.may_hold(holder_id):
            raise PermissionDenied(f"{principal.name} may not act as holder {shown(holder_id)}",
                                   field=field, holder_id=_cut(holder_id))


def check_holder_field(field: str = "holder_id") -> Check:
    def check(principal: Principal, request: Any) -> None:
        deny_holder(principal, getattr(request, field), field)

    return check


# ---- TLS ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files. A server serves TLS with `cert` + `key` and, with `client_auth`, requires
    client certificates signed by `ca` (mutual TLS). A client trusts `ca` (else the system's
    roots) and presents `cert` + `key` when given (for a server that requires them)."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    client_auth: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def validate(self, *, server: bool) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls_cert and tls_key go together")
        if server and self.ca and not self.cert:
            raise ValueError("a TLS server needs tls_cert and tls_key (tls_ca alone is for "
                             "clients)")
        if self.client_auth and not (self.ca and self.cert):
            raise ValueError("tls_client_auth needs tls_ca (the clients' CA) and a server "
                             "certificate")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"tls_{name}: no file {path}")

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials:
        self.validate(server=True)
        key, cert = self._read("key"), self._read("cert")
        assert key is not None and cert is not None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=self._read("ca") if self.client_auth else None,
            require_client_auth=self.client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        self.validate(server=False)
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca"),
                                            private_key=self._read("key"),
                                            certificate_chain=self._read("cert"))


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def describe(table: TokenTable | None, tls: TlsFiles) -> dict[str, Any]:
    """For a server's start line: how callers are authenticated (never a token)."""
    return {"auth": "tokens" if table is not None else "off (insecure local mode)",
            "token_roles": table.roles() if table is not None else None,
            "tls": ("mutual" if tls.client_auth else "on") if tls.cert else "off"}


def require_secured(table: TokenTable | None, insecure: bool, service: str) -> None:
    """A server with no token table starts only in insecure local mode."""
    if table is None and not insecure:
        raise ValueError(
            f"the {service} has no authentication configured: give it a token table "
            f"(--auth-tokens-file FILE or {TOKENS_FILE_ENV}=FILE, or its lines in "
            f"{TOKENS_ENV} separated by ';'; see `kvbridge auth --help`) or, on a trusted "
            f"local machine only, run it with --insecure ({INSECURE_ENV}=1)")


def is_loopback_host(host: str) -> bool:
    """Whether a listen host names a loopback address ('localhost', 127.x, ::1)."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(logger: Any, service: str, listen: str, host: str,
                    table: TokenTable | None, tls: TlsFiles) -> str | None:
    """At a server's start: a loud warning (and the event's name) when it listens on `host`
    beyond loopback unprotected: in insecure local mode (`insecure_mode_on_network`: anyone who
    reaches it is an admin), or with tokens but no TLS (`tokens_without_tls`: bearer tokens
    cross the network in the clear). None, and no warning, otherwise."""
    if is_loopback_host(host):
        return None
    if table is None:
        event = "insecure_mode_on_network"
        logger.warning(event, service=service, listen=listen,
                       risk="no authentication on a non-loopback address: every caller that "
                            "reaches it is an admin",
                       fix="give it --auth-tokens-file and --tls-cert/--tls-key, or listen on "
                           "127.0.0.1")
        return event
    if not tls.cert:
        event = "tokens_without_tls"
        logger.warning(event, service=service, listen=listen,
                       risk="bearer tokens cross the network in the clear on a non-loopback "
                            "address",
                       fix="add --tls-cert/--tls-key (and --tls-ca for clients), or listen on "
                           "127.0.0.1")
        return event
    return None


# ---- configuration ------------------------------------------------------------------------------

def _setting(default: Any, help: str, env: str) -> Any:
    from kvbridge.config import setting

    return setting(default, help, env=env)


@dataclasses.dataclass(frozen=True)
class SecuritySettings:
    """The security settings every kvbridge server shares (a base of its config class)."""

    insecure: bool = _setting(
        False, "insecure local mode: run with no token table (every caller is an admin); "
        "for a trusted local machine only. Without it a server refuses to start "
        "unauthenticated; with it on a non-loopback --listen, it warns loudly at start "
        "(insecure_mode_on_network), as it does with tokens but no TLS (tokens_without_tls)",
        INSECURE_ENV)
    auth_tokens_file: str = _setting(
        "", "token table file: 'TOKEN ROLE [holder=IDS] [tenants=IDS] [name=LABEL]' lines, "
        "roles admin|holder|reader|gateway|router|tenant, TOKEN may be sha256:<hex> "
        "(see `kvbridge auth --help`)", TOKENS_FILE_ENV)
    auth_tokens: str = _setting(
        "", "token table lines inline (';'-separated), added to --auth-tokens-file's",
        TOKENS_ENV)
    tls_cert: str = _setting("", "PEM certificate: serve TLS (and present it to servers "
                             "that require client certificates)", "KVBRIDGE_TLS_CERT")
    tls_key: str = _setting("", "PEM private key of --tls-cert", "KVBRIDGE_TLS_KEY")
    tls_ca: str = _setting("", "PEM CA: trust it for outgoing connections (which then use "
                           "TLS) and, with --tls-client-auth, for client certificates",
                           "KVBRIDGE_TLS_CA")
    tls_client_auth: bool = _setting(
        False, "mutual TLS: require client certificates signed by --tls-ca",
        "KVBRIDGE_TLS_CLIENT_AUTH")

    def check_security(self) -> None:
        """Validate TLS files and the token table (ValueError with the reason)."""
        self.tls_files().validate(server=True)
        self.token_table()

    def token_table(self) -> TokenTable | None:
        return TokenTable.load(self.auth_tokens_file, self.auth_tokens)

    def tls_files(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca, self.tls_client_auth)

    def client_tls(self) -> TlsFiles | None:
        """TLS for this server's own outgoing calls: on when tls_ca is set."""
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca) if self.tls_ca else None


def bind(server: grpc.aio.Server, address: str, tls: TlsFiles) -> int:
    """Bind `server` to `address`, with TLS when `tls` has a certificate; the port, 0 on
    failure."""
    if tls.cert:
        return int(server.add_secure_port(address, tls.server_credentials()))
    return int(server.add_insecure_port(address))
