"""Prefill side: find verified, pinned KV of a conversation on a decode engine, or recompute.

All methods run on the engine-core scheduler thread except the RPCs, which run on a small
thread pool so that AcquireRead overlaps the request's own queueing. The control plane is never
trusted blindly: a miss, an error, a deadline, a partial block whose hash differs, a pin close
to its end, or a read expected to be slower than recomputing (`_cost`) all mean "recompute".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from kvbridge import blockhash
from kvbridge.clients import seconds
from kvbridge.clock import Clock, monotonic
from kvbridge.connector._cost import PROBE, CostModel, Decision
from kvbridge.connector._metrics import ConnectorMetrics
from kvbridge.connector._pin_guard import LANDED_LATE, NOT_POSTED
from kvbridge.connector._routed import (
    LEASE_WHOLE,
    PIN_LEFT,
    READ_KEY,
    RELEASED_BY,
    ROUTED_TRANSIT_SLACK_S,
    BadRoutedRead,
    routed_pin_base,
    verified_read,
)
from kvbridge.connector._settings import (
    CONVERSATION_KEY,
    ConnectorSettings,
    conversation_of,
    kv_scope,
)
from kvbridge.errors import KvbridgeError
from kvbridge.registry.v1 import registry_pb2 as pb

log = structlog.get_logger("kvbridge.connector")

# Reads the worker failed for their pin (see `_pin_guard`): their own decision labels.
PIN_FAILURES = (NOT_POSTED, LANDED_LATE)

REMOTE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                 "remote_port", "remote_num_tokens", "tp_size")



def _estimates(decision: Decision) -> dict[str, Any]:
    """What a cost decision was made on, for its log line (nothing while not learned)."""
    if decision.read_s is None or decision.recompute_s is None:
        return {}
    return {"read_est_ms": round(decision.read_s * 1000, 2),
            "recompute_est_ms": round(decision.recompute_s * 1000, 2)}


def _forget_remote_blocks(params: dict[str, Any]) -> None:
    """No (more) remote blocks to read for this request: NIXL will not queue its read again."""
    params.pop("remote_block_ids", None)
    params["remote_num_tokens"] = 0


class ReadClient(Protocol):
    """Where reads are resolved: the registry (RegistryClient) or a router (RouterClient)."""

    def acquire_read(self, tenant: str, conversation_id: str, block_hashes: bytes,
                     min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                     request_id: str | None = None, *, timeout: float | None = None
                     ) -> pb.AcquireReadResponse: ...

    def release_read(self, pin_id: str, *, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...

@dataclass
class _Pending:
    tenant: str
    conversation: str
    hashes: bytes
    future: Future[pb.AcquireReadResponse]
    deadline: float
    started: float = 0.0
    answered: float = 0.0  # when the AcquireRead came back (monotonic)
    source: str = "lookup"  # "route": pinned when the gateway routed the turn
    pin_base: float | None = None  # when the pin's expires_in counts from (None: started)


@dataclass
class _Active:
    pin_id: str
    tokens: int
    started: float
    conversation: str
    params: dict[str, Any]
    pin_end: float  # when the pin runs out (monotonic, as the reply was received)
    sync: bool = False  # read within the step that computes the request
    posted: bool = False  # the read went out (a synchronous one, in this step)
    sent: bool = False  # handed to the worker to post (either kind): a READ may be in flight


class PrefillReuse:
    def __init__(self, settings: ConnectorSettings, client: ReadClient, *, reader_id: str,
                 block_size: int, fingerprint: str, threshold: int,
                 metrics: ConnectorMetrics, clock: Clock | None = None) -> None:
        self.settings = settings
        # Pin ends are compared with times on this clock (and, on one host, with the gateway's
        # and the workers' `monotonic()`): tests inject a FakeClock, engines use the deadline
        # clock itself.
        self._now: Callable[[], float] = monotonic if clock is None else clock.monotonic
        self.client = client
        self.reader_id = reader_id
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.metrics = metrics
        # Until compute is measured (`step_scheduled` / `step_done`; never on a vLLM lacking a
        # name the step's shape is read from), the threshold decides.
        self.cost = CostModel(threshold=threshold, by_cost=settings.decision == "cost",
                              margin=settings.read_margin,
                              probe_interval_s=settings.probe_interval_s, now=self._now)
        # Decode engines read from, and when their first read finished: that read opened
        # NIXL's connection, a one-off cost the read model must not learn, nor the time other
        # reads started before it spent waiting for the connection.
        self._engines_read: dict[str, float] = {}
        # Finished requests whose synchronous read's time is still to come from the worker
        # (it reports after the step, which may have finished the request).
        self._awaiting_read: dict[str, _Active] = {}
        # Requests decided on arrival (no lookup), until the scheduler first asks about them:
        # why, and what to log with it.
        self._early: dict[str, tuple[str, dict[str, Any]]] = {}
        self._context = 1024  # a recent step's mean context, for the per-token gauge
        # Steps in flight, for the compute model: (scheduled at, tokens, area).
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=2)
        self._step_end = float("-inf")
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvbridge-read")
        self._pending: dict[str, _Pending] = {}
        self._active: dict[str, _Active] = {}
        # Requests that ended (aborted) while their asynchronous READ may still run: the pin
        # stays until the read is reported done (vLLM keeps the blocks until then too), or
        # runs out on its own.
        self._draining: dict[str, _Active] = {}
        self._rebase_logged = False  # routed reads from a gateway on another host, said once
        self._foreign_logged = False  # requests that named remote blocks themselves, said once
        # What was decided for each conversation request, until it finishes: the gateway
        # reads it back from the prefill response's kv_transfer_params.
        self._outcomes: dict[str, dict[str, Any]] = {}

    def warm(self) -> None:
        """Connect to the registry (or router) now, in the background, so that the first
        conversation's lookup does not pay for the connection."""
        info = getattr(self.client, "get_server_info", None)
        if info is not None:
            self._pool.submit(self._warm, info)

    def _warm(self, info: Any) -> None:
        try:
            info(timeout=self.settings.rpc_timeout_s)
        except KvbridgeError as err:  # the first lookup connects (or fails) on its own
            log.info("kvbridge_lookup_service_not_reachable_yet", error=err.reason)

    # ---- hooks (scheduler thread) -----------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and params.get("remote_block_ids"):
            # Decode's blocks named by whoever sent the request (NIXL's own read-back, as its
            # proxy sends it, or a forgery): never read, and nothing else either (recomputed).
            # This engine reads only what kvbridge looked up, pinned and verified against the
            # prompt's hashes; NIXL's scheduler would read these unchecked.
            for name in REMOTE_FIELDS:
                params.pop(name, None)
            self._drop_routed_pin(params)
            if not self._foreign_logged:
                self._foreign_logged = True
                log.warning("request_remote_blocks_dropped", request_id=request.request_id,
                            hint="a request came with remote_block_ids of its own; this "
                                 "engine reads decode's KV only through kvbridge (requests "
                                 "go through the gateway): recomputed")
            return
        key = conversation_of(params)
        if key is None or not params.get("do_remote_decode"):
            self._drop_routed_pin(params)
            return
        tokens = request.prompt_token_ids or []
        early: tuple[str, dict[str, Any]] | None = None
        scope = kv_scope(request, self.fingerprint)
        if len(tokens) < max(self.cost.floor(), self.block_size):
            early = ("short_prompt", {})
        elif scope is None:  # inputs the block hashes cannot cover: recompute
            early = ("unsupported_inputs", {})
        else:
            # Even reading all of the prompt but its last token would not pay: no lookup.
            best = self.cost.decide(len(tokens) - 1, len(tokens), before_lookup=True)
            if not best.read:
                early = (best.reason, _estimates(best))
        if early is not None or scope is None:
            # Decided now; counted once the scheduler says what its prefix cache holds.
            reason, fields = early or ("unsupported_inputs", {})
            left = self._drop_routed_pin(params, leave=True)
            if left:
                fields = {**fields, "pin_left": left}
            if len(self._early) >= 4096:  # never asked about (aborted unseen): its pin too
                _, dropped = self._early.pop(next(iter(self._early)))
                if dropped.get("pin_left"):
                    self._release(dropped["pin_left"])
            self._early[request.request_id] = (reason, fields)
            return
        hashes = blockhash.block_hashes(tokens, self.block_size, *scope)
        tenant, conversation = key
        now = self._now()
        routed = params[CONVERSATION_KEY].get(READ_KEY)
        if routed is not None and self._routed(request, tenant, conversation, hashes, routed,
                                               now):
            return
        future = self._pool.submit(
            self.client.acquire_read, tenant, conversation, hashes,
            min_tokens=self.cost.floor(), pin_ttl=self.settings.pin_ttl_s,
            reader_id=self.reader_id, request_id=request.request_id,
            timeout=self.settings.read_deadline_s)
        pending = _Pending(tenant, conversation, hashes, future,
                           now + self.settings.read_deadline_s, started=now)
        future.add_done_callback(lambda _: setattr(pending, "answered", self._now()))
        self._pending[request.request_id] = pending

    def _routed(self, request: Any, tenant: str, conversation: str, hashes: bytes,
                routed: Any, now: float) -> bool:
        """Take the read the gateway pinned when it routed the turn: verified here against
        the prompt's hashes, decided on at once, no call made. False if it is malformed (the
        request then looks the lease up itself)."""
        try:
            read, release = verified_read(routed, hashes)
        except BadRoutedRead as err:
            log.warning("routed_read_ignored", request_id=request.request_id, error=str(err))
            pin = routed.get("pin_id") if isinstance(routed, dict) else None
            if isinstance(pin, str) and pin:
                self._release(pin)
            return False
        if release:
            self._release(release)
        future: Future[pb.AcquireReadResponse] = Future()
        future.set_result(read)
        base, exact = routed_pin_base(routed, now)
        # (A miss carries no pin, and so no time: nothing to say about the gateway's host.)
        if not exact and read.pin.pin_id and not self._rebase_logged:
            self._rebase_logged = True
            log.info("routed_pins_rebased",
                     hint="the gateway is on another host (or older, or sent no usable "
                          "time): routed reads' pins are taken to end sooner by the time they "
                          "may have spent on the way",
                     slack_s=ROUTED_TRANSIT_SLACK_S)
        self._pending[request.request_id] = _Pending(
            tenant, conversation, hashes, future, now, started=now, answered=now,
            source="route", pin_base=base)
        return True

    def resolve(self, request: Any, num_computed_tokens: int) -> bool | None:
        """Decide for a request: None while its AcquireRead is pending (ask again), True when
        its kv_transfer_params now name verified remote blocks to read, False to recompute."""
        early = self._early.pop(request.request_id, None)
        if early is not None:
            reason, fields = early
            tokens = request.prompt_token_ids or []
            self._decide(request, reason, 0, len(tokens) - num_computed_tokens,
                         local=num_computed_tokens, **fields)
            return False
        pending = self._pending.get(request.request_id)
        if pending is None:
            return self._asked_again(request)
        tokens = request.prompt_token_ids or []
        if not pending.future.done():
            if self._now() < pending.deadline:
                return None
            if pending.source == "lookup":  # what waiting for it cost, at least
                self.cost.looked_up(pending.deadline - pending.started)
            del self._pending[request.request_id]
            pending.future.add_done_callback(self._release_late)
            self._decide(request, "deadline", 0, len(tokens) - num_computed_tokens,
                         local=num_computed_tokens, conversation=pending.conversation)
            return False
        del self._pending[request.request_id]
        answered = pending.answered or self._now()
        lookup_ms = round((answered - pending.started) * 1000, 2)
        if pending.source == "lookup":
            self.cost.looked_up(answered - pending.started)
        try:
            read = pending.future.result()
        except KvbridgeError as err:
            self._decide(request, "registry_error", 0, len(tokens) - num_computed_tokens,
                         local=num_computed_tokens, conversation=pending.conversation,
                         lookup_ms=lookup_ms,
                         source=pending.source, error=err.reason)
            return False
        if read.miss_reason != pb.MISS_REASON_UNSPECIFIED:
            reason = pb.MissReason.Name(read.miss_reason).removeprefix("MISS_REASON_").lower()
            self._decide(request, f"miss_{reason}", 0, len(tokens) - num_computed_tokens,
                         local=num_computed_tokens, conversation=pending.conversation,
                         lookup_ms=lookup_ms,
                         source=pending.source,
                         mismatch_block=read.mismatch_block)
            return False

        block_ids = list(read.remote_block_ids)
        usable = read.matched_tokens
        if read.partial_block_tokens:
            scope = kv_scope(request, self.fingerprint)  # as the prompt's hashes were made
            assert scope is not None  # (a request without one was never looked up)
            mine = blockhash.partial_block_hash(
                tokens, read.lease.token_count, self.block_size, *scope,
                full_hashes=pending.hashes)
            if mine is not None and mine == read.partial_block_hash:
                usable = read.lease.token_count
                block_ids.append(read.partial_block_id)
        # Whether this prompt holds all of the lease's tokens (so it continues that turn, not
        # a sibling that shares its history keys): for the gateway's lookup by content.
        whole = usable >= read.lease.token_count
        # At least the prompt's last token is computed here: the scheduler needs one new token
        # to schedule (a read naming the whole prompt would leave none, and a synchronous read
        # does not go through the asynchronous path's own step back by one token).
        usable = min(usable, len(tokens) - 1)
        # The pin ends `expires_in` after the registry answered, which was after this request
        # asked: counted from the asking, the end is never later than the registry's. A routed
        # read's counts from when the gateway sent it (`_routed`).
        base = pending.started if pending.pin_base is None else pending.pin_base
        pin_end = base + seconds(read.pin.expires_in)
        why = None
        cost = Decision(False, "local_cache")
        if usable <= num_computed_tokens:
            why = "local_cache"
        else:
            cost = self.cost.decide(usable - num_computed_tokens, len(tokens))
            if not cost.read:
                why = cost.reason
            elif pin_end - self._now() < self.settings.pin_margin_s:
                why = "pin_margin"
        if why is not None:
            self._release(read.pin.pin_id)
            self._decide(request, why, 0, len(tokens) - num_computed_tokens,
                         local=num_computed_tokens, conversation=pending.conversation,
                         lookup_ms=lookup_ms, source=pending.source, lease_whole=whole,
                         **_estimates(cost))
            return False

        params = request.kv_transfer_params
        params.update(
            remote_block_ids=[block_ids[: -(-usable // self.block_size)]],
            remote_num_tokens=usable,
            remote_engine_id=read.holder.holder_id,
            remote_request_id=read.lease.remote_request_id,
            remote_host=read.holder.nixl_host,
            remote_port=read.holder.nixl_port,
            tp_size=read.holder.tp_size or 1,
        )
        self._active[request.request_id] = _Active(
            read.pin.pin_id, usable - num_computed_tokens, self._now(),
            pending.conversation, params, pin_end=pin_end)
        self._decide(request, "hit", usable - num_computed_tokens, len(tokens) - usable,
                     local=num_computed_tokens, conversation=pending.conversation,
                     lookup_ms=lookup_ms, source=pending.source, lease_whole=whole,
                     lease_id=read.lease.lease_id,
                     epoch=read.lease.epoch, holder=read.holder.holder_id,
                     probe=cost.reason == PROBE, **_estimates(cost))
        return True

    def _asked_again(self, request: Any) -> bool:
        """The scheduler asks again about a request it decided on before (it could not
        allocate its blocks then). A hit stands only while its pin has more than the margin
        left: past that, decode may free the blocks before the read is done."""
        active = self._active.get(request.request_id)
        if active is None or active.posted:
            return False
        if active.pin_end - self._now() < self.settings.pin_margin_s:
            self.decline(request, "pin_margin_when_asked_again")
            return False
        return True

    def decline(self, request: Any, why: str = "declined_by_engine") -> None:
        """The engine will not read after all (e.g. NIXL's own threshold), or the pin ran too
        low while the request waited for blocks: undo the hit."""
        active = self._active.pop(request.request_id, None)
        if active is None:
            return
        for name in REMOTE_FIELDS:
            request.kv_transfer_params.pop(name, None)
        self._release(active.pin_id)
        # "local_cache": the scheduler kept a local hit reaching as far as the read would, so
        # this engine's own cache holds those tokens: not recomputed.
        local = why == "local_cache"
        if not local:
            self.metrics.recomputed_tokens.inc(active.tokens)
        self.metrics.decisions.labels(why).inc()
        self._undo_reuse(request.request_id, why, active.tokens, local=local)
        if why != "declined_by_engine":
            log.info("prefill_hit_withdrawn", request_id=request.request_id, why=why,
                     conversation=active.conversation, tokens=active.tokens)

    def reading_sync(self, request_id: str, sync: bool = True) -> None:
        """The hit will be read within the step that computes the request (`_sync_reads`),
        or (`sync` False) by NIXL's asynchronous path after all."""
        active = self._active.get(request_id)
        if active is not None:
            active.sync = sync
        outcome = self._outcomes.get(request_id)
        if outcome is not None:
            if sync:
                outcome["kvbridge_load"] = "sync"
            else:
                outcome.pop("kvbridge_load", None)

    def reading(self, request_id: str) -> bool:
        """Whether the request has a hit whose read has not gone to the worker yet."""
        active = self._active.get(request_id)
        return active is not None and not active.sent

    def placed(self, request_id: str, *, local: int, reused: int) -> None:
        """The scheduler allocated the request: `local` prompt tokens come from this engine's
        prefix cache, `reused` from the read (what the scheduler settled on, which may differ
        from the decision when it asked again later)."""
        active = self._active.get(request_id)
        if active is not None:
            active.tokens = reused
        outcome = self._outcomes.get(request_id)
        if outcome is not None:
            total = (outcome.get("kvbridge_local_tokens", 0) + outcome["kvbridge_reused_tokens"]
                     + outcome["kvbridge_recomputed_tokens"])
            outcome["kvbridge_local_tokens"] = local
            outcome["kvbridge_reused_tokens"] = reused
            outcome["kvbridge_recomputed_tokens"] = max(total - local - reused, 0)

    def spoil(self, request_id: str) -> None:
        """The read must not happen (it could not be placed): its pin is taken as over, so
        the worker's pin guard fails it and the scheduler recomputes its blocks."""
        active = self._active.get(request_id)
        if active is not None:
            # Now, not minus infinity: the guard forgets ends long past (and would then post).
            active.pin_end = min(active.pin_end, self._now())

    def read_posted(self, request_id: str) -> None:
        """The read is posted in this step: should the request be preempted later, it
        recomputes rather than wait for a read that will not come again."""
        active = self._active.get(request_id)
        if active is not None:
            active.posted = True
            _forget_remote_blocks(active.params)

    def read_sent(self, request_id: str) -> float | None:
        """The request's read goes to the worker in this step (NIXL posts it there). Returns
        when its pin ends (monotonic), for the worker to check (`_pin_guard`); None if the
        read is not ours."""
        active = self._active.get(request_id)
        if active is None:
            return None
        active.sent = True
        return active.pin_end

    def read_done(self, request_id: str, ok: bool, *, why: str | None = None) -> str | None:
        """The read ended (landed, or failed and recomputes). Returns the decode engine it
        read from, or None if the request had no read of ours."""
        active = self._active.pop(request_id, None)
        if active is None:
            aborted = self._draining.pop(request_id, None)
            if aborted is None:
                return None
            self._release(aborted.pin_id)  # the READ of an aborted request is over
            engine = aborted.params.get("remote_engine_id")
            return engine if ok and isinstance(engine, str) else None
        # The read is over: a preempted request must recompute, not wait for a read that NIXL
        # will never queue again.
        _forget_remote_blocks(active.params)
        self._release(active.pin_id)
        elapsed = self._now() - active.started
        if ok:
            self.metrics.reused_tokens.inc(active.tokens)
            self.metrics.transfer_seconds.observe(elapsed)
            self._learn_read(active, elapsed)
            outcome = self._outcomes.get(request_id)
            if outcome is not None:
                outcome["kvbridge_transfer_ms"] = round(elapsed * 1000, 2)
        else:
            # The worker failed a read for its pin (`_pin_guard`): counted as such; any other
            # failure is the transfer's.
            decision = why if why in PIN_FAILURES else "transfer_failed"
            self.metrics.recomputed_tokens.inc(active.tokens)
            self.metrics.decisions.labels(decision).inc()
            self._undo_reuse(request_id, decision, active.tokens)
            log.warning("kv_read_failed", request_id=request_id,
                        conversation=active.conversation, tokens=active.tokens,
                        why=why or "transfer_failed")
        engine = active.params.get("remote_engine_id")
        return engine if isinstance(engine, str) else None

    def step_scheduled(self, tokens: int, area: int, *, overlapped: bool = False) -> None:
        """The scheduler made a step of `tokens` tokens (`area`: the sum over its requests of
        their tokens times their context). `overlapped`: vLLM schedules a step before the
        previous one's output is in (async scheduling), so two may be in flight."""
        if not overlapped:
            self._steps.clear()  # one that produced no connector output: not a sample
        if tokens:  # an empty step may produce no output to pair it with
            self._steps.append((self._now(), tokens, area))

    def step_done(self, read_wait_s: float = 0.0) -> None:
        """The oldest step in flight is done; its synchronous reads waited `read_wait_s`. It
        ran from when it was scheduled, or from when the step before it was done, if later."""
        if not self._steps:
            return
        at, tokens, area = self._steps.popleft()
        now = self._now()
        start, self._step_end = max(at, self._step_end), now
        if tokens:
            self.cost.computed(tokens, area, now - start - read_wait_s)
            self._show_estimates(area // tokens)

    def read_measured(self, request_id: str, seconds: float) -> None:
        """A synchronous read landed after `seconds` (the worker's figure, reported after the
        step: before the request finished, or after when the step finished it)."""
        active = self._active.get(request_id) or self._awaiting_read.pop(request_id, None)
        if active is not None:
            self._learn_read(active, seconds)

    def finished(self, request_id: str) -> dict[str, Any] | None:
        """The request ended (possibly aborted): let go of whatever it still holds. Returns
        what was decided for it (kvbridge_decision, kvbridge_reused_tokens, ...), for the
        response's kv_transfer_params; None for a request outside any conversation."""
        self._early.pop(request_id, None)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.future.add_done_callback(self._release_late)
        active = self._active.pop(request_id, None)
        now = self._now()
        for rid in [r for r, a in self._draining.items() if a.pin_end <= now]:
            del self._draining[rid]  # their pins have run out in the registry
        if active is not None and active.sent and not active.sync:
            self._draining[request_id] = active  # released once its read is reported done
        elif active is not None:
            self._release(active.pin_id)
            if active.sync:
                # A synchronous read that failed would have held the request back (the
                # scheduler recomputes its blocks first), so finishing means it landed; the
                # worker's own report of it (and of its time) comes after this.
                self.metrics.reused_tokens.inc(active.tokens)
                if len(self._awaiting_read) >= 64:
                    del self._awaiting_read[next(iter(self._awaiting_read))]
                self._awaiting_read[request_id] = active
        outcome = self._outcomes.pop(request_id, None)
        if outcome is not None and outcome.get("kvbridge_local_tokens"):
            self.metrics.local_tokens.inc(outcome["kvbridge_local_tokens"])
        return outcome

    def _learn_read(self, active: _Active, seconds: float) -> None:
        engine = active.params.get("remote_engine_id")
        opened = self._engines_read.get(engine) if isinstance(engine, str) else None
        if opened is None:  # the first read opened NIXL's connection
            if isinstance(engine, str) and len(self._engines_read) < 4096:
                self._engines_read[engine] = self._now()
            return
        if active.started < opened:  # it waited for the connection the first one opened
            return
        self.cost.read(active.tokens, seconds)
        self._show_estimates(None)

    def _show_estimates(self, context: int | None) -> None:
        if context is not None:
            self._context = context
        for name, value in self.cost.estimates(self._context).items():
            self.metrics.cost_estimates.labels(name).set(value)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- helpers ----------------------------------------------------------------------------

    def _decide(self, request: Any, decision: str, reused: int, recomputed: int, *,
                local: int = 0, **fields: Any) -> None:
        # local + reused + recomputed: the prompt (local: this engine's own prefix cache, as
        # far as the scheduler offered it, block-aligned).
        self._outcomes[request.request_id] = {
            "kvbridge_decision": decision, "kvbridge_reused_tokens": reused,
            "kvbridge_recomputed_tokens": max(recomputed, 0), "kvbridge_local_tokens": local}
        if "lookup_ms" in fields:  # how long the AcquireRead took, as seen by the engine
            self._outcomes[request.request_id]["kvbridge_lookup_ms"] = fields["lookup_ms"]
        if "source" in fields:  # "route": pinned by the gateway's route; "lookup": our own call
            self._outcomes[request.request_id]["kvbridge_read_source"] = fields["source"]
        if fields.get("pin_left"):  # the gateway releases the routed pin
            self._outcomes[request.request_id][PIN_LEFT] = True
        if "lease_whole" in fields:
            self._outcomes[request.request_id][LEASE_WHOLE] = fields["lease_whole"]
        if decision == "miss_hash_mismatch":
            self._outcomes[request.request_id]["kvbridge_mismatch_block"] = fields.get(
                "mismatch_block", 0)
        self.metrics.decisions.labels(decision).inc()
        if recomputed > 0:
            self.metrics.recomputed_tokens.inc(recomputed)
        if fields.get("pin_left"):
            fields = {**fields, "pin_left": True}  # its id is the gateway's to release
        log.info("prefill_decision", request_id=request.request_id, decision=decision,
                 reused_tokens=reused, recomputed_tokens=max(recomputed, 0),
                 local_tokens=local, prompt_tokens=len(request.prompt_token_ids or []), **fields)

    def _undo_reuse(self, request_id: str, decision: str, tokens: int, *,
                    local: bool = False) -> None:
        outcome = self._outcomes.get(request_id)
        if outcome is not None:
            outcome["kvbridge_decision"] = decision
            outcome["kvbridge_reused_tokens"] = 0
            outcome["kvbridge_local_tokens" if local else "kvbridge_recomputed_tokens"] += tokens

    def _drop_routed_pin(self, params: Any, *, leave: bool = False) -> str:
        """Let go of the pin of a read the gateway made while routing a turn this engine will
        not read for: otherwise it holds the lease until its TTL runs out. With `leave`, a pin
        the gateway releases itself once prefill answers (`RELEASED_BY`) is left to it, and
        its id returned (the answer then says so: `PIN_LEFT`); otherwise released here, and
        "" returned."""
        section = params.get(CONVERSATION_KEY) if isinstance(params, dict) else None
        routed = section.get(READ_KEY) if isinstance(section, dict) else None
        if not isinstance(routed, dict):
            return ""
        pin = routed.get("pin_id")
        if not (isinstance(pin, str) and pin):
            return ""
        if leave and routed.get(RELEASED_BY) == "gateway":
            return pin
        self._release(pin)
        return ""

    def _release(self, pin_id: str) -> None:
        self._pool.submit(self._release_quietly, pin_id)

    def _release_quietly(self, pin_id: str) -> None:
        try:
            self.client.release_read(pin_id, timeout=self.settings.rpc_timeout_s)
        except KvbridgeError as err:  # the pin runs out on its own
            log.debug("release_read_failed", pin_id=pin_id, error=err.reason)

    def _release_late(self, future: Future[pb.AcquireReadResponse]) -> None:
        # Runs on whichever thread completes the future, or inline on the scheduler thread when
        # it is done already: the release itself goes to the pool, never blocking either.
        try:
            read = future.result()
        except Exception:
            return
        if read.pin.pin_id:
            self._release(read.pin.pin_id)
