"""The connector's decision logic (`PrefillReuse`, `DecodeRetention`) without vLLM.

vLLM's Request and BlockPool are replaced by small fakes; the registry is real, served over
gRPC on 127.0.0.1 from its own thread (`ThreadedRegistry`, FakeClock: nothing expires unless a
test says so). Background threads (grants, releases, revocations) are waited for by short,
bounded polling of the registry or of the connector's metrics.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from conftest import ThreadedRegistry

from kvbridge import blockhash, errors
from kvbridge.clients import RegistryClient
from kvbridge.clock import Clock, FakeClock, boot_id, monotonic
from kvbridge.connector._decode import DecodeRetention
from kvbridge.connector._metrics import ConnectorMetrics
from kvbridge.connector._prefill import REMOTE_FIELDS, PrefillReuse
from kvbridge.connector._routed import (
    ROUTED_TRANSIT_SLACK_S,
    BadRoutedRead,
    routed_read,
    verified_read,
)
from kvbridge.connector._settings import ConnectorSettings
from kvbridge.registry.v1 import registry_pb2 as pb

BS = 4
FP = "fp-connector-logic"
TENANT = "acme"
HOLDER = "decode-1"
NIXL_HOST = "10.9.8.7"
NIXL_PORT = 5601
READER = "prefill-1"

_T = TypeVar("_T")


# ---- fakes of vLLM objects ----------------------------------------------------------------------


@dataclass
class FakeStatus:
    name: str


class FakeRequest:
    """The fields of vllm.v1.request.Request the connector reads."""

    def __init__(self, request_id: str, prompt: list[int], output: list[int] | None = None, *,
                 params: dict[str, Any] | None = None, num_computed_tokens: int | None = None,
                 status: str = "RUNNING", cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt)
        self.all_token_ids = list(prompt) + list(output or [])
        # A finished decode request has computed the KV of every token but the last sampled.
        self.num_computed_tokens = (len(self.all_token_ids) - 1 if num_computed_tokens is None
                                    else num_computed_tokens)
        self.kv_transfer_params = params if params is not None else {}
        self.status = FakeStatus(status)
        self.cache_salt = cache_salt
        # vLLM's chained hashes of the full blocks (here kvbridge's, under another fingerprint,
        # salted as vLLM salts them).
        hashes = blockhash.block_hashes(self.all_token_ids, BS, "vllm", cache_salt or "")
        size = blockhash.HASH_SIZE
        self.block_hashes = [hashes[i:i + size] for i in range(0, len(hashes), size)]
        self.mm_features: list[Any] = []
        self.prompt_embeds: Any = None
        self.lora_request: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class FakeBlock:
    block_id: int
    ref_cnt: int = 0


@dataclass
class FakeBlockPool:
    """vLLM's BlockPool as retention uses it: reference counts, touch and free."""

    num_gpu_blocks: int = 64
    blocks: list[FakeBlock] = field(default_factory=list)
    touched: list[list[int]] = field(default_factory=list)
    reported_free: int | None = None  # set to simulate memory pressure

    def __post_init__(self) -> None:
        self.blocks = [FakeBlock(i) for i in range(self.num_gpu_blocks)]

    def touch(self, blocks: list[FakeBlock]) -> None:
        self.touched.append([b.block_id for b in blocks])
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: Any) -> None:
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of block {b.block_id}"
            b.ref_cnt -= 1

    def get_num_free_blocks(self) -> int:
        if self.reported_free is not None:
            return self.reported_free
        return sum(1 for b in self.blocks[1:] if b.ref_cnt == 0)  # block 0: vLLM's null block

    def refs(self, ids: Any) -> list[int]:
        return [self.blocks[i].ref_cnt for i in ids]


# ---- helpers ------------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], _T], what: str, timeout: float = 5.0) -> _T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def sample(metrics: ConnectorMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


def decisions(metrics: ConnectorMetrics, decision: str) -> float:
    return sample(metrics, "kvbridge_connector_decisions_total", decision=decision)


def conv_key(conversation: str) -> dict[str, str]:
    return {"tenant": TENANT, "conversation_id": conversation}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@contextmanager
def paused(registry: ThreadedRegistry) -> Iterator[threading.Event]:
    """Block the registry's event loop (a slow registry) until the block exits or the gate is
    set."""
    gate, entered = threading.Event(), threading.Event()

    def block() -> None:
        entered.set()
        gate.wait(10)

    registry.loop.call_soon_threadsafe(block)
    assert entered.wait(5)
    try:
        yield gate
    finally:
        gate.set()


class RecordingClient(RegistryClient):
    """A real client that remembers the pins it acquired and the releases it made. With
    `acquire_timeout`, AcquireRead gets that deadline instead of the connector's: the RPC
    outlives the scheduling deadline, as when the read pool starts it late."""

    def __init__(self, *args: Any, acquire_timeout: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acquire_timeout = acquire_timeout
        self.pins: list[str] = []
        self.released: list[tuple[str, bool]] = []

    def acquire_read(self, *args: Any, **kwargs: Any) -> pb.AcquireReadResponse:
        if self.acquire_timeout is not None:
            kwargs["timeout"] = self.acquire_timeout
        resp = super().acquire_read(*args, **kwargs)
        if resp.pin.pin_id:
            self.pins.append(resp.pin.pin_id)
        return resp

    def release_read(self, pin_id: str, *, timeout: float | None = None) -> bool:
        ok = super().release_read(pin_id, timeout=timeout)
        self.released.append((pin_id, ok))
        return ok


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def registry() -> Iterator[ThreadedRegistry]:
    reg = ThreadedRegistry()
    yield reg
    reg.close()


@pytest.fixture
def client(registry: ThreadedRegistry) -> Iterator[RegistryClient]:
    with RegistryClient(registry.target, timeout=2.0) as c:
        yield c


@dataclass
class DecodeKit:
    retention: DecodeRetention
    pool: FakeBlockPool
    metrics: ConnectorMetrics
    last_extra: dict[str, Any] | None = None

    def finish(self, request_id: str, conversation: str | None, prompt: list[int],
               output: list[int], block_ids: list[int], *, status: str = "FINISHED_STOPPED",
               groups: int = 1, history_keys: str | None = None) -> FakeRequest:
        params: dict[str, Any] = {}
        if conversation is not None:
            params["kvbridge"] = conv_key(conversation)
            if history_keys is not None:
                params["kvbridge"]["history_keys"] = history_keys
        request = FakeRequest(request_id, prompt, output, params=params, status=status)
        self.last_extra = self.retention.on_finished(request, (list(block_ids),) * groups)
        return request

    def drain_until(self, blocks: int, what: str) -> int:
        """Drain until at least `blocks` blocks are freed; returns how many were."""
        freed = [0]

        def drained() -> bool:
            freed[0] += self.retention.drain()
            return freed[0] >= blocks

        wait_for(drained, what)
        return freed[0]

    def granted(self) -> float:
        return sample(self.metrics, "kvbridge_connector_leases_granted_total")

    def wait_granted(self, n: int) -> None:
        wait_for(lambda: self.granted() >= n, f"{n} lease grant(s)")

    def freed(self, why: str) -> float:
        return sample(self.metrics, "kvbridge_connector_retained_blocks_freed_total", why=why)

    def retained(self) -> float:
        return sample(self.metrics, "kvbridge_connector_retained_blocks")


@contextmanager
def decode_kit(registry: ThreadedRegistry, *, clock: Clock | None = None,
               **settings: Any) -> Iterator[DecodeKit]:
    # retries=1 and a short RPC timeout, as the connector builds its client.
    rpc = RegistryClient(registry.target, timeout=1.0, retries=1)
    config = ConnectorSettings(**{"registry": registry.target, "rpc_timeout_s": 1.0,
                                  "holder_ttl_s": 60.0, "free_watermark": 0.1, **settings})
    metrics = ConnectorMetrics()
    retention = DecodeRetention(config, rpc, holder_id=HOLDER, nixl_host=NIXL_HOST,
                                nixl_port=NIXL_PORT, block_size=BS, fingerprint=FP, tp_size=1,
                                metrics=metrics, clock=clock)
    pool = FakeBlockPool(64)
    retention.bind(pool)
    retention.start()  # registers; its own heartbeats come every 20 s, past any test here
    assert retention.session.registered
    try:
        yield DecodeKit(retention, pool, metrics)
    finally:
        retention.close()
        rpc.close()


@pytest.fixture
def decode(registry: ThreadedRegistry) -> Iterator[DecodeKit]:
    with decode_kit(registry) as kit:
        yield kit


def lease_state(client: RegistryClient, conversation: str) -> int:
    """The state of the conversation's newest lease, revoked or expired ones included."""
    leases = list(client.list_leases(tenant=TENANT, conversation_id=conversation,
                                     include_inactive=True).leases)
    assert leases, f"no lease for {conversation}"
    return max(leases, key=lambda lease: lease.epoch).state


def only_lease(client: RegistryClient, conversation: str) -> pb.Lease:
    leases = list(client.list_leases(tenant=TENANT, conversation_id=conversation,
                                     include_blocks=True).leases)
    assert len(leases) == 1, leases
    return leases[0]


# ---- decode: retention ---------------------------------------------------------------------

PROMPT1 = list(range(21))
OUTPUT1 = [100 + i for i in range(7)]  # 28 tokens, 27 computed: 7 blocks, the last partial


def test_decode_retains_and_grants_exact_lease(decode: DecodeKit, client: RegistryClient):
    table = [5, 6, 7, 8, 9, 10, 11, 12]  # one block more than the computed tokens need
    request = decode.finish("req-1", "c1", PROMPT1, OUTPUT1, table)
    n = request.num_computed_tokens
    assert n == 27
    assert decode.last_extra == {"kvbridge_retained_tokens": 27}
    held = table[: cdiv(n, BS)]
    assert decode.pool.touched == [held]  # exactly cdiv(27, 4) == 7 blocks, touched once
    assert decode.pool.refs(held) == [1] * 7 and decode.pool.refs([12]) == [0]
    assert decode.retained() == 7

    decode.wait_granted(1)
    lease = only_lease(client, "c1")
    assert lease.token_count == n
    assert lease.block_hashes == blockhash.block_hashes(request.all_token_ids[:n], BS, FP,
                                                        include_partial=True)
    assert list(lease.block_ids) == held
    assert lease.holder_id == HOLDER and lease.epoch == 1
    assert lease.remote_request_id == "kvbridge-req-1"
    assert lease.state == pb.LEASE_STATE_ACTIVE
    assert decode.retention.drain() == 0  # nothing reclaimable: nothing freed
    assert decode.pool.refs(held) == [1] * 7


@pytest.mark.parametrize(("sent", "indexed"), [
    (base64.b64encode(b"k" * 32).decode(), True),
    (base64.b64encode(b"k" * 31).decode(), False),  # not whole keys: dropped
    ("not base64!", False),
])
def test_decode_grants_with_the_gateways_history_keys(decode: DecodeKit, client: RegistryClient,
                                                      sent: str, indexed: bool):
    decode.finish("req-h", "c-h", PROMPT1, OUTPUT1, [5, 6, 7, 8, 9, 10, 11], history_keys=sent)
    decode.wait_granted(1)
    lease = only_lease(client, "c-h")  # granted either way: malformed keys are only dropped
    found = client.pin_lease(TENANT, "", history_keys=b"k" * 16)
    assert (found.read.lease.lease_id == lease.lease_id) is indexed
    assert found.match.whole is indexed


def test_decode_length_capped_finish_is_retained(decode: DecodeKit, client: RegistryClient):
    decode.finish("req-cap", "c-cap", PROMPT1, OUTPUT1, [5, 6, 7, 8, 9, 10, 11],
                  status="FINISHED_LENGTH_CAPPED")
    decode.wait_granted(1)
    assert only_lease(client, "c-cap").token_count == 27


@pytest.mark.parametrize(("conversation", "status", "groups"), [
    pytest.param(None, "FINISHED_STOPPED", 1, id="no-conversation-key"),
    pytest.param("c1", "FINISHED_ABORTED", 1, id="aborted"),
    pytest.param("c1", "FINISHED_STOPPED", 2, id="two-kv-cache-groups"),
])
def test_decode_retains_nothing(decode: DecodeKit, client: RegistryClient,
                                conversation: str | None, status: str, groups: int):
    decode.finish("req-x", conversation, PROMPT1, OUTPUT1, [5, 6, 7, 8, 9, 10, 11],
                  status=status, groups=groups)
    assert decode.last_extra is None
    assert decode.pool.touched == []
    assert all(b.ref_cnt == 0 for b in decode.pool.blocks)
    assert decode.retained() == 0
    # A well-formed turn after it is granted; had the first one been submitted, its grant
    # (same single grant thread, submitted earlier) would be there too.
    decode.finish("req-ok", "c-ok", PROMPT1, OUTPUT1, [20, 21, 22, 23, 24, 25, 26])
    decode.wait_granted(1)
    assert decode.granted() == 1
    assert [x.conversation_id for x in client.list_leases(holder_id=HOLDER).leases] == ["c-ok"]


def test_decode_conversation_key_needs_tenant_and_id(decode: DecodeKit):
    request = FakeRequest("req-y", PROMPT1, OUTPUT1, status="FINISHED_STOPPED",
                          params={"kvbridge": {"conversation_id": "c1"}})
    assert decode.retention.on_finished(request, ([5, 6, 7, 8, 9, 10, 11],)) is None
    assert decode.pool.touched == []


def _two_turns(decode: DecodeKit, client: RegistryClient) -> tuple[pb.Lease, list[int]]:
    """Turn 1 (blocks 5..11) then, once its lease exists, nothing else. Returns the lease."""
    turn1 = [5, 6, 7, 8, 9, 10, 11]
    decode.finish("req-1", "c1", PROMPT1, OUTPUT1, turn1)
    decode.wait_granted(1)
    return only_lease(client, "c1"), turn1


def _turn2(decode: DecodeKit) -> tuple[FakeRequest, list[int]]:
    # Turn 2 re-sends turn 1 and adds to it; vLLM's prefix cache shares the 6 full blocks of
    # turn 1, the partial 7th is recomputed into a fresh block.
    prompt2 = PROMPT1 + OUTPUT1 + [200 + i for i in range(10)]
    turn2 = [5, 6, 7, 8, 9, 10, 20, 21, 22, 23, 24]  # 42 computed tokens: 11 blocks
    request = decode.finish("req-2", "c1", prompt2, [300 + i for i in range(5)], turn2)
    assert request.num_computed_tokens == 42
    return request, turn2


def test_decode_newer_turn_supersedes_and_heartbeat_frees(decode: DecodeKit,
                                                         client: RegistryClient):
    lease1, turn1 = _two_turns(decode, client)
    _, turn2 = _turn2(decode)
    decode.wait_granted(2)
    lease2 = only_lease(client, "c1")
    assert lease2.epoch == 2 and lease2.lease_id != lease1.lease_id
    assert client.get_lease(lease1.lease_id).state == pb.LEASE_STATE_SUPERSEDED
    assert decode.pool.refs(range(5, 11)) == [2] * 6  # shared by both turns
    assert decode.pool.refs([11]) == [1] and decode.pool.refs(range(20, 25)) == [1] * 5
    assert sample(decode.metrics, "kvbridge_connector_retained_turns") == 2

    assert decode.retention.drain() == 0  # reclaimable, but not reported yet
    decode.retention.session.heartbeat_once()
    assert decode.retention.drain() == len(turn1)
    assert decode.pool.refs(range(5, 11)) == [1] * 6  # turn 2 still holds them
    assert decode.pool.refs([11]) == [0]
    assert decode.pool.refs(turn2) == [1] * len(turn2)
    assert decode.freed("reclaimed") == len(turn1)
    assert decode.retained() == len(turn2)
    assert sample(decode.metrics, "kvbridge_connector_retained_turns") == 1
    assert decode.retention.drain() == 0  # freed once only

    # The next heartbeat acknowledges the free: the registry forgets the old lease.
    decode.retention.session.heartbeat_once()
    with pytest.raises(errors.LeaseNotFound):
        client.get_lease(lease1.lease_id)
    assert decode.retention.drain() == 0
    assert client.get_lease(lease2.lease_id).state == pb.LEASE_STATE_ACTIVE


def test_decode_never_frees_under_a_live_pin(decode: DecodeKit, client: RegistryClient):
    lease1, turn1 = _two_turns(decode, client)
    # A prefill reader pins turn 1 before turn 2 supersedes it.
    prompt2 = PROMPT1 + OUTPUT1 + [200 + i for i in range(10)]
    read = client.acquire_read(TENANT, "c1", blockhash.block_hashes(prompt2, BS, FP),
                               min_tokens=1, pin_ttl=10.0, reader_id=READER)
    assert read.miss_reason == pb.MISS_REASON_UNSPECIFIED and read.pin.pin_id
    _turn2(decode)
    decode.wait_granted(2)
    assert client.get_lease(lease1.lease_id).pin_count == 1

    for _ in range(2):
        decode.retention.session.heartbeat_once()
        assert decode.retention.drain() == 0
    assert decode.pool.refs(turn1) == [2] * 6 + [1]

    assert client.release_read(read.pin.pin_id) is True
    assert decode.retention.drain() == 0  # not before a heartbeat reports it
    assert decode.pool.refs([11]) == [1]
    decode.retention.session.heartbeat_once()
    assert decode.retention.drain() == len(turn1)
    assert decode.pool.refs(turn1) == [1] * 6 + [0]


def test_decode_grant_failure_frees_at_next_drain(decode: DecodeKit,
                                                  registry: ThreadedRegistry):
    registry.stop()
    table = [5, 6, 7, 8, 9, 10, 11]
    decode.finish("req-1", "c1", PROMPT1, OUTPUT1, table)
    assert decode.pool.refs(table) == [1] * 7  # retained until the grant's outcome is known
    freed = decode.drain_until(1, "the failed grant's blocks to be freed")
    assert freed == 7
    assert decode.pool.refs(table) == [0] * 7
    assert decode.freed("grant_failed") == 7
    assert decode.retained() == 0
    assert decode.granted() == 0
    assert decode.retention.drain() == 0


@contextmanager
def grants_answer_late(registry: ThreadedRegistry, delay: float) -> Iterator[None]:
    """The registry makes each lease at once but answers `delay` seconds later (a slow
    network or an overloaded registry): a holder whose deadline is shorter cannot tell
    whether its grant happened."""
    assert registry.server is not None
    store = registry.server.store
    original = store.grant

    async def late(spec: Any) -> Any:
        grant = await original(spec)
        await asyncio.sleep(delay)
        return grant

    store.grant = late  # type: ignore[method-assign]
    try:
        yield
    finally:
        store.grant = original  # type: ignore[method-assign]


def _settle_pending(kit: DecodeKit) -> None:
    """Heartbeat until the session has settled every grant of unknown outcome."""
    session = kit.retention.session

    def settled() -> bool:
        session.heartbeat_once()
        return not session.pending_grants()

    wait_for(settled, "the grants of unknown outcome to settle")


def test_decode_grant_of_unknown_outcome_keeps_the_blocks_until_resolved(
        registry: ThreadedRegistry, client: RegistryClient):
    """A grant that timed out may have made a lease that readers will use: its blocks are
    kept, and once the grant cannot be running any more the session looks up the lease it
    would have made and adopts it (before: the blocks were freed under a live lease, and the
    next turn read other data)."""
    table = [5, 6, 7, 8, 9, 10, 11]
    with decode_kit(registry, hard_deadline_margin_s=0.2) as kit:
        with grants_answer_late(registry, 1.5):
            kit.finish("req-1", "c1", PROMPT1, OUTPUT1, table)
            wait_for(lambda: kit.retention.session.pending_grants(), "the grant to time out")
            lease = only_lease(client, "c1")  # the registry did make it
            assert lease.state == pb.LEASE_STATE_ACTIVE
            assert kit.retention.drain() == 0
            assert kit.pool.refs(table) == [1] * 7
            assert kit.granted() == 0
            assert sample(kit.metrics, "kvbridge_connector_grants_outcome_unknown_total") == 1
        _settle_pending(kit)
        kit.wait_granted(1)
        assert [h.lease_id for h in kit.retention.session.held()] == [lease.lease_id]
        assert only_lease(client, "c1").lease_id == lease.lease_id  # no second lease made
        assert kit.retention.drain() == 0
        assert kit.pool.refs(table) == [1] * 7
        # An ordinary lease from now on: revoked, it is reported reclaimable and freed.
        client.revoke_lease(lease.lease_id, "test", HOLDER)
        kit.retention.session.heartbeat_once()
        wait_for(lambda: kit.retention.drain() == 7, "the revoked lease's blocks to be freed")
        assert kit.pool.refs(table) == [0] * 7


def test_decode_grant_of_unknown_outcome_dead_within_the_recovery_grace_is_kept() -> None:
    """A grant of unknown outcome whose lease the session finds dead and showing no pin, on a
    registry within its recovery grace (it started empty: pins from before may be live that it
    cannot know about), is held, not freed, until the registry reports it reclaimable. Before,
    the session freed it at once ("dead_unpinned") from the lease's state and pin count."""
    table = [5, 6, 7, 8, 9, 10, 11]
    registry = ThreadedRegistry(skip_grace=False, max_pin_ttl_s=5.0, default_pin_ttl_s=5.0)
    try:
        with RegistryClient(registry.target, timeout=2.0) as client, \
                decode_kit(registry, hard_deadline_margin_s=0.2) as kit:
            with grants_answer_late(registry, 1.5):
                kit.finish("req-1", "c1", PROMPT1, OUTPUT1, table)
                wait_for(lambda: kit.retention.session.pending_grants(),
                         "the grant to time out")
                lease = only_lease(client, "c1")
            revoked = client.revoke_lease(lease.lease_id, "test")
            assert revoked.lease.pin_count == 0 and not revoked.reclaimable
            _settle_pending(kit)
            assert [h.lease_id for h in kit.retention.session.held()] == [lease.lease_id]
            assert kit.retention.drain() == 0
            assert kit.pool.refs(table) == [1] * 7
            registry.advance(6.0)  # the grace (max pin TTL + 1) is over: it knows every pin
            kit.retention.session.heartbeat_once()
            wait_for(lambda: kit.retention.drain() == 7, "the revoked lease's blocks to be freed")
            assert kit.pool.refs(table) == [0] * 7
    finally:
        registry.close()


def test_decode_grant_of_unknown_outcome_that_made_no_lease_is_freed_and_not_made_late(
        registry: ThreadedRegistry, client: RegistryClient, monkeypatch: pytest.MonkeyPatch):
    """A grant that timed out without making a lease (the registry ran it past its deadline,
    so refused it) frees its blocks once the session has looked, and no lease is made for it
    later: a late lease would supersede a newer turn's."""
    from kvbridge.services.registry._servicer import RegistryServicer

    original = RegistryServicer._grant_spec

    def slow(self: Any, request: Any, holder_id: str) -> Any:
        if request.conversation_id == "c1":
            time.sleep(1.3)  # past the grant's 1 s deadline: the registry refuses it
        return original(self, request, holder_id)

    table = [5, 6, 7, 8, 9, 10, 11]
    with decode_kit(registry, hard_deadline_margin_s=0.2) as kit:
        monkeypatch.setattr(RegistryServicer, "_grant_spec", slow)
        kit.finish("req-1", "c1", PROMPT1, OUTPUT1, table)
        wait_for(lambda: kit.retention.session.pending_grants(), "the grant to time out")
        assert kit.pool.refs(table) == [1] * 7
        monkeypatch.setattr(RegistryServicer, "_grant_spec", original)
        kit.finish("req-2", "c1", PROMPT1 + OUTPUT1 + [9], [8], [21, 22, 23, 24, 25, 26, 27, 28])
        kit.wait_granted(1)  # the newer turn's lease
        newer = only_lease(client, "c1")
        _settle_pending(kit)
        wait_for(lambda: kit.retention.drain() == 7, "the first turn's blocks to be freed")
        assert kit.freed("grant_unresolved") == 7
        assert kit.pool.refs(table) == [0] * 7
        leases = list(client.list_leases(tenant=TENANT, conversation_id="c1",
                                         include_inactive=True).leases)
        assert [lease.lease_id for lease in leases] == [newer.lease_id]
        assert leases[0].state == pb.LEASE_STATE_ACTIVE


def test_decode_unresolved_grant_is_freed_at_its_hard_deadline(
        decode: DecodeKit, registry: ThreadedRegistry):
    """A grant whose outcome stays unknown (the registry is gone) keeps its blocks until the
    hard deadline a lease of that grant could have had, then frees them."""
    table = [5, 6]  # 7 computed tokens: 2 blocks
    with grants_answer_late(registry, 1.5):
        decode.finish("req-1", "c1", PROMPT1[:6], OUTPUT1[:2], table)
        wait_for(lambda: decode.retention.session.pending_grants(), "the grant to time out")
    registry.stop()
    session = decode.retention.session
    (request_id,) = session.pending_grants()
    pending = session._pending[request_id]
    # sent + timeout + margin + max lifetime + the registry's max pin TTL
    assert pending.hard_deadline - monotonic() > decode.retention.settings.max_lifetime_s
    session.heartbeat_once()  # unreachable: nothing resolved, nothing freed
    assert decode.retention.drain() == 0 and decode.pool.refs(table) == [1] * 2
    pending.hard_deadline = monotonic()  # as if that time had come
    session.heartbeat_once()
    assert session.pending_grants() == []
    wait_for(lambda: decode.retention.drain() == 2, "the unresolved grant's blocks to be freed")
    assert decode.freed("grant_unresolved") == 2
    assert decode.pool.refs(table) == [0] * 2


def test_decode_retains_one_turn_per_request_id(decode: DecodeKit, client: RegistryClient):
    """A request id that finishes twice while its first turn is retained (ids are the
    client's to choose) does not take that turn's place: the first keeps its blocks and lease,
    the second's blocks go back at once."""
    decode.finish("req-1", "c1", PROMPT1, OUTPUT1, [1, 2, 3, 4, 5, 6, 7])
    decode.wait_granted(1)
    second = [11, 12, 13, 14, 15, 16, 17]
    decode.finish("req-1", "c2", PROMPT1, OUTPUT1, second)
    assert decode.last_extra is None
    assert decode.pool.refs(second) == [0] * 7 and decode.pool.refs([1, 2]) == [1, 1]
    assert decode.retained() == 7
    only_lease(client, "c1")


def test_decode_retains_no_more_turns_than_its_grants_can_settle(registry: ThreadedRegistry):
    """With grants slow to settle, at most max_unsettled_grants turns wait for a lease: a turn
    finishing past that is not retained (its blocks go back at once), and retention resumes
    once the grants settle."""
    with decode_kit(registry, max_unsettled_grants=2) as kit, \
            grants_answer_late(registry, 0.5):
        kit.finish("req-1", "c1", PROMPT1, OUTPUT1, [1, 2, 3, 4, 5, 6, 7])
        kit.finish("req-2", "c2", PROMPT1, OUTPUT1, [11, 12, 13, 14, 15, 16, 17])
        third = [21, 22, 23, 24, 25, 26, 27]
        kit.finish("req-3", "c3", PROMPT1, OUTPUT1, third)
        assert kit.last_extra is None
        assert kit.pool.refs(third) == [0] * 7
        assert sample(kit.metrics, "kvbridge_connector_retention_skipped_total") == 1
        kit.wait_granted(2)
        kit.finish("req-4", "c4", PROMPT1, OUTPUT1, third)
        assert kit.last_extra is not None
        kit.wait_granted(3)


def test_registry_runs_no_grant_past_its_deadline(registry: ThreadedRegistry, holder: pb.Holder,
                                                  client: RegistryClient,
                                                  monkeypatch: pytest.MonkeyPatch):
    """A grant whose handler starts only after its deadline passed is not made: so a holder
    whose grant timed out knows how old a lease of it could be."""
    from kvbridge.services.registry._servicer import RegistryServicer

    original = RegistryServicer._grant_spec

    def slow(self: Any, request: Any, holder_id: str) -> Any:
        if request.conversation_id == "late":
            time.sleep(0.5)  # the registry is busy: the caller's 0.3 s run out meanwhile
        return original(self, request, holder_id)

    monkeypatch.setattr(RegistryServicer, "_grant_spec", slow)
    hashes = blockhash.block_hashes(list(range(8)), BS, FP, include_partial=True)
    with (RegistryClient(registry.target, timeout=0.3, retries=0) as hasty,
          pytest.raises(errors.DeadlineExceeded)):
        hasty.grant_lease(HOLDER, TENANT, "late", "r-late", [1, 2], 8, hashes)
    client.get_server_info()  # the registry has finished the late call by now
    assert list(client.list_leases(tenant=TENANT, conversation_id="late",
                                   include_inactive=True).leases) == []


def test_decode_watermark_revokes_oldest_leases(decode: DecodeKit, client: RegistryClient):
    a, b, c = [1, 2, 3], [4, 5, 6], [7, 8]
    decode.finish("req-a", "ca", list(range(10)), [50, 51], a)  # 11 computed: 3 blocks
    decode.finish("req-b", "cb", list(range(10)), [60, 61], b)
    decode.finish("req-c", "cc", list(range(6)), [70, 71], c)  # 7 computed: 2 blocks
    decode.wait_granted(3)
    ids = {conv: only_lease(client, conv).lease_id for conv in ("ca", "cb", "cc")}

    decode.retention.check_watermark()  # 55 of 63 blocks free: above the 10 % watermark
    # Memory pressure: the 10 % watermark of 63 blocks is 6; none are free, so the two oldest
    # leases (3 + 3 blocks) go and the newest stays.
    decode.pool.reported_free = 0
    decode.retention.check_watermark()
    freed = decode.drain_until(6, "revoked leases to be freed")
    assert freed == 6
    assert decode.pool.refs(a + b) == [0] * 6
    assert decode.pool.refs(c) == [1, 1]
    assert decode.freed("reclaimed") == 6
    assert client.get_lease(ids["ca"]).state == pb.LEASE_STATE_REVOKED
    assert client.get_lease(ids["cb"]).state == pb.LEASE_STATE_REVOKED
    assert client.get_lease(ids["cc"]).state == pb.LEASE_STATE_ACTIVE


def test_decode_watermark_waits_for_pinned_victim(decode: DecodeKit, client: RegistryClient):
    table = [1, 2, 3]
    prompt = list(range(10))
    decode.finish("req-a", "ca", prompt, [50, 51], table)
    decode.wait_granted(1)
    lease_id = only_lease(client, "ca").lease_id
    read = client.acquire_read(TENANT, "ca", blockhash.block_hashes(prompt + [50, 51], BS, FP),
                               min_tokens=1, reader_id=READER)
    assert read.pin.pin_id

    decode.pool.reported_free = 0
    decode.retention.check_watermark()
    wait_for(lambda: client.get_lease(lease_id).state == pb.LEASE_STATE_REVOKED,
             "the memory-pressure revocation")
    decode.retention.session.heartbeat_once()
    assert decode.retention.drain() == 0  # pinned: kept
    assert decode.pool.refs(table) == [1, 1, 1]
    assert client.release_read(read.pin.pin_id)
    decode.retention.session.heartbeat_once()
    assert decode.retention.drain() == 3
    assert decode.pool.refs(table) == [0, 0, 0]


def test_decode_make_room_defers_preemption_only_while_blocks_are_coming(
        decode: DecodeKit, client: RegistryClient):
    """vLLM asks `has_pending_block_frees` when it cannot allocate: yes while revoked, unpinned
    leases are being freed (the scheduler retries next step instead of preempting), no once
    nothing is on its way, and no for a revoked lease a reader still pins."""
    a, b = [1, 2, 3], [4, 5, 6]
    decode.finish("req-a", "ca", list(range(10)), [50, 51], a)
    decode.finish("req-b", "cb", list(range(10)), [60, 61], b)
    decode.wait_granted(2)
    assert decode.retention.make_room() is False  # plenty free: nothing revoked, nothing due
    prompt_b = list(range(10)) + [60, 61]
    read = client.acquire_read(TENANT, "cb", blockhash.block_hashes(prompt_b, BS, FP),
                               min_tokens=1, reader_id=READER)
    assert read.pin.pin_id
    decode.pool.reported_free = 0  # memory pressure: both leases are revoked, b is pinned
    answers = []

    def freed_a() -> bool:
        answers.append(decode.retention.make_room())
        return decode.pool.refs(a) == [0, 0, 0]

    wait_for(freed_a, "the unpinned revoked lease to be freed")
    assert answers[-1] is True  # the call that freed a's blocks says so
    assert decode.pool.refs(b) == [1, 1, 1]
    wait_for(lambda: lease_state(client, "cb") == pb.LEASE_STATE_REVOKED, "b's revocation")
    wait_for(lambda: decode.retention.make_room() is False,
             "nothing on its way but a pinned lease")
    assert decode.pool.refs(b) == [1, 1, 1]
    assert client.release_read(read.pin.pin_id)
    decode.retention.session.heartbeat_once()
    assert decode.retention.make_room() is True  # b's blocks freed by this call
    assert decode.pool.refs(b) == [0, 0, 0]
    assert decode.retention.make_room() is False


def test_decode_make_room_lets_vllm_preempt_while_the_registry_is_down(
        registry: ThreadedRegistry):
    """With the registry unreachable, a revocation cannot free anything before decode's hard
    deadline: `has_pending_block_frees` must not keep saying yes (vLLM then skips scheduling
    instead of preempting, and generation stalls for the whole outage). It says yes only for a
    short wait on each revocation round, and a failed round is not retried at once."""
    clock = FakeClock()
    with decode_kit(registry, clock=clock) as decode:
        table = [1, 2, 3]
        decode.finish("req-a", "ca", list(range(10)), [50, 51], table)
        decode.wait_granted(1)
        registry.stop()
        decode.pool.reported_free = 0  # memory pressure: the lease would be revoked
        answers = []
        for _ in range(60):  # 3 s, a scheduler step every 50 ms
            answers.append(decode.retention.make_room())
            # Each round fails on its own (real) RPC time; the retention's clock waits for it.
            wait_for(lambda: not decode.retention._revoking, "the revocation round to fail")
            clock.advance(0.05)
        assert answers.count(True) < len(answers) / 3, answers
        assert answers[-4:].count(False) >= 1
        assert decode.pool.refs(table) == [1, 1, 1]  # nothing freed without the registry


def test_decode_arriving_request_makes_room_at_once(registry: ThreadedRegistry,
                                                    client: RegistryClient):
    """A request that needs more blocks than are free does not wait for leases to expire: the
    oldest idle ones are revoked as it arrives, just enough for it (plus the watermark)."""
    with decode_kit(registry, headroom_window_s=0.0) as decode:
        a, b, c = list(range(1, 21)), list(range(21, 41)), list(range(41, 61))  # 20 blocks each
        for rid, conv, table in (("req-a", "ca", a), ("req-b", "cb", b), ("req-c", "cc", c)):
            decode.finish(rid, conv, list(range(78)), [1, 2], table)  # 79 computed: 20 blocks
        decode.wait_granted(3)
        # 3 of 63 blocks free, under the 6-block watermark: the grant thread revoked the oldest
        # lease by itself, with no scheduler step.
        wait_for(lambda: decode.retention.drain() == 20, "the watermark revocation")
        assert decode.pool.get_num_free_blocks() == 23
        assert lease_state(client, "ca") == pb.LEASE_STATE_REVOKED
        # A request of 80 tokens none of them hold needs 20 blocks (+1) on top of the 6-block
        # watermark: 27 > 23.
        decode.retention.on_new_request(FakeRequest("req-new", list(range(1000, 1080))))
        wait_for(lambda: decode.retention.drain() == 20, "room for the arriving request")
        assert decode.pool.refs(b) == [0] * 20
        assert decode.pool.refs(c) == [1] * 20  # the newest lease stays: 43 free is enough
        assert lease_state(client, "cb") == pb.LEASE_STATE_REVOKED
        assert lease_state(client, "cc") == pb.LEASE_STATE_ACTIVE
        assert sample(decode.metrics, "kvbridge_connector_leases_revoked_total",
                      outcome="freed") == 2
        assert sample(decode.metrics, "kvbridge_connector_memory_revocations_total",
                      cause="demand") == 2
        # Once the request has its blocks, its demand is gone, and with no headroom window
        # nothing more is revoked.
        decode.retention.allocated("req-new")
        decode.pool.reported_free = 10
        decode.retention.check_watermark()
        time.sleep(0.2)
        assert decode.retention.drain() == 0
        assert lease_state(client, "cc") == pb.LEASE_STATE_ACTIVE


def test_decode_headroom_makes_room_before_the_next_arrival(decode: DecodeKit,
                                                            client: RegistryClient):
    """Once a 21-block request has arrived, retention keeps 21 blocks free on top of the
    watermark: turns retained later push out the oldest leases as their grants land, so the
    next such request finds room and waits for no revocation."""
    decode.retention.on_new_request(FakeRequest("req-big", list(range(80))))  # 21 blocks
    decode.retention.allocated("req-big")
    assert decode.retention.headroom() == 21
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(5)]  # 10 blocks each
    for i, table in enumerate(tables):
        decode.finish(f"req-{i}", f"c{i}", list(range(38)), [1, 2], table)  # 39 computed
        decode.wait_granted(i + 1)
    # 63 - 50 = 13 free after five turns; the watermark (6) plus the headroom (21) needs 27:
    # the two oldest leases go, with no request waiting and no scheduler step.
    freed = decode.drain_until(20, "the headroom revocations")
    assert freed == 20
    assert [lease_state(client, f"c{i}") for i in range(5)] == (
        [pb.LEASE_STATE_REVOKED] * 2 + [pb.LEASE_STATE_ACTIVE] * 3)
    assert sample(decode.metrics, "kvbridge_connector_memory_revocations_total",
                  cause="headroom") >= 1
    assert sample(decode.metrics, "kvbridge_connector_memory_revocations_total",
                  cause="demand") == 0
    assert decode.pool.get_num_free_blocks() == 33
    # The next request of the same size arrives: room is there, nothing is revoked for it.
    decode.retention.on_new_request(FakeRequest("req-big-2", list(range(80))))
    time.sleep(0.2)
    assert decode.retention.drain() == 0
    assert sample(decode.metrics, "kvbridge_connector_memory_revocations_total",
                  cause="demand") == 0


def test_decode_headroom_follows_recent_demand(registry: ThreadedRegistry) -> None:
    """The headroom is the peak of waiting demand within the window, capped at headroom_cap of
    the pool, and falls back once the peak leaves the window."""
    clock = FakeClock()
    with decode_kit(registry, clock=clock, headroom_window_s=0.3, headroom_cap=0.25) as decode:
        retention = decode.retention
        assert retention.headroom() == 0
        retention.on_new_request(FakeRequest("r1", list(range(20))))  # 6 blocks
        retention.on_new_request(FakeRequest("r2", list(range(8))))  # 3 more, both waiting
        assert retention.headroom() == 9
        retention.allocated("r1")
        retention.allocated("r2")
        retention.on_new_request(FakeRequest("r3", list(range(200))))  # 51 blocks: capped
        assert retention.headroom() == 15  # a quarter of 63
        retention.allocated("r3")
        clock.advance(0.35)
        assert retention.headroom() == 0
        assert sample(decode.metrics, "kvbridge_connector_headroom_blocks") == 0


def test_decode_later_turn_demands_only_what_it_adds(decode: DecodeKit,
                                                     client: RegistryClient) -> None:
    """A later turn of a conversation retained here finds its history in decode's prefix
    cache: its demand (and so the headroom kept for such arrivals) counts only the blocks past
    the full blocks held, not its whole prompt. So does any request whose prompt starts with
    blocks a retained turn holds, such as another conversation's shared system prompt."""
    history = list(range(38))
    decode.finish("req-1", "ca", history, [1, 2], list(range(1, 11)))  # 39 computed: 10 blocks
    decode.wait_granted(1)
    later = history + [1, 2] + list(range(100, 120))  # 60 tokens: 15 blocks, 9 of them held
    params = {"kvbridge": conv_key("ca")}
    decode.retention.on_new_request(FakeRequest("req-2", later, params=params))
    assert decode.retention.headroom() == cdiv(60, BS) + 1 - 39 // BS  # 7, not 16
    decode.retention.request_done("req-2")
    # Another conversation (or none) that shares the first 5 blocks, then goes its own way.
    shared = history[:22] + list(range(200, 238))  # 60 tokens: token 21 is in block 5
    for rid, extra in (("req-3", {"params": {"kvbridge": conv_key("cb")}}), ("req-3b", {})):
        decode.retention.on_new_request(FakeRequest(rid, shared, **extra))
        assert decode.retention._demand[rid][0] == cdiv(60, BS) + 1 - 5
        decode.retention.request_done(rid)
    # A prompt that differs in its first token holds nothing here: all of it counts.
    decode.retention.on_new_request(FakeRequest("req-3c", [999] + later[1:]))
    assert decode.retention._demand["req-3c"][0] == cdiv(60, BS) + 1
    decode.retention.request_done("req-3c")
    # Under another cache salt the same tokens are other KV: nothing held either.
    decode.retention.on_new_request(FakeRequest("req-3d", later, params=params, cache_salt="s"))
    assert decode.retention._demand["req-3d"][0] == cdiv(60, BS) + 1
    decode.retention.request_done("req-3d")
    assert decode.retention._demand == {} and decode.retention._active == {}
    # Once its lease is revoked for memory, the retained turn is on its way out: not counted.
    decode.pool.reported_free = 0
    decode.retention.check_watermark()
    wait_for(lambda: lease_state(client, "ca") == pb.LEASE_STATE_REVOKED, "the revocation")
    decode.retention.on_new_request(FakeRequest("req-4", later, params=params))
    assert decode.retention._demand["req-4"][0] == cdiv(60, BS) + 1
    decode.retention.request_done("req-4")
    decode.pool.reported_free = None  # the pressure is over
    # A prompt of exactly nine full blocks, all held: vLLM computes its last token, so the
    # last of them is not taken from the cache (8 found, 10 needed).
    decode.finish("req-d", "cd", history, [1, 2], list(range(20, 30)))
    decode.wait_granted(2)
    decode.retention.on_new_request(FakeRequest("req-5", history[:36],
                                                params={"kvbridge": conv_key("cd")}))
    assert decode.retention._demand["req-5"][0] == 9 + 1 - 8


def test_decode_watermark_spares_a_conversation_with_a_request_here(
        decode: DecodeKit, client: RegistryClient) -> None:
    """The oldest lease's conversation has its next turn on decode: that turn reuses the
    retained blocks, so revoking them frees nothing. The next oldest goes instead, and the
    spared one is a victim again once its request has left."""
    a, b, c = [1, 2, 3], [4, 5, 6], [7, 8]
    decode.finish("req-a", "ca", list(range(10)), [50, 51], a)
    decode.finish("req-b", "cb", list(range(10)), [60, 61], b)
    decode.finish("req-c", "cc", list(range(6)), [70, 71], c)
    decode.wait_granted(3)
    ids = {conv: only_lease(client, conv).lease_id for conv in ("ca", "cb", "cc")}
    decode.retention.on_new_request(FakeRequest("req-a2", list(range(12)),
                                                params={"kvbridge": conv_key("ca")}))
    decode.retention.allocated("req-a2")  # running: still "here" until it finishes
    # Watermark 6 + headroom 2 (req-a2's demand: 4 blocks, 2 held) - 5 free: a deficit of 3.
    assert decode.retention.headroom() == 2
    decode.pool.reported_free = 5
    decode.retention.check_watermark()
    wait_for(lambda: decode.retention.drain() == 3, "the next oldest lease to be freed")
    assert decode.pool.refs(b) == [0, 0, 0] and decode.pool.refs(a) == [1, 1, 1]
    assert client.get_lease(ids["cb"]).state == pb.LEASE_STATE_REVOKED
    assert client.get_lease(ids["ca"]).state == pb.LEASE_STATE_ACTIVE
    decode.retention.request_done("req-a2")
    decode.retention.check_watermark()  # still short: now "ca" is the oldest victim
    wait_for(lambda: decode.retention.drain() == 3, "the spared lease to be freed")
    assert client.get_lease(ids["ca"]).state == pb.LEASE_STATE_REVOKED
    assert client.get_lease(ids["cc"]).state == pb.LEASE_STATE_ACTIVE


def test_decode_victims_count_only_the_blocks_they_free(decode: DecodeKit,
                                                        client: RegistryClient) -> None:
    """Turns share the blocks of a common prefix (a system prompt the next conversation found
    in decode's prefix cache). Revoking one frees only the blocks no other turn holds: the
    watermark takes as many victims as the room needs, and spares a turn whose blocks are all
    held by newer ones, since revoking it would free nothing."""
    system = list(range(32))  # 8 full blocks
    decode.finish("req-p", "cp", system[:15], [7, 7], [1, 2, 3, 4])  # 16 computed: blocks 1-4
    decode.finish("req-a", "ca", system, [50, 51, 52, 53, 54, 55, 56, 57, 58],
                  list(range(1, 11)))  # 40 computed: 10 blocks, 9 and 10 its own
    decode.finish("req-b", "cb", system, [60, 61, 62, 63, 64, 65, 66, 67, 68],
                  list(range(1, 9)) + [21, 22])  # blocks 1-8 shared with ca's turn
    decode.finish("req-c", "cc", list(range(500, 511)), [70], [31, 32, 33])
    decode.wait_granted(4)
    ids = {conv: only_lease(client, conv).lease_id for conv in ("cp", "ca", "cb", "cc")}
    # Watermark 6, 3 free: a deficit of 3. The oldest ("cp") holds only blocks newer turns
    # hold too; "ca" frees 2 (9, 10); "cb" then frees 6 (21, 22 and 5-8, which "cp" does not
    # hold): 8 blocks freed, 20 references dropped.
    decode.pool.reported_free = 3
    decode.retention.check_watermark()
    freed = decode.drain_until(20, "the revoked turns to be freed")
    assert freed == 20  # the blocks released: 10 + 10 references
    assert [client.get_lease(ids[c]).state for c in ("cp", "ca", "cb", "cc")] == [
        pb.LEASE_STATE_ACTIVE, pb.LEASE_STATE_REVOKED, pb.LEASE_STATE_REVOKED,
        pb.LEASE_STATE_ACTIVE]
    assert decode.pool.refs(range(1, 5)) == [1] * 4  # still cp's
    assert decode.pool.refs([5, 6, 7, 8, 9, 10, 21, 22]) == [0] * 8
    assert sample(decode.metrics, "kvbridge_connector_memory_revocations_total",
                  cause="demand") == 1  # one round took both


def test_decode_revoked_turn_counts_only_its_own_blocks_as_freeing(
        decode: DecodeKit, client: RegistryClient) -> None:
    """Between its revocation and the drain that frees it, a turn counts as about to free only
    the blocks no other turn holds: the blocks it shares stay, so room is still short and the
    next turn goes at once."""
    system = list(range(16))  # 4 full blocks, shared
    decode.finish("req-a", "ca", system + [20, 21, 22, 23], [50, 51, 52, 53, 54],
                  [1, 2, 3, 4, 5, 6])  # 24 computed: 6 blocks, 5 and 6 its own
    decode.finish("req-b", "cb", system + [30, 31, 32, 33], [60, 61, 62, 63, 64],
                  [1, 2, 3, 4, 7, 8])
    decode.finish("req-c", "cc", list(range(500, 511)), [70], [31, 32, 33])
    decode.wait_granted(3)
    decode.pool.reported_free = 4  # watermark 6: a deficit of 2, which "ca" meets (5, 6)
    decode.retention.check_watermark()
    wait_for(lambda: lease_state(client, "ca") == pb.LEASE_STATE_REVOKED
             and not decode.retention._revoking, "the first revocation")
    assert lease_state(client, "cb") == pb.LEASE_STATE_ACTIVE
    # Not drained yet: "ca" is about to free 2 blocks, not 6. With 2 free, room is short by 2.
    decode.pool.reported_free = 2
    decode.retention.check_watermark()
    wait_for(lambda: lease_state(client, "cb") == pb.LEASE_STATE_REVOKED, "the second")
    assert lease_state(client, "cc") == pb.LEASE_STATE_ACTIVE
    decode.drain_until(12, "both turns to be freed")
    assert decode.pool.refs(range(1, 9)) == [0] * 8


def test_decode_keeps_the_prefix_an_arriving_request_was_counted_as_finding(
        decode: DecodeKit, client: RegistryClient) -> None:
    """A request that finds its prefix held by a retained turn (here another conversation's)
    needs fewer blocks; that turn is no victim until the request has its blocks, else the room
    made would be short by that prefix."""
    prefix = list(range(16))
    decode.finish("req-x", "cx", prefix, [1], [1, 2, 3, 4])  # 16 computed: 4 full blocks
    decode.finish("req-y", "cy", list(range(500, 511)), [70], [11, 12, 13])
    decode.wait_granted(2)
    decode.retention.on_new_request(FakeRequest("req-r", prefix + list(range(100, 108))))
    assert decode.retention._demand["req-r"][0] == cdiv(24, BS) + 1 - 4
    decode.pool.reported_free = 4  # watermark 6 + 3 waiting - 4 free: "cx" is the oldest
    decode.retention.check_watermark()
    wait_for(lambda: lease_state(client, "cy") == pb.LEASE_STATE_REVOKED, "the revocation")
    assert lease_state(client, "cx") == pb.LEASE_STATE_ACTIVE
    wait_for(lambda: decode.retention.drain() == 3, "its blocks to be freed")
    decode.retention.allocated("req-r")  # it holds the prefix itself now
    decode.retention.check_watermark()
    wait_for(lambda: lease_state(client, "cx") == pb.LEASE_STATE_REVOKED, "the next one")


def test_decode_spares_turns_whose_blocks_requests_hold_and_searches_again_on_change(
        decode: DecodeKit, client: RegistryClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running request holds every block of the only leased turn: revoking it would free
    nothing, so it stays. Under that pressure the search is not rerun at every step, only
    once something changes: here the request leaves and its blocks are freed."""
    table = [1, 2, 3]
    decode.finish("req-a", "ca", list(range(10)), [50, 51], table)
    decode.wait_granted(1)
    decode.pool.touch([decode.pool.blocks[b] for b in table])  # a running request's refs
    searched = []
    original = decode.retention._freed_with

    def counting(leaving: Any, blocks: Any) -> int:
        searched.append(1)
        return original(leaving, blocks)

    monkeypatch.setattr(decode.retention, "_freed_with", counting)
    decode.pool.reported_free = 0
    decode.retention.check_watermark()
    first = len(searched)
    assert first >= 2  # what is leaving, then the one candidate
    for _ in range(5):
        decode.retention.check_watermark()
    assert len(searched) == first + 5  # only the cheap count of what is leaving
    assert lease_state(client, "ca") == pb.LEASE_STATE_ACTIVE
    # The request finishes, as vLLM does it: the connector hears of it first (a search then
    # still finds the blocks held), and its blocks are freed after, unannounced (deferred, or
    # preempted): the pool's free count moving is what says to search again.
    decode.retention.request_done("req-running")
    decode.retention.check_watermark()
    assert lease_state(client, "ca") == pb.LEASE_STATE_ACTIVE
    decode.pool.free_blocks(decode.pool.blocks[b] for b in table)
    decode.retention.check_watermark()  # the same changes, the same free count: no search
    assert not decode.retention._revoked  # victims are picked before the call returns
    assert lease_state(client, "ca") == pb.LEASE_STATE_ACTIVE
    decode.pool.reported_free = 3  # the pool's count, now that they are free
    decode.retention.check_watermark()
    wait_for(lambda: lease_state(client, "ca") == pb.LEASE_STATE_REVOKED, "the revocation")


def test_decode_pinned_victim_is_not_picked_twice(decode: DecodeKit, client: RegistryClient):
    """A revoked lease under a pin stays until the pin ends; the next pass picks another."""
    a, b = [1, 2, 3], [4, 5, 6]
    prompt = list(range(10))
    decode.finish("req-a", "ca", prompt, [50, 51], a)
    decode.wait_granted(1)
    decode.finish("req-b", "cb", prompt, [60, 61], b)
    decode.wait_granted(2)
    ids = {conv: only_lease(client, conv).lease_id for conv in ("ca", "cb")}
    read = client.acquire_read(TENANT, "ca", blockhash.block_hashes(prompt + [50, 51], BS, FP),
                               min_tokens=1, reader_id=READER)
    decode.pool.reported_free = 4  # watermark 6: a deficit of 2, met by the oldest lease
    decode.retention.check_watermark()
    wait_for(lambda: client.get_lease(ids["ca"]).state == pb.LEASE_STATE_REVOKED,
             "the pinned lease's revocation")
    wait_for(lambda: not decode.retention._revoking, "the revocation to finish")
    assert decode.retention.drain() == 0  # pinned: kept
    decode.retention.check_watermark()  # still short: the next oldest goes, not "ca" again
    wait_for(lambda: decode.retention.drain() == 3, "the second lease to be freed")
    assert decode.pool.refs(b) == [0, 0, 0]
    assert decode.pool.refs(a) == [1, 1, 1]
    assert client.get_lease(ids["cb"]).state == pb.LEASE_STATE_REVOKED
    client.release_read(read.pin.pin_id)
    decode.retention.session.heartbeat_once()
    assert decode.retention.drain() == 3
    assert decode.pool.refs(a) == [0, 0, 0]


def test_decode_reclaim_reported_before_grant_is_recorded(decode: DecodeKit,
                                                          client: RegistryClient):
    """The heartbeat thread may report a lease reclaimable between the session's grant
    returning and the grant thread recording it; its blocks must still be freed."""
    session = decode.retention.session
    grant_rpc = session.grant

    def grant_then_interleaved_heartbeat(*args: Any, **kwargs: Any) -> pb.Lease | None:
        lease = grant_rpc(*args, **kwargs)
        assert lease is not None
        client.revoke_lease(lease.lease_id, "operator")  # dies at once...
        session.heartbeat_once()  # ...and a heartbeat reports it, before _grant records it
        return lease

    session.grant = grant_then_interleaved_heartbeat  # type: ignore[method-assign]
    table = [5, 6, 7, 8, 9, 10, 11]
    decode.finish("req-1", "c1", PROMPT1, OUTPUT1, table)
    decode.wait_granted(1)
    assert session.held() == []  # the session handed it over and forgot it
    assert decode.retention.drain() == len(table)
    assert decode.pool.refs(table) == [0] * 7
    assert decode.retained() == 0


# ---- prefill: reuse ---------------------------------------------------------------------------

LEASE_TOKENS = list(range(1000, 1038))  # 38 tokens: 9 full blocks and a partial one of 2
LEASE_BLOCKS = list(range(101, 111))
EXTRA = [500 + i for i in range(10)]


@pytest.fixture
def holder(client: RegistryClient) -> pb.Holder:
    return client.register_holder(holder_id=HOLDER, nixl_host=NIXL_HOST, nixl_port=NIXL_PORT,
                                  block_size=BS, engine_fingerprint=FP, ttl=60.0).holder


def grant(client: RegistryClient, conversation: str, tokens: list[int],
          first_block: int = 101) -> pb.Lease:
    blocks = list(range(first_block, first_block + cdiv(len(tokens), BS)))
    return client.grant_lease(
        HOLDER, TENANT, conversation, f"kvbridge-dec-{conversation}", blocks, len(tokens),
        blockhash.block_hashes(tokens, BS, FP, include_partial=True)).lease


@dataclass
class PrefillKit:
    reuse: PrefillReuse
    metrics: ConnectorMetrics
    client: RegistryClient

    def request(self, request_id: str, prompt: list[int], conversation: str = "c1",
                **params: Any) -> FakeRequest:
        kv = {"do_remote_decode": True, "kvbridge": conv_key(conversation), **params}
        request = FakeRequest(request_id, prompt, params=kv, num_computed_tokens=0)
        self.reuse.on_new_request(request)
        return request

    def resolve(self, request: FakeRequest, computed: int = 0) -> bool:
        """Ask until decided (the AcquireRead runs on the connector's pool)."""
        out: list[bool] = []

        def decided() -> bool:
            value = self.reuse.resolve(request, computed)
            if value is not None:
                out.append(value)
            return bool(out)

        wait_for(decided, "a prefill decision")
        return out[0]

    def decision(self, name: str) -> float:
        return decisions(self.metrics, name)


def make_prefill(target: str, threshold: int = 8, client: RegistryClient | None = None,
                 clock: Clock | None = None, **overrides: Any) -> PrefillKit:
    overrides.setdefault("read_deadline_s", 5.0)  # generous: only the deadline tests shorten it
    settings = ConnectorSettings(registry=target, **overrides)
    rpc = client or RegistryClient(target, timeout=settings.rpc_timeout_s, retries=1)
    metrics = ConnectorMetrics()
    reuse = PrefillReuse(settings, rpc, reader_id=READER, block_size=BS, fingerprint=FP,
                         threshold=threshold, metrics=metrics, clock=clock)
    return PrefillKit(reuse, metrics, rpc)


@pytest.fixture
def prefill(registry: ThreadedRegistry, holder: pb.Holder) -> Iterator[PrefillKit]:
    kit = make_prefill(registry.target)
    yield kit
    kit.reuse.close()
    kit.client.close()


def pins(client: RegistryClient, lease_id: str) -> int:
    return client.get_lease(lease_id).pin_count


def wait_unpinned(client: RegistryClient, lease_id: str) -> None:
    wait_for(lambda: pins(client, lease_id) == 0, "the pin to be released")


def no_remote_fields(params: dict[str, Any]) -> bool:
    return not any(name in params for name in REMOTE_FIELDS)


def test_prefill_miss_without_lease(prefill: PrefillKit):
    prompt = LEASE_TOKENS + EXTRA
    request = prefill.request("p-1", prompt)
    assert prefill.resolve(request) is False
    assert no_remote_fields(request.kv_transfer_params)
    assert prefill.decision("miss_no_lease") == 1
    assert sample(prefill.metrics, "kvbridge_connector_recomputed_tokens_total") == len(prompt)
    assert prefill.reuse.resolve(request, 0) is False  # decided once; no decision again
    assert prefill.decision("miss_no_lease") == 1


@pytest.mark.parametrize("gateway_releases", [True, False])
def test_prefill_decided_before_any_read_leaves_the_pin_to_a_gateway_that_releases_it(
        routed_prefill: PrefillKit, client: RegistryClient, gateway_releases: bool):
    """A turn decided before any read (here: too short to read) needs no pin. A gateway that
    releases routed pins itself once prefill answers gets the pin left to it, and the answer
    says so: no call from inside the engine next to its compute. Otherwise (an older gateway)
    the engine releases it, as before."""
    lease = grant(client, "c1", LEASE_TOKENS)
    read = routed_read(client.pin_lease(TENANT, "c1", pin_ttl=10.0, reader_id=READER),
                       monotonic(), gateway_releases=gateway_releases)
    assert (read.get("released_by") == "gateway") is gateway_releases
    request = routed_prefill.request("p-short", list(range(7)),  # threshold 8
                                     kvbridge={**conv_key("c1"), "read": read})
    assert routed_prefill.reuse.resolve(request, 0) is False
    assert routed_prefill.decision("short_prompt") == 1
    outcome = routed_prefill.reuse.finished("p-short")
    assert outcome is not None and outcome["kvbridge_decision"] == "short_prompt"
    if gateway_releases:
        assert outcome["kvbridge_pin_left"] is True
        time.sleep(0.2)  # a release would be on its way by now
        assert pins(client, lease.lease_id) == 1
        assert client.release_read(read["pin_id"])  # the gateway's release
    else:
        assert "kvbridge_pin_left" not in outcome
        wait_unpinned(client, lease.lease_id)


def test_prefill_pin_left_to_the_gateway_is_released_if_its_request_is_never_asked_about(
        routed_prefill: PrefillKit, client: RegistryClient):
    """Decisions taken on arrival wait for the scheduler's question in a bounded table; one
    dropped from it (its request aborted before it was scheduled, say) never reaches an answer
    that tells the gateway the pin was left to it: the engine releases that pin itself."""
    lease = grant(client, "c1", LEASE_TOKENS)
    read = routed_read(client.pin_lease(TENANT, "c1", pin_ttl=10.0, reader_id=READER),
                       monotonic(), gateway_releases=True)
    routed_prefill.request("p-first", list(range(7)), kvbridge={**conv_key("c1"), "read": read})
    time.sleep(0.1)
    assert pins(client, lease.lease_id) == 1  # left to the gateway
    for i in range(4096):
        routed_prefill.request(f"p-{i}", list(range(7)), kvbridge=conv_key("c1"))
    wait_unpinned(client, lease.lease_id)


@pytest.mark.parametrize(("prompt", "n_blocks", "usable"), [
    pytest.param(LEASE_TOKENS + EXTRA, 10, 38, id="exact-with-partial-block"),
    pytest.param(LEASE_TOKENS[:36] + [7, 7] + EXTRA, 9, 36, id="partial-block-differs"),
    pytest.param(LEASE_TOKENS[:17] + [7] + LEASE_TOKENS[18:] + EXTRA, 4, 16,
                 id="edited-inside-block-4"),
])
def test_prefill_hit_names_verified_blocks(prefill: PrefillKit, client: RegistryClient,
                                           prompt: list[int], n_blocks: int, usable: int):
    lease = grant(client, "c1", LEASE_TOKENS)
    request = prefill.request("p-1", prompt)
    assert prefill.resolve(request) is True
    params = request.kv_transfer_params
    assert params["remote_block_ids"] == [LEASE_BLOCKS[:n_blocks]]
    assert n_blocks == cdiv(usable, BS)
    assert params["remote_num_tokens"] == usable
    assert params["remote_engine_id"] == HOLDER
    assert params["remote_request_id"] == lease.remote_request_id
    assert (params["remote_host"], params["remote_port"]) == (NIXL_HOST, NIXL_PORT)
    assert params["tp_size"] == 1
    assert params["do_remote_decode"] is True and params["kvbridge"] == conv_key("c1")
    assert prefill.decision("hit") == 1
    assert pins(client, lease.lease_id) == 1  # pinned until the read is done


def test_prefill_read_of_the_whole_prompt_leaves_its_last_token_to_compute(
        prefill: PrefillKit, client: RegistryClient):
    """A turn sent again with the same prompt (a retry, a regeneration) matches the lease in
    full: the read stops one token short, since the scheduler must have a token to compute (a
    synchronous read naming every token would leave it none)."""
    prompt = LEASE_TOKENS[:36]  # nine full blocks, all in the lease
    lease = grant(client, "c1", prompt)
    request = prefill.request("p-1", prompt)
    assert prefill.resolve(request) is True
    params = request.kv_transfer_params
    assert params["remote_num_tokens"] == len(prompt) - 1
    assert params["remote_block_ids"] == [LEASE_BLOCKS[:9]]  # the last block holds token 34
    assert prefill.reuse._outcomes["p-1"]["kvbridge_recomputed_tokens"] == 1
    assert pins(client, lease.lease_id) == 1


def test_prefill_cache_salt_is_part_of_the_hash(prefill: PrefillKit, client: RegistryClient):
    grant(client, "c1", LEASE_TOKENS)
    kv = {"do_remote_decode": True, "kvbridge": conv_key("c1")}
    request = FakeRequest("p-salt", LEASE_TOKENS + EXTRA, params=kv, num_computed_tokens=0,
                          cache_salt="other-tenant-salt")
    prefill.reuse.on_new_request(request)
    assert prefill.resolve(request) is False
    assert prefill.decision("miss_hash_mismatch") == 1
    assert no_remote_fields(request.kv_transfer_params)


def test_prefill_lora_adapter_is_part_of_the_hash(prefill: PrefillKit, client: RegistryClient):
    """KV computed under one LoRA adapter is never reused for a prompt under another, or
    under the base model: the adapter's name is folded into the hashes on both sides."""
    from types import SimpleNamespace

    from kvbridge.connector._settings import kv_scope

    under_a = SimpleNamespace(lora_name="adapter-a", lora_int_id=1, lora_path="/a")
    lease_hashes = blockhash.block_hashes(LEASE_TOKENS, BS, f"{FP}/lora:adapter-a",
                                          include_partial=True)
    lease = client.grant_lease(HOLDER, TENANT, "c1", "kvbridge-dec-c1",
                               list(range(101, 101 + cdiv(len(LEASE_TOKENS), BS))),
                               len(LEASE_TOKENS), lease_hashes).lease
    kv = {"do_remote_decode": True, "kvbridge": conv_key("c1")}
    for request_id, lora, expected in [
            ("p-base", None, False), ("p-b", SimpleNamespace(lora_name="adapter-b"), False),
            ("p-a", under_a, True)]:
        request = FakeRequest(request_id, LEASE_TOKENS + EXTRA, params=dict(kv),
                              num_computed_tokens=0)
        request.lora_request = lora  # type: ignore[attr-defined]
        assert kv_scope(request, FP) == (FP if lora is None else f"{FP}/lora:{lora.lora_name}",
                                         "")
        prefill.reuse.on_new_request(request)
        assert prefill.resolve(request) is expected, request_id
    assert prefill.decision("miss_hash_mismatch") == 2
    # The trailing partial block is verified under the adapter too: all 38 tokens are read.
    assert request.kv_transfer_params["remote_num_tokens"] == len(LEASE_TOKENS)
    assert pins(client, lease.lease_id) == 1


def test_prefill_lora_prompt_never_reads_a_base_model_partial_block(
        registry: ThreadedRegistry, holder: pb.Holder, client: RegistryClient):
    """A lease of a single, partial block (no full block to chain from): its hash depends on
    the engine, salt and adapter alone, and the reader checks it under its own adapter."""
    from types import SimpleNamespace

    kit = make_prefill(registry.target, threshold=1)
    try:
        tokens = [1000, 1001, 1002]  # 3 tokens, block size 4: one partial block
        lease = client.grant_lease(HOLDER, TENANT, "c-part", "kvbridge-dec-c-part", [101], 3,
                                   blockhash.block_hashes(tokens, BS, FP,
                                                          include_partial=True)).lease
        kv = {"do_remote_decode": True, "kvbridge": conv_key("c-part")}
        for request_id, lora, expected in [
                ("p-lora", SimpleNamespace(lora_name="adapter-a"), False),
                ("p-base", None, True)]:
            request = FakeRequest(request_id, tokens + EXTRA, params=dict(kv),
                                  num_computed_tokens=0)
            request.lora_request = lora  # type: ignore[attr-defined]
            kit.reuse.on_new_request(request)
            assert kit.resolve(request) is expected, request_id
            assert ("remote_block_ids" in request.kv_transfer_params) is expected
            kit.reuse.finished(request_id)
        wait_unpinned(client, lease.lease_id)
    finally:
        kit.reuse.close()
        kit.client.close()


def test_multimodal_requests_are_neither_read_nor_retained(prefill: PrefillKit,
                                                          decode: DecodeKit,
                                                          client: RegistryClient):
    """An image's placeholder tokens are the same whatever the image: hashes of token ids
    cannot tell two images apart, so such a request recomputes, and its turn is not leased."""
    grant(client, "c1", LEASE_TOKENS)
    kv = {"do_remote_decode": True, "kvbridge": conv_key("c1")}
    request = FakeRequest("p-image", LEASE_TOKENS + EXTRA, params=kv, num_computed_tokens=0)
    request.mm_features = [object()]  # type: ignore[attr-defined]
    prefill.reuse.on_new_request(request)
    assert prefill.reuse.resolve(request, 0) is False
    assert prefill.decision("unsupported_inputs") == 1
    assert no_remote_fields(request.kv_transfer_params)
    finished = FakeRequest("d-image", list(range(10)), [50, 51],
                           params={"kvbridge": conv_key("c-image")}, status="FINISHED_STOPPED")
    finished.mm_features = [object()]  # type: ignore[attr-defined]
    assert decode.retention.on_finished(finished, ([1, 2, 3],)) is None
    assert decode.pool.refs([1, 2, 3]) == [0, 0, 0]
    assert not list(client.list_leases(tenant=TENANT, conversation_id="c-image").leases)


def test_prefill_releases_a_routed_pin_it_will_not_read_for(prefill: PrefillKit,
                                                           client: RegistryClient):
    """A turn the gateway pinned while routing, whose prompt this engine will not read for
    (too short here), gives its pin back at once instead of holding the lease for its TTL."""
    grant(client, "c1", LEASE_TOKENS)
    pinned = client.pin_lease(TENANT, "c1", reader_id="gateway")
    assert pinned.read.pin.pin_id
    lease_id = pinned.read.lease.lease_id
    assert pins(client, lease_id) == 1
    params = {"do_remote_decode": True,
              "kvbridge": {**conv_key("c1"), "read": {"pin_id": pinned.read.pin.pin_id}}}
    short = FakeRequest("p-short", list(range(7)), params=params, num_computed_tokens=0)
    prefill.reuse.on_new_request(short)
    wait_unpinned(client, lease_id)  # on arrival, before the scheduler asks
    assert prefill.reuse.resolve(short, 0) is False
    assert prefill.decision("short_prompt") == 1


def test_reads_that_waited_for_the_connection_are_not_learned(prefill: PrefillKit,
                                                              client: RegistryClient):
    """The first read from a decode engine opens NIXL's connection to it; a read that started
    before that one finished waited for the connection too: neither is what a read costs. A
    read started after is learned."""
    grant(client, "c1", LEASE_TOKENS)
    grant(client, "c2", LEASE_TOKENS, first_block=201)
    grant(client, "c3", LEASE_TOKENS, first_block=301)
    first = prefill.request("p-1", LEASE_TOKENS + EXTRA, conversation="c1")
    waiting = prefill.request("p-2", LEASE_TOKENS + EXTRA, conversation="c2")
    assert prefill.resolve(first) is True and prefill.resolve(waiting) is True
    assert prefill.reuse.read_done("p-1", ok=True) == HOLDER
    assert prefill.reuse.read_done("p-2", ok=True) == HOLDER
    assert prefill.reuse.cost._read.samples == 0
    later = prefill.request("p-3", LEASE_TOKENS + EXTRA, conversation="c3")
    assert prefill.resolve(later) is True
    prefill.reuse.read_done("p-3", ok=True)
    assert prefill.reuse.cost._read.samples == 1


def test_prefill_read_done_ok_releases_and_counts(prefill: PrefillKit, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    prompt = LEASE_TOKENS + EXTRA
    request = prefill.request("p-1", prompt)
    assert prefill.resolve(request) is True
    prefill.reuse.read_done("p-1", ok=True)
    params = request.kv_transfer_params
    assert "remote_block_ids" not in params and params["remote_num_tokens"] == 0
    wait_unpinned(client, lease.lease_id)
    m = prefill.metrics
    assert sample(m, "kvbridge_connector_reused_tokens_total") == 38
    assert sample(m, "kvbridge_connector_recomputed_tokens_total") == len(EXTRA)
    assert sample(m, "kvbridge_connector_transfer_seconds_count") == 1
    assert prefill.decision("transfer_failed") == 0
    prefill.reuse.read_done("p-1", ok=True)  # a second notification changes nothing
    assert sample(m, "kvbridge_connector_reused_tokens_total") == 38
    # The outcome goes back in the prefill response's kv_transfer_params, once.
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None and outcome["kvbridge_transfer_ms"] >= 0
    assert 0 <= outcome["kvbridge_lookup_ms"] < 5000
    timings = ("kvbridge_transfer_ms", "kvbridge_lookup_ms")
    assert {k: v for k, v in outcome.items() if k not in timings} == {
        "kvbridge_decision": "hit", "kvbridge_reused_tokens": 38,
        "kvbridge_recomputed_tokens": len(EXTRA), "kvbridge_read_source": "lookup",
        "kvbridge_local_tokens": 0, "kvbridge_lease_whole": True}
    assert prefill.reuse.finished("p-1") is None


@pytest.mark.parametrize("diverge", [0, 1, 5])
def test_prefill_says_whether_the_prompt_holds_the_whole_lease(
        prefill: PrefillKit, client: RegistryClient, diverge: int):
    """The gateway's lookup by content continues a conversation only when the prompt holds
    all of the lease's tokens (a regenerated answer's lease shares the history, not the
    answer): prefill says so from the hashes it checked, and reads the shared part either
    way."""
    grant(client, "c1", LEASE_TOKENS)
    lease = LEASE_TOKENS[:len(LEASE_TOKENS) - diverge] + [7] * diverge
    request = prefill.request("p-1", lease + EXTRA)
    assert prefill.resolve(request) is True
    prefill.reuse.read_done("p-1", ok=True)
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None and outcome["kvbridge_decision"] == "hit"
    assert outcome["kvbridge_lease_whole"] is (diverge == 0)
    shared = len(LEASE_TOKENS) if diverge == 0 else (len(LEASE_TOKENS) - diverge) // BS * BS
    assert outcome["kvbridge_reused_tokens"] == shared


def test_prefill_read_done_failed_counts_recompute(prefill: PrefillKit, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    prompt = LEASE_TOKENS + EXTRA
    request = prefill.request("p-1", prompt)
    assert prefill.resolve(request) is True
    prefill.reuse.read_done("p-1", ok=False)
    assert "remote_block_ids" not in request.kv_transfer_params
    assert request.kv_transfer_params["remote_num_tokens"] == 0
    wait_unpinned(client, lease.lease_id)
    m = prefill.metrics
    assert sample(m, "kvbridge_connector_reused_tokens_total") == 0
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None and outcome.pop("kvbridge_lookup_ms") >= 0
    assert outcome == {
        "kvbridge_decision": "transfer_failed", "kvbridge_reused_tokens": 0,
        "kvbridge_recomputed_tokens": len(prompt), "kvbridge_read_source": "lookup",
        "kvbridge_local_tokens": 0, "kvbridge_lease_whole": True}
    # The 10 tokens past the lease, then the 38 the failed read should have brought.
    assert sample(m, "kvbridge_connector_recomputed_tokens_total") == len(prompt)
    assert prefill.decision("transfer_failed") == 1
    assert sample(m, "kvbridge_connector_transfer_seconds_count") == 0


def test_prefill_decline_undoes_the_hit(prefill: PrefillKit, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    request = prefill.request("p-1", LEASE_TOKENS + EXTRA)
    assert prefill.resolve(request) is True
    prefill.reuse.decline(request)
    assert no_remote_fields(request.kv_transfer_params)
    wait_unpinned(client, lease.lease_id)
    assert prefill.decision("declined_by_engine") == 1
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None
    assert (outcome["kvbridge_reused_tokens"], outcome["kvbridge_recomputed_tokens"]) == (
        0, len(LEASE_TOKENS + EXTRA))


def test_prefill_hit_declined_for_the_local_cache_counts_those_tokens_as_local(
        prefill: PrefillKit, client: RegistryClient):
    """The scheduler kept a local hit reaching as far as the read would: the hit's tokens
    come from this engine's own prefix cache, not recomputed."""
    grant(client, "c1", LEASE_TOKENS)
    request = prefill.request("p-1", LEASE_TOKENS + EXTRA)
    assert prefill.resolve(request, computed=16) is True
    prefill.reuse.decline(request, "local_cache")
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None and outcome["kvbridge_decision"] == "local_cache"
    assert (outcome["kvbridge_local_tokens"], outcome["kvbridge_reused_tokens"],
            outcome["kvbridge_recomputed_tokens"]) == (38, 0, len(EXTRA))
    assert sample(prefill.metrics, "kvbridge_connector_recomputed_tokens_total") == len(EXTRA)
    assert sample(prefill.metrics, "kvbridge_connector_local_tokens_total") == 38


def test_prefill_finished_after_hit_releases_pin(prefill: PrefillKit, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    request = prefill.request("p-1", LEASE_TOKENS + EXTRA)
    assert prefill.resolve(request) is True
    assert pins(client, lease.lease_id) == 1
    prefill.reuse.finished("p-1")
    wait_unpinned(client, lease.lease_id)


def test_prefill_aborted_during_its_read_keeps_the_pin_until_the_read_ends(
        prefill: PrefillKit, client: RegistryClient):
    """A request that ends (aborted) after its asynchronous READ went to the worker keeps its
    pin until the read is reported done: released at once, the lease could be reclaimed and
    decode could reuse the blocks while NIXL still copies them."""
    lease = grant(client, "c1", LEASE_TOKENS)
    request = prefill.request("p-1", LEASE_TOKENS + EXTRA)
    assert prefill.resolve(request) is True
    prefill.reuse.read_sent("p-1")  # in this step's metadata: the worker posts the READ
    prefill.reuse.finished("p-1")  # aborted meanwhile
    time.sleep(0.2)  # a release would have gone out by now
    assert pins(client, lease.lease_id) == 1
    assert prefill.reuse.read_done("p-1", ok=True) == HOLDER  # vLLM reports the READ over
    wait_unpinned(client, lease.lease_id)
    assert prefill.reuse.read_done("p-1", ok=True) is None  # once


@pytest.mark.parametrize(("lease_tokens", "prompt", "threshold", "computed", "decision"), [
    # Decode holds 38 tokens, 32 are in prefill's own prefix cache: 6 to read, fewer than 8.
    pytest.param(LEASE_TOKENS, LEASE_TOKENS + EXTRA, 8, 32, "below_threshold",
                 id="local-cache-leaves-too-few"),
    pytest.param(LEASE_TOKENS, LEASE_TOKENS + EXTRA, 8, 40, "local_cache",
                 id="local-cache-covers-all"),
    # The registry counts the partial block (9 tokens >= 9) and pins; the prompt differs in
    # it, so only 8 tokens are usable.
    pytest.param(LEASE_TOKENS[:9], LEASE_TOKENS[:8] + [7] + EXTRA, 9, 0, "below_threshold",
                 id="partial-block-mismatch-drops-below"),
])
def test_prefill_below_threshold_releases_pin(registry: ThreadedRegistry, holder: pb.Holder,
                                              client: RegistryClient, lease_tokens: list[int],
                                              prompt: list[int], threshold: int,
                                              computed: int, decision: str):
    # The threshold decides (by cost, no read measured yet, any stretch would be read).
    kit = make_prefill(registry.target, threshold=threshold, client=RecordingClient(
        registry.target, timeout=1.0, retries=1), decision="threshold")
    try:
        lease = grant(client, "c1", lease_tokens)
        request = kit.request("p-1", prompt)
        assert kit.resolve(request, computed) is False
        assert no_remote_fields(request.kv_transfer_params)
        assert kit.decision(decision) == 1
        recording = kit.client
        assert isinstance(recording, RecordingClient)
        assert len(recording.pins) == 1  # a pin was granted...
        wait_for(lambda: recording.released, "the release")
        assert recording.released == [(recording.pins[0], True)]  # ...and handed back
        assert pins(client, lease.lease_id) == 0
        assert sample(kit.metrics, "kvbridge_connector_recomputed_tokens_total") == (
            len(prompt) - computed)
    finally:
        kit.reuse.close()
        kit.client.close()


def test_prefill_registry_side_minimum_is_a_miss(prefill: PrefillKit, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    prompt = LEASE_TOKENS[:4] + [7] + LEASE_TOKENS[5:] + EXTRA  # only block 0 matches
    request = prefill.request("p-1", prompt)
    assert prefill.resolve(request) is False
    assert prefill.decision("miss_below_minimum") == 1
    assert pins(client, lease.lease_id) == 0


def test_prefill_decision_on_arrival_counts_the_local_cache_as_local(prefill: PrefillKit):
    """A request decided on arrival (too short here) is counted when the scheduler first asks,
    with what its prefix cache holds: local, not recomputed; an aborted one is forgotten."""
    short = prefill.request("p-short", list(range(7)))
    assert prefill.decision("short_prompt") == 0  # not counted before the scheduler asks
    assert prefill.reuse.resolve(short, 4) is False
    outcome = prefill.reuse.finished("p-short")
    assert outcome is not None
    assert (outcome["kvbridge_local_tokens"], outcome["kvbridge_recomputed_tokens"]) == (4, 3)
    assert sample(prefill.metrics, "kvbridge_connector_recomputed_tokens_total") == 3
    prefill.request("p-gone", list(range(7)))
    assert prefill.reuse.finished("p-gone") is None
    assert not prefill.reuse._early


def test_prefill_short_prompt_and_foreign_requests_skip_the_registry(prefill: PrefillKit):
    short = prefill.request("p-short", list(range(7)))  # threshold 8
    assert prefill.reuse.resolve(short, 0) is False
    assert prefill.decision("short_prompt") == 1
    for request_id, params in [("p-decode", {"kvbridge": conv_key("c1")}),
                               ("p-nokey", {"do_remote_decode": True}),
                               ("p-has-remote", {"do_remote_decode": True,
                                                 "kvbridge": conv_key("c1"),
                                                 "remote_block_ids": [[1]]})]:
        request = FakeRequest(request_id, LEASE_TOKENS, params=params, num_computed_tokens=0)
        prefill.reuse.on_new_request(request)
        assert prefill.reuse.resolve(request, 0) is False
    total = sum(s.value for metric in prefill.metrics.decisions.collect()
                for s in metric.samples if s.name.endswith("_total"))
    assert total == 1  # only the short prompt was a decision


def test_prefill_declines_pin_within_margin(client: RegistryClient):
    # A registry whose pins last at most 1 s: below the 2 s margin the reader asks for.
    reg = ThreadedRegistry(max_pin_ttl_s=1.0, default_pin_ttl_s=1.0)
    try:
        with RegistryClient(reg.target, timeout=2.0) as direct:
            direct.register_holder(holder_id=HOLDER, nixl_host=NIXL_HOST, nixl_port=NIXL_PORT,
                                   block_size=BS, engine_fingerprint=FP, ttl=60.0)
            lease = grant(direct, "c1", LEASE_TOKENS)
            kit = make_prefill(reg.target, pin_ttl_s=10.0, pin_margin_s=2.0)
            try:
                request = kit.request("p-1", LEASE_TOKENS + EXTRA)
                assert kit.resolve(request) is False
                assert kit.decision("pin_margin") == 1
                assert no_remote_fields(request.kv_transfer_params)
                wait_unpinned(direct, lease.lease_id)
            finally:
                kit.reuse.close()
                kit.client.close()
    finally:
        reg.close()


def test_prefill_hit_asked_about_again_stands_only_while_its_pin_does(
        registry: ThreadedRegistry, holder: pb.Holder, client: RegistryClient):
    """The scheduler asks again about a request it could not allocate blocks for: the hit
    stands while the pin has more than the margin left, and is withdrawn (fields stripped,
    pin released, counted as recomputed) once it has not."""
    lease = grant(client, "c1", LEASE_TOKENS)
    clock = FakeClock()
    kit = make_prefill(registry.target, clock=clock, pin_ttl_s=2.5, pin_margin_s=2.0)
    try:
        request = kit.request("p-1", LEASE_TOKENS + EXTRA)
        assert kit.resolve(request) is True
        assert kit.reuse.resolve(request, 0) is True  # asked again at once: still a hit
        assert request.kv_transfer_params["remote_num_tokens"] == 38
        clock.advance(0.6)  # the pin now has less than the 2 s margin left
        assert kit.reuse.resolve(request, 0) is False
        assert no_remote_fields(request.kv_transfer_params)
        assert kit.decision("pin_margin_when_asked_again") == 1
        outcome = kit.reuse.finished("p-1")
        assert outcome is not None
        assert outcome["kvbridge_decision"] == "pin_margin_when_asked_again"
        assert outcome["kvbridge_reused_tokens"] == 0
        wait_unpinned(client, lease.lease_id)
    finally:
        kit.reuse.close()
        kit.client.close()


def test_prefill_registry_unreachable_recomputes():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    target = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nobody listens: connections are refused
    kit = make_prefill(target, rpc_timeout_s=1.0)
    try:
        prompt = LEASE_TOKENS + EXTRA
        request = kit.request("p-1", prompt)
        assert kit.resolve(request) is False
        assert kit.decision("registry_error") == 1
        assert no_remote_fields(request.kv_transfer_params)
        assert sample(kit.metrics, "kvbridge_connector_recomputed_tokens_total") == len(prompt)
    finally:
        kit.reuse.close()
        kit.client.close()


def test_prefill_silent_registry_hits_the_deadline():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # accepts, never answers
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    target = f"127.0.0.1:{sock.getsockname()[1]}"
    rpc = RecordingClient(target, timeout=1.0, retries=1, acquire_timeout=1.0)
    clock = FakeClock()
    kit = make_prefill(target, client=rpc, clock=clock, read_deadline_s=0.2)
    try:
        request = kit.request("p-1", LEASE_TOKENS + EXTRA)
        started = clock.monotonic()
        assert kit.reuse.resolve(request, 0) is None  # pending, before the deadline
        clock.advance(0.15)
        assert kit.reuse.resolve(request, 0) is None  # still pending: time alone decides
        clock.advance(0.1)  # past the 0.2 s deadline
        assert kit.resolve(request) is False
        assert clock.monotonic() - started >= 0.15
        assert kit.decision("deadline") == 1
        assert no_remote_fields(request.kv_transfer_params)
        assert kit.reuse.resolve(request, 0) is False
    finally:
        kit.reuse.close()
        rpc.close()
        sock.close()


def test_prefill_slow_registry_deadline_then_late_pin_is_released(
        registry: ThreadedRegistry, holder: pb.Holder, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    recording = RecordingClient(registry.target, timeout=5.0, retries=1, acquire_timeout=5.0)
    clock = FakeClock()
    kit = make_prefill(registry.target, client=recording, clock=clock, read_deadline_s=0.3)
    try:
        with paused(registry):
            request = kit.request("p-1", LEASE_TOKENS + EXTRA)
            assert kit.reuse.resolve(request, 0) is None
            clock.advance(0.35)  # past the 0.3 s deadline
            assert kit.resolve(request) is False  # the deadline passed, the RPC is pending
            assert kit.decision("deadline") == 1
            assert no_remote_fields(request.kv_transfer_params)
            assert recording.pins == []
        wait_for(lambda: recording.released, "the late pin's release")
        assert len(recording.pins) == 1
        assert recording.released == [(recording.pins[0], True)]
        assert pins(client, lease.lease_id) == 0
        assert no_remote_fields(request.kv_transfer_params)
    finally:
        kit.reuse.close()
        recording.close()


def test_prefill_finished_while_pending_releases_pin_later(
        registry: ThreadedRegistry, holder: pb.Holder, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    recording = RecordingClient(registry.target, timeout=5.0, retries=1)
    kit = make_prefill(registry.target, client=recording)
    try:
        with paused(registry):
            request = kit.request("p-1", LEASE_TOKENS + EXTRA)
            assert kit.reuse.resolve(request, 0) is None
            kit.reuse.finished("p-1")  # e.g. aborted while its AcquireRead is in flight
            assert recording.pins == []
        wait_for(lambda: recording.released, "the pin acquired after finish to be released")
        assert len(recording.pins) == 1
        assert recording.released == [(recording.pins[0], True)]
        assert pins(client, lease.lease_id) == 0
        assert kit.reuse.resolve(request, 0) is False
        assert no_remote_fields(request.kv_transfer_params)
    finally:
        kit.reuse.close()
        recording.close()


# ---- prefill reading through the routing service -------------------------------------------------


def test_prefill_reads_through_a_router(registry: ThreadedRegistry, holder: pb.Holder,
                                        client: RegistryClient):
    """kvbridge.router points reads at the routing service: same decisions, same blocks, and
    the pin is released through it."""
    import asyncio as _asyncio

    from kvbridge.clients._router import RouterClient
    from kvbridge.clock import FakeClock
    from kvbridge.services.router import RouterConfig, create_server

    loop = _asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Any:
        server = await create_server(RouterConfig(listen="127.0.0.1:0", metrics_listen="",
                                                  registry=registry.target), clock=FakeClock())
        await server.start()
        return server

    router = _asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    target = f"127.0.0.1:{router.port}"
    kit = make_prefill(registry.target, client=RouterClient(target, timeout=1.0, retries=1),
                       router=target)  # type: ignore[arg-type]
    try:
        lease = grant(client, "c1", LEASE_TOKENS)
        request = kit.request("p-1", LEASE_TOKENS + EXTRA)
        assert kit.resolve(request) is True
        assert request.kv_transfer_params["remote_block_ids"] == [LEASE_BLOCKS]
        assert pins(client, lease.lease_id) == 1
        kit.reuse.read_done("p-1", True)
        wait_unpinned(client, lease.lease_id)
        assert kit.decision("hit") == 1
    finally:
        kit.reuse.close()
        kit.client.close()
        _asyncio.run_coroutine_threadsafe(router.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# ---- prefill: reads pinned when the gateway routed the turn ------------------------------------


class NoLookupClient(RegistryClient):
    """A client for reads that must not be looked up: routed reads are decided locally."""

    def acquire_read(self, *args: Any, **kwargs: Any) -> pb.AcquireReadResponse:
        raise AssertionError("a routed read made an AcquireRead call")


@pytest.fixture
def routed_prefill(registry: ThreadedRegistry, holder: pb.Holder) -> Iterator[PrefillKit]:
    kit = make_prefill(registry.target,
                       client=NoLookupClient(registry.target, timeout=2.0, retries=1))
    yield kit
    kit.reuse.close()
    kit.client.close()


def pinned_read(client: RegistryClient, conversation: str = "c1", pin_ttl: float = 10.0,
                ) -> dict[str, Any]:
    """What the gateway puts in kv_transfer_params after the router pinned the lease."""
    return routed_read(client.pin_lease(TENANT, conversation, pin_ttl=pin_ttl,
                                        reader_id=READER), monotonic())


class SlowReleaseClient(NoLookupClient):
    """Releases that take `delay` seconds, as against a registry that is slow to answer."""

    def __init__(self, *args: Any, delay: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay
        self.released: list[tuple[str, str]] = []

    def release_read(self, pin_id: str, *, timeout: float | None = None) -> bool:
        time.sleep(self.delay)
        self.released.append((pin_id, threading.current_thread().name))
        return super().release_read(pin_id, timeout=timeout)


def test_prefill_aborted_routed_request_never_waits_for_the_release(
        registry: ThreadedRegistry, holder: pb.Holder, client: RegistryClient):
    """A routed request aborted before it was scheduled has its pin released in the
    background: the scheduler thread does not wait for the registry's answer."""
    lease = grant(client, "c1", LEASE_TOKENS)
    slow = SlowReleaseClient(registry.target, timeout=5.0, retries=1, delay=1.0)
    kit = make_prefill(registry.target, client=slow)
    try:
        kit.request("p-1", LEASE_TOKENS + EXTRA,
                    kvbridge={**conv_key("c1"), "read": pinned_read(client)})
        started = time.monotonic()
        kit.reuse.finished("p-1")
        assert time.monotonic() - started < 0.5
        wait_for(lambda: slow.released, "the pin's release")
        assert slow.released[0][1].startswith("kvbridge-read")
        wait_unpinned(client, lease.lease_id)
    finally:
        kit.reuse.close()
        slow.close()


@pytest.mark.parametrize(("prompt", "n_blocks", "usable"), [
    pytest.param(LEASE_TOKENS + EXTRA, 10, 38, id="exact-with-partial-block"),
    pytest.param(LEASE_TOKENS[:36] + [7, 7] + EXTRA, 9, 36, id="partial-block-differs"),
    pytest.param(LEASE_TOKENS[:17] + [7] + LEASE_TOKENS[18:] + EXTRA, 4, 16,
                 id="edited-inside-block-4"),
])
def test_prefill_routed_read_is_verified_locally_without_a_lookup(
        routed_prefill: PrefillKit, client: RegistryClient, prompt: list[int], n_blocks: int,
        usable: int):
    """The same verified blocks as AcquireRead gives (test_prefill_hit_names_verified_blocks),
    decided on the request's first scheduling pass: no call, no "ask again"."""
    lease = grant(client, "c1", LEASE_TOKENS)
    read = pinned_read(client)
    request = routed_prefill.request("p-1", prompt, kvbridge={**conv_key("c1"), "read": read})
    assert routed_prefill.reuse.resolve(request, 0) is True
    params = request.kv_transfer_params
    assert params["remote_block_ids"] == [LEASE_BLOCKS[:n_blocks]]
    assert params["remote_num_tokens"] == usable
    assert params["remote_engine_id"] == HOLDER
    assert params["remote_request_id"] == lease.remote_request_id
    assert (params["remote_host"], params["remote_port"]) == (NIXL_HOST, NIXL_PORT)
    assert pins(client, lease.lease_id) == 1
    routed_prefill.reuse.read_done("p-1", ok=True)
    wait_unpinned(client, lease.lease_id)
    outcome = routed_prefill.reuse.finished("p-1")
    assert outcome is not None
    assert outcome["kvbridge_decision"] == "hit" and outcome["kvbridge_reused_tokens"] == usable
    assert outcome["kvbridge_read_source"] == "route" and outcome["kvbridge_lookup_ms"] == 0


def test_prefill_routed_read_of_another_prompt_is_released_and_recomputed(
        routed_prefill: PrefillKit, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    read = pinned_read(client)
    prompt = [7] * 30
    request = routed_prefill.request("p-1", prompt, kvbridge={**conv_key("c1"), "read": read})
    assert routed_prefill.reuse.resolve(request, 0) is False
    assert no_remote_fields(request.kv_transfer_params)
    assert routed_prefill.decision("miss_hash_mismatch") == 1
    wait_unpinned(client, lease.lease_id)


def test_prefill_routed_miss_and_pin_margin(routed_prefill: PrefillKit, client: RegistryClient):
    request = routed_prefill.request("p-1", LEASE_TOKENS + EXTRA,
                                     kvbridge={**conv_key("c1"), "read": {"miss": "no_lease"}})
    assert routed_prefill.reuse.resolve(request, 0) is False
    assert routed_prefill.decision("miss_no_lease") == 1
    # A pin that ends within the 2 s margin by the time prefill sees it: recompute, released.
    lease = grant(client, "c1", LEASE_TOKENS)
    read = pinned_read(client, pin_ttl=1.5)
    request = routed_prefill.request("p-2", LEASE_TOKENS + EXTRA,
                                     kvbridge={**conv_key("c1"), "read": read})
    assert routed_prefill.reuse.resolve(request, 0) is False
    assert routed_prefill.decision("pin_margin") == 1
    wait_unpinned(client, lease.lease_id)


@pytest.mark.parametrize(("sent", "pin_ttl", "left"), [
    # The gateway on this host sent it 3 s ago (a slow API server, an engine step): the pin
    # has 7 s left, not 10.
    pytest.param({"boot": "here", "clock": -3.0}, 10.0, 7.0, id="same-host-3s-on-the-way"),
    # 8.5 s ago: 1.5 s left, within the margin (seen as fresh, it would have been a hit).
    pytest.param({"boot": "here", "clock": -8.5}, 10.0, None, id="same-host-pin-margin"),
    # From another host: the slack comes off (2.9 s would pass the 2 s margin, 1.9 does not).
    pytest.param({"boot": "elsewhere", "clock": -3.0}, 10.0, 10.0 - ROUTED_TRANSIT_SLACK_S,
                 id="other-host"),
    pytest.param({"boot": "elsewhere", "clock": 0.0}, 2.9, None, id="other-host-pin-margin"),
    # Without `sent` (an older gateway), or a clock after the request was seen: as another host.
    pytest.param(None, 10.0, 10.0 - ROUTED_TRANSIT_SLACK_S, id="older-gateway"),
    pytest.param({"boot": "here", "clock": 60.0}, 10.0, 10.0 - ROUTED_TRANSIT_SLACK_S,
                 id="clock-from-the-future"),
    # Hostile or broken values of this host's gateway: as another host, never an error.
    pytest.param({"boot": "here", "clock": 10**400}, 10.0, 10.0 - ROUTED_TRANSIT_SLACK_S,
                 id="clock-too-large-for-a-float"),
    pytest.param({"boot": "here", "clock": float("nan")}, 10.0, 10.0 - ROUTED_TRANSIT_SLACK_S,
                 id="clock-nan"),
    pytest.param({"boot": "here", "clock": "soon"}, 10.0, 10.0 - ROUTED_TRANSIT_SLACK_S,
                 id="clock-a-string"),
    pytest.param({"boot": "here", "clock": True}, 10.0, 10.0 - ROUTED_TRANSIT_SLACK_S,
                 id="clock-a-bool"),
])
def test_prefill_counts_a_routed_pin_from_when_the_gateway_sent_it(
        routed_prefill: PrefillKit, client: RegistryClient, sent: dict[str, Any] | None,
        pin_ttl: float, left: float | None):
    if sent is not None and sent["boot"] == "here" and not boot_id():
        pytest.skip("this host has no boot id: no gateway is taken to share its clock")
    lease = grant(client, "c1", LEASE_TOKENS)
    read = pinned_read(client, pin_ttl=pin_ttl)
    if sent is None:
        del read["sent"]
    else:
        clock = sent["clock"]
        if isinstance(clock, float) and -60 < clock < 100:  # relative to now
            clock += monotonic()
        read["sent"] = {"boot": read["sent"]["boot"] if sent["boot"] == "here" else "b-2",
                        "clock": clock}
    request = routed_prefill.request("p-1", LEASE_TOKENS + EXTRA,
                                     kvbridge={**conv_key("c1"), "read": read})
    hit = routed_prefill.reuse.resolve(request, 0)
    if left is None:
        assert hit is False and routed_prefill.decision("pin_margin") == 1
        wait_unpinned(client, lease.lease_id)
        return
    assert hit is True
    end = routed_prefill.reuse.read_sent("p-1")
    assert end is not None and left - 1.5 < end - monotonic() <= left
    routed_prefill.reuse.read_done("p-1", ok=True)
    wait_unpinned(client, lease.lease_id)


def test_prefill_malformed_routed_read_falls_back_to_a_lookup(prefill: PrefillKit,
                                                              client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    read = pinned_read(client)
    read["block_ids"] = read["block_ids"][:-1]  # one id fewer than hashes
    request = prefill.request("p-1", LEASE_TOKENS + EXTRA,
                              kvbridge={**conv_key("c1"), "read": read})
    assert prefill.resolve(request) is True  # looked up for itself
    assert request.kv_transfer_params["remote_num_tokens"] == 38
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None and outcome["kvbridge_read_source"] == "lookup"
    # The malformed read's pin was released; the lookup's pin went with finished().
    wait_unpinned(client, lease.lease_id)


@pytest.mark.parametrize(("change", "error"), [
    ({"expires_in_s": -1}, "expires_in_s"),
    ({"expires_in_s": float("nan")}, "expires_in_s"),
    ({"expires_in_s": 10**400}, "expires_in_s"),
    ({"expires_in_s": 1e300}, "expires_in_s"),
    ({"block_hashes": "not base64!"}, "block_hashes"),
    ({"token_count": 39}, "token_count"),
    ({"holder": {"id": "d", "host": "h", "port": 0, "block_size": BS}}, "holder.port"),
    ({"pin_id": ""}, "pin_id"),
    ({"block_ids": [True]}, "block_ids"),
])
def test_verified_read_refuses_malformed_input(client: RegistryClient, holder: pb.Holder,
                                               change: dict[str, Any], error: str):
    grant(client, "c1", LEASE_TOKENS)
    read = {**pinned_read(client), **change}
    with pytest.raises(BadRoutedRead, match=error):
        verified_read(read, blockhash.block_hashes(LEASE_TOKENS, BS, FP))


def test_verified_read_of_an_unknown_miss_is_no_lease() -> None:
    read, release = verified_read({"miss": "meteor"}, b"")
    assert read.miss_reason == pb.MISS_REASON_NO_LEASE and release is None


def test_prefill_sync_read_counts_when_the_request_finishes(prefill: PrefillKit,
                                                            client: RegistryClient):
    """A read made within the step that computes the request: posted (its remote blocks are
    dropped from the params, so a preempted request recomputes), counted as reuse when the
    request finishes (a failed one would have held it back), pin released."""
    lease = grant(client, "c1", LEASE_TOKENS)
    request = prefill.request("p-1", LEASE_TOKENS + EXTRA)
    assert prefill.resolve(request) is True
    prefill.reuse.reading_sync("p-1")
    prefill.reuse.read_posted("p-1")
    params = request.kv_transfer_params
    assert "remote_block_ids" not in params and params["remote_num_tokens"] == 0
    assert sample(prefill.metrics, "kvbridge_connector_reused_tokens_total") == 0
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None
    assert outcome["kvbridge_load"] == "sync" and outcome["kvbridge_decision"] == "hit"
    assert sample(prefill.metrics, "kvbridge_connector_reused_tokens_total") == 38
    wait_unpinned(client, lease.lease_id)
    # The worker's report arrives after the request finished: nothing is counted twice.
    assert prefill.reuse.read_done("p-1", ok=True) is None
    assert sample(prefill.metrics, "kvbridge_connector_reused_tokens_total") == 38


def test_prefill_outcome_counts_local_reused_and_recomputed_tokens(prefill: PrefillKit,
                                                                    client: RegistryClient):
    """The scheduler offered a local prefix hit of 16 tokens: the read brings the lease's
    tokens past it, the rest is computed; the three add up to the prompt. Where the scheduler
    settled on another hit (asked again later), the allocation's figures stand."""
    lease = grant(client, "c1", LEASE_TOKENS)
    prompt = LEASE_TOKENS + EXTRA
    request = prefill.request("p-1", prompt)
    assert prefill.resolve(request, computed=16) is True
    prefill.reuse.reading_sync("p-1")
    prefill.reuse.placed("p-1", local=8, reused=30)
    prefill.reuse.read_posted("p-1")
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None
    assert (outcome["kvbridge_local_tokens"], outcome["kvbridge_reused_tokens"],
            outcome["kvbridge_recomputed_tokens"]) == (8, 30, len(EXTRA))
    assert sample(prefill.metrics, "kvbridge_connector_local_tokens_total") == 8
    assert sample(prefill.metrics, "kvbridge_connector_reused_tokens_total") == 30
    wait_unpinned(client, lease.lease_id)


def test_prefill_spoiled_read_is_failed_by_the_pin_guard(prefill: PrefillKit,
                                                         client: RegistryClient):
    """A read the connector could not place: its pin end goes to the worker as past, so the
    worker's guard never posts it (and the scheduler recomputes its blocks)."""
    grant(client, "c1", LEASE_TOKENS)
    request = prefill.request("p-1", LEASE_TOKENS + EXTRA)
    assert prefill.resolve(request) is True
    prefill.reuse.spoil("p-1")
    end = prefill.reuse.read_sent("p-1")
    assert end is not None
    from types import SimpleNamespace

    from kvbridge.connector._pin_guard import PIN_ENDS_ATTR, PinEnds, PinGuard

    guard = PinGuard(margin_s=1.0, boot="b")
    guard.update(SimpleNamespace(**{PIN_ENDS_ATTR: PinEnds("b", 0.0, {"p-1": end})}))
    assert not guard.may_post("p-1")


def test_prefill_sync_read_failure_recomputes(prefill: PrefillKit, client: RegistryClient):
    lease = grant(client, "c1", LEASE_TOKENS)
    prompt = LEASE_TOKENS + EXTRA
    request = prefill.request("p-1", prompt)
    assert prefill.resolve(request) is True
    prefill.reuse.reading_sync("p-1")
    prefill.reuse.read_posted("p-1")
    assert prefill.reuse.read_done("p-1", ok=False, why="transfer_failed") == HOLDER
    wait_unpinned(client, lease.lease_id)
    outcome = prefill.reuse.finished("p-1")
    assert outcome is not None and outcome["kvbridge_decision"] == "transfer_failed"
    assert outcome["kvbridge_recomputed_tokens"] == len(prompt)
    assert sample(prefill.metrics, "kvbridge_connector_reused_tokens_total") == 0
    assert prefill.decision("transfer_failed") == 1


# ---- prefill: read or recompute by measured cost ---------------------------------------------


def _step(kit: PrefillKit, clock: FakeClock, tokens: int, seconds: float,
          read_wait_s: float = 0.0) -> None:
    """An engine step computes `tokens` tokens of a `tokens`-token prompt in `seconds`."""
    kit.reuse.step_scheduled(tokens, tokens * tokens)
    clock.advance(seconds)
    kit.reuse.step_done(read_wait_s)


def _reads(kit: PrefillKit, clock: FakeClock, request_id: str, conversation: str,
           seconds: float) -> None:
    """A conversation turn reads LEASE_TOKENS back (asynchronously) in `seconds`."""
    request = kit.request(request_id, LEASE_TOKENS + EXTRA, conversation)
    assert kit.resolve(request) is True
    clock.advance(seconds)
    kit.reuse.read_done(request_id, ok=True)
    kit.reuse.finished(request_id)


def test_prefill_learns_that_reads_are_slower_and_skips_the_lookup(
        registry: ThreadedRegistry, holder: pb.Holder, client: RegistryClient):
    """Compute is measured from engine steps, reads from landed ones (not the first one from
    an engine: it opened NIXL's connection); once reading is estimated slower than recomputing
    a whole prompt, a conversation's turn recomputes without even a lookup."""
    clock = FakeClock()
    kit = make_prefill(registry.target, clock=clock, client=RecordingClient(
        registry.target, timeout=1.0, retries=1))
    try:
        for tokens in (10, 20, 40, 80, 160):  # 1 ms a token, 2 ms a step
            _step(kit, clock, tokens, 0.002 + tokens * 0.001)
        kit.reuse.step_done()  # an output without a step scheduled: nothing to learn
        for i in range(3):
            grant(client, f"c{i}", LEASE_TOKENS)
        _reads(kit, clock, "first", "c0", 2.0)  # with the handshake: not learned
        assert kit.reuse.cost.estimates().get("read_fixed") is None
        _reads(kit, clock, "second", "c1", 0.5)  # 0.5 s to read 38 tokens
        assert kit.reuse.cost.ready()
        assert kit.reuse.cost.read_s(38) == pytest.approx(0.5, rel=0.01)
        assert kit.reuse.cost.recompute_s(38, 38) == pytest.approx(0.038, rel=0.1)
        gauge = sample(kit.metrics, "kvbridge_connector_cost_estimate_seconds",
                       estimate="read_fixed")
        assert 0 < gauge <= 0.5
        assert 0 < sample(kit.metrics, "kvbridge_connector_cost_estimate_seconds",
                          estimate="recompute_fixed") < 0.01
        recording = kit.client
        assert isinstance(recording, RecordingClient)
        lookups = len(recording.pins)
        request = kit.request("p-3", LEASE_TOKENS + EXTRA, "c2")
        assert kit.reuse.resolve(request, 0) is False
        assert len(recording.pins) == lookups  # no AcquireRead
        assert kit.decision("recompute_cheaper") == 1
        outcome = kit.reuse.finished("p-3")
        assert outcome is not None and outcome["kvbridge_decision"] == "recompute_cheaper"
        assert outcome["kvbridge_recomputed_tokens"] == len(LEASE_TOKENS + EXTRA)
    finally:
        kit.reuse.close()
        kit.client.close()


def test_prefill_threshold_decision_reads_however_slow(registry: ThreadedRegistry,
                                                       holder: pb.Holder,
                                                       client: RegistryClient):
    clock = FakeClock()
    kit = make_prefill(registry.target, clock=clock, decision="threshold")
    try:
        for tokens in (10, 20, 40, 80):
            _step(kit, clock, tokens, 0.002 + tokens * 0.001)
        for i in range(3):
            grant(client, f"c{i}", LEASE_TOKENS)
            _reads(kit, clock, f"r-{i}", f"c{i}", 0.5)
        assert kit.decision("hit") == 3 and kit.decision("recompute_cheaper") == 0
    finally:
        kit.reuse.close()
        kit.client.close()


def test_prefill_sync_read_time_reported_after_finishing_is_learned(
        registry: ThreadedRegistry, holder: pb.Holder, client: RegistryClient):
    """A synchronous read's time comes from the worker after the step, which may have finished
    the request: the read is learned then, and the step's compute is its time less the read's
    wait."""
    clock = FakeClock()
    kit = make_prefill(registry.target, clock=clock)
    try:
        for tokens in (10, 20, 40, 80):
            _step(kit, clock, tokens, 0.002 + tokens * 0.001)
        grant(client, "c0", LEASE_TOKENS)
        _reads(kit, clock, "first", "c0", 1.0)  # the handshake, asynchronously
        grant(client, "c1", LEASE_TOKENS)
        request = kit.request("p-1", LEASE_TOKENS + EXTRA, "c1")
        assert kit.resolve(request) is True
        kit.reuse.reading_sync("p-1")
        kit.reuse.step_scheduled(len(EXTRA), len(EXTRA) * len(LEASE_TOKENS + EXTRA))
        kit.reuse.read_posted("p-1")
        clock.advance(0.032)  # the step: a 20 ms read, then 10 tokens computed in 12 ms
        kit.reuse.finished("p-1")
        assert not kit.reuse.cost.ready()  # the read's time is not known yet
        kit.reuse.read_measured("p-1", 0.020)
        kit.reuse.step_done(0.020)
        assert kit.reuse.cost.ready()
        assert kit.reuse.cost.read_s(38) == pytest.approx(0.020, rel=0.01)
        # Compute samples on one line (2 ms + 1 ms a token), the read's step included.
        assert kit.reuse.cost.recompute_s(100, 100) == pytest.approx(0.1, rel=0.1)
    finally:
        kit.reuse.close()
        kit.client.close()


def test_prefill_steps_in_flight_under_async_scheduling():
    """Two steps in flight (vLLM schedules the next before the last one's output is in): each
    counts from when the one before it was done. Without overlap, a step that produced no
    output is dropped rather than paired with the next output."""
    clock = FakeClock()
    reuse = make_prefill("127.0.0.1:1", clock=clock).reuse
    try:
        reuse.step_scheduled(100, 100 * 100, overlapped=True)
        clock.advance(0.001)
        reuse.step_scheduled(100, 100 * 100, overlapped=True)  # while the first runs
        clock.advance(0.101)
        reuse.step_done()  # the first: 0.102 s from its scheduling
        clock.advance(0.1)
        reuse.step_done()  # the second: 0.1 s from the first's end, not 0.201
        clock.advance(5.0)
        reuse.step_scheduled(100, 100 * 100)  # produced no output: dropped by the next
        reuse.step_scheduled(100, 100 * 100)
        clock.advance(0.1)
        reuse.step_done()
        assert reuse.cost.estimates()["recompute_fixed"] + reuse.cost.recompute_s(
            100, 100) == pytest.approx(0.1, rel=0.05)
    finally:
        reuse.close()


def test_prefill_never_reads_remote_blocks_a_request_named_itself(
        prefill: PrefillKit, client: RegistryClient):
    """A request that reached prefill with decode's blocks already named (NIXL's own
    read-back params, or a forgery sent to the engine directly) reads none of them: the
    fields are dropped on arrival (NIXL's scheduler would read them unchecked), and it is
    recomputed, with or without a conversation named, even where a lease would match."""
    forged = {"remote_block_ids": [[1, 2, 3]], "remote_engine_id": "decode-9",
              "remote_request_id": "x", "remote_host": "10.0.0.9", "remote_port": 5600,
              "remote_num_tokens": 96, "tp_size": 1}
    lease = grant(client, "c1", LEASE_TOKENS)
    named = prefill.request("p-1", LEASE_TOKENS + EXTRA, **forged)
    bare = FakeRequest("p-2", LEASE_TOKENS + EXTRA, params={"do_remote_decode": True,
                                                            **forged},
                       num_computed_tokens=0)
    prefill.reuse.on_new_request(bare)
    for request in (named, bare):
        assert no_remote_fields(request.kv_transfer_params)
        assert prefill.reuse.resolve(request, 0) is False
    assert pins(client, lease.lease_id) == 0
