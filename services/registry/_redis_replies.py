"""What the Redis store's functions answer, read back: holders and leases as `_model` records
on this replica's clock, and refusals as the domain errors (with `LeaseTable`'s wording)."""

from __future__ import annotations

import sys
from typing import Any

from kvbridge.errors import (
    CapacityExhausted,
    HolderDraining,
    HolderNotFound,
    IdempotencyConflict,
    KvbridgeError,
    LeaseNotFound,
    NotLeaseHolder,
    TenantQuotaExceeded,
)
from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._core import pins_exceeded
from kvbridge.services.registry._model import Holder, HolderState, Lease, LeaseState
from kvbridge.services.registry._redis_lua import Refusal


def _s(value: bytes) -> str:
    return value.decode()


def holder_of(f: list[Any], base: float) -> Holder:
    """A holder as replies carry it (`holder_enc` in store.lua); `base` puts its Redis times
    on the local clock."""
    hid, host, port, tp, bs, fp, ttl, x, ver, state, blocks, active = f
    holder = Holder(_s(hid), _s(host), int(port), int(tp), int(bs), _s(fp), float(ttl),
                    base + float(x), _s(ver))
    holder.state = HolderState(int(state))
    holder.retained_blocks = int(blocks)
    holder.lease_count = int(active)
    return holder


def lease_of(f: list[Any], holder: Holder, base: float) -> Lease:
    """A lease as replies carry it (`lease_enc` in store.lua)."""
    lid, tenant, conv, _h, rrid, payload, tokens, epoch, idle, life, created, x, state, k = f
    return Lease.from_payload(
        _s(lid), sys.intern(_s(tenant)), _s(conv), holder, _s(rrid), payload, int(tokens),
        int(epoch), float(idle), float(life), base + float(created), base + float(x),
        LeaseState(int(state)), int(k))


def lease_with_holder(lease: list[Any], holder: list[Any], base: float) -> Lease:
    return lease_of(lease, holder_of(holder, base), base)


def refusal(config: RegistryConfig, reason: str, *, holder: str = "", lease_id: str = "",
            request_id: str = "", what: str = "", tenant: str = "") -> KvbridgeError:
    """The domain error for a function's refusal (HOLDER_CONFLICT, and NOT_LEASE_HOLDER of a
    registration, carry more and are mapped by their caller)."""
    if reason == Refusal.HOLDER_NOT_FOUND:
        return HolderNotFound(f"holder {holder!r} is not registered; register it (again)",
                              holder=holder)
    if reason == Refusal.HOLDER_DRAINING:
        return HolderDraining(f"holder {holder!r} is draining", holder=holder)
    if reason == Refusal.CAPACITY_EXHAUSTED:
        return CapacityExhausted("registry lease capacity reached", limit=config.max_leases)
    if reason == Refusal.LEASE_NOT_FOUND:
        return LeaseNotFound(f"no lease {lease_id!r}", lease_id=lease_id)
    if reason == Refusal.NOT_LEASE_HOLDER:
        return NotLeaseHolder(f"lease {lease_id!r} belongs to another holder",
                              lease_id=lease_id)
    if reason == Refusal.TENANT_QUOTA_EXCEEDED:
        return TenantQuotaExceeded(
            "the tenant is at its quota and its other leases are pinned (or this lease "
            "alone exceeds its block quota)", holder=holder)
    if reason == Refusal.TENANT_PINS_EXCEEDED:
        return pins_exceeded(tenant, config.tenant_max_pins)
    if reason == Refusal.REQUEST_ID_REUSED:
        return IdempotencyConflict(f"request_id {request_id!r} was used for another {what}",
                                   request_id=request_id)
    return KvbridgeError(f"Redis store refused: {reason}")
