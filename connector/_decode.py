"""Decode side: keep a finished turn's KV blocks under a lease, free them when told to.

Retention pins the blocks in vLLM's block pool (one extra reference each), so the request
itself is freed as usual, the engine loop does not spin, and the blocks stay in decode's own
prefix cache for the next turn. Grants run on a background thread (never on the scheduler's
critical path); reclaim notices arrive on the holder session's heartbeat thread; both hand work
to the scheduler thread through a queue, since the block pool is not thread-safe.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from kvbridge import blockhash
from kvbridge.clients import GrantOutcomeUnknown, HolderSession, RegistryClient
from kvbridge.clock import Clock, monotonic
from kvbridge.connector import _vllm
from kvbridge.connector._metrics import ConnectorMetrics
from kvbridge.connector._settings import (
    REMOTE_ID_PREFIX,
    ConnectorSettings,
    conversation_of,
    history_keys_of,
    kv_scope,
)

log = structlog.get_logger("kvbridge.connector")

# How long a RevokeLease round may take before the scheduler stops deferring preemption for
# it: a registry that answers answers within milliseconds (see `make_room`).
_REVOKE_WAIT_S = 0.25


def _unindex(index: dict[Any, set[str]], entry: Any, key: str) -> None:
    keys = index.get(entry)
    if keys is not None:
        keys.discard(key)
        if not keys:
            del index[entry]


@dataclass
class _Retained:
    key: str  # the remote request id readers name
    block_ids: list[int]
    tokens: int
    since: float
    lease_id: str = ""
    grant_request_id: str = ""  # set while the grant's outcome is unknown
    conversation: tuple[str, str] | None = None  # (tenant, conversation id)
    full_hashes: tuple[Any, ...] = ()  # vLLM's hashes of its full blocks, in order


class DecodeRetention:
    def __init__(self, settings: ConnectorSettings, client: RegistryClient, *, holder_id: str,
                 nixl_host: str, nixl_port: int, block_size: int, fingerprint: str,
                 tp_size: int, metrics: ConnectorMetrics, software_version: str = "",
                 clock: Clock | None = None) -> None:
        self.settings = settings
        # Retention's own timers (revocation waits, headroom window): a FakeClock in tests.
        self._now: Callable[[], float] = monotonic if clock is None else clock.monotonic
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.session = HolderSession(
            client, holder_id=holder_id, nixl_host=nixl_host, nixl_port=nixl_port,
            block_size=block_size, engine_fingerprint=fingerprint, tp_size=tp_size,
            ttl=settings.holder_ttl_s, hard_deadline_margin=settings.hard_deadline_margin_s,
            on_reclaim=self._on_reclaim, software_version=software_version,
            on_grant_resolved=self._on_grant_resolved)
        self._pool: Any = None  # vLLM BlockPool, bound by the scheduler
        self._grants = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-grant")
        # Revocations make room for arriving requests: never queued behind slow grants.
        self._revokes = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-revoke")
        self._lock = threading.Lock()
        self._by_key: dict[str, _Retained] = {}
        self._by_lease: dict[str, str] = {}
        self._by_grant: dict[str, str] = {}  # grant request id (outcome unknown) -> key
        self._resolved_early: dict[str, Any] = {}  # resolved before _grant recorded the id
        self._granting = 0  # grants submitted and not finished (queued or in flight)
        self._frees: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._reclaimed_early: set[str] = set()  # reported before _grant recorded the lease
        self._revoking = False
        self._in_flight: set[str] = set()  # of _revoked, those whose RevokeLease is running
        self._revoke_sent = 0.0  # when the running RevokeLease round started
        # After a round the registry failed: no new round until then (an unreachable registry
        # answers each only at its timeout; meanwhile vLLM must be free to preempt).
        self._revoke_backoff_until = 0.0
        self._revoked: set[str] = set()  # revoked for memory, blocks not freed yet
        self._revoked_pinned: set[str] = set()  # of those, the ones a reader still pins
        # Blocks that arrived requests still need before they can be scheduled: retention
        # gives way to them at once instead of making them wait for leases to expire.
        self._demand: dict[str, tuple[int, float]] = {}  # request id: (blocks, arrived at)
        # The conversations of requests here (arrived, not finished): their own retained turns
        # are the prefix those requests reuse, so revoking them frees nothing for them.
        self._active: dict[str, tuple[str, str]] = {}  # request id: conversation
        # Retained turns by vLLM's hash of each of their full blocks: an arriving request finds
        # there the prefix decode's cache already holds for it, its own history or another
        # conversation's (a shared system prompt), and needs no new blocks for it.
        self._by_hash: dict[Any, set[str]] = {}
        # Until a request has its blocks: the turn that holds the prefix it was credited with,
        # kept from revocation (which would free those blocks only for the request to take
        # them back from the prefix cache, short of what it was counted to need).
        self._credited: dict[str, str] = {}  # request id: retained turn's key
        self._shared = False  # whether this vLLM's blocks show their reference counts
        # Bumped whenever a victim search could find more (a lease recorded or not revoked
        # after all, retained blocks freed, a request's blocks or credit let go). A search
        # that found no victim is not run again until then, or until the pool's free count
        # moves (vLLM frees a request's blocks, or a preempted one's, without telling the
        # connector): under pressure it would otherwise run at every step.
        self._changes = 0
        self._fruitless: tuple[int, int] | None = None  # (changes, free blocks) it ran at
        self._hash_size_warned = False
        self._request_hashes: bool | None = None  # whether its requests show their hashes
        # Headroom: the peak of that demand over a recent window, kept free ahead of the next
        # arrivals. A monotonic queue of (arrived at, demand): values decrease front to back,
        # so the front is the window's maximum.
        self._peaks: collections.deque[tuple[float, int]] = collections.deque()

    def start(self) -> None:
        self.session.start()

    def bind(self, block_pool: Any) -> None:
        """Retain into this block pool (none, and nothing retained, if this vLLM's pool
        lacks what retention uses)."""
        if not _vllm.usable(_vllm.RETENTION, {_vllm.BLOCK_POOL: block_pool},
                            owners=[_vllm.BLOCK_POOL]):
            return
        self._pool = block_pool
        self._shared = _vllm.usable(
            _vllm.SHARED_BLOCKS, {_vllm.KV_CACHE_BLOCK: _vllm.null_block(block_pool)},
            owners=[_vllm.KV_CACHE_BLOCK])
        self.metrics.kv_blocks.set(_vllm.pool_blocks(block_pool))
        self.metrics.free_blocks.set_function(_vllm.free_block_counter(block_pool))

    # ---- scheduler thread -------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """A request arrived: free what was reclaimed, and make room for it if retained turns
        hold the blocks it needs."""
        self.drain()
        conversation = conversation_of(request.kv_transfer_params)
        held, holder = self._held_blocks(request)
        need = -(-request.num_tokens // self.block_size) + 1 - held
        with self._lock:
            if conversation is not None:
                self._active[request.request_id] = conversation
            if holder:
                self._credited[request.request_id] = holder
        now = self._now()
        self._demand[request.request_id] = (need, now)
        self._note_demand(sum(n for n, _ in self._demand.values()), now)
        self.check_watermark()

    def _full_hashes(self, request: Any) -> Sequence[Any]:
        """vLLM's hashes of the request's full blocks, one per block of this pool; none where
        this vLLM hides them or hashes at another granularity."""
        if self._request_hashes is None:  # checked on the first request, as it arrives
            self._request_hashes = self._shared and _vllm.usable(
                _vllm.SHARED_BLOCKS, {_vllm.REQUEST: request}, owners=[_vllm.REQUEST])
            self._shared = self._request_hashes  # the feature is off as a whole
        if not self._request_hashes:
            return ()
        hashes = _vllm.block_hashes(request)
        if len(hashes) == request.num_tokens // self.block_size:
            return hashes
        if not self._hash_size_warned:  # prefix caching off, or hashed at another size
            self._hash_size_warned = True
            log.warning("shared_blocks_unseen", request_id=request.request_id,
                        block_hashes=len(hashes), tokens=request.num_tokens,
                        block_size=self.block_size,
                        why="the request's block hashes are not one per block: requests "
                            "count their whole prompt when making room")
        return ()

    def _held_blocks(self, request: Any) -> tuple[int, str]:
        """How many leading full blocks of the request's prompt turns retained here (and not
        revoked) hold, and one such turn: vLLM finds those blocks in decode's prefix cache, so
        the request needs no new blocks for them. At most the blocks before the last token,
        which vLLM always computes. An estimate for making room (the blocks may be evicted
        meanwhile): a request that needs more still gets room as vLLM asks for it
        (`make_room`)."""
        hashes = self._full_hashes(request)
        lo, hi = 0, min(len(hashes), (request.num_tokens - 1) // self.block_size)
        holder = ""
        with self._lock:
            if not self._by_hash:
                return 0, ""
            # The hashes chain: a turn holding block i holds every block before it, so the
            # blocks held are a prefix, found in a binary search (lo held, hi-1 the last tried).
            while lo < hi:
                mid = (lo + hi + 1) // 2
                key = self._live_holder(hashes[mid - 1])
                if key:
                    lo, holder = mid, key
                else:
                    hi = mid - 1
        return lo, holder

    def _live_holder(self, block_hash: Any) -> str:
        """The newest retained, not revoked turn holding a block of this hash ("": none; lock
        held)."""
        turns = (self._by_key[k] for k in self._by_hash.get(block_hash, ()) if k in self._by_key)
        live = [r for r in turns if r.lease_id not in self._revoked]
        return max(live, key=lambda r: r.since).key if live else ""

    def request_done(self, request_id: str) -> None:
        """A request left the scheduler (finished, aborted, or handed to a remote reader)."""
        self._demand.pop(request_id, None)
        with self._lock:
            self._active.pop(request_id, None)
            self._credited.pop(request_id, None)
            self._changes += 1

    def allocated(self, request_id: str) -> None:
        """The scheduler gave the request its blocks: no demand left."""
        demand = self._demand.pop(request_id, None)
        with self._lock:  # it holds its blocks itself now
            if self._credited.pop(request_id, None) is not None:
                self._changes += 1
        if demand is not None:
            self.metrics.admission_wait.observe(self._now() - demand[1])

    def on_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> dict[str, Any] | None:
        """Retain a normally finished conversation turn's blocks and grant a lease over them in
        the background. Returns extra kv_transfer_params for the response, or None."""
        self.request_done(request.request_id)
        key = conversation_of(request.kv_transfer_params)
        if (key is None or self._pool is None
                or not _vllm.finished_normally(request)):
            return None
        if len(block_ids) != 1:
            log.warning("retention_skipped", request_id=request.request_id,
                        why="multiple KV cache groups are not supported")
            return None
        computed = request.num_computed_tokens
        blocks = list(block_ids[0][: -(-computed // self.block_size)])
        if computed <= 0 or not blocks or 0 in blocks:
            return None
        with self._lock:
            unsettled = self._granting + len(self._by_grant)
            again = f"{REMOTE_ID_PREFIX}{request.request_id}" in self._by_key
        if again:  # a request id used twice: the turn retained under it keeps its place
            log.warning("retention_skipped", request_id=request.request_id,
                        why="a turn of this request id is retained already")
            return None
        if unsettled >= self.settings.max_unsettled_grants:
            self.metrics.retention_skipped.inc()
            log.warning("retention_skipped", request_id=request.request_id,
                        why="registry slow or unreachable", unsettled_grants=unsettled)
            return None
        scope = kv_scope(request, self.fingerprint)
        if scope is None:  # inputs the block hashes cannot cover: never read back
            log.info("retention_skipped", request_id=request.request_id,
                     why="multimodal or embedding inputs")
            return None
        tokens = list(request.all_token_ids[:computed])
        hashes = blockhash.block_hashes(tokens, self.block_size, *scope, include_partial=True)
        _vllm.hold_blocks(self._pool, blocks)
        full = tuple(self._full_hashes(request)[: computed // self.block_size])
        retained = _Retained(f"{REMOTE_ID_PREFIX}{request.request_id}", blocks, computed,
                             self._now(), conversation=key, full_hashes=full)
        with self._lock:
            self._by_key[retained.key] = retained
            for block_hash in full:
                self._by_hash.setdefault(block_hash, set()).add(retained.key)
        self.metrics.retained_blocks.inc(len(blocks))
        self.metrics.retained_turns.inc()
        tenant, conversation = key
        with self._lock:
            self._granting += 1
        self._grants.submit(self._grant, retained, tenant, conversation, hashes,
                            history_keys_of(request.kv_transfer_params))
        return {"kvbridge_retained_tokens": computed}

    def drain(self) -> int:
        """Free what was reclaimed since the last call. Returns blocks freed."""
        freed = 0
        while True:
            try:
                key, why = self._frees.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                retained = self._by_key.pop(key, None)
                for block_hash in () if retained is None else retained.full_hashes:
                    _unindex(self._by_hash, block_hash, key)
                if retained is not None and retained.lease_id:
                    self._by_lease.pop(retained.lease_id, None)
                    self._revoked.discard(retained.lease_id)
                    self._revoked_pinned.discard(retained.lease_id)
            if retained is None or self._pool is None:
                continue
            _vllm.release_blocks(self._pool, reversed(retained.block_ids))
            with self._lock:  # after the release: a victim search sees the counts it left
                self._changes += 1
            freed += len(retained.block_ids)
            self.metrics.retained_blocks.dec(len(retained.block_ids))
            self.metrics.retained_turns.dec()
            self.metrics.blocks_freed.labels(why).inc(len(retained.block_ids))
            log.info("retained_blocks_freed", lease_id=retained.lease_id or None,
                     blocks=len(retained.block_ids), why=why,
                     held_s=round(self._now() - retained.since, 1))
        return freed

    def make_room(self) -> bool:
        """The scheduler could not allocate blocks (vLLM's `has_pending_block_frees`): free
        what was reclaimed, revoke idle leases if memory is short, and say whether blocks were
        just freed or are about to be (revoked leases no reader pins), so that the scheduler
        tries again next step instead of preempting a running request. Blocks under a pinned
        revocation do not count: they wait for the pin, which may last its whole TTL. Nor does
        a revocation the registry has not answered past `_REVOKE_WAIT_S`: an unreachable
        registry answers only at its timeout, and a failed round is not retried at once, so
        during an outage vLLM preempts as it would without kvbridge."""
        freed = self.drain()
        self.check_watermark()
        if freed:
            return True
        with self._lock:
            if any(lid in self._by_lease
                   for lid in self._revoked - self._revoked_pinned - self._in_flight):
                return True  # reported reclaimable: freed by the next drain
            return bool(self._in_flight) and (
                self._now() - self._revoke_sent < _REVOKE_WAIT_S)

    def _note_demand(self, blocks: int, now: float) -> None:
        if self.settings.headroom_window_s <= 0:
            return
        with self._lock:
            peaks = self._peaks
            while peaks and peaks[-1][1] <= blocks:
                peaks.pop()
            peaks.append((now, blocks))

    def headroom(self) -> int:
        """Blocks to keep free ahead of demand: the most that arriving requests needed at once
        within the window, capped at `headroom_cap` of the pool."""
        if self._pool is None or self.settings.headroom_window_s <= 0:
            return 0
        horizon = self._now() - self.settings.headroom_window_s
        with self._lock:
            peaks = self._peaks
            while peaks and peaks[0][0] < horizon:
                peaks.popleft()
            peak = peaks[0][1] if peaks else 0
        blocks = min(peak, int(_vllm.pool_blocks(self._pool) * self.settings.headroom_cap))
        self.metrics.headroom_blocks.set(blocks)
        return blocks

    def check_watermark(self) -> None:
        """Revoke the oldest idle leases while free blocks (plus those revoked and about to be
        freed) are below the watermark plus what waiting requests need, or plus the headroom
        kept for the next arrivals, whichever is more.

        Called on the scheduler thread (at each step and as requests arrive) and on the grant
        thread once a new lease is recorded, so room is made while the engine is idle, before
        the next request comes."""
        pool = self._pool
        if pool is None or self._revoking or self._now() < self._revoke_backoff_until:
            return
        total = _vllm.pool_blocks(pool)
        watermark = int(total * self.settings.free_watermark)
        try:  # may run off the scheduler thread: a snapshot of the waiting requests' need
            waiting = sum(need for need, _ in tuple(self._demand.values()))
        except RuntimeError:  # changed while copied: the scheduler thread checks again
            return
        headroom = self.headroom()
        free = _vllm.free_block_counter(pool)()
        with self._lock:
            if self._revoking:
                return
            # Turns share blocks (a system prompt one conversation left in decode's prefix
            # cache and the next found there), and so may running requests: a block is freed
            # only with its last reference. Revoked turns no reader pins are freed by the next
            # drain; the blocks they alone hold are about to be free.
            leaving = collections.Counter(
                b for lid in self._revoked - self._revoked_pinned if lid in self._by_lease
                for b in self._by_key[self._by_lease[lid]].block_ids)
            available = free + self._freed_with(leaving, leaving)
            deficit = watermark + max(waiting, headroom) - available
            if deficit <= 0:
                return
            cause = "demand" if watermark + waiting > available else "headroom"
            if self._fruitless == (self._changes, free):
                return
            # Revoked but pinned: a reader is copying them; freed when the pin ends. A
            # conversation with a request here is not a victim: that request reuses its
            # retained turn, so revoking it frees no room and costs the next turn its read.
            # Nor is a turn whose prefix an arriving request was counted as finding.
            busy = set(self._active.values())
            credited = set(self._credited.values())
            leased = sorted((r for r in self._by_key.values()
                             if r.lease_id and r.lease_id not in self._revoked
                             and r.conversation not in busy and r.key not in credited),
                            key=lambda r: r.since)
            # A victim counts only the blocks it frees; one that would free none (all its
            # blocks held by newer turns or requests too) is spared.
            victims: list[str] = []
            for retained in leased:
                if deficit <= 0:
                    break
                leaving.update(retained.block_ids)
                frees = self._freed_with(leaving, retained.block_ids)
                if frees == 0:
                    leaving.subtract(retained.block_ids)
                    continue
                victims.append(retained.lease_id)
                deficit -= frees
            if not victims:
                self._fruitless = (self._changes, free)
                return
            self._revoking = True
            self._revoked.update(victims)
            self._in_flight = set(victims)
            self._revoke_sent = self._now()
        self.metrics.revocations.labels(cause).inc()
        self._revokes.submit(self._revoke, victims, self._now(), cause)

    def _freed_with(self, leaving: collections.Counter[int], blocks: Iterable[int]) -> int:
        """How many of `blocks` are freed once the retained turns `leaving` (the references
        they drop, by block) let go: those with no other reference. Where this vLLM hides
        reference counts, every one."""
        if not self._shared or self._pool is None:
            return len(set(blocks))
        return sum(1 for b in set(blocks) if _vllm.block_refs(self._pool, b) <= leaving[b])

    # ---- background threads -----------------------------------------------------------------

    def _grant(self, retained: _Retained, tenant: str, conversation: str, hashes: bytes,
               history_keys: bytes = b"") -> None:
        try:
            self._grant_once(retained, tenant, conversation, hashes, history_keys)
        finally:
            with self._lock:
                self._granting -= 1

    def _grant_once(self, retained: _Retained, tenant: str, conversation: str,
                    hashes: bytes, history_keys: bytes = b"") -> None:
        try:
            lease = self.session.grant(
                tenant, conversation, retained.key, retained.block_ids, retained.tokens, hashes,
                idle_ttl=self.settings.idle_ttl_s, max_lifetime=self.settings.max_lifetime_s,
                history_keys=history_keys, timeout=self.settings.rpc_timeout_s)
        except GrantOutcomeUnknown as unknown:
            # The registry may have made the lease, and a reader may use it: the blocks stay
            # until the session learns the outcome (or the grant's hard deadline passes).
            self.metrics.grants_unresolved.inc()
            with self._lock:
                resolved = unknown.request_id in self._resolved_early
                early = self._resolved_early.pop(unknown.request_id, None)
                if not resolved:
                    retained.grant_request_id = unknown.request_id
                    self._by_grant[unknown.request_id] = retained.key
                    return
            # The heartbeat thread resolved it before this thread got here.
            if early is None:
                self._frees.put((retained.key, "grant_unresolved"))
            else:
                self._record(retained, early, conversation)
            return
        if lease is None:  # no lease, no reader: free right away
            self._frees.put((retained.key, "grant_failed"))
            return
        self._record(retained, lease, conversation)

    def _on_grant_resolved(self, request_id: str, lease: Any) -> None:
        """The session learned what became of a grant whose outcome was unknown."""
        with self._lock:
            key = self._by_grant.pop(request_id, None)
            if key is None:  # _grant has not recorded it yet: it will find this there
                self._resolved_early[request_id] = lease
                return
            retained = self._by_key.get(key)
            if retained is not None:
                retained.grant_request_id = ""
        if retained is None:
            return
        if lease is None:  # refused, or its hard deadline passed: no reader can use them now
            self._frees.put((retained.key, "grant_unresolved"))
            return
        self._record(retained, lease, lease.conversation_id)

    def _record(self, retained: _Retained, lease: Any, conversation: str) -> None:
        with self._lock:
            retained.lease_id = lease.lease_id
            self._by_lease[lease.lease_id] = retained.key
            self._changes += 1
            early = lease.lease_id in self._reclaimed_early
            self._reclaimed_early.discard(lease.lease_id)
        if early:
            self._frees.put((retained.key, "reclaimed"))
        self.metrics.leases_granted.inc()
        log.info("lease_granted", lease_id=lease.lease_id, conversation=conversation,
                 epoch=lease.epoch, blocks=len(retained.block_ids), tokens=retained.tokens)
        # This lease may have eaten into the headroom: make room now, while the engine may be
        # idle, rather than when the next request arrives.
        self.check_watermark()

    def _on_reclaim(self, lease_ids: list[str]) -> None:
        # The session forgets these leases once this returns, so none may be dropped: a lease
        # reported between session.grant() returning and _grant() recording it is freed by
        # _grant() (otherwise its blocks would be held forever, under no lease).
        with self._lock:
            for lid in lease_ids:
                key = self._by_lease.get(lid)
                if key is None:
                    self._reclaimed_early.add(lid)
                else:
                    self._frees.put((key, "reclaimed"))

    def _revoke(self, lease_ids: list[str], submitted: float, cause: str = "demand") -> None:
        try:
            started = self._now()
            result = self.session.revoke(lease_ids, "memory_pressure")
            with self._lock:
                # Not revoked: they may be picked again on a later pass, not at once.
                self._revoked.difference_update(result.failed)
                self._changes += 1
                if result.unreachable:  # not a lease refused (say, gone): the registry
                    self._revoke_backoff_until = (self._now()
                                                  + max(self.settings.rpc_timeout_s, 1.0))
                # Pinned: freed when the pin ends, so not counted as free meanwhile.
                self._revoked_pinned.update(lid for lid in result.pinned
                                            if lid in self._revoked)
            self.metrics.leases_revoked.labels("freed").inc(len(result.freed))
            self.metrics.leases_revoked.labels("pinned").inc(len(result.pinned))
            log.info("leases_revoked_for_memory", cause=cause, count=len(lease_ids),
                     freed_now=len(result.freed), pinned=len(result.pinned),
                     failed=len(result.failed),
                     queued_ms=round((started - submitted) * 1000, 1),
                     rpc_ms=round((self._now() - started) * 1000, 1))
        finally:
            with self._lock:
                self._in_flight = set()
            self._revoking = False

    def close(self) -> None:
        self._grants.shutdown(wait=False, cancel_futures=True)
        self._revokes.shutdown(wait=False, cancel_futures=True)
        self.session.close()
