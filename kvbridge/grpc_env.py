"""gRPC core settings for kvbridge's serving commands, applied before gRPC is imported.

gRPC core reads its `GRPC_EXPERIMENTS` environment variable once, when the `grpc` module is
first imported: a process that wants a setting must have it in its environment by then. So
the serving commands (`kvbridge registry serve`, `router serve`, `gateway serve`, `up`) and the
registry benchmark's driver (`kvbridge bench registry`) call `apply_server_defaults` first thing
(from the console script `kvbridge._entry`, or `python -m kvbridge.cli`, before anything
imports grpc), and nothing else does: the other CLI
commands, the connector inside vLLM and servers embedded in other programs keep whatever their
process has (the vLLM engines `kvbridge up` starts too: `engine_environment`).

The default turns off the `event_engine_listener` and `event_engine_client` experiments, so that
connections (accepted and made) are served by gRPC's classic TCP endpoints, which read and write
on the thread that polls instead of handing each read and write to EventEngine threads. On gRPC
1.85.3 that costs less CPU per call, on both sides; on 1.78.2, the version kvbridge installs
(gRPC is held below 1.80, see docs/development.md), it measures the same either way, and it
stays for installations on a newer gRPC (figures: docs/benchmarks.md, "gRPC versions and
settings"). Setting `GRPC_EXPERIMENTS` yourself, even to the empty string, keeps gRPC's own
defaults or your choice: it is never overridden.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Container, MutableMapping, Sequence
from typing import Any

DEFAULT_SERVER_EXPERIMENTS = "-event_engine_listener,-event_engine_client"

# From gRPC 1.80 on, grpc.aio spends more CPU per unary call (grpc/grpc#43092; figures in
# docs/benchmarks.md); kvbridge's requirements hold gRPC below it. A serving process that runs
# such a release anyway (installed over the requirements) says so when it starts.
SLOW_GRPC_FROM = (1, 80)

# Commands (their words, in order) that serve or drive gRPC on kvbridge's hot path.
SERVING_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("registry", "serve"), ("router", "serve"), ("gateway", "serve"), ("up",),
    ("bench", "registry"))


def serving_command(argv: Sequence[str]) -> bool:
    """Whether `argv` (without the program name) runs one of `SERVING_COMMANDS`: the words
    after the `kvbridge` group's own options (`--log-level LEVEL`) name the command."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "--log-level" else 1
    words = tuple(argv[i:i + 2])
    return any(words[:len(command)] == command for command in SERVING_COMMANDS)


def apply_server_defaults(argv: Sequence[str],
                          environ: MutableMapping[str, str] | None = None,
                          modules: Container[str] | None = None) -> str | None:
    """Set `GRPC_EXPERIMENTS` to `DEFAULT_SERVER_EXPERIMENTS` for a serving command, unless it
    is set already or gRPC is imported (too late to matter). Returns what it set, or None.
    `environ` and `modules` stand for `os.environ` and `sys.modules`."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "GRPC_EXPERIMENTS" in environ or "grpc" in modules or not serving_command(argv):
        return None
    environ["GRPC_EXPERIMENTS"] = DEFAULT_SERVER_EXPERIMENTS
    if environ is os.environ:
        global _applied
        _applied = True
    return DEFAULT_SERVER_EXPERIMENTS


def slow_grpc(version: str) -> bool:
    """Whether gRPC `version` ("1.85.3", "1.80.0rc1") is one of the releases with the slower
    grpc.aio (`SLOW_GRPC_FROM` on). A version that does not parse is not called slow."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and (int(found[1]), int(found[2])) >= SLOW_GRPC_FROM


def describe(log: Any) -> dict[str, str | None]:
    """What a serving process's `*_started` log line says of gRPC (its version and
    GRPC_EXPERIMENTS); on a slow release, `log` also gets a warning that says what to do."""
    import grpc

    version = grpc.__version__
    if slow_grpc(version):
        log.warning("grpc_version_slow", grpc_version=version,
                    hint="grpc.aio costs about 45% more CPU per call from gRPC 1.80 on "
                         "(grpc/grpc#43092): install kvbridge's requirement, grpcio<1.80")
    return {"grpc_version": version, "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS")}


_applied = False  # whether this process's GRPC_EXPERIMENTS is kvbridge's default, not a choice


def engine_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` for a vLLM engine started by this process: without the GRPC_EXPERIMENTS that
    `apply_server_defaults` set here (engines keep gRPC's defaults unless the operator chose)."""
    if _applied and env.get("GRPC_EXPERIMENTS") == DEFAULT_SERVER_EXPERIMENTS:
        env = {k: v for k, v in env.items() if k != "GRPC_EXPERIMENTS"}
    return env
