"""gRPC core settings of kvbridge's serving commands (`kvbridge.grpc_env`)."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from structlog.testing import capture_logs

from kvbridge import grpc_env
from kvbridge.engines import EngineSpec
from kvbridge.grpc_env import DEFAULT_SERVER_EXPERIMENTS, apply_server_defaults, serving_command


@pytest.mark.parametrize("argv", [
    ["registry", "serve"],
    ["registry", "serve", "--listen", "127.0.0.1:0"],
    ["--log-level", "error", "registry", "serve"],
    ["--log-level=error", "router", "serve", "--registry", "127.0.0.1:1"],
    ["gateway", "serve"],
    ["up", "--cpu-engines"],
    ["--log-level", "error", "bench", "registry", "--json"],
])
def test_serving_commands_are_recognised(argv: list[str]) -> None:
    assert serving_command(argv)


@pytest.mark.parametrize("argv", [
    [],
    ["--help"],
    ["registry", "--help"],
    ["registry", "demo"],
    ["leases", "list", "--registry", "up"],  # an option value that names a command
    ["leases", "show", "up"],
    ["bench", "soak"],
    ["--log-level", "up", "leases", "list"],  # --log-level takes the next word
    ["engine", "run", "--role", "prefill"],  # vLLM's process: left alone
    ["-h"],
    ["--version"],
])
def test_other_commands_are_not(argv: list[str]) -> None:
    assert not serving_command(argv)


def test_the_default_is_set_only_when_unset_and_before_grpc_is_imported() -> None:
    env: dict[str, str] = {}
    assert apply_server_defaults(["registry", "serve"], env, modules=()) == \
        DEFAULT_SERVER_EXPERIMENTS
    assert env == {"GRPC_EXPERIMENTS": DEFAULT_SERVER_EXPERIMENTS}

    chosen = {"GRPC_EXPERIMENTS": ""}  # the operator's choice (here gRPC's own defaults) wins
    assert apply_server_defaults(["registry", "serve"], chosen, modules=()) is None
    assert chosen == {"GRPC_EXPERIMENTS": ""}

    late: dict[str, str] = {}  # gRPC already read its configuration: setting it would lie
    assert apply_server_defaults(["registry", "serve"], late, modules={"grpc"}) is None
    assert late == {}

    other: dict[str, str] = {}
    assert apply_server_defaults(["leases", "list"], other, modules=()) is None
    assert other == {}


def test_the_default_names_experiments_this_grpc_knows() -> None:
    # An unknown name is only logged by gRPC ("Unknown experiment: NAME") and ignored: the
    # setting would silently do nothing.
    def import_grpc(experiments: str) -> str:
        env = {**os.environ, "GRPC_EXPERIMENTS": experiments, "GRPC_VERBOSITY": "ERROR"}
        return subprocess.run([sys.executable, "-c", "import grpc"], env=env, text=True,
                              capture_output=True, timeout=60, check=True).stderr

    assert "Unknown experiment: no_such_experiment" in import_grpc("-no_such_experiment")
    assert "Unknown experiment" not in import_grpc(DEFAULT_SERVER_EXPERIMENTS)


def test_engines_started_by_a_serving_command_keep_grpcs_defaults(monkeypatch, tmp_path) -> None:
    spec = EngineSpec("prefill", "/m", 1, 2, "p0")
    monkeypatch.setattr(grpc_env, "_applied", False)
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")  # records what to restore after the test
    monkeypatch.delenv("GRPC_EXPERIMENTS")
    # As `kvbridge up` does on start, on this process's own environment:
    assert apply_server_defaults(["up", "--cpu-engines"], modules=()) == \
        DEFAULT_SERVER_EXPERIMENTS
    assert os.environ["GRPC_EXPERIMENTS"] == DEFAULT_SERVER_EXPERIMENTS
    assert "GRPC_EXPERIMENTS" not in spec.environment(tmp_path)  # kvbridge's default: not

    monkeypatch.setattr(grpc_env, "_applied", False)  # the operator's choice: passed on
    assert spec.environment(tmp_path)["GRPC_EXPERIMENTS"] == DEFAULT_SERVER_EXPERIMENTS
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")
    assert spec.environment(tmp_path)["GRPC_EXPERIMENTS"] == ""


@pytest.mark.parametrize(("version", "slow"), [
    ("1.78.2", False), ("1.79.0", False), ("1.8.0", False), ("1.62.3", False),
    ("1.80.0", True), ("1.85.3", True), ("1.80.0rc1", True), ("1.90.0.dev0", True),
    ("2.0.0", True), ("", False), ("1", False), ("one.two", False),
])
def test_slow_grpc_releases_are_those_from_1_80(version: str, slow: bool) -> None:
    assert grpc_env.slow_grpc(version) is slow


def test_this_install_runs_a_grpc_below_the_slow_releases() -> None:
    # pyproject holds grpcio below 1.80 (grpc/grpc#43092): a resolver that ignored it, or a
    # requirement that drifted, shows here.
    assert not grpc_env.slow_grpc(grpc.__version__), grpc.__version__


def test_describe_names_the_version_and_warns_on_a_slow_release(monkeypatch) -> None:
    import structlog

    log = structlog.get_logger("test")
    monkeypatch.setenv("GRPC_EXPERIMENTS", "-x")
    with capture_logs() as logs:
        said = grpc_env.describe(log)
    assert said == {"grpc_version": grpc.__version__, "grpc_experiments": "-x"}
    assert logs == []
    monkeypatch.setattr(grpc, "__version__", "1.85.3")
    with capture_logs() as logs:
        said = grpc_env.describe(log)
    assert said["grpc_version"] == "1.85.3"
    [warning] = logs
    assert warning["event"] == "grpc_version_slow" and warning["log_level"] == "warning"
    assert "grpcio<1.80" in warning["hint"]
