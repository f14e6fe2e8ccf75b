"""The `LeaseStore` contract, run against every backend through the same tests.

`memory` is a `MemoryStore` on a `FakeClock`; `redis` is a `RedisStore` on a real redis-server
(one per session, a namespace per test), whose time is Redis's own, moved forward for every
replica at once by `advance_clock`. Durations are compared with a tolerance: on Redis, real
time passes too. Then two real gRPC registry replicas on one Redis serve one fleet, and
`kvbridge registry serve --backend redis` is run as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from conftest import wait_for_watchers
from structlog.testing import capture_logs

from kvbridge import errors
from kvbridge.clients import AsyncRegistryClient
from kvbridge.clock import FakeClock, SystemClock
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.services.registry import (
    EventType,
    GrantSpec,
    HolderSpec,
    HolderState,
    LeaseEvent,
    LeaseState,
    LeaseStore,
    MemoryStore,
    MissReason,
    RegistryConfig,
    RegistryServer,
    Snapshot,
    create_server,
)
from kvbridge.services.registry._core import OWED_EVENTS_PER_TICK
from kvbridge.services.registry._redis import RedisStore
from kvbridge.services.registry._redis_shards import ShardedStore, shard_of

BS = 4


class Backend:
    """One store under test, with a way to move its time and to see its events."""

    def __init__(self, name: str, store: LeaseStore, clock: FakeClock | None) -> None:
        self.name = name
        self.store = store
        self.clock = clock
        self.events: list[LeaseEvent] = []
        store.add_listener(self.events.append)

    async def advance(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            shards = self.store.shards if isinstance(self.store, ShardedStore) else [self.store]
            for shard in shards:
                assert isinstance(shard, RedisStore)
                await shard.advance_clock(seconds)

    def left(self, deadline: float) -> float:
        return deadline - self.store.clock.monotonic()

    async def wait_events(self, lease_id: str, expected: list[str],
                          timeout: float = 5.0) -> None:
        """Wait until the lease's events are exactly `expected` (type names, in order)."""
        deadline = time.monotonic() + timeout
        while True:
            got = [e.type.name for e in self.events if e.lease_id == lease_id]
            if got == expected or time.monotonic() > deadline:
                assert got == expected
                return
            await asyncio.sleep(0.01)


Factory = Callable[..., Awaitable[Backend]]


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def make_backend(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    """`await make_backend(recovering=False, **config_overrides)`: a fresh store of the
    parametrized backend (`recovering`: hold reclaims for the grace, as after a restart)."""
    stores: list[LeaseStore] = []

    async def make(recovering: bool = False, **overrides: Any) -> Backend:
        if request.param == "memory":
            clock = FakeClock()
            store: LeaseStore = MemoryStore.create(RegistryConfig(**overrides), clock,
                                                   recovering=recovering)
            backend = Backend("memory", store, clock)
        elif request.param == "redis":
            redis_server = request.getfixturevalue("redis_server")
            namespace = request.getfixturevalue("redis_namespace") + f"-{len(stores)}"
            config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                                    redis_namespace=namespace, **overrides)
            store = RedisStore(config, SystemClock(), recovering=recovering)
            backend = Backend("redis", store, None)
        else:  # tenants spread over 3 shards, one on each of the cluster's 3 primaries
            cluster = request.getfixturevalue("redis_cluster")
            namespace = request.getfixturevalue("redis_namespace") + f"-{len(stores)}"
            config = RegistryConfig(backend="redis", redis_url=cluster.url,
                                    redis_namespace=namespace, redis_shards=3, **overrides)
            store = ShardedStore(config, SystemClock(), recovering=recovering)
            backend = Backend("redis-cluster", store, None)
        await store.start()
        stores.append(store)
        return backend

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
async def b(make_backend: Factory) -> Backend:
    return await make_backend()


def holder(holder_id: str = "h1", **kw: Any) -> HolderSpec:
    args: dict[str, Any] = dict(holder_id=holder_id, nixl_host="10.0.0.7", nixl_port=5600,
                                tp_size=1, block_size=BS, fingerprint="fp-test")
    args.update(kw)
    return HolderSpec(**args)


def grant_spec(kv: Any, tokens: list[int], holder_id: str = "h1", tenant: str = "t1",
               conversation: str = "c1", first_block: int = 100, **kw: Any) -> GrantSpec:
    n = -(-len(tokens) // BS)
    args: dict[str, Any] = dict(
        holder_id=holder_id, tenant=tenant, conversation_id=conversation,
        remote_request_id=f"req-{conversation}-{len(tokens)}",
        block_ids=list(range(first_block, first_block + n)), token_count=len(tokens),
        hashes=kv.lease_hashes(tokens))
    args.update(kw)
    return GrantSpec(**args)


# ---- holders --------------------------------------------------------------------------------


async def test_register_heartbeat_and_conflicting_layout(b: Backend) -> None:
    reg = await b.store.register_holder(holder(ttl=12.0, version="kvbridge/test"))
    h = reg.holder
    assert (h.holder_id, h.nixl_host, h.nixl_port, h.block_size, h.state, h.version) == (
        "h1", "10.0.0.7", 5600, BS, HolderState.ACTIVE, "kvbridge/test")
    assert b.left(h.expire_at) == pytest.approx(12.0, abs=0.5)
    assert reg.restored == [] and reg.reclaimable == []
    assert await b.store.heartbeat("h1") == ([], 12.0)
    with pytest.raises(errors.HolderConflict):
        await b.store.register_holder(holder(block_size=8))
    again = await b.store.register_holder(holder(nixl_port=5601))  # same layout: fine
    assert again.holder.nixl_port == 5601
    assert [x.holder_id for x in await b.store.holders()] == ["h1"]
    with pytest.raises(errors.HolderNotFound):
        await b.store.get_holder("nobody")
    with pytest.raises(errors.HolderNotFound):
        await b.store.heartbeat("nobody")


async def test_holder_that_misses_its_ttl_loses_its_leases(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder(ttl=5.0))
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8)))).lease
    await b.advance(6.0)
    await b.store.tick()
    assert [x.holder_id for x in await b.store.holders()] == []
    with pytest.raises(errors.HolderNotFound):
        await b.store.heartbeat("h1")
    assert (await b.store.get_lease(lease.lease_id)).state is LeaseState.HOLDER_LOST
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
    assert read.miss is MissReason.HOLDER_GONE and read.pin is None
    # Back again (say after a partition): the lost lease is never handed out again.
    reg = await b.store.register_holder(holder(ttl=5.0), [
        Snapshot(lease.lease_id, grant_spec(kv, kv.tokens(8)), 1, 6.0)])
    assert reg.restored == [] and reg.reclaimable == [lease.lease_id]
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
    assert read.miss is MissReason.HOLDER_GONE
    await b.wait_events(lease.lease_id, ["GRANTED", "HOLDER_LOST", "RECLAIMABLE"])


async def test_deregister_revokes_and_counts_pinned(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    one = (await b.store.grant(grant_spec(kv, kv.tokens(8)))).lease
    two = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c2"))).lease
    read = await b.store.pin_lease("t1", "c2")
    assert read.pin is not None
    reclaimable, pinned = await b.store.deregister_holder("h1")
    assert (reclaimable, pinned) == ([one.lease_id], 1)
    with pytest.raises(errors.HolderDraining):
        await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c3"))
    assert (await b.store.get_holder("h1")).state is HolderState.DRAINING
    assert (await b.store.get_lease(two.lease_id)).state is LeaseState.REVOKED
    assert await b.store.release_read(read.pin.pin_id)
    reclaimable, _ = await b.store.heartbeat("h1")
    assert sorted(reclaimable) == sorted([one.lease_id, two.lease_id])


async def test_reregistration_restores_held_leases(b: Backend, kv: Any) -> None:
    tokens = kv.tokens(10)
    snap = Snapshot("l-held", grant_spec(kv, tokens), 3, 2.0)
    before = b.store.clock.monotonic()
    reg = await b.store.register_holder(holder(), [snap])
    assert reg.restored == ["l-held"]
    lease = await b.store.get_lease("l-held")
    after = b.store.clock.monotonic()
    assert (lease.epoch, lease.state, lease.token_count) == (3, LeaseState.ACTIVE, 10)
    # The lease keeps its age: created 2.0 s before the registration took it, which is
    # bracketed by the clock around the calls (a loaded machine can stall them for most of
    # a second).
    assert before - 2.5 <= lease.created_at <= after - 1.5
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
    assert read.miss is MissReason.HIT and read.lease is not None
    assert read.lease.lease_id == "l-held"
    # Re-registering without it: the holder freed it, so it is never read again.
    reg = await b.store.register_holder(holder())
    assert reg.restored == []
    assert (await b.store.get_lease("l-held")).state is LeaseState.REVOKED
    assert reg.reclaimable == []  # the read's pin still holds it
    assert await b.store.release_read(read.pin.pin_id)  # type: ignore[union-attr]
    assert (await b.store.heartbeat("h1"))[0] == ["l-held"]


@pytest.mark.parametrize("path", ["grant", "restore"])
async def test_default_max_lifetime_is_never_shorter_than_the_idle_ttl(
        make_backend: Factory, kv: Any, path: str) -> None:
    """A lease that names an idle TTL above the default maximum lifetime and no lifetime of
    its own lives at least that idle TTL, whether granted or restored by its holder: the
    default lifetime is max(default, idle) on every path of both backends."""
    b = await make_backend(default_idle_ttl_s=30.0, default_max_lifetime_s=60.0,
                           max_idle_ttl_s=600.0)
    spec = grant_spec(kv, kv.tokens(8), idle_ttl=200.0)
    if path == "grant":
        await b.store.register_holder(holder(ttl=300.0))
        lease = (await b.store.grant(spec)).lease
    else:
        await b.store.register_holder(holder(ttl=300.0), [Snapshot("l-held", spec, 1, 0.0)])
        lease = await b.store.get_lease("l-held")
    assert lease.max_lifetime == pytest.approx(200.0)
    assert b.left(lease.expire_at) == pytest.approx(200.0, abs=1.0)
    await b.advance(100.0)  # past the default lifetime, within the idle TTL
    await b.store.tick()
    assert (await b.store.get_lease(lease.lease_id)).state is LeaseState.ACTIVE


async def test_restored_leases_keep_the_tenant_quota(make_backend: Factory, kv: Any) -> None:
    """Issue 32: the quota holds on every path that creates a lease. A re-registering holder
    that lists more leases than its tenant's quota gets the excess restored revoked (the
    holder frees them); the tenant ends within its quota, other tenants unaffected."""
    b = await make_backend(tenant_max_leases=5, tenant_max_blocks=100)
    snaps = [Snapshot(f"l-held-{i}", grant_spec(kv, kv.tokens(8), conversation=f"c{i}",
                                                  first_block=10 * i), 1, 1.0)
             for i in range(45)]
    snaps.append(Snapshot("l-other", grant_spec(kv, kv.tokens(8), tenant="t2"), 1, 1.0))
    reg = await b.store.register_holder(holder(ttl=300.0), snaps)
    active = await b.store.list_leases(tenant="t1")
    assert len(active) == 5 and sum(x.block_count for x in active) <= 100
    assert [x.lease_id for x in await b.store.list_leases(tenant="t2")] == ["l-other"]
    revoked = {x.lease_id for x in await b.store.list_leases(tenant="t1", include_inactive=True)
               if x.state is LeaseState.REVOKED}
    assert len(revoked) == 40
    assert sorted(reg.reclaimable) == sorted(revoked)  # the holder frees them at once


async def test_grant_retry_never_returns_another_holders_lease(
        make_backend: Factory, kv: Any) -> None:
    """Issue 32: a holder lists, as held, the id that another holder's grant with a given
    request id will make; that grant must not return the planted lease."""
    from kvbridge.ids import grant_lease_id

    b = await make_backend()
    await b.store.register_holder(holder("h2", ttl=300.0))
    planted = grant_lease_id("h2", "req-7")
    if isinstance(b.store, ShardedStore):  # the id the grant makes ends with its shard's tag
        planted += f".s{shard_of('t1', len(b.store.shards))}"
    await b.store.register_holder(holder(ttl=300.0), [
        Snapshot(planted, grant_spec(kv, kv.tokens(8), tenant="t1"), 1, 0.0)])
    with pytest.raises(errors.IdempotencyConflict):
        await b.store.grant(grant_spec(kv, kv.tokens(8), holder_id="h2", tenant="t1",
                                       request_id="req-7"))
    # And the other way round: h2 cannot list h1's lease as its own. The refusal names the
    # call's own field, also when its own lease before it is another shard's part.
    shards = len(b.store.shards) if isinstance(b.store, ShardedStore) else 1
    other = next(t for t in (f"t{i}" for i in range(2, 99))
                 if shard_of(t, shards) != shard_of("t1", shards) or shards == 1)
    with pytest.raises(errors.NotLeaseHolder) as caught:
        await b.store.register_holder(holder("h2", ttl=300.0), [
            Snapshot(grant_lease_id("h2", "req-own"),
                     grant_spec(kv, kv.tokens(8), holder_id="h2", tenant=other), 1, 0.0),
            Snapshot(planted, grant_spec(kv, kv.tokens(8), holder_id="h2"), 1, 0.0)])
    assert caught.value.metadata["field"] == "held_leases[1].lease_id"
    assert (await b.store.get_lease(planted)).holder.holder_id == "h1"


async def test_a_grant_is_found_by_the_id_its_request_id_derives(b: Backend, kv: Any) -> None:
    """A holder whose grant's outcome is unknown asks for the lease by the id it derives
    (`kvbridge.ids.grant_lease_id`): found, however the store names it (a sharded store's
    ids end with their shard's tag), and revoked by it too."""
    from kvbridge.ids import grant_lease_id

    await b.store.register_holder(holder(ttl=300.0))
    made = (await b.store.grant(grant_spec(kv, kv.tokens(8), request_id="req-9"))).lease
    derived = grant_lease_id("h1", "req-9")
    assert (await b.store.get_lease(derived)).lease_id == made.lease_id
    assert (await b.store.revoke(derived)).state is LeaseState.REVOKED
    with pytest.raises(errors.LeaseNotFound):
        await b.store.get_lease(grant_lease_id("h1", "req-never-sent"))
    longest = "l" * b.store.config.max_id_length  # valid, and unknown: not found
    with pytest.raises(errors.LeaseNotFound):
        await b.store.get_lease(longest)


async def test_a_tenants_live_pins_are_capped(make_backend: Factory, kv: Any) -> None:
    """Issue 32, item 14: a tenant holds at most tenant_max_pins live pins; a read past it is
    refused (TENANT_QUOTA_EXCEEDED: prefill recomputes) with nothing pinned, another tenant
    reads on, and a released or ended pin makes room again."""
    b = await make_backend(tenant_max_pins=2)
    await b.store.register_holder(holder(ttl=300.0))
    for tenant in ("t1", "t2"):
        await b.store.grant(grant_spec(kv, kv.tokens(8), tenant=tenant))
    prompt = kv.prompt_hashes(kv.tokens(8))
    first = await b.store.acquire_read("t1", "c1", prompt, pin_ttl=5.0)
    await b.store.pin_lease("t1", "c1", pin_ttl=30.0)
    with pytest.raises(errors.TenantQuotaExceeded):
        await b.store.acquire_read("t1", "c1", prompt, pin_ttl=5.0)
    assert (await b.store.get_lease(first.lease.lease_id)).pin_count == 2  # type: ignore[union-attr]
    assert (await b.store.acquire_read("t2", "c1", prompt)).pin is not None
    assert first.pin is not None and await b.store.release_read(first.pin.pin_id)
    second = await b.store.acquire_read("t1", "c1", prompt, pin_ttl=5.0)
    assert second.pin is not None
    await b.advance(6.0)  # the 5 s pin ends
    await b.store.tick()
    assert (await b.store.acquire_read("t1", "c1", prompt)).pin is not None


async def test_held_leases_come_in_pages(make_backend: Factory, kv: Any) -> None:
    """Issue 32, item 4: one registration restores at most max_held_leases_per_call held
    leases. A holder with more sends pages: the first lists every id it retains (what it does
    not list is revoked), the later ones only restore; nothing another page carries is
    revoked, and a later page cannot carry ids."""
    b = await make_backend(max_held_leases_per_call=2)
    snaps = [Snapshot(f"l-{i}", grant_spec(kv, kv.tokens(8), conversation=f"c{i}",
                                             first_block=10 * i), 1, 0.0) for i in range(5)]
    ids = [x.lease_id for x in snaps]
    with pytest.raises(errors.InvalidArgument) as caught:
        await b.store.register_holder(holder(ttl=300.0), snaps[:3])
    assert caught.value.metadata["field"] == "held_leases"
    await b.store.register_holder(holder(ttl=300.0), [], ["l-old"])  # a lease of before
    await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="gone"))
    first = await b.store.register_holder(holder(ttl=300.0), snaps[:2], ids)
    assert first.restored == ids[:2]
    for start in (2, 4):
        page = await b.store.register_holder(holder(ttl=300.0), snaps[start:start + 2],
                                             restore_only=True)
        assert page.restored == ids[start:start + 2]
    active = await b.store.list_leases(holder_id="h1")
    assert sorted(x.lease_id for x in active) == ids  # "gone" (not listed) was revoked
    with pytest.raises(errors.InvalidArgument):
        await b.store.register_holder(holder(ttl=300.0), snaps[:1], ids, restore_only=True)


async def test_a_later_page_for_a_holder_the_store_does_not_know_starts_over(
        b: Backend, kv: Any) -> None:
    """A later page of a paged registration (restore only) needs the first page, which
    revokes what the holder no longer lists, to have run on this state: for a holder the
    store does not know (a restart or failover between pages), it is refused, changing
    nothing, and the holder registers again from the first page."""
    snap = Snapshot("l-page2", grant_spec(kv, kv.tokens(8)), 1, 0.0)
    with pytest.raises(errors.HolderNotFound):
        await b.store.register_holder(holder(ttl=300.0), [snap], restore_only=True)
    assert await b.store.holders() == []
    assert await b.store.list_leases(include_inactive=True) == []
    first = await b.store.register_holder(holder(ttl=300.0), [snap], ["l-page2"])
    assert first.restored == ["l-page2"]


async def test_duplicate_block_ids_are_refused(b: Backend, kv: Any) -> None:
    """Issue 32: a lease naming one block twice ([7, 7]) is refused, state unchanged."""
    await b.store.register_holder(holder(ttl=300.0))
    with pytest.raises(errors.InvalidArgument) as caught:
        await b.store.grant(grant_spec(kv, kv.tokens(8), block_ids=[7, 7]))
    assert caught.value.metadata["field"] == "block_ids"
    with pytest.raises(errors.InvalidArgument):
        await b.store.register_holder(holder(ttl=300.0), [
            Snapshot("l-dup", grant_spec(kv, kv.tokens(8), block_ids=[7, 7]), 1, 0.0)])
    assert await b.store.list_leases(include_inactive=True) == []


# ---- leases ---------------------------------------------------------------------------------


async def test_grant_supersede_reclaim_and_forget(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    first = await b.store.grant(grant_spec(kv, kv.tokens(10), idle_ttl=30.0))
    lease = first.lease
    assert first.superseded is None
    assert (lease.tenant, lease.conversation_id, lease.holder.holder_id, lease.epoch) == (
        "t1", "c1", "h1", 1)
    assert lease.block_id_list() == [100, 101, 102] and lease.hashes == kv.lease_hashes(
        kv.tokens(10))
    assert b.left(lease.expire_at) == pytest.approx(30.0, abs=0.5)
    assert lease.idle_ttl == 30.0 and lease.state is LeaseState.ACTIVE

    second = await b.store.grant(grant_spec(kv, kv.tokens(14), first_block=200))
    assert second.lease.epoch == 2
    assert second.superseded is not None and second.superseded.lease_id == lease.lease_id
    assert (await b.store.get_lease(lease.lease_id)).state is LeaseState.SUPERSEDED
    assert await b.store.heartbeat("h1") == ([lease.lease_id], 10.0)
    assert await b.store.heartbeat("h1", [lease.lease_id]) == ([], 10.0)
    with pytest.raises(errors.LeaseNotFound):
        await b.store.get_lease(lease.lease_id)
    await b.wait_events(lease.lease_id, ["GRANTED", "SUPERSEDED", "RECLAIMABLE", "RECLAIMED"])
    await b.wait_events(second.lease.lease_id, ["GRANTED"])


async def test_grant_is_idempotent_by_request_id(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    one = await b.store.grant(grant_spec(kv, kv.tokens(8), request_id="g1"))
    two = await b.store.grant(grant_spec(kv, kv.tokens(8), request_id="g1"))
    assert one.lease.lease_id == two.lease.lease_id and two.lease.epoch == 1
    with pytest.raises(errors.IdempotencyConflict):
        await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c2", request_id="g1"))
    assert len(await b.store.list_leases(include_inactive=True)) == 1


async def test_conversations_are_scoped_by_tenant(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    await b.store.grant(grant_spec(kv, kv.tokens(8), tenant="a"))
    other = await b.store.grant(grant_spec(kv, kv.tokens(8), tenant="b"))
    assert other.superseded is None and other.lease.epoch == 1
    assert (await b.store.acquire_read("c", "c1", kv.prompt_hashes(kv.tokens(8)))).miss is (
        MissReason.NO_LEASE)


async def test_renew_by_id_and_conversation_capped_by_lifetime(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder(ttl=300.0))
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8), idle_ttl=10.0,
                                            max_lifetime=25.0))).lease
    await b.advance(8.0)
    out = await b.store.renew([lease.lease_id, "l-unknown"], [("t1", "c1"), ("t1", "nope")])
    assert [(r.lease_id, r.renewed, r.state) for r in out] == [
        (lease.lease_id, True, LeaseState.ACTIVE), ("l-unknown", False, None),
        (lease.lease_id, True, LeaseState.ACTIVE), ("", False, None)]
    assert out[0].expires_in == pytest.approx(10.0, abs=0.5)
    await b.advance(8.0)  # 16 s after the grant: 9 s of lifetime left
    (r,) = await b.store.renew([lease.lease_id])
    assert r.expires_in == pytest.approx(9.0, abs=0.5)
    await b.advance(9.5)
    (r,) = await b.store.renew([lease.lease_id])
    assert (r.renewed, r.state) == (False, LeaseState.EXPIRED)


async def test_expiry_fires_once_and_reads_miss(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder(ttl=300.0))
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8), idle_ttl=5.0))).lease
    await b.store.tick()
    assert (await b.store.get_lease(lease.lease_id)).state is LeaseState.ACTIVE
    await b.advance(5.5)
    assert await b.store.tick() == 1
    assert await b.store.tick() == 0
    assert (await b.store.get_lease(lease.lease_id)).state is LeaseState.EXPIRED
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
    assert read.miss is MissReason.EXPIRED
    assert b.store.counts() == {"leases_active": 0, "leases_total": 1, "holders": 1, "pins": 0,
                                "history_keys": 0}
    await b.wait_events(lease.lease_id, ["GRANTED", "EXPIRED", "RECLAIMABLE"])
    assert next(e.lateness for e in b.events if e.type is EventType.EXPIRED) >= 0


async def test_deadlines_apply_without_tick(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder(ttl=300.0))
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8), idle_ttl=5.0))).lease
    await b.advance(6.0)
    assert (await b.store.get_lease(lease.lease_id)).state is LeaseState.EXPIRED
    assert await b.store.tick() == 0


async def test_revoke(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    await b.store.register_holder(holder("h2"))
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8)))).lease
    with pytest.raises(errors.NotLeaseHolder):
        await b.store.revoke(lease.lease_id, "h2")
    with pytest.raises(errors.LeaseNotFound):
        await b.store.revoke("l-nope")
    revoked = await b.store.revoke(lease.lease_id, "h1", "memory pressure")
    assert revoked.state is LeaseState.REVOKED and revoked.reclaimable
    assert (await b.store.revoke(lease.lease_id)).state is LeaseState.REVOKED  # no-op
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
    assert read.miss is MissReason.REVOKED


async def test_list_filters_and_pages(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    await b.store.register_holder(holder("h2"))
    ids = []
    for i in range(5):
        g = await b.store.grant(grant_spec(kv, kv.tokens(8), conversation=f"c{i}",
                                           holder_id="h2" if i == 4 else "h1"))
        ids.append(g.lease.lease_id)
    newer = await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c0"))
    old = newer.superseded
    assert old is not None
    active = sorted((set(ids) - {old.lease_id}) | {newer.lease.lease_id})
    listed = await b.store.list_leases()
    assert [x.lease_id for x in listed] == active  # active only, in id order
    page1 = await b.store.list_leases(limit=2)
    page2 = await b.store.list_leases(after=page1[-1].lease_id, limit=2)
    page3 = await b.store.list_leases(after=page2[-1].lease_id, limit=2)
    assert [x.lease_id for x in page1 + page2 + page3] == [x.lease_id for x in listed]
    assert len(page3) == 1
    everything = await b.store.list_leases(include_inactive=True)
    assert len(everything) == 6 and old.lease_id in [x.lease_id for x in everything]
    assert [x.lease_id for x in await b.store.list_leases(holder_id="h2")] == [ids[4]]
    conv = await b.store.list_leases(tenant="t1", conversation_id="c0", include_inactive=True)
    assert sorted(x.epoch for x in conv) == [1, 2]
    assert [x.epoch for x in await b.store.list_leases(tenant="t1", conversation_id="c0")] == [2]
    assert await b.store.list_leases(tenant="other") == []
    await b.store.revoke(newer.lease.lease_id)  # a dead current lease is listed once
    conv = await b.store.list_leases(tenant="t1", conversation_id="c0", include_inactive=True)
    assert sorted(x.epoch for x in conv) == [1, 2]


async def test_list_by_tenant_uses_the_tenants_own_leases(b: Backend, kv: Any) -> None:
    """Listing one tenant (issue 32: through its own indexes) gives its active leases, with
    include_inactive its dead ones not yet freed, pages in id order, never another tenant's;
    a lease its holder freed is gone from it."""
    await b.store.register_holder(holder(ttl=300.0))
    mine = [(await b.store.grant(grant_spec(kv, kv.tokens(8), tenant="ta", conversation=f"c{i}",
                                            first_block=10 * i))).lease for i in range(5)]
    for i in range(20):
        await b.store.grant(grant_spec(kv, kv.tokens(8), tenant="tb", conversation=f"c{i}"))
    dead = await b.store.revoke(mine[0].lease_id, "h1")
    active = sorted(x.lease_id for x in mine[1:])
    assert [x.lease_id for x in await b.store.list_leases(tenant="ta")] == active
    everything = await b.store.list_leases(tenant="ta", include_inactive=True)
    assert [x.lease_id for x in everything] == sorted([dead.lease_id, *active])
    page = await b.store.list_leases(tenant="ta", include_inactive=True,
                                     after=everything[1].lease_id, limit=2)
    assert [x.lease_id for x in page] == [x.lease_id for x in everything[2:4]]
    await b.store.heartbeat("h1", [dead.lease_id])  # the holder freed it
    assert [x.lease_id for x in await b.store.list_leases(tenant="ta", include_inactive=True)
            ] == active


async def test_capacity(make_backend: Factory, kv: Any) -> None:
    b = await make_backend(max_leases=2)
    await b.store.register_holder(holder())
    await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="a"))
    await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="b"))
    with pytest.raises(errors.CapacityExhausted):
        await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c"))


# ---- reads and pins -------------------------------------------------------------------------


async def test_read_hits_partials_and_misses(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    tokens = kv.tokens(10)  # two full blocks and a partial one
    lease = (await b.store.grant(grant_spec(kv, tokens))).lease
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(tokens + [7, 7]),
                                      reader_id="p1")
    assert (read.miss, read.matched_blocks, read.partial) == (MissReason.HIT, 2, True)
    assert read.pin is not None and read.lease is not None
    assert read.lease.lease_id == lease.lease_id and read.lease.pin_count == 1
    assert read.lease.holder.nixl_host == "10.0.0.7" and read.lease.holder.block_size == BS
    assert b.left(read.pin.expire_at) == pytest.approx(10.0, abs=0.5)  # the default pin TTL
    edited = kv.prompt_hashes([0, 1, 2, 3, 9, 9, 9, 9])  # the second block differs
    read = await b.store.acquire_read("t1", "c1", edited, pin_ttl=3.0)
    assert (read.miss, read.matched_blocks, read.partial) == (MissReason.HIT, 1, False)
    assert read.pin is not None and b.left(read.pin.expire_at) == pytest.approx(3.0, abs=0.5)
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes([5, 5, 5, 5]))
    assert (read.miss, read.mismatch_block, read.pin) == (MissReason.HASH_MISMATCH, 0, None)
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(tokens), min_tokens=11)
    assert (read.miss, read.matched_blocks, read.pin) == (MissReason.BELOW_MINIMUM, 2, None)
    assert (await b.store.acquire_read("t1", "c9", b"")).miss is MissReason.NO_LEASE
    whole = await b.store.pin_lease("t1", "c1", pin_ttl=100.0)
    assert (whole.miss, whole.matched_blocks, whole.partial) == (MissReason.HIT, 2, True)
    assert whole.pin is not None and b.left(whole.pin.expire_at) == pytest.approx(30.0, abs=0.5)
    assert (await b.store.get_lease(lease.lease_id)).pin_count == 3


async def test_a_hit_reports_the_lease_and_holder_as_stored(b: Backend, kv: Any) -> None:
    """A hit's lease and holder are the state the read left behind (Redis answers a hit from
    what it read before updating, so every field it changes must be reported changed)."""
    await b.store.register_holder(holder(ttl=300.0))
    await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c0"))
    tokens = kv.tokens(10)
    await b.store.grant(grant_spec(kv, tokens, idle_ttl=10.0))
    await b.advance(4.0)
    for pins in (1, 2):
        read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(tokens), reader_id="p1",
                                          request_id=f"r{pins}")
        assert read.miss is MissReason.HIT and read.lease is not None
        stored = await b.store.get_lease(read.lease.lease_id)
        got, want = read.lease, stored
        assert (got.lease_id, got.tenant, got.conversation_id, got.remote_request_id,
                got.token_count, got.epoch, got.state, got.pin_count) == (
            want.lease_id, want.tenant, want.conversation_id, want.remote_request_id,
            want.token_count, want.epoch, want.state, want.pin_count)
        assert got.pin_count == pins
        assert got.block_id_list() == want.block_id_list()
        assert b.left(got.expire_at) == pytest.approx(b.left(want.expire_at), abs=0.5)
        assert b.left(got.expire_at) == pytest.approx(10.0, abs=0.5)  # renewed by the read
        h, stored_holder = got.holder, await b.store.get_holder("h1")
        assert (h.holder_id, h.nixl_host, h.nixl_port, h.tp_size, h.block_size, h.fingerprint,
                h.state, h.lease_count, h.retained_blocks) == (
            stored_holder.holder_id, stored_holder.nixl_host, stored_holder.nixl_port,
            stored_holder.tp_size, stored_holder.block_size, stored_holder.fingerprint,
            stored_holder.state, stored_holder.lease_count, stored_holder.retained_blocks)
        assert h.lease_count == 2


async def test_read_is_idempotent_by_request_id(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    await b.store.grant(grant_spec(kv, kv.tokens(8)))
    await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c2"))
    one = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)),
                                     reader_id="p1", request_id="r1")
    two = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)),
                                     reader_id="p1", request_id="r1")
    assert one.pin is not None and two.pin is not None and one.pin.pin_id == two.pin.pin_id
    assert two.lease is not None and two.lease.pin_count == 1
    with pytest.raises(errors.IdempotencyConflict):
        await b.store.pin_lease("t1", "c2", reader_id="p1", request_id="r1")


async def test_pin_ids_are_not_derivable_and_tenants_reads_are_apart(b: Backend,
                                                                     kv: Any) -> None:
    """A pin id is a capability (whoever has it may release the pin): it is stable for a
    retried read but cannot be computed from the reader and request ids alone. Two tenants'
    reads with the same reader and request ids are two reads, not a conflict."""
    from kvbridge.ids import derived_id

    await b.store.register_holder(holder())
    await b.store.grant(grant_spec(kv, kv.tokens(8)))
    await b.store.grant(grant_spec(kv, kv.tokens(8), tenant="t2"))
    one = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)),
                                     reader_id="p1", request_id="r1")
    other = await b.store.acquire_read("t2", "c1", kv.prompt_hashes(kv.tokens(8)),
                                       reader_id="p1", request_id="r1")
    assert one.pin is not None and other.pin is not None
    assert one.pin.pin_id != other.pin.pin_id
    assert one.pin.pin_id not in (derived_id("p", "p1", "r1"), derived_id("p", "t1", "r1"))
    assert other.lease is not None and other.lease.pin_count == 1


async def test_a_pinned_lease_is_never_reclaimable(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder(ttl=300.0))
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8), idle_ttl=5.0))).lease
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)), pin_ttl=20.0)
    assert read.pin is not None
    await b.store.grant(grant_spec(kv, kv.tokens(12)))  # supersedes the pinned lease
    assert await b.store.heartbeat("h1") == ([], 300.0)
    assert await b.store.heartbeat("h1", [lease.lease_id]) == ([], 300.0)  # early ack ignored
    assert (await b.store.get_lease(lease.lease_id)).pin_count == 1
    await b.advance(10.0)
    await b.store.tick()
    assert await b.store.heartbeat("h1") == ([], 300.0)  # pin still live
    await b.advance(11.0)
    await b.store.tick()  # the pin ran out
    assert (await b.store.heartbeat("h1"))[0] == sorted([lease.lease_id])
    assert not await b.store.release_read(read.pin.pin_id)
    await b.wait_events(lease.lease_id, ["GRANTED", "SUPERSEDED", "RECLAIMABLE"])


async def test_one_tick_ends_hundreds_of_pins_across_leases(b: Backend, kv: Any) -> None:
    # More pins than the Redis tick removes in one call (200): each lease is unpinned once
    # per pin, every pin's record goes, and a pin still live stays.
    await b.store.register_holder(holder(ttl=300.0))
    leases = [(await b.store.grant(grant_spec(kv, kv.tokens(8), conversation=f"c{i}",
                                               request_id=f"g{i}"))).lease for i in range(3)]
    prompt = kv.prompt_hashes(kv.tokens(8))
    reads = [await b.store.acquire_read("t1", f"c{i % 3}", prompt, pin_ttl=5.0,
                                        request_id=f"r{i}") for i in range(450)]
    live = await b.store.acquire_read("t1", "c0", prompt, pin_ttl=30.0, request_id="live")
    assert all(r.pin is not None for r in reads) and live.pin is not None
    assert [(await b.store.get_lease(x.lease_id)).pin_count for x in leases] == [151, 150, 150]
    for x in leases:
        await b.store.revoke(x.lease_id)
    await b.advance(10.0)
    await b.store.tick()
    assert [(await b.store.get_lease(x.lease_id)).pin_count for x in leases] == [1, 0, 0]
    assert b.store.counts()["pins"] == 1
    assert sorted((await b.store.heartbeat("h1"))[0]) == sorted(x.lease_id for x in leases[1:])
    assert not await b.store.release_read(reads[0].pin.pin_id)  # type: ignore[union-attr]
    assert await b.store.release_read(live.pin.pin_id)
    assert sorted((await b.store.heartbeat("h1"))[0]) == sorted(x.lease_id for x in leases)


async def test_release_makes_a_dead_lease_reclaimable(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8)))).lease
    read = await b.store.pin_lease("t1", "c1")
    assert read.pin is not None
    await b.store.revoke(lease.lease_id)
    assert (await b.store.heartbeat("h1"))[0] == []
    assert await b.store.release_read(read.pin.pin_id)
    assert not await b.store.release_read(read.pin.pin_id)
    assert (await b.store.heartbeat("h1"))[0] == [lease.lease_id]
    await b.wait_events(lease.lease_id, ["GRANTED", "REVOKED", "RECLAIMABLE"])


async def test_a_read_renews_the_lease(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder(ttl=300.0))
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8), idle_ttl=10.0))).lease
    await b.advance(8.0)
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
    assert read.lease is not None and b.left(read.lease.expire_at) == pytest.approx(10, abs=0.5)
    await b.advance(8.0)
    assert await b.store.tick() == 0
    assert (await b.store.get_lease(lease.lease_id)).state is LeaseState.ACTIVE


async def test_renewal_events_go_to_renewal_listeners_only(b: Backend, kv: Any) -> None:
    renewals: list[LeaseEvent] = []
    b.store.add_listener(renewals.append, renewals=True)
    await b.store.register_holder(holder())
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8)))).lease
    deadline = time.monotonic() + 5
    while not any(e.type is EventType.RENEWED for e in renewals):  # Redis: once announced
        assert time.monotonic() < deadline
        await b.store.renew([lease.lease_id])
        await asyncio.sleep(0.02)
    assert renewals[-1].lease_id == lease.lease_id
    assert not any(e.type is EventType.RENEWED for e in b.events)
    b.store.remove_listener(renewals.append, renewals=True)


async def test_fresh_state_reports_nothing_reclaimable_for_the_grace(make_backend: Factory,
                                                                     kv: Any) -> None:
    started = time.monotonic()
    b = await make_backend(recovering=True, max_pin_ttl_s=5.0, default_pin_ttl_s=5.0)
    await b.store.register_holder(holder(ttl=300.0))
    hold = await b.store.reclaim_hold()
    # The grace (max pin TTL + 1) counts from the backend's start: on a backend whose clock is
    # real (Redis), what setting up took (three shards on a loaded machine: a second or more)
    # has passed already.
    assert 6.0 - (time.monotonic() - started) - 0.5 <= hold <= 6.5, hold
    old = (await b.store.grant(grant_spec(kv, kv.tokens(8)))).lease
    await b.store.grant(grant_spec(kv, kv.tokens(12)))  # supersedes `old`, unpinned
    assert await b.store.heartbeat("h1") == ([], 300.0)  # a pin from before may be live
    await b.advance(5.5)  # the grace: max pin TTL + 1
    assert await b.store.heartbeat("h1") == ([], 300.0)
    assert 0 < await b.store.reclaim_hold() <= 0.5
    await b.advance(0.6)
    assert await b.store.heartbeat("h1") == ([old.lease_id], 300.0)
    assert await b.store.reclaim_hold() == 0


async def test_reclaimable_events_wait_for_the_grace(make_backend: Factory, kv: Any) -> None:
    """Within the grace no RECLAIMABLE event goes out either (a watcher would take it for
    leave to free); the first tick after it sends one per dead lease no pin holds, and each
    lease is reported once however it died: superseded, its pin released or expired, found
    expired by a read, its holder lost, released between the grace's end and that tick, or
    killed by that tick itself."""
    b = await make_backend(recovering=True, max_pin_ttl_s=20.0, default_pin_ttl_s=5.0)
    grace = 21.0  # the longest pin + 1
    await b.store.register_holder(holder(ttl=300.0))
    await b.store.register_holder(holder("h2", ttl=2.0))
    await b.store.register_holder(holder("h3", ttl=grace + 0.5))

    async def grant(conversation: str, tokens: int = 8, **kw: Any) -> Any:
        spec = grant_spec(kv, kv.tokens(tokens), conversation=conversation, **kw)
        return (await b.store.grant(spec)).lease

    async def pin(conversation: str, **kw: Any) -> str:
        read = await b.store.pin_lease("t1", conversation, **kw)
        assert read.pin is not None
        return read.pin.pin_id

    superseded, released, expired = await grant("c1"), await grant("c2"), await grant(
        "c3", idle_ttl=1.0)
    lost, pin_ran_out, lost_late = await grant("c4", holder_id="h2"), await grant("c7"), \
        await grant("c6", holder_id="h3")
    released_late = await grant("c5")
    released_pin = await pin("c2")
    await pin("c7")  # runs out at 5 s
    for conversation in ("c1", "c2", "c7"):
        await grant(conversation, 12)  # supersedes
    assert await b.store.release_read(released_pin)
    await b.advance(1.5)
    miss = await b.store.acquire_read("t1", "c3", kv.prompt_hashes(kv.tokens(8)))
    assert miss.miss is MissReason.EXPIRED  # found expired by the read itself
    await b.advance(7.5)
    await b.store.tick()  # the pin of c7 runs out, h2 is lost
    deadline = b.store.next_deadline()
    assert deadline is not None
    assert b.left(deadline) == pytest.approx(await b.store.reclaim_hold(), abs=0.1)
    late_pin = await pin("c5", pin_ttl=20.0)
    await grant("c5", 12)

    async def marker(name: str) -> None:  # events arrive in order: all before it are in
        lease = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation=name))).lease
        await b.wait_events(lease.lease_id, ["GRANTED"])

    await marker("m1")
    assert not [e for e in b.events if e.type is EventType.RECLAIMABLE]
    assert (await b.store.heartbeat("h1"))[0] == []
    await b.advance(grace + 0.7 - 9.0)  # past the grace and h3's TTL
    assert await b.store.release_read(late_pin)  # before the tick that pays
    await b.store.tick()  # pays, and loses h3
    await marker("m2")
    for lease, death in ((superseded, "SUPERSEDED"), (released, "SUPERSEDED"),
                         (pin_ran_out, "SUPERSEDED"), (released_late, "SUPERSEDED"),
                         (expired, "EXPIRED"), (lost, "HOLDER_LOST"),
                         (lost_late, "HOLDER_LOST")):
        await b.wait_events(lease.lease_id, ["GRANTED", death, "RECLAIMABLE"])
    await b.store.tick()
    await marker("m3")
    assert len([e for e in b.events if e.type is EventType.RECLAIMABLE]) == 7  # once each
    mine = sorted(x.lease_id for x in (superseded, released, pin_ran_out, released_late,
                                       expired))
    assert sorted((await b.store.heartbeat("h1"))[0]) == mine


async def test_owed_reclaimable_events_go_out_a_share_per_tick(make_backend: Factory,
                                                                 kv: Any) -> None:
    """More owed RECLAIMABLE events than one tick sends: they go out OWED_EVENTS_PER_TICK a
    tick (the scheduler is due again at once while some are left), each lease once: one pinned
    when they were queued is sent as its pin is released, one its holder freed before its turn
    is not sent at all."""
    b = await make_backend(recovering=True, max_pin_ttl_s=20.0, default_pin_ttl_s=5.0)
    grace = 21.0  # the longest pin + 1
    await b.store.register_holder(holder(ttl=300.0))
    many = OWED_EVENTS_PER_TICK * 2 + 100
    dead = []
    for i in range(many):  # they expire at 1 s, within the grace
        spec = grant_spec(kv, kv.tokens(8), conversation=f"c{i}", idle_ttl=1.0)
        dead.append((await b.store.grant(spec)).lease.lease_id)
    held = [(await b.store.grant(grant_spec(kv, kv.tokens(8), conversation=f"held{i}"))).lease
            for i in range(20)]
    await b.advance(10.0)
    await b.store.tick()
    pins = []
    for i in range(20):  # pinned until 30 s, superseded: dead, held past the grace
        pin = (await b.store.pin_lease("t1", f"held{i}", pin_ttl=20.0)).pin
        assert pin is not None
        pins.append(pin.pin_id)
        await b.store.grant(grant_spec(kv, kv.tokens(12), conversation=f"held{i}"))

    async def marker(name: str) -> None:  # events arrive in order: all before it are in
        lease = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation=name))).lease
        await b.wait_events(lease.lease_id, ["GRANTED"], timeout=30.0)

    def sent() -> list[str]:
        return [e.lease_id for e in b.events if e.type is EventType.RECLAIMABLE]

    await marker("m0")
    assert sent() == []
    await b.advance(grace + 0.5 - 10.0)
    await b.store.tick()
    await marker("m1")
    first = sent()
    # (Redis queues the pinned ones too and skips them in their turn: a share of up to 20 less)
    assert OWED_EVENTS_PER_TICK - len(held) <= len(first) <= OWED_EVENTS_PER_TICK
    deadline = b.store.next_deadline()
    assert deadline is not None and b.left(deadline) <= 0  # the rest are due now
    freed = sorted(set(dead) - set(first))[:50]
    await b.store.heartbeat("h1", freed)  # the holder frees 50 before their turn
    for pin_id in pins:  # released, most of them before their turn in the queue
        assert await b.store.release_read(pin_id)
    for _ in range(3):
        await b.store.tick()
    await marker("m2")
    got = sent()
    assert len(got) == len(set(got)), "a lease was reported twice"
    assert sorted(got) == sorted((set(dead) - set(freed)) | {x.lease_id for x in held})
    deadline = b.store.next_deadline()
    assert deadline is None or b.left(deadline) > 0  # nothing left to send


async def test_no_hold_on_a_store_started_without_recovery(b: Backend) -> None:
    assert await b.store.reclaim_hold() == 0


async def test_redis_replica_joining_live_state_holds_nothing(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """Only state found empty may have lost pins: a replica started (recovering) on a fleet's
    live state reports the hold the fleet is in, not one of its own."""
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace, max_pin_ttl_s=5.0,
                            default_pin_ttl_s=5.0)
    first = RedisStore(config, SystemClock(), recovering=True)
    await first.start()
    try:
        await first.register_holder(holder(ttl=300.0))
        assert await first.reclaim_hold() > 5.0
        await first.advance_clock(6.5)
        assert await first.reclaim_hold() == 0
        second = RedisStore(config, SystemClock(), recovering=True)
        await second.start()
        try:
            assert await second.reclaim_hold() == 0
        finally:
            await second.close()
    finally:
        await first.close()


# ---- bad input: the same error for the same input, and nothing changes ------------------------

BAD_CALLS: dict[str, tuple[Callable[[LeaseStore, Any], Awaitable[Any]], type, str]] = {
    "register_empty_id": (lambda s, kv: s.register_holder(holder("")),
                          errors.InvalidArgument, "holder_id"),
    "register_block_size": (lambda s, kv: s.register_holder(holder("h9", block_size=0)),
                            errors.InvalidArgument, "block_size"),
    "register_ttl": (lambda s, kv: s.register_holder(holder("h9", ttl=1e9)),
                     errors.InvalidArgument, "ttl"),
    "register_layout": (lambda s, kv: s.register_holder(holder(tp_size=2)),
                        errors.HolderConflict, ""),
    "register_held_duplicate": (
        lambda s, kv: s.register_holder(holder("h9"), [
            Snapshot("l-x", grant_spec(kv, kv.tokens(4), holder_id="h9"), 1, 0.0),
            Snapshot("l-x", grant_spec(kv, kv.tokens(4), holder_id="h9"), 1, 0.0)]),
        errors.InvalidArgument, "held_leases[1].lease_id"),
    "heartbeat_unknown": (lambda s, kv: s.heartbeat("nobody"), errors.HolderNotFound, ""),
    "heartbeat_bad_id": (lambda s, kv: s.heartbeat("a b"), errors.InvalidArgument,
                         "holder_id"),
    "deregister_unknown": (lambda s, kv: s.deregister_holder("nobody"),
                           errors.HolderNotFound, ""),
    "grant_unknown_holder": (lambda s, kv: s.grant(grant_spec(kv, kv.tokens(4),
                                                              holder_id="nobody")),
                             errors.HolderNotFound, ""),
    "grant_tokens": (lambda s, kv: s.grant(grant_spec(kv, kv.tokens(8), token_count=3)),
                     errors.InvalidArgument, "token_count"),
    "grant_hashes": (lambda s, kv: s.grant(grant_spec(kv, kv.tokens(8), hashes=b"x" * 5)),
                     errors.InvalidArgument, "block_hashes"),
    "grant_no_blocks": (lambda s, kv: s.grant(grant_spec(kv, kv.tokens(8), block_ids=[])),
                        errors.InvalidArgument, "block_ids"),
    "grant_idle_ttl": (lambda s, kv: s.grant(grant_spec(kv, kv.tokens(8), idle_ttl=1e7)),
                       errors.InvalidArgument, "idle_ttl"),
    "grant_tenant": (lambda s, kv: s.grant(grant_spec(kv, kv.tokens(8), tenant="a b")),
                     errors.InvalidArgument, "tenant"),
    "grant_draining": (lambda s, kv: s.grant(grant_spec(kv, kv.tokens(8), holder_id="h2")),
                       errors.HolderDraining, ""),
    "grant_request_reused": (lambda s, kv: s.grant(grant_spec(kv, kv.tokens(8), request_id="g1",
                                                              conversation="c7")),
                             errors.IdempotencyConflict, ""),
    "renew_bad_id": (lambda s, kv: s.renew(["a b"]), errors.InvalidArgument, "lease_ids[0]"),
    "renew_bad_conv": (lambda s, kv: s.renew([], [("t1", "")]), errors.InvalidArgument,
                       "conversations[0].conversation_id"),
    "revoke_unknown": (lambda s, kv: s.revoke("l-nope"), errors.LeaseNotFound, ""),
    "revoke_other_holder": (lambda s, kv: s.revoke("l-held", "h2"), errors.NotLeaseHolder, ""),
    "get_unknown": (lambda s, kv: s.get_lease("l-nope"), errors.LeaseNotFound, ""),
    "list_conv_without_tenant": (lambda s, kv: s.list_leases(conversation_id="c1"),
                                 errors.InvalidArgument, "conversation_id"),
    "read_hashes": (lambda s, kv: s.acquire_read("t1", "c1", b"x" * 17),
                    errors.InvalidArgument, "block_hashes"),
    "read_pin_ttl": (lambda s, kv: s.acquire_read("t1", "c1", b"", pin_ttl=-1.0),
                     errors.InvalidArgument, "pin_ttl"),
    "read_min_tokens": (lambda s, kv: s.acquire_read("t1", "c1", b"", min_tokens=-1),
                        errors.InvalidArgument, "min_tokens"),
    "read_request_reused": (lambda s, kv: s.pin_lease("t1", "c2", reader_id="p1",
                                                      request_id="r1"),
                            errors.IdempotencyConflict, ""),
    "pin_tenant": (lambda s, kv: s.pin_lease("", "c1"), errors.InvalidArgument, "tenant"),
    "release_empty": (lambda s, kv: s.release_read(""), errors.InvalidArgument, "pin_id"),
}


async def _state(store: LeaseStore) -> Any:
    leases = [(x.lease_id, x.state, x.pin_count, x.epoch, x.token_count)
              for x in await store.list_leases(include_inactive=True, limit=1000)]
    holders = [(h.holder_id, h.state, h.lease_count, h.retained_blocks)
               for h in await store.holders()]
    return leases, holders


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
async def test_bad_input_is_refused_alike_and_changes_nothing(b: Backend, kv: Any,
                                                              case: str) -> None:
    s = b.store
    await s.register_holder(holder())
    await s.register_holder(holder("h2"))
    await s.deregister_holder("h2")
    await s.register_holder(holder(), [Snapshot("l-held", grant_spec(kv, kv.tokens(10)), 1, 0.0)])
    await s.grant(grant_spec(kv, kv.tokens(8), conversation="c2", request_id="g1"))
    await s.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)), reader_id="p1",
                         request_id="r1")
    before = await _state(s)
    call, error, field = BAD_CALLS[case]
    with pytest.raises(error) as caught:
        await call(s, kv)
    if field:
        assert caught.value.metadata["field"] == field
    assert await _state(s) == before


async def test_redis_that_lost_its_data_holds_reclaims_again(redis_server: Any,
                                                             redis_namespace: str,
                                                             kv: Any) -> None:
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace, max_pin_ttl_s=5.0,
                            default_pin_ttl_s=5.0)
    store = RedisStore(config, SystemClock())
    await store.start()
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await store.advance_clock(10.0)  # past the first start's grace
        await store.register_holder(holder(ttl=300.0))
        spec = grant_spec(kv, kv.tokens(8))
        old = (await store.grant(spec)).lease
        await store.pin_lease("t1", "c1")  # a reader reads...
        keys = await client.keys(store.prefix + "*")
        await client.delete(*keys)  # ...when Redis loses everything (no persistence)
        with pytest.raises(errors.HolderNotFound):
            await store.heartbeat("h1")
        reg = await store.register_holder(holder(ttl=300.0), [
            Snapshot(old.lease_id, spec, old.epoch, 1.0)])  # the holder re-registers
        assert reg.restored == [old.lease_id]
        await store.grant(grant_spec(kv, kv.tokens(12)))  # supersedes it
        assert (await store.heartbeat("h1"))[0] == []  # the lost pin may still be read
        await store.advance_clock(6.5)
        assert (await store.heartbeat("h1"))[0] == [old.lease_id]
    finally:
        await client.aclose()
        await store.close()


async def test_redis_durations_count_from_when_the_call_was_sent(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """A reply that arrives late (queued behind others, a busy event loop) shortens the
    durations the replica derives from it, never lengthens them: a pin or lease ends on the
    local clock no later than in Redis."""
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = RedisStore(config, SystemClock())
    await store.start()
    try:
        await store.register_holder(holder(ttl=300.0))
        assert store._batcher is not None
        original = store._batcher.call

        async def late(args: Any) -> Any:
            reply = await original(args)
            await asyncio.sleep(0.5)
            return reply

        store._batcher.call = late  # type: ignore[assignment,method-assign]
        lease = (await store.grant(grant_spec(kv, kv.tokens(8), idle_ttl=60.0))).lease
        assert lease.expire_at - store.clock.monotonic() <= 59.55
        read = await store.pin_lease("t1", "c1", pin_ttl=10.0)
        assert read.pin is not None and read.pin.expire_at - store.clock.monotonic() <= 9.55
    finally:
        await store.close()


async def test_redis_forgets_a_tenant_with_no_active_lease_left(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """The per-tenant block counts (for quotas) keep no entry for a tenant whose leases have
    all ended: the hash does not grow with every tenant ever seen."""
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = RedisStore(config, SystemClock())
    await store.start()
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await store.register_holder(holder(ttl=300.0))
        one = (await store.grant(grant_spec(kv, kv.tokens(8), tenant="t-brief"))).lease
        two = (await store.grant(grant_spec(kv, kv.tokens(8), tenant="t-brief",
                                            conversation="c2"))).lease
        assert int(await client.hget(store.prefix + "tb", "t-brief")) == 4
        await store.revoke(one.lease_id)
        assert int(await client.hget(store.prefix + "tb", "t-brief")) == 2
        await store.revoke(two.lease_id)
        assert not await client.hexists(store.prefix + "tb", "t-brief")
    finally:
        await client.aclose()
        await store.close()


async def test_redis_replicas_derive_the_same_pin_for_a_retried_read(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """Replicas share the key of pin ids: a read retried on another replica finds its pin."""
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    first, second = RedisStore(config, SystemClock()), RedisStore(config, SystemClock())
    await first.start()
    await second.start()
    try:
        await first.register_holder(holder())
        await first.grant(grant_spec(kv, kv.tokens(8)))
        hashes = kv.prompt_hashes(kv.tokens(8))
        one = await first.acquire_read("t1", "c1", hashes, reader_id="p1", request_id="r1")
        two = await second.acquire_read("t1", "c1", hashes, reader_id="p1", request_id="r1")
        assert one.pin is not None and two.pin is not None and one.pin.pin_id == two.pin.pin_id
        assert two.lease is not None and two.lease.pin_count == 1
    finally:
        await first.close()
        await second.close()


async def test_redis_scheduled_ticks_take_turns_across_replicas(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """The background scheduler's ticks run on one replica at a time (the fleet's deadlines
    need one), so Redis's tick load does not grow with the replicas; another replica takes
    over once the one ticking stops for longer than its turn (20 s here)."""
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    a, b = RedisStore(config, SystemClock()), RedisStore(config, SystemClock())
    await a.start()
    await b.start()
    n = 0

    async def short_lease() -> None:  # idle for 5 s, it is due 5 s from now
        nonlocal n
        n += 1
        await a.grant(grant_spec(kv, kv.tokens(8), conversation=f"c{n}", request_id=f"g{n}",
                                 idle_ttl=5.0))

    try:
        await a.register_holder(holder(ttl=300.0))
        assert await a.tick(turn=20.0) == 0  # a takes the turn (nothing due yet)
        await short_lease()
        await short_lease()
        await a.advance_clock(6.0)  # both are due; a's turn holds for 14 s more
        assert await b.tick(turn=20.0) == 0  # left to a
        wake = b.next_deadline()  # b tries again when a's turn ends
        assert wake is not None and 13.0 < wake - b.clock.monotonic() <= 14.1
        assert await a.tick(turn=20.0) == 2  # a, ticking, expires both
        # a stops ticking: once its hold is over, b's scheduled tick runs, and takes the turn.
        await short_lease()
        await a.advance_clock(21.0)
        assert await b.tick(turn=20.0) == 1
        await short_lease()
        await a.advance_clock(5.5)
        assert await a.tick(turn=20.0) == 0  # b's turn now
        assert await a.tick() == 1  # an unscheduled tick (start-up, tests) always runs
        # A turn that ends further away than one hold (the fleet's clock went back since it
        # was taken) is over: a step of the clock cannot stall the ticks.
        assert a._redis is not None
        await a._redis.hset(a.prefix + "ticker", mapping={"o": "gone", "x": "9e12"})
        await short_lease()
        await a.advance_clock(5.5)
        assert await b.tick(turn=20.0) == 1
        # Nor can a turn that is not a number (a hand edit).
        await a._redis.hset(a.prefix + "ticker", mapping={"o": "gone", "x": "soon"})
        await short_lease()
        await a.advance_clock(5.5)
        assert await b.tick(turn=20.0) == 1
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("policy, warned", [("allkeys-lru", True), ("noeviction", False),
                                            ("volatile-lru", False)])
async def test_redis_that_may_evict_any_key_is_warned_of(policy: str, warned: bool,
                                                         redis_namespace: str) -> None:
    from conftest import RedisProcess

    server = RedisProcess("--save", "", "--appendonly", "no", "--maxmemory-policy", policy)
    config = RegistryConfig(backend="redis", redis_url=server.url,
                            redis_namespace=redis_namespace)
    store = RedisStore(config, SystemClock())
    try:
        with capture_logs() as logs:
            await store.start()
        warnings = [e for e in logs if e["event"] == "redis_may_evict_leases"]
        assert [e["maxmemory_policy"] for e in warnings] == ([policy] if warned else [])
    finally:
        await store.close()
        server.stop()


@pytest.fixture
async def evicting(redis_server: Any, redis_namespace: str) -> AsyncIterator[Any]:
    """`store, client = await evicting(**config)`: a started RedisStore and a plain client to
    delete keys behind its back, as a Redis with an eviction policy would."""
    opened: list[tuple[RedisStore, Any]] = []

    async def make(**overrides: Any) -> tuple[RedisStore, Any]:
        config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                                redis_namespace=redis_namespace, **overrides)
        store = RedisStore(config, SystemClock())
        await store.start()
        client = aioredis.Redis.from_url(redis_server.url)
        opened.append((store, client))
        return store, client

    yield make
    for store, client in opened:
        await client.aclose()
        await store.close()


async def test_redis_read_of_a_lease_evicted_under_its_conversation_misses(
        evicting: Any, kv: Any) -> None:
    """A Redis that evicts keys (a maxmemory policy other than noeviction) can drop a lease's
    hash while its conversation still points at it: the read is a plain miss (prefill
    recomputes), not a script error."""
    store, client = await evicting()
    await store.register_holder(holder(ttl=300.0))
    tokens = kv.tokens(8)
    lease = (await store.grant(grant_spec(kv, tokens))).lease
    assert (await store.acquire_read("t1", "c1", kv.prompt_hashes(tokens))).pin is not None
    await client.delete(store.prefix + "l:" + lease.lease_id)
    read = await store.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
    assert (read.miss, read.lease, read.pin) == (MissReason.NO_LEASE, None, None)


async def test_redis_grant_over_an_evicted_lease_supersedes_nothing_and_raises_the_epoch(
        evicting: Any, kv: Any) -> None:
    """The conversation's next grant after Redis evicted its current lease's hash succeeds
    (the conversation is not stuck), its epoch exceeds the lost one, and it is readable."""
    store, client = await evicting()
    await store.register_holder(holder(ttl=300.0))
    first = (await store.grant(grant_spec(kv, kv.tokens(8)))).lease
    second = (await store.grant(grant_spec(kv, kv.tokens(12)))).lease
    assert second.epoch == first.epoch + 1
    await client.delete(store.prefix + "l:" + second.lease_id)
    tokens = kv.tokens(16)
    third = await store.grant(grant_spec(kv, tokens))
    assert third.superseded is None
    assert third.lease.epoch > second.epoch
    read = await store.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
    assert read.miss is MissReason.HIT and read.lease is not None
    assert read.lease.lease_id == third.lease.lease_id
    fourth = (await store.grant(grant_spec(kv, kv.tokens(20)))).lease
    assert fourth.epoch == third.lease.epoch + 1


async def test_redis_reregistration_restores_a_lease_whose_hash_was_evicted(
        evicting: Any, kv: Any) -> None:
    """A holder that still holds a lease Redis evicted restores it on re-registration: the
    conversation points at it again and it is readable (and the conversation's pointer, which
    names the restored lease itself, does not make it look superseded)."""
    store, client = await evicting()
    await store.register_holder(holder(ttl=300.0))
    tokens = kv.tokens(8)
    spec = grant_spec(kv, tokens)
    lease = (await store.grant(spec)).lease
    await client.delete(store.prefix + "l:" + lease.lease_id)
    reg = await store.register_holder(holder(ttl=300.0),
                                      [Snapshot(lease.lease_id, spec, lease.epoch, 1.0)])
    assert reg.restored == [lease.lease_id]
    assert (await store.get_lease(lease.lease_id)).state is LeaseState.ACTIVE
    read = await store.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
    assert read.miss is MissReason.HIT and read.lease is not None
    assert read.lease.lease_id == lease.lease_id


async def test_redis_evicted_lease_does_not_count_against_its_tenants_quota(
        evicting: Any, kv: Any, tmp_path: Path) -> None:
    """A lease whose hash Redis evicted leaves the tenant's quota count at the next grant of
    that tenant: it does not make a live lease give way."""
    quotas = tmp_path / "quotas.txt"
    quotas.write_text("t1 2 0\n")
    store, client = await evicting(tenant_quota_file=str(quotas))
    await store.register_holder(holder(ttl=300.0))
    gone = (await store.grant(grant_spec(kv, kv.tokens(8), conversation="c1"))).lease
    kept = (await store.grant(grant_spec(kv, kv.tokens(8), conversation="c2"))).lease
    await client.delete(store.prefix + "l:" + gone.lease_id)
    await store.grant(grant_spec(kv, kv.tokens(8), conversation="c3"))
    assert (await store.get_lease(kept.lease_id)).state is LeaseState.ACTIVE


async def test_redis_expiry_skips_an_evicted_lease_and_goes_on(
        evicting: Any, kv: Any) -> None:
    """A lease whose hash Redis evicted comes due like any other: the tick skips it instead
    of failing (a failing tick would stop every expiry of the fleet) and the rest expire."""
    store, client = await evicting()
    await store.register_holder(holder(ttl=300.0))
    gone = (await store.grant(grant_spec(kv, kv.tokens(8), idle_ttl=5.0))).lease
    kept = (await store.grant(grant_spec(kv, kv.tokens(8), conversation="c2",
                                         idle_ttl=5.0))).lease
    await client.delete(store.prefix + "l:" + gone.lease_id)
    await store.advance_clock(6.0)
    assert await store.tick() == 1  # the evicted one is not counted
    assert (await store.get_lease(kept.lease_id)).state is LeaseState.EXPIRED
    assert await client.zscore(store.prefix + "lexp", gone.lease_id) is None
    await store.tick()  # and the next tick is fine too


# ---- Redis down, Redis back --------------------------------------------------------------


async def test_redis_outage_fails_fast_and_service_resumes(tmp_path: Path, kv: Any) -> None:
    from conftest import RedisProcess

    durable = ("--dir", str(tmp_path), "--appendonly", "yes", "--appendfsync", "always",
               "--save", "")
    server = RedisProcess(*durable)
    config = RegistryConfig(backend="redis", redis_url=server.url, redis_namespace="outage")
    store = RedisStore(config, SystemClock())
    await store.start()
    try:
        await store.register_holder(holder(ttl=300.0))
        lease = (await store.grant(grant_spec(kv, kv.tokens(8)))).lease
        server.stop()
        started = time.monotonic()
        with pytest.raises(errors.Unavailable):
            await store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        assert await store.tick() == 0  # the scheduler keeps going
        assert time.monotonic() - started < 2.0  # readers fail open, they do not wait
        server = RedisProcess(*durable, port=server.port)  # back, with its append-only file
        # Another Redis process (it may have come back from an older file): the holder's
        # leases are not read until it registers again with what it holds, which its next
        # heartbeat asks for.
        read = await store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        assert read.miss is MissReason.HOLDER_GONE and read.pin is None
        with pytest.raises(errors.HolderNotFound):
            await store.heartbeat("h1")
        reg = await store.register_holder(holder(ttl=300.0), held_ids=[lease.lease_id])
        assert reg.reclaimable == []
        read = await store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        assert read.miss is MissReason.HIT and read.lease is not None
        assert read.lease.lease_id == lease.lease_id
    finally:
        await store.close()
        server.stop()


async def test_replicas_agree_on_the_pin_secret_after_redis_loses_it(evicting: Any,
                                                                     kv: Any) -> None:
    a, client = await evicting()
    b, _ = await evicting()
    key = a.prefix + "pin_secret"
    shared = a._pin_secret
    assert shared and b._pin_secret == shared
    await client.delete(key)  # as a Redis that lost its data
    c, _ = await evicting()  # started since: it makes a new one
    assert c._pin_secret != shared
    with capture_logs() as logs:
        await a.tick()
        await b.tick()
    assert a._pin_secret == b._pin_secret == c._pin_secret == await client.get(key)
    assert [e["event"] for e in logs].count("redis_pin_secret_changed") == 2
    # A read retried on another replica finds the same pin.
    await a.register_holder(holder(ttl=300.0))
    await a.grant(grant_spec(kv, kv.tokens(8)))
    hashes = kv.prompt_hashes(kv.tokens(8))
    first = await a.acquire_read("t1", "c1", hashes, reader_id="p1", request_id="r1")
    again = await c.acquire_read("t1", "c1", hashes, reader_id="p1", request_id="r1")
    assert first.pin is not None and again.pin is not None
    assert again.pin.pin_id == first.pin.pin_id
    # Lost with no replica started since: the next tick writes the fleet's secret back.
    await client.delete(key)
    await b.tick()
    assert await client.get(key) == c._pin_secret


async def test_a_gap_in_the_event_stream_is_told_and_never_replayed(evicting: Any,
                                                                    kv: Any) -> None:
    store, client = await evicting()
    told: list[str] = []
    store.on_events_lost(told.append)
    seen: list[str] = []
    arrived = asyncio.Event()

    def listener(event: Any) -> None:
        seen.append(event.conversation_id)
        arrived.set()

    store.add_listener(listener)
    await store.register_holder(holder(ttl=300.0))

    async def grant(conversation: str) -> None:
        # After a kill the tick meets the dead connection (script calls are never resent),
        # so that the grant finds a new one.
        await store.tick()
        arrived.clear()
        await store.grant(grant_spec(kv, kv.tokens(4), conversation=conversation))
        while conversation not in seen:
            await asyncio.wait_for(arrived.wait(), 5)
            arrived.clear()

    key = store.prefix + "events"
    await grant("c1")
    await grant("c2")
    assert told == []  # reads that find what they delivered tell nothing
    # As Redis restarted from an older snapshot: the stream holds only entries before the last
    # one delivered, and the replica's connections drop.
    old = {"t": 1, "l": "l-old", "tn": "t1", "c": "from-the-snapshot", "h": "h1", "e": 1,
           "w": "0", "lt": "0"}
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        pipe.xadd(key, old, id="1-0")
        pipe.xadd(key, old, id="2-0")
        pipe.client_kill_filter(_type="normal", skipme=True)
        await pipe.execute()
    await grant("c3")
    assert len(told) == 1 and "may have been lost" in told[0]
    assert "from-the-snapshot" not in seen  # not replayed as if new
    # As Redis restarted without its data: told, and the new stream is read from its start.
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        pipe.client_kill_filter(_type="normal", skipme=True)
        await pipe.execute()
    await grant("c4")
    assert len(told) == 2
    # Connections dropped with the stream intact (a Redis restarted from its append-only
    # file): nothing to tell.
    await client.client_kill_filter(_type="normal", skipme=True)
    await grant("c5")
    assert len(told) == 2
    assert [c for c in seen if c.startswith("c")] == ["c1", "c2", "c3", "c4", "c5"]


@pytest.mark.parametrize("durable", [True, False], ids=["kept", "lost"])
async def test_watch_ends_when_redis_comes_back_without_its_events(
        tmp_path: Path, kv: Any, durable: bool) -> None:
    from conftest import RedisProcess

    kept = (("--dir", str(tmp_path), "--appendonly", "yes", "--appendfsync", "always",
             "--save", "") if durable else ("--save", "", "--appendonly", "no"))
    redis = RedisProcess(*kept)
    server = await create_server(RegistryConfig(
        listen="127.0.0.1:0", metrics_listen="", backend="redis", redis_url=redis.url,
        redis_namespace="events-lost"))
    await server.start()
    client = AsyncRegistryClient(f"127.0.0.1:{server.port}", timeout=5.0)
    watch = _Watch(client)
    try:
        await wait_for_watchers(server, 1)
        await client.register_holder(**kv.holder_args("h1", ttl=300.0))
        before = (await client.grant_lease(**kv.grant_args("h1", "t1", "c1",
                                                           kv.tokens(4)))).lease
        await watch.wait_for(("GRANTED", before.lease_id))
        redis.stop()
        redis = RedisProcess(*kept, port=redis.port)
        with capture_logs() as logs:
            if durable:  # the stream still holds what was delivered: the watch goes on
                await client.register_holder(**kv.holder_args("h1", ttl=300.0))
                after = (await client.grant_lease(**kv.grant_args("h1", "t1", "c2",
                                                                  kv.tokens(4)))).lease
                await watch.wait_for(("GRANTED", after.lease_id), timeout=10.0)
                assert not watch.task.done()
            else:  # it does not: the watch ends, and says why
                with pytest.raises(errors.Unavailable, match="may have been lost"):
                    await asyncio.wait_for(watch.task, 10.0)
        assert any(e["event"] == "redis_events_lost" for e in logs) is not durable
        if not durable:  # a new watch sees the new stream's events
            watch = _Watch(client)
            await wait_for_watchers(server, 1)
            await client.register_holder(**kv.holder_args("h1", ttl=300.0))
            after = (await client.grant_lease(**kv.grant_args("h1", "t1", "c2",
                                                              kv.tokens(4)))).lease
            await watch.wait_for(("GRANTED", after.lease_id), timeout=10.0)
    finally:
        await watch.close()
        await client.close()
        await server.stop(0)
        redis.stop()


# ---- two registry replicas on one Redis, over real gRPC --------------------------------------


async def _replica(redis_url: str, namespace: str) -> RegistryServer:
    """A registry on Redis, its (shared) clock moved past the grace after a first start."""
    config = RegistryConfig(listen="127.0.0.1:0", metrics_listen="", backend="redis",
                            redis_url=redis_url, redis_namespace=namespace)
    server = await create_server(config)
    await server.start()
    assert isinstance(server.store, RedisStore)
    await server.store.advance_clock(config.effective_recovery_grace_s)
    return server


class _Watch:
    def __init__(self, client: AsyncRegistryClient) -> None:
        self.events: list[tuple[str, str]] = []
        self.task = asyncio.create_task(self._run(client))

    async def _run(self, client: AsyncRegistryClient) -> None:
        async for event in client.watch_leases():
            self.events.append(
                (pb.LeaseEventType.Name(event.type).removeprefix("LEASE_EVENT_TYPE_"),
                 event.lease_id))

    async def wait_for(self, item: tuple[str, str], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while item not in self.events:
            assert time.monotonic() < deadline, f"no {item} in {self.events}"
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def test_two_replicas_serve_one_fleet(redis_server: Any, redis_namespace: str,
                                            kv: Any) -> None:
    a = await _replica(redis_server.url, redis_namespace)
    b = await _replica(redis_server.url, redis_namespace)
    ca = AsyncRegistryClient(f"127.0.0.1:{a.port}")
    cb = AsyncRegistryClient(f"127.0.0.1:{b.port}")
    watch_a, watch_b = _Watch(ca), _Watch(cb)
    try:
        await wait_for_watchers(a, 1)
        await wait_for_watchers(b, 1)
        await cb.register_holder(**kv.holder_args("h1", ttl=300.0))
        tokens = kv.tokens(10)
        granted = (await cb.grant_lease(**kv.grant_args("h1", "t1", "c1", tokens,
                                                        idle_ttl=5.0))).lease
        # A grant on B is readable and pinnable on A; A sees B's events.
        read = await ca.acquire_read("t1", "c1", kv.prompt_hashes(tokens), reader_id="p1")
        assert read.miss_reason == pb.MISS_REASON_UNSPECIFIED and read.matched_blocks == 2  # a hit
        assert read.lease.lease_id == granted.lease_id and read.holder.nixl_host == "10.0.0.7"
        whole = await ca.pin_lease("t1", "c1")
        assert whole.read.miss_reason == pb.MISS_REASON_UNSPECIFIED
        assert whole.block_hashes == kv.lease_hashes(tokens)[:2 * 16]
        await watch_a.wait_for(("GRANTED", granted.lease_id))
        assert (await cb.get_lease(granted.lease_id)).pin_count == 2
        assert await cb.release_read(read.pin.pin_id)
        assert await cb.release_read(whole.read.pin.pin_id)
        # Expiry: both replicas tick; the lease expires once, and each watcher sees it once.
        store = a.store
        assert isinstance(store, RedisStore)
        await store.advance_clock(6.0)
        await watch_a.wait_for(("RECLAIMABLE", granted.lease_id))
        await watch_b.wait_for(("RECLAIMABLE", granted.lease_id))
        await asyncio.sleep(0.2)  # more ticks on both replicas: nothing more may come
        for watch in (watch_a, watch_b):
            mine = [t for t, lid in watch.events if lid == granted.lease_id]
            assert mine == ["GRANTED", "EXPIRED", "RECLAIMABLE"]
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            stream = await client.xrange(store.prefix + "events")
        finally:
            await client.aclose()
        expired = [f for _, f in stream
                   if f[b"t"] == b"%d" % EventType.EXPIRED and f[b"l"] == granted.lease_id.encode()]
        assert len(expired) == 1
        # The reclaim notice reaches the holder through either replica, until it acks.
        assert list((await ca.heartbeat("h1")).reclaimable_lease_ids) == [granted.lease_id]
        assert list((await cb.heartbeat("h1", [granted.lease_id])).reclaimable_lease_ids) == []
        with pytest.raises(errors.LeaseNotFound):
            await ca.get_lease(granted.lease_id)
    finally:
        await watch_a.close()
        await watch_b.close()
        await ca.close()
        await cb.close()
        await a.stop(0)
        await b.stop(0)


async def test_replica_bad_input_gets_the_canonical_status(redis_server: Any,
                                                           redis_namespace: str,
                                                           kv: Any) -> None:
    a = await _replica(redis_server.url, redis_namespace)
    c = AsyncRegistryClient(f"127.0.0.1:{a.port}")
    try:
        with pytest.raises(errors.HolderNotFound):
            await c.grant_lease(**kv.grant_args("nobody", "t1", "c1", kv.tokens(4)))
        await c.register_holder(**kv.holder_args("h1"))
        with pytest.raises(errors.InvalidArgument) as caught:
            await c.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(8),
                                                token_count=2))
        assert caught.value.metadata["field"] == "token_count"
        assert (await c.list_leases(include_inactive=True)).leases == []
    finally:
        await c.close()
        await a.stop(0)


# ---- `kvbridge registry serve --backend redis` -----------------------------------------------


def _kvbridge() -> list[str]:
    script = Path(sys.executable).parent / "kvbridge"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvbridge.cli"]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env.update(extra)
    return env


def test_serve_with_unreachable_redis_fails_cleanly() -> None:
    for args, env in (
        (["--redis-url", "redis://127.0.0.1:1/0", "--backend", "redis"], {}),
        ([], {"KVBRIDGE_REGISTRY_BACKEND": "redis",
              "KVBRIDGE_REGISTRY_REDIS_URL": "redis://127.0.0.1:1/0"}),
    ):
        result = subprocess.run(
            [*_kvbridge(), "registry", "serve", "--insecure", "--listen", "127.0.0.1:0",
             "--metrics-listen", "", *args],
            capture_output=True, text=True, timeout=60, env=_clean_env(**env))
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith(
            "Error: cannot start the registry: cannot reach Redis at redis://127.0.0.1:1/0")
        assert "Traceback" not in result.stderr


def test_serve_redis_backend_needs_a_url() -> None:
    result = subprocess.run(
        [*_kvbridge(), "registry", "serve", "--insecure", "--backend", "redis"],
        capture_output=True, text=True, timeout=60, env=_clean_env())
    assert result.returncode == 2
    assert "backend redis needs redis_url" in result.stderr


def _spawn_replica(redis_url: str, namespace: str) -> tuple[subprocess.Popen[str], str]:
    """`kvbridge registry serve --backend redis` as a process (configured by environment);
    returns it and its gRPC address once it logged `registry_started`."""
    proc = subprocess.Popen(
        [*_kvbridge(), "registry", "serve", "--insecure", "--listen", "127.0.0.1:0",
         "--metrics-listen", ""],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=_clean_env(KVBRIDGE_REGISTRY_BACKEND="redis", KVBRIDGE_REGISTRY_REDIS_URL=redis_url,
                       KVBRIDGE_REGISTRY_REDIS_NAMESPACE=namespace))
    assert proc.stderr is not None
    for line in proc.stderr:
        event = json.loads(line)
        if event.get("event") == "registry_started":
            assert event["backend"] == "redis"
            return proc, event["listen"]
    raise AssertionError(f"the replica exited with {proc.wait(5)} before it started")


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


@pytest.mark.slow
def test_serve_subprocess_on_redis(redis_server: Any, redis_namespace: str, kv: Any) -> None:
    from kvbridge.clients import RegistryClient

    proc, target = _spawn_replica(redis_server.url, redis_namespace)
    try:
        with RegistryClient(target) as client:
            client.register_holder(**kv.holder_args("h1"))
            lease = client.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(8))).lease
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        rest = proc.stderr.read()  # the pipe must not fill up while the replica shuts down
        assert proc.wait(timeout=10) == 0, rest
    finally:
        _end(proc)

    async def check() -> None:  # the lease outlives the replica: it lives in Redis
        config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                                redis_namespace=redis_namespace)
        store = RedisStore(config, SystemClock())
        await store.start()
        try:
            assert (await store.get_lease(lease.lease_id)).state is LeaseState.ACTIVE
        finally:
            await store.close()

    asyncio.run(check())


@pytest.mark.slow
async def test_a_replica_killed_mid_pin_loses_no_lease_and_no_pin(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    proc, target = _spawn_replica(redis_server.url, redis_namespace)
    other = await _replica(redis_server.url, redis_namespace)
    try:
        async with AsyncRegistryClient(target) as client:
            await client.register_holder(**kv.holder_args("h1", ttl=300.0))
            lease = (await client.grant_lease(**kv.grant_args("h1", "t1", "c1",
                                                              kv.tokens(8)))).lease
            read = await client.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)),
                                             pin_ttl=25.0)
            assert read.pin.pin_id
        proc.send_signal(signal.SIGKILL)  # mid-pin: the reader is still reading
        proc.wait(5)
        async with AsyncRegistryClient(f"127.0.0.1:{other.port}") as client:
            kept = await client.get_lease(lease.lease_id)
            assert (kept.state, kept.pin_count) == (pb.LEASE_STATE_ACTIVE, 1)
            await client.revoke_lease(lease.lease_id, "memory pressure", holder_id="h1")
            # The pin granted by the dead replica still holds the blocks.
            assert list((await client.heartbeat("h1")).reclaimable_lease_ids) == []
            assert await client.release_read(read.pin.pin_id)
            assert list((await client.heartbeat("h1")).reclaimable_lease_ids) == [
                lease.lease_id]
    finally:
        _end(proc)
        await other.stop(0)


# ---- tenant quotas ----------------------------------------------------------------------------


async def test_tenant_quota_revokes_the_tenants_own_leases_only(make_backend: Factory,
                                                                 kv: Any, tmp_path: Any) -> None:
    """t1 may hold 2 leases of at most 6 blocks in all (a quota file); t2 has no quota. A grant
    past t1's quota revokes t1's soonest-expiring unpinned lease; t2's are never touched; when
    every other t1 lease is pinned the grant is refused and nothing changes."""
    quotas = tmp_path / "quotas.txt"
    quotas.write_text("t1 2 6\n")
    b = await make_backend(tenant_quota_file=str(quotas))
    await b.store.register_holder(holder())
    toks = kv.tokens(8)  # 2 blocks

    async def grant(tenant: str, conv: str, tokens: list[int] = toks) -> Any:
        return (await b.store.grant(grant_spec(kv, tokens, tenant=tenant, conversation=conv,
                                               idle_ttl=30.0))).lease

    other = [await grant("t2", f"o{i}") for i in range(3)]  # t2: over t1's quota, unlimited
    first = await grant("t1", "c1")
    await b.advance(1.0)
    second = await grant("t1", "c2")
    await b.advance(1.0)
    third = await grant("t1", "c3")  # 3 leases > 2: c1 goes
    states = [(await b.store.get_lease(x.lease_id)).state for x in (first, second, third)]
    assert states == [LeaseState.REVOKED, LeaseState.ACTIVE, LeaseState.ACTIVE]
    assert {(await b.store.get_lease(x.lease_id)).state for x in other} == {LeaseState.ACTIVE}
    # The next turn of c3, bigger (3 blocks: 2 + 3 <= 6), supersedes c3 and revokes nothing.
    c3b = await grant("t1", "c3", kv.tokens(12))
    assert c3b.epoch == 2
    assert (await b.store.get_lease(second.lease_id)).state is LeaseState.ACTIVE
    # Blocks: c2 pinned; a 4-block c4 needs c3b (3 blocks) to go: 2 + 4 <= 6.
    pin = await b.store.pin_lease("t1", "c2")
    assert pin.pin is not None
    c4 = await grant("t1", "c4", kv.tokens(16))
    assert c4.block_count == 4
    assert (await b.store.get_lease(c3b.lease_id)).state is LeaseState.REVOKED
    # Pin c4 too: c5 can make no room, so it is refused and nothing changes.
    assert (await b.store.pin_lease("t1", "c4")).pin is not None
    with pytest.raises(errors.TenantQuotaExceeded):
        await grant("t1", "c5")
    with pytest.raises(errors.TenantQuotaExceeded):  # alone bigger than the block quota
        await grant("t1", "c6", kv.tokens(28))
    active = [x.conversation_id for x in await b.store.list_leases("t1")
              if x.state is LeaseState.ACTIVE]
    assert sorted(active) == ["c2", "c4"]
    await b.wait_events(first.lease_id, ["GRANTED", "REVOKED", "RECLAIMABLE"])


# ---- Redis: replays, replicas' caches, the event tail -----------------------------------------


def _redis_config(url: str, namespace: str, **overrides: Any) -> RegistryConfig:
    return RegistryConfig(backend="redis", redis_url=url, redis_namespace=namespace,
                          **overrides)


async def _until(done: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until `done()` (the event tail delivers asynchronously), at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        if done() or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.01)


def _run_twice(store: RedisStore, commands: set[str]) -> list[str]:
    """Run every script call of `commands` twice with the same arguments, as a client that
    resends a call whose reply it lost would (Redis ran it); the caller gets the second reply."""
    run = store._run
    replayed: list[str] = []

    async def twice(*args: Any) -> list[Any]:
        if args[0] in commands:
            await run(*args)
            replayed.append(args[0])
        return await run(*args)

    store._run = twice  # type: ignore[method-assign]
    return replayed


async def test_redis_replayed_grants_and_reads_change_nothing(redis_server: Any,
                                                              redis_namespace: str,
                                                              kv: Any) -> None:
    """A grant or a read without request_id run twice (a replayed script call) is one grant or
    one pin: the lease is not superseded by itself (ACTIVE yet reclaimable, its pins wiped),
    and a pin is not counted twice (a dead lease never reclaimable)."""
    store = RedisStore(_redis_config(redis_server.url, redis_namespace), SystemClock(),
                       recovering=False)
    await store.start()
    events: list[LeaseEvent] = []
    store.add_listener(events.append)
    try:
        await store.register_holder(holder(ttl=300.0))
        replayed = _run_twice(store, {"grant", "read"})
        first = await store.grant(grant_spec(kv, kv.tokens(8)))
        assert (first.lease.state, first.lease.epoch, first.superseded) == (
            LeaseState.ACTIVE, 1, None)
        read = await store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)),
                                        pin_ttl=20.0)
        assert read.pin is not None and read.lease is not None
        assert read.lease.pin_count == 1
        assert await store.heartbeat("h1") == ([], 300.0)
        second = (await store.grant(grant_spec(kv, kv.tokens(12)))).lease  # supersedes first
        assert (second.state, second.epoch, second.pin_count) == (LeaseState.ACTIVE, 2, 0)
        old = await store.get_lease(first.lease.lease_id)
        assert (old.state, old.pin_count) == (LeaseState.SUPERSEDED, 1)
        assert await store.heartbeat("h1") == ([], 300.0)  # first pinned, second live
        assert (await store.get_holder("h1")).lease_count == 1
        assert await store.release_read(read.pin.pin_id)
        assert (await store.heartbeat("h1"))[0] == [first.lease.lease_id]
        assert (await store.get_lease(second.lease_id)).state is LeaseState.ACTIVE
        assert replayed == ["grant", "read", "grant"]
        await _until(lambda: len(events) >= 4)
        assert [(e.type.name, e.lease_id) for e in events] == [
            ("GRANTED", first.lease.lease_id), ("SUPERSEDED", first.lease.lease_id),
            ("GRANTED", second.lease_id), ("RECLAIMABLE", first.lease.lease_id)]
    finally:
        await store.close()


class _CutAfterRun:
    """A TCP proxy to Redis that, the first time a function call of `command` passes, lets Redis
    run it and then drops the connection instead of passing the reply on: a connection lost
    while reading the reply of a call Redis ran."""

    def __init__(self, upstream_port: int, command: bytes) -> None:
        self.marker = b"$%d\r\n%s\r\n" % (len(command), command)
        self.upstream_port = upstream_port
        self.cut = False
        self.sent = 0  # chunks with a call of `command` passed on to Redis
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        armed = False

        async def to_redis() -> None:
            nonlocal armed
            while data := await reader.read(65536):
                if self.marker in data:
                    self.sent += 1
                    if not self.cut:
                        self.cut = armed = True
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if armed:  # Redis ran the call: lose its reply
                    writer.transport.abort()
                    up_writer.transport.abort()
                    return
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(to_redis(), to_client(), return_exceptions=True)


async def test_redis_script_call_is_never_sent_again_after_redis_may_have_run_it(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """A connection lost after a grant reached Redis fails the call (Unavailable: the caller
    fails open) instead of resending it: the lease Redis granted stays one live lease."""
    from kvbridge.services.registry._redis_lua import library

    proxy = _CutAfterRun(redis_server.port, library().function("grant").encode())
    port = await proxy.start()
    store = RedisStore(_redis_config(f"redis://127.0.0.1:{port}/0", redis_namespace),
                       SystemClock(), recovering=False)
    await store.start()
    try:
        await store.register_holder(holder(ttl=300.0))
        with pytest.raises(errors.Unavailable):
            await store.grant(grant_spec(kv, kv.tokens(8)))
        assert (proxy.cut, proxy.sent) == (True, 1)
        leases = await store.list_leases(include_inactive=True)
        assert [(x.state, x.epoch, x.pin_count) for x in leases] == [(LeaseState.ACTIVE, 1, 0)]
        assert await store.heartbeat("h1") == ([], 300.0)
        read = await store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        assert read.miss is MissReason.HIT and read.lease is not None
        assert read.lease.lease_id == leases[0].lease_id and read.lease.pin_count == 1
    finally:
        await store.close()
        await proxy.close()


async def test_redis_grant_follows_a_block_size_changed_via_another_replica(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """Replica A cached h1's block size; h1 is lost and re-registers with another block size
    via replica B. Grants via A are checked against the new size, not refused by the old one."""
    config = _redis_config(redis_server.url, redis_namespace)
    a = RedisStore(config, SystemClock(), recovering=False)
    b = RedisStore(config, SystemClock(), recovering=False)
    await a.start()
    await b.start()
    try:
        await a.register_holder(holder(ttl=5.0))
        await a.grant(grant_spec(kv, kv.tokens(8)))  # A caches block size 4
        await b.advance_clock(6.0)
        await b.tick()  # B finds h1 lost; A does not hear of it
        await b.register_holder(holder(ttl=300.0, block_size=8))
        two_of_eight = grant_spec(kv, kv.tokens(16), conversation="c2", block_ids=[200, 201],
                                  hashes=bytes(32))
        lease = (await a.grant(two_of_eight)).lease
        assert (lease.block_count, lease.token_count, lease.holder.block_size) == (2, 16, 8)
        with pytest.raises(errors.InvalidArgument) as caught:  # 8 tokens do not fill 2 of 8
            await a.grant(grant_spec(kv, kv.tokens(8), conversation="c3"))
        assert caught.value.metadata["field"] == "token_count"
        # and back: A now caches 8; h1 returns with 4 via B
        await b.advance_clock(301.0)
        await b.tick()
        await b.register_holder(holder(ttl=300.0))
        lease = (await a.grant(grant_spec(kv, kv.tokens(8), conversation="c4"))).lease
        assert (lease.block_count, lease.holder.block_size) == (2, 4)
    finally:
        await a.close()
        await b.close()


async def test_redis_malformed_event_is_skipped_and_delivery_goes_on(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """An event this replica cannot read (a field missing, a type from a newer replica) is
    logged and skipped; the events after it still reach the listeners."""
    store = RedisStore(_redis_config(redis_server.url, redis_namespace), SystemClock(),
                       recovering=False)
    await store.start()
    events: list[LeaseEvent] = []
    store.add_listener(events.append)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        with capture_logs() as logs:
            bad = [await client.xadd(store._events_key, {"t": 1, "l": "l-x"}),
                   await client.xadd(store._events_key, {
                       "t": 99, "l": "l-y", "tn": "t1", "c": "c1", "h": "h1", "e": 1,
                       "w": "1.0", "lt": "0"})]
            await store.register_holder(holder(ttl=300.0))
            lease = (await store.grant(grant_spec(kv, kv.tokens(8)))).lease
            await _until(lambda: bool(events))
        assert [(e.type, e.lease_id) for e in events] == [(EventType.GRANTED, lease.lease_id)]
        skipped = [e for e in logs if e["event"] == "redis_event_skipped"]
        assert [e["id"] for e in skipped] == [x.decode() for x in bad]
        assert all(e["reason"] for e in skipped)
    finally:
        await client.aclose()
        await store.close()


@pytest.mark.parametrize("epoch, ok", [(2**53 - 1, True), (2**53, False), (2**63 - 1, False)])
async def test_snapshot_epochs_are_capped_alike(b: Backend, kv: Any, epoch: int,
                                                ok: bool) -> None:
    """Epochs a Lua number holds exactly (below 2**53) are restored and read back exactly on
    both backends; larger ones are refused alike, naming the field."""
    spec = grant_spec(kv, kv.tokens(8))
    snap = Snapshot("l-big", spec, epoch, 1.0)
    if not ok:
        with pytest.raises(errors.InvalidArgument) as caught:
            await b.store.register_holder(holder(ttl=300.0), [snap])
        assert caught.value.metadata["field"] == "held_leases[0].epoch"
        assert await b.store.holders() == []
        return
    reg = await b.store.register_holder(holder(ttl=300.0), [snap])
    assert reg.restored == ["l-big"]
    assert (await b.store.get_lease("l-big")).epoch == epoch
    read = await b.store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
    assert read.miss is MissReason.HIT and read.lease is not None and read.lease.epoch == epoch
    nxt = await b.store.grant(grant_spec(kv, kv.tokens(12)))
    assert nxt.lease.epoch == epoch + 1
    assert sorted(x.epoch for x in await b.store.list_leases(include_inactive=True)) == [
        epoch, epoch + 1]


async def test_tenant_quota_counts_an_expired_lease_as_free_before_any_tick(
        make_backend: Factory, kv: Any) -> None:
    """The tenant's only lease passed its idle TTL but no tick has run yet: a new grant finds
    the room it left (correctness never waits for the expiry scheduler) instead of refusing,
    as if that lease were pinned."""
    b = await make_backend(tenant_max_leases=1)
    await b.store.register_holder(holder(ttl=300.0))
    first = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c1",
                                            idle_ttl=5.0))).lease
    await b.advance(6.0)
    second = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c2"))).lease
    assert (await b.store.get_lease(first.lease_id)).state is LeaseState.EXPIRED
    assert (await b.store.get_lease(second.lease_id)).state is LeaseState.ACTIVE
    assert (await b.store.pin_lease("t1", "c2")).pin is not None
    with pytest.raises(errors.TenantQuotaExceeded):  # c2 is live and pinned: no room
        await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c3"))


# ---- Redis's own clock steps ------------------------------------------------------------------


async def _two_replicas(url: str, namespace: str) -> tuple[RedisStore, RedisStore]:
    config = _redis_config(url, namespace, max_pin_ttl_s=5.0, default_pin_ttl_s=5.0)
    a, b = RedisStore(config, SystemClock(), recovering=False), RedisStore(
        config, SystemClock(), recovering=False)
    await a.start()
    await b.start()
    return a, b


async def test_redis_clock_step_forward_ends_no_pin_early(redis_server: Any,
                                                          redis_namespace: str,
                                                          kv: Any) -> None:
    """Redis's clock jumps 30 s ahead (an NTP step, a failover to a host whose clock differs)
    while a superseded lease is pinned: the pin must not end early (the holder would free
    blocks prefill still reads). The replicas see the step against their monotonic clocks,
    one stores the fix, and a replica started after it keeps the fleet's pace too."""
    a, b = await _two_replicas(redis_server.url, redis_namespace)
    c: RedisStore | None = None
    try:
        await a.register_holder(holder(ttl=300.0))
        old = (await a.grant(grant_spec(kv, kv.tokens(8), idle_ttl=60.0))).lease
        read = await a.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        assert read.pin is not None
        await a.grant(grant_spec(kv, kv.tokens(12), idle_ttl=60.0))  # supersedes `old`
        assert await a.heartbeat("h1") == ([], 300.0)  # pinned: not reclaimable
        with capture_logs() as logs:
            await a.step_redis_clock(30.0)
            await b.tick()  # would end the pin (and the holder's TTL is 300 s: not that)
            assert await b.heartbeat("h1") == ([], 300.0)
            await _until(lambda: a.clock_steps + b.clock_steps == 1)
        assert a.clock_steps + b.clock_steps == 1
        steps = [e for e in logs if e["event"] == "redis_clock_step"]
        assert steps and steps[0]["step_s"] == pytest.approx(30.0, abs=0.5)
        c = RedisStore(b.config, SystemClock(), recovering=False)
        await c.start()
        for store in (a, b, c):
            await store.tick()
            assert await store.heartbeat("h1") == ([], 300.0)
        lease = await c.get_lease(old.lease_id)
        assert lease.state is LeaseState.SUPERSEDED
        assert 50.0 < lease.expire_at - c.clock.monotonic() <= 60.0  # not 30 s early
        # The reader's own end (5 s from the read, on its clock) is untouched by the step.
        pin_left = read.pin.expire_at - a.clock.monotonic()
        assert 3.0 < pin_left <= 5.0
        assert await c.release_read(read.pin.pin_id)
        assert await a.heartbeat("h1") == ([old.lease_id], 300.0)
        assert a.clock_steps + b.clock_steps + c.clock_steps == 1
    finally:
        for store in (a, b, c):
            if store is not None:
                await store.close()


async def test_redis_clock_step_back_keeps_idle_ttls(redis_server: Any, redis_namespace: str,
                                                     kv: Any) -> None:
    """Redis's clock jumps 30 s back: a lease still expires after its idle TTL of fleet time,
    not 30 s later (nor does a pin outlive its holder's hard deadline by as much)."""
    a, b = await _two_replicas(redis_server.url, redis_namespace)
    try:
        await a.register_holder(holder(ttl=300.0))
        lease = (await a.grant(grant_spec(kv, kv.tokens(8), idle_ttl=5.0))).lease
        await a.step_redis_clock(-30.0)
        await b.tick()
        await _until(lambda: a.clock_steps + b.clock_steps == 1)
        assert a.clock_steps + b.clock_steps == 1
        got = await a.get_lease(lease.lease_id)
        assert got.state is LeaseState.ACTIVE and got.expire_at - a.clock.monotonic() <= 5.0
        await a.advance_clock(6.0)
        await b.tick()
        assert (await a.get_lease(lease.lease_id)).state is LeaseState.EXPIRED
    finally:
        await a.close()
        await b.close()


async def test_redis_clock_step_below_the_threshold_is_not_one(redis_server: Any,
                                                               redis_namespace: str) -> None:
    """Steps under a second (or calls that merely ran late) store no fix: the fleet's clock is
    Redis's."""
    a, b = await _two_replicas(redis_server.url, redis_namespace)
    try:
        await a.step_redis_clock(0.3)
        for _ in range(5):
            await a.tick()
            await b.tick()
        assert a.clock_steps == b.clock_steps == 0
        assert a._clock_bounds is not None and b._clock_bounds is not None
    finally:
        await a.close()
        await b.close()


async def test_redis_replica_that_learned_a_stepped_clock_follows_the_fix(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """A replica started after a step but before the fix learned the stepped clock; once a
    replica that saw the step stores the fix, the newcomer learns the clock anew instead of
    undoing the fix (which would set the replicas fixing against each other)."""
    a, b = await _two_replicas(redis_server.url, redis_namespace)
    c = RedisStore(b.config, SystemClock(), recovering=False)
    try:
        await a.register_holder(holder(ttl=300.0))
        lease = (await a.grant(grant_spec(kv, kv.tokens(8), idle_ttl=60.0))).lease
        await a.step_redis_clock(30.0)
        await c.start()
        await b.tick()
        await _until(lambda: a.clock_steps + b.clock_steps == 1)
        for _ in range(3):
            for store in (c, a, b):
                await store.tick()
        await _until(lambda: not (a._clock_fixing or b._clock_fixing or c._clock_fixing))
        assert (a.clock_steps, b.clock_steps, c.clock_steps).count(0) == 2
        assert sum((a.clock_steps, b.clock_steps, c.clock_steps)) == 1
        got = await c.get_lease(lease.lease_id)
        assert got.state is LeaseState.ACTIVE
        assert 50.0 < got.expire_at - c.clock.monotonic() <= 60.0
    finally:
        for store in (a, b, c):
            await store.close()


async def test_redis_replicas_record_their_layout_and_an_outdated_one_stops_serving(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """Replicas record the state layout they speak; once a newer replica needs an older one
    gone (a layout it would misread), the older stops serving (UNAVAILABLE: readers recompute,
    clients fail over) and another of its version refuses to start, with a message that says
    to upgrade."""
    from kvbridge.services.registry._redis import LAYOUT, LAYOUT_MIN

    v, n = LAYOUT, LAYOUT + 1  # this version's layout, and a newer one that needs it gone
    config = _redis_config(redis_server.url, redis_namespace)
    old = RedisStore(config, SystemClock(), recovering=False)
    await old.start()
    new = RedisStore(config, SystemClock(), recovering=False)
    try:
        await old.register_holder(holder())
        layout = await old._redis.hgetall(old.prefix + "layout")  # type: ignore[union-attr]
        assert layout == {b"version": str(v).encode(), b"min": str(LAYOUT_MIN).encode()}
        new.layout, new.layout_min = n, n
        await new.start()
        lease = (await new.grant(grant_spec(kv, kv.tokens(8)))).lease
        assert old._outdated == ""  # until its next tick
        with capture_logs() as logs:
            await old.tick()
        assert any(e["event"] == "redis_layout_outdated" for e in logs)
        for call in (old.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8))),
                     old.heartbeat("h1")):
            with pytest.raises(errors.Unavailable, match=rf"needs at least {n}.*upgrade"):
                await call
        read = await new.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        assert read.miss is MissReason.HIT and read.lease is not None
        assert read.lease.lease_id == lease.lease_id
        again = RedisStore(config, SystemClock(), recovering=False)
        with pytest.raises(OSError, match=f"layout needs at least {n}; this replica speaks "
                                          f"layout {v}: upgrade"):
            await again.start()
        layout = await new._redis.hgetall(new.prefix + "layout")  # type: ignore[union-attr]
        assert layout == {b"version": str(n).encode(),  # the refused one changed nothing
                          b"min": str(n).encode()}
    finally:
        await new.close()
        await old.close()


async def test_redis_outdated_replica_reports_not_serving_and_a_lost_layout_is_rewritten(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """Over gRPC: a replica a newer layout left behind turns its health NOT_SERVING (load
    balancers and probes take it out) and answers UNAVAILABLE; and a layout record Redis lost
    is written again by the running replicas' ticks, so an older replica started after the
    loss is still refused."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvbridge.services.registry._redis import LAYOUT

    n = LAYOUT + 1  # a newer layout that needs this version's gone
    old = await _replica(redis_server.url, redis_namespace)
    config = _redis_config(redis_server.url, redis_namespace)
    new = RedisStore(config, SystemClock(), recovering=False)
    new.layout, new.layout_min = n, n
    channel = grpc.aio.insecure_channel(old.address)
    watcher = AsyncRegistryClient(old.address, retries=0)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="")
        assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
        # A watch open on the old replica before the upgrade: it sees events, then ends with
        # UNAVAILABLE once the replica stops serving (rather than go on quietly).
        await old.store.register_holder(holder(ttl=300.0))
        stream = watcher.watch_leases()
        first = asyncio.ensure_future(stream.__anext__())
        await wait_for_watchers(old, 1)  # the stream is open before the grant
        await old.store.grant(grant_spec(kv, kv.tokens(8)))
        assert (await asyncio.wait_for(first, 5)).type == pb.LEASE_EVENT_TYPE_GRANTED
        await new.start()
        deadline = time.monotonic() + 5
        while (await health.Check(check)).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "the outdated replica still reports SERVING"
            await asyncio.sleep(0.02)
        with pytest.raises(errors.Unavailable, match="upgrade"):
            await asyncio.wait_for(stream.__anext__(), 5)
        with pytest.raises(errors.Unavailable, match="upgrade"):  # and no new one opens
            await asyncio.wait_for(watcher.watch_leases().__anext__(), 5)
        async with AsyncRegistryClient(old.address, retries=0) as client:
            with pytest.raises(errors.Unavailable, match="upgrade"):
                await client.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        assert new._redis is not None
        await new._redis.delete(new.prefix + "layout")  # as a Redis that lost its data
        await new.tick()
        assert await new._redis.hgetall(new.prefix + "layout") == {
            b"version": str(n).encode(), b"min": str(n).encode()}
        again = RedisStore(config, SystemClock(), recovering=False)
        with pytest.raises(OSError, match=f"needs at least {n}"):
            await again.start()
    finally:
        await watcher.close()
        await channel.close()
        await new.close()
        await old.stop()


# ---- lookup by content (history keys) -------------------------------------------------------


def hkeys(*names: str) -> list[bytes]:
    """Chained-looking 16-byte keys, one per name, for tests (the registry treats keys as
    opaque)."""
    return [(name * 16).encode()[:16] for name in names]


async def test_lookup_by_content_finds_longest_indexed_key(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    s, u1, a1, u2, x = hkeys("s", "u", "a", "v", "x")
    one = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c1",
                                          history_keys=s + u1))).lease
    two = (await b.store.grant(grant_spec(kv, kv.tokens(12), conversation="c2",
                                          history_keys=s + u1 + a1 + u2))).lease
    # The longest key the request shares with an indexed one wins; its lease is pinned whole.
    read = await b.store.pin_lease("t1", "", history_keys=s + u1 + a1 + u2 + x)
    assert read.miss is MissReason.HIT and read.pin is not None
    assert read.lease is not None and read.lease.lease_id == two.lease_id
    assert (read.keys_matched, read.whole) == (4, True)
    assert read.matched_tokens == 12 or read.lease.token_count == 12
    # u1 is indexed by both: the most recent grant (c2) holds it; it is not c2's last key.
    read = await b.store.pin_lease("t1", "", history_keys=s + u1 + x)
    assert read.lease is not None and read.lease.lease_id == two.lease_id
    assert (read.keys_matched, read.whole) == (2, False)
    # Nothing shared: a miss, nothing pinned.
    read = await b.store.pin_lease("t1", "", history_keys=x)
    assert read.miss is MissReason.NO_LEASE and read.pin is None and read.keys_matched == 0
    assert one.lease_id != two.lease_id


async def test_lookup_is_scoped_to_the_tenant(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    s, u = hkeys("s", "u")
    await b.store.grant(grant_spec(kv, kv.tokens(8), tenant="t1", history_keys=s + u))
    read = await b.store.pin_lease("t2", "", history_keys=s + u)
    assert read.miss is MissReason.NO_LEASE and read.pin is None and read.lease is None


async def test_lookup_forgets_leases_that_stop_being_active(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    s, u1, a1, u2 = hkeys("s", "u", "a", "v")
    one = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c1",
                                          history_keys=s + u1, idle_ttl=10.0))).lease
    # Superseded by the conversation's next turn: found under the new lease only.
    two = (await b.store.grant(grant_spec(kv, kv.tokens(12), conversation="c1",
                                          history_keys=s + u1 + a1 + u2,
                                          idle_ttl=10.0))).lease
    read = await b.store.pin_lease("t1", "", history_keys=s + u1)
    assert read.lease is not None and read.lease.lease_id == two.lease_id
    assert read.pin is not None
    await b.store.release_read(read.pin.pin_id)
    assert one.lease_id != two.lease_id
    # Revoked: gone from the lookup.
    await b.store.revoke(two.lease_id, reason="test")
    read = await b.store.pin_lease("t1", "", history_keys=s + u1 + a1 + u2)
    assert read.miss is MissReason.NO_LEASE and read.pin is None
    # Expired (idle TTL): gone too, even before a tick processed it.
    three = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c3",
                                            history_keys=s + u1, idle_ttl=10.0))).lease
    read = await b.store.pin_lease("t1", "", history_keys=s + u1)
    assert read.lease is not None and read.lease.lease_id == three.lease_id
    assert read.pin is not None
    await b.store.release_read(read.pin.pin_id)
    await b.advance(11.0)
    read = await b.store.pin_lease("t1", "", history_keys=s + u1)
    assert read.miss is MissReason.NO_LEASE and read.pin is None


async def test_lookup_falls_back_to_a_shorter_key_of_a_live_lease(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder(ttl=60.0))
    s, u1, a1, u2 = hkeys("s", "u", "a", "v")
    old = (await b.store.grant(grant_spec(kv, kv.tokens(8), conversation="c1",
                                          history_keys=s + u1, idle_ttl=100.0))).lease
    await b.store.grant(grant_spec(kv, kv.tokens(12), conversation="c2",
                                   history_keys=a1 + u2, idle_ttl=10.0))
    await b.advance(11.0)  # c2 expires; no tick has processed it yet
    read = await b.store.pin_lease("t1", "", history_keys=s + u1 + a1 + u2)
    assert read.lease is not None and read.lease.lease_id == old.lease_id
    assert (read.keys_matched, read.whole) == (2, True) and read.pin is not None


async def test_lookup_restored_lease_is_indexed_again(make_backend: Factory, kv: Any) -> None:
    b = await make_backend(recovering=False)
    await b.store.register_holder(holder())
    s, u = hkeys("s", "u")
    lease = (await b.store.grant(grant_spec(kv, kv.tokens(8), history_keys=s + u))).lease
    fresh = await make_backend(recovering=True)  # another registry that lost its state
    reg = await fresh.store.register_holder(holder(), [
        Snapshot(lease.lease_id, grant_spec(kv, kv.tokens(8), history_keys=s + u), 1, 1.0)])
    assert reg.restored == [lease.lease_id]
    read = await fresh.store.pin_lease("t1", "", history_keys=s + u)
    assert read.lease is not None and read.lease.lease_id == lease.lease_id
    assert (read.keys_matched, read.whole) == (2, True)


async def test_lookup_bad_input_is_refused(b: Backend, kv: Any) -> None:
    await b.store.register_holder(holder())
    s, u = hkeys("s", "u")
    with pytest.raises(errors.InvalidArgument):  # not whole keys
        await b.store.grant(grant_spec(kv, kv.tokens(8), history_keys=s + b"x"))
    with pytest.raises(errors.InvalidArgument):  # too many keys for one lease
        await b.store.grant(grant_spec(kv, kv.tokens(8), history_keys=s * 65))
    with pytest.raises(errors.InvalidArgument):  # a conversation and keys
        await b.store.pin_lease("t1", "c1", history_keys=s)
    with pytest.raises(errors.InvalidArgument):
        await b.store.pin_lease("t1", "", history_keys=s[:5])
    with pytest.raises(errors.InvalidArgument):
        await b.store.pin_lease("t1", "", history_keys=s * 4097)
    with pytest.raises(errors.InvalidArgument):
        await b.store.pin_lease("", "", history_keys=s)
    # Nothing changed: no lease was made, the lookup finds nothing.
    assert await b.store.list_leases(tenant="t1") == []
    read = await b.store.pin_lease("t1", "", history_keys=s + u)
    assert read.miss is MissReason.NO_LEASE
