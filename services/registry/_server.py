"""Running a registry: `create_server` builds and binds one (tests, embedding), `serve` runs it
until SIGTERM/SIGINT and then shuts down gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kvbridge import aio, auth, grpc_env, logs, tracing
from kvbridge._grpc_handlers import (
    SERVER_KEEPALIVE_OPTIONS,
    add_health_and_reflection,
    add_servicer,
)
from kvbridge.clients._base import parse_hostport
from kvbridge.clock import Clock, SystemClock
from kvbridge.errors import Unavailable
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.services.registry._access import RULES
from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._core import LeaseTable
from kvbridge.services.registry._metrics import RegistryMetrics
from kvbridge.services.registry._servicer import RegistryServicer
from kvbridge.services.registry._store import LeaseStore, MemoryStore

if TYPE_CHECKING:
    from kvbridge._otel import Tracing

log = structlog.get_logger("kvbridge.registry")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RegistryService"].full_name
# The longest the expiry scheduler sleeps with nothing due that it knows of. Each replica of a
# shared store (and each shard of it) ticks at least this often, so it is what an idle fleet
# pays in script calls: replicas x shards / this, a second.
_MAX_TICK_SLEEP = 0.25
_WATCH_END_WAIT_S = 0.5  # most a stop waits for the watch streams it ended to send why


def split_hostport(value: str) -> tuple[str, int]:
    """A listen address `HOST:PORT` (port 0..65535; an empty host is every interface);
    ValueError("expected HOST:PORT ...") otherwise."""
    host, port = parse_hostport(value, listen=True)
    return host or "0.0.0.0", port


@dataclass
class RegistryServer:
    """A bound (and, after `start`, serving) registry."""

    config: RegistryConfig
    store: LeaseStore
    metrics: RegistryMetrics
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    servicer: RegistryServicer
    authenticator: auth.Authenticator
    metrics_port: int | None = None
    _scheduler: asyncio.Task[None] | None = None
    _stopping: bool = False
    _not_serving: bool = False
    _http: object | None = field(default=None, repr=False)
    traces: Tracing | None = None  # None: off

    @property
    def table(self) -> LeaseTable:
        """The lease table of a memory-backed registry (tests and embedding)."""
        if not isinstance(self.store, MemoryStore):
            raise TypeError(f"a {type(self.store).__name__} has no in-process lease table")
        return self.store.table

    @property
    def address(self) -> str:
        host, _ = split_hostport(self.config.listen)
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def reload_tokens(self) -> auth.TokenTable:
        """Read the token table file again and authenticate every call from now on with it
        (leases, holders and pins are untouched); ValueError, with the old table kept, when
        the new one is not valid. `serve` does this on SIGHUP."""
        return self.authenticator.reload()

    async def start(self) -> None:
        if self.config.metrics_listen:  # first: if its port is taken, nothing is left running
            host, port = split_hostport(self.config.metrics_listen)
            httpd, _thread = start_http_server(port, host, registry=self.metrics.registry)
            self._http = httpd
            self.metrics_port = httpd.server_port
        await self.server.start()
        self._scheduler = asyncio.create_task(self._run_expiry(), name="registry-expiry")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("registry_started", listen=self.address, metrics_port=self.metrics_port,
                 backend=self.config.backend,
                 event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
                 recovery_grace_s=self.config.effective_recovery_grace_s,
                 **grpc_env.describe(log),
                 **auth.describe(self.authenticator.table, self.config.tls_files()))
        host, _ = split_hostport(self.config.listen)
        auth.warn_if_exposed(log, "registry", self.config.listen, host,
                             self.authenticator.table, self.config.tls_files())

    async def _run_expiry(self) -> None:
        store, clock = self.store, self.store.clock
        cfg = self.config
        shortest = cfg.expiry_tick_s
        # Sleeping until the first known deadline misses one that a call sets sooner in the
        # meantime (another replica's grant, on a shared store). No grant, renewal or
        # registration sets one sooner than the shortest idle or holder TTL from now, so
        # waking at least that often expires leases and holders on time. Only a pin (whose
        # TTL its reader picks) or a restored lease near its end may then expire up to this
        # late: a reclaim that waits a little longer, never one too early.
        longest = max(min(_MAX_TICK_SLEEP, cfg.min_idle_ttl_s, cfg.min_holder_ttl_s), shortest)
        # This replica ticks again within `longest` (plus the event loop's lag): its turn at
        # a shared store's ticks lasts one `shortest` longer, so that it keeps it as it ticks.
        turn = longest + shortest
        while not self._stopping:
            try:
                expired = await store.tick(turn=turn)
            except Exception:  # the scheduler must outlive any single bad tick
                log.exception("expiry_tick_failed")
                expired = 0
            if store.not_serving and not self._not_serving:
                self._not_serving = True  # for good: only a restart (an upgrade) serves again
                for name in ("", SERVICE_NAME):
                    await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
                # Its watchers would otherwise go on with only the events it can still read:
                # ended, they reconnect to a replica that serves and re-list.
                ended = self.servicer.end_watches(Unavailable(store.not_serving))
                log.error("registry_not_serving", error=store.not_serving, watches_ended=ended)
            if expired >= self.config.expiry_batch:
                await asyncio.sleep(0)  # more are due: let RPCs in, then continue
                continue
            deadline = store.next_deadline()
            delay = longest if deadline is None else deadline - clock.monotonic()
            await asyncio.sleep(min(max(delay, shortest), longest))

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting RPCs, give in-flight ones `grace` seconds, then close."""
        await self.health.enter_graceful_shutdown()
        # Watch streams never end by themselves: ended now (UNAVAILABLE), their watchers move
        # to another replica at once instead of holding the shutdown for its whole grace.
        ended = self.servicer.close_watches(Unavailable("the registry is shutting down"))
        if ended:
            log.info("watches_ended", count=ended, why="shutdown")
            # Each sends its status before the server goes, even with no grace (a stop with
            # grace 0 would cancel them mid-way: the watcher would not learn why).
            await self.servicer.watches_gone(_WATCH_END_WAIT_S)
        await self.server.stop(self.config.shutdown_grace_s if grace is None else grace)
        if self._scheduler is not None:
            # A flag as well as a cancellation: a Redis call may swallow the cancellation
            # (redis-py retries the command), and the loop must end all the same.
            self._stopping = True
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([self._scheduler], timeout=5.0)
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]
            self._http.server_close()  # type: ignore[attr-defined]
        if self.traces is not None:
            await self.traces.close()  # exports what is left
        counts = self.store.counts()
        await self.store.close()
        log.info("registry_stopped", backend=self.config.backend, counts=counts)


async def open_store(config: RegistryConfig, clock: Clock | None = None) -> LeaseStore:
    """The store `config.backend` names, connected. Raises OSError when Redis is unreachable."""
    clock = clock or SystemClock()
    if config.backend == "redis":
        try:
            from kvbridge.services.registry._redis import RedisStore
            from kvbridge.services.registry._redis_shards import ShardedStore
        except ImportError as exc:
            raise OSError(f"the redis backend needs redis-py: pip install 'kvbridge[redis]' "
                          f"({exc})") from exc

        store: LeaseStore = (ShardedStore(config, clock) if config.redis_shards > 1
                             else RedisStore(config, clock))
    else:
        store = MemoryStore.create(config, clock)
    await store.start()
    return store


async def create_server(config: RegistryConfig, *, clock: Clock | None = None,
                        table: LeaseTable | None = None,
                        store: LeaseStore | None = None) -> RegistryServer:
    """Build a registry bound to `config.listen` (not started). Port 0 picks a free port.
    The store is `store`, else a `MemoryStore` over `table`, else what `config.backend`
    names (connected here: OSError when unreachable)."""
    if store is None:
        store = MemoryStore(table) if table is not None else await open_store(config, clock)
    try:
        return _bind(config, store)
    except BaseException:
        await store.close()
        raise


def _bind(config: RegistryConfig, store: LeaseStore) -> RegistryServer:
    metrics = RegistryMetrics(store)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        *SERVER_KEEPALIVE_OPTIONS,
    ], interceptors=tracing.server_interceptors(  # None unless tracing is on
        traces := tracing.start(config.otlp_traces_endpoint, "kvbridge-registry")))
    # Requests are parsed by the handlers: bytes that are not the request message get
    # INVALID_ARGUMENT with a reason, not gRPC's UNKNOWN.
    servicer = RegistryServicer(store, metrics)
    authenticator = auth.Authenticator(config.token_table())
    add_servicer(server, servicer, pb, "RegistryService", authenticator=authenticator,
                 rules=RULES, max_id_length=config.max_id_length)
    health_servicer = health.aio.HealthServicer()
    add_health_and_reflection(
        server, health_servicer,
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME))
    host, port = split_hostport(config.listen)
    try:
        bound = auth.bind(server, f"{host}:{port}" if ":" not in host else f"[{host}]:{port}",
                          config.tls_files())
    except RuntimeError as exc:  # grpcio raises (rather than return 0) when the bind fails
        raise OSError(f"cannot bind the registry to {config.listen}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind the registry to {config.listen}")
    return RegistryServer(config, store, metrics, server, bound, health_servicer, servicer,
                          authenticator, traces=traces)


async def _tame_gc(freeze_every: float, full_every: float) -> None:
    """Keep the cyclic garbage collector's pauses off the request path.

    Leases are long-lived and free of reference cycles, but a full collection walks every one
    of them (about 100 ms at 100,000 leases here) and, left alone, runs every few seconds
    under load. So objects that survived `freeze_every` go to the permanent generation, and a
    full collection of everything (which also frees any cycles among them) runs every
    `full_every` instead.
    """
    last_full = time.monotonic()
    while True:
        await asyncio.sleep(freeze_every)
        if time.monotonic() - last_full >= full_every:
            gc.unfreeze()
            start = time.monotonic()
            collected = gc.collect()
            last_full = time.monotonic()
            log.info("gc_full_collection", collected=collected,
                     pause_ms=round((last_full - start) * 1000, 1))
        gc.freeze()


async def serve(config: RegistryConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run a registry until SIGTERM or SIGINT; on SIGHUP, read the token table file again.
    ValueError when it would run unauthenticated outside insecure local mode."""
    auth.require_secured(config.token_table(), config.insecure, "registry")
    logs.configure(config.log_level, config.log_format)
    registry = await create_server(config)
    await registry.start()
    auth.reload_tokens_on_sighup(log)  # a token is rotated without a restart
    gc_task = None
    if config.gc_freeze_interval_s > 0:
        gc_task = asyncio.create_task(
            _tame_gc(config.gc_freeze_interval_s, config.gc_full_interval_s))
    if ready is not None:
        ready.set()
    await aio.wait_for_stop_signal()
    log.info("registry_shutting_down", grace_s=config.shutdown_grace_s)
    if gc_task is not None:
        gc_task.cancel()
    await registry.stop()
