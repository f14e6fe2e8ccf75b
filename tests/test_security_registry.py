"""The registry's security (issue 32, items 8, 9, 10 and 14): watch streams are capped per
caller, a refused call never echoes an unbounded value, an exposed registry says so, the token
table is reloaded on SIGHUP, denials are logged at a bounded rate, and a registry with tokens
caps each tenant by default. Real registries on 127.0.0.1, real gRPC calls."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from conftest import KvKit, start_registry
from structlog.testing import capture_logs

from kvbridge import _grpc_handlers, auth
from kvbridge._grpc_status import error_info, stream_is_live
from kvbridge.clock import FakeClock
from kvbridge.errors import InvalidArgument, PermissionDenied
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc
from kvbridge.router.v1 import router_pb2 as rpb
from kvbridge.router.v1 import router_pb2_grpc as rpb_grpc
from kvbridge.services.registry import RegistryConfig, RegistryServer
from kvbridge.services.router import RouterConfig
from kvbridge.services.router import create_server as create_router

ADMIN = "admin-token-0123456789"
HOLDER = "holder-token-0123456789"
ACME = "tenant-acme-token-0123456789"
ACME_2 = "tenant-acme-second-token-0123"
GLOBEX = "tenant-globex-token-0123456789"
READER_ACME = "reader-acme-token-0123456789"
GATEWAY_ACME = "gateway-acme-token-0123456789"
TOKENS = ";".join([
    f"{ADMIN} admin name=ops",
    f"{HOLDER} holder holder=dec-0",
    f"{ACME} tenant tenants=acme name=acme-ops",
    f"{ACME_2} tenant tenants=acme name=acme-ops-2",
    f"{GLOBEX} tenant tenants=globex name=globex-ops",
    f"{READER_ACME} reader tenants=acme name=prefill-acme",
    f"{GATEWAY_ACME} gateway tenants=acme name=gw-acme",
])


def md(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return auth.call_metadata(token) or None


async def refused(call: Any, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == code, raised.value.details()
    return raised.value


def trailer_bytes(err: grpc.aio.AioRpcError) -> int:
    return sum(len(k) + len(v) for k, v in (err.trailing_metadata() or ()))


@pytest.fixture
async def secured() -> AsyncIterator[RegistryServer]:
    server = await start_registry(FakeClock(), auth_tokens=TOKENS)
    yield server
    await server.stop(0)


@pytest.fixture
async def stub(secured: RegistryServer) -> AsyncIterator[pb_grpc.RegistryServiceStub]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{secured.port}")
    yield pb_grpc.RegistryServiceStub(channel)
    await channel.close()


@pytest.fixture
async def watch_stub() -> AsyncIterator[pb_grpc.RegistryServiceStub]:
    """A registry that lets in 8 watch streams, 3 of them per caller."""
    server = await start_registry(FakeClock(), auth_tokens=TOKENS, max_watchers=8,
                                  max_watchers_per_principal=3)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.RegistryServiceStub(channel)
    await channel.close()
    await server.stop(0)


# ==== item 8: watch streams are capped per caller ================================================

async def watch(stub: pb_grpc.RegistryServiceStub, token: str) -> Any:
    """A watch stream, once the server has subscribed it (or raised AioRpcError)."""
    call = stub.WatchLeases(pb.WatchLeasesRequest(), metadata=md(token))
    if not stream_is_live(await call.initial_metadata()):
        await call.read()  # the refusal
        pytest.fail("the watch neither went live nor was refused")
    return call


async def test_one_callers_watches_do_not_lock_out_other_tenants_or_the_admin(
        watch_stub: pb_grpc.RegistryServiceStub) -> None:
    """The audit: one tenant's 256 streams (the global cap) locked out every other tenant and
    the admin. Now each caller has at most max_watchers_per_principal (3 here) of max_watchers
    (8); a token is a caller of its own even when it serves the same tenant."""
    stub = watch_stub
    open_calls = [await watch(stub, ACME) for _ in range(3)]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await watch(stub, ACME)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(raised.value)
    assert info is not None and info.reason == "CAPACITY_EXHAUSTED"
    assert info.metadata["scope"] == "principal" and info.metadata["limit"] == "3"
    open_calls.append(await watch(stub, GLOBEX))
    open_calls.append(await watch(stub, ACME_2))
    # The admin is bounded by the global cap only: three more (8 in all) are let in.
    open_calls += [await watch(stub, ADMIN) for _ in range(3)]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await watch(stub, ADMIN)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(raised.value)
    assert info is not None and "scope" not in info.metadata
    # A stream that ends gives its caller's slot back.
    for call in open_calls:
        call.cancel()
    for _ in range(3):
        await watch(stub, ACME)


def test_the_per_caller_watch_cap_defaults_to_a_fraction_of_the_global_one() -> None:
    config = RegistryConfig()
    assert config.max_watchers_per_principal == 16 < config.max_watchers
    with pytest.raises(ValueError, match="max_watchers_per_principal must be positive"):
        RegistryConfig(max_watchers_per_principal=0)


# ==== item 9: a refused call echoes nothing unbounded ============================================

HUGE = "t" * 1_000_000


def registry_calls(stub: pb_grpc.RegistryServiceStub, tenant: str) -> dict[str, Any]:
    """Calls whose tenant the access rules check, each by a caller scoped to acme."""
    kv = KvKit()
    tokens = kv.tokens(8)
    return {
        "AcquireRead": lambda: stub.AcquireRead(pb.AcquireReadRequest(
            tenant=tenant, conversation_id="c1", block_hashes=kv.prompt_hashes(tokens)),
            metadata=md(READER_ACME)),
        "PinLease": lambda: stub.PinLease(pb.PinLeaseRequest(
            tenant=tenant, conversation_id="c1"), metadata=md(READER_ACME)),
        "ListLeases": lambda: stub.ListLeases(pb.ListLeasesRequest(tenant=tenant),
                                              metadata=md(ACME)),
        "RenewLeases": lambda: stub.RenewLeases(pb.RenewLeasesRequest(
            conversations=[pb.ConversationRef(tenant=tenant, conversation_id="c1")]),
            metadata=md(ACME)),
        "GrantLease": lambda: stub.GrantLease(pb.GrantLeaseRequest(
            **kv.grant_args("x" * 300_000, "acme", "c1", tokens)), metadata=md(HOLDER)),
    }


@pytest.mark.parametrize("method", ["AcquireRead", "PinLease", "ListLeases", "RenewLeases",
                                    "GrantLease"])
async def test_an_over_long_id_is_invalid_before_the_access_check(
        stub: pb_grpc.RegistryServiceStub, method: str) -> None:
    """The audit: a refused call echoed a 1 MB tenant into its error, trailers and log line.
    Now an id that is not an id is INVALID_ARGUMENT, with a bounded message, before any
    access decision (GrantLease: the holder id a holder token is checked against)."""
    with capture_logs() as logs:
        err = await refused(registry_calls(stub, HUGE)[method](),
                            grpc.StatusCode.INVALID_ARGUMENT)
    info = error_info(err)
    assert info is not None and info.reason == "INVALID_ARGUMENT"
    assert "longer than 256 characters" in (err.details() or "")
    assert len(err.details() or "") < 200 and trailer_bytes(err) < 1000
    denied = [e for e in logs if e["event"] == "rpc_denied"]
    assert len(denied) == 1 and len(json.dumps(denied[0], default=str)) < 1000


@pytest.mark.parametrize("tenant", ["a b", "caf\u00e9", "tab\there", "nul\x00"])
async def test_a_tenant_that_is_not_an_id_is_invalid_not_denied(
        stub: pb_grpc.RegistryServiceStub, tenant: str) -> None:
    err = await refused(registry_calls(stub, tenant)["AcquireRead"](),
                        grpc.StatusCode.INVALID_ARGUMENT)
    assert "printable ASCII" in (err.details() or "")


async def test_another_tenants_valid_id_is_still_denied_with_a_bounded_echo(
        stub: pb_grpc.RegistryServiceStub) -> None:
    tenant = "g" * 250  # a valid id, but not acme
    err = await refused(registry_calls(stub, tenant)["AcquireRead"](),
                        grpc.StatusCode.PERMISSION_DENIED)
    assert len(err.details() or "") < 150 and "(250 characters)" in (err.details() or "")
    assert trailer_bytes(err) < 600


async def test_the_id_limit_is_the_registrys_own() -> None:
    """With max_id_length 1024 a 300-character tenant is an id: the answer is the access
    check's (PERMISSION_DENIED for another tenant's), not INVALID_ARGUMENT."""
    server = await start_registry(FakeClock(), auth_tokens=TOKENS, max_id_length=1024)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        calls = registry_calls(pb_grpc.RegistryServiceStub(channel), "g" * 300)
        await refused(calls["AcquireRead"](), grpc.StatusCode.PERMISSION_DENIED)
        calls = registry_calls(pb_grpc.RegistryServiceStub(channel), "g" * 1025)
        await refused(calls["AcquireRead"](), grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        await channel.close()
        await server.stop(0)


def test_deny_helpers_never_repeat_a_value_whole() -> None:
    reader = auth.Principal("prefill", "reader", tenants=("acme",))
    with pytest.raises(PermissionDenied) as denied:
        auth.deny_tenant(reader, "z" * 200)
    assert len(denied.value.message) < 150
    assert all(len(str(v)) <= 70 for v in denied.value.metadata.values())
    holder = auth.Principal("decode", "holder", holders=("dec-0",))
    with pytest.raises(PermissionDenied) as denied:
        auth.deny_holder(holder, "d" * 200)
    assert len(denied.value.message) < 150
    with pytest.raises(InvalidArgument):
        auth.deny_holder(holder, "d" * 257)


async def test_the_routers_rules_validate_ids_too() -> None:
    """The router's rules run in the same guard: its Route with a 1 MB tenant is
    INVALID_ARGUMENT with a bounded message, not a denial that repeats it."""
    router = await create_router(RouterConfig(listen="127.0.0.1:0", metrics_listen="",
                                              registry="", auth_tokens=TOKENS),
                                 clock=FakeClock())
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    try:
        stub = rpb_grpc.RouterServiceStub(channel)
        err = await refused(stub.Route(rpb.RouteRequest(tenant=HUGE, conversation_id="c1"),
                                       metadata=md(GATEWAY_ACME)),
                            grpc.StatusCode.INVALID_ARGUMENT)
        assert len(err.details() or "") < 200 and trailer_bytes(err) < 1000
    finally:
        await channel.close()
        await router.stop(0)


# ==== item 14: denials are logged at a bounded rate ==============================================

class Ticks:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_denials_are_logged_at_most_ten_a_second_per_reason(
        stub: pb_grpc.RegistryServiceStub, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit: every unauthenticated call wrote an info line. Now at most 10 a second per
    reason; the next line written says how many were held back."""
    ticks = Ticks()
    monkeypatch.setattr(_grpc_handlers, "_now", ticks)
    with capture_logs() as logs:
        for _ in range(30):
            await refused(stub.GetServerInfo(pb.GetServerInfoRequest()),
                          grpc.StatusCode.UNAUTHENTICATED)
        # Another reason has lines of its own.
        await refused(stub.ListHolders(pb.ListHoldersRequest(), metadata=md(ACME)),
                      grpc.StatusCode.PERMISSION_DENIED)
        ticks.now += 1.0
        await refused(stub.GetServerInfo(pb.GetServerInfoRequest()),
                      grpc.StatusCode.UNAUTHENTICATED)
    denied = [e for e in logs if e["event"] == "rpc_denied"]
    reasons = [e["reason"] for e in denied]
    assert reasons == ["UNAUTHENTICATED"] * 10 + ["PERMISSION_DENIED", "UNAUTHENTICATED"]
    assert "suppressed" not in denied[9]
    assert denied[-1]["suppressed"] == 20


# ==== item 14: a registry with tokens caps each tenant by default =================================

def test_a_registry_with_tokens_caps_tenants_unless_told_otherwise(tmp_path: Path) -> None:
    secured = RegistryConfig(auth_tokens=TOKENS)
    assert (secured.tenant_max_leases, secured.tenant_max_blocks) == (100_000, 10_000_000)
    tokens_file = tmp_path / "tokens.txt"
    tokens_file.write_text(f"{ADMIN} admin\n")
    assert RegistryConfig(auth_tokens_file=str(tokens_file)).tenant_max_leases == 100_000
    assert RegistryConfig(auth_tokens=TOKENS, tenant_max_leases=0).tenant_max_leases == 0
    assert RegistryConfig(auth_tokens=TOKENS, tenant_max_blocks=5).tenant_max_blocks == 5
    local = RegistryConfig(insecure=True)
    assert (local.tenant_max_leases, local.tenant_max_blocks) == (0, 0)


async def test_the_default_caps_reach_the_lease_table(secured: RegistryServer,
                                                      stub: pb_grpc.RegistryServiceStub
                                                      ) -> None:
    """The lease table counts a tenant's usage only while quotas are on: on a registry with
    tokens and no quota settings, they are."""
    kv = KvKit()
    tokens = kv.tokens(8)
    await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-0")),
                              metadata=md(HOLDER))
    await stub.GrantLease(pb.GrantLeaseRequest(**kv.grant_args("dec-0", "acme", "c1", tokens)),
                          metadata=md(HOLDER))
    assert secured.table.tenant_usage("acme") == (1, 2)
    assert secured.table.config.quota_of("acme", {}) == (100_000, 10_000_000)


# ==== item 10: an exposed registry warns; tokens are reloaded on SIGHUP ===========================

@pytest.mark.parametrize(("overrides", "event"), [
    (dict(insecure=True, listen="0.0.0.0:0"), "insecure_mode_on_network"),
    (dict(auth_tokens=TOKENS, listen="0.0.0.0:0"), "tokens_without_tls"),
    (dict(auth_tokens=TOKENS, listen="0.0.0.0:0", tls=True), None),
    (dict(insecure=True, listen="127.0.0.1:0"), None),
    (dict(auth_tokens=TOKENS, listen="127.0.0.1:0"), None),
])
async def test_an_exposed_registry_warns_at_startup(overrides: dict[str, Any],
                                                    event: str | None, tmp_path: Path) -> None:
    if overrides.pop("tls", False):
        from test_auth import _pki

        pki = _pki(tmp_path)
        overrides.update(tls_cert=pki["cert"], tls_key=pki["key"])
    with capture_logs() as logs:
        server = await start_registry(FakeClock(), **overrides)
        await server.stop(0)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ([event] if event else [])
    if event:
        assert warnings[0]["service"] == "registry" and warnings[0]["risk"]


OLD = "old-admin-token-0123456789"
NEW = "new-admin-token-0123456789"


async def test_a_token_is_rotated_by_reloading_the_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{OLD} admin name=ops\n{HOLDER} holder holder=dec-0\n")
    server = await start_registry(FakeClock(), auth_tokens_file=str(tokens))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.RegistryServiceStub(channel)
    kv = KvKit()
    try:
        await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-0")),
                                  metadata=md(HOLDER))
        grant = await stub.GrantLease(pb.GrantLeaseRequest(
            **kv.grant_args("dec-0", "acme", "c1", kv.tokens(8))), metadata=md(HOLDER))
        tokens.write_text(f"{NEW} admin name=ops\n{HOLDER} holder holder=dec-0\n")
        assert server.reload_tokens().roles() == {"admin": 1, "holder": 1}
        await refused(stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md(OLD)),
                      grpc.StatusCode.UNAUTHENTICATED)
        got = await stub.GetLease(pb.GetLeaseRequest(lease_id=grant.lease.lease_id),
                                  metadata=md(NEW))  # state kept
        assert got.lease.state == pb.LEASE_STATE_ACTIVE
        # A file that does not parse: refused, and the table in use stays.
        tokens.write_text("short admin\n")
        with pytest.raises(ValueError, match="at least 16 characters"):
            server.reload_tokens()
        await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md(NEW))
    finally:
        await channel.close()
        await server.stop(0)


class Serving:
    """`kvbridge SERVICE serve` (the registry by default) in a subprocess, its JSON log lines
    read as they come."""

    def __init__(self, *args: str, service: str = "registry") -> None:
        metrics = ("--metrics-listen", "") if service != "gateway" else ()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.cli", service, "serve", "--listen",
             "127.0.0.1:0", *metrics, "--log-format", "json", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "KVBRIDGE_REGISTRY_GC_FREEZE_INTERVAL_S": "0"})
        self.lines: list[dict[str, Any]] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._seen:
                self.lines.append(event)
                self._seen.notify_all()

    def wait_for(self, name: str, after: int = 0, timeout: float = 30.0) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((e for e in self.lines[after:] if e.get("event") == name), None)

        with self._seen:
            if not self._seen.wait_for(lambda: found() is not None or
                                       self.proc.poll() is not None, timeout):
                pytest.fail(f"no {name} line in {timeout}s")
            event = found()
        if event is None:
            pytest.fail(f"the service exited ({self.proc.returncode}) before {name}")
        return event

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[tuple[Serving, Path]]:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{OLD} admin name=ops\n")
    registry = Serving("--auth-tokens-file", str(tokens))
    yield registry, tokens
    registry.stop()


async def test_sighup_reloads_the_token_file_of_a_running_registry(
        serving: tuple[Serving, Path]) -> None:
    registry, tokens = serving
    started = registry.wait_for("registry_started")
    channel = grpc.aio.insecure_channel(started["listen"])
    stub = pb_grpc.RegistryServiceStub(channel)
    try:
        await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md(OLD))
        tokens.write_text(f"{NEW} admin name=ops\n")
        mark = len(registry.lines)
        registry.proc.send_signal(signal.SIGHUP)
        reloaded = registry.wait_for("tokens_reloaded", mark)
        assert reloaded["token_roles"] == {"admin": 1}
        await refused(stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md(OLD)),
                      grpc.StatusCode.UNAUTHENTICATED)
        await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md(NEW))
        # An invalid file is logged and the table in use kept; the process lives on.
        tokens.write_text(f"{OLD} superuser\n")
        mark = len(registry.lines)
        registry.proc.send_signal(signal.SIGHUP)
        failed = registry.wait_for("tokens_reload_failed", mark)
        assert "unknown role" in failed["error"] and OLD not in json.dumps(failed)
        await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md(NEW))
        assert registry.proc.poll() is None
    finally:
        await channel.close()


async def test_the_sighup_hook_reloads_other_credentials_too(tmp_path: Path) -> None:
    """For the router and gateway: one hook reloads every token table of the process and any
    other credentials named to it (the gateway's API keys), each logged on its own."""
    import asyncio

    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{OLD} admin\n")
    authenticator = auth.Authenticator(auth.TokenTable.load(str(tokens)))
    tokens.write_text(f"{NEW} admin\n")
    calls: list[str] = []

    def bad() -> None:
        raise ValueError("keys.txt:1: expected 'API_KEY TENANT'")

    loop = asyncio.get_running_loop()
    with capture_logs() as logs:
        auth.reload_tokens_on_sighup(structlog.get_logger("test"),
                                     ("api_keys", lambda: calls.append("api_keys")),
                                     ("other_keys", bad))
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(100):
                if calls:
                    break
                await asyncio.sleep(0.01)
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
    assert calls == ["api_keys"]
    assert authenticator.authenticate(md(NEW)).role == "admin"
    mine = {(e["event"], e["source"]) for e in logs
            if e["source"] in (str(tokens), "api_keys", "other_keys")}
    assert mine == {("tokens_reloaded", str(tokens)), ("tokens_reloaded", "api_keys"),
                    ("tokens_reload_failed", "other_keys")}
