"""`kvbridge bench soak`: the control plane under a long, churning load, checked for lost leases.

A real registry runs in a process of its own. This process plays a fleet: decode engines
(`HolderSession`, the connector's own holder code, over gRPC) that keep "blocks" for the
conversations they serve, and prefill readers that pin and release them. About `--conversations`
conversations are live at any time; each takes turns with think times between them (some long
enough to need a client keepalive), then ends (the client deletes it: revoke) or is abandoned
(its idle TTL expires). Holders churn: one at a time stops heartbeating past its TTL, the
registry declares it lost, and it re-registers with the leases it still holds.

Checked all along and at the end:
- wrong reads: a pin granted on a lease whose holder no longer holds the blocks (must be 0);
- leases lost: leases a holder still held when the run ended that the registry no longer
  counts as active, freed only by the holder's own hard deadline, or active in the registry
  without a holder keeping them (must be 0);
- reconciled: leases a re-registering holder re-sent, and how many the registry restored or
  told it to free;
- the registry's resident memory over time.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from kvbridge import blockhash
from kvbridge.benchmarks.registry_bench import _spawn
from kvbridge.clients import GrantOutcomeUnknown, HolderSession, RegistryClient
from kvbridge.errors import KvbridgeError
from kvbridge.registry.v1 import registry_pb2 as pb

BLOCK = 16
FINGERPRINT = "soak-fingerprint"
TENANT = "soak"


class _CountingClient(RegistryClient):
    """The holders' client: counts what re-registrations re-sent and got back."""

    def __init__(self, *args: Any, stats: Stats, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats = stats

    def register_holder(self, *args: Any, **kwargs: Any) -> pb.RegisterHolderResponse:
        resp = super().register_holder(*args, **kwargs)
        held = len(kwargs.get("held_leases") or ())
        if held:
            with self.stats.lock:
                self.stats.resent += held
                self.stats.restored += len(resp.restored_lease_ids)
                self.stats.told_to_free += len(resp.reclaimable_lease_ids)
        return resp


@dataclass
class Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)
    turns: int = 0
    grants: int = 0
    grant_failures: int = 0
    grants_unknown: int = 0  # timed out: blocks kept until the session settles them
    reads: int = 0
    read_hits: int = 0
    read_misses: dict[str, int] = field(default_factory=dict)
    wrong_reads: int = 0
    renewals: int = 0
    ended: int = 0
    abandoned: int = 0
    churns: int = 0
    resent: int = 0
    restored: int = 0
    told_to_free: int = 0
    freed: dict[str, int] = field(default_factory=dict)
    errors: int = 0


class FakeEngine:
    """A decode engine's memory as the soak sees it: lease id -> blocks kept."""

    def __init__(self, holder_id: str, target: str, stats: Stats, holder_ttl: float) -> None:
        self.holder_id = holder_id
        self.stats = stats
        self.kept: dict[str, int] = {}
        self.lock = threading.Lock()
        self.paused_until = 0.0
        self.client = _CountingClient(target, timeout=2.0, retries=1, stats=stats)
        self.session = _PausableSession(
            self, self.client, holder_id=holder_id, nixl_host="127.0.0.1", nixl_port=5600,
            block_size=BLOCK, engine_fingerprint=FINGERPRINT, on_reclaim=self.free,
            ttl=holder_ttl, hard_deadline_margin=5.0, on_grant_resolved=self.settled)
        self._unsettled: dict[str, str] = {}  # grant request id -> the lease id it may have

    def unsettled(self, unknown: GrantOutcomeUnknown, blocks: int) -> None:
        """A grant of unknown outcome: keep its blocks under the only id its lease can have."""
        with self.lock:
            self.kept[unknown.lease_id] = blocks
            self._unsettled[unknown.request_id] = unknown.lease_id

    def settled(self, request_id: str, lease: Any) -> None:
        with self.lock:
            lease_id = self._unsettled.pop(request_id, "")
            if lease is None:
                self.kept.pop(lease_id, None)
        if lease is None:
            with self.stats.lock:
                self.stats.freed["unsettled"] = self.stats.freed.get("unsettled", 0) + 1

    def free(self, lease_ids: list[str]) -> None:
        why = "hard_deadline" if any(self.session.due(lid) for lid in lease_ids) else "notice"
        with self.lock:
            for lid in lease_ids:
                self.kept.pop(lid, None)
        with self.stats.lock:
            self.stats.freed[why] = self.stats.freed.get(why, 0) + len(lease_ids)

    def holds(self, lease_id: str) -> bool:
        with self.lock:
            return lease_id in self.kept


class _PausableSession(HolderSession):
    """A holder session whose heartbeats can be starved (churn), as a stalled engine's are."""

    def __init__(self, engine: FakeEngine, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = engine

    def heartbeat_once(self) -> None:
        if time.monotonic() < self.engine.paused_until:
            return
        super().heartbeat_once()

    def due(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._held.get(lease_id)
        return lease is not None and lease.hard_deadline <= self.clock.monotonic()


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    conversation: int = field(compare=False)
    kind: str = field(compare=False)  # "turn" | "keepalive"


@dataclass
class _Conversation:
    name: str
    engine: FakeEngine
    turns_left: int
    tokens: list[int] = field(default_factory=list)
    lease_id: str = ""


class Soak:
    def __init__(self, target: str, *, conversations: int, holders: int, idle_ttl: float,
                 holder_ttl: float, churn_every: float, think_s: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.stats = Stats()
        self.idle_ttl = idle_ttl
        self.holder_ttl = holder_ttl
        self.churn_every = churn_every
        self.think_s = think_s
        self.engines = [FakeEngine(f"soak-decode-{i}", target, self.stats, holder_ttl)
                        for i in range(holders)]
        self.reader = RegistryClient(target, timeout=2.0, retries=1)
        self.live: dict[int, _Conversation] = {}
        self.events: list[_Event] = []
        self._seq = 0
        self._next_id = 0
        self.target_live = conversations

    # ---- scheduling ------------------------------------------------------------------------

    def _at(self, when: float, conversation: int, kind: str) -> None:
        self._seq += 1
        heapq.heappush(self.events, _Event(when, self._seq, conversation, kind))

    def _think(self) -> float:
        """Think time between turns: mostly short, a heavy tail of long pauses (tool calls,
        a person reading)."""
        return min(self.rng.lognormvariate(math.log(self.think_s), 1.0), 20 * self.think_s)

    def _start(self, now: float) -> None:
        cid = self._next_id
        self._next_id += 1
        engine = self.rng.choice(self.engines)
        self.live[cid] = _Conversation(f"conv-{cid}", engine,
                                       turns_left=1 + int(self.rng.expovariate(1 / 6)))
        self._at(now + self.rng.uniform(0, self.think_s), cid, "turn")

    # ---- what happens ----------------------------------------------------------------------

    def _turn(self, cid: int, now: float) -> None:
        conv = self.live[cid]
        stats = self.stats
        stats.turns += 1
        new = [self.rng.randrange(1, 50_000) for _ in range(self.rng.randrange(20, 200))]
        prompt = conv.tokens + new
        if conv.lease_id:  # the prefill reads the history back under a pin
            stats.reads += 1
            try:
                read = self.reader.acquire_read(
                    TENANT, conv.name, blockhash.block_hashes(prompt, BLOCK, FINGERPRINT),
                    min_tokens=1, pin_ttl=5.0, reader_id="soak-prefill")
            except KvbridgeError:
                stats.errors += 1
            else:
                if read.pin.pin_id:
                    stats.read_hits += 1
                    holder = next(e for e in self.engines
                                  if e.holder_id == read.holder.holder_id)
                    if not holder.holds(read.lease.lease_id):
                        stats.wrong_reads += 1
                    self.reader.release_read(read.pin.pin_id)
                else:
                    reason = pb.MissReason.Name(read.miss_reason).removeprefix("MISS_REASON_")
                    stats.read_misses[reason] = stats.read_misses.get(reason, 0) + 1
        # Decode generates an answer and keeps the whole sequence under a new lease.
        conv.tokens = prompt + [self.rng.randrange(1, 50_000) for _ in range(16)]
        engine = conv.engine
        n = -(-len(conv.tokens) // BLOCK)
        try:
            lease = engine.session.grant(
                TENANT, conv.name, f"kvbridge-soak-{cid}-{stats.turns}", list(range(1, n + 1)),
                len(conv.tokens), blockhash.block_hashes(conv.tokens, BLOCK, FINGERPRINT,
                                                         include_partial=True),
                idle_ttl=self.idle_ttl, max_lifetime=3600.0, timeout=2.0)
        except GrantOutcomeUnknown as unknown:  # kept under the only id its lease can have
            stats.grants_unknown += 1
            engine.unsettled(unknown, n)
            conv.lease_id = unknown.lease_id
        else:
            if lease is None:
                stats.grant_failures += 1
                conv.lease_id = ""
            else:
                stats.grants += 1
                with engine.lock:
                    engine.kept[lease.lease_id] = n
                conv.lease_id = lease.lease_id
        conv.turns_left -= 1
        if conv.turns_left > 0:
            pause = self._think()
            if pause > 0.8 * self.idle_ttl:  # a long tool call: the client keeps it alive
                self._at(now + 0.5 * self.idle_ttl, cid, "keepalive")
            self._at(now + pause, cid, "turn")
            return
        # The conversation is over: the client deletes it, or walks away.
        del self.live[cid]
        if self.rng.random() < 0.5 and conv.lease_id:
            try:
                self.reader.revoke_lease(conv.lease_id, "conversation_ended")
                stats.ended += 1
            except KvbridgeError:
                stats.errors += 1
        else:
            stats.abandoned += 1
        self._start(now)

    def _keepalive(self, cid: int, now: float) -> None:
        conv = self.live.get(cid)
        if conv is None:
            return
        try:
            self.reader.renew_leases(conversations=[(TENANT, conv.name)])
            self.stats.renewals += 1
        except KvbridgeError:
            self.stats.errors += 1
        next_turn = min((e.at for e in self.events
                         if e.conversation == cid and e.kind == "turn"), default=now)
        if next_turn - now > 0.5 * self.idle_ttl:
            self._at(now + 0.5 * self.idle_ttl, cid, "keepalive")

    # ---- the run ---------------------------------------------------------------------------

    def run(self, seconds: float, on_tick: Callable[[float], None]) -> None:
        for engine in self.engines:
            engine.session.start()
        start = time.monotonic()
        for _ in range(self.target_live):
            self._start(start)
        next_churn = start + self.churn_every
        next_tick = start
        while True:
            now = time.monotonic()
            if now - start >= seconds:
                break
            if now >= next_tick:
                on_tick(now - start)
                next_tick += 5.0
            if self.churn_every and now >= next_churn:
                # A holder stalls past its TTL: the registry declares it lost; when it comes
                # back it re-registers with what it still holds.
                victim = self.rng.choice(self.engines)
                victim.paused_until = now + self.holder_ttl * 1.5
                self.stats.churns += 1
                next_churn += self.churn_every
            if not self.events or self.events[0].at > now:
                time.sleep(0.001)
                continue
            event = heapq.heappop(self.events)
            if event.conversation not in self.live:
                continue
            if event.kind == "turn":
                self._turn(event.conversation, now)
            else:
                self._keepalive(event.conversation, now)

    def finish(self, settle_s: float) -> dict[str, Any]:
        """End every conversation, let the registry tell holders to free, and audit."""
        for conv in list(self.live.values()):
            if conv.lease_id:
                try:
                    self.reader.revoke_lease(conv.lease_id, "soak_over")
                except KvbridgeError:
                    self.stats.errors += 1
        self.live.clear()
        for engine in self.engines:
            engine.paused_until = 0.0
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            for engine in self.engines:
                engine.session.heartbeat_once()
            if not any(engine.kept for engine in self.engines):
                break
            time.sleep(0.2)
        active = {lease.lease_id: lease.holder_id
                  for lease in self.reader.iter_leases(tenant=TENANT)}
        kept = {lid: engine for engine in self.engines for lid in engine.kept}
        # Held but the registry has forgotten it (never told the holder): memory leaked on
        # decode until the hard deadline. Active but nobody keeps it: a read would be wrong.
        forgotten = [lid for lid in kept if lid not in active]
        orphaned = [lid for lid in active if lid not in kept]
        lost = len(forgotten) + len(orphaned) + self.stats.freed.get("hard_deadline", 0)
        for engine in self.engines:
            engine.session.close()
            engine.client.close()
        self.reader.close()
        return {"leases_lost": lost, "leases_forgotten": len(forgotten),
                "leases_orphaned": len(orphaned), "still_held": len(kept),
                "registry_active_at_end": len(active)}


@click.command("soak")
@click.option("--minutes", default=10.0, show_default=True, type=click.FloatRange(min=0.1),
              help="how long to run the load")
@click.option("--conversations", default=1000, show_default=True,
              type=click.IntRange(min=1), help="conversations live at any time")
@click.option("--holders", default=8, show_default=True, type=click.IntRange(min=1),
              help="decode engines (holders)")
@click.option("--think-s", default=4.0, show_default=True, type=click.FloatRange(min=0.05),
              help="median think time between a conversation's turns (heavy-tailed)")
@click.option("--idle-ttl-s", default=6.0, show_default=True, type=click.FloatRange(min=1),
              help="lease idle TTL (abandoned conversations expire after it)")
@click.option("--holder-ttl-s", default=3.0, show_default=True,
              type=click.FloatRange(min=1), help="holder heartbeat TTL")
@click.option("--churn-every-s", default=15.0, show_default=True,
              type=click.FloatRange(min=0), help="stall one holder past its TTL this often "
                                                 "(0: never)")
@click.option("--seed", default=0, show_default=True, type=int,
              help="seed of the load's random choices (think times, turns, tokens, which "
                   "conversations end or are abandoned, which holder stalls)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object at the end")
def soak_bench(minutes: float, conversations: int, holders: int, think_s: float,
               idle_ttl_s: float, holder_ttl_s: float, churn_every_s: float, seed: int,
               as_json: bool) -> None:
    """Run the control plane under churn for N minutes; print resident memory over time, leases
    lost (must be 0), wrong reads (must be 0) and reconciled counts."""

    def log(msg: str) -> None:
        click.echo(msg, err=True)

    # Readers pin for 5 s at most here, so the registry's start-up hold on reclaims (it cannot
    # tell a first start from a restart that lost pins) lasts 6 s rather than the default 31.
    registry = _spawn([sys.executable, "-m", "kvbridge.cli", "registry", "serve", "--insecure",
                       "--listen", "127.0.0.1:0", "--metrics-listen", "",
                       "--log-level", "info", "--log-format", "json",
                       "--default-pin-ttl-s", "5", "--max-pin-ttl-s", "5",
                       "--recovery-grace-s", "6"])
    assert registry.popen.stdout is not None
    threading.Thread(target=registry.popen.stdout.read, daemon=True).start()
    rss: list[tuple[float, float]] = []
    try:
        soak = Soak(f"127.0.0.1:{registry.port}", conversations=conversations,
                    holders=holders, idle_ttl=idle_ttl_s, holder_ttl=holder_ttl_s,
                    churn_every=churn_every_s, think_s=think_s, seed=seed)

        def tick(elapsed: float) -> None:
            mb = registry.rss_bytes() / 2**20
            rss.append((round(elapsed, 1), round(mb, 1)))
            s = soak.stats
            log(f"  t={elapsed:6.1f}s rss {mb:6.1f} MB, {s.turns} turns, {s.read_hits}/"
                f"{s.reads} reads hit, {s.grants} grants, {s.churns} churns, wrong reads "
                f"{s.wrong_reads}")

        soak.run(minutes * 60, tick)
        audit = soak.finish(settle_s=max(3 * holder_ttl_s, idle_ttl_s) + 10)
        if registry.popen.poll() is not None:
            raise click.ClickException("the registry died during the soak")
        rss_end = registry.rss_bytes() / 2**20
    finally:
        registry.stop()
    s = soak.stats
    result = {
        **audit, "wrong_reads": s.wrong_reads, "minutes": minutes,
        "conversations_live": conversations, "holders": holders, "turns": s.turns,
        "grants": s.grants, "grant_failures": s.grant_failures,
        "grants_outcome_unknown": s.grants_unknown, "reads": s.reads,
        "read_hits": s.read_hits, "read_misses": s.read_misses, "renewals": s.renewals,
        "conversations_ended": s.ended, "conversations_abandoned": s.abandoned,
        "holder_churns": s.churns, "reconciled_resent": s.resent,
        "reconciled_restored": s.restored, "reconciled_told_to_free": s.told_to_free,
        "freed": s.freed, "errors": s.errors,
        "rss_start_mb": rss[0][1] if rss else round(rss_end, 1),
        "rss_end_mb": round(rss_end, 1), "rss_mb_over_time": rss,
    }
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
    else:
        for key, value in result.items():
            if key != "rss_mb_over_time":
                click.echo(f"{key:<26} {value}")
    if result["leases_lost"] or result["wrong_reads"]:
        raise click.ClickException(f"leases lost: {result['leases_lost']}, wrong reads: "
                                   f"{result['wrong_reads']}")
