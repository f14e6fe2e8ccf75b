"""The routing service: the transport-free policy over many instances (fake clock), then the
gRPC service on 127.0.0.1 with a real registry behind it, and `kvbridge instances list`."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from click.testing import CliRunner
from google.protobuf import duration_pb2

from kvbridge._grpc_status import error_info
from kvbridge.cli import main
from kvbridge.clients import AsyncRegistryClient, duration
from kvbridge.clients._registry import seconds
from kvbridge.clients._router import RouterClient
from kvbridge.clock import FakeClock
from kvbridge.errors import InstanceNotFound, InvalidArgument, NoInstance
from kvbridge.registry.v1 import registry_pb2 as reg_pb
from kvbridge.router.v1 import router_pb2 as pb
from kvbridge.router.v1 import router_pb2_grpc as pb_grpc
from kvbridge.services.registry import RegistryServer
from kvbridge.services.router import (
    DecodeReason,
    Instance,
    InstanceSpec,
    InstanceTable,
    Load,
    Role,
    RouterConfig,
    RouterServer,
    create_server,
)

MODEL = "tiny"


def spec(instance_id: str, role: Role, *, engine_id: str | None = None, model: str = MODEL,
         ttl: float = 0.0) -> InstanceSpec:
    return InstanceSpec(instance_id, role, f"http://127.0.0.1:8{len(instance_id)}00",
                        engine_id or f"engine-{instance_id}", model, "127.0.0.1", 5600, ttl)


CAP = 8192  # KV capacity (tokens) of the decodes that report one: exact binary fractions


@pytest.fixture
def rtable(clock: FakeClock) -> InstanceTable:
    return InstanceTable(RouterConfig(decode_load_margin=4), clock)


def fleet(table: InstanceTable, prefills: int, decodes: int) -> None:
    for i in range(prefills):
        table.register(spec(f"p{i}", Role.PREFILL))
    for i in range(decodes):
        table.register(spec(f"d{i}", Role.DECODE))


# ==== policy =====================================================================================


def test_least_loaded_prefill_and_decode_when_no_lease(rtable: InstanceTable) -> None:
    fleet(rtable, 3, 3)
    rtable.heartbeat("p0", Load(running=2, waiting=3))
    rtable.heartbeat("p1", Load(running=1, waiting=0, tokens_in_flight=900))
    rtable.heartbeat("p2", Load(running=1, waiting=0, tokens_in_flight=100))
    rtable.heartbeat("d0", Load(running=6, kv_capacity_tokens=CAP))  # 6 > 1 + 4: too busy
    rtable.heartbeat("d1", Load(running=1, kv_usage=0.5, kv_capacity_tokens=CAP))
    rtable.heartbeat("d2", Load(running=1, kv_usage=0.2, kv_capacity_tokens=CAP))
    decision = rtable.route(300, MODEL, "")
    assert decision.prefill.instance_id == "p2"  # equal queues: fewer tokens in flight
    assert decision.decode.instance_id == "d2"  # less KV in use
    assert decision.decode_reason is DecodeReason.NO_LEASE
    assert "least KV in use" in decision.explanation
    assert "least loaded" in decision.explanation  # prefill's reason


def test_new_conversations_go_where_kv_is_free_within_the_margin(
        rtable: InstanceTable) -> None:
    """A conversation stays where it starts and is retained there between turns: among decodes
    with queues within the margin, memory decides, not a snapshot of seconds-long requests."""
    fleet(rtable, 1, 2)
    rtable.heartbeat("d0", Load(running=0, kv_usage=0.8, kv_capacity_tokens=CAP))  # idle now,
    rtable.heartbeat("d1", Load(running=2, kv_usage=0.3, kv_capacity_tokens=CAP))  # busier now
    decision = rtable.route(1200, MODEL, "")
    assert decision.decode.instance_id == "d1"
    assert decision.decode_reason is DecodeReason.NO_LEASE
    # Turns of d1's own conversations raise its queue, still within the margin of 4.
    rtable.route(200, MODEL, "engine-d1")
    assert rtable.route(1200, MODEL, None).decode.instance_id == "d1"  # registry down: same
    # Past the margin, the queue wins: d1 has 2 running + 3 routed = 5 > 0 + 4.
    assert rtable.route(1200, MODEL, "").decode.instance_id == "d0"


def test_burst_of_new_conversations_counts_what_it_placed(rtable: InstanceTable) -> None:
    """Between two reports, each placed prompt counts at the capacity the decode reported, so
    a burst fills the emptier decode up to the other's level and then alternates."""
    fleet(rtable, 1, 2)
    rtable.heartbeat("d0", Load(kv_usage=0.5, kv_capacity_tokens=CAP))
    rtable.heartbeat("d1", Load(kv_usage=0.125, kv_capacity_tokens=CAP))
    picks = [rtable.route(CAP // 8, MODEL, "").decode.instance_id for _ in range(8)]
    # d1 takes three (0.125 to 0.5); then they alternate (at equal usage the shorter queue).
    assert picks == ["d1"] * 3 + ["d0", "d1"] * 2 + ["d0"]
    d0, d1 = rtable.instances(Role.DECODE)
    assert (d0.kv_usage(), d1.kv_usage()) == (0.875, 0.75)
    # Turns to a lease holder add to its queue but not to what is placed (their history is
    # held there already); a heartbeat replaces the estimate by the engine's own figure.
    rtable.route(3000, MODEL, "engine-d0")
    assert d0.kv_usage() == 0.875 and d0.queue == 4
    rtable.heartbeat("d0", Load(kv_usage=0.625, kv_capacity_tokens=CAP))
    assert d0.kv_usage() == 0.625 and d0.placed_tokens == 0


def test_placement_without_capacities(rtable: InstanceTable) -> None:
    """A decode that reports no capacity counts its placements at the median of its peers';
    where none reports one, the queue (which counts placements) comes first."""
    fleet(rtable, 1, 3)
    rtable.heartbeat("d0", Load(kv_usage=0.5, kv_capacity_tokens=CAP))
    rtable.heartbeat("d1", Load(kv_usage=0.5, kv_capacity_tokens=3 * CAP))
    rtable.heartbeat("d2", Load(kv_usage=0.25))  # an older agent: no capacity
    d2 = rtable.instances(Role.DECODE)[2]
    for _ in range(2):
        assert rtable.route(CAP // 2, MODEL, "").decode is d2
    assert d2.kv_usage() == 0.25 and d2.kv_usage(3 * CAP) == 0.25 + 1 / 3
    # At d1's capacity (the median of CAP and 3 CAP) d2 is at 0.58: d0 and d1 are ahead.
    assert {rtable.route(1, MODEL, "").decode.instance_id for _ in range(2)} == {"d0", "d1"}
    # No capacity anywhere: the queue first, then the reported usage.
    for name in ("d0", "d1", "d2"):
        rtable.heartbeat(name, Load(kv_usage=0.5 if name == "d0" else 0.9))
    assert [rtable.route(CAP, MODEL, "").decode.instance_id for _ in range(4)] == [
        "d0", "d1", "d2", "d0"]


def test_kv_usages_within_a_step_are_equal_and_the_queue_decides(
        rtable: InstanceTable) -> None:
    fleet(rtable, 1, 2)
    rtable.heartbeat("d0", Load(running=3, kv_usage=0.30, kv_capacity_tokens=CAP))
    rtable.heartbeat("d1", Load(running=0, kv_usage=0.31, kv_capacity_tokens=CAP))
    assert rtable.route(1, MODEL, "").decode.instance_id == "d1"
    rtable.heartbeat("d1", Load(running=0, kv_usage=0.36, kv_capacity_tokens=CAP))
    assert rtable.route(1, MODEL, "").decode.instance_id == "d0"  # a step apart: d0's KV wins
    # Within a step and with equal queues, the exact usage still decides (not the name).
    rtable.heartbeat("d0", Load(running=0, kv_usage=0.02, kv_capacity_tokens=CAP))
    rtable.heartbeat("d1", Load(running=0, kv_usage=0.01, kv_capacity_tokens=CAP))
    assert rtable.route(1, MODEL, "").decode.instance_id == "d1"


def test_burst_between_heartbeats_spreads_over_equal_instances(rtable: InstanceTable) -> None:
    fleet(rtable, 2, 4)
    picks = [rtable.route(100, MODEL, "") for _ in range(8)]
    decodes = [d.decode.instance_id for d in picks]
    assert sorted(decodes) == ["d0", "d0", "d1", "d1", "d2", "d2", "d3", "d3"]
    assert sorted(d.prefill.instance_id for d in picks) == ["p0"] * 4 + ["p1"] * 4
    # A heartbeat replaces the routed estimate by the engine's own figures.
    rtable.heartbeat("d3", Load())
    assert rtable.instances(Role.DECODE)[3].routed == 0


def test_lease_holder_wins_within_the_margin(rtable: InstanceTable) -> None:
    fleet(rtable, 1, 3)
    rtable.heartbeat("d1", Load(running=4))  # queue 4 vs least 0: within the margin of 4
    decision = rtable.route(200, MODEL, "engine-d1")
    assert decision.decode.instance_id == "d1"
    assert decision.decode_reason is DecodeReason.HOLDS_LEASE
    assert decision.lease_holder == "engine-d1"


def test_overloaded_lease_holder_loses_the_turn(rtable: InstanceTable) -> None:
    fleet(rtable, 1, 3)
    rtable.heartbeat("d1", Load(running=3, waiting=2))  # queue 5 > 0 + 4
    decision = rtable.route(200, MODEL, "engine-d1")
    assert decision.decode.instance_id == "d0"
    assert decision.decode_reason is DecodeReason.HOLDER_OVERLOADED
    rtable.heartbeat("d1", Load(running=0, kv_usage=0.97))  # idle, but its KV is full
    decision = rtable.route(200, MODEL, "engine-d1")
    assert decision.decode_reason is DecodeReason.HOLDER_OVERLOADED
    assert decision.decode.instance_id != "d1"


def test_excluded_instances_are_not_picked(rtable: InstanceTable) -> None:
    fleet(rtable, 2, 2)
    decision = rtable.route(10, MODEL, "engine-d0", exclude={"d0", "p0"})
    assert decision.decode.instance_id == "d1" and decision.prefill.instance_id == "p1"
    assert decision.decode_reason is DecodeReason.HOLDER_UNAVAILABLE
    with pytest.raises(NoInstance):
        rtable.route(10, MODEL, "", exclude={"d0", "d1"})


def test_holder_not_live_or_unknown_registry(rtable: InstanceTable) -> None:
    fleet(rtable, 1, 2)
    decision = rtable.route(10, MODEL, "engine-elsewhere")
    assert decision.decode_reason is DecodeReason.HOLDER_UNAVAILABLE
    decision = rtable.route(10, MODEL, None)
    assert decision.decode_reason is DecodeReason.REGISTRY_UNAVAILABLE
    assert decision.lease_holder == ""


def test_instances_expire_and_their_engines_are_remembered_dead(
        rtable: InstanceTable, clock: FakeClock) -> None:
    rtable.register(spec("p0", Role.PREFILL, ttl=30))
    rtable.register(spec("d0", Role.DECODE, ttl=3))
    rtable.register(spec("d1", Role.DECODE, ttl=30))
    clock.advance(2.9)
    rtable.heartbeat("d1", Load())
    assert not rtable.engine_is_dead("engine-d0")
    clock.advance(0.2)
    assert [i.instance_id for i in rtable.instances(Role.DECODE)] == ["d1"]
    assert rtable.engine_is_dead("engine-d0")
    assert not rtable.engine_is_dead("engine-never-seen")
    with pytest.raises(InstanceNotFound):
        rtable.heartbeat("d0", Load())
    # The lease holder d0 is gone: its conversations go elsewhere.
    assert rtable.route(10, MODEL, "engine-d0").decode_reason is DecodeReason.HOLDER_UNAVAILABLE
    rtable.register(spec("d0", Role.DECODE))  # back (a restart re-registers)
    assert not rtable.engine_is_dead("engine-d0")
    assert rtable.deregister("d1") and not rtable.deregister("d1")
    assert rtable.engine_is_dead("engine-d1")
    clock.advance(RouterConfig().dead_engine_memory_s + 1)
    assert not rtable.engine_is_dead("engine-d1")  # forgotten after an hour


def test_model_filter_and_no_instance(rtable: InstanceTable) -> None:
    rtable.register(spec("p0", Role.PREFILL))
    rtable.register(spec("d0", Role.DECODE))
    rtable.register(spec("d-big", Role.DECODE, model="big"))
    assert rtable.route(10, MODEL, "").decode.instance_id == "d0"
    with pytest.raises(NoInstance, match="no live prefill instance serves 'big'"):
        rtable.route(10, "big", "")
    assert rtable.route(10, "", "").prefill.instance_id == "p0"


@pytest.mark.parametrize(("change", "field"), [
    (dict(role=0), "role"),
    (dict(http_url="ftp://x"), "http_url"),
    (dict(http_url="http://a b"), "http_url"),
    (dict(instance_id=""), "instance_id"),
    (dict(engine_id="has space"), "engine_id"),
    (dict(model=""), "model"),
    (dict(ttl=0.5), "ttl"),
    (dict(ttl=1000.0), "ttl"),
    (dict(nixl_port=70000), "nixl_port"),
    (dict(engine_id="engine-d0", instance_id="d9"), "engine_id"),  # taken by d0
])
def test_bad_registration_is_refused_and_changes_nothing(
        rtable: InstanceTable, change: dict[str, Any], field: str) -> None:
    rtable.register(spec("d0", Role.DECODE))
    before = [(i.instance_id, i.spec, i.expire_at) for i in rtable.instances()]
    fields = dict(instance_id="d1", role=Role.DECODE, http_url="http://127.0.0.1:8000",
                  engine_id="engine-d1", model=MODEL, nixl_host="127.0.0.1", nixl_port=5600,
                  ttl=0.0)
    fields.update(change)
    with pytest.raises(InvalidArgument) as raised:
        rtable.register(InstanceSpec(**fields))
    assert raised.value.field == field
    assert [(i.instance_id, i.spec, i.expire_at) for i in rtable.instances()] == before


@pytest.mark.parametrize("load", [Load(running=-1), Load(kv_usage=1.5), Load(kv_usage=math.nan),
                                  Load(tokens_in_flight=-5), Load(kv_capacity_tokens=-1)])
def test_bad_load_is_refused(rtable: InstanceTable, load: Load) -> None:
    rtable.register(spec("d0", Role.DECODE))
    rtable.heartbeat("d0", Load(running=2))
    with pytest.raises(InvalidArgument):
        rtable.heartbeat("d0", load)
    assert rtable.instances()[0].load == Load(running=2)


def test_many_instances_route_matches_brute_force(rtable: InstanceTable) -> None:
    rng = random.Random(7)
    fleet(rtable, 20, 100)
    for round_ in range(50):
        for instance in rtable.instances():
            rtable.heartbeat(instance.instance_id, Load(
                running=rng.randrange(8), waiting=rng.randrange(4),
                kv_usage=rng.random() * 0.99, tokens_in_flight=rng.randrange(5000),
                kv_capacity_tokens=rng.choice([0, 0, 4096, 8192, 65536]) if round_ % 5 else 0))
        placed = {i.instance_id: 0 for i in rtable.instances(Role.DECODE)}
        for _turn in range(8):  # turns between two heartbeats
            decodes = rtable.instances(Role.DECODE)
            prefills = rtable.instances(Role.PREFILL)
            holder = rng.choice(decodes) if rng.random() < 0.7 else None
            shortest = min(i.queue for i in decodes)
            capacities = sorted(c for i in decodes if (c := i.load.kv_capacity_tokens))

            def key(i: Instance, capacities: list[int] = capacities,
                    placed: dict[str, int] = placed) -> tuple[Any, ...]:
                if not capacities:
                    return (i.queue, i.load.kv_usage, i.instance_id)
                capacity = i.load.kv_capacity_tokens or capacities[len(capacities) // 2]
                usage = i.load.kv_usage + placed[i.instance_id] / capacity
                return (math.floor(usage * 20 + 1e-9), i.queue, usage, i.instance_id)

            least = min((i for i in decodes if i.queue <= shortest + 4), key=key)
            best_prefill = min(prefills, key=lambda i: (i.queue, i.tokens, i.instance_id))
            expect_holder = holder is not None and (holder.queue - shortest <= 4
                                                    and holder.load.kv_usage < 0.95)
            prompt = rng.randrange(4000)
            decision = rtable.route(prompt, MODEL, holder.spec.engine_id if holder else "")
            assert decision.prefill is best_prefill, round_
            assert decision.decode is (holder if expect_holder else least), round_
            assert decision.decode_reason is (
                DecodeReason.HOLDS_LEASE if expect_holder else
                DecodeReason.HOLDER_OVERLOADED if holder else DecodeReason.NO_LEASE)
            if decision.decode is not holder:
                placed[decision.decode.instance_id] += prompt


# ==== the service, over gRPC with a real registry ==============================================


@pytest.fixture
def router_clock() -> FakeClock:
    return FakeClock()


async def start_router(clock: FakeClock, **overrides: Any) -> RouterServer:
    overrides.setdefault("metrics_listen", "")
    overrides.setdefault("listen", "127.0.0.1:0")
    server = await create_server(RouterConfig(**overrides), clock=clock)
    await server.start()
    return server


@pytest.fixture
async def router(registry_server: RegistryServer, router_clock: FakeClock
                 ) -> AsyncIterator[RouterServer]:
    server = await start_router(router_clock, registry=f"127.0.0.1:{registry_server.port}")
    yield server
    await server.stop(0)


@pytest.fixture
async def stub(router: RouterServer) -> AsyncIterator[pb_grpc.RouterServiceStub]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    yield pb_grpc.RouterServiceStub(channel)
    await channel.close()


async def register(stub: pb_grpc.RouterServiceStub, instance_id: str, role: int,
                   engine_id: str = "", ttl: float = 0.0) -> pb.RegisterInstanceResponse:
    return await stub.RegisterInstance(pb.RegisterInstanceRequest(
        instance_id=instance_id, role=role, http_url=f"http://127.0.0.1:90{len(instance_id)}0",
        engine_id=engine_id or f"engine-{instance_id}", model=MODEL, nixl_host="127.0.0.1",
        nixl_port=5600, ttl=duration(ttl)))


async def test_membership_over_grpc(stub: pb_grpc.RouterServiceStub) -> None:
    resp = await register(stub, "d0", pb.ROLE_DECODE, ttl=6)
    assert resp.instance.instance_id == "d0"
    assert resp.heartbeat_interval.seconds == 2
    await register(stub, "p0", pb.ROLE_PREFILL)
    await stub.HeartbeatInstance(pb.HeartbeatInstanceRequest(
        instance_id="d0", load=pb.Load(running_requests=3, kv_usage=0.25)))
    listed = (await stub.ListInstances(pb.ListInstancesRequest())).instances
    assert [(i.instance_id, i.role) for i in listed] == [("p0", pb.ROLE_PREFILL),
                                                        ("d0", pb.ROLE_DECODE)]
    assert listed[1].load.running_requests == 3 and listed[1].load.kv_usage == 0.25
    only = (await stub.ListInstances(pb.ListInstancesRequest(role=pb.ROLE_PREFILL))).instances
    assert [i.instance_id for i in only] == ["p0"]
    assert (await stub.DeregisterInstance(pb.DeregisterInstanceRequest(instance_id="d0"))).removed
    with pytest.raises(grpc.RpcError) as raised:
        await stub.HeartbeatInstance(pb.HeartbeatInstanceRequest(instance_id="d0"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(raised.value).reason == "INSTANCE_NOT_FOUND"


@pytest.mark.parametrize(("request_", "field"), [
    (pb.RegisterInstanceRequest(instance_id="x", role=pb.ROLE_UNSPECIFIED,
                                http_url="http://h:1", engine_id="e", model="m"), "role"),
    (pb.RegisterInstanceRequest(instance_id="x", role=pb.ROLE_DECODE, http_url="h:1",
                                engine_id="e", model="m"), "http_url"),
    (pb.RegisterInstanceRequest(instance_id="x", role=pb.ROLE_DECODE, http_url="http://h:1",
                                engine_id="e", model="m", ttl=duration(0.1)), "ttl"),
])
async def test_bad_registration_over_grpc(stub: pb_grpc.RouterServiceStub,
                                          request_: pb.RegisterInstanceRequest,
                                          field: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        await stub.RegisterInstance(request_)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(raised.value)
    assert info.reason == "INVALID_ARGUMENT" and info.metadata["field"] == field
    assert not (await stub.ListInstances(pb.ListInstancesRequest())).instances


async def grant(registry: AsyncRegistryClient, kv: Any, holder: str, tenant: str,
                conversation: str, tokens: list[int]) -> reg_pb.Lease:
    await registry.register_holder(holder, "127.0.0.1", 5600, kv.block_size, kv.fingerprint,
                                   ttl=60)
    n = -(-len(tokens) // kv.block_size)
    resp = await registry.grant_lease(holder, tenant, conversation, f"req-{conversation}",
                                      list(range(1, n + 1)), len(tokens),
                                      kv.lease_hashes(tokens))
    return resp.lease


async def test_route_follows_the_lease_and_tenants_stay_apart(
        stub: pb_grpc.RouterServiceStub, registry_client: AsyncRegistryClient, kv: Any) -> None:
    await register(stub, "p0", pb.ROLE_PREFILL)
    for name in ("d0", "d1", "d2"):
        await register(stub, name, pb.ROLE_DECODE)
    await grant(registry_client, kv, "engine-d2", "t1", "c1", kv.tokens(10))
    for _ in range(3):  # sticky, turn after turn, while d2 is not overloaded
        resp = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c1",
                                                prompt_tokens=40, model=MODEL))
        assert resp.decode.instance_id == "d2"
        assert resp.decode_reason == pb.DECODE_REASON_HOLDS_LEASE
        assert resp.lease_holder_id == "engine-d2"
        assert resp.prefill.instance_id == "p0"
        assert resp.prefill_reason == pb.PREFILL_REASON_LEAST_LOADED
    other = await stub.Route(pb.RouteRequest(tenant="t2", conversation_id="c1",
                                             prompt_tokens=40))
    assert other.decode_reason == pb.DECODE_REASON_NO_LEASE
    assert other.lease_holder_id == ""
    # d2 gets busy: the next turn goes to the least loaded instance, and says why.
    await stub.HeartbeatInstance(pb.HeartbeatInstanceRequest(
        instance_id="d2", load=pb.Load(running_requests=9)))
    resp = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c1",
                                            prompt_tokens=40))
    assert resp.decode_reason == pb.DECODE_REASON_HOLDER_OVERLOADED
    assert resp.decode.instance_id in ("d0", "d1")
    assert "overloaded" in resp.explanation


async def test_route_without_registry_or_instances(
        router_clock: FakeClock, unused_tcp_port: int) -> None:
    server = await start_router(router_clock, registry=f"127.0.0.1:{unused_tcp_port}",
                                registry_timeout_s=0.2)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.RouterServiceStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            await stub.Route(pb.RouteRequest(tenant="t", conversation_id="c", prompt_tokens=1))
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(raised.value).reason == "NO_INSTANCE"
        await register(stub, "p0", pb.ROLE_PREFILL)
        await register(stub, "d0", pb.ROLE_DECODE)
        resp = await stub.Route(pb.RouteRequest(tenant="t", conversation_id="c",
                                                prompt_tokens=1))
        assert resp.decode_reason == pb.DECODE_REASON_REGISTRY_UNAVAILABLE
        assert resp.decode.instance_id == "d0"
        with pytest.raises(grpc.RpcError) as raised:
            await stub.Route(pb.RouteRequest(tenant="bad tenant", conversation_id="c"))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
        await server.stop(0)


async def test_reads_through_the_router_never_offer_a_dead_holder(
        stub: pb_grpc.RouterServiceStub, registry_client: AsyncRegistryClient,
        registry_server: RegistryServer, router_clock: FakeClock, kv: Any) -> None:
    await register(stub, "d0", pb.ROLE_DECODE, ttl=5)
    tokens = kv.tokens(10)
    lease = await grant(registry_client, kv, "engine-d0", "t1", "c1", tokens)
    request = reg_pb.AcquireReadRequest(tenant="t1", conversation_id="c1",
                                        block_hashes=kv.prompt_hashes(tokens + [99, 98]),
                                        min_tokens=1, reader_id="p0")
    hit = await stub.AcquireRead(request)
    assert hit.miss_reason == reg_pb.MISS_REASON_UNSPECIFIED
    assert hit.lease.lease_id == lease.lease_id
    assert list(hit.remote_block_ids) == [1, 2]
    assert hit.partial_block_id == 3 and hit.partial_block_tokens == 2
    assert (await stub.ReleaseRead(reg_pb.ReleaseReadRequest(pin_id=hit.pin.pin_id))).released
    # The engine stops heartbeating the router; the registry has not noticed (its holder TTL
    # is longer): the router refuses the read and leaves no pin behind.
    router_clock.advance(5.1)
    miss = await stub.AcquireRead(request)
    assert miss.miss_reason == reg_pb.MISS_REASON_HOLDER_GONE
    assert not miss.pin.pin_id and not miss.remote_block_ids
    assert registry_server.table.counts()["pins"] == 0
    # The registry's own errors come back as they are.
    with pytest.raises(grpc.RpcError) as raised:
        await stub.AcquireRead(reg_pb.AcquireReadRequest(tenant="t1", conversation_id="c1",
                                                         block_hashes=b"short"))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(raised.value)
    assert info.reason == "INVALID_ARGUMENT" and info.metadata["field"] == "block_hashes"


async def test_route_pins_the_read_for_prefill(
        stub: pb_grpc.RouterServiceStub, registry_client: AsyncRegistryClient,
        registry_server: RegistryServer, router_clock: FakeClock, kv: Any) -> None:
    """With pin_read, Route pins the conversation's whole lease and returns the read with the
    lease's hashes, in the same call that picks the instances."""
    await register(stub, "p0", pb.ROLE_PREFILL)
    await register(stub, "d0", pb.ROLE_DECODE, ttl=5)
    none = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c1", prompt_tokens=9,
                                            pin_read=True))
    assert none.HasField("read")
    assert none.read.read.miss_reason == reg_pb.MISS_REASON_NO_LEASE
    assert none.decode_reason == pb.DECODE_REASON_NO_LEASE
    tokens = kv.tokens(10)
    lease = await grant(registry_client, kv, "engine-d0", "t1", "c1", tokens)
    resp = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c1", prompt_tokens=40,
                                            pin_read=True, pin_ttl=duration(3.0)))
    assert resp.decode.instance_id == "d0"
    assert resp.decode_reason == pb.DECODE_REASON_HOLDS_LEASE
    read = resp.read.read
    assert read.lease.lease_id == lease.lease_id and read.pin.pin_id
    assert 0 < read.pin.expires_in.ToNanoseconds() <= 3_000_000_000
    assert list(read.remote_block_ids) == [1, 2] and read.matched_blocks == 2
    assert read.partial_block_id == 3 and read.partial_block_tokens == 2
    # The lease's own hashes: the reader checks its prompt against them.
    assert resp.read.block_hashes == kv.prompt_hashes(tokens)
    assert read.partial_block_hash == kv.lease_hashes(tokens)[32:]
    assert registry_server.table.counts()["pins"] == 1
    assert (await stub.ReleaseRead(reg_pb.ReleaseReadRequest(pin_id=read.pin.pin_id))).released
    # Without pin_read, nothing is pinned.
    plain = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c1",
                                             prompt_tokens=40))
    assert not plain.HasField("read") and plain.lease_holder_id == "engine-d0"
    # The engine stops heartbeating the router: no read of its KV, and no pin left behind.
    router_clock.advance(5.1)
    await register(stub, "d1", pb.ROLE_DECODE)
    dead = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c1",
                                            prompt_tokens=40, pin_read=True))
    assert dead.read.read.miss_reason == reg_pb.MISS_REASON_HOLDER_GONE
    assert not dead.read.read.pin.pin_id and dead.decode.instance_id == "d1"
    assert registry_server.table.counts()["pins"] == 0
    with pytest.raises(grpc.RpcError) as raised:
        await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c1", pin_read=True,
                                         pin_ttl=duration_pb2.Duration(seconds=-1)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert registry_server.table.counts()["pins"] == 0


async def test_route_waits_for_a_lease_only_while_the_conversation_has_none(
        router: RouterServer, stub: pb_grpc.RouterServiceStub,
        registry_client: AsyncRegistryClient, router_clock: FakeClock, kv: Any) -> None:
    """A follow-up can beat decode's background grant over the turn before it: with
    lease_wait, Route waits for a lease while the conversation has none, then pins and routes
    to its holder; a conversation with a lease is routed at once, and one that gets none within
    the wait is routed as without a lease, its miss counted once."""
    await register(stub, "p0", pb.ROLE_PREFILL)
    await register(stub, "d0", pb.ROLE_DECODE)
    await register(stub, "d1", pb.ROLE_DECODE)
    tokens = kv.tokens(10)

    def reads(outcome: str) -> float:
        value = router.metrics.registry.get_sample_value("kvbridge_router_reads_total",
                                                         {"outcome": outcome})
        return value or 0.0

    async def grant_soon(conversation: str) -> None:  # as decode's grant thread would
        await asyncio.sleep(0.1)
        await grant(registry_client, kv, "engine-d1", "t1", conversation, tokens)

    for pin in (True, False):
        conversation = f"c-{pin}"
        hits, misses = reads("hit"), reads("miss")
        granting = asyncio.create_task(grant_soon(conversation))
        waited = await stub.Route(pb.RouteRequest(
            tenant="t1", conversation_id=conversation, prompt_tokens=40, pin_read=pin,
            lease_wait=duration(2.0)))
        await granting
        assert waited.decode.instance_id == "d1", pin
        assert waited.decode_reason == pb.DECODE_REASON_HOLDS_LEASE
        assert 0.05 <= seconds(waited.lease_waited) < 1.5
        assert waited.HasField("read") == pin
        if pin:
            assert waited.read.read.pin.pin_id
            assert (reads("hit"), reads("miss")) == (hits + 1, misses)
            await stub.ReleaseRead(reg_pb.ReleaseReadRequest(pin_id=waited.read.read.pin.pin_id))
        # The lease is there now: no wait at all.
        at_once = await stub.Route(pb.RouteRequest(
            tenant="t1", conversation_id=conversation, prompt_tokens=40, lease_wait=duration(2.0)))
        assert at_once.decode_reason == pb.DECODE_REASON_HOLDS_LEASE
        assert seconds(at_once.lease_waited) == 0.0

    # No lease comes: routed without one once the wait is over, its miss counted once.
    misses = reads("miss")
    none = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c-none",
                                            prompt_tokens=40, pin_read=True,
                                            lease_wait=duration(0.1)))
    assert none.decode_reason == pb.DECODE_REASON_NO_LEASE
    assert none.read.read.miss_reason == reg_pb.MISS_REASON_NO_LEASE
    assert 0.1 <= seconds(none.lease_waited) < 1.5
    assert reads("miss") == misses + 1
    # A revoked lease is no active lease: the turn waits for the grant over its last turn.
    revoked = await grant(registry_client, kv, "engine-d1", "t1", "c-revoked", tokens)
    await registry_client.revoke_lease(revoked.lease_id, "memory_pressure")

    async def grant_next() -> None:
        await asyncio.sleep(0.1)
        await registry_client.grant_lease("engine-d1", "t1", "c-revoked", "req-next", [7, 8, 9],
                                          len(tokens), kv.lease_hashes(tokens))

    granting = asyncio.create_task(grant_next())
    renewed = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c-revoked",
                                               prompt_tokens=40, pin_read=True,
                                               lease_wait=duration(2.0)))
    await granting
    assert list(renewed.read.read.remote_block_ids) == [7, 8]  # the partial block apart
    assert 0.05 <= seconds(renewed.lease_waited) < 1.5
    # An active lease whose holder the router has seen die is not waited on: refused at once.
    router_clock.advance(31)
    await register(stub, "p0", pb.ROLE_PREFILL)
    await register(stub, "d0", pb.ROLE_DECODE)
    dead = await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c-revoked",
                                            prompt_tokens=40, pin_read=True,
                                            lease_wait=duration(2.0)))
    assert dead.read.read.miss_reason == reg_pb.MISS_REASON_HOLDER_GONE
    assert seconds(dead.lease_waited) == 0.0 and dead.decode.instance_id == "d0"
    for bad in (duration(5.5), duration_pb2.Duration(seconds=-1)):
        with pytest.raises(grpc.RpcError) as raised:
            await stub.Route(pb.RouteRequest(tenant="t1", conversation_id="c-none",
                                             pin_read=True, lease_wait=bad))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(raised.value).metadata["field"] == "lease_wait"


async def test_route_pin_read_without_registry_leaves_the_read_unset(
        router_clock: FakeClock, unused_tcp_port: int) -> None:
    server = await start_router(router_clock, registry=f"127.0.0.1:{unused_tcp_port}",
                                registry_timeout_s=0.2)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.RouterServiceStub(channel)
    try:
        await register(stub, "p0", pb.ROLE_PREFILL)
        await register(stub, "d0", pb.ROLE_DECODE)
        resp = await stub.Route(pb.RouteRequest(tenant="t", conversation_id="c",
                                                prompt_tokens=1, pin_read=True))
        assert resp.decode_reason == pb.DECODE_REASON_REGISTRY_UNAVAILABLE
        assert not resp.HasField("read")  # prefill looks the lease up for itself
    finally:
        await channel.close()
        await server.stop(0)


# ==== CLI ========================================================================================


class ThreadedRouter:
    """A router on its own thread and loop, for the blocking client and the CLI."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            start_router(FakeClock(), registry=""), self.loop).result(10)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def threaded_router() -> Iterator[ThreadedRouter]:
    router = ThreadedRouter()
    yield router
    router.close()


def test_instances_list_cli_and_blocking_client(threaded_router: ThreadedRouter) -> None:
    with RouterClient(threaded_router.target) as client:
        client.register_instance("d0", "decode", "http://127.0.0.1:8200", "engine-d0", MODEL,
                                 "127.0.0.1", 5601)
        client.register_instance("p0", "prefill", "http://127.0.0.1:8100", "engine-p0", MODEL)
        client.heartbeat("d0", running=2, waiting=1, kv_usage=0.5)
        route = client.route("t", "c", 100, MODEL)
        assert route.decode.instance_id == "d0"  # no registry: routed by load alone
        assert route.decode_reason == pb.DECODE_REASON_NO_LEASE
    runner = CliRunner()
    result = runner.invoke(main, ["instances", "list", "--router", threaded_router.target])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:4] == ["INSTANCE", "ROLE", "MODEL", "URL"]
    assert lines[1].split()[:2] == ["p0", "prefill"] and lines[2].split()[:2] == ["d0", "decode"]
    assert lines[2].split()[5:8] == ["2", "1", "50%"]
    assert lines[-1] == "2 instance(s)"
    result = runner.invoke(main, ["instances", "list", "--router", threaded_router.target,
                                  "--role", "decode", "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines()]
    assert [r["instance_id"] for r in records] == ["d0"]
    assert records[0]["load"]["running_requests"] == 2


def test_instances_list_cli_explains_an_unreachable_router(unused_tcp_port: int) -> None:
    result = CliRunner().invoke(main, ["instances", "list", "--router",
                                       f"127.0.0.1:{unused_tcp_port}", "--timeout", "0.5"])
    assert result.exit_code == 1
    assert "cannot reach the router" in result.output
    assert "kvbridge router serve" in result.output
