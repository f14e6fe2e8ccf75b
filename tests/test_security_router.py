"""The router's security (issue 32): instances belong to the principal that registered them,
engine ids cannot be squatted, tenant-scoped engines serve only their tenants, engine URLs
follow a policy, and an exposed router says so. Real routers on 127.0.0.1, real gRPC calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from kvbridge._grpc_status import error_info
from kvbridge.clients import duration
from kvbridge.clock import FakeClock
from kvbridge.router.v1 import router_pb2 as pb
from kvbridge.router.v1 import router_pb2_grpc as pb_grpc
from kvbridge.services.router import RouterConfig, RouterServer, create_server
from kvbridge.services.router._urls import EngineUrlPolicy

MODEL = "tiny"
TOKENS = {
    "decode1": "decode-1-token-0123456789",
    "decode2": "decode-2-token-0123456789",
    "reader": "reader-main-token-0123456789",
    "acme": "reader-acme-token-0123456789",
    "reader2": "reader-other-token-0123456789",
    "gateway": "gateway-token-0123456789",
    "admin": "admin-token-0123456789abcdef",
}
TABLE = ";".join([
    f"{TOKENS['decode1']} holder holder=decode-1 name=decode-1",
    f"{TOKENS['decode2']} holder holder=decode-2 name=decode-2",
    f"{TOKENS['reader']} reader name=prefill-main",
    f"{TOKENS['acme']} reader tenants=acme name=prefill-acme",
    f"{TOKENS['reader2']} reader name=prefill-other",
    f"{TOKENS['gateway']} gateway name=gw",
    f"{TOKENS['admin']} admin name=ops",
])


async def start_router(**overrides: Any) -> RouterServer:
    overrides.setdefault("metrics_listen", "")
    overrides.setdefault("listen", "127.0.0.1:0")
    overrides.setdefault("registry", "")
    server = await create_server(RouterConfig(**overrides), clock=FakeClock())
    await server.start()
    return server


class Caller:
    """One router stub per token."""

    def __init__(self, channel: grpc.aio.Channel, token: str | None) -> None:
        self.stub = pb_grpc.RouterServiceStub(channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def register(self, instance_id: str, role: int, engine_id: str = "",
                       url: str = "") -> pb.RegisterInstanceResponse:
        return await self.stub.RegisterInstance(pb.RegisterInstanceRequest(
            instance_id=instance_id, role=role,
            http_url=url or f"http://127.0.0.1:9{len(instance_id):03d}",
            engine_id=engine_id or instance_id, model=MODEL, ttl=duration(30)),
            metadata=self.metadata)

    async def heartbeat(self, instance_id: str, running: int = 0
                        ) -> pb.HeartbeatInstanceResponse:
        return await self.stub.HeartbeatInstance(pb.HeartbeatInstanceRequest(
            instance_id=instance_id, load=pb.Load(running_requests=running)),
            metadata=self.metadata)

    async def deregister(self, instance_id: str) -> bool:
        resp = await self.stub.DeregisterInstance(
            pb.DeregisterInstanceRequest(instance_id=instance_id), metadata=self.metadata)
        return bool(resp.removed)

    async def instances(self) -> list[tuple[str, str, str]]:
        resp = await self.stub.ListInstances(pb.ListInstancesRequest(), metadata=self.metadata)
        return [(i.instance_id, i.engine_id, i.http_url) for i in resp.instances]

    async def route(self, tenant: str) -> pb.RouteResponse:
        return await self.stub.Route(pb.RouteRequest(tenant=tenant, prompt_tokens=10),
                                     metadata=self.metadata)


@pytest.fixture
async def secured() -> AsyncIterator[RouterServer]:
    server = await start_router(auth_tokens=TABLE)
    yield server
    await server.stop(0)


@pytest.fixture
async def callers(secured: RouterServer) -> AsyncIterator[dict[str, Caller]]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{secured.port}")
    yield {name: Caller(channel, token) for name, token in TOKENS.items()}
    await channel.close()


async def refused(call: Any, code: grpc.StatusCode, reason: str) -> Any:
    with pytest.raises(grpc.RpcError) as raised:
        await call
    assert raised.value.code() == code, raised.value.details()
    info = error_info(raised.value)
    assert info is not None and info.reason == reason, info
    return info


# ==== ownership ==================================================================================


async def test_another_engine_token_cannot_heartbeat_deregister_or_replace(
        callers: dict[str, Caller]) -> None:
    """The audit's takeover: a reader token scoped to acme deregistered the real prefill and
    registered its own URL under the same instance id."""
    real, attacker = callers["reader"], callers["acme"]
    await real.register("prefill-0", pb.ROLE_PREFILL, url="http://127.0.0.1:8100")
    before = await callers["gateway"].instances()
    denied = grpc.StatusCode.PERMISSION_DENIED
    await refused(attacker.deregister("prefill-0"), denied, "INSTANCE_OWNED")
    await refused(attacker.heartbeat("prefill-0", running=99), denied, "INSTANCE_OWNED")
    await refused(attacker.register("prefill-0", pb.ROLE_PREFILL, engine_id="prefill-0",
                                    url="http://127.0.0.2:6666"), denied, "INSTANCE_OWNED")
    await refused(callers["reader2"].register("prefill-0", pb.ROLE_PREFILL,
                                              engine_id="other-engine"),
                  denied, "INSTANCE_OWNED")
    assert await callers["gateway"].instances() == before
    listed = (await real.stub.ListInstances(pb.ListInstancesRequest(),
                                            metadata=callers["gateway"].metadata)).instances
    assert listed[0].load.running_requests == 0  # the refused heartbeat changed nothing
    # The owner itself heartbeats, re-registers and deregisters; an admin may too.
    await real.heartbeat("prefill-0", running=1)
    await real.register("prefill-0", pb.ROLE_PREFILL, url="http://127.0.0.1:8101")
    assert (await callers["gateway"].instances())[0][2] == "http://127.0.0.1:8101"
    assert await real.deregister("prefill-0")
    await real.register("prefill-0", pb.ROLE_PREFILL)
    await callers["admin"].heartbeat("prefill-0")
    assert await callers["admin"].deregister("prefill-0")
    assert await callers["gateway"].instances() == []


async def test_an_engine_id_in_use_by_another_principal_is_refused(
        callers: dict[str, Caller]) -> None:
    await callers["decode1"].register("decode-1", pb.ROLE_DECODE)
    await callers["reader"].register("prefill-a", pb.ROLE_PREFILL)
    before = await callers["gateway"].instances()
    denied = grpc.StatusCode.PERMISSION_DENIED
    info = await refused(callers["reader2"].register("squat", pb.ROLE_PREFILL,
                                                     engine_id="decode-1"),
                         denied, "ENGINE_ID_TAKEN")
    assert info.metadata["engine_id"] == "decode-1"
    await refused(callers["reader2"].register("prefill-b", pb.ROLE_PREFILL,
                                              engine_id="prefill-a"),
                  denied, "ENGINE_ID_TAKEN")
    assert await callers["gateway"].instances() == before


async def test_a_squatted_engine_id_goes_to_the_engine_its_scope_names(
        callers: dict[str, Caller]) -> None:
    """The audit's squatting: a call registered engine_id=decode-1 first, so that the real
    decode-1 could not register. A holder token scoped to decode-1 displaces an instance whose
    owner's scope does not name its engine id; another holder cannot."""
    await callers["acme"].register("decode-1", pb.ROLE_PREFILL, engine_id="decode-1",
                                   url="http://127.0.0.9:7777")
    await callers["decode1"].register("decode-1", pb.ROLE_DECODE)
    assert await callers["gateway"].instances() == [
        ("decode-1", "decode-1", "http://127.0.0.1:9008")]
    # Squatting under another instance id, then the real engine arrives.
    assert await callers["decode1"].deregister("decode-1")
    await callers["reader"].register("squat", pb.ROLE_PREFILL, engine_id="decode-1")
    await callers["decode1"].register("decode-1", pb.ROLE_DECODE)
    assert await callers["gateway"].instances() == [
        ("decode-1", "decode-1", "http://127.0.0.1:9008")]
    # A holder entitled to its own engine is not displaced by another holder.
    await callers["decode2"].register("decode-2", pb.ROLE_DECODE)
    await refused(callers["decode1"].register("decode-2", pb.ROLE_DECODE, engine_id="decode-1"),
                  grpc.StatusCode.PERMISSION_DENIED, "INSTANCE_OWNED")
    assert len(await callers["gateway"].instances()) == 2


async def test_a_holder_cannot_take_over_a_prefill_by_its_instance_id(
        callers: dict[str, Caller]) -> None:
    """From review: a holder token takes over only a squatter of an engine id its own scope
    names. Re-registering another principal's prefill instance id with an engine id the holder
    is entitled to must not displace that prefill."""
    await callers["reader"].register("prefill-1", pb.ROLE_PREFILL)
    before = await callers["gateway"].instances()
    await refused(callers["decode1"].register("prefill-1", pb.ROLE_DECODE,
                                              engine_id="decode-1"),
                  grpc.StatusCode.PERMISSION_DENIED, "INSTANCE_OWNED")
    assert await callers["gateway"].instances() == before
    await callers["reader"].heartbeat("prefill-1")  # still its owner's


async def test_a_tenant_scoped_engine_serves_only_its_tenants(
        callers: dict[str, Caller]) -> None:
    """The audit's hijack: globex's turn (with its pinned read) went to the engine an
    acme-scoped token registered. Routing now picks, for tenant T, only instances whose owner
    may serve T."""
    acme, main = callers["acme"], callers["reader"]
    gateway = callers["gateway"]
    await acme.register("prefill-acme", pb.ROLE_PREFILL)
    await callers["decode1"].register("decode-1", pb.ROLE_DECODE)
    with pytest.raises(grpc.RpcError) as raised:
        await gateway.route("globex")
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(raised.value).reason == "NO_INSTANCE"
    await main.register("prefill-main", pb.ROLE_PREFILL)
    await main.heartbeat("prefill-main", running=50)  # busy: acme's engine looks better
    for _ in range(3):
        assert (await gateway.route("globex")).prefill.instance_id == "prefill-main"
    assert (await gateway.route("acme")).prefill.instance_id == "prefill-acme"
    # A holder (decode) token scoped to a tenant is treated alike.
    assert (await gateway.route("acme")).decode.instance_id == "decode-1"


async def test_insecure_mode_keeps_todays_behaviour() -> None:
    server = await start_router(insecure=True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    anyone = Caller(channel, None)
    try:
        await anyone.register("d0", pb.ROLE_DECODE, engine_id="e0")
        await anyone.register("d0", pb.ROLE_DECODE, engine_id="e1")  # replaced, as before
        await anyone.heartbeat("d0")
        assert [i[:2] for i in await anyone.instances()] == [("d0", "e1")]
        assert await anyone.deregister("d0")
    finally:
        await channel.close()
        await server.stop(0)


# ==== engine URLs ================================================================================


@pytest.mark.parametrize(("allow", "listen", "url", "ok"), [
    ("", "127.0.0.1", "http://127.0.0.1:8000", True),
    ("", "127.0.0.1", "http://localhost:8000/engine", True),
    ("", "127.0.0.1", "http://10.1.2.3:8000", False),  # local mode: loopback only
    ("", "127.0.0.1", "http://[::1]:8000", True),
    ("", "0.0.0.0", "http://10.1.2.3:8000", True),  # a networked router: any host ...
    ("", "0.0.0.0", "http://127.0.0.1:6379", False),  # ... but its own host's services
    ("", "0.0.0.0", "http://localhost:8000", False),
    ("*", "0.0.0.0", "http://127.0.0.1:8000", True),  # unless asked for
    ("*", "0.0.0.0", "http://[fd00:ec2::254]/latest", False),  # AWS metadata over IPv6
    ("*", "0.0.0.0", "http://100.100.100.200/latest", False),  # Alibaba Cloud metadata
    ("*", "0.0.0.0", "http://[64:ff9b::a9fe:a9fe]/", False),  # NAT64 of 169.254.169.254
    ("*", "0.0.0.0", "http://[2002:a9fe:a9fe::1]/", False),  # 6to4 of 169.254.169.254
    ("", "0.0.0.0", "http://169.254.169.254/latest/meta-data", False),  # metadata: never
    ("*", "0.0.0.0", "http://169.254.169.254", False),
    ("169.254.0.0/16", "0.0.0.0", "http://169.254.169.254", False),
    ("*", "0.0.0.0", "http://[fe80::1]:80", False),
    ("*", "0.0.0.0", "http://[::ffff:169.254.169.254]:80", False),
    ("*", "0.0.0.0", "http://0.0.0.0:8000", False),
    ("*", "0.0.0.0", "http://224.0.0.1:8000", False),
    ("*", "0.0.0.0", "http://127.0.0.1@169.254.169.254/", False),  # credentials
    ("*", "0.0.0.0", "http://127.0.0.1:80#@169.254.169.254/", False),  # fragment
    ("*", "0.0.0.0", "http://127.0.0.1:80/?x=1", False),  # query
    ("*", "0.0.0.0", "http://169.254.169.254\\@127.0.0.1/", False),  # backslash
    ("*", "0.0.0.0", "http://%31%32%37.0.0.1/", False),  # escapes
    ("*", "0.0.0.0", "http://no-such-host.invalid:8000", False),  # does not resolve
    ("*", "0.0.0.0", "ftp://127.0.0.1", False),
    ("10.0.0.0/8", "0.0.0.0", "http://10.9.8.7:8000", True),
    ("10.0.0.0/8", "0.0.0.0", "http://11.0.0.1:8000", False),
    ("10.0.0.0/8", "0.0.0.0", "http://localhost:8000", False),
    ("*.engines.internal,127.0.0.0/8", "0.0.0.0", "http://localhost:8000", True),
    # A listed name is taken as named (its record may not be published yet here).
    ("*.engines.internal", "0.0.0.0", "http://p0.engines.internal:8000", True),
])
async def test_engine_url_policy(allow: str, listen: str, url: str, ok: bool) -> None:
    policy = EngineUrlPolicy.parse(allow, listen)
    if ok:
        await policy.check(url)
    else:
        from kvbridge.errors import InvalidArgument

        with pytest.raises(InvalidArgument) as raised:
            await policy.check(url)
        assert raised.value.field == "http_url"


def test_a_malformed_url_policy_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="engine_url_allow"):
        RouterConfig(engine_url_allow="10.0.0.0/8,bad host!", insecure=True)


async def test_registration_of_a_url_outside_the_policy_is_refused(
        callers: dict[str, Caller]) -> None:
    """The audit's SSRF: any http(s) URL was accepted, and the gateway posted turns to it."""
    for url in ("http://169.254.169.254/latest", "http://10.0.0.5:8000"):
        info = await refused(callers["reader"].register("p0", pb.ROLE_PREFILL, url=url),
                             grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
        assert info.metadata["field"] == "http_url"
    assert await callers["gateway"].instances() == []


async def test_a_configured_policy_admits_its_networks() -> None:
    server = await start_router(auth_tokens=TABLE, engine_url_allow="10.0.0.0/8")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    reader = Caller(channel, TOKENS["reader"])
    try:
        await reader.register("p0", pb.ROLE_PREFILL, url="http://10.0.0.5:8000")
        await refused(reader.register("p1", pb.ROLE_PREFILL, url="http://127.0.0.1:8000"),
                      grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    finally:
        await channel.close()
        await server.stop(0)


# ==== exposure warnings ==========================================================================


@pytest.mark.parametrize(("overrides", "event"), [
    (dict(insecure=True, listen="0.0.0.0:0"), "insecure_mode_on_network"),
    (dict(auth_tokens=TABLE, listen="0.0.0.0:0"), "tokens_without_tls"),
    (dict(insecure=True, listen="127.0.0.1:0"), None),
    (dict(auth_tokens=TABLE, listen="127.0.0.1:0"), None),
])
async def test_an_exposed_router_warns_at_startup(overrides: dict[str, Any],
                                                  event: str | None) -> None:
    with capture_logs() as logs:
        server = await start_router(**overrides)
        await server.stop(0)
    warnings = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warnings == ([event] if event else [])


def test_a_reloaded_tokens_new_scope_keeps_its_instances() -> None:
    """From review: ownership compared the whole token entry, so after a SIGHUP that changed a
    token's tenants its own engines got INSTANCE_OWNED until they lapsed. The same name and
    role still own them; a heartbeat brings the owner's scope (which routing reads) up to
    date."""
    from kvbridge.auth import Principal
    from kvbridge.services.router._policy import InstanceSpec, InstanceTable, Load, Role

    table = InstanceTable(RouterConfig(listen="127.0.0.1:0", insecure=True), FakeClock())
    before = Principal("engines", "reader", tenants=("acme",))
    after = Principal("engines", "reader", tenants=("acme", "globex"))
    table.register(InstanceSpec("p0", Role.PREFILL, "http://127.0.0.1:8000", "p0", "m"),
                   before)
    instance = table.heartbeat("p0", Load(), after)
    assert instance.owner == after and instance.managed_by(before)
    with pytest.raises(Exception, match="belongs to another"):
        table.heartbeat("p0", Load(), Principal("engines", "holder", holders=("p0",)))
