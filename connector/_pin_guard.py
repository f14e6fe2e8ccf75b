"""Reads happen under a live pin: checked where the READ is posted and where it lands.

The scheduler decides on a hit with the pin's end in view (it declines a pin within
`pin_margin_s` of its end), but NIXL's worker posts an asynchronous READ later: after this
step's forward pass, or only once a background handshake with the decode engine finishes, and
the READ then takes its own time. Past the pin's end the registry may call the lease
reclaimable and decode may free, and reuse, the blocks under the READ: what lands could be
another request's KV. So the worker checks the pin twice:

- before posting: a read whose pin ends within the margin is not posted; the request is
  reported failed and recomputes (as NIXL does for its own expiring blocks);
- on landing: a read that NIXL reports done only after the pin's end is reported failed, its
  blocks invalid, so the scheduler recomputes them. A read seen done before the end was under
  the pin all along.

The scheduler sends each read's pin end in the step's connector metadata (`PinEnds`). On the
same host (the same kernel boot) the monotonic clock is shared, so the end is used as is: the
time the metadata spends waiting for the worker (under asynchronous scheduling, a whole
forward pass) cannot lengthen it. A worker on another host rebases the remaining duration onto
its own clock, less the time its metadata can be late (`_REBASE_SLACK_S`), and logs once that
it does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from kvbridge.clock import boot_id, monotonic
from kvbridge.connector import _vllm

log = structlog.get_logger("kvbridge.connector")

# The attribute of the scheduler's NixlConnectorMetadata carrying this step's pin ends.
PIN_ENDS_ATTR = "kvbridge_pin_ends"
# A worker on another host than its scheduler: metadata can reach it this much later than it
# was built (a forward pass under asynchronous scheduling), so pins are taken to end this much
# sooner than their remaining time says.
_REBASE_SLACK_S = 1.0
# Ends kept for reads never reported done (a request aborted before its read was posted): let
# go this long after the pin ended.
_FORGET_AFTER_S = 60.0


@dataclass
class PinEnds:
    """Sent with a step's metadata: when each read's pin ends, on the scheduler's monotonic
    clock, read at `clock` on the host with boot id `boot`."""

    boot: str
    clock: float
    ends: dict[str, float] = field(default_factory=dict)


class PinGuard:
    """Worker side: the pin end of each read this worker may post, on its own clock."""

    def __init__(self, margin_s: float, *, clock: Callable[[], float] = monotonic,
                 boot: str | None = None) -> None:
        self.margin_s = margin_s
        self._clock = clock
        self._boot = boot_id() if boot is None else boot
        self._ends: dict[str, float] = {}
        self._rebase_logged = False

    def update(self, metadata: object) -> None:
        """Take the pin ends of this step's reads (before NIXL's worker sees the step)."""
        sent = _vllm.attached(metadata, PIN_ENDS_ATTR)
        if not isinstance(sent, PinEnds) or not sent.ends:
            return
        now = self._clock()
        same_host = bool(sent.boot) and sent.boot == self._boot
        if not same_host and not self._rebase_logged:
            self._rebase_logged = True
            log.info("kvbridge_pin_ends_rebased", why="the scheduler runs on another host: "
                     "pin ends are rebased onto this worker's clock", slack_s=_REBASE_SLACK_S)
        for req_id, end in sent.ends.items():
            local = end if same_host else now + (end - sent.clock) - _REBASE_SLACK_S
            # A read already known keeps its first end (a pin is never extended by a resend).
            self._ends[req_id] = min(local, self._ends.get(req_id, local))
        for req_id in [r for r, end in self._ends.items() if end + _FORGET_AFTER_S < now]:
            del self._ends[req_id]

    def left(self, req_id: str) -> float | None:
        """Seconds left of the read's pin; None for a read that is not kvbridge's."""
        end = self._ends.get(req_id)
        return None if end is None else end - self._clock()

    def may_post(self, req_id: str) -> bool:
        """Whether the read may be posted now: its pin has more than the margin left."""
        left = self.left(req_id)
        return left is None or left > self.margin_s

    def landed_in_time(self, req_id: str) -> bool:
        """The read is seen done now: whether its pin was still live (and forget it)."""
        end = self._ends.pop(req_id, None)
        return end is None or self._clock() < end

    def forget(self, req_id: str) -> None:
        self._ends.pop(req_id, None)

    def known(self) -> list[str]:
        return list(self._ends)

    def __len__(self) -> int:
        return len(self._ends)


# Why a read was failed for its pin (reported to the scheduler side, counted as decisions).
NOT_POSTED = "pin_margin_when_posted"
LANDED_LATE = "pin_expired_in_read"


def guard_worker(worker: Any, guard: PinGuard, report: Callable[[str, str], None]) -> bool:
    """Check the pins of the reads NIXL's pull worker posts itself (asynchronous reads, and
    the posting of synchronous ones): wraps its `_read_blocks_for_req`, where every READ is
    posted (at once, or once a handshake is done), and its `get_transfer_results`, where
    finished reads are reported. `report(request_id, why)` hears of each read failed here.
    False, and nothing wrapped, when this vLLM's worker lacks a name the guard uses (the
    scheduler side then plans no reads: `KVBridgeConnector._reads_guarded`)."""
    if not _vllm.usable(_vllm.PIN_GUARD, _vllm.worker_objects(worker),
                        owners=[_vllm.WORKER, _vllm.STATS]):
        return False
    read_blocks = _vllm.read_blocks_for_req(worker)
    transfer_results = _vllm.transfer_results(worker)

    def _read_blocks_for_req(req_id: str, meta: Any) -> None:
        if guard.may_post(req_id):
            read_blocks(req_id, meta)
            return
        left = guard.left(req_id)
        guard.forget(req_id)
        _vllm.xfer_stats(worker).record_kv_expired_req()
        log.warning("kv_read_not_posted", request_id=req_id, why=NOT_POSTED,
                    pin_left_s=None if left is None else round(left, 3),
                    margin_s=guard.margin_s)
        report(req_id, NOT_POSTED)
        # As NIXL fails a read of blocks about to expire: reported done and failed, recomputed.
        _vllm.fail_read(worker, req_id)

    def get_transfer_results() -> Any:
        recving = _vllm.recving_metadata(worker)
        blocks = {r: recving[r].local_block_ids for r in guard.known() if r in recving}
        results = transfer_results()
        for req_id in results.finished_recving:
            if req_id in results.failed_recving:
                guard.forget(req_id)
                continue
            if guard.landed_in_time(req_id):
                continue
            results.failed_recving.add(req_id)
            if req_id in blocks and not _vllm.hma_required(worker):
                _vllm.report_invalid_blocks(worker, set(blocks[req_id][0]))
            _vllm.xfer_stats(worker).record_kv_expired_req()
            log.warning("kv_read_recompute", request_id=req_id, why=LANDED_LATE)
            report(req_id, LANDED_LATE)
        return results

    _vllm.set_read_blocks_for_req(worker, _read_blocks_for_req)
    _vllm.set_transfer_results(worker, get_transfer_results)
    return True
