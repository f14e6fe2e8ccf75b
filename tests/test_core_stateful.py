"""A model-based state machine over LeaseTable: random grants, renewals, reads, pins, revokes,
heartbeats with acks, holder loss and re-registration, malformed calls, and a FakeClock that
moves in exact binary fractions of a second.

The model predicts every outcome that the protocol fixes (which lease a read may hit, renewals,
release results, reclaim reports) and checks the lease invariants of DESIGN.md after each step:
never reclaimable under a live pin, superseded / lost / revoked / expired leases never read
again, reads hit only the conversation's newest granted lease, counts consistent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvbridge import blockhash
from kvbridge.clock import FakeClock
from kvbridge.errors import (
    CapacityExhausted,
    HolderNotFound,
    IdempotencyConflict,
    InvalidArgument,
    LeaseNotFound,
    NotLeaseHolder,
)
from kvbridge.services.registry import (
    GrantSpec,
    HolderSpec,
    LeaseState,
    LeaseTable,
    MissReason,
    RegistryConfig,
    Snapshot,
)
from kvbridge.services.registry._core import short_keys

BS = 4
FP = "fp-stateful"
HOLDERS = ("h0", "h1")
HOLDER_TTL = {"h0": 4.0, "h1": 7.0}
CONVS = (("t0", "c0"), ("t0", "c1"), ("t1", "c0"))
READER = "prefill-0"
CONFIG = RegistryConfig(
    default_idle_ttl_s=6.0, min_idle_ttl_s=1.0, max_idle_ttl_s=20.0,
    default_max_lifetime_s=10.0, max_lifetime_cap_s=1000.0,  # lost holders are never purged
    default_pin_ttl_s=2.0, max_pin_ttl_s=4.0,
    default_holder_ttl_s=3.0, min_holder_ttl_s=1.0, max_holder_ttl_s=30.0,
    max_leases=12, max_blocks_per_lease=8, max_batch=16, expiry_batch=4,
)
GRACE = CONFIG.effective_recovery_grace_s
STEPS = st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0])  # exact in binary floating point
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=20)
REASON_OF_STATE = {LeaseState.EXPIRED: MissReason.EXPIRED,
                   LeaseState.REVOKED: MissReason.REVOKED,
                   LeaseState.HOLDER_LOST: MissReason.HOLDER_GONE}


def lease_hashes(tokens: list[int]) -> bytes:
    return blockhash.block_hashes(tokens, BS, FP, include_partial=True)


def chunks(h: bytes) -> list[bytes]:
    return [h[i : i + 16] for i in range(0, len(h), 16)]


@dataclass
class MLease:
    lease_id: str
    holder: str
    tenant: str
    conv: str
    tokens: list[int]
    spec: GrantSpec
    epoch: int
    created: float
    idle: float
    max_expire: float
    expire_at: float
    dead: set[MissReason] | None = None  # None: alive; else the miss reasons a read may give
    superseded: bool = False
    by_deadline: bool = False  # died by a deadline the table may not have processed yet
    processed: bool = False  # the table has certainly recorded the death
    forgotten: bool = False  # acked by its holder: gone from the table


@dataclass
class MPin:
    lease_id: str
    deadline: float
    in_table: bool = True


@dataclass
class MHolder:
    expire_at: float
    lost: bool = False
    pending_acks: dict[str, None] = field(default_factory=dict)  # ordered: replays match


class LeaseTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.start = self.clock.monotonic()
        self.table = LeaseTable(CONFIG, self.clock)  # recovering: nothing reclaimable at first
        self.holders: dict[str, MHolder] = {}
        for h in HOLDERS:
            reg = self.table.register_holder(self.holder_spec(h))
            assert reg.restored == [] and reg.reclaimable == []
            self.holders[h] = MHolder(self.now + HOLDER_TTL[h])
        self.leases: dict[str, MLease] = {}
        # the newest grant of each conversation (a record, not an id: a request-derived lease
        # id comes back for a new lease once the first one is forgotten)
        self.newest: dict[tuple[str, str], MLease] = {}
        self.pins: dict[str, MPin] = {}
        self.read_requests: dict[tuple[str, str], str] = {}  # (tenant, request id) -> pin id
        self.grant_requests: dict[tuple[str, str], str] = {}  # (holder, request id) -> lease id
        self.reported: set[str] = set()  # ever reported reclaimable

    # ---- model helpers ----------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    @staticmethod
    def holder_spec(h: str) -> HolderSpec:
        return HolderSpec(h, "10.0.0.1", 5600 + HOLDERS.index(h), 1, BS, FP, HOLDER_TTL[h])

    def live(self) -> list[MLease]:
        return [x for x in self.leases.values() if not x.forgotten]

    def pins_in_table(self, lease_id: str) -> list[MPin]:
        return [p for p in self.pins.values() if p.in_table and p.lease_id == lease_id]

    def holder_is_lost(self, h: str) -> bool:
        return self.holders[h].lost or self.holders[h].expire_at <= self.now

    def sync(self) -> None:
        """Apply every deadline that has passed to the model (the table may do so lazily)."""
        now = self.now
        for lease in self.leases.values():
            if lease.dead is None and lease.expire_at <= now:
                lease.dead = {MissReason.EXPIRED}
                lease.by_deadline = True
        for h, mh in self.holders.items():
            if not mh.lost and mh.expire_at <= now:
                mh.lost = True
                for lease in self.leases.values():
                    if lease.holder != h or lease.forgotten:
                        continue
                    if lease.dead is None:
                        lease.dead = {MissReason.HOLDER_GONE}
                        lease.by_deadline = True
                    elif lease.by_deadline and not lease.processed:
                        lease.dead.add(MissReason.HOLDER_GONE)

    def kill(self, lease: MLease, reason: MissReason) -> None:
        if lease.dead is None:
            lease.dead = {reason}
        elif lease.by_deadline and not lease.processed:
            lease.dead.add(reason)
        lease.processed = True

    def check_reclaimable(self, h: str, ids: list[str]) -> None:
        assert len(ids) == len(set(ids))
        if self.now < self.start + GRACE:
            assert ids == [], "reported reclaimable during the recovery grace"
            return
        for lid in ids:
            lease = self.leases[lid]
            assert lease.holder == h
            assert not lease.forgotten
            assert lease.dead is not None, "an active lease reported reclaimable"
            assert not self.pins_in_table(lid), "reported reclaimable under a pin"
        # completeness: every lease whose death the table has recorded and that nothing pins
        expected = {x.lease_id for x in self.live() if x.holder == h and x.dead is not None
                    and x.processed and not self.pins_in_table(x.lease_id)}
        assert expected <= set(ids)
        if ids:
            event("reclaimable reported")
        self.reported.update(ids)
        self.holders[h].pending_acks.update(dict.fromkeys(ids))

    def read_expectation(self, tenant: str, conv: str, tokens: list[int] | None
                         ) -> tuple[MLease | None, MissReason | set[MissReason], int, bool]:
        lease = self.newest.get((tenant, conv))
        if lease is None or lease.forgotten:
            return None, MissReason.NO_LEASE, 0, False
        if lease.dead is not None:
            return lease, set(lease.dead), 0, False
        full = len(lease.tokens) // BS
        ours = chunks(lease_hashes(lease.tokens))[:full]
        theirs = chunks(blockhash.block_hashes(tokens or [], BS, FP))
        k = 0
        while k < min(len(ours), len(theirs)) and ours[k] == theirs[k]:
            k += 1
        partial = k == full and len(lease.tokens) % BS != 0
        return lease, MissReason.HIT, k, partial

    # ---- rules ------------------------------------------------------------------------------

    @initialize(data=st.data())
    def first_turns(self, data: Any) -> None:
        """Every conversation starts with a finished turn, so reads have something to find."""
        for i, conv in enumerate(CONVS):
            self.grant(data, HOLDERS[i % 2], conv, False, 0.0, 0.0, "", 0, False)

    @rule(data=st.data(), h=st.sampled_from(HOLDERS), conv=st.sampled_from(CONVS),
          extend=st.booleans(), idle=st.sampled_from([0.0, 1.0, 2.0, 8.0]),
          life=st.sampled_from([0.0, 8.0, 16.0]),
          request_id=st.sampled_from(["", "", "", "g0", "g1"]), rrid=st.integers(0, 1),
          next_turn=st.booleans())
    def grant(self, data: Any, h: str, conv: tuple[str, str], extend: bool, idle: float,
              life: float, request_id: str, rrid: int, next_turn: bool) -> None:
        """A turn ends: decode grants a lease. With `next_turn`, the conversation's next
        request follows at once: prefill reads with a prompt that extends the tokens."""
        self.sync()
        tenant, cid = conv
        prev = self.newest.get(conv)
        if extend and prev is not None:
            extra = data.draw(st.lists(st.integers(0, 2), max_size=6))
            tokens = (prev.tokens + extra)[: BS * CONFIG.max_blocks_per_lease]
        else:
            tokens = data.draw(TOKENS)
        n = -(-len(tokens) // BS)
        # History keys from a small pool, so that leases share some and overwrite each
        # other's index entries (the lookup by content).
        keys = b"".join(bytes([k]) * 16 for k in data.draw(
            st.lists(st.integers(1, 4), max_size=3), label="history keys"))
        spec = GrantSpec(h, tenant, cid, f"rr-{rrid}", list(range(10 * n, 11 * n)), len(tokens),
                         lease_hashes(tokens), idle, life, request_id, keys)

        if self.holder_is_lost(h):
            with pytest.raises(HolderNotFound):
                self.table.grant(spec)
            self.do_register(h, set())  # what an engine does on HolderNotFound
            return
        existing = self.leases.get(self.grant_requests.get((h, request_id), ""))
        if request_id and existing is not None and not existing.forgotten:
            if (existing.tenant, existing.conv, existing.spec.remote_request_id) != (
                    tenant, cid, spec.remote_request_id):
                with pytest.raises(IdempotencyConflict):
                    self.table.grant(spec)
                return
            g = self.table.grant(spec)
            assert g.lease.lease_id == existing.lease_id and g.superseded is None
            return
        if len(self.live()) >= CONFIG.max_leases:
            with pytest.raises(CapacityExhausted):
                self.table.grant(spec)
            event("grant: capacity exhausted")
            return

        g = self.table.grant(spec)
        now = self.now
        current = prev if prev is not None and not prev.forgotten else None
        epoch = current.epoch + 1 if current is not None else 1
        assert g.lease.epoch == epoch
        assert g.lease.state is LeaseState.ACTIVE
        if current is not None and current.dead is None:
            event("grant: superseded an active lease")
            assert g.superseded is not None and g.superseded.lease_id == current.lease_id
        if current is not None:
            current.superseded = True
            self.kill(current, MissReason.NO_LEASE)
        if g.superseded is not None:
            assert g.superseded.state is LeaseState.SUPERSEDED
        eff_idle = idle or CONFIG.default_idle_ttl_s
        eff_life = life or max(CONFIG.default_max_lifetime_s, eff_idle)
        lid = g.lease.lease_id
        if lid in self.leases:  # a derived id reused after the first lease was forgotten
            assert self.leases[lid].forgotten
            self.reported.discard(lid)
        self.leases[lid] = MLease(lid, h, tenant, cid, tokens, spec, epoch, now, eff_idle,
                                  now + eff_life, min(now + eff_idle, now + eff_life))
        assert g.lease.expire_at == self.leases[lid].expire_at
        self.newest[conv] = self.leases[lid]
        if request_id:
            self.grant_requests[(h, request_id)] = lid
        if next_turn:
            more = data.draw(st.lists(st.integers(0, 2), max_size=6))
            self.do_read(conv, tokens + more, 0, 0.0, "")

    @rule(data=st.data(), n_ids=st.integers(0, 3), convs=st.lists(st.sampled_from(CONVS),
                                                                  max_size=2))
    def renew(self, data: Any, n_ids: int, convs: list[tuple[str, str]]) -> None:
        self.sync()
        known = list(self.leases)  # insertion order: ids are random, replays must match
        ids = [data.draw(st.sampled_from([*known, "l-unknown"])) for _ in range(n_ids)]
        self.do_renew(ids, convs)

    def do_renew(self, ids: list[str], convs: list[tuple[str, str]]) -> None:
        out = self.table.renew(ids, convs)
        assert len(out) == len(ids) + len(convs)
        targets = [self.leases.get(i) for i in ids]
        targets += [self.newest.get(c) for c in convs]
        names = ids + [""] * len(convs)
        now = self.now
        for r, lease, name in zip(out, targets, names, strict=True):
            if lease is None or lease.forgotten:
                assert (r.lease_id, r.renewed, r.state, r.expires_in) == (name, False, None, 0.0)
            elif lease.dead is None:
                lease.expire_at = min(now + lease.idle, lease.max_expire)
                assert r.lease_id == lease.lease_id and r.renewed
                assert r.expires_in == lease.expire_at - now
            else:
                assert r.lease_id == lease.lease_id and not r.renewed
                assert r.state is not LeaseState.ACTIVE and r.expires_in == 0.0

    @rule(data=st.data(), any_conv=st.sampled_from(CONVS), granted=st.booleans(),
          kind=st.sampled_from(["same", "same", "longer", "longer", "edited", "random",
                                "empty"]),
          min_tokens=st.sampled_from([0, 0, 4, 9, 100]),
          pin_ttl=st.sampled_from([0.0, 1.0, 3.0, 50.0]),
          request_id=st.sampled_from(["", "", "q0", "q1"]))
    def acquire_read(self, data: Any, any_conv: tuple[str, str], granted: bool, kind: str,
                     min_tokens: int, pin_ttl: float, request_id: str) -> None:
        self.sync()
        # mostly a conversation that had a grant, sometimes any
        conv = data.draw(st.sampled_from(sorted(self.newest))) if granted and self.newest \
            else any_conv
        newest = self.newest.get(conv)
        base = newest.tokens if newest else []
        tokens: list[int]
        if kind == "same":
            tokens = list(base)
        elif kind == "longer":
            tokens = base + data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=6))
        elif kind == "edited" and base:
            tokens = list(base)
            pos = data.draw(st.integers(0, len(base) - 1))
            tokens[pos] = 7
        elif kind == "random":
            tokens = data.draw(TOKENS)
        else:
            tokens = []
        self.do_read(conv, tokens, min_tokens, pin_ttl, request_id)

    def do_read(self, conv: tuple[str, str], tokens: list[int], min_tokens: int,
                pin_ttl: float, request_id: str) -> None:
        hashes = blockhash.block_hashes(tokens, BS, FP)
        lease, expect, k, partial = self.read_expectation(*conv, tokens)

        reusable = 0
        if lease is not None and expect is MissReason.HIT:
            full = len(lease.tokens) // BS
            reusable = k * BS + (len(lease.tokens) - full * BS if partial else 0)
            if reusable == 0:
                expect = MissReason.HASH_MISMATCH if full and hashes else MissReason.BELOW_MINIMUM
            elif reusable < min_tokens:
                expect = MissReason.BELOW_MINIMUM
        old_pin = self.pins.get(self.read_requests.get((conv[0], request_id), ""))
        conflict = (expect is MissReason.HIT and request_id and old_pin is not None
                    and old_pin.in_table and old_pin.lease_id != lease.lease_id)
        if conflict:
            with pytest.raises(IdempotencyConflict):
                self.table.acquire_read(*conv, hashes, min_tokens, pin_ttl, READER, request_id)
            return
        read = self.table.acquire_read(*conv, hashes, min_tokens, pin_ttl, READER, request_id)

        event(f"read: {read.miss.name}")
        if isinstance(expect, set):
            assert read.miss in expect, (read.miss, expect)
        else:
            assert read.miss is expect, (read.miss, expect)
        if read.miss is not MissReason.HIT:
            assert read.pin is None
            return
        # a hit: the conversation's newest granted lease, alive, never reported reclaimable
        assert lease is not None and read.lease is not None
        assert lease is self.newest[conv]
        assert read.lease.lease_id == lease.lease_id
        assert read.lease.epoch == lease.epoch
        assert not lease.superseded and lease.dead is None
        assert not self.holder_is_lost(lease.holder)
        assert lease.lease_id not in self.reported
        assert (read.matched_blocks, read.partial) == (k, partial)
        now = self.now
        lease.expire_at = min(now + lease.idle, lease.max_expire)
        assert read.lease.expire_at == lease.expire_at
        pin = read.pin
        assert pin is not None and pin.lease is read.lease
        if request_id and old_pin is not None and old_pin.in_table:
            assert pin.pin_id == self.read_requests[(conv[0], request_id)]  # the same pin, retried
            event("read: idempotent retry")
            return
        deadline = min(now + min(pin_ttl or CONFIG.default_pin_ttl_s, CONFIG.max_pin_ttl_s),
                       lease.max_expire + CONFIG.max_pin_ttl_s)
        assert pin.expire_at == deadline
        assert pin.pin_id not in self.pins or not self.pins[pin.pin_id].in_table
        self.pins[pin.pin_id] = MPin(lease.lease_id, deadline)
        if request_id:
            self.read_requests[(conv[0], request_id)] = pin.pin_id

    @rule(data=st.data())
    def release_read(self, data: Any) -> None:
        self.sync()
        pin_id = data.draw(st.sampled_from([*self.pins, "p-unknown"]))
        pin = self.pins.get(pin_id)
        released = self.table.release_read(pin_id)
        assert released is (pin is not None and pin.in_table)
        if pin is not None:
            pin.in_table = False

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), by=st.sampled_from(["own", "other", "operator"]))
    def revoke(self, data: Any, by: str) -> None:
        self.sync()
        lease = self.leases[data.draw(st.sampled_from(list(self.leases)))]
        holder = {"own": lease.holder, "operator": "",
                  "other": next(h for h in HOLDERS if h != lease.holder)}[by]
        if lease.forgotten:
            with pytest.raises(LeaseNotFound):
                self.table.revoke(lease.lease_id, holder)
            return
        if by == "other":
            with pytest.raises(NotLeaseHolder):
                self.table.revoke(lease.lease_id, holder)
            return
        got = self.table.revoke(lease.lease_id, holder, "test")
        assert got.lease_id == lease.lease_id and got.state is not LeaseState.ACTIVE
        self.kill(lease, MissReason.REVOKED)

    @rule(data=st.data(), h=st.sampled_from(HOLDERS), ack_alive=st.booleans(),
          ack_early=st.booleans())
    def heartbeat(self, data: Any, h: str, ack_alive: bool, ack_early: bool) -> None:
        self.sync()
        pending = list(self.holders[h].pending_acks)
        acks = data.draw(st.lists(st.sampled_from(pending), unique=True)) if pending else []
        alive = [x.lease_id for x in self.live() if x.holder == h and x.dead is None]
        bogus = [alive[0]] if ack_alive and alive else []  # acking an active lease: ignored
        # a dead lease the holder freed on its own hard deadline, before being told: the
        # registry forgets it only if nothing pins it
        dead = [x.lease_id for x in self.live() if x.holder == h and x.dead is not None
                and x.processed and x.lease_id not in self.holders[h].pending_acks]
        pinned = [x for x in dead if self.pins_in_table(x)]
        early = [data.draw(st.sampled_from(pinned or dead))] if ack_early and dead else []
        self.do_heartbeat(h, acks, bogus, early)

    def do_heartbeat(self, h: str, acks: Sequence[str], bogus: Sequence[str] = (),
                     early: Sequence[str] = ()) -> None:
        mh = self.holders[h]
        sent = [*acks, *bogus, *early]
        if self.holder_is_lost(h):
            with pytest.raises(HolderNotFound):
                self.table.heartbeat(h, sent)
            return
        ids, ttl = self.table.heartbeat(h, sent)
        assert ttl == HOLDER_TTL[h]
        mh.expire_at = self.now + ttl
        for lid in acks:
            self.leases[lid].forgotten = True
            event("lease acked and forgotten")
            del mh.pending_acks[lid]
        for lid in early:
            if self.pins_in_table(lid):
                event("early ack of a pinned lease: kept")
                assert lid not in ids
            else:
                self.leases[lid].forgotten = True
        assert not set(acks) & set(ids)
        self.check_reclaimable(h, ids)

    @rule(dt=STEPS, keepalive=st.booleans())
    def advance(self, dt: float, keepalive: bool) -> None:
        """Time passes; with `keepalive`, live holders heartbeat (acking all they were told)
        first, as engines do."""
        self.sync()
        if keepalive:  # engines heartbeat, the gateway renews the conversations
            for h in HOLDERS:
                if not self.holder_is_lost(h):
                    self.do_heartbeat(h, list(self.holders[h].pending_acks))
            self.do_renew([], list(CONVS))
        self.clock.advance(dt)
        self.sync()

    @rule(h=st.sampled_from(HOLDERS), come_back=st.booleans())
    def lose_holder(self, h: str, come_back: bool) -> None:
        """The holder stops heartbeating for its whole TTL (a pause, a partition); with
        `come_back` it re-registers at once, before anything else touched the table."""
        self.clock.advance(max(0.0, self.holders[h].expire_at - self.now))
        self.sync()
        assert self.holders[h].lost
        if come_back:
            self.do_register(h, set())

    @rule()
    def tick(self) -> None:
        self.sync()
        expired = self.table.tick()
        assert 0 <= expired <= CONFIG.expiry_batch
        for pin in self.pins.values():
            if pin.in_table and pin.deadline <= self.now:
                pin.in_table = False
        for h, mh in self.holders.items():
            if mh.lost:  # tick processes every due holder
                for lease in self.leases.values():
                    if lease.holder == h and lease.dead is not None:
                        lease.processed = True

    @rule(data=st.data(), h=st.sampled_from(HOLDERS))
    def reregister(self, data: Any, h: str) -> None:
        self.sync()
        mine = [x.lease_id for x in self.live() if x.holder == h]
        dropped = set(data.draw(st.lists(st.sampled_from(mine), unique=True))) if mine else set()
        self.do_register(h, dropped)

    def do_register(self, h: str, dropped: set[str]) -> None:
        """Re-register `h` listing every lease it still holds except `dropped`."""
        mine = [x.lease_id for x in self.live() if x.holder == h]
        listed = [x for x in mine if x not in dropped]
        now = self.now
        held = [Snapshot(lid, self.leases[lid].spec, self.leases[lid].epoch,
                         now - self.leases[lid].created) for lid in listed]
        was_lost = self.holder_is_lost(h)
        reg = self.table.register_holder(self.holder_spec(h), held)
        mh = self.holders[h]
        mh.lost, mh.expire_at = False, now + HOLDER_TTL[h]
        alive_listed = {x for x in listed if self.leases[x].dead is None}
        maybe = {x for x in listed if self.leases[x].by_deadline
                 and not self.leases[x].processed}
        if was_lost:
            assert reg.restored == []
        else:
            assert alive_listed <= set(reg.restored) <= alive_listed | maybe
        for lid in mine:
            lease = self.leases[lid]
            if lid in dropped:
                self.kill(lease, MissReason.REVOKED)
            elif was_lost and lease.dead is not None:
                lease.processed = True
        self.check_reclaimable(h, reg.reclaimable)

    @rule()
    def list_and_compare(self) -> None:
        """Listing refreshes every lease: then the table agrees with the model exactly."""
        self.sync()
        listed = {x.lease_id: x for x in self.table.leases(include_inactive=True)}
        assert set(listed) == {x.lease_id for x in self.live()}
        for lid, got in listed.items():
            lease = self.leases[lid]
            assert got.epoch == lease.epoch
            assert got.holder.holder_id == lease.holder
            if lease.dead is None:
                assert got.state is LeaseState.ACTIVE
                assert got.expire_at == lease.expire_at
            elif lease.superseded and got.state is LeaseState.SUPERSEDED:
                lease.processed = True
            else:
                assert got.state is not LeaseState.ACTIVE
                assert REASON_OF_STATE[got.state] in lease.dead
                lease.processed = True
        active = {x.lease_id for x in self.table.leases()}
        assert active == {x.lease_id for x in self.live() if x.dead is None}
        assert self.table.counts()["leases_active"] == len(active)

    @rule(data=st.data())
    def malformed_call(self, data: Any) -> None:
        """A malformed request raises InvalidArgument and changes nothing."""
        self.sync()
        live_holders = [h for h in HOLDERS if not self.holder_is_lost(h)]
        calls: dict[str, Any] = {
            "register bad id": lambda t: t.register_holder(HolderSpec("h 0", "x", 1, 1, BS, FP)),
            "register ttl": lambda t: t.register_holder(HolderSpec("h0", "x", 1, 1, BS, FP,
                                                                   math.nan)),
            "register held bad": lambda t: t.register_holder(self.holder_spec("h0"), [
                Snapshot("l-x", GrantSpec("h0", "t0", "c0", "rr", [1], 9, bytes(16)), 1, 0.0)]),
            "renew bad id": lambda t: t.renew(["bad id"]),
            "renew too many": lambda t: t.renew(["l-x"] * (CONFIG.max_batch + 1)),
            "revoke long reason": lambda t: t.revoke("l-x", "", "r" * 1025),
            "read bad hashes": lambda t: t.acquire_read("t0", "c0", bytes(17)),
            "read negative pin": lambda t: t.acquire_read("t0", "c0", b"", 0, -1.0),
            "read nan pin": lambda t: t.acquire_read("t0", "c0", b"", 0, math.nan),
            "read negative min": lambda t: t.acquire_read("t0", "c0", b"", -5),
            "read bad tenant": lambda t: t.acquire_read("", "c0", b""),
            "release empty": lambda t: t.release_read(""),
            "heartbeat too many acks": lambda t: t.heartbeat(
                "h0", ["l-x"] * (CONFIG.max_batch + 1)),
            "heartbeat bad id": lambda t: t.heartbeat("h\n0"),
            "list conversation only": lambda t: t.leases(conversation_id="c0"),
        }
        if live_holders:
            h = live_holders[0]
            calls.update({
                "grant token count": lambda t: t.grant(GrantSpec(
                    h, "t0", "c0", "rr", [1, 2], 4, lease_hashes([0] * 8))),
                "grant hashes": lambda t: t.grant(GrantSpec(
                    h, "t0", "c0", "rr", [1], 4, bytes(15))),
                "grant too many blocks": lambda t: t.grant(GrantSpec(
                    h, "t0", "c0", "rr", list(range(9)), 36, bytes(16 * 9))),
                "grant idle": lambda t: t.grant(GrantSpec(
                    h, "t0", "c0", "rr", [1], 4, lease_hashes([0] * 4), 30.0)),
                "grant lifetime": lambda t: t.grant(GrantSpec(
                    h, "t0", "c0", "rr", [1], 4, lease_hashes([0] * 4), 4.0, 2.0)),
                "grant bad tenant": lambda t: t.grant(GrantSpec(
                    h, "t 0", "c0", "rr", [1], 4, lease_hashes([0] * 4))),
                "grant bad request id": lambda t: t.grant(GrantSpec(
                    h, "t0", "c0", "rr", [1], 4, lease_hashes([0] * 4), 0.0, 0.0, "r\t")),
            })
        name = data.draw(st.sampled_from(sorted(calls)))

        def observe() -> Any:
            leases = [(x.lease_id, x.state, x.expire_at, x.pin_count, x.epoch)
                      for x in self.table.leases(include_inactive=True)]
            return self.table.counts(), leases, self.table.next_deadline()

        before = observe()
        with pytest.raises(InvalidArgument):
            calls[name](self.table)
        assert observe() == before, name

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def counts_are_consistent(self) -> None:
        counts = self.table.counts()
        live = self.live()
        assert counts["leases_total"] == len(live)
        assert counts["pins"] == sum(1 for p in self.pins.values() if p.in_table)
        alive = sum(1 for x in live if x.dead is None)
        unprocessed = sum(1 for x in live if x.dead is not None and x.by_deadline
                          and not x.processed)
        assert alive <= counts["leases_active"] <= alive + unprocessed
        live_holders = sum(1 for h in HOLDERS if not self.holder_is_lost(h))
        assert live_holders <= counts["holders"] <= len(HOLDERS)

    @invariant()
    def history_index_holds_only_active_leases_under_their_own_keys(self) -> None:
        entries = 0
        for tenant, index in self.table._history.items():
            assert index, "an empty tenant index is kept"
            entries += len(index)
            for key, lease in index.items():
                assert lease.tenant == tenant and lease.state is LeaseState.ACTIVE
                assert key in short_keys(lease.history)
        assert self.table.counts()["history_keys"] == entries

    @invariant()
    def live_pins_hold_their_leases(self) -> None:
        for pin in self.pins.values():
            if pin.in_table and pin.deadline > self.now:
                lease = self.leases[pin.lease_id]
                assert not lease.forgotten, "a lease was dropped under a live pin"


LeaseTableMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLeaseTableStateMachine = LeaseTableMachine.TestCase
