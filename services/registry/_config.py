"""The registry's configuration and limits."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvbridge import tracing
from kvbridge.auth import SecuritySettings
from kvbridge.config import check_logging, setting

# A registry with tokens caps each tenant by default (`tenant_max_leases`/`tenant_max_blocks`
# left at -1): a tenth of the default max_leases, and 100 blocks a lease on average.
SECURED_TENANT_MAX_LEASES = 100_000
SECURED_TENANT_MAX_BLOCKS = 10_000_000
# ... and its live pins (reads in flight): far more than a tenant's prefill engines read at once.
SECURED_TENANT_MAX_PINS = 10_000
MAX_SHARDS = 1024  # each shard is a store with its own connections and ticks


@dataclasses.dataclass(frozen=True)
class RegistryConfig(SecuritySettings):
    """Everything an operator can set on a registry; validated at construction."""

    env_prefix: ClassVar[str] = "KVBRIDGE_REGISTRY_"

    listen: str = setting("127.0.0.1:50051", "host:port for the gRPC API (port 0 picks one)")
    backend: str = setting(
        "memory", "where leases live: memory (this process only) or redis (shared by every "
        "replica that names the same --redis-url and --redis-namespace)")
    redis_url: str = setting(
        "", "with --backend redis: the Redis (or Valkey) URL: redis://HOST:PORT/DB, "
        "rediss://... for TLS (?ssl_ca_certs=FILE&ssl_certfile=FILE&ssl_keyfile=FILE), "
        "unix:///PATH, redis+sentinel://S1:26379,S2:26379,S3:26379/SERVICE[/DB] (rediss+"
        "sentinel:// for TLS) to follow Sentinel's primary, or redis+cluster://N1:6379,N2:6379 "
        "(rediss+cluster://) for a Redis Cluster")
    redis_shards: int = setting(
        1, "with --backend redis: spread tenants over this many shards, each its own hash "
        "tag, so that a Redis Cluster's primaries share the fleet (a multiple of the primaries "
        "spreads evenly); every replica of a namespace must name the same count")
    redis_namespace: str = setting(
        "kvbridge", "with --backend redis: the key prefix (a Redis Cluster hash tag) that "
        "replicas of one fleet share")
    redis_events_maxlen: int = setting(
        100_000, "with --backend redis: lease events kept in the shared stream (approximate)")
    metrics_listen: str = setting(
        "127.0.0.1:9464", "host:port for Prometheus /metrics over HTTP; empty disables it"
    )
    default_idle_ttl_s: float = setting(
        60.0, "idle TTL of a lease when the grant names none; renewed by each turn or keepalive"
    )
    min_idle_ttl_s: float = setting(1.0, "shortest idle TTL a grant may ask for")
    max_idle_ttl_s: float = setting(3600.0, "longest idle TTL a grant may ask for")
    default_max_lifetime_s: float = setting(
        3600.0, "maximum lifetime of a lease when the grant names none (no renewal goes past it)"
    )
    max_lifetime_cap_s: float = setting(86400.0, "longest maximum lifetime a grant may ask for")
    default_pin_ttl_s: float = setting(10.0, "read pin duration when the reader names none")
    max_pin_ttl_s: float = setting(
        30.0, "longest read pin; holders add it to their hard deadline, restarts wait it out"
    )
    default_holder_ttl_s: float = setting(
        10.0, "holder heartbeat TTL when the holder names none (heartbeat every TTL/3)"
    )
    min_holder_ttl_s: float = setting(1.0, "shortest holder TTL accepted")
    max_holder_ttl_s: float = setting(300.0, "longest holder TTL accepted")
    recovery_grace_s: float = setting(
        -1.0,
        "after a start with empty state, report nothing reclaimable for this long so pins "
        "granted before the restart run out; -1 means max_pin_ttl_s + 1",
    )
    max_leases: int = setting(
        1_000_000, "total leases (active and awaiting reclaim) held; with --redis-shards, "
        "per shard")
    tenant_max_leases: int = setting(
        -1, "most active leases one tenant may hold (0: no limit); past it the tenant's own "
        "soonest-expiring unpinned leases are revoked to make room, never another tenant's. "
        f"-1: {SECURED_TENANT_MAX_LEASES:,} on a registry with tokens, no limit in insecure "
        "local mode")
    tenant_max_blocks: int = setting(
        -1, "most KV blocks one tenant's active leases may retain (0: no limit); enforced like "
        f"tenant_max_leases. -1: {SECURED_TENANT_MAX_BLOCKS:,} on a registry with tokens, no "
        "limit in insecure local mode")
    tenant_max_pins: int = setting(
        -1, "most live pins (reads in flight) one tenant may hold (0: no limit); a read past "
        f"it is refused, and prefill recomputes. -1: {SECURED_TENANT_MAX_PINS:,} on a registry "
        "with tokens, no limit in insecure local mode")
    tenant_quota_file: str = setting(
        "", "per-tenant quotas overriding the two above: 'TENANT MAX_LEASES MAX_BLOCKS' lines "
        "(0: no limit)")
    max_blocks_per_lease: int = setting(16384, "most KV blocks one lease may cover")
    max_history_keys: int = setting(
        64, "most history keys one lease may be granted with (the gateway sends a few per "
        "turn: the prompt's last message boundaries, then fewer further back)")
    max_lookup_keys: int = setting(
        4096, "most history keys one lookup by content may carry (one per message boundary "
        "of the request)")
    max_id_length: int = setting(256, "longest id (tenant, conversation, holder, request)")
    max_batch: int = setting(10000, "most items in one RenewLeases call")
    max_held_leases_per_call: int = setting(
        512, "most held leases one RegisterHolder call restores (a holder that retains more "
        "sends them in pages): bounds the time one call holds the registry")
    max_watchers: int = setting(256, "concurrent WatchLeases streams, all callers together")
    max_watchers_per_principal: int = setting(
        16, "concurrent WatchLeases streams of one caller (token); an admin is bounded by "
        "max_watchers only")
    list_rate_per_principal: float = setting(
        10.0, "ListLeases calls not narrowed to one conversation, and WatchLeases opens, one "
        "caller (token) may make per second (a listing of more than 250 leases counts one "
        "call per 250), with bursts of list_burst_per_principal; past it RESOURCE_EXHAUSTED "
        "with retry_after_s (0: no limit). Lookups of one conversation (gateway, router) are "
        "not limited; `kvbridge leases list` pages at this rate")
    list_burst_per_principal: int = setting(
        40, "burst of list_rate_per_principal (a watcher that reconnects also lists again: "
        "room for max_watchers_per_principal of them at once)")
    max_holders_per_principal: int = setting(
        1024, "live holders one caller (token) may register; an admin is not limited")
    max_message_bytes: int = setting(8 * 1024 * 1024, "largest gRPC message accepted")
    expiry_batch: int = setting(20000, "most expirations processed per scheduler tick")
    expiry_tick_s: float = setting(
        0.01, "shortest pause of the expiry scheduler: deadlines falling due within it are "
        "processed in one tick (leases and holders expire up to this late, a pin made since "
        "the last tick up to a quarter second; longer ticks cost less CPU, and on Redis fewer "
        "script calls)")
    shutdown_grace_s: float = setting(5.0, "seconds in-flight RPCs get on SIGTERM")
    gc_freeze_interval_s: float = setting(
        5.0, "move objects older than this out of the cyclic GC's reach (0: plain GC); keeps "
        "full collections over many leases off the request path")
    gc_full_interval_s: float = setting(
        600.0, "with gc_freeze_interval_s: run a full collection of everything this often")
    otlp_traces_endpoint: str = tracing.endpoint_setting()
    log_level: str = setting("info", "debug, info, warning or error")
    log_format: str = setting("auto", "json, console, or auto (JSON unless on a terminal)")

    def __post_init__(self) -> None:
        positive = ("default_idle_ttl_s", "min_idle_ttl_s", "max_idle_ttl_s",
                    "default_max_lifetime_s", "max_lifetime_cap_s", "default_pin_ttl_s",
                    "max_pin_ttl_s", "default_holder_ttl_s", "min_holder_ttl_s",
                    "max_holder_ttl_s", "max_leases", "max_blocks_per_lease", "max_id_length",
                    "max_batch", "max_held_leases_per_call", "max_watchers",
                    "max_history_keys", "max_lookup_keys", "max_watchers_per_principal",
                    "list_burst_per_principal",
                    "max_holders_per_principal", "max_message_bytes", "expiry_batch",
                    "expiry_tick_s", "redis_events_maxlen", "redis_shards")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.min_idle_ttl_s <= self.default_idle_ttl_s <= self.max_idle_ttl_s:
            raise ValueError("need min_idle_ttl_s <= default_idle_ttl_s <= max_idle_ttl_s")
        if not self.default_idle_ttl_s <= self.default_max_lifetime_s <= self.max_lifetime_cap_s:
            raise ValueError(
                "need default_idle_ttl_s <= default_max_lifetime_s <= max_lifetime_cap_s")
        if self.default_pin_ttl_s > self.max_pin_ttl_s:
            raise ValueError("default_pin_ttl_s must not exceed max_pin_ttl_s")
        if not self.min_holder_ttl_s <= self.default_holder_ttl_s <= self.max_holder_ttl_s:
            raise ValueError(
                "need min_holder_ttl_s <= default_holder_ttl_s <= max_holder_ttl_s")
        if self.recovery_grace_s != -1.0 and self.recovery_grace_s < self.max_pin_ttl_s:
            raise ValueError("recovery_grace_s must be at least max_pin_ttl_s (or -1 for auto)")
        if self.backend not in ("memory", "redis"):
            raise ValueError(f"backend must be memory or redis, got {self.backend!r}")
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("backend redis needs redis_url (--redis-url or "
                             "KVBRIDGE_REGISTRY_REDIS_URL)")
        if self.backend == "redis":
            from kvbridge.services.registry._redis_url import check_url

            check_url(self.redis_url)
        if self.redis_shards > MAX_SHARDS:
            raise ValueError(f"redis_shards must be at most {MAX_SHARDS}, got "
                             f"{self.redis_shards}")
        if self.list_rate_per_principal < 0:
            raise ValueError("list_rate_per_principal must not be negative")
        if not self.redis_namespace or any(c in self.redis_namespace for c in "{}~ \t\n"):
            raise ValueError("redis_namespace must be non-empty, without braces, '~' (it "
                             "separates a shard's namespace) or spaces")
        check_logging(self.log_level, self.log_format)
        tracing.check_endpoint(self.otlp_traces_endpoint)
        self.check_security()
        if min(self.tenant_max_leases, self.tenant_max_blocks, self.tenant_max_pins) < -1:
            raise ValueError("tenant_max_leases, tenant_max_blocks and tenant_max_pins must be "
                             "0 (no limit), positive, or -1 (the default for the registry's "
                             "mode)")
        # -1: sane caps once callers are told apart by token (one tenant must not take the
        # whole registry); none in insecure local mode, where every caller is an admin anyway.
        # Resolved here, once: the lease table and the Redis store read the plain values.
        secured = bool(self.auth_tokens_file or self.auth_tokens)
        for name, cap in (("tenant_max_leases", SECURED_TENANT_MAX_LEASES),
                          ("tenant_max_blocks", SECURED_TENANT_MAX_BLOCKS),
                          ("tenant_max_pins", SECURED_TENANT_MAX_PINS)):
            if getattr(self, name) == -1:
                object.__setattr__(self, name, cap if secured else 0)
        self.tenant_quotas()  # a bad quota file is an error at start

    def tenant_quotas(self) -> dict[str, tuple[int, int]]:
        """tenant -> (max leases, max blocks) from tenant_quota_file (0: no limit)."""
        if not self.tenant_quota_file:
            return {}
        try:
            with open(self.tenant_quota_file) as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read tenant_quota_file {self.tenant_quota_file}: "
                             f"{exc.strerror}") from exc
        quotas: dict[str, tuple[int, int]] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].split()
            if not line:
                continue
            if len(line) != 3 or not line[1].isdigit() or not line[2].isdigit():
                raise ValueError(f"{self.tenant_quota_file}:{number}: expected "
                                 f"'TENANT MAX_LEASES MAX_BLOCKS' (whole numbers, 0: no limit)")
            quotas[line[0]] = (int(line[1]), int(line[2]))
        return quotas

    def quota_of(self, tenant: str, overrides: dict[str, tuple[int, int]]
                 ) -> tuple[int, int]:
        return overrides.get(tenant, (self.tenant_max_leases, self.tenant_max_blocks))

    @property
    def effective_recovery_grace_s(self) -> float:
        return self.max_pin_ttl_s + 1.0 if self.recovery_grace_s < 0 else self.recovery_grace_s
