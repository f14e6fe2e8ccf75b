"""Issue 38, item 2: the Redis store reaches Redis over TLS (`rediss://`) and follows a
Sentinel-managed primary (`redis+sentinel://`), through redis-py.

URL checks are unit tests. TLS runs a real redis-server with a TLS port that requires client
certificates. Sentinel runs a primary, a replica and three sentinels on 127.0.0.1, a real gRPC
registry on the Sentinel URL, and a stream of turns (a decode holder through `HolderSession`,
readers through `AsyncRegistryClient`) while the primary is killed: no turn fails (reads fail
open), no read names a lease the holder does not hold as its conversation's latest, and grants
succeed again within the sentinels' failover time plus 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from conftest import KvKit, RedisProcess, stop_process
from redis.asyncio.connection import SSLConnection
from test_auth import _pki
from test_store_contract import grant_spec, holder

from kvbridge import errors
from kvbridge.clients import AsyncRegistryClient, GrantOutcomeUnknown, HolderSession, RegistryClient
from kvbridge.clock import SystemClock
from kvbridge.ids import grant_lease_id
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.services.registry import RegistryConfig, create_server
from kvbridge.services.registry._redis import RedisStore
from kvbridge.services.registry._redis_calls import connect
from kvbridge.services.registry._redis_url import check_url, redacted, sentinel_parts

SERVICE = "kvb"
DOWN_AFTER_MS = 1000
# Both may become the primary: a full sync starts at once, not 5 s later.
SERVER = ("--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0")
MARGIN_S = 2.0  # the bound: serving again within the failover time plus this


# ==== URL checks ==============================================================================

@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "127.0.0.1:6379", "sentinel://a/kvb",
                                 "cluster://a:1"])
def test_a_bad_scheme_names_the_accepted_ones(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_url(url)
    message = str(caught.value)
    for scheme in ("redis://", "rediss://", "unix", "redis+sentinel://", "rediss+sentinel",
                   "redis+cluster://", "rediss+cluster"):
        assert scheme in message, message


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://127.0.0.1:26379", "name the Sentinel service"),
    ("redis+sentinel://127.0.0.1:26379/", "name the Sentinel service"),
    ("redis+sentinel://a:26379,b:x/kvb", "bad sentinel address 'b:x'"),
    ("redis+cluster://a:1/0", "database 0 only"),
    ("redis+cluster://a:1,b:0", "bad cluster node address 'b:0'"),
    ("rediss+cluster://a:1,,b", "bad cluster node address ''"),
    ("redis+sentinel://a:99999/kvb", "bad sentinel address 'a:99999'"),
    ("redis+sentinel://a:26379,,b:26379/kvb", "bad sentinel address ''"),
    ("rediss+sentinel://a:26379/kvb/zero", "the database must be a number"),
])
def test_bad_sentinel_urls_say_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match="redis_url") as caught:
        check_url(url)
    assert says in str(caught.value)


def test_sentinel_urls_are_split_into_sentinels_service_and_primary() -> None:
    sentinels, service, plain = sentinel_parts(
        "rediss+sentinel://app:pw@s1:26380,[::1]:26381,s3/kvb/2?ssl_ca_certs=/ca.pem")
    assert sentinels == [("s1", 26380), ("::1", 26381), ("s3", 26379)]
    assert service == "kvb"
    assert plain == "rediss://app:pw@primary/2?ssl_ca_certs=/ca.pem"
    assert sentinel_parts("redis+sentinel://s1/kvb")[2] == "redis://primary/0"


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379/0", "redis+sentinel://a:1,b:2",
                                 "redis+sentinel://a:1/kvb/db0"])
def test_the_registry_config_refuses_a_bad_url_at_construction(url: str) -> None:
    with pytest.raises(ValueError, match="redis_url"):
        RegistryConfig(backend="redis", redis_url=url)
    RegistryConfig(backend="memory", redis_url=url)  # only the redis backend uses it


def test_good_urls_pass() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://r.example:6380/0?ssl_ca_certs=/ca.pem",
                "unix:///run/redis.sock?db=1", "redis+sentinel://s1:26379,s2:26379/kvb/0",
                "rediss+sentinel://u:p@s1/kvb?sentinel_password=x"):
        check_url(url)
        RegistryConfig(backend="redis", redis_url=url)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://app:s3cret@r:6379/0", "redis://***@r:6379/0"),
    ("redis://app:s3c@ret@r:6379/0", "redis://***@r:6379/0"),  # an unescaped "@"
    ("redis+sentinel://:s3cret@a:1,b:2/kvb?sentinel_password=s3cret&ssl_ca_certs=/ca.pem",
     "redis+sentinel://***@a:1,b:2/kvb?sentinel_password=***&ssl_ca_certs=/ca.pem"),
    ("unix:///run/r@dis.sock?db=0&password=s3cret", "unix:///run/r@dis.sock?db=0&password=***"),
    ("redis://r:6379/0", "redis://r:6379/0"),
])
def test_redacted_hides_passwords(url: str, shown: str) -> None:
    assert redacted(url) == shown
    with pytest.raises(ValueError) as caught:  # the checks' messages show the redacted form
        check_url(url.replace("://", "+nope://", 1))
    assert "s3cret" not in str(caught.value) and "ret@" not in str(caught.value)


# ==== TLS =====================================================================================

def _free_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    return port


@dataclass
class TlsRedis:
    server: RedisProcess
    tls_port: int
    pki: dict[str, str]

    def url(self, *, client_cert: bool = True, ca: str | None = None) -> str:
        query = f"ssl_ca_certs={ca or self.pki['ca']}"
        if client_cert:
            query += f"&ssl_certfile={self.pki['client_cert']}&ssl_keyfile={self.pki['client_key']}"
        return f"rediss://127.0.0.1:{self.tls_port}/0?{query}"


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TlsRedis]:
    """A redis-server with a plain port (for readiness and inspection) and a TLS port that
    requires a client certificate signed by the test CA."""
    pki = _pki(tmp_path)
    for _attempt in range(5):  # the free port may be taken before redis-server binds it
        port = _free_port()
        server = RedisProcess(*SERVER, "--tls-port", str(port), "--tls-cert-file", pki["cert"],
                              "--tls-key-file", pki["key"], "--tls-ca-cert-file", pki["ca"],
                              "--tls-auth-clients", "yes")
        if _listening(port):
            break
        server.stop()
    else:
        raise RuntimeError("could not start redis-server with TLS")
    yield TlsRedis(server, port, pki)
    server.stop()


def _listening(port: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return True
        time.sleep(0.05)
    return False


async def test_a_store_on_rediss_grants_and_reads(tls_redis: TlsRedis, kv: KvKit,
                                                  redis_namespace: str) -> None:
    config = RegistryConfig(backend="redis", redis_url=tls_redis.url(),
                            redis_namespace=redis_namespace)
    store = RedisStore(config, SystemClock())
    await store.start()
    try:
        await store.register_holder(holder())
        tokens = kv.tokens(10)
        lease = (await store.grant(grant_spec(kv, tokens))).lease
        read = await store.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
        assert read.lease is not None and read.lease.lease_id == lease.lease_id
        assert read.matched_blocks == 2 and read.pin is not None
        assert (await store.get_lease(lease.lease_id)).token_count == 10
    finally:
        await store.close()
    # It went to this Redis (the plain port shows the same data).
    plain = aioredis.Redis.from_url(tls_redis.server.url)
    try:
        assert await plain.keys("{" + redis_namespace + "}:*")
    finally:
        await plain.aclose()


@pytest.mark.parametrize("how", ["no client certificate", "a CA that did not sign the server"])
async def test_a_store_refused_by_tls_fails_to_start_and_writes_nothing(
        tls_redis: TlsRedis, tmp_path: Path, redis_namespace: str, how: str) -> None:
    if how == "no client certificate":
        url = tls_redis.url(client_cert=False)
    else:
        other = tmp_path / "other"
        other.mkdir()
        url = tls_redis.url(ca=_pki(other)["ca"])
    plain = aioredis.Redis.from_url(tls_redis.server.url)
    try:
        before = await plain.dbsize()
        store = RedisStore(RegistryConfig(backend="redis", redis_url=url,
                                          redis_namespace=redis_namespace), SystemClock())
        started = time.monotonic()
        with pytest.raises(OSError) as caught:
            await store.start()
        assert time.monotonic() - started < 10.0
        message = str(caught.value)
        assert message.startswith("cannot reach Redis at rediss://127.0.0.1:"), message
        if how != "no client certificate":  # the client refuses the server: it says why
            assert "certificate verify failed" in message, message
        else:  # the server just drops the connection: the message says what may be missing
            assert "needs a client certificate: add ssl_certfile" in message, message
        assert await plain.dbsize() == before
        assert not await plain.keys("{" + redis_namespace + "}:*")
        await store.close()  # closing again is harmless
    finally:
        await plain.aclose()


async def test_a_sentinel_url_sets_the_primarys_and_the_sentinels_options() -> None:
    """The user part and database go to the primary; sentinel_username/sentinel_password to
    the sentinels only; TLS (rediss+sentinel) and its files to both."""
    client = connect("rediss+sentinel://app:pw@127.0.0.1:1,127.0.0.1:2/kvb/3?ssl_ca_certs=/ca"
                     "&sentinel_username=mon&sentinel_password=spw", socket_timeout=5.0)
    try:
        pool = client.connection_pool
        primary = pool.connection_kwargs
        assert issubclass(pool.connection_class, SSLConnection)
        assert (primary["username"], primary["password"], primary["db"]) == ("app", "pw", 3)
        assert (primary["ssl_ca_certs"], primary["socket_timeout"]) == ("/ca", 5.0)
        assert not any(k.startswith("sentinel_") for k in primary)
        sentinels = client.sentinel_manager.sentinels
        assert [(s.connection_pool.connection_kwargs["host"],
                 s.connection_pool.connection_kwargs["port"]) for s in sentinels] == [
            ("127.0.0.1", 1), ("127.0.0.1", 2)]
        for sentinel in sentinels:
            own = sentinel.connection_pool.connection_kwargs
            assert issubclass(sentinel.connection_pool.connection_class, SSLConnection)
            assert (own["username"], own["password"], own["ssl_ca_certs"]) == ("mon", "spw",
                                                                               "/ca")
            assert own.get("db", 0) == 0
    finally:
        await client.aclose()


async def test_a_store_follows_a_tls_sentinel_with_its_own_password(
        tls_redis: TlsRedis, tmp_path: Path, kv: KvKit, redis_namespace: str) -> None:
    """rediss+sentinel: a sentinel on TLS with a password of its own, monitoring the primary
    over TLS; the store asks it for the primary and reaches that over TLS too. A wrong
    sentinel password is refused at start."""
    pki = tls_redis.pki
    sentinel = SentinelProcess(tmp_path, tls_redis.tls_port, quorum=1, tls=pki,
                               password="sentinel-pw")
    try:
        files = (f"ssl_ca_certs={pki['ca']}&ssl_certfile={pki['client_cert']}"
                 f"&ssl_keyfile={pki['client_key']}")
        url = (f"rediss+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}/0?{files}"
               "&sentinel_password=sentinel-pw")
        store = RedisStore(RegistryConfig(backend="redis", redis_url=url,
                                          redis_namespace=redis_namespace), SystemClock())
        await store.start()
        try:
            await store.register_holder(holder())
            lease = (await store.grant(grant_spec(kv, kv.tokens(8)))).lease
            read = await store.acquire_read("t1", "c1", kv.prompt_hashes(kv.tokens(8)))
            assert read.lease is not None and read.lease.lease_id == lease.lease_id
        finally:
            await store.close()
        plain = aioredis.Redis.from_url(tls_redis.server.url)  # it is this primary's data
        try:
            assert await plain.keys("{" + redis_namespace + "}:*")
        finally:
            await plain.aclose()
        wrong = RedisStore(RegistryConfig(
            backend="redis", redis_url=url.replace("=sentinel-pw", "=nope"),
            redis_namespace=redis_namespace + "x"), SystemClock())
        with pytest.raises(OSError, match=r"No master found.*invalid username-password"):
            await wrong.start()
    finally:
        sentinel.stop()


# ==== Sentinel ================================================================================

class SentinelProcess:
    """A `redis-server --sentinel` this test started, stopped by its PID."""

    def __init__(self, home: Path, primary_port: int, *, quorum: int = 2,
                 tls: dict[str, str] | None = None, password: str = "") -> None:
        """`tls`: certificates (`_pki`) for a sentinel on a TLS port only, that also reaches
        the primary over TLS; `password`: the sentinel's own (`requirepass`)."""
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed")
        for _attempt in range(5):  # the free port may be taken before the sentinel binds it
            self.port = _free_port()
            conf = home / f"sentinel-{self.port}.conf"  # the sentinel rewrites it: its own
            own = [f"port {self.port}"] if tls is None else [
                "port 0", f"tls-port {self.port}", f"tls-cert-file {tls['cert']}",
                f"tls-key-file {tls['key']}", f"tls-ca-cert-file {tls['ca']}",
                f"tls-client-cert-file {tls['client_cert']}",
                f"tls-client-key-file {tls['client_key']}", "tls-replication yes",
                "tls-auth-clients yes"]
            if password:
                own.append(f"requirepass {password}")
            conf.write_text("\n".join([
                *own, "bind 127.0.0.1", f"dir {home}",
                f"logfile {home}/sentinel-{self.port}.log",
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} {quorum}",
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {SERVICE} 10000", ""]))
            self.proc = subprocess.Popen([exe, str(conf), "--sentinel"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if _listening(self.port) and self.proc.poll() is None:
                return
            self.stop()
        raise RuntimeError("could not start redis-server --sentinel")

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass
class SentinelFleet:
    primary: RedisProcess
    replica: RedisProcess
    sentinels: list[SentinelProcess]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"


async def _until(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            last = await check()
            if last is True:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} within {timeout}s (last: {last!r})")


@pytest.fixture
async def sentinel_fleet(tmp_path: Path) -> AsyncIterator[SentinelFleet]:
    """A primary, its replica (in sync) and three sentinels that all see each other and the
    replica."""
    started: list[Any] = []
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        primary = RedisProcess(*SERVER, "--dir", str(tmp_path / "a"))
        started.append(primary)
        replica = RedisProcess(*SERVER, "--dir", str(tmp_path / "b"), "--replicaof",
                               "127.0.0.1", str(primary.port))
        started.append(replica)
        sentinels = []
        for _ in range(3):
            sentinels.append(SentinelProcess(tmp_path, primary.port))
            started.append(sentinels[-1])
        fleet = SentinelFleet(primary, replica, sentinels)

        async def synced() -> Any:
            async with aioredis.Redis(host="127.0.0.1", port=replica.port) as r:
                link = (await r.info("replication")).get("master_link_status")
                return link == "up" or link

        await _until("the replica syncs", synced, 15.0)
        for s in sentinels:
            async def sees(s: SentinelProcess = s) -> Any:
                async with aioredis.Redis(host="127.0.0.1", port=s.port) as r:
                    m = await r.sentinel_master(SERVICE)
                    return (m["num-other-sentinels"], m["num-slaves"]) == (2, 1) or m
            await _until(f"sentinel {s.port} sees the others and the replica", sees, 20.0)
        yield fleet
    finally:
        for proc in reversed(started):
            proc.stop()


@dataclass
class Stream:
    """What the turns saw, on the test's monotonic clock."""

    turns: int = 0
    hits: list[float] = field(default_factory=list)  # when each read that hit was sent
    recomputes: int = 0  # reads that failed (fail open) or missed
    read_errors: int = 0
    misses: dict[str, int] = field(default_factory=dict)  # by reason (a first turn misses)
    unleased: int = 0  # turns whose grant failed: their KV is not leased
    grants: list[tuple[float, float]] = field(default_factory=list)  # successful: sent, done
    failed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)


class Decode:
    """The decode side: a `HolderSession` (register, heartbeat, re-register with the leases it
    holds when the registry no longer knows it), and what each conversation's latest lease is."""

    def __init__(self, target: str, kv: KvKit) -> None:
        self.client = RegistryClient(target, timeout=1.0)
        self.session = HolderSession(
            self.client, holder_id="decode-0", nixl_host="127.0.0.1", nixl_port=5600,
            block_size=kv.block_size, engine_fingerprint=kv.fingerprint,
            on_reclaim=lambda ids: None, ttl=3.0)
        # conversation -> the lease ids a read may name: its latest granted lease, and those
        # of later grants whose outcome is unknown (they may exist; the session keeps their
        # blocks until it knows).
        self.latest: dict[str, set[str]] = {}
        self.blocks: dict[str, list[int]] = {}  # lease id -> its block ids
        self.registered_at: list[float] = []  # when each registration succeeded
        register = self.client.register_holder

        def registering(*args: Any, **kwargs: Any) -> Any:
            reply = register(*args, **kwargs)
            self.registered_at.append(time.monotonic())
            return reply

        self.client.register_holder = registering  # type: ignore[method-assign]

    def may_read(self, conversation: str, lease_id: str) -> bool:
        if lease_id not in self.latest.get(conversation, set()):
            return False
        held = {lease.lease_id for lease in self.session.held()}
        pending = {grant_lease_id(self.session.holder_id, request_id)
                   for request_id in self.session.pending_grants()}
        return lease_id in held | pending


async def _turns(decode: Decode, reader: AsyncRegistryClient, kv: KvKit, name: str,
                 stream: Stream, stop: asyncio.Event, block_ids: Iterator[int]) -> None:
    """One conversation after another (each at most 12 turns), turn after turn until `stop`."""
    for n in itertools.count():
        conversation = f"{name}-{n}"
        history: list[int] = []
        for turn in range(12):
            if stop.is_set():
                return
            history = history + kv.tokens(9, start=1000 * turn + len(history))  # the prompt
            stream.turns += 1
            sent = time.monotonic()
            try:
                read = await reader.acquire_read("t1", conversation, kv.prompt_hashes(history))
            except (errors.Unavailable, errors.DeadlineExceeded):
                stream.read_errors += 1
                stream.recomputes += 1
                read = None
            except Exception as exc:  # anything else escaping fails the turn
                stream.failed.append(f"{conversation} turn {turn}: read: {exc!r}")
                read = None
            if read is not None and read.miss_reason != pb.MISS_REASON_UNSPECIFIED:
                stream.recomputes += 1
                reason = pb.MissReason.Name(read.miss_reason)
                stream.misses[reason] = stream.misses.get(reason, 0) + 1
            elif read is not None:
                stream.hits.append(sent)
                lease_id = read.lease.lease_id
                blocks = decode.blocks.get(lease_id, [])
                if not decode.may_read(conversation, lease_id) or \
                        list(read.remote_block_ids) != blocks[:read.matched_blocks]:
                    stream.wrong.append(f"{conversation} turn {turn}: read {lease_id} blocks "
                                        f"{list(read.remote_block_ids)}; latest "
                                        f"{decode.latest.get(conversation)}")
                with contextlib.suppress(errors.Unavailable, errors.DeadlineExceeded):
                    await reader.release_read(read.pin.pin_id)
            history = history + kv.tokens(7, start=1000 * turn + 500)  # the reply
            ids = [next(block_ids) for _ in range(-(-len(history) // kv.block_size))]
            sent = time.monotonic()
            try:
                lease = await asyncio.to_thread(
                    decode.session.grant, "t1", conversation, f"req-{conversation}-{turn}", ids,
                    len(history), kv.lease_hashes(history), idle_ttl=60.0, timeout=1.0)
            except GrantOutcomeUnknown as unknown:
                decode.blocks[unknown.lease_id] = ids
                decode.latest.setdefault(conversation, set()).add(unknown.lease_id)
                stream.unleased += 1
            except Exception as exc:
                stream.failed.append(f"{conversation} turn {turn}: grant: {exc!r}")
            else:
                if lease is None:
                    stream.unleased += 1
                else:
                    decode.blocks[lease.lease_id] = ids
                    decode.latest[conversation] = {lease.lease_id}
                    stream.grants.append((sent, time.monotonic()))
            await asyncio.sleep(0.02)


class SwitchWatch:
    """When the sentinels' failover ends: the first `+switch-master` any sentinel announces
    (the leader's; the others learn it later). Listened to on threads, so that a busy event
    loop does not make the failover look slower than it was."""

    def __init__(self, fleet: SentinelFleet) -> None:
        self.switched: list[tuple[float, str]] = []
        self._done = threading.Event()
        self._stop = threading.Event()
        self._clients = [redis.Redis(host="127.0.0.1", port=s.port) for s in fleet.sentinels]
        self._threads = []
        for client in self._clients:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe("+switch-master")  # before the kill: nothing is missed
            thread = threading.Thread(target=self._listen, args=(pubsub,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _listen(self, pubsub: Any) -> None:
        try:
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=0.05)
                if message is not None:
                    self.switched.append((time.monotonic(), message["data"].decode()))
                    self._done.set()
        finally:
            pubsub.close()

    def wait(self, timeout: float) -> tuple[float, str]:
        if not self._done.wait(timeout):
            raise AssertionError(f"no sentinel switched the primary within {timeout}s")
        return min(self.switched)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        for client in self._clients:
            client.close()


@pytest.mark.slow  # ~8 s: the sentinels' failover alone takes 2-3 s
async def test_a_registry_on_sentinel_serves_through_a_failover(
        sentinel_fleet: SentinelFleet, kv: KvKit, redis_namespace: str) -> None:
    fleet = sentinel_fleet
    config = RegistryConfig(listen="127.0.0.1:0", backend="redis", redis_url=fleet.url,
                            redis_namespace=redis_namespace, metrics_listen="")
    server = await create_server(config, clock=SystemClock())
    await server.start()
    target = f"127.0.0.1:{server.port}"
    decode = Decode(target, kv)
    stream, stop = Stream(), asyncio.Event()
    switch = SwitchWatch(fleet)
    tasks: list[asyncio.Task[None]] = []
    reader = AsyncRegistryClient(target, timeout=1.0)
    try:
        await asyncio.to_thread(decode.session.start)
        assert decode.session.registered
        block_ids = itertools.count(1)
        tasks = [asyncio.create_task(_turns(decode, reader, kv, f"c{i}", stream, stop,
                                            block_ids)) for i in range(4)]
        await _until("reads hit before the kill", _returns(lambda: len(stream.hits) >= 20), 15)
        fleet.primary.proc.kill()  # SIGKILL: no goodbye to anyone
        death = time.monotonic()
        fleet.primary.proc.wait(5)
        switch_at, switch_message = await asyncio.to_thread(switch.wait, 60.0)
        assert switch_message.split()[-1] == str(fleet.replica.port), switch_message
        # A failover loses what the replica had not received yet: the holder registers again
        # (its leases are not read until then), and reads hit again after that.
        await _until("the holder registers again",
                     _returns(lambda: max(decode.registered_at) > death), 30.0)
        again = min(t for t in decode.registered_at if t > death)
        await _until("reads hit again after the failover",
                     _returns(lambda: sum(t > again for t in stream.hits) >= 20), 30.0)
    finally:
        stop.set()
        await asyncio.wait(tasks, timeout=10) if tasks else None
        switch.close()
        await asyncio.to_thread(decode.session.close)
        decode.client.close()
        await reader.close()
        await server.stop(0)
    # Grants sent after the death cannot have gone to the dead primary; the first of them
    # counts from when it succeeded.
    after = [done for sent, done in stream.grants if sent > death]
    assert after, "no grant succeeded after the primary died"
    first_grant = min(after)
    print(f"\nsentinel failover: death->switch {switch_at - death:.2f} s, death->first grant "
          f"{first_grant - death:.2f} s, death->holder registered again {again - death:.2f} s, "
          f"turns {stream.turns}, recomputes {stream.recomputes} (read errors "
          f"{stream.read_errors}, misses {stream.misses}), unleased {stream.unleased}, hits "
          f"{len(stream.hits)}")
    assert stream.failed == []
    assert stream.wrong == []
    assert first_grant - death <= (switch_at - death) + MARGIN_S
    assert sum(t < death for t in stream.hits) >= 20  # the stream ran before the kill


def _returns(value: Any) -> Any:
    async def check() -> Any:
        return value()
    return check



@pytest.mark.parametrize("url", ["redis://app:s3cret@127.0.0.1:1/0",
                                 "redis+sentinel://127.0.0.1:1/kvb?sentinel_password=s3cret"])
async def test_a_store_that_cannot_start_never_shows_a_password(url: str) -> None:
    store = RedisStore(RegistryConfig(backend="redis", redis_url=url, redis_namespace="pw"),
                       SystemClock())
    with pytest.raises(OSError, match="cannot reach Redis at") as caught:
        await store.start()
    assert "s3cret" not in str(caught.value), caught.value
