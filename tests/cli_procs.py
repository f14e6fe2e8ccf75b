"""`kvbridge` commands as the tests of deployment files (compose, Kubernetes) check them:
parsed as the CLI would, or run as processes until they log a given event."""

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


def parse_kvbridge(args: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Parse `kvbridge ARGS` (without the leading `kvbridge`) as the CLI would, without running
    it: (the command's path, its parameters). Unknown commands or options, bad values and
    missing required options fail here; the command's --help must work too."""
    import click
    from click.testing import CliRunner

    from kvbridge.cli import main

    command: click.Command = main
    path: list[str] = []
    while isinstance(command, click.Group) and args and not args[0].startswith("-"):
        sub = command.get_command(click.Context(command), args[0])
        assert sub is not None, f"`kvbridge {' '.join(path + args[:1])}` is unknown"
        command, path, args = sub, path + [args[0]], args[1:]
    assert not isinstance(command, click.Group), f"{path} is a group"
    with command.make_context(" ".join(path), list(args)) as ctx:
        params = dict(ctx.params)
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0, result.output
    return path, params
