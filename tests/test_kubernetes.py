"""deploy/kubernetes/ renders, validates and runs real `kvbridge` commands; `engine attach` works.

No cluster is reachable here, so what can be checked offline is: every overlay renders with
`kubectl kustomize` and each object validates against the Kubernetes API schemas
(`kubernetes-validate`, which ships them); every container command parses, the `kvbridge` ones
with the CLI (as tests/test_compose.py does for compose) and the `vllm serve` ones with vLLM's
own parser, their kv-transfer-config with the connector's settings; the wiring holds together
(Services, probes, Secrets, NetworkPolicy, PDBs); the ServiceMonitor and PrometheusRule, which
are CRDs the schemas do not cover, are checked by shape and their metrics against our code; and
`make-secrets.sh` makes Secrets that the services accept. `kvbridge engine attach`, the
engines' sidecar, runs against a real router over gRPC on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

from kvbridge.cli import main
from kvbridge.router.v1 import router_pb2 as pb
from kvbridge.router.v1 import router_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"

# ==== kvbridge engine attach: the engines' sidecar ==============================================

TOKENS = {
    "decode": "decode-token-0123456789abcdef",
    "prefill": "prefill-token-0123456789abcdef",
    "admin": "admin-token-0123456789abcdef",
}
TABLE = ";".join([
    f"{TOKENS['decode']} holder holder=kvbridge-decode-* name=decode",
    f"{TOKENS['prefill']} reader name=prefill",
    f"{TOKENS['admin']} admin name=ops",
])
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


class _FakeEngine(BaseHTTPRequestHandler):
    """vLLM's /health and /metrics, as much of them as the agent reads."""

    def do_GET(self) -> None:
        if self.path == "/health":
            body = b""
        elif self.path == "/metrics":
            body = VLLM_METRICS.encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _start(args: list[str], env: dict[str, str], event: str
           ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Run `kvbridge ARGS` until it logs `event` (JSON lines on stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", *args],
                            env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if line.startswith("{") and json.loads(line)["event"] == event:
            return proc, json.loads(line)
    proc.kill()
    raise AssertionError(f"kvbridge {args[:2]} did not log {event}")


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.fixture
def router() -> Iterator[str]:
    proc, started = _start(
        ["router", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "", "--registry", "",
         "--engine-url-allow", "127.0.0.0/8"],
        {"KVBRIDGE_AUTH_TOKENS": TABLE, "KVBRIDGE_ROUTER_LOG_FORMAT": "json"},
        "router_started")
    try:
        yield str(started["listen"])
    finally:
        assert _stop(proc) == 0


def _instances(router: str) -> dict[str, Any]:
    with grpc.insecure_channel(router) as channel:
        reply = pb_grpc.RouterServiceStub(channel).ListInstances(
            pb.ListInstancesRequest(),
            metadata=(("authorization", f"Bearer {TOKENS['admin']}"),), timeout=5)
    return {i.instance_id: i for i in reply.instances}


def _attach_args(router: str, url: str, role: str = "decode",
                 engine_id: str = "kvbridge-decode-abc12") -> list[str]:
    return ["engine", "attach", "--role", role, "--url", url, "--engine-id", engine_id,
            "--model", "kvbridge-tiny", "--router", router, "--instance-ttl-s", "3"]


@pytest.mark.slow
def test_engine_attach_registers_heartbeats_and_deregisters(router: str,
                                                            fake_engine: str) -> None:
    proc, _ = _start(_attach_args(router, fake_engine),
                     {"KVBRIDGE_TOKEN": TOKENS["decode"]},
                     "instance_attached")
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            instance = _instances(router).get("kvbridge-decode-abc12")
            if instance is not None and instance.load.running_requests == 2:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"no heartbeat with the engine's load: {_instances(router)}")
        assert instance.role == pb.ROLE_DECODE
        assert instance.http_url == fake_engine
        assert instance.engine_id == "kvbridge-decode-abc12"
        assert instance.model == "kvbridge-tiny"
        assert (instance.nixl_host, instance.nixl_port) == ("127.0.0.1", 5600)
        assert instance.load.waiting_requests == 1
        assert instance.load.kv_usage == pytest.approx(0.25)
    finally:
        assert _stop(proc) == 0  # SIGTERM: deregistered, exit status 0
    assert "kvbridge-decode-abc12" not in _instances(router)


@pytest.mark.slow
@pytest.mark.parametrize(("token", "role", "reason"), [
    (TOKENS["prefill"], "decode", "PERMISSION_DENIED"),  # a reader cannot register a decode
    ("not-a-token-0123456789", "prefill", "UNAUTHENTICATED"),
])
def test_engine_attach_stops_when_the_router_refuses(router: str, fake_engine: str, token: str,
                                                     role: str, reason: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", *_attach_args(router, fake_engine, role)],
        env={**os.environ, "KVBRIDGE_TOKEN": token}, capture_output=True, text=True,
        timeout=30)
    assert result.returncode == 1, result.stderr
    assert f"error: {reason}" in result.stderr
    assert "kvbridge-decode-abc12" in result.stderr
    assert _instances(router) == {}


def test_engine_attach_waits_for_the_engine_and_stops_on_sigterm(router: str) -> None:
    # Nothing listens on the engine's port yet: it waits (registers nothing) until SIGTERM.
    proc, started = _start(_attach_args(router, "http://127.0.0.1:9"),
                           {"KVBRIDGE_TOKEN": TOKENS["decode"]},
                           "engine_attach_waiting")
    assert started["url"] == "http://127.0.0.1:9"
    time.sleep(0.5)
    assert _instances(router) == {}
    assert _stop(proc) == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--url", "10.0.0.5:8000"], "expected http://HOST:PORT"),
    (["--url", "http://10.0.0.5"], "expected http://HOST:PORT"),
    (["--url", "http://10.0.0.5:8000/v1"], "expected http://HOST:PORT"),
    (["--router", "not an address"], "--router"),
    (["--role", "both"], "--role"),
])
def test_engine_attach_refuses_bad_arguments(args: list[str], message: str) -> None:
    base = {"--role": "decode", "--url": "http://10.0.0.5:8000", "--engine-id": "d",
            "--model": "m", "--router": "router:50061"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    result = CliRunner().invoke(main, ["engine", "attach",
                                       *[x for kv in base.items() for x in kv]])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_engine_attach_needs_its_options() -> None:
    result = CliRunner().invoke(main, ["engine", "attach", "--role", "decode"])
    assert result.exit_code == 2
    assert "Missing option" in result.output
    help_text = CliRunner().invoke(main, ["engine", "attach", "--help"])
    assert help_text.exit_code == 0 and "heartbeat" in help_text.output
