"""The registry's records: holders, leases, pins, and the events their changes emit.

Records are plain slotted objects owned by a store (`LeaseTable`, or built from a Redis reply by
`RedisStore`); nothing outside the stores mutates them.
A lease keeps its block ids packed as uint32 `bytes` and its hashes as one `bytes`, and derives
what it can (maximum lifetime, pin bound) instead of storing it: a lease of 64 blocks costs about
1.3 KiB of payload plus a few hundred bytes of bookkeeping.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable

from kvbridge.blockhash import HASH_SIZE


class HolderState(enum.IntEnum):
    ACTIVE = 1
    DRAINING = 2
    LOST = 3  # missed its TTL; kept only until its dead leases are accounted for


class LeaseState(enum.IntEnum):
    ACTIVE = 1
    EXPIRED = 2
    REVOKED = 3
    SUPERSEDED = 4
    HOLDER_LOST = 5


class MissReason(enum.IntEnum):
    HIT = 0
    NO_LEASE = 1
    EXPIRED = 2
    HOLDER_GONE = 3
    HASH_MISMATCH = 4
    BELOW_MINIMUM = 5
    REVOKED = 6


class EventType(enum.IntEnum):
    GRANTED = 1
    RENEWED = 2
    SUPERSEDED = 3
    EXPIRED = 4
    REVOKED = 5
    HOLDER_LOST = 6
    RECLAIMABLE = 7
    RECLAIMED = 8


class Holder:
    __slots__ = (
        "active", "block_size", "dead_leases", "expire_at", "fingerprint", "holder_id",
        "lease_count", "lost_at", "nixl_host", "nixl_port", "retained_blocks", "scheduled",
        "state", "tp_size", "ttl", "version",
    )

    def __init__(
        self, holder_id: str, nixl_host: str, nixl_port: int, tp_size: int, block_size: int,
        fingerprint: str, ttl: float, expire_at: float, version: str = "",
    ) -> None:
        self.holder_id = holder_id
        self.version = version
        self.nixl_host = nixl_host
        self.nixl_port = nixl_port
        self.tp_size = tp_size
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.ttl = ttl
        self.expire_at = expire_at
        self.state = HolderState.ACTIVE
        self.lost_at = 0.0
        # Active leases and leases no longer active whose blocks the holder has not yet
        # confirmed freeing, by id: re-registration, holder loss, listing by holder and every
        # heartbeat cost what the holder has, not what the registry has. (`active` is kept by
        # the in-memory table only; a Redis store's Holder carries the count.)
        self.lease_count = 0
        self.scheduled: float | None = None  # its deadline in the in-memory table's wheel
        self.active: dict[str, Lease] = {}
        self.dead_leases: dict[str, Lease] = {}
        self.retained_blocks = 0


class Lease:
    __slots__ = (
        "conversation_id", "epoch", "expire_at", "history", "holder", "idle_ttl", "lease_id",
        "max_expire_at", "max_lifetime", "payload", "pin_count", "remote_request_id", "state",
        "tenant", "token_count",
    )

    def __init__(
        self, lease_id: str, tenant: str, conversation_id: str, holder: Holder,
        remote_request_id: str, block_ids: Iterable[int], token_count: int, hashes: bytes,
        epoch: int, idle_ttl: float, max_lifetime: float, created_at: float,
        history: bytes = b"",
    ) -> None:
        self.lease_id = lease_id
        self.tenant = tenant
        self.conversation_id = conversation_id
        self.holder = holder
        self.remote_request_id = remote_request_id
        # One object for both: the hashes (HASH_SIZE bytes per block), then the block ids
        # (uint32 each).
        self.payload = hashes + array("I", block_ids).tobytes()
        self.token_count = token_count
        self.epoch = epoch
        self.idle_ttl = idle_ttl
        self.max_lifetime = max_lifetime
        self.max_expire_at = created_at + max_lifetime
        self.expire_at = min(created_at + idle_ttl, self.max_expire_at)
        self.state = LeaseState.ACTIVE
        self.pin_count = 0
        # The history keys it was granted with (16 bytes each, the whole prompt's last): the
        # tenant's lookup by content finds it under them while it is active.
        self.history = history

    @classmethod
    def from_payload(
        cls, lease_id: str, tenant: str, conversation_id: str, holder: Holder,
        remote_request_id: str, payload: bytes, token_count: int, epoch: int, idle_ttl: float,
        max_lifetime: float, created_at: float, expire_at: float, state: LeaseState,
        pin_count: int, history: bytes = b"",
    ) -> Lease:
        """A lease as a shared backend stored it: the packed payload as is, times already on
        the local clock."""
        lease = cls.__new__(cls)
        lease.lease_id = lease_id
        lease.tenant = tenant
        lease.conversation_id = conversation_id
        lease.holder = holder
        lease.remote_request_id = remote_request_id
        lease.payload = payload
        lease.token_count = token_count
        lease.epoch = epoch
        lease.idle_ttl = idle_ttl
        lease.max_lifetime = max_lifetime
        lease.max_expire_at = created_at + max_lifetime
        lease.expire_at = expire_at
        lease.state = state
        lease.pin_count = pin_count
        lease.history = history
        return lease

    @property
    def created_at(self) -> float:
        return self.max_expire_at - self.max_lifetime

    @property
    def block_count(self) -> int:
        return len(self.payload) // (HASH_SIZE + 4)

    @property
    def hashes(self) -> bytes:
        return self.payload[: self.block_count * HASH_SIZE]

    def hash_view(self, blocks: int) -> memoryview:
        """The first `blocks` hashes, without copying."""
        return memoryview(self.payload)[: blocks * HASH_SIZE]

    def block_id_list(self, start: int = 0, stop: int | None = None) -> list[int]:
        payload = self.payload
        first = len(payload) // (HASH_SIZE + 4) * HASH_SIZE  # where the block ids begin
        end = len(payload) if stop is None else first + 4 * stop
        return array("I", payload[first + 4 * start : end]).tolist()

    @property
    def reclaimable(self) -> bool:
        return self.state is not LeaseState.ACTIVE and self.pin_count == 0


class Pin:
    __slots__ = ("expire_at", "lease", "pin_id")

    def __init__(self, pin_id: str, lease: Lease, expire_at: float) -> None:
        self.pin_id = pin_id
        self.lease = lease
        self.expire_at = expire_at


class LeaseEvent:
    """One lease change, as delivered to listeners (metrics, watch streams, logs)."""

    __slots__ = ("conversation_id", "epoch", "holder_id", "lateness", "lease_id", "tenant",
                 "type", "wall")

    def __init__(self, type: EventType, lease: Lease, wall: float, lateness: float = 0.0) -> None:
        self.type = type
        self.lease_id = lease.lease_id
        self.tenant = lease.tenant
        self.conversation_id = lease.conversation_id
        self.holder_id = lease.holder.holder_id
        self.epoch = lease.epoch
        self.wall = wall
        self.lateness = lateness

    @classmethod
    def of(cls, type: EventType, lease_id: str, tenant: str, conversation_id: str,
           holder_id: str, epoch: int, wall: float, lateness: float = 0.0) -> LeaseEvent:
        """An event read back from a shared backend's event stream (no `Lease` at hand)."""
        event = cls.__new__(cls)
        event.type = type
        event.lease_id = lease_id
        event.tenant = tenant
        event.conversation_id = conversation_id
        event.holder_id = holder_id
        event.epoch = epoch
        event.wall = wall
        event.lateness = lateness
        return event
