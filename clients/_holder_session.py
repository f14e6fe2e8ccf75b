"""`HolderSession`: what a decode engine runs to hold leases safely.

It registers the engine as a holder, heartbeats every TTL/3 on a background thread, grants
leases and remembers them, and calls `on_reclaim(lease_ids)` when blocks may be freed:

- when the registry reports them reclaimable (expired, revoked, superseded; no live pin);
- when a lease's hard deadline passes (max lifetime + the registry's max pin TTL + a margin,
  counted from before the grant was sent), whether or not the registry can be reached: the
  fail-safe of DESIGN invariant 4.

After `on_reclaim` returns, the freed ids are acknowledged on the next heartbeat. When the
registry no longer knows the holder (it restarted, or this engine missed its TTL), the session
re-registers and re-sends the leases it still holds; the registry restores or rejects them.

A grant the registry refused returns None: the caller does not retain the blocks. A grant
whose outcome is unknown (it ran out of time, or the connection broke after it was sent) may
have made a lease that readers will use, so it raises `GrantOutcomeUnknown` and the caller
must keep the blocks. The lease such a grant makes has an id the holder can compute
(`kvbridge.ids.grant_lease_id`), so once the grant can no longer be running anywhere, the
session looks that id up after each heartbeat (never granting again: a late lease would
supersede a newer turn's) and reports through `on_grant_resolved(request_id, lease)`: the
lease, now held like any other, or None when no reader can use the blocks (no such lease, or
one already dead and unpinned, or the grant's hard deadline passed).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import structlog

from kvbridge.clients._registry import RegistryClient, duration, seconds
from kvbridge.clock import Clock, SystemClock
from kvbridge.errors import (
    DeadlineExceeded,
    HolderNotFound,
    KvbridgeError,
    LeaseNotFound,
    Unavailable,
)
from kvbridge.ids import grant_lease_id
from kvbridge.registry.v1 import registry_pb2 as pb

log = structlog.get_logger("kvbridge.holder")

ReclaimCallback = Callable[[list[str]], None]
GrantResolvedCallback = Callable[[str, "pb.Lease | None"], None]
DEFAULT_MAX_PIN_TTL = 30.0
# Held leases a registration sends in one call until the registry says its own limit
# (`RegistryLimits.max_held_leases_per_call`; the registry's default).
DEFAULT_HELD_PER_CALL = 512
# A grant that names no maximum lifetime gets the registry's default, which the holder does not
# know: an unresolved one is bounded by the longest lifetime a registry allows by default.
UNKNOWN_MAX_LIFETIME = 86400.0


class GrantOutcomeUnknown(Exception):
    """The grant may or may not have made a lease: keep the blocks until the session reports
    the outcome (`on_grant_resolved`) or `hard_deadline` (holder's monotonic clock) passes."""

    def __init__(self, request_id: str, lease_id: str, hard_deadline: float, cause: str) -> None:
        super().__init__(f"grant {request_id}: outcome unknown ({cause})")
        self.request_id = request_id
        # The id to ask the registry about this grant's lease by (`GetLease`): the lease's
        # own id, or, on a registry sharded over Redis, its id without the shard's tag.
        self.lease_id = lease_id
        self.hard_deadline = hard_deadline


def outcome_unknown(err: KvbridgeError) -> bool:
    """Whether a failed call may have taken effect. The clients say so themselves
    (`maybe_applied`, over all of a call's attempts); for other errors: it ran out of time, the
    connection broke, or the server failed without saying why."""
    maybe = getattr(err, "maybe_applied", None)
    if maybe is not None:
        return bool(maybe)
    return isinstance(err, (Unavailable, DeadlineExceeded)) or type(err) is KvbridgeError


@dataclass(slots=True)
class _PendingGrant:
    request_id: str
    lease_id: str  # the id a lease of this grant has
    args: tuple[str, str, str, list[int], int, bytes, float, float]
    life: float
    first_sent: float
    hard_deadline: float = 0.0  # a lease of any attempt so far, and its pins, are over by then
    settled_after: float = 0.0  # no attempt can still be making the lease after this
    maybe_applied: bool = False
    history_keys: bytes = b""


@dataclass(slots=True)
class HeldLease:
    lease_id: str
    tenant: str
    conversation_id: str
    remote_request_id: str
    block_ids: list[int]
    token_count: int
    block_hashes: bytes
    epoch: int
    idle_ttl: float
    max_lifetime: float
    granted_at: float  # holder's monotonic clock, read before the grant was sent
    hard_deadline: float
    history_keys: bytes = b""

    def snapshot(self, now: float) -> pb.LeaseSnapshot:
        return pb.LeaseSnapshot(
            lease_id=self.lease_id, tenant=self.tenant, conversation_id=self.conversation_id,
            remote_request_id=self.remote_request_id, block_ids=self.block_ids,
            token_count=self.token_count, block_hashes=self.block_hashes, epoch=self.epoch,
            idle_ttl=duration(self.idle_ttl), max_lifetime=duration(self.max_lifetime),
            age=duration(max(now - self.granted_at, 0.0)), history_keys=self.history_keys)


class Revoked(NamedTuple):
    """What `HolderSession.revoke` did with each lease."""

    freed: list[str]  # reclaimable at once: handed to on_reclaim
    pinned: list[str]  # revoked, but a reader holds a pin: freed when a heartbeat says so
    failed: list[str]  # the registry could not be reached or refused: still held
    unreachable: bool = False  # some failed because the registry could not be reached


class HolderSession:
    """A decode engine's registration, heartbeat and lease bookkeeping."""

    def __init__(
        self, client: RegistryClient, *, holder_id: str, nixl_host: str, nixl_port: int,
        block_size: int, engine_fingerprint: str, on_reclaim: ReclaimCallback, tp_size: int = 1,
        ttl: float = 10.0, hard_deadline_margin: float = 5.0, clock: Clock | None = None,
        software_version: str = "", on_grant_resolved: GrantResolvedCallback | None = None,
    ) -> None:
        self.client = client
        self.holder_id = holder_id
        self._register_args = dict(holder_id=holder_id, nixl_host=nixl_host,
                                   nixl_port=nixl_port, block_size=block_size,
                                   engine_fingerprint=engine_fingerprint, tp_size=tp_size,
                                   ttl=ttl, software_version=software_version)
        self.ttl = ttl
        self.margin = hard_deadline_margin
        self.on_reclaim = on_reclaim
        self.on_grant_resolved = on_grant_resolved
        self.clock = clock or SystemClock()
        self.max_pin_ttl = DEFAULT_MAX_PIN_TTL
        self.held_per_call = DEFAULT_HELD_PER_CALL
        self.registered = False
        self.last_ok: float | None = None
        self._held: dict[str, HeldLease] = {}
        self._pending: dict[str, _PendingGrant] = {}  # by request id: outcome unknown
        self._acks: set[str] = set()
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Register (once, without raising) and start heartbeating in the background."""
        self._register()
        self._thread = threading.Thread(target=self._run, name=f"holder-{self.holder_id}",
                                        daemon=True)
        self._thread.start()

    def close(self, *, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl)
        if deregister and self.registered:
            try:
                resp = self.client.deregister_holder(self.holder_id)
                self._reclaim(list(resp.reclaimable_lease_ids), "drained")
            except KvbridgeError as err:
                log.warning("holder_deregister_failed", holder=self.holder_id, error=str(err))

    def _run(self) -> None:
        interval = self.ttl / 3
        while not self._stop.wait(interval):
            self.heartbeat_once()

    # ---- the protocol -----------------------------------------------------------------------

    def _register(self) -> bool:
        with self._register_lock:  # the heartbeat and grant threads may both get here
            return self._register_locked()

    def _register_locked(self) -> bool:
        now = self.clock.monotonic()
        with self._lock:
            held = [lease.snapshot(now) for lease in self._held.values()]
        # More held leases than one call may carry go in pages: the first call lists every id
        # (the registry revokes what it does not list), the later ones only restore.
        per_call = self.held_per_call
        ids = [s.lease_id for s in held] if len(held) > per_call else []
        restored: set[str] = set()
        try:
            for start in range(0, max(len(held), 1), per_call):
                resp = self.client.register_holder(
                    **self._register_args,  # type: ignore[arg-type]
                    held_leases=held[start:start + per_call],
                    held_lease_ids=ids if start == 0 else (), restore_only=start > 0)
                restored.update(resp.restored_lease_ids)
        except KvbridgeError as err:
            log.warning("holder_register_failed", holder=self.holder_id, error=str(err))
            self.registered = False
            return False
        self.held_per_call = resp.limits.max_held_leases_per_call or DEFAULT_HELD_PER_CALL
        self.max_pin_ttl = seconds(resp.limits.max_pin_ttl) or DEFAULT_MAX_PIN_TTL
        self.registered = True
        self.last_ok = self.clock.monotonic()
        with self._lock:
            rejected = [lid for lid in self._held if lid not in restored]
        log.info("holder_registered", holder=self.holder_id, held=len(held),
                 restored=len(restored), rejected=len(rejected))
        # Leases the registry would not take back are never read again, but a reader may still
        # hold a pin on one: free them only once reported reclaimable (or at the hard deadline).
        self._reclaim(list(resp.reclaimable_lease_ids), "reclaimable")
        return True

    def heartbeat_once(self) -> None:
        """One heartbeat: ack freed leases, free reclaimable and past-deadline ones."""
        if not self.registered and not self._register():
            self._enforce_hard_deadlines()
            return
        with self._lock:
            acks = list(self._acks)
        try:
            resp = self.client.heartbeat(self.holder_id, acks, timeout=self.ttl / 3)
        except HolderNotFound:
            log.warning("holder_unknown_to_registry", holder=self.holder_id)
            self.registered = False
            self._register()
        except KvbridgeError as err:
            log.warning("holder_heartbeat_failed", holder=self.holder_id, error=str(err))
        else:
            self.last_ok = self.clock.monotonic()
            with self._lock:
                self._acks.difference_update(acks)
            self._reclaim(list(resp.reclaimable_lease_ids), "reclaimable")
            self._resolve_pending()
        self._enforce_hard_deadlines()

    def _enforce_hard_deadlines(self) -> None:
        now = self.clock.monotonic()
        with self._lock:
            due = [lid for lid, lease in self._held.items() if lease.hard_deadline <= now]
            lapsed = [p for p in self._pending.values() if p.hard_deadline <= now]
            for p in lapsed:
                del self._pending[p.request_id]
        if due:
            self._reclaim(due, "hard_deadline")
        for p in lapsed:
            log.warning("lease_grant_unresolved", holder=self.holder_id,
                        request_id=p.request_id, why="hard_deadline")
            self._grant_resolved(p.request_id, None)

    def _resolve_pending(self) -> None:
        """Look up the leases that grants of unknown outcome may have made, once those grants
        cannot be running anywhere any more; within a share of the heartbeat interval, so that
        a slow registry cannot starve the heartbeat."""
        now = self.clock.monotonic()
        until = now + self.ttl / 6
        with self._lock:
            due = [p for p in self._pending.values() if p.settled_after <= now]
        for p in due:
            left = until - self.clock.monotonic()
            if left <= 0:
                return
            try:
                status = self.client.lease_status(p.lease_id, timeout=left)
            except LeaseNotFound:
                # None was made (no grant runs past its deadline, and those have passed), or
                # it was made, reported reclaimable and forgotten: no reader can use them. (A
                # registry within its recovery grace answers RECOVERING instead: still unknown.)
                self._settle(p, None, "no_lease")
                continue
            except KvbridgeError as err:
                log.info("lease_grant_still_unknown", holder=self.holder_id,
                         request_id=p.request_id, error=str(err))
                continue
            lease = status.lease
            if status.reclaimable:  # dead, unpinned, and no pin from before a registry restart
                self._settle(p, None, "dead_unpinned")
                continue
            tenant, conversation, rrid, block_ids, tokens, hashes, _, _ = p.args
            held = HeldLease(lease.lease_id, tenant, conversation, rrid, list(block_ids), tokens,
                             hashes, lease.epoch, seconds(lease.idle_ttl),
                             seconds(lease.max_lifetime), p.first_sent, p.hard_deadline,
                             p.history_keys)
            with self._lock:
                self._held[lease.lease_id] = held
                self._acks.discard(lease.lease_id)  # held now: it must be reported again
            self._settle(p, lease, pb.LeaseState.Name(lease.state))

    def _settle(self, p: _PendingGrant, lease: pb.Lease | None, how: str) -> None:
        with self._lock:
            self._pending.pop(p.request_id, None)
        log.info("lease_grant_resolved", holder=self.holder_id, request_id=p.request_id,
                 lease_id=lease.lease_id if lease is not None else None, how=how)
        self._grant_resolved(p.request_id, lease)

    def _grant_resolved(self, request_id: str, lease: pb.Lease | None) -> None:
        if self.on_grant_resolved is None:
            return
        try:
            self.on_grant_resolved(request_id, lease)
        except Exception:  # the engine's callback failing must not kill the heartbeat
            log.exception("grant_resolved_callback_failed", holder=self.holder_id)

    def _reclaim(self, lease_ids: list[str], why: str) -> None:
        with self._lock:
            # Out of `_held` before the engine frees anything: a registration on another
            # thread (after a registry restart) must not list, and so restore as readable, a
            # lease whose blocks are being freed.
            taken = {lid: self._held.pop(lid) for lid in lease_ids if lid in self._held}
            # Ids we do not hold (freed before, or never ours) are acked straight away.
            self._acks.update(lid for lid in lease_ids if lid not in taken)
        if not taken:
            return
        mine = list(taken)
        try:
            self.on_reclaim(mine)
        except Exception:  # the engine's callback failing must not kill the heartbeat
            log.exception("reclaim_callback_failed", holder=self.holder_id)
            with self._lock:  # nothing freed: still held, freed on a later report
                for lid, lease in taken.items():
                    self._held.setdefault(lid, lease)
            return
        with self._lock:
            self._acks.update(mine)
        log.info("leases_reclaimed", holder=self.holder_id, count=len(mine), why=why)

    # ---- leases -----------------------------------------------------------------------------

    def grant(self, tenant: str, conversation_id: str, remote_request_id: str,
              block_ids: list[int], token_count: int, block_hashes: bytes, *,
              idle_ttl: float = 0.0, max_lifetime: float = 0.0, history_keys: bytes = b"",
              timeout: float | None = None) -> pb.Lease | None:
        """Grant a lease over blocks the caller keeps. None means: do not keep them.
        `GrantOutcomeUnknown` means: keep them until `on_grant_resolved` says what became of
        the grant (see the module docstring).

        A registry that no longer knows this holder (it restarted, or heartbeats were starved
        past the TTL) gets a re-registration and the grant once more, with the same request
        id (so a lease an earlier attempt made is the one returned)."""
        budget = timeout if timeout is not None else float(getattr(self.client, "timeout", 0) or
                                                           30.0)
        life = max_lifetime if max_lifetime > 0 else UNKNOWN_MAX_LIFETIME
        request_id = uuid.uuid4().hex
        p = _PendingGrant(request_id, grant_lease_id(self.holder_id, request_id),
                          (tenant, conversation_id, remote_request_id, list(block_ids),
                           token_count, block_hashes, idle_ttl, max_lifetime), life,
                          self.clock.monotonic(), history_keys=history_keys)
        for attempt in range(2):
            if not self.registered and (attempt == 0 or not self._register()):
                break
            try:
                return self._send_grant(p, timeout=budget)
            except HolderNotFound as err:
                p.maybe_applied = p.maybe_applied or outcome_unknown(err)
                self.registered = False
                log.warning("holder_unknown_to_registry", holder=self.holder_id)
            except KvbridgeError as err:
                p.maybe_applied = p.maybe_applied or outcome_unknown(err)
                if not p.maybe_applied:
                    log.warning("lease_grant_failed", holder=self.holder_id,
                                conversation=conversation_id, error=str(err))
                    return None
                self._keep_pending(p, str(err))
        if p.maybe_applied:
            self._keep_pending(p, "holder unknown to the registry")
        return None

    def _keep_pending(self, p: _PendingGrant, cause: str) -> None:
        with self._lock:
            self._pending[p.request_id] = p
        log.warning("lease_grant_outcome_unknown", holder=self.holder_id,
                    conversation=p.args[1], request_id=p.request_id, lease_id=p.lease_id,
                    error=cause,
                    hard_deadline_in_s=round(p.hard_deadline - self.clock.monotonic(), 1))
        raise GrantOutcomeUnknown(p.request_id, p.lease_id, p.hard_deadline, cause)

    def _send_grant(self, p: _PendingGrant, timeout: float) -> pb.Lease:
        """One GrantLease for `p`, with its request id; the lease is held once it is back.
        Before sending, `p`'s deadlines cover a lease this attempt may make: the registry runs
        no grant past its deadline (send time + `timeout`), and the margin covers a store
        still finishing one it started before then."""
        tenant, conversation, rrid, block_ids, tokens, hashes, idle_ttl, max_lifetime = p.args
        sent_at = self.clock.monotonic()
        p.settled_after = max(p.settled_after, sent_at + timeout + self.margin)
        p.hard_deadline = max(p.hard_deadline, p.settled_after + p.life + self.max_pin_ttl)
        resp = self.client.grant_lease(
            self.holder_id, tenant, conversation, rrid, block_ids, tokens, hashes, idle_ttl,
            max_lifetime, request_id=p.request_id, history_keys=p.history_keys,
            timeout=timeout)
        lease = resp.lease
        life = seconds(lease.max_lifetime)
        # The lease was made before its reply came back: count from now, not from the send.
        answered = self.clock.monotonic()
        held = HeldLease(lease.lease_id, tenant, conversation, rrid, list(block_ids), tokens,
                         hashes, lease.epoch, seconds(lease.idle_ttl), life, p.first_sent,
                         answered + life + self.max_pin_ttl + self.margin, p.history_keys)
        with self._lock:
            self._held[lease.lease_id] = held
        if resp.superseded_lease_id:
            log.debug("lease_superseded", lease_id=resp.superseded_lease_id,
                      by=lease.lease_id, conversation=conversation)
        return lease

    def pending_grants(self) -> list[str]:
        """Request ids of grants whose outcome is not known yet."""
        with self._lock:
            return list(self._pending)

    def revoke(self, lease_ids: Iterable[str], reason: str = "memory_pressure") -> Revoked:
        """Revoke leases (e.g. under memory pressure). Those reclaimable right away are freed
        through `on_reclaim` now; pinned ones are freed when a heartbeat reports them; those
        the registry could not be asked about stay held."""
        freed: list[str] = []
        pinned: list[str] = []
        failed: list[str] = []
        unreachable = False
        for lease_id in lease_ids:
            try:
                resp = self.client.revoke_lease(lease_id, reason, self.holder_id)
            except KvbridgeError as err:
                log.warning("lease_revoke_failed", lease_id=lease_id, error=str(err))
                failed.append(lease_id)
                unreachable = unreachable or isinstance(err, (Unavailable, DeadlineExceeded))
                continue
            (freed if resp.reclaimable else pinned).append(lease_id)
        self._reclaim(freed, reason)
        return Revoked(freed, pinned, failed, unreachable)

    def held(self) -> list[HeldLease]:
        """Leases held now, oldest grant first."""
        with self._lock:
            return sorted(self._held.values(), key=lambda lease: lease.granted_at)
