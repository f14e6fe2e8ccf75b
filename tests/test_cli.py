"""The `kvbridge` command against real registries: operator commands through click's runner
against a registry on its own thread, and `kvbridge registry serve` as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import grpc
import pytest
from click.testing import CliRunner, Result

from kvbridge.cli import main
from kvbridge.clients import AsyncRegistryClient, RegistryClient, seconds
from kvbridge.registry.v1 import registry_pb2 as pb


@pytest.fixture
def cli(threaded_registry):
    """`cli(*args)` runs `kvbridge ARGS --registry <the test registry>`."""
    runner = CliRunner()

    def run(*args: str, registry: str | None = None) -> Result:
        argv = list(args)
        if registry is not False:
            argv += ["--registry", registry or threaded_registry.target]
        return runner.invoke(main, argv, catch_exceptions=False)

    return run


@pytest.fixture
def leases(sync_client, kv):
    """Two holders and four leases: t1/a (h1), t1/b (h1), t2/a (h2), and t1/old (h1, revoked)."""
    for h in ("h1", "h2"):
        sync_client.register_holder(**kv.holder_args(h))
    made = {}
    for holder, tenant, conv, n in [("h1", "t1", "a", 10), ("h1", "t1", "b", 8),
                                    ("h2", "t2", "a", 4), ("h1", "t1", "old", 4)]:
        made[f"{tenant}/{conv}"] = sync_client.grant_lease(
            **kv.grant_args(holder, tenant, conv, kv.tokens(n))).lease
    sync_client.revoke_lease(made["t1/old"].lease_id)
    return made


def json_lines(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.strip()]


# ---- help -----------------------------------------------------------------------------------


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name)


def test_help_works_for_every_command():
    runner = CliRunner()
    paths = list(_commands(main))
    assert {("leases", "list"), ("leases", "show"), ("leases", "renew"), ("leases", "revoke"),
            ("leases", "watch"), ("holders", "list"), ("registry", "serve")} <= set(paths)
    for path in paths:
        for flag in ("--help", "-h"):
            result = runner.invoke(main, [*path, flag])
            assert result.exit_code == 0, (path, result.output)
            assert result.output.startswith("Usage: "), path
    serve_help = runner.invoke(main, ["registry", "serve", "--help"]).output
    assert "KVBRIDGE_REGISTRY_LISTEN" in serve_help and "--metrics-listen" in serve_help


# ---- leases ---------------------------------------------------------------------------------


def test_leases_list_table(cli, leases):
    result = cli("leases", "list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["LEASE", "TENANT", "CONVERSATION", "HOLDER", "EPOCH", "STATE",
                                "TOKENS", "BLOCKS", "PINS", "EXPIRES_IN"]
    assert lines[-1] == "3 lease(s)"
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    a = leases["t1/a"]
    assert rows[a.lease_id] == [a.lease_id, "t1", "a", "h1", "1", "active", "10", "-", "0",
                                "1.0m"]
    assert leases["t1/old"].lease_id not in rows
    # Filters and --all.
    result = cli("leases", "list", "--tenant", "t1", "--all")
    ids = {line.split()[0] for line in result.output.splitlines()[1:-1]}
    assert ids == {leases[k].lease_id for k in ("t1/a", "t1/b", "t1/old")}
    assert "revoked" in result.output
    result = cli("leases", "list", "--holder", "h2")
    assert result.output.splitlines()[-1] == "1 lease(s)"
    result = cli("leases", "list", "--tenant", "t1", "--conversation", "b")
    assert result.output.splitlines()[1].split()[0] == leases["t1/b"].lease_id
    result = cli("leases", "list", "--limit", "2")
    assert result.output.splitlines()[-1] == "2 lease(s)"


def test_leases_list_json_one_object_per_line(cli, leases):
    result = cli("leases", "list", "--json", "--all")
    assert result.exit_code == 0, result.output
    rows = json_lines(result.output)
    assert len(rows) == len(result.output.splitlines()) == 4
    assert {r["lease_id"] for r in rows} == {x.lease_id for x in leases.values()}
    by_id = {r["lease_id"]: r for r in rows}
    a = by_id[leases["t1/a"].lease_id]
    assert (a["tenant"], a["conversation_id"], a["holder_id"], a["token_count"]) == (
        "t1", "a", "h1", 10)
    assert a["state"] == "LEASE_STATE_ACTIVE" and a["epoch"] == "1"
    assert by_id[leases["t1/old"].lease_id]["state"] == "LEASE_STATE_REVOKED"
    assert cli("leases", "list", "--json", "--tenant", "t9").output == ""


def test_leases_show(cli, leases, kv):
    a = leases["t1/a"]
    result = cli("leases", "show", a.lease_id)
    assert result.exit_code == 0, result.output
    fields = dict(line.split(":", 1) for line in result.output.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    assert fields["lease"] == a.lease_id
    assert (fields["tenant"], fields["conversation"], fields["holder"]) == ("t1", "a", "h1")
    assert (fields["tokens"], fields["blocks"], fields["state"]) == ("10", "3", "active")
    assert (fields["idle ttl"], fields["max lifetime"]) == ("1.0m", "1.0h")
    shown = json_lines(cli("leases", "show", a.lease_id, "--json").output)
    assert len(shown) == 1
    assert shown[0]["block_ids"] == [100, 101, 102]
    import base64

    assert base64.b64decode(shown[0]["block_hashes"]) == kv.lease_hashes(kv.tokens(10))


def test_leases_renew(cli, leases, threaded_registry):
    a, b, old = leases["t1/a"], leases["t1/b"], leases["t1/old"]
    threaded_registry.advance(5)
    result = cli("leases", "renew", a.lease_id, "--conversation", "t1/b")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"{a.lease_id}: renewed {a.lease_id}, expires in 1.0m",
        f"t1/b: renewed {b.lease_id}, expires in 1.0m"]
    # Anything not renewed makes the exit code 1, and says why.
    result = cli("leases", "renew", a.lease_id, old.lease_id, "l-missing",
                 "--conversation", "t1/none")
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"{a.lease_id}: renewed {a.lease_id}, expires in 1.0m",
        f"{old.lease_id}: not renewed (revoked)",
        "l-missing: not renewed (no lease)",
        "t1/none: not renewed (no lease)"]
    rows = json_lines(cli("leases", "renew", a.lease_id, "l-missing", "--json").output)
    assert rows[0]["renewed"] is True and rows[0]["expires_in"] == "60s"
    assert rows[1]["lease_id"] == "l-missing" and "renewed" not in rows[1]


def test_leases_renew_argument_errors_exit_2(cli, leases):
    result = cli("leases", "renew")
    assert result.exit_code == 2 and "name at least one lease id" in result.output
    result = cli("leases", "renew", "--conversation", "no-slash")
    assert result.exit_code == 2 and "TENANT/CONVERSATION" in result.output
    result = cli("leases", "renew", "--conversation", "/c")
    assert result.exit_code == 2


def test_leases_revoke(cli, leases, sync_client, kv):
    a, b = leases["t1/a"], leases["t1/b"]
    result = cli("leases", "revoke", a.lease_id, "--reason", "maintenance")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == (
        f"revoked {a.lease_id} (state revoked); holder h1 may free it now")
    assert sync_client.get_lease(a.lease_id).state == pb.LEASE_STATE_REVOKED
    sync_client.acquire_read("t1", "b", kv.prompt_hashes(kv.tokens(8)))
    result = cli("leases", "revoke", b.lease_id, "--json")
    [row] = json_lines(result.output)
    assert row["lease"]["state"] == "LEASE_STATE_REVOKED" and row["lease"]["pin_count"] == 1
    assert "reclaimable" not in row  # false: a reader still holds a pin
    result = cli("leases", "revoke", b.lease_id)
    assert "may free it after 1 pin(s) end" in result.output


@pytest.mark.timeout(60)
def test_leases_watch_count_json(cli, sync_client, kv, threaded_registry):
    sync_client.register_holder(**kv.holder_args("h1"))

    def produce() -> None:
        threaded_registry.wait_for_watchers()
        with RegistryClient(threaded_registry.target) as client:
            client.grant_lease(**kv.grant_args("h1", "t2", "skipped", kv.tokens(4)))
            first = client.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(4))).lease
            client.renew_leases([first.lease_id])
            client.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(8)))
            client.grant_lease(**kv.grant_args("h1", "t1", "after", kv.tokens(4)))

    producer = threading.Thread(target=produce)
    producer.start()
    result = cli("leases", "watch", "--tenant", "t1", "--renewals", "--count", "4", "--json")
    producer.join(10)
    assert result.exit_code == 0, result.output
    rows = json_lines(result.output)
    assert [(r["type"], r["conversation_id"]) for r in rows] == [
        ("LEASE_EVENT_TYPE_GRANTED", "c1"), ("LEASE_EVENT_TYPE_RENEWED", "c1"),
        ("LEASE_EVENT_TYPE_SUPERSEDED", "c1"), ("LEASE_EVENT_TYPE_RECLAIMABLE", "c1")]
    assert rows[0]["tenant"] == "t1" and rows[0]["holder_id"] == "h1"


@pytest.mark.timeout(60)
def test_leases_watch_table(cli, sync_client, kv, threaded_registry):
    sync_client.register_holder(**kv.holder_args("h1"))

    def produce() -> None:
        threaded_registry.wait_for_watchers()
        with RegistryClient(threaded_registry.target) as client:
            client.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(4)))

    producer = threading.Thread(target=produce)
    producer.start()
    result = cli("leases", "watch", "--holder", "h1", "--count", "1")
    producer.join(10)
    assert result.exit_code == 0, result.output
    [line] = result.output.splitlines()
    assert " granted " in line and "tenant=t1 conversation=c1 holder=h1 epoch=1" in line


@pytest.mark.timeout(60)
def test_leases_watch_reconnects_when_its_registry_restarts(cli, sync_client, kv,
                                                            threaded_registry):
    sync_client.register_holder(**kv.holder_args("h1"))

    def produce() -> None:
        threaded_registry.wait_for_watchers()
        with RegistryClient(threaded_registry.target) as client:
            client.grant_lease(**kv.grant_args("h1", "t1", "before", kv.tokens(4)))
        threaded_registry.restart_fresh()  # the stream ends with the old registry
        threaded_registry.wait_for_watchers()
        with RegistryClient(threaded_registry.target) as client:
            client.register_holder(**kv.holder_args("h1"))
            client.grant_lease(**kv.grant_args("h1", "t1", "after", kv.tokens(4)))

    producer = threading.Thread(target=produce)
    producer.start()
    result = cli("leases", "watch", "--count", "2", "--reconnect-for", "10", "--json")
    producer.join(10)
    assert result.exit_code == 0, result.output
    assert [r["conversation_id"] for r in json_lines(result.stdout)] == ["before", "after"]
    # (the registry runs in this process: its own log lines go to the same stderr)
    lost, resumed = [line for line in result.stderr.splitlines() if line.startswith("watch:")]
    assert lost.startswith(f"watch: the stream from {threaded_registry.target} ended "
                           "(UNAVAILABLE: the registry is shutting down); reconnecting")
    assert resumed.startswith(f"watch: now watching {threaded_registry.target}, after ")
    assert "events in between are not shown" in resumed


def test_leases_watch_without_reconnect_exits_when_its_registry_stops(cli, sync_client,
                                                                      threaded_registry):
    def stop() -> None:
        threaded_registry.wait_for_watchers()
        threaded_registry.stop()

    stopper = threading.Thread(target=stop)
    stopper.start()
    started = time.monotonic()
    result = cli("leases", "watch", "--reconnect-for", "0")
    stopper.join(10)
    assert result.exit_code == 1
    assert ("error: UNAVAILABLE: the watch stream ended (the registry is shutting down)"
            in result.stderr)
    assert time.monotonic() - started < 10


# ---- holders --------------------------------------------------------------------------------


def test_holders_list(cli, leases):
    result = cli("holders", "list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["HOLDER", "STATE", "NIXL", "BLOCK_SIZE", "TP", "LEASES",
                                "BLOCKS", "EXPIRES_IN"]
    assert lines[1].split() == ["h1", "active", "10.0.0.7:5600", "4", "1", "2", "6", "10.0s"]
    assert lines[2].split()[:6] == ["h2", "active", "10.0.0.7:5600", "4", "1", "1"]
    assert lines[-1] == "2 holder(s)"
    rows = json_lines(cli("holders", "list", "--json").output)
    assert [r["holder_id"] for r in rows] == ["h1", "h2"]
    assert rows[0]["state"] == "HOLDER_STATE_ACTIVE" and rows[0]["lease_count"] == 2
    assert rows[0]["retained_blocks"] == "6"


# ---- errors ---------------------------------------------------------------------------------


def test_domain_errors_print_reason_and_exit_1(cli, leases):
    result = cli("leases", "show", "l-missing")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: LEASE_NOT_FOUND: ")
    assert "l-missing" in result.stderr
    result = cli("leases", "revoke", "l-missing")
    assert result.exit_code == 1 and result.stderr.startswith("error: LEASE_NOT_FOUND: ")


def test_invalid_arguments_exit_2(cli, leases):
    result = cli("leases", "list", "--conversation", "a")  # needs --tenant
    assert result.exit_code == 2
    assert result.stderr.startswith("error: INVALID_ARGUMENT: conversation_id: ")
    result = cli("leases", "show", "bad id")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: INVALID_ARGUMENT: lease_id: ")
    result = cli("leases", "list", "--limit", "-1")
    assert result.exit_code == 2  # click's own validation


def test_unreachable_registry_exit_1(cli):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    result = cli("leases", "list", "--timeout", "1", registry=f"127.0.0.1:{port}")
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"error: UNAVAILABLE: cannot reach the registry at 127.0.0.1:{port} (")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        result = cli("holders", "list", "--timeout", "0.3",
                     registry=f"127.0.0.1:{silent.getsockname()[1]}")
    finally:
        silent.close()
    assert result.exit_code == 1
    assert result.stderr.startswith("error: DEADLINE_EXCEEDED: cannot reach the registry")


def test_registry_from_environment(threaded_registry, leases):
    result = CliRunner().invoke(main, ["holders", "list", "--json"],
                                env={"KVBRIDGE_REGISTRY": threaded_registry.target})
    assert result.exit_code == 0, result.output
    assert len(json_lines(result.output)) == 2


def test_serve_rejects_invalid_config_with_exit_2():
    result = CliRunner().invoke(main, ["registry", "serve", "--insecure", "--max-pin-ttl-s", "0"])
    assert result.exit_code == 2
    assert "max_pin_ttl_s must be positive" in result.output
    result = CliRunner().invoke(main, ["registry", "serve", "--insecure", "--log-level", "loud"])
    assert result.exit_code == 2


def test_serve_on_a_busy_port_fails_cleanly(threaded_registry):
    result = CliRunner().invoke(main, ["registry", "serve", "--insecure", "--listen",
                                       threaded_registry.target, "--metrics-listen", ""])
    assert result.exit_code == 1
    assert "cannot start the registry" in result.output


# ---- `kvbridge registry serve` as a process ---------------------------------------------------


def _kvbridge() -> list[str]:
    script = Path(sys.executable).parent / "kvbridge"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvbridge.cli"]


class Served:
    """A `kvbridge registry serve` subprocess and its JSON log lines (stderr)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen([*_kvbridge(), "registry", "serve", "--insecure", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=full_env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.events: list[dict] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_event(self, name: str, timeout: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout
        for event in self.events:
            if event.get("event") == name:
                return event
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {name} log line; got {self.events}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            event = json.loads(line)  # every line is one JSON object
            self.events.append(event)
            if event.get("event") == name:
                return event

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def served():
    started: list[Served] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Served:
        s = Served(*args, env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.mark.slow
def test_serve_subprocess_serves_and_stops_cleanly_on_sigterm(served, kv):
    proc = served("--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0")
    started = proc.wait_event("registry_started")
    host, port = started["listen"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert started["level"] == "info" and started["recovery_grace_s"] == 31.0
    target = started["listen"]
    with RegistryClient(target) as client:
        client.register_holder(**kv.holder_args("h1"))
        client.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(4)))
    result = CliRunner().invoke(main, ["holders", "list", "--json", "--registry", target])
    assert json_lines(result.output)[0]["lease_count"] == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{started['metrics_port']}/metrics",
                                timeout=5) as resp:
        assert 'kvbridge_registry_leases{state="active"} 1.0' in resp.read().decode()

    sent = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=5) == 0
    assert time.monotonic() - sent < 3
    stopped = proc.wait_event("registry_stopped", timeout=2)
    assert stopped["counts"]["leases_active"] == 1
    assert proc.wait_event("registry_shutting_down", timeout=1)["grace_s"] == 5.0


@pytest.mark.slow
def test_serve_subprocess_runs_grpc_with_kvbridge_defaults_unless_told(served, kv, monkeypatch):
    # gRPC reads GRPC_EXPERIMENTS once, on import: `registry serve` sets kvbridge's default
    # before that (kvbridge.grpc_env), and leaves an operator's value, even empty, alone.
    from kvbridge.grpc_env import DEFAULT_SERVER_EXPERIMENTS

    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    tuned = served("--listen", "127.0.0.1:0", "--metrics-listen", "")
    stock = served("--listen", "127.0.0.1:0", "--metrics-listen", "",
                   env={"GRPC_EXPERIMENTS": ""})
    for proc, expected in ((tuned, DEFAULT_SERVER_EXPERIMENTS), (stock, "")):
        started = proc.wait_event("registry_started")
        assert started["grpc_experiments"] == expected
        assert started["grpc_version"] == grpc.__version__
        with RegistryClient(started["listen"]) as client:  # both serve
            client.register_holder(**kv.holder_args("h1"))
            client.grant_lease(**kv.grant_args("h1", "t1", "c1", kv.tokens(4)))
            assert len(client.list_leases(tenant="t1").leases) == 1


@pytest.mark.slow
def test_serve_subprocess_reads_environment_and_flags_win(served, kv):
    env = {"KVBRIDGE_REGISTRY_LISTEN": "127.0.0.1:0",
           "KVBRIDGE_REGISTRY_METRICS_LISTEN": "",
           "KVBRIDGE_REGISTRY_MAX_PIN_TTL_S": "7",
           "KVBRIDGE_REGISTRY_DEFAULT_PIN_TTL_S": "5",
           "KVBRIDGE_REGISTRY_DEFAULT_HOLDER_TTL_S": "12"}
    proc = served("--default-pin-ttl-s", "2", env=env)
    started = proc.wait_event("registry_started")
    assert started["listen"].startswith("127.0.0.1:")
    assert started["listen"] != "127.0.0.1:50051"  # the env var replaced the default
    assert started["metrics_port"] is None  # metrics disabled by an empty variable
    assert started["recovery_grace_s"] == 8.0  # max pin TTL 7 + 1
    with RegistryClient(started["listen"]) as client:
        reg = client.register_holder(**kv.holder_args("h1"))
        assert seconds(reg.limits.max_pin_ttl) == 7.0
        assert seconds(reg.holder.ttl) == 12.0
        tokens = kv.tokens(4)
        client.grant_lease(**kv.grant_args("h1", "t1", "c1", tokens))
        read = client.acquire_read("t1", "c1", kv.prompt_hashes(tokens))
        assert seconds(read.pin.expires_in) == pytest.approx(2.0, abs=0.5)  # the flag won
    proc.proc.send_signal(signal.SIGINT)
    assert proc.proc.wait(timeout=5) == 0
    proc.wait_event("registry_stopped", timeout=2)


def test_serve_subprocess_with_busy_metrics_port_fails_cleanly():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        result = subprocess.run(
            [*_kvbridge(), "registry", "serve", "--insecure", "--listen", "127.0.0.1:0",
             "--metrics-listen", f"127.0.0.1:{busy.getsockname()[1]}"],
            capture_output=True, text=True, timeout=30,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")})
    finally:
        busy.close()
    assert result.returncode == 1
    assert result.stderr.startswith("Error: cannot start the registry: ")
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


# ---- addresses, timeouts and help texts -------------------------------------------------------

BAD_ADDRESSES = ["nonsense", "host:99999", "a b:c", "", ","]

# (command line up to the address flag, whether '' is a valid value there: none / disabled)
ADDRESS_FLAGS = [
    (["registry", "serve", "--insecure", "--listen"], False),
    (["registry", "serve", "--insecure", "--metrics-listen"], True),
    (["router", "serve", "--insecure", "--listen"], False),
    (["router", "serve", "--insecure", "--metrics-listen"], True),
    (["router", "serve", "--insecure", "--registry"], True),
    (["gateway", "serve", "--insecure", "--listen"], False),
    (["gateway", "serve", "--insecure", "--router"], False),
    (["gateway", "serve", "--insecure", "--registry"], True),
    (["up", "--registry-listen"], False),
    (["up", "--router-listen"], False),
    (["up", "--gateway-listen"], False),
    (["leases", "list", "--registry"], False),
    (["leases", "show", "l-1", "--registry"], False),
    (["holders", "list", "--registry"], False),
    (["instances", "list", "--router"], False),
    (["doctor", "--no-probe", "--registry"], True),
    (["doctor", "--no-probe", "--router"], True),
    (["registry", "demo", "--registry"], True),
    (["engine", "run", "--role", "prefill", "--model", "m", "--registry"], True),
    (["engine", "run", "--role", "prefill", "--model", "m", "--router"], True),
    (["fault-proxy", "--target", "127.0.0.1:1", "--listen"], False),
    (["fault-proxy", "--target"], False),
]


def _no_kvbridge_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVBRIDGE_"):
            monkeypatch.delenv(name)


# Every flag with every malformed address, except '' where it is a valid value (none, or off).
_ADDRESS_CASES = [pytest.param(argv, bad, id=f"{' '.join(argv[:2] + argv[-1:])}={bad!r}")
                  for argv, empty_ok in ADDRESS_FLAGS for bad in BAD_ADDRESSES
                  if not (bad == "" and empty_ok)]


@pytest.mark.parametrize(("argv", "bad"), _ADDRESS_CASES)
def test_malformed_addresses_exit_2_before_anything_starts(
        argv: list[str], bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_kvbridge_env(monkeypatch)
    monkeypatch.chdir(tmp_path)  # `up` and `engine run` would make .kvbridge/ here
    result = CliRunner().invoke(main, [*argv, bad], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and "expected HOST:PORT" in error[0], result.output
    assert "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing started


def test_malformed_address_from_the_environment_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_kvbridge_env(monkeypatch)
    for argv, env in ((["holders", "list"], {"KVBRIDGE_REGISTRY": "host:99999"}),
                      (["registry", "serve", "--insecure"],
                       {"KVBRIDGE_REGISTRY_METRICS_LISTEN": "127.0.0.1:99999"}),
                      (["router", "serve", "--insecure"], {"KVBRIDGE_ROUTER_REGISTRY": ","})):
        result = CliRunner().invoke(main, argv, env=env, catch_exceptions=False)
        assert result.exit_code == 2, (argv, result.output)
        assert "expected HOST:PORT" in result.output


def test_metrics_port_out_of_range_is_a_usage_error_not_an_overflow() -> None:
    result = subprocess.run(
        [*_kvbridge(), "registry", "serve", "--insecure", "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:99999"], capture_output=True, text=True, timeout=30,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")})
    assert result.returncode == 2
    assert "expected HOST:PORT with a port from 0 to 65535, got '127.0.0.1:99999'" in (
        result.stderr)
    assert "Traceback" not in result.stderr and "OverflowError" not in result.stderr


def test_split_hostport_checks_the_port_range() -> None:
    from kvbridge.services.registry._server import split_hostport

    assert split_hostport("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_hostport(":50051") == ("0.0.0.0", 50051)
    assert split_hostport("[::1]:65535") == ("::1", 65535)
    assert split_hostport("registry:50051") == ("registry", 50051)
    for bad in ("127.0.0.1:65536", "127.0.0.1:99999", "h:-1", "h:", "nonsense", "", "a b:1",
                "::1:50051", "h:0x10", "h:\uff11\uff12"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            split_hostport(bad)


def test_client_addresses_need_a_host_and_a_port_from_1() -> None:
    from kvbridge.clients._base import parse_targets

    assert parse_targets("a:1, b:65535") == ["a:1", "b:65535"]
    assert parse_targets("[::1]:50051") == ["[::1]:50051"]
    for bad in (":50051", "a:0", "a:1,b:70000", ",", "", "a:1,nonsense"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            parse_targets(bad)


def test_client_addresses_take_grpc_dns_and_unix_targets() -> None:
    from kvbridge.clients._base import parse_targets

    good = ["dns:///registry.svc:50051", "dns://10.0.0.2:53/registry:50051", "dns:registry:1",
            "unix:/run/kvbridge.sock", "unix:///run/kvbridge.sock", "unix:relative.sock"]
    assert parse_targets(",".join(good)) == good
    for bad in ("dns:///registry", "dns:///:50051", "dns://resolver", "dns:///h:0", "unix:",
                "unix://", "unix:///", "unix:/a b", "a:1,dns:///nope"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            parse_targets(bad)


def test_cli_reaches_a_registry_by_dns_and_unix_targets(tmp_path: Path) -> None:
    """`--registry` passes gRPC's dns:/// and unix: targets through: a real registry served on
    TCP and on a unix socket at once answers the CLI by both."""
    from kvbridge.services.registry import RegistryConfig, create_server

    sock = tmp_path / "registry.sock"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Any:
        server = await create_server(RegistryConfig(listen="127.0.0.1:0", metrics_listen=""))
        assert server.server.add_insecure_port(f"unix:{sock}") == 1
        await server.start()
        client = AsyncRegistryClient(f"unix:{sock}", timeout=5, retries=0)
        await client.register_holder("decode-unix", "127.0.0.1", 5600, 16, "fp", ttl=60)
        await client.close()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(15)
    try:
        for target in (f"dns:///127.0.0.1:{server.port}", f"unix:{sock}", f"unix://{sock}"):
            result = CliRunner().invoke(main, ["holders", "list", "--json", "--registry", target],
                                        catch_exceptions=False)
            assert result.exit_code == 0, (target, result.output)
            rows = [json.loads(line) for line in result.output.splitlines() if line.strip()]
            assert [r["holder_id"] for r in rows] == ["decode-unix"], (target, rows)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_timeout_must_be_positive(timeout: str) -> None:
    for argv in (["leases", "list"], ["holders", "list"], ["instances", "list"]):
        result = CliRunner().invoke(main, [*argv, "--timeout", timeout])
        assert result.exit_code == 2, (argv, result.output)
        assert "Invalid value for '--timeout'" in result.output


def test_every_option_has_help_text() -> None:
    missing = []
    for path in _commands(main):
        command: click.Command = main
        for name in path:
            assert isinstance(command, click.Group)
            command = command.commands[name]
        missing += [f"kvbridge {' '.join(path)} {param.opts[0]}" for param in command.params
                    if isinstance(param, click.Option) and not (param.help or "").strip()]
    assert missing == []


def test_help_texts_name_what_is_easy_to_get_wrong() -> None:
    runner = CliRunner()
    engine = runner.invoke(main, ["engine", "run", "--help"]).output
    assert "0 (the default): 32 on cpu, 16 on cuda" in " ".join(engine.split())
    gateway = runner.invoke(main, ["gateway", "serve", "--help"]).output
    assert "times (0 to 8)" in " ".join(gateway.split())
    auth_help = " ".join(runner.invoke(main, ["auth", "--help"]).output.split())
    assert "KVBRIDGE_AUTH_TOKENS_FILE=FILE" in auth_help
    assert "KVBRIDGE_AUTH_TOKENS, separated by ';'" in auth_help


def test_serve_without_authentication_names_both_token_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _no_kvbridge_env(monkeypatch)
    result = CliRunner().invoke(main, ["registry", "serve", "--listen", "127.0.0.1:0",
                                       "--metrics-listen", ""])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "--auth-tokens-file FILE or KVBRIDGE_AUTH_TOKENS_FILE=FILE" in message
    assert "lines in KVBRIDGE_AUTH_TOKENS separated by ';'" in message
