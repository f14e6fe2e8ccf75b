"""The connector's figures on the engine's own `/metrics`, with vLLM's labels.

vLLM carries a connector's statistics from the engine-core process to the API server, which
serves `/metrics`: the scheduler asks the connector for its statistics after every step
(`get_kv_connector_stats`, merged with what the workers report), sends them along with the
step's output, and the API server hands them to the connector class's Prometheus hook
(`build_prom_metrics`) under the labels `model_name` and `engine`. kvbridge's counters live in
the engine-core process (`ConnectorMetrics`); a snapshot of them rides that path, and a
collector in the API server serves the latest snapshot per engine. NIXL's own transfer
statistics ride alongside, unchanged (`vllm:nixl_*`).

A snapshot is taken when a request finished in the step (decisions and token counts moved) and
at most every `_MIN_INTERVAL_S`, or every `_MAX_INTERVAL_S` while the engine steps: collecting
the registry costs a few hundred microseconds, not to be paid every step. Figures that move while
the engine is idle (decode's retained blocks) show at the next step; the separate metrics port
(`metrics_port`) stays exact at all times.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import structlog
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvbridge.connector._metrics import ConnectorMetrics

log = structlog.get_logger("kvbridge.connector")

NIXL = "nixl"
KVBRIDGE = "kvbridge"
_MIN_INTERVAL_S = 0.1
_MAX_INTERVAL_S = 1.0

Sample = tuple[str, dict[str, str], float]


def snapshot(registry: CollectorRegistry) -> list[Sample]:
    return [(s.name, dict(s.labels), float(s.value))
            for family in registry.collect() for s in family.samples]


class Snapshots:
    """Engine-core side: when to send a snapshot of the connector's metrics."""

    def __init__(self, metrics: ConnectorMetrics, now: Callable[[], float]) -> None:
        self._metrics = metrics
        self._now = now
        self._sent = float("-inf")
        self._moved = True

    def moved(self) -> None:
        """Figures moved (a request finished): send at the next chance."""
        self._moved = True

    def due(self) -> list[Sample] | None:
        elapsed = self._now() - self._sent
        if elapsed < _MIN_INTERVAL_S or (not self._moved and elapsed < _MAX_INTERVAL_S):
            return None
        self._sent = self._now()
        self._moved = False
        return snapshot(self._metrics.registry)


@dataclass
class BridgeStats(KVConnectorStats):  # type: ignore[misc]
    """vLLM's KVConnectorStats for kvbridge: NIXL's transfer statistics (as NIXL's own stats
    class keeps them) and the latest snapshot of kvbridge's metrics. `make_nixl` (set by the
    connector: `NixlPullConnector.build_kv_connector_stats`) turns NIXL's part into NIXL's
    stats object; a class attribute, so that the stats pickle as plain data."""

    make_nixl: ClassVar[Callable[[dict[str, Any]], Any] | None] = None

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def _nixl(self) -> Any:
        part = self.data.get(NIXL)
        if part is None or BridgeStats.make_nixl is None:
            return None
        return BridgeStats.make_nixl(part)

    def aggregate(self, other: Any) -> BridgeStats:
        data = getattr(other, "data", None) or {}
        if NIXL in data:
            mine = self._nixl()
            if mine is None or BridgeStats.make_nixl is None:
                self.data[NIXL] = data[NIXL]
            else:
                self.data[NIXL] = mine.aggregate(BridgeStats.make_nixl(data[NIXL])).data
        if KVBRIDGE in data:  # the later snapshot replaces the earlier
            self.data[KVBRIDGE] = data[KVBRIDGE]
        return self

    def reduce(self) -> dict[str, int | float]:
        nixl = self._nixl()
        return dict(nixl.reduce()) if nixl is not None and not nixl.is_empty() else {}

    def is_empty(self) -> bool:
        nixl = self._nixl()
        return KVBRIDGE not in self.data and (nixl is None or nixl.is_empty())


class _Collector:
    """API server side: serves each engine's latest snapshot under vLLM's labels."""

    def __init__(self) -> None:
        # name -> (type, help) of every family ConnectorMetrics defines.
        self._families = {f.name: (f.type, f.documentation)
                          for f in ConnectorMetrics().registry.collect()}
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, ...], list[Sample]] = {}
        self._labelnames: list[str] = []

    def update(self, labelnames: list[str], labelvalues: list[object],
               samples: list[Sample]) -> None:
        with self._lock:
            self._labelnames = list(labelnames)
            self._latest[tuple(str(v) for v in labelvalues)] = samples

    def describe(self) -> list[Metric]:
        return []  # names are known only once snapshots come

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            latest = dict(self._latest)
            labelnames = list(self._labelnames)
        families: dict[str, Metric] = {}
        for values, samples in latest.items():
            extra = dict(zip(labelnames, values, strict=False))
            for name, labels, value in samples:
                family = self._family_of(name)
                if family is None:
                    continue
                if family not in families:
                    kind, doc = self._families[family]
                    families[family] = Metric(family, doc, kind)
                families[family].add_sample(name, {**extra, **labels}, value)
        yield from families.values()

    def _family_of(self, sample: str) -> str | None:
        for suffix in ("", "_total", "_bucket", "_sum", "_count", "_created"):
            if suffix and not sample.endswith(suffix):
                continue
            base = sample[: len(sample) - len(suffix)] if suffix else sample
            if base in self._families:
                return base
        return None


_collector: _Collector | None = None
_collector_lock = threading.Lock()


def collector() -> _Collector:
    """The API server's one collector (registered once on prometheus_client's registry,
    which vLLM's `/metrics` serves)."""
    global _collector
    with _collector_lock:
        if _collector is None:
            _collector = _Collector()
            REGISTRY.register(_collector)
        return _collector


class BridgeProm:
    """vLLM's KVConnectorPromMetrics for kvbridge: NIXL's own (`nixl`, or None) and the
    collector of kvbridge's snapshots."""

    def __init__(self, nixl: Any, labelnames: list[str],
                 per_engine_labelvalues: Mapping[int, list[object]]) -> None:
        self._nixl = nixl
        self._labelnames = labelnames
        self._labelvalues = dict(per_engine_labelvalues)
        self._collector = collector()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Several API server processes: vLLM serves /metrics from a multiprocess registry
            # of its own, which this process's collector does not reach.
            log.warning("connector_metrics_not_on_vllm_metrics",
                        why="vLLM runs several API server processes (PROMETHEUS_MULTIPROC_DIR)",
                        fix="set the connector's metrics_port to serve its metrics on a port "
                            "of their own")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if self._nixl is not None and NIXL in transfer_stats_data:
            self._nixl.observe(transfer_stats_data[NIXL], engine_idx)
        samples = transfer_stats_data.get(KVBRIDGE)
        if samples is not None:
            values = self._labelvalues.get(engine_idx, ["", str(engine_idx)])
            self._collector.update(self._labelnames, values,
                                   [(n, dict(lab), float(v)) for n, lab, v in samples])
