"""The registry's state sharded by tenant over a real 3-primary Redis Cluster (issue 38, item
3): tenants spread over the primaries, holder calls fan out to every shard, a shard that
loses its data asks the holder to register again and holds only its own reclaims, ids without
a shard tag are found, listings page across shards, the shard count is one per namespace, and
a gRPC registry serves from the cluster. The store contract suite also runs over the cluster
(`test_store_contract.py`, backend `redis-cluster`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from conftest import RedisCluster
from test_store_contract import grant_spec, holder

from kvbridge import errors
from kvbridge.clients import AsyncRegistryClient
from kvbridge.clock import SystemClock
from kvbridge.services.registry import RegistryConfig, create_server
from kvbridge.services.registry._core import Snapshot
from kvbridge.services.registry._model import LeaseState, MissReason
from kvbridge.services.registry._redis import RedisStore
from kvbridge.services.registry._redis_shards import ShardedStore, shard_namespaces, shard_of

SHARDS = 3

Make = Callable[..., Awaitable[ShardedStore]]


@pytest.fixture
async def make_store(redis_cluster: Any, redis_namespace: str) -> AsyncIterator[Make]:
    """`await make_store(**config)`: a started ShardedStore of 3 shards on the cluster, on
    the test's namespace, its fleet clock past the recovery grace unless `recovering`."""
    stores: list[Any] = []

    async def make(*, recovering: bool = False, shards: int = SHARDS,
                   namespace: str = redis_namespace, **overrides: Any) -> Any:
        config = RegistryConfig(backend="redis", redis_url=redis_cluster.url,
                                redis_namespace=namespace, redis_shards=shards, **overrides)
        store: Any = (ShardedStore(config, SystemClock(), recovering=recovering)
                      if shards > 1 else RedisStore(config, SystemClock()))
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


async def advance(store: ShardedStore, seconds: float) -> None:
    """Move every shard's fleet clock forward (instead of sleeping through a grace)."""
    for shard in store.shards:
        await shard.advance_clock(seconds)


def tenants_by_shard(per_shard: int) -> list[list[str]]:
    """`per_shard` tenant names for each shard."""
    out: list[list[str]] = [[] for _ in range(SHARDS)]
    i = 0
    while min(len(x) for x in out) < per_shard:
        tenant = f"tenant-{i}"
        if len(out[shard_of(tenant, SHARDS)]) < per_shard:
            out[shard_of(tenant, SHARDS)].append(tenant)
        i += 1
    return out


async def primaries(cluster: Any) -> dict[int, tuple[int, int, int]]:
    """port -> (first slot, last slot, keys) of each primary."""
    out = {}
    for node in cluster.nodes:
        client = aioredis.Redis(port=node.port)
        try:
            slots = await client.execute_command("CLUSTER", "SLOTS")
            mine = [s for s in slots if int(s[2][1]) == node.port]
            assert len(mine) == 1  # redis-cli --cluster create: one range each
            out[node.port] = (int(mine[0][0]), int(mine[0][1]), int(await client.dbsize()))
        finally:
            await client.aclose()
    return out


async def test_ten_thousand_tenants_spread_evenly_over_the_primaries(
        make_store: Make, redis_cluster: Any, redis_namespace: str, kv: Any) -> None:
    """One lease for each of 10,000 tenants: each primary serves one shard, and holds its
    share of the namespace's keys within 20% of the mean."""
    from redis.crc import key_slot

    store = await make_store()
    names = shard_namespaces(redis_namespace, SHARDS)
    ranges = await primaries(redis_cluster)
    owner = {}
    for k, name in enumerate(names):
        slot = key_slot(f"{{{name}}}".encode())
        owner[k] = next(port for port, (lo, hi, _) in ranges.items() if lo <= slot <= hi)
    assert sorted(owner.values()) == sorted(ranges)  # a shard on each primary
    before = {port: keys for port, (_, _, keys) in ranges.items()}
    await store.register_holder(holder(ttl=300.0))
    tokens = kv.tokens(4)
    specs = [grant_spec(kv, tokens, tenant=f"spread-{i}", conversation="c") for i in range(10_000)]
    for start in range(0, len(specs), 500):
        await asyncio.gather(*(store.grant(g) for g in specs[start:start + 500]))
    after = await primaries(redis_cluster)
    added = {port: after[port][2] - before[port] for port in after}
    mean = sum(added.values()) / len(added)
    print(f"keys added per primary: {added} (mean {mean:.0f})")
    assert all(abs(n - mean) <= 0.2 * mean for n in added.values()), added
    counts = [len(await s.list_leases(limit=10_000)) for s in store.shards]
    assert sum(counts) == 10_000 and min(counts) > 0
    await store.tick()  # (counts are as of the last tick)
    assert store.counts()["leases_active"] == 10_000 and store.counts()["holders"] == 1


async def test_a_holder_lives_in_every_shard(make_store: Make, kv: Any) -> None:
    """Registration, heartbeat and deregistration fan out: a re-registration that drops
    leases of several shards revokes them in each, and every shard's reclaimable ids come
    back together until acked."""
    store = await make_store()
    await store.register_holder(holder(ttl=300.0))
    groups = tenants_by_shard(2)
    leases = {}
    for k, group in enumerate(groups):
        for j, tenant in enumerate(group):
            g = await store.grant(grant_spec(kv, kv.tokens(8), tenant=tenant,
                                             first_block=100 + 10 * (2 * k + j)))
            leases[tenant] = g.lease
            assert g.lease.lease_id.endswith(f".s{k}")
    mine = await store.get_holder("h1")  # every shard's leases counted
    assert mine.lease_count == 2 * SHARDS and mine.retained_blocks == 2 * 2 * SHARDS
    assert [h.lease_count for h in await store.holders()] == [2 * SHARDS]
    kept = [leases[group[0]].lease_id for group in groups]
    dropped = sorted(leases[group[1]].lease_id for group in groups)
    reg = await store.register_holder(holder(ttl=300.0), held_ids=kept)
    assert sorted(reg.reclaimable) == dropped
    for lease_id in dropped:
        assert (await store.get_lease(lease_id)).state is LeaseState.REVOKED
    reclaimable, ttl = await store.heartbeat("h1")
    assert sorted(reclaimable) == dropped and ttl == 300.0
    reclaimable, _ = await store.heartbeat("h1", dropped)
    assert reclaimable == []
    for lease_id in kept:  # each shard's kept lease still reads
        tenant = next(t for t, x in leases.items() if x.lease_id == lease_id)
        read = await store.acquire_read(tenant, "c1", kv.prompt_hashes(kv.tokens(8)))
        assert read.miss is MissReason.HIT and read.pin is not None
        assert read.pin.pin_id.endswith(lease_id[-3:])  # the pin is its lease's shard's
    unreleased, pinned = await store.deregister_holder("h1")
    assert pinned == SHARDS and unreleased == []
    with pytest.raises(errors.HolderDraining):
        await store.grant(grant_spec(kv, kv.tokens(8), tenant=groups[2][0],
                                     conversation="c9"))


async def test_a_shard_that_lost_its_data_holds_only_its_own_reclaims(
        make_store: Make, redis_cluster: Any, redis_namespace: str, kv: Any) -> None:
    """One primary loses the shard's keys (a restart without persistence): the holder's
    heartbeat is answered HOLDER_NOT_FOUND, reads in the other shards go on hitting, the
    holder registers again with what it holds, and only the lost shard holds reclaims for the
    recovery grace (a pin of its may have been lost with the data)."""
    store = await make_store(recovering=True, max_pin_ttl_s=1.0, default_pin_ttl_s=1.0,
                             recovery_grace_s=1.5)
    await store.register_holder(holder(ttl=300.0))
    await advance(store, 1.6)  # past the fresh state's grace
    groups = tenants_by_shard(2)
    grants, specs = {}, {}
    for k, group in enumerate(groups):
        for j, tenant in enumerate(group):
            specs[tenant] = grant_spec(kv, kv.tokens(8), tenant=tenant,
                                       first_block=100 + 10 * (2 * k + j))
            grants[tenant] = await store.grant(specs[tenant])
    lost = 1
    name = shard_namespaces(redis_namespace, SHARDS)[lost]
    from redis.crc import key_slot

    slot = key_slot(f"{{{name}}}".encode())
    ranges = await primaries(redis_cluster)
    port = next(p for p, (lo, hi, _) in ranges.items() if lo <= slot <= hi)
    node = aioredis.Redis(port=port)
    try:
        keys = await node.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000)
        assert keys
        await node.delete(*keys)
    finally:
        await node.aclose()
    with pytest.raises(errors.HolderNotFound):
        await store.heartbeat("h1")
    for k, group in enumerate(groups):
        read = await store.acquire_read(group[0], "c1", kv.prompt_hashes(kv.tokens(8)))
        assert (read.miss is MissReason.HIT) is (k != lost), (k, read.miss)
        if read.pin is not None:
            await store.release_read(read.pin.pin_id)
    snaps = [Snapshot(g.lease.lease_id, specs[t], g.lease.epoch, 0.0)
             for t, g in grants.items()]
    reg = await store.register_holder(holder(ttl=300.0), snaps,
                                      held_ids=[s.lease_id for s in snaps])
    # (restored: every held lease active now, the lost shard's put back)
    assert sorted(reg.restored) == sorted(g.lease.lease_id for g in grants.values())
    read = await store.acquire_read(groups[lost][0], "c1", kv.prompt_hashes(kv.tokens(8)))
    assert read.miss is MissReason.HIT
    assert read.pin is not None
    await store.release_read(read.pin.pin_id)
    # A revoke in a healthy shard is reclaimable at once; in the lost one, after the grace.
    healthy = grants[groups[0][1]].lease.lease_id
    held = grants[groups[lost][1]].lease.lease_id
    await store.revoke(healthy)
    await store.revoke(held)
    assert (await store.heartbeat("h1"))[0] == [healthy]
    assert await store.reclaim_hold() > 0 and await store.reclaim_hold(held) > 0
    assert await store.reclaim_hold(healthy) == 0  # (GetLease says reclaimable: it is)
    await advance(store, 1.6)  # past the lost shard's grace
    reclaimable, _ = await store.heartbeat("h1")
    assert sorted(reclaimable) == sorted([healthy, held])


async def test_leases_without_a_shard_tag_are_found_in_any_shard(make_store: Make,
                                                                  kv: Any) -> None:
    """A holder restores leases whose ids carry no shard tag (made before sharding): they go
    to their tenant's shard, and calls by id find them there."""
    store = await make_store()
    tenants = [group[0] for group in tenants_by_shard(1)]
    snaps = [Snapshot(f"l-legacy-{k}", grant_spec(kv, kv.tokens(8), tenant=t,
                                                  first_block=100 + 10 * k), 3, 1.0)
             for k, t in enumerate(tenants)]
    reg = await store.register_holder(holder(ttl=300.0), snaps)
    assert sorted(reg.restored) == [f"l-legacy-{k}" for k in range(SHARDS)]
    for k, tenant in enumerate(tenants):
        lease = await store.get_lease(f"l-legacy-{k}")
        assert lease.tenant == tenant and lease.epoch == 3
    renewals = await store.renew(["l-legacy-2", "l-missing", "l-legacy-0"],
                                 [(tenants[1], "c1")])
    assert [(r.lease_id, r.renewed) for r in renewals] == [
        ("l-legacy-2", True), ("l-missing", False), ("l-legacy-0", True),
        ("l-legacy-1", True)]
    await store.revoke("l-legacy-1")
    with pytest.raises(errors.LeaseNotFound):
        await store.get_lease("l-missing")
    reclaimable, _ = await store.heartbeat("h1", [])
    assert reclaimable == ["l-legacy-1"]
    assert (await store.heartbeat("h1", ["l-legacy-1"]))[0] == []
    with pytest.raises(errors.LeaseNotFound):
        await store.get_lease("l-legacy-1")  # forgotten once freed, in its shard
    # One request id used for two tenants (two shards): its derived id names one lease, the
    # same for a lookup and for the revoke it guards, and the revoke touches only that one.
    from kvbridge.ids import grant_lease_id

    made = [(await store.grant(grant_spec(kv, kv.tokens(8), tenant=t, conversation="c7",
                                          request_id="req-twice", first_block=200 + 10 * k))
             ).lease.lease_id for k, t in enumerate(tenants[:2])]
    derived = grant_lease_id("h1", "req-twice")
    found = (await store.get_lease(derived)).lease_id
    assert found in made
    assert (await store.revoke(derived)).lease_id == found
    other = next(x for x in made if x != found)
    assert (await store.get_lease(other)).state is LeaseState.ACTIVE


async def test_listings_page_across_shards_in_id_order(make_store: Make, kv: Any) -> None:
    store = await make_store()
    await store.register_holder(holder(ttl=300.0))
    granted = []
    for i in range(30):
        g = await store.grant(grant_spec(kv, kv.tokens(4), tenant=f"page-{i}",
                                         conversation="c"))
        granted.append(g.lease.lease_id)
    assert len({x[-3:] for x in granted}) == SHARDS  # every shard holds some
    seen: list[str] = []
    after = ""
    while True:
        page = await store.list_leases(holder_id="h1", after=after, limit=7)
        if not page:
            break
        seen += [x.lease_id for x in page]
        after = page[-1].lease_id
    assert seen == sorted(granted)
    one = await store.list_leases(tenant="page-3")
    assert [x.lease_id for x in one] == [granted[3]]


async def test_every_replica_of_a_namespace_names_the_same_shard_count(
        make_store: Make, redis_cluster: Any, redis_namespace: str) -> None:
    """Replicas that disagree on the count would look for a tenant in different shards (one's
    reclaim could free KV under another's pin): a replica with another count refuses to
    start, and says how to start it."""
    fleet = await make_store()
    # A release from before sharding reads no count: the namespace's layout keeps it out.
    older = RedisStore(RegistryConfig(backend="redis", redis_url=redis_cluster.url,
                                      redis_namespace=redis_namespace),
                       SystemClock(), shard=(redis_namespace, ""))  # (skips the count)
    with pytest.raises(OSError, match="needs at least 6; this replica speaks layout 5"):
        await older.start()
    # Redis loses both records: a single-shard replica is refused without writing a count
    # (which would stop the fleet), and the fleet's next check writes both back.
    own = f"{{{redis_namespace}}}:"
    cluster_client = aioredis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        assert await cluster_client.delete(own + "shards") == 1
        with pytest.raises(OSError, match="is a sharded fleet's"):
            await make_store(shards=1)
        assert await cluster_client.get(own + "shards") is None
        assert await cluster_client.delete(own + "layout") == 1
        await asyncio.sleep(1.05)  # (ticks check the records at most once a second)
        await fleet.tick()
        assert fleet.not_serving == ""
        assert await cluster_client.get(own + "shards") == b"3"
        assert await cluster_client.hget(own + "layout", "min") == b"6"
    finally:
        await cluster_client.aclose()
    for shards in (2, 1):
        with pytest.raises(OSError, match="spread over 3 shard.s.; this replica was started "
                                          f"with redis_shards {shards}"):
            await make_store(shards=shards)
    # A record Redis lost lets a replica of another count start; the first check of the
    # others (at a tick, once a second) that finds the record rewritten stops them serving.
    first = await make_store(namespace=redis_namespace + "-lost")
    await first.tick()
    assert first.not_serving == ""
    client = aioredis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        assert await client.delete(f"{{{redis_namespace}-lost}}:shards") == 1
    finally:
        await client.aclose()
    second = await make_store(namespace=redis_namespace + "-lost", shards=2)
    await asyncio.sleep(1.05)  # (ticks check the record at most once a second)
    await first.tick()
    assert "spread over 2 shard(s)" in first.not_serving
    with pytest.raises(errors.Unavailable):
        await first.acquire_read("t1", "c1", b"")
    await second.tick()
    assert second.not_serving == ""
    single = redis_namespace + "-single"
    await make_store(shards=1, namespace=single)
    with pytest.raises(OSError, match="--redis-shards 1"):
        await make_store(namespace=single)
    # A single-shard fleet's state from before the record: its count is 1 all the same.
    client = aioredis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        assert await client.delete(f"{{{single}}}:shards") == 1
    finally:
        await client.aclose()
    with pytest.raises(OSError, match="--redis-shards 1"):
        await make_store(namespace=single)
    await make_store(namespace=single + "-x")  # a new namespace takes any count


async def test_a_grpc_registry_serves_from_the_cluster(redis_cluster: Any,
                                                       redis_namespace: str,
                                                       kv: Any) -> None:
    """`kvbridge registry serve --backend redis --redis-url redis+cluster://...
    --redis-shards 3`, over real gRPC: a holder, grants in every shard, reads that hit, a
    listing of all of them, and the fleet counts."""
    config = RegistryConfig(listen="127.0.0.1:0", metrics_listen="", backend="redis",
                            redis_url=redis_cluster.url, redis_namespace=redis_namespace,
                            redis_shards=SHARDS, recovery_grace_s=30.0)
    server = await create_server(config)
    await server.start()
    client = AsyncRegistryClient(f"127.0.0.1:{server.port}", timeout=5.0)
    try:
        assert isinstance(server.store, ShardedStore)
        await client.register_holder(**kv.holder_args("h1", ttl=300.0))
        tenants = [group[0] for group in tenants_by_shard(1)]
        ids = []
        for tenant in tenants:
            lease = (await client.grant_lease(**kv.grant_args("h1", tenant, "c1",
                                                              kv.tokens(8)))).lease
            ids.append(lease.lease_id)
        for tenant, lease_id in zip(tenants, ids, strict=True):
            read = await client.acquire_read(tenant, "c1", kv.prompt_hashes(kv.tokens(12)))
            assert read.miss_reason == 0 and read.lease.lease_id == lease_id
            assert read.pin.pin_id.endswith(lease_id[-3:])
            assert await client.release_read(read.pin.pin_id)
        listed = await client.list_leases(holder_id="h1")
        assert sorted(x.lease_id for x in listed.leases) == sorted(ids)
        assert server.store.counts()["leases_active"] >= 0  # as of the last tick
        await server.store.tick()
        assert server.store.counts()["leases_active"] == SHARDS
    finally:
        await client.close()
        await server.stop(0)


async def test_a_primary_failover_holds_and_reconfirms_only_its_shard(
        redis_namespace: str, kv: Any) -> None:
    """A 3-primary cluster with a replica each (`cluster-require-full-coverage no`, as
    docs/registry.md asks); one primary is SIGKILLed. Its shard answers UNAVAILABLE until the
    replica takes over, then asks the holder to register again (the replica's term is
    another) and holds its reclaims for the grace; the other shards' reads hit throughout;
    after the holder registered again with what it holds, every shard reads."""
    from redis.crc import key_slot

    cluster = RedisCluster(3, 1, "--cluster-require-full-coverage", "no",
                           "--cluster-node-timeout", "1000")
    store: Any = None
    try:
        config = RegistryConfig(backend="redis", redis_url=cluster.url,
                                redis_namespace=redis_namespace, redis_shards=SHARDS,
                                max_pin_ttl_s=1.0, default_pin_ttl_s=1.0,
                                recovery_grace_s=1.5)
        store = ShardedStore(config, SystemClock())
        await store.start()
        spec = holder(ttl=300.0)
        await store.register_holder(spec)
        tenants = [group[0] for group in tenants_by_shard(1)]
        specs = [grant_spec(kv, kv.tokens(8), tenant=t, first_block=100 + 10 * k)
                 for k, t in enumerate(tenants)]
        grants = [await store.grant(g) for g in specs]
        await advance(store, 1.6)  # past the fresh state's grace
        assert await store.reclaim_hold() == 0
        victim_shard = 0
        slot = key_slot(f"{{{store.shards[victim_shard].namespace}}}".encode())
        primary = cluster.primary_of(slot)
        node = aioredis.Redis(port=primary.port)
        try:  # the replica has every write before this one once it acknowledges it
            await node.set(f"{{{store.shards[victim_shard].namespace}}}:probe", 1)
            assert await node.execute_command("WAIT", 1, 5000) == 1
        finally:
            await node.aclose()
        primary.proc.kill()
        killed = time.monotonic()
        outcomes: list[list[str]] = [[] for _ in range(SHARDS)]
        first_hit = None
        registered_again = False
        beats_while_down = 0
        while time.monotonic() - killed < 30:
            for k, tenant in enumerate(tenants):
                try:
                    read = await store.acquire_read(tenant, "c1",
                                                    kv.prompt_hashes(kv.tokens(8)))
                    outcomes[k].append(read.miss.name)
                    if read.pin is not None:
                        await store.release_read(read.pin.pin_id)
                        if read.lease is not None:  # never another lease than granted
                            assert read.lease.lease_id == grants[k].lease.lease_id
                except errors.Unavailable:
                    outcomes[k].append("UNAVAILABLE")
            try:
                await store.heartbeat(spec.holder_id)
                if outcomes[victim_shard][-1] == "UNAVAILABLE":
                    beats_while_down += 1  # the other shards' beats went on
            except errors.HolderNotFound:  # what decode's session does: all it holds
                snaps = [Snapshot(g.lease.lease_id, s, g.lease.epoch, 0.0)
                         for g, s in zip(grants, specs, strict=True)]
                await store.register_holder(spec, snaps, [x.lease_id for x in snaps])
                registered_again = True
            except errors.Unavailable:
                pass
            if registered_again and outcomes[victim_shard][-1] == "HIT":
                first_hit = time.monotonic() - killed
                break
            await asyncio.sleep(0.1)
        print(f"victim shard outcomes: {outcomes[victim_shard]}; first hit again after "
              f"{first_hit} s")
        assert first_hit is not None, outcomes[victim_shard]
        assert registered_again
        assert "UNAVAILABLE" in outcomes[victim_shard]
        assert beats_while_down > 0
        for k in range(SHARDS):
            if k != victim_shard:
                assert set(outcomes[k]) == {"HIT"}, (k, outcomes[k])
        # Only the failed-over shard holds reclaims: a revoke elsewhere is reclaimable now.
        assert await store.reclaim_hold() > 0
        healthy, held = grants[1].lease.lease_id, grants[victim_shard].lease.lease_id
        await store.revoke(healthy)
        await store.revoke(held)
        assert (await store.heartbeat(spec.holder_id))[0] == [healthy]
    finally:
        if store is not None:
            await store.close()
        cluster.stop()
