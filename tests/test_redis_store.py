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
        assert await store.heartbeat("h1") == ([], 300.0)
    finally:
        await store.close()
        server.stop()
