"""Registry clients: `RegistryClient` (blocking) and `AsyncRegistryClient` (asyncio).

Both take the same arguments and return the API's response messages. Every call has a
deadline (`timeout`, per client and per call). Idempotent calls are retried on UNAVAILABLE with
jittered backoff inside that deadline; grants and reads get a generated `request_id` so that a
retry after a lost reply returns the same lease or pin instead of making a second one. Failures
raise `kvbridge.errors` exceptions (`LeaseNotFound`, `Unavailable`, `DeadlineExceeded`, ...).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf import duration_pb2

from kvbridge.clients._base import AsyncClient, StreamResume, SyncClient
from kvbridge.errors import KvbridgeError, RateLimited, Unavailable
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc

MAX_PAGE_SIZE = 1000  # ListLeasesRequest.page_size at most (registry.proto): the fewest calls


def duration(seconds: float) -> duration_pb2.Duration:
    """A google.protobuf.Duration for `seconds`."""
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


def seconds(d: duration_pb2.Duration) -> float:
    """Seconds in a google.protobuf.Duration."""
    return float(d.seconds + d.nanos * 1e-9)


class _Requests:
    """Builds each RPC's request from keyword arguments (shared by both clients)."""

    @staticmethod
    def register_holder(holder_id: str, nixl_host: str, nixl_port: int, block_size: int,
                        engine_fingerprint: str, tp_size: int = 1, ttl: float = 0.0,
                        held_leases: Sequence[pb.LeaseSnapshot] = (),
                        software_version: str = "", held_lease_ids: Sequence[str] = (),
                        restore_only: bool = False) -> pb.RegisterHolderRequest:
        return pb.RegisterHolderRequest(
            holder_id=holder_id, nixl_host=nixl_host, nixl_port=nixl_port, tp_size=tp_size,
            block_size=block_size, engine_fingerprint=engine_fingerprint,
            ttl=duration(ttl), held_leases=held_leases, software_version=software_version,
            held_lease_ids=held_lease_ids, restore_only=restore_only)

    @staticmethod
    def grant_lease(holder_id: str, tenant: str, conversation_id: str, remote_request_id: str,
                    block_ids: Sequence[int], token_count: int, block_hashes: bytes,
                    idle_ttl: float = 0.0, max_lifetime: float = 0.0,
                    request_id: str | None = None, history_keys: bytes = b""
                    ) -> pb.GrantLeaseRequest:
        return pb.GrantLeaseRequest(
            holder_id=holder_id, tenant=tenant, conversation_id=conversation_id,
            remote_request_id=remote_request_id, block_ids=block_ids, token_count=token_count,
            block_hashes=block_hashes, idle_ttl=duration(idle_ttl),
            max_lifetime=duration(max_lifetime),
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            history_keys=history_keys)

    @staticmethod
    def renew_leases(lease_ids: Iterable[str] = (),
                     conversations: Iterable[tuple[str, str]] = ()) -> pb.RenewLeasesRequest:
        return pb.RenewLeasesRequest(
            lease_ids=list(lease_ids),
            conversations=[pb.ConversationRef(tenant=t, conversation_id=c)
                           for t, c in conversations])

    @staticmethod
    def acquire_read(tenant: str, conversation_id: str, block_hashes: bytes,
                     min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                     request_id: str | None = None) -> pb.AcquireReadRequest:
        return pb.AcquireReadRequest(
            tenant=tenant, conversation_id=conversation_id, block_hashes=block_hashes,
            min_tokens=min_tokens, pin_ttl=duration(pin_ttl), reader_id=reader_id,
            request_id=request_id if request_id is not None else uuid.uuid4().hex)

    @staticmethod
    def pin_lease(tenant: str, conversation_id: str, min_tokens: int = 0, pin_ttl: float = 0.0,
                  reader_id: str = "", request_id: str | None = None,
                  history_keys: bytes = b"") -> pb.PinLeaseRequest:
        return pb.PinLeaseRequest(
            tenant=tenant, conversation_id=conversation_id, min_tokens=min_tokens,
            pin_ttl=duration(pin_ttl), reader_id=reader_id,
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            history_keys=history_keys)

    @staticmethod
    def list_leases(tenant: str = "", conversation_id: str = "", holder_id: str = "",
                    include_inactive: bool = False, page_size: int = 0, page_token: str = "",
                    include_blocks: bool = False) -> pb.ListLeasesRequest:
        return pb.ListLeasesRequest(
            tenant=tenant, conversation_id=conversation_id, holder_id=holder_id,
            include_inactive=include_inactive, page_size=page_size, page_token=page_token,
            include_blocks=include_blocks)


class RegistryClient(SyncClient):
    """Blocking registry client. Thread-safe; one channel per client."""

    stub_class = pb_grpc.RegistryServiceStub

    def register_holder(self, holder_id: str, nixl_host: str, nixl_port: int, block_size: int,
                        engine_fingerprint: str, tp_size: int = 1, ttl: float = 0.0,
                        held_leases: Sequence[pb.LeaseSnapshot] = (), software_version: str = "",
                        held_lease_ids: Sequence[str] = (), restore_only: bool = False, *,
                        timeout: float | None = None) -> pb.RegisterHolderResponse:
        """Register (again) as a holder. A holder that retains more leases than one call may
        carry (`RegistryLimits.max_held_leases_per_call`) sends them in pages: the first call
        with every id in `held_lease_ids`, the later ones with `restore_only`."""
        req = _Requests.register_holder(holder_id, nixl_host, nixl_port, block_size,
                                        engine_fingerprint, tp_size, ttl, held_leases,
                                        software_version, held_lease_ids, restore_only)
        return self._call("RegisterHolder", req, idempotent=True, timeout=timeout)

    def get_server_info(self, *, timeout: float | None = None) -> pb.GetServerInfoResponse:
        return self._call("GetServerInfo", pb.GetServerInfoRequest(), idempotent=True,
                          timeout=timeout)

    def heartbeat(self, holder_id: str, reclaimed_lease_ids: Iterable[str] = (), *,
                  timeout: float | None = None) -> pb.HeartbeatHolderResponse:
        req = pb.HeartbeatHolderRequest(holder_id=holder_id,
                                        reclaimed_lease_ids=list(reclaimed_lease_ids))
        return self._call("HeartbeatHolder", req, idempotent=True, timeout=timeout)

    def deregister_holder(self, holder_id: str, *, timeout: float | None = None
                          ) -> pb.DeregisterHolderResponse:
        req = pb.DeregisterHolderRequest(holder_id=holder_id)
        return self._call("DeregisterHolder", req, idempotent=True, timeout=timeout)

    def list_holders(self, page_size: int = 0, page_token: str = "", *,
                     timeout: float | None = None) -> pb.ListHoldersResponse:
        req = pb.ListHoldersRequest(page_size=page_size, page_token=page_token)
        return self._call("ListHolders", req, idempotent=True, timeout=timeout)

    def iter_holders(self, *, timeout: float | None = None) -> Iterator[pb.Holder]:
        token = ""
        while True:
            page = self.list_holders(page_token=token, timeout=timeout)
            yield from page.holders
            token = page.next_page_token
            if not token:
                return

    def grant_lease(self, holder_id: str, tenant: str, conversation_id: str,
                    remote_request_id: str, block_ids: Sequence[int], token_count: int,
                    block_hashes: bytes, idle_ttl: float = 0.0, max_lifetime: float = 0.0,
                    request_id: str | None = None, *, history_keys: bytes = b"",
                    timeout: float | None = None) -> pb.GrantLeaseResponse:
        req = _Requests.grant_lease(holder_id, tenant, conversation_id, remote_request_id,
                                    block_ids, token_count, block_hashes, idle_ttl,
                                    max_lifetime, request_id, history_keys)
        return self._call("GrantLease", req, idempotent=True, timeout=timeout)

    def renew_leases(self, lease_ids: Iterable[str] = (),
                     conversations: Iterable[tuple[str, str]] = (), *,
                     timeout: float | None = None) -> pb.RenewLeasesResponse:
        req = _Requests.renew_leases(lease_ids, conversations)
        return self._call("RenewLeases", req, idempotent=True, timeout=timeout)

    def revoke_lease(self, lease_id: str, reason: str = "", holder_id: str = "", *,
                     timeout: float | None = None) -> pb.RevokeLeaseResponse:
        req = pb.RevokeLeaseRequest(lease_id=lease_id, reason=reason, holder_id=holder_id)
        return self._call("RevokeLease", req, idempotent=True, timeout=timeout)

    def get_lease(self, lease_id: str, *, timeout: float | None = None) -> pb.Lease:
        return self.lease_status(lease_id, timeout=timeout).lease

    def lease_status(self, lease_id: str, *, timeout: float | None = None
                     ) -> pb.GetLeaseResponse:
        """The lease and whether its holder may free its blocks now (`reclaimable`)."""
        req = pb.GetLeaseRequest(lease_id=lease_id)
        return self._call("GetLease", req, idempotent=True, timeout=timeout)

    def list_leases(self, tenant: str = "", conversation_id: str = "", holder_id: str = "",
                    include_inactive: bool = False, page_size: int = 0, page_token: str = "",
                    include_blocks: bool = False, *, timeout: float | None = None
                    ) -> pb.ListLeasesResponse:
        req = _Requests.list_leases(tenant, conversation_id, holder_id, include_inactive,
                                    page_size, page_token, include_blocks)
        return self._call("ListLeases", req, idempotent=True, timeout=timeout)

    def iter_leases(self, *, page_size: int = MAX_PAGE_SIZE, max_wait: float = 30.0,
                    **filters: Any) -> Iterator[pb.Lease]:
        """Every lease matching `filters` (those of `list_leases`), page by page. A broad
        listing of a large fleet takes many pages, more than the registry's listing rate per
        caller lets through at once: a page refused for it (RATE_LIMITED) is asked again
        after the `retry_after_s` the refusal names, up to `max_wait` seconds of waiting for
        one page (then the refusal is raised)."""
        token = ""
        waited = 0.0
        while True:
            try:
                page = self.list_leases(page_token=token, page_size=page_size, **filters)
            except RateLimited as err:
                wait = max(float(err.metadata.get("retry_after_s", 0) or 0), 0.05)
                if waited + wait > max_wait:
                    raise
                time.sleep(wait)
                waited += wait
                continue
            waited = 0.0
            yield from page.leases
            token = page.next_page_token
            if not token:
                return

    def acquire_read(self, tenant: str, conversation_id: str, block_hashes: bytes,
                     min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                     request_id: str | None = None, *, timeout: float | None = None
                     ) -> pb.AcquireReadResponse:
        req = _Requests.acquire_read(tenant, conversation_id, block_hashes, min_tokens,
                                     pin_ttl, reader_id, request_id)
        return self._call("AcquireRead", req, idempotent=True, timeout=timeout)

    def pin_lease(self, tenant: str, conversation_id: str, min_tokens: int = 0,
                  pin_ttl: float = 0.0, reader_id: str = "", request_id: str | None = None, *,
                  history_keys: bytes = b"", timeout: float | None = None
                  ) -> pb.PinLeaseResponse:
        """Pin the conversation's whole lease (with `history_keys` and no conversation id:
        the lease found by content); the reader verifies its prompt against the returned
        hashes itself (see `kvbridge.blockhash.matching_prefix`)."""
        req = _Requests.pin_lease(tenant, conversation_id, min_tokens, pin_ttl, reader_id,
                                  request_id, history_keys)
        return self._call("PinLease", req, idempotent=True, timeout=timeout)

    def release_read(self, pin_id: str, *, timeout: float | None = None) -> bool:
        req = pb.ReleaseReadRequest(pin_id=pin_id)
        return bool(self._call("ReleaseRead", req, idempotent=True, timeout=timeout).released)

    def watch_leases(self, holder_id: str = "", tenant: str = "",
                     include_renewals: bool = False, *, reconnect_for: float = 0.0,
                     on_lost: Callable[[str, KvbridgeError], None] | None = None,
                     on_resumed: Callable[[str], None] | None = None
                     ) -> Iterator[pb.LeaseEvent]:
        """Stream lease events until the caller stops iterating or the stream fails.

        With several addresses the stream opens on the first that answers. With
        `reconnect_for` > 0 a stream that ends because its replica went away or cut it
        (UNAVAILABLE, CANCELLED, RESOURCE_EXHAUSTED) is opened again, on the next address
        first, for up to that many seconds without one: `on_lost(target, error)` is called
        when it ends and `on_resumed(target)` when another is live. Events between the two
        are not replayed: a watcher that needs them re-lists. A raised error's
        `stream_ended` says whether a stream had been live (else none could be opened).
        Channels ping (`CHANNEL_OPTIONS`), so a replica that vanished without closing the
        connection (a host crash, a partition) ends the stream within about 40 s.
        """
        req = pb.WatchLeasesRequest(holder_id=holder_id, tenant=tenant,
                                    include_renewals=include_renewals)
        resume = StreamResume(self, reconnect_for, on_lost, on_resumed)
        while True:
            index = self._active
            stream = self._stubs[index].WatchLeases(req, metadata=self.metadata)
            try:
                resume.opened(index, stream.initial_metadata())
                for resp in stream:
                    resume.event()
                    yield resp.event
                return
            except grpc.RpcError as err:
                wait = resume.failed(err)
                if wait is None:
                    error = resume.error(err)
                    if error is None:
                        return
                    raise error from None
            finally:
                stream.cancel()
            time.sleep(wait)


class AsyncRegistryClient(AsyncClient):
    """asyncio registry client; same methods as `RegistryClient`, awaitable."""

    stub_class = pb_grpc.RegistryServiceStub

    @property
    def stub(self) -> pb_grpc.RegistryServiceStub:
        """The raw stub, for forwarding requests as they are (the router does)."""
        return self._stub

    async def register_holder(self, holder_id: str, nixl_host: str, nixl_port: int,
                              block_size: int, engine_fingerprint: str, tp_size: int = 1,
                              ttl: float = 0.0, held_leases: Sequence[pb.LeaseSnapshot] = (),
                              software_version: str = "", held_lease_ids: Sequence[str] = (),
                              restore_only: bool = False, *, timeout: float | None = None
                              ) -> pb.RegisterHolderResponse:
        """See `RegistryClient.register_holder`."""
        req = _Requests.register_holder(holder_id, nixl_host, nixl_port, block_size,
                                        engine_fingerprint, tp_size, ttl, held_leases,
                                        software_version, held_lease_ids, restore_only)
        return await self._call("RegisterHolder", req, idempotent=True, timeout=timeout)

    async def get_server_info(self, *, timeout: float | None = None
                              ) -> pb.GetServerInfoResponse:
        return await self._call("GetServerInfo", pb.GetServerInfoRequest(), idempotent=True,
                                timeout=timeout)

    async def heartbeat(self, holder_id: str, reclaimed_lease_ids: Iterable[str] = (), *,
                        timeout: float | None = None) -> pb.HeartbeatHolderResponse:
        req = pb.HeartbeatHolderRequest(holder_id=holder_id,
                                        reclaimed_lease_ids=list(reclaimed_lease_ids))
        return await self._call("HeartbeatHolder", req, idempotent=True, timeout=timeout)

    async def deregister_holder(self, holder_id: str, *, timeout: float | None = None
                                ) -> pb.DeregisterHolderResponse:
        req = pb.DeregisterHolderRequest(holder_id=holder_id)
        return await self._call("DeregisterHolder", req, idempotent=True, timeout=timeout)

    async def list_holders(self, page_size: int = 0, page_token: str = "", *,
                           timeout: float | None = None) -> pb.ListHoldersResponse:
        req = pb.ListHoldersRequest(page_size=page_size, page_token=page_token)
        return await self._call("ListHolders", req, idempotent=True, timeout=timeout)

    async def grant_lease(self, holder_id: str, tenant: str, conversation_id: str,
                          remote_request_id: str, block_ids: Sequence[int], token_count: int,
                          block_hashes: bytes, idle_ttl: float = 0.0, max_lifetime: float = 0.0,
                          request_id: str | None = None, *, history_keys: bytes = b"",
                          timeout: float | None = None) -> pb.GrantLeaseResponse:
        req = _Requests.grant_lease(holder_id, tenant, conversation_id, remote_request_id,
                                    block_ids, token_count, block_hashes, idle_ttl,
                                    max_lifetime, request_id, history_keys)
        return await self._call("GrantLease", req, idempotent=True, timeout=timeout)

    async def renew_leases(self, lease_ids: Iterable[str] = (),
                           conversations: Iterable[tuple[str, str]] = (), *,
                           timeout: float | None = None) -> pb.RenewLeasesResponse:
        req = _Requests.renew_leases(lease_ids, conversations)
        return await self._call("RenewLeases", req, idempotent=True, timeout=timeout)

    async def revoke_lease(self, lease_id: str, reason: str = "", holder_id: str = "", *,
                           timeout: float | None = None) -> pb.RevokeLeaseResponse:
        req = pb.RevokeLeaseRequest(lease_id=lease_id, reason=reason, holder_id=holder_id)
        return await self._call("RevokeLease", req, idempotent=True, timeout=timeout)

    async def get_lease(self, lease_id: str, *, timeout: float | None = None) -> pb.Lease:
        return (await self.lease_status(lease_id, timeout=timeout)).lease

    async def lease_status(self, lease_id: str, *, timeout: float | None = None
                           ) -> pb.GetLeaseResponse:
        """The lease and whether its holder may free its blocks now (`reclaimable`)."""
        req = pb.GetLeaseRequest(lease_id=lease_id)
        return await self._call("GetLease", req, idempotent=True, timeout=timeout)

    async def list_leases(self, tenant: str = "", conversation_id: str = "",
                          holder_id: str = "", include_inactive: bool = False,
                          page_size: int = 0, page_token: str = "",
                          include_blocks: bool = False, *, timeout: float | None = None
                          ) -> pb.ListLeasesResponse:
        req = _Requests.list_leases(tenant, conversation_id, holder_id, include_inactive,
                                    page_size, page_token, include_blocks)
        return await self._call("ListLeases", req, idempotent=True, timeout=timeout)

    async def acquire_read(self, tenant: str, conversation_id: str, block_hashes: bytes,
                           min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                           request_id: str | None = None, *, timeout: float | None = None
                           ) -> pb.AcquireReadResponse:
        req = _Requests.acquire_read(tenant, conversation_id, block_hashes, min_tokens,
                                     pin_ttl, reader_id, request_id)
        return await self._call("AcquireRead", req, idempotent=True, timeout=timeout)

    async def pin_lease(self, tenant: str, conversation_id: str, min_tokens: int = 0,
                        pin_ttl: float = 0.0, reader_id: str = "",
                        request_id: str | None = None, *, history_keys: bytes = b"",
                        timeout: float | None = None) -> pb.PinLeaseResponse:
        req = _Requests.pin_lease(tenant, conversation_id, min_tokens, pin_ttl, reader_id,
                                  request_id, history_keys)
        return await self._call("PinLease", req, idempotent=True, timeout=timeout)

    async def release_read(self, pin_id: str, *, timeout: float | None = None) -> bool:
        req = pb.ReleaseReadRequest(pin_id=pin_id)
        resp = await self._call("ReleaseRead", req, idempotent=True, timeout=timeout)
        return bool(resp.released)

    async def watch_leases(self, holder_id: str = "", tenant: str = "",
                           include_renewals: bool = False, *, reconnect_for: float = 0.0,
                           on_lost: Callable[[str, KvbridgeError], None] | None = None,
                           on_resumed: Callable[[str], None] | None = None) -> Any:
        """An async iterator of lease events; failover and `reconnect_for` as in
        `RegistryClient.watch_leases`."""
        req = pb.WatchLeasesRequest(holder_id=holder_id, tenant=tenant,
                                    include_renewals=include_renewals)
        resume = StreamResume(self, reconnect_for, on_lost, on_resumed)
        while True:
            index = self._active
            call = self._stubs[index].WatchLeases(req, metadata=self.metadata)
            try:
                resume.opened(index, await call.initial_metadata())
                async for resp in call:
                    resume.event()
                    yield resp.event
                return
            except grpc.RpcError as err:
                wait = resume.failed(err)
                if wait is None:
                    error = resume.error(err)
                    if error is None:
                        return
                    raise error from None
            finally:
                call.cancel()
            await asyncio.sleep(wait)


__all__ = ["AsyncRegistryClient", "KvbridgeError", "RegistryClient", "Unavailable",
           "duration", "seconds"]
