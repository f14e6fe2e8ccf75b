"""Clients given several registry addresses fail over, over real gRPC: to a replica that
answers when the first is down, and (on Redis) from a stopped replica to its twin with the
fleet's state intact."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest
from conftest import wait_for_watchers

from kvbridge import errors
from kvbridge.clients import AsyncRegistryClient, RegistryClient
from kvbridge.clients._base import STREAM_STABLE_S as STABLE
from kvbridge.clients._base import split_targets
from kvbridge.services.registry import RegistryConfig, RegistryServer, create_server


def _closed_port() -> int:
    """A port nothing listens on (connections are refused)."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return int(port)


def test_targets_are_split_and_checked() -> None:
    assert split_targets(" a:1, b:2 ,") == ["a:1", "b:2"]
    assert split_targets(["a:1"]) == ["a:1"]
    with pytest.raises(ValueError):
        split_targets(" , ")


def test_sync_client_skips_a_dead_address(threaded_registry: Any, kv: Any) -> None:
    dead = f"127.0.0.1:{_closed_port()}"
    with RegistryClient(f"{dead},{threaded_registry.target}", timeout=5.0) as client:
        started = time.monotonic()
        client.register_holder(**kv.holder_args("h1"))
        assert time.monotonic() - started < 2.0
        assert client.targets[client._active] == threaded_registry.target
        assert [h.holder_id for h in client.iter_holders()] == ["h1"]


async def test_async_client_skips_a_dead_address(registry_server: RegistryServer,
                                                 kv: Any) -> None:
    live = f"127.0.0.1:{registry_server.port}"
    async with AsyncRegistryClient([f"127.0.0.1:{_closed_port()}", live]) as client:
        await client.register_holder(**kv.holder_args("h1"))
        assert client.targets[client._active] == live


async def test_all_addresses_down_fails_within_the_budget(kv: Any) -> None:
    targets = [f"127.0.0.1:{_closed_port()}" for _ in range(2)]
    async with AsyncRegistryClient(targets, timeout=1.0) as client:
        started = time.monotonic()
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            await client.register_holder(**kv.holder_args("h1"))
        assert time.monotonic() - started < 1.5


async def test_failover_between_redis_replicas(redis_server: Any, redis_namespace: str,
                                               kv: Any) -> None:
    replicas: list[RegistryServer] = []
    for _ in range(2):
        server = await create_server(RegistryConfig(
            listen="127.0.0.1:0", metrics_listen="", backend="redis",
            redis_url=redis_server.url, redis_namespace=redis_namespace))
        await server.start()
        replicas.append(server)
    targets = [f"127.0.0.1:{r.port}" for r in replicas]
    try:
        async with AsyncRegistryClient(targets, timeout=5.0) as client:
            await client.register_holder(**kv.holder_args("h1", ttl=300.0))
            lease = (await client.grant_lease(**kv.grant_args("h1", "t1", "c1",
                                                              kv.tokens(8)))).lease
            await replicas[0].stop(0)  # the replica the client was using
            read = await client.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
            assert read.lease.lease_id == lease.lease_id and read.pin.pin_id
            assert client.targets[client._active] == targets[1]
            assert (await client.heartbeat("h1")).reclaimable_lease_ids == []
    finally:
        for r in replicas:
            await r.stop(0)


async def test_router_forwarding_moves_to_the_next_registry_replica(
        registry_server: RegistryServer, kv: Any) -> None:
    import grpc

    from kvbridge.clock import FakeClock
    from kvbridge.registry.v1 import registry_pb2 as reg_pb
    from kvbridge.router.v1 import router_pb2_grpc
    from kvbridge.services.router import RouterConfig
    from kvbridge.services.router import create_server as create_router

    registry = f"127.0.0.1:{_closed_port()},127.0.0.1:{registry_server.port}"
    router = await create_router(RouterConfig(listen="127.0.0.1:0", metrics_listen="",
                                              registry=registry), clock=FakeClock())
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    stub = router_pb2_grpc.RouterServiceStub(channel)
    request = reg_pb.AcquireReadRequest(tenant="t1", conversation_id="c1",
                                        block_hashes=kv.prompt_hashes(kv.tokens(8)))
    try:
        with pytest.raises(grpc.RpcError) as raised:  # the dead replica: prefill fails open
            await stub.AcquireRead(request)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        resp = await stub.AcquireRead(request)  # the next call goes to the live replica
        assert resp.miss_reason == reg_pb.MISS_REASON_NO_LEASE
    finally:
        await channel.close()
        await router.stop(0)


# ---- watch streams --------------------------------------------------------------------------


def test_sync_watch_opens_on_the_address_that_answers(threaded_registry: Any, kv: Any) -> None:
    dead = f"127.0.0.1:{_closed_port()}"
    with RegistryClient(f"{dead},{threaded_registry.target}") as client:
        client.register_holder(**kv.holder_args("h1"))
        stream = client.watch_leases()  # no reconnect_for: one try of each address
        granted: list[str] = []

        def grant() -> None:
            threaded_registry.wait_for_watchers()
            with RegistryClient(threaded_registry.target) as other:
                granted.append(other.grant_lease(**kv.grant_args("h1", "t1", "c1",
                                                                 kv.tokens(4))).lease.lease_id)

        producer = threading.Thread(target=grant)
        producer.start()
        event = next(stream)
        producer.join(10)
        stream.close()
        assert [event.lease_id] == granted
        assert client.targets[client._active] == threaded_registry.target


async def test_watch_with_every_address_down_gives_up_after_reconnect_for() -> None:
    targets = [f"127.0.0.1:{_closed_port()}" for _ in range(2)]
    async with AsyncRegistryClient(targets) as client:
        for reconnect_for, within in ((0.0, 1.0), (1.5, 4.0)):
            started = time.monotonic()
            with pytest.raises(errors.Unavailable):
                async for _ in client.watch_leases(reconnect_for=reconnect_for):
                    pass
            took = time.monotonic() - started
            assert took < within
            if reconnect_for:
                assert took >= 1.5  # it kept trying for reconnect_for


async def _redis_replicas(redis_server: Any, namespace: str, n: int) -> list[RegistryServer]:
    replicas: list[RegistryServer] = []
    for _ in range(n):
        server = await create_server(RegistryConfig(
            listen="127.0.0.1:0", metrics_listen="", backend="redis",
            redis_url=redis_server.url, redis_namespace=namespace))
        await server.start()
        replicas.append(server)
    return replicas


async def test_watch_moves_to_the_next_redis_replica_when_its_own_stops(
        redis_server: Any, redis_namespace: str, kv: Any) -> None:

    replicas = await _redis_replicas(redis_server, redis_namespace, 2)
    targets = [f"127.0.0.1:{r.port}" for r in replicas]
    lost: list[tuple[str, str]] = []
    resumed: list[str] = []
    seen: list[str] = []
    first = asyncio.Event()
    try:
        async with AsyncRegistryClient(targets, timeout=5.0) as writer, \
                AsyncRegistryClient(targets, timeout=5.0) as watcher:
            await writer.register_holder(**kv.holder_args("h1", ttl=300.0))

            async def watch() -> None:
                async for event in watcher.watch_leases(
                        tenant="t1", reconnect_for=10.0,
                        on_lost=lambda t, e: lost.append((t, e.message)),
                        on_resumed=resumed.append):
                    seen.append(event.conversation_id)
                    first.set()
                    if len(seen) == 2:
                        return

            task = asyncio.create_task(watch())
            await wait_for_watchers(replicas[0], 1)
            await writer.grant_lease(**kv.grant_args("h1", "t1", "before", kv.tokens(4)))
            await asyncio.wait_for(first.wait(), 5)
            started = time.monotonic()
            await replicas[0].stop(10.0)  # the watch does not hold the shutdown for its grace
            assert time.monotonic() - started < 5.0
            await wait_for_watchers(replicas[1], 1)
            assert lost == [(targets[0], "the registry is shutting down")]
            await _until(lambda: resumed)  # (told once its initial metadata is in)
            assert resumed == [targets[1]]
            await writer.grant_lease(**kv.grant_args("h1", "t1", "after", kv.tokens(4)))
            await asyncio.wait_for(task, 10)
            assert seen == ["before", "after"]
    finally:
        for r in replicas:
            await r.stop(0)


async def test_watch_without_reconnect_ends_with_its_replica(
        redis_server: Any, redis_namespace: str) -> None:

    replicas = await _redis_replicas(redis_server, redis_namespace, 2)
    targets = [f"127.0.0.1:{r.port}" for r in replicas]
    try:
        async with AsyncRegistryClient(targets) as watcher:
            async def watch() -> None:
                async for _ in watcher.watch_leases():
                    pass

            task = asyncio.create_task(watch())
            await wait_for_watchers(replicas[0], 1)
            await replicas[0].stop(10.0)
            with pytest.raises(errors.Unavailable, match="shutting down"):
                await asyncio.wait_for(task, 5)
    finally:
        for r in replicas:
            await r.stop(0)


async def _until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_watch_leaves_a_replica_that_vanished_without_a_word(
        registry_factory: Any, kv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.clients import _base
    from kvbridge.faultproxy import FaultProxy

    # Pings every 0.3 s (gRPC waits at least 1 s), 0.5 s for the ack (30 s, 10 s by default).
    short = {"grpc.keepalive_time_ms": 300, "grpc.keepalive_timeout_ms": 500,
             "grpc.http2.ping_timeout_ms": 500}
    assert set(short) <= {k for k, _ in _base.CHANNEL_OPTIONS}
    quick = [(k, short.get(k, v)) for k, v in _base.CHANNEL_OPTIONS]
    monkeypatch.setattr(_base, "CHANNEL_OPTIONS", quick)
    a, b = await registry_factory(), await registry_factory()
    proxy = FaultProxy("127.0.0.1", a.port)
    await proxy.start()
    lost: list[str] = []
    resumed: list[str] = []
    seen: list[str] = []
    try:
        async with AsyncRegistryClient([proxy.address, f"127.0.0.1:{b.port}"]) as watcher:
            async def watch() -> None:
                async for event in watcher.watch_leases(
                        reconnect_for=10.0, on_lost=lambda t, e: lost.append(t),
                        on_resumed=resumed.append):
                    seen.append(event.conversation_id)
                    return

            task = asyncio.create_task(watch())
            await wait_for_watchers(a, 1)
            started = time.monotonic()
            proxy.set(drop=True)  # a black hole: the connection stays open, nothing comes
            await _until(lambda: resumed)
            assert time.monotonic() - started < 5.0
            assert lost == [proxy.address] and resumed == [f"127.0.0.1:{b.port}"]
            async with AsyncRegistryClient(f"127.0.0.1:{b.port}") as writer:
                await writer.register_holder(**kv.holder_args("h1"))
                await writer.grant_lease(**kv.grant_args("h1", "t1", "on-b", kv.tokens(4)))
            await asyncio.wait_for(task, 10)
            assert seen == ["on-b"]
    finally:
        await proxy.stop()


async def test_a_registry_shutting_down_refuses_new_watches(registry_server: Any) -> None:
    registry_server.servicer.close_watches(errors.Unavailable("the registry is shutting down"))
    async with AsyncRegistryClient(f"127.0.0.1:{registry_server.port}") as client:
        with pytest.raises(errors.Unavailable, match="shutting down") as raised:
            async for _ in client.watch_leases(reconnect_for=0.5):
                pass
        assert raised.value.stream_ended is False  # type: ignore[attr-defined]


async def test_watch_reopens_after_its_replica_cut_it_and_gives_up_on_one_that_flaps(
        registry_server: Any) -> None:
    lost: list[str] = []
    resumed: list[str] = []
    async with AsyncRegistryClient(f"127.0.0.1:{registry_server.port}") as client:
        stream = client.watch_leases(reconnect_for=1.5, on_lost=lambda t, e: lost.append(e.reason),
                                     on_resumed=resumed.append)
        task = asyncio.create_task(stream.__anext__())
        # Cut for falling behind ("reconnect and re-list"): opened again on the same replica.
        await wait_for_watchers(registry_server, 1)
        await asyncio.sleep(STABLE)  # live long enough to count as a stream that worked
        registry_server.servicer.end_watches(errors.CapacityExhausted("watcher fell behind"))
        await _until(lambda: resumed)
        assert lost == ["CAPACITY_EXHAUSTED"] and len(resumed) == 1
        # Ended every time it opens: given up on after reconnect_for, not reopened forever.
        started = time.monotonic()
        while not task.done():
            registry_server.servicer.end_watches(errors.Unavailable("flapping"))
            await asyncio.sleep(0.02)
        with pytest.raises(errors.Unavailable, match="flapping") as raised:
            task.result()
        assert 1.4 < time.monotonic() - started < 5.0
        assert raised.value.stream_ended is True  # type: ignore[attr-defined]
        assert len(lost) >= 3 and set(lost[1:]) == {"UNAVAILABLE"}
