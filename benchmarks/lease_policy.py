"""`kvbridge bench lease-policy`: what leases save over a fixed TTL, on an agentic trace.

A trace-driven study through the real registry core (`LeaseTable`) on a fake clock. One decode
engine (the holder) with a memory budget in KV blocks serves agentic conversations: each starts
with a long prompt, then alternates turns (the context grows by a tool result or a user message
and the answer) with pauses that are either tool calls (the agent knows it is waiting, and can
send keepalives) or human think time (heavy-tailed: a coffee, a meeting, the end of the day),
and ends after a random number of turns.

Policies:
- ``fixed_ttl_480``: upstream vLLM's retention. After every turn decode keeps the blocks for a
  fixed 480 s; the first read-back frees them; nothing else can free them early, so when they
  fill the budget a new turn has to wait for memory (counted as ``stalled_turns``).
- ``lease_idle_N``: kvbridge leases with an idle TTL of N seconds; the client sends keepalives
  during tool calls (every N/2 s), releases the KV when the conversation ends, and decode
  revokes its oldest idle leases when a turn needs the memory (counted as
  ``lost_to_pressure`` when that conversation comes back).
- ``lease_idle_N_no_keepalive``: the same without keepalives, to show what they buy.

Measured per policy: retained block-seconds (idle conversations' blocks held over time), reuse
hit rate (turns 2+ that found their KV), peak retained blocks, turns that lost their KV to
memory pressure, and turns stalled for memory.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from kvbridge import blockhash, logs
from kvbridge.clock import FakeClock

BLOCK_SIZE = 64
FINGERPRINT = "lease-policy-study"
HOLDER = "decode-0"
HEARTBEAT_S = 10.0
FIXED_TTL_S = 480.0


@dataclass(frozen=True)
class TraceSpec:
    conversations: int = 600
    arrival_s: float = 4.0  # mean seconds between new conversations
    mean_turns: float = 8.0
    first_prompt: tuple[int, int] = (1500, 6000)  # tokens, uniform
    growth: tuple[int, int] = (100, 1500)  # tool result or user message per turn
    answer: tuple[int, int] = (50, 400)
    max_context: int = 32_768
    tool_fraction: float = 0.75  # pauses that are tool calls (the rest: human think time)
    tool_median_s: float = 6.0
    tool_sigma: float = 1.3  # lognormal: most tool calls take seconds, some minutes
    think_median_s: float = 45.0
    think_alpha: float = 1.1  # Pareto tail of human pauses
    think_cap_s: float = 4 * 3600.0
    turn_s: float = 3.0  # a turn's own duration (prefill + decode)
    seed: int = 0


@dataclass
class Turn:
    at: float  # when the turn arrives (seconds from the trace's start)
    context: int  # prompt tokens of this turn
    held: int  # tokens decode holds after it: the prompt and the answer
    pause_kind: str  # what follows this turn: "tool", "think" or "end"
    pause_s: float


@dataclass
class Conversation:
    cid: str
    turns: list[Turn]


def make_trace(spec: TraceSpec) -> list[Conversation]:
    rng = random.Random(spec.seed)
    out = []
    t = 0.0
    for i in range(spec.conversations):
        t += rng.expovariate(1.0 / spec.arrival_s)
        n_turns = 1 + min(int(rng.expovariate(1.0 / (spec.mean_turns - 1))), 60)
        context = rng.randint(*spec.first_prompt)
        at = t
        turns = []
        for k in range(n_turns):
            held = context + rng.randint(*spec.answer)
            last = k == n_turns - 1 or held + spec.growth[1] + spec.answer[1] > spec.max_context
            if last:
                turns.append(Turn(at, context, held, "end", 0.0))
                break
            if rng.random() < spec.tool_fraction:
                kind, pause = "tool", rng.lognormvariate(math.log(spec.tool_median_s),
                                                         spec.tool_sigma)
            else:
                kind = "think"
                pause = min(spec.think_median_s * (2 ** (1 / spec.think_alpha))
                            * rng.paretovariate(spec.think_alpha) / 2, spec.think_cap_s)
            turns.append(Turn(at, context, held, kind, pause))
            at += spec.turn_s + pause
            context = held + rng.randint(*spec.growth)
        out.append(Conversation(f"conv-{i}", turns))
    return out


@dataclass(frozen=True)
class Policy:
    name: str
    idle_ttl_s: float
    keepalive: bool
    release_at_end: bool
    revoke_under_pressure: bool
    free_on_read: bool  # upstream: the first read-back frees decode's copy


def policies(idle_ttls: tuple[float, ...]) -> list[Policy]:
    out = [Policy("fixed_ttl_480", FIXED_TTL_S, False, False, False, True)]
    for ttl in idle_ttls:
        out.append(Policy(f"lease_idle_{ttl:g}", ttl, True, True, True, False))
    for ttl in idle_ttls[:1]:
        out.append(Policy(f"lease_idle_{ttl:g}_no_keepalive", ttl, False, True, True, False))
    return out


@dataclass
class Result:
    block_seconds: float = 0.0
    hits: int = 0
    reuse_turns: int = 0
    peak_blocks: int = 0
    lost_to_pressure: int = 0
    stalled_turns: int = 0
    keepalives: int = 0
    revoked: int = 0
    expired_leases: int = 0
    turns: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"block_seconds": round(self.block_seconds), "hit_rate":
                round(self.hits / self.reuse_turns, 4) if self.reuse_turns else 0.0,
                "peak_blocks": self.peak_blocks, "lost_to_pressure": self.lost_to_pressure,
                "stalled_turns": self.stalled_turns, "keepalives": self.keepalives,
                "revoked": self.revoked, "turns": self.turns}


class Chains:
    """Each conversation's tokens and chained block hashes, made once and shared by every
    policy: a prefix's hashes are a prefix of the whole conversation's."""

    def __init__(self, trace: list[Conversation]) -> None:
        self._tokens: dict[int, list[int]] = {}
        self._chains: dict[int, bytes] = {}
        for ci, conv in enumerate(trace):
            rng = random.Random(f"tokens-{ci}")
            tokens = [rng.randrange(10, 50_000) for _ in range(conv.turns[-1].held)]
            self._tokens[ci] = tokens
            self._chains[ci] = blockhash.block_hashes(tokens, BLOCK_SIZE, FINGERPRINT)

    def hashes(self, ci: int, n: int, *, include_partial: bool = False) -> bytes:
        full = self._chains[ci][: (n // BLOCK_SIZE) * blockhash.HASH_SIZE]
        if include_partial and n % BLOCK_SIZE:
            partial = blockhash.partial_block_hash(self._tokens[ci], n, BLOCK_SIZE, FINGERPRINT,
                                                   full_hashes=full)
            assert partial is not None
            return full + partial
        return full


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    kind: str = field(compare=False)  # "turn", "done", "keepalive"
    conv: int = field(compare=False)
    index: int = field(compare=False)


class Simulation:
    """One policy over one trace, through the registry's LeaseTable on a fake clock."""

    def __init__(self, policy: Policy, trace: list[Conversation], budget_blocks: int,
                 spec: TraceSpec, chains: Chains) -> None:
        from kvbridge.services.registry._config import RegistryConfig
        from kvbridge.services.registry._core import HolderSpec, LeaseTable
        from kvbridge.services.registry._model import EventType

        self.policy, self.trace, self.budget, self.spec = policy, trace, budget_blocks, spec
        self.chains = chains
        self.clock = FakeClock(start=0.0)
        self.table = LeaseTable(RegistryConfig(max_holder_ttl_s=300.0), self.clock,
                                recovering=False)
        self.table.register_holder(HolderSpec(HOLDER, "127.0.0.1", 1, 1, BLOCK_SIZE,
                                              FINGERPRINT, ttl=60.0))
        self._reclaimable_event = EventType.RECLAIMABLE
        self._expired_event = EventType.EXPIRED
        self.table.add_listener(self._on_event)
        self.result = Result()
        self.retained: dict[str, int] = {}  # lease id -> blocks decode still holds for it
        self.retained_blocks = 0
        self.active_blocks = 0  # running turns
        self.last_change = 0.0
        self.lease_of: dict[int, str] = {}
        self.idle_since: dict[str, float] = {}
        self.revoked_convs: set[int] = set()
        self._owner: dict[str, int] = {}  # lease id -> conversation
        self._reclaimed: list[str] = []  # freed by decode since its last heartbeat
        self._next_heartbeat = HEARTBEAT_S

    # ---- accounting -----------------------------------------------------------------------

    def _account(self) -> None:
        now = self.clock.monotonic()
        self.result.block_seconds += self.retained_blocks * (now - self.last_change)
        self.last_change = now

    def _on_event(self, event: Any) -> None:
        if event.type is self._expired_event:
            self.result.expired_leases += 1
        if event.type is not self._reclaimable_event:
            return
        lease_id = event.lease_id
        blocks = self.retained.pop(lease_id, None)
        if blocks is not None:  # decode frees the blocks (acked with the next heartbeat)
            self._account()
            self.retained_blocks -= blocks
            self.idle_since.pop(lease_id, None)
            self._reclaimed.append(lease_id)

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> Result:
        events = [_Event(conv.turns[0].at, ci, "turn", ci, 0)
                  for ci, conv in enumerate(self.trace)]
        heapq.heapify(events)
        seq = len(events)
        while events:
            event = heapq.heappop(events)
            self._advance_to(event.at)
            for at, kind, index in self._handle(event):
                seq += 1
                heapq.heappush(events, _Event(at, seq, kind, event.conv, index))
        # Let whatever is still retained run out.
        self._advance_to(self.clock.monotonic() + 2 * FIXED_TTL_S + 60)
        self._account()
        return self.result

    def _advance_to(self, at: float) -> None:
        """Move the clock to `at`, firing the registry's deadlines and decode's heartbeats
        (which acknowledge the blocks it freed) on the way."""
        while True:
            now = self.clock.monotonic()
            due = self.table.next_deadline()
            step = min(at, self._next_heartbeat)
            if due is not None and now < due < step:
                step = due
            self.clock.advance(max(step - now, 0.0))
            self.table.tick()
            if self.clock.monotonic() >= self._next_heartbeat:
                self.table.heartbeat(HOLDER, self._reclaimed)
                self._reclaimed = []
                self._next_heartbeat += HEARTBEAT_S
            if self.clock.monotonic() >= at:
                return

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE)

    def _handle(self, event: _Event) -> list[tuple[float, str, int]]:
        conv = self.trace[event.conv]
        turn = conv.turns[event.index]
        now = self.clock.monotonic()
        if event.kind == "keepalive":
            lease_id = self.lease_of.get(event.conv)
            if lease_id is None:
                return []
            self.table.renew([lease_id])
            self.result.keepalives += 1
            return []
        if event.kind == "turn":
            return self._turn_starts(event.conv, event.index, conv, turn)
        # "done": the turn ends; decode keeps the blocks under a new lease.
        return self._turn_done(event.conv, event.index, conv, turn, now)

    def _turn_starts(self, ci: int, index: int, conv: Conversation, turn: Turn
                     ) -> list[tuple[float, str, int]]:
        self.result.turns += 1
        if index > 0:
            self.result.reuse_turns += 1
            hashes = self.chains.hashes(ci, turn.context)
            read = self.table.acquire_read("tenant", conv.cid, hashes, min_tokens=BLOCK_SIZE,
                                           pin_ttl=5.0)
            if read.pin is not None:
                self.result.hits += 1
                self.table.release_read(read.pin.pin_id)
                if self.policy.free_on_read and read.lease is not None:
                    self._revoke(read.lease.lease_id, "read back")
            elif ci in self.revoked_convs:
                self.result.lost_to_pressure += 1
            self.revoked_convs.discard(ci)
        lease_id = self.lease_of.get(ci)
        if lease_id is not None:
            self.idle_since.pop(lease_id, None)  # in use by this turn again
        need = self._blocks(turn.held)
        self._make_room(need)
        self.active_blocks += need
        return [(self.clock.monotonic() + self.spec.turn_s, "done", index)]

    def _turn_done(self, ci: int, index: int, conv: Conversation, turn: Turn, now: float
                   ) -> list[tuple[float, str, int]]:
        from kvbridge.services.registry._core import GrantSpec

        blocks = self._blocks(turn.held)
        self.active_blocks -= blocks
        if turn.pause_kind == "end" and self.policy.release_at_end:
            lease_id = self.lease_of.pop(ci, None)
            if lease_id is not None:
                self._revoke(lease_id, "conversation ended")
            return []
        # Decode keeps this turn's blocks (prompt and answer) under a new lease.
        nxt = conv.turns[index + 1] if index + 1 < len(conv.turns) else None
        held_tokens = turn.held
        grant = self.table.grant(GrantSpec(
            HOLDER, "tenant", conv.cid, f"{conv.cid}-{index}", list(range(blocks)),
            held_tokens, self.chains.hashes(ci, held_tokens, include_partial=True),
            idle_ttl=self.policy.idle_ttl_s, max_lifetime=max(self.policy.idle_ttl_s, 86400.0)
            if not self.policy.free_on_read else self.policy.idle_ttl_s))
        self._account()
        self.retained[grant.lease.lease_id] = blocks
        self.retained_blocks += blocks
        self.result.peak_blocks = max(self.result.peak_blocks, self.retained_blocks)
        self.lease_of[ci] = grant.lease.lease_id
        self.idle_since[grant.lease.lease_id] = now
        self._owner[grant.lease.lease_id] = ci
        out: list[tuple[float, str, int]] = []
        if nxt is not None:
            out.append((nxt.at, "turn", index + 1))
            if turn.pause_kind == "tool" and self.policy.keepalive:
                at = now + self.policy.idle_ttl_s / 2
                while at < nxt.at:
                    out.append((at, "keepalive", index))
                    at += self.policy.idle_ttl_s / 2
        return out

    def _make_room(self, need: int) -> None:
        """A turn needs `need` blocks: revoke the oldest idle leases (kvbridge), or stall."""
        if self.retained_blocks + self.active_blocks + need <= self.budget:
            return
        if not self.policy.revoke_under_pressure:
            self.result.stalled_turns += 1
            return
        for lease_id, _ in sorted(self.idle_since.items(), key=lambda kv: kv[1]):
            if self.retained_blocks + self.active_blocks + need <= self.budget:
                break
            self._revoke(lease_id, "memory pressure")
            self.result.revoked += 1
            ci = self._owner.get(lease_id)
            if ci is not None:
                self.revoked_convs.add(ci)

    def _revoke(self, lease_id: str, reason: str) -> None:
        from kvbridge.errors import LeaseNotFound

        with contextlib.suppress(LeaseNotFound):  # expired and freed already
            self.table.revoke(lease_id, HOLDER, reason)



# ---- the command ------------------------------------------------------------------------------


def run_study(spec: TraceSpec, budget_blocks: int, idle_ttls: tuple[float, ...]
              ) -> dict[str, dict[str, Any]]:
    trace = make_trace(spec)
    chains = Chains(trace)
    return {policy.name: Simulation(policy, trace, budget_blocks, spec, chains).run().as_json()
            for policy in policies(idle_ttls)}


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        marker = "s" if name.startswith("fixed") else ("x" if "no_keepalive" in name else "o")
        ax.scatter(r["block_seconds"] / 1e6, r["hit_rate"] * 100, marker=marker, s=60)
        ax.annotate(name, (r["block_seconds"] / 1e6, r["hit_rate"] * 100),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("retained KV (million block-seconds)")
    ax.set_ylabel("reuse hit rate, turns 2+ (%)")
    ax.set_title("Hit rate against retained memory, per retention policy")
    ax.margins(x=0.2, y=0.1)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _floats(value: str) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated seconds, got {value!r}") from exc
    if not out or min(out) < 1 or max(out) > 3600:
        raise click.BadParameter("idle TTLs must be between 1 and 3600 seconds")
    return out


@click.command("lease-policy")
@click.option("--conversations", default=600, show_default=True, type=click.IntRange(min=1),
              help="conversations in the generated agentic trace")
@click.option("--arrival-s", default=4.0, show_default=True, type=click.FloatRange(min=0.01),
              help="mean seconds between new conversations")
@click.option("--budget-blocks", default=32768, show_default=True, type=click.IntRange(min=1),
              help=f"decode KV memory, in blocks of {BLOCK_SIZE} tokens")
@click.option("--idle-ttls", default="60,120,240,480", show_default=True,
              help="kvbridge idle TTLs to compare (seconds, comma-separated)")
@click.option("--seed", default=0, show_default=True, type=int,
              help="seed of the trace: the same seed gives the same figures")
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False),
              default=None, help="write results.json and lease_policy.png here")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def lease_policy_bench(conversations: int, arrival_s: float, budget_blocks: int,
                       idle_ttls: str, seed: int, out_dir: Path | None, as_json: bool) -> None:
    """Trace-driven study: upstream's fixed 480 s TTL against kvbridge leases (idle TTL,
    keepalive in tool calls, release at the end, revoke under memory pressure), through the
    registry core on a fake clock. Prints block-seconds, hit rate and peak blocks per policy."""
    logs.configure("warning")  # the registry core logs every lease at info: noise here
    spec = TraceSpec(conversations=conversations, arrival_s=arrival_s, seed=seed)
    results = run_study(spec, budget_blocks, _floats(idle_ttls))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        plot(results, out_dir / "lease_policy.png")
    if as_json:
        click.echo(json.dumps(results))
        return
    base = results["fixed_ttl_480"]
    click.echo(f"{conversations} conversations, one decode with {budget_blocks} blocks of "
               f"{BLOCK_SIZE} tokens")
    click.echo(f"{'policy':<28} {'block-s':>12} {'vs fixed':>8} {'hit rate':>8} "
               f"{'peak blk':>9} {'lost':>5} {'stalled':>7}")
    for name, r in results.items():
        ratio = r["block_seconds"] / base["block_seconds"] if base["block_seconds"] else 0.0
        click.echo(f"{name:<28} {r['block_seconds']:>12,} {ratio:>8.2f} "
                   f"{r['hit_rate'] * 100:>7.1f}% {r['peak_blocks']:>9,} "
                   f"{r['lost_to_pressure']:>5} {r['stalled_turns']:>7}")
