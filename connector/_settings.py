"""The connector's settings, read from `kv_connector_extra_config["kvbridge"]`.

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
      "kv_connector_module_path": "kvbridge.connector",
      "kv_role": "kv_producer", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"bidirectional_kv_xfer": true,
                                    "kv_recompute_threshold": 64,
                                    "kvbridge": {"registry": "127.0.0.1:50051"}}}'
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from kvbridge.auth import TlsFiles
from kvbridge.connector import _vllm
from kvbridge.history import KEY_SIZE as HISTORY_KEY_SIZE

# The key under which a request's kv_transfer_params carry its conversation.
CONVERSATION_KEY = "kvbridge"
_MAX_HISTORY_KEYS_B64 = 4 * 1024  # base64 of 64 keys, the registry's default cap, with room
# remote_request_id prefix of retained decode blocks: NIXL's own bookkeeping must ignore the
# read notifications that carry it.
REMOTE_ID_PREFIX = "kvbridge-"


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """What an operator sets per engine (all durations in seconds)."""

    registry: str = ""
    """Registry address HOST:PORT, or several replicas' addresses comma-separated (failover).
    Empty: no control plane (the engine behaves as NIXL)."""
    router: str = ""
    """Prefill: ask this routing service (HOST:PORT) for reads instead of the registry; it
    also refuses KV held by engines it knows are dead. Decode always talks to the registry."""
    decision: str = "cost"
    """Prefill: how to choose between reading decode's KV and recomputing it. "cost": read
    only when the read is expected to be faster, by this engine's own measured compute and
    read times (`kvbridge.connector._cost`; until it has measured both, as "threshold");
    "threshold": read whenever at least `kv_recompute_threshold` tokens are reusable."""
    read_margin: float = 0.1
    """Prefill, decision "cost": read only when expected to take at most (1 - this) of the
    time recomputing would."""
    probe_interval_s: float = 60.0
    """Prefill, decision "cost": while reads are estimated slower, read once in this long
    anyway to measure them again (0: never)."""
    read_deadline_s: float = 0.05
    """Prefill: how long a request may wait for its AcquireRead before recomputing."""
    rpc_timeout_s: float = 2.0
    """Deadline of control-plane calls off the time-to-first-token path."""
    pin_ttl_s: float = 10.0
    """Prefill: pin duration asked for a read."""
    pin_margin_s: float = 2.0
    """Prefill: decline a read whose pin ends within this margin (recompute instead)."""
    idle_ttl_s: float = 60.0
    """Decode: lease idle TTL (renewed by each turn, read, or client keepalive)."""
    max_lifetime_s: float = 3600.0
    """Decode: lease maximum lifetime."""
    holder_ttl_s: float = 10.0
    """Decode: holder heartbeat TTL (heartbeats every third of it)."""
    hard_deadline_margin_s: float = 5.0
    """Decode: margin past max lifetime + max pin TTL after which blocks are freed regardless."""
    max_unsettled_grants: int = 16
    """Decode: at most this many finished turns may wait for their lease (a grant queued, in
    flight, or of unknown outcome after a timeout); past it a finishing turn is not retained,
    so a slow or unreachable registry cannot fill decode's memory with blocks under no lease."""
    free_watermark: float = 0.1
    """Decode: keep at least this fraction of KV blocks free by revoking the oldest idle
    leases."""
    headroom_window_s: float = 300.0
    """Decode: on top of the watermark, keep free as many blocks as arriving requests needed
    at once within this window, revoking the oldest idle leases ahead of demand so a request
    does not wait for a revocation round trip (0: make room only when a request arrives)."""
    headroom_cap: float = 0.5
    """Decode: the most of the pool that headroom may keep free (a fraction)."""
    token_env: str = "KVBRIDGE_TOKEN"
    """The environment variable of the engine process holding its bearer token (a decode
    engine's has role holder, a prefill engine's role reader). Never put the token itself in
    the transfer config: vLLM logs it."""
    token_file: str = ""
    """A file holding the bearer token (instead of `token_env`)."""
    tls_ca: str = ""
    """PEM CA to trust for the registry and router: calls to them then use TLS."""
    tls_cert: str = ""
    """PEM client certificate for mutual TLS (with `tls_key`)."""
    tls_key: str = ""
    """PEM private key of `tls_cert`."""
    sync_reads: bool = True
    """Prefill: once this engine has read from a decode engine (NIXL handshake done), read
    that engine's KV within the engine step that computes the request, instead of parking the
    request until an asynchronous read completes; saves the scheduling steps around the read
    (see `kvbridge.connector._sync_reads`). False: always NIXL's asynchronous read."""
    sync_read_timeout_s: float = 2.0
    """Prefill: a synchronous read still in flight after this long is cancelled and its
    tokens recomputed (the engine step waits for it meanwhile)."""
    layerwise_reads: bool = True
    """Prefill: split a synchronous read by layer; a reading thread posts the layers in order
    and the forward pass waits for each layer just before attending over it, so the copy
    overlaps the compute (see `kvbridge.connector._layerwise`). False: the whole read lands
    before the forward pass."""
    read_cpus: str = "all"
    """Prefill: CPUs for the thread that posts layered reads: "all" (the kernel picks a core the
    engine is not computing on; on the CPU, NIXL's READ is a copy made by that thread),
    "inherit" (the engine's own) or a list like "1" or "2-3"."""
    metrics_port: int = 0
    """Port for the connector's Prometheus metrics in the engine-core process (0: off)."""
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and value < 0:
                raise ValueError(f"kvbridge.{field.name} must not be negative, got {value}")
        if self.max_lifetime_s <= 0 or self.idle_ttl_s <= 0:
            raise ValueError("kvbridge.idle_ttl_s and max_lifetime_s must be positive (a holder "
                             "bounds how long it keeps blocks by the lifetime it asks for)")
        if self.max_unsettled_grants < 1:
            raise ValueError("kvbridge.max_unsettled_grants must be at least 1")
        if not 0.0 <= self.free_watermark < 1.0:
            raise ValueError("kvbridge.free_watermark must be in [0, 1)")
        if not 0.0 <= self.headroom_cap <= 1.0:
            raise ValueError("kvbridge.headroom_cap must be in [0, 1]")
        parse_cpus(self.read_cpus)  # a bad list fails here, at start-up
        if self.decision not in ("cost", "threshold"):
            raise ValueError(f"kvbridge.decision must be 'cost' or 'threshold', got "
                             f"{self.decision!r}")
        if not 0.0 <= self.read_margin < 1.0:
            raise ValueError("kvbridge.read_margin must be in [0, 1)")
        if self.pin_margin_s >= self.pin_ttl_s:
            raise ValueError("kvbridge.pin_margin_s must be smaller than pin_ttl_s")

    def token(self) -> str | None:
        """The bearer token, from `token_file` or the `token_env` variable; None when unset."""
        if self.token_file:
            try:
                with open(self.token_file) as f:
                    return f.read().strip() or None
            except OSError as exc:
                raise ValueError(f"kvbridge.token_file: cannot read {self.token_file}: "
                                 f"{exc.strerror}") from exc
        return os.environ.get(self.token_env) or None

    def tls(self) -> TlsFiles | None:
        if not self.tls_ca:
            if self.tls_cert:
                raise ValueError("kvbridge.tls_cert needs kvbridge.tls_ca")
            return None
        files = TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)
        files.validate(server=False)
        return files

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        raw = dict((extra or {}).get(CONVERSATION_KEY) or {})
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise ValueError(f"unknown kvbridge connector settings: {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        kwargs = {}
        for name, value in raw.items():
            kind: Any = type(names[name].default)
            if kind is bool and isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(f"kvbridge.{name}: expected true or false, got {value!r}")
                value = value.lower() in ("true", "1", "yes")
            try:
                kwargs[name] = kind(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"kvbridge.{name}: {exc}") from exc
        return cls(**kwargs)


def parse_cpus(spec: str) -> set[int] | None:
    """`read_cpus`: "all" (every CPU this machine has; the kernel puts the reading thread where
    the engine is not computing), "inherit" (the engine's own), or a list like "1" or "2-3,6"."""
    spec = spec.strip().lower()
    if spec in ("", "inherit"):
        return None
    if spec == "all":
        return set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for item in spec.split(","):
        lo, _, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"kvbridge.read_cpus: expected all, inherit or a CPU list like "
                             f"'1' or '2-3,6', got {spec!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"kvbridge.read_cpus: bad CPU range {item.strip()!r}")
        cpus.update(range(first, last + 1))
    return cpus


def conversation_of(params: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(tenant, conversation id) a request's kv_transfer_params name, if any."""
    if not params:
        return None
    key = params.get(CONVERSATION_KEY)
    if not isinstance(key, Mapping):
        return None
    tenant, conversation = key.get("tenant"), key.get("conversation_id")
    if isinstance(tenant, str) and isinstance(conversation, str) and tenant and conversation:
        return tenant, conversation
    return None


def history_keys_of(params: Mapping[str, Any] | None) -> bytes:
    """The history keys (`kvbridge.history`) the gateway sent for a turn's lease, in
    `kv_transfer_params["kvbridge"]["history_keys"]` as base64; b"" when there are none or
    they are malformed (the lease is then granted without them: found by id only)."""
    key = params.get(CONVERSATION_KEY) if params else None
    value = key.get("history_keys") if isinstance(key, Mapping) else None
    if not isinstance(value, str) or not value or len(value) > _MAX_HISTORY_KEYS_B64:
        return b""
    try:
        keys = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return b""
    return keys if len(keys) % HISTORY_KEY_SIZE == 0 else b""


def kv_scope(request: Any, fingerprint: str) -> tuple[str, str] | None:
    """What a request's KV depends on besides its token ids, for its block hashes: (the
    engine fingerprint, extended with the LoRA adapter's name when it has one, and the cache
    salt). A turn decoded under one adapter is never reused for a prompt under another, or
    under the base model. (The fingerprint is hex, so "/lora:" cannot be forged by a salt.)
    None when the request has inputs the hashes cannot cover (images and other multimodal
    inputs, whose placeholder tokens are the same for different content; prompt embeddings):
    such a request is neither retained nor read back, it recomputes. So is every request when
    this vLLM's requests lack one of the fields read here (`_vllm.input_scope`)."""
    scope = _vllm.input_scope(request)
    if scope is None:
        return None
    opaque, lora, salt = scope
    if opaque:
        return None
    if lora is not None:
        fingerprint = f"{fingerprint}/lora:{lora.lora_name}"
    return fingerprint, salt
