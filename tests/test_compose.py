"""docker-compose.yml stays valid and runs the same commands the tests run.

Docker has no engine on the CI machine, so the registry service's command is run here as a
process, with its listen addresses moved to 127.0.0.1 port 0, and must come up healthy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_is_well_formed() -> None:
    compose = _compose()
    registry = compose["services"]["registry"]
    assert registry["build"] == "."
    assert (ROOT / "Dockerfile").is_file()
    assert registry["command"][:2] == ["registry", "serve"]
    published = {p.split(":")[1] for p in registry["ports"]}
    command = registry["command"]
    assert command[command.index("--listen") + 1].endswith(":50051")
    assert command[command.index("--metrics-listen") + 1].endswith(":9464")
    assert published == {"50051", "9464"}


@pytest.mark.slow
def test_compose_registry_command_serves(tmp_path: Path) -> None:
    command = list(_compose()["services"]["registry"]["command"])
    for flag in ("--listen", "--metrics-listen"):
        command[command.index(flag) + 1] = "127.0.0.1:0"
    env = {**os.environ, **_compose()["services"]["registry"]["environment"]}
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", *command], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        started = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and started is None:
            line = proc.stderr.readline()
            if not line:
                break
            event = json.loads(line)
            if event["event"] == "registry_started":
                started = event
        assert started is not None, "the compose registry command did not start"
        with grpc.insecure_channel(started["listen"]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvbridge.registry.v1.RegistryService"),
                timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
