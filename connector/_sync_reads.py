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

from kvbridge.connector import _vllm
from kvbridge.connector._layerwise import Captured, LayerReader, Layout, Part, Plan
from kvbridge.connector._pin_guard import LANDED_LATE, NOT_POSTED, PinGuard

log = structlog.get_logger("kvbridge.connector")

# The attribute of the scheduler's NixlConnectorMetadata naming this step's synchronous reads.
SYNC_READS_ATTR = "kvbridge_sync_reads"


@dataclass
class SyncReadResults(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Per request: whether its synchronous read landed, and how long it took (ms)."""

    ok: dict[str, bool] = field(default_factory=dict)
    ms: dict[str, float] = field(default_factory=dict)  # what the step waited for the read
    why: dict[str, str] = field(default_factory=dict)
    layered: dict[str, float] = field(default_factory=dict)  # read by layer: the copy's ms
    # Asynchronous reads failed for their pin (`_pin_guard`): why, per request.
    async_why: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, SyncReadResults):
            return self
        for req_id, ok in other.ok.items():  # tensor-parallel ranks: ok only if all were
            self.ok[req_id] = self.ok.get(req_id, True) and ok
            self.ms[req_id] = max(self.ms.get(req_id, 0.0), other.ms.get(req_id, 0.0))
            if req_id in other.why:
                self.why.setdefault(req_id, other.why[req_id])
            if req_id in other.layered:
                self.layered[req_id] = max(self.layered.get(req_id, 0.0), other.layered[req_id])
        for req_id, why in other.async_why.items():
            self.async_why.setdefault(req_id, why)
        return self


class SyncReads:
    """Worker side. `before` runs ahead of NIXL's `start_load_kv`, `after` right after it, both
    before the forward pass of the step (vLLM starts loads first when a step has sync loads)."""

    def __init__(self, worker: Any, timeout_s: float, poll_s: float = 0.0002, *,
                 layerwise: bool = False, read_cpus: set[int] | None = None,
                 pins: PinGuard | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.worker = worker
        self.pins = pins
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.layerwise = layerwise
        self.read_cpus = read_cpus
        self._clock = clock
        self._sleep = sleep
        self._results = SyncReadResults()
        self._layout: Layout | None = None
        self._reader: LayerReader | None = None
        self._layout_checked = False
        self._plan_metas: dict[str, Any] = {}  # the requests of the step's layered reads
        self._plan_boundary_ms = 0.0  # what the step waited for their boundary blocks
        self._not_posted_why: dict[str, str] = {}  # reads `_pin_guard` declined to post
        self._step_sync: set[str] = set()  # the synchronous reads of the step being posted

    def _layer_reader(self) -> LayerReader | None:
        """The reading thread, when layered reads apply to this engine (decided on first use,
        once NIXL's worker knows its KV layout)."""
        if not self.layerwise:
            return None
        if not self._layout_checked:
            self._layout_checked = True
            self._layout = Layout.of(self.worker)
            if self._layout is not None:
                self._reader = LayerReader(self.worker, cpus=self.read_cpus,
                                           poll_s=self.poll_s, clock=self._clock,
                                           sleep=self._sleep)
                log.info("layerwise_reads_on", layers=len(dict.fromkeys(
                    self._layout.region_layers)), regions=len(self._layout.region_layers),
                    read_cpus=sorted(self.read_cpus) if self.read_cpus else "inherit")
        if self._reader is not None and not self._reader.enabled:
            return None
        return self._reader

    def before(self, metadata: Any) -> set[str]:
        """This step's synchronous reads. Those that cannot be posted now (no NIXL handshake
        with the holder) are taken out of the metadata and failed at once: NIXL would otherwise
        handshake in the background and read later, after the forward pass used the blocks."""
        sync = set(_vllm.attached(metadata, SYNC_READS_ATTR) or ())
        worker = self.worker
        reads = _vllm.reads_to_recv(metadata)
        for req_id in sorted(sync):
            meta = reads.get(req_id)
            remote = _vllm.read_remote(meta)
            if remote is None:
                sync.discard(req_id)
                continue
            if not _vllm.handshake_done(worker, remote[0]):
                del reads[req_id]
                sync.discard(req_id)
                self._fail(req_id, meta, "no_handshake", 0.0)
        self._step_sync = sync
        return sync

    def owners(self, metadata: Any, sync: set[str]) -> dict[str, str]:
        """remote request id -> request id, for the reads to capture (and split by layer)
        while NIXL's worker prepares them; empty when layered reads are off."""
        layers = self._layer_reader()
        if layers is None or self._layout is None or not sync:
            return {}
        owners: dict[str, str] = {}
        shared: set[str] = set()  # also read by a request NIXL posts itself: not captured
        for req_id, meta in _vllm.reads_to_recv(metadata).items():
            remote = _vllm.read_remote(meta)
            if remote is None:
                continue
            if req_id in sync:
                owners[remote[1]] = req_id
            else:
                shared.add(remote[1])
        return {remote: req_id for remote, req_id in owners.items() if remote not in shared}

    def after(self, sync: set[str]) -> None:
        """Take NIXL's bookkeeping of the posted reads over (it must never report these as
        finished_recving: the requests are running, not waiting) and wait for them: whole, or,
        for reads captured for layering, their boundary blocks, the rest being left to the
        reading thread and the forward pass's per-layer waits."""
        if not sync:
            return
        worker = self.worker
        started = self._clock()
        metas: dict[str, Any] = {}
        handles: dict[str, list[Any]] = {}
        failed: dict[str, str] = {}
        layered: dict[str, list[tuple[str, Part]]] = {}
        for req_id in sync:
            meta = _vllm.recving_metadata(worker).pop(req_id, None)
            posted = _vllm.recving_transfers(worker).pop(req_id, None)
            if meta is None:  # nothing to read after all (cannot happen with blocks to load)
                continue
            metas[req_id] = meta
            handles[req_id] = []
            if req_id in _vllm.recv_failures(worker) or posted is None:
                _vllm.recv_failures(worker).discard(req_id)
                failed[req_id] = self._not_posted_why.pop(req_id, "not_posted")
            for handle in posted or []:
                if not isinstance(handle, Captured):
                    handles[req_id].append(handle)
                    continue
                handle.req_id = req_id  # NIXL's bookkeeping says whose it is
                split = (self._layout.split(handle) if self._layout is not None
                         and req_id not in failed else None)
                part = handle.whole() if split is None else split[0]
                if split is not None:
                    layered.setdefault(req_id, []).extend(split[1])
                if req_id in failed:
                    continue
                posted_handle = self._post(part, meta)
                if posted_handle is None:
                    failed[req_id] = "not_posted"
                else:
                    handles[req_id].append(posted_handle)
        self._post_stray_captures(sync)
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
                                           if not _vllm.try_release_xfer(worker, req_id, h)]
                if any(handles.values()):
                    log.error("sync_read_uncancellable", waiting=sorted(
                        r for r, h in handles.items() if h))
                continue
            self._sleep(self.poll_s)
        elapsed_ms = round((self._clock() - started) * 1000, 2)
        parts = [(layer, part) for req_id, req_parts in layered.items() if req_id not in failed
                 for layer, part in req_parts]
        if parts:
            # Interleave by layer so that each layer's event fires once all requests have it.
            assert self._layout is not None and self._reader is not None
            order = {layer: i for i, layer in enumerate(self._layout.region_layers)}
            parts.sort(key=lambda item: order[item[0]])
            self._plan_metas = {req_id: metas[req_id] for req_id in layered
                                if req_id not in failed}
            self._plan_boundary_ms = elapsed_ms
            self._reader.start(Plan(parts, deadline))
        for req_id, meta in metas.items():
            if req_id in failed:
                if failed[req_id] == NOT_POSTED:  # not the transfer's fault
                    self._fail(req_id, meta, NOT_POSTED, elapsed_ms)
                else:
                    self._record_failure(req_id, meta, failed[req_id], elapsed_ms)
            elif req_id not in layered and not self._in_time(req_id):
                self._fail(req_id, meta, LANDED_LATE, elapsed_ms)
            elif req_id not in layered:
                self._results.ok[req_id] = True
                self._results.ms[req_id] = elapsed_ms
        self._not_posted_why.clear()
        self._step_sync = set()

    def wait_for_layer(self, layer: str) -> None:
        if self._reader is not None:
            self._reader.wait_for_layer(layer)

    def finish(self) -> None:
        """End the step's layered reads (before NIXL's worker is used again): wait for the
        reading thread, fail what did not land, report the rest."""
        if self._reader is None or not self._reader.active():
            return
        plan = self._reader.finish()
        if plan is None:
            return
        for telemetry in plan.telemetry:
            _vllm.xfer_stats(self.worker).record_transfer(telemetry)
        for req_id, meta in self._plan_metas.items():
            # What the step lost to this read: the boundary blocks plus the forward's waits.
            exposed = self._plan_boundary_ms + plan.wait_s.get(req_id, 0.0) * 1000
            why = plan.failed.get(req_id)
            if why == "layer_not_waited":  # not the transfer's fault
                self._fail(req_id, meta, why, round(exposed, 2))
            elif why is not None:
                self._record_failure(req_id, meta, why, round(exposed, 2))
            elif not self._in_time(req_id):
                self._fail(req_id, meta, LANDED_LATE, round(exposed, 2))
            else:
                self._results.ok[req_id] = True
                self._results.ms[req_id] = round(exposed, 2)
                self._results.layered[req_id] = round(plan.copy_s * 1000, 2)
        self._plan_metas = {}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def results(self) -> SyncReadResults | None:
        if not self._results.ok and not self._results.async_why:
            return None
        out, self._results = self._results, SyncReadResults()
        return out

    def pin_failure(self, req_id: str, why: str) -> None:
        """`_pin_guard` failed a read for its pin: a synchronous one's reason is its failure's
        (see `after`), an asynchronous one's goes to the scheduler side with the results."""
        if req_id in self._step_sync:
            self._not_posted_why[req_id] = why
        else:
            self._results.async_why[req_id] = why

    # ---- helpers ----------------------------------------------------------------------------

    def _poll(self, req_id: str, meta: Any, pending: list[int],
              failed: dict[str, str]) -> list[int]:
        """One look at a request's transfers: those still in flight (or failed and not
        releasable) are returned. Failures are logged in NIXL's own terms."""
        worker = self.worker
        wrapper = _vllm.nixl_agent(worker)
        left = []
        for handle in pending:
            try:
                state = wrapper.check_xfer_state(handle)
            except Exception as exc:  # a dead peer surfaces here
                _vllm.log_failure(worker, failure_type="transfer_exception", req_id=req_id,
                                  error=exc, meta=meta, load="sync")
                state = "ERR"
            if state == "DONE":
                _vllm.xfer_stats(worker).record_transfer(wrapper.get_xfer_telemetry(handle))
            elif state == "PROC":
                left.append(handle)
                continue
            else:
                if state != "ERR":
                    _vllm.log_failure(worker, failure_type="transfer_failed", req_id=req_id,
                                      xfer_state=state, meta=meta, load="sync")
                failed.setdefault(req_id, "transfer_failed")
            if not _vllm.try_release_xfer(worker, req_id, handle):
                left.append(handle)
        return left

    def _post(self, part: Part, meta: Any) -> Any:
        """Post a captured READ; its handle, or None if NIXL refused it."""
        wrapper = _vllm.nixl_agent(self.worker)
        handle = None
        try:
            handle = wrapper.make_prepped_xfer("READ", part.local, part.local_ids, part.remote,
                                               part.remote_ids, notif_msg=part.notif)
            wrapper.transfer(handle)
            return handle
        except Exception as exc:
            _vllm.log_failure(self.worker, failure_type="transfer_setup_failed",
                              req_id=part.req_id, error=exc, meta=meta, load="sync")
            if handle is not None:
                while not _vllm.try_release_xfer(self.worker, part.req_id, handle):
                    self._sleep(self.poll_s)
            return None

    def _post_stray_captures(self, sync: set[str]) -> None:
        """A READ captured for a request NIXL tracks itself (an asynchronous read, e.g. one whose
        handshake just finished, of the same decode request as a synchronous one): posted
        whole, as NIXL would have, so that its bookkeeping only ever holds real handles."""
        worker = self.worker
        transfers = _vllm.recving_transfers(worker)
        for req_id, pending in list(transfers.items()):
            if req_id in sync or not any(isinstance(h, Captured) for h in pending):
                continue
            real = []
            for handle in pending:
                if not isinstance(handle, Captured):
                    real.append(handle)
                    continue
                handle.req_id = req_id
                posted = self._post(handle.whole(), _vllm.recving_metadata(worker).get(req_id))
                if posted is None:
                    _vllm.recv_failures(worker).add(req_id)
                else:
                    real.append(posted)
            transfers[req_id] = real

    def _in_time(self, req_id: str) -> bool:
        """The synchronous read landed: whether its pin was still live then."""
        return self.pins is None or self.pins.landed_in_time(req_id)

    def _record_failure(self, req_id: str, meta: Any, why: str, elapsed_ms: float) -> None:
        _vllm.xfer_stats(self.worker).record_failed_transfer()
        remote = _vllm.read_remote(meta)
        if remote is not None:
            _vllm.remote_engine_failed(self.worker, remote[0])
        self._fail(req_id, meta, why, elapsed_ms)

    def _fail(self, req_id: str, meta: Any, why: str, elapsed_ms: float) -> None:
        """Report the request's blocks as not loaded: the scheduler recomputes them."""
        blocks = {b for group in _vllm.read_local_blocks(meta) for b in group}
        _vllm.report_invalid_blocks(self.worker, blocks)
        if self.pins is not None:
            self.pins.forget(req_id)
        self._results.ok[req_id] = False
        self._results.ms[req_id] = elapsed_ms
        self._results.why[req_id] = why
        log.warning("sync_read_recompute", request_id=req_id, why=why, blocks=len(blocks))
