"""The gateway's configuration."""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

from kvbridge import tracing
from kvbridge.auth import INSECURE_ENV, TOKEN_ENV, TlsFiles
from kvbridge.config import check_logging, setting


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """Everything an operator can set on a gateway; validated at construction."""

    env_prefix: ClassVar[str] = "KVBRIDGE_GATEWAY_"

    listen: str = setting("127.0.0.1:8080", "host:port for the OpenAI-compatible HTTP API")
    router: str = setting("127.0.0.1:50061", "routing service host:port")
    registry: str = setting(
        "127.0.0.1:50051",
        "registry host:port (replicas: comma-separated, with failover), for renewing a "
        "conversation's lease each turn, keepalive and DELETE; empty disables those")
    api_keys_file: str = setting(
        "", "file of 'API_KEY TENANT' lines: only these keys are accepted, each mapped to its "
        "tenant. Empty: open mode, any bearer token is accepted and names its own tenant (a "
        "hash of it), and a request without one is tenant 'anonymous'")
    route_timeout_s: float = setting(2.0, "deadline of the Route call to the router")
    request_timeout_s: float = setting(600.0, "longest a prefill or decode request may take")
    connect_timeout_s: float = setting(
        10.0, "longest to wait for a connection to an engine before trying another instance")
    engine_keepalive_s: float = setting(
        3.0, "idle time after which a kept-alive connection to an engine is not reused. Keep it "
        "below the engines' own keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by "
        "default): past that the engine closes the connection, and a request sent on it as "
        "it does fails and is retried elsewhere, or refused where no other instance serves")
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request body accepted")
    header_timeout_s: float = setting(
        10.0, "longest a client may take to send a request's headers (from connecting, or from "
        "its first byte after a previous request); past it the connection is closed")
    body_timeout_s: float = setting(
        30.0, "longest a client may take to send a request's body; past it the request gets a "
        "408 and the connection is closed")
    keepalive_timeout_s: float = setting(
        15.0, "idle time after which a kept-alive client connection is closed (clients such as "
        "the OpenAI SDK drop theirs after 5 s)")
    max_connections: int = setting(
        1024, "open client connections at most; past it a new connection gets a 503 and is "
              "closed")
    http_tls_cert: str = setting(
        "", "PEM certificate: serve the HTTP API over TLS (HTTPS). Apart from --tls-cert, "
        "which is the gateway's client certificate towards the router and registry")
    http_tls_key: str = setting("", "PEM private key of --http-tls-cert")
    lease_wait_s: float = setting(
        0.3, "when a conversation's next turn arrives this soon after its previous turn ended "
        "and the conversation has no lease yet (decode grants it in the background), wait up "
        "to this long for it, so that fast follow-ups (tool results) reuse KV; 0 disables")
    pin_at_route: bool = setting(
        True, "pin the conversation's lease when the turn is routed and hand the read (block "
        "ids and the lease's hashes) to prefill with the request: prefill verifies it locally "
        "and makes no lookup call on its path. Off: prefill looks the lease up itself")
    conversation_lookup: str = setting(
        "content", "how a turn that names no conversation (no conversation_id in the body, no "
        "X-Conversation-Id or X-Session-ID header) finds its KV: 'content' looks its history "
        "up among the tenant's live leases (at each message boundary) and continues or "
        "branches from what it finds; 'off' serves it without reuse")
    pin_ttl_s: float = setting(10.0, "how long a read pinned at route time holds decode's "
                               "blocks at most (released as soon as prefill has read them)")
    retries: int = setting(
        1, "times (0 to 8) a turn is sent to another instance when an engine fails it before "
        "anything was sent to the client: unreachable, gone mid-request (connection lost), or "
        "a prefill that answered 5xx (its pinned read is released first)")
    token: str = setting(
        "", "bearer token (role gateway) the gateway sends to the router and the registry; "
        "prefer the environment variable to the flag", env=TOKEN_ENV)
    insecure: bool = setting(
        False, "insecure local mode: accept requests without a configured --api-keys-file "
        "(any bearer token names its own tenant). Without it the gateway refuses to start "
        "with no API keys", env=INSECURE_ENV)
    tls_ca: str = setting("", "PEM CA to trust for the router and registry (calls to them then "
                          "use TLS)", env="KVBRIDGE_TLS_CA")
    tls_cert: str = setting("", "PEM client certificate for routers and registries that "
                            "require one (mutual TLS)", env="KVBRIDGE_TLS_CERT")
    tls_key: str = setting("", "PEM private key of --tls-cert", env="KVBRIDGE_TLS_KEY")
    otlp_traces_endpoint: str = tracing.endpoint_setting()
    log_level: str = setting("info", "debug, info, warning or error")
    log_format: str = setting("auto", "json, console, or auto (JSON unless on a terminal)")

    def __post_init__(self) -> None:
        for name in ("route_timeout_s", "request_timeout_s", "connect_timeout_s",
                     "engine_keepalive_s", "max_body_bytes", "pin_ttl_s", "header_timeout_s",
                     "body_timeout_s", "keepalive_timeout_s", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.lease_wait_s <= 5.0:
            raise ValueError("lease_wait_s must be between 0 and 5")
        if self.conversation_lookup not in ("off", "content"):
            raise ValueError(f"conversation_lookup must be 'off' or 'content', got "
                             f"{self.conversation_lookup!r}")
        if not 0 <= self.retries <= 8:
            raise ValueError("retries must be between 0 and 8")
        if not self.router:
            raise ValueError("router is required")
        check_logging(self.log_level, self.log_format)
        tracing.check_endpoint(self.otlp_traces_endpoint)
        if self.client_tls() is not None:
            TlsFiles(self.tls_cert, self.tls_key, self.tls_ca).validate(server=False)
        if bool(self.http_tls_cert) != bool(self.http_tls_key):
            raise ValueError("http_tls_cert and http_tls_key go together")
        for name in ("http_tls_cert", "http_tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}: no file {path}")

    def client_tls(self) -> TlsFiles | None:
        """TLS for the gateway's calls to the router and registry: on when tls_ca is set."""
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca) if self.tls_ca else None
