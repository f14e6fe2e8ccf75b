"""`ShardedStore`: the fleet's state spread over N `RedisStore` shards by tenant, so that the
primaries of a Redis Cluster share it (one hash tag keeps every key of a shard in one slot,
and one slot is served by one primary).

Each shard is a whole store: its own namespace, function calls, clock, event stream, expiry
ticks, recovery hold and `serving` check, so that a failover of one primary holds and
re-confirms only its shard's part. This class writes no lease rule; it only routes:

- A call that names a tenant (grant, read, pin, a listing or renewal by tenant) goes to the
  tenant's shard: a stable hash of the tenant, modulo N.
- A call that names a lease or pin id goes to the shard that made it: ids end with the
  shard's tag (".s3"). An id without a valid tag (one a holder derives from a request id, or
  one restored from before sharding) is asked of every shard, and the one that knows it
  answers.
- A holder lives in every shard (its leases may be of any tenant): registration, heartbeat and
  deregistration fan out. A registration sends each shard the snapshots it will keep and the
  held ids it made (untagged ones to all). `HOLDER_NOT_FOUND` from any shard is the answer, so
  that the holder registers again everywhere. A heartbeat is answered by the shards that
  answer (one out of reach must not get the holder lost in the others); any other failure of
  a shard fails the call, and the retry repeats what the others did (every holder call is
  idempotent).
- Broad listings merge the shards' pages in lease id order, so the page token (the last id)
  works across them.
- Shard namespaces are `NAMESPACE~KofN` (see `shard_namespaces`); the fleet's own namespace
  keeps only the shard count and a layout record that releases from before sharding refuse.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import structlog
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import RedisClusterException, RedisError

from kvbridge.clock import Clock
from kvbridge.errors import LeaseNotFound, NotLeaseHolder, Unavailable
from kvbridge.services.registry import _validate as check
from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._core import (
    Grant,
    GrantSpec,
    HolderSpec,
    Listener,
    Read,
    Registration,
    Renewal,
    Snapshot,
    check_heartbeat,
    check_listing,
    check_registration,
    check_renewal,
    check_revocation,
    held_of_another_holder,
)
from kvbridge.services.registry._model import Holder, Lease
from kvbridge.services.registry._redis import RedisStore
from kvbridge.services.registry._redis_layout import SHARDED_NAMESPACE_LAYOUT

__all__ = ["ShardedStore", "shard_namespaces", "shard_of"]

_T = TypeVar("_T")

log = structlog.get_logger("kvbridge.registry")


def shard_namespaces(namespace: str, count: int) -> list[str]:
    """The namespaces of `count` shards of `namespace`: `NAMESPACE~KofN`, with a suffix
    `.J` where needed to put shard K's slot in the K-th of `count` equal ranges of the
    cluster's slots. (`~` is refused in a configured namespace, and the count is in the name:
    no shard of one count shares keys with a fleet's own namespace or another count's shard.)"""
    names = []
    for k in range(count):
        lo = k * REDIS_CLUSTER_HASH_SLOTS // count
        hi = (k + 1) * REDIS_CLUSTER_HASH_SLOTS // count
        j = 0
        while True:
            name = f"{namespace}~{k}of{count}" + (f".{j}" if j else "")
            if lo <= key_slot(f"{{{name}}}".encode()) < hi:
                break
            j += 1
        names.append(name)
    return names


def shard_of(tenant: str, count: int) -> int:
    """The shard of a tenant: stable across processes and versions (not Python's hash)."""
    digest = hashlib.blake2b(tenant.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


class ShardedStore:
    """N `RedisStore` shards behind the `LeaseStore` interface; see the module docstring."""

    def __init__(self, config: RegistryConfig, clock: Clock, *, recovering: bool = True
                 ) -> None:
        self.config = config
        self.clock = clock
        count = config.redis_shards
        self._prefix = f"{{{config.redis_namespace}}}:"  # the fleet's own: its shard count
        self.shards = [RedisStore(config, clock, recovering=recovering, shard=(name, f".s{k}"))
                       for k, name in enumerate(shard_namespaces(config.redis_namespace,
                                                                 count))]

    # ---- routing ----------------------------------------------------------------------------

    def _of_tenant(self, tenant: str) -> RedisStore:
        return self.shards[shard_of(tenant, len(self.shards))]

    def _tag(self, some_id: str) -> int | None:
        """The shard that made `some_id` (from its tag), or None when it has no valid tag."""
        head, sep, k = some_id.rpartition(".s")
        if sep and head and k.isdigit() and int(k) < len(self.shards) and str(int(k)) == k:
            return int(k)
        return None

    def _split(self, ids: Iterable[str]) -> list[list[str]]:
        """Each shard's part of `ids`: the ids it made, and every untagged one (any shard may
        know it), in the order given."""
        parts: list[list[str]] = [[] for _ in self.shards]
        for some_id in ids:
            k = self._tag(some_id)
            for part in parts if k is None else (parts[k],):
                part.append(some_id)
        return parts

    async def _all(self, call: Callable[[RedisStore], Awaitable[_T]]) -> list[_T]:
        """`call` on every shard at once (see `_gather`)."""
        return await _gather([call(s) for s in self.shards])

    async def _find(self, lease_id: str) -> tuple[RedisStore, Lease]:
        """An untagged lease id's shard and lease. Such an id is one derived from a request id
        (`kvbridge.ids.grant_lease_id`: a holder asks about a grant of unknown outcome by it,
        not knowing the shard) or one restored from before sharding: every shard K is asked
        at once for `id.sK` and for `id`; the first found, in that order, answers (the same
        one every time, so that an access check and the call it guards see one lease).
        LeaseNotFound when none has it; an outage of a shard when one was down (it may)."""
        longest = self.config.max_id_length
        check.identifier("lease_id", lease_id, longest)
        asks = [(s, f"{lease_id}{s.tag}") for s in self.shards
                if len(lease_id) + len(s.tag) <= longest]  # (a longer one was never made)
        asks += [(s, lease_id) for s in self.shards]
        results = await asyncio.gather(*(s.get_lease(x) for s, x in asks),
                                       return_exceptions=True)
        errors: list[BaseException] = []
        for (store, _), result in zip(asks, results, strict=True):
            if not isinstance(result, BaseException):
                return store, result
            errors.append(result)
        outages = [e for e in errors if not isinstance(e, LeaseNotFound)]
        raise _first(outages) if outages else errors[-1]  # (-1: the plain id's, named so)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._all(lambda s: s.start())
            await self.shards[0]._check_shard_count(self._prefix, len(self.shards))
            refused = await self._mark_sharded()
            if refused:
                raise OSError(refused)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.shards), return_exceptions=True)

    async def _mark_sharded(self) -> str:
        """Record `SHARDED_NAMESPACE_LAYOUT` in the fleet's own namespace (again, when Redis
        lost it), so that releases from before sharding keep off it; "" or, when a release
        that needs a newer layout shares the namespace, why this one must not serve."""
        first = self.shards[0]
        ok, _, minimum = await first._fcall("layout", [self._prefix + "layout"],
                                            [SHARDED_NAMESPACE_LAYOUT,
                                             SHARDED_NAMESPACE_LAYOUT])
        return "" if int(ok) else first._too_old(int(minimum))

    # ---- holders ----------------------------------------------------------------------------

    async def register_holder(self, spec: HolderSpec, held: Iterable[Snapshot] = (),
                              held_ids: Sequence[str] = (), restore_only: bool = False
                              ) -> Registration:
        snapshots, ids = list(held), list(held_ids)
        # What the call itself can be refused for is checked first, for the whole call. A
        # refusal that depends on a shard's state (a held lease of another holder, another
        # block size, no room) may come after other shards applied their parts: the holder
        # then registers again (every part is idempotent), as the docs say.
        check_registration(self.config, spec, snapshots, ids, restore_only)
        n = len(self.shards)
        snaps: list[list[Snapshot]] = [[] for _ in range(n)]
        for snap in snapshots:
            k = self._tag(snap.lease_id)
            snaps[shard_of(snap.grant.tenant, n) if k is None else k].append(snap)
        own = self._split(ids)
        try:
            results = await _gather([s.register_holder(spec, snaps[k], own[k], restore_only)
                                     for k, s in enumerate(self.shards)])
        except NotLeaseHolder as err:  # its field counts within the shard's part: the call's
            lease_id = err.metadata.get("lease_id", "")
            index = next((i for i, snap in enumerate(snapshots) if snap.lease_id == lease_id),
                         None)
            if index is None:
                raise
            raise held_of_another_holder(lease_id, index) from None
        holder = _summed(results[0].holder, [r.holder for r in results[1:]])
        return Registration(holder, [x for r in results for x in r.restored],
                            _unique(x for r in results for x in r.reclaimable))

    async def heartbeat(self, holder_id: str,
                        reclaimed: Iterable[str] = ()) -> tuple[list[str], float]:
        acked = list(reclaimed)
        check_heartbeat(self.config, holder_id, acked)
        parts = self._split(acked)
        # A shard that cannot be reached must not starve the others of heartbeats (the
        # holder would be lost in all of them, its leases with it): while any shard answers,
        # the answer is theirs. What a missed shard would have said comes at a later beat:
        # its reclaimable ids until acked (an ack it missed is repeated, since decode acks an
        # id it no longer holds at once), and HOLDER_NOT_FOUND if it lost the holder.
        outcomes = await asyncio.gather(*(s.heartbeat(holder_id, parts[k])
                                          for k, s in enumerate(self.shards)),
                                        return_exceptions=True)
        answered = [r for r in outcomes if not isinstance(r, BaseException)]
        missed = [r for r in outcomes if isinstance(r, BaseException)]
        if missed and (not answered or any(not isinstance(e, Unavailable) for e in missed)):
            raise _first(missed)
        if missed:
            log.warning("heartbeat_missed_shards", holder=holder_id, shards=len(missed),
                        of=len(self.shards), error=str(missed[0]))
        return _unique(x for r, _ in answered for x in r), answered[0][1]

    async def deregister_holder(self, holder_id: str) -> tuple[list[str], int]:
        check.identifier("holder_id", holder_id, self.config.max_id_length)
        results = await self._all(lambda s: s.deregister_holder(holder_id))
        return _unique(x for r, _ in results for x in r), sum(p for _, p in results)

    async def holders(self) -> list[Holder]:
        """Holders every shard counts live: one lost in a shard must register again (its next
        heartbeat there says so), and until then that shard reads none of its leases."""
        results = await self._all(lambda s: s.holders())
        live = set.intersection(*({h.holder_id for h in r} for r in results))
        others = [{h.holder_id: h for h in r} for r in results[1:]]
        return [_summed(h, [o[h.holder_id] for o in others])
                for h in results[0] if h.holder_id in live]

    async def get_holder(self, holder_id: str) -> Holder:
        first, *others = await self._all(lambda s: s.get_holder(holder_id))
        return _summed(first, others)

    # ---- leases -----------------------------------------------------------------------------

    async def grant(self, spec: GrantSpec) -> Grant:
        return await self._of_tenant(spec.tenant).grant(spec)

    async def renew(self, lease_ids: Iterable[str],
                    conversations: Iterable[tuple[str, str]] = ()) -> list[Renewal]:
        ids, convs = list(lease_ids), list(conversations)
        check_renewal(self.config, ids, convs)
        n = len(self.shards)
        by_id = self._split(ids)
        by_conv: list[list[tuple[str, str]]] = [[] for _ in range(n)]
        for pair in convs:
            by_conv[shard_of(pair[0], n)].append(pair)
        results = await _gather([s.renew(by_id[k], by_conv[k])
                                 if by_id[k] or by_conv[k] else _none()
                                 for k, s in enumerate(self.shards)])
        known: dict[str, Renewal] = {}
        conv_out: list[list[Renewal]] = [[] for _ in range(n)]
        for k, renewals in enumerate(results):
            asked = len(by_id[k])
            for r in renewals[:asked]:
                # An untagged id: the shard that knows it (a state) answers for it.
                if r.lease_id not in known or known[r.lease_id].state is None:
                    known[r.lease_id] = r
            conv_out[k] = list(renewals[asked:])
        out = [known[i] for i in ids]
        for pair in convs:
            out.append(conv_out[shard_of(pair[0], n)].pop(0))
        return out

    async def revoke(self, lease_id: str, holder_id: str = "", reason: str = "") -> Lease:
        check_revocation(self.config, lease_id, holder_id, reason)
        k = self._tag(lease_id)
        if k is not None:
            return await self.shards[k].revoke(lease_id, holder_id, reason)
        store, lease = await self._find(lease_id)  # then that one only
        return await store.revoke(lease.lease_id, holder_id, reason)

    async def get_lease(self, lease_id: str) -> Lease:
        k = self._tag(lease_id)
        if k is not None:
            return await self.shards[k].get_lease(lease_id)
        return (await self._find(lease_id))[1]

    async def reclaim_hold(self, lease_id: str = "") -> float:
        k = self._tag(lease_id) if lease_id else None
        if k is not None:  # a failover of one primary holds its own shards only
            return await self.shards[k].reclaim_hold()
        return max(await self._all(lambda s: s.reclaim_hold()))

    async def list_leases(self, tenant: str = "", conversation_id: str = "",
                          holder_id: str = "", include_inactive: bool = False,
                          after: str = "", limit: int = 100) -> list[Lease]:
        check_listing(self.config, tenant, conversation_id, holder_id)

        def page(s: RedisStore) -> Awaitable[list[Lease]]:
            return s.list_leases(tenant, conversation_id, holder_id, include_inactive, after,
                                 limit)

        if tenant:
            return await page(self._of_tenant(tenant))
        # Each shard's page is in lease id order after `after`: the first `limit` of their
        # merge are the fleet's, and the last of them is the next page's `after`.
        pages = await self._all(page)
        merged = heapq.merge(*pages, key=lambda lease: lease.lease_id.encode())
        return [lease for _, lease in zip(range(limit), merged, strict=False)]

    # ---- reads ------------------------------------------------------------------------------

    async def acquire_read(self, tenant: str, conversation_id: str, hashes: bytes,
                           min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                           request_id: str = "", caller: str = "") -> Read:
        return await self._of_tenant(tenant).acquire_read(
            tenant, conversation_id, hashes, min_tokens, pin_ttl, reader_id, request_id,
            caller)

    async def pin_lease(self, tenant: str, conversation_id: str, min_tokens: int = 0,
                        pin_ttl: float = 0.0, reader_id: str = "", request_id: str = "",
                        caller: str = "", history_keys: bytes = b"") -> Read:
        return await self._of_tenant(tenant).pin_lease(
            tenant, conversation_id, min_tokens, pin_ttl, reader_id, request_id, caller,
            history_keys)

    async def release_read(self, pin_id: str) -> bool:
        check.identifier("pin_id", pin_id, self.config.max_id_length)
        k = self._tag(pin_id)
        if k is not None:
            return await self.shards[k].release_read(pin_id)
        return any(await self._all(lambda s: s.release_read(pin_id)))

    # ---- events, expiry, introspection ------------------------------------------------------

    def add_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        for s in self.shards:
            s.add_listener(listener, renewals=renewals)

    def remove_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        for s in self.shards:
            s.remove_listener(listener, renewals=renewals)

    def listener_count(self) -> int:
        return self.shards[0].listener_count()

    def on_events_lost(self, callback: Callable[[str], None]) -> None:
        for s in self.shards:
            s.on_events_lost(callback)

    async def tick(self, *, turn: float = 0.0) -> int:
        # Each shard's tick takes that shard's turn (tick.lua): the expiry runs per shard.
        expired = sum(await asyncio.gather(*(s.tick(turn=turn) for s in self.shards)))
        first = self.shards[0]
        if not self.not_serving and first.count_check_due():
            why = await first.recheck_shard_count(self._prefix, len(self.shards))
            if not why:
                try:
                    why = await self._mark_sharded()
                except (RedisError, RedisClusterException, OSError) as exc:
                    first._unreachable("tick", exc)
            for s in self.shards if why else ():
                s._stop_serving(why)
        return expired

    def next_deadline(self) -> float | None:
        due = [d for d in (s.next_deadline() for s in self.shards) if d is not None]
        return min(due) if due else None

    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for s in self.shards:
            for name, value in s.counts().items():
                # Every shard counts each holder: the fleet's holders are the most any counts.
                merge = max if name == "holders" else int.__add__
                total[name] = merge(total[name], value) if name in total else value
        return total

    @property
    def not_serving(self) -> str:
        return next((s.not_serving for s in self.shards if s.not_serving), "")


async def _gather(calls: Sequence[Awaitable[_T]]) -> list[_T]:
    """Await `calls` at once. If any fails, raise: a refusal of the registry's own
    (HOLDER_NOT_FOUND, ...) before an outage, so that the caller does what the refusal asks
    (register again) even while another shard is down."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise _first(errors)
    return results  # type: ignore[return-value]


def _first(errors: Sequence[BaseException]) -> BaseException:
    """The error to raise of several shards' (a cancellation, then a refusal, then an
    outage)."""
    return (next((e for e in errors if not isinstance(e, Exception)), None)
            or next((e for e in errors if not isinstance(e, Unavailable)), None)
            or errors[0])


def _summed(holder: Holder, others: Sequence[Holder]) -> Holder:
    """A holder as every shard has it: each counts its own leases and blocks."""
    for other in others:
        holder.lease_count += other.lease_count
        holder.retained_blocks += other.retained_blocks
    return holder


async def _none() -> list[Any]:
    return []


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))

