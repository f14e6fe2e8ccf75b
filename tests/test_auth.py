"""Authentication and authorization: the token table, every role against every registry and
router method over real gRPC, tenant and holder isolation, the insecure-mode guard, and TLS
(server-only and mutual) with certificates made here."""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner
from conftest import KvKit, ThreadedRegistry, start_registry
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge import auth
from kvbridge._grpc_status import error_info
from kvbridge.auth import TokenTable, hash_token
from kvbridge.cli import main
from kvbridge.clients import AsyncRegistryClient
from kvbridge.clock import FakeClock
from kvbridge.errors import PermissionDenied, Unauthenticated
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc
from kvbridge.router.v1 import router_pb2 as rpb
from kvbridge.router.v1 import router_pb2_grpc as rpb_grpc
from kvbridge.services.registry import RegistryServer
from kvbridge.services.router import RouterConfig
from kvbridge.services.router import create_server as create_router

ADMIN = "admin-token-0123456789"
HOLDER = "holder-token-0123456789"
READER = "reader-token-0123456789"
GATEWAY = "gateway-token-0123456789"
ROUTER = "router-token-0123456789"
TENANT = "tenant-acme-token-0123456789"
READER_ACME = "reader-acme-token-0123456789"

TOKENS = "\n".join([
    f"{ADMIN} admin name=ops",
    f"{HOLDER} holder holder=dec-0,dec-9",
    f"{hash_token(READER)} reader name=prefill",  # written hashed: the file holds no secret
    f"{GATEWAY} gateway",
    f"{ROUTER} router",
    f"{TENANT} tenant tenants=acme",
    f"{READER_ACME} reader tenants=acme",
])


# ---- the token table --------------------------------------------------------------------------

def test_token_table_parses_roles_scopes_and_hashed_tokens() -> None:
    table = TokenTable.parse(TOKENS + "\n# a comment\n\n")
    assert len(table) == 7
    holder = table.lookup(HOLDER)
    assert holder is not None and holder.role == "holder"
    assert holder.may_hold("dec-0") and holder.may_hold("dec-9") and not holder.may_hold("dec-1")
    reader = table.lookup(READER)
    assert reader is not None and reader.name == "prefill" and reader.tenants is None
    tenant = table.lookup(TENANT)
    assert tenant is not None and tenant.single_tenant == "acme"
    assert tenant.may_tenant("acme") and not tenant.may_tenant("globex")
    assert table.lookup("not-a-known-token-at-all") is None
    assert table.lookup(hash_token(READER)) is None  # the hash is not itself a credential
    assert table.roles() == {"admin": 1, "holder": 1, "reader": 2, "gateway": 1, "router": 1,
                             "tenant": 1}
    # `;` separates entries in the environment variable's one line.
    assert len(TokenTable.parse(f"{ADMIN} admin; {GATEWAY} gateway")) == 2


@pytest.mark.parametrize("text, message", [
    ("", "no tokens"),
    (f"{ADMIN}", "expected TOKEN ROLE"),
    (f"{ADMIN} superuser", "unknown role"),
    (f"{HOLDER} holder", "needs holder="),
    (f"{TENANT} tenant", "needs tenants="),
    (f"{READER} reader holder=x", "holder= applies to role holder only"),
    (f"{ADMIN} admin tenants=acme", "not limited to tenants"),
    (f"{READER} reader colour=blue", "expected holder=IDS"),
    ("short reader", "at least 16 characters"),
    (f"{ADMIN} admin\n{ADMIN} reader", "appears twice"),
])
def test_token_table_errors_name_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenTable.parse(text, "tokens.txt")


def test_token_file_that_cannot_be_read_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the token file"):
        TokenTable.load(str(tmp_path / "missing.txt"))
    (tmp_path / "t.txt").write_text(f"{ADMIN} admin\n")
    table = TokenTable.load(str(tmp_path / "t.txt"), f"{GATEWAY} gateway")
    assert table is not None and len(table) == 2


def test_bearer_metadata_forms() -> None:
    assert auth.bearer([("authorization", "Bearer abc")]) == "abc"
    assert auth.bearer([("x-other", "1")]) is None
    with pytest.raises(Unauthenticated):
        auth.bearer([("authorization", "Basic abc")])
    with pytest.raises(Unauthenticated):
        auth.bearer([("authorization", "Bearer ")])


# ---- a registry with authentication, over real gRPC --------------------------------------------

@pytest.fixture
async def secured() -> AsyncIterator[RegistryServer]:
    server = await start_registry(FakeClock(), auth_tokens=TOKENS)
    yield server
    await server.stop(0)


def _md(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return auth.call_metadata(token) or None


async def _code(coro: Any) -> tuple[grpc.StatusCode, str]:
    """The call's status code and ErrorInfo reason (OK, '' when it succeeded)."""
    try:
        await coro
    except grpc.aio.AioRpcError as err:
        info = error_info(err)
        return err.code(), info.reason if info is not None else ""
    return grpc.StatusCode.OK, ""


class Fleet:
    """A holder dec-0 with one lease for acme/c1 and one for globex/g1, set up by the admin;
    a holder dec-1 (not the holder token's) with one lease for acme/c2."""

    def __init__(self, server: RegistryServer) -> None:
        self.kv = KvKit()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = pb_grpc.RegistryServiceStub(self.channel)
        self.tokens = self.kv.tokens(12)
        self.leases: dict[str, str] = {}

    async def setup(self) -> Fleet:
        admin = _md(ADMIN)
        for holder in ("dec-0", "dec-1", "dec-9"):
            await self.stub.RegisterHolder(pb.RegisterHolderRequest(
                **self.kv.holder_args(holder)), metadata=admin)
        for name, holder, tenant, conv in (("acme", "dec-0", "acme", "c1"),
                                            ("globex", "dec-0", "globex", "g1"),
                                            ("other_holder", "dec-1", "acme", "c2")):
            resp = await self.stub.GrantLease(pb.GrantLeaseRequest(
                **self.kv.grant_args(holder, tenant, conv, self.tokens)), metadata=admin)
            self.leases[name] = resp.lease.lease_id
        return self

    async def state(self, name: str) -> int:
        resp = await self.stub.GetLease(pb.GetLeaseRequest(lease_id=self.leases[name]),
                                        metadata=_md(ADMIN))
        return int(resp.lease.state)

    def calls(self, token: str | None) -> dict[str, Any]:
        """One well-formed call per method, as a caller scoped to dec-0 and acme would make."""
        md, s, kv = _md(token), self.stub, self.kv
        return {
            "RegisterHolder": lambda: s.RegisterHolder(pb.RegisterHolderRequest(
                **kv.holder_args("dec-9")), metadata=md),
            "HeartbeatHolder": lambda: s.HeartbeatHolder(
                pb.HeartbeatHolderRequest(holder_id="dec-9"), metadata=md),
            "DeregisterHolder": lambda: s.DeregisterHolder(
                pb.DeregisterHolderRequest(holder_id="dec-9"), metadata=md),
            "ListHolders": lambda: s.ListHolders(pb.ListHoldersRequest(), metadata=md),
            "GrantLease": lambda: s.GrantLease(pb.GrantLeaseRequest(
                **kv.grant_args("dec-0", "acme", "c9", self.tokens)), metadata=md),
            "RenewLeases": lambda: s.RenewLeases(
                pb.RenewLeasesRequest(lease_ids=[self.leases["acme"]]), metadata=md),
            "RevokeLease": lambda: s.RevokeLease(
                pb.RevokeLeaseRequest(lease_id="no-such-lease"), metadata=md),
            "GetLease": lambda: s.GetLease(
                pb.GetLeaseRequest(lease_id=self.leases["acme"]), metadata=md),
            "ListLeases": lambda: s.ListLeases(
                pb.ListLeasesRequest(tenant="acme", holder_id="dec-0"), metadata=md),
            "AcquireRead": lambda: s.AcquireRead(pb.AcquireReadRequest(
                tenant="acme", conversation_id="c1",
                block_hashes=kv.prompt_hashes(self.tokens)), metadata=md),
            "PinLease": lambda: s.PinLease(
                pb.PinLeaseRequest(tenant="acme", conversation_id="c1"), metadata=md),
            "ReleaseRead": lambda: s.ReleaseRead(
                pb.ReleaseReadRequest(pin_id="no-such-pin"), metadata=md),
            "GetServerInfo": lambda: s.GetServerInfo(pb.GetServerInfoRequest(), metadata=md),
            "WatchLeases": lambda: _watch_briefly(s, md),
        }


async def _watch_briefly(stub: pb_grpc.RegistryServiceStub, md: Any) -> None:
    """A watch that is let in stays open: it ends in DEADLINE_EXCEEDED, not a denial."""
    call = stub.WatchLeases(pb.WatchLeasesRequest(tenant="acme", holder_id="dec-0"),
                            metadata=md, timeout=0.3)
    async for _ in call:
        pass


# What each role may call: written out here, apart from the server's own rules table.
REGISTRY_ALLOWED = {
    ADMIN: {"RegisterHolder", "HeartbeatHolder", "DeregisterHolder", "ListHolders",
            "GrantLease", "RenewLeases", "RevokeLease", "GetLease", "ListLeases",
            "AcquireRead", "PinLease", "ReleaseRead", "GetServerInfo", "WatchLeases"},
    HOLDER: {"RegisterHolder", "HeartbeatHolder", "DeregisterHolder", "GrantLease",
             "RenewLeases", "RevokeLease", "GetLease", "ListLeases", "GetServerInfo",
             "WatchLeases"},
    READER: {"AcquireRead", "PinLease", "ReleaseRead", "GetServerInfo"},
    GATEWAY: {"RenewLeases", "RevokeLease", "GetLease", "ListLeases", "AcquireRead",
              "PinLease", "ReleaseRead", "GetServerInfo", "WatchLeases"},
    ROUTER: {"RenewLeases", "RevokeLease", "GetLease", "ListLeases", "AcquireRead",
             "PinLease", "ReleaseRead", "GetServerInfo", "WatchLeases"},
    TENANT: {"RenewLeases", "RevokeLease", "GetLease", "ListLeases", "GetServerInfo",
             "WatchLeases"},
}
DENIED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.parametrize("token", list(REGISTRY_ALLOWED), ids=lambda t: t.split("-")[0])
async def test_each_role_against_each_registry_method(secured: RegistryServer,
                                                      token: str) -> None:
    fleet = await Fleet(secured).setup()
    try:
        outcome = {}
        for method, call in fleet.calls(token).items():
            outcome[method] = await _code(call())
        for method, (code, reason) in outcome.items():
            if method in REGISTRY_ALLOWED[token]:
                assert code not in DENIED, (method, code, reason)
            else:
                assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED,
                                          "PERMISSION_DENIED"), method
        assert len(outcome) == len(pb.DESCRIPTOR.services_by_name["RegistryService"].methods)
    finally:
        await fleet.channel.close()


async def test_calls_without_a_valid_token_are_unauthenticated(secured: RegistryServer) -> None:
    fleet = await Fleet(secured).setup()
    try:
        for token in (None, "an-unknown-token-0123456789"):
            for method, call in fleet.calls(token).items():
                assert await _code(call()) == (grpc.StatusCode.UNAUTHENTICATED,
                                               "UNAUTHENTICATED"), method
        bad = (("authorization", f"Basic {ADMIN}"),)
        code = await _code(fleet.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=bad))
        assert code == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        # Health stays open: load balancers and orchestrators probe it without a token.
        health = health_pb2_grpc.HealthStub(fleet.channel)
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Nothing was changed by the refused calls: the holder dec-9 is still registered.
        holders = await fleet.stub.ListHolders(pb.ListHoldersRequest(), metadata=_md(ADMIN))
        assert "dec-9" in {h.holder_id for h in holders.holders}
    finally:
        await fleet.channel.close()


async def test_a_tenant_cannot_reach_another_tenants_conversation(
        secured: RegistryServer) -> None:
    fleet = await Fleet(secured).setup()
    s, md = fleet.stub, _md(TENANT)
    globex = fleet.leases["globex"]
    try:
        denied = [
            s.GetLease(pb.GetLeaseRequest(lease_id=globex), metadata=md),
            s.RevokeLease(pb.RevokeLeaseRequest(lease_id=globex, reason="x"), metadata=md),
            s.RenewLeases(pb.RenewLeasesRequest(lease_ids=[fleet.leases["acme"], globex]),
                          metadata=md),
            s.RenewLeases(pb.RenewLeasesRequest(conversations=[pb.ConversationRef(
                tenant="globex", conversation_id="g1")]), metadata=md),
            s.ListLeases(pb.ListLeasesRequest(tenant="globex"), metadata=md),
        ]
        for call in denied:
            assert await _code(call) == (grpc.StatusCode.PERMISSION_DENIED,
                                         "PERMISSION_DENIED")
        assert await fleet.state("globex") == pb.LEASE_STATE_ACTIVE  # the revoke changed nothing
        # Listing without a tenant is scoped to the token's own.
        listed = await s.ListLeases(pb.ListLeasesRequest(), metadata=md)
        assert {x.tenant for x in listed.leases} == {"acme"}
        assert {x.lease_id for x in listed.leases} == {fleet.leases["acme"],
                                                       fleet.leases["other_holder"]}
        # Its own conversation it may touch.
        resp = await s.RevokeLease(pb.RevokeLeaseRequest(lease_id=fleet.leases["acme"],
                                                         reason="done"), metadata=md)
        assert resp.lease.state == pb.LEASE_STATE_REVOKED
        # A reader limited to acme cannot read globex's KV.
        code = await _code(s.AcquireRead(pb.AcquireReadRequest(
            tenant="globex", conversation_id="g1",
            block_hashes=fleet.kv.prompt_hashes(fleet.tokens)), metadata=_md(READER_ACME)))
        assert code == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
    finally:
        await fleet.channel.close()


async def test_a_tenants_watch_sees_only_its_own_events(secured: RegistryServer) -> None:
    fleet = await Fleet(secured).setup()
    try:
        call = fleet.stub.WatchLeases(pb.WatchLeasesRequest(), metadata=_md(TENANT))
        await asyncio.sleep(0.2)  # the watch is registered before the grants below
        for tenant in ("globex", "acme"):
            await fleet.stub.GrantLease(pb.GrantLeaseRequest(**fleet.kv.grant_args(
                "dec-0", tenant, "w1", fleet.tokens)), metadata=_md(HOLDER))
        event = (await asyncio.wait_for(call.read(), 5.0)).event
        assert (event.tenant, event.conversation_id) == ("acme", "w1")
        call.cancel()
    finally:
        await fleet.channel.close()


async def test_a_holder_touches_only_its_own_leases(secured: RegistryServer) -> None:
    fleet = await Fleet(secured).setup()
    s, md = fleet.stub, _md(HOLDER)
    other = fleet.leases["other_holder"]
    try:
        denied = [
            s.RevokeLease(pb.RevokeLeaseRequest(lease_id=other, reason="x"), metadata=md),
            s.RevokeLease(pb.RevokeLeaseRequest(lease_id=other, holder_id="dec-1"),
                          metadata=md),
            s.RenewLeases(pb.RenewLeasesRequest(lease_ids=[other]), metadata=md),
            s.GetLease(pb.GetLeaseRequest(lease_id=other), metadata=md),
            s.GrantLease(pb.GrantLeaseRequest(**fleet.kv.grant_args(
                "dec-1", "acme", "c7", fleet.tokens)), metadata=md),
            s.RegisterHolder(pb.RegisterHolderRequest(**fleet.kv.holder_args("dec-1")),
                             metadata=md),
            s.HeartbeatHolder(pb.HeartbeatHolderRequest(holder_id="dec-1"), metadata=md),
            s.DeregisterHolder(pb.DeregisterHolderRequest(holder_id="dec-1"), metadata=md),
            s.RenewLeases(pb.RenewLeasesRequest(conversations=[pb.ConversationRef(
                tenant="acme", conversation_id="c2")]), metadata=md),
            s.ListLeases(pb.ListLeasesRequest(holder_id="dec-1"), metadata=md),
            # Two holders in the token's scope: a listing must name which.
            s.ListLeases(pb.ListLeasesRequest(), metadata=md),
        ]
        for call in denied:
            assert (await _code(call))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert await fleet.state("other_holder") == pb.LEASE_STATE_ACTIVE
        listed = await s.ListLeases(pb.ListLeasesRequest(holder_id="dec-0"), metadata=md)
        assert {x.holder_id for x in listed.leases} == {"dec-0"}
        resp = await s.RevokeLease(pb.RevokeLeaseRequest(lease_id=fleet.leases["globex"],
                                                         reason="memory"), metadata=md)
        assert resp.lease.state == pb.LEASE_STATE_REVOKED
    finally:
        await fleet.channel.close()


async def test_the_client_library_sends_its_token(secured: RegistryServer) -> None:
    target = f"127.0.0.1:{secured.port}"
    async with AsyncRegistryClient(target, token=ADMIN) as client:
        assert (await client.get_server_info()).version
    async with AsyncRegistryClient(target, token=READER) as client:
        with pytest.raises(PermissionDenied):
            await client.list_holders()
    async with AsyncRegistryClient(target) as client:
        with pytest.raises(Unauthenticated):
            await client.get_server_info()


# ---- the router --------------------------------------------------------------------------------

async def test_router_roles_and_its_own_registry_token(secured: RegistryServer) -> None:
    fleet = await Fleet(secured).setup()
    router = await create_router(RouterConfig(
        listen="127.0.0.1:0", registry=f"127.0.0.1:{secured.port}", metrics_listen="",
        auth_tokens=TOKENS, token=ROUTER))
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    stub = rpb_grpc.RouterServiceStub(channel)

    def register(token: str, role: Any, engine: str, name: str) -> Any:
        return stub.RegisterInstance(rpb.RegisterInstanceRequest(
            instance_id=name, role=role, http_url="http://127.0.0.1:1", engine_id=engine,
            nixl_host="127.0.0.1", nixl_port=1, model="m"), metadata=_md(token))

    try:
        ok = grpc.StatusCode.OK
        assert (await _code(register(HOLDER, rpb.ROLE_DECODE, "dec-0", "d0")))[0] == ok
        assert (await _code(register(READER, rpb.ROLE_PREFILL, "pre-0", "p0")))[0] == ok
        denied = [register(HOLDER, rpb.ROLE_PREFILL, "dec-0", "x1"),
                  register(HOLDER, rpb.ROLE_DECODE, "dec-1", "x2"),
                  register(READER, rpb.ROLE_DECODE, "pre-0", "x3"),
                  register(GATEWAY, rpb.ROLE_PREFILL, "pre-1", "x4"),
                  stub.Route(rpb.RouteRequest(tenant="acme", conversation_id="c1", model="m"),
                             metadata=_md(READER)),
                  stub.ListInstances(rpb.ListInstancesRequest(), metadata=_md(HOLDER)),
                  stub.AcquireRead(pb.AcquireReadRequest(tenant="globex", conversation_id="g1"),
                                   metadata=_md(READER_ACME))]
        for call in denied:
            assert (await _code(call))[0] == grpc.StatusCode.PERMISSION_DENIED
        code = await _code(stub.Route(rpb.RouteRequest(model="m"), metadata=None))
        assert code[0] == grpc.StatusCode.UNAUTHENTICATED
        # The gateway routes, and the router pins acme/c1 at the registry with its own token.
        route = await stub.Route(rpb.RouteRequest(
            tenant="acme", conversation_id="c1", model="m", prompt_tokens=12, pin_read=True),
            metadata=_md(GATEWAY))
        assert route.decode.instance_id == "d0" and route.lease_holder_id == "dec-0"
        assert route.read.read.pin.pin_id, "the router's registry token was refused"
        # A prefill reads through the router; the router forwards with its token.
        read = await stub.AcquireRead(pb.AcquireReadRequest(
            tenant="acme", conversation_id="c1",
            block_hashes=fleet.kv.prompt_hashes(fleet.tokens)), metadata=_md(READER))
        assert read.pin.pin_id and read.matched_blocks == 3
    finally:
        await channel.close()
        await router.stop(0)
        await fleet.channel.close()


# ---- insecure local mode -----------------------------------------------------------------------

def test_a_server_without_tokens_refuses_to_start_unless_insecure() -> None:
    for group in ("registry", "router"):
        result = CliRunner().invoke(main, [group, "serve", "--listen", "127.0.0.1:0",
                                           "--metrics-listen", ""])
        assert result.exit_code == 2, result.output
        assert "no authentication configured" in result.output
        assert "--insecure" in result.output
    result = CliRunner().invoke(main, ["gateway", "serve", "--listen", "127.0.0.1:0"])
    assert result.exit_code == 1 and "no API keys configured" in result.output


def test_insecure_mode_is_said_in_the_start_line() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", "registry", "serve", "--insecure", "--listen",
         "127.0.0.1:0", "--metrics-listen", "", "--log-format", "json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "registry_started" in line:
                assert '"auth": "off (insecure local mode)"' in line
                assert '"tls": "off"' in line
                break
        else:
            pytest.fail("no registry_started line")
    finally:
        proc.terminate()
        proc.wait(10)


def test_cli_commands_take_a_token() -> None:
    registry = ThreadedRegistry(auth_tokens=TOKENS)
    try:
        runner = CliRunner()
        result = runner.invoke(main, ["holders", "list", "--registry", registry.target])
        assert result.exit_code == 1 and "UNAUTHENTICATED" in result.output
        result = runner.invoke(main, ["holders", "list", "--registry", registry.target,
                                      "--token", READER])
        assert result.exit_code == 1 and "PERMISSION_DENIED" in result.output
        result = runner.invoke(main, ["holders", "list", "--registry", registry.target],
                               env={"KVBRIDGE_TOKEN": ADMIN})
        assert result.exit_code == 0, result.output
    finally:
        registry.close()


# ---- TLS ---------------------------------------------------------------------------------------

def _pki(tmp: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key: Any, cert: x509.Certificate) -> None:
        (tmp / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        (tmp / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("kvbridge test CA"))
          .issuer_name(name("kvbridge test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    write("ca", ca_key, ca)
    import ipaddress

    for stem, usage, sans in (
            ("server", ExtendedKeyUsageOID.SERVER_AUTH,
             [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("decode-0")])):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(stem, key, cert)
    return {k: str(tmp / f) for k, f in (("ca", "ca.pem"), ("cert", "server.pem"),
                                         ("key", "server.key"), ("client_cert", "client.pem"),
                                         ("client_key", "client.key"))}


async def test_tls_and_mutual_tls(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    server = await start_registry(FakeClock(), auth_tokens=TOKENS, tls_cert=pki["cert"],
                                  tls_key=pki["key"])
    target = f"127.0.0.1:{server.port}"
    try:
        tls = auth.TlsFiles(ca=pki["ca"])
        async with AsyncRegistryClient(target, token=ADMIN, tls=tls, timeout=5) as client:
            assert (await client.get_server_info()).version
        async with AsyncRegistryClient(target, token=ADMIN, timeout=1, retries=0) as client:
            with pytest.raises(Exception) as err:  # plaintext to a TLS port: no connection
                await client.get_server_info()
            assert getattr(err.value, "reason", "") in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    finally:
        await server.stop(0)

    server = await start_registry(FakeClock(), auth_tokens=TOKENS, tls_cert=pki["cert"],
                                  tls_key=pki["key"], tls_ca=pki["ca"], tls_client_auth=True)
    target = f"127.0.0.1:{server.port}"
    try:
        mutual = auth.TlsFiles(cert=pki["client_cert"], key=pki["client_key"], ca=pki["ca"])
        async with AsyncRegistryClient(target, token=ADMIN, tls=mutual, timeout=5) as client:
            assert (await client.get_server_info()).version
        async with AsyncRegistryClient(target, token=ADMIN, tls=auth.TlsFiles(ca=pki["ca"]),
                                       timeout=1, retries=0) as client:
            with pytest.raises(Exception) as err:  # no client certificate: refused
                await client.get_server_info()
            assert getattr(err.value, "reason", "") in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    finally:
        await server.stop(0)


def test_tls_settings_are_checked_at_startup(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["registry", "serve", "--insecure", "--tls-cert",
                                       str(tmp_path / "nope.pem"), "--tls-key",
                                       str(tmp_path / "nope.key")])
    assert result.exit_code == 2 and "tls_cert: no file" in result.output
    result = CliRunner().invoke(main, ["registry", "serve", "--insecure", "--tls-cert",
                                       str(tmp_path / "nope.pem")])
    assert result.exit_code == 2 and "tls_cert and tls_key go together" in result.output


# ---- tenant quotas -----------------------------------------------------------------------------

async def test_a_tenant_over_quota_gives_up_its_own_oldest_kv_not_anothers(
        tmp_path: Path) -> None:
    """acme may hold 2 leases and 8 blocks; globex is unlimited. acme's third conversation
    revokes acme's soonest-expiring unpinned lease; globex's leases are never touched; a pinned
    lease is not revoked, and when nothing can give way the grant is refused with
    RESOURCE_EXHAUSTED / TENANT_QUOTA_EXCEEDED and nothing changes."""
    quotas = tmp_path / "quotas.txt"
    quotas.write_text("# tenant max_leases max_blocks\nacme 2 8\nglobex 0 0\n")
    clock = FakeClock()
    server = await start_registry(clock, auth_tokens=TOKENS, tenant_max_leases=1,
                                  tenant_quota_file=str(quotas))
    kv = KvKit()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    s, md = pb_grpc.RegistryServiceStub(channel), _md(ADMIN)

    async def grant(tenant: str, conv: str, n_tokens: int = 12) -> pb.Lease:
        resp = await s.GrantLease(pb.GrantLeaseRequest(**kv.grant_args(
            "dec-0", tenant, conv, kv.tokens(n_tokens))), metadata=md)
        return resp.lease

    async def state(lease: pb.Lease) -> int:
        got = await s.GetLease(pb.GetLeaseRequest(lease_id=lease.lease_id), metadata=md)
        return int(got.lease.state)

    try:
        await s.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-0")), metadata=md)
        g = [await grant("globex", f"g{i}") for i in range(4)]  # no limit for globex
        a1 = await grant("acme", "a1")
        clock.advance(1.0)
        a2 = await grant("acme", "a2")
        clock.advance(1.0)
        a3 = await grant("acme", "a3")  # 3 leases > 2: a1 (soonest to expire) gives way
        assert [await state(x) for x in (a1, a2, a3)] == [
            pb.LEASE_STATE_REVOKED, pb.LEASE_STATE_ACTIVE, pb.LEASE_STATE_ACTIVE]
        assert {await state(x) for x in g} == {pb.LEASE_STATE_ACTIVE}
        # A new turn of a3 supersedes a3 itself: no other lease has to go.
        a3b = await grant("acme", "a3", 16)
        assert await state(a2) == pb.LEASE_STATE_ACTIVE and a3b.epoch == 2
        # Pin a2 and a3: a fourth conversation finds nothing to revoke and is refused.
        for conv in ("a2", "a3"):
            pin = await s.PinLease(pb.PinLeaseRequest(tenant="acme", conversation_id=conv),
                                   metadata=md)
            assert pin.read.pin.pin_id
        assert await _code(grant("acme", "a4")) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                    "TENANT_QUOTA_EXCEEDED")
        listed = await s.ListLeases(pb.ListLeasesRequest(tenant="acme"), metadata=md)
        assert {x.conversation_id for x in listed.leases} == {"a2", "a3"}
        # One lease bigger than the block quota on its own is refused outright.
        assert (await _code(grant("acme", "a2", 40)))[1] == "TENANT_QUOTA_EXCEEDED"
        # The default quota (1 lease) applies to a tenant the file does not name.
        i1 = await grant("initech", "i1")
        await grant("initech", "i2")
        assert await state(i1) == pb.LEASE_STATE_REVOKED
        assert server.table.tenant_usage("acme") == (2, 7)
    finally:
        await channel.close()
        await server.stop(0)


def test_quota_settings_are_checked(tmp_path: Path) -> None:
    from kvbridge.services.registry import RegistryConfig

    bad = tmp_path / "q.txt"
    bad.write_text("acme two 8\n")
    with pytest.raises(ValueError, match=r"q\.txt:1: expected 'TENANT MAX_LEASES MAX_BLOCKS'"):
        RegistryConfig(tenant_quota_file=str(bad))
    with pytest.raises(ValueError, match=r"must be 0 \(no limit\), positive, or -1"):
        RegistryConfig(tenant_max_blocks=-2)


def test_auth_cli_makes_tokens_a_server_accepts(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["auth", "token", "--role", "holder", "--holder", "dec-0"])
    assert result.exit_code == 0, result.output
    line = result.output.strip()
    token = line.split()[0]
    assert line.endswith("holder holder=dec-0") and token.startswith("kvb_")
    result = runner.invoke(main, ["auth", "token", "--role", "tenant"])
    assert result.exit_code == 2 and "needs tenants=" in result.output
    hashed = runner.invoke(main, ["auth", "token", "--role", "admin", "--hashed"])
    assert hashed.exit_code == 0
    table = tmp_path / "tokens.txt"
    table.write_text(line + "\n" + hashed.stdout)
    result = runner.invoke(main, ["auth", "check", str(table)])
    assert result.exit_code == 0 and "2 token(s): admin 1, holder 1" in result.output
    loaded = TokenTable.load(str(table))
    assert loaded is not None and loaded.lookup(token) is not None
    (tmp_path / "bad.txt").write_text("x y\n")
    result = runner.invoke(main, ["auth", "check", str(tmp_path / "bad.txt")])
    assert result.exit_code == 1 and "unknown role" in result.output


def test_connector_reads_its_token_from_the_environment_or_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.connector._settings import ConnectorSettings

    monkeypatch.setenv("KVBRIDGE_TOKEN", HOLDER)
    assert ConnectorSettings().token() == HOLDER
    monkeypatch.setenv("DECODE_TOKEN", READER)
    assert ConnectorSettings.from_extra_config(
        {"kvbridge": {"token_env": "DECODE_TOKEN"}}).token() == READER
    (tmp_path / "tok").write_text(GATEWAY + "\n")
    assert ConnectorSettings(token_file=str(tmp_path / "tok")).token() == GATEWAY
    with pytest.raises(ValueError, match="cannot read"):
        ConnectorSettings(token_file=str(tmp_path / "missing")).token()
    with pytest.raises(ValueError, match=r"tls_cert needs kvbridge\.tls_ca"):
        ConnectorSettings(tls_cert="x.pem").tls()


ROUTER_ALLOWED = {
    ADMIN: {"RegisterInstance", "HeartbeatInstance", "DeregisterInstance", "ListInstances",
            "Route", "GetServerInfo", "AcquireRead", "ReleaseRead"},
    HOLDER: {"RegisterInstance", "HeartbeatInstance", "DeregisterInstance", "GetServerInfo"},
    READER: {"RegisterInstance", "HeartbeatInstance", "DeregisterInstance", "GetServerInfo",
             "AcquireRead", "ReleaseRead"},
    GATEWAY: {"ListInstances", "Route", "GetServerInfo", "AcquireRead", "ReleaseRead"},
    ROUTER: {"GetServerInfo"},
    TENANT: {"GetServerInfo"},
}


@pytest.mark.parametrize("token", list(ROUTER_ALLOWED), ids=lambda t: t.split("-")[0])
async def test_each_role_against_each_router_method(secured: RegistryServer,
                                                    token: str) -> None:
    router = await create_router(RouterConfig(
        listen="127.0.0.1:0", registry=f"127.0.0.1:{secured.port}", metrics_listen="",
        auth_tokens=TOKENS, token=ROUTER))
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    stub, md = rpb_grpc.RouterServiceStub(channel), _md(token)
    # A decode engine's token registers a decode instance of its engine; any other a prefill.
    role, engine = ((rpb.ROLE_DECODE, "dec-0") if token == HOLDER
                    else (rpb.ROLE_PREFILL, "pre-0"))
    calls = {
        "RegisterInstance": lambda: stub.RegisterInstance(rpb.RegisterInstanceRequest(
            instance_id="i0", role=role, http_url="http://127.0.0.1:1", engine_id=engine,
            nixl_host="127.0.0.1", nixl_port=1, model="m"), metadata=md),
        "HeartbeatInstance": lambda: stub.HeartbeatInstance(
            rpb.HeartbeatInstanceRequest(instance_id="i0"), metadata=md),
        "DeregisterInstance": lambda: stub.DeregisterInstance(
            rpb.DeregisterInstanceRequest(instance_id="i0"), metadata=md),
        "ListInstances": lambda: stub.ListInstances(rpb.ListInstancesRequest(), metadata=md),
        "Route": lambda: stub.Route(rpb.RouteRequest(
            tenant="acme", conversation_id="c1", model="m"), metadata=md),
        "GetServerInfo": lambda: stub.GetServerInfo(rpb.GetServerInfoRequest(), metadata=md),
        "AcquireRead": lambda: stub.AcquireRead(pb.AcquireReadRequest(
            tenant="acme", conversation_id="c1"), metadata=md),
        "ReleaseRead": lambda: stub.ReleaseRead(
            pb.ReleaseReadRequest(pin_id="no-such-pin"), metadata=md),
    }
    try:
        assert set(calls) == set(
            rpb.DESCRIPTOR.services_by_name["RouterService"].methods_by_name)
        for method, call in calls.items():
            code, reason = await _code(call())
            if method in ROUTER_ALLOWED[token]:
                assert code not in DENIED, (method, code, reason)
            else:
                assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED,
                                          "PERMISSION_DENIED"), method
    finally:
        await channel.close()
        await router.stop(0)
