"""`RedisStore`: the lease state in Redis (or Valkey), shared by any number of registry replicas.

Every operation is one call of the Lua script in `_redis_lua` (atomic: a grant and the
supersession it causes, a pin and the lease activity it records, an expiry and its events
happen together or not at all). Time is Redis's own clock, read inside the script, so replicas
need no clock agreement; replies carry durations that this replica puts on its local clock.

- Expiry: every replica runs `tick()`; the script takes due holders, pins and leases and marks
  them in one step, so each deadline is processed (and its events sent) exactly once however
  many replicas tick. Deadlines are also applied lazily by any operation that touches a lease.
- Reclaim notices are pulled, not pushed: a holder's heartbeat returns its dead leases that no
  pin holds, until the holder confirms freeing them, so a notice can be neither lost (a replica
  dying) nor given under a live pin.
- Events go to a Redis Stream in the same script; each replica tails it and hands every event to
  its listeners (watch streams, metrics), so `WatchLeases` on any replica sees the whole fleet.
- Input is checked here with the same functions `LeaseTable` uses, before any Redis call; a
  refused call changes nothing. Redis errors become `Unavailable` (callers fail open): an
  unreachable Redis, and one that cannot serve now (loading, busy, a read-only replica...).
- A script call is sent once. A connection lost after it was written fails the call (Redis may
  have run it; the caller sees `Unavailable`) rather than sending it again; the scripts are
  replay-safe all the same (a grant or pin that exists already is answered as it stands).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
import sys
from array import array
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvbridge.clock import Clock, monotonic
from kvbridge.errors import (
    CapacityExhausted,
    HolderConflict,
    HolderDraining,
    HolderNotFound,
    IdempotencyConflict,
    InvalidArgument,
    KvbridgeError,
    LeaseNotFound,
    NotLeaseHolder,
    TenantQuotaExceeded,
    Unavailable,
)
from kvbridge.ids import grant_lease_id, pin_id_maker
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
from kvbridge.services.registry._model import (
    EventType,
    Holder,
    HolderState,
    Lease,
    LeaseEvent,
    LeaseState,
    MissReason,
    Pin,
)
from kvbridge.services.registry._redis_lua import LUA

log = structlog.get_logger("kvbridge.registry")

_EVENT_BATCH = 1000
_EVENT_BLOCK_MS = 200  # also bounds how long close() waits for the tail to stop
_RENEW_WATCH_MS = 5000  # replicas watching renewals re-announce it at least this often
_UNREACHABLE_LOG_EVERY = 5.0
# How far Redis's clock and this process's monotonic clock may drift apart, in seconds per
# second (NTP slews a clock by at most 500 ppm): what this replica knows of Redis's clock
# widens by this much with the time since it last saw it.
_CLOCK_DRIFT = 1e-3
_CLOCK_FIX_MAX_RTT = 0.1  # a step is fixed from a call of at most this round trip (seconds)
# The layout of the shared state (its keys and fields, and what the script's arguments mean)
# that this replica speaks, recorded in `<prefix>layout`. A change that replicas of another
# version would misread bumps it, and raises LAYOUT_MIN when the older ones must not go on
# sharing the namespace. Layout 1: replicas from before layouts were recorded (they neither
# record nor check one, and ignore the clock fix). Layout 3 adds `td:<tenant>`, the tenant's
# dead leases, for listings by tenant: layout-2 replicas do not keep it (a listing of inactive
# leases then misses the ones they killed until those are freed), which misreads nothing.
LAYOUT = 3
LAYOUT_MIN = 2  # the oldest layout that may share a namespace with this one
_LAYOUT_LUA = r"""
local K = KEYS[1]
local mine, min = tonumber(ARGV[1]), tonumber(ARGV[2])
local f = redis.call('HMGET', K, 'version', 'min')
local v, m = tonumber(f[1] or '0'), tonumber(f[2] or '0')
if mine < m then return {0, tostring(v), tostring(m)} end
if mine > v then v = mine; redis.call('HSET', K, 'version', v) end
if min > m then m = min; redis.call('HSET', K, 'min', m) end
return {1, tostring(v), tostring(m)}
"""


def _widened(bounds: tuple[float, float, float, bytes], at: float) -> tuple[float, float]:
    """Clock bounds learned at `bounds[2]`, widened by the drift allowed until `at`."""
    widen = max(at - bounds[2], 0.0) * _CLOCK_DRIFT
    return bounds[0] - widen, bounds[1] + widen


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


def _s(value: bytes) -> str:
    return value.decode()


class RedisStore:
    """Leases in Redis under `{config.redis_namespace}:`; see the module docstring."""

    def __init__(self, config: RegistryConfig, clock: Clock, *, recovering: bool = True
                 ) -> None:
        self.config = config
        self.clock = clock
        # When the shared state is found empty, hold reclaims for the grace (0: tests).
        self._grace = config.effective_recovery_grace_s if recovering else 0.0
        self.prefix = f"{{{config.redis_namespace}}}:"
        self._quotas = config.tenant_quotas()
        self._events_key = self.prefix + "events"
        self._keys = [self._events_key]
        self._redis: aioredis.Redis | None = None
        self._tail: aioredis.Redis | None = None  # blocking XREADs get their own connection
        self._script: Any = None
        self._batcher: _Batcher | None = None
        self._listeners: list[Listener] = []
        self._events_lost: Callable[[str], None] | None = None
        self._renewal_listeners: list[Listener] = []
        self._block_sizes: dict[str, int] = {}  # holder -> block size, to check grants first
        self._counts = {"leases_active": 0, "leases_total": 0, "holders": 0, "pins": 0}
        self._next_deadline: float | None = None
        self._reader: asyncio.Task[None] | None = None
        self._chores: set[asyncio.Task[Any]] = set()
        self._last_unreachable_log = 0.0
        self._closing = False
        self._use_pin_secret(b"")  # the fleet's, from Redis at start
        self._ticker = secrets.token_hex(8)  # this replica's token for the fleet's tick turn
        # What this replica knows of the fleet clock: (lo, hi, at, gen) bounds of (that clock -
        # our monotonic clock) as of our monotonic `at`, learned under the fix of generation
        # `gen`; see `_clock_check` and the script.
        self._clock_bounds: tuple[float, float, float, bytes] | None = None
        self._clock_fixing = False
        self._last_clock_log = float("-inf")
        self.clock_steps = 0  # steps of Redis's clock this replica confirmed (and fixed)
        self.layout, self.layout_min = LAYOUT, LAYOUT_MIN  # (tests set others)
        self._outdated = ""  # why this replica no longer serves (a newer layout's minimum)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        url = self.config.redis_url
        try:
            # Script calls (and every other write) go through this one: never resent.
            self._redis = aioredis.Redis.from_url(url, socket_connect_timeout=2.0,
                                                  socket_timeout=5.0, retry=_no_retry(),
                                                  **_pool_checks())
            self._tail = aioredis.Redis.from_url(url, socket_connect_timeout=2.0,
                                                 socket_timeout=_EVENT_BLOCK_MS / 1000 + 5.0,
                                                 retry=_retry(), **_pool_checks())
            await self._redis.ping()
            last = await self._redis.xrevrange(self._events_key, count=1)
        except (RedisError, OSError, ValueError) as exc:
            await self.close()
            raise OSError(f"cannot reach Redis at {url}: {exc}") from exc
        await self._check_eviction_policy()
        await self._check_layout()
        self._use_pin_secret(await self._shared_pin_secret())
        self._script = self._redis.register_script(LUA)
        self._batcher = _Batcher(self._redis, self._script, self._events_key)
        await self.tick()  # loads the script, primes counts
        if self._outdated:  # a newer replica raised the minimum since the check above
            await self.close()
            raise OSError(self._outdated)
        last_id: Any = last[0][0] if last else b"0-0"
        self._reader = asyncio.create_task(self._read_events(last_id), name="registry-events")
        log.info("redis_store_started", url=_redacted(url), namespace=self.config.redis_namespace)

    async def _check_layout(self) -> None:
        """Record this replica's state layout in the namespace, or refuse to start when the
        replicas sharing it need a newer one (it would misread their state)."""
        assert self._redis is not None
        try:
            ok, version, minimum = await self._redis.eval(
                _LAYOUT_LUA, 1, self.prefix + "layout", self.layout, self.layout_min)
        except (RedisError, OSError) as exc:
            await self._failed_start(exc)
        if not int(ok):
            await self.close()
            raise OSError(self._too_old(int(minimum)))
        if int(version) > self.layout:
            log.info("redis_layout_newer", namespace=self.config.redis_namespace,
                     layout=self.layout, namespace_layout=int(version),
                     hint="replicas of a newer version share this namespace; upgrade this "
                          "one too")

    @property
    def not_serving(self) -> str:
        return self._outdated  # a newer layout's minimum left this replica behind

    async def _failed_start(self, exc: Exception) -> NoReturn:
        await self.close()
        raise OSError(f"cannot reach Redis at {_redacted(self.config.redis_url)}: {exc}"
                      ) from exc

    def _too_old(self, minimum: int) -> str:
        return (f"Redis namespace {self.config.redis_namespace!r} is shared by replicas whose "
                f"state layout needs at least {minimum}; this replica speaks layout "
                f"{self.layout}: upgrade kvbridge on it")

    def _use_pin_secret(self, secret: bytes) -> None:
        self._pin_secret = secret
        self._pin_id = pin_id_maker(secret)

    async def _shared_pin_secret(self) -> bytes:
        """The key of every replica's pin ids (`kvbridge.ids.pin_id_maker`), made by the first
        replica to start: a read retried on another replica finds the same pin. (A Redis that
        lost its data gets it back from the first replica's tick after; one started in
        between makes a new one, which the others take at their next tick.)"""
        assert self._redis is not None
        key = self.prefix + "pin_secret"
        try:
            await self._redis.set(key, secrets.token_hex(16), nx=True)
            secret = await self._redis.get(key)
        except (RedisError, OSError) as exc:
            await self._failed_start(exc)
        if not secret:  # evicted or flushed between the two calls: this replica's own
            return secrets.token_bytes(16)
        return secret.encode() if isinstance(secret, str) else bytes(secret)

    async def _check_eviction_policy(self) -> None:
        """Warn when Redis may evict any key: a lease, pin or conversation key dropped under
        memory pressure loses state the fleet relies on (pins most of all)."""
        assert self._redis is not None
        try:
            policy = (await self._redis.config_get("maxmemory-policy")).get("maxmemory-policy")
        except RedisError:  # CONFIG is often disabled on managed Redis: nothing to check
            return
        if policy and policy.startswith("allkeys"):
            log.warning("redis_may_evict_leases", maxmemory_policy=policy,
                        hint="set maxmemory-policy noeviction (or a volatile-* policy): an "
                             "evicted key loses a lease or a pin")

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

    async def _run(self, *args: Any) -> list[Any]:
        """Run one script command; raise Unavailable when Redis cannot be reached."""
        if self._script is None:
            raise Unavailable("the Redis store is not started", backend="redis")
        if self._outdated:
            raise Unavailable(self._outdated, backend="redis", redis_error="LAYOUT")
        sent = self.clock.monotonic()
        bounds = self._clock_bounds
        if bounds is None:
            lo = hi = ""
            gen = b""
        else:
            b_lo, b_hi = _widened(bounds, sent)
            lo, hi, gen = f"{b_lo:.6f}", f"{b_hi:.6f}", bounds[3]
        argv = [args[0], self.config.redis_events_maxlen, self._grace, f"{sent:.6f}", lo, hi,
                gen, *args[1:]]
        try:
            if self._batcher is None:
                raise Unavailable("the Redis store is not started", backend="redis")
            reply: list[Any] = await self._batcher.call(argv)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            # Only unreachability: a script error is a bug and must not look like an outage.
            raise Unavailable(f"Redis unreachable: {exc}", backend="redis") from exc
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
            # The script's NOW becomes the base that puts Redis times on the local clock, as of
            # when the call was sent: the reply's own delay (queued behind others, a busy loop)
            # then shortens the durations derived from it, never lengthens them.
            reply[1] = sent - float(stamp[0])
        return reply

    def _clock_check(self, stamp: list[bytes], sent: float, lo: str, hi: str) -> None:
        """Learn the fleet clock from a reply's stamp (NOW, the clock, the fix's generation)
        or, when the script found the clock outside what this replica knew of it (then also
        Redis's clock), confirm the step and store the fix that undoes it.

        Each reply bounds (fleet clock - monotonic clock): the script ran after the call was
        sent and before its reply came. Bounds meet (intersect) over replies, widened by the
        drift allowed since; replies that disagree with them (a step below the script's
        threshold) or come under another fix start them anew."""
        recv = self.clock.monotonic()
        base, gen = float(stamp[1]), stamp[2]
        if len(stamp) == 3:
            s_lo, s_hi = base - recv, base - sent
            bounds = self._clock_bounds
            if bounds is not None and bounds[3] == gen:
                b_lo, b_hi = _widened(bounds, sent)
                n_lo, n_hi = max(b_lo, s_lo), min(b_hi, s_hi)
                if n_lo <= n_hi:
                    s_lo, s_hi = n_lo, n_hi
            self._clock_bounds = (s_lo, s_hi, sent, gen)
            return
        # The call ran at sent + lo (the script's BASE); Redis's clock said `raw`.
        off = float(stamp[3]) - base  # > 0: Redis's clock is ahead of what we know of it
        rtt = recv - sent
        # Back: certain (a call cannot run before it is sent). Forward: certain once more than
        # the round trip (the call ran before its reply came), plus what we did not know. A fix
        # is only as good as the call's round trip: only a quick one stores it.
        certain = off < 0 or off > rtt + (float(hi) - float(lo)) + 0.01
        if not certain or rtt > _CLOCK_FIX_MAX_RTT:
            if recv - self._last_clock_log >= _UNREACHABLE_LOG_EVERY:
                self._last_clock_log = recv
                log.warning("redis_clock_unconfirmed", ahead_s=round(off, 6),
                            round_trip_s=round(rtt, 6),
                            hint="Redis's clock is not where this replica expected it, and the "
                                 "call took too long to tell a step: it ran at the earliest "
                                 "time it could have")
            return
        if self._clock_fixing or self._closing:
            return
        self._clock_fixing = True
        self._chore(self._store_clock_fix(gen, off))

    async def _store_clock_fix(self, gen: bytes, step: float) -> None:
        try:
            reply = await self._run("clockfix", gen, f"{-step:.6f}")
            if int(reply[2]):
                self.clock_steps += 1
                log.warning("redis_clock_step", step_s=round(step, 6),
                            hint="Redis's clock stepped (NTP, a failover to another host): "
                                 "the fleet's clock keeps its pace; pins and leases keep "
                                 "their deadlines")
        except (Unavailable, RedisError, OSError) as exc:
            self._unreachable("clockfix", exc)
        finally:
            self._clock_fixing = False

    @staticmethod
    def _base(base: float) -> float:
        """What to add to a Redis time to put it on the local clock (`_run` turns an OK
        reply's Redis NOW into it)."""
        return base

    # ---- decoding ---------------------------------------------------------------------------

    @staticmethod
    def _holder(f: list[Any], base: float) -> Holder:
        hid, host, port, tp, bs, fp, ttl, x, ver, state, blocks, active = f
        holder = Holder(_s(hid), _s(host), int(port), int(tp), int(bs), _s(fp), float(ttl),
                        base + float(x), _s(ver))
        holder.state = HolderState(int(state))
        holder.retained_blocks = int(blocks)
        holder.lease_count = int(active)
        return holder

    @staticmethod
    def _lease(f: list[Any], holder: Holder, base: float) -> Lease:
        lid, tenant, conv, _h, rrid, payload, tokens, epoch, idle, life, created, x, state, k = f
        return Lease.from_payload(
            _s(lid), sys.intern(_s(tenant)), _s(conv), holder, _s(rrid), payload, int(tokens),
            int(epoch), float(idle), float(life), base + float(created), base + float(x),
            LeaseState(int(state)), int(k))

    def _lease_with_holder(self, lease: list[Any], holder: list[Any], base: float) -> Lease:
        return self._lease(lease, self._holder(holder, base), base)

    # ---- holders ----------------------------------------------------------------------------

    async def register_holder(self, spec: HolderSpec,
                              held: Iterable[Snapshot] = ()) -> Registration:
        cfg = self.config
        snapshots = list(held)
        ttl = check_registration(cfg, spec, snapshots)
        args: list[Any] = ["register", spec.holder_id, spec.nixl_host, spec.nixl_port,
                           spec.tp_size, spec.block_size, spec.fingerprint, ttl, spec.version,
                           cfg.max_leases, len(snapshots)]
        for snap in snapshots:
            g = snap.grant
            idle, life = grant_ttls(cfg, g)
            args += [snap.lease_id, g.tenant, g.conversation_id, g.remote_request_id,
                     g.hashes + array("I", g.block_ids).tobytes(), g.token_count,
                     len(g.block_ids), snap.epoch, snap.age, idle, life,
                     *cfg.quota_of(g.tenant, self._quotas)]
        reply = await self._run(*args)
        if reply[0] == b"ERR":
            reason = _s(reply[1])
            if reason == "HOLDER_CONFLICT":
                raise HolderConflict(
                    f"holder {spec.holder_id!r} is registered with another layout "
                    f"(block size {_s(reply[2])}, tp {_s(reply[3])}); deregister it first",
                    holder=spec.holder_id)
            if reason == "NOT_LEASE_HOLDER":
                raise held_of_another_holder(_s(reply[2]), int(reply[3]))
            raise self._refusal(reason)
        holder = self._holder(reply[2], self._base(reply[1]))
        self._block_sizes[holder.holder_id] = holder.block_size
        restored, reclaimable = [_s(x) for x in reply[3]], [_s(x) for x in reply[4]]
        log.info(_s(reply[5]), holder=holder.holder_id,
                 nixl=f"{holder.nixl_host}:{holder.nixl_port}", block_size=holder.block_size,
                 ttl_s=ttl, restored=len(restored), dead=len(reclaimable), backend="redis")
        return Registration(holder, restored, reclaimable)

    async def heartbeat(self, holder_id: str,
                        reclaimed: Iterable[str] = ()) -> tuple[list[str], float]:
        acked = list(reclaimed)
        check_heartbeat(self.config, holder_id, acked)
        reply = await self._run("heartbeat", holder_id, *acked)
        if reply[0] == b"ERR":
            raise self._refusal(_s(reply[1]), holder=holder_id)
        return [_s(x) for x in reply[2]], float(reply[3])

    async def deregister_holder(self, holder_id: str) -> tuple[list[str], int]:
        check.identifier("holder_id", holder_id, self.config.max_id_length)
        reply = await self._run("deregister", holder_id)
        if reply[0] == b"ERR":
            raise self._refusal(_s(reply[1]), holder=holder_id)
        log.info("holder_draining", holder=holder_id, pinned=int(reply[3]))
        return [_s(x) for x in reply[2]], int(reply[3])

    async def holders(self) -> list[Holder]:
        reply = await self._run("holders")
        base = self._base(reply[1])
        return sorted((self._holder(f, base) for f in reply[2]), key=lambda h: h.holder_id)

    async def get_holder(self, holder_id: str) -> Holder:
        check.identifier("holder_id", holder_id, self.config.max_id_length)
        reply = await self._run("get_holder", holder_id)
        if reply[0] == b"ERR":
            self._block_sizes.pop(holder_id, None)
            raise self._refusal(_s(reply[1]), holder=holder_id)
        holder = self._holder(reply[2], self._base(reply[1]))
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
            lease_id = grant_lease_id(g.holder_id, g.request_id)
        else:
            lease_id = "l-" + secrets.token_hex(8)
        idle, life = grant_ttls(cfg, g)
        payload = g.hashes + array("I", g.block_ids).tobytes()
        for _ in range(3):  # the script found another block size (STALE): check against it
            if not checked:
                check_grant(cfg, g, block_size)
            reply = await self._run(
                "grant", g.holder_id, block_size, lease_id, 1 if g.request_id else 0, g.tenant,
                g.conversation_id, g.remote_request_id, payload, g.token_count,
                len(g.block_ids), idle, life, cfg.max_leases,
                *cfg.quota_of(g.tenant, self._quotas))
            if reply[0] != b"STALE":
                break
            block_size, checked = int(reply[1]), False
            self._block_sizes[g.holder_id] = block_size
        else:
            raise Unavailable("holder layout kept changing; retry", holder=g.holder_id)
        if reply[0] == b"ERR":
            reason = _s(reply[1])
            if reason == "HOLDER_NOT_FOUND":
                self._block_sizes.pop(g.holder_id, None)
            raise self._refusal(reason, holder=g.holder_id, request_id=g.request_id,
                                what="grant")
        base = self._base(reply[1])
        lease = self._lease_with_holder(reply[2], reply[3], base)
        superseded = self._lease_with_holder(reply[4][0], reply[4][1], base) if reply[4] else None
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
            raise self._refusal(_s(reply[1]), lease_id=lease_id)
        lease = self._lease_with_holder(reply[2], reply[3], self._base(reply[1]))
        if reply[4]:
            log.info("lease_revoked", lease_id=lease_id, tenant=lease.tenant,
                     conversation=lease.conversation_id, holder=lease.holder.holder_id,
                     reason=reason or "unspecified", pins=lease.pin_count)
        return lease

    async def get_lease(self, lease_id: str) -> Lease:
        check.identifier("lease_id", lease_id, self.config.max_id_length)
        reply = await self._run("get_lease", lease_id)
        if reply[0] == b"ERR":
            raise self._refusal(_s(reply[1]), lease_id=lease_id)
        return self._lease_with_holder(reply[2], reply[3], self._base(reply[1]))

    async def reclaim_hold(self) -> float:
        reply = await self._run("hold")
        return float(reply[2])

    async def list_leases(self, tenant: str = "", conversation_id: str = "",
                          holder_id: str = "", include_inactive: bool = False,
                          after: str = "", limit: int = 100) -> list[Lease]:
        check_listing(self.config, tenant, conversation_id, holder_id)
        reply = await self._run("list", tenant, conversation_id, holder_id,
                                1 if include_inactive else 0, after, limit)
        base = self._base(reply[1])
        holders = {_s(f[0]): self._holder(f, base) for f in reply[3]}
        return [self._lease(f, holders[_s(f[3])], base) for f in reply[2]]

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
                        caller: str = "") -> Read:
        check_read(self.config, tenant, conversation_id, min_tokens, pin_ttl, reader_id,
                   request_id)
        return await self._read("p", tenant, conversation_id, b"", min_tokens, pin_ttl,
                                reader_id, request_id, caller)

    async def _read(self, mode: str, tenant: str, conversation_id: str, hashes: bytes,
                    min_tokens: int, pin_ttl: float, reader_id: str, request_id: str,
                    caller: str) -> Read:
        cfg = self.config
        if request_id:
            pin_id = self._pin_id(tenant, reader_id, request_id, caller)
        else:
            pin_id = "p-" + secrets.token_hex(8)
        ttl = min(pin_ttl or cfg.default_pin_ttl_s, cfg.max_pin_ttl_s)
        reply = await self._run("read", mode, tenant, conversation_id, hashes, min_tokens, ttl,
                                pin_id, 1 if request_id else 0, cfg.max_pin_ttl_s)
        if reply[0] == b"ERR":
            raise self._refusal(_s(reply[1]), request_id=request_id, what="read")
        miss = MissReason(reply[2])
        if len(reply) == 6:
            return Read(miss, 0, None)
        base = self._base(reply[1])
        lease = self._lease_with_holder(reply[6], reply[7], base)
        pin = Pin(_s(reply[8]), lease, base + float(reply[9])) if len(reply) > 8 else None
        return Read(miss, int(reply[3]), lease, int(reply[4]), bool(reply[5]), pin)

    async def release_read(self, pin_id: str) -> bool:
        check.identifier("pin_id", pin_id, self.config.max_id_length)
        reply = await self._run("release", pin_id)
        return bool(reply[2])

    # ---- errors -----------------------------------------------------------------------------

    def _refusal(self, reason: str, *, holder: str = "", lease_id: str = "",
                 request_id: str = "", what: str = "") -> KvbridgeError:
        """The domain error (with LeaseTable's wording) for a script's refusal."""
        if reason == "HOLDER_NOT_FOUND":
            return HolderNotFound(f"holder {holder!r} is not registered; register it (again)",
                                  holder=holder)
        if reason == "HOLDER_DRAINING":
            return HolderDraining(f"holder {holder!r} is draining", holder=holder)
        if reason == "CAPACITY_EXHAUSTED":
            return CapacityExhausted("registry lease capacity reached",
                                     limit=self.config.max_leases)
        if reason == "LEASE_NOT_FOUND":
            return LeaseNotFound(f"no lease {lease_id!r}", lease_id=lease_id)
        if reason == "NOT_LEASE_HOLDER":
            return NotLeaseHolder(f"lease {lease_id!r} belongs to another holder",
                                  lease_id=lease_id)
        if reason == "TENANT_QUOTA_EXCEEDED":
            return TenantQuotaExceeded(
                "the tenant is at its quota and its other leases are pinned (or this lease "
                "alone exceeds its block quota)", holder=holder)
        if reason == "REQUEST_ID_REUSED":
            return IdempotencyConflict(f"request_id {request_id!r} was used for another {what}",
                                       request_id=request_id)
        return KvbridgeError(f"Redis store refused: {reason}")

    # ---- events -----------------------------------------------------------------------------

    def add_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        self._listeners.append(listener)
        if renewals:
            self._renewal_listeners.append(listener)
            self._chore(self._announce_renewal_watch())

    def remove_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        self._listeners.remove(listener)
        if renewals:
            self._renewal_listeners.remove(listener)

    def listener_count(self) -> int:
        return len(self._listeners)

    def on_events_lost(self, callback: Callable[[str], None]) -> None:
        self._events_lost = callback

    def _chore(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _announce_renewal_watch(self) -> None:
        """Renewals are written to the stream only while some replica watches them."""
        if self._redis is not None:
            try:
                await self._redis.set(self.prefix + "renew_watch", 1, px=_RENEW_WATCH_MS * 2)
            except (RedisError, OSError) as exc:
                log.warning("redis_unreachable", during="renew_watch", error=str(exc))

    async def _read_events(self, last_id: Any) -> None:
        """Tail the fleet's event stream and hand each event to this replica's listeners.

        Each read first checks, on the same connection, that the stream still holds the last
        event delivered: a Redis that restarted without its data or from an older snapshot, a
        failover to a replica that lagged (redis-py reconnects without a word), or a trim to
        MAXLEN past a tail that fell behind all lose events, and `on_events_lost` hears of it.
        """
        assert self._tail is not None
        announced = 0.0
        gone: Any = None  # a last id found missing and told of: read past, not checked again
        while not self._closing:
            try:
                async with self._tail.pipeline(transaction=False) as pipe:
                    if last_id not in (b"0-0", gone):  # (0-0: nothing delivered to check)
                        pipe.xrange(self._events_key, min=last_id, max=last_id)
                    pipe.xread({self._events_key: last_id}, count=_EVENT_BATCH,
                               block=_EVENT_BLOCK_MS)
                    *kept, reply = await pipe.execute()
                if kept and not kept[0]:
                    last_id = gone = await self._events_gap(last_id)
                    continue
            except Exception as exc:  # the tail must outlive any one failure
                if self._closing:
                    return
                self._unreachable("events", exc)
                await asyncio.sleep(0.5)
                continue
            streams = reply.items() if isinstance(reply, dict) else reply or []
            entries: Any
            for _key, entries in streams:
                for event_id, fields in entries:
                    last_id = event_id
                    try:
                        self._deliver(fields)
                    except Exception as exc:  # one unreadable event must not stop the tail
                        log.warning("redis_event_skipped", id=_event_id(event_id),
                                    reason=f"{type(exc).__name__}: {exc}")
            if self._renewal_listeners and monotonic() - announced > _RENEW_WATCH_MS / 1e3:
                announced = monotonic()
                await self._announce_renewal_watch()

    async def _events_gap(self, last_id: Any) -> Any:
        """The stream no longer holds `last_id`, the last event delivered: tell
        `on_events_lost`, and return where to read on. Entries after `last_id` came since (ids
        follow the clock): from `last_id`. A stream whose entries all come before it (an older
        snapshot's, or new ones under a clock behind ours: they cannot be told apart) is read
        from after its newest entry, and an empty one from its start."""
        assert self._tail is not None
        log.warning("redis_events_lost", after=_event_id(last_id),
                    hint="watch streams end: watchers re-list")
        if self._events_lost is not None:
            try:
                self._events_lost(
                    "lease events may have been lost while Redis was unreachable (its event "
                    f"stream no longer holds event {_event_id(last_id)}, the last this "
                    "replica delivered)")
            except Exception:  # the tail goes on whatever the callback does
                log.exception("events_lost_callback_failed")
        newest = await self._tail.xrevrange(self._events_key, count=1)
        if not newest:
            return b"0-0"
        return last_id if _id_order(newest[0][0]) > _id_order(last_id) else newest[0][0]

    def _deliver(self, fields: dict[bytes, bytes]) -> None:
        kind = EventType(int(fields[b"t"]))
        targets = self._renewal_listeners if kind is EventType.RENEWED else self._listeners
        if not targets:
            return
        event = LeaseEvent.of(kind, _s(fields[b"l"]), sys.intern(_s(fields[b"tn"])),
                              _s(fields[b"c"]), _s(fields[b"h"]), int(fields[b"e"]),
                              float(fields[b"w"]), float(fields[b"lt"]))
        for listener in tuple(targets):
            try:
                listener(event)
            except Exception:  # one bad listener must not stop the stream for the others
                log.exception("event_listener_failed", type=kind.name)

    # ---- expiry, introspection --------------------------------------------------------------

    async def tick(self, *, turn: float = 0.0) -> int:
        cfg = self.config
        # A scheduler's tick takes the fleet's turn for `turn` seconds or leaves the work to
        # the replica that has it (see the script).
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
                        "holders": int(reply[7]), "pins": int(reply[8])}
        secret = bytes(reply[10]) if len(reply) > 10 else b""
        if secret and secret != self._pin_secret:
            # Redis lost its data and a replica started since made a new secret (or this one
            # had none to share): take it, so that a read retried on any replica finds its pin.
            self._use_pin_secret(secret)
            log.warning("redis_pin_secret_changed", namespace=self.config.redis_namespace,
                        hint="reads retried across the change make a second pin, which "
                             "expires")
        if int(reply[9]) > self.layout:  # a newer replica needs this one gone: stop serving
            self._outdated = self._too_old(int(reply[9]))
            log.error("redis_layout_outdated", namespace=self.config.redis_namespace,
                      layout=self.layout, namespace_layout_min=int(reply[9]),
                      hint="this replica now answers UNAVAILABLE (readers recompute): "
                           "upgrade it")
        expired = int(reply[2])
        if expired:
            log.debug("leases_expired", count=expired)
        return expired

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

    # ---- tests ------------------------------------------------------------------------------

    async def advance_clock(self, seconds: float) -> None:
        """Move the fleet's clock (every replica on this namespace) forward: for tests, which
        advance time instead of sleeping."""
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        assert self._redis is not None
        await self._redis.hincrbyfloat(self.prefix + "clock", "off", seconds)

    async def step_redis_clock(self, seconds: float) -> None:
        """Step Redis's own clock (as an NTP step or a failover to another host would), which
        the replicas must notice and undo: for tests."""
        assert self._redis is not None
        await self._redis.hincrbyfloat(self.prefix + "clock", "tstep", seconds)


def _retry() -> Retry:
    """For the event tail (reads only): one immediate retry when a pooled connection turns out
    dead (Redis restarted), and no more: with Redis down, calls must fail fast."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def _no_retry() -> Retry:
    """For script calls and other writes: none. redis-py retries a command (or a whole
    pipeline) by sending it again, also after a connection lost while reading the reply, when
    Redis has run it. A pooled connection that Redis closed (a restart) is still replaced
    before use: the pool checks each one as it hands it out."""
    return Retry(NoBackoff(), 0)


def _pool_checks() -> dict[str, Any]:
    """Options that keep redis-py's pool replacing a pooled connection Redis has closed before
    handing it out. redis-py 7+ skips that check while "maintenance notifications" (a RESP3
    feature of managed Redis, unused here) are on, and they are on ("auto") by default: the
    first call after a Redis restart would then fail, since script calls are never resent."""
    # The asyncio client takes the option from redis-py 8.1 (7.x has the notifications in the
    # blocking client only): ask the client itself rather than the version.
    if "maint_notifications_config" not in inspect.signature(aioredis.Redis.__init__).parameters:
        return {}
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # no such notifications: the pool always checks
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def _id_order(event_id: Any) -> tuple[int, int]:
    """A stream entry id `ms-seq` as a pair that sorts as Redis does."""
    ms, _, seq = _event_id(event_id).partition("-")
    return int(ms), int(seq or 0)


def _event_id(event_id: Any) -> str:
    return event_id.decode() if isinstance(event_id, bytes) else str(event_id)


def _redacted(url: str) -> str:
    """The URL without a password, for logs."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest


class _Batcher:
    """Sends the script calls made within one turn of the event loop to Redis together, as one
    non-transactional pipeline: one write and one read for the lot instead of a connection
    checkout, a write and a read each. Every call is still its own atomic script run, in the
    order made; a failure of one is that call's alone. Under load the gRPC server hands the
    store many calls per loop turn, so this is most of a replica's Redis overhead."""

    def __init__(self, redis: Any, script: Any, events_key: str) -> None:
        self._redis, self._script, self._keys = redis, script, [events_key]
        self._queue: list[tuple[list[Any], asyncio.Future[Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def call(self, args: list[Any]) -> asyncio.Future[Any]:
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
            reply = await self._script(keys=self._keys, args=args)  # loads it if Redis lost it
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
        for args, _ in batch:
            pipe.evalsha(self._script.sha, 1, *self._keys, *args)
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
            if isinstance(reply, NoScriptError):  # Redis restarted: load it, run this one
                await self._one(args, future)
            elif future.done():
                continue
            elif isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result(reply)

