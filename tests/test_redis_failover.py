"""A Redis failover to an asynchronous replica that lacks the latest pins: no registry replica
ever tells decode to free a lease while a pin granted before the failover could still be live.

Real redis-servers on 127.0.0.1: a primary and a replica (`--replicaof`), whose replication
link runs through a fault proxy (dropping its traffic: the replica misses what the primary
writes next, as an asynchronous replica may). The registry replicas reach Redis through
another proxy, a virtual address that the failover moves to the promoted replica (as Sentinel
or a managed service moves its endpoint); a registry replica started after the failover is
pointed at it directly. A seeded loop runs many interleavings: which registry replica pins,
how the lease dies (superseded, revoked, expired, drained, its holder lost) and when, which
replica ticks, and who asks. Every way decode learns that it may free a lease is watched
(heartbeat and registration replies, GetLease's and RevokeLease's `reclaimable`, drain replies,
RECLAIMABLE events), each on the fleet's clock against the lost pin's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from conftest import RedisProcess
from test_store_contract import grant_spec, holder

from kvbridge import errors
from kvbridge.clock import SystemClock
from kvbridge.faultproxy import FaultProxy
from kvbridge.services.registry import (
    EventType,
    LeaseEvent,
    LeaseState,
    MissReason,
    RegistryConfig,
    Snapshot,
)
from kvbridge.services.registry._redis import RedisStore

PIN_TTL = 5.0  # the longest pin: the grace after a loss of state is this + 1 s
GRACE = PIN_TTL + 1.0
SHORT = 2.0  # the idle TTL of a lease that expires, and the TTL of a holder that is lost
ROUNDS = int(os.environ.get("KVBRIDGE_FAILOVER_ROUNDS", "24"))
SEED = int(os.environ.get("KVBRIDGE_FAILOVER_SEED", "38"))
KILLS = ("supersede", "revoke", "expire", "deregister", "holder_lost")
# Both may become the primary: a full sync starts at once, not 5 s later.
SERVER = ("--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0")

_T = TypeVar("_T")


async def _retry(call: Callable[[], Awaitable[_T]]) -> _T:
    """A call through a failover: the first ones meet connections the failover closed."""
    for _ in range(100):
        try:
            return await call()
        except errors.Unavailable:
            await asyncio.sleep(0.02)
    return await call()


class Fleet:
    """A primary and a replica, the replication link through `link`, clients through `vip`."""

    def __init__(self, home: Path) -> None:
        self.home = home  # each server's own directory: a replica writes what it syncs there
        self.primary = RedisProcess(*SERVER, "--dir", self._dir("a"))
        self.replica: RedisProcess | None = None
        self.link = FaultProxy("127.0.0.1", self.primary.port)
        self.vip = FaultProxy("127.0.0.1", self.primary.port)
        self.admin: dict[int, aioredis.Redis] = {}

    async def start(self) -> None:
        await self.link.start()
        await self.vip.start()
        self.replica = RedisProcess(*SERVER, "--dir", self._dir("b"), "--replicaof",
                                    "127.0.0.1", str(self.link.port))
        await self.synced()

    def _dir(self, name: str) -> str:
        (self.home / name).mkdir()
        return str(self.home / name)

    def client(self, server: RedisProcess) -> aioredis.Redis:
        if server.port not in self.admin:
            self.admin[server.port] = aioredis.Redis.from_url(server.url)
        return self.admin[server.port]

    @property
    def vip_url(self) -> str:
        return f"redis://{self.vip.address}/0"

    async def synced(self) -> None:
        """Until the replica has everything the primary has. WAIT counts the replicas that
        acknowledged this connection's own last write, and the stores wrote on theirs: a write
        here first puts everything before it into what is waited for."""
        primary = self.client(self.primary)
        await primary.incr("synced")
        for _ in range(200):
            if await primary.wait(1, 100) >= 1:
                return
        raise AssertionError("the replica does not catch up")

    async def fail_over(self, before_clients: Callable[[aioredis.Redis], Awaitable[None]]
                        ) -> None:
        """Promote the replica (its link cut: it lacks what the primary wrote since), move the
        virtual address to it, and make the old primary its replica (it then drops what the
        new primary lacks). `before_clients` runs on the promoted one before any client."""
        assert self.replica is not None
        old, new = self.primary, self.replica
        await self.client(new).execute_command("REPLICAOF", "NO", "ONE")
        await before_clients(self.client(new))
        self.vip.target = ("127.0.0.1", new.port)
        self.vip.reset_all()
        await self.link.stop()
        self.link = FaultProxy("127.0.0.1", new.port)
        await self.link.start()
        await self.client(old).execute_command("REPLICAOF", "127.0.0.1", str(self.link.port))
        self.primary, self.replica = new, old

    async def close(self) -> None:
        for client in self.admin.values():
            await client.aclose()
        await self.vip.stop()
        await self.link.stop()
        for server in (self.primary, self.replica):
            if server is not None:
                server.stop()


@pytest.fixture
async def fleet(tmp_path: Path) -> Any:
    f = Fleet(tmp_path)
    try:
        await f.start()
        yield f
    finally:
        await f.close()


async def _fleet_now(client: aioredis.Redis, prefix: str) -> float:
    """The fleet's clock as the functions read it (TIME, the test's `off`, a clock fix)."""
    secs, micros = await client.time()
    off, fix = await client.hmget(prefix + "clock", "off", "fix")
    return secs + micros / 1e6 + float(off or 0) + float(fix or 0)


async def _serving(client: aioredis.Redis) -> str:
    """Who serves the state, as the functions record it (store.lua `serving`)."""
    run_id = (await client.info("server"))["run_id"]
    return f"{run_id}:{(await client.info('replication'))['master_replid']}"


async def _round(fleet: Fleet, kv: Any, rng: random.Random, defeat: bool) -> tuple[int, str]:
    """One interleaving: how many times decode was told it may free the lease while the lost
    pin could be live, and what the round did (for a failure's message)."""
    namespace = "fo-" + uuid.uuid4().hex[:10]
    prefix = "{" + namespace + "}:"
    config = RegistryConfig(backend="redis", redis_url=fleet.vip_url,
                            redis_namespace=namespace, max_pin_ttl_s=PIN_TTL,
                            default_pin_ttl_s=PIN_TTL)
    stores: dict[str, RedisStore] = {}
    told: list[tuple[str, float]] = []  # (how, on the fleet's clock)
    lease_id = ""

    def on_event(name: str) -> Callable[[LeaseEvent], None]:
        def listen(event: LeaseEvent) -> None:
            if event.type is EventType.RECLAIMABLE and event.lease_id == lease_id:
                told.append((f"RECLAIMABLE event on {name}", event.wall))
        return listen

    async def add(name: str, url: str) -> None:
        store = RedisStore(dataclasses.replace(config, redis_url=url), SystemClock())
        await _retry(store.start)
        store.add_listener(on_event(name))
        stores[name] = store

    try:
        await add("A", fleet.vip_url)
        await add("B", fleet.vip_url)
        a = stores["A"]
        await a.advance_clock(GRACE + 0.5)  # past the grace of the fresh namespace
        await a.tick()
        kill = rng.choice(KILLS)
        steps = []
        pick = lambda: stores[rng.choice(sorted(stores))]  # noqa: E731
        await pick().register_holder(holder(ttl=SHORT if kill == "holder_lost" else 300.0))
        idle = SHORT if kill == "expire" else 60.0
        lease = (await pick().grant(grant_spec(kv, kv.tokens(8), idle_ttl=idle))).lease
        lease_id = lease.lease_id
        held = [lease_id]  # what decode holds (it frees nothing it was not told to)
        await fleet.synced()
        fleet.link.set(drop=True)  # from now on the replica hears nothing
        reader = rng.choice("AB")
        how = rng.choice(("acquire", "pin"))
        if how == "acquire":
            read = await stores[reader].acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        else:
            read = await stores[reader].pin_lease("t1", "c1")
        assert read.pin is not None, read
        old = fleet.client(fleet.primary)
        deadline = await old.zscore(prefix + "pexp", read.pin.pin_id)
        assert deadline is not None
        if rng.random() < 0.5:  # more writes the replica never gets
            await pick().renew([lease_id])
        steps.append(f"pinned on {reader} ({how}), kill by {kill}")

        async def defeated(new: aioredis.Redis) -> None:
            if defeat:  # the promoted Redis passed off as the one that wrote the state
                await new.set(prefix + "rid", await _serving(new))

        await fleet.fail_over(defeated)
        new = fleet.client(fleet.primary)
        assert not await new.exists(prefix + "p:" + read.pin.pin_id)  # the pin is lost
        if rng.random() < 0.3:  # time passes, and a read is the first call on the new primary
            await a.advance_clock(SHORT + 0.5)  # (a lease that expires has, a holder is lost)
            first = rng.choice("AB")
            await _retry(lambda: stores[first].acquire_read(
                "t1", "c1", kv.prompt_hashes(kv.tokens(8)), pin_ttl=1.0))
            steps.append(f"read first on {first}")
        if rng.random() < 0.5:
            await add("C", fleet.primary.url)  # started after the failover, pointed at it
            steps.append("C started")
        killed, kill_at = False, rng.randint(0, 2)
        holder_lost_at = 0.0

        async def note(how: str) -> None:
            told.append((how, await _fleet_now(new, prefix)))

        async def ask(name: str) -> None:
            """Every way the replica `name` tells decode that it may free the lease."""
            store = stores[name]
            if kill == "holder_lost":
                if holder_lost_at and await _fleet_now(new, prefix) > holder_lost_at:
                    reg = await _retry(lambda: store.register_holder(holder(ttl=300.0)))
                    if lease_id in reg.reclaimable:
                        await note(f"register on {name}")
            else:
                try:
                    freed, _ = await _retry(lambda: store.heartbeat("h1"))
                except errors.HolderNotFound:  # as decode does: register again, with its leases
                    if kill == "deregister" and killed:
                        return
                    reg = await _retry(lambda: store.register_holder(holder(ttl=300.0),
                                                                     held_ids=held))
                    freed = reg.reclaimable
                if lease_id in freed:
                    await note(f"heartbeat on {name}")
            got = await _retry(lambda: store.get_lease(lease_id))
            if got.reclaimable and await _retry(store.reclaim_hold) <= 0:
                await note(f"get_lease on {name}")

        async def do_kill() -> None:
            nonlocal holder_lost_at
            name = rng.choice(sorted(stores))
            store = stores[name]
            steps.append(f"killed on {name}")
            if kill == "supersede":
                held.append((await _retry(lambda: store.grant(grant_spec(kv, kv.tokens(12)))
                             )).lease.lease_id)
            elif kill == "revoke":
                dead = await _retry(lambda: store.revoke(lease_id))
                if dead.reclaimable and await _retry(store.reclaim_hold) <= 0:
                    await note(f"revoke on {name}")
            elif kill == "deregister":
                freed, _ = await _retry(lambda: store.deregister_holder("h1"))
                if lease_id in freed:
                    await note(f"deregister on {name}")
            elif kill == "holder_lost":
                steps[-1] = "heartbeats stop"  # its TTL runs out within SHORT from now
                holder_lost_at = await _fleet_now(new, prefix) + SHORT

        end = float(deadline) + GRACE + 1.0
        step = 0
        while await _fleet_now(new, prefix) < end:
            if not killed and step >= kill_at:
                await do_kill()
                killed = True
            for name in rng.sample(sorted(stores), len(stores)):
                if rng.random() < 0.5:
                    await _retry(stores[name].tick)
                if step < 3 and rng.random() < 0.3:  # a read: may find the lease expired
                    await _retry(lambda: stores[name].acquire_read(  # noqa: B023
                        "t1", "c1", kv.prompt_hashes(kv.tokens(8)), pin_ttl=1.0))
                await ask(name)
            await a.advance_clock(rng.uniform(0.2, 1.0))
            step += 1
        for name in sorted(stores):
            await ask(name)
        await asyncio.sleep(0.05)  # the event tails deliver what came last
        unsafe = [(h, t) for h, t in told if t < float(deadline)]
        if not defeat:  # the hold ends: decode is told after all, later
            assert told, f"never told to free the lease: {steps}"
        return len(unsafe), f"{'; '.join(steps)}; unsafe: {unsafe}"
    finally:
        for store in stores.values():
            await store.close()


async def test_a_failover_that_loses_a_pin_never_frees_the_lease_under_it(
        fleet: Fleet, kv: Any) -> None:
    """Whatever the interleaving, no registry replica (the one that granted the pin, another,
    one started after the failover) tells decode to free the lease before the lost pin's
    deadline. Then, with the failover passed off as no failover, such rounds do: the rounds
    can see an unsafe reclaim."""
    rng = random.Random(SEED)
    for i in range(ROUNDS):
        unsafe, what = await _round(fleet, kv, rng, defeat=False)
        assert unsafe == 0, f"round {i} (seed {SEED}): {what}"
    # Not every interleaving can: one that kills the lease late, or reads it again after the
    # failover (a new pin that ends first), is told only after the lost pin's deadline anyway.
    caught = [await _round(fleet, kv, rng, defeat=True) for _ in range(4)]
    assert any(n > 0 for n, _ in caught), caught


@dataclasses.dataclass
class _Freed:
    """A lease (`first`, of `old_tokens`) that its holder freed after a grant (`second`, of
    `spec`) superseded it, both on the primary only: the replica heard nothing of either."""

    store: RedisStore
    namespace: str
    first: Any
    second: Any
    spec: Any
    old_tokens: list[int]
    new_tokens: list[int]


@contextlib.asynccontextmanager
async def _freed_on_the_primary_only(fleet: Fleet, kv: Any) -> AsyncIterator[_Freed]:
    namespace = "fo-" + uuid.uuid4().hex[:10]
    config = RegistryConfig(backend="redis", redis_url=fleet.vip_url, redis_namespace=namespace,
                            max_pin_ttl_s=PIN_TTL, default_pin_ttl_s=PIN_TTL)
    store = RedisStore(config, SystemClock())
    await _retry(store.start)
    try:
        await store.advance_clock(GRACE + 0.5)  # past the grace of the fresh namespace
        await store.tick()
        await store.register_holder(holder(ttl=300.0))
        old_tokens, new_tokens = kv.tokens(8), kv.tokens(12)
        first = (await store.grant(grant_spec(kv, old_tokens))).lease
        await fleet.synced()
        fleet.link.set(drop=True)  # the replica gets nothing more
        spec = grant_spec(kv, new_tokens)
        second = (await store.grant(spec)).lease
        assert (await store.heartbeat("h1"))[0] == [first.lease_id]  # decode frees it
        await store.heartbeat("h1", [first.lease_id])  # and says so
        yield _Freed(store, namespace, first, second, spec, old_tokens, new_tokens)
    finally:
        await store.close()


async def _nothing(_: aioredis.Redis) -> None:
    """A failover's step before clients: nothing."""


async def test_a_failover_that_loses_a_grant_never_reads_a_lease_its_holder_freed(
        fleet: Fleet, kv: Any) -> None:
    """The other way round: the promoted replica lacks a grant that superseded a lease, and
    decode, told so by the old primary, freed the superseded lease's blocks; the replica still
    has that lease live. No read pins it: a holder's leases are read again only once it has
    registered with the new primary, with what it holds (then the lease it freed is revoked,
    and the one it holds restored from its snapshot)."""
    async with _freed_on_the_primary_only(fleet, kv) as f:
        store = f.store
        await fleet.fail_over(_nothing)
        assert (await fleet.client(fleet.primary).hget(
            "{" + f.namespace + "}:l:" + f.first.lease_id, "s")) is not None  # back, as it was
        for read in (
                await _retry(lambda: store.acquire_read("t1", "c1",
                                                        kv.prompt_hashes(f.old_tokens))),
                await store.pin_lease("t1", "c1")):
            assert read.pin is None and read.miss is MissReason.HOLDER_GONE, read
        with pytest.raises(errors.HolderNotFound):  # its next heartbeat: register again
            await store.heartbeat("h1")
        reg = await store.register_holder(
            holder(ttl=300.0), [Snapshot(f.second.lease_id, f.spec, f.second.epoch, 0.0)])
        assert reg.restored == [f.second.lease_id]
        assert (await store.get_lease(f.first.lease_id)).state is LeaseState.REVOKED
        read = await store.acquire_read("t1", "c1", kv.prompt_hashes(f.new_tokens))
        assert read.miss is MissReason.HIT and read.lease is not None
        assert read.lease.lease_id == f.second.lease_id


async def test_a_failover_there_and_back_never_reads_a_lease_its_holder_freed(
        fleet: Fleet, kv: Any) -> None:
    """The primary stalls and is replaced by a replica that lacks its last writes (a grant
    that superseded a lease, and decode's word that it freed it); it resyncs from its
    replacement, taking on that state, and is promoted again before the holder re-registered:
    the same Redis process, another history. No read pins the freed lease."""
    async with _freed_on_the_primary_only(fleet, kv) as f:
        primary = fleet.primary
        await fleet.fail_over(_nothing)  # to the replica, no call served there
        await fleet.synced()  # the old primary now has the replacement's state
        await fleet.fail_over(_nothing)  # and is promoted again
        assert fleet.primary is primary
        read = await _retry(lambda: f.store.acquire_read("t1", "c1",
                                                         kv.prompt_hashes(f.old_tokens)))
        assert read.pin is None and read.miss is MissReason.HOLDER_GONE, read
        with pytest.raises(errors.HolderNotFound):
            await f.store.heartbeat("h1")


async def _started_store(server: RedisProcess, namespace: str) -> RedisStore:
    """A store on `server`, started and past its start's recovery grace."""
    config = RegistryConfig(backend="redis", redis_url=server.url, redis_namespace=namespace,
                            max_pin_ttl_s=PIN_TTL, default_pin_ttl_s=PIN_TTL)
    store = RedisStore(config, SystemClock())
    await store.start()
    await store.advance_clock(GRACE + 0.5)
    return store


async def test_a_restarted_redis_holds_reclaims_for_the_grace(tmp_path: Path, kv: Any) -> None:
    """Redis restarted from its append-only file: it may be an older one (fsync'd once a
    second, or restored from a backup), which no replica can tell; so reclaims wait for the
    grace, as after a failover. A dead lease is reported again once it is over."""
    durable = ("--dir", str(tmp_path), "--appendonly", "yes", "--appendfsync", "always",
               "--save", "")
    server = RedisProcess(*durable)
    store: RedisStore | None = None
    try:  # from here on the server is stopped whatever fails
        store = await _started_store(server, "restart")
        await store.register_holder(holder(ttl=300.0))
        lease = (await store.grant(grant_spec(kv, kv.tokens(8)))).lease
        await store.revoke(lease.lease_id)
        assert await store.heartbeat("h1") == ([lease.lease_id], 300.0)
        server.stop()
        server = RedisProcess(*durable, port=server.port)
        with pytest.raises(errors.HolderNotFound):  # register again, with what it holds
            await _retry(lambda: store.heartbeat("h1"))
        reg = await store.register_holder(holder(ttl=300.0), held_ids=[lease.lease_id])
        assert reg.reclaimable == []
        assert await store.reclaim_hold() == pytest.approx(GRACE, abs=0.5)
        await store.advance_clock(GRACE + 0.1)
        assert await store.heartbeat("h1") == ([lease.lease_id], 300.0)
    finally:
        if store is not None:
            await store.close()
        server.stop()


@pytest.mark.parametrize("first", ["read", "heartbeat"])
async def test_a_restart_longer_than_the_holder_ttl_loses_no_lease(tmp_path: Path, kv: Any,
                                                                   first: str) -> None:
    """No holder can heartbeat while Redis restarts: one that took longer than the holder
    TTL must not get the holder lost, and every lease with it, once Redis is back (whichever
    call comes first). The holder registers again with what it holds, and reads go on."""
    durable = ("--dir", str(tmp_path), "--appendonly", "yes", "--appendfsync", "always",
               "--save", "")
    server = RedisProcess(*durable)
    store: RedisStore | None = None
    try:
        store = await _started_store(server, "long-restart")
        await store.register_holder(holder(ttl=10.0))
        tokens = kv.tokens(8)
        lease = (await store.grant(grant_spec(kv, tokens))).lease
        server.stop()
        server = RedisProcess(*durable, port=server.port)
        # The outage took 30 s (on a connection of its own: no call of the store's first).
        direct = aioredis.Redis.from_url(server.url)
        await direct.hincrbyfloat(store.prefix + "clock", "off", 30.0)
        await direct.aclose()
        if first == "read":  # unconfirmed holder: a miss, but no holder lost
            read = await _retry(lambda: store.acquire_read("t1", "c1",
                                                           kv.prompt_hashes(tokens)))
            assert read.pin is None and read.miss is MissReason.HOLDER_GONE, read
        with pytest.raises(errors.HolderNotFound):  # register again, with what it holds
            await _retry(lambda: store.heartbeat("h1"))
        reg = await store.register_holder(holder(ttl=10.0), held_ids=[lease.lease_id])
        assert reg.reclaimable == []
        read = await store.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
        assert read.pin is not None and read.lease is not None, read
        assert read.lease.lease_id == lease.lease_id
    finally:
        if store is not None:
            await store.close()
        server.stop()


async def test_a_redis_user_without_info_is_refused_at_start() -> None:
    """The functions read the run id with INFO: an ACL user without it fails the start with
    a clear error, and nothing is left running."""
    server = RedisProcess("--save", "", "--appendonly", "no")
    admin = aioredis.Redis.from_url(server.url)
    try:
        await admin.acl_setuser("kv", enabled=True, passwords=["+pw"], keys=["*"],
                                channels=["*"], commands=["+@all", "-info"])
        config = RegistryConfig(backend="redis", redis_namespace="acl",
                                redis_url=f"redis://kv:pw@127.0.0.1:{server.port}/0")
        store = RedisStore(config, SystemClock())
        with pytest.raises(OSError, match=r"refused the registry's functions: .*can't run"):
            await store.start()
        assert store._redis is None and store._reader is None
    finally:
        await admin.aclose()
        server.stop()
