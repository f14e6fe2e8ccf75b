"""`LeaseStore`: the storage interface under the registry's gRPC servicer, and `MemoryStore`.

A store owns holders, leases, pins and their deadlines, and answers in domain objects (`Holder`,
`Lease`, `Read`, ...) whose deadlines (`expire_at`, `max_expire_at`) are on the store's local
`clock`, whatever clock the backend keeps internally. Every method checks its input first and
raises the same `kvbridge.errors` class for the same bad input on every backend; a call that
raises changes nothing. Two backends:

- `MemoryStore` (here): one process, over the synchronous `LeaseTable`. Its methods are
  `async def`s that return the table's result directly: no executor, no copy.
- `RedisStore` (`_redis`): shared by any number of registry replicas (Lua scripts, Redis time).

The contract suite `tests/test_store_contract.py` runs against both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Protocol

from kvbridge.clock import Clock
from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._core import (
    Grant,
    GrantSpec,
    HolderSpec,
    LeaseTable,
    Listener,
    Read,
    Registration,
    Renewal,
    Snapshot,
)
from kvbridge.services.registry._model import Holder, Lease


class LeaseStore(Protocol):
    """Holders, conversation leases and read pins of one registry fleet (DESIGN invariants)."""

    config: RegistryConfig
    clock: Clock  # the local clock every returned deadline is on

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start background work (event delivery). Raises OSError when the
        backend is unreachable."""
        ...

    async def close(self) -> None:
        """Stop background work and release connections."""
        ...

    # ---- holders ----------------------------------------------------------------------------

    async def register_holder(self, spec: HolderSpec, held: Sequence[Snapshot] = (),
                              held_ids: Sequence[str] = (), restore_only: bool = False
                              ) -> Registration:
        """Register or re-register a holder; restore the `held` leases the store does not know;
        revoke the holder's active leases it no longer lists (`held_ids`, when given: every id
        it retains, `held` being the first page of them), unless `restore_only` (a later
        page: restore, revoke nothing)."""
        ...

    async def heartbeat(self, holder_id: str,
                        reclaimed: Sequence[str] = ()) -> tuple[list[str], float]:
        """Keep a holder alive, forget the dead leases it freed (`reclaimed`), and return
        (its reclaimable lease ids, its TTL)."""
        ...

    async def deregister_holder(self, holder_id: str) -> tuple[list[str], int]:
        """Drain a holder: revoke its leases. Returns (reclaimable ids, leases still pinned)."""
        ...

    async def holders(self) -> list[Holder]:
        """Registered holders that are not lost, in id order."""
        ...

    async def get_holder(self, holder_id: str) -> Holder:
        """A live holder, or HolderNotFound."""
        ...

    # ---- leases -----------------------------------------------------------------------------

    async def grant(self, spec: GrantSpec) -> Grant:
        """Grant a lease, superseding the conversation's current one (epoch + 1); idempotent
        by (holder, request id)."""
        ...

    async def renew(self, lease_ids: Sequence[str],
                    conversations: Sequence[tuple[str, str]] = ()) -> list[Renewal]:
        """Renew leases by id, then conversations' current leases: one result per item."""
        ...

    async def revoke(self, lease_id: str, holder_id: str = "", reason: str = "") -> Lease:
        """Revoke a lease (no-op if already dead); with `holder_id` it must be that holder's."""
        ...

    async def get_lease(self, lease_id: str) -> Lease:
        """A lease in any state until its holder confirms freeing it, else LeaseNotFound."""
        ...

    async def list_leases(self, tenant: str = "", conversation_id: str = "",
                          holder_id: str = "", include_inactive: bool = False,
                          after: str = "", limit: int = 100) -> list[Lease]:
        """Up to `limit` leases matching the filters, in lease id order, after id `after`."""
        ...

    # ---- reads ------------------------------------------------------------------------------

    async def acquire_read(self, tenant: str, conversation_id: str, hashes: bytes,
                           min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                           request_id: str = "", caller: str = "") -> Read:
        """Match a prompt's full-block hashes against the conversation's lease; pin on a hit
        (idempotent by (caller, reader, request id): `caller` names the authenticated
        principal, so that two principals never share a pin)."""
        ...

    async def pin_lease(self, tenant: str, conversation_id: str, min_tokens: int = 0,
                        pin_ttl: float = 0.0, reader_id: str = "", request_id: str = "",
                        caller: str = "", history_keys: bytes = b"") -> Read:
        """Pin the conversation's whole lease for a reader that verifies hashes itself; with
        `history_keys` (and no conversation id), the tenant's lease found by content."""
        ...

    async def release_read(self, pin_id: str) -> bool:
        """Release a pin. False when it was already released or expired."""
        ...

    # ---- events, expiry, introspection ------------------------------------------------------

    def add_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        """Call `listener` (on the event loop) for every lease event of the fleet from now on;
        RENEWED ones only when `renewals`."""
        ...

    def remove_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        ...

    def listener_count(self) -> int:
        """Listeners subscribed (metrics included)."""
        ...

    def on_events_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)` when events may have been lost before reaching this store's
        listeners (the shared event stream lost entries it had not delivered yet): the server
        then ends its watch streams, so that watchers know to re-list."""
        ...

    async def tick(self, *, turn: float = 0.0) -> int:
        """Process due deadlines (holders, pins, a batch of leases); return the leases
        expired. Safe to run on every replica at once: each deadline is processed once.
        `turn` > 0: a tick of a scheduler that ticks again within `turn` seconds; a shared
        store then processes the fleet's deadlines on one replica at a time, for `turn`
        seconds from its tick, and leaves this tick to a replica whose turn it is (the next
        deadline then says when to try again)."""
        ...

    async def reclaim_hold(self, lease_id: str = "") -> float:
        """Seconds left of the recovery grace, 0 when over. A store that starts empty may have
        lost its state (a restart; on Redis also a restart or failover of Redis): pins from
        before may be live, so for that long no lease is reclaimable, whatever its own pin
        count says (DESIGN invariant 7). `lease_id`: the hold that applies to that lease
        (a sharded store's shards hold apart); "": the longest."""
        ...

    def next_deadline(self) -> float | None:
        """The earliest pending deadline on the local clock, as known after the last tick."""
        ...

    def counts(self) -> dict[str, int]:
        """leases_active, leases_total, holders, pins (a shared backend's as of its last
        tick). Synchronous: the metrics scrape calls it from another thread."""
        ...

    @property
    def not_serving(self) -> str:
        """Why this store no longer serves, for good ("" while it does): its server then
        reports NOT_SERVING health, so that load balancers and probes take it out."""
        ...


class MemoryStore:
    """The embedded backend: one `LeaseTable` in this process."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table
        self.config = table.config
        self.clock = table.clock

    @classmethod
    def create(cls, config: RegistryConfig, clock: Clock, *, recovering: bool = True
               ) -> MemoryStore:
        return cls(LeaseTable(config, clock, recovering=recovering))

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def register_holder(self, spec: HolderSpec, held: Iterable[Snapshot] = (),
                              held_ids: Sequence[str] = (), restore_only: bool = False
                              ) -> Registration:
        return self.table.register_holder(spec, held, held_ids, restore_only)

    async def heartbeat(self, holder_id: str,
                        reclaimed: Iterable[str] = ()) -> tuple[list[str], float]:
        return self.table.heartbeat(holder_id, reclaimed)

    async def deregister_holder(self, holder_id: str) -> tuple[list[str], int]:
        return self.table.deregister_holder(holder_id)

    async def holders(self) -> list[Holder]:
        return self.table.holders()

    async def get_holder(self, holder_id: str) -> Holder:
        return self.table.get_holder(holder_id)

    async def grant(self, spec: GrantSpec) -> Grant:
        return self.table.grant(spec)

    async def renew(self, lease_ids: Iterable[str],
                    conversations: Iterable[tuple[str, str]] = ()) -> list[Renewal]:
        return self.table.renew(lease_ids, conversations)

    async def revoke(self, lease_id: str, holder_id: str = "", reason: str = "") -> Lease:
        return self.table.revoke(lease_id, holder_id, reason)

    async def get_lease(self, lease_id: str) -> Lease:
        return self.table.get_lease(lease_id)

    async def reclaim_hold(self, lease_id: str = "") -> float:
        return self.table.reclaim_hold()

    async def list_leases(self, tenant: str = "", conversation_id: str = "",
                          holder_id: str = "", include_inactive: bool = False,
                          after: str = "", limit: int = 100) -> list[Lease]:
        found = self.table.leases(tenant, conversation_id, holder_id, include_inactive, after)
        return list(islice(found, limit))

    async def acquire_read(self, tenant: str, conversation_id: str, hashes: bytes,
                           min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                           request_id: str = "", caller: str = "") -> Read:
        return self.table.acquire_read(tenant, conversation_id, hashes, min_tokens, pin_ttl,
                                       reader_id, request_id, caller)

    async def pin_lease(self, tenant: str, conversation_id: str, min_tokens: int = 0,
                        pin_ttl: float = 0.0, reader_id: str = "", request_id: str = "",
                        caller: str = "", history_keys: bytes = b"") -> Read:
        return self.table.pin_lease(tenant, conversation_id, min_tokens, pin_ttl, reader_id,
                                    request_id, caller, history_keys)

    async def release_read(self, pin_id: str) -> bool:
        return self.table.release_read(pin_id)

    def add_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        self.table.add_listener(listener, renewals=renewals)

    def remove_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        self.table.remove_listener(listener, renewals=renewals)

    def listener_count(self) -> int:
        return len(self.table._listeners)

    def on_events_lost(self, callback: Callable[[str], None]) -> None:
        pass  # events go from the table to its listeners in this process: none is lost

    async def tick(self, *, turn: float = 0.0) -> int:
        return self.table.tick()

    def next_deadline(self) -> float | None:
        return self.table.next_deadline()

    def counts(self) -> dict[str, int]:
        return self.table.counts()

    @property
    def not_serving(self) -> str:
        return ""  # nothing outlives this process's own state
