"""Layer-by-layer synchronous reads: the forward pass starts while decode's KV is still arriving.

A synchronous read (`kvbridge.connector._sync_reads`) lands whole before the step's forward
pass. On the CPU, NIXL's READ (UCX over CMA) is a copy made by the very thread that posts it:
about 10-25 ms for 4,000 tokens of the benchmark model here, all of it ahead of the forward.

Here a step's synchronous reads are split by layer instead. NIXL's worker prepares each READ as
usual; `CapturingWrapper` keeps it from being posted, `split` cuts it into one READ per layer
(the descriptors of one region are one layer's blocks) and a reading thread posts them in layer
order, off the compute thread (on another core when `read_cpus` allows it). The forward pass
waits in `wait_for_layer_load` only for the layer it is about to attend over, so the copy of
layer k+1 overlaps the compute of layer k.

What keeps this exact:
- The block holding the boundary between reused and newly computed tokens is read before the
  forward pass starts: the forward writes the new tokens' KV into it before the layer's
  attention (before `wait_for_layer_load`), and a later read would overwrite them.
- Nothing else of the request is written before its layer's wait: a full reused block holds no
  new token.
- A READ that fails or outlives the deadline fails the whole request: its blocks are reported
  invalid and recomputed, and the token sampled in that step is dropped, as for any failed
  synchronous read. A transfer that can be neither finished nor cancelled is waited for before
  the step ends (its blocks must not be reused while it may still write them).
- If the forward pass never waited for a layer it should have (a model or attention backend
  that does not call the connector's per-layer hook), the step's layered reads are failed
  (recomputed) and layered reads are switched off for the engine's life.
- Layouts this does not understand (several KV-cache groups, Mamba state, mixed memory types,
  a host staging buffer, context parallelism, KV caches shared between layers) and engines
  with speculative decoding keep the whole-request read.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from kvbridge.connector import _vllm

log = structlog.get_logger("kvbridge.connector")


@dataclass
class Captured:
    """A READ that NIXL's worker prepared for a synchronous request, not posted yet. It stands
    in for the transfer handle in the worker's bookkeeping until `SyncReads` takes it over."""

    req_id: str
    local: Any  # the local prepped descriptor list handle
    local_ids: np.ndarray
    remote: Any  # the remote prepped descriptor list handle
    remote_ids: np.ndarray
    notif: bytes

    def part(self, positions: np.ndarray, notif: bytes) -> Part:
        return Part(self.req_id, self.local, self.local_ids[positions], self.remote,
                    self.remote_ids[positions], notif)

    def whole(self) -> Part:
        return Part(self.req_id, self.local, self.local_ids, self.remote, self.remote_ids,
                    self.notif)


@dataclass
class Part:
    """One READ to post: some of a request's descriptors (and NIXL's completion notice to the
    decode engine when it is the request's last)."""

    req_id: str
    local: Any
    local_ids: np.ndarray
    remote: Any
    remote_ids: np.ndarray
    notif: bytes


class CapturingWrapper:
    """Stands in for the NIXL agent while NIXL's worker posts a step's reads: the READs of
    `owners` (remote request id -> request id) are prepared but not posted; everything else
    goes through."""

    def __init__(self, inner: Any, owners: dict[str, str]) -> None:
        self._inner = inner
        self._owners = owners

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def make_prepped_xfer(self, operation: str, local_xfer_side: Any, local_indices: Any,
                          remote_xfer_side: Any, remote_indices: Any, notif_msg: bytes = b"",
                          *args: Any, **kwargs: Any) -> Any:
        owner = self._owner(operation, notif_msg)
        if owner is None or args or kwargs:
            return self._inner.make_prepped_xfer(operation, local_xfer_side, local_indices,
                                                 remote_xfer_side, remote_indices, notif_msg,
                                                 *args, **kwargs)
        return Captured(owner, local_xfer_side, np.asarray(local_indices), remote_xfer_side,
                        np.asarray(remote_indices), notif_msg)

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(handle, Captured):
            return "PROC"  # posted later, by SyncReads
        return self._inner.transfer(handle, *args, **kwargs)

    def release_xfer_handle(self, handle: Any) -> Any:
        if isinstance(handle, Captured):
            return None
        return self._inner.release_xfer_handle(handle)

    def _owner(self, operation: str, notif: Any) -> str | None:
        if operation != "READ" or not notif:
            return None
        text = notif.decode() if isinstance(notif, bytes) else str(notif)
        remote_request_id = text.rsplit(":", 1)[0]
        return self._owners.get(remote_request_id)


@dataclass
class Layout:
    """How a request's descriptors map to layers: NIXL's prepared descriptor ids are region
    major (all of region 0's blocks, then region 1's, ...) and `region_layers[r]` names the
    attention layer whose KV region r holds. `per_block` descriptors make one KV block in
    each region (kernel blocks per logical block)."""

    region_layers: list[str]
    region_offsets: np.ndarray  # first local descriptor id of each region (and the end)
    per_block: int = 1

    @classmethod
    def of(cls, worker: Any) -> Layout | None:
        """The worker's layout, or None where layered reads do not apply (the whole-request
        read is kept)."""
        layout = _vllm.worker_layout(worker)
        if layout is None:  # this vLLM lacks a name the layout is read from (warned there)
            return None
        reasons = []
        if layout.several_groups:
            reasons.append("several KV cache groups")
        if layout.mamba:
            reasons.append("Mamba state")
        if layout.layer_name_routing:
            reasons.append("layer-name routing")
        if layout.mixed_mem_types:
            reasons.append("mixed memory types")
        if layout.host_buffer:
            reasons.append("a host staging buffer")
        if layout.context_parallel:
            reasons.append("context parallelism")
        if layout.speculative:
            # A drafter's layers run after the step's transfer results are taken: their
            # layers would never be waited for, and layered reads would turn themselves off.
            reasons.append("speculative decoding")
        names, regions = layout.region_names, layout.num_regions
        if regions < 2 or len(names) != regions:
            reasons.append("fewer than two KV regions")
        if layout.cache_names and layout.cache_names != set(names):
            # Layers sharing another layer's KV (or drafter layers): their attention would
            # find no per-layer wait under their own name.
            reasons.append("KV caches shared between layers")
        if reasons:
            log.info("layerwise_reads_off", why=", ".join(reasons))
            return None
        counts = layout.region_num_blocks
        if len(counts) != regions:
            counts = [layout.num_blocks] * regions
        offsets = np.cumsum([0, *counts])
        return cls(names, offsets, layout.per_block)

    def split(self, xfer: Captured) -> tuple[Part, list[tuple[str, Part]]] | None:
        """(the boundary READ: each region's last block, posted before the forward pass;
        [(layer, that layer's READ of the other blocks), ...] in layer order, the last one
        carrying NIXL's completion notice). None when the descriptors are not laid out as
        expected: the caller then posts the READ whole."""
        n, regions = len(xfer.local_ids), len(self.region_layers)
        if n == 0 or n != len(xfer.remote_ids) or n % regions:
            return None
        per_region = n // regions
        if per_region <= self.per_block:
            return None  # one block: nothing to overlap
        region_of = np.searchsorted(self.region_offsets, xfer.local_ids, side="right") - 1
        if not np.array_equal(region_of, np.repeat(np.arange(regions), per_region)):
            return None
        positions = np.arange(n).reshape(regions, per_region)
        tail = positions[:, per_region - self.per_block:].ravel()
        body = positions[:, :per_region - self.per_block]
        layers: list[tuple[str, list[int]]] = []
        for region, name in enumerate(self.region_layers):
            if layers and layers[-1][0] == name:
                layers[-1][1].append(region)
            elif any(name == seen for seen, _ in layers):
                return None  # a layer's regions are not adjacent
            else:
                layers.append((name, [region]))
        parts = []
        for i, (name, regions_of_layer) in enumerate(layers):
            notif = xfer.notif if i == len(layers) - 1 else b""
            parts.append((name, xfer.part(body[regions_of_layer].ravel(), notif)))
        return xfer.part(tail, b""), parts


@dataclass
class Plan:
    """One step's layered reads."""

    parts: list[tuple[str, Part]]  # (layer, READ) in posting order
    deadline: float
    events: dict[str, threading.Event] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request -> why
    waited: set[str] = field(default_factory=set)
    wait_s: dict[str, float] = field(default_factory=dict)  # request -> time the forward waited
    telemetry: list[Any] = field(default_factory=list)
    copy_s: float = 0.0
    abandoned: bool = False  # a layer outlived the deadline: the forward pass stops waiting
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        for layer, _ in self.parts:
            self.events.setdefault(layer, threading.Event())

    def requests_of(self, layer: str) -> set[str]:
        return {part.req_id for name, part in self.parts if name == layer}


class LayerReader:
    """The reading thread (started on first use) and the forward pass's per-layer waits.

    `cpus`: where the reading thread runs (None: where the engine's threads run). Only one
    thread calls the NIXL agent at any time: the reading thread from `start` until the plan is
    done, the engine's thread before and after (`finish` waits for the plan)."""

    def __init__(self, worker: Any, *, cpus: set[int] | None, poll_s: float = 0.0002,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.worker = worker
        self.cpus = cpus
        self.poll_s = poll_s
        self._clock = clock
        self._sleep = sleep
        self._plan: Plan | None = None
        self._queue: queue.SimpleQueue[Plan | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.enabled = True

    # ---- engine thread ----------------------------------------------------------------------

    def start(self, plan: Plan) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvbridge-layer-reads",
                                            daemon=True)
            self._thread.start()
        self._plan = plan
        self._queue.put(plan)

    def active(self) -> bool:
        return self._plan is not None

    def wait_for_layer(self, layer: str) -> None:
        """Called by the forward pass before it attends over `layer`."""
        plan = self._plan
        if plan is None:
            return
        event = plan.events.get(layer)
        if event is None:
            return
        started = self._clock()
        if not event.is_set() and not plan.abandoned:
            # Past the deadline the reading thread cancels what is in flight; a transfer that
            # cannot be cancelled is waited for in `finish`, not here: the forward goes on and
            # every request of the plan recomputes (their later layers queue behind it).
            limit = max(plan.deadline - started, 0.0) + 0.5
            if not event.wait(limit):
                plan.abandoned = True
        if plan.abandoned and not event.is_set():
            for _, part in plan.parts:
                plan.failed.setdefault(part.req_id, "timeout")
        plan.waited.add(layer)
        spent = self._clock() - started
        for req_id in plan.requests_of(layer):
            plan.wait_s[req_id] = plan.wait_s.get(req_id, 0.0) + spent

    def finish(self) -> Plan | None:
        """Wait for the step's plan to end (every READ landed, failed or cancelled); returns it
        (None without one). Requests whose layers the forward pass did not wait for are
        failed."""
        plan, self._plan = self._plan, None
        if plan is None:
            return None
        plan.done.wait()
        skipped = set(plan.events) - plan.waited
        if skipped:
            # The forward pass may have attended over blocks still being read.
            self.enabled = False
            for layer in skipped:
                for req_id in plan.requests_of(layer):
                    plan.failed.setdefault(req_id, "layer_not_waited")
            log.error("layerwise_reads_disabled", why="the forward pass did not wait for "
                      "layers it reads (wait_for_layer_load not called)",
                      layers=sorted(skipped)[:4], count=len(skipped))
        return plan

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)

    # ---- reading thread ---------------------------------------------------------------------

    def _run(self) -> None:
        if self.cpus:
            try:
                os.sched_setaffinity(0, self.cpus)  # this thread only
            except (OSError, AttributeError) as exc:
                log.warning("layer_reads_affinity_failed", cpus=sorted(self.cpus),
                            error=str(exc))
        while True:
            plan = self._queue.get()
            if plan is None:
                return
            try:
                self._read(plan)
            except Exception as exc:  # never leave the forward pass waiting
                log.exception("layer_reads_crashed", error=str(exc))
                for _, part in plan.parts:
                    plan.failed.setdefault(part.req_id, "transfer_failed")
            finally:
                for event in plan.events.values():
                    event.set()
                plan.done.set()

    def _read(self, plan: Plan) -> None:
        started = self._clock()
        for i, (layer, part) in enumerate(plan.parts):
            if part.req_id not in plan.failed and self._clock() >= plan.deadline:
                plan.failed[part.req_id] = "timeout"  # not posted: it could only be cancelled
            if part.req_id not in plan.failed:
                why = self._read_part(part, plan)
                if why is not None:
                    plan.failed[part.req_id] = why
            if i + 1 == len(plan.parts) or plan.parts[i + 1][0] != layer:
                plan.events[layer].set()
        plan.copy_s = self._clock() - started

    def _read_part(self, part: Part, plan: Plan) -> str | None:
        """Post one READ and wait for it; the failure reason, or None when it landed."""
        worker = self.worker
        wrapper = _vllm.nixl_agent(worker)
        try:
            handle = wrapper.make_prepped_xfer("READ", part.local, part.local_ids, part.remote,
                                               part.remote_ids, notif_msg=part.notif)
        except Exception as exc:
            _vllm.log_failure(worker, failure_type="transfer_setup_failed", req_id=part.req_id,
                              error=exc, load="layerwise")
            return "not_posted"
        released = False
        try:
            why, released = self._wait(part, plan, wrapper, handle)
            return why
        finally:
            # Whatever happened, the handle is released (a transfer the backend still holds
            # is waited for) before the plan can end and its blocks be reused.
            while not released and not _vllm.try_release_xfer(worker, part.req_id, handle):
                self._sleep(self.poll_s)

    def _wait(self, part: Part, plan: Plan, wrapper: Any, handle: Any) -> tuple[str | None, bool]:
        """Wait for a posted READ: (the failure reason or None, whether it was released)."""
        worker = self.worker
        try:
            state = wrapper.transfer(handle)
        except Exception as exc:
            _vllm.log_failure(worker, failure_type="transfer_exception", req_id=part.req_id,
                              error=exc, load="layerwise")
            state = "ERR"
        cancelled = False
        while state in ("PROC", ""):
            if self._clock() >= plan.deadline and not cancelled:
                cancelled = True
                if _vllm.try_release_xfer(worker, part.req_id, handle):
                    return "timeout", True
                log.error("sync_read_uncancellable", request_id=part.req_id)
            self._sleep(self.poll_s)
            try:
                state = wrapper.check_xfer_state(handle)
            except Exception as exc:  # a dead peer surfaces here
                _vllm.log_failure(worker, failure_type="transfer_exception",
                                  req_id=part.req_id, error=exc, load="layerwise")
                state = "ERR"
        if state == "DONE":
            with contextlib.suppress(Exception):
                plan.telemetry.append(wrapper.get_xfer_telemetry(handle))
            return None, False
        if state != "ERR":
            _vllm.log_failure(worker, failure_type="transfer_failed", req_id=part.req_id,
                              xfer_state=state, load="layerwise")
        return "transfer_failed", False


@contextlib.contextmanager
def capturing(worker: Any, owners: dict[str, str]) -> Iterator[None]:
    """NIXL's worker prepares but does not post the READs of `owners` while this lasts."""
    if not owners:
        yield
        return
    inner = _vllm.nixl_agent(worker)
    _vllm.set_nixl_agent(worker, CapturingWrapper(inner, owners))
    try:
        yield
    finally:
        _vllm.set_nixl_agent(worker, inner)
