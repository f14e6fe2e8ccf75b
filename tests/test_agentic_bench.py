"""`kvbridge bench agentic`: its trace, its figures and its targets, without engines (the
benchmark itself runs in CI as `--quick`)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvbridge.benchmarks.agentic import (
    TraceSpec,
    TurnResult,
    check_targets,
    make_trace,
    summarize,
    tool_definitions,
)
from kvbridge.cli import main


def _bytes(text: str) -> list[int]:
    """A stand-in tokenizer: one token per UTF-8 byte."""
    return list(text.encode())


def test_trace_is_seeded_and_shares_one_system_prompt() -> None:
    spec = TraceSpec(conversations=12, arrival_s=60.0, time_scale=0.5, seed=3)
    system, plans = make_trace(spec, _bytes)
    assert (system, plans) == make_trace(spec, _bytes)
    assert make_trace(TraceSpec(conversations=12, seed=4), _bytes)[1] != plans
    assert len(system) == spec.system_tokens and len(plans) == 12
    assert [p.arrive_s for p in plans] == sorted(p.arrive_s for p in plans)
    for plan in plans:
        assert 0 <= plan.arrive_s <= 60.0
        assert spec.turns[0] <= len(plan.turns) <= spec.turns[1]
        assert plan.turns[0].pause_s == 0
        for turn in plan.turns:
            assert spec.added_tokens[0] <= len(turn.added) <= spec.added_tokens[1]
            assert spec.answer_tokens[0] <= turn.answer_tokens <= spec.answer_tokens[1]
            assert turn.pause_s <= spec.think_cap_s * 0.5
    # Tool calls (short) and think times (heavy-tailed) both occur.
    pauses = [t.pause_s for p in plans for t in p.turns[1:]]
    assert min(pauses) < 1.0 and max(pauses) >= spec.think_pause_s * 0.5


def test_system_prompt_is_tool_definitions_cut_at_its_length() -> None:
    # The instructions, then the tools as JSON function definitions; taken as many times as
    # the length needs (the second time under numbered names), cut at the length.
    one = tool_definitions()
    assert one.startswith("You are a software engineering agent")
    tools = json.loads(one[one.index("["):])
    assert [t["function"]["name"] for t in tools][:3] == ["read_file", "write_file",
                                                          "edit_file"]
    assert tools[0]["function"]["parameters"]["required"] == ["path"]
    spec = TraceSpec(conversations=1, system_tokens=len(one) + 500)
    system, _ = make_trace(spec, _bytes)
    assert len(system) == spec.system_tokens
    assert bytes(system).decode() == tool_definitions(2)[:spec.system_tokens]
    assert '"name": "read_file_2"' in bytes(system).decode()


def _turn(conversation: int, turn: int, ttft: float | None, decode: str, reused: int = 0,
          local: int | None = None) -> TurnResult:
    return TurnResult("kvbridge", conversation, turn, float(turn), 1000,
                      900 if turn > 1 else 0, ttft_ms=ttft, tpot_ms=5.0 if ttft else None,
                      cached_tokens=reused + (local or 0), reused_tokens=reused,
                      local_tokens=local, decode=decode)


def test_summary_counts_waits_reuse_blocks_and_balance() -> None:
    results = [_turn(0, 1, 100.0, "decode-0", local=0), _turn(0, 2, 50.0, "decode-0", 900, 0),
               _turn(1, 1, 120.0, "decode-1", local=1024),
               _turn(1, 2, 60.0, "decode-1", 0, 100), _turn(2, 1, None, "")]
    delta = {"prefill-0": {"tokens_local_cache_hit": 1024.0, "tokens_external_kv_transfer": 900,
                           "tokens_local_compute": 3076.0, "decision_hit": 1.0,
                           "decision_recompute_cheaper": 1.0, "decision_miss_no_lease": 0.0},
             "decode-0": {"queued": 3.0, "queued_within": 2.0, "tpot_sum": 0.02,
                          "tpot_count": 3.0},
             "decode-1": {"queued": 2.0, "queued_within": 2.0, "tpot_sum": 0.01,
                          "tpot_count": 2.0}}
    samples = [(0.0, "decode-0", 10.0), (2.0, "decode-0", 30.0), (3.0, "decode-0", 0.0),
               (0.0, "decode-1", 5.0), (4.0, "decode-1", 5.0)]
    s = summarize(results, delta, samples, 30.0, [])
    assert s["turns"] == 5 and s["turns_answered"] == 4 and s["turns_unanswered"] == 1
    assert s["turns_waited_1s"] == 2  # one queued past 1 s, one never answered
    assert s["reuse_hit_rate"] == 0.5 and s["reuse_or_cheaper_rate"] == 0.5
    # Conversation 1's turn 2 found 100 of its 900 history tokens: a miss, unless prefill had
    # the history under a lease and recomputed it because that was measured faster.
    results[3].decision = "recompute_cheaper"
    declined = summarize(results, delta, samples, 30.0, [])
    assert declined["reuse_hit_rate"] == 0.5 and declined["reuse_or_cheaper_rate"] == 1.0
    results[3].decision = ""
    assert s["retained_block_seconds"] == 10 * 2 + 30 * 1 + 5 * 4
    assert s["new_conversations_by_decode"] == {"decode-0": 1, "decode-1": 1}
    assert s["turns_by_decode"] == {"decode-0": 2, "decode-1": 2}
    # Of the two turns 2+, one read 900 tokens back, the other nothing.
    assert s["read_back_rate"] == 0.5
    # A leg that does not say, turn by turn, what was read back (upstream, off): not known.
    untold = [TurnResult("upstream", 0, turn, float(turn), 1000, 900 if turn > 1 else 0,
                         ttft_ms=50.0, cached_tokens=900, decode="decode-0")
              for turn in (1, 2)]
    upstream = summarize(untold, {}, [], 30.0, [])
    assert upstream["read_back_rate"] is None and upstream["reuse_hit_rate"] == 1.0
    assert s["tokens_local_cache"] == 1024 and s["tokens_read_back"] == 900
    assert s["first_turns_from_local_cache"] == 1.0  # the second first turn (after warm-up)
    assert s["turns_local_and_read_back"] == 0
    assert s["turns_per_minute"] == 8.0
    # The unanswered turn (from 1 s in) waited at least to the leg's end (30 s): it counts at
    # that bound, so the slowest turns of a leg that leaves them unanswered are not dropped.
    assert s["ttft_p50_ms"] == 100.0 and s["ttft_p90_ms"] == 29000.0
    assert s["ttft_p90_answered_ms"] == 120.0
    assert s["connector_decisions"] == {"hit": 1, "recompute_cheaper": 1}
    assert s["decode_engine_tpot_ms"] == 6.0


def _leg(**overrides: object) -> dict[str, object]:
    leg: dict[str, object] = {
        "ttft_p90_ms": 100.0, "tpot_p50_ms": 5.0, "turns_waited_1s": 0, "reuse_hit_rate": 1.0,
        "retained_block_seconds": 1000.0, "turns_per_minute": 30.0,
        "new_conversations_by_decode": {"decode-0": 5, "decode-1": 5},
        "first_turns_from_local_cache": 1.0, "turns_local_and_read_back": 4}
    leg.update(overrides)
    return leg


def test_targets_compare_the_legs() -> None:
    summary = {"off": _leg(ttft_p90_ms=300.0, reuse_hit_rate=0.0),
               "upstream": _leg(ttft_p90_ms=900.0, turns_waited_1s=12, reuse_hit_rate=0.5,
                                retained_block_seconds=5000.0, turns_per_minute=20.0),
               "kvbridge": _leg()}
    assert all(check_targets(summary).values()), check_targets(summary)
    summary["kvbridge"] = _leg(ttft_p90_ms=500.0, turns_waited_1s=1,
                               new_conversations_by_decode={"decode-0": 7, "decode-1": 3},
                               tpot_p50_ms=5.5)
    failed = {name for name, ok in check_targets(summary).items() if not ok}
    assert failed == {"ttft_p90 <= 0.5x upstream", "ttft_p90 <= off", "0 turns waited >= 1 s",
                      "no decode > 65% of new conversations", "tpot_p50 within 5% of off"}


def test_targets_without_the_other_legs_are_not_measured() -> None:
    targets = check_targets({"kvbridge": _leg()})
    assert targets["ttft_p90 <= 0.5x upstream"] is None
    assert targets["0 turns waited >= 1 s"] is True


@pytest.mark.parametrize("legs", ["", "off,nope"])
def test_unknown_legs_are_a_usage_error(legs: str, tmp_path) -> None:
    result = CliRunner().invoke(main, ["bench", "agentic", "--out", str(tmp_path),
                                       "--legs", legs])
    assert result.exit_code == 2 and "choose from off, upstream, kvbridge" in result.output
