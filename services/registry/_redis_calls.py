"""How the Redis store calls Redis: its connections, the function library (loaded, and loaded
again when Redis lost it), and the batching of the calls of one event-loop turn.

A function call is sent once. A connection lost after it was written fails the call (Redis may
have run it; the caller sees `Unavailable`) rather than sending it again; the functions are
replay-safe all the same (a grant or pin that exists already is answered as it stands). The
one call sent again is one Redis answered "Function not found": it did not run.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kvbridge.services.registry._redis_lua import Library
from kvbridge.services.registry._redis_url import (
    check_url,
    cluster_parts,
    redacted,
    sentinel_parts,
)

__all__ = ["check_url", "connect", "redacted"]

# Error replies of a Redis that cannot serve now, whatever the call: an outage to the caller
# (who retries or fails over), not a function's error. OOM: a full Redis refuses every write.
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
    if code in NOT_SERVING:
        return code
    # A function touching a key whose slot moved away (a live resharding: the docs say not to
    # migrate a registry shard's slot; if it happens all the same, an outage, not a bug).
    return "CLUSTER" if "non local key" in str(exc) else None


def _function_not_found(reply: Any) -> bool:
    """Whether a reply says that Redis has no such function (a restart without persistence,
    FUNCTION FLUSH, a failover to a replica without it): the call did not run."""
    return isinstance(reply, ResponseError) and str(reply).startswith("Function not found")


def retry_once() -> Retry:
    """For the event tail (reads only): one immediate retry when a pooled connection turns out
    dead (Redis restarted), and no more: with Redis down, calls must fail fast."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def no_retry() -> Retry:
    """For function calls and other writes: none. redis-py retries a command (or a whole
    pipeline) by sending it again, also after a connection lost while reading the reply, when
    Redis has run it. A pooled connection that Redis closed (a restart) is still replaced
    before use: the pool checks each one as it hands it out."""
    return Retry(NoBackoff(), 0)


def pool_checks() -> dict[str, Any]:
    """Options that keep redis-py's pool replacing a pooled connection Redis has closed before
    handing it out. redis-py 7+ skips that check while "maintenance notifications" (a RESP3
    feature of managed Redis, unused here) are on, and they are on ("auto") by default: the
    first call after a Redis restart would then fail, since function calls are never resent."""
    # The asyncio client takes the option from redis-py 8.1 (7.x has the notifications in the
    # blocking client only): ask the client itself rather than the version.
    if "maint_notifications_config" not in inspect.signature(aioredis.Redis.__init__).parameters:
        return {}
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # no such notifications: the pool always checks
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def connect(url: str, **options: Any) -> aioredis.Redis:
    """A client for `url` (see `check_url`): redis-py's own URLs, TLS (`rediss://`, its options
    as query arguments such as `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`), or a primary
    found through Sentinel, which redis-py asks again whenever a connection to it fails (a
    failover). `options` go to the connections to the primary. The sentinels themselves are
    reached with the same TLS settings and with `sentinel_username`/`sentinel_password` from
    the query, if any (Sentinel has its own users). A cluster URL gives a Redis Cluster
    client: each call goes to the primary that serves its keys' slot, found again when a
    slot moves or a primary fails over (a MOVED reply: the call did not run there)."""
    check_url(url)
    scheme = url.partition("://")[0]
    if scheme.endswith("+cluster"):
        return _cluster(url, options)
    if not scheme.endswith("+sentinel"):
        return aioredis.Redis.from_url(url, **options)
    sentinels, service, plain = sentinel_parts(url)
    kwargs: dict[str, Any] = dict(parse_url(plain))
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    tls = kwargs.pop("connection_class", None) is not None  # SSLConnection: rediss
    own = {k.removeprefix("sentinel_"): kwargs.pop(k) for k in list(kwargs)
           if k in ("sentinel_username", "sentinel_password")}
    ssl_opts = {k: v for k, v in kwargs.items() if k.startswith("ssl_")}
    sentinel_kwargs = {"socket_connect_timeout": options.get("socket_connect_timeout", 2.0),
                       "socket_timeout": options.get("socket_connect_timeout", 2.0),
                       **own, **({"ssl": True, **ssl_opts} if tls else {})}
    primary: dict[str, Any] = {**kwargs, **options, **({"ssl": True} if tls else {})}
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)
    client: _SentinelPrimary = sentinel.master_for(service, redis_class=_SentinelPrimary,
                                                   **primary)
    client.sentinel_manager = sentinel
    return client


def _cluster(url: str, options: dict[str, Any]) -> aioredis.Redis:
    nodes, plain = cluster_parts(url)
    kwargs: dict[str, Any] = dict(parse_url(plain))
    for key in ("host", "port", "db"):
        kwargs.pop(key, None)
    if kwargs.pop("connection_class", None) is not None:  # SSLConnection: rediss
        kwargs["ssl"] = True
    client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                          **{**kwargs, **options})
    # The store calls of it what a plain client has: single-slot commands and pipelines.
    return cast(aioredis.Redis, client)


class _SentinelPrimary(aioredis.Redis):
    """A client of Sentinel's primary that also closes its connections to the sentinels: a
    `master_for` client leaves them to its `Sentinel`, which nothing else here would close
    (each store's start and close would leave them open)."""

    sentinel_manager: Sentinel | None = None  # (`sentinel` is the SENTINEL command's)

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            # (Sentinel.aclose came long after redis-py 5.2: redis/redis-py#3201)
            for client in self.sentinel_manager.sentinels:
                await client.aclose()


class FunctionCalls:
    """Calls the library's functions. The calls made within one turn of the event loop go to
    Redis together, as one non-transactional pipeline: one write and one read for the lot
    instead of a connection checkout, a write and a read each. Every call is still its own
    atomic function run, in the order made; a failure of one is that call's alone. Under load
    the gRPC server hands the store many calls per loop turn, so this is most of a replica's
    Redis overhead."""

    def __init__(self, redis: Any, library: Library, events_key: str) -> None:
        self._redis, self._library, self._events_key = redis, library, events_key
        self._queue: list[tuple[list[Any], asyncio.Future[Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def load(self) -> None:
        """Load the library (again). Raise OSError on a Redis without functions (< 7.0)."""
        try:
            await self._redis.function_load(self._library.source, replace=True)
        except ResponseError as exc:
            if "unknown command" not in str(exc).lower():
                raise
            try:
                version = (await self._redis.info("server")).get("redis_version", "unknown")
            except ResponseError:
                version = "unknown"
            raise OSError(f"Redis {version} has no functions (FUNCTION LOAD: {exc}); the "
                          "Redis store needs Redis 7.0 or newer (or Valkey 7.2+)") from exc

    async def direct(self, operation: str, keys: list[str], args: list[Any]) -> Any:
        """Call `operation` now, on its own (loading the library when Redis lost it)."""
        name = self._library.function(operation)
        try:
            return await self._redis.fcall(name, len(keys), *keys, *args)
        except ResponseError as exc:
            if not _function_not_found(exc):
                raise
        await self.load()
        return await self._redis.fcall(name, len(keys), *keys, *args)

    def call(self, args: list[Any]) -> asyncio.Future[Any]:
        """Call the operation `args[0]` with the events key and `args[1:]`, batched."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((args, future))
        return future

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        task = asyncio.ensure_future(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _one(self, args: list[Any], future: asyncio.Future[Any]) -> None:
        try:
            reply = await self.direct(args[0], [self._events_key], args[1:])
        except BaseException as exc:  # handed to the caller, whatever it is
            if not future.done():
                future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not future.done():
            future.set_result(reply)

    async def _send(self, batch: list[tuple[list[Any], asyncio.Future[Any]]]) -> None:
        batch = [(args, f) for args, f in batch if not f.done()]  # cancelled callers
        if len(batch) <= 1:
            for args, future in batch:
                await self._one(args, future)
            return
        pipe = self._redis.pipeline(transaction=False)
        function, key = self._library.function, self._events_key
        for args, _ in batch:
            pipe.fcall(function(args[0]), 1, key, *args[1:])
        try:
            replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (args, future), reply in zip(batch, replies, strict=True):
            if _function_not_found(reply):  # Redis lost the library: load it, run this one
                await self._one(args, future)
            elif future.done():
                continue
            elif isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result(reply)
