"""The registry's per-caller limits (issue 32, items 3, 7 and 11), over real gRPC on 127.0.0.1:
broad listings and watch opens are rate-limited per caller (one-conversation lookups are not),
a caller registers a bounded number of live holders, and two callers of one tenant never share
a pin."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from conftest import KvKit, start_registry

from kvbridge import auth
from kvbridge._grpc_status import error_info
from kvbridge.clock import FakeClock
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc
from kvbridge.services.registry import RegistryServer

ADMIN = "admin-token-0123456789"
HOLDERS = "holders-token-0123456789"
ACME = "tenant-acme-token-0123456789"
GLOBEX = "tenant-globex-token-0123456789"
READER_1 = "reader-acme-one-token-0123456789"
READER_2 = "reader-acme-two-token-0123456789"
TOKENS = ";".join([
    f"{ADMIN} admin name=ops",
    f"{HOLDERS} holder holder=dec-* name=decoders",
    f"{ACME} tenant tenants=acme name=acme-ops",
    f"{GLOBEX} tenant tenants=globex name=globex-ops",
    f"{READER_1} reader tenants=acme name=prefill-1",
    f"{READER_2} reader tenants=acme name=prefill-2",
])


def md(token: str) -> tuple[tuple[str, str], ...]:
    return tuple(auth.call_metadata(token))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def registry(clock: FakeClock) -> AsyncIterator[RegistryServer]:
    server = await start_registry(clock, auth_tokens=TOKENS, list_rate_per_principal=5.0,
                                  list_burst_per_principal=3, max_holders_per_principal=2)
    yield server
    await server.stop(0)


@pytest.fixture
async def stub(registry: RegistryServer) -> AsyncIterator[pb_grpc.RegistryServiceStub]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    yield pb_grpc.RegistryServiceStub(channel)
    await channel.close()


async def rate_limited(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value.details()
    return raised.value


async def test_broad_listings_are_rate_limited_per_caller(
        stub: pb_grpc.RegistryServiceStub, clock: FakeClock) -> None:
    """A caller looping ListLeases over its tenant gets RESOURCE_EXHAUSTED (RATE_LIMITED,
    with when to retry) past its burst; another caller is not slowed by it, a lookup of one
    conversation is never limited, and the bucket refills with time."""
    broad = pb.ListLeasesRequest(tenant="acme")
    for _ in range(3):
        await stub.ListLeases(broad, metadata=md(ACME))
    err = await rate_limited(stub.ListLeases(broad, metadata=md(ACME)))
    info = error_info(err)
    assert info is not None and info.reason == "RATE_LIMITED"
    assert float(info.metadata["retry_after_s"]) > 0
    await stub.ListLeases(pb.ListLeasesRequest(tenant="globex"), metadata=md(GLOBEX))
    for _ in range(5):  # the gateway's and router's lookups: one conversation each
        await stub.ListLeases(pb.ListLeasesRequest(tenant="acme", conversation_id="c1"),
                              metadata=md(ACME))
    # Watch opens draw from the same bucket.
    stream = stub.WatchLeases(pb.WatchLeasesRequest(tenant="acme"), metadata=md(ACME))
    await rate_limited(stream.read())
    clock.advance(0.2)  # one token back at 5 a second
    await stub.ListLeases(broad, metadata=md(ACME))
    await rate_limited(stub.ListLeases(broad, metadata=md(ACME)))


async def test_a_large_page_counts_one_listing_per_250_leases(
        stub: pb_grpc.RegistryServiceStub, kv: KvKit, clock: FakeClock) -> None:
    """A listing's cost follows its size: a page of 600 leases takes 2.4 of the caller's
    listing tokens (burst 3, 5 a second), so its next broad listing waits for the rest to
    come back, while a page of 100 takes one token, as any call does."""
    await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-1")),
                              metadata=md(HOLDERS))
    tokens = kv.tokens(4)
    for i in range(600):
        await stub.GrantLease(pb.GrantLeaseRequest(**kv.grant_args("dec-1", "acme", f"c{i}",
                                                                   tokens)),
                              metadata=md(HOLDERS))
    page = await stub.ListLeases(pb.ListLeasesRequest(tenant="acme", page_size=1000),
                                 metadata=md(ACME))
    assert len(page.leases) == 600
    small = pb.ListLeasesRequest(tenant="acme", page_size=100)
    err = await rate_limited(stub.ListLeases(small, metadata=md(ACME)))
    info = error_info(err)
    assert info is not None and float(info.metadata["retry_after_s"]) == pytest.approx(0.08,
                                                                                      abs=0.005)
    clock.advance(0.1)  # 0.6 tokens + 0.5 back: one listing of 100
    assert len((await stub.ListLeases(small, metadata=md(ACME))).leases) == 100
    await rate_limited(stub.ListLeases(small, metadata=md(ACME)))
    clock.advance(0.2)  # one token back: another page of 100 costs just that
    await stub.ListLeases(small, metadata=md(ACME))


async def test_a_caller_registers_a_bounded_number_of_live_holders(
        stub: pb_grpc.RegistryServiceStub, kv: KvKit, registry: RegistryServer,
        clock: FakeClock) -> None:
    """Item 7: one token cannot register holders without bound (each costs the registry);
    re-registering one it has, and a new one once another is lost, are allowed (a draining
    one still counts: it holds blocks); an admin is not counted."""
    for hid in ("dec-1", "dec-2"):
        await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args(hid)),
                                  metadata=md(HOLDERS))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-3")),
                                  metadata=md(HOLDERS))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(raised.value)
    assert info is not None and info.metadata["scope"] == "principal"
    holders = await stub.ListHolders(pb.ListHoldersRequest(), metadata=md(ADMIN))
    assert sorted(h.holder_id for h in holders.holders) == ["dec-1", "dec-2"]
    await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-1")),
                              metadata=md(HOLDERS))  # again: the same holder
    await stub.DeregisterHolder(pb.DeregisterHolderRequest(holder_id="dec-2"),
                                metadata=md(HOLDERS))
    with pytest.raises(grpc.aio.AioRpcError):  # draining, not gone
        await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-3")),
                                  metadata=md(HOLDERS))
    clock.advance(registry.config.default_holder_ttl_s + 1)  # both missed their TTL: lost
    await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-3")),
                              metadata=md(HOLDERS))
    for hid in ("dec-4", "dec-5", "dec-6"):
        await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args(hid)),
                                  metadata=md(ADMIN))


async def test_two_readers_of_one_tenant_never_share_a_pin(
        stub: pb_grpc.RegistryServiceStub, kv: KvKit) -> None:
    """Item 11: the same reader and request ids from two tokens give two pins; neither token
    releases the other's, and a retry by the same token finds its own pin."""
    tokens = kv.tokens(8)
    await stub.RegisterHolder(pb.RegisterHolderRequest(**kv.holder_args("dec-1")),
                              metadata=md(HOLDERS))
    await stub.GrantLease(pb.GrantLeaseRequest(**kv.grant_args("dec-1", "acme", "c1", tokens)),
                          metadata=md(HOLDERS))
    read = pb.AcquireReadRequest(tenant="acme", conversation_id="c1",
                                 block_hashes=kv.prompt_hashes(tokens), reader_id="prefill",
                                 request_id="turn-1")
    one = await stub.AcquireRead(read, metadata=md(READER_1))
    two = await stub.AcquireRead(read, metadata=md(READER_2))
    assert one.pin.pin_id and two.pin.pin_id and one.pin.pin_id != two.pin.pin_id
    again = await stub.AcquireRead(read, metadata=md(READER_1))
    assert again.pin.pin_id == one.pin.pin_id and again.lease.pin_count == 2
    released = await stub.ReleaseRead(pb.ReleaseReadRequest(pin_id=one.pin.pin_id),
                                      metadata=md(READER_1))
    assert released.released
    lease = await stub.GetLease(pb.GetLeaseRequest(lease_id=one.lease.lease_id),
                                metadata=md(ADMIN))
    assert lease.lease.pin_count == 1  # the second reader's pin still holds it
