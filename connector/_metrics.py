"""The connector's counters, in a registry of their own, served over HTTP from the engine-core
process when `kvbridge.metrics_port` is set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class ConnectorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reused_tokens = Counter(
            "kvbridge_connector_reused_tokens", "Prompt tokens read back from decode", registry=r)
        self.local_tokens = Counter(
            "kvbridge_connector_local_tokens",
            "Prompt tokens of conversation requests found in this engine's own prefix cache",
            registry=r)
        self.recomputed_tokens = Counter(
            "kvbridge_connector_recomputed_tokens",
            "Prompt tokens of conversation requests computed by this prefill engine", registry=r)
        self.decisions = Counter(
            "kvbridge_connector_decisions", "Prefill reuse decisions", ["decision"], registry=r)
        self.cost_estimates = Gauge(
            "kvbridge_connector_cost_estimate_seconds",
            "Prefill: what reading and recomputing cost on this engine, as learned from its "
            "recent requests: fixed parts and per-token rates (recompute_per_token at the "
            "latest prompt's length), and the registry lookup", ["estimate"], registry=r)
        self.transfer_seconds = Histogram(
            "kvbridge_connector_transfer_seconds", "Decision to finished D->P read",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0), registry=r)
        self.sync_reads = Counter(
            "kvbridge_connector_sync_reads",
            "Synchronous reads that landed, by mode: whole (before the step's forward pass) or "
            "layered (layer by layer, overlapping it); their wait is in transfer_seconds",
            ["mode"], registry=r)
        self.layered_copy_seconds = Histogram(
            "kvbridge_connector_layered_copy_seconds",
            "Layered reads: first layer posted to last layer landed (overlaps the forward pass)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=r)
        self.held_for_reads = Counter(
            "kvbridge_connector_held_for_reads",
            "Prefill with prefix caching: times a request was asked to wait a step because its "
            "local prefix hit reached into blocks a synchronous read of that step fills",
            registry=r)
        self.read_blocks_evicted = Counter(
            "kvbridge_connector_read_blocks_evicted",
            "Prefill with prefix caching: blocks of failed synchronous reads taken out of the "
            "prefix cache (recomputed by their request, found by no other)", registry=r)
        self.leases_granted = Counter(
            "kvbridge_connector_leases_granted", "Leases granted over retained decode KV",
            registry=r)
        self.grants_unresolved = Counter(
            "kvbridge_connector_grants_outcome_unknown",
            "Grants that timed out or lost their connection: their blocks are kept until the "
            "registry says whether it made the lease", registry=r)
        self.retention_skipped = Counter(
            "kvbridge_connector_retention_skipped",
            "Finished turns not retained: too many grants waiting (max_unsettled_grants)",
            registry=r)
        self.blocks_freed = Counter(
            "kvbridge_connector_retained_blocks_freed", "Retained decode blocks freed, by why",
            ["why"], registry=r)
        self.retained_blocks = Gauge(
            "kvbridge_connector_retained_blocks", "Decode KV blocks held for leases", registry=r)
        self.retained_turns = Gauge(
            "kvbridge_connector_retained_turns",
            "Decode: finished turns whose blocks are held (each under a lease, or its grant "
            "under way): this engine's live leases", registry=r)
        self.kv_blocks = Gauge(
            "kvbridge_connector_kv_blocks", "KV blocks in this engine's pool", registry=r)
        self.free_blocks = Gauge(
            "kvbridge_connector_free_blocks",
            "Free KV blocks in this engine's pool (cached ones included)", registry=r)
        self.leases_revoked = Counter(
            "kvbridge_connector_leases_revoked",
            "Leases this decode engine revoked to make room, by whether they were freed at "
            "once or pinned", ["outcome"], registry=r)
        self.revocations = Counter(
            "kvbridge_connector_memory_revocations",
            "Revocation passes to make room, by cause: demand (a waiting request needs the "
            "blocks) or headroom (ahead of demand)", ["cause"], registry=r)
        self.headroom_blocks = Gauge(
            "kvbridge_connector_headroom_blocks",
            "Decode: blocks kept free ahead of demand (recent peak of arriving requests' need)",
            registry=r)
        self.admission_wait = Histogram(
            "kvbridge_connector_admission_wait_seconds",
            "Decode: arrival to KV block allocation of a request",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0),
            registry=r)
        self.port: int | None = None

    def serve(self, host: str, port: int) -> None:
        httpd, _ = start_http_server(port, host, registry=self.registry)
        self.port = httpd.server_port
