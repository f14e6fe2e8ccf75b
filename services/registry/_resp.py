"""`ScriptPipe`: the store's script calls on one connection of their own, pipelined as made.

redis-py spends much of a replica's time per call in its own machinery (a pool checkout, retry
and observability wrappers, a reply parser that awaits each line): at 1,000 reads/s over two
replicas each replica took 70% of a core through redis-py and 48% through this. Here every call
is written to the socket the moment it is made and its future is resolved when its reply
arrives, in order (Redis answers a connection's commands in the order sent): no checkout, no
per-call task, no batching turn; replies are parsed by hiredis when it is installed, else by a
small parser over the received bytes.

Semantics kept from the redis-py path it replaces: a script Redis lost (NOSCRIPT, Redis
restarted) is loaded again and that call rerun; a connection found closed when a call is made
is reopened (bounded by `connect_timeout`); a connection lost with calls in flight fails those
calls (whether each ran is unknown, so none is retried) with `ConnectionError`; a call
unanswered for `timeout` seconds closes the connection and fails with `TimeoutError`; a
script's own error is `ResponseError`. A Redis that cannot serve now (`NOT_SERVING`: loading
its data, busy with another script, a replica that takes no writes, ...) fails the call with
the domain `Unavailable`, as an outage: callers fail open or go elsewhere; after READONLY or
MASTERDOWN (a failover under way) the connection is closed, so the next call connects anew.
Plain TCP and unix sockets only (`redis://`, `unix://`): the store uses redis-py for TLS.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import time
from typing import Any, cast

from redis.connection import UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvbridge.errors import Unavailable

hiredis: Any
try:
    hiredis = importlib.import_module("hiredis")
except ImportError:  # the small parser below serves
    hiredis = None


class _Incomplete(Exception):
    pass


class _PyReader:
    """RESP2 replies from a byte stream (the subset Redis sends to scripts' callers)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def gets(self) -> Any:
        try:
            value, self._pos = self._parse(self._pos)
        except _Incomplete:
            return False
        return value

    def _parse(self, pos: int) -> tuple[Any, int]:
        buf = self._buf
        end = buf.find(b"\r\n", pos)
        if end < 0:
            raise _Incomplete
        kind, line = buf[pos], bytes(buf[pos + 1:end])
        pos = end + 2
        if kind == 0x24:  # $ bulk string
            n = int(line)
            if n < 0:
                return None, pos
            if len(buf) < pos + n + 2:
                raise _Incomplete
            return bytes(buf[pos:pos + n]), pos + n + 2
        if kind == 0x2A:  # * array
            n = int(line)
            if n < 0:
                return None, pos
            items = []
            for _ in range(n):
                item, pos = self._parse(pos)
                items.append(item)
            return items, pos
        if kind == 0x3A:  # : integer
            return int(line), pos
        if kind == 0x2B:  # + status
            return line, pos
        if kind == 0x2D:  # - error
            return _error(line.decode(errors="replace")), pos
        raise RedisConnectionError(f"protocol error: unexpected reply type {chr(kind)!r}")


# Error replies of a Redis that cannot serve now, whatever the call: an outage to the caller
# (who retries or fails over), not a script error. OOM: a full Redis refuses every write.
NOT_SERVING = frozenset({"LOADING", "BUSY", "READONLY", "MASTERDOWN", "TRYAGAIN",
                         "CLUSTERDOWN", "NOREPLICAS", "MISCONF", "OOM"})
# Of those, the ones that mean this connection's server is no longer the one to talk to.
RECONNECT = frozenset({"READONLY", "MASTERDOWN"})


def not_serving(exc: BaseException) -> str | None:
    """The error code of a reply in `NOT_SERVING`, else None (redis-py strips the code from
    the message of the errors it has classes for and keeps it in `status_code`)."""
    if not isinstance(exc, ResponseError):
        return None
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return code if code in NOT_SERVING else None


def _error(message: str) -> ResponseError:
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return ResponseError(message)


def _reader() -> Any:
    if hiredis is not None:
        return hiredis.Reader(replyError=ResponseError)
    return _PyReader()


def _arg(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int):  # bool included: 1/0, as redis-py would refuse it anyway
        return b"%d" % value
    if isinstance(value, float):
        return repr(value).encode()
    raise TypeError(f"cannot send {type(value).__name__} to Redis")


def pack(args: list[Any] | tuple[Any, ...]) -> bytes:
    """One RESP command."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = _arg(a)
        parts.append(b"$%d\r\n" % len(b))
        parts.append(b)
        parts.append(b"\r\n")
    return b"".join(parts)


def supported(url: str) -> bool:
    return url.startswith(("redis://", "unix://"))


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: ScriptPipe) -> None:
        self.owner = owner
        self.reader = _reader()
        self.pending: collections.deque[tuple[asyncio.Future[Any], float]] = (
            collections.deque())
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader, pending = self.reader, self.pending
        try:
            reader.feed(data)
            while True:
                reply = reader.gets()
                if reply is False:
                    return
                future = pending.popleft()[0]
                if isinstance(reply, ResponseError) and (code := not_serving(reply)):
                    if not future.done():
                        future.set_exception(Unavailable(
                            f"Redis cannot serve now: {reply}", backend="redis",
                            redis_error=code))
                    if code in RECONNECT:
                        self.fail(Unavailable(f"Redis cannot serve now: {reply}",
                                              backend="redis", redis_error=code))
                        if self.transport is not None:
                            self.transport.abort()
                        return
                    continue
                if future.done():
                    continue
                if isinstance(reply, ResponseError):
                    if reply.args and str(reply.args[0]).startswith("NOSCRIPT"):
                        reply = NoScriptError(*reply.args)
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except Exception as exc:  # a protocol error: nothing after it can be trusted
            self.fail(RedisConnectionError(f"Redis protocol error: {exc}"))
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def fail(self, exc: Exception) -> None:
        self.closed = True
        while self.pending:
            future = self.pending.popleft()[0]
            if not future.done():
                future.set_exception(exc)


class ScriptPipe:
    """EVALSHA calls of one script on one pipelined connection; see the module docstring."""

    def __init__(self, url: str, script: str, sha: str, *, connect_timeout: float,
                 timeout: float) -> None:
        kwargs: dict[str, Any] = cast(Any, parse_url)(url)  # untyped in some redis-py
        self._unix = kwargs.get("connection_class") is UnixDomainSocketConnection
        self._path = kwargs.get("path", "")
        self._host = kwargs.get("host", "localhost")
        self._port = int(kwargs.get("port", 6379))
        self._db = int(kwargs.get("db", 0) or 0)
        self._username = kwargs.get("username")
        self._password = kwargs.get("password")
        self._script = script
        self._sha = sha
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._proto: _Protocol | None = None
        self._lock = asyncio.Lock()
        self._failure: tuple[float, str] = (-1.0, "")  # the last failed connect: when, why
        self._timer: asyncio.TimerHandle | None = None

    async def call(self, keys: list[Any], args: list[Any]) -> Any:
        """Run the script; raises redis-py's ConnectionError, TimeoutError or ResponseError,
        or `Unavailable` for a Redis that cannot serve now."""
        command = pack(["EVALSHA", self._sha, len(keys), *keys, *args])
        try:
            return await self._send(command)
        except NoScriptError:  # Redis restarted (or flushed its scripts): load it, run this
            await self._send(pack(["SCRIPT", "LOAD", self._script]))
            return await self._send(command)

    async def _send(self, command: bytes) -> Any:
        proto = self._proto
        if proto is None or proto.closed:
            proto = await self._connect()
            if proto.closed:
                # Lost in the loop turns between connecting and here (a Redis at maxclients,
                # or shutting down, closes at once): a call queued on it now would never be
                # answered, nor failed. Not sent, so safe for the caller to run again.
                raise RedisConnectionError("connection to Redis lost as it was made")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        proto.pending.append((future, time.monotonic()))
        assert proto.transport is not None
        proto.transport.write(command)
        if self._timer is None:
            self._arm(self._timeout)
        return await future

    def _arm(self, delay: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(max(delay, 0.001), self._check)

    def _check(self) -> None:
        """Fail calls unanswered for longer than the timeout (and close the connection: later
        replies could no longer be matched to their calls)."""
        self._timer = None
        proto = self._proto
        if proto is None or not proto.pending:
            return
        if proto.closed:  # calls left on a closed connection: nothing else will fail them
            proto.fail(RedisConnectionError("connection to Redis lost"))
            return
        age = time.monotonic() - proto.pending[0][1]
        if age < self._timeout:
            self._arm(self._timeout - age)
            return
        proto.fail(RedisTimeoutError(f"Redis did not answer within {self._timeout} s"))
        if proto.transport is not None:
            proto.transport.abort()

    async def _connect(self) -> _Protocol:
        waiting_since = time.monotonic()
        async with self._lock:
            proto = self._proto
            if proto is not None and not proto.closed:
                return proto  # another call connected while this one waited
            failed_at, failure = self._failure
            if failed_at >= waiting_since:
                # The attempt made while this call waited has just failed: share its answer
                # rather than queue one more attempt (against a Redis that does not answer,
                # each would wait the whole connect timeout, one after another).
                raise RedisConnectionError(failure)
            try:
                proto = await asyncio.wait_for(self._open(), self._connect_timeout)
            except TimeoutError as exc:
                failure = f"cannot connect to Redis within {self._connect_timeout} s"
                self._failure = (time.monotonic(), failure)
                raise RedisConnectionError(failure) from exc
            except (OSError, ResponseError) as exc:
                failure = f"cannot connect to Redis: {exc}"
                self._failure = (time.monotonic(), failure)
                raise RedisConnectionError(failure) from exc
            self._proto = proto
            return proto

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        proto: _Protocol
        if self._unix:
            _, proto = await loop.create_unix_connection(lambda: _Protocol(self), self._path)
        else:
            _, proto = await loop.create_connection(lambda: _Protocol(self), self._host,
                                                    self._port)
        setup: list[bytes] = []
        if self._password is not None:
            auth = ["AUTH", self._password] if self._username is None else [
                "AUTH", self._username, self._password]
            setup.append(pack(auth))
        if self._db:
            setup.append(pack(["SELECT", self._db]))
        futures = []
        for command in setup:
            future: asyncio.Future[Any] = loop.create_future()
            proto.pending.append((future, time.monotonic()))
            futures.append(future)
            assert proto.transport is not None
            proto.transport.write(command)
        try:
            for future in futures:
                await future
        except BaseException:
            assert proto.transport is not None
            proto.transport.abort()
            raise
        return proto

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.fail(RedisConnectionError("the store is closing"))
            proto.transport.close()
