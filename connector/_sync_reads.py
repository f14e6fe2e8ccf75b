"""Synchronous reads: decode's KV is read within the engine step that computes the request.

NIXL's own read-back is asynchronous: the request is parked (WAITING_FOR_REMOTE_KVS), the READ
is posted after that step's forward pass, completion is noticed at the end of a later step, and
only the step after that schedules the request. On an engine that is computing something else,
each of those hops waits for a whole forward pass; on an idle one they still cost a few steps.

Once this engine has read from a decode engine before (so the NIXL handshake with it is done),
kvbridge schedules a hit like a local cache hit instead: the request runs in the very step it is
scheduled, and the READ is posted and waited for before that step's forward pass. A read that
cannot be posted (no handshake after all), fails, or outlives its deadline and can be cancelled
reports its blocks as invalid: the scheduler then truncates the request at the first of them and
recomputes, and the token sampled from that step is thrown away. Nothing is ever computed on
top of KV that did not arrive. A transfer that can be neither completed nor cancelled is waited
for: its blocks must not be reused while a DMA may still write them.

The worker reports each read's outcome back to the scheduler side in `SyncReadResults`
(the connector's worker metadata), which releases the pin and counts the reuse.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

log = structlog.get_logger("kvbridge.connector")

# The attribute of the scheduler's NixlConnectorMetadata naming this step's synchronous reads.
SYNC_READS_ATTR = "kvbridge_sync_reads"


@dataclass
class SyncReadResults(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Per request: whether its synchronous read landed, and how long it took (ms)."""

    ok: dict[str, bool] = field(default_factory=dict)
    ms: dict[str, float] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, SyncReadResults):
            return self
        for req_id, ok in other.ok.items():  # tensor-parallel ranks: ok only if all were
            self.ok[req_id] = self.ok.get(req_id, True) and ok
            self.ms[req_id] = max(self.ms.get(req_id, 0.0), other.ms.get(req_id, 0.0))
            if req_id in other.why:
                self.why.setdefault(req_id, other.why[req_id])
        return self


class SyncReads:
    """Worker side. `before` runs ahead of NIXL's `start_load_kv`, `after` right after it, both
    before the forward pass of the step (vLLM starts loads first when a step has sync loads)."""

    def __init__(self, worker: Any, timeout_s: float, poll_s: float = 0.0002, *,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.worker = worker
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._clock = clock
        self._sleep = sleep
        self._results = SyncReadResults()

    def before(self, metadata: Any) -> set[str]:
        """This step's synchronous reads. Those that cannot be posted now (no NIXL handshake
        with the holder) are taken out of the metadata and failed at once: NIXL would otherwise
        handshake in the background and read later, after the forward pass used the blocks."""
        sync = set(getattr(metadata, SYNC_READS_ATTR, ()) or ())
        worker = self.worker
        for req_id in sorted(sync):
            meta = metadata.reqs_to_recv.get(req_id)
            if meta is None or meta.remote is None:
                sync.discard(req_id)
                continue
            engine = meta.remote.engine_id
            if engine in worker._invalid_remote_engines or engine not in worker._remote_agents:
                del metadata.reqs_to_recv[req_id]
                sync.discard(req_id)
                self._fail(req_id, meta, "no_handshake", 0.0)
        return sync

    def after(self, sync: set[str]) -> None:
        """Take NIXL's bookkeeping of the posted reads over (it must never report these as
        finished_recving: the requests are running, not waiting) and wait for them."""
        if not sync:
            return
        worker = self.worker
        started = self._clock()
        metas: dict[str, Any] = {}
        handles: dict[str, list[int]] = {}
        failed: dict[str, str] = {}
        for req_id in sync:
            meta = worker._recving_metadata.pop(req_id, None)
            posted = worker._recving_transfers.pop(req_id, None)
            if meta is None:  # nothing to read after all (cannot happen with blocks to load)
                continue
            metas[req_id] = meta
            handles[req_id] = list(posted or [])
            if req_id in worker._recv_failures or posted is None:
                worker._recv_failures.discard(req_id)
                failed[req_id] = "not_posted"
        deadline = started + self.timeout_s
        cancelled = False
        while any(handles.values()):
            for req_id, pending in handles.items():
                if pending:
                    handles[req_id] = self._poll(req_id, metas[req_id], pending, failed)
            if not any(handles.values()):
                break
            if self._clock() >= deadline and not cancelled:
                cancelled = True
                for req_id, pending in handles.items():
                    if pending:
                        failed.setdefault(req_id, "timeout")
                        handles[req_id] = [h for h in pending
                                           if not worker._try_release_xfer_handle(req_id, h)]
                if any(handles.values()):
                    log.error("sync_read_uncancellable", waiting=sorted(
                        r for r, h in handles.items() if h))
                continue
            self._sleep(self.poll_s)
        elapsed_ms = round((self._clock() - started) * 1000, 2)
        for req_id, meta in metas.items():
            if req_id in failed:
                worker.xfer_stats.record_failed_transfer()
                worker._failed_remote_engines.add(meta.remote.engine_id)
                self._fail(req_id, meta, failed[req_id], elapsed_ms)
            else:
                self._results.ok[req_id] = True
                self._results.ms[req_id] = elapsed_ms

    def results(self) -> SyncReadResults | None:
        if not self._results.ok:
            return None
        out, self._results = self._results, SyncReadResults()
        return out

    # ---- helpers ----------------------------------------------------------------------------

    def _poll(self, req_id: str, meta: Any, pending: list[int],
              failed: dict[str, str]) -> list[int]:
        """One look at a request's transfers: those still in flight (or failed and not
        releasable) are returned. Failures are logged in NIXL's own terms."""
        worker = self.worker
        wrapper = worker.nixl_wrapper
        left = []
        for handle in pending:
            try:
                state = wrapper.check_xfer_state(handle)
            except Exception as exc:  # a dead peer surfaces here
                worker._log_failure(failure_type="transfer_exception", req_id=req_id,
                                    error=exc, meta=meta, load="sync")
                state = "ERR"
            if state == "DONE":
                worker.xfer_stats.record_transfer(wrapper.get_xfer_telemetry(handle))
            elif state == "PROC":
                left.append(handle)
                continue
            else:
                if state != "ERR":
                    worker._log_failure(failure_type="transfer_failed", req_id=req_id,
                                        xfer_state=state, meta=meta, load="sync")
                failed.setdefault(req_id, "transfer_failed")
            if not worker._try_release_xfer_handle(req_id, handle):
                left.append(handle)
        return left

    def _fail(self, req_id: str, meta: Any, why: str, elapsed_ms: float) -> None:
        """Report the request's blocks as not loaded: the scheduler recomputes them."""
        blocks = {b for group in meta.local_block_ids for b in group}
        self.worker._invalid_block_ids.put(blocks)
        self._results.ok[req_id] = False
        self._results.ms[req_id] = elapsed_ms
        self._results.why[req_id] = why
        log.warning("sync_read_recompute", request_id=req_id, why=why, blocks=len(blocks))
