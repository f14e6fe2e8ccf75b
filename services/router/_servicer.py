"""The gRPC adapter over `InstanceTable`, plus the registry calls a route and a read need."""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc
import structlog
from google.protobuf import duration_pb2, timestamp_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbridge import __version__, auth
from kvbridge._grpc_status import to_status
from kvbridge.clients._registry import AsyncRegistryClient
from kvbridge.errors import KvbridgeError, Unavailable
from kvbridge.registry.v1 import registry_pb2 as reg_pb
from kvbridge.registry.v1 import registry_pb2_grpc as reg_grpc
from kvbridge.router.v1 import router_pb2 as pb
from kvbridge.router.v1 import router_pb2_grpc as pb_grpc
from kvbridge.services.registry import _validate as check
from kvbridge.services.registry._core import check_named_or_found
from kvbridge.services.router._policy import (
    Instance,
    InstanceSpec,
    InstanceTable,
    Load,
    Role,
)
from kvbridge.services.router._urls import EngineUrlPolicy

log = structlog.get_logger("kvbridge.router")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Ctx = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[[Any, Req, Ctx], Awaitable[Resp]]


class RouterMetrics:
    def __init__(self, table: InstanceTable) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.routes = Counter("kvbridge_router_routes", "Turns routed, by decode reason",
                              ["decode_reason"], registry=r)
        self.reads = Counter("kvbridge_router_reads",
                             "Reads (AcquireRead forwarded, leases pinned at route time), by "
                             "outcome (hit, miss, refused_dead_holder, error)", ["outcome"],
                             registry=r)
        self.rpc_duration = Histogram(
            "kvbridge_router_rpc_duration_seconds", "RPC handling time", ["method"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r)
        self.rpc_errors = Counter("kvbridge_router_rpc_errors", "RPCs failed, by reason",
                                  ["method", "reason"], registry=r)
        instances = Gauge("kvbridge_router_instances", "Live instances, by role", ["role"],
                          registry=r)
        for role in Role:
            instances.labels(role.name.lower()).set_function(
                functools.partial(lambda role: len(table.instances(role)), role))


def _rpc(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: RouterServicer, request: Req, context: Ctx) -> Resp:
        start = time.perf_counter()
        try:
            return await fn(self, request, context)
        except KvbridgeError as err:
            self.metrics.rpc_errors.labels(name, err.reason).inc()
            log.debug("rpc_rejected", method=name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))
            raise  # unreachable: abort_with_status raises
        finally:
            self.metrics.rpc_duration.labels(name).observe(time.perf_counter() - start)

    return wrapper


def _duration(seconds: float) -> duration_pb2.Duration:
    seconds = max(seconds, 0.0)
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


# A turn's wait for its conversation's lease (RouteRequest.lease_wait): at most this long in
# all, polling this often (a grant lands within milliseconds of its turn's end).
_MAX_LEASE_WAIT_S = 5.0
_LEASE_POLL_S = 0.01
# The misses of a conversation with no active lease: what a lease wait waits on (one that has
# an active lease, even one too short to read, is routed at once).
_NO_ACTIVE_LEASE = frozenset({reg_pb.MISS_REASON_NO_LEASE, reg_pb.MISS_REASON_EXPIRED,
                              reg_pb.MISS_REASON_REVOKED})


def _seconds(d: duration_pb2.Duration, field: str) -> float:
    if d.seconds < 0 or d.nanos < 0:
        raise check.InvalidArgument(field, "must not be negative")
    return d.seconds + d.nanos * 1e-9


class RouterServicer(pb_grpc.RouterServiceServicer):
    def __init__(self, table: InstanceTable, metrics: RouterMetrics,
                 registry: AsyncRegistryClient | None,
                 urls: EngineUrlPolicy | None = None) -> None:
        self.table = table
        self.urls = urls or EngineUrlPolicy(any_host=True)
        self.metrics = metrics
        self.registry = registry
        self.config = table.config
        self._started = time.monotonic()

    def _instance(self, i: Instance) -> pb.Instance:
        s = i.spec
        return pb.Instance(
            instance_id=s.instance_id, role=cast(pb.Role.ValueType, int(s.role)),
            http_url=s.http_url, engine_id=s.engine_id, nixl_host=s.nixl_host,
            nixl_port=s.nixl_port, model=s.model,
            load=pb.Load(running_requests=i.load.running, waiting_requests=i.load.waiting,
                         kv_usage=i.load.kv_usage, tokens_in_flight=i.load.tokens_in_flight,
                         kv_capacity_tokens=i.load.kv_capacity_tokens),
            routed_since_heartbeat=i.routed, expires_in=_duration(self.table.time_left(i)))

    # ---- membership -------------------------------------------------------------------------

    @_rpc
    async def RegisterInstance(self, request: pb.RegisterInstanceRequest,
                               context: Ctx) -> pb.RegisterInstanceResponse:
        if request.role not in (pb.ROLE_PREFILL, pb.ROLE_DECODE):
            raise check.InvalidArgument("role", "must be ROLE_PREFILL or ROLE_DECODE")
        spec = InstanceSpec(
            request.instance_id, Role(request.role), request.http_url, request.engine_id,
            request.model, request.nixl_host, request.nixl_port,
            _seconds(request.ttl, "ttl"))
        self.table.check_spec(spec)  # cheap checks first: no lookup for a malformed request
        await self.urls.check(request.http_url)
        instance = self.table.register(spec, auth.current())
        return pb.RegisterInstanceResponse(instance=self._instance(instance),
                                           heartbeat_interval=_duration(instance.ttl / 3))

    @_rpc
    async def HeartbeatInstance(self, request: pb.HeartbeatInstanceRequest,
                                context: Ctx) -> pb.HeartbeatInstanceResponse:
        load = request.load
        instance = self.table.heartbeat(request.instance_id, Load(
            load.running_requests, load.waiting_requests, load.kv_usage, load.tokens_in_flight,
            load.kv_capacity_tokens),
            auth.current())
        return pb.HeartbeatInstanceResponse(expires_in=_duration(self.table.time_left(instance)))

    @_rpc
    async def DeregisterInstance(self, request: pb.DeregisterInstanceRequest,
                                 context: Ctx) -> pb.DeregisterInstanceResponse:
        return pb.DeregisterInstanceResponse(
            removed=self.table.deregister(request.instance_id, auth.current()))

    @_rpc
    async def ListInstances(self, request: pb.ListInstancesRequest,
                            context: Ctx) -> pb.ListInstancesResponse:
        if request.role not in (pb.ROLE_UNSPECIFIED, pb.ROLE_PREFILL, pb.ROLE_DECODE):
            raise check.InvalidArgument("role", f"unknown role {request.role}")
        role = Role(request.role) if request.role else None
        return pb.ListInstancesResponse(instances=[
            self._instance(i) for i in self.table.instances(role, request.model)])

    # ---- routing ----------------------------------------------------------------------------

    async def _lease_holder(self, tenant: str, conversation_id: str) -> str | None:
        """The engine id holding the conversation's active lease, "" for none, None when the
        registry cannot say in time."""
        if self.registry is None:
            return ""
        try:
            page = await self.registry.list_leases(tenant=tenant, conversation_id=conversation_id,
                                                   page_size=1,
                                                   timeout=self.config.registry_timeout_s)
        except KvbridgeError as err:
            log.warning("lease_lookup_failed", tenant=tenant, conversation=conversation_id,
                        error=str(err))
            return None
        for lease in page.leases:
            if lease.state == reg_pb.LEASE_STATE_ACTIVE:
                return lease.holder_id
        return ""

    async def _await_lease(self, tenant: str, conversation_id: str,
                           deadline: float) -> bool | None:
        """Poll until the conversation has an active lease (True) or `deadline` (monotonic)
        passes (False), or the registry cannot say (None). A list call, not a pin, so that the
        registry counts no read miss per poll."""
        assert self.registry is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                page = await self.registry.list_leases(
                    tenant=tenant, conversation_id=conversation_id, page_size=1,
                    timeout=min(left, self.config.registry_timeout_s))
            except KvbridgeError as err:
                log.warning("lease_wait_failed", tenant=tenant, conversation=conversation_id,
                            error=str(err))
                return None
            if any(lease.state == reg_pb.LEASE_STATE_ACTIVE for lease in page.leases):
                return True
            await asyncio.sleep(min(_LEASE_POLL_S, max(0.0, deadline - time.monotonic())))

    async def _find_lease(self, request: pb.RouteRequest, wait: float
                          ) -> tuple[str | None, reg_pb.PinLeaseResponse | None, float]:
        """The conversation's lease holder and, with `pin_read` or a lookup by content, its
        pinned read (as `_pin_read`); after waiting up to `wait` seconds for a lease while
        the named conversation has none. Also the seconds waited."""
        pin = request.pin_read or bool(request.history_keys)
        if pin:
            _seconds(request.pin_ttl, "pin_ttl")  # bad input fails before any pin
        if not (wait and request.conversation_id and self.registry is not None):
            wait = 0.0
        started = time.monotonic()
        pinned: reg_pb.PinLeaseResponse | None = None
        if pin:
            holder, pinned = await self._pin_read(request, count_no_lease=not wait)
            no_lease = (pinned is not None and not pinned.read.pin.pin_id
                        and pinned.read.miss_reason in _NO_ACTIVE_LEASE)
        else:
            holder = await self._lease_holder(request.tenant, request.conversation_id)
            no_lease = holder == ""
        if not (wait and no_lease):
            return holder, pinned, 0.0
        # A miss for want of an active lease is counted once, after the wait, whatever it finds.
        found = await self._await_lease(request.tenant, request.conversation_id,
                                        started + wait)
        if found:
            if pin:
                holder, pinned = await self._pin_read(request)
            else:
                holder = await self._lease_holder(request.tenant, request.conversation_id)
        elif pin:
            self.metrics.reads.labels("miss" if found is False else "error").inc()
        waited = time.monotonic() - started
        log.debug("lease_waited", tenant=request.tenant, conversation=request.conversation_id,
                  waited_ms=round(waited * 1000, 1), found=bool(holder))
        return holder, pinned, waited

    async def _pin_read(self, request: pb.RouteRequest, *, count_no_lease: bool = True
                        ) -> tuple[str | None, reg_pb.PinLeaseResponse | None]:
        """Pin the conversation's lease for the turn's prefill: (the lease holder as
        `_lease_holder` gives it, the pinned read or its miss; None when the registry could
        not answer in time). A miss for want of an active lease is not counted with
        `count_no_lease` off (the caller waits for one, then counts)."""
        if self.registry is None:
            return "", None
        try:
            pinned = await self.registry.pin_lease(
                request.tenant, request.conversation_id,
                pin_ttl=_seconds(request.pin_ttl, "pin_ttl"), reader_id="router",
                history_keys=request.history_keys, timeout=self.config.registry_timeout_s)
        except KvbridgeError as err:
            log.warning("lease_pin_failed", tenant=request.tenant,
                        conversation=request.conversation_id, error=str(err))
            self.metrics.reads.labels("error").inc()
            return None, None
        read = pinned.read
        if not read.pin.pin_id:
            if count_no_lease or read.miss_reason not in _NO_ACTIVE_LEASE:
                self.metrics.reads.labels("miss").inc()
            active = read.lease.state == reg_pb.LEASE_STATE_ACTIVE
            return (read.lease.holder_id if active and read.miss_reason
                    == reg_pb.MISS_REASON_BELOW_MINIMUM else ""), pinned
        holder = read.holder.holder_id
        if self.table.engine_is_dead(holder):
            self.metrics.reads.labels("refused_dead_holder").inc()
            log.warning("read_refused_dead_holder", holder=holder,
                        conversation=request.conversation_id)
            await self._release_quietly(read.pin.pin_id)
            return "", reg_pb.PinLeaseResponse(read=reg_pb.AcquireReadResponse(
                miss_reason=reg_pb.MISS_REASON_HOLDER_GONE, lease=read.lease))
        self.metrics.reads.labels("hit").inc()
        return holder, pinned

    async def _release_quietly(self, pin_id: str) -> None:
        try:
            release = self._registry_stub().ReleaseRead
            await release(reg_pb.ReleaseReadRequest(pin_id=pin_id),  # type: ignore[misc]
                          timeout=self.config.read_timeout_s,
                          metadata=self.registry.metadata if self.registry else None)
        except grpc.aio.AioRpcError as err:  # the pin runs out on its own
            log.warning("release_failed", pin_id=pin_id, error=err.details())

    @_rpc
    async def Route(self, request: pb.RouteRequest, context: Ctx) -> pb.RouteResponse:
        cfg = self.config
        holder: str | None = ""
        pinned: reg_pb.PinLeaseResponse | None = None
        waited = 0.0
        wait = _seconds(request.lease_wait, "lease_wait")
        if wait > _MAX_LEASE_WAIT_S:
            raise check.InvalidArgument("lease_wait", f"must be at most {_MAX_LEASE_WAIT_S:g}s")
        if request.conversation_id or request.history_keys:
            check.identifier("tenant", request.tenant, cfg.max_id_length)
            # How many keys a lookup may carry is the registry's to say.
            check_named_or_found(request.conversation_id, request.history_keys,
                                 cfg.max_id_length, sys.maxsize)
            holder, pinned, waited = await self._find_lease(request, wait)
        elif request.tenant:
            check.identifier("tenant", request.tenant, cfg.max_id_length)
        try:
            decision = self.table.route(request.prompt_tokens, request.model, holder,
                                        frozenset(request.exclude_instance_ids),
                                        tenant=request.tenant)
        except BaseException:
            if pinned is not None and pinned.read.pin.pin_id:
                await self._release_quietly(pinned.read.pin.pin_id)
            raise
        self.metrics.routes.labels(decision.decode_reason.name.lower()).inc()
        log.info("routed", tenant=request.tenant or None,
                 conversation=request.conversation_id or None,
                 found=(pinned.read.lease.conversation_id or None
                        if request.history_keys and pinned is not None else None),
                 prompt_tokens=request.prompt_tokens, prefill=decision.prefill.instance_id,
                 decode=decision.decode.instance_id,
                 decode_reason=decision.decode_reason.name.lower(),
                 lease_holder=decision.lease_holder or None,
                 pinned=bool(pinned and pinned.read.pin.pin_id) if request.pin_read else None)
        return pb.RouteResponse(
            prefill=self._instance(decision.prefill), decode=self._instance(decision.decode),
            prefill_reason=pb.PREFILL_REASON_LEAST_LOADED,
            decode_reason=cast(pb.DecodeReason.ValueType, int(decision.decode_reason)),
            lease_holder_id=decision.lease_holder, explanation=decision.explanation,
            read=pinned, lease_waited=_duration(waited))

    @_rpc
    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: Ctx) -> pb.GetServerInfoResponse:
        now = time.time()
        whole = int(now)
        return pb.GetServerInfoResponse(
            version=__version__,
            current_time=timestamp_pb2.Timestamp(seconds=whole, nanos=int((now - whole) * 1e9)),
            uptime=_duration(time.monotonic() - self._started))

    # ---- reads, for prefill connectors ------------------------------------------------------

    def _registry_stub(self) -> reg_grpc.RegistryServiceStub:
        if self.registry is None:
            raise Unavailable("this router has no registry (--registry is empty)")
        return self.registry.stub

    async def _forward(self, method: str, request: Any, context: Ctx) -> Any:
        stub = self._registry_stub()
        try:
            return await getattr(stub, method)(request, timeout=self.config.read_timeout_s,
                                               metadata=self.registry and self.registry.metadata)
        except grpc.aio.AioRpcError as err:
            if self.registry is not None:
                self.registry.report_failure(err.code())  # registry replicas: fail over
            # The registry's own status (code, message, ErrorInfo) goes back as it came.
            await context.abort(err.code(), err.details() or "",
                                tuple(err.trailing_metadata() or ()))
            raise  # unreachable

    @_rpc
    async def AcquireRead(self, request: reg_pb.AcquireReadRequest,
                          context: Ctx) -> reg_pb.AcquireReadResponse:
        try:
            resp: reg_pb.AcquireReadResponse = await self._forward("AcquireRead", request,
                                                                   context)
        except BaseException:
            self.metrics.reads.labels("error").inc()
            raise
        if not resp.pin.pin_id:
            self.metrics.reads.labels("miss").inc()
            return resp
        holder = resp.holder.holder_id
        if self.table.engine_is_dead(holder):
            # The registry has not noticed yet; the router has. Never offer that KV.
            self.metrics.reads.labels("refused_dead_holder").inc()
            log.warning("read_refused_dead_holder", holder=holder,
                        conversation=request.conversation_id)
            await self._release_quietly(resp.pin.pin_id)
            return reg_pb.AcquireReadResponse(miss_reason=reg_pb.MISS_REASON_HOLDER_GONE,
                                              lease=resp.lease)
        self.metrics.reads.labels("hit").inc()
        return resp

    @_rpc
    async def ReleaseRead(self, request: reg_pb.ReleaseReadRequest,
                          context: Ctx) -> reg_pb.ReleaseReadResponse:
        resp: reg_pb.ReleaseReadResponse = await self._forward("ReleaseRead", request, context)
        return resp
