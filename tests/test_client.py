"""The blocking client, deadlines and retries, and the holder session, over real gRPC.

Registries run on their own thread and event loop (`threaded_registry`) with a FakeClock; the
holder session gets a FakeClock of its own, as a decode engine would have its own clock.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvbridge import errors
from kvbridge.clients import AsyncRegistryClient, HolderSession, RegistryClient, Revoked, seconds
from kvbridge.clock import FakeClock
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc

# Reconnect quickly to a registry that comes back on the same port.
_FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50),
                   ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 100)]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never speaks gRPC."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def closed_port() -> int:
    """A port nobody listens on (connections are refused)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# ---- the blocking client against a real registry --------------------------------------------


def test_sync_client_round_trip(sync_client, kv, threaded_registry):
    c = sync_client
    reg = c.register_holder(**kv.holder_args("h1", ttl=30.0))
    assert reg.holder.holder_id == "h1" and seconds(reg.limits.max_pin_ttl) == 30.0
    tokens = kv.tokens(10)
    granted = c.grant_lease(**kv.grant_args("h1", "t1", "c1", tokens))
    lease = c.get_lease(granted.lease.lease_id)
    assert lease.block_hashes == kv.lease_hashes(tokens)
    read = c.acquire_read("t1", "c1", kv.prompt_hashes(tokens), min_tokens=8)
    assert (read.matched_tokens, read.partial_block_tokens) == (8, 2)
    assert c.release_read(read.pin.pin_id) is True
    assert c.release_read(read.pin.pin_id) is False
    renewed = c.renew_leases([lease.lease_id], [("t1", "c1")])
    assert renewed.renewed_count == 2
    assert c.heartbeat("h1").expires_in.seconds == 30
    revoked = c.revoke_lease(lease.lease_id, "test", "h1")
    assert revoked.reclaimable
    drained = c.deregister_holder("h1")
    assert list(drained.reclaimable_lease_ids) == [lease.lease_id]
    [h] = c.list_holders().holders
    assert h.state == pb.HOLDER_STATE_DRAINING
    with pytest.raises(errors.LeaseNotFound):
        c.get_lease("l-missing")


def test_sync_iterators_walk_every_page(sync_client, kv):
    c = sync_client
    for i in range(4):
        c.register_holder(**kv.holder_args(f"h{i}"))
    ids = set()
    for i in range(11):
        ids.add(c.grant_lease(**kv.grant_args(f"h{i % 4}", "t1", f"c{i}",
                                              kv.tokens(4))).lease.lease_id)
    walked = [x.lease_id for x in c.iter_leases(page_size=3)]
    assert walked == sorted(ids)
    assert [x.lease_id for x in c.iter_leases(page_size=3, holder_id="h1")] == sorted(
        x.lease_id for x in c.list_leases(holder_id="h1").leases)
    assert [h.holder_id for h in c.iter_holders()] == ["h0", "h1", "h2", "h3"]


@pytest.mark.timeout(60)
def test_iter_leases_waits_out_the_callers_listing_rate(kv):
    """A broad listing takes more pages than the caller's listing rate lets through at once:
    each refused page is asked again after the refusal's retry_after_s, so the walk ends with
    every lease (it failed with RATE_LIMITED on its second page before); a rate too slow to
    wait for raises the refusal once max_wait is spent."""
    from conftest import ThreadedRegistry

    registry = ThreadedRegistry(list_rate_per_principal=10.0, list_burst_per_principal=1)
    try:
        with RegistryClient(registry.target) as c:
            c.register_holder(**kv.holder_args("h1"))
            ids = sorted(c.grant_lease(**kv.grant_args("h1", "t1", f"c{i}", kv.tokens(4)))
                         .lease.lease_id for i in range(10))
            stop = threading.Event()

            def time_passes() -> None:  # the registry's clock, which refills the bucket
                while not stop.wait(0.02):
                    registry.call(registry.clock.advance, 0.05)

            mover = threading.Thread(target=time_passes, daemon=True)
            mover.start()
            try:
                walked = [x.lease_id for x in c.iter_leases(page_size=3, tenant="t1")]
            finally:
                stop.set()
                mover.join()
            assert walked == ids  # 4 pages with a burst of 1
            with pytest.raises(errors.RateLimited):  # the clock stands still: no refill
                for _ in range(3):  # (the walk may have left the bucket a call)
                    list(c.iter_leases(page_size=3, tenant="t1", max_wait=0.3))
    finally:
        registry.close()


@pytest.mark.timeout(60)
def test_sync_watch_streams_until_the_caller_stops(sync_client, kv, threaded_registry):
    sync_client.register_holder(**kv.holder_args("h1"))

    def produce() -> None:
        threaded_registry.wait_for_watchers()
        with RegistryClient(threaded_registry.target) as other:
            for conv in ("a", "b"):
                other.grant_lease(**kv.grant_args("h1", "t1", conv, kv.tokens(4)))

    producer = threading.Thread(target=produce)
    producer.start()
    seen = []
    for event in sync_client.watch_leases(holder_id="h1"):
        seen.append((event.type, event.conversation_id))
        if len(seen) == 2:
            break
    producer.join(5)
    assert seen == [(pb.LEASE_EVENT_TYPE_GRANTED, "a"), (pb.LEASE_EVENT_TYPE_GRANTED, "b")]
    # Leaving the loop cancelled the stream: the registry dropped the watcher.
    deadline = time.monotonic() + 5
    while threaded_registry.watcher_count() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert threaded_registry.watcher_count() == 0


# ---- deadlines, unreachable registries, retries ---------------------------------------------


def test_sync_deadline_exceeded_when_nothing_answers(silent_port):
    with RegistryClient(f"127.0.0.1:{silent_port}", timeout=0.3) as client:
        start = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded):
            client.list_holders()
        assert 0.25 <= time.monotonic() - start < 2.0
        start = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded):
            client.get_lease("l-1", timeout=0.2)  # a per-call deadline overrides
        assert 0.15 <= time.monotonic() - start < 2.0


async def test_async_deadline_exceeded_when_nothing_answers(silent_port):
    async with AsyncRegistryClient(f"127.0.0.1:{silent_port}", timeout=0.3) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(errors.DeadlineExceeded):
            await client.heartbeat("h1")
        assert 0.25 <= loop.time() - start < 2.0


def test_sync_connection_refused_is_unavailable(closed_port):
    with RegistryClient(f"127.0.0.1:{closed_port}", timeout=2.0) as client:
        start = time.monotonic()
        with pytest.raises(errors.Unavailable):
            client.get_lease("l-1")
        assert time.monotonic() - start < 2.0  # refused fails fast, not at the deadline


async def test_async_connection_refused_is_unavailable(closed_port):
    async with AsyncRegistryClient(f"127.0.0.1:{closed_port}", timeout=2.0) as client:
        with pytest.raises(errors.Unavailable):
            await client.list_leases()


def test_errors_say_whether_the_call_may_have_taken_effect(closed_port, silent_port,
                                                           sync_client):
    """`maybe_applied`: False when no attempt reached a server or the server refused with a
    reason; True when one may have run (no reply in time)."""
    with (RegistryClient(f"127.0.0.1:{closed_port}", timeout=1.0) as refused,
          pytest.raises(errors.Unavailable) as never_sent):
        refused.grant_lease("h1", "t", "c", "r", [1], 4, b"\0" * 16)
    assert never_sent.value.maybe_applied is False  # type: ignore[attr-defined]
    with (RegistryClient(f"127.0.0.1:{silent_port}", timeout=0.3) as silent,
          pytest.raises(errors.DeadlineExceeded) as timed_out):
        silent.grant_lease("h1", "t", "c", "r", [1], 4, b"\0" * 16)
    assert timed_out.value.maybe_applied is True  # type: ignore[attr-defined]
    with pytest.raises(errors.HolderNotFound) as explained:
        sync_client.grant_lease("nobody", "t", "c", "r", [1], 4, b"\0" * 16)
    assert explained.value.maybe_applied is False  # type: ignore[attr-defined]


async def test_async_errors_say_whether_the_call_may_have_taken_effect(closed_port,
                                                                       silent_port):
    async with AsyncRegistryClient(f"127.0.0.1:{closed_port}", timeout=1.0) as refused:
        with pytest.raises(errors.Unavailable) as never_sent:
            await refused.grant_lease("h1", "t", "c", "r", [1], 4, b"\0" * 16)
    assert never_sent.value.maybe_applied is False  # type: ignore[attr-defined]
    async with AsyncRegistryClient(f"127.0.0.1:{silent_port}", timeout=0.3) as silent:
        with pytest.raises(errors.DeadlineExceeded) as timed_out:
            await silent.grant_lease("h1", "t", "c", "r", [1], 4, b"\0" * 16)
    assert timed_out.value.maybe_applied is True  # type: ignore[attr-defined]


class Flaky(pb_grpc.RegistryServiceServicer):
    """Answers UNAVAILABLE `failures` times per method, then succeeds; records requests."""

    def __init__(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.failures = failures
        self.code = code
        self.requests: dict[str, list[object]] = {}
        self.lock = threading.Lock()

    def _attempt(self, name: str, request: object, context: grpc.ServicerContext) -> None:
        with self.lock:
            seen = self.requests.setdefault(name, [])
            seen.append(request)
            fail = len(seen) <= self.failures
        if fail:
            context.abort(self.code, "flaky")

    def GetLease(self, request, context):
        self._attempt("GetLease", request, context)
        return pb.GetLeaseResponse(lease=pb.Lease(lease_id=request.lease_id))

    def GrantLease(self, request, context):
        self._attempt("GrantLease", request, context)
        return pb.GrantLeaseResponse(lease=pb.Lease(lease_id="l-1"))

    def AcquireRead(self, request, context):
        self._attempt("AcquireRead", request, context)
        return pb.AcquireReadResponse(miss_reason=pb.MISS_REASON_NO_LEASE)


@pytest.fixture
def flaky_server():
    """`flaky_server(failures, code)` -> (servicer, target)."""
    servers = []

    def make(failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        servicer = Flaky(failures, code)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistryServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield make
    for server in servers:
        server.stop(0)


def test_sync_client_retries_unavailable_then_succeeds(flaky_server):
    servicer, target = flaky_server(2)
    with RegistryClient(target, retries=3) as client:
        assert client.get_lease("l-7").lease_id == "l-7"
        assert len(servicer.requests["GetLease"]) == 3
        # A grant retried after lost replies keeps its request id: the registry dedupes it.
        assert client.grant_lease("h1", "t1", "c1", "r", [1], 4, b"\x00" * 16).lease.lease_id
        ids = {r.request_id for r in servicer.requests["GrantLease"]}
        assert len(servicer.requests["GrantLease"]) == 3 and len(ids) == 1 and "" not in ids
        client.acquire_read("t1", "c1", b"")
        ids = {r.request_id for r in servicer.requests["AcquireRead"]}
        assert len(servicer.requests["AcquireRead"]) == 3 and len(ids) == 1 and "" not in ids


async def test_async_client_retries_unavailable_then_succeeds(flaky_server):
    servicer, target = flaky_server(2)
    async with AsyncRegistryClient(target, retries=3) as client:
        assert (await client.get_lease("l-7")).lease_id == "l-7"
        await client.grant_lease("h1", "t1", "c1", "r", [1], 4, b"\x00" * 16)
    assert len(servicer.requests["GetLease"]) == 3
    assert len({r.request_id for r in servicer.requests["GrantLease"]}) == 1


def test_retries_are_bounded_by_count_and_deadline(flaky_server):
    servicer, target = flaky_server(100)
    with RegistryClient(target, retries=1) as client, pytest.raises(errors.Unavailable):
        client.get_lease("l-1")
    assert len(servicer.requests["GetLease"]) == 2
    servicer.requests.clear()
    with RegistryClient(target, retries=1000, timeout=0.4) as client:
        start = time.monotonic()
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            client.get_lease("l-1")
        assert time.monotonic() - start < 1.0  # the deadline bounds the retries
    assert 1 < len(servicer.requests["GetLease"]) < 1000


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.DEADLINE_EXCEEDED])
def test_other_failures_are_not_retried(flaky_server, code):
    servicer, target = flaky_server(100, code)
    with RegistryClient(target, retries=5) as client, pytest.raises(errors.KvbridgeError):
        client.get_lease("l-1")
    assert len(servicer.requests["GetLease"]) == 1


# ---- HolderSession --------------------------------------------------------------------------


class Engine:
    """What a decode engine gives the session: a reclaim callback that records frees."""

    def __init__(self) -> None:
        self.freed: list[list[str]] = []
        self.fail = False

    def on_reclaim(self, lease_ids: list[str]) -> None:
        if self.fail:
            raise RuntimeError("engine busy")
        self.freed.append(sorted(lease_ids))


@pytest.fixture
def engine() -> Engine:
    return Engine()


@pytest.fixture
def holder_clock() -> FakeClock:
    return FakeClock(start=50_000.0)


def make_session(client: RegistryClient, kv, engine: Engine, clock: FakeClock,
                 **kw) -> HolderSession:
    # ttl 300 s: the background heartbeat (every ttl/3 of real time) never fires in a test.
    args = dict(holder_id="decode-0", nixl_host="10.1.2.3", nixl_port=5601,
                block_size=kv.block_size, engine_fingerprint=kv.fingerprint, ttl=300.0,
                hard_deadline_margin=5.0, clock=clock)
    args.update(kw)
    return HolderSession(client, on_reclaim=engine.on_reclaim, **args)


def session_grant(session: HolderSession, kv, conv: str, n_tokens: int = 8, **kw):
    args = kv.grant_args(session.holder_id, "t1", conv, kv.tokens(n_tokens))
    return session.grant(args["tenant"], conv, args["remote_request_id"], args["block_ids"],
                         args["token_count"], args["block_hashes"], **kw)


def test_session_start_registers_and_close_drains(sync_client, kv, engine, holder_clock):
    session = make_session(sync_client, kv, engine, holder_clock)
    assert session.grant("t1", "c1", "r", [1], 4, b"\0" * 16) is None  # not registered yet
    session.start()
    try:
        assert session.registered and session.last_ok == holder_clock.monotonic()
        assert session.max_pin_ttl == 30.0
        [h] = sync_client.list_holders().holders
        assert (h.holder_id, h.nixl_host, h.nixl_port, seconds(h.ttl)) == (
            "decode-0", "10.1.2.3", 5601, 300.0)
        lease = session_grant(session, kv, "c1")
        assert lease is not None and lease.state == pb.LEASE_STATE_ACTIVE
        [held] = session.held()
        assert held.lease_id == lease.lease_id
        assert held.hard_deadline == holder_clock.monotonic() + 3600 + 30 + 5
    finally:
        session.close()
    assert engine.freed == [[lease.lease_id]]  # drained: freed at once (no pin)
    [h] = sync_client.list_holders().holders
    assert h.state == pb.HOLDER_STATE_DRAINING
    assert session.held() == []


def test_session_heartbeat_frees_reclaimable_and_acks_them(sync_client, kv, engine,
                                                           holder_clock, threaded_registry):
    session = make_session(sync_client, kv, engine, holder_clock)
    session.start()
    try:
        a = session_grant(session, kv, "a")
        b = session_grant(session, kv, "b", idle_ttl=5.0)
        c = session_grant(session, kv, "c")
        sync_client.revoke_lease(a.lease_id, "operator")
        threaded_registry.advance(6)  # b expires
        session.heartbeat_once()
        assert engine.freed == [sorted([a.lease_id, b.lease_id])]
        assert [x.lease_id for x in session.held()] == [c.lease_id]
        # The registry still has them until the next heartbeat acknowledges the frees.
        assert {x.lease_id for x in sync_client.list_leases(include_inactive=True).leases} == {
            a.lease_id, b.lease_id, c.lease_id}
        session.heartbeat_once()
        assert engine.freed == [sorted([a.lease_id, b.lease_id])]  # nothing freed twice
        assert [x.lease_id for x in sync_client.list_leases(include_inactive=True).leases] == [
            c.lease_id]
        with pytest.raises(errors.LeaseNotFound):
            sync_client.get_lease(a.lease_id)
    finally:
        session.close(deregister=False)


def test_session_keeps_pinned_leases_until_the_pin_ends(sync_client, kv, engine, holder_clock):
    session = make_session(sync_client, kv, engine, holder_clock)
    session.start()
    try:
        lease = session_grant(session, kv, "c1")
        read = sync_client.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
        # Revoking through the session frees nothing while a reader holds a pin.
        assert session.revoke([lease.lease_id]) == Revoked([], [lease.lease_id], [])  # pinned
        session.heartbeat_once()
        assert engine.freed == []
        sync_client.release_read(read.pin.pin_id)
        session.heartbeat_once()
        assert engine.freed == [[lease.lease_id]]
    finally:
        session.close(deregister=False)


def test_session_retries_a_failed_reclaim_callback(sync_client, kv, engine, holder_clock):
    session = make_session(sync_client, kv, engine, holder_clock)
    session.start()
    try:
        lease = session_grant(session, kv, "c1")
        sync_client.revoke_lease(lease.lease_id)
        engine.fail = True
        session.heartbeat_once()  # the callback raised: nothing freed, nothing acked
        assert [x.lease_id for x in session.held()] == [lease.lease_id]
        engine.fail = False
        session.heartbeat_once()
        assert engine.freed == [[lease.lease_id]] and session.held() == []
    finally:
        session.close(deregister=False)


def test_a_registration_while_blocks_are_freed_does_not_list_them(sync_client, kv, engine,
                                                                  holder_clock):
    """The grant thread may register (the registry restarted) while the heartbeat thread is
    freeing reclaimed blocks: that registration must not list the lease being freed, or a
    registry without it would restore it as readable over freed blocks."""
    session = make_session(sync_client, kv, engine, holder_clock)
    session.start()
    listed: list[list[str]] = []
    register = sync_client.register_holder

    def spy(*args, **kw):
        listed.append([s.lease_id for s in kw.get("held_leases", ())])
        return register(*args, **kw)

    def free_while_registering(lease_ids: list[str]) -> None:
        if not listed:
            session._register()  # as the grant thread would, at this moment
        engine.freed.append(sorted(lease_ids))

    try:
        keep = session_grant(session, kv, "keep")
        gone = session_grant(session, kv, "gone")
        sync_client.revoke_lease(gone.lease_id)
        sync_client.register_holder = spy  # type: ignore[method-assign]
        session.on_reclaim = free_while_registering
        session.heartbeat_once()
        assert engine.freed == [[gone.lease_id]]
        assert listed == [[keep.lease_id]], listed
    finally:
        sync_client.register_holder = register  # type: ignore[method-assign]
        session.close(deregister=False)


def _until_unreachable(client: RegistryClient, timeout: float = 10.0) -> None:
    """Wait until calls find the stopped registry gone (refused at connect). One made while its
    connection was closing may have reached it: that grant's outcome is unknown, as the
    session's tests of unknown outcomes cover."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.get_server_info(timeout=0.5)
        except errors.Unavailable:
            return
        assert time.monotonic() < deadline, "the stopped registry still answers"
        time.sleep(0.01)


def test_session_hard_deadline_frees_when_registry_is_gone(sync_client, kv, engine,
                                                           holder_clock, threaded_registry):
    session = make_session(sync_client, kv, engine, holder_clock)
    session.start()
    try:
        short = session_grant(session, kv, "short", idle_ttl=10.0, max_lifetime=100.0)
        long = session_grant(session, kv, "long", idle_ttl=10.0, max_lifetime=1000.0)
        threaded_registry.stop()  # the registry is gone for good
        _until_unreachable(sync_client)
        assert session_grant(session, kv, "new") is None  # outages never raise into the engine
        # Hard deadline: max lifetime + max pin TTL (30 s) + margin (5 s), from the grant.
        holder_clock.advance(100 + 30 + 5 - 0.5)
        session.heartbeat_once()
        assert engine.freed == []
        holder_clock.advance(0.5)
        session.heartbeat_once()
        assert engine.freed == [[short.lease_id]]
        assert [x.lease_id for x in session.held()] == [long.lease_id]
        holder_clock.advance(900)
        session.heartbeat_once()
        assert engine.freed == [[short.lease_id], [long.lease_id]]
        assert session.held() == []
    finally:
        session.close(deregister=False)


def _reregister(session: HolderSession, registry) -> None:
    """Heartbeat until the session has found the restarted (empty) registry and registered
    again with its held leases (HOLDER_NOT_FOUND -> re-register)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        session.heartbeat_once()
        if registry.call(lambda: registry.table.counts()["holders"]):
            return
        time.sleep(0.02)


def test_session_reregisters_after_registry_restart_and_restores_leases(
        kv, engine, holder_clock, threaded_registry):
    channel = grpc.insecure_channel(threaded_registry.target, options=_FAST_RECONNECT)
    client = RegistryClient(threaded_registry.target, timeout=1.0, channel=channel)
    session = make_session(client, kv, engine, holder_clock)
    session.start()
    try:
        tokens = kv.tokens(10)
        lease = session_grant(session, kv, "c1", 10)
        holder_clock.advance(7)
        threaded_registry.restart_fresh()  # same port, empty state
        assert threaded_registry.call(lambda: threaded_registry.table.counts()) == {
            "leases_active": 0, "leases_total": 0, "holders": 0, "pins": 0, "history_keys": 0}
        _reregister(session, threaded_registry)
        restored = client.get_lease(lease.lease_id)
        assert restored.state == pb.LEASE_STATE_ACTIVE
        assert (restored.tenant, restored.conversation_id, restored.epoch) == ("t1", "c1", 1)
        assert list(restored.block_ids) == [100, 101, 102]
        assert restored.block_hashes == kv.lease_hashes(tokens)
        assert engine.freed == []
        assert [x.lease_id for x in session.held()] == [lease.lease_id]
        # Readers find it again on the new registry.
        read = client.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
        assert read.miss_reason == pb.MISS_REASON_UNSPECIFIED and read.matched_tokens == 8
    finally:
        session.close(deregister=False)
        client.close()


def test_session_restores_many_held_leases_in_pages(kv, engine, holder_clock,
                                                    threaded_registry):
    """Issue 32, item 4: a holder that retains more leases than one RegisterHolder call may
    carry re-registers in pages, each call listing every id: all are restored, none revoked,
    and the session learns the registry's page size."""
    channel = grpc.insecure_channel(threaded_registry.target, options=_FAST_RECONNECT)
    client = RegistryClient(threaded_registry.target, timeout=1.0, channel=channel)
    session = make_session(client, kv, engine, holder_clock)
    session.start()
    try:
        assert session.held_per_call == 512  # the registry's default, from its reply
        leases = [session_grant(session, kv, f"c{i}", 8) for i in range(7)]
        session.held_per_call = 3  # seven leases: three calls of 3, 3 and 1
        threaded_registry.restart_fresh()  # same port, empty state
        _reregister(session, threaded_registry)
        counts = threaded_registry.call(lambda: threaded_registry.table.counts())
        assert counts["leases_active"] == 7 and counts["leases_total"] == 7
        for lease in leases:
            assert client.get_lease(lease.lease_id).state == pb.LEASE_STATE_ACTIVE
        assert engine.freed == [] and len(session.held()) == 7
        assert session.held_per_call == 512
    finally:
        session.close(deregister=False)
        client.close()


def test_session_frees_leases_lost_with_a_missed_ttl(sync_client, kv, engine, holder_clock,
                                                     threaded_registry):
    session = make_session(sync_client, kv, engine, holder_clock, ttl=30.0)
    session.start()
    try:
        lease = session_grant(session, kv, "c1")
        threaded_registry.advance(31)  # the engine stalled past its TTL
        session.heartbeat_once()  # HOLDER_NOT_FOUND -> re-register; the lease stays dead
        assert session.registered
        assert engine.freed == [[lease.lease_id]]
        assert sync_client.get_lease(lease.lease_id).state == pb.LEASE_STATE_HOLDER_LOST
        session.heartbeat_once()
        with pytest.raises(errors.LeaseNotFound):
            sync_client.get_lease(lease.lease_id)
    finally:
        session.close(deregister=False)


def test_session_grant_reregisters_a_holder_the_registry_lost(sync_client, kv, engine,
                                                              holder_clock, threaded_registry):
    # Heartbeats starved past the TTL (a busy engine start): the next grant must not be lost.
    session = make_session(sync_client, kv, engine, holder_clock, ttl=30.0)
    session.start()
    try:
        threaded_registry.advance(31)
        threaded_registry.call(threaded_registry.table.tick)
        with pytest.raises(errors.HolderNotFound):
            sync_client.heartbeat("decode-0")
        lease = session_grant(session, kv, "c1")
        assert lease is not None and session.registered
        assert sync_client.get_lease(lease.lease_id).state == pb.LEASE_STATE_ACTIVE
        assert [x.lease_id for x in session.held()] == [lease.lease_id]
    finally:
        session.close(deregister=False)


def test_session_never_frees_a_pinned_lease_lost_with_a_missed_ttl(
        sync_client, kv, engine, holder_clock, threaded_registry):
    """DESIGN invariant 3: a lease is never reclaimed while one of its pins is live, even when
    the holder lost it by missing its TTL and re-registers."""
    session = make_session(sync_client, kv, engine, holder_clock, ttl=20.0)
    session.start()
    try:
        lease = session_grant(session, kv, "c1")
        read = sync_client.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)),
                                        pin_ttl=30.0)
        threaded_registry.advance(21)  # the engine stalled past its TTL; the reader reads on
        assert sync_client.get_lease(lease.lease_id).pin_count == 1
        session.heartbeat_once()  # re-registers
        assert session.registered
        assert engine.freed == []  # the pin is live: the blocks must stay
        sync_client.release_read(read.pin.pin_id)
        session.heartbeat_once()
        assert engine.freed == [[lease.lease_id]]
    finally:
        session.close(deregister=False)
