"""Routing service clients (blocking and asyncio): instance membership, routes, listing, and
the registry's read API as the router serves it."""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.clients._base import AsyncClient, SyncClient
from kvbridge.clients._registry import _Requests
from kvbridge.clients._registry import duration as duration_pb
from kvbridge.registry.v1 import registry_pb2 as reg_pb
from kvbridge.router.v1 import router_pb2 as pb
from kvbridge.router.v1 import router_pb2_grpc as pb_grpc

ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}


class RouterClient(SyncClient):
    """Blocking router client. Thread-safe; one channel per client. Every call is idempotent
    and retried on UNAVAILABLE within its deadline."""

    stub_class = pb_grpc.RouterServiceStub

    def register_instance(self, instance_id: str, role: str, http_url: str, engine_id: str,
                          model: str, nixl_host: str = "", nixl_port: int = 0,
                          ttl: float = 0.0, *, timeout: float | None = None
                          ) -> pb.RegisterInstanceResponse:
        req = pb.RegisterInstanceRequest(
            instance_id=instance_id, role=ROLES.get(role, pb.ROLE_UNSPECIFIED),
            http_url=http_url, engine_id=engine_id, model=model, nixl_host=nixl_host,
            nixl_port=nixl_port, ttl=duration_pb(ttl))
        return self._call("RegisterInstance", req, timeout=timeout)

    def heartbeat(self, instance_id: str, running: int = 0, waiting: int = 0,
                  kv_usage: float = 0.0, tokens_in_flight: int = 0, *,
                  kv_capacity_tokens: int = 0,
                  timeout: float | None = None) -> pb.HeartbeatInstanceResponse:
        req = pb.HeartbeatInstanceRequest(instance_id=instance_id, load=pb.Load(
            running_requests=running, waiting_requests=waiting, kv_usage=kv_usage,
            tokens_in_flight=tokens_in_flight, kv_capacity_tokens=kv_capacity_tokens))
        return self._call("HeartbeatInstance", req, timeout=timeout)

    def deregister_instance(self, instance_id: str, *, timeout: float | None = None) -> bool:
        req = pb.DeregisterInstanceRequest(instance_id=instance_id)
        return bool(self._call("DeregisterInstance", req, timeout=timeout).removed)

    def list_instances(self, role: str = "", model: str = "", *,
                       timeout: float | None = None) -> list[pb.Instance]:
        req = pb.ListInstancesRequest(role=ROLES.get(role, pb.ROLE_UNSPECIFIED), model=model)
        return list(self._call("ListInstances", req, timeout=timeout).instances)

    def route(self, tenant: str, conversation_id: str, prompt_tokens: int, model: str = "",
              exclude: Sequence[str] = (), *, pin_read: bool = False, pin_ttl: float = 0.0,
              history_keys: bytes = b"", lease_wait: float = 0.0,
              timeout: float | None = None) -> pb.RouteResponse:
        """Pick a prefill and a decode instance for a turn. With `pin_read`, also pin the
        conversation's lease for the prefill (the response's `read`); not retried, so that a
        retry cannot leave a second pin behind. With `history_keys` and no conversation id,
        the conversation is found by content (`kvbridge.history`). With `lease_wait`, wait up
        to that long for the conversation's lease while it has none (the timeout must cover
        it)."""
        req = pb.RouteRequest(tenant=tenant, conversation_id=conversation_id,
                              prompt_tokens=prompt_tokens, model=model,
                              exclude_instance_ids=list(exclude), pin_read=pin_read,
                              pin_ttl=duration_pb(pin_ttl), history_keys=history_keys,
                              lease_wait=duration_pb(lease_wait))
        resp: pb.RouteResponse = self._call("Route", req, timeout=timeout)
        return resp

    def get_server_info(self, *, timeout: float | None = None) -> pb.GetServerInfoResponse:
        resp: pb.GetServerInfoResponse = self._call("GetServerInfo", pb.GetServerInfoRequest(),
                                                    timeout=timeout)
        return resp

    # The registry's read API, as the router serves it (same signatures as RegistryClient's),
    # so that a prefill connector can be pointed at either.

    def acquire_read(self, tenant: str, conversation_id: str, block_hashes: bytes,
                     min_tokens: int = 0, pin_ttl: float = 0.0, reader_id: str = "",
                     request_id: str | None = None, *, timeout: float | None = None
                     ) -> reg_pb.AcquireReadResponse:
        req = _Requests.acquire_read(tenant, conversation_id, block_hashes, min_tokens,
                                     pin_ttl, reader_id, request_id)
        return self._call("AcquireRead", req, timeout=timeout)

    def release_read(self, pin_id: str, *, timeout: float | None = None) -> bool:
        req = reg_pb.ReleaseReadRequest(pin_id=pin_id)
        return bool(self._call("ReleaseRead", req, timeout=timeout).released)


class AsyncRouterClient(AsyncClient):
    """asyncio router client (the gateway's, the instance agent's)."""

    stub_class = pb_grpc.RouterServiceStub

    async def route(self, tenant: str, conversation_id: str, prompt_tokens: int,
                    model: str = "", exclude: Sequence[str] = (), *, pin_read: bool = False,
                    pin_ttl: float = 0.0, history_keys: bytes = b"",
                    lease_wait: float = 0.0, timeout: float | None = None) -> pb.RouteResponse:
        req = pb.RouteRequest(tenant=tenant, conversation_id=conversation_id,
                              prompt_tokens=prompt_tokens, model=model,
                              exclude_instance_ids=list(exclude), pin_read=pin_read,
                              pin_ttl=duration_pb(pin_ttl), history_keys=history_keys,
                              lease_wait=duration_pb(lease_wait))
        return await self._call("Route", req, timeout=timeout)

    async def list_instances(self, role: str = "", model: str = "", *,
                             timeout: float | None = None) -> list[pb.Instance]:
        req = pb.ListInstancesRequest(role=ROLES.get(role, pb.ROLE_UNSPECIFIED), model=model)
        return list((await self._call("ListInstances", req, timeout=timeout)).instances)

    async def register_instance(self, instance_id: str, role: str, http_url: str,
                                engine_id: str, model: str, nixl_host: str = "",
                                nixl_port: int = 0, ttl: float = 0.0, *,
                                timeout: float | None = None) -> pb.RegisterInstanceResponse:
        req = pb.RegisterInstanceRequest(
            instance_id=instance_id, role=ROLES.get(role, pb.ROLE_UNSPECIFIED),
            http_url=http_url, engine_id=engine_id, model=model, nixl_host=nixl_host,
            nixl_port=nixl_port, ttl=duration_pb(ttl))
        return await self._call("RegisterInstance", req, timeout=timeout)

    async def heartbeat(self, instance_id: str, running: int = 0, waiting: int = 0,
                        kv_usage: float = 0.0, tokens_in_flight: int = 0, *,
                        kv_capacity_tokens: int = 0,
                        timeout: float | None = None) -> pb.HeartbeatInstanceResponse:
        req = pb.HeartbeatInstanceRequest(instance_id=instance_id, load=pb.Load(
            running_requests=running, waiting_requests=waiting, kv_usage=kv_usage,
            tokens_in_flight=tokens_in_flight, kv_capacity_tokens=kv_capacity_tokens))
        return await self._call("HeartbeatInstance", req, timeout=timeout)

    async def deregister_instance(self, instance_id: str, *,
                                  timeout: float | None = None) -> bool:
        req = pb.DeregisterInstanceRequest(instance_id=instance_id)
        return bool((await self._call("DeregisterInstance", req, timeout=timeout)).removed)
