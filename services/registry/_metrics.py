"""Prometheus metrics for one registry, kept outside the core: lease events arrive as a
listener, table sizes are read at scrape time, RPCs are timed by the servicer's wrapper."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbridge.services.registry._model import EventType, LeaseEvent, MissReason
from kvbridge.services.registry._store import LeaseStore

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 1.0)
_LATENESS_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class _TableCollector(Collector):
    def __init__(self, table: LeaseStore) -> None:
        self._table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self._table.counts()
        leases = GaugeMetricFamily("kvbridge_registry_leases", "Leases held, by state class",
                                   labels=["state"])
        leases.add_metric(["active"], counts["leases_active"])
        leases.add_metric(["awaiting_reclaim"], counts["leases_total"] - counts["leases_active"])
        yield leases
        yield GaugeMetricFamily("kvbridge_registry_holders", "Registered holders",
                                value=counts["holders"])
        yield GaugeMetricFamily("kvbridge_registry_pins", "Live read pins", value=counts["pins"])


class RegistryMetrics:
    """All metrics of one registry instance, in their own CollectorRegistry."""

    def __init__(self, table: LeaseStore) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_TableCollector(table))
        self.lease_events = Counter(
            "kvbridge_registry_lease_events", "Lease lifecycle events", ["type"],
            registry=self.registry)
        self._event_children = {t: self.lease_events.labels(t.name.lower()) for t in EventType}
        self.renewals = Counter("kvbridge_registry_renewals", "Leases renewed",
                                registry=self.registry)
        self.reads = Counter("kvbridge_registry_reads", "AcquireRead and PinLease outcomes",
                             ["outcome"], registry=self.registry)
        self._read_children = {
            r: self.reads.labels("hit" if r is MissReason.HIT else r.name.lower())
            for r in MissReason
        }
        self.expiry_lateness = Histogram(
            "kvbridge_registry_expiry_lateness_seconds",
            "How long after its deadline a lease expiry was processed",
            buckets=_LATENESS_BUCKETS, registry=self.registry)
        self.rpc_duration = Histogram(
            "kvbridge_registry_rpc_duration_seconds", "Server-side RPC handling time",
            ["method"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.rpc_errors = Counter("kvbridge_registry_rpc_errors", "RPCs that failed",
                                  ["method", "code"], registry=self.registry)
        table.add_listener(self.on_event)

    def on_event(self, event: LeaseEvent) -> None:
        self._event_children[event.type].inc()
        if event.type is EventType.EXPIRED:
            self.expiry_lateness.observe(event.lateness)

    def read(self, outcome: MissReason) -> None:
        self._read_children[outcome].inc()
