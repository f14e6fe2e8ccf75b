"""Malformed and refused requests, for every RPC, over real gRPC.

Each case checks the canonical status code, the google.rpc.ErrorInfo (domain "kvbridge.dev",
reason, field), the exception class the client raises, and that the registry's state is exactly
what it was before the call. Every case that starts from the shared `world` runs against both
backends: the memory store and a Redis store (a real redis-server).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from kvbridge import errors
from kvbridge._grpc_status import error_info
from kvbridge.clients import AsyncRegistryClient, duration
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc
from kvbridge.services.registry import MemoryStore, RegistryServer
from kvbridge.services.registry._redis import RedisStore

INVALID = grpc.StatusCode.INVALID_ARGUMENT
LONG_ID = "x" * 257  # max_id_length is 256
BAD_IDS = {"empty": "", "oversized": LONG_ID, "space": "a b", "nul": "a\x00b", "non_ascii": "é",
           "newline": "conv\n"}


@dataclass
class World:
    """The state every case starts from."""

    kv: Any
    lease: pb.Lease  # t1/c1, holder h1, pinned by reader p1 (request r1)
    other: pb.Lease  # t1/c2, holder h1
    pin_id: str


async def snapshot(stub: pb_grpc.RegistryServiceStub, server: Any) -> tuple[Any, ...]:
    leases = await stub.ListLeases(pb.ListLeasesRequest(include_inactive=True,
                                                        include_blocks=True))
    holders = await stub.ListHolders(pb.ListHoldersRequest())
    if not isinstance(server.store, MemoryStore):  # Redis time runs: compare all but clocks
        for item in [*leases.leases, *holders.holders]:
            for name in ("expires_in", "expire_time", "create_time"):
                if item.DESCRIPTOR.fields_by_name.get(name) is not None:
                    item.ClearField(name)  # type: ignore[arg-type]
    return (leases.SerializeToString(deterministic=True),
            holders.SerializeToString(deterministic=True),
            server.store.counts() if isinstance(server.store, MemoryStore) else None)


@pytest.fixture(params=["memory", "redis"])
async def registry_server(request: pytest.FixtureRequest,
                          registry_clock: Any) -> AsyncIterator[RegistryServer]:
    """The conftest registry, on each backend (the Redis one on a namespace of its own)."""
    from conftest import start_registry

    if request.param == "memory":
        server = await start_registry(registry_clock)
    else:
        redis_server = request.getfixturevalue("redis_server")
        server = await start_registry(
            registry_clock, skip_grace=False, backend="redis", redis_url=redis_server.url,
            redis_namespace=request.getfixturevalue("redis_namespace"))
        assert isinstance(server.store, RedisStore)
        await server.store.advance_clock(server.config.effective_recovery_grace_s)
    yield server
    await server.stop(0)


@pytest.fixture
async def world(registry_client: AsyncRegistryClient, kv) -> World:
    c = registry_client
    await c.register_holder(**kv.holder_args("h1"))
    await c.register_holder(**kv.holder_args("h2"))
    drained = await c.grant_lease(**kv.grant_args("h2", "t2", "c9", kv.tokens(4)))
    await c.deregister_holder("h2")  # h2 is draining; its lease revoked
    assert drained.lease.lease_id
    lease = (await c.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(10)))).lease
    other = (await c.grant_lease(**kv.grant_args("h1", "t1", "c2", kv.tokens(8),
                                                 request_id="grant-r1"))).lease
    read = await c.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)), reader_id="p1",
                                request_id="r1")
    assert read.pin.pin_id
    return World(kv, lease, other, read.pin.pin_id)


def dur(seconds: int = 0, nanos: int = 0) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


def holder_req(w: World, **kw: Any) -> pb.RegisterHolderRequest:
    args = w.kv.holder_args("h3")
    args.update(kw)
    return pb.RegisterHolderRequest(**args)


def grant_req(w: World, tokens: int = 10, **kw: Any) -> pb.GrantLeaseRequest:
    args = w.kv.grant_args("h1", "t1", "c5", w.kv.tokens(tokens))
    args.update(kw)
    return pb.GrantLeaseRequest(**args)


def snapshot_msg(w: World, **kw: Any) -> pb.LeaseSnapshot:
    args = w.kv.grant_args("h3", "t3", "c3", w.kv.tokens(8))
    del args["holder_id"]
    args.update(lease_id="l-held", epoch=1, idle_ttl=duration(60), age=duration(1))
    args.update(kw)
    return pb.LeaseSnapshot(**args)


def pin_req(w: World, **kw: Any) -> pb.PinLeaseRequest:
    args: dict[str, Any] = dict(tenant="t1", conversation_id="c1")
    args.update(kw)
    return pb.PinLeaseRequest(**args)


def read_req(w: World, **kw: Any) -> pb.AcquireReadRequest:
    args: dict[str, Any] = dict(tenant="t1", conversation_id="c1",
                                block_hashes=w.kv.prompt_hashes(w.kv.tokens(8)))
    args.update(kw)
    return pb.AcquireReadRequest(**args)


@dataclass
class Case:
    method: str
    request: Callable[[World], Any]
    code: grpc.StatusCode
    reason: str
    error: type[errors.KvbridgeError]
    field: str | None = None


def invalid(method: str, request: Callable[[World], Any], field: str) -> Case:
    return Case(method, request, INVALID, "INVALID_ARGUMENT", errors.InvalidArgument, field)


CASES: dict[str, Case] = {}
for _name, _bad in BAD_IDS.items():
    CASES[f"register-holder_id-{_name}"] = invalid(
        "RegisterHolder", lambda w, b=_bad: holder_req(w, holder_id=b), "holder_id")
    CASES[f"heartbeat-holder_id-{_name}"] = invalid(
        "HeartbeatHolder", lambda w, b=_bad: pb.HeartbeatHolderRequest(holder_id=b), "holder_id")
    CASES[f"deregister-holder_id-{_name}"] = invalid(
        "DeregisterHolder", lambda w, b=_bad: pb.DeregisterHolderRequest(holder_id=b),
        "holder_id")
    CASES[f"grant-tenant-{_name}"] = invalid(
        "GrantLease", lambda w, b=_bad: grant_req(w, tenant=b), "tenant")
    CASES[f"grant-conversation-{_name}"] = invalid(
        "GrantLease", lambda w, b=_bad: grant_req(w, conversation_id=b), "conversation_id")
    CASES[f"renew-lease_id-{_name}"] = invalid(
        "RenewLeases", lambda w, b=_bad: pb.RenewLeasesRequest(lease_ids=[w.lease.lease_id, b]),
        "lease_ids[1]")
    CASES[f"get-lease_id-{_name}"] = invalid(
        "GetLease", lambda w, b=_bad: pb.GetLeaseRequest(lease_id=b), "lease_id")
    CASES[f"revoke-lease_id-{_name}"] = invalid(
        "RevokeLease", lambda w, b=_bad: pb.RevokeLeaseRequest(lease_id=b), "lease_id")
    CASES[f"read-conversation-{_name}"] = invalid(
        "AcquireRead", lambda w, b=_bad: read_req(w, conversation_id=b), "conversation_id")
    CASES[f"pin-conversation-{_name}"] = invalid(
        "PinLease", lambda w, b=_bad: pin_req(w, conversation_id=b), "conversation_id")
    CASES[f"release-pin_id-{_name}"] = invalid(
        "ReleaseRead", lambda w, b=_bad: pb.ReleaseReadRequest(pin_id=b), "pin_id")

CASES.update({
    # RegisterHolder
    "register-nixl_host-empty": invalid("RegisterHolder", lambda w: holder_req(w, nixl_host=""),
                                        "nixl_host"),
    "register-nixl_port-too-big": invalid(
        "RegisterHolder", lambda w: holder_req(w, nixl_port=65536), "nixl_port"),
    "register-tp_size-zero": invalid("RegisterHolder", lambda w: holder_req(w, tp_size=0),
                                     "tp_size"),
    "register-block_size-zero": invalid("RegisterHolder", lambda w: holder_req(w, block_size=0),
                                        "block_size"),
    "register-block_size-huge": invalid(
        "RegisterHolder", lambda w: holder_req(w, block_size=65537), "block_size"),
    "register-fingerprint-non-printable": invalid(
        "RegisterHolder", lambda w: holder_req(w, engine_fingerprint="fp\t1"),
        "engine_fingerprint"),
    "register-software-version-non-printable": invalid(
        "RegisterHolder", lambda w: holder_req(w, software_version="kvbridge/1\n"),
        "software_version"),
    "register-ttl-negative": invalid("RegisterHolder", lambda w: holder_req(w, ttl=dur(-5)),
                                     "ttl"),
    "register-ttl-negative-nanos": invalid(
        "RegisterHolder", lambda w: holder_req(w, ttl=dur(0, -5)), "ttl"),
    "register-ttl-below-minimum": invalid(
        "RegisterHolder", lambda w: holder_req(w, ttl=dur(0, 500_000_000)), "ttl"),
    "register-ttl-oversized": invalid("RegisterHolder", lambda w: holder_req(w, ttl=dur(301)),
                                      "ttl"),
    "register-ttl-absurd": invalid(
        "RegisterHolder", lambda w: holder_req(w, ttl=dur(315_576_000_000)), "ttl"),
    "register-held-hash-length": invalid(
        "RegisterHolder",
        lambda w: holder_req(w, held_leases=[snapshot_msg(w, block_hashes=b"\x01" * 31)]),
        "held_leases[0].block_hashes"),
    "register-held-token-count": invalid(
        "RegisterHolder",
        lambda w: holder_req(w, held_leases=[snapshot_msg(w, token_count=9)]),
        "held_leases[0].token_count"),
    "register-held-duplicate": invalid(
        "RegisterHolder",
        lambda w: holder_req(w, held_leases=[snapshot_msg(w), snapshot_msg(w)]),
        "held_leases[1].lease_id"),
    "register-held-epoch-zero": invalid(
        "RegisterHolder", lambda w: holder_req(w, held_leases=[snapshot_msg(w, epoch=0)]),
        "held_leases[0].epoch"),
    "register-held-age-negative": invalid(
        "RegisterHolder", lambda w: holder_req(w, held_leases=[snapshot_msg(w, age=dur(-1))]),
        "held_leases[0].age"),
    "register-held-idle-negative": invalid(
        "RegisterHolder",
        lambda w: holder_req(w, held_leases=[snapshot_msg(w, idle_ttl=dur(-1))]),
        "held_leases[0].idle_ttl"),
    "register-held-lease_id-empty": invalid(
        "RegisterHolder", lambda w: holder_req(w, held_leases=[snapshot_msg(w, lease_id="")]),
        "held_leases[0].lease_id"),
    "register-layout-conflict": Case(
        "RegisterHolder", lambda w: holder_req(w, holder_id="h1", block_size=8),
        grpc.StatusCode.FAILED_PRECONDITION, "HOLDER_CONFLICT", errors.HolderConflict),
    "register-fingerprint-conflict": Case(
        "RegisterHolder", lambda w: holder_req(w, holder_id="h1", engine_fingerprint="other"),
        grpc.StatusCode.FAILED_PRECONDITION, "HOLDER_CONFLICT", errors.HolderConflict),
    # HeartbeatHolder
    "heartbeat-unknown-holder": Case(
        "HeartbeatHolder", lambda w: pb.HeartbeatHolderRequest(holder_id="h-unknown"),
        grpc.StatusCode.NOT_FOUND, "HOLDER_NOT_FOUND", errors.HolderNotFound),
    "heartbeat-batch-too-large": invalid(
        "HeartbeatHolder",
        lambda w: pb.HeartbeatHolderRequest(holder_id="h1",
                                            reclaimed_lease_ids=["l-x"] * 10_001),
        "reclaimed_lease_ids"),
    # DeregisterHolder
    "deregister-unknown-holder": Case(
        "DeregisterHolder", lambda w: pb.DeregisterHolderRequest(holder_id="h-unknown"),
        grpc.StatusCode.NOT_FOUND, "HOLDER_NOT_FOUND", errors.HolderNotFound),
    # ListHolders
    "list-holders-page-size": invalid(
        "ListHolders", lambda w: pb.ListHoldersRequest(page_size=1001), "page_size"),
    # GrantLease
    "grant-unknown-holder": Case(
        "GrantLease", lambda w: grant_req(w, holder_id="h-unknown"),
        grpc.StatusCode.NOT_FOUND, "HOLDER_NOT_FOUND", errors.HolderNotFound),
    "grant-holder_id-empty": invalid("GrantLease", lambda w: grant_req(w, holder_id=""),
                                     "holder_id"),
    "grant-draining-holder": Case(
        "GrantLease", lambda w: grant_req(w, holder_id="h2"),
        grpc.StatusCode.FAILED_PRECONDITION, "HOLDER_DRAINING", errors.HolderDraining),
    "grant-remote_request_id-empty": invalid(
        "GrantLease", lambda w: grant_req(w, remote_request_id=""), "remote_request_id"),
    "grant-request_id-non-printable": invalid(
        "GrantLease", lambda w: grant_req(w, request_id="r 1"), "request_id"),
    "grant-request_id-oversized": invalid(
        "GrantLease", lambda w: grant_req(w, request_id=LONG_ID), "request_id"),
    "grant-no-blocks": invalid(
        "GrantLease", lambda w: grant_req(w, block_ids=[], token_count=0, block_hashes=b""),
        "block_ids"),
    "grant-hash-length": invalid(
        "GrantLease", lambda w: grant_req(w, block_hashes=b"\x00" * (3 * 16 - 1)),
        "block_hashes"),
    "grant-hash-count": invalid(
        "GrantLease", lambda w: grant_req(w, block_hashes=b"\x00" * (2 * 16)), "block_hashes"),
    "grant-tokens-too-many": invalid("GrantLease", lambda w: grant_req(w, token_count=13),
                                     "token_count"),
    "grant-tokens-too-few": invalid("GrantLease", lambda w: grant_req(w, token_count=8),
                                    "token_count"),
    "grant-tokens-zero": invalid(
        "GrantLease", lambda w: grant_req(w, 4, token_count=0), "token_count"),
    "grant-too-many-blocks": invalid(
        "GrantLease",
        lambda w: grant_req(w, block_ids=list(range(16385)), token_count=16385 * 4,
                            block_hashes=b"\x00" * (16385 * 16)),
        "block_ids"),
    "grant-idle-negative": invalid("GrantLease", lambda w: grant_req(w, idle_ttl=dur(-1)),
                                   "idle_ttl"),
    "grant-idle-below-minimum": invalid(
        "GrantLease", lambda w: grant_req(w, idle_ttl=dur(0, 1000)), "idle_ttl"),
    "grant-idle-oversized": invalid("GrantLease", lambda w: grant_req(w, idle_ttl=dur(3601)),
                                    "idle_ttl"),
    "grant-lifetime-negative": invalid(
        "GrantLease", lambda w: grant_req(w, max_lifetime=dur(0, -1)), "max_lifetime"),
    "grant-lifetime-below-idle": invalid(
        "GrantLease", lambda w: grant_req(w, idle_ttl=dur(30), max_lifetime=dur(10)),
        "max_lifetime"),
    "grant-lifetime-oversized": invalid(
        "GrantLease", lambda w: grant_req(w, max_lifetime=dur(86401)), "max_lifetime"),
    "grant-request_id-reused": Case(
        "GrantLease", lambda w: grant_req(w, request_id="grant-r1"),
        grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_REUSED", errors.IdempotencyConflict),
    # RenewLeases
    "renew-batch-too-large": invalid(
        "RenewLeases", lambda w: pb.RenewLeasesRequest(lease_ids=["l-x"] * 10_001),
        "lease_ids"),
    "renew-batch-too-large-mixed": invalid(
        "RenewLeases", lambda w: pb.RenewLeasesRequest(
            lease_ids=["l-x"] * 5_001,
            conversations=[pb.ConversationRef(tenant="t", conversation_id="c")] * 5_000),
        "lease_ids"),
    "renew-conversation-tenant-empty": invalid(
        "RenewLeases", lambda w: pb.RenewLeasesRequest(
            conversations=[pb.ConversationRef(tenant="t1", conversation_id="c1"),
                           pb.ConversationRef(tenant="", conversation_id="c1")]),
        "conversations[1].tenant"),
    "renew-conversation-id-oversized": invalid(
        "RenewLeases", lambda w: pb.RenewLeasesRequest(
            conversations=[pb.ConversationRef(tenant="t1", conversation_id=LONG_ID)]),
        "conversations[0].conversation_id"),
    # RevokeLease
    "revoke-unknown-lease": Case(
        "RevokeLease", lambda w: pb.RevokeLeaseRequest(lease_id="l-unknown"),
        grpc.StatusCode.NOT_FOUND, "LEASE_NOT_FOUND", errors.LeaseNotFound),
    "revoke-other-holder": Case(
        "RevokeLease", lambda w: pb.RevokeLeaseRequest(lease_id=w.lease.lease_id,
                                                        holder_id="h2"),
        grpc.StatusCode.PERMISSION_DENIED, "NOT_LEASE_HOLDER", errors.NotLeaseHolder),
    "revoke-holder_id-non-printable": invalid(
        "RevokeLease", lambda w: pb.RevokeLeaseRequest(lease_id=w.lease.lease_id,
                                                        holder_id="h\x7f"), "holder_id"),
    "revoke-reason-oversized": invalid(
        "RevokeLease", lambda w: pb.RevokeLeaseRequest(lease_id=w.lease.lease_id,
                                                        reason="r" * 1025), "reason"),
    # GetLease
    "get-unknown-lease": Case(
        "GetLease", lambda w: pb.GetLeaseRequest(lease_id="l-unknown"),
        grpc.StatusCode.NOT_FOUND, "LEASE_NOT_FOUND", errors.LeaseNotFound),
    # ListLeases
    "list-leases-page-size": invalid(
        "ListLeases", lambda w: pb.ListLeasesRequest(page_size=1001), "page_size"),
    "list-leases-conversation-without-tenant": invalid(
        "ListLeases", lambda w: pb.ListLeasesRequest(conversation_id="c1"), "conversation_id"),
    "list-leases-tenant-non-printable": invalid(
        "ListLeases", lambda w: pb.ListLeasesRequest(tenant="t 1"), "tenant"),
    "list-leases-holder-oversized": invalid(
        "ListLeases", lambda w: pb.ListLeasesRequest(holder_id=LONG_ID), "holder_id"),
    "list-leases-page-token-garbage": invalid(
        "ListLeases", lambda w: pb.ListLeasesRequest(page_token="\x00\x01"), "page_token"),
    # AcquireRead
    "read-tenant-empty": invalid("AcquireRead", lambda w: read_req(w, tenant=""), "tenant"),
    "read-hash-length": invalid(
        "AcquireRead", lambda w: read_req(w, block_hashes=b"\x00" * 17), "block_hashes"),
    "read-too-many-hashes": invalid(
        "AcquireRead", lambda w: read_req(w, block_hashes=b"\x00" * (16384 * 4 + 1) * 16),
        "block_hashes"),
    "read-pin_ttl-negative": invalid("AcquireRead", lambda w: read_req(w, pin_ttl=dur(-1)),
                                     "pin_ttl"),
    "read-min_tokens-oversized": invalid(
        "AcquireRead", lambda w: read_req(w, min_tokens=2**31 + 1), "min_tokens"),
    "read-reader_id-non-printable": invalid(
        "AcquireRead", lambda w: read_req(w, reader_id="prefill 1"), "reader_id"),
    "read-request_id-oversized": invalid(
        "AcquireRead", lambda w: read_req(w, request_id=LONG_ID), "request_id"),
    "read-request_id-reused": Case(
        "AcquireRead", lambda w: read_req(w, conversation_id="c2", reader_id="p1",
                                          request_id="r1"),
        grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_REUSED", errors.IdempotencyConflict),
    # PinLease
    "pin-tenant-empty": invalid("PinLease", lambda w: pin_req(w, tenant=""), "tenant"),
    "pin-pin_ttl-negative": invalid("PinLease", lambda w: pin_req(w, pin_ttl=dur(-1)),
                                    "pin_ttl"),
    "pin-min_tokens-oversized": invalid(
        "PinLease", lambda w: pin_req(w, min_tokens=2**31 + 1), "min_tokens"),
    "pin-reader_id-non-printable": invalid(
        "PinLease", lambda w: pin_req(w, reader_id="prefill 1"), "reader_id"),
    "pin-request_id-oversized": invalid(
        "PinLease", lambda w: pin_req(w, request_id=LONG_ID), "request_id"),
    "pin-request_id-reused": Case(
        "PinLease", lambda w: pin_req(w, conversation_id="c2", reader_id="p1",
                                      request_id="r1"),
        grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_REUSED", errors.IdempotencyConflict),
    # ReleaseRead: an unknown pin is not an error (released=False), see test_service.py.
})


@pytest.mark.parametrize("name", sorted(CASES))
async def test_bad_request_is_refused_with_status_and_changes_nothing(
        name, world, registry_server, registry_stub, registry_client):
    case = CASES[name]
    request = case.request(world)
    before = await snapshot(registry_stub, registry_server)

    with pytest.raises(grpc.RpcError) as raised:
        await getattr(registry_stub, case.method)(request)
    err = raised.value
    assert err.code() == case.code, err.details()
    info = error_info(err)
    assert info is not None, "no ErrorInfo in the status details"
    assert info.domain == "kvbridge.dev"
    assert info.reason == case.reason
    if case.field is not None:
        assert info.metadata["field"] == case.field
        assert err.details().startswith(case.field + ": ")

    # The client raises the matching domain error (through its one call path).
    with pytest.raises(case.error) as client_err:
        await registry_client._call(case.method, request, idempotent=True, timeout=None)
    assert type(client_err.value) is case.error
    assert client_err.value.reason == case.reason
    if case.field is not None:
        assert client_err.value.field == case.field

    assert await snapshot(registry_stub, registry_server) == before


def test_every_rpc_has_a_bad_input_case():
    methods = set(pb.DESCRIPTOR.services_by_name["RegistryService"].methods_by_name)
    # GetServerInfo takes no input.
    covered = {c.method for c in CASES.values()} | {"WatchLeases", "GetServerInfo"}
    assert covered == methods


async def test_not_found_errors_carry_the_id(world, registry_stub):
    with pytest.raises(grpc.RpcError) as raised:
        await registry_stub.GetLease(pb.GetLeaseRequest(lease_id="l-gone"))
    assert dict(error_info(raised.value).metadata) == {"lease_id": "l-gone"}
    with pytest.raises(grpc.RpcError) as raised:
        await registry_stub.HeartbeatHolder(pb.HeartbeatHolderRequest(holder_id="h-gone"))
    assert dict(error_info(raised.value).metadata) == {"holder": "h-gone"}


async def test_public_client_methods_raise_domain_errors(world, registry_client):
    c = registry_client
    with pytest.raises(errors.LeaseNotFound):
        await c.get_lease("l-unknown")
    with pytest.raises(errors.HolderNotFound):
        await c.heartbeat("h-unknown")
    with pytest.raises(errors.HolderDraining):
        await c.grant_lease(**world.kv.grant_args("h2", "t1", "c7", world.kv.tokens(4)))
    with pytest.raises(errors.NotLeaseHolder):
        await c.revoke_lease(world.lease.lease_id, holder_id="h2")
    with pytest.raises(errors.InvalidArgument) as bad:
        await c.list_leases(page_size=5000)
    assert bad.value.field == "page_size"
    with pytest.raises(errors.InvalidArgument) as bad:
        await c.acquire_read("t1", "c1", b"\x00" * 5)
    assert bad.value.field == "block_hashes"
    assert "multiple of 16" in bad.value.message
    with pytest.raises(errors.InvalidArgument) as bad:
        await c.release_read("")
    assert bad.value.field == "pin_id"


@pytest.mark.parametrize(("filters", "field"), [
    ({"holder_id": "a b"}, "holder_id"), ({"tenant": LONG_ID}, "tenant"),
    ({"holder_id": "\x00"}, "holder_id"),
])
async def test_watch_rejects_bad_filters(world, registry_stub, registry_client, filters, field):
    with pytest.raises(grpc.RpcError) as raised:
        async for _ in registry_stub.WatchLeases(pb.WatchLeasesRequest(**filters)):
            pass
    assert raised.value.code() == INVALID
    info = error_info(raised.value)
    assert (info.domain, info.reason, info.metadata["field"]) == (
        "kvbridge.dev", "INVALID_ARGUMENT", field)
    with pytest.raises(errors.InvalidArgument) as client_err:
        async for _ in registry_client.watch_leases(**filters):
            pass
    assert client_err.value.field == field


async def test_too_many_watchers_is_resource_exhausted(registry_factory, watchers):
    server = await registry_factory(max_watchers=1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RegistryServiceStub(channel)
        first = stub.WatchLeases(pb.WatchLeasesRequest())
        await watchers(server, 1)
        with pytest.raises(grpc.RpcError) as raised:
            async for _ in stub.WatchLeases(pb.WatchLeasesRequest(tenant="t1")):
                pass
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = error_info(raised.value)
        assert (info.domain, info.reason) == ("kvbridge.dev", "CAPACITY_EXHAUSTED")
        async with AsyncRegistryClient(f"127.0.0.1:{server.port}") as client:
            with pytest.raises(errors.CapacityExhausted):
                async for _ in client.watch_leases():
                    pass
        first.cancel()
        await watchers(server, 0)
        # The slot is free again once the first watcher leaves.
        again = stub.WatchLeases(pb.WatchLeasesRequest())
        await watchers(server, 1)
        again.cancel()


async def test_lease_capacity_is_resource_exhausted(registry_factory, kv):
    server = await registry_factory(max_leases=2)
    async with AsyncRegistryClient(f"127.0.0.1:{server.port}") as client, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RegistryServiceStub(channel)
        await client.register_holder(**kv.holder_args("h1"))
        for conv in ("a", "b"):
            await client.grant_lease(**kv.grant_args("h1", "t1", conv, kv.tokens(4)))
        before = await snapshot(stub, server)
        request = pb.GrantLeaseRequest(**kv.grant_args("h1", "t1", "c", kv.tokens(4)))
        with pytest.raises(grpc.RpcError) as raised:
            await stub.GrantLease(request)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = error_info(raised.value)
        assert (info.domain, info.reason, info.metadata["limit"]) == (
            "kvbridge.dev", "CAPACITY_EXHAUSTED", "2")
        with pytest.raises(errors.CapacityExhausted):
            await client.grant_lease(**kv.grant_args("h1", "t1", "c", kv.tokens(4)))
        # Re-registering with more held leases than fit is refused the same way.
        held = [pb.LeaseSnapshot(lease_id=f"l-held-{i}", tenant="t2", conversation_id=f"c{i}",
                                 remote_request_id="r", block_ids=[1], token_count=4,
                                 block_hashes=kv.lease_hashes(kv.tokens(4)), epoch=1)
                for i in range(2)]
        with pytest.raises(errors.CapacityExhausted):
            await client.register_holder(**kv.holder_args("h2"), held_leases=held)
        assert await snapshot(stub, server) == before


async def test_message_over_max_message_bytes_is_resource_exhausted(registry_factory, kv):
    server = await registry_factory(max_message_bytes=64 * 1024)
    async with AsyncRegistryClient(f"127.0.0.1:{server.port}") as client, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RegistryServiceStub(channel)
        await client.register_holder(**kv.holder_args("h1"))
        before = await snapshot(stub, server)
        n = 5000  # 5000 blocks: ~80 KiB of hashes
        big = kv.grant_args("h1", "t1", "c1", kv.tokens(n * kv.block_size))
        assert len(big["block_hashes"]) > 64 * 1024
        with pytest.raises(grpc.RpcError) as raised:
            await stub.GrantLease(pb.GrantLeaseRequest(**big))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(errors.CapacityExhausted):
            await client.grant_lease(**big)
        assert await snapshot(stub, server) == before
        # A message under the limit still goes through.
        small = kv.grant_args("h1", "t1", "c1", kv.tokens(100 * kv.block_size))
        assert (await client.grant_lease(**small)).lease.token_count == 400
