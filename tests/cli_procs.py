"""`kvbridge` commands run as processes by the tests that check deployment files (compose,
Kubernetes): started, then read until they log a given event."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any


def run_until_logged(args: list[str], env: dict[str, str], event: str, timeout: float = 30.0
                     ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Run `kvbridge ARGS` (with `env` over this process's environment) until it logs `event`
    (JSON lines on stderr); returns the process and that line. Kills it if it never does."""
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", *args],
                            env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if line.startswith("{") and (record := json.loads(line))["event"] == event:
            return proc, record
    proc.kill()
    raise AssertionError(f"kvbridge {args[:2]} did not log {event}")
