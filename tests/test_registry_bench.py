"""`kvbridge bench registry --json`, briefly: a real registry process and the trivial echo, driven
from the bench process; the JSON carries every figure the registry's targets are read from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

# The figures issue 2 names, and the echo's measured in the same run for scale.
REQUIRED = ("acquire_read_p50_ms", "acquire_read_p99_ms", "max_rps", "renewals_per_s",
            "bytes_per_lease", "expiry_late_p99_ms", "echo_p99_ms", "echo_max_rps",
            "acquire_read_p99_ms_under_list_flood", "acquire_read_p99_ms_without_list_flood",
            "list_flood_p99_ratio")


@pytest.mark.slow  # a benchmark subprocess: ~15 s
def test_short_registry_bench_prints_every_figure() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "--log-level", "error", "bench", "registry",
         "--leases", "2000", "--rate", "200", "--duration", "0.5", "--rounds", "1",
         "--concurrency", "8", "--json"],
        capture_output=True, text=True, timeout=240,
        env={k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for key in REQUIRED:
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])
    assert result["acquire_read_p50_ms"] <= result["acquire_read_p99_ms"]
    # The other tenant's ListLeases flood ran (issue 32): answered or refused, it was served.
    assert result["list_flood_answered"] + result["list_flood_refused"] > 0
    assert result["echo_p50_ms"] <= result["echo_p99_ms"]
    assert result["leases"] == 2000 and result["blocks_per_lease"] == 64
    # What the figures ran on: the gRPC of this install and kvbridge's gRPC core settings.
    assert result["grpc_version"] == grpc.__version__
    assert result["grpc_experiments"] == "-event_engine_listener,-event_engine_client"
    assert result["acquire_p99_vs_echo"] == round(
        result["acquire_read_p99_ms"] / result["echo_p99_ms"], 2)
