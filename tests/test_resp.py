"""`ScriptPipe` (the Redis store's script calls on a pipelined connection of their own)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvbridge.services.registry import _resp
from kvbridge.services.registry._resp import ScriptPipe, _PyReader, pack

SCRIPT = "return {ARGV[1], tonumber(ARGV[2]) + 1, {KEYS[1]}, redis.call('GET', KEYS[1])}"
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()


def test_pack_encodes_as_redis_py_does() -> None:
    assert pack(["EVALSHA", b"\x00\r\n", 3, 1.5, "é"]) == (
        b"*5\r\n$7\r\nEVALSHA\r\n$3\r\n\x00\r\n\r\n$1\r\n3\r\n$3\r\n1.5\r\n$2\r\n\xc3\xa9\r\n")
    with pytest.raises(TypeError):
        pack([None])


def test_python_reader_takes_replies_in_any_chunks() -> None:
    wire = (b"*5\r\n$2\r\nOK\r\n:-7\r\n*2\r\n$-1\r\n$4\r\na\r\nb\r\n+PONG\r\n*0\r\n"
            b"-NOSCRIPT No matching script\r\n-ERR boom\r\n$0\r\n\r\n")
    for step in (1, 2, 3, 7, len(wire)):
        reader, got = _PyReader(), []
        for i in range(0, len(wire), step):
            reader.feed(wire[i:i + step])
            while (reply := reader.gets()) is not False:
                got.append(reply)
        assert got[0] == [b"OK", -7, [None, b"a\r\nb"], b"PONG", []]
        assert isinstance(got[1], ResponseError) and str(got[1]).startswith("NOSCRIPT")
        assert isinstance(got[2], ResponseError) and str(got[2]) == "ERR boom"
        assert got[3] == b""
        assert len(got) == 4


@pytest.fixture(params=["hiredis", "python"])
def reader_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "hiredis":
        if _resp.hiredis is None:
            pytest.skip("hiredis is not installed")
    else:
        monkeypatch.setattr(_resp, "hiredis", None)
    return str(request.param)


async def test_calls_pipeline_in_order_and_reload_a_lost_script(
        redis_server: Any, redis_namespace: str, reader_kind: str) -> None:
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(redis_server.url)
    pipe = ScriptPipe(redis_server.url, SCRIPT, SHA, connect_timeout=2.0, timeout=5.0)
    key = redis_namespace + ":k"
    try:
        await admin.set(key, b"v")
        await admin.script_flush()  # the first call meets NOSCRIPT and loads it
        replies = await asyncio.gather(*(pipe.call([key], [f"a{i}", i]) for i in range(50)))
        for i, reply in enumerate(replies):
            assert reply == [f"a{i}".encode(), i + 1, [key.encode()], b"v"]
        await admin.script_flush()
        assert await pipe.call([key], [b"x", 1.5]) == [b"x", 2, [key.encode()], b"v"]
        with pytest.raises(ResponseError):  # a script's own error is not an outage
            await pipe.call([key], [b"x", b"not a number"])
        assert (await pipe.call([key], [b"y", 0]))[0] == b"y"  # the connection goes on
    finally:
        await pipe.close()
        await admin.delete(key)
        await admin.aclose()


async def test_db_is_selected(redis_server: Any, redis_namespace: str) -> None:
    import redis.asyncio as aioredis

    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    admin = aioredis.Redis.from_url(url)
    pipe = ScriptPipe(url, SCRIPT, SHA, connect_timeout=2.0, timeout=5.0)
    key = redis_namespace + ":db"
    try:
        await admin.set(key, b"three")
        assert (await pipe.call([key], [b"x", 1]))[3] == b"three"
    finally:
        await pipe.close()
        await admin.delete(key)
        await admin.aclose()


async def test_unreachable_and_unanswered_calls_fail_fast() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pipe = ScriptPipe(f"redis://127.0.0.1:{port}/0", SCRIPT, SHA, connect_timeout=1.0,
                      timeout=0.3)
    with pytest.raises(RedisConnectionError):  # nothing listens there
        await pipe.call(["k"], [b"x", 1])

    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pipe = ScriptPipe(f"redis://127.0.0.1:{port}/0", SCRIPT, SHA, connect_timeout=1.0,
                      timeout=0.3)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RedisTimeoutError):
            await pipe.call(["k"], [b"x", 1])
        assert loop.time() - started < 2.0
        for writer in accepted:  # a connection lost with a call in flight fails that call
            writer.close()
        call = asyncio.ensure_future(pipe.call(["k"], [b"x", 1]))
        await asyncio.sleep(0.05)
        for writer in accepted:
            writer.transport.abort()
        with pytest.raises((RedisConnectionError, RedisTimeoutError)):
            await call
    finally:
        await pipe.close()
        server.close()
        await server.wait_closed()


async def test_a_connection_closed_as_it_is_made_fails_its_calls() -> None:
    """A server that closes each connection at once (a Redis at maxclients writes an error and
    closes): every call ends with an error within its timeout. Before, a call queued on the
    connection after it was lost (in the loop turns after connecting) waited forever."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def refuse_all() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"-ERR max number of clients reached\r\n")

    thread = threading.Thread(target=refuse_all, daemon=True)
    thread.start()
    try:
        stuck = 0
        for i in range(10):
            pipe = ScriptPipe(f"redis://127.0.0.1:{port}/0", SCRIPT, SHA, connect_timeout=1.0,
                              timeout=0.5)
            try:
                await asyncio.wait_for(pipe.call(["k"], [b"x", i]), 3.0)
            except TimeoutError:
                stuck += 1
            except (RedisConnectionError, RedisTimeoutError, ResponseError):
                pass
            finally:
                await pipe.close()
        assert stuck == 0, f"{stuck} of 10 calls never ended"
    finally:
        stop.set()
        listener.close()
        thread.join(5)


async def test_calls_waiting_on_a_failing_connect_share_its_failure() -> None:
    """Calls that queue behind a connect attempt to a Redis that does not answer fail with it,
    rather than each making an attempt of its own after it (n calls: one connect timeout, not
    n of them one after another)."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # never answers AUTH: the connect times out

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pipe = ScriptPipe(f"redis://:secret@127.0.0.1:{port}/0", SCRIPT, SHA, connect_timeout=0.5,
                      timeout=5.0)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await asyncio.gather(*(pipe.call(["k"], [b"x", i]) for i in range(4)),
                                       return_exceptions=True)
        assert all(isinstance(r, RedisConnectionError) for r in results), results
        assert loop.time() - started < 1.2  # one attempt's timeout, not four
        assert len(accepted) == 1
        with pytest.raises(RedisConnectionError):  # a later call tries again
            await pipe.call(["k"], [b"x", 9])
        assert len(accepted) == 2
    finally:
        await pipe.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_store_on_a_url_the_pipe_does_not_take_uses_redis_py(
        redis_server: Any, redis_namespace: str, kv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TLS URLs go through redis-py (the batcher): the same store, pipelined or not."""
    from test_store_contract import grant_spec, holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis
    from kvbridge.services.registry._model import MissReason

    monkeypatch.setattr(_redis, "supported", lambda url: False)
    config = RegistryConfig(backend="redis", redis_url=redis_server.url,
                            redis_namespace=redis_namespace)
    store = _redis.RedisStore(config, SystemClock(), recovering=False)
    await store.start()
    try:
        assert store._pipe is None and store._batcher is not None
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


TRANSIENT_REPLIES = {
    "LOADING": "LOADING Redis is loading the dataset in memory",
    "BUSY": "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN "
            "NOSCRIPT.",
    "READONLY": "READONLY You can't write against a read only replica.",
    "MASTERDOWN": "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set "
                  "to 'no'.",
    "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
}


@pytest.mark.parametrize("code", sorted(TRANSIENT_REPLIES))
async def test_a_redis_not_serving_now_is_unavailable(code: str, reader_kind: str) -> None:
    """Replies of a Redis that cannot serve now (loading, busy, a replica, ...) fail the call
    as Unavailable (clients retry or fail over), not as a script error; after READONLY and
    MASTERDOWN (a failover) the connection is closed, so the next call connects anew."""
    from kvbridge.errors import Unavailable

    accepted: list[asyncio.StreamWriter] = []
    reply = b"-" + TRANSIENT_REPLIES[code].encode() + b"\r\n"

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        while await reader.read(65536):  # one call per read: the test awaits each
            writer.write(reply)

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pipe = ScriptPipe(f"redis://127.0.0.1:{port}/0", SCRIPT, SHA, connect_timeout=1.0,
                      timeout=2.0)
    try:
        for _ in range(2):
            with pytest.raises(Unavailable) as caught:
                await pipe.call(["k"], [b"x", 1])
            assert caught.value.metadata["redis_error"] == code
        assert len(accepted) == (2 if code in ("READONLY", "MASTERDOWN") else 1)
    finally:
        await pipe.close()
        server.close()
        await server.wait_closed()


async def test_a_store_on_redis_py_maps_a_redis_not_serving_to_unavailable(
        redis_server: Any, redis_namespace: str, kv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The redis-py path (TLS URLs) maps the same replies as the pipe does."""
    from redis.exceptions import MasterDownError, ReadOnlyError
    from test_store_contract import holder

    from kvbridge.clock import SystemClock
    from kvbridge.errors import Unavailable
    from kvbridge.services.registry import RegistryConfig, _redis

    monkeypatch.setattr(_redis, "supported", lambda url: False)
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
        kv: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Script calls through redis-py are never resent, so a pooled connection that a restarted
    Redis closed must be replaced before a call is written to it, not fail that call."""
    from conftest import RedisProcess
    from test_store_contract import holder

    from kvbridge.clock import SystemClock
    from kvbridge.services.registry import RegistryConfig, _redis

    monkeypatch.setattr(_redis, "supported", lambda url: False)
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
