"""The layout of the Redis store's shared state: its keys, and the record of which layout the
replicas sharing a namespace speak (so that one of an older version, which would misread the
state, stops serving or refuses to start).

Keys (P = `{namespace}:`, a Redis Cluster hash tag, so all keys of a fleet, or of one shard of
it, live in one slot; a sharded fleet's shards have namespaces `namespace~KofN[.j]`):
  P h:<holder>       hash: host port tp bs fp ttl x(expire) ver s(state) la(lost at) rb(blocks)
                     rid(who served the state when it registered, see P rid; layout 5)
  P ha:<holder>      set: the holder's ACTIVE lease ids
  P hd:<holder>      set: its dead lease ids the holder has not confirmed freeing
  P holders          zset: live (active, draining) holder -> expire time
  P lost             zset: lost holder -> lost time (kept until its dead leases are freed)
  P l:<lease>        hash: t c h r p(hashes + uint32 block ids) n(tokens) b(blocks) e(epoch)
                     i(idle ttl) m(max lifetime) ct(created) x(expire) s(state) k(pin count)
                     hk(history keys, concatenated: only while ACTIVE, only when granted
                     with some; layout 4)
  P leases           zset (score 0): every lease id, in id order for listing
  P lexp             zset: ACTIVE lease -> expire time
  P c:<tenant> <conv>  string: the conversation's current lease id
  P ta:<tenant>      set: the tenant's ACTIVE lease ids (for quotas and listing)
  P td:<tenant>      set: the tenant's dead lease ids not yet freed (for listing; layout 3)
  P tb               hash: tenant -> blocks of its ACTIVE leases (for quotas)
  P tp               hash: tenant -> its live pins (tenant_max_pins)
  P tk:<tenant>      hash: history key (16 bytes) -> the tenant's ACTIVE lease most recently
                     granted or restored under it, for the lookup by content (layout 4)
  P tkn              string: how many entries the tk: hashes hold, all tenants (a metric)
  P p:<pin>          hash: l(lease) x(expire)
  P pexp             zset: pin -> expire time
  P events           stream: lease events (t l tn c h e w lt), read by every replica
  P renew_watch      string with a TTL: set while some replica watches renewals
  P pin_secret       the key of derived pin ids (kvbridge.ids.pin_id_maker), set by the first
                     replica to start, read by the others; written back by the next tick
                     when Redis lost it (every tick returns it)
  P clock            hash: fix (seconds added to TIME after a step), gen (the fix's
                     generation), off and tstep (tests)
  P layout           hash: version (the newest state layout of the replicas that shared it),
                     min (the oldest layout that may still share it)
  P owed             string: RECLAIMABLE events held back by the grace are owed (the first
                     tick after it queues them in P paying)
  P paying           zset: dead lease ids whose owed RECLAIMABLE is yet to be sent (a share
                     each tick; replicas of layout 2 before it ignore it: they leave the
                     sending to the others)
  P ticker           hash: o (the ticker token of the replica whose turn it is to run the
                     scheduled ticks), x (until when that turn holds, on the fleet's clock)
  P shards           how many shards the fleet spreads its tenants over (in the fleet's own
                     namespace; `_check_shard_count`)
  P rid, P hold_until  who serves this state (the Redis process's run id and its replication
                     id: a restart or a promotion changes it), and until when nothing is
                     reported reclaimable (pins granted before a loss of Redis data, a restart
                     or a failover, may still be read; store.lua `serving`)
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any, NoReturn

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from kvbridge.ids import PinIds, pin_id_maker

if TYPE_CHECKING:
    from kvbridge.services.registry._config import RegistryConfig

log = structlog.get_logger("kvbridge.registry")

# The layout of the shared state (its keys and fields, and what they mean) that this replica
# speaks, recorded in `<prefix>layout`. A change that replicas of another version would
# misread bumps it, and raises LAYOUT_MIN when the older ones must not go on sharing the
# namespace. (The functions' arguments are no part of it: each version calls its own functions,
# see `_redis_lua`.) Layout 1: replicas from before layouts were recorded (they neither record
# nor check one, and ignore the clock fix). Layout 3 adds `td:<tenant>`, the tenant's dead
# leases, for listings by tenant: layout-2 replicas do not keep it (a listing of inactive leases
# then misses the ones they killed until those are freed), which misreads nothing. Layout 4
# adds the lookup by content (`tk:<tenant>`, and each lease's keys in `hk`): layout-2 and 3
# replicas neither index the leases they grant or restore (those are not found by content)
# nor take the leases they kill out of the index (the lookup checks the lease an entry names
# and drops an entry it should not hold), which misreads nothing either; a lease granted
# before has no keys and is just not indexed. Layout 5 records in each holder who served the
# state when it registered and reads only the leases of holders registered with whoever serves
# it now (store.lua `confirmed`): an older replica would read leases that a failover or a
# restart from an older file brought back after their holder had freed them, so layout 5 needs
# the older ones gone.
LAYOUT = 5
LAYOUT_MIN = 5  # the oldest layout that may share a namespace with this one
# What a sharded fleet records as its own namespace's layout (beside its shard count, its
# state being in the shards' namespaces): releases from before sharding, which do not read
# the count, refuse to start on it (or stop serving) rather than serve that namespace as a
# fleet of one shard beside it; later releases read the count first.
SHARDED_NAMESPACE_LAYOUT = 6


class LayoutRecord:
    """The part of `RedisStore` that checks the shared namespace as it starts: the layout
    record, the eviction policy, the fleet's pin secret."""

    config: RegistryConfig
    namespace: str
    prefix: str
    layout: int
    layout_min: int
    _outdated: str  # why this replica no longer serves (a newer layout's minimum)
    _redis: aioredis.Redis | None
    _pin_secret: bytes
    _pin_id: PinIds

    async def _fcall(self, operation: str, keys: list[str], args: list[Any]) -> Any:
        raise NotImplementedError  # RedisStore's

    async def _failed_start(self, exc: Exception) -> NoReturn:
        raise NotImplementedError  # RedisStore's

    async def close(self) -> None:
        raise NotImplementedError  # RedisStore's

    async def _check_layout(self) -> None:
        """Record this replica's state layout in the namespace, or refuse to start when the
        replicas sharing it need a newer one (it would misread their state)."""
        try:
            ok, version, minimum = await self._fcall(
                "layout", [self.prefix + "layout"], [self.layout, self.layout_min])
        except (RedisError, OSError) as exc:
            await self._failed_start(exc)
        if not int(ok):
            await self.close()
            raise OSError(self._too_old(int(minimum)))
        if int(version) > self.layout:
            log.info("redis_layout_newer", namespace=self.namespace,
                     layout=self.layout, namespace_layout=int(version),
                     hint="replicas of a newer version share this namespace; upgrade this "
                          "one too")

    async def _check_shard_count(self, prefix: str, count: int) -> None:
        """Record in `<prefix>shards` how many shards the fleet of this namespace spreads its
        tenants over, or refuse to start with another count: replicas that disagree would
        look for a tenant's leases and pins in different shards, and one's reclaim could
        free KV under another's pin. (Changing it takes a new namespace, or every replica
        stopped and the namespace's keys deleted.)"""
        try:
            conflict = await self._shard_count_conflict(prefix, count, fresh=True)
        except (RedisError, OSError) as exc:
            await self._failed_start(exc)
        if conflict:
            await self.close()
            raise OSError(conflict)

    async def _shard_count_conflict(self, prefix: str, count: int, *, fresh: bool = False
                                    ) -> str:
        """Why `count` is not the namespace's shard count ("" when it is), writing the record
        when Redis lost it (every tick checks it again: a replica of another count started
        after a loss stops serving at the first tick that finds the record rewritten). A
        record missing at start (`fresh`) beside a single-shard fleet's state is that fleet's:
        it predates the record."""
        assert self._redis is not None
        key = prefix + "shards"
        recorded = await self._redis.get(key)
        if recorded is None and fresh:
            if count > 1 and await self._redis.exists(prefix + "holders", prefix + "leases",
                                                       prefix + "rid"):
                recorded = b"1"  # (a sharded fleet's own namespace has no such key)
            elif count == 1 and int(await self._redis.hget(prefix + "layout", "version")
                                    or 0) >= SHARDED_NAMESPACE_LAYOUT:
                # A sharded fleet's namespace that lost its count: refused without writing
                # one, which would stop that fleet.
                return (f"Redis namespace {self.config.redis_namespace!r} is a sharded "
                        "fleet's (its shard count record is lost): start this replica with "
                        "that fleet's --redis-shards")
        if recorded is None:
            await self._redis.set(key, count, nx=True)
            recorded = await self._redis.get(key)
        said = recorded.decode(errors="replace") if isinstance(recorded, bytes) else recorded
        if said is None or said == str(count):
            return ""
        return (f"Redis namespace {self.config.redis_namespace!r} is spread over {said} "
                f"shard(s); this replica was started with redis_shards {count}: start it "
                f"with --redis-shards {said}, or use a new --redis-namespace for another "
                "count")

    def _stop_serving(self, why: str) -> None:
        """Answer every call UNAVAILABLE from now on (readers recompute), for `why`."""
        if not self._outdated:
            log.error("redis_replica_stops_serving", namespace=self.namespace, why=why)
        self._outdated = why

    def _check_layout_min(self, minimum: int) -> None:
        """Stop serving when a newer replica raised the namespace's minimum past this one's
        layout (every tick reports it)."""
        if minimum > self.layout:
            self._outdated = self._too_old(minimum)
            log.error("redis_layout_outdated", namespace=self.namespace,
                      layout=self.layout, namespace_layout_min=minimum,
                      hint="this replica now answers UNAVAILABLE (readers recompute): "
                           "upgrade it")

    @property
    def not_serving(self) -> str:
        return self._outdated  # a newer layout's minimum left this replica behind

    def _too_old(self, minimum: int) -> str:
        return (f"Redis namespace {self.namespace!r} is shared by replicas whose "
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
