"""The main job (`kvbridge registry demo`) end to end: real registry, real gRPC, real time."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from kvbridge.cli import main


@pytest.mark.slow
def test_demo_reuses_verified_kv_and_reclaims_idle_lease() -> None:
    result = CliRunner().invoke(main, ["registry", "demo", "--turns", "4", "--idle-ttl", "1"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    turns = [line for line in lines if line.startswith("turn ")]
    assert len(turns) == 4
    assert "miss (no_lease)" in turns[0]
    for line in turns[1:3]:
        assert re.search(r"hit \d+ tokens", line), line
    # Turn 4 edits history halfway: reuse stops where the hashes stop matching.
    assert "history edited" in turns[3] and "history differs from block" in turns[3]
    assert "after idle: lease state expired; decode freed 4 lease(s) in total, holds 0" in lines
    m = re.search(r"reused (\d+) of (\d+) prompt tokens", result.output)
    assert m is not None and 0 < int(m.group(1)) < int(m.group(2))
