"""The lease table: holders, conversation leases, read pins and expiry, with no transport.

`LeaseTable` is single-threaded (the servicer calls it from one event loop) and takes an
injected clock; `tick()` runs expiry and is driven by the server's scheduler or, in tests, by
advancing a `FakeClock`. Every check happens before the first mutation, so a call that raises
changes nothing. Deadlines are also checked lazily on access, so correctness never depends on
how promptly `tick()` runs.

Invariants kept here (DESIGN.md):
- a lease is never reported reclaimable while a pin on it is live;
- a pin never ends after its lease's maximum lifetime + the maximum pin TTL, the bound the
  holder's own hard deadline is built on;
- only the conversation's current ACTIVE lease is readable: superseded, expired, revoked and
  holder-lost leases never are again;
- after a start with empty state nothing is reported reclaimable for the recovery grace (not
  by heartbeats, lease lookups or RECLAIMABLE events, which are sent once it ends).
"""

from __future__ import annotations

import secrets
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import structlog

from kvbridge import blockhash
from kvbridge.clock import Clock
from kvbridge.errors import (
    CapacityExhausted,
    HolderConflict,
    HolderDraining,
    HolderNotFound,
    IdempotencyConflict,
    LeaseNotFound,
    NotLeaseHolder,
    TenantQuotaExceeded,
)
from kvbridge.history import KEY_SIZE as HISTORY_KEY_SIZE
from kvbridge.ids import grant_lease_id, pin_id_maker
from kvbridge.services.registry import _validate as check
from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._expiry import ExpiryWheel
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

log = structlog.get_logger("kvbridge.registry")

Listener = Callable[[LeaseEvent], None]

# The largest epoch a restored lease may carry: the Redis backend's Lua numbers are doubles,
# exact up to 2**53 (a larger epoch would be stored as '4.6e+18' and fail every read back).
MAX_EPOCH = 2**53 - 1
# RECLAIMABLE events the recovery grace held back, sent per scheduler tick once it is over
# (both backends; each is a watch event, and in Redis a stream entry written by one script).
OWED_EVENTS_PER_TICK = 1000
# A lost holder is forgotten strictly after its retention: looked at again this much later.
_RETENTION_STEP = 0.01

DEAD_EVENT = {
    LeaseState.EXPIRED: EventType.EXPIRED,
    LeaseState.REVOKED: EventType.REVOKED,
    LeaseState.SUPERSEDED: EventType.SUPERSEDED,
    LeaseState.HOLDER_LOST: EventType.HOLDER_LOST,
}
MISS_FOR_STATE = {
    LeaseState.EXPIRED: MissReason.EXPIRED,
    LeaseState.REVOKED: MissReason.REVOKED,
    LeaseState.HOLDER_LOST: MissReason.HOLDER_GONE,
    LeaseState.SUPERSEDED: MissReason.NO_LEASE,
}


@dataclass(slots=True)
class HolderSpec:
    holder_id: str
    nixl_host: str
    nixl_port: int
    tp_size: int
    block_size: int
    fingerprint: str
    ttl: float = 0.0  # 0: the registry default
    version: str = ""  # free text, e.g. "kvbridge/0.1.0 vllm/0.32.0"


@dataclass(slots=True)
class GrantSpec:
    holder_id: str
    tenant: str
    conversation_id: str
    remote_request_id: str
    block_ids: Sequence[int]
    token_count: int
    hashes: bytes
    idle_ttl: float = 0.0  # 0: the registry default
    max_lifetime: float = 0.0
    request_id: str = ""
    history_keys: bytes = b""  # see GrantLeaseRequest.history_keys


@dataclass(slots=True)
class Snapshot:
    """A lease a holder still retains, replayed on re-registration."""

    lease_id: str
    grant: GrantSpec
    epoch: int
    age: float


@dataclass(slots=True)
class Registration:
    holder: Holder
    restored: list[str]
    reclaimable: list[str]


@dataclass(slots=True)
class Grant:
    lease: Lease
    superseded: Lease | None


@dataclass(slots=True)
class Renewal:
    lease_id: str
    renewed: bool
    state: LeaseState | None
    expires_in: float


@dataclass(slots=True)
class Read:
    """The outcome of `acquire_read`. On a hit, `pin` is set and the listed blocks are pinned."""

    miss: MissReason
    mismatch_block: int
    lease: Lease | None
    matched_blocks: int = 0
    partial: bool = False
    pin: Pin | None = None
    # A lookup by content: how many of the request's history keys the match covers, and
    # whether the matching key is the lease's last (see HistoryMatch).
    keys_matched: int = 0
    whole: bool = False

    @property
    def matched_tokens(self) -> int:
        return self.matched_blocks * self.lease.holder.block_size if self.lease else 0


# ---- request checks -------------------------------------------------------------------------
# Shared by every store: each raises `InvalidArgument` before any state is read or changed, so
# all backends refuse the same bad input the same way.


def check_registration(cfg: RegistryConfig, spec: HolderSpec, snapshots: Sequence[Snapshot],
                       held_ids: Sequence[str] = (), restore_only: bool = False) -> float:
    """Check a holder registration (`held_ids`: every id it retains, when `snapshots` is the
    first page of them; `restore_only`: a later page); return the holder's TTL."""
    check.identifier("holder_id", spec.holder_id, cfg.max_id_length)
    check.identifier("nixl_host", spec.nixl_host, cfg.max_id_length)
    check.in_range("nixl_port", spec.nixl_port, 0, 65535)
    check.in_range("tp_size", spec.tp_size, 1, 4096)
    check.in_range("block_size", spec.block_size, 1, 65536)
    check.identifier("engine_fingerprint", spec.fingerprint, cfg.max_id_length)
    ttl = spec.ttl or cfg.default_holder_ttl_s
    check.duration("ttl", ttl, cfg.min_holder_ttl_s, cfg.max_holder_ttl_s)
    if spec.version:
        check.text("software_version", spec.version, 128)
    if len(snapshots) > cfg.max_held_leases_per_call:
        raise check.InvalidArgument(
            "held_leases", f"at most {cfg.max_held_leases_per_call} a call: send the rest in "
            "further calls, every one with all the ids in held_lease_ids",
            count=len(snapshots))
    if restore_only and held_ids:
        raise check.InvalidArgument("held_lease_ids", "not with restore_only (a later page)")
    if len(held_ids) > cfg.max_leases:
        raise check.InvalidArgument("held_lease_ids", f"at most {cfg.max_leases}")
    all_ids = set(held_ids)
    if len(all_ids) != len(held_ids):
        raise check.InvalidArgument("held_lease_ids", "duplicate lease id")
    for i, lease_id in enumerate(held_ids):
        check.identifier(f"held_lease_ids[{i}]", lease_id, cfg.max_id_length)
    seen: set[str] = set()
    for i, snap in enumerate(snapshots):
        check.identifier(f"held_leases[{i}].lease_id", snap.lease_id, cfg.max_id_length)
        if all_ids and snap.lease_id not in all_ids:
            raise check.InvalidArgument(f"held_leases[{i}].lease_id",
                                        "not listed in held_lease_ids")
        if snap.lease_id in seen:
            raise check.InvalidArgument(f"held_leases[{i}].lease_id", "duplicate lease id")
        seen.add(snap.lease_id)
        check.duration(f"held_leases[{i}].age", snap.age, 0.0, cfg.max_lifetime_cap_s * 2)
        check.in_range(f"held_leases[{i}].epoch", snap.epoch, 1, MAX_EPOCH)
        check_grant(cfg, snap.grant, spec.block_size, f"held_leases[{i}].")
    return ttl


def held_of_another_holder(lease_id: str, index: int) -> NotLeaseHolder:
    """A re-registering holder listed a lease another holder holds: refused, nothing changed
    (a holder could otherwise plant the id another holder's retried grant will look up)."""
    return NotLeaseHolder(f"held lease {lease_id!r} belongs to another holder",
                          lease_id=lease_id, field=f"held_leases[{index}].lease_id")


def pins_exceeded(tenant: str, limit: int) -> TenantQuotaExceeded:
    """A read refused: its tenant holds `limit` live pins already (prefill recomputes)."""
    return TenantQuotaExceeded(f"tenant {tenant!r} holds {limit} live pins (reads in flight), "
                               "its quota", tenant=tenant, max_pins=limit)


def check_heartbeat(cfg: RegistryConfig, holder_id: str, acked: Sequence[str]) -> None:
    check.identifier("holder_id", holder_id, cfg.max_id_length)
    if len(acked) > cfg.max_batch:
        raise check.InvalidArgument("reclaimed_lease_ids", f"at most {cfg.max_batch}")


def check_grant(cfg: RegistryConfig, g: GrantSpec, block_size: int, prefix: str = "") -> None:
    """Check a grant's fields against the holder's block size (holder_id is checked apart)."""
    check.identifier(prefix + "tenant", g.tenant, cfg.max_id_length)
    check.identifier(prefix + "conversation_id", g.conversation_id, cfg.max_id_length)
    check.identifier(prefix + "remote_request_id", g.remote_request_id, cfg.max_id_length)
    check.blocks(prefix, g.block_ids, g.token_count, g.hashes, block_size,
                 cfg.max_blocks_per_lease)
    idle, life = grant_ttls(cfg, g)
    check.duration(prefix + "idle_ttl", idle, cfg.min_idle_ttl_s, cfg.max_idle_ttl_s)
    check.duration(prefix + "max_lifetime", life, idle, cfg.max_lifetime_cap_s)
    if g.request_id:
        check.identifier(prefix + "request_id", g.request_id, cfg.max_id_length)
    check_history_keys(prefix + "history_keys", g.history_keys, cfg.max_history_keys)


def check_history_keys(field: str, keys: bytes, most: int) -> int:
    """History keys (GrantLeaseRequest, PinLeaseRequest): whole 16-byte keys, at most `most`.
    Returns how many."""
    if len(keys) % HISTORY_KEY_SIZE:
        raise check.InvalidArgument(
            field, f"length {len(keys)} is not a multiple of {HISTORY_KEY_SIZE}")
    n = len(keys) // HISTORY_KEY_SIZE
    if n > most:
        raise check.InvalidArgument(field, f"more than {most} keys")
    return n


def clip_history_keys(keys: bytes, most: int) -> bytes:
    """A grant's history keys within `most`: the first and the latest kept (the ones a later
    turn finds it by), so that a holder granting more (or re-registering leases granted under
    a higher limit) is not refused. Bad lengths are left to `check_history_keys`."""
    if len(keys) % HISTORY_KEY_SIZE or len(keys) <= most * HISTORY_KEY_SIZE or most < 1:
        return keys
    if most == 1:
        return keys[-HISTORY_KEY_SIZE:]
    return keys[:HISTORY_KEY_SIZE] + keys[-(most - 1) * HISTORY_KEY_SIZE:]


def grant_ttls(cfg: RegistryConfig, g: GrantSpec) -> tuple[float, float]:
    """(idle TTL, maximum lifetime) of a grant, defaults applied."""
    idle = g.idle_ttl or cfg.default_idle_ttl_s
    return idle, g.max_lifetime or max(cfg.default_max_lifetime_s, idle)


def check_renewal(cfg: RegistryConfig, ids: Sequence[str],
                  convs: Sequence[tuple[str, str]]) -> None:
    if len(ids) + len(convs) > cfg.max_batch:
        raise check.InvalidArgument("lease_ids", f"at most {cfg.max_batch} items per call")
    for i, lid in enumerate(ids):
        check.identifier(f"lease_ids[{i}]", lid, cfg.max_id_length)
    for i, (tenant, conv) in enumerate(convs):
        check.identifier(f"conversations[{i}].tenant", tenant, cfg.max_id_length)
        check.identifier(f"conversations[{i}].conversation_id", conv, cfg.max_id_length)


def check_revocation(cfg: RegistryConfig, lease_id: str, holder_id: str, reason: str) -> None:
    check.identifier("lease_id", lease_id, cfg.max_id_length)
    if holder_id:
        check.identifier("holder_id", holder_id, cfg.max_id_length)
    if len(reason) > 1024:
        raise check.InvalidArgument("reason", "at most 1024 characters")


def check_listing(cfg: RegistryConfig, tenant: str, conversation_id: str, holder_id: str) -> None:
    for name, value in (("tenant", tenant), ("conversation_id", conversation_id),
                        ("holder_id", holder_id)):
        if value:
            check.identifier(name, value, cfg.max_id_length)
    if conversation_id and not tenant:
        raise check.InvalidArgument("conversation_id", "filtering by conversation needs tenant")


def check_read(cfg: RegistryConfig, tenant: str, conversation_id: str, min_tokens: int,
               pin_ttl: float, reader_id: str, request_id: str, history_keys: bytes = b"",
               ) -> None:
    """A read's fields. `history_keys` (a lookup by content) stands for an empty
    conversation_id; a read names one or the other."""
    check.identifier("tenant", tenant, cfg.max_id_length)
    check_named_or_found(conversation_id, history_keys, cfg.max_id_length, cfg.max_lookup_keys)
    check.in_range("min_tokens", min_tokens, 0, 2**31)
    if not pin_ttl >= 0:  # also rejects NaN
        raise check.InvalidArgument("pin_ttl", "must not be negative")
    if reader_id:
        check.identifier("reader_id", reader_id, cfg.max_id_length)
    if request_id:
        check.identifier("request_id", request_id, cfg.max_id_length)


def check_named_or_found(conversation_id: str, history_keys: bytes, max_id_length: int,
                         most_keys: int) -> None:
    """A conversation named by its id, or to be found by its history keys: one or the
    other."""
    if history_keys and conversation_id:
        raise check.InvalidArgument("history_keys", "a conversation_id or history_keys, not "
                                    "both")
    if history_keys:
        check_history_keys("history_keys", history_keys, most_keys)
    else:
        check.identifier("conversation_id", conversation_id, max_id_length)


def check_prompt_hashes(cfg: RegistryConfig, hashes: bytes) -> None:
    check.hashes("block_hashes", hashes, cfg.max_blocks_per_lease * 4)



_SHORT_KEY = (1 << 60) - 1


def short_keys(keys: bytes) -> list[int]:
    """History keys as the in-memory index holds them: 60 bits of each, an int (32 bytes of
    memory where the 16-byte key as bytes takes 56). A hit is checked against the lease's own
    full keys (`holds_key`), so two keys that share those bits never find the wrong lease."""
    words = array("Q", keys)  # two words a key; the first stands for it
    return [w & _SHORT_KEY for w in words[::2]]


def holds_key(history: bytes, key: bytes) -> bool:
    """Whether `history` (a lease's keys) has `key` as one of its whole keys."""
    at = history.find(key)
    while at >= 0:
        if at % HISTORY_KEY_SIZE == 0:
            return True
        at = history.find(key, at + 1)
    return False


def _over_quota(max_leases: int, max_blocks: int, leases: int, used: int, blocks: int) -> bool:
    """Whether one more lease of `blocks` puts a tenant with `leases` active leases holding
    `used` blocks over a quota of `max_leases` / `max_blocks` (0: no limit)."""
    return bool((max_leases and leases + 1 > max_leases)
                or (max_blocks and used + blocks > max_blocks))


class LeaseTable:
    """Holders, leases and pins of one registry (the in-memory backend's state)."""

    def __init__(
        self, config: RegistryConfig, clock: Clock, *, recovering: bool = True
    ) -> None:
        self.config = config
        self.clock = clock
        self._holders: dict[str, Holder] = {}
        self._leases: dict[str, Lease] = {}
        self._conversations: dict[str, dict[str, Lease]] = {}  # tenant -> conversation -> lease
        # tenant -> conversation -> dead leases not yet freed (by id): with the conversations'
        # current leases, every lease of a tenant, so that listing one tenant (or one of its
        # conversations) costs what that tenant (or conversation) has.
        self._dead_of_tenant: dict[str, dict[str, dict[str, Lease]]] = {}
        # tenant -> history key (`short_keys`) -> the active lease most recently granted under
        # it: the lookup by content (a lease leaves it when it stops being active).
        self._history: dict[str, dict[int, Lease]] = {}
        self.history_keys = 0  # entries of `_history`, all tenants
        self._pins: dict[str, Pin] = {}
        self._pin_id = pin_id_maker(secrets.token_bytes(16))  # keyed pin ids (kvbridge.ids)
        self._expiry: ExpiryWheel[Lease] = ExpiryWheel()  # lazily rescheduled on renewal
        self._durations: dict[float, float] = {}  # one float object per distinct TTL
        # Pins by deadline (a pin's deadline never moves; a released pin stays until then).
        self._pin_expiry: ExpiryWheel[Pin] = ExpiryWheel()
        # Live holders by TTL deadline (lazily rescheduled on heartbeat, as leases are), and
        # lost ones by the end of their retention: a tick costs what falls due, not a scan of
        # every holder (lost ones are kept for about a day).
        self._holder_expiry: ExpiryWheel[Holder] = ExpiryWheel()
        self._lost_expiry: ExpiryWheel[Holder] = ExpiryWheel()
        self._listeners: list[Listener] = []
        self._renewal_listeners: list[Listener] = []
        now = clock.monotonic()
        # A fresh, empty registry may be a restarted one: holders may have pins from before.
        self._reclaim_hold_until = now + config.effective_recovery_grace_s if recovering else now
        # RECLAIMABLE events held back by the grace are owed: once it is over, the dead leases
        # no pin holds are queued (`_paying`) and sent OWED_EVENTS_PER_TICK a tick.
        self._reclaimable_owed = False
        self._paying: list[Lease] = []
        self.active_leases = 0
        # tenant -> [active leases, their blocks], for quotas (only while quotas are set)
        self._quotas = config.tenant_quotas()
        self._quotas_on = bool(self._quotas or config.tenant_max_leases
                               or config.tenant_max_blocks)
        self._tenant_usage: dict[str, list[int]] = {}
        self._tenant_pins: dict[str, int] = {}  # live pins by tenant (tenant_max_pins)

    # ---- listeners --------------------------------------------------------------------------

    def add_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        """Call `listener` for every lease event (RENEWED ones only when `renewals`)."""
        self._listeners.append(listener)
        if renewals:
            self._renewal_listeners.append(listener)

    def remove_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        self._listeners.remove(listener)
        if renewals:
            self._renewal_listeners.remove(listener)

    def _emit(self, type: EventType, lease: Lease, lateness: float = 0.0) -> None:
        if self._listeners:
            event = LeaseEvent(type, lease, self.clock.wall(), lateness)
            targets = self._renewal_listeners if type is EventType.RENEWED else self._listeners
            for listener in tuple(targets):
                listener(event)

    # ---- holders ----------------------------------------------------------------------------

    def register_holder(self, spec: HolderSpec, held: Iterable[Snapshot] = (),
                        held_ids: Sequence[str] = (), restore_only: bool = False
                        ) -> Registration:
        """Register or re-register a holder; restore `held` leases this registry does not
        know; revoke its active leases it does not list (in `held_ids` when given: every id
        it retains, `held` being the first page of them), unless `restore_only` (a later
        page)."""
        cfg = self.config
        snapshots = list(held)
        ttl = check_registration(cfg, spec, snapshots, held_ids, restore_only)

        now = self.clock.monotonic()
        holder = self._holders.get(spec.holder_id)
        if holder is not None and holder.state is not HolderState.LOST and holder.expire_at <= now:
            self._lose_holder(holder, now)  # it missed its TTL: its leases are lost for good
        if restore_only and (holder is None or holder.state is HolderState.LOST):
            # A later page needs the first (which revokes what the holder no longer lists) to
            # have run on this state; a restart between pages lost it: start again.
            raise HolderNotFound(f"holder {spec.holder_id!r} is not registered; register it "
                                 "(again) from the first page", holder=spec.holder_id)
        if holder is not None and holder.state is not HolderState.LOST and (
            holder.block_size != spec.block_size or holder.fingerprint != spec.fingerprint
            or holder.tp_size != spec.tp_size
        ):
            raise HolderConflict(
                f"holder {spec.holder_id!r} is registered with another layout "
                f"(block size {holder.block_size}, tp {holder.tp_size}); deregister it first",
                holder=spec.holder_id,
            )
        unknown = 0
        for i, snap in enumerate(snapshots):
            known = self._leases.get(snap.lease_id)
            if known is None:
                unknown += 1
            elif known.holder.holder_id != spec.holder_id:
                raise held_of_another_holder(snap.lease_id, i)
        if len(self._leases) + unknown > cfg.max_leases:
            raise CapacityExhausted("registry lease capacity reached", limit=cfg.max_leases)

        if holder is None:
            holder = Holder(spec.holder_id, spec.nixl_host, spec.nixl_port, spec.tp_size,
                            spec.block_size, spec.fingerprint, ttl, now + ttl, spec.version)
            self._holders[spec.holder_id] = holder
            event = "holder_registered"
        else:
            event = "holder_reregistered"
            if holder.state is HolderState.LOST:
                holder.block_size, holder.tp_size = spec.block_size, spec.tp_size
                holder.fingerprint = spec.fingerprint
            holder.nixl_host, holder.nixl_port = spec.nixl_host, spec.nixl_port
            holder.version = spec.version
            holder.ttl, holder.expire_at = ttl, now + ttl
            holder.state = HolderState.ACTIVE
        # Scheduled once; again only when a re-registration brings its deadline forward
        # (a shorter TTL): the later entry is then stale and dropped when it comes due.
        if holder.scheduled is None or holder.expire_at < holder.scheduled:
            self._holder_expiry.add(holder, holder.expire_at)
            holder.scheduled = holder.expire_at

        # The holder is the source of truth for its memory: an active lease it no longer
        # lists (say the engine restarted) must never be read again.
        listed = set(held_ids) if held_ids else {snap.lease_id for snap in snapshots}
        for lease in () if restore_only else self._active_of(holder):
            if lease.lease_id not in listed:
                self._kill(lease, LeaseState.REVOKED)
        restored: list[str] = []
        for snap in snapshots:
            known = self._leases.get(snap.lease_id)
            if known is None:
                self._restore(holder, snap, now)
                restored.append(snap.lease_id)
            elif known.holder is holder and known.state is LeaseState.ACTIVE:
                restored.append(snap.lease_id)
        reclaimable = self.reclaimable_of(holder)
        log.info(event, holder=holder.holder_id, nixl=f"{holder.nixl_host}:{holder.nixl_port}",
                 block_size=holder.block_size, ttl_s=ttl, restored=len(restored),
                 dead=len(reclaimable))
        return Registration(holder, restored, reclaimable)

    def _restore(self, holder: Holder, snap: Snapshot, now: float) -> None:
        g = snap.grant
        idle, life = grant_ttls(self.config, g)
        lease = Lease(snap.lease_id, sys.intern(g.tenant), g.conversation_id, holder,
                      g.remote_request_id, g.block_ids, g.token_count, g.hashes, snap.epoch,
                      idle, life, now - snap.age, g.history_keys)
        lease.expire_at = min(now + idle, lease.max_expire_at)  # restoring counts as activity
        current = self._conversations.get(g.tenant, {}).get(g.conversation_id)
        newer = current is None or (
            (current.epoch, current.created_at) < (lease.epoch, lease.created_at))
        # The tenant's quota holds here as on a grant, but a restore makes no room by revoking
        # others: a lease that does not fit is restored revoked, and the holder frees it.
        fits = not self._quotas_on or self._within_quota(
            g.tenant, lease.block_count, current if newer else None)
        self._add(lease)
        if lease.expire_at <= now:
            self._kill(lease, LeaseState.EXPIRED)
        elif not fits:
            log.info("lease_revoked", lease_id=lease.lease_id, tenant=lease.tenant,
                     conversation=lease.conversation_id, holder=holder.holder_id,
                     reason="tenant_quota", pins=0)
            self._kill(lease, LeaseState.REVOKED)
        elif newer:
            self._conversations.setdefault(g.tenant, {})[g.conversation_id] = lease
            if current is not None and current.state is LeaseState.ACTIVE:
                self._kill(current, LeaseState.SUPERSEDED)
        else:
            self._kill(lease, LeaseState.SUPERSEDED)
        if lease.state is LeaseState.ACTIVE:
            self._expiry.add(lease, lease.expire_at)
            self._index(lease)

    def heartbeat(self, holder_id: str, reclaimed: Iterable[str] = ()) -> tuple[list[str], float]:
        """Keep a holder alive; forget leases it freed; return its reclaimable leases."""
        acked = list(reclaimed)
        check_heartbeat(self.config, holder_id, acked)
        now = self.clock.monotonic()
        holder = self._live_holder(holder_id, now)
        holder.expire_at = now + holder.ttl
        for lease_id in acked:
            lease = holder.dead_leases.get(lease_id)
            if lease is not None and lease.pin_count == 0:
                self._forget(lease)
        return self.reclaimable_of(holder), holder.ttl

    def deregister_holder(self, holder_id: str) -> tuple[list[str], int]:
        """Drain a holder: revoke its leases. Returns (reclaimable ids, leases still pinned)."""
        check.identifier("holder_id", holder_id, self.config.max_id_length)
        holder = self._live_holder(holder_id, self.clock.monotonic())
        holder.state = HolderState.DRAINING
        for lease in self._active_of(holder):
            self._kill(lease, LeaseState.REVOKED)
        pinned = sum(1 for lease in holder.dead_leases.values() if lease.pin_count)
        log.info("holder_draining", holder=holder_id, pinned=pinned)
        return self.reclaimable_of(holder), pinned

    def reclaim_hold(self) -> float:
        """Seconds left of the recovery grace (0 when over): nothing is reclaimable before."""
        return max(self._reclaim_hold_until - self.clock.monotonic(), 0.0)

    def reclaimable_of(self, holder: Holder) -> list[str]:
        if self.clock.monotonic() < self._reclaim_hold_until:
            return []
        return [lid for lid, lease in holder.dead_leases.items() if lease.pin_count == 0]

    def holders(self) -> list[Holder]:
        """Registered holders that are not lost, in id order."""
        self._expire_holders(self.clock.monotonic())
        return sorted(
            (h for h in self._holders.values() if h.state is not HolderState.LOST),
            key=lambda h: h.holder_id,
        )

    def get_holder(self, holder_id: str) -> Holder:
        return self._live_holder(holder_id, self.clock.monotonic())

    def _live_holder(self, holder_id: str, now: float) -> Holder:
        holder = self._holders.get(holder_id)
        if holder is not None and holder.state is not HolderState.LOST and holder.expire_at <= now:
            self._lose_holder(holder, now)
        if holder is None or holder.state is HolderState.LOST:
            raise HolderNotFound(f"holder {holder_id!r} is not registered; register it (again)",
                                 holder=holder_id)
        return holder

    def _lose_holder(self, holder: Holder, now: float) -> None:
        holder.state = HolderState.LOST
        holder.lost_at = now
        holder.scheduled = None
        lost = self._active_of(holder)
        for lease in lost:
            self._kill(lease, LeaseState.HOLDER_LOST)
        log.warning("holder_lost", holder=holder.holder_id, leases_lost=len(lost),
                    late_ms=round((now - holder.expire_at) * 1000, 1))
        # Kept until its own hard deadline has freed what it held; one that held nothing is
        # forgotten at the next tick (lapsed holders must not pile up for a day).
        self._lost_expiry.add(holder, now + self._retention() if holder.dead_leases else now)

    # ---- leases -----------------------------------------------------------------------------

    def grant(self, g: GrantSpec) -> Grant:
        """Grant a lease; supersede the conversation's current one. Idempotent by request id."""
        cfg = self.config
        check.identifier("holder_id", g.holder_id, cfg.max_id_length)
        now = self.clock.monotonic()
        holder = self._live_holder(g.holder_id, now)
        check_grant(cfg, g, holder.block_size)
        if holder.state is HolderState.DRAINING:
            raise HolderDraining(f"holder {g.holder_id!r} is draining", holder=g.holder_id)
        if g.request_id:
            lease_id = grant_lease_id(g.holder_id, g.request_id)
            existing = self._leases.get(lease_id)
            if existing is not None:
                if (existing.tenant, existing.conversation_id, existing.remote_request_id,
                        existing.holder) != (g.tenant, g.conversation_id, g.remote_request_id,
                                             holder):
                    raise IdempotencyConflict(
                        f"request_id {g.request_id!r} was used for another grant",
                        request_id=g.request_id)
                return Grant(existing, None)
        else:
            lease_id = "l-" + secrets.token_hex(8)
        if len(self._leases) >= cfg.max_leases:
            raise CapacityExhausted("registry lease capacity reached", limit=cfg.max_leases)

        idle, life = grant_ttls(cfg, g)
        current = self._conversations.get(g.tenant, {}).get(g.conversation_id)
        if self._quotas_on:
            self._make_room_for_tenant(g.tenant, len(g.block_ids), current)
        convs = self._conversations.setdefault(g.tenant, {})
        epoch = current.epoch + 1 if current is not None else 1
        lease = Lease(lease_id, sys.intern(g.tenant), g.conversation_id, holder,
                      g.remote_request_id, g.block_ids, g.token_count, g.hashes, epoch,
                      self._shared(idle), self._shared(life), now, g.history_keys)
        superseded = None
        if current is not None and current.state is LeaseState.ACTIVE:
            self._kill(current, LeaseState.SUPERSEDED)
            superseded = current
        convs[g.conversation_id] = lease
        self._add(lease)
        self._index(lease)
        self._expiry.add(lease, lease.expire_at)
        log.debug("lease_granted", lease_id=lease_id, tenant=g.tenant,
                  conversation=g.conversation_id, holder=g.holder_id, epoch=epoch,
                  blocks=lease.block_count, tokens=g.token_count)
        self._emit(EventType.GRANTED, lease)
        return Grant(lease, superseded)

    def renew(self, lease_ids: Iterable[str], conversations: Iterable[tuple[str, str]] = ()
              ) -> list[Renewal]:
        """Renew leases by id and conversations' current leases; one result per item."""
        ids, convs = list(lease_ids), list(conversations)
        check_renewal(self.config, ids, convs)
        now = self.clock.monotonic()
        leases = [self._leases.get(lid) for lid in ids]
        leases += [self._conversations.get(t, {}).get(c) for t, c in convs]
        names = ids + [""] * len(convs)
        out = []
        for name, lease in zip(names, leases, strict=True):
            if lease is None:
                out.append(Renewal(name, False, None, 0.0))
                continue
            self._refresh(lease, now)
            if lease.state is LeaseState.ACTIVE:
                lease.expire_at = min(now + lease.idle_ttl, lease.max_expire_at)
                out.append(Renewal(lease.lease_id, True, lease.state, lease.expire_at - now))
                if self._renewal_listeners:
                    self._emit(EventType.RENEWED, lease)
            else:
                out.append(Renewal(lease.lease_id, False, lease.state, 0.0))
        return out

    def revoke(self, lease_id: str, holder_id: str = "", reason: str = "") -> Lease:
        """Revoke a lease (no-op if already dead). With `holder_id`, it must be that holder's."""
        check_revocation(self.config, lease_id, holder_id, reason)
        lease = self.get_lease(lease_id)
        if holder_id and lease.holder.holder_id != holder_id:
            raise NotLeaseHolder(f"lease {lease_id!r} belongs to another holder",
                                 lease_id=lease_id)
        if lease.state is LeaseState.ACTIVE:
            log.info("lease_revoked", lease_id=lease_id, tenant=lease.tenant,
                     conversation=lease.conversation_id, holder=lease.holder.holder_id,
                     reason=reason or "unspecified", pins=lease.pin_count)
            self._kill(lease, LeaseState.REVOKED)
        return lease

    def get_lease(self, lease_id: str) -> Lease:
        check.identifier("lease_id", lease_id, self.config.max_id_length)
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"no lease {lease_id!r}", lease_id=lease_id)
        self._refresh(lease, self.clock.monotonic())
        return lease

    def leases(self, tenant: str = "", conversation_id: str = "", holder_id: str = "",
               include_inactive: bool = False, after: str = "") -> Iterator[Lease]:
        """Leases matching the filters, in lease id order, starting after lease id `after`."""
        check_listing(self.config, tenant, conversation_id, holder_id)
        source: Iterable[Lease]
        if holder_id:
            holder = self._holders.get(holder_id)
            source = [] if holder is None else [
                *holder.active.values(), *holder.dead_leases.values()]
        elif tenant:
            # An active lease is its conversation's current one; a dead one not yet freed is
            # in the tenant's dead index (a current lease may be in both: counted once).
            convs = self._conversations.get(tenant, {})
            current = [convs[conversation_id]] if conversation_id in convs else (
                [] if conversation_id else list(convs.values()))
            dead_convs = self._dead_of_tenant.get(tenant, {}) if include_inactive else {}
            dead = [x for conv in ([dead_convs.get(conversation_id, {})] if conversation_id
                                   else dead_convs.values()) for x in conv.values()]
            source = {x.lease_id: x for x in (*current, *dead)}.values()
        else:
            source = self._leases.values()
        now = self.clock.monotonic()
        picked = []
        for lease in source:
            if (tenant and lease.tenant != tenant) or (
                conversation_id and lease.conversation_id != conversation_id
            ) or lease.lease_id <= after:
                continue
            self._refresh(lease, now)
            if include_inactive or lease.state is LeaseState.ACTIVE:
                picked.append(lease)
        picked.sort(key=lambda x: x.lease_id)
        return iter(picked)

    # ---- reads ------------------------------------------------------------------------------

    def _readable(self, tenant: str, conversation_id: str, now: float) -> Lease | Read:
        """The conversation's lease if it can be read, else the miss."""
        lease = self._conversations.get(tenant, {}).get(conversation_id)
        if lease is None:
            return Read(MissReason.NO_LEASE, 0, None)
        self._refresh(lease, now)
        if lease.state is not LeaseState.ACTIVE:
            return Read(MISS_FOR_STATE[lease.state], 0, lease)
        if lease.holder.state is not HolderState.ACTIVE:
            return Read(MissReason.HOLDER_GONE, 0, lease)
        return lease

    def acquire_read(self, tenant: str, conversation_id: str, hashes: bytes, min_tokens: int = 0,
                     pin_ttl: float = 0.0, reader_id: str = "", request_id: str = "",
                     caller: str = "") -> Read:
        """Match a prompt's full-block hashes against the conversation's lease; pin on a hit."""
        check_read(self.config, tenant, conversation_id, min_tokens, pin_ttl, reader_id,
                   request_id)
        check_prompt_hashes(self.config, hashes)
        now = self.clock.monotonic()
        lease = self._readable(tenant, conversation_id, now)
        if isinstance(lease, Read):
            return lease
        block_size = lease.holder.block_size
        full = lease.token_count // block_size
        k = blockhash.matching_prefix(lease.payload, hashes, full)
        partial = k == full and lease.token_count % block_size != 0
        reusable = k * block_size + (lease.token_count - full * block_size if partial else 0)
        if reusable == 0:
            reason = MissReason.HASH_MISMATCH if full and hashes else MissReason.BELOW_MINIMUM
            return Read(reason, k, lease)
        return self._pin(lease, k, partial, reusable, min_tokens, pin_ttl, reader_id, request_id,
                         caller, now)

    def pin_lease(self, tenant: str, conversation_id: str, min_tokens: int = 0,
                  pin_ttl: float = 0.0, reader_id: str = "", request_id: str = "",
                  caller: str = "", history_keys: bytes = b"") -> Read:
        """Pin the conversation's whole lease for a reader that verifies the blocks itself
        against the lease's hashes: every full block counts as matched, and the partial block
        is listed too. With `history_keys` instead of a conversation id, the lease is the
        tenant's active one indexed under the longest of them (`Read.keys_matched`)."""
        check_read(self.config, tenant, conversation_id, min_tokens, pin_ttl, reader_id,
                   request_id, history_keys)
        now = self.clock.monotonic()
        found = (self._found_by_history(tenant, history_keys, now) if history_keys
                 else self._readable(tenant, conversation_id, now))
        if isinstance(found, Read):
            return found
        lease = found if isinstance(found, Lease) else found[0]
        full = lease.token_count // lease.holder.block_size
        partial = lease.token_count % lease.holder.block_size != 0
        if lease.token_count == 0:
            read = Read(MissReason.BELOW_MINIMUM, 0, lease)
        else:
            read = self._pin(lease, full, partial, lease.token_count, min_tokens, pin_ttl,
                             reader_id, request_id, caller, now)
        if not isinstance(found, Lease):
            read.keys_matched, read.whole = found[1], found[2]
        return read

    def _found_by_history(self, tenant: str, keys: bytes, now: float
                          ) -> tuple[Lease, int, bool] | Read:
        """The tenant's readable lease under the longest of `keys` that is indexed: (it, how
        many keys the match covers, whether the key is the lease's last), else the miss. Only
        the tenant's own index is looked at: no other tenant's leases are compared."""
        index = self._history.get(tenant)
        if index is not None:
            short = short_keys(keys)
            for i in range(len(short) - 1, -1, -1):
                lease = index.get(short[i])
                if lease is None:
                    continue
                key = keys[i * HISTORY_KEY_SIZE:(i + 1) * HISTORY_KEY_SIZE]
                if not holds_key(lease.history, key):  # another key with the same 60 bits
                    continue
                readable = self._readable_lease(lease, now)
                if readable is not None:
                    return readable, i + 1, lease.history.endswith(key)
        return Read(MissReason.NO_LEASE, 0, None)

    def _readable_lease(self, lease: Lease, now: float) -> Lease | None:
        self._refresh(lease, now)  # an expired lease leaves the index here
        if lease.state is not LeaseState.ACTIVE or lease.holder.state is not HolderState.ACTIVE:
            return None
        return lease

    def _index(self, lease: Lease) -> None:
        if not lease.history:
            return
        index = self._history.setdefault(lease.tenant, {})
        before = len(index)
        for key in short_keys(lease.history):
            index[key] = lease
        self.history_keys += len(index) - before

    def _unindex(self, lease: Lease) -> None:
        index = self._history.get(lease.tenant) if lease.history else None
        if index is None:
            return
        before = len(index)
        for key in short_keys(lease.history):
            if index.get(key) is lease:
                del index[key]
        self.history_keys -= before - len(index)
        if not index:
            del self._history[lease.tenant]

    def _pin(self, lease: Lease, k: int, partial: bool, reusable: int, min_tokens: int,
             pin_ttl: float, reader_id: str, request_id: str, caller: str, now: float) -> Read:
        cfg = self.config
        if reusable < min_tokens:
            return Read(MissReason.BELOW_MINIMUM, k, lease, k, partial)
        pin_id = self._pin_id(lease.tenant, reader_id, request_id, caller) if request_id else ""
        pin = self._pins.get(pin_id) if pin_id else None
        if pin is not None and pin.lease is not lease:
            raise IdempotencyConflict(f"request_id {request_id!r} was used for another read",
                                      request_id=request_id)
        if pin is None:
            deadline = min(now + min(pin_ttl or cfg.default_pin_ttl_s, cfg.max_pin_ttl_s),
                           lease.max_expire_at + cfg.max_pin_ttl_s)
            if deadline <= now:
                return Read(MissReason.EXPIRED, k, lease)
            pins = self._tenant_pins.get(lease.tenant, 0)
            if cfg.tenant_max_pins and pins >= cfg.tenant_max_pins:
                raise pins_exceeded(lease.tenant, cfg.tenant_max_pins)
            pin = Pin(pin_id or "p-" + secrets.token_hex(8), lease, deadline)
            self._pins[pin.pin_id] = pin
            self._tenant_pins[lease.tenant] = pins + 1
            lease.pin_count += 1
            self._pin_expiry.add(pin, deadline)
        # A read is conversation activity: keep the lease for the turn that follows.
        lease.expire_at = min(now + lease.idle_ttl, lease.max_expire_at)
        return Read(MissReason.HIT, k, lease, k, partial, pin)

    def release_read(self, pin_id: str) -> bool:
        """Release a pin. False when it was already released or expired."""
        check.identifier("pin_id", pin_id, self.config.max_id_length)
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        self._unpin(pin.lease)
        return True

    def _unpin(self, lease: Lease) -> None:
        left = self._tenant_pins[lease.tenant] - 1
        if left:
            self._tenant_pins[lease.tenant] = left
        else:
            del self._tenant_pins[lease.tenant]
        lease.pin_count -= 1
        if lease.reclaimable:
            self._emit_reclaimable(lease)

    def _emit_reclaimable(self, lease: Lease) -> None:
        """RECLAIMABLE, or, within the recovery grace (when heartbeats report nothing
        reclaimable: pins from before a restart may be live), owed until the tick after it,
        which sends every owed one (and so, until then, this one too)."""
        if self._reclaimable_owed or self._reclaim_hold_until > self.clock.monotonic():
            self._reclaimable_owed = True
        else:
            self._emit(EventType.RECLAIMABLE, lease)

    def _pay_reclaimable(self, now: float) -> None:
        """After the grace: queue every dead lease no pin holds once (a dead lease gains no
        pin, so those pinned now are sent as their last pin ends), then send a tick's share of
        the queue. One tick does not walk them all: that would stall every RPC for as long."""
        if now < self._reclaim_hold_until:
            return
        if self._reclaimable_owed:
            self._reclaimable_owed = False
            for holder in list(self._holders.values()):
                self._paying += [lease for lease in holder.dead_leases.values()
                                 if lease.pin_count == 0]
        paying, leases = self._paying, self._leases
        for _ in range(min(len(paying), OWED_EVENTS_PER_TICK)):
            lease = paying.pop()
            if leases.get(lease.lease_id) is lease:  # not freed by its holder since
                self._emit(EventType.RECLAIMABLE, lease)

    # ---- lifecycle --------------------------------------------------------------------------

    def _refresh(self, lease: Lease, now: float) -> None:
        """Apply a deadline that passed but that tick() has not processed yet."""
        if lease.state is LeaseState.ACTIVE:
            holder = lease.holder
            if holder.state is not HolderState.LOST and holder.expire_at <= now:
                self._lose_holder(holder, now)
            elif lease.expire_at <= now:
                self._kill(lease, LeaseState.EXPIRED, now - lease.expire_at)

    def _shared(self, seconds: float) -> float:
        """The same float object for equal TTLs: leases mostly share a handful of them."""
        if len(self._durations) > 1024:
            self._durations.clear()
        return self._durations.setdefault(seconds, seconds)

    def _add(self, lease: Lease) -> None:
        self._leases[lease.lease_id] = lease
        lease.holder.active[lease.lease_id] = lease
        lease.holder.lease_count += 1
        lease.holder.retained_blocks += lease.block_count
        self.active_leases += 1
        if self._quotas_on:
            usage = self._tenant_usage.setdefault(lease.tenant, [0, 0])
            usage[0] += 1
            usage[1] += lease.block_count

    def _within_quota(self, tenant: str, blocks: int, replacing: Lease | None) -> bool:
        """Whether `tenant` stays within its quota once a lease of `blocks` is added
        (superseding `replacing`), revoking nothing."""
        max_leases, max_blocks = self.config.quota_of(tenant, self._quotas)
        leases, used = self._tenant_usage.get(tenant, (0, 0))
        if replacing is not None and replacing.state is LeaseState.ACTIVE:
            leases, used = leases - 1, used - replacing.block_count
        return not _over_quota(max_leases, max_blocks, leases, used, blocks)

    def _make_room_for_tenant(self, tenant: str, blocks: int, replacing: Lease | None) -> None:
        """Keep `tenant` within its quota once a lease of `blocks` is added (superseding
        `replacing`): revoke the tenant's own soonest-expiring unpinned leases as needed.
        TenantQuotaExceeded, with nothing changed, when that cannot make enough room."""
        max_leases, max_blocks = self.config.quota_of(tenant, self._quotas)
        if not max_leases and not max_blocks:
            return
        leases, used = self._tenant_usage.get(tenant, (0, 0))
        if replacing is not None and replacing.state is LeaseState.ACTIVE:
            leases, used = leases - 1, used - replacing.block_count

        def over(leases: int, used: int) -> bool:
            return _over_quota(max_leases, max_blocks, leases, used, blocks)

        if max_blocks and blocks > max_blocks:
            raise TenantQuotaExceeded(
                f"a lease of {blocks} blocks exceeds tenant {tenant!r}'s quota of {max_blocks}",
                tenant=tenant, max_blocks=max_blocks)
        if not over(leases, used):
            return
        now = self.clock.monotonic()
        # Deadlines that passed but tick() has not applied yet make room too: apply them (as a
        # read of those leases would) and count again.
        stale = [x for x in self._conversations.get(tenant, {}).values()
                 if x.state is LeaseState.ACTIVE and x is not replacing
                 and (x.expire_at <= now or x.holder.expire_at <= now)]
        if stale:
            for lease in stale:
                self._refresh(lease, now)
            leases, used = self._tenant_usage.get(tenant, (0, 0))
            if replacing is not None and replacing.state is LeaseState.ACTIVE:
                leases, used = leases - 1, used - replacing.block_count
        candidates = sorted(
            (x for x in self._conversations.get(tenant, {}).values()
             if x is not replacing and x.state is LeaseState.ACTIVE and x.pin_count == 0
             and x.expire_at > now),
            key=lambda x: x.expire_at)
        victims = []
        for lease in candidates:
            if not over(leases, used):
                break
            victims.append(lease)
            leases, used = leases - 1, used - lease.block_count
        if over(leases, used):
            raise TenantQuotaExceeded(
                f"tenant {tenant!r} is at its quota ({max_leases or 'any'} leases, "
                f"{max_blocks or 'any'} blocks) and its other leases are pinned",
                tenant=tenant, max_leases=max_leases, max_blocks=max_blocks)
        for lease in victims:
            log.info("lease_revoked", lease_id=lease.lease_id, tenant=tenant,
                     conversation=lease.conversation_id, holder=lease.holder.holder_id,
                     reason="tenant_quota", pins=0)
            self._kill(lease, LeaseState.REVOKED)

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(active leases, their blocks) of `tenant`; counted only while quotas are set."""
        leases, blocks = self._tenant_usage.get(tenant, (0, 0))
        return leases, blocks

    def _active_of(self, holder: Holder) -> list[Lease]:
        """A holder's active leases (a copy: the caller may kill them as it goes)."""
        return list(holder.active.values())

    def _kill(self, lease: Lease, state: LeaseState, lateness: float = 0.0) -> None:
        holder = lease.holder
        lease.state = state
        self._unindex(lease)
        self.active_leases -= 1
        if self._quotas_on:
            usage = self._tenant_usage[lease.tenant]
            usage[0] -= 1
            usage[1] -= lease.block_count
            if usage[0] == 0:
                del self._tenant_usage[lease.tenant]
        holder.lease_count -= 1
        del holder.active[lease.lease_id]
        holder.dead_leases[lease.lease_id] = lease
        self._dead_of_tenant.setdefault(lease.tenant, {}).setdefault(
            lease.conversation_id, {})[lease.lease_id] = lease
        self._emit(DEAD_EVENT[state], lease, lateness)
        if lease.pin_count == 0:
            self._emit_reclaimable(lease)

    def _forget(self, lease: Lease) -> None:
        """The holder freed the blocks: drop every trace of the lease."""
        holder = lease.holder
        holder.dead_leases.pop(lease.lease_id, None)
        convs_dead = self._dead_of_tenant.get(lease.tenant)
        dead = convs_dead.get(lease.conversation_id) if convs_dead is not None else None
        if convs_dead is not None and dead is not None:
            dead.pop(lease.lease_id, None)
            if not dead:
                del convs_dead[lease.conversation_id]
                if not convs_dead:
                    del self._dead_of_tenant[lease.tenant]
        holder.retained_blocks -= lease.block_count
        self._leases.pop(lease.lease_id, None)
        convs = self._conversations.get(lease.tenant)
        if convs is not None and convs.get(lease.conversation_id) is lease:
            del convs[lease.conversation_id]
            if not convs:
                del self._conversations[lease.tenant]
        self._emit(EventType.RECLAIMED, lease)

    def tick(self) -> int:
        """Process due deadlines (holders, pins, at most `expiry_batch` leases). Returns the
        number of leases expired."""
        now = self.clock.monotonic()
        if self._reclaimable_owed or self._paying:
            self._pay_reclaimable(now)  # first: what this tick kills is then sent as it dies
        self._expire_holders(now)
        pins = self._pins
        for pin in self._pin_expiry.due(now, len(self._pin_expiry)):
            if pins.get(pin.pin_id) is pin:  # not released
                del pins[pin.pin_id]
                self._unpin(pin.lease)
        expired = 0
        for lease in self._expiry.due(now, self.config.expiry_batch):
            if lease.state is not LeaseState.ACTIVE:
                continue
            if lease.expire_at > now:  # renewed since it was scheduled
                self._expiry.add(lease, lease.expire_at)
                continue
            self._kill(lease, LeaseState.EXPIRED, now - lease.expire_at)
            expired += 1
        if expired:
            log.debug("leases_expired", count=expired)
        return expired

    def _retention(self) -> float:
        """How long a lost holder is kept: past its own hard deadline it has freed everything
        it held."""
        return self.config.max_lifetime_cap_s + self.config.max_pin_ttl_s

    def _expire_holders(self, now: float) -> None:
        for holder in self._holder_expiry.due(now, len(self._holder_expiry)):
            if holder.state is HolderState.LOST or self._holders.get(holder.holder_id) \
                    is not holder or holder.scheduled is None or holder.scheduled > now:
                continue  # lost or forgotten since, or a stale entry (its current one is later)
            if holder.expire_at <= now:
                self._lose_holder(holder, now)
            else:  # heartbeats moved its deadline since it was scheduled
                self._holder_expiry.add(holder, holder.expire_at)
                holder.scheduled = holder.expire_at
        for holder in self._lost_expiry.due(now, len(self._lost_expiry)):
            if holder.state is not HolderState.LOST or self._holders.get(holder.holder_id) \
                    is not holder:
                continue  # registered again since, or forgotten
            end = holder.lost_at + self._retention()
            if holder.dead_leases and now <= end:  # lost again since, or due at this instant
                self._lost_expiry.add(holder, end + _RETENTION_STEP)
                continue
            if any(lease.pin_count for lease in holder.dead_leases.values()):
                # A pin outlives no holder's hard deadline; look again once pins may be over.
                self._lost_expiry.add(holder, now + self.config.max_pin_ttl_s)
                continue
            for lease in list(holder.dead_leases.values()):
                self._forget(lease)
            del self._holders[holder.holder_id]

    def next_deadline(self) -> float | None:
        """The earliest pending deadline, for the scheduler's sleep."""
        candidates = [due for due in (self._pin_expiry.next_deadline(),
                                      self._expiry.next_deadline(),
                                      self._holder_expiry.next_deadline(),
                                      self._lost_expiry.next_deadline()) if due is not None]
        if self._reclaimable_owed or self._paying:
            candidates.append(self._reclaim_hold_until)
        return min(candidates) if candidates else None

    # ---- introspection ----------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        return {
            "leases_active": self.active_leases,
            "leases_total": len(self._leases),
            "holders": sum(1 for h in self._holders.values() if h.state is not HolderState.LOST),
            "pins": len(self._pins),
            "history_keys": self.history_keys,
        }

