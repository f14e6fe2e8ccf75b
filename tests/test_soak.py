"""`kvbridge bench soak`, briefly: a real registry process, holder sessions and readers over gRPC,
holder churn; nothing lost, no wrong read, the figures the issue asks for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # a benchmark subprocess: ~15 s
def test_short_soak_loses_nothing() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "--log-level", "error", "bench", "soak",
         "--minutes", "0.15", "--conversations", "60", "--holders", "3", "--think-s", "0.5",
         "--idle-ttl-s", "2", "--holder-ttl-s", "1.5", "--churn-every-s", "3", "--json"],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["leases_lost"] == 0 and result["wrong_reads"] == 0
    assert result["turns"] > 100 and result["grants"] > 100
    assert result["read_hits"] > 0 and result["conversations_abandoned"] > 0
    assert result["holder_churns"] >= 2
    # Abandoned conversations expired and churned holders were told what to free: at the end
    # nothing is held and nothing is active.
    assert result["still_held"] == 0 and result["registry_active_at_end"] == 0
    assert sum(result["freed"].values()) == result["grants"]
    assert {"rss_start_mb", "rss_end_mb"} <= set(result) and result["rss_end_mb"] > 0
