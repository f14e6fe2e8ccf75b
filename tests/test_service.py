"""The registry end to end: a real server on 127.0.0.1:0, the asyncio client, real gRPC.

Time moves only through the server's FakeClock (`registry_clock.advance` + `table.tick()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvbridge import blockhash
from kvbridge.clients import AsyncRegistryClient, duration, seconds
from kvbridge.errors import HolderNotFound, LeaseNotFound, Recovering
from kvbridge.registry.v1 import registry_pb2 as pb

SERVICE = "kvbridge.registry.v1.RegistryService"
WALL_START = 1_700_000_000.0  # FakeClock's default wall reading at monotonic 1000


@pytest.fixture
def tick(registry_server, registry_clock):
    """`tick(seconds)`: advance the registry's clock and run its expiry."""

    def advance(by: float) -> int:
        registry_clock.advance(by)
        return registry_server.table.tick()

    return advance


async def holder(client: AsyncRegistryClient, kv, holder_id: str = "h1", **kw: Any):
    return (await client.register_holder(**kv.holder_args(holder_id, **kw))).holder


async def grant(client: AsyncRegistryClient, kv, tokens: list[int], holder_id: str = "h1",
                tenant: str = "t1", conversation: str = "c1", **kw: Any) -> pb.Lease:
    resp = await client.grant_lease(**kv.grant_args(holder_id, tenant, conversation, tokens,
                                                    **kw))
    return resp.lease


class Watch:
    """Collects a WatchLeases stream in the background."""

    def __init__(self, client: AsyncRegistryClient, **filters: Any) -> None:
        self.queue: asyncio.Queue[pb.LeaseEvent] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(client, filters))

    async def _run(self, client: AsyncRegistryClient, filters: dict[str, Any]) -> None:
        async for event in client.watch_leases(**filters):
            await self.queue.put(event)

    async def take(self, n: int, timeout: float = 5.0) -> list[tuple[str, str]]:
        """The next n events as (type name without prefix, lease id)."""
        out = []
        for _ in range(n):
            event = await asyncio.wait_for(self.queue.get(), timeout)
            out.append((pb.LeaseEventType.Name(event.type).removeprefix("LEASE_EVENT_TYPE_"),
                        event.lease_id))
        return out

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


# ---- health, reflection ---------------------------------------------------------------------


async def test_registry_on_ipv6_loopback_gives_a_bracketed_address(registry_clock):
    """A registry listening on [::1] reports `[::1]:PORT`, an address clients (and `up`, which
    hands it to engines) accept and reach."""
    from conftest import start_registry

    server = await start_registry(registry_clock, listen="[::1]:0")
    try:
        assert server.address == f"[::1]:{server.port}"
        async with AsyncRegistryClient(server.address) as client:
            assert (await client.get_server_info()).version
    finally:
        await server.stop(0)


async def test_health_reports_serving_for_server_and_service(registry_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{registry_server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_and_describes_the_service(registry_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{registry_server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]
        responses = [r async for r in stub.ServerReflectionInfo(iter(requests))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in responses[1].file_descriptor_response.file_descriptor_proto]
    registry_file = next(f for f in files if f.package == "kvbridge.registry.v1")
    methods = {m.name for s in registry_file.service for m in s.method}
    assert methods == {"RegisterHolder", "HeartbeatHolder", "DeregisterHolder", "ListHolders",
                       "GrantLease", "RenewLeases", "RevokeLease", "GetLease", "ListLeases",
                       "PinLease", "AcquireRead", "ReleaseRead", "GetServerInfo", "WatchLeases"}


# ---- holders --------------------------------------------------------------------------------


async def test_register_holder_returns_holder_and_limits(registry_client, kv):
    resp = await registry_client.register_holder(**kv.holder_args("h1", ttl=6.0, tp_size=2))
    h = resp.holder
    assert (h.holder_id, h.nixl_host, h.nixl_port, h.tp_size, h.block_size) == (
        "h1", "10.0.0.7", 5600, 2, kv.block_size)
    assert h.engine_fingerprint == kv.fingerprint
    assert h.state == pb.HOLDER_STATE_ACTIVE
    assert seconds(h.ttl) == 6.0 and seconds(h.expires_in) == 6.0
    assert (h.lease_count, h.retained_blocks) == (0, 0)
    assert seconds(resp.limits.max_pin_ttl) == 30.0
    assert seconds(resp.limits.heartbeat_interval) == pytest.approx(2.0)
    assert resp.limits.max_blocks_per_lease == 16384
    assert list(resp.restored_lease_ids) == [] and list(resp.reclaimable_lease_ids) == []
    # Default TTL when none is named.
    other = await holder(registry_client, kv, "h2")
    assert seconds(other.ttl) == 10.0


async def test_heartbeat_keeps_holder_alive_and_missing_ttl_loses_it(registry_client, kv, tick):
    await holder(registry_client, kv, "h1", ttl=3.0)
    lease = await grant(registry_client, kv, kv.tokens(8))
    for _ in range(4):  # 4 x 2.5 s > TTL, kept alive by heartbeats
        tick(2.5)
        hb = await registry_client.heartbeat("h1")
        assert seconds(hb.expires_in) == 3.0
        assert list(hb.reclaimable_lease_ids) == []
    [listed] = (await registry_client.list_holders()).holders
    assert seconds(listed.expires_in) == pytest.approx(3.0)
    assert (listed.lease_count, listed.retained_blocks) == (1, 2)

    tick(3.0)  # missed the TTL
    assert list((await registry_client.list_holders()).holders) == []
    assert (await registry_client.get_lease(lease.lease_id)).state == pb.LEASE_STATE_HOLDER_LOST
    with pytest.raises(HolderNotFound):
        await registry_client.heartbeat("h1")
    # Re-registering without the lease: it is reported reclaimable, never active again.
    resp = await registry_client.register_holder(**kv.holder_args("h1", ttl=3.0))
    assert list(resp.reclaimable_lease_ids) == [lease.lease_id]
    assert list(resp.restored_lease_ids) == []
    assert (await registry_client.get_lease(lease.lease_id)).state == pb.LEASE_STATE_HOLDER_LOST


async def test_deregister_revokes_leases_and_reports_pinned(registry_client, kv):
    await holder(registry_client, kv, "h1")
    a = await grant(registry_client, kv, kv.tokens(8), conversation="a")
    b = await grant(registry_client, kv, kv.tokens(8), conversation="b")
    read = await registry_client.acquire_read("t1", "b", kv.prompt_hashes(kv.tokens(8)))
    assert read.pin.pin_id
    resp = await registry_client.deregister_holder("h1")
    assert list(resp.reclaimable_lease_ids) == [a.lease_id]
    assert resp.pinned_lease_count == 1
    [h] = (await registry_client.list_holders()).holders
    assert h.state == pb.HOLDER_STATE_DRAINING and h.lease_count == 0
    for lease in (a, b):
        assert (await registry_client.get_lease(lease.lease_id)).state == pb.LEASE_STATE_REVOKED
    # Once the reader is done, the pinned one is reported too.
    assert await registry_client.release_read(read.pin.pin_id)
    hb = await registry_client.heartbeat("h1", [a.lease_id])
    assert list(hb.reclaimable_lease_ids) == [b.lease_id]
    with pytest.raises(LeaseNotFound):
        await registry_client.get_lease(a.lease_id)


async def test_list_holders_paginates_in_id_order(registry_client, kv):
    ids = [f"holder-{i:02d}" for i in (7, 3, 5, 1, 0, 6, 2, 4)]
    for hid in ids:
        await holder(registry_client, kv, hid)
    seen, token, pages = [], "", 0
    while True:
        page = await registry_client.list_holders(page_size=3, page_token=token)
        assert len(page.holders) <= 3
        seen += [h.holder_id for h in page.holders]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == sorted(ids)
    assert pages == 3
    everything = await registry_client.list_holders()  # default page holds them all
    assert [h.holder_id for h in everything.holders] == sorted(ids)
    assert everything.next_page_token == ""
    exact = await registry_client.list_holders(page_size=8)
    assert len(exact.holders) == 8 and exact.next_page_token == ""


async def test_reregister_with_held_leases_restores_them(registry_client, kv, registry_clock):
    tokens = kv.tokens(10)
    args = kv.grant_args("h1", "t1", "c1", tokens)
    snap = pb.LeaseSnapshot(
        lease_id="l-restored", tenant="t1", conversation_id="c1",
        remote_request_id=args["remote_request_id"], block_ids=args["block_ids"],
        token_count=10, block_hashes=args["block_hashes"], epoch=4, idle_ttl=duration(20),
        max_lifetime=duration(600), age=duration(5))
    resp = await registry_client.register_holder(**kv.holder_args("h1"), held_leases=[snap])
    assert list(resp.restored_lease_ids) == ["l-restored"]
    assert list(resp.reclaimable_lease_ids) == []
    lease = await registry_client.get_lease("l-restored")
    assert lease.state == pb.LEASE_STATE_ACTIVE
    assert (lease.epoch, lease.token_count, lease.remote_request_id) == (
        4, 10, args["remote_request_id"])
    assert list(lease.block_ids) == args["block_ids"]
    assert lease.block_hashes == args["block_hashes"]
    assert seconds(lease.expires_in) == 20.0  # restoring counts as activity
    assert lease.create_time.seconds == int(registry_clock.wall() - 5)
    [h] = (await registry_client.list_holders()).holders
    assert (h.lease_count, h.retained_blocks) == (1, 3)
    # Readable again, and a new grant continues the epoch sequence.
    read = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
    assert read.miss_reason == pb.MISS_REASON_UNSPECIFIED and read.matched_blocks == 2
    await registry_client.release_read(read.pin.pin_id)
    newer = await grant(registry_client, kv, kv.tokens(12))
    assert newer.epoch == 5
    # Re-registering with the same snapshot again: known, not active, so not restored.
    again = await registry_client.register_holder(**kv.holder_args("h1"),
                                                  held_leases=[snap])
    assert list(again.restored_lease_ids) == []
    # ... and a lease it no longer lists is revoked: the holder is the source of truth.
    assert (await registry_client.get_lease(newer.lease_id)).state == pb.LEASE_STATE_REVOKED
    assert sorted(again.reclaimable_lease_ids) == sorted(["l-restored", newer.lease_id])


async def test_reregister_with_known_leases_at_capacity_is_accepted(registry_factory, kv):
    """Leases the registry already knows take no new capacity when a holder re-sends them."""
    server = await registry_factory(max_leases=2)
    async with AsyncRegistryClient(f"127.0.0.1:{server.port}") as client:
        await client.register_holder(**kv.holder_args("h1"))
        held = []
        for conv in ("a", "b"):
            args = kv.grant_args("h1", "t1", conv, kv.tokens(8))
            lease = (await client.grant_lease(**args)).lease
            held.append(pb.LeaseSnapshot(
                lease_id=lease.lease_id, tenant="t1", conversation_id=conv,
                remote_request_id=args["remote_request_id"], block_ids=args["block_ids"],
                token_count=8, block_hashes=args["block_hashes"], epoch=lease.epoch,
                idle_ttl=lease.idle_ttl, max_lifetime=lease.max_lifetime))
        resp = await client.register_holder(**kv.holder_args("h1"), held_leases=held)
        assert sorted(resp.restored_lease_ids) == sorted(x.lease_id for x in held)
        assert len((await client.list_leases()).leases) == 2


async def test_history_keys_past_the_limit_are_clipped_not_refused(registry_factory, kv):
    """A grant (or a re-registered lease) with more history keys than --max-history-keys
    keeps the first and the latest: found by those, the grant and the registration go
    through."""
    server = await registry_factory(max_history_keys=3)
    keys = [bytes([i]) * 16 for i in range(1, 9)]
    async with AsyncRegistryClient(f"127.0.0.1:{server.port}") as client:
        reg = await client.register_holder(**kv.holder_args("h1"))
        assert reg.limits.max_history_keys == 3
        args = kv.grant_args("h1", "t1", "c1", kv.tokens(8))
        lease = (await client.grant_lease(**args, history_keys=b"".join(keys))).lease

        async def found(key: bytes) -> str:
            resp = await client.pin_lease("t1", "", history_keys=key)
            return resp.read.lease.lease_id

        assert await found(keys[0]) == lease.lease_id
        assert await found(keys[-1]) == lease.lease_id
        assert await found(keys[-2]) == lease.lease_id
        assert await found(keys[3]) == ""  # clipped away
        held = pb.LeaseSnapshot(
            lease_id=lease.lease_id, tenant="t1", conversation_id="c1",
            remote_request_id=args["remote_request_id"], block_ids=args["block_ids"],
            token_count=8, block_hashes=args["block_hashes"], epoch=lease.epoch,
            idle_ttl=lease.idle_ttl, max_lifetime=lease.max_lifetime,
            history_keys=b"".join(keys))
        resp = await client.register_holder(**kv.holder_args("h1"), held_leases=[held])
        assert list(resp.restored_lease_ids) == [lease.lease_id]


async def test_restarted_registry_reports_nothing_reclaimable_during_grace(registry_factory,
                                                                           kv):
    from kvbridge.clock import FakeClock

    clock = FakeClock()
    server = await registry_factory(clock, skip_grace=False)
    async with AsyncRegistryClient(f"127.0.0.1:{server.port}") as client:
        await client.register_holder(**kv.holder_args("h1", ttl=60.0))
        lease = await grant(client, kv, kv.tokens(8))
        revoked = await client.revoke_lease(lease.lease_id)
        # No pin on it here, but a fresh registry cannot know about pins granted before it
        # started: neither the revocation, a lookup nor a heartbeat says the holder may free.
        assert revoked.lease.pin_count == 0 and not revoked.reclaimable
        assert not (await client.lease_status(lease.lease_id)).reclaimable
        # A lease it does not know may still be held (its holder not yet re-registered).
        with pytest.raises(Recovering, match="recovering") as err:
            await client.get_lease("l-from-before")
        assert err.value.metadata["lease_id"] == "l-from-before"
        clock.advance(server.config.effective_recovery_grace_s - 1)
        assert list((await client.heartbeat("h1")).reclaimable_lease_ids) == []
        clock.advance(1)
        assert list((await client.heartbeat("h1")).reclaimable_lease_ids) == [lease.lease_id]
        assert (await client.lease_status(lease.lease_id)).reclaimable
        with pytest.raises(LeaseNotFound):
            await client.get_lease("l-from-before")
        second = await grant(client, kv, kv.tokens(8), conversation="c2")
        assert (await client.revoke_lease(second.lease_id)).reclaimable


# ---- leases ---------------------------------------------------------------------------------


async def test_grant_lease_returns_active_lease_without_blocks(registry_client, kv,
                                                               registry_clock):
    await holder(registry_client, kv)
    resp = await registry_client.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(10)))
    lease = resp.lease
    assert lease.lease_id.startswith("l-")
    assert (lease.tenant, lease.conversation_id, lease.holder_id) == ("t1", "c1", "h1")
    assert (lease.epoch, lease.state, lease.token_count) == (1, pb.LEASE_STATE_ACTIVE, 10)
    assert lease.remote_request_id == "req-c1-10"
    assert list(lease.block_ids) == [] and lease.block_hashes == b""
    assert seconds(lease.idle_ttl) == 60.0 and seconds(lease.max_lifetime) == 3600.0
    assert seconds(lease.expires_in) == 60.0
    assert lease.create_time.seconds == int(registry_clock.wall())
    assert lease.expire_time.seconds == int(registry_clock.wall()) + 60
    assert lease.pin_count == 0 and resp.superseded_lease_id == ""
    [h] = (await registry_client.list_holders()).holders
    assert (h.lease_count, h.retained_blocks) == (1, 3)


async def test_lease_idle_ttl_renewal_and_max_lifetime(registry_client, kv, tick):
    await holder(registry_client, kv, ttl=300.0)
    lease = await grant(registry_client, kv, kv.tokens(8), idle_ttl=5.0, max_lifetime=12.0)
    assert seconds(lease.idle_ttl) == 5.0 and seconds(lease.max_lifetime) == 12.0
    tick(4)
    renewed = await registry_client.renew_leases([lease.lease_id])
    assert seconds(renewed.results[0].expires_in) == 5.0
    tick(4)  # t=8: renewal may not pass the maximum lifetime (t=12)
    renewed = await registry_client.renew_leases([lease.lease_id])
    assert seconds(renewed.results[0].expires_in) == 4.0
    tick(3.9)
    assert (await registry_client.get_lease(lease.lease_id)).state == pb.LEASE_STATE_ACTIVE
    assert tick(0.1) == 1
    expired = await registry_client.get_lease(lease.lease_id)
    assert expired.state == pb.LEASE_STATE_EXPIRED
    assert seconds(expired.expires_in) == 0.0
    hb = await registry_client.heartbeat("h1")
    assert list(hb.reclaimable_lease_ids) == [lease.lease_id]


async def test_grant_supersedes_previous_turn(registry_client, kv):
    await holder(registry_client, kv)
    first = await grant(registry_client, kv, kv.tokens(8))
    resp = await registry_client.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(13),
                                                             first_block=200))
    second = resp.lease
    assert resp.superseded_lease_id == first.lease_id
    assert second.lease_id != first.lease_id and second.epoch == 2
    assert (await registry_client.get_lease(first.lease_id)).state == pb.LEASE_STATE_SUPERSEDED
    # Another tenant's conversation of the same name is independent.
    other = await registry_client.grant_lease(**kv.grant_args("h1", "t2", "c1", kv.tokens(4)))
    assert other.lease.epoch == 1 and other.superseded_lease_id == ""
    hb = await registry_client.heartbeat("h1")
    assert list(hb.reclaimable_lease_ids) == [first.lease_id]
    # Reads see the newest turn only.
    read = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(13)))
    assert read.lease.lease_id == second.lease_id
    assert list(read.remote_block_ids) == [200, 201, 202]


async def test_grant_retry_with_same_request_id_returns_same_lease(registry_client, kv):
    await holder(registry_client, kv)
    args = kv.grant_args("h1", "t1", "c1", kv.tokens(8), request_id="grant-42")
    first = await registry_client.grant_lease(**args)
    retry = await registry_client.grant_lease(**args)
    assert retry.lease.lease_id == first.lease.lease_id
    assert retry.lease.epoch == 1 and retry.superseded_lease_id == ""
    listed = await registry_client.list_leases(include_inactive=True)
    assert [x.lease_id for x in listed.leases] == [first.lease.lease_id]
    # Without a request id, two grants are two turns.
    a = await registry_client.grant_lease(**kv.grant_args("h1", "t1", "c2", kv.tokens(8)))
    b = await registry_client.grant_lease(**kv.grant_args("h1", "t1", "c2", kv.tokens(8)))
    assert a.lease.lease_id != b.lease.lease_id and b.superseded_lease_id == a.lease.lease_id


async def test_renew_leases_batch_reports_each_item_in_order(registry_client, kv, tick):
    await holder(registry_client, kv, ttl=300.0)
    a = await grant(registry_client, kv, kv.tokens(8), conversation="a")
    b = await grant(registry_client, kv, kv.tokens(8), conversation="b")
    c = await grant(registry_client, kv, kv.tokens(8), conversation="c")
    idle = await grant(registry_client, kv, kv.tokens(8), conversation="idle")
    await registry_client.revoke_lease(b.lease_id)
    tick(50)
    resp = await registry_client.renew_leases(
        [a.lease_id, b.lease_id, "l-missing"], [("t1", "c"), ("t1", "nope"), ("t9", "a")])
    got = [(r.lease_id, r.renewed, r.state, seconds(r.expires_in)) for r in resp.results]
    assert got == [
        (a.lease_id, True, pb.LEASE_STATE_ACTIVE, 60.0),
        (b.lease_id, False, pb.LEASE_STATE_REVOKED, 0.0),
        ("l-missing", False, pb.LEASE_STATE_UNSPECIFIED, 0.0),
        (c.lease_id, True, pb.LEASE_STATE_ACTIVE, 60.0),
        ("", False, pb.LEASE_STATE_UNSPECIFIED, 0.0),
        ("", False, pb.LEASE_STATE_UNSPECIFIED, 0.0),
    ]
    assert resp.renewed_count == 2
    assert tick(10) == 1  # only the lease nobody renewed expires
    states = {x.lease_id: x.state for x in
              (await registry_client.list_leases(include_inactive=True)).leases}
    assert states == {a.lease_id: pb.LEASE_STATE_ACTIVE, b.lease_id: pb.LEASE_STATE_REVOKED,
                      c.lease_id: pb.LEASE_STATE_ACTIVE, idle.lease_id: pb.LEASE_STATE_EXPIRED}
    empty = await registry_client.renew_leases()
    assert list(empty.results) == [] and empty.renewed_count == 0


async def test_revoke_lease_reclaimable_only_without_live_pin(registry_client, kv):
    await holder(registry_client, kv)
    a = await grant(registry_client, kv, kv.tokens(8), conversation="a")
    b = await grant(registry_client, kv, kv.tokens(8), conversation="b")
    resp = await registry_client.revoke_lease(a.lease_id, reason="memory_pressure",
                                              holder_id="h1")
    assert resp.lease.state == pb.LEASE_STATE_REVOKED and resp.reclaimable
    again = await registry_client.revoke_lease(a.lease_id)  # idempotent
    assert again.lease.state == pb.LEASE_STATE_REVOKED and again.reclaimable

    read = await registry_client.acquire_read("t1", "b", kv.prompt_hashes(kv.tokens(8)))
    pinned = await registry_client.revoke_lease(b.lease_id)
    assert pinned.lease.state == pb.LEASE_STATE_REVOKED
    assert not pinned.reclaimable and pinned.lease.pin_count == 1
    assert list((await registry_client.heartbeat("h1")).reclaimable_lease_ids) == [a.lease_id]
    assert await registry_client.release_read(read.pin.pin_id)
    hb = await registry_client.heartbeat("h1", [a.lease_id])
    assert list(hb.reclaimable_lease_ids) == [b.lease_id]


async def test_get_lease_includes_block_ids_and_hashes(registry_client, kv):
    await holder(registry_client, kv)
    args = kv.grant_args("h1", "t1", "c1", kv.tokens(10), first_block=7)
    granted = (await registry_client.grant_lease(**args)).lease
    lease = await registry_client.get_lease(granted.lease_id)
    assert list(lease.block_ids) == [7, 8, 9]
    assert lease.block_hashes == args["block_hashes"]
    assert len(lease.block_hashes) == 3 * blockhash.HASH_SIZE
    granted.block_ids.extend([7, 8, 9])
    granted.block_hashes = args["block_hashes"]
    assert lease == granted


async def test_list_leases_filters(registry_client, kv):
    for h in ("h1", "h2"):
        await holder(registry_client, kv, h)
    made = {}
    for h, tenant, conv in [("h1", "t1", "a"), ("h1", "t1", "b"), ("h2", "t1", "c"),
                            ("h2", "t2", "a"), ("h1", "t2", "d")]:
        made[(tenant, conv)] = await grant(registry_client, kv, kv.tokens(8), holder_id=h,
                                           tenant=tenant, conversation=conv)
    superseded = made[("t1", "a")]
    made[("t1", "a")] = await grant(registry_client, kv, kv.tokens(12), tenant="t1",
                                    conversation="a")

    async def ids(**filters):
        resp = await registry_client.list_leases(**filters)
        assert resp.next_page_token == ""
        return [x.lease_id for x in resp.leases]

    def expect(*keys):
        return sorted(made[k].lease_id for k in keys)

    assert await ids() == expect(*made)
    assert await ids(tenant="t1") == expect(("t1", "a"), ("t1", "b"), ("t1", "c"))
    assert await ids(tenant="t2") == expect(("t2", "a"), ("t2", "d"))
    assert await ids(tenant="t1", conversation_id="a") == expect(("t1", "a"))
    assert await ids(tenant="t1", conversation_id="a", include_inactive=True) == sorted(
        [made[("t1", "a")].lease_id, superseded.lease_id])
    assert await ids(holder_id="h2") == expect(("t1", "c"), ("t2", "a"))
    assert await ids(holder_id="h1", tenant="t2") == expect(("t2", "d"))
    assert await ids(holder_id="h1", include_inactive=True) == sorted(
        [*expect(("t1", "a"), ("t1", "b"), ("t2", "d")), superseded.lease_id])
    assert await ids(tenant="t3") == []
    assert await ids(holder_id="nobody") == []
    # Blocks only when asked.
    plain = await registry_client.list_leases(tenant="t1", conversation_id="b")
    assert list(plain.leases[0].block_ids) == [] and plain.leases[0].block_hashes == b""
    full = await registry_client.list_leases(tenant="t1", conversation_id="b",
                                             include_blocks=True)
    assert list(full.leases[0].block_ids) == [100, 101]
    assert full.leases[0].block_hashes == kv.lease_hashes(kv.tokens(8))


async def test_list_leases_pagination_returns_each_lease_once(registry_client, kv,
                                                               registry_clock):
    await holder(registry_client, kv, "h1")
    await holder(registry_client, kv, "h2")
    granted = []
    for i in range(23):
        lease = await grant(registry_client, kv, kv.tokens(4), holder_id=f"h{i % 2 + 1}",
                            tenant="t1" if i % 3 else "t2", conversation=f"conv-{i}")
        granted.append(lease)
    revoked = granted[5].lease_id
    await registry_client.revoke_lease(revoked)

    async def all_pages(**filters):
        seen, token, pages = [], "", 0
        while True:
            registry_clock.advance(0.1)  # the caller's listing rate (10 a second) refills
            page = await registry_client.list_leases(page_size=4, page_token=token, **filters)
            assert 0 < len(page.leases) <= 4 or (pages == 0 and not page.leases)
            seen += [x.lease_id for x in page.leases]
            pages += 1
            token = page.next_page_token
            if not token:
                return seen, pages

    everything = sorted(x.lease_id for x in granted)
    seen, pages = await all_pages(include_inactive=True)
    assert seen == everything and pages == 6
    seen, pages = await all_pages()
    assert seen == [x for x in everything if x != revoked] and pages == 6
    t1 = sorted(x.lease_id for x, i in zip(granted, range(23), strict=True) if i % 3)
    seen, _ = await all_pages(tenant="t1", include_inactive=True)
    assert seen == t1
    h2 = sorted(x.lease_id for x in granted if x.holder_id == "h2")
    seen, _ = await all_pages(holder_id="h2", include_inactive=True)
    assert seen == h2
    # A page size that divides the count exactly ends without an empty page.
    seen, pages = await all_pages(tenant="t2", include_inactive=True)
    assert len(seen) == 8 and pages == 2


# ---- reads ----------------------------------------------------------------------------------


async def test_acquire_read_hit_pins_matching_blocks_and_partial(registry_client, kv, tick):
    await holder(registry_client, kv, nixl_host="decode-3", nixl_port=7777, tp_size=2,
                 ttl=300.0)
    tokens = kv.tokens(10)  # 2 full blocks + a partial block of 2 tokens
    lease = await grant(registry_client, kv, tokens, first_block=40)
    prompt = tokens + kv.tokens(9, start=500)  # the next turn extends the conversation
    tick(50)
    read = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(prompt),
                                              min_tokens=8, reader_id="prefill-1")
    assert read.miss_reason == pb.MISS_REASON_UNSPECIFIED
    assert (read.matched_blocks, read.matched_tokens) == (2, 8)
    assert list(read.remote_block_ids) == [40, 41]
    assert (read.partial_block_id, read.partial_block_tokens) == (42, 2)
    assert read.partial_block_hash == blockhash.partial_block_hash(
        prompt, 10, kv.block_size, kv.fingerprint)
    assert read.mismatch_block == 2
    assert (read.holder.holder_id, read.holder.nixl_host, read.holder.nixl_port) == (
        "h1", "decode-3", 7777)
    assert (read.holder.tp_size, read.holder.block_size) == (2, kv.block_size)
    assert read.holder.engine_fingerprint == kv.fingerprint
    assert read.lease.lease_id == lease.lease_id and read.lease.pin_count == 1
    assert read.lease.block_hashes == b""
    assert read.pin.pin_id.startswith("p-")
    assert seconds(read.pin.expires_in) == 10.0  # the default pin TTL
    # A read is activity: the lease's idle TTL restarted.
    current = await registry_client.get_lease(lease.lease_id)
    assert seconds(current.expires_in) == 60.0 and current.pin_count == 1
    # The pin ends on its own when not released.
    tick(10)
    assert (await registry_client.get_lease(lease.lease_id)).pin_count == 0
    assert not await registry_client.release_read(read.pin.pin_id)


async def test_acquire_read_partial_match_and_pin_ttl(registry_client, kv):
    await holder(registry_client, kv)
    tokens = kv.tokens(16)
    await grant(registry_client, kv, tokens)
    edited = tokens[:9] + [9999] + tokens[10:]  # the client edited history in block 2
    read = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(edited),
                                              pin_ttl=3.0)
    assert read.miss_reason == pb.MISS_REASON_UNSPECIFIED
    assert (read.matched_blocks, read.matched_tokens, read.mismatch_block) == (2, 8, 2)
    assert list(read.remote_block_ids) == [100, 101]
    assert (read.partial_block_id, read.partial_block_tokens, read.partial_block_hash) == (
        0, 0, b"")
    assert seconds(read.pin.expires_in) == 3.0
    capped = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(tokens),
                                                pin_ttl=3600.0)
    assert seconds(capped.pin.expires_in) == 30.0  # at most max_pin_ttl
    assert capped.matched_blocks == 4 and capped.partial_block_id == 0  # exact multiple
    # A retried acquire with the same request id returns the same pin.
    one = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(tokens),
                                             reader_id="p1", request_id="read-1")
    two = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(tokens),
                                             reader_id="p1", request_id="read-1")
    assert one.pin.pin_id == two.pin.pin_id
    assert two.lease.pin_count == 3


async def test_acquire_read_misses_say_why(registry_client, kv, tick):
    def miss(read):
        return pb.MissReason.Name(read.miss_reason).removeprefix("MISS_REASON_")

    await holder(registry_client, kv, "h1", ttl=300.0)
    await holder(registry_client, kv, "h2", ttl=3.0)
    tokens = kv.tokens(12)
    hashes = kv.prompt_hashes(tokens)
    read = await registry_client.acquire_read("t1", "none", hashes)
    assert miss(read) == "NO_LEASE" and not read.HasField("lease")

    await grant(registry_client, kv, tokens, conversation="c")
    other = kv.prompt_hashes(kv.tokens(12, start=1))
    read = await registry_client.acquire_read("t1", "c", other)
    assert (miss(read), read.mismatch_block, read.matched_blocks) == ("HASH_MISMATCH", 0, 0)
    assert not read.HasField("pin") and list(read.remote_block_ids) == []

    read = await registry_client.acquire_read("t1", "c", hashes, min_tokens=13)
    assert (miss(read), read.mismatch_block) == ("BELOW_MINIMUM", 3)
    assert not read.HasField("pin")
    partial_prompt = kv.prompt_hashes(tokens[:4] + [7, 7, 7, 7])
    read = await registry_client.acquire_read("t1", "c", partial_prompt, min_tokens=5)
    assert (miss(read), read.mismatch_block) == ("BELOW_MINIMUM", 1)
    read = await registry_client.acquire_read("t1", "c", b"")  # nothing to compare
    assert miss(read) == "BELOW_MINIMUM"
    assert (await registry_client.acquire_read("t1", "c", hashes, min_tokens=12)).pin.pin_id

    revoked = await grant(registry_client, kv, tokens, conversation="r")
    await registry_client.revoke_lease(revoked.lease_id)
    read = await registry_client.acquire_read("t1", "r", hashes)
    assert miss(read) == "REVOKED" and read.lease.lease_id == revoked.lease_id

    await grant(registry_client, kv, tokens, conversation="e", idle_ttl=5.0)
    await grant(registry_client, kv, tokens, holder_id="h2", conversation="g")
    await registry_client.heartbeat("h2")
    tick(5)
    read = await registry_client.acquire_read("t1", "e", hashes)
    assert miss(read) == "EXPIRED" and read.lease.state == pb.LEASE_STATE_EXPIRED
    read = await registry_client.acquire_read("t1", "g", hashes)
    assert miss(read) == "HOLDER_GONE" and read.lease.state == pb.LEASE_STATE_HOLDER_LOST
    # Misses pin nothing: only the one hit above holds a pin.
    assert registry_client_pins(await registry_client.list_leases(include_inactive=True)) == 1


def registry_client_pins(resp: pb.ListLeasesResponse) -> int:
    return sum(x.pin_count for x in resp.leases)


async def test_release_read_is_idempotent(registry_client, kv):
    await holder(registry_client, kv)
    lease = await grant(registry_client, kv, kv.tokens(8))
    read = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
    assert await registry_client.release_read(read.pin.pin_id) is True
    assert await registry_client.release_read(read.pin.pin_id) is False
    assert await registry_client.release_read("p-never-granted") is False
    assert (await registry_client.get_lease(lease.lease_id)).pin_count == 0


# ---- watch ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_watch_streams_lifecycle_events_in_order(registry_server, registry_client, kv,
                                                       tick, watchers):
    await holder(registry_client, kv, ttl=300.0)
    watch = Watch(registry_client)
    try:
        await watchers(registry_server, 1)
        first = await grant(registry_client, kv, kv.tokens(8))
        await registry_client.renew_leases([first.lease_id])  # no RENEWED without asking
        second = await grant(registry_client, kv, kv.tokens(12))
        read = await registry_client.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(12)))
        await registry_client.revoke_lease(second.lease_id)
        await registry_client.release_read(read.pin.pin_id)
        await registry_client.heartbeat("h1", [first.lease_id])
        short = await grant(registry_client, kv, kv.tokens(4), conversation="c2", idle_ttl=2.0)
        tick(3)
        assert await watch.take(9) == [
            ("GRANTED", first.lease_id),
            ("SUPERSEDED", first.lease_id), ("RECLAIMABLE", first.lease_id),
            ("GRANTED", second.lease_id),
            ("REVOKED", second.lease_id), ("RECLAIMABLE", second.lease_id),
            ("RECLAIMED", first.lease_id),
            ("GRANTED", short.lease_id),
            ("EXPIRED", short.lease_id),
        ]
        assert await watch.take(1) == [("RECLAIMABLE", short.lease_id)]
    finally:
        await watch.close()


@pytest.mark.timeout(60)
async def test_watch_event_fields(registry_server, registry_client, kv, tick, watchers,
                                  registry_clock):
    await holder(registry_client, kv, ttl=300.0)
    watch = Watch(registry_client)
    try:
        await watchers(registry_server, 1)
        await grant(registry_client, kv, kv.tokens(4), tenant="acme", conversation="chat-9",
                    idle_ttl=2.0)
        granted = await asyncio.wait_for(watch.queue.get(), 5)
        assert (granted.tenant, granted.conversation_id, granted.holder_id, granted.epoch) == (
            "acme", "chat-9", "h1", 1)
        assert granted.event_time.seconds == int(registry_clock.wall())
        registry_clock.advance(2.5)  # noticed 0.5 s late
        registry_server.table.tick()
        expired = await asyncio.wait_for(watch.queue.get(), 5)
        assert expired.type == pb.LEASE_EVENT_TYPE_EXPIRED
        assert seconds(expired.lateness) == pytest.approx(0.5)
    finally:
        await watch.close()


@pytest.mark.timeout(60)
async def test_watch_filters_by_holder_and_tenant_and_renewals(registry_server, registry_client,
                                                               kv, watchers):
    await holder(registry_client, kv, "h1")
    await holder(registry_client, kv, "h2")
    by_holder = Watch(registry_client, holder_id="h2")
    by_tenant = Watch(registry_client, tenant="t2")
    renewals = Watch(registry_client, tenant="t1", include_renewals=True)
    try:
        await watchers(registry_server, 3)
        a = await grant(registry_client, kv, kv.tokens(4), holder_id="h1", tenant="t1")
        b = await grant(registry_client, kv, kv.tokens(4), holder_id="h2", tenant="t1",
                        conversation="c2")
        c = await grant(registry_client, kv, kv.tokens(4), holder_id="h1", tenant="t2")
        await registry_client.renew_leases([a.lease_id, c.lease_id])
        d = await grant(registry_client, kv, kv.tokens(4), holder_id="h2", tenant="t2")
        await registry_client.renew_leases(conversations=[("t1", "c2")])
        for lease in (a, b, d):
            await registry_client.revoke_lease(lease.lease_id)
        # Each filtered stream skips the others' events (and RENEWED unless asked), so its
        # last events are its own revokes.
        assert await by_holder.take(6) == [
            ("GRANTED", b.lease_id), ("GRANTED", d.lease_id),
            ("REVOKED", b.lease_id), ("RECLAIMABLE", b.lease_id),
            ("REVOKED", d.lease_id), ("RECLAIMABLE", d.lease_id)]
        assert await by_tenant.take(6) == [
            ("GRANTED", c.lease_id), ("SUPERSEDED", c.lease_id),
            ("RECLAIMABLE", c.lease_id), ("GRANTED", d.lease_id),
            ("REVOKED", d.lease_id), ("RECLAIMABLE", d.lease_id)]
        assert await renewals.take(8) == [
            ("GRANTED", a.lease_id), ("GRANTED", b.lease_id), ("RENEWED", a.lease_id),
            ("RENEWED", b.lease_id), ("REVOKED", a.lease_id), ("RECLAIMABLE", a.lease_id),
            ("REVOKED", b.lease_id), ("RECLAIMABLE", b.lease_id)]
    finally:
        for w in (by_holder, by_tenant, renewals):
            await w.close()


# ---- metrics --------------------------------------------------------------------------------


async def test_metrics_endpoint_reports_state_and_outcomes(registry_factory, kv):
    server = await registry_factory(metrics_listen="127.0.0.1:0")
    assert server.metrics_port
    async with AsyncRegistryClient(f"127.0.0.1:{server.port}") as client:
        await client.register_holder(**kv.holder_args("h1"))
        await client.register_holder(**kv.holder_args("h2"))
        tokens = kv.tokens(8)
        a = await grant(client, kv, tokens, conversation="a")
        await grant(client, kv, tokens, conversation="b")
        await grant(client, kv, tokens, conversation="b")  # supersedes
        await client.revoke_lease(a.lease_id)
        for conv in ("b", "b", "a", "nope"):
            await client.acquire_read("t1", conv, kv.prompt_hashes(tokens))
        await client.acquire_read("t1", "b", kv.prompt_hashes(kv.tokens(8, start=3)))
        await client.renew_leases(conversations=[("t1", "b"), ("t1", "a")])
        with pytest.raises(LeaseNotFound):
            await client.get_lease("l-nope")

    def scrape() -> str:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200
            return resp.read().decode()

    text = await asyncio.to_thread(scrape)
    assert 'kvbridge_registry_reads_total{outcome="hit"} 2.0' in text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("kvbridge_registry_leases", state="active") == 1
    assert value("kvbridge_registry_leases", state="awaiting_reclaim") == 2
    assert value("kvbridge_registry_holders") == 2
    assert value("kvbridge_registry_pins") == 2
    assert value("kvbridge_registry_reads_total", outcome="hit") == 2
    assert value("kvbridge_registry_reads_total", outcome="revoked") == 1
    assert value("kvbridge_registry_reads_total", outcome="no_lease") == 1
    assert value("kvbridge_registry_reads_total", outcome="hash_mismatch") == 1
    assert value("kvbridge_registry_reads_total", outcome="expired") == 0
    assert value("kvbridge_registry_renewals_total") == 1
    assert value("kvbridge_registry_lease_events_total", type="granted") == 3
    assert value("kvbridge_registry_lease_events_total", type="superseded") == 1
    assert value("kvbridge_registry_lease_events_total", type="revoked") == 1
    assert value("kvbridge_registry_lease_events_total", type="reclaimable") == 2
    assert value("kvbridge_registry_rpc_errors_total", method="GetLease",
                 code="LEASE_NOT_FOUND") == 1
    assert value("kvbridge_registry_rpc_duration_seconds_count", method="AcquireRead") == 5
    assert value("kvbridge_registry_rpc_duration_seconds_count", method="GrantLease") == 3


async def test_server_info_and_holder_software_version(registry_client: AsyncRegistryClient,
                                                       registry_stub, kv) -> None:
    """GetServerInfo (what `kvbridge doctor` compares) and the version a holder registers."""
    import time

    from kvbridge import __version__
    from kvbridge._grpc_status import error_info

    info = await registry_client.get_server_info()
    assert info.version == __version__
    assert abs(info.current_time.seconds - time.time()) < 5
    registered = await holder(registry_client, kv, "h-v", software_version="kvbridge/9 vllm/0.32")
    assert registered.software_version == "kvbridge/9 vllm/0.32"
    listed = (await registry_client.list_holders()).holders
    assert [h.software_version for h in listed if h.holder_id == "h-v"] == [
        "kvbridge/9 vllm/0.32"]
    with pytest.raises(grpc.RpcError) as raised:
        await registry_stub.RegisterHolder(pb.RegisterHolderRequest(
            **kv.holder_args("h-bad"), software_version="x" * 200))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(raised.value).metadata["field"] == "software_version"
    assert "h-bad" not in [h.holder_id for h in (await registry_client.list_holders()).holders]
