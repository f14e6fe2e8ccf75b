"""The routing service's configuration."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvbridge import tracing
from kvbridge.auth import TOKEN_ENV, SecuritySettings
from kvbridge.config import check_logging, setting
from kvbridge.services.router._urls import EngineUrlPolicy


@dataclasses.dataclass(frozen=True)
class RouterConfig(SecuritySettings):
    """Everything an operator can set on a router; validated at construction."""

    env_prefix: ClassVar[str] = "KVBRIDGE_ROUTER_"

    listen: str = setting("127.0.0.1:50061", "host:port for the gRPC API (port 0 picks one)")
    registry: str = setting(
        "127.0.0.1:50051",
        "registry host:port (replicas: comma-separated, with failover), asked where each "
        "conversation's KV lives; empty: route by load only and refuse AcquireRead")
    metrics_listen: str = setting(
        "127.0.0.1:9465", "host:port for Prometheus /metrics over HTTP; empty disables it")
    default_instance_ttl_s: float = setting(
        10.0, "instance heartbeat TTL when the instance names none (heartbeat every TTL/3)")
    min_instance_ttl_s: float = setting(1.0, "shortest instance TTL accepted")
    max_instance_ttl_s: float = setting(300.0, "longest instance TTL accepted")
    decode_load_margin: int = setting(
        4, "route a turn away from the decode instance holding its lease when that instance "
        "has more than this many requests (running + waiting) over the shortest queue; a turn "
        "with no lease goes to the decode with the least KV in use among those within this "
        "many requests of the shortest queue")
    decode_max_kv_usage: float = setting(
        0.95, "route away from a lease holder whose KV cache usage is at or above this")
    registry_timeout_s: float = setting(
        0.25, "deadline of the lease lookup in Route; past it the turn is routed by load")
    read_timeout_s: float = setting(
        1.0, "deadline of AcquireRead and ReleaseRead forwarded to the registry")
    dead_engine_memory_s: float = setting(
        3600.0, "how long the router remembers an engine id that stopped heartbeating (reads "
        "of its KV are refused meanwhile)")
    max_id_length: int = setting(256, "longest id (instance, engine, tenant, conversation)")
    engine_url_allow: str = setting(
        "", "hosts an instance's http_url may name (the gateway sends turns there): "
        "comma-separated host names (*-patterns) and CIDRs, or * for any host. Empty: loopback "
        "only when --listen is a loopback address, else any host. Link-local/metadata "
        "(169.254.0.0/16, fe80::/10), unspecified and multicast addresses are always refused")
    shutdown_grace_s: float = setting(5.0, "seconds in-flight RPCs get on SIGTERM")
    token: str = setting(
        "", "bearer token (role router) the router sends to the registry; prefer the "
        "environment variable to the flag", env=TOKEN_ENV)
    otlp_traces_endpoint: str = tracing.endpoint_setting()
    log_level: str = setting("info", "debug, info, warning or error")
    log_format: str = setting("auto", "json, console, or auto (JSON unless on a terminal)")

    def __post_init__(self) -> None:
        for name in ("default_instance_ttl_s", "min_instance_ttl_s", "max_instance_ttl_s",
                     "registry_timeout_s", "read_timeout_s", "dead_engine_memory_s",
                     "max_id_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not (self.min_instance_ttl_s <= self.default_instance_ttl_s
                <= self.max_instance_ttl_s):
            raise ValueError("need min_instance_ttl_s <= default_instance_ttl_s "
                             "<= max_instance_ttl_s")
        if self.decode_load_margin < 0:
            raise ValueError("decode_load_margin must not be negative")
        if not 0.0 < self.decode_max_kv_usage <= 1.0:
            raise ValueError("decode_max_kv_usage must be in (0, 1]")
        check_logging(self.log_level, self.log_format)
        tracing.check_endpoint(self.otlp_traces_endpoint)
        self.url_policy()
        self.check_security()

    def url_policy(self) -> EngineUrlPolicy:
        """The engine URL policy `engine_url_allow` describes (ValueError when malformed)."""
        host = self.listen.rsplit(":", 1)[0] if ":" in self.listen else self.listen
        return EngineUrlPolicy.parse(self.engine_url_allow, host)
