"""`RedisStore`: the lease state in Redis (or Valkey), shared by any number of registry replicas.

Every operation is one call of a function of the library in `_redis_lua` (atomic: a grant and
the supersession it causes, a pin and the lease activity it records, an expiry and its events
happen together or not at all). Time is Redis's own clock, read inside the function, so replicas
need no clock agreement (`_redis_clock`); replies carry durations that this replica puts on its
local clock.

- Expiry: every replica runs `tick()`; the function takes due holders, pins and leases and marks
  them in one step, so each deadline is processed (and its events sent) exactly once however
  many replicas tick. Deadlines are also applied lazily by any operation that touches a lease.
- Reclaim notices are pulled, not pushed: a holder's heartbeat returns its dead leases that no
  pin holds, until the holder confirms freeing them, so a notice can be neither lost (a replica
  dying) nor given under a live pin.
- Events go to a Redis Stream in the same call; each replica tails it (`_redis_events`).
- Input is checked here with the same functions `LeaseTable` uses, before any Redis call; a
  refused call changes nothing. Redis errors become `Unavailable` (callers fail open): an
  unreachable Redis, and one that cannot serve now (loading, busy, a read-only replica...).
- A call is sent once (`_redis_calls`); the state's keys and the layout record that keeps
  replicas of incompatible versions apart are in `_redis_layout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from array import array
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, NoReturn

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvbridge.clock import Clock, monotonic
from kvbridge.errors import HolderConflict, InvalidArgument, Unavailable
from kvbridge.ids import grant_lease_id
from kvbridge.services.registry import _validate as check
from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._core import (
    OWED_EVENTS_PER_TICK,
    Grant,
    GrantSpec,
    HolderSpec,
    Listener,
    Read,
    Registration,
    Renewal,
    Snapshot,
    check_grant,
    check_heartbeat,
    check_listing,
    check_prompt_hashes,
    check_read,
    check_registration,
    check_renewal,
    check_revocation,
    grant_ttls,
    held_of_another_holder,
)
from kvbridge.services.registry._model import Holder, Lease, LeaseState, MissReason, Pin
from kvbridge.services.registry._redis_calls import (
    RECONNECT,
    FunctionCalls,
    connect,
    no_retry,
    not_serving,
    pool_checks,
    redacted,
    retry_once,
)
from kvbridge.services.registry._redis_clock import _UNREACHABLE_LOG_EVERY, FleetClock
from kvbridge.services.registry._redis_events import EVENT_BLOCK_MS, EventTail
from kvbridge.services.registry._redis_layout import LAYOUT, LAYOUT_MIN, LayoutRecord
from kvbridge.services.registry._redis_lua import Refusal, library
from kvbridge.services.registry._redis_replies import (
    holder_of,
    lease_of,
    lease_with_holder,
    refusal,
)

__all__ = ["LAYOUT", "LAYOUT_MIN", "RedisStore"]

log = structlog.get_logger("kvbridge.registry")

# How often ticks check the namespace's shard count record again (`recheck_shard_count`): a
# replica of another count, started after Redis lost the record, serves at most this long
# beside this one (plus a tick) before one of them stops.
_COUNT_CHECK_EVERY_S = 1.0


def _s(value: bytes) -> str:
    return value.decode()


class RedisStore(LayoutRecord, FleetClock, EventTail):
    """Leases in Redis under `{config.redis_namespace}:`; see the module docstring."""

    def __init__(self, config: RegistryConfig, clock: Clock, *, recovering: bool = True,
                 shard: tuple[str, str] | None = None) -> None:
        """`shard`: (namespace, id tag) of one shard of a `ShardedStore` (`_redis_shards`):
        its keys are under that namespace and the lease and pin ids it makes end with the
        tag; None: the whole fleet's state under `config.redis_namespace`."""
        self.config = config
        self.clock = clock
        # When Redis may have lost pins (empty state, a restart, a failover: store.lua's
        # hold_until), hold reclaims for the grace (0: tests).
        self._grace = config.effective_recovery_grace_s if recovering else 0.0
        self.namespace, self.tag = shard or (config.redis_namespace, "")
        self._sharded = shard is not None
        self.prefix = f"{{{self.namespace}}}:"
        self._quotas = config.tenant_quotas()
        self._events_key = self.prefix + "events"
        self._redis: aioredis.Redis | None = None
        self._tail: aioredis.Redis | None = None  # blocking XREADs get their own connection
        self._batcher: FunctionCalls | None = None
        self._listeners: list[Listener] = []
        self._events_lost: Callable[[str], None] | None = None
        self._renewal_listeners: list[Listener] = []
        self._block_sizes: dict[str, int] = {}  # holder -> block size, to check grants first
        self._counts = {"leases_active": 0, "leases_total": 0, "holders": 0, "pins": 0,
                        "history_keys": 0}
        self._next_deadline: float | None = None
        self._reader: asyncio.Task[None] | None = None
        self._chores: set[asyncio.Task[Any]] = set()
        self._last_unreachable_log = 0.0
        self._closing = False
        self._use_pin_secret(b"")  # the fleet's, from Redis at start
        self._ticker = secrets.token_hex(8)  # this replica's token for the fleet's tick turn
        self._init_clock()
        self.layout, self.layout_min = LAYOUT, LAYOUT_MIN  # (tests set others)
        self._outdated = ""  # why this replica no longer serves (a newer layout's minimum)
        self._count_checked = -_COUNT_CHECK_EVERY_S  # when the shard count was last checked

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        url = self.config.redis_url
        try:
            # Function calls (and every other write) go through this one: never resent.
            self._redis = connect(url, socket_connect_timeout=2.0, socket_timeout=5.0,
                                  retry=no_retry(), **pool_checks())
            self._tail = connect(url, socket_connect_timeout=2.0,
                                 socket_timeout=EVENT_BLOCK_MS / 1000 + 5.0, retry=retry_once(),
                                 **pool_checks())
            await self._redis.ping()
            last = await self._redis.xrevrange(self._events_key, count=1)
        except (RedisError, OSError, ValueError) as exc:
            await self.close()
            hint = ""
            if url.startswith("rediss") and "ssl_certfile" not in url:
                # A Redis that asks for client certificates just drops the connection.
                hint = (" (a Redis with tls-auth-clients yes needs a client certificate: "
                        "add ssl_certfile=FILE&ssl_keyfile=FILE to the URL's query)")
            raise OSError(f"cannot reach Redis at {redacted(url)}: {exc}{hint}") from exc
        self._batcher = FunctionCalls(self._redis, library(), self._events_key)
        try:
            await self._batcher.load()  # refuses a Redis without functions (< 7.0)
        except RedisError as exc:
            await self._failed_start(exc)
        except OSError:
            await self.close()
            raise
        await self._check_eviction_policy()
        if not self._sharded:  # (a ShardedStore checks the count for its shards)
            # First: a sharded fleet's own namespace also records a layout this one does not
            # speak (`SHARDED_NAMESPACE_LAYOUT`), and the count is the reason to give.
            await self._check_shard_count(self.prefix, 1)
        await self._check_layout()
        self._use_pin_secret(await self._shared_pin_secret())
        try:
            await self.tick()  # primes counts
        except ResponseError as exc:  # an ACL user without a command the functions run (INFO)
            await self.close()
            raise OSError(f"Redis at {redacted(url)} refused the registry's functions: {exc}"
                          ) from exc
        if self._outdated:  # a newer replica raised the minimum since the check above
            await self.close()
            raise OSError(self._outdated)
        last_id: Any = last[0][0] if last else b"0-0"
        self._reader = asyncio.create_task(self._read_events(last_id), name="registry-events")
        log.info("redis_store_started", url=redacted(url), namespace=self.namespace)

    async def _failed_start(self, exc: Exception) -> NoReturn:
        await self.close()
        raise OSError(f"cannot reach Redis at {redacted(self.config.redis_url)}: {exc}"
                      ) from exc

    async def close(self) -> None:
        """Stop the event tail and close connections; every wait is bounded (a blocked XREAD
        does not always end on cancellation: redis-py may retry it)."""
        self._closing = True
        tasks = [t for t in (self._reader, *self._chores) if t is not None]
        if self._tail is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tail.connection_pool.disconnect(), 1.0)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        self._reader = None
        for client in (self._redis, self._tail):
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.aclose(), 2.0)
        self._redis = self._tail = None

    async def _fcall(self, operation: str, keys: list[str], args: list[Any]) -> Any:
        """Call `operation` alone, without the call context (`layout`, at start)."""
        if self._batcher is None:
            raise Unavailable("the Redis store is not started", backend="redis")
        return await self._batcher.direct(operation, keys, args)

    async def _run(self, operation: str, *args: Any) -> list[Any]:
        """Call the library's `operation` with `args` and the call context; raise Unavailable
        when Redis cannot be reached."""
        if self._batcher is None:
            raise Unavailable("the Redis store is not started", backend="redis")
        if self._outdated:
            raise Unavailable(self._outdated, backend="redis", redis_error="LAYOUT")
        sent = self.clock.monotonic()
        lo, hi, gen = self._clock_context(sent)
        argv = [operation, *args, self.config.redis_events_maxlen, self._grace, f"{sent:.6f}",
                lo, hi, gen]
        try:
            reply: list[Any] = await self._batcher.call(argv)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            # Only unreachability: a function's error is a bug and must not look like an outage.
            raise Unavailable(f"Redis unreachable: {exc}", backend="redis") from exc
        except RedisClusterException as exc:  # no primary serves the slot now (a failover)
            raise Unavailable(f"Redis Cluster cannot serve now: {exc}", backend="redis",
                              redis_error="CLUSTER") from exc
        except ResponseError as exc:
            code = not_serving(exc)
            if code is None:
                raise
            if code in RECONNECT and self._redis is not None:  # a failover: connect anew
                with contextlib.suppress(Exception):
                    await self._redis.connection_pool.disconnect()
            raise Unavailable(f"Redis cannot serve now: {code} {exc}", backend="redis",
                              redis_error=code) from exc
        if reply[0] == b"OK":
            stamp = reply[1].split()
            self._clock_check(stamp, sent, lo, hi)
            # The function's NOW becomes the base that puts Redis times on the local clock, as
            # of when the call was sent: the reply's own delay (queued behind others, a busy
            # loop) then shortens the durations derived from it, never lengthens them.
            reply[1] = sent - float(stamp[0])
        return reply

    @staticmethod
    def _base(base: float) -> float:
        """What to add to a Redis time to put it on the local clock (`_run` turns an OK
        reply's Redis NOW into it)."""
        return base

    # ---- holders ----------------------------------------------------------------------------

    async def register_holder(self, spec: HolderSpec, held: Iterable[Snapshot] = (),
                              held_ids: Sequence[str] = (), restore_only: bool = False
                              ) -> Registration:
        cfg = self.config
        snapshots = list(held)
        ttl = check_registration(cfg, spec, snapshots, held_ids, restore_only)
        args: list[Any] = ["register", spec.holder_id, spec.nixl_host, spec.nixl_port,
                           spec.tp_size, spec.block_size, spec.fingerprint, ttl, spec.version,
                           cfg.max_leases, len(snapshots)]
        for snap in snapshots:
            g = snap.grant
            idle, life = grant_ttls(cfg, g)
            args += [snap.lease_id, g.tenant, g.conversation_id, g.remote_request_id,
                     g.hashes + array("I", g.block_ids).tobytes(), g.token_count,
                     len(g.block_ids), snap.epoch, snap.age, idle, life,
                     *cfg.quota_of(g.tenant, self._quotas), g.history_keys]
        args += [1 if restore_only else 0, len(held_ids), *held_ids]
        reply = await self._run(*args)
        if reply[0] == b"ERR":
            reason = _s(reply[1])
            if reason == Refusal.HOLDER_CONFLICT:
                raise HolderConflict(
                    f"holder {spec.holder_id!r} is registered with another layout "
                    f"(block size {_s(reply[2])}, tp {_s(reply[3])}); deregister it first",
                    holder=spec.holder_id)
            if reason == Refusal.NOT_LEASE_HOLDER:
                raise held_of_another_holder(_s(reply[2]), int(reply[3]))
            raise refusal(self.config, reason)
        holder = holder_of(reply[2], self._base(reply[1]))
        self._block_sizes[holder.holder_id] = holder.block_size
        restored, reclaimable = [_s(x) for x in reply[3]], [_s(x) for x in reply[4]]
        log.info(_s(reply[5]), holder=holder.holder_id,
                 nixl=f"{holder.nixl_host}:{holder.nixl_port}", block_size=holder.block_size,
                 ttl_s=ttl, restored=len(restored), dead=len(reclaimable), backend="redis",
                 **({"shard": self.namespace} if self._sharded else {}))
        return Registration(holder, restored, reclaimable)

    async def heartbeat(self, holder_id: str,
                        reclaimed: Iterable[str] = ()) -> tuple[list[str], float]:
        acked = list(reclaimed)
        check_heartbeat(self.config, holder_id, acked)
        reply = await self._run("heartbeat", holder_id, *acked)
        if reply[0] == b"ERR":
            raise refusal(self.config, _s(reply[1]), holder=holder_id)
        return [_s(x) for x in reply[2]], float(reply[3])

    async def deregister_holder(self, holder_id: str) -> tuple[list[str], int]:
        check.identifier("holder_id", holder_id, self.config.max_id_length)
        reply = await self._run("deregister", holder_id)
        if reply[0] == b"ERR":
            raise refusal(self.config, _s(reply[1]), holder=holder_id)
        log.info("holder_draining", holder=holder_id, pinned=int(reply[3]))
        return [_s(x) for x in reply[2]], int(reply[3])

    async def holders(self) -> list[Holder]:
        reply = await self._run("holders")
        base = self._base(reply[1])
        return sorted((holder_of(f, base) for f in reply[2]), key=lambda h: h.holder_id)

    async def get_holder(self, holder_id: str) -> Holder:
        check.identifier("holder_id", holder_id, self.config.max_id_length)
        reply = await self._run("get_holder", holder_id)
        if reply[0] == b"ERR":
            self._block_sizes.pop(holder_id, None)
            raise refusal(self.config, _s(reply[1]), holder=holder_id)
        holder = holder_of(reply[2], self._base(reply[1]))
        self._block_sizes[holder_id] = holder.block_size
        return holder

    # ---- leases -----------------------------------------------------------------------------

    async def grant(self, g: GrantSpec) -> Grant:
        cfg = self.config
        check.identifier("holder_id", g.holder_id, cfg.max_id_length)
        block_size = self._block_sizes.get(g.holder_id)
        checked = False
        if block_size is not None:
            try:
                check_grant(cfg, g, block_size)
                checked = True
            except InvalidArgument:
                # The cached size may be stale (the holder re-registered with another block
                # size via another replica): check against the holder as it stands.
                self._block_sizes.pop(g.holder_id, None)
                block_size = None
        if block_size is None:
            block_size = (await self.get_holder(g.holder_id)).block_size
        if g.request_id:
            lease_id = grant_lease_id(g.holder_id, g.request_id) + self.tag
        else:
            lease_id = "l-" + secrets.token_hex(8) + self.tag
        idle, life = grant_ttls(cfg, g)
        payload = g.hashes + array("I", g.block_ids).tobytes()
        for _ in range(3):  # the function found another block size (STALE): check against it
            if not checked:
                check_grant(cfg, g, block_size)
            reply = await self._run(
                "grant", g.holder_id, block_size, lease_id, 1 if g.request_id else 0, g.tenant,
                g.conversation_id, g.remote_request_id, payload, g.token_count,
                len(g.block_ids), idle, life, cfg.max_leases,
                *cfg.quota_of(g.tenant, self._quotas), g.history_keys)
            if reply[0] != b"STALE":
                break
            block_size, checked = int(reply[1]), False
            self._block_sizes[g.holder_id] = block_size
        else:
            raise Unavailable("holder layout kept changing; retry", holder=g.holder_id)
        if reply[0] == b"ERR":
            reason = _s(reply[1])
            if reason == Refusal.HOLDER_NOT_FOUND:
                self._block_sizes.pop(g.holder_id, None)
            raise refusal(self.config, reason, holder=g.holder_id, request_id=g.request_id,
                                what="grant")
        base = self._base(reply[1])
        lease = lease_with_holder(reply[2], reply[3], base)
        superseded = lease_with_holder(reply[4][0], reply[4][1], base) if reply[4] else None
        for victim in (reply[5] if len(reply) > 5 else ()):
            log.info("lease_revoked", lease_id=_s(victim), tenant=g.tenant,
                     reason="tenant_quota", pins=0)
        log.debug("lease_granted", lease_id=lease.lease_id, tenant=g.tenant,
                  conversation=g.conversation_id, holder=g.holder_id, epoch=lease.epoch,
                  blocks=lease.block_count, tokens=g.token_count)
        return Grant(lease, superseded)

    async def renew(self, lease_ids: Iterable[str],
                    conversations: Iterable[tuple[str, str]] = ()) -> list[Renewal]:
        ids, convs = list(lease_ids), list(conversations)
        check_renewal(self.config, ids, convs)
        reply = await self._run("renew", len(ids), *ids, *(x for pair in convs for x in pair))
        out = []
        for lid, renewed, state, left in reply[2]:
            out.append(Renewal(_s(lid), bool(renewed), LeaseState(state) if state else None,
                               float(left)))
        return out

    async def revoke(self, lease_id: str, holder_id: str = "", reason: str = "") -> Lease:
        check_revocation(self.config, lease_id, holder_id, reason)
        reply = await self._run("revoke", lease_id, holder_id)
        if reply[0] == b"ERR":
            raise refusal(self.config, _s(reply[1]), lease_id=lease_id)
        lease = lease_with_holder(reply[2], reply[3], self._base(reply[1]))
        if reply[4]:
            log.info("lease_revoked", lease_id=lease_id, tenant=lease.tenant,
                     conversation=lease.conversation_id, holder=lease.holder.holder_id,
                     reason=reason or "unspecified", pins=lease.pin_count)
        return lease

    async def get_lease(self, lease_id: str) -> Lease:
        check.identifier("lease_id", lease_id, self.config.max_id_length)
        reply = await self._run("get_lease", lease_id)
        if reply[0] == b"ERR":
            raise refusal(self.config, _s(reply[1]), lease_id=lease_id)
        return lease_with_holder(reply[2], reply[3], self._base(reply[1]))

    async def reclaim_hold(self, lease_id: str = "") -> float:
        reply = await self._run("hold")
        return float(reply[2])

    async def list_leases(self, tenant: str = "", conversation_id: str = "",
                          holder_id: str = "", include_inactive: bool = False,
                          after: str = "", limit: int = 100) -> list[Lease]:
        check_listing(self.config, tenant, conversation_id, holder_id)
        reply = await self._run("list", tenant, conversation_id, holder_id,
                                1 if include_inactive else 0, after, limit)
        base = self._base(reply[1])
        holders = {_s(f[0]): holder_of(f, base) for f in reply[3]}
        return [lease_of(f, holders[_s(f[3])], base) for f in reply[2]]

    # ---- reads ------------------------------------------------------------------------------

    async def acquire_read(self, tenant: str, conversation_id: str, hashes: bytes,
                           min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                           request_id: str = "", caller: str = "") -> Read:
        check_read(self.config, tenant, conversation_id, min_tokens, pin_ttl, reader_id,
                   request_id)
        check_prompt_hashes(self.config, hashes)
        return await self._read("a", tenant, conversation_id, hashes, min_tokens, pin_ttl,
                                reader_id, request_id, caller)

    async def pin_lease(self, tenant: str, conversation_id: str, min_tokens: int = 0,
                        pin_ttl: float = 0.0, reader_id: str = "", request_id: str = "",
                        caller: str = "", history_keys: bytes = b"") -> Read:
        check_read(self.config, tenant, conversation_id, min_tokens, pin_ttl, reader_id,
                   request_id, history_keys)
        if history_keys:  # the lookup by content: the keys ride where a prompt's hashes do
            return await self._read("h", tenant, "", history_keys, min_tokens, pin_ttl,
                                    reader_id, request_id, caller)
        return await self._read("p", tenant, conversation_id, b"", min_tokens, pin_ttl,
                                reader_id, request_id, caller)

    async def _read(self, mode: str, tenant: str, conversation_id: str, hashes: bytes,
                    min_tokens: int, pin_ttl: float, reader_id: str, request_id: str,
                    caller: str) -> Read:
        cfg = self.config
        if request_id:
            pin_id = self._pin_id(tenant, reader_id, request_id, caller) + self.tag
        else:
            pin_id = "p-" + secrets.token_hex(8) + self.tag
        ttl = min(pin_ttl or cfg.default_pin_ttl_s, cfg.max_pin_ttl_s)
        reply = await self._run("read", mode, tenant, conversation_id, hashes, min_tokens, ttl,
                                pin_id, 1 if request_id else 0, cfg.max_pin_ttl_s,
                                cfg.tenant_max_pins)
        if reply[0] == b"ERR":
            raise refusal(self.config, _s(reply[1]), request_id=request_id, what="read",
                          tenant=tenant)
        # OK, base, miss, k, matched, partial, keys matched, whole[, lease, holder[, pin]]
        miss = MissReason(reply[2])
        if len(reply) == 8:
            return Read(miss, 0, None)
        base = self._base(reply[1])
        lease = lease_with_holder(reply[8], reply[9], base)
        pin = Pin(_s(reply[10]), lease, base + float(reply[11])) if len(reply) > 10 else None
        return Read(miss, int(reply[3]), lease, int(reply[4]), bool(reply[5]), pin,
                    keys_matched=int(reply[6]), whole=bool(reply[7]))

    async def release_read(self, pin_id: str) -> bool:
        check.identifier("pin_id", pin_id, self.config.max_id_length)
        reply = await self._run("release", pin_id)
        return bool(reply[2])

    # ---- chores, expiry, introspection ------------------------------------------------------

    def _chore(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def tick(self, *, turn: float = 0.0) -> int:
        cfg = self.config
        # A scheduler's tick takes the fleet's turn for `turn` seconds or leaves the work to
        # the replica that has it (see tick.lua).
        args = (self._ticker, turn) if turn > 0 else ("", 0)
        try:
            reply = await self._run("tick", cfg.expiry_batch,
                                    cfg.max_lifetime_cap_s + cfg.max_pin_ttl_s, self.layout,
                                    self.layout_min, OWED_EVENTS_PER_TICK, self._pin_secret,
                                    *args)
        except Unavailable as exc:
            self._unreachable("tick", exc)
            self._next_deadline = None
            return 0
        for hid, count in reply[4]:
            log.warning("holder_lost", holder=_s(hid), leases_lost=int(count), backend="redis")
            self._block_sizes.pop(_s(hid), None)
        self._next_deadline = self.clock.monotonic() + float(reply[3]) if reply[3] else None
        self._counts = {"leases_active": int(reply[5]), "leases_total": int(reply[6]),
                        "holders": int(reply[7]), "pins": int(reply[8]),
                        "history_keys": int(reply[11]) if len(reply) > 11 else 0}
        secret = bytes(reply[10]) if len(reply) > 10 else b""
        if secret and secret != self._pin_secret:
            # Redis lost its data and a replica started since made a new secret (or this one
            # had none to share): take it, so that a read retried on any replica finds its pin.
            self._use_pin_secret(secret)
            log.warning("redis_pin_secret_changed", namespace=self.namespace,
                        hint="reads retried across the change make a second pin, which "
                             "expires")
        self._check_layout_min(int(reply[9]))  # a newer replica may need this one gone
        if not self._sharded and self.count_check_due():  # (a ShardedStore checks its own)
            await self.recheck_shard_count(self.prefix, 1)
        expired = int(reply[2])
        if expired:
            log.debug("leases_expired", count=expired)
        return expired

    def count_check_due(self) -> bool:
        """Whether a tick should check the shard count record again (once a second)."""
        now = self.clock.monotonic()
        if now - self._count_checked < _COUNT_CHECK_EVERY_S:
            return False
        self._count_checked = now
        return True

    async def recheck_shard_count(self, prefix: str, count: int) -> str:
        """At a tick: stop serving if the namespace's shard count is no longer `count` (and
        say why); an unreachable Redis is checked at the next tick."""
        try:
            conflict = await self._shard_count_conflict(prefix, count)
        except (RedisError, RedisClusterException, OSError) as exc:
            self._unreachable("tick", exc)
            return ""
        if conflict:
            self._stop_serving(conflict)
        return conflict

    def _unreachable(self, during: str, exc: Exception) -> None:
        now = monotonic()
        if now - self._last_unreachable_log >= _UNREACHABLE_LOG_EVERY:
            self._last_unreachable_log = now
            if self._outdated:
                log.error("redis_layout_outdated", during=during, error=self._outdated)
            else:
                log.warning("redis_unreachable", during=during, error=str(exc))

    def next_deadline(self) -> float | None:
        return self._next_deadline

    def counts(self) -> dict[str, int]:
        return dict(self._counts)
