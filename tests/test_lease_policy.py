"""The lease-policy study: hand-made traces whose outcome is known, through the real registry
core on a fake clock, and the command's JSON."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvbridge.benchmarks.lease_policy import (
    Chains,
    Conversation,
    Policy,
    Simulation,
    TraceSpec,
    Turn,
    lease_policy_bench,
    make_trace,
    policies,
)

FIXED = Policy("fixed_ttl_480", 480.0, False, False, False, True)


def lease(ttl: float, keepalive: bool = True) -> Policy:
    return Policy(f"lease_idle_{ttl:g}", ttl, keepalive, True, True, False)


def two_turns(pause_kind: str, pause: float) -> list[Conversation]:
    """Turn 0 holds 640 tokens (10 blocks of 64), pauses, turn 1 holds 768 (12) and ends."""
    spec = TraceSpec()
    return [Conversation("c0", [Turn(0.0, 600, 640, pause_kind, pause),
                                Turn(spec.turn_s + pause, 700, 768, "end", 0.0)])]


def simulate(policy: Policy, trace: list[Conversation], budget: int = 10_000) -> dict:
    return Simulation(policy, trace, budget, TraceSpec(), Chains(trace)).run().as_json()


def test_fixed_ttl_keeps_until_read_back_and_then_480s_after_the_last_turn() -> None:
    r = simulate(FIXED, two_turns("think", 100.0))
    # 10 blocks from turn 0's end (t=3) to the read-back (t=103), then 12 blocks for 480 s.
    assert r["block_seconds"] == pytest.approx(10 * 100 + 12 * 480, abs=1)
    assert r["hit_rate"] == 1.0 and r["peak_blocks"] == 12


def test_idle_ttl_shorter_than_a_human_pause_misses_and_frees_early() -> None:
    r = simulate(lease(60), two_turns("think", 100.0))
    assert r["hit_rate"] == 0.0
    assert r["block_seconds"] == pytest.approx(10 * 60, abs=1)


def test_keepalive_carries_a_lease_through_a_long_tool_call() -> None:
    with_keepalive = simulate(lease(60), two_turns("tool", 100.0))
    assert with_keepalive["hit_rate"] == 1.0 and with_keepalive["keepalives"] >= 3
    # Kept from t=3 until the conversation ends (t=106) and the client releases it.
    assert with_keepalive["block_seconds"] == pytest.approx(10 * 103, abs=1)
    without = simulate(lease(60, keepalive=False), two_turns("tool", 100.0))
    assert without["hit_rate"] == 0.0 and without["keepalives"] == 0


def test_memory_pressure_revokes_the_oldest_idle_lease_and_the_turn_misses() -> None:
    # Two conversations; the second's turn needs room only the first's idle lease can give.
    trace = [Conversation("a", [Turn(0.0, 600, 640, "tool", 50.0),
                                Turn(53.0, 700, 768, "end", 0.0)]),
             Conversation("b", [Turn(10.0, 600, 640, "end", 0.0)])]
    r = simulate(lease(120), trace, budget=15)
    assert r["revoked"] == 1 and r["lost_to_pressure"] == 1 and r["hit_rate"] == 0.0
    assert r["stalled_turns"] == 0
    # A fixed TTL cannot make room: b's turn waits, and so does a's next (b's 480 s).
    fixed = simulate(FIXED, trace, budget=15)
    assert fixed["revoked"] == 0 and fixed["stalled_turns"] == 2 and fixed["hit_rate"] == 1.0


def test_the_trace_is_seeded_and_turns_grow() -> None:
    spec = TraceSpec(conversations=20)
    a, b = make_trace(spec), make_trace(spec)
    assert [[(t.at, t.context) for t in c.turns] for c in a] == \
        [[(t.at, t.context) for t in c.turns] for c in b]
    for conv in a:
        assert conv.turns[-1].pause_kind == "end"
        for prev, nxt in zip(conv.turns, conv.turns[1:], strict=False):
            assert nxt.context > prev.held >= prev.context and nxt.at > prev.at


def test_command_prints_each_policy_with_the_documented_keys() -> None:
    result = CliRunner().invoke(lease_policy_bench, ["--conversations", "40", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out) == {p.name for p in policies((60, 120, 240, 480))}
    for figures in out.values():
        assert {"block_seconds", "hit_rate", "peak_blocks"} <= set(figures)
        assert 0.0 <= figures["hit_rate"] <= 1.0
    # Releasing at the end alone saves the fixed TTL's last 480 s of every conversation.
    assert out["lease_idle_480"]["block_seconds"] < out["fixed_ttl_480"]["block_seconds"]


def test_command_rejects_bad_idle_ttls() -> None:
    result = CliRunner().invoke(lease_policy_bench, ["--idle-ttls", "0.5"])
    assert result.exit_code == 2 and "between 1 and 3600" in result.output
