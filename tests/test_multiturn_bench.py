"""The multi-turn benchmark's arithmetic, files and argument checks (the legs themselves run on
real engines: `kvbridge bench multiturn --quick` in CI)."""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbridge.benchmarks.multiturn import (
    LEGS,
    NOID,
    PC,
    GatewayRunner,
    ModelShape,
    Record,
    Stack,
    Workload,
    multiturn_bench,
    noid_targets,
    plot,
    run_legs,
    scrape,
    spread,
    summarize,
    summary_markdown,
)


def record(leg: str, turn: int, ttft: float, length: int = 512, **kw: float) -> Record:
    fields = {"prefill_ms": ttft - 10, "kv_xfer_ms": 0.0, "queue_ms": 1.0, "compute_ms": 5.0,
              "wait_ms": 1.0, "decode_ttft_ms": 10.0, "reused_tokens": 0,
              "recomputed_tokens": length, **kw}
    return Record(leg=leg, prompt_tokens=length, conversation=0, turn=turn,
                  input_tokens=length, ttft_ms=ttft, **fields)  # type: ignore[arg-type]


def test_summary_means_cover_the_turns_that_can_reuse() -> None:
    records = [record("off", 1, 1000.0), record("off", 2, 900.0), record("off", 3, 1100.0),
               record("kvbridge", 1, 1000.0), record("kvbridge", 2, 90.0, lookup_ms=2.0),
               record("kvbridge", 3, 110.0, lookup_ms=4.0)]
    summary = summarize(records)
    assert summary["off"]["512"]["ttft_ms"] == 1000.0  # turn 1 left out
    assert summary["kvbridge"]["512"]["ttft_ms"] == 100.0
    assert summary["kvbridge"]["512"]["lookup_ms"] == 3.0
    assert "lookup_ms" not in summary["off"]["512"]
    assert summary["off"]["512"]["turns"] == 2


def test_markdown_table_has_the_ratios_and_overheads() -> None:
    records = []
    for leg, ttft in (("off", 1000.0), ("upstream", 120.0), ("kvbridge", 100.0),
                      ("local", 300.0), ("floor", 80.0)):
        records += [record(leg, 1, 2000.0), record(leg, 2, ttft)]
    text = summary_markdown(summarize(records), ModelShape(), Workload((512,)))
    row = next(line for line in text.splitlines() if line.startswith("| 512 | 10.00x"))
    # OFF/KVBRIDGE, KVBRIDGE/UPSTREAM, KVBRIDGE-UPSTREAM, KVBRIDGE-FLOOR, UPSTREAM-FLOOR
    assert "| 0.83x | -20.0 | +20.0 | +40.0 |" in row


def noid_pair(id_ttft: float, noid_ttft: float, id_reused: int, noid_reused: int,
              length: int = 512, **noid_kw: object) -> list[Record]:
    """Turns 1 and 2 of the id and noid legs at a length; the TTFTs are the client's."""
    out = []
    for leg, ttft, reused, source in (("kvbridge", id_ttft, id_reused, "body"),
                                      (NOID, noid_ttft, noid_reused, "recent")):
        kw: dict[str, object] = {"conversation_source": source, "route_ms": 1.0}
        if leg == NOID:
            kw.update(noid_kw)
        out += [record(leg, 1, 2000.0, length, client_ttft_ms=2100.0,
                       conversation_source="body" if leg == "kvbridge" else "new"),
                record(leg, 2, ttft - 5, length, client_ttft_ms=ttft, reused_tokens=reused,
                       **kw)]  # type: ignore[arg-type]
    return out


def test_noid_targets_met_within_the_slack() -> None:
    # 200 ms: +2% is 4 ms, more than 2 ms; 96% of the tokens is enough.
    summary = summarize(noid_pair(200.0, 203.9, 1000, 960))
    entry = summary[NOID]["512"]
    assert entry["vs_id_reused_ratio"] == 0.96
    assert entry["vs_id_ttft_allowed_ms"] == 4.0
    assert entry["vs_id_ttft_diff_ms"] == pytest.approx(3.9)
    assert entry["vs_id_client_ttft"] == 1.0  # the client's TTFT, not prefill + decode
    assert entry["vs_id_reuse_met"] == entry["vs_id_ttft_met"] == entry["vs_id_met"] == 1.0
    assert "vs_id_met" not in summary["kvbridge"]["512"]
    text = summary_markdown(summary, ModelShape(), Workload((512,)))
    row = next(line for line in text.splitlines()
               if line.startswith("| 512 | 1000 / 960 |"))
    assert "| 0.960 | 200.0 / 203.9 | +3.9 | 4.0 |" in row
    # The client's TTFT is 5 ms more than prefill + decode's in noid_pair: the gateway's part.
    assert row.endswith("| 1.0 / 1.0 | 5.0 / 5.0 | recent 1 | met |")
    assert summary["kvbridge"]["512"]["gateway_ms"] == 5.0
    assert "KVBRIDGE-NOID targets at every length: **met**." in text


def test_noid_targets_not_met_at_one_length_fail_the_sweep() -> None:
    # At 100 ms, +2% is the 2 ms floor: +2.5 ms is over it. At 1,024 tokens, 90% of the
    # tokens reused is short of 95%.
    records = noid_pair(100.0, 102.5, 500, 500) + noid_pair(300.0, 300.0, 1000, 900,
                                                            length=1024)
    summary = summarize(records)
    short, long_ = summary[NOID]["512"], summary[NOID]["1024"]
    assert (short["vs_id_reuse_met"], short["vs_id_ttft_met"]) == (1.0, 0.0)
    assert short["vs_id_ttft_allowed_ms"] == 2.0
    assert (long_["vs_id_reuse_met"], long_["vs_id_ttft_met"]) == (0.0, 1.0)
    assert short["vs_id_met"] == long_["vs_id_met"] == 0.0
    text = summary_markdown(summary, ModelShape(), Workload((512, 1024)))
    verdict = next(line for line in text.splitlines()
                   if line.startswith("KVBRIDGE-NOID targets"))
    assert verdict == ("KVBRIDGE-NOID targets at every length: **not met**: 512: TTFT +2.5 ms "
                       "(allowed +2.0); 1024: reused 0.900 of KVBRIDGE's tokens (< 0.95).")


def test_noid_targets_fall_back_to_engine_ttft_and_zero_reuse() -> None:
    # Without the client's TTFT (older records) the targets use prefill + decode; an id leg
    # that reused nothing cannot be fallen short of.
    got = noid_targets({"ttft_median_ms": 150.0, "reused_tokens": 0.0},
                       {"ttft_median_ms": 150.0, "client_ttft_median_ms": 140.0,
                        "reused_tokens": 0.0})
    assert got["vs_id_client_ttft"] == 0.0
    assert got["vs_id_ttft_diff_ms"] == 0.0
    assert got["vs_id_reused_ratio"] == 1.0 and got["vs_id_met"] == 1.0


def test_noid_without_the_id_leg_is_not_evaluated() -> None:
    records = [r for r in noid_pair(100.0, 100.0, 500, 500) if r.leg == NOID]
    summary = summarize(records)
    assert "vs_id_met" not in summary[NOID]["512"]
    text = summary_markdown(summary, ModelShape(), Workload((512,)))
    assert ("KVBRIDGE-NOID targets at every length: not evaluated (no KVBRIDGE leg to "
            "compare with).") in text


def pc_pair(kvb_ttft: float, pc_ttft: float, length: int = 512) -> list[Record]:
    """Turns 1 and 2 of the kvbridge leg (prefill's prefix caching off) and the pc leg (on,
    the history up to its last full block from prefill's cache); the TTFTs are the client's."""
    out = []
    for leg, ttft, reused, local in (("kvbridge", kvb_ttft, 480, 0), (PC, pc_ttft, 32, 448)):
        out += [record(leg, 1, 2000.0, length, client_ttft_ms=2100.0),
                record(leg, 2, ttft - 5, length, client_ttft_ms=ttft, reused_tokens=reused,
                       local_tokens=local, recomputed_tokens=length - reused - local,
                       decision="hit")]
    return out


def test_pc_target_met_within_the_slack_and_tokens_by_source() -> None:
    summary = summarize(pc_pair(300.0, 305.9))
    entry = summary[PC]["512"]
    assert entry["vs_kvb_ttft_allowed_ms"] == 6.0  # +2% of 300 ms, more than 2 ms
    assert entry["vs_kvb_ttft_diff_ms"] == pytest.approx(5.9)
    assert entry["vs_kvb_client_ttft"] == 1.0 and entry["vs_kvb_met"] == 1.0
    assert entry["local_tokens"] == 448.0
    text = summary_markdown(summary, ModelShape(), Workload((512,)))
    row = next(line for line in text.splitlines()
               if line.startswith("| 512 | 300.0 / 305.9 |"))
    assert row == ("| 512 | 300.0 / 305.9 | +5.9 | 6.0 | 300.0 / 305.9 | 448 / 32 / 32 "
                   "| hit 1 | met |")
    assert "KVBRIDGE-PC target at every length: **met**." in text


def test_ttft_targets_compare_medians_not_means() -> None:
    # Four turns 2+ a leg at 512 tokens. The pc leg's turns are 1 ms faster but one of them
    # stalled for a second (as decode's first token does now and then here, in every leg):
    # its mean is 250 ms above, its median 1 ms below. The other way round, a kvbridge-leg
    # stall does not hide a pc leg slower in every turn.
    def leg(name: str, ttfts: list[float], length: int = 512) -> list[Record]:
        return [record(name, 1, 2000.0, length, client_ttft_ms=2100.0)] + [
            record(name, turn, t - 5, length, client_ttft_ms=t, reused_tokens=32,
                   local_tokens=448 if name == PC else 0)
            for turn, t in enumerate(ttfts, start=2)]

    summary = summarize(leg("kvbridge", [300.0, 301.0, 302.0, 303.0])
                        + leg(PC, [299.0, 300.0, 301.0, 1302.0])
                        + leg("kvbridge", [300.0, 301.0, 302.0, 1303.0], 1024)
                        + leg(PC, [310.0, 311.0, 312.0, 313.0], 1024))
    stalled, slower = summary[PC]["512"], summary[PC]["1024"]
    assert stalled["client_ttft_ms"] - summary["kvbridge"]["512"]["client_ttft_ms"] == 249.0
    assert stalled["vs_kvb_ttft_diff_ms"] == -1.0 and stalled["vs_kvb_met"] == 1.0
    assert slower["vs_kvb_ttft_diff_ms"] == 10.0 and slower["vs_kvb_met"] == 0.0
    assert slower["vs_kvb_ttft_allowed_ms"] == pytest.approx(6.03)


def test_pc_target_not_met_names_the_length() -> None:
    summary = summarize(pc_pair(100.0, 102.5) + pc_pair(300.0, 301.0, length=1024))
    assert summary[PC]["512"]["vs_kvb_met"] == 0.0  # the 2 ms floor at 100 ms
    assert summary[PC]["1024"]["vs_kvb_met"] == 1.0
    text = summary_markdown(summary, ModelShape(), Workload((512, 1024)))
    assert ("KVBRIDGE-PC target at every length: **not met** at 512 (+2.5 ms, allowed "
            "+2.0).") in text
    alone = summarize([r for r in pc_pair(100.0, 100.0) if r.leg == PC])
    assert "vs_kvb_met" not in alone[PC]["512"]
    assert ("KVBRIDGE-PC target: not evaluated (no KVBRIDGE leg to compare with)."
            in summary_markdown(alone, ModelShape(), Workload((512,))))


def test_summary_counts_how_turns_were_found() -> None:
    records = noid_pair(100.0, 100.0, 500, 500)
    records += [record(NOID, 3, 100.0, client_ttft_ms=100.0, conversation_source="continued"),
                record(NOID, 4, 100.0, client_ttft_ms=100.0, conversation_source="recent")]
    summary = summarize(records)
    # Turns 2+ only: turn 1's "new" is left out.
    assert {k: v for k, v in summary[NOID]["512"].items() if k.startswith("source_")} == {
        "source_recent": 2, "source_continued": 1}
    assert summary["kvbridge"]["512"]["source_body"] == 1
    assert "| continued 1, recent 2 |" in summary_markdown(summary, ModelShape(),
                                                          Workload((512,)))


def test_noid_conversations_are_other_tokens_of_the_same_shape() -> None:
    workload = Workload((512,))
    _, id_history = workload.conversation(512, 0)
    _, noid_history = workload.conversation(512, 0, "noid")
    _, again = workload.conversation(512, 0)
    assert id_history == again and len(noid_history) == len(id_history) == 512
    assert noid_history != id_history
    # The legs that were there before keep their conversations.
    import random
    rng = random.Random("0-512-0")
    assert id_history == [rng.randrange(10, 1000) for _ in range(512)]


def test_gateway_runner_names_the_conversation_only_in_the_id_leg() -> None:
    stack = Stack("http://p", "http://d", "m", gateway_url="http://g")
    with_id, without = GatewayRunner(stack, Workload((512,))), GatewayRunner(
        stack, Workload((512,)), send_id=False)
    for runner in (with_id, without):
        runner.begin_conversation()
    assert with_id.request_body([1, 2])["conversation_id"].startswith("bench-")
    body = without.request_body([1, 2])
    assert "conversation_id" not in body and body["prompt"] == [1, 2]


def test_stack_mates_do_not_follow_each_other() -> None:
    a, b, c = (Stack("", "", "m") for _ in range(3))
    stacks = {"upstream": a, "kvbridge": b, NOID: b, "floor": c}
    order = spread(["upstream", "kvbridge", NOID, "floor"], stacks)
    assert order == ["upstream", "kvbridge", "floor", NOID]
    # Nothing shared (or nothing to gain): the order stays.
    assert spread(["upstream", "kvbridge", "floor"], {"upstream": a, "kvbridge": b,
                                                      "floor": c}) == [
        "upstream", "kvbridge", "floor"]
    assert spread(["kvbridge", NOID], stacks) == ["kvbridge", NOID]


class FakeRunner:
    """A leg that answers at once, checking that its stack runs and the others are stopped."""

    def __init__(self, leg: str, stack: Stack, stacks: list[Stack], log: list[tuple[str, int]]
                 ) -> None:
        self.leg, self.stack, self.stacks, self.log = leg, stack, stacks, log

    def begin_conversation(self) -> None:
        pass

    def turn(self, prompt: list[int], previous: list[int] | None
             ) -> tuple[list[int], dict[str, float]]:
        assert not self.stack.frozen
        assert all(s.frozen for s in self.stacks if s is not self.stack)
        self.log.append((self.leg, hash(tuple(prompt[:64]))))
        return [7] * 8, {"prefill_ms": 1.0, "decode_ttft_ms": 1.0, "kv_xfer_ms": 0.0,
                         "queue_ms": 0.0, "compute_ms": 0.0, "engine_ms": 0.0,
                         "reused_tokens": 0, "recomputed_tokens": len(prompt)}


def test_legs_sharing_a_stack_run_on_it_with_their_own_conversations() -> None:
    shared, other = Stack("", "", "m"), Stack("", "", "m")
    log: list[tuple[str, int]] = []
    stacks = [shared, other]
    runners = {"upstream": FakeRunner("upstream", other, stacks, log),
               "kvbridge": FakeRunner("kvbridge", shared, stacks, log),
               NOID: FakeRunner(NOID, shared, stacks, log)}
    records: list[Record] = []
    workload = Workload((256, 512), conversations=1, turns=3, new_tokens=16, answer_tokens=8)
    sink = io.StringIO()
    run_legs(runners, workload, records, sink)  # type: ignore[arg-type]
    # The warm-up first: two turns per leg at the shortest length, not recorded.
    warmup, measured = log[:6], log[6:]
    assert sorted(leg for leg, _ in warmup) == sorted(["upstream", "kvbridge", NOID] * 2)
    assert len(records) == len(measured) == 18 and len(sink.getvalue().splitlines()) == 18
    assert [(r.leg, r.turn) for r in records[:3]] == [
        ("kvbridge", 1), (NOID, 1), ("upstream", 1)]
    first = dict(measured[:3])
    assert first["kvbridge"] == first["upstream"] != first[NOID]
    # Warm-up conversations are none of the measured ones.
    assert not {h for _, h in warmup} & {h for _, h in measured}

    log.clear()
    no_warmup = Workload((256,), conversations=1, turns=3, new_tokens=16, answer_tokens=8,
                         warmup=False)
    run_legs(runners, no_warmup, [], io.StringIO())  # type: ignore[arg-type]
    assert len(log) == 9


def test_figures_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = [record(leg, t, 100.0 * (i + 1), length=n) for i, leg in enumerate(LEGS)
               for n in (256, 512) for t in (1, 2)]
    plot(summarize(records), tmp_path)
    for name in ("ttft.png", "prefill_breakdown.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def metrics_server() -> Iterator[str]:
    body = (b"# HELP vllm:x help\n"
            b'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5\n'
            b'vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.5\n'
            b"vllm:time_to_first_token_seconds_count 3\n"
            b"vllm:other 7\n")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_scrape_sums_a_series_over_its_labels(metrics_server: str) -> None:
    got = scrape(metrics_server, ("vllm:time_to_first_token_seconds_sum",
                                  "vllm:time_to_first_token_seconds_count", "vllm:absent"))
    assert got == {"vllm:time_to_first_token_seconds_sum": 2.0,
                   "vllm:time_to_first_token_seconds_count": 3.0, "vllm:absent": 0.0}


@pytest.mark.parametrize(("args", "message"), [
    (["--legs", "off,bogus"], "unknown leg"),
    (["--lengths", "7900"], "more than --max-len 8192"),
    (["--lengths", "abc"], "comma-separated integers"),
    (["--hidden", "100", "--heads", "12"], "hidden must divide by heads"),
])
def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path, args: list[str],
                                                          message: str) -> None:
    result = CliRunner().invoke(multiturn_bench, ["--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "o").exists()


def test_the_benchmark_gives_sigterm_back_when_it_ends(tmp_path: Path) -> None:
    """SIGTERM unwinds the benchmark (its stacks stop) only while it runs: the caller's
    handler is back afterwards, however it ended."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []
    original = summary_markdown

    def spy(*args: object, **kwargs: object) -> str:
        seen.append(signal.getsignal(signal.SIGTERM))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    import kvbridge.benchmarks.multiturn as mt
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(record("off", 2, 100.0).__dict__) + "\n")
    mp = pytest.MonkeyPatch()
    mp.setattr(mt, "summary_markdown", spy)
    try:
        result = CliRunner().invoke(multiturn_bench, ["--out", str(tmp_path / "o"),
                                                      "--from-records", str(records)])
    finally:
        mp.undo()
    assert result.exit_code == 0, result.output
    assert seen and seen[0] is not before  # the benchmark's own while it ran
    assert signal.getsignal(signal.SIGTERM) is before


def test_model_shape_default_is_about_fifty_million_parameters() -> None:
    shape = ModelShape()
    assert 35e6 < shape.params() < 60e6
    assert json.dumps(shape.__dict__)


def test_cost_targets_compare_with_the_better_of_off_and_upstream() -> None:
    # At 64 tokens OFF is the better (40 ms): KVBRIDGE at 41.5 is within +2 ms. At 4,096
    # UPSTREAM is (500 ms): +2% of it is 10 ms, and KVBRIDGE is 12 ms above.
    records = []
    for length, off, up, kvb, decision in ((64, 40.0, 60.0, 41.5, "recompute_cheaper"),
                                           (4096, 5000.0, 500.0, 512.0, "hit")):
        for leg, ttft in (("off", off), ("upstream", up), ("kvbridge", kvb)):
            records += [record(leg, 1, 2 * ttft, length),
                        Record(**{**record(leg, 2, ttft, length).__dict__,
                                  "decision": decision if leg == "kvbridge" else None})]
    summary = summarize(records)
    short, long_ = summary["kvbridge"]["64"], summary["kvbridge"]["4096"]
    assert (short["vs_best_ttft_ms"], short["vs_best_allowed_ms"], short["vs_best_met"]) == (
        40.0, 2.0, 1.0)
    assert (long_["vs_best_ttft_ms"], long_["vs_best_allowed_ms"], long_["vs_best_met"]) == (
        500.0, 10.0, 0.0)
    assert short["decision_recompute_cheaper"] == 1 and long_["decision_hit"] == 1
    assert "vs_best_met" not in summary["off"]["64"]
    text = summary_markdown(summary, ModelShape(), Workload((64, 4096)))
    assert "| 64 | 40.0 | 41.5 | +1.5 | 2.0 | recompute_cheaper 1 | met |" in text
    assert "| 4096 | 500.0 | 512.0 | +12.0 | 10.0 | hit 1 | **not met** |" in text
    assert "Read-or-recompute target at every length: **not met** at 4096." in text
    # Neither OFF nor UPSTREAM ran: nothing to compare with.
    alone = summarize([r for r in records if r.leg == "kvbridge"])
    assert "vs_best_met" not in alone["kvbridge"]["64"]
    assert "Read-or-recompute" not in summary_markdown(alone, ModelShape(), Workload((64,)))
