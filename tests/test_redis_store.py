"""The Redis store's connection to Redis (redis-py): script calls pipelined per loop turn, a
Redis that cannot serve now mapped to Unavailable, a connection Redis closed replaced."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ResponseError


async def test_script_calls_of_one_loop_turn_share_a_pipeline(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """Calls made in one loop turn go to Redis as one pipeline, each its own script run."""
    from test_store_contract import grant_spec, holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis
    from kvbridge.services.registry._model import MissReason

    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        assert store._batcher is not None
        await store.register_holder(holder(ttl=300.0))
        lease = (await store.grant(grant_spec(kv, kv.tokens(8)))).lease
        prompt = kv.prompt_hashes(kv.tokens(8))
        reads = await asyncio.gather(*(store.acquire_read("t1", "c1", prompt)
                                       for _ in range(5)))  # one loop turn: one pipeline
        assert all(r.miss is MissReason.HIT and r.lease is not None
                   and r.lease.lease_id == lease.lease_id for r in reads)
        assert reads[0].pin is not None
        assert await store.release_read(reads[0].pin.pin_id)
    finally:
        await store.close()


async def test_a_store_on_redis_py_maps_a_redis_not_serving_to_unavailable(
        redis_server: Any, redis_namespace: str, kv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies of a Redis that cannot serve now (read-only replica, master down, busy) fail
    the call as Unavailable (clients retry or fail over); a script's own error does not."""
    from redis.exceptions import MasterDownError, ReadOnlyError
    from test_store_contract import holder

    from kvbridge.clock import SystemClock
    from kvbridge.errors import Unavailable
    from kvbridge.services.registry import RegistryConfig, _redis

    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        await store.register_holder(holder(ttl=300.0))
        assert store._batcher is not None
        send = store._batcher.call
        for exc in (ReadOnlyError("You can't write against a read only replica.",
                                  status_code="READONLY"),
                    MasterDownError("Link with MASTER is down", status_code="MASTERDOWN"),
                    ResponseError("BUSY Redis is busy running a script.")):
            def refuse(args: list[Any], exc: Exception = exc) -> Any:
                future = asyncio.get_running_loop().create_future()
                future.set_exception(exc)
                return future

            monkeypatch.setattr(store._batcher, "call", refuse)
            with pytest.raises(Unavailable):
                await store.heartbeat("h1")
        monkeypatch.setattr(store._batcher, "call", send)
        assert (await store.heartbeat("h1"))[1] == 300.0
        with pytest.raises(ResponseError):  # a script's own error is still not an outage
            await store._run("renew", "not a number")
    finally:
        await store.close()


async def test_a_store_on_redis_py_replaces_a_connection_redis_closed(
        kv: Any, tmp_path: Any) -> None:
    """Script calls through redis-py are never resent, so a pooled connection that a restarted
    Redis closed must be replaced before a call is written to it, not fail that call."""
    from conftest import RedisProcess
    from test_store_contract import holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis

    durable = ("--dir", str(tmp_path), "--appendonly", "yes", "--appendfsync", "always",
               "--save", "")
    server = RedisProcess(*durable)
    config = RegistryConfig(backend="redis", redis_url=server.url, redis_namespace="restart")
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        await store.register_holder(holder(ttl=300.0))
        server.stop()
        await asyncio.sleep(0.1)  # the store's loop sees its connections closed
        server = RedisProcess(*durable, port=server.port)
        assert (await store.get_holder("h1")).holder_id == "h1"  # the call ran
    finally:
        await store.close()
        server.stop()


async def test_a_redis_that_lost_its_functions_gets_them_again_and_the_call_runs(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """A Redis that lost the library (restarted without persistence, FUNCTION FLUSH, a
    failover to a replica without it) answers "Function not found": the call did not run, so
    the library is loaded again and the call sent again, alone or in a batch."""
    import redis.asyncio as aioredis
    from test_store_contract import grant_spec, holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis
    from kvbridge.services.registry._model import MissReason

    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    client = aioredis.Redis.from_url(redis_server.url)
    await store.start()
    try:
        await client.function_flush()
        await store.register_holder(holder(ttl=300.0))  # alone
        lease = (await store.grant(grant_spec(kv, kv.tokens(8)))).lease
        await client.function_flush()
        prompt = kv.prompt_hashes(kv.tokens(8))
        reads = await asyncio.gather(*(store.acquire_read("t1", "c1", prompt)
                                       for _ in range(3)))  # one batch
        assert [(r.miss, r.lease.lease_id if r.lease else None) for r in reads] == [
            (MissReason.HIT, lease.lease_id)] * 3
        assert (await store.get_lease(lease.lease_id)).pin_count == 3  # each ran once
    finally:
        await client.aclose()
        await store.close()


async def test_replicas_of_other_versions_keep_their_own_functions(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """The library and its functions are named by state layout and source digest: loading
    another version's library leaves this one's functions in place, and the reverse."""
    import redis.asyncio as aioredis
    from test_store_contract import holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis
    from kvbridge.services.registry._redis_lua import library

    mine = library()
    assert mine.name.startswith(f"kvbridge_l{_redis.LAYOUT}_")
    assert all(f.startswith(f"kvb{_redis.LAYOUT}_") and f.endswith("_" + op)
               for op, f in mine.functions.items())
    other = mine.source.replace(mine.name, "kvbridge_l0_other").replace(
        mine.functions["grant"].removesuffix("grant"), "kvb0_other_")
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.function_load(other)
        await store.start()
        await store.register_holder(holder(ttl=300.0))
        names = {dict(zip(lib[::2], lib[1::2], strict=True))[b"library_name"]
                 for lib in await client.function_list()}
        assert {mine.name.encode(), b"kvbridge_l0_other"} <= names
    finally:
        await client.aclose()
        await store.close()


async def test_a_redis_without_functions_is_refused_with_a_clear_error(
        redis_server: Any, redis_namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis before 7.0 has no FUNCTION command: the store refuses to start, saying so."""
    import redis.asyncio as aioredis

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis

    async def no_functions(self: Any, code: str, replace: bool = False) -> Any:
        raise ResponseError("unknown command 'FUNCTION', with args beginning with: 'LOAD'")

    async def info(self: Any, section: str = "") -> dict[str, Any]:
        return {"redis_version": "6.2.14"}

    monkeypatch.setattr(aioredis.Redis, "function_load", no_functions)
    monkeypatch.setattr(aioredis.Redis, "info", info)
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    with pytest.raises(OSError, match=r"Redis 6\.2\.14 has no functions.*Redis 7\.0 or newer"):
        await store.start()


def test_the_lua_takes_every_shared_value_from_python() -> None:
    """The values both sides must agree on come from Python (the generated preamble): every
    enum member and refusal reason is defined there, the Lua uses no such name the preamble
    lacks and writes no value of its own, and every refusal maps to its own domain error."""
    import re
    from importlib import resources

    from kvbridge.errors import KvbridgeError
    from kvbridge.services.registry import RegistryConfig
    from kvbridge.services.registry._model import EventType, HolderState, LeaseState, MissReason
    from kvbridge.services.registry._redis_lua import _FILES, Refusal, _constants
    from kvbridge.services.registry._redis_replies import refusal

    preamble = _constants()
    defined = set(re.findall(r"\b([A-Z][A-Z0-9_]+)\b(?=[^=\n]*=)", preamble))
    for prefix, members in (("", LeaseState), ("H_", HolderState),
                            ("MISS_", MissReason), ("EV_", EventType), ("ERR_", Refusal)):
        assert {prefix + m.name for m in members} <= defined
    lua = "".join((resources.files("kvbridge.services.registry") / "lua" / f).read_text()
                  for f in _FILES)
    used = set(re.findall(r"\b((?:H|MISS|EV|ERR|S)_[A-Z_]+)\b", lua))
    assert used <= defined, used - defined
    assert not re.search(r"\{'ERR', '", lua)  # refusals by name, never a literal
    assert not re.search(r"emit\(\d", lua)  # event types by name
    for reason in Refusal:
        if reason is not Refusal.HOLDER_CONFLICT:  # mapped with its layout by the caller
            assert type(refusal(RegistryConfig(), reason)) is not KvbridgeError, reason


async def test_lapsed_holders_are_forgotten_as_the_memory_table_forgets_them(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """From review: a holder that lapsed holding nothing is forgotten at once (it was kept
    for the whole retention); one with dead leases is kept; a pinned one is looked at again
    later rather than blocking the others."""
    from test_store_contract import grant_spec, holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis

    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace, min_holder_ttl_s=1.0,
                            max_lifetime_cap_s=100.0, default_max_lifetime_s=100.0)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        assert store._redis is not None
        await store.register_holder(holder("empty", ttl=1.0))
        await store.register_holder(holder("h1", ttl=1.0))
        await store.grant(grant_spec(kv, kv.tokens(8)))
        await store.advance_clock(1.5)
        await store.tick()
        exists = [await store._redis.exists(store.prefix + f"h:{h}") for h in ("empty", "h1")]
        assert exists == [0, 1]
        retention = config.max_lifetime_cap_s + config.max_pin_ttl_s
        await store.advance_clock(retention + 1)
        await store.tick()
        assert await store._redis.exists(store.prefix + "h:h1") == 0
        assert await store.list_leases(include_inactive=True) == []
    finally:
        await store.close()


async def _history_index(store: Any, tenant: str) -> dict[bytes, str]:
    """The tenant's lookup index as Redis holds it: history key -> lease id."""
    assert store._redis is not None
    raw = await store._redis.hgetall(store.prefix + f"tk:{tenant}")
    return {k: v.decode() for k, v in raw.items()}


async def test_the_history_index_loses_a_lease_wherever_lua_ends_it(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """Each way a lease stops being active inside the functions takes it out of the tenant's
    lookup index (`tk:<tenant>`) and drops the keys it kept (`hk`): expiry by a tick, a holder
    lost by a tick, a quota revocation, a drain. A key a later lease took stays that lease's;
    the keys are one binary field of the lease."""
    from test_store_contract import grant_spec, hkeys, holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis
    from kvbridge.services.registry._model import LeaseState, MissReason

    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace, min_holder_ttl_s=1.0)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        assert store._redis is not None
        s, u, v, w, x, y = hkeys("s", "u", "v", "w", "x", "y")
        await store.register_holder(holder("h1", ttl=300.0))
        await store.register_holder(holder("h2", ttl=1.0))
        a = (await store.grant(grant_spec(kv, kv.tokens(8), conversation="c1",
                                          history_keys=s + u, idle_ttl=100.0))).lease
        assert await store._redis.hget(store.prefix + f"l:{a.lease_id}", "hk") == s + u
        b = (await store.grant(grant_spec(kv, kv.tokens(8), conversation="c2",
                                          history_keys=s + v, idle_ttl=1.0))).lease
        c = (await store.grant(grant_spec(kv, kv.tokens(8), holder_id="h2", conversation="c3",
                                          history_keys=w, idle_ttl=100.0))).lease
        assert await _history_index(store, "t1") == {
            s: b.lease_id, u: a.lease_id, v: b.lease_id, w: c.lease_id}
        # A tick expires b (idle) and loses h2 (its TTL) with c: both leave the index; s,
        # which b had taken from a, is no one's now.
        await store.advance_clock(1.5)
        await store.tick()
        assert (await store.get_lease(b.lease_id)).state is LeaseState.EXPIRED
        assert (await store.get_lease(c.lease_id)).state is LeaseState.HOLDER_LOST
        assert await _history_index(store, "t1") == {u: a.lease_id}
        assert store.counts()["history_keys"] == 1  # counted as they come and go
        for dead in (b, c):
            assert await store._redis.hget(store.prefix + f"l:{dead.lease_id}", "hk") is None
        read = await store.pin_lease("t1", "", history_keys=s + u + v)
        assert read.lease is not None and read.lease.lease_id == a.lease_id
        assert (read.keys_matched, read.whole) == (2, True) and read.pin is not None
        await store.release_read(read.pin.pin_id)
        # A quota revocation (the tenant's soonest-expiring lease makes room).
        quota = _redis.RedisStore(RegistryConfig(
            backend="redis", redis_url=redis_server.url, redis_namespace=redis_namespace,
            tenant_max_leases=1), SystemClock(), recovering=False)
        await quota.start()
        try:
            d = (await quota.grant(grant_spec(kv, kv.tokens(8), tenant="t2",
                                              history_keys=x))).lease
            e = (await quota.grant(grant_spec(kv, kv.tokens(8), tenant="t2", conversation="c2",
                                              history_keys=y))).lease
            assert (await quota.get_lease(d.lease_id)).state is LeaseState.REVOKED
            assert await _history_index(store, "t2") == {y: e.lease_id}
        finally:
            await quota.close()
        # A drain revokes the holder's leases: the index is gone with the last of them.
        await store.deregister_holder("h1")
        assert await store._redis.exists(store.prefix + "tk:t1",
                                         store.prefix + "tk:t2") == 0
        await store.tick()
        assert store.counts()["history_keys"] == 0
        read = await store.pin_lease("t1", "", history_keys=s + u)
        assert read.miss is MissReason.NO_LEASE and read.pin is None
    finally:
        await store.close()


async def test_a_restored_lease_is_indexed_only_if_it_ends_up_active(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """RegisterHolder restores: one older than the conversation's current lease is restored
    superseded and not indexed; a newer one supersedes the current lease, which leaves the
    index, and takes its place; an expired one is not indexed."""
    from test_store_contract import grant_spec, hkeys, holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, Snapshot, _redis
    from kvbridge.services.registry._model import LeaseState

    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        s, u, v, w = hkeys("s", "u", "v", "w")
        await store.register_holder(holder(ttl=300.0))
        cur = (await store.grant(grant_spec(kv, kv.tokens(8), history_keys=s + u,
                                            request_id="r1"))).lease
        older = Snapshot("l-older", grant_spec(kv, kv.tokens(8), history_keys=s + v), 1, 5.0)
        expired = Snapshot("l-expired", grant_spec(kv, kv.tokens(8), conversation="c9",
                                                   history_keys=w, idle_ttl=5.0,
                                                   max_lifetime=5.0), 1, 10.0)
        await store.register_holder(holder(ttl=300.0), [older, expired],
                                    held_ids=[cur.lease_id, "l-older", "l-expired"])
        assert (await store.get_lease("l-older")).state is LeaseState.SUPERSEDED
        assert (await store.get_lease("l-expired")).state is LeaseState.EXPIRED
        assert await _history_index(store, "t1") == {s: cur.lease_id, u: cur.lease_id}
        newer = Snapshot("l-newer", grant_spec(kv, kv.tokens(8), history_keys=s + v), 5, 0.0)
        reg = await store.register_holder(holder(ttl=300.0), [newer], restore_only=True)
        assert reg.restored == ["l-newer"]
        assert (await store.get_lease(cur.lease_id)).state is LeaseState.SUPERSEDED
        assert await _history_index(store, "t1") == {s: "l-newer", v: "l-newer"}
    finally:
        await store.close()


async def test_the_lookup_drops_entries_the_index_should_not_hold(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """Entries a replica of an older layout leaves (it keeps no index: a lease it killed or
    freed stays under its keys) or that point to another tenant's lease (an id used again
    after its lease was freed) are never answered: the lookup checks the lease it finds,
    drops such an entry, and goes on to shorter keys."""
    from test_store_contract import grant_spec, hkeys, holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis
    from kvbridge.services.registry._model import MissReason

    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        assert store._redis is not None
        s, u, v, w, x = hkeys("s", "u", "v", "w", "x")
        await store.register_holder(holder(ttl=300.0))
        live = (await store.grant(grant_spec(kv, kv.tokens(8), history_keys=s))).lease
        dead = (await store.grant(grant_spec(kv, kv.tokens(8), conversation="c2",
                                             history_keys=u))).lease
        other = (await store.grant(grant_spec(kv, kv.tokens(8), tenant="t2",
                                              history_keys=v))).lease
        await store.revoke(dead.lease_id)
        tk = store.prefix + "tk:t1"
        await store._redis.hset(tk, mapping={u: dead.lease_id, v: other.lease_id,
                                             w: "l-gone", x: live.lease_id})
        read = await store.pin_lease("t1", "", history_keys=s + u + v + w + x)
        assert read.lease is not None and read.lease.lease_id == live.lease_id
        assert (read.keys_matched, read.whole) == (1, True) and read.pin is not None
        assert await _history_index(store, "t1") == {s: live.lease_id}
        assert await _history_index(store, "t2") == {v: other.lease_id}  # its own, untouched
        read = await store.pin_lease("t1", "", history_keys=u + v + w + x)
        assert read.miss is MissReason.NO_LEASE and read.pin is None
    finally:
        await store.close()


async def test_a_long_lookup_finds_the_longest_key_in_any_chunk(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:
    """The lookup reads a long request's keys a chunk at a time (a few, then more): the match
    is the longest indexed key wherever it falls, and counted from the request's start."""
    from test_store_contract import grant_spec, holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis

    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        keys = [i.to_bytes(16, "big") for i in range(1, 1001)]
        request = b"".join(keys)
        await store.register_holder(holder(ttl=300.0))
        found = {}
        for at, conv in ((7, "c7"), (40, "c40"), (300, "c300"), (997, "c997")):
            found[at] = (await store.grant(grant_spec(
                kv, kv.tokens(8), conversation=conv,
                history_keys=keys[at - 1] + (1000 + at).to_bytes(16, "big")))).lease
        for at in (997, 300, 40, 7):  # longest first; each revoked in turn
            read = await store.pin_lease("t1", "", history_keys=request)
            assert read.lease is not None and read.lease.lease_id == found[at].lease_id
            assert (read.keys_matched, read.whole) == (at, False) and read.pin is not None
            await store.release_read(read.pin.pin_id)
            await store.revoke(found[at].lease_id)
        read = await store.pin_lease("t1", "", history_keys=request)
        assert read.lease is None and read.keys_matched == 0
    finally:
        await store.close()
