"""docker-compose.yml stays valid and runs real `kvbridge` commands.

Docker has no engine on the CI machine, so: the file is parsed (the observability profile's
mounts name files that exist, and its Prometheus scrapes the ports the services serve); every
service's command is resolved to a `kvbridge` command and parsed by it (options and values
checked as the command itself checks them, and its --help works); and the control-plane
commands are run here as processes, with their listen addresses moved to 127.0.0.1 port 0, and
must come up serving.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from cli_procs import parse_kvbridge, run_until_logged
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
_DEFAULTED = re.compile(r"\$\{[A-Z_]+:-([^}]*)\}")


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _command(service: str) -> list[str]:
    """The service's command with ${VAR:-default} interpolated as compose would by default."""
    return [_DEFAULTED.sub(r"\1", arg) for arg in _compose()["services"][service]["command"]]


# Services that run kvbridge (redis, Prometheus and Grafana run their own images).
SERVICES = sorted(name for name, svc in _compose()["services"].items()
                  if svc["image"].startswith("kvbridge"))


def test_compose_file_is_well_formed() -> None:
    services = _compose()["services"]
    assert {"redis", "registry", "registry-2", "router", "gateway", "prefill", "decode",
            "prefill-cpu", "decode-cpu", "tiny-model"} <= set(services)
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name in ("registry", "registry-2", "router", "gateway"):
        assert services[name]["build"] == "." and "profiles" not in services[name]
        assert services[name]["healthcheck"]["test"][0] == "CMD"
    assert (ROOT / "Dockerfile").is_file()
    assert {p.split(":")[1] for p in services["registry"]["ports"]} == {"50051", "9464"}
    assert {p.split(":")[0] for p in services["registry-2"]["ports"]} == {"50052", "9466"}
    for name in ("registry", "registry-2"):  # replicas of one fleet, on the compose Redis
        command = _command(name)
        assert command[command.index("--backend") + 1] == "redis"
        assert command[command.index("--redis-url") + 1] == "redis://redis:6379/0"
        assert services[name]["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert {p.split(":")[1] for p in services["gateway"]["ports"]} == {"8080"}
    for name in ("prefill", "decode"):
        assert services[name]["profiles"] == ["gpu"]
        assert services[name]["build"]["dockerfile"] == "Dockerfile.engine"
        assert "--device" in services[name]["command"]
    for name in ("prefill-cpu", "decode-cpu", "tiny-model"):
        assert services[name]["profiles"] == ["cpu"]
        assert services[name]["build"]["dockerfile"] == "Dockerfile.cpu"
    for dockerfile in ("Dockerfile.engine", "Dockerfile.cpu"):
        assert 'ENTRYPOINT ["kvbridge"]' in (ROOT / dockerfile).read_text()
    # The services find each other by the addresses the commands name.
    replicas = "registry:50051,registry-2:50051"
    assert _command("router")[_command("router").index("--registry") + 1] == replicas
    gateway = _command("gateway")
    assert gateway[gateway.index("--router") + 1] == "router:50061"
    assert gateway[gateway.index("--registry") + 1] == replicas
    for engine in ("prefill", "decode", "prefill-cpu", "decode-cpu"):
        command = _command(engine)
        assert command[command.index("--advertise-host") + 1] == engine
        assert command[command.index("--registry") + 1] == replicas
    # The CPU engines compute on cores of their own (`engine run --cpu`, default 0).
    cores = []
    for engine in ("prefill-cpu", "decode-cpu"):
        command = _command(engine)
        cores.append(command[command.index("--cpu") + 1] if "--cpu" in command else "0")
    assert cores == ["0", "1"]


def _mounts(service: str) -> dict[str, Path]:
    """The service's bind mounts from this repository: container path -> file or folder here."""
    out = {}
    for volume in _compose()["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            out[target] = ROOT / source
    return out


def test_observability_profile_loads_the_files_under_deploy() -> None:
    services = _compose()["services"]
    assert set(SERVICES) | {"redis", "prometheus", "grafana"} == set(services)
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"]
        for source in _mounts(name).values():
            assert source.exists(), f"{name} mounts {source}, which does not exist"
        binds = [v for v in services[name]["volumes"] if v.startswith("./")]
        assert binds and all(v.endswith(":ro") for v in binds), name
    # Prometheus: its config, and the rule file the config names beside it.
    prometheus = services["prometheus"]
    mounts = _mounts("prometheus")
    config_path = next(c.split("=", 1)[1] for c in prometheus["command"]
                       if c.startswith("--config.file="))
    config = yaml.safe_load(mounts[config_path].read_text())
    for rule_file in config["rule_files"]:
        in_container = str(Path(config_path).parent / rule_file)
        assert mounts[in_container] == ROOT / "deploy" / "prometheus" / "alerts.yml"
    # Every scrape job reaches compose services on the ports their commands serve.
    served: dict[str, set[int]] = {}
    for name in SERVICES:
        command = _command(name)
        ports = served.setdefault(name, set())
        for flag in ("--listen", "--metrics-listen"):
            if flag in command:
                ports.add(int(command[command.index(flag) + 1].rsplit(":", 1)[1]))
        if "--port" in command:
            ports.add(int(command[command.index("--port") + 1]))
        ports |= {int(s.split("=")[1]) for s in command if s.startswith("metrics_port=")}
        if name in ("prefill", "decode", "prefill-cpu", "decode-cpu"):
            # The connector's metrics are scraped once, from vLLM's /metrics on --port: a
            # separate metrics port would be a second copy of every series.
            assert not any(s.startswith(("metrics_port=", "metrics_host=")) for s in command), (
                name)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvbridge-registry", "kvbridge-router", "kvbridge-gateway",
                         "kvbridge-engines"}
    engines = {"prefill", "decode", "prefill-cpu", "decode-cpu"}
    for job in jobs.values():
        [sd] = job["dns_sd_configs"]
        for host in sd["names"]:
            assert sd["port"] in served[host], (job["job_name"], host, sd["port"])
        if set(sd["names"]) == engines:
            assert sd["port"] == 8000  # vLLM's /metrics: vllm:* and kvbridge_connector_*
            assert {r["target_label"] for r in job["relabel_configs"]} == {"component", "pod"}
    assert {n for job in jobs.values() for n in job["dns_sd_configs"][0]["names"]} == {
        "registry", "registry-2", "router", "gateway", *engines}
    # Each engine is scraped by one job (two would count the connector's series twice).
    assert [name for name, job in jobs.items()
            if set(job["dns_sd_configs"][0]["names"]) & engines] == ["kvbridge-engines"]
    # Grafana: the provisioned datasource is this Prometheus; the dashboard provider reads the
    # folder the dashboard is mounted at.
    grafana = _mounts("grafana")
    datasources = yaml.safe_load(
        (grafana["/etc/grafana/provisioning/datasources"] / "prometheus.yml").read_text())
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090:9090" in prometheus["ports"]
    providers = yaml.safe_load(
        (grafana["/etc/grafana/provisioning/dashboards"] / "kvbridge.yml").read_text())
    [provider] = providers["providers"]
    folder = grafana[provider["options"]["path"]]
    assert (folder / "kvbridge.json").is_file()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert grafana[str(Path(home).parent)] / Path(home).name == folder / "kvbridge.json"


@pytest.mark.parametrize("service", SERVICES)
def test_every_command_is_a_kvbridge_command_that_parses(service: str) -> None:
    # Parse (not run): unknown options, bad values and missing required ones raise here.
    _path, params = parse_kvbridge(_command(service))
    assert params, service


@pytest.mark.slow
def test_compose_control_plane_commands_serve(redis_server: Any, redis_namespace: str) -> None:
    services = _compose()["services"]
    procs: list[subprocess.Popen[str]] = []
    try:
        listens = []
        for name in ("registry", "registry-2"):  # both replicas, on a real redis-server
            registry_cmd = _command(name)
            for flag in ("--listen", "--metrics-listen"):
                registry_cmd[registry_cmd.index(flag) + 1] = "127.0.0.1:0"
            registry_cmd[registry_cmd.index("--redis-url") + 1] = redis_server.url
            env = {**os.environ, **services[name]["environment"],
                   "KVBRIDGE_REGISTRY_REDIS_NAMESPACE": redis_namespace}
            registry, started = run_until_logged(registry_cmd, env, "registry_started")
            procs.append(registry)
            assert started["backend"] == "redis"
            listens.append(started["listen"])
        router_cmd = _command("router")
        for flag in ("--listen", "--metrics-listen"):
            router_cmd[router_cmd.index(flag) + 1] = "127.0.0.1:0"
        router_cmd[router_cmd.index("--registry") + 1] = ",".join(listens)
        router, router_started = run_until_logged(
            router_cmd, {**os.environ, **services["router"]["environment"]}, "router_started")
        procs.append(router)
        for address, service in ((listens[0], "kvbridge.registry.v1.RegistryService"),
                                 (listens[1], "kvbridge.registry.v1.RegistryService"),
                                 (router_started["listen"], "kvbridge.router.v1.RouterService")):
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
