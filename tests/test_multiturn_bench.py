"""The multi-turn benchmark's arithmetic, files and argument checks (the legs themselves run on
real engines: `kvbridge bench multiturn --quick` in CI)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbridge.benchmarks.multiturn import (
    LEGS,
    ModelShape,
    Record,
    Workload,
    multiturn_bench,
    plot,
    scrape,
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


def test_model_shape_default_is_about_fifty_million_parameters() -> None:
    shape = ModelShape()
    assert 35e6 < shape.params() < 60e6
    assert json.dumps(shape.__dict__)
