"""What the end-to-end tests share: free ports, a registry process, the connector's metrics."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# Prefill without its own prefix cache: a turn's history is then read back from decode every
# turn, which is what these tests check (on a busy fleet a prefill's cache no longer holds the
# conversation). test_prefix_caching_e2e.py runs prefill with its cache on.
PREFILL_PREFIX_CACHING = False
# The tests of the read path itself (turns 2+ read back; outputs equal recompute) read by
# the threshold: by measured cost (the connector's default) the tiny model recomputes about as
# fast as it reads, so whether a turn reads would depend on this machine's speed. The cost
# model has its own tests (tests/test_cost_model.py) and runs on real engines in
# `kvbridge bench multiturn`.
READ_BY_THRESHOLD = {"decision": "threshold"}


def free_port() -> int:
    """A port for a process that binds it later: below the ephemeral range (see
    `kvbridge.stack._free_port`), so that vLLM's own port-0 binds cannot take it first."""
    from kvbridge.stack import _free_port

    return _free_port()


def metrics(port: int) -> dict[str, float]:
    # Generous: the endpoint is a thread of a CPU engine that busy-polls its core.
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvbridge_connector") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def engine_series(url: str, prefix: str = "kvbridge_connector"
                  ) -> list[tuple[str, dict[str, str], float]]:
    """The series an engine's own vLLM `/metrics` serves whose names start with `prefix`:
    (name, labels, value)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out = []
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        pairs = re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)
        out.append((name, dict(pairs), float(value)))
    return out


@dataclass
class Registry:
    port: int
    log: Path
    process: subprocess.Popen[bytes] | None = None
    # Security flags (e.g. ["--auth-tokens-file", PATH]); empty: insecure local mode.
    security: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.cli", "registry", "serve",
             *(self.security or ["--insecure"]), "--listen", self.address,
             "--metrics-listen", "", "--max-pin-ttl-s", "10", "--default-pin-ttl-s", "5",
             "--recovery-grace-s", "10", "--log-level", "info"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("ab"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # this start's lines only (a killed one logs none)
            with self.log.open("rb") as f:
                f.seek(offset)
                if b"registry_started" in f.read():
                    return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"registry did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)


def lease_epoch(registry: str, tenant: str, conversation: str, token: str | None = None) -> int:
    """The epoch of the conversation's active lease (0 when it has none)."""
    from kvbridge.clients import RegistryClient
    from kvbridge.registry.v1 import registry_pb2 as pb

    with RegistryClient(registry, timeout=10, token=token) as client:
        leases = client.list_leases(tenant=tenant, conversation_id=conversation).leases
    return max((int(x.epoch) for x in leases if x.state == pb.LEASE_STATE_ACTIVE), default=0)


def wait_for_newer_lease(registry: str, tenant: str, conversation: str, epoch: int,
                         timeout: float = 20.0, token: str | None = None) -> int:
    """Wait until decode's background grant over the last turn is in the registry: an active
    lease of the conversation newer than `epoch`. Returns its epoch."""
    deadline = time.monotonic() + timeout
    while True:
        now = lease_epoch(registry, tenant, conversation, token)
        if now > epoch:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"decode granted no lease over {conversation} in {timeout}s")
        time.sleep(0.1)


def stop(process: subprocess.Popen[str], sig: int, timeout: float) -> None:
    """Stop a process this test started: `sig`, then a kill if it outlives `timeout`."""
    process.send_signal(sig)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
