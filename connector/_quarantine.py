"""Prefill, scheduler side: the blocks a synchronous read fills, kept from other requests until
the read is known to have landed.

With prefix caching on, vLLM hashes all of a request's full blocks when it allocates them, if
the request does not load asynchronously: the blocks a synchronous read is about to fill, and
those its new tokens are computed into over them, are findable by the next request with the same
prefix before the step that fills them has run. If the read then fails, vLLM truncates the
reading request and recomputes it (with `kv_load_failure_policy: recompute` it leaves the blocks
cached, since that request rewrites them), but only as fast as its token budget allows: another
request could meanwhile be computed over what the failed read left.

So, from its allocation until its step reports, a read's blocks (from the first one it fills to
the request's last) are held here by their hashes. A request whose local prefix hit reaches into
held blocks is asked again at the next step (the connector answers vLLM "not yet"). When the
step reports, a read that landed releases its blocks; one that failed, or was never reported,
has them evicted from the prefix cache first: they stay allocated to the reading request, which
recomputes them, and no one finds them again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog

log = structlog.get_logger("kvbridge.connector")


@dataclass
class _Held:
    blocks: list[int]
    hashes: list[bytes]
    step: int | None = None  # the schedule it was posted in (None: that schedule is under way)


class Quarantine:
    """`evict(block_ids)` takes blocks out of the engine's prefix cache (they stay allocated)."""

    def __init__(self, evict: Callable[[set[int]], None]) -> None:
        self._evict = evict
        self._held: dict[str, _Held] = {}
        self._hashes: dict[bytes, int] = {}  # hash -> how many held reads have it
        self._step = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req_id: str, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """A read placed in this schedule: `blocks` are the request's from the first the read
        fills to its last, `hashes` those of its full blocks from the same place."""
        self._drop(req_id)  # placed again (cannot happen): the newer placement counts
        held = _Held(list(blocks), list(hashes))
        self._held[req_id] = held
        for h in held.hashes:
            self._hashes[h] = self._hashes.get(h, 0) + 1

    def reaches(self, hashes: Sequence[bytes], local_blocks: int) -> bool:
        """Whether a local prefix hit of `local_blocks` blocks (whose hashes are the first of
        `hashes`) reaches into a held read's blocks: the request must then wait a step."""
        if not self._hashes or local_blocks <= 0:
            return False
        return any(h in self._hashes for h in hashes[:local_blocks])

    def scheduled(self) -> None:
        """The schedule is complete (its metadata is built). Reads held since an earlier
        schedule whose outcome was never reported are evicted: without async scheduling each
        step reports before the next is scheduled, so they are not coming."""
        stale = [r for r, held in self._held.items()
                 if held.step is not None and held.step < self._step]
        for req_id in stale:
            self._release(req_id, landed=False, why="not_reported")
        for held in self._held.values():
            if held.step is None:
                held.step = self._step
        self._step += 1

    def reported(self, outcomes: Iterable[tuple[str, bool]]) -> None:
        """A step's synchronous reads: (request id, landed)."""
        for req_id, landed in outcomes:
            if req_id in self._held:
                self._release(req_id, landed=landed, why="failed")

    def _release(self, req_id: str, *, landed: bool, why: str) -> None:
        held = self._drop(req_id)
        if held is None or landed:
            return
        if held.blocks:
            self._evict(set(held.blocks))
        log.warning("sync_read_blocks_evicted", request_id=req_id, blocks=len(held.blocks),
                    why=why)

    def _drop(self, req_id: str) -> _Held | None:
        held = self._held.pop(req_id, None)
        if held is None:
            return None
        for h in held.hashes:
            left = self._hashes[h] - 1
            if left:
                self._hashes[h] = left
            else:
                del self._hashes[h]
        return held
