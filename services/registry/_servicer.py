"""The gRPC adapter over a `LeaseStore`: proto in, domain call, proto out. No policy lives here.

Every method is wrapped by `_rpc`, which times it and turns a domain error into a canonical
status with an ErrorInfo (the mapping is `kvbridge.errors.STATUS_CODES`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc
import structlog
from google.protobuf import duration_pb2, timestamp_pb2

from kvbridge import __version__, auth, blockhash
from kvbridge._grpc_status import STREAM_LIVE, to_status
from kvbridge.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    HolderNotFound,
    KvbridgeError,
    LeaseNotFound,
    RateLimited,
    Recovering,
    Unavailable,
)
from kvbridge.ratelimit import RateLimiter
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc
from kvbridge.services.registry import _access
from kvbridge.services.registry import _validate as check
from kvbridge.services.registry._core import (
    GrantSpec,
    HolderSpec,
    Read,
    Snapshot,
    clip_history_keys,
)
from kvbridge.services.registry._metrics import RegistryMetrics
from kvbridge.services.registry._model import (
    EventType,
    Holder,
    HolderState,
    Lease,
    LeaseEvent,
    LeaseState,
)
from kvbridge.services.registry._store import LeaseStore

log = structlog.get_logger("kvbridge.registry")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Ctx = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[[Any, Req, Ctx], Awaitable[Resp]]

_HOLDER_STATE = {HolderState.ACTIVE: pb.HOLDER_STATE_ACTIVE,
                 HolderState.DRAINING: pb.HOLDER_STATE_DRAINING}
_DEFAULT_PAGE, _MAX_PAGE = 100, 1000
# Leases of a listing page turned into messages between two turns of the event loop (each takes
# some microseconds: a 1,000-lease page at once would hold every other call for milliseconds).
_LIST_CHUNK = 16
# A broad listing takes one token of its caller's listing rate per this many leases it returns
# (at least one): a token is then at most a few milliseconds of the registry's time, whatever
# the page size, so that pages of 1,000 do not buy ten times the time at the same rate.
_LEASES_PER_TOKEN = 250
_WATCH_QUEUE = 10_000


def _seconds(d: duration_pb2.Duration, field: str) -> float:
    if d.seconds < 0 or d.nanos < 0:
        raise check.InvalidArgument(field, "must not be negative")
    return d.seconds + d.nanos * 1e-9


def _duration(seconds: float) -> duration_pb2.Duration:
    seconds = max(seconds, 0.0)
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


def _timestamp(wall: float) -> timestamp_pb2.Timestamp:
    whole = int(wall)
    return timestamp_pb2.Timestamp(seconds=whole, nanos=int((wall - whole) * 1e9))


def _set_time(field: Any, seconds: float) -> None:
    """Set a Duration or Timestamp field in place."""
    whole = int(seconds)
    field.seconds = whole
    field.nanos = int((seconds - whole) * 1e9)


def _page(size: int) -> int:
    if size > _MAX_PAGE:
        raise check.InvalidArgument("page_size", f"at most {_MAX_PAGE}")
    return size or _DEFAULT_PAGE


def _rpc(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: RegistryServicer, request: Req,
                      context: Ctx) -> Resp:
        start = time.perf_counter()
        try:
            return await fn(self, request, context)
        except KvbridgeError as err:
            self.metrics.rpc_errors.labels(name, err.reason).inc()
            log.debug("rpc_rejected", method=name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))
            raise  # unreachable: abort_with_status raises
        finally:
            self._durations[name].observe(time.perf_counter() - start)

    return wrapper


class RegistryServicer(pb_grpc.RegistryServiceServicer):
    def __init__(self, store: LeaseStore, metrics: RegistryMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self.clock = store.clock
        self._watch_enders: set[Callable[[KvbridgeError], None]] = set()
        self._watchers_of: dict[auth.Principal, int] = {}  # open watch streams by caller
        cfg = store.config
        # Listings that walk a tenant's (or everyone's) leases, and watch opens, by caller.
        self._listing = RateLimiter(cfg.list_rate_per_principal, cfg.list_burst_per_principal,
                                    store.clock)
        # Holder ids each caller registered (pruned of lost ones when it reaches its cap).
        self._holders_of: dict[str, set[str]] = {}
        self._watches_closed: KvbridgeError | None = None  # set by `close_watches`
        # Events lost upstream (a Redis that lost its stream): the watches end, so that their
        # watchers know of the gap and re-list, instead of going on as if nothing was missed.
        store.on_events_lost(self._events_lost)
        self._started = time.monotonic()
        self._durations = {
            name: metrics.rpc_duration.labels(name)
            for name in pb.DESCRIPTOR.services_by_name["RegistryService"].methods_by_name
        }

    # ---- conversions ------------------------------------------------------------------------

    def _holder(self, h: Holder) -> pb.Holder:
        left = h.expire_at - self.clock.monotonic()
        return pb.Holder(
            holder_id=h.holder_id, nixl_host=h.nixl_host, nixl_port=h.nixl_port,
            tp_size=h.tp_size, block_size=h.block_size, engine_fingerprint=h.fingerprint,
            state=_HOLDER_STATE.get(h.state, pb.HOLDER_STATE_UNSPECIFIED),
            ttl=_duration(h.ttl), expires_in=_duration(left),
            expire_time=_timestamp(self.clock.wall() + left), lease_count=h.lease_count,
            retained_blocks=h.retained_blocks, software_version=h.version,
        )

    def _lease(self, lease: Lease, *, blocks: bool = False, into: Any = None) -> pb.Lease:
        """The message of `lease`; appended to the repeated field `into` when given (a page:
        added in place, its times set field by field, which takes a third less time than
        building each part as a message of its own)."""
        now = self.clock.monotonic()
        wall = self.clock.wall()
        left = lease.expire_at - now if lease.state is LeaseState.ACTIVE else 0.0
        fields: dict[str, Any] = dict(
            lease_id=lease.lease_id, tenant=lease.tenant, conversation_id=lease.conversation_id,
            holder_id=lease.holder.holder_id, remote_request_id=lease.remote_request_id,
            token_count=lease.token_count, epoch=lease.epoch,
            state=cast(pb.LeaseState.ValueType, int(lease.state)), pin_count=lease.pin_count)
        msg: pb.Lease = pb.Lease(**fields) if into is None else into.add(**fields)
        _set_time(msg.idle_ttl, max(lease.idle_ttl, 0.0))
        _set_time(msg.max_lifetime, max(lease.max_lifetime, 0.0))
        _set_time(msg.expires_in, max(left, 0.0))
        _set_time(msg.expire_time, wall + left)
        _set_time(msg.create_time, wall - (now - lease.created_at))
        if blocks:
            msg.block_ids.extend(lease.block_id_list())
            msg.block_hashes = lease.hashes
        return msg

    def _grant_spec(self, r: Any, holder_id: str, prefix: str = "") -> GrantSpec:
        return GrantSpec(
            holder_id=holder_id, tenant=r.tenant, conversation_id=r.conversation_id,
            remote_request_id=r.remote_request_id, block_ids=r.block_ids,
            token_count=r.token_count, hashes=r.block_hashes,
            idle_ttl=_seconds(r.idle_ttl, prefix + "idle_ttl"),
            max_lifetime=_seconds(r.max_lifetime, prefix + "max_lifetime"),
            request_id=getattr(r, "request_id", ""),
            history_keys=clip_history_keys(r.history_keys, self.store.config.max_history_keys),
        )

    # ---- holders ----------------------------------------------------------------------------

    @_rpc
    async def RegisterHolder(self, request: pb.RegisterHolderRequest,
                             context: Ctx) -> pb.RegisterHolderResponse:
        spec = HolderSpec(request.holder_id, request.nixl_host, request.nixl_port,
                          request.tp_size, request.block_size, request.engine_fingerprint,
                          _seconds(request.ttl, "ttl"), request.software_version)
        held = [
            Snapshot(s.lease_id, self._grant_spec(s, request.holder_id, f"held_leases[{i}]."),
                     s.epoch, _seconds(s.age, f"held_leases[{i}].age"))
            for i, s in enumerate(request.held_leases)
        ]
        owned = await self._holders_of_caller(request.holder_id)
        # Counted before the store is awaited, so that concurrent registrations see it.
        counting = owned if owned is not None and request.holder_id not in owned else None
        if counting is not None:
            counting.add(request.holder_id)
        try:
            reg = await self.store.register_holder(spec, held, request.held_lease_ids,
                                                   request.restore_only)
        except BaseException:
            if counting is not None:
                counting.discard(request.holder_id)
            raise
        cfg = self.store.config
        return pb.RegisterHolderResponse(
            holder=self._holder(reg.holder),
            limits=pb.RegistryLimits(
                max_pin_ttl=_duration(cfg.max_pin_ttl_s),
                heartbeat_interval=_duration(reg.holder.ttl / 3),
                max_blocks_per_lease=cfg.max_blocks_per_lease,
                max_held_leases_per_call=cfg.max_held_leases_per_call,
                max_history_keys=cfg.max_history_keys),
            restored_lease_ids=reg.restored, reclaimable_lease_ids=reg.reclaimable,
        )

    async def _holders_of_caller(self, holder_id: str) -> set[str] | None:
        """The live holder ids the caller registered, when it may register `holder_id`
        (None: an admin, not counted); CapacityExhausted when that would pass
        max_holders_per_principal (each registry replica counts its own callers)."""
        caller = auth.current()
        if caller.is_admin:
            return None
        cap = self.store.config.max_holders_per_principal
        owned = self._holders_of.setdefault(caller.name, set())
        if holder_id in owned or len(owned) < cap:
            return owned
        for hid in list(owned):  # at the cap: forget the ones no longer registered
            try:
                await self.store.get_holder(hid)
            except HolderNotFound:
                owned.discard(hid)
        if len(owned) >= cap:
            raise CapacityExhausted(f"{caller.name} has {cap} live holders registered: "
                                    f"deregister one first", limit=cap, scope="principal")
        return owned

    def _limit_listing(self, method: str) -> None:
        """RateLimited when the caller is past list_rate_per_principal."""
        caller = auth.current().name
        wait = self._listing.allow(caller)
        if wait:
            raise RateLimited(f"{method}: {caller} is over its rate of "
                              f"{self._listing.rate:g} a second; retry in {wait:.2f} s",
                              limit=self._listing.rate, retry_after_s=round(wait, 3))

    @staticmethod
    def _caller() -> str:
        """The caller's name for keying its pins ("" in insecure local mode)."""
        caller = auth.current()
        return "" if caller is auth.LOCAL_ADMIN else caller.name

    @_rpc
    async def HeartbeatHolder(self, request: pb.HeartbeatHolderRequest,
                              context: Ctx) -> pb.HeartbeatHolderResponse:
        reclaimable, ttl = await self.store.heartbeat(request.holder_id,
                                                      request.reclaimed_lease_ids)
        return pb.HeartbeatHolderResponse(reclaimable_lease_ids=reclaimable,
                                          expires_in=_duration(ttl))

    @_rpc
    async def DeregisterHolder(self, request: pb.DeregisterHolderRequest,
                               context: Ctx) -> pb.DeregisterHolderResponse:
        reclaimable, pinned = await self.store.deregister_holder(request.holder_id)
        return pb.DeregisterHolderResponse(reclaimable_lease_ids=reclaimable,
                                           pinned_lease_count=pinned)

    @_rpc
    async def ListHolders(self, request: pb.ListHoldersRequest,
                          context: Ctx) -> pb.ListHoldersResponse:
        size = _page(request.page_size)
        holders = [h for h in (await self.store.holders()) if h.holder_id > request.page_token]
        page = holders[:size]
        token = page[-1].holder_id if len(holders) > size else ""
        return pb.ListHoldersResponse(holders=[self._holder(h) for h in page],
                                      next_page_token=token)

    # ---- leases -----------------------------------------------------------------------------

    @_rpc
    async def GrantLease(self, request: pb.GrantLeaseRequest,
                         context: Ctx) -> pb.GrantLeaseResponse:
        spec = self._grant_spec(request, request.holder_id)
        # No grant runs past the caller's deadline: a holder whose grant timed out bounds the
        # age of any lease it may have made by the send time plus its timeout.
        left = context.time_remaining()
        if left is not None and left <= 0:
            raise DeadlineExceeded("the grant's deadline passed before it ran: nothing granted")
        grant = await self.store.grant(spec)
        return pb.GrantLeaseResponse(
            lease=self._lease(grant.lease),
            superseded_lease_id=grant.superseded.lease_id if grant.superseded else "",
        )

    @_rpc
    async def RenewLeases(self, request: pb.RenewLeasesRequest,
                          context: Ctx) -> pb.RenewLeasesResponse:
        if request.lease_ids and _access.scoped():
            await self._check_leases(request.lease_ids)
        results = await self.store.renew(
            request.lease_ids, [(c.tenant, c.conversation_id) for c in request.conversations])
        out = pb.RenewLeasesResponse()
        renewed = 0
        for r in results:
            item = out.results.add(lease_id=r.lease_id, renewed=r.renewed,
                                   state=cast(pb.LeaseState.ValueType, int(r.state or 0)))
            if r.renewed:
                renewed += 1
                left = r.expires_in
                item.expires_in.seconds = int(left)
                item.expires_in.nanos = int((left - int(left)) * 1e9)
        out.renewed_count = renewed
        self.metrics.renewals.inc(renewed)
        return out

    @_rpc
    async def RevokeLease(self, request: pb.RevokeLeaseRequest,
                          context: Ctx) -> pb.RevokeLeaseResponse:
        if _access.scoped():
            _access.may_touch(await self.store.get_lease(request.lease_id))
        lease = await self.store.revoke(request.lease_id, request.holder_id, request.reason)
        return pb.RevokeLeaseResponse(lease=self._lease(lease),
                                      reclaimable=await self._reclaimable(lease))

    @_rpc
    async def GetLease(self, request: pb.GetLeaseRequest,
                       context: Ctx) -> pb.GetLeaseResponse:
        try:
            lease = await self.store.get_lease(request.lease_id)
        except LeaseNotFound:
            hold = await self.store.reclaim_hold(request.lease_id)
            if hold > 0:  # it may have existed: its holder may not have re-registered yet
                raise Recovering(
                    f"lease {request.lease_id!r} is unknown to this registry, which lost its "
                    f"state and is recovering it from its holders ({hold:.0f}s left)",
                    lease_id=request.lease_id, recovery_grace_left_s=round(hold, 3)) from None
            raise
        _access.may_touch(lease)
        return pb.GetLeaseResponse(lease=self._lease(lease, blocks=True),
                                   reclaimable=await self._reclaimable(lease))

    async def _reclaimable(self, lease: Lease) -> bool:
        """May the holder free the lease's blocks now: dead, unpinned, and not within the
        recovery grace (after a loss of state, pins from before may be live)."""
        return lease.reclaimable and await self.store.reclaim_hold(lease.lease_id) <= 0

    @_rpc
    async def ListLeases(self, request: pb.ListLeasesRequest,
                         context: Ctx) -> pb.ListLeasesResponse:
        size = _page(request.page_size)
        if request.page_token:
            check.identifier("page_token", request.page_token, self.store.config.max_id_length)
        broad = not request.conversation_id  # walks a tenant's leases, a holder's, or all
        if broad:
            self._limit_listing("ListLeases")
        found = await self.store.list_leases(
            request.tenant, request.conversation_id, request.holder_id,
            request.include_inactive, request.page_token, size + 1)
        page: list[Lease] = found[:size]
        out = pb.ListLeasesResponse(next_page_token=page[-1].lease_id if len(found) > size
                                    else "")
        if broad:
            self._listing.charge(auth.current().name, len(page) / _LEASES_PER_TOKEN - 1)
        for i in range(0, len(page), _LIST_CHUNK):
            if i:  # a page holds the event loop per lease: other callers' reads go between
                await asyncio.sleep(0)
            for lease in page[i:i + _LIST_CHUNK]:
                self._lease(lease, blocks=request.include_blocks, into=out.leases)
        return out

    async def _check_leases(self, lease_ids: Any) -> None:
        """The caller may touch every one of these leases (unknown ids are left to the call)."""
        for lease_id in lease_ids:
            try:
                lease = await self.store.get_lease(lease_id)
            except LeaseNotFound:
                continue
            _access.may_touch(lease)

    # ---- reads ------------------------------------------------------------------------------

    @_rpc
    async def AcquireRead(self, request: pb.AcquireReadRequest,
                          context: Ctx) -> pb.AcquireReadResponse:
        read = await self.store.acquire_read(
            request.tenant, request.conversation_id, request.block_hashes, request.min_tokens,
            _seconds(request.pin_ttl, "pin_ttl"), request.reader_id, request.request_id,
            self._caller())
        self.metrics.read(read.miss)
        return self._read_response(read, pb.AcquireReadResponse())

    @_rpc
    async def PinLease(self, request: pb.PinLeaseRequest, context: Ctx) -> pb.PinLeaseResponse:
        read = await self.store.pin_lease(
            request.tenant, request.conversation_id, request.min_tokens,
            _seconds(request.pin_ttl, "pin_ttl"), request.reader_id, request.request_id,
            self._caller(), request.history_keys)
        self.metrics.read(read.miss)
        out = pb.PinLeaseResponse()
        self._read_response(read, out.read)
        if read.pin is not None and read.lease is not None:
            out.block_hashes = bytes(read.lease.hash_view(read.matched_blocks))
        if read.keys_matched:
            out.match.keys_matched = read.keys_matched
            out.match.whole = read.whole
        return out

    def _read_response(self, read: Read, out: pb.AcquireReadResponse) -> pb.AcquireReadResponse:
        out.miss_reason = cast(pb.MissReason.ValueType, int(read.miss))
        out.mismatch_block = read.mismatch_block
        lease = read.lease
        if lease is None:
            return out
        # The hot path: only what a reader needs, no timestamps.
        ref = out.lease
        ref.lease_id = lease.lease_id
        ref.tenant = lease.tenant
        ref.conversation_id = lease.conversation_id
        ref.holder_id = lease.holder.holder_id
        ref.remote_request_id = lease.remote_request_id
        ref.token_count = lease.token_count
        ref.epoch = lease.epoch
        ref.state = cast(pb.LeaseState.ValueType, int(lease.state))
        ref.pin_count = lease.pin_count
        if read.pin is None:
            return out
        h = lease.holder
        holder = out.holder  # each `out.holder` is a lookup: once, not per field
        holder.holder_id = h.holder_id
        holder.nixl_host = h.nixl_host
        holder.nixl_port = h.nixl_port
        holder.tp_size = h.tp_size
        holder.block_size = h.block_size
        holder.engine_fingerprint = h.fingerprint
        holder.state = pb.HOLDER_STATE_ACTIVE
        k = read.matched_blocks
        out.matched_blocks = k
        out.matched_tokens = k * h.block_size
        if read.partial:
            ids = lease.block_id_list(0, k + 1)
            out.partial_block_id = ids.pop()
            size = blockhash.HASH_SIZE
            out.partial_block_tokens = lease.token_count - k * h.block_size
            out.partial_block_hash = bytes(lease.hash_view(k + 1)[k * size:])
        else:
            ids = lease.block_id_list(0, k)
        out.remote_block_ids.extend(ids)
        # Set in place: building Duration/Timestamp messages and copying them in costs twice
        # as much.
        left = read.pin.expire_at - self.clock.monotonic()
        pin = out.pin
        pin.pin_id = read.pin.pin_id
        _set_time(pin.expires_in, max(left, 0.0))
        _set_time(pin.expire_time, self.clock.wall() + left)
        return out

    @_rpc
    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: Ctx) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            version=__version__, current_time=_timestamp(time.time()),
            uptime=_duration(time.monotonic() - self._started))

    @_rpc
    async def ReleaseRead(self, request: pb.ReleaseReadRequest,
                          context: Ctx) -> pb.ReleaseReadResponse:
        return pb.ReleaseReadResponse(released=await self.store.release_read(request.pin_id))

    # ---- watch ------------------------------------------------------------------------------

    async def WatchLeases(self, request: pb.WatchLeasesRequest,
                          context: Ctx
                          ) -> AsyncIterator[pb.WatchLeasesResponse]:
        cfg = self.store.config
        caller = auth.current()
        try:
            for name in ("holder_id", "tenant"):
                value = getattr(request, name)
                if value:
                    check.identifier(name, value, cfg.max_id_length)
            if self.store.not_serving:
                raise Unavailable(self.store.not_serving)
            if self._watches_closed is not None:  # shutting down: a watch would be cut short
                raise self._watches_closed
            self._limit_listing("WatchLeases")
            # Per caller first: one token's streams must not take every slot from the others
            # (an admin is bounded by max_watchers alone).
            if not caller.is_admin and \
                    self._watchers_of.get(caller, 0) >= cfg.max_watchers_per_principal:
                raise CapacityExhausted(
                    f"too many watchers for {caller.name}: at most "
                    f"{cfg.max_watchers_per_principal} a caller",
                    limit=cfg.max_watchers_per_principal, scope="principal")
            if len(self._watch_enders) >= cfg.max_watchers:
                raise CapacityExhausted("too many watchers", limit=cfg.max_watchers)
        except KvbridgeError as err:
            await context.abort_with_status(to_status(err))
            return
        # None wakes the stream to end it (`ended`); events that arrive after it are dropped
        # with the stream, which the watcher re-lists elsewhere.
        queue: asyncio.Queue[LeaseEvent | None] = asyncio.Queue(_WATCH_QUEUE)
        holder, tenant = request.holder_id, request.tenant
        overflowed = False
        ended: KvbridgeError | None = None

        def end(err: KvbridgeError) -> None:
            nonlocal ended
            ended = err
            if not queue.full():  # else the stream wakes for what is queued and sees `ended`
                queue.put_nowait(None)

        def listener(event: LeaseEvent) -> None:
            nonlocal overflowed
            if (holder and event.holder_id != holder) or (tenant and event.tenant != tenant):
                return
            if event.type is EventType.RENEWED and not request.include_renewals:
                return
            if queue.full():
                overflowed = True  # the stream ends at its next step; events are not skipped
            else:
                queue.put_nowait(event)

        self._watch_enders.add(end)
        self._watchers_of[caller] = self._watchers_of.get(caller, 0) + 1
        self.store.add_listener(listener, renewals=request.include_renewals)
        log.info("watch_started", holder=holder or "*", tenant=tenant or "*")
        try:
            # Subscribed: the watcher knows its stream is live before any event comes.
            await context.send_initial_metadata((STREAM_LIVE,))
            while True:
                event = await queue.get()
                if ended is not None:
                    log.warning("watch_ended", holder=holder or "*", tenant=tenant or "*",
                                reason=ended.reason, error=ended.message)
                    await context.abort_with_status(to_status(ended))
                    return
                if overflowed:
                    log.warning("watch_overflow", holder=holder or "*", tenant=tenant or "*")
                    await context.abort_with_status(to_status(CapacityExhausted(
                        "watcher fell behind; reconnect and re-list", queue=_WATCH_QUEUE)))
                    return
                assert event is not None  # None comes only with `ended`
                yield pb.WatchLeasesResponse(event=pb.LeaseEvent(
                    type=cast(pb.LeaseEventType.ValueType, int(event.type)),
                    lease_id=event.lease_id, tenant=event.tenant,
                    conversation_id=event.conversation_id, holder_id=event.holder_id,
                    epoch=event.epoch, event_time=_timestamp(event.wall),
                    lateness=_duration(event.lateness)))
        finally:
            self.store.remove_listener(listener, renewals=request.include_renewals)
            self._watch_enders.discard(end)
            left = self._watchers_of[caller] - 1
            if left:
                self._watchers_of[caller] = left
            else:
                del self._watchers_of[caller]

    def _events_lost(self, why: str) -> None:
        ended = self.end_watches(Unavailable(why))
        log.warning("watches_ended", count=ended, why="events lost")

    def close_watches(self, err: KvbridgeError) -> int:
        """End every open watch stream with `err` and refuse new ones with it from now on
        (the server is shutting down). Returns how many were open."""
        self._watches_closed = err
        return self.end_watches(err)

    def end_watches(self, err: KvbridgeError) -> int:
        """End every open watch stream with `err` (a replica that stops serving: watchers
        reconnect to another and re-list). Returns how many were open."""
        enders = list(self._watch_enders)
        for end in enders:
            end(err)
        return len(enders)

    async def watches_gone(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the watch streams ended (`end_watches`) to finish:
        their status is then on its way, not cut short by a server stopping under it."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._watch_enders:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.005)
        await asyncio.sleep(0)  # the handler's last step: its status is sent
        return True
